"""What a causal attention layer carries between calls, for incremental decoding.

``LinearAttentionState`` is one layer's state: position counters, the state of its attention path
(``KernelAttentionState`` or ``SoftmaxAttentionState``, made on first use) and, for encodings that add a
bias over past values (FastRPB), a ``ValueHistory``. B batch, H heads, d head dim.
"""

from dataclasses import dataclass, fields

import torch


def is_marked_static(tensor: torch.Tensor) -> bool:
    """Whether ``torch._dynamo.mark_static_address`` marked ``tensor`` (it sets this attribute)."""
    return getattr(tensor, "_dynamo_static_input_type", None) is not None


class TensorState:
    """A dataclass of tensors (and nested states) whose batch rows can be selected or repeated together.

    While decoding (no autograd), ``store`` writes each step's state into the tensor already there, so that state
    tensors keep their addresses from step to step: a compiled decoding step then reads and writes static
    addresses, which a CUDA graph can replay (``torch.compile(mode="reduce-overhead")``)."""

    def store(self, name: str, value: torch.Tensor | None):
        """Set the field ``name`` to ``value``, in place where the field already holds a tensor of its shape,
        dtype and device and autograd tracks neither; otherwise anew (the first call, a batch that changed size,
        training), then as a copy if ``value`` may view another tensor (a later write in place must not reach it),
        marked as a static address for compilers."""
        current = getattr(self, name)
        if value is current:  # updated in place already
            return
        if (
            value is None
            or torch.is_grad_enabled()
            and (value.requires_grad or current is not None and current.requires_grad)
        ):
            setattr(self, name, value)
        elif isinstance(current, torch.Tensor) and (current.shape, current.dtype, current.device) == (
            value.shape,
            value.dtype,
            value.device,
        ):
            current.copy_(value)
        else:
            # torch.inference_mode tracks no views (``_base`` is None there), so what it made is copied too; a
            # compiled call (which cannot ask for inference mode without breaking its graph) copies always
            compiling = torch.compiler.is_compiling()
            copied = compiling or value._base is not None or torch.is_inference_mode_enabled()
            value = value.clone() if copied else value
            if not compiling:
                torch._dynamo.mark_static_address(value)
            setattr(self, name, value)

    def make_static(self):
        """Give every tensor (recursively) an address of its own, marked static for compilers, where it is not marked
        yet: see ``LinearAttentionCache.make_static``."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and not is_marked_static(value):
                value = value.clone()
                torch._dynamo.mark_static_address(value)
                setattr(self, f.name, value)
            elif isinstance(value, TensorState):
                value.make_static()

    def apply(self, fn):
        """Replace every tensor t (recursively) by fn(t)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, fn(value))
            elif isinstance(value, TensorState):
                value.apply(fn)

    def select(self, index: torch.Tensor):
        """Keep the batch rows ``index`` (beam search)."""
        self.apply(lambda t: t.index_select(0, index.to(t.device)))

    def repeat_interleave(self, repeats: int):
        self.apply(lambda t: t.repeat_interleave(repeats, dim=0))


@dataclass
class ValueHistory(TensorState):
    """The values (B, H, T, d), positions (B, T, A) and documents (B, T) seen so far. Without autograd
    (generation) the storage doubles when full, so each step copies only its own tokens."""

    values: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    length: int = 0

    def append(self, values: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor):
        """Append values (B, H, n, d), positions (B, n, A) and documents (B, n); return everything so far."""
        new = {"values": values, "positions": positions, "documents": documents}
        dims = {"values": 2, "positions": 1, "documents": 1}
        had_history = self.values is not None
        if torch.is_grad_enabled():  # keep autograd's saved tensors intact: no writes into shared storage
            for name, tensor in new.items():
                if had_history:
                    kept = getattr(self, name).narrow(dims[name], 0, self.length)
                    tensor = torch.cat([kept, tensor], dim=dims[name])
                setattr(self, name, tensor)
            self.length = self.values.shape[2]
            return self.values, self.positions, self.documents
        end = self.length + values.shape[2]
        if self.values is None or end > self.values.shape[2]:
            capacity = max(64, 2 * end)
            for name, tensor in new.items():
                shape = list(tensor.shape)
                shape[dims[name]] = capacity
                grown = tensor.new_zeros(shape)
                if had_history:
                    grown.narrow(dims[name], 0, self.length).copy_(
                        getattr(self, name).narrow(dims[name], 0, self.length)
                    )
                setattr(self, name, grown)
        for name, tensor in new.items():
            getattr(self, name).narrow(dims[name], self.length, end - self.length).copy_(tensor)
        self.length = end
        return tuple(getattr(self, name).narrow(dims[name], 0, end) for name in new)


@dataclass
class LinearAttentionState(TensorState):
    """One causal layer's state; pass the same object to successive calls of the layer.

    ``num_tokens`` (B,): real tokens seen per row (the next default position); ``last_position`` (B,): the last
    real token's position (meaningful where num_tokens > 0); ``document`` (B,): the current document of a
    packed row; ``path``: the attention path's own state; ``value_history``: past values for an encoding with a
    value bias; ``given_positions``: some call gave positions (later default ones may then fall back and start a
    document, so they are searched: ``positions.find_documents``).
    """

    num_tokens: torch.Tensor | None = None
    last_position: torch.Tensor | None = None
    document: torch.Tensor | None = None
    path: TensorState | None = None
    value_history: ValueHistory | None = None
    given_positions: bool = False

    def share_counters(self, other: "LinearAttentionState"):
        """Take ``other``'s token counters as this state's own (the same tensors): layers that see the same tokens."""
        self.num_tokens, self.last_position, self.document = other.num_tokens, other.last_position, other.document
        self.given_positions = other.given_positions

    def count(self, positions: torch.Tensor, mask: torch.Tensor | None, documents: torch.Tensor):
        """Advance the counters past this call's tokens: positions (B, N, A), mask (B, N) or None, documents
        (B, N)."""
        B, N = positions.shape[:2]
        if mask is None:  # every token is real (the common case while decoding: a handful of ops per layer)
            seen = self.num_tokens
            if seen is not None and seen.shape == (B,) and not seen.requires_grad and not torch.is_grad_enabled():
                seen.add_(N)  # in place, as ``store`` would write it
            else:
                self.store("num_tokens", (seen if seen is not None else positions.new_zeros(B)) + N)
            self.store("last_position", positions[:, -1, 0])
            self.store("document", documents[:, -1])
            return
        index = torch.arange(N, device=positions.device).expand(B, N).masked_fill(~mask, -1)
        last_index = index.amax(-1)  # the last real token of each row, -1 if none
        last = positions[..., 0].gather(-1, last_index.clamp_min(0)[:, None])[:, 0]
        if self.last_position is not None:
            last = torch.where(last_index >= 0, last, self.last_position)
        real = (index >= 0).long().sum(-1)
        self.store("num_tokens", real if self.num_tokens is None else self.num_tokens + real)
        self.store("last_position", last)
        self.store("document", documents[:, -1])
