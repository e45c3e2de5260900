"""The causal product with per-token log gates (the exp and performer maps' running-maximum rescaling, decays that are
not one constant per head, packed documents), in chunks, and its one-token recurrent step.

out_s = sum_{t<=s} exp(G_s - G_t) (q_s . k_t) v_t + exp(G_s) q_s S_0, G the running sum of the gates from the
call's start. Gates are only ever exponentiated as differences inside a chunk, so nothing overflows however long
the sequence.

Shapes: B batch, H heads, N tokens, m feature dim, dv value dim.
"""

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from .products_shared import head_blocks


def recurrent_step(q, k, v, log_gates, initial_state, resets, in_place=False, ones_column=False):
    """One decoding step, in its recurrent form: S = exp(g) S_0 + k^T v (no S_0 after a reset), out = q S.
    q, k (B, H, 1, m); v (B, H, 1, dv); log_gates (B, H, 1) or None; initial_state (B, H, m, dv) or None.
    ``ones_column``: v stands for [v, 1] (the denominator's column; initial_state is then (B, H, m, dv + 1)).
    ``in_place``: S is written over S_0 (the caller's stored state, which it would overwrite with S anyway), where
    dtypes agree: one fused multiply-add (baddbmm) instead of a product, a sum and the caller's copy (and the
    ones column's part is the key added, not a column appended to v). A wider state (fla's prompt leaves float32
    beside half-precision features) is updated in its own precision; out is in the inputs' dtype."""
    dtype = torch.promote_types(k.dtype, v.dtype)
    out_dtype = dtype
    if initial_state is not None and initial_state.dtype != dtype:
        dtype = torch.promote_types(dtype, initial_state.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kT = k.transpose(-1, -2)
    if in_place and initial_state is not None and initial_state.dtype == dtype and initial_state.is_contiguous():
        state = initial_state
        if log_gates is not None:
            keep = log_gates.exp() if resets is None else log_gates.exp().masked_fill(resets[:, None], 0.0)
            state.mul_(keep[..., None].to(dtype))
        rows = state.flatten(0, 1)
        if ones_column:
            rows[..., :-1].baddbmm_(kT.flatten(0, 1), v.flatten(0, 1))
            rows[..., -1:].add_(kT.flatten(0, 1))
        else:
            rows.baddbmm_(kT.flatten(0, 1), v.flatten(0, 1))
        out = q @ state
        return (out if out_dtype == dtype else out.to(out_dtype)), state
    if ones_column:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    state = kT @ v
    if initial_state is not None:
        previous = initial_state.to(state.dtype)
        if log_gates is not None:
            keep = log_gates.exp() if resets is None else log_gates.exp().masked_fill(resets[:, None], 0.0)
            previous = previous * keep[..., None].to(state.dtype)
        state = state + previous
    out = q @ state
    return (out if out_dtype == dtype else out.to(out_dtype)), state


def gated_chunks(q, k, v, log_gates, initial_state, C, resets, dtype):
    """The gated causal product in chunks of C (N a multiple of C): arguments as ``causal_linear_attention``.
    Returns out (B, H, N, dv) and the final state (B, H, m, dv)."""
    B, H, N, m = q.shape
    dv, num_chunks = v.shape[-1], N // C
    device = q.device.type
    # one layout copy each (heads-first, contiguous), where every batched product below would make its own
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    q = q.view(B, H, num_chunks, C, m)
    k = k.view(B, H, num_chunks, C, m)
    v = v.view(B, H, num_chunks, C, dv)
    causal_mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()

    # Gated: G relative to each chunk's start. Documents: a segment index inside each chunk (0 until its first
    # reset); a query sees keys of its own segment, and the state from before the chunk only in segment 0.
    G = log_gates.to(torch.promote_types(q.dtype, torch.float32))
    visible = causal_mask
    from_before = to_after = None
    if resets is not None:
        segment = resets.view(B, 1, num_chunks, C).long().cumsum(-1)  # (B, 1, nc, C)
        G = G.masked_fill(resets[:, None], 0.0)  # a reset token's gate never applies: the past is dropped
        visible = causal_mask & (segment[..., :, None] == segment[..., None, :])
        from_before = segment == 0  # (B, 1, nc, C)
        to_after = segment == segment[..., -1:]
    G = G.view(B, H, num_chunks, C).cumsum(-1)
    with torch.autocast(device, enabled=False):  # the function computes in one dtype, forward and backward
        intra = GatedIntraChunkProduct.apply(q, k, v, G, visible)
    to_chunk_end = G[..., -1:] - G
    query_decay = G
    chunk_decay = G[..., -1]
    if resets is not None:
        to_chunk_end = to_chunk_end.masked_fill(~to_after, float("-inf"))
        query_decay = query_decay.masked_fill(~from_before, float("-inf"))
        chunk_decay = chunk_decay.masked_fill(~from_before[..., -1], float("-inf"))
    state = initial_state.to(v.dtype) if initial_state is not None else v.new_zeros(B, H, m, dv)
    with torch.autocast(device, enabled=False):
        inter, state = GatedChunkStates.apply(q, k, v, to_chunk_end, query_decay, chunk_decay, state)
    return intra.add_(inter).view(B, H, N, dv), state  # intra: a fresh tensor


class GatedIntraChunkProduct(torch.autograd.Function):
    """Inside each chunk: out_i = sum_j exp(G_i - G_j) (q_i . k_j) v_j over the visible pairs (i, j), a block
    of heads at a time (``heads_per_block``). Saves only its inputs: backward recomputes the C x C scores and
    decays. The gradient of G follows from the exponent G_i - G_j: row sums minus column sums of
    dL/d(exponent).

    q, k (B, H, nc, C, m); v (B, H, nc, C, dv) contiguous; G (B, H, nc, C), the log gates summed from the
    chunk's start; visible (C, C) or (B, 1, nc, C, C) bool. Returns (B, H, nc, C, dv).
    """

    @staticmethod
    def forward(ctx, q, k, v, G, visible):
        ctx.save_for_backward(q, k, v, G, visible)
        out = v.new_empty(v.shape)
        for qb, kb, vb, Gb, visible_b, out_b in GatedIntraChunkProduct.blocks(q, k, v, G, visible, out):
            scores, decay = GatedIntraChunkProduct.scores_and_decay(qb, kb, Gb, visible_b)
            torch.matmul(scores.mul_(decay.to(scores.dtype)), vb, out=out_b)
        return out

    @staticmethod
    def blocks(q, k, v, G, visible, *more):
        """For each block of heads: the (B * H)-flattened slices of q, k, v, G, the matching visibility, and of
        every tensor in ``more`` (shaped like q, v or G)."""
        B, H, nc, C, _ = q.shape
        flat = [x.view(B * H, *x.shape[2:]) for x in (q, k, v, G, *more)]
        for heads in head_blocks(B * H, nc, C):
            rows = [x[heads] for x in flat]
            if visible.dim() == 2:
                visible_b = visible
            else:  # per batch row: the batch index of each flattened head
                batch = torch.arange(B * H, device=q.device)[heads] // H
                visible_b = visible[:, 0].index_select(0, batch)
            yield *rows[:4], visible_b, *rows[4:]

    @staticmethod
    def scores_and_decay(q, k, G, visible):
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~visible, float("-inf")).exp_()
        return q @ k.transpose(-1, -2), decay

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, G, visible = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_q, grad_k, grad_v, grad_G = (torch.empty_like(x) for x in (q, k, v, G))
        blocks = GatedIntraChunkProduct.blocks(q, k, v, G, visible, grad_out, grad_q, grad_k, grad_v, grad_G)
        for qb, kb, vb, Gb, visible_b, gob, gqb, gkb, gvb, gGb in blocks:
            scores, decay = GatedIntraChunkProduct.scores_and_decay(qb, kb, Gb, visible_b)
            decay = decay.to(scores.dtype)
            grad_weights = gob @ vb.transpose(-1, -2)  # dL/d(scores * decay)
            torch.matmul((scores * decay).transpose(-1, -2), gob, out=gvb)
            grad_scores = grad_weights.mul_(decay)
            torch.matmul(grad_scores, kb, out=gqb)
            torch.matmul(grad_scores.transpose(-1, -2), qb, out=gkb)
            grad_exponent = (grad_scores * scores).to(G.dtype)  # d exp(x) / dx = exp(x): decay folded in above
            torch.sub(grad_exponent.sum(-1), grad_exponent.sum(-2), out=gGb)
        return grad_q, grad_k, grad_v, grad_G, None


class GatedChunkStates(torch.autograd.Function):
    """What reaches each chunk from before it: out_{c,i} = exp(b_{c,i}) q_{c,i} S_c, where
    S_{c+1} = exp(L_c) S_c + sum_j exp(a_{c,j}) k_{c,j} v_{c,j}^T and S_0 = initial. Saves only its inputs:
    backward recomputes the states, and runs the same recurrence backwards for their gradients
    (g_c = q-side terms of chunk c + exp(L_c) g_{c+1}, from the final state's gradient).

    q, k (B, H, nc, C, m); v (B, H, nc, C, dv); a, b (B, H, nc, C) and L (B, H, nc) log decays (-inf: nothing
    passes); initial (B, H, m, dv). Returns out (B, H, nc, C, dv) and the final state (B, H, m, dv).
    """

    @staticmethod
    def forward(ctx, q, k, v, a, b, L, initial):
        out = v.new_empty(*q.shape[:-1], v.shape[-1])
        final = torch.empty_like(initial)
        for heads in GatedChunkStates.head_slices(q):
            qb, kb, vb, ab, bb, Lb = (x[:, heads] for x in (q, k, v, a, b, L))
            previous, final[:, heads] = GatedChunkStates.states(kb, vb, ab, Lb, initial[:, heads])
            out[:, heads] = (qb * bb.exp().to(q.dtype)[..., None]) @ previous
        ctx.save_for_backward(q, k, v, a, b, L, initial)
        return out, final

    @staticmethod
    def head_slices(q):
        """Blocks of heads whose per-chunk states stay near ``BLOCK_ELEMENTS`` (as the chunked products' scores):
        at 32k tokens a whole-input state tensor is 68 MB, past glibc's largest reused block, so every one of them
        would be freshly mapped and page-faulted."""
        B, H, nc, C, _ = q.shape
        return head_blocks(H, B * nc, C)

    @staticmethod
    def states(k, v, a, L, initial):
        """The state before each chunk (B, h, nc, m, dv) and the final state."""
        chunk_kv = (k * a.exp().to(k.dtype)[..., None]).transpose(-1, -2) @ v
        return states_before_chunks(L, chunk_kv, initial)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_final):
        q, k, v, a, b, L, initial = ctx.saved_tensors
        grads = [torch.empty_like(x) for x in (q, k, v, a, b, L, initial)]
        final_grad = grad_final if grad_final is not None else torch.zeros_like(initial)
        for heads in GatedChunkStates.head_slices(q):
            qb, kb, vb, ab, bb, Lb, go = (x[:, heads] for x in (q, k, v, a, b, L, grad_out))
            block_grads = GatedChunkStates.block_backward(
                qb, kb, vb, ab, bb, Lb, initial[:, heads], go, final_grad[:, heads]
            )
            for grad, block_grad in zip(grads, block_grads):
                grad[:, heads] = block_grad
        return tuple(grads)

    @staticmethod
    def block_backward(q, k, v, a, b, L, initial, grad_out, grad_final):
        """The gradients of q, k, v, a, b, L and initial for one block of heads."""
        previous, _ = GatedChunkStates.states(k, v, a, L, initial)
        query_weight = b.exp().to(q.dtype)[..., None]
        grad_q = (grad_out @ previous.transpose(-1, -2)) * query_weight
        grad_b = (grad_q * q).sum(-1).to(b.dtype)
        # g_c, the gradient of S_c: the same recurrence run from the last chunk back to the first
        from_queries = (q * query_weight).transpose(-1, -2) @ grad_out  # (B, h, nc, m, dv)
        after, grad_initial = states_before_chunks(L.flip(-1), from_queries.flip(2), grad_final)
        grad_chunk_kv = after.flip(2)  # g_{c+1}: what the chunk's own keys and values reach
        grad_L = (grad_chunk_kv * previous).sum((-1, -2)).to(L.dtype) * L.exp()
        key_weight = a.exp().to(k.dtype)[..., None]
        grad_k = (v @ grad_chunk_kv.transpose(-1, -2)) * key_weight
        grad_v = (k * key_weight) @ grad_chunk_kv
        grad_a = (grad_k * k).sum(-1).to(a.dtype)
        return grad_q, grad_k, grad_v, grad_a, grad_b, grad_L, grad_initial


def states_before_chunks(log_decay, chunk_kv, initial, group_size: int = 16):
    """The recurrence S_{c+1} = exp(L_c) S_c + kv_c from S_0 = initial, in groups of chunks: inside a group, one
    batched product with the decay matrix W[i, j] = exp(L_{j+1} + ... + L_{i-1}) (j < i); across groups, a loop
    (N / (C * group_size) steps: a per-chunk loop costs a kernel launch per chunk on a GPU).

    log_decay (B, H, nc) <= 0, -inf where a chunk drops the past; chunk_kv (B, H, nc, m, dv); initial (B, H, m, dv).
    Returns the state before each chunk (B, H, nc, m, dv) and the final state (B, H, m, dv). The decays are only
    summed, never subtracted, so -inf (a reset) and long sequences stay exact.
    """
    B, H, nc, m, dv = chunk_kv.shape
    K = min(group_size, nc)
    pad = (-nc) % K
    if pad:  # padded chunks carry nothing and keep the state (decay exp(0) = 1)
        log_decay, chunk_kv = F.pad(log_decay, (0, pad)), F.pad(chunk_kv, (0, 0, 0, 0, 0, pad))
    groups = (nc + pad) // K
    L = log_decay.view(B, H, groups, K)
    # sum_{j < l < i} L_l for rows i = 0..K (row K: the end of the group) and columns j = 0..K-1
    later = torch.arange(K, device=L.device)[:, None] > torch.arange(K, device=L.device)[None, :]  # l > j
    partial = L[..., :, None].masked_fill(~later, 0.0).cumsum(-2)  # (…, l, j): sum_{j < l' <= l} L_l'
    spans = torch.cat([torch.full_like(partial[..., :1, :], float("-inf")), partial], dim=-2)  # row i: l < i
    before = torch.arange(K + 1, device=L.device)[:, None] > torch.arange(K, device=L.device)[None, :]  # j < i
    weights = spans.masked_fill(~before, float("-inf")).exp().to(chunk_kv.dtype)  # (B, H, groups, K + 1, K)
    local = weights @ chunk_kv.reshape(B, H, groups, K, m * dv)  # (B, H, groups, K + 1, m dv)
    from_start = torch.cat([L.new_zeros(B, H, groups, 1), L.cumsum(-1)], dim=-1).exp().to(chunk_kv.dtype)
    state = initial.reshape(B, H, 1, m * dv)
    states = []
    for local_g, from_start_g in zip(local.unbind(2), from_start.unbind(2)):
        states.append(local_g + from_start_g[..., None] * state)  # (B, H, K + 1, m dv)
        state = states[-1][:, :, K:]
    previous = torch.stack(states, dim=2)[:, :, :, :K].reshape(B, H, groups * K, m, dv)[:, :, :nc]
    return previous, state.reshape(B, H, m, dv)
