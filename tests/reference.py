"""Explicit O(N^2) evaluation of the papers' formulas, written independently of the library's kernels.

It reads only the layer's parameters (projections, angles, Householder vectors, permutations, SPE kernels and
noise, FastRPB weights) and builds every positional transform as an explicit matrix per position:
score(s, t) = Re((M_s phi(q_s))^H (M_t phi(k_t))) * r^(p_s - p_t), then the chosen normalisation.
Runs per batch row, in float64.
"""

import math

import pytest
import torch


# ---------------------------------------------------------------- feature maps
def feature_map(layer, x, head):
    """phi(x) for one head's queries or keys (N, D), from each paper's formula."""
    o = layer.options
    fm = layer.feature_map
    if o.feature_map == "elu":
        return torch.where(x > 0, x + 1, torch.exp(x))
    if o.feature_map == "relu":
        return torch.clamp(x, min=0) + o.relu_eps
    if o.feature_map == "exp":
        return torch.exp(x)
    if o.feature_map == "dpfp":
        r = torch.cat([x.clamp(min=0), (-x).clamp(min=0)], dim=-1)
        n = r.shape[-1]
        parts = []
        for j in range(1, o.dpfp_nu + 1):
            rolled = r[..., [(i - j) % n for i in range(n)]]
            parts.append(r * rolled)
        return torch.cat(parts, dim=-1)
    if o.feature_map == "performer":
        w = fm.projection.double()
        d = x.shape[-1]
        xs = x / d**0.25
        return torch.exp(xs @ w.T - (xs**2).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])
    if o.feature_map == "hedgehog":  # [softmax(W x), softmax(-W x)]
        y = x @ fm.weight[head].double()
        return torch.cat([torch.softmax(y, -1), torch.softmax(-y, -1)], dim=-1)
    if o.feature_map == "t2r":  # relu(W x + b)
        return torch.clamp(x @ fm.weight[head].double() + fm.bias[head].double(), min=0)
    raise AssertionError(o.feature_map)


# ---------------------------------------------------------------- explicit matrices
def rotation(angles):
    """Block-diagonal 2x2 rotations for pair angles (P,) -> (2P, 2P)."""
    m = torch.zeros(2 * len(angles), 2 * len(angles), dtype=torch.float64)
    for i, a in enumerate(angles.tolist()):
        c, s = math.cos(a), math.sin(a)
        m[2 * i, 2 * i], m[2 * i, 2 * i + 1], m[2 * i + 1, 2 * i], m[2 * i + 1, 2 * i + 1] = c, -s, s, c
    return m


def pad_identity(m, size):
    out = torch.eye(size, dtype=m.dtype)
    out[: m.shape[0], : m.shape[1]] = m
    return out


def householder(v):
    v = v.double()
    return torch.eye(len(v), dtype=torch.float64) - 2 * torch.outer(v, v) / (v @ v)


def permutation_matrix(perm):
    """(P x)_i = x[pi(i)]: P[i, pi(i)] = 1."""
    n = len(perm)
    m = torch.zeros(n, n, dtype=torch.float64)
    m[torch.arange(n), torch.as_tensor(perm)] = 1.0
    return m


def permutation_of(cyclic, head):
    """Recover pi from a CyclicPermutations module: pi(i) is the next element of i's cycle."""
    members, start, length, index = (getattr(cyclic, n)[head] for n in ("members", "start", "length", "index"))
    return [int(members[start[i] + (index[i] + 1) % length[i]]) for i in range(len(members))]


def axis_split(n, dims):
    """Units driven by each axis: 1D all; 2D first ceil(n/2) by the row."""
    return [n] if dims == 1 else [(n + 1) // 2, n // 2]


def p_matrix(pe, head, m):
    p = pe.p
    name = type(p).__name__
    if name == "Identity":
        return torch.eye(m, dtype=torch.float64)
    if name == "HouseholderReflection":
        return householder(p.vector[head].detach())
    if name == "DCTMatrix":  # orthonormal DCT-II from its formula
        k = torch.arange(m, dtype=torch.float64)[:, None]
        n = torch.arange(m, dtype=torch.float64)[None, :]
        scale = torch.full((m, 1), math.sqrt(2 / m), dtype=torch.float64)
        scale[0] = math.sqrt(1 / m)
        return scale * torch.cos(math.pi * (2 * n + 1) * k / (2 * m))
    if name == "OddEvenPermutation":  # y[2k] = x[k], y[2k+1] = x[ceil(m/2) + k]
        half = m - m // 2
        perm = [i // 2 if i % 2 == 0 else half + (i - 1) // 2 for i in range(m)]
        return permutation_matrix(perm)
    raise AssertionError(name)


def rope_pair_frequencies(num_pairs, base, dims):
    out = []
    for units in axis_split(num_pairs, dims):
        out += [base ** (-2 * i / (2 * units)) for i in range(units)]
    return torch.tensor(out, dtype=torch.float64)


def position_matrix(layer, head, position, m):
    """M_s for one head at one position (a tuple of coordinates) acting on features of width m."""
    o = layer.options
    pe = layer.positional_encoding
    name, dims = o.positional_encoding, o.position_dims
    if name in ("none", "spe_sine", "spe_conv", "fastrpb"):
        return torch.eye(m, dtype=torch.complex128)
    if name in ("rope", "lrpe_orthogonal"):
        pairs = m // 2
        freqs = (
            rope_pair_frequencies(pairs, o.rope_base, dims)
            if name == "rope"
            else pe.rotation.frequencies[head].detach().double()
        )
        coords = torch.tensor(
            [position[0]] * axis_split(pairs, dims)[0] + ([position[1]] * (pairs // 2) if dims == 2 else []),
            dtype=torch.float64,
        )
        rot = pad_identity(rotation(coords * freqs), m)
        p = p_matrix(pe, head, m) if name == "lrpe_orthogonal" else torch.eye(m, dtype=torch.float64)
        return (rot @ p).to(torch.complex128)
    if name == "lrpe_unitary":
        alphas = pe.angles[head].detach().double()
        sizes = axis_split(m, dims)
        coords = torch.tensor(sum([[position[a]] * n for a, n in enumerate(sizes)], []), dtype=torch.float64)
        return torch.diag(torch.exp(1j * coords * alphas)) @ p_matrix(pe, head, m).to(torch.complex128)
    if name in ("lrpe_permutation", "permute"):
        module = pe.permutation if name == "lrpe_permutation" else pe
        blocks = []
        for a, cyclic in enumerate(module.permutations):
            perm = permutation_matrix(permutation_of(cyclic, head))
            blocks.append(torch.linalg.matrix_power(perm, int(position[a])))
        mat = torch.block_diag(*blocks)
        if name == "lrpe_permutation":
            mat = mat @ p_matrix(pe, head, m)
        return mat.to(torch.complex128)
    pytest.skip(f"{name} has no formula here; the invariance tests (tests/test_properties.py) check it")


# ---------------------------------------------------------------- SPE
def spe_codes(layer, draw, positions, head, is_query):
    """Qbar_d(p) for every position: (N, D, R), from the paper's formulas with the draw's noise."""
    codes = draw.codes
    D, R = codes.head_dim, codes.num_realizations
    N = len(positions)
    out = torch.zeros(N, D, R, dtype=torch.float64)
    if type(codes).__name__ == "SineSPECodes":
        K = codes.num_sines
        noise = draw.tensor("sine", (codes.num_heads, D, 2, K, R))[head].double()
        for n, p in enumerate(positions):
            for d in range(D):
                for k in range(K):
                    f = codes.frequencies[:, head, d, k].detach().double()
                    phase = 2 * math.pi * float((f * torch.tensor(p, dtype=torch.float64)).sum())
                    if is_query:
                        phase += float(codes.phases[head, d, k].detach())
                    lam = float(codes.amplitudes[head, d, k].detach())
                    out[n, d] += (
                        lam * (math.cos(phase) * noise[d, 0, k] + math.sin(phase) * noise[d, 1, k]) / math.sqrt(K)
                    )
    else:
        L, A = codes.kernel_size, codes.position_dims
        filt = (codes.query_filters if is_query else codes.key_filters)[head].double()
        pos = torch.tensor(positions)
        lo, hi = pos.amin(0), pos.amax(0)
        start = tuple(int(v) - L + 1 for v in lo)
        stop = tuple(int(v) + 1 for v in hi)
        grid = draw.grid(start, stop, (D, R)).double()
        for n, p in enumerate(positions):
            if A == 1:
                for j in range(L):
                    out[n] += filt[:, j, None] * grid[p[0] - j - start[0]]
            else:
                for j1 in range(L):
                    for j2 in range(L):
                        out[n] += filt[:, j1, j2, None] * grid[p[0] - j1 - start[0], p[1] - j2 - start[1]]
    pe = layer.positional_encoding
    if pe.gate_logits is not None:
        delta = torch.sigmoid(pe.gate_logits[head].detach().double())
        eps = draw.tensor("gate", (codes.num_heads, D, R))[head].double()
        out = (1 - delta).sqrt()[None, :, None] * out + (delta.sqrt()[:, None] * eps)[None]
    return out


# ---------------------------------------------------------------- attention
def reference_attention(layer, x, mask=None, positions=None, shared_draw=None):
    """x (B, N, hidden); mask (B, N) bool; positions (B, N, A) int. Returns (B, N, hidden) float64."""
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

    q, k, v = (proj(lin, x).view(B, N, H, D) for lin in (layer.q_proj, layer.k_proj, layer.v_proj))
    out = torch.zeros(B, N, H, D, dtype=torch.float64)
    value_bias = torch.zeros(B, N, H, D, dtype=torch.float64)
    pe = layer.positional_encoding
    decays = getattr(pe, "decays", None)
    for b in range(B):
        pos = [tuple(int(c) for c in p) for p in positions[b]]
        for h in range(H):
            qh, kh, vh = q[b, :, h], k[b, :, h], v[b, :, h]
            if o.positional_encoding in ("spe_sine", "spe_conv"):
                D_, R = D, o.spe_realizations
                qc, kc = spe_codes(layer, shared_draw, pos, h, True), spe_codes(layer, shared_draw, pos, h, False)
                qh = torch.einsum("nd,ndr->nr", qh, qc) / (D_ * R) ** 0.25
                kh = torch.einsum("nd,ndr->nr", kh, kc) / (D_ * R) ** 0.25
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
            r = float(decays[h]) if decays is not None and o.causal else 1.0
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
            if o.positional_encoding == "fastrpb":
                for s in range(N):
                    for t in range(N):
                        if not mask[b, t]:
                            continue
                        bias = 0.0
                        for a in range(o.position_dims):
                            lag_a = pos[s][a] - pos[t][a]
                            if o.causal and lag_a < 0:
                                continue
                            bias += float(pe.weights[a, h, o.max_positions - 1 + lag_a].detach())
                        value_bias[b, s, h] += bias * vh[t]
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
