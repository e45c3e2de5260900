"""The linear (kernel) attention path: feature map, positional transform of the features, normalisation.

Per head, with phi the feature map and A_s, B_t the encoding's transforms of the features:

    out_s = sum_t w(s, t) <A_s phi(q_s), B_t phi(k_t)> v_t / norm_s,

summed over every t (bidirectional) or t <= s (causal); w(s, t) = exp(log_decay (p_s - p_t)) for a decaying
encoding (PermuteFormer), 1 otherwise. ``norm_s`` is one of three normalisations:

- ``denominator``: sum_t w(s, t) <A_s phi(q_s), B_t phi(k_t)> + eps (LRPE eq. 3, PermuteFormer eq. 11), what a
  ones column appended to the values gives (the products compute it alongside, without widening v);
- ``unrotated_denominator``: sum_t w(s, t) <phi(q_s), phi(k_t)> + eps (RoFormer eq. 19);
- ``output_norm``: no denominator; the output is normalised per head by an RMSNorm;
- ``output_layer_norm``: no denominator; one LayerNorm (gain and bias) over all heads together, as the LRPE
  authors' code (``linear_kernel_attention.py`` with ``use_urpe``) does before the output projection.

With ``local_window`` W > 0, each query attends to its W nearest tokens by exact softmax and to the others by the
form above, the two under one normaliser with a learned factor per head (``local_window.py``, its formula there).

eps is defined on the unstabilised scale: where an exponential feature map divided every term of output s by
exp(log_scale_s), eps is multiplied by exp(-log_scale_s) (and the RMSNorm's by its square).
"""

from dataclasses import dataclass

import torch
from torch import nn

from .attention_kernels import bidirectional_linear_attention, causal_linear_attention
from .attention_state import TensorState
from .context_parallel import active_group, bidirectional_product, causal_product
from .feature_maps import FEW_ELEMENTS, FeatureMap, Features
from .gradients import wants_gradient
from .local_window import LocalWindow, WindowState
from .positional_encoding import PositionalEncoding
from .positions import document_count, position_steps
from .products_chunked import causal_key_sums
from .products_dispatch import kernel_backend_serves
from .products_gated import recurrent_step
from .products_shared import divide_rows, row_dot
from .registry import build_feature_map


def nonzero(denominator: torch.Tensor) -> torch.Tensor:
    """The denominator, with rows that underflowed (below the dtype's smallest normal number, where a ratio has
    lost its precision) set to infinity, so that their output is 0."""
    return denominator.masked_fill(denominator.abs() < torch.finfo(denominator.dtype).tiny, float("inf"))


def updates_in_place(state) -> bool:
    """Whether a decoding step may update ``state``'s stored tensors in place (``store`` overwrites them with the
    new values anyway): eagerly and without autograd, as while generating."""
    return state is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class DivideByDenominator(torch.autograd.Function):
    """``divide_rows`` for autograd, saving the result and the divisor only."""

    @staticmethod
    def divide(numerator, denominator, eps, guard=None):
        """The division, through this Function only when a gradient is wanted and the code runs eagerly (a compiler
        differentiates the plain division itself)."""
        if wants_gradient(numerator, denominator, eps) and not torch.compiler.is_compiling():
            return DivideByDenominator.apply(numerator, denominator, eps, guard)
        return divide_rows(numerator, denominator, eps, guard)[0]

    @staticmethod
    def forward(ctx, numerator, denominator, eps, guard=None):
        result, divisor = divide_rows(numerator, denominator, eps, guard)
        ctx.save_for_backward(result, divisor)
        ctx.eps_shape = eps.shape if isinstance(eps, torch.Tensor) else None
        ctx.denominator_dtype = denominator.dtype
        return result

    @staticmethod
    def backward(ctx, grad):
        result, divisor = ctx.saved_tensors
        # d(n / D)/dn = 1 / D; d(n / D)/dD = -(n / D) / D, summed over the row with the output's gradient (in the
        # divisor's dtype, float32 for float16 inputs, then cast to each input's)
        if divisor.dtype != grad.dtype:  # float16: the row's sum in float16, then over the float32 divisor
            grad_numerator = torch.div(grad, divisor, out=torch.empty_like(grad))
            grad_denominator = torch.linalg.vecdot(grad, result, dim=-1).unsqueeze(-1).div(divisor).neg_()
        else:  # the numerator's gradient first: the denominator's is its sum with the result, one product fewer
            grad_numerator = grad / divisor
            grad_denominator = row_dot(grad_numerator, result, alpha=-1.0)
        grad_eps = grad_denominator.sum_to_size(ctx.eps_shape) if ctx.needs_input_grad[2] else None
        return grad_numerator, grad_denominator.to(ctx.denominator_dtype), grad_eps, None


@dataclass
class KernelAttentionState(TensorState):
    """``kv``: sum_t w(s, t) k_t v_t^T, with the key sum sum_t w(s, t) k_t as one more column for the
    transformed denominator (B, H, m, d [+1]); ``key_sum``: the unrotated denominator's state (B, H, m', 1);
    ``key_max``: the running key maximum of exponential feature maps (B, H); ``window``: with ``local_window``, the
    last W tokens (the linear states then hold every older token)."""

    kv: torch.Tensor | None = None
    key_sum: torch.Tensor | None = None
    key_max: torch.Tensor | None = None
    window: WindowState | None = None


class KernelAttention(nn.Module):
    """q, k (B, H, N, D'), v (B, H, N, d) -> out (B, H, N, d). ``feature_dim`` is phi's output width."""

    State = KernelAttentionState

    def __init__(self, options, head_dim: int, query_key_dim: int):
        super().__init__()
        self.causal, self.chunk_size, self.kernel_backend = options.causal, options.chunk_size, options.kernel_backend
        self.normalization, self.eps = options.normalization, options.eps
        self.feature_map = build_feature_map(options, query_key_dim)
        self.feature_dim = self.feature_map.output_dim
        self.output_norm = None
        if self.normalization == "output_norm":
            self.output_norm = nn.RMSNorm(head_dim, eps=options.eps)
        elif self.normalization == "output_layer_norm":
            self.output_norm = nn.LayerNorm(head_dim * options.num_heads, eps=options.eps)
        self.local_window = None  # W = 0: no module, no parameter, today's path
        if options.local_window:
            self.local_window = LocalWindow(options, head_dim, query_key_dim, self.feature_dim)

    def forward(self, q, k, v, inputs, reuse_inputs=False):
        """``inputs``: the layer's ``AttentionInputs`` (mask, positions, encoding, this path's state for causal
        decoding, a decay's position steps, packed rows' starts; ``consecutive``: each token one past the one before,
        so a decay by distance is the same at every token: nothing to look at); ``reuse_inputs``: q and k are the
        layer's temporaries, which the feature map may overwrite."""
        if self.local_window is not None:
            return self.local_window(self, q, k, v, inputs)
        state, starts = inputs.state, inputs.starts
        local_documents = None if starts is None else starts.long().cumsum(-1)
        features, tq, tk = self.encoded_features(q, k, inputs, local_documents, reuse_inputs)
        gates, known_decay = self.gates(features, inputs, q.dtype)
        with_denominator = self.normalization == "denominator"
        # without a stabiliser or a gradient, the causal product divides by the denominator as it goes
        divided = self.causal and with_denominator and features.log_scale is None
        cp = active_group()
        divided = divided and not wants_gradient(tq, tk, v, gates) and cp is None
        in_place = updates_in_place(state)
        if cp is not None:
            out, denominator, kv = self.context_parallel_product(tq, tk, v, gates, starts, with_denominator, cp)
        elif self.causal:
            previous = state.kv if state else None
            divide_eps = self.eps if divided else None
            out, denominator, kv = causal_linear_attention(
                tq, tk, v, gates, previous, self.chunk_size, starts, with_denominator, divide_eps, self.kernel_backend,
                in_place, known_decay, final_state=state is not None,
            )  # fmt: skip
        else:
            count = None if starts is None else document_count(starts)
            out, denominator = bidirectional_linear_attention(tq, tk, v, local_documents, with_denominator, count)
            kv = None
        if state is not None:
            state.store("kv", kv)
            state.store("key_max", features.key_max)
        if divided:
            return out
        if self.normalization == "unrotated_denominator":
            denominator = self.unrotated_denominator(
                features.query, features.key, gates, state, starts, in_place, known_decay
            )
        return self.normalized(out, denominator, features.log_scale)

    def encoded_features(self, q, k, inputs, local_documents, reuse_inputs: bool):
        """The feature map's ``Features`` of q and k, and their encoded forms tq, tk (B, H, N, m): stacked for a
        decoding step where it can (``stacks``)."""
        mask, positions, encoding, state = inputs.mask, inputs.positions, inputs.encoding, inputs.state
        if self.stacks(q, k, encoding):
            features, (tq, tk) = self.stacked_features(q, k, mask, positions, encoding)
        else:
            key_max = state.key_max if state else None
            features = self.feature_map.features(q, k, mask, self.causal, key_max, local_documents, reuse_inputs)
            tq, tk = encoding.encode_features(features.query, features.key, positions)
        if active_group() is not None and (features.log_scale is not None or features.key_max is not None):
            raise ValueError(
                f"Context parallelism does not take feature_map={type(self.feature_map).__name__}: it is stabilised "
                "by a running key maximum, which the ranks would need in turn; use a map without one (elu, relu, dpfp, "
                "hedgehog or t2r)"
            )
        return features, tq, tk

    def gates(self, features, inputs, dtype):
        """The product's per-token log gates (B, H, N) or None: the stabiliser's, plus the encoding's decay by
        distance; and the decay per head where the caller knows it is one at every token (``known_decay``)."""
        gates = features.log_gates
        log_decay = inputs.encoding.log_decay
        if log_decay is not None and not self.causal:
            raise ValueError(f"{type(inputs.encoding).__name__} decays with distance: it is for causal attention only")
        decay = self.decay_gates(log_decay, inputs.position_steps, dtype)
        uniform = inputs.consecutive and decay is not None and gates is None and inputs.starts is None
        known_decay = log_decay if uniform else None
        if decay is not None:
            gates = decay if gates is None else gates + decay
        return gates, known_decay

    def normalized(self, out, denominator, log_scale):
        """out (B, H, N, d) divided by its denominator (B, H, N, 1), or through the output norm where there is none;
        ``log_scale`` (B, H, N, 1): the stabiliser's, whose eps is on the unstabilised scale, or None."""
        if self.normalization == "output_layer_norm":
            return self.layer_norm_over_heads(out, log_scale)
        if log_scale is None:
            if denominator is not None:
                return DivideByDenominator.divide(out, denominator, self.eps)
            return self.output_norm(out.to(self.output_norm.weight.dtype)).to(out.dtype)  # fused kernel under autocast
        # Stabilised features: eps on the unstabilised scale, kept in float32 (or wider): exp(-log_scale) overflows
        # half precision for logits below -11. A row whose every term underflowed (logits spread over ~80 or more
        # in float32) has no precision left: its output is 0 instead of noise or NaN.
        eps = self.eps * torch.exp(-log_scale)
        if denominator is not None:
            return DivideByDenominator.divide(out, denominator, eps, nonzero)
        # RMSNorm is scale-free: divide by the row's largest entry first, so that squaring cannot underflow.
        peak = out.abs().amax(-1, keepdim=True)
        unit = out / nonzero(peak)
        log_peak = peak.to(log_scale.dtype).clamp_min(torch.finfo(peak.dtype).tiny).log()
        mean_square = unit.pow(2).mean(-1, keepdim=True) + self.eps * torch.exp(-2 * (log_scale + log_peak))
        return (unit / nonzero(mean_square.sqrt())).to(out.dtype) * self.output_norm.weight.to(out.dtype)

    def context_parallel_product(self, q, k, v, gates, starts, with_denominator, cp):
        """The product over a sequence split across ``cp``'s ranks (``context_parallel``): out, the denominator and,
        causal, the state after this rank's last token (``context_parallel.causal_product``), else None."""
        if self.causal:
            return causal_product(q, k, v, gates, starts, with_denominator, self.chunk_size, self.kernel_backend, cp)
        out, denominator = bidirectional_product(q, k, v, with_denominator, cp)
        return out, denominator, None

    def stacks(self, q, k, encoding) -> bool:
        """Whether q and k go through the feature map and the encoding as one tensor (``stacked_features``): for
        a decoding step's few elements without gradient, where the map treats queries and keys alike (the base
        ``features``) and the encoding can (``stacks_features``). Not while compiling, where the compiler fuses,
        nor for a batch of several rows where the product may take fla's kernels: their halves would not be
        contiguous in fla's layout, and it would copy each."""
        return (
            q.numel() < FEW_ELEMENTS
            and (q.shape[0] == 1 or not kernel_backend_serves(q, self.kernel_backend))
            and q.shape == k.shape
            and q.dtype == k.dtype
            and encoding.stacks_features
            and type(self.feature_map).features is FeatureMap.features
            and not torch.compiler.is_compiling()
            and not wants_gradient(q, k)
        )

    def takes_plain_road(self, encoding) -> bool:
        """Whether a plain call of this path with ``encoding`` can take ``plain_forward``: a feature map without a
        stabiliser (the base ``features``), an encoding that acts on the features alone (no ``encode_query_key``, no
        value bias) and no local window."""
        return (
            self.local_window is None
            and type(self.feature_map).features is FeatureMap.features
            and type(encoding).encode_query_key is PositionalEncoding.encode_query_key
            and not encoding.has_value_bias
        )

    def takes_short_steps(self, encoding) -> bool:
        """Whether a decoding step of this path with ``encoding`` can take ``decoding_step``: causal, the plain road
        (``takes_plain_road``), and the products' default backends (a named other backend keeps its own one-step
        kernel)."""
        return self.causal and self.kernel_backend in ("auto", "torch") and self.takes_plain_road(encoding)

    def plain_forward(self, q, k, v, mask, positions, encoding, call):
        """``forward`` for a plain ``call`` (``takes_plain_road``; no state, default positions, one document a row,
        no context parallelism): the features, the encoding, a decay's gates, one product, the normalisation, padded
        outputs zeroed. q, k (B, H, N, D) the layer's own temporaries, v (B, H, N, d) with padded values zeroed,
        mask (B, N) bool or None, positions (B, N, 1) -> out (B, H, N, d)."""
        out = self.plain_product(q, k, v, mask, positions, encoding, call.consecutive)
        return out if mask is None else out.masked_fill(~mask[:, None, :, None], 0.0)

    def plain_product(self, q, k, v, mask, positions, encoding, consecutive: bool):
        """``plain_forward`` before padded outputs are zeroed; ``consecutive``: positions without padding."""
        features = self.feature_map.features(q, k, mask, self.causal, reuse_inputs=True)
        tq, tk = encoding.encode_features(features.query, features.key, positions)
        log_decay, gates, known_decay = encoding.log_decay, None, None
        if log_decay is not None:
            gates = self.decay_gates(log_decay, position_steps(positions, mask), q.dtype)
            known_decay = log_decay if consecutive else None
        with_denominator = self.normalization == "denominator"
        if not self.causal:
            out, denominator = bidirectional_linear_attention(tq, tk, v, None, with_denominator)
        else:  # without a gradient, the product divides by the denominator as it goes
            divide_eps = self.eps if with_denominator and not wants_gradient(tq, tk, v, gates) else None
            out, denominator, _ = causal_linear_attention(
                tq, tk, v, gates, None, self.chunk_size, None, with_denominator, divide_eps, self.kernel_backend,
                known_decay=known_decay, final_state=False,
            )  # fmt: skip
            if divide_eps is not None:
                return out
        if self.normalization == "unrotated_denominator":
            fq, fk = features.query, features.key
            denominator = self.unrotated_denominator(fq, fk, gates, None, known_decay=known_decay)
        return self.normalized(out, denominator, None)

    def decoding_step(self, q, k, v, positions, encoding, state):
        """One token after a cache, as a model's common decoding call makes it (the positions the defaults, one
        past each row's last real token, no mask, no gradient): the features and the encoding stacked, then the
        recurrent update in place and the readout, S = exp(log_decay) S + phi(k)^T [v, 1], out = phi(q) S divided
        by its last column (the unrotated denominator from its own key sums; the output norms as ``normalized``).
        q, k (B, H, 1, D), v (B, H, 1, d), positions (B, 1, 1), ``state`` this path's ``KernelAttentionState`` (made
        by the prompt) -> out (B, H, 1, d)."""
        features, (tq, tk) = self.stacked_features(q, k, None, positions, encoding)
        log_decay = encoding.log_decay
        dtype = torch.promote_types(q.dtype, torch.float32)
        gates = None if log_decay is None else log_decay.to(dtype)[None, :, None].expand(q.shape[0], -1, 1)
        with_denominator = self.normalization == "denominator"
        numerator, kv = recurrent_step(tq, tk, v, gates, state.kv, None, True, with_denominator)
        state.store("kv", kv)
        if with_denominator:
            out, denominator = numerator.split([v.shape[-1], 1], dim=-1)
            return divide_rows(out, denominator, self.eps)[0]
        if self.normalization == "unrotated_denominator":
            fq, fk = features.query, features.key
            denominator, key_sum = recurrent_step(
                fq, fk, fk.new_ones(*fk.shape[:-1], 1), gates, state.key_sum, None, True
            )
            state.store("key_sum", key_sum)
            return divide_rows(numerator, denominator, self.eps)[0]
        return self.normalized(numerator, None, None)

    def stacked_features(self, q, k, mask, positions, encoding):
        """``Features`` of q and k (B, H, N, D) and their encoded forms, the two stacked along the heads
        (B, 2H, N, m), queries' heads first: one op each for the map and the encoding where two would be, for one
        concatenation (on a GPU a decoding step's cost is its launches). The map sees them as a batch of 2B rows
        of H heads (its per-head parameters apply alike). Returns the features and the encoded (tq, tk), views
        (each contiguous for one row, as fla's one-step kernel takes them)."""
        B, H, N = q.shape[:3]
        x = torch.cat((q, k), dim=1).view(2 * B, H, N, -1)  # rows (b, 0) the queries, (b, 1) the keys
        x = self.feature_map.in_place(x).reshape(B, 2 * H, N, -1)
        if mask is not None:
            x[:, H:].masked_fill_(~mask[:, None, :, None], 0.0)  # padded keys add nothing
        encoded = encoding.encode_stacked(x, positions)
        return Features(x[:, :H], x[:, H:]), (encoded[:, :H], encoded[:, H:])

    def layer_norm_over_heads(self, out, log_scale):
        """LayerNorm over the concatenated heads: out (B, H, N, d) -> (B, H, N, d). With stabilised features each
        head first returns to one scale (the row's largest), and eps is scaled with it, as for the other norms."""
        B, H, N, d = out.shape
        norm = self.output_norm
        if log_scale is None:
            merged = out.transpose(1, 2).reshape(B, N, H * d)
            merged = norm(merged.to(norm.weight.dtype)).to(out.dtype)
            return merged.view(B, N, H, d).transpose(1, 2)
        reference = log_scale.amax(1, keepdim=True)  # (B, 1, N, 1)
        common = out * torch.exp(log_scale - reference).to(out.dtype)  # every head at the scale exp(-reference)
        merged = common.transpose(1, 2).reshape(B, N, H * d)
        peak = merged.abs().amax(-1, keepdim=True)
        unit = merged / nonzero(peak)
        log_peak = peak.to(reference.dtype).clamp_min(torch.finfo(peak.dtype).tiny).log()
        centred = unit - unit.mean(-1, keepdim=True)
        eps = self.eps * torch.exp(-2 * (reference[:, 0] + log_peak))  # (B, N, 1)
        variance = centred.pow(2).mean(-1, keepdim=True) + eps  # in eps's float32: eps may overflow half precision
        normed = (centred / nonzero(variance.sqrt())).to(out.dtype)
        normed = normed * norm.weight.to(out.dtype) + norm.bias.to(out.dtype)
        return normed.view(B, N, H, d).transpose(1, 2)

    @staticmethod
    def decay_gates(log_decay, steps, dtype):
        """A decaying encoding's per-token log gates log_decay * (p_t - p_prev) (B, H, N), from each real token's
        step from the previous real token (B, N; 0 for padding, whose gate is then 1), or None."""
        if log_decay is None:
            return None
        dtype = torch.promote_types(dtype, torch.float32)
        return log_decay.to(dtype)[None, :, None] * steps[:, None, :].to(dtype)

    def unrotated_denominator(self, fq, fk, gates, state, starts=None, in_place=False, known_decay=None):
        """<phi(q_s), sum_t w(s, t) phi(k_t)> without the positional transform (RoFormer eq. 19): (B, H, N, 1)."""
        cp = active_group()
        if cp is not None:
            ones = torch.ones_like(fk[..., :1])
            denominator, _, key_sum = self.context_parallel_product(fq, fk, ones, gates, starts, False, cp)
            if state is not None:
                state.store("key_sum", key_sum)
            return denominator
        if not self.causal:
            documents = None if starts is None else starts.long().cumsum(-1)
            count = None if starts is None else document_count(starts)
            return bidirectional_linear_attention(fq, fk, torch.ones_like(fk[..., :1]), documents, False, count)[0]
        previous = state.key_sum if state is not None else None
        if gates is None and starts is None:
            denominator, key_sum = causal_key_sums(fq, fk, previous, self.chunk_size, in_place, state is not None)
        else:
            ones = torch.ones_like(fk[..., :1])
            denominator, _, key_sum = causal_linear_attention(
                fq, fk, ones, gates, previous, self.chunk_size, starts, backend=self.kernel_backend,
                known_decay=known_decay, final_state=state is not None,
            )  # fmt: skip
        if state is not None:
            state.store("key_sum", key_sum)
        return denominator
