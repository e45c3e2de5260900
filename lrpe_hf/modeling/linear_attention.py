"""``LinearAttention``: multi-head attention with a kernel feature map and a relative positional encoding.

Per head, with phi the feature map and A_s, B_t the encoding's transforms of the features:

    out_s = sum_t <A_s phi(q_s), B_t phi(k_t)> v_t / norm_s  (+ W V for FastRPB)

summed over every t (bidirectional) or t <= s (causal), never forming an N x N matrix outside a causal chunk.
``norm_s`` is one of three normalisations (``AttentionOptions.normalization``): the transformed denominator,
the unrotated denominator of RoFormer eq. 19, or none followed by a per-head RMSNorm of the output (the
LRPE authors' choice). ``attention="softmax"`` is the quadratic baseline through SDPA, with the same
encodings applied to the raw queries and keys.

Padded positions (``attention_mask == 0``) contribute nothing: their key features and values are zeroed after
the feature map, and their outputs are zero. Without ``position_ids``, positions count the real tokens of
each row (so left and right padding both leave the real tokens' positions unchanged).

Incremental decoding: pass a ``LinearAttentionState`` as ``state``; the layer reads and updates it in place,
so calling it token by token gives the same outputs as one call over the whole sequence.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .attention_kernels import bidirectional_linear_attention, causal_linear_attention
from .attention_options import AttentionOptions
from .feature_maps import build_feature_map
from .positional_encoding import NoPositionalEncoding, PositionalEncoding
from .positional_fastrpb import FastRelativePositionBias
from .positional_lrpe import LRPEOrthogonal, LRPEPermutation, LRPEUnitary
from .positional_permute import PermutePositionalEncoding
from .positional_rope import RotaryPositionalEncoding
from .positional_spe import ConvSPECodes, SineSPECodes, StochasticPositionalEncoding


@dataclass
class LinearAttentionState:
    """What one causal layer carries between calls (B batch, H heads, m feature dim, d head dim).

    ``kv``: sum_t decay(s, t) k_t v_t^T, with a trailing ones column in v for the transformed denominator
    (B, H, m, d [+1]); ``key_sum``: the unrotated denominator's state (B, H, m', 1); ``key_max``: the running
    key maximum of exponential feature maps (B, H); ``num_tokens`` and ``last_position``: per-row counters
    (B,). FastRPB keeps the values and positions it biases with (``values``, ``value_positions``); the
    softmax baseline keeps its encoded keys, values, positions and padding mask.
    """

    num_tokens: torch.Tensor | None = None
    last_position: torch.Tensor | None = None
    kv: torch.Tensor | None = None
    key_sum: torch.Tensor | None = None
    key_max: torch.Tensor | None = None
    values: torch.Tensor | None = None
    value_positions: torch.Tensor | None = None
    history_length: int = 0
    keys: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None

    def append_history(self, values: torch.Tensor, positions: torch.Tensor):
        """FastRPB's history: append values (B, H, n, d) and positions (B, n, A), return all of it so far.

        Without autograd (generation) the storage doubles when full, so each step copies only its own tokens.
        """
        if torch.is_grad_enabled():  # keep autograd's saved tensors intact: no writes into shared storage
            if self.values is not None:
                values = torch.cat([self.values[:, :, : self.history_length], values], dim=2)
                positions = torch.cat([self.value_positions[:, : self.history_length], positions], dim=1)
            self.values, self.value_positions, self.history_length = values, positions, values.shape[2]
            return values, positions
        end = self.history_length + values.shape[2]
        if self.values is None or end > self.values.shape[2]:
            capacity = max(64, 2 * end)
            grown = values.new_zeros(values.shape[:2] + (capacity,) + values.shape[3:])
            grown_positions = positions.new_zeros(positions.shape[0], capacity, positions.shape[2])
            if self.values is not None:
                grown[:, :, : self.history_length] = self.values[:, :, : self.history_length]
                grown_positions[:, : self.history_length] = self.value_positions[:, : self.history_length]
            self.values, self.value_positions = grown, grown_positions
        self.values[:, :, self.history_length : end] = values
        self.value_positions[:, self.history_length : end] = positions
        self.history_length = end
        return self.values[:, :, :end], self.value_positions[:, :end]

    def reorder(self, index: torch.Tensor):
        """Select batch rows (beam search)."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.index_select(0, index.to(value.device)))


def build_positional_encoding(
    options: AttentionOptions, num_heads: int, head_dim: int, feature_dim: int, own_spe_codes: bool = True
) -> PositionalEncoding:
    """The encoding module for ``options.positional_encoding``; ``feature_dim`` is the width it transforms."""
    name, dims = options.positional_encoding, options.position_dims
    lrpe = dict(position_dims=dims, p_matrix=options.lrpe_p_matrix, learnable_p=options.lrpe_learnable_p)
    if name == "none":
        return NoPositionalEncoding()
    if name == "rope":
        return RotaryPositionalEncoding(num_heads, feature_dim, options.rope_base, dims)
    if name == "lrpe_unitary":
        return LRPEUnitary(
            num_heads, feature_dim, learnable_angles=options.lrpe_learnable_angles, base=options.rope_base, **lrpe
        )
    if name == "lrpe_orthogonal":
        return LRPEOrthogonal(
            num_heads, feature_dim, learnable_angles=options.lrpe_learnable_angles, base=options.rope_base, **lrpe
        )
    if name == "lrpe_permutation":
        return LRPEPermutation(num_heads, feature_dim, **lrpe)
    if name == "permute":
        return PermutePositionalEncoding(num_heads, feature_dim, dims, options.causal, options.permute_decay)
    if name in ("spe_sine", "spe_conv"):
        codes = build_spe_codes(options, num_heads, head_dim) if own_spe_codes else None
        return StochasticPositionalEncoding(num_heads, head_dim, options.spe_realizations, options.spe_gated, codes)
    if name == "fastrpb":
        return FastRelativePositionBias(num_heads, options.max_positions, dims, options.fastrpb_init_std)
    raise ValueError(f"Unknown positional_encoding {name!r}")


def build_spe_codes(options: AttentionOptions, num_heads: int, head_dim: int):
    """The SPE kernels; a model builds one and shares it across its layers."""
    if options.positional_encoding == "spe_sine":
        return SineSPECodes(
            num_heads, head_dim, options.spe_realizations, options.spe_sines, options.position_dims, options.spe_seed
        )
    return ConvSPECodes(
        num_heads, head_dim, options.spe_realizations, options.spe_kernel_size, options.position_dims, options.spe_seed
    )


class LinearAttention(nn.Module):
    """Multi-head (linear or softmax) self-attention with a positional encoding.

    Args:
        hidden_size, num_heads: model width and number of heads (head_dim = hidden_size / num_heads).
        standalone: the layer owns its randomness. For SPE it builds its own kernels and draws at every
            forward; with ``performer_redraw`` it redraws its random features at every training forward. A
            model passes ``False``, shares one SPE draw across its layers (``spe_draw``) and redraws Performer
            features once per step itself.
        bias: use biases in the q/k/v/output projections.
        **options: any field of :class:`AttentionOptions` (``positional_encoding``, ``feature_map``, ``causal``...).

    forward(hidden_states (B, N, hidden_size), attention_mask (B, N) = None, position_ids (B, N) or (B, N, 2)
    = None, state = None, spe_draw = None) -> (B, N, hidden_size)
    """

    def __init__(self, hidden_size: int, num_heads: int, standalone: bool = True, bias: bool = True, **options):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
        self.options = o = AttentionOptions(**options)
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

        # Widths: head_dim -> (SPE: R realizations) -> (feature map) feature_dim -> (encoding) encoded width.
        is_spe = o.positional_encoding in ("spe_sine", "spe_conv")
        query_key_dim = o.spe_realizations if is_spe else self.head_dim
        if o.attention == "linear":
            self.feature_map = build_feature_map(
                o.feature_map,
                query_key_dim,
                relu_eps=o.relu_eps,
                dpfp_nu=o.dpfp_nu,
                performer_features=o.performer_features,
                performer_redraw=o.performer_redraw,
            )
            feature_dim = self.feature_map.output_dim
        else:
            self.feature_map = None
            feature_dim = query_key_dim
        self.standalone = standalone
        self.positional_encoding = build_positional_encoding(o, num_heads, self.head_dim, feature_dim, standalone)
        self.output_norm = nn.RMSNorm(self.head_dim, eps=1e-6) if o.normalization == "output_norm" else None

    # ------------------------------------------------------------------ inputs
    def resolve_positions(self, position_ids, mask, state, batch_size, num_tokens, device):
        """Integer positions (B, N, A)."""
        dims = self.options.position_dims
        if position_ids is not None:
            positions = torch.as_tensor(position_ids, device=device)
            if positions.is_floating_point():
                raise ValueError("position_ids must be integers")
            if dims == 1 and positions.dim() == 2:
                positions = positions[..., None]
            if positions.dim() != 3 or positions.shape[1:] != (num_tokens, dims):
                expected = f"(batch, {num_tokens})" if dims == 1 else f"(batch, {num_tokens}, 2) with (row, col)"
                raise ValueError(f"position_ids must have shape {expected}; got {tuple(position_ids.shape)}")
            return positions.expand(batch_size, -1, -1).long()
        if dims == 2:
            if self.options.positional_encoding == "none":
                return torch.zeros(batch_size, num_tokens, 2, dtype=torch.long, device=device)
            raise ValueError("2D positional encodings need position_ids of shape (batch, tokens, 2) with (row, col)")
        start = state.num_tokens if state is not None and state.num_tokens is not None else 0
        if mask is None:
            positions = torch.arange(num_tokens, device=device).expand(batch_size, -1)
        else:
            positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        return (positions + (start[:, None] if torch.is_tensor(start) else start))[..., None]

    def split_heads(self, x):
        B, N, _ = x.shape
        return x.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, state=None, spe_draw=None):
        B, N, _ = hidden_states.shape
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != (B, N):
                raise ValueError(
                    f"attention_mask must have shape (batch, tokens) = {(B, N)}, got {tuple(attention_mask.shape)}"
                )
            mask = attention_mask.bool()
        if state is not None and not self.options.causal:
            raise ValueError("A recurrent state is only meaningful for causal attention (causal=True)")
        positions = self.resolve_positions(position_ids, mask, state, B, N, hidden_states.device)
        if self.standalone and self.training and self.options.performer_redraw:
            self.feature_map.redraw_projection()
        q, k, v = (self.split_heads(proj(hidden_states)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if mask is not None:  # padded values contribute nothing, in every path (and in saved states)
            v = v.masked_fill(~mask[:, None, :, None], 0.0)
        q, k = self.positional_encoding.encode_query_key(q, k, positions, spe_draw)
        if self.options.attention == "softmax":
            out = self.softmax_attention(q, k, v, mask, positions, state)
        else:
            out = self.linear_attention(q, k, v, mask, positions, state)
        out = self.add_value_bias(out, v, positions, state)
        if mask is not None:
            out = out.masked_fill(~mask[:, None, :, None], 0.0)
        if state is not None:
            real = mask.long().sum(-1) if mask is not None else torch.full((B,), N, device=out.device)
            state.num_tokens = real if state.num_tokens is None else state.num_tokens + real
            last = positions[..., 0].masked_fill(~mask, -1).amax(-1) if mask is not None else positions[:, -1, 0]
            state.last_position = last if state.last_position is None else torch.maximum(state.last_position, last)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, self.hidden_size))

    # ------------------------------------------------------------------ linear attention
    def features(self, q, k, mask, state):
        """phi(q), phi(k) (B, H, N, m), with keys zeroed where padded, and the log gates that an exponential
        map's running key maximum adds (causal) or None."""
        fm = self.feature_map
        gates = None
        if not fm.is_exponential:
            fq, fk = fm(q), fm(k)
        else:
            lq, lk = fm.log_features(q), fm.log_features(k)
            fq = (lq - lq.amax(-1, keepdim=True).detach()).exp()
            token_max = lk.amax(-1).detach().to(torch.promote_types(lk.dtype, torch.float32))  # (B, H, N)
            if mask is not None:
                token_max = token_max.masked_fill(~mask[:, None], float("-inf"))
            if self.options.causal:
                # Keys are divided by exp(running maximum); each growth of the maximum rescales the past by a
                # log gate <= 0. Only keys up to s set the scale of output s: no future token leaks in.
                previous = state.key_max if state is not None and state.key_max is not None else token_max[..., 0]
                running = torch.cummax(torch.cat([previous[..., None], token_max], dim=-1), dim=-1).values
                finite = running.isfinite()
                first = running.masked_fill(~finite, float("inf")).amin(-1, keepdim=True)  # first real key
                running = torch.where(finite, running, first.masked_fill(first.isinf(), 0.0))
                gates = running[..., :-1] - running[..., 1:]
                stabiliser = running[..., 1:]
                if state is not None:
                    state.key_max = running[..., -1]
            else:
                stabiliser = token_max.amax(-1, keepdim=True)
                stabiliser = stabiliser.masked_fill(stabiliser.isinf(), 0.0).expand_as(token_max)
            fk = (lk - stabiliser[..., None].to(lk.dtype)).exp()
        if mask is not None:
            fk = fk.masked_fill(~mask[:, None, :, None], 0.0)
        return fq, fk, gates

    def position_gates(self, positions, state, dtype):
        """PermuteFormer's decay as per-token log gates log(r) * (p_t - p_{t-1}): (B, H, N) or None."""
        log_decay = self.positional_encoding.log_decay
        if log_decay is None:
            return None
        p = positions[..., 0]
        if state is not None and state.last_position is not None:
            previous = torch.cat([state.last_position[:, None], p[:, :-1]], dim=-1)
        else:
            previous = torch.cat([p[:, :1], p[:, :-1]], dim=-1)
        dtype = torch.promote_types(dtype, torch.float32)
        steps = (p - previous).clamp_min(0).to(dtype)
        return log_decay.to(dtype)[None, :, None] * steps[:, None, :]

    def linear_attention(self, q, k, v, mask, positions, state):
        o = self.options
        fq, fk, gates = self.features(q, k, mask, state)
        position_gates = self.position_gates(positions, state, q.dtype)
        if position_gates is not None:
            gates = position_gates if gates is None else gates + position_gates
        tq, tk = self.positional_encoding.encode_features(fq, fk, positions)
        if o.normalization == "denominator":
            ones = torch.ones_like(v[..., :1])
            if mask is not None:
                ones = ones * mask[:, None, :, None].to(v.dtype)
            v = torch.cat([v, ones], dim=-1)
        if o.causal:
            previous = state.kv if state is not None else None
            out, kv = causal_linear_attention(tq, tk, v, gates, previous, o.chunk_size)
            if state is not None:
                state.kv = kv
        else:
            out = bidirectional_linear_attention(tq, tk, v)
        if o.normalization == "denominator":
            out, denominator = out[..., :-1], out[..., -1:]
            return out / (denominator + o.eps)
        if o.normalization == "unrotated_denominator":
            return out / (self.unrotated_denominator(fq, fk, gates, state) + o.eps)
        return self.output_norm(out)

    def unrotated_denominator(self, fq, fk, gates, state):
        """<phi(q_s), sum_t phi(k_t)> without the positional transform (RoFormer eq. 19): (B, H, N, 1)."""
        if not self.options.causal:
            return fq @ fk.sum(-2)[..., None]
        previous = state.key_sum if state is not None else None
        if gates is None:
            sums = fk.cumsum(-2)
            if previous is not None:
                sums = sums + previous.transpose(-1, -2)
            if state is not None:
                state.key_sum = sums[..., -1:, :].transpose(-1, -2)
            return (fq * sums).sum(-1, keepdim=True)
        ones = torch.ones_like(fk[..., :1])
        denominator, key_sum = causal_linear_attention(fq, fk, ones, gates, previous, self.options.chunk_size)
        if state is not None:
            state.key_sum = key_sum
        return denominator

    # ------------------------------------------------------------------ softmax baseline
    def softmax_attention(self, q, k, v, mask, positions, state):
        """SDPA over the encoded raw queries and keys; PermuteFormer's decay becomes an additive log bias."""
        q, k = self.positional_encoding.encode_features(q, k, positions)
        B, H, N, _ = q.shape
        key_mask = mask if mask is not None else torch.ones(B, N, dtype=torch.bool, device=q.device)
        key_positions = positions
        if state is not None:
            if state.keys is not None:
                k = torch.cat([state.keys, k], dim=2)
                v = torch.cat([state.values, v], dim=2)
                key_mask = torch.cat([state.key_mask, key_mask], dim=1)
                key_positions = torch.cat([state.value_positions, positions], dim=1)
            state.keys, state.values, state.key_mask, state.value_positions = k, v, key_mask, key_positions
        T = k.shape[2]
        log_decay = self.positional_encoding.log_decay
        if mask is None and state is None and log_decay is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.options.causal)
        allowed = key_mask[:, None, None, :].expand(B, 1, N, T)
        if self.options.causal:
            order = torch.arange(T - N, T, device=q.device)[:, None] >= torch.arange(T, device=q.device)[None, :]
            allowed = allowed & order
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # rows with no key (padding): outputs are zeroed later
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        if log_decay is not None:
            distance = (positions[:, :, 0, None] - key_positions[:, None, :, 0]).clamp_min(0)  # (B, N, T)
            bias = bias + (log_decay.to(q.dtype)[None, :, None, None] * distance[:, None].to(q.dtype))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    # ------------------------------------------------------------------ FastRPB
    def add_value_bias(self, out, v, positions, state):
        encoding = self.positional_encoding
        if not isinstance(encoding, FastRelativePositionBias):
            return out
        key_values, key_positions = v, positions
        if state is not None and self.options.attention == "linear":
            key_values, key_positions = state.append_history(v, positions)
        elif state is not None:  # the softmax state already holds every (masked) value and position
            key_values, key_positions = state.values, state.value_positions
        return out + encoding.value_bias(key_values, key_positions, positions, self.options.causal)
