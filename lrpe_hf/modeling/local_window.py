"""Exact softmax nearby, linear beyond: the ``local_window`` of linear attention (LoLCATs, Zhang et al. 2024; Based,
Arora et al. 2024; RATTENTION, Wang et al. 2025), for every encoding.

Per head h, with W = ``local_window``, the window W(s) of query s holds the tokens t of s's document with
0 <= s - t < W (causal: the W latest up to s itself) or |s - t| < W (bidirectional), counted in the row's tokens
(slots): padding takes slots without being attended, so wherever padding lies at the ends of a row (left or right,
as tokenizers pad) and positions count up by one (the defaults, packed documents), the window is the W nearest
real tokens and the W nearest positions. Never across a document boundary. Then

    out_s = (sum_{t in W(s)} exp(a_st) v_t + g_h sum_{t outside W(s)} l(s, t) v_t)
            / (sum_{t in W(s)} exp(a_st)     + g_h sum_{t outside W(s)} n(s, t)),

- a_st: the encoding's softmax form, as ``attention="softmax"`` computes it: (E_s q_s) . (E_t k_t) / sqrt(D') with
  the encoding's ``encode_features`` applied to q and k (rotations for rope and lrpe_*, permutations for permute,
  SPE's codes before it, identity otherwise), plus PermuteFormer's log_decay (p_s - p_t); FastRPB's bias over the
  values is added by the layer after the attention, as in both other paths;
- l(s, t) = w(s, t) <A_s phi(q_s), B_t phi(k_t)>, the linear path's weight (``kernel_attention.py``, with its decay);
  n(s, t) = l(s, t) with ``normalization="denominator"``, w(s, t) <phi(q_s), phi(k_t)> with
  ``"unrotated_denominator"``; the output norms have no denominator to share and are refused (``attention_options``);
- g_h = exp(``log_linear_weight[h]``), learned, initially 1.

The linear weights stand on the scale of exp(a_st) itself, not on the window's maximum (LoLCATs' code divides only
the softmax part by exp(max a), so its mix between the parts moves with the window's largest score): a linear
kernel stands in for exp(q . k / sqrt(D)) (FAVOR+ estimates it without bias), so with g_h = 1 the linear part is an
estimate of the softmax weights outside the window and the two parts share one scale. It is computed stably: both
sums are multiplied by exp(-c_s), c_s = max(m_s, log g_h + L_s), m_s the window's largest a_st and L_s the log of
the factor an exponential map's stabiliser divided the linear sums by (0 without one). No eps: a real query's
window holds itself, so its denominator is at least exp(m_s - c_s) > 0. W at least the sequence leaves no token
outside: exactly ``attention="softmax"`` with the same encoding. W = 0 is off: no module, no parameter (checkpoints
saved without a window load unchanged).

Cost, linear in N at a fixed W: the softmax part in blocks of min(W, N) queries against the keys their windows
reach (O(N W D) time, O(N W) memory for the weights autograd keeps); the linear part is the causal product
(any backend: torch's chunked products, fla's kernels) of the queries with the keys and values delayed by W tokens
(key t enters at query t + W, its decay over those W tokens folded into it, zeroed where t + W lies in another
document), so it sums exactly the tokens older than the window, with no subtraction that could cancel;
bidirectional, the same again over the tokens reversed (t > s + W - 1).

Decoding keeps the last W tokens (their softmax-form keys, values, encoded features, positions, documents, padding
and the decay since each entered) in fixed-size tensors beside the linear state of every older token: a step moves
the oldest into the state and costs the same at any context length. Context parallelism is refused (a rank would
need its neighbour's last W tokens).
"""

import math
from dataclasses import dataclass

import torch

from .attention_kernels import causal_linear_attention
from .attention_state import TensorState
from .context_parallel import active_group
from .positional_encoding import PositionalEncoding
from .registry import build_positional_encoding
from .reinitialisable import Reinitialisable


@dataclass
class WindowState(TensorState):
    """The last W tokens of a causal layer, oldest first: ``keys`` (B, H, W, D') in the encoding's softmax form,
    ``values`` (B, H, W, d), ``features`` (B, H, W, m) encoded and ``plain`` (unencoded, for the unrotated
    denominator, else None), ``decay`` (B, H, W) the log gates since each token (None without gates), ``mask``
    (B, W) bool (False: padding or an empty slot), ``positions`` and ``documents`` (B, W)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    features: torch.Tensor | None = None
    plain: torch.Tensor | None = None
    decay: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    documents: torch.Tensor | None = None


class Tokens(dict):
    """A call's tokens as the window reads them, each field along its tokens axis (``WindowState``'s fields; those
    given as None left out)."""

    AXES = {"keys": 2, "values": 2, "features": 2, "plain": 2, "mask": 1, "positions": 1, "documents": 1}

    @classmethod
    def of(cls, **fields) -> "Tokens":
        return cls({name: t for name, t in fields.items() if t is not None})

    def joined(self, earlier: "Tokens") -> "Tokens":
        return Tokens({n: torch.cat([earlier[n], t], self.AXES[n]) for n, t in self.items() if t is not None})

    def last(self, count: int) -> "Tokens":
        return Tokens({n: t.narrow(self.AXES[n], t.shape[self.AXES[n]] - count, count) for n, t in self.items()})

    def empty(self, count: int) -> "Tokens":
        """``count`` empty slots (masked, in no document) shaped as these tokens."""
        slots = {}
        for name, t in self.items():
            shape = list(t.shape)
            shape[self.AXES[name]] = count
            slots[name] = t.new_full(shape, -1) if name == "documents" else t.new_zeros(shape)
        return Tokens(slots)


class LocalWindow(Reinitialisable):
    """The windowed form of ``KernelAttention`` (``local_window`` > 0): see the module docstring."""

    def __init__(self, options, head_dim: int, query_key_dim: int, feature_dim: int):
        super().__init__()
        self.size, self.causal, self.num_heads = options.local_window, options.causal, options.num_heads
        self.scale = 1.0 / math.sqrt(query_key_dim)
        self.register_initial_values(trainable={"log_linear_weight": True})
        # the softmax form acts on q and k (width D'); where the feature map changes the width and the encoding acts
        # on features, it needs its own encoding at the queries' width (as attention="softmax" builds it)
        self.encoding = None
        if feature_dim != query_key_dim:
            encoding = build_positional_encoding(options, options.num_heads, head_dim, query_key_dim)
            if type(encoding).encode_features is not PositionalEncoding.encode_features:
                self.encoding = encoding

    def initial_values(self):
        return {"log_linear_weight": torch.zeros(self.num_heads)}

    def forward(self, path, q, k, v, inputs):
        """``path``: the ``KernelAttention`` whose features, gates and products the linear part takes; q, k
        (B, H, N, D'), v (B, H, N, d), ``inputs`` its ``AttentionInputs`` -> out (B, H, N, d)."""
        if active_group() is not None:
            raise ValueError(
                "Context parallelism does not take local_window: a rank's first tokens would need the last "
                "local_window tokens of the rank before it; use local_window=0 or run without context parallelism"
            )
        state, starts, mask, positions = inputs.state, inputs.starts, inputs.mask, inputs.positions
        B, H, N = q.shape[:3]
        softmax_encoding = self.encoding if self.encoding is not None else inputs.encoding
        sq, sk = softmax_encoding.encode_features(q, k, positions)
        local_documents = None if starts is None else starts.long().cumsum(-1)
        features, tq, tk = path.encoded_features(q, k, inputs, local_documents, False)
        gates, known_decay = path.gates(features, inputs, q.dtype)
        unrotated = path.normalization == "unrotated_denominator"
        documents = inputs.documents if inputs.documents is not None else local_documents
        tokens = Tokens.of(
            keys=sk,
            values=v,
            features=tk,
            plain=features.key if unrotated else None,
            mask=mask if mask is not None else torch.ones(B, N, dtype=torch.bool, device=q.device),
            positions=positions[..., 0],
            documents=documents if documents is not None else positions.new_zeros(B, N),
        )
        slots = self.size if state is not None else min(self.size, N)
        window = state.window if state is not None else None
        earlier = tokens.empty(slots) if window is None else Tokens({n: getattr(window, n) for n in tokens})
        joined = tokens.joined(earlier)
        past_decay = None
        if gates is not None:
            past_decay = window.decay if window is not None else gates.new_zeros(B, H, slots)
        window_sums = self.softmax_part(sq, joined, slots, inputs.encoding.log_decay)
        out, denominator = self.linear_part(path, tq, features.query, joined, gates, known_decay, past_decay,
                                            starts, state, slots, unrotated)  # fmt: skip
        if state is not None:
            self.keep(state, joined.last(slots), gates, past_decay, features.key_max)
        log_weight = self.log_linear_weight.to(torch.float32)[None, :, None, None]
        if features.log_scale is not None:
            log_weight = log_weight + features.log_scale
        return self.combined(window_sums, out, denominator, log_weight, v.dtype)

    def softmax_part(self, sq, joined, slots: int, log_decay):
        """The window's sums relative to its row maximum: (numerator (B, H, N, d), denominator (B, H, N, 1), m_s
        (B, H, N, 1), -inf for a query with no key) of sum_t exp(a_st - m_s) [v_t, 1]; ``joined``: the ``slots``
        earlier slots then this call's tokens (the queries')."""
        B, H, N, D = sq.shape
        ahead = 0 if self.causal else slots - 1
        block = max(1, min(slots, N))
        blocks = -(-N // block)
        span = block + slots - 1 + ahead  # the keys a block of queries reaches: joined slots a*block + 1 onwards
        reach = (blocks - 1) * block + 1 + span
        keys = padded(joined["keys"], 2, reach)[:, :, 1:].unfold(2, span, block)  # (B, H, blocks, D, span)
        values = padded(joined["values"], 2, reach)[:, :, 1:].unfold(2, span, block).transpose(-1, -2)
        queries = padded(sq, 2, blocks * block).view(B, H, blocks, block, D)
        dtype = torch.promote_types(sq.dtype, torch.float32)
        scores = (queries @ keys).to(dtype) * self.scale  # (B, H, blocks, block, span)
        names = ("mask", "positions", "documents")
        meta = {n: padded(joined[n], 1, reach)[:, 1:].unfold(1, span, block) for n in names}
        own = {n: padded(joined[n][:, slots:], 1, blocks * block).view(B, blocks, block) for n in meta}
        row, column = torch.arange(block, device=sq.device)[:, None], torch.arange(span, device=sq.device)
        band = (column >= row) & (column <= row + slots - 1 + ahead)  # query r of a block sits at slot r + slots
        allowed = band & meta["mask"][:, :, None, :] & (own["documents"][..., None] == meta["documents"][:, :, None])
        if log_decay is not None:
            distance = (own["positions"][..., None] - meta["positions"][:, :, None]).clamp_min(0)
            scores = scores + log_decay.to(dtype)[None, :, None, None, None] * distance[:, None].to(dtype)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        peak = scores.amax(-1, keepdim=True).detach()
        weights = torch.exp(scores - peak.masked_fill(peak.isinf(), 0.0))
        numerator = (weights.to(values.dtype) @ values).reshape(B, H, blocks * block, -1)[:, :, :N]
        denominator = weights.sum(-1, keepdim=True).reshape(B, H, blocks * block, 1)[:, :, :N]
        return (numerator, denominator, peak.reshape(B, H, blocks * block, 1)[:, :, :N])

    def linear_part(self, path, tq, fq, joined, gates, known_decay, past_decay, starts, state, slots, unrotated):
        """The linear sums over the tokens outside the windows: (numerator (B, H, N, d), denominator (B, H, N, 1)),
        each divided by exp(L_s) where a stabiliser scales the features; the causal states stored in ``state``."""
        N = tq.shape[2]
        with_denominator = not unrotated
        previous = state.kv if state is not None else None
        keys, values = self.delayed(joined, "features", gates, past_decay, slots, N)
        out, denominator, kv = causal_linear_attention(
            tq, keys, values, gates, previous, path.chunk_size, starts, with_denominator, None, path.kernel_backend,
            known_decay=known_decay, final_state=state is not None,
        )  # fmt: skip
        if state is not None:
            state.store("kv", kv)
        if unrotated:
            plain, _ = self.delayed(joined, "plain", gates, past_decay, slots, N)
            previous = state.key_sum if state is not None else None
            denominator, _, key_sum = causal_linear_attention(
                fq, plain, torch.ones_like(plain[..., :1]), gates, previous, path.chunk_size, starts,
                backend=path.kernel_backend, known_decay=known_decay, final_state=state is not None,
            )  # fmt: skip
            if state is not None:
                state.store("key_sum", key_sum)
        if not self.causal:  # the tokens after the window: the same over the tokens reversed
            later, later_denominator = self.reversed_linear_part(path, tq, fq, joined, starts, slots, unrotated)
            out, denominator = out + later, denominator + later_denominator
        return out, denominator

    def reversed_linear_part(self, path, tq, fq, joined, starts, slots, unrotated):
        """``linear_part`` for the tokens t > s + W - 1 (bidirectional): the causal product over the reversed
        tokens, documents reset at each document's last token."""
        N = tq.shape[2]
        flipped = Tokens({n: t.narrow(Tokens.AXES[n], slots, N).flip(Tokens.AXES[n]) for n, t in joined.items()})
        flipped = flipped.joined(flipped.empty(slots))
        resets = None
        if starts is not None:
            ends = torch.cat([starts[:, 1:], torch.ones_like(starts[:, :1])], dim=1)
            resets = ends.flip(1)
        keys, values = self.delayed(flipped, "features", None, None, slots, N)
        out, denominator, _ = causal_linear_attention(
            tq.flip(2), keys, values, None, None, path.chunk_size, resets, not unrotated, None, path.kernel_backend,
            final_state=False,
        )  # fmt: skip
        if unrotated:
            plain, _ = self.delayed(flipped, "plain", None, None, slots, N)
            ones = torch.ones_like(plain[..., :1])
            denominator = causal_linear_attention(
                fq.flip(2), plain, ones, None, None, path.chunk_size, resets, backend=path.kernel_backend,
                final_state=False,
            )[0]  # fmt: skip
        return out.flip(2), denominator.flip(2)

    @staticmethod
    def delayed(joined, name, gates, past_decay, slots: int, N: int):
        """The keys (``joined[name]``) and values entering the causal product at this call's tokens: the token
        ``slots`` before each (slot i of ``joined``), times its decay over those tokens, exp(G_i - G_t) <= 1, and
        zero where it is padding or of another document than the query it enters at."""
        keys, values = joined[name].narrow(2, 0, N), joined["values"].narrow(2, 0, N)
        keep = joined["mask"][:, :N] & (joined["documents"][:, :N] == joined["documents"][:, slots:])
        factor = keep[:, None].to(keys.dtype)
        if gates is not None:
            running = gates.double().cumsum(-1)  # G_i, from just before this call
            entered = torch.cat([-past_decay.double(), running], dim=-1)[..., :N]  # G_t of the token entering at i
            factor = factor * torch.exp(running - entered).to(keys.dtype)
        return keys * factor[..., None], values

    def keep(self, state, last, gates, past_decay, key_max):
        """Store the last ``slots`` tokens (``last``) and the decay since each entered in ``state.window``."""
        window = state.window if state.window is not None else WindowState()
        for name, tensor in last.items():
            window.store(name, tensor)
        if gates is not None:
            running = gates.double().cumsum(-1)
            entered = torch.cat([-past_decay.double(), running], dim=-1)
            since = running[..., -1:] - entered[..., entered.shape[-1] - past_decay.shape[-1] :]
            window.store("decay", since.to(past_decay.dtype))
        state.window = window
        state.store("key_max", key_max)

    @staticmethod
    def combined(window_sums, out, denominator, log_weight, dtype):
        """The two parts under one normaliser (module docstring): the window's sums relative to its maximum m_s
        (``softmax_part``'s), the linear sums each scaled by exp(log_weight) = g_h exp(L_s). m_s and c_s only scale
        numerator and denominator alike: no gradient flows through them."""
        window_numerator, window_denominator, peak = window_sums
        common = torch.maximum(peak, log_weight).detach()  # c_s; finite: log_weight is
        to_window, to_linear = torch.exp(peak - common), torch.exp(log_weight - common)
        numerator = window_numerator * to_window.to(window_numerator.dtype) + out * to_linear.to(out.dtype)
        total = window_denominator * to_window + denominator.to(to_linear.dtype) * to_linear
        total = total.masked_fill(total == 0, 1.0)  # a padded query with nothing to attend to: its output is 0
        return (numerator / total.to(numerator.dtype)).to(dtype)


def padded(x, dim: int, length: int):
    """``x`` with empty slots appended along ``dim`` up to ``length`` (no copy where it is that long)."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim)
