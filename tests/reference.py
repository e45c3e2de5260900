"""Explicit O(N^2) evaluation of the papers' formulas, written independently of the library's kernels.

Each registered feature map and encoding carries its own formula (``FeatureMap.reference``, the encodings'
``reference_transform``, ``reference_decay``, ``reference_query_key``, ``reference_value_bias``: from the
parameters, explicit, in float64), so a component registered later is held to its own formula here with no change
to this file. The attention is built from them with every positional transform an explicit matrix per position:
score(s, t) = Re((M_s phi(q_s))^H (M_t phi(k_t))) * r^(p_s - p_t), then the chosen normalisation. Runs per batch
row, in float64.
"""

import math

import pytest
import torch


# ---------------------------------------------------------------- the components' own formulas
# Each registered feature map and encoding carries its reference (``FeatureMap.reference``, the encodings'
# ``reference_*``): written apart from its kernels, explicit and in float64. These read them for a layer.
def feature_map(layer, x, head):
    """phi(x) for one head's queries or keys (N, D), by the map's own formula."""
    return layer.feature_map.reference(x, head)


def position_matrix(layer, head, position, m):
    """M_s for one head at one position (a tuple of coordinates) acting on features of width m."""
    return layer.positional_encoding.reference_transform(head, position, m)


def spe_codes(layer, draw, positions, head, is_query):
    """SPE's gated codes Qbar_d(p) (N, D, R) for every position, by the encoding's own formula."""
    return layer.positional_encoding.reference_codes(positions, head, draw, is_query)


# ---------------------------------------------------------------- attention
def reference_attention(layer, x, mask=None, positions=None, shared_draw=None):
    """x (B, N, hidden); mask (B, N) bool; positions (B, N, A) int. Returns (B, N, hidden) float64. Skips the test
    where a component gives no formula (it overrides a hook without its reference): the invariance tests check it."""
    try:
        return attention_by_formulas(layer, x, mask, positions, shared_draw)
    except NotImplementedError as missing:
        pytest.skip(str(missing))


def attention_by_formulas(layer, x, mask=None, positions=None, shared_draw=None):
    """``reference_attention`` itself."""
    o = layer.options
    B, N, _ = x.shape
    H, D = layer.num_heads, layer.head_dim
    x = x.double()
    if mask is None:
        mask = torch.ones(B, N, dtype=torch.bool)
    if positions is None:
        positions = ((mask.long().cumsum(-1) - 1).clamp(min=0))[..., None]

    def proj(linear, t):
        return t @ linear.weight.double().T + linear.bias.double()

    q, k, v = proj(layer.qkv_proj, x).view(B, N, 3, H, D).unbind(2)  # qkv_proj's rows: q's, k's, v's
    out = torch.zeros(B, N, H, D, dtype=torch.float64)
    value_bias = torch.zeros(B, N, H, D, dtype=torch.float64)
    pe = layer.positional_encoding
    for b in range(B):
        pos = [tuple(int(c) for c in p) for p in positions[b]]
        for h in range(H):
            qh, kh, vh = q[b, :, h], k[b, :, h], v[b, :, h]
            qh = pe.reference_query_key(qh, pos, h, shared_draw, True)
            kh = pe.reference_query_key(kh, pos, h, shared_draw, False)
            if o.attention == "linear":
                fq, fk = feature_map(layer, qh, h), feature_map(layer, kh, h)
            else:
                fq, fk = qh, kh
            m = fq.shape[-1]
            mats = [position_matrix(layer, h, p, m) for p in pos]
            tq = torch.stack([mats[s] @ fq[s].to(torch.complex128) for s in range(N)])
            tk = torch.stack([mats[t] @ fk[t].to(torch.complex128) for t in range(N)])
            scores = (tq.conj() @ tk.T).real  # (N, N)
            allowed = mask[b][None, :].expand(N, N).clone()
            if o.causal:
                allowed &= torch.ones(N, N, dtype=torch.bool).tril()
            lag = torch.tensor([[pos[s][0] - pos[t][0] for t in range(N)] for s in range(N)], dtype=torch.float64)
            r = pe.reference_decay(h) if o.causal else 1.0
            if o.attention == "softmax":
                width = qh.shape[-1]  # the width of the queries the encoding transforms (R after SPE)
                logits = scores / math.sqrt(width) + math.log(r) * lag.clamp(min=0)
                logits = logits.masked_fill(~allowed, float("-inf"))
                if not allowed.any(-1).all():
                    logits = torch.where(allowed.any(-1, keepdim=True), logits, torch.zeros_like(logits))
                oh = torch.softmax(logits, dim=-1) @ vh
            else:
                weights = torch.where(allowed, scores * r**lag, torch.zeros_like(scores))
                oh = weights @ vh
                if o.normalization == "denominator":
                    oh = oh / (weights.sum(-1, keepdim=True) + o.eps)
                elif o.normalization == "unrotated_denominator":
                    plain = torch.where(allowed, fq @ fk.T, torch.zeros_like(scores))
                    oh = oh / (plain.sum(-1, keepdim=True) + o.eps)
                elif o.normalization == "output_norm":
                    weight = layer.output_norm.weight.double()
                    oh = oh / torch.sqrt((oh**2).mean(-1, keepdim=True) + layer.output_norm.eps) * weight
                # output_layer_norm: normalised over all heads below
            bias = pe.reference_value_bias(vh, pos, mask[b], h, o.causal)
            if bias is not None:
                value_bias[b, :, h] = bias
            out[b, :, h] = oh
        if o.attention == "linear" and o.normalization == "output_layer_norm":  # one LayerNorm over every head
            norm = layer.output_norm
            merged = out[b].reshape(N, H * D)
            centred = merged - merged.mean(-1, keepdim=True)
            merged = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps)
            out[b] = (merged * norm.weight.double() + norm.bias.double()).view(N, H, D)
    out = out + value_bias  # FastRPB's W V, added after the attention's normalisation
    out = out * mask[:, :, None, None]
    return proj(layer.o_proj, out.reshape(B, N, H * D))
