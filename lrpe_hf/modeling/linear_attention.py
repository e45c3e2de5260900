"""``LinearAttention``: multi-head self-attention with a positional encoding, linear or softmax.

The layer projects queries, keys and values, lets the positional encoding act where it acts (see
``positional_encoding.py``), and hands the products to its attention path, chosen by ``options.attention``:
``KernelAttention`` (linear, ``kernel_attention.py``) or ``SoftmaxAttention`` (the quadratic baseline,
``softmax_attention.py``).

Padded positions (``attention_mask == 0``) contribute nothing: their values are zeroed, their key features are
zeroed after the feature map, and their outputs are zero. Without ``position_ids``, positions count the real
tokens of each row (so left and right padding both leave the real tokens' positions unchanged).

Packed rows (padding-free batches, as ``DataCollatorWithFlattening`` makes): in 1D, a real token whose given
position is not greater than the previous real token's starts a new document, and nothing crosses a document
boundary, in every path (bidirectional sums, causal chunks, recurrent decoding, softmax, FastRPB's bias).
Default positions only grow: a row never given ``position_ids`` is one document.

Incremental decoding: pass a ``LinearAttentionState`` as ``state``; the layer reads and updates it in place,
so calling it token by token gives the same outputs as one call over the whole sequence.
"""

from dataclasses import replace

import torch
from torch import nn

from .attention_inputs import LayerCall, attention_inputs
from .attention_options import AttentionOptions
from .attention_state import ValueHistory
from .context_parallel import active_group, refuse_in_context_parallel
from .kernel_attention import KernelAttention
from .positions import mask_as_bool
from .registry import build_positional_encoding, build_shared_codes, positional_encoding_entry
from .softmax_attention import SoftmaxAttention

ATTENTION_PATHS = {"linear": KernelAttention, "softmax": SoftmaxAttention}


def refuse_a_decay_without_causality(encoding, options):
    """Raises where ``encoding`` decays with distance (a ``log_decay``) but ``options`` are bidirectional: a decay by
    how far back a key lies has no meaning there. Not on the meta device, where there is nothing to read yet."""
    tensors = [*encoding.parameters(), *encoding.buffers()]
    if options.causal or any(t.is_meta for t in tensors) or encoding.log_decay is None:
        return
    raise ValueError(
        f"positional_encoding={options.positional_encoding!r} decays with distance (it has a log_decay): it is for "
        "causal attention only (LinearGPT, or LinearAttention(causal=True)); register it with causal_only=True so "
        "that bidirectional configs refuse it when built"
    )


class LinearAttention(nn.Module):
    """Multi-head (linear or softmax) self-attention with a positional encoding.

    Args:
        hidden_size, num_heads: model width and number of heads (head_dim = hidden_size / num_heads).
        options: an :class:`AttentionOptions`; or give its fields as keywords (``positional_encoding``,
            ``feature_map``, ``causal``...).
        standalone: the layer owns its randomness. It builds the codes an encoding shares across layers (SPE)
            and draws them at every forward, and redraws random features (``performer_redraw``) at every training
            forward. A model passes ``False``, shares one draw across its layers (``shared_draw``) and redraws
            once per step itself.
        bias: use biases in the input projection (``qkv_proj``: q, k and v side by side) and the output one.

    forward(hidden_states (B, N, hidden_size), attention_mask (B, N) = None, position_ids (B, N) or (B, N, 2)
    = None, state = None, shared_draw = None, call = None) -> (B, N, hidden_size). ``call``: a ``LayerCall``
    (``attention_inputs.py``) from a model; what flows on to the attention path is one ``AttentionInputs``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        options: AttentionOptions | None = None,
        standalone: bool = True,
        bias: bool = True,
        **option_fields,
    ):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
        if options is not None and option_fields:
            raise ValueError("Give either options or option fields as keywords, not both")
        o = options if options is not None else AttentionOptions(**option_fields)
        self.options = o = o if o.num_heads == num_heads else replace(o, num_heads=num_heads)
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)  # rows: q's, then k's, then v's
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

        # Widths: head_dim -> (encode_query_key) query_key_dim -> (feature map) feature_dim -> (encode_features).
        entry = positional_encoding_entry(o.positional_encoding)
        query_key_dim = entry.width_of_queries_and_keys(o, self.head_dim)
        self.attention = ATTENTION_PATHS[o.attention](o, self.head_dim, query_key_dim)
        feature_dim = getattr(self.attention, "feature_dim", query_key_dim)
        self.positional_encoding = build_positional_encoding(o, num_heads, self.head_dim, feature_dim)
        refuse_a_decay_without_causality(self.positional_encoding, o)
        self.standalone = standalone
        self.shared_codes = build_shared_codes(o, num_heads, self.head_dim) if standalone else None

    @property
    def feature_map(self):
        return getattr(self.attention, "feature_map", None)

    @property
    def takes_plain_road(self) -> bool:
        """Whether a plain call (``LayerCall.plain_positions``) can take ``plain_attend`` (the path's
        ``takes_plain_road``), asked at each call as ``takes_short_steps``; not where the attention path has hooks of
        its own, which the plain road would pass by."""
        attention = self.attention
        hooked = attention._forward_hooks or attention._forward_pre_hooks
        return not hooked and attention.takes_plain_road(self.positional_encoding)

    @property
    def takes_short_steps(self) -> bool:
        """Whether a common decoding step can take ``decoding_step`` (the path's ``takes_short_steps``), asked at each
        step: the encoding or the feature map may have been replaced since the layer was built."""
        return self.attention.takes_short_steps(self.positional_encoding)

    @property
    def output_norm(self):
        return getattr(self.attention, "output_norm", None)

    def redraw_random_features(self):
        """Redraw random feature maps that ask for it (once per training step)."""
        if self.feature_map is not None:
            self.feature_map.redraw()

    def forward(self, hidden_states, attention_mask=None, position_ids=None, state=None, shared_draw=None, call=None):
        """``call``: a ``LayerCall``, what a model finds once for all its layers (packed rows' documents, consecutive
        positions, context-parallel counters, whether the state counts these tokens, the softmax kernel)."""
        if call is not None and call.plain_positions is not None and self.takes_plain_road:
            out = self.plain_attend(hidden_states, attention_mask, call)
        else:
            out = self.attend(hidden_states, attention_mask, position_ids, state, shared_draw, call)
        B, N = hidden_states.shape[:2]
        return self.o_proj(out.transpose(1, 2).reshape(B, N, self.hidden_size))

    def attention_weights(self, hidden_states, attention_mask=None, position_ids=None, shared_draw=None):
        """The weight the layer gives each key in each query's output, (B, H, N queries, N keys): its own path
        probed with one-hot values (value t = e_t), so every stabiliser, gate, decay and normalisation it applies
        is in them (FastRPB's bias included). Padded queries' rows and padded keys' columns are zero. O(N^2)
        memory: for analysis and attention transfer, not for long inputs."""
        refuse_in_context_parallel("attention weights (output_attentions): a rank holds its own queries and keys only")
        B, N = hidden_states.shape[:2]
        one_hot = torch.eye(N, dtype=hidden_states.dtype, device=hidden_states.device)
        probe = one_hot.expand(B, self.num_heads, N, N)
        return self.attend(hidden_states, attention_mask, position_ids, None, shared_draw, values=probe)

    def attend(self, hidden_states, attention_mask=None, position_ids=None, state=None, shared_draw=None, call=None,
               values=None):  # fmt: skip
        """The heads' outputs before the output projection, (B, H, N, d): ``forward`` without ``o_proj``.
        ``values`` (B, H, N, d') replace the projected values (``attention_weights``)."""
        B, N, _ = hidden_states.shape
        if B == 0:  # an empty batch has nothing to attend to (and the chunked products nothing to split)
            width = values.shape[-1] if values is not None else self.head_dim
            return hidden_states.new_zeros(0, self.num_heads, N, width)
        if state is not None and not self.options.causal:
            raise ValueError("A recurrent state is only meaningful for causal attention (causal=True)")
        mask = mask_as_bool(attention_mask, B, N)
        inputs = attention_inputs(self, mask, position_ids, state, call or LayerCall(), B, N, hidden_states.device)
        if self.standalone and self.training:
            self.redraw_random_features()
        if shared_draw is None and self.shared_codes is not None:
            shared_draw = self.own_draw(N, mask is None, position_ids is None and state is None, hidden_states.device)
        q, k, v = self.heads(hidden_states, mask, values)
        projected = q, k
        q, k = self.positional_encoding.encode_query_key(q, k, inputs.positions, shared_draw)
        reuse_inputs = q is projected[0] and k is projected[1]  # this call's own: the feature map may overwrite them
        out = self.attention(q, k, v, inputs, reuse_inputs)
        if self.positional_encoding.has_value_bias:
            out = out + self.value_bias(v, inputs)
        if mask is not None:
            out = out.masked_fill(~mask[:, None, :, None], 0.0)
        if inputs.counted_state is not None and inputs.count_tokens:
            inputs.counted_state.count(inputs.positions, mask, inputs.documents)
        return out

    def plain_attend(self, hidden_states, mask, call):
        """``attend`` for a model's plain ``call`` (``takes_plain_road``): the projections, then the path's
        ``plain_forward``. hidden_states (B, N, hidden), mask (B, N) bool or None -> (B, H, N, d)."""
        q, k, v = self.heads(hidden_states, mask)
        return self.attention.plain_forward(q, k, v, mask, call.plain_positions, self.positional_encoding, call)

    def decoding_step(self, hidden_states, state, positions):
        """``forward`` for a model's common decoding call (``takes_short_steps``; one token after a cache, default
        positions, no mask, no gradient, no hooks on this layer): the projections, the path's ``decoding_step`` on the
        state the prompt made, the output projection. hidden_states (B, 1, hidden), positions (B, 1, 1) ->
        (B, 1, hidden)."""
        q, k, v = self.heads(hidden_states, None)
        out = self.attention.decoding_step(q, k, v, positions, self.positional_encoding, state.path)
        return self.o_proj(out.transpose(1, 2).reshape(hidden_states.shape))

    def own_draw(self, num_tokens: int, unpadded: bool, default_positions: bool, device):
        """A standalone layer's draw of its shared codes (SPE), told where its positions are the defaults from 0."""
        shared_draw = self.shared_codes.draw(device)
        if default_positions and active_group() is None and self.options.position_dims == 1:
            shared_draw.default_positions = (num_tokens, unpadded)  # counted from 0 (``positions_of``)
        return shared_draw

    def heads(self, hidden_states, mask, values=None):
        """q, k, v (B, H, N, d) from the one input projection ``qkv_proj`` (one product forward, one of each kind
        backward), views of its output, or the given ``values`` for v; padded values zeroed (they contribute nothing
        in any path, nor to saved states). Where v wants a gradient it is copied into memory of its own: the
        products keep v for backward, and a view would keep q's and k's columns alive with it (3x the memory); fla's
        path would make that copy anyway. Not where the encoding keeps q and k themselves (``keeps_query_key``):
        their columns stay alive then, and a copy would keep one v more."""
        B, N, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).view(B, N, 3, self.num_heads, self.head_dim).unbind(2)
        if values is not None:
            v = values
        else:
            if v.requires_grad and not self.positional_encoding.keeps_query_key:
                v = v.contiguous()
            v = v.transpose(1, 2)
        if mask is not None:
            v = v.masked_fill(~mask[:, None, :, None], 0.0)
        return q.transpose(1, 2), k.transpose(1, 2), v

    def value_bias(self, v, inputs):
        """The encoding's bias from every visible value (FastRPB), over the state's stored history while decoding."""
        state, keys = inputs.counted_state, (v, inputs.positions, inputs.documents)
        if state is not None:
            state.value_history = state.value_history or ValueHistory()
            keys = state.value_history.append(*keys)
        return self.positional_encoding.value_bias(
            keys[0], keys[1], inputs.positions, self.options.causal, keys[2], inputs.documents
        )
