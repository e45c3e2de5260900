"""The generation cache of a LinearGPT model: one recurrent ``LinearAttentionState`` per layer.

A linear-attention layer needs O(m d) numbers per head whatever the context length (FastRPB adds the values
it biases with; the softmax baseline keeps its keys and values). The cache counts tokens itself and cannot be
cropped (a recurrent state cannot forget its last tokens).

A decoding step compiles (``torch.compile(model, fullgraph=True)``) to one graph over every layer, with no graph
break and no host read: the recurrent states keep their shapes from step to step and are written in place
(``TensorState.store``), so they keep their addresses too, and the token count is a tensor the step adds to. A CUDA
graph can then replay each step (``mode="reduce-overhead"``). What grows, FastRPB's history and the softmax
baseline's keys, becomes a dynamic shape and a new address at each growth.
A prefill run by a compiled forward makes the states inside its graph, where nothing can mark them static:
``make_static`` gives them addresses of their own, marked, before the next step (``generate`` calls it before every
step of a compiled forward). ``is_compileable`` is True, so ``generate`` compiles decoding by itself where asked: the
model leaves the masks 2D (``create_masks_for_generate``) and compiles only with a ``compile_config``
(``LinearGPTForCausalLM._valid_auto_compile_criteria``). convSPE still breaks the graph: the noise it filters is read
at the positions' values.
"""

import torch
from transformers.cache_utils import Cache

from .attention_state import LinearAttentionState, is_marked_static


class LinearAttentionCache(Cache):
    is_compileable = True

    def __init__(self, num_layers: int):
        super().__init__(layers=[])
        self.states = [LinearAttentionState() for _ in range(num_layers)]
        self.token_count = None  # () long tensor on the model's device, from the first call on
        self.host_count = 0  # the same count as a Python number, kept by eager calls; None once a compiled step counted
        self.steps_compiled = False  # set by generate when it compiles the decoding steps: make_static before each

    def __len__(self):
        return len(self.states)

    def __repr__(self):
        return f"LinearAttentionCache(layers={len(self.states)}, seen_tokens={self.seen_tokens})"

    def advance(self, num_tokens: int, device):
        """Count a call's tokens (padding included), in place in a tensor: a compiled step adds to it in its graph,
        which a Python count would break (or specialise on each value)."""
        if self.token_count is None:
            self.token_count = torch.zeros((), dtype=torch.long, device=device)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.token_count)
        self.token_count.add_(num_tokens)
        if torch.compiler.is_compiling():  # the graph adds on the device only: the host's count is stale from here
            self.host_count = None
        elif self.host_count is not None:
            self.host_count += num_tokens

    def make_static(self):
        """Every state tensor at an address of its own, marked static for compilers (``mark_static_address``), where
        it is not marked yet. Tensors made inside a compiled call (a compiled prefill's states, counters made by a
        compiled step) are that graph's outputs, which the compiler cannot mark from inside, and a CUDA graph may
        hand their memory to a later replay; a compiled decoding step that writes them in place must find them as
        static inputs, or CUDA-graph trees skip its graph ("mutated inputs"). ``generate`` calls this before every
        step when the model's forward is compiled (outside the compiled forward; an eager one makes its states
        marked); a decoding loop of one's own calls it after a compiled prefill. Not while compiling."""
        if torch.compiler.is_compiling():
            return
        if self.token_count is not None and not is_marked_static(self.token_count):
            self.token_count = self.token_count.clone()
            torch._dynamo.mark_static_address(self.token_count)
        first = self.states[0]
        for state in self.states:
            state.make_static()
            if state is not first:
                state.share_counters(first)  # the layers' counters stay one set of tensors

    def count(self, positions: torch.Tensor, mask: torch.Tensor | None, documents: torch.Tensor):
        """Advance the layers' token counters past a call's tokens (positions (B, N, 1), mask (B, N) bool or None,
        documents (B, N)), once for all layers: they all saw the same tokens, so their states share the first
        one's counters (the same tensors, advanced in place while decoding: a few ops a step, not a few a layer)."""
        first = self.states[0]
        first.count(positions, mask, documents)
        for state in self.states[1:]:
            state.share_counters(first)

    @property
    def seen_tokens(self) -> int:
        """The tokens the cache has seen, padding included: counted on the host by eager calls, read from the device
        (a sync) only after a compiled step has counted."""
        if self.host_count is not None:
            return self.host_count
        return 0 if self.token_count is None else int(self.token_count)

    @property
    def has_seen_tokens(self) -> bool:
        """Whether the cache has seen a token, without a read from the device (a compiled step adds at least one)."""
        return self.host_count > 0 if self.host_count is not None else self.token_count is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    @property
    def is_initialized(self) -> bool:
        return self.token_count is not None

    def reset(self):
        self.states = [LinearAttentionState() for _ in self.states]
        self.token_count, self.host_count = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor):
        for state in self.states:
            state.select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor):
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int):
        for state in self.states:
            state.repeat_interleave(repeats)

    @property
    def is_linear(self) -> list[bool]:
        """False for every layer. transformers reads True as "this layer cannot say how many tokens it has seen" (its
        recurrent caches keep no count), and then ``generate`` (5.24 on) feeds a sequence that continues a returned
        cache whole, through the state a second time. This cache counts its tokens, so ``generate`` cuts such a
        sequence to its uncached tail, as it does for key-value caches (and as releases before 5.24 do for any)."""
        return [False] * len(self.states)

    @property
    def is_croppable(self) -> bool:
        """False: ``generate`` (5.24 on) then refuses assisted decoding before its first rollback."""
        return False

    def crop(self, max_length: int):
        raise NotImplementedError(
            "A linear-attention state cannot be cropped (it summarises every past token); generation strategies that "
            "roll back tokens (assisted or prompt-lookup decoding) are not supported by this model"
        )
