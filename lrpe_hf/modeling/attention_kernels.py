"""Linear-attention products, free of any positional logic.

Shapes: B batch, H heads, N tokens, m feature dim, dv value dim.

- ``bidirectional_linear_attention``: out_s = q_s^T (sum_t k_t v_t^T), two matmuls, O(N m dv); with
  ``documents``, the sum runs over the tokens of s's document only.
- ``causal_linear_attention``: out_s = sum_{t<=s} exp(G_s - G_t) (q_s . k_t) v_t, plus the contribution of an
  initial state, where G is the running sum of per-token log gates g <= 0 (a decay such as PermuteFormer's
  r^(s-t), or the rescaling of a running maximum). A token with ``resets`` set starts a new document: no earlier
  token (nor the initial state) reaches it or anything after it. Chunkwise: a masked C x C product inside each
  chunk of C tokens, and a running (m x dv) state across chunks. Memory O(N C + (N / C) m dv); gates are only
  ever exponentiated as differences inside a chunk, so nothing overflows however long the sequence. Ungated
  inputs, and gates that are one constant per head (a decay by position over consecutive positions), take one
  product (``ChunkedCausalProduct``, the decay as fixed weights, ``ChunkDecay``); other gates the general gated
  product (``gated_chunks``).
"""

import math

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from .gradients import wants_gradient
from .triton_kernels import can_run, fla_causal_product


def bidirectional_linear_attention(q, k, v, documents=None, with_denominator=False):
    """q, k (B, H, N, m); v (B, H, N, dv); documents (B, N) long document index per token, or None. Returns out
    (B, H, N, dv) and, ``with_denominator``, the denominator sum_t q_s . k_t (B, H, N, 1), else None."""
    if documents is None:
        out = q @ (k.transpose(-1, -2) @ v)
        return out, (q @ k.sum(-2).unsqueeze(-1)) if with_denominator else None
    if with_denominator:
        out, _ = bidirectional_linear_attention(q, k, torch.cat([v, torch.ones_like(v[..., :1])], dim=-1), documents)
        return out[..., :-1], out[..., -1:]
    first = documents[:, :1]
    one_hot = F.one_hot(documents - first, int((documents - first).max()) + 1).to(k.dtype)  # (B, N, D)
    per_document = torch.einsum("bnd,bhnm,bhne->bhdme", one_hot, k, v)  # (B, H, D, m, dv)
    out = q[:, :, None] @ per_document  # (B, H, D, N, dv)
    return torch.einsum("bhdne,bnd->bhne", out, one_hot), None


BLOCK_ELEMENTS = 1 << 20  # the C x C scores of one block of the chunked products: 4 MB in float32


def heads_per_block(num_heads: int, num_chunks: int, chunk_size: int) -> int:
    """How many heads the chunked products handle at once: as many as keep one block's C x C scores within
    ``BLOCK_ELEMENTS``. Small blocks stay in the CPU's caches and in the allocator's reused memory; a full-size
    temporary costs a fresh allocation (page faults) and a trip through main memory."""
    return max(1, min(num_heads, BLOCK_ELEMENTS // (num_chunks * chunk_size * chunk_size)))


def head_blocks(num_heads: int, num_chunks: int, chunk_size: int):
    """The slices of consecutive heads, ``heads_per_block`` at a time, that cover ``num_heads``."""
    step = heads_per_block(num_heads, num_chunks, chunk_size)
    return [slice(start, start + step) for start in range(0, num_heads, step)]


def batch_head_blocks(batch_size: int, num_heads: int, num_chunks: int, chunk_size: int):
    """(rows, heads) slices that cover a (B, H) grid in blocks within ``BLOCK_ELEMENTS``: every row and some heads,
    or one head and some rows. Either way the block of a tensor stored heads-first (``heads_first``) is
    contiguous."""
    heads = heads_per_block(num_heads, batch_size * num_chunks, chunk_size)
    rows = batch_size if heads > 1 else heads_per_block(batch_size, num_chunks, chunk_size)
    return [
        (slice(row, row + rows), slice(head, head + heads))
        for head in range(0, num_heads, heads)
        for row in range(0, batch_size, rows)
    ]


def heads_first(batch_size: int, num_heads: int, num_tokens: int, width: int, like, dtype=None):
    """A new (B, H, N, width) tensor stored as (H, B, N, width), where every block of ``batch_head_blocks`` is
    contiguous."""
    return like.new_empty(num_heads, batch_size, num_tokens, width, dtype=dtype).transpose(0, 1)


def block_of(x, rows, heads):
    """x[rows, heads] (b, h, ...) as (h, b, ...): the order in which a block's chunks are stacked."""
    return x[rows, heads].transpose(0, 1)


class Scratch:
    """Memory that the blocks of one chunked product reuse: one buffer per purpose, allocated once per call, not
    once per block. (Freed multi-MB temporaries go back to the system, and a fresh one is faulted in page by page:
    on a CPU that took about as long as the copy that fills it.)"""

    def __init__(self):
        self.buffers = {}

    def __call__(self, purpose: str, shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` on ``like``'s device (in ``dtype``, or like's): the memory last
        handed out for ``purpose``, where it is large enough."""
        dtype = dtype or like.dtype
        size = math.prod(shape)
        buffer = self.buffers.get(purpose)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            buffer = self.buffers[purpose] = like.new_empty(size, dtype=dtype)
        return buffer[:size].view(shape)


def chunks_of(x, rows, heads, chunk_size: int, dtype, scratch: Scratch, purpose: str):
    """The block (rows, heads) of x (B, H, N, w) as contiguous chunks (h * b * nc, C, w) in ``dtype``: a view when
    x is laid out so already, otherwise a copy of the block into ``scratch``'s memory for ``purpose``."""
    block = block_of(x, rows, heads)
    if block.dtype == dtype and block.is_contiguous():
        return block.view(-1, chunk_size, block.shape[-1])
    chunks = scratch(purpose, block.shape, block, dtype).copy_(block)
    return chunks.view(-1, chunk_size, block.shape[-1])


def add_state_products(target, left, states, initial, num_chunks):
    """target[c] += left[c] @ states[c - 1] for every chunk c of every head, and left[c] @ initial (or nothing) for
    each head's first chunk. target, left (heads * nc, C, ·); states (heads * nc, ·, ·) the inclusive running
    states; initial (heads, ·, ·) or None. One batched product over the whole block, offset by one chunk; the
    heads' first chunks, which it pairs with the previous head's last state, are put back and fixed."""
    firsts = torch.arange(0, target.shape[0], num_chunks, device=target.device)
    kept = target.index_select(0, firsts[1:])
    target[1:].baddbmm_(left[1:], states[:-1])
    target.index_copy_(0, firsts[1:], kept)
    if initial is not None:
        target.index_add_(0, firsts, torch.bmm(left.index_select(0, firsts), initial))


def running_sum_(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """x[:, i] <- x[:, 0] + ... + x[:, i] in place, for x (G, n, ...): the sums within blocks of ``block`` rows,
    then the blocks' totals carried forward, about n / block + block in-place additions in all. (``cumsum_``
    along dim 1 ran up to 6x slower on 2 CPU cores when the trailing size is a power of two, as m x dv = 4096;
    with at most 256 trailing elements, as the key sums' m x 1, one ``cumsum`` was up to 10x faster.)"""
    if x[0, 0].numel() <= 256:
        return x.copy_(x.cumsum(1))
    n = x.shape[1]
    full = n - n % block
    blocks = x[:, :full].unflatten(1, (full // block, block))  # (G, nb, block, ...)
    for row in range(1, block if full else 0):
        blocks[:, :, row] += blocks[:, :, row - 1]
    totals = blocks[:, :, -1]  # each block's last row: after this loop, the running sum up to it
    for index in range(1, totals.shape[1]):
        totals[:, index] += totals[:, index - 1]
    if full > block:
        blocks[:, 1:, :-1] += totals[:, :-1, None]
    rest = x[:, full:]
    if rest.shape[1]:
        if full:
            rest[:, 0] += totals[:, -1]
        for row in range(1, rest.shape[1]):
            rest[:, row] += rest[:, row - 1]
    return x


def decay_powers(log_decay: torch.Tensor, size: int) -> torch.Tensor:
    """The lower-triangular (G, size, size) matrices r^(i - j) for j <= i, 0 above the diagonal: log_decay (G,) is
    log r <= 0 (r = 0 allowed: -inf gives r^0 = 1 on the diagonal and 0 below it)."""
    steps = torch.arange(size, device=log_decay.device)
    lags = steps[:, None] - steps[None, :]
    exponents = (log_decay[:, None, None] * lags.clamp_min(0)).nan_to_num(nan=0.0)  # -inf * 0 on the diagonal
    return exponents.exp().masked_fill(lags < 0, 0.0)


def decayed_running_sum_(x: torch.Tensor, factor: torch.Tensor, reverse: bool = False, block: int = 16):
    """x[:, i] <- x[:, i] + factor * x[:, i - 1] in place, for x (G, n, ...) and factor (G,) in [0, 1]: the running
    sum of a state that decays by ``factor`` per step; with ``reverse``, x[:, i] + factor * x[:, i + 1] from the last
    step back. Within blocks of ``block`` steps one product with the matrix of factor^|i - j|, then each block's
    boundary sum carried into the next: n / block steps one after another, not n."""
    G, n = x.shape[:2]
    K = min(block, n)
    padded = F.pad(x.reshape(G, n, -1), (0, 0, 0, (-n) % K))  # zeros past the end reach nothing
    steps = torch.arange(K, device=x.device)
    within = decay_powers(factor.log(), K)
    within = within.transpose(1, 2) if reverse else within
    sums = torch.matmul(within[:, None], padded.view(G, -1, K, padded.shape[-1]))  # (G, blocks, K, rest)
    reach = factor[:, None] ** ((K - steps) if reverse else (steps + 1))  # a neighbour's boundary sum, at each step
    for b in range(sums.shape[1] - 2, -1, -1) if reverse else range(1, sums.shape[1]):
        boundary = sums[:, b + 1, :1] if reverse else sums[:, b - 1, -1:]
        sums[:, b].addcmul_(reach[:, :, None], boundary)
    return x.copy_(sums.view(G, -1, sums.shape[-1])[:, :n].view(x.shape))


def running_states(chunk_states, start, num_chunks, decay=None):
    """The inclusive state after each chunk, start + sum_{c' <= c} chunk_states[c'], in place: chunk_states
    (heads * nc, m, w), start (heads, m, w) or None. ``decay`` (heads,): each state decays by it per chunk (and
    start by it once, in the first chunk), or None."""
    if start is not None:
        chunk_states[::num_chunks] += start if decay is None else start * decay[:, None, None]
    states = chunk_states.view(-1, num_chunks, *chunk_states.shape[1:])
    if decay is None:
        running_sum_(states)
    else:
        decayed_running_sum_(states, decay)
    return chunk_states


def later_states(left, grad, grad_final, num_chunks, decay=None):
    """The gradient of each chunk's own state (k_c^T v_c): sum_{c' > c} left_c'^T grad_c', plus the final state's
    gradient; and the initial state's gradient (the sum over every chunk). left (heads * nc, C, m), grad
    (heads * nc, C, w), grad_final (heads, m, w) or None; ``decay`` (heads,) per chunk as ``running_states``,
    which weighs the term of chunk c' by decay^(c' - c - 1) (the final state's by decay^(nc - 1 - c)).
    Returns (heads * nc, m, w) and (heads, m, w)."""
    m, w = left.shape[-1], grad.shape[-1]
    if decay is not None:
        return decayed_later_states(torch.bmm(left.transpose(1, 2), grad).view(-1, num_chunks, m, w), grad_final, decay)
    later = running_sum_(torch.bmm(left.transpose(1, 2), grad).view(-1, num_chunks, m, w))
    total = later[:, -1].clone()
    if grad_final is not None:
        total += grad_final
    later.neg_().add_(total[:, None])  # the total minus the sum up to c
    return later.view(-1, m, w), total


def decayed_later_states(products, grad_final, decay):
    """``later_states`` with a decay, from each chunk's own products (heads, nc, m, w): the sums from the last chunk
    back, R_c = products_c + decay R_{c+1} (R_nc = grad_final), then shifted by one chunk."""
    if grad_final is not None:
        products[:, -1].addcmul_(grad_final, decay[:, None, None])
    reached = decayed_running_sum_(products, decay, reverse=True)
    total = reached[:, 0].clone()
    after = grad_final[:, None] if grad_final is not None else reached.new_zeros(reached[:, :1].shape)
    return torch.cat([reached[:, 1:], after], dim=1).view(-1, *reached.shape[2:]), total


def unweighted(x: torch.Tensor) -> torch.Tensor:
    """x itself: the weights of queries and keys without a decay."""
    return x


class ChunkDecay:
    """A per-head decay r = exp(log_decay) <= 1 per token, as the chunked products apply it to one block (h heads
    of b rows, chunks of C tokens, stacked heads-first as ``block_of``): query i of a chunk weighs key j of the
    same chunk by r^(i - j) and the state before the chunk by r^(i + 1); key j enters the state after its chunk
    with weight r^(C - 1 - j); the states decay by r^C from one chunk to the next.

    log_decay (h,) <= 0, float32 or wider; ``groups``: h * b; ``dtype``: the products' dtype.
    """

    def __init__(self, log_decay: torch.Tensor, groups: int, chunk_size: int, dtype):
        self.heads = log_decay.shape[0]
        steps = torch.arange(chunk_size, device=log_decay.device, dtype=log_decay.dtype)
        self.within = decay_powers(log_decay, chunk_size).to(dtype)[:, None]  # (h, 1, C, C), zero above the diagonal
        self.to_query = (log_decay[:, None] * (steps + 1)).exp().to(dtype)[:, None, :, None]  # (h, 1, C, 1)
        self.from_key = (log_decay[:, None] * (chunk_size - 1 - steps)).exp().to(dtype)[:, None, :, None]
        self.per_chunk = (log_decay * chunk_size).exp().to(dtype).repeat_interleave(groups // self.heads)  # (h b,)

    def to_queries(self, x: torch.Tensor) -> torch.Tensor:
        """x (h * b * nc, C, w) with the row of query i times r^(i + 1)."""
        return (x.view(self.heads, -1, *x.shape[1:]) * self.to_query).view(x.shape)

    def from_keys(self, x: torch.Tensor) -> torch.Tensor:
        """x (h * b * nc, C, w) with the row of key j times r^(C - 1 - j)."""
        return (x.view(self.heads, -1, *x.shape[1:]) * self.from_key).view(x.shape)

    def mask_(self, scores: torch.Tensor) -> torch.Tensor:
        """The C x C scores (h * b * nc, C, C) times r^(i - j), zero above the diagonal, in place."""
        scores.view(self.heads, -1, *scores.shape[1:]).mul_(self.within)
        return scores


class ChunkedCausalProduct(torch.autograd.Function):
    """The causal product in chunks, ungated or with one decay per head: out_s = q_s S_0 + sum_{t<=s} (q_s . k_t) v_t,
    the final state S_0 + sum_t k_t v_t^T and, ``with_denominator``, the denominator q_s . (z_0 + sum_{t<=s} k_t):
    what a ones column appended to v would give, without widening every product to dv + 1 (a width of 65 ran them
    at half the speed of 64). With ``log_decay`` (H,), every term is weighted by r^(s - t), r = exp(log_decay) per
    token (S_0 and z_0 by r^(s + 1)): the gated product's case of one constant gate per head (``ChunkDecay``).
    Blocks of rows and heads at a time (``batch_head_blocks``), each copied to contiguous chunks where it is not so
    already: neither a copy of the inputs, nor the C x C scores, nor the per-chunk states are ever made for the
    whole input. Backward recomputes the scores and the states: only q, k and v are saved.

    q, k (B, H, N, m) and v (B, H, N, dv) in any memory layout, N a multiple of C; initial (B, H, m, dv') or None,
    dv' = dv + 1 with the denominator (the last column holds z_0), dv otherwise; ``dtype``: the dtype of every
    product. Returns out (B, H, N, dv), the denominator (B, H, N, 1) or None, and the final state (B, H, m, dv'),
    all stored heads-first. With ``eps`` (a number; with the denominator, for forward only) out is returned
    divided by the denominator + eps, block by block, and stored as (B, N, H, dv), the order the output
    projection reads: neither the undivided output nor a pass to divide it is made for the whole input.
    """

    @staticmethod
    def forward(ctx, q, k, v, initial, chunk_size, with_denominator, dtype, log_decay=None, eps=None):
        B, H, N, m = q.shape
        C, nc, dv = chunk_size, N // chunk_size, v.shape[-1]
        divide = eps is not None
        out = v.new_empty(B, N, H, dv, dtype=dtype).transpose(1, 2) if divide else heads_first(B, H, N, dv, v, dtype)
        denominator = heads_first(B, H, N, 1, v, dtype) if with_denominator else None
        final = heads_first(B, H, m, dv + with_denominator, v, dtype)
        scratch = Scratch()
        for rows, heads in batch_head_blocks(B, H, nc, C):
            qf, kf, vf = (chunks_of(x, rows, heads, C, dtype, scratch, name) for name, x in zip("qkv", (q, k, v)))
            start, start_keys = ChunkedCausalProduct.initial_block(initial, rows, heads, dv, dtype)
            decay = ChunkedCausalProduct.decay_block(log_decay, heads, qf.shape[0] // nc, C, dtype)
            to_queries, from_keys, per_chunk = ChunkedCausalProduct.state_weights(decay)
            queries, keys = to_queries(qf), from_keys(kf)  # as they meet the states across chunks
            states = scratch("states", (qf.shape[0], m, dv), qf)
            kv = running_states(torch.bmm(keys.transpose(1, 2), vf, out=states), start, nc, per_chunk)
            scores = ChunkedCausalProduct.masked_scores(qf, kf, decay, scratch("scores", (qf.shape[0], C, C), qf))
            out_block = (
                scratch("out", (qf.shape[0], C, dv), qf) if divide else block_of(out, rows, heads).view(-1, C, dv)
            )
            torch.bmm(scores, vf, out=out_block)
            add_state_products(out_block, queries, kv, start, nc)
            final_block = block_of(final, rows, heads).view(-1, m, dv + with_denominator)
            final_block[..., :dv] = kv.view(-1, nc, m, dv)[:, -1]
            if with_denominator:
                key_sums = running_states(keys.sum(1).unsqueeze(-1), start_keys, nc, per_chunk)  # (rows, m, 1)
                denominator_block = block_of(denominator, rows, heads).view(-1, C, 1)
                torch.sum(scores, -1, keepdim=True, out=denominator_block)
                add_state_products(denominator_block, queries, key_sums, start_keys, nc)
                final_block[..., dv:] = key_sums.view(-1, nc, m, 1)[:, -1]
                if divide:
                    target = block_of(out, rows, heads)
                    reciprocal = denominator_block.add(eps).reciprocal_().view(*target.shape[:-1], 1)
                    torch.mul(out_block.view(target.shape), reciprocal, out=target)
        ctx.save_for_backward(q, k, v, initial, log_decay)
        ctx.chunk_size, ctx.with_denominator, ctx.dtype = chunk_size, with_denominator, dtype
        return out, denominator, final

    @staticmethod
    def decay_block(log_decay, heads, groups, chunk_size, dtype):
        """The ``ChunkDecay`` of a block of heads (``groups``: its heads x rows), or None without a decay."""
        return None if log_decay is None else ChunkDecay(log_decay[heads], groups, chunk_size, dtype)

    @staticmethod
    def state_weights(decay):
        """How a query and a key are weighted where they meet the states across chunks (``to_queries``,
        ``from_keys``), and the states' decay per chunk: unchanged and None without a decay."""
        if decay is None:
            return unweighted, unweighted, None
        return decay.to_queries, decay.from_keys, decay.per_chunk

    @staticmethod
    def masked_scores(qf, kf, decay, out):
        """The C x C scores q_i . k_j of each chunk, zero above the diagonal, and times r^(i - j) with a decay,
        written to ``out``."""
        scores = torch.bmm(qf, kf.transpose(1, 2), out=out)
        return scores.tril_() if decay is None else decay.mask_(scores)

    @staticmethod
    def initial_block(state, rows, heads, dv, dtype):
        """A block of an initial state (or of its gradient) (B, H, m, dv'), split into the values' part
        (h * b, m, dv) and the key sums' (h * b, m, 1) (None without a denominator); (None, None) for None."""
        if state is None:
            return None, None
        block = block_of(state, rows, heads)
        block = block.reshape(-1, *block.shape[-2:]).to(dtype)
        return block[..., :dv], (block[..., dv:] if block.shape[-1] > dv else None)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_denominator, grad_final):
        q, k, v, initial, log_decay = ctx.saved_tensors
        C, with_denominator, dtype = ctx.chunk_size, ctx.with_denominator, ctx.dtype
        B, H, N, m = q.shape
        nc, dv = N // C, v.shape[-1]
        grad_q, grad_k, grad_v = (heads_first(B, H, N, x.shape[-1], x) for x in (q, k, v))
        grad_initial = heads_first(B, H, m, dv + with_denominator, initial) if initial is not None else None
        scratch = Scratch()
        for rows, heads in batch_head_blocks(B, H, nc, C):
            inputs = zip(("q", "k", "v", "grad"), (q, k, v, grad_out))
            qf, kf, vf, go = (chunks_of(x, rows, heads, C, dtype, scratch, name) for name, x in inputs)
            start, start_keys = ChunkedCausalProduct.initial_block(initial, rows, heads, dv, dtype)
            final_go, final_gd = ChunkedCausalProduct.initial_block(grad_final, rows, heads, dv, dtype)
            decay = ChunkedCausalProduct.decay_block(log_decay, heads, qf.shape[0] // nc, C, dtype)
            to_queries, from_keys, per_chunk = ChunkedCausalProduct.state_weights(decay)
            queries, keys = to_queries(qf), from_keys(kf)
            states = scratch("states", (qf.shape[0], m, dv), qf)
            kv = running_states(torch.bmm(keys.transpose(1, 2), vf, out=states), start, nc, per_chunk)
            later, total = later_states(queries, go, final_go, nc, per_chunk)
            scores = ChunkedCausalProduct.masked_scores(qf, kf, decay, scratch("scores", (qf.shape[0], C, C), qf))
            grad_scores = torch.bmm(go, vf.transpose(1, 2), out=scratch("grad_scores", scores.shape, qf))
            if with_denominator:  # the denominator's gradient reaches every visible score of its row
                gd = chunks_of(grad_denominator, rows, heads, C, dtype, scratch, "grad_denominator")
                grad_scores += gd
            grad_scores = grad_scores.tril_() if decay is None else decay.mask_(grad_scores)
            dq = ChunkedCausalProduct.target(grad_q, rows, heads, C, dtype)
            torch.bmm(grad_scores, kf, out=dq)
            start_t = None if start is None else start.transpose(1, 2)
            add_state_products(dq, to_queries(go), kv.transpose(1, 2), start_t, nc)
            dk = ChunkedCausalProduct.target(grad_k, rows, heads, C, dtype)
            torch.bmm(grad_scores.transpose(1, 2), qf, out=dk).baddbmm_(from_keys(vf), later.transpose(1, 2))
            dv_block = ChunkedCausalProduct.target(grad_v, rows, heads, C, dtype)
            torch.bmm(scores.transpose(1, 2), go, out=dv_block).baddbmm_(keys, later)
            if with_denominator:
                key_sums = running_states(keys.sum(1).unsqueeze(-1), start_keys, nc, per_chunk)
                later_keys, total_keys = later_states(queries, gd, final_gd, nc, per_chunk)
                key_start = None if start_keys is None else start_keys.transpose(1, 2)
                add_state_products(dq, to_queries(gd), key_sums.transpose(1, 2), key_start, nc)
                dk += from_keys(later_keys.transpose(1, 2).expand(-1, C, -1))  # each key adds to the key sums after it
                total = torch.cat([total, total_keys], dim=-1)
            if grad_initial is not None:
                initial_block = block_of(grad_initial, rows, heads)
                initial_block.copy_(total.view(initial_block.shape))
            for grad, computed in ((grad_q, dq), (grad_k, dk), (grad_v, dv_block)):
                target = block_of(grad, rows, heads)
                if computed.data_ptr() != target.data_ptr():  # computed in the products' dtype
                    target.copy_(computed.view(target.shape))
        return grad_q, grad_k, grad_v, grad_initial, None, None, None, None, None

    @staticmethod
    def target(grad, rows, heads, chunk_size, dtype):
        """Where a block's gradient is computed: its place in ``grad`` (C rows at a time), or a temporary when
        the products run in another dtype."""
        block = block_of(grad, rows, heads)
        if block.dtype == dtype:
            return block.view(-1, chunk_size, block.shape[-1])
        return block.new_empty(block.shape, dtype=dtype).view(-1, chunk_size, block.shape[-1])


def chunk_prefix_sums(x, chunk_size: int, reverse: bool = False):
    """Inclusive prefix sums of x (G, N, m) along the tokens, or suffix sums with ``reverse``; N a multiple of C.
    Within each chunk one product with a triangular matrix of ones, across chunks the running totals of the
    chunks. (``cumsum`` along the tokens runs one serial thread per column on CUDA, and was slower on the CPU too.)
    """
    G, N, m = x.shape
    ones = torch.ones(chunk_size, chunk_size, dtype=x.dtype, device=x.device)
    sums = torch.matmul(ones.triu_() if reverse else ones.tril_(), x.view(G, N // chunk_size, chunk_size, m))
    if reverse:  # each chunk's total is its first row; every chunk adds the totals of the chunks after it
        carried = sums[:, :, 0].flip(1).cumsum(1).flip(1)
        sums[:, :-1] += carried[:, 1:, None]
    else:
        carried = sums[:, :, -1].cumsum(1)
        sums[:, 1:] += carried[:, :-1, None]
    return sums.view(G, N, m)


class CausalKeySums(torch.autograd.Function):
    """The ungated causal denominator q_s . (z_0 + sum_{t<=s} k_t) and the final key sum z_0 + sum_t k_t, by prefix
    sums of the keys (``chunk_prefix_sums``): O(N m), where the chunked product with a ones column computes every
    C x C score. Blocks of rows and heads at a time, as ``ChunkedCausalProduct``; saves its inputs, and backward
    recomputes the prefix sums (the keys' gradient is a suffix sum).

    q, k (B, H, N, m) in any layout, N a multiple of C; initial (B, H, m, 1) or None; ``dtype``: the dtype of the
    sums. Returns (B, H, N, 1) and (B, H, m, 1), stored heads-first.
    """

    @staticmethod
    def forward(ctx, q, k, initial, chunk_size, dtype):
        B, H, N, m = q.shape
        denominator = heads_first(B, H, N, 1, q, dtype)
        final = heads_first(B, H, m, 1, q, dtype)
        scratch = Scratch()
        for rows, heads in batch_head_blocks(B, H, N // chunk_size, chunk_size):
            qf = chunks_of(q, rows, heads, N, dtype, scratch, "q")  # (h * b, N, m)
            sums = CausalKeySums.key_sums(k, initial, rows, heads, N, chunk_size, dtype, scratch)
            torch.linalg.vecdot(qf, sums, out=block_of(denominator, rows, heads).view(-1, N))
            block_of(final, rows, heads).view(-1, m).copy_(sums[:, -1])
        ctx.save_for_backward(q, k, initial)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return denominator, final

    @staticmethod
    def key_sums(k, initial, rows, heads, num_tokens, chunk_size, dtype, scratch):
        """z_0 + sum_{t<=s} k_t for a block: (h * b, N, m)."""
        sums = chunk_prefix_sums(chunks_of(k, rows, heads, num_tokens, dtype, scratch, "k"), chunk_size)
        if initial is not None:
            sums += block_of(initial, rows, heads).reshape(sums.shape[0], 1, -1).to(dtype)
        return sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_final):
        q, k, initial = ctx.saved_tensors
        C, dtype = ctx.chunk_size, ctx.dtype
        B, H, N, m = q.shape
        grad_q, grad_k = (heads_first(B, H, N, m, x) for x in (q, k))
        grad_initial = heads_first(B, H, m, 1, initial) if initial is not None else None
        scratch = Scratch()
        for rows, heads in batch_head_blocks(B, H, N // C, C):
            qf = chunks_of(q, rows, heads, N, dtype, scratch, "q")
            gd = chunks_of(grad, rows, heads, N, dtype, scratch, "grad")  # (h * b, N, 1)
            sums = CausalKeySums.key_sums(k, initial, rows, heads, N, C, dtype, scratch)
            block_of(grad_q, rows, heads).copy_(sums.mul_(gd).view(block_of(grad_q, rows, heads).shape))
            later = chunk_prefix_sums(qf * gd, C, reverse=True)  # sum over s >= t
            later += block_of(grad_final, rows, heads).reshape(later.shape[0], 1, m).to(dtype)
            block_of(grad_k, rows, heads).copy_(later.view(block_of(grad_k, rows, heads).shape))
            if grad_initial is not None:  # z_0 reaches every query
                block_of(grad_initial, rows, heads).view(-1, m).copy_(later[:, 0])
        return grad_q, grad_k, grad_initial, None, None


def causal_key_sums(q, k, initial=None, chunk_size: int | None = None):
    """q_s . (z_0 + sum_{t<=s} k_t), the denominator of ungated causal attention without a positional transform,
    and the final key sum: q, k (B, H, N, m); initial (B, H, m, 1) or None. Returns (B, H, N, 1) and
    (B, H, m, 1)."""
    N = q.shape[2]
    if N == 1:  # one decoding step, in its recurrent form
        final = k.transpose(-1, -2) if initial is None else initial + k.transpose(-1, -2)
        return q @ final, final
    C, dtype = chunk_length(N, chunk_size), product_dtype(q, k)
    device = q.device.type
    pad = (-N) % C
    if pad:
        q, k = (F.pad(x, (0, 0, 0, pad)) for x in (q, k))
    with torch.autocast(device, enabled=False):
        denominator, final = CausalKeySums.apply(q, k, initial, C, dtype)
    return denominator[:, :, :N], final


def divide_rows(numerator: torch.Tensor, denominator: torch.Tensor, eps, guard=None):
    """numerator (B, H, N, d) / guard(denominator (B, H, N, 1) + eps), written in the memory order (B, N, H, d)
    that the output projection reads: the heads are merged by a view, not by one more copy. ``eps`` is a number
    or a tensor broadcastable to (B, H, N, 1); ``guard`` maps the denominator before its reciprocal is taken
    (``nonzero``), or is None. Returns the result and the reciprocal (B, H, N, 1)."""
    denominator = denominator + eps
    reciprocal = (guard(denominator) if guard else denominator).reciprocal()
    B, H, N, d = numerator.shape
    return torch.mul(numerator, reciprocal, out=numerator.new_empty(B, N, H, d).transpose(1, 2)), reciprocal


def default_chunk_size(num_tokens: int) -> int:
    """64 at every length: the fastest forward and forward+backward measured on a 2-core CPU, 4k to 16k tokens."""
    return 64


def chunk_length(num_tokens: int, chunk_size: int | None) -> int:
    """The chunk length for an input of ``num_tokens``: ``chunk_size`` (None: the default), at most the input."""
    return max(1, min(chunk_size or default_chunk_size(num_tokens), num_tokens))


def product_dtype(*tensors) -> torch.dtype:
    """The dtype the chunked products compute in: autocast's where it is on (as a matmul would), otherwise the
    inputs' promoted dtype."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(tensors[0].dtype, tensors[1].dtype)


def causal_linear_attention(
    q,
    k,
    v,
    log_gates=None,
    initial_state=None,
    chunk_size: int | None = None,
    resets=None,
    with_denominator=False,
    divide_eps: float | None = None,
    backend: str = "auto",
):
    """q, k (B, H, N, m); v (B, H, N, dv); log_gates (B, H, N) or None; initial_state (B, H, m, dv') or None;
    chunk_size None picks ``default_chunk_size(N)``; resets (B, N) bool or None; ``with_denominator``: also the
    denominator sum_{t<=s} exp(G_s - G_t) q_s . k_t, what a ones column appended to v would give.

    Returns out (B, H, N, dv), the denominator (B, H, N, 1) or None, and the final state
    sum_t exp(G_N - G_t) k_t v_t^T (over the last document) (B, H, m, dv'), the state of a recurrent formulation,
    so a later call can continue where this one stopped; dv' = dv + 1 with the denominator (its last column is
    the state of the key sum), dv otherwise.

    ``divide_eps`` (a number, with the denominator, where no gradient is wanted): out is returned divided by the
    denominator + divide_eps, in the memory order (B, N, H, dv) of ``divide_rows``; the ungated product divides
    each block as it makes it.

    ``backend``: ``torch`` (the products below), ``triton`` (fla's kernels, ``triton_kernels.py``; raises where
    they cannot run) or ``auto`` (fla's kernels where they can run, torch otherwise). The chunk size is the torch
    path's.
    """
    if divide_eps is not None and (not with_denominator or wants_gradient(q, k, v, initial_state, log_gates)):
        raise ValueError("divide_eps needs with_denominator=True and inputs that want no gradient")
    B, H, N, m = q.shape
    C, dtype = chunk_length(N, chunk_size), product_dtype(q, v)
    why_not = "the torch backend was chosen" if backend == "torch" else can_run(q, v, with_denominator)
    if backend == "triton" and why_not:
        raise ValueError(f"kernel_backend='triton' cannot run this product: {why_not}; 'auto' falls back to torch")
    if why_not is None:
        decay = uniform_decay(log_gates, initial_state, resets)
        out, denominator, final = fla_causal_product(
            q, k, v, None if decay is not None else log_gates, decay, initial_state, resets, with_denominator, dtype
        )
        if divide_eps is not None:
            out = divide_rows(out, denominator, divide_eps)[0]
        return out, denominator, final
    if resets is not None and log_gates is None:
        log_gates = q.new_zeros(B, H, N, dtype=torch.promote_types(q.dtype, torch.float32))
    device = q.device.type
    pad = (-N) % C
    decay = (
        uniform_decay(log_gates, initial_state, resets) if N > 1 and not (pad and initial_state is not None) else None
    )
    if (log_gates is None or decay is not None) and N > 1:
        # zero tokens fill the last chunk; with a decay they go first (after the last token they would decay the
        # final state; before the first, with no initial state, they reach nothing)
        kept = slice(pad, None) if decay is not None else slice(None, N)
        if pad:
            q, k, v = (F.pad(x, (0, 0, pad, 0) if decay is not None else (0, 0, 0, pad)) for x in (q, k, v))
        with torch.autocast(device, enabled=False):  # the function computes in one dtype, forward and backward
            out, denominator, final = ChunkedCausalProduct.apply(
                q, k, v, initial_state, C, with_denominator, dtype, decay, divide_eps
            )
        return out[:, :, kept], None if denominator is None else denominator[:, :, kept], final
    if pad and N > 1:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        log_gates = F.pad(log_gates, (0, pad))
        resets = F.pad(resets, (0, pad)) if resets is not None else None
    if with_denominator:  # a ones column: these paths' products are per chunk or per token, not the bulk
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    if N == 1:
        out, final = recurrent_step(q, k, v, log_gates, initial_state, resets)
    else:
        out, final = gated_chunks(q, k, v, log_gates, initial_state, C, resets, dtype)
        out = out[:, :, :N]
    if with_denominator:  # one split: its backward joins the two gradients, where slices would each fill a zero one
        out, denominator = out.split([out.shape[-1] - 1, 1], dim=-1)
        if divide_eps is not None:
            out = divide_rows(out, denominator, divide_eps)[0]
        return out, denominator, final
    return out, None, final


def uniform_decay(log_gates, initial_state, resets):
    """The log decay per head (H,) when ``log_gates`` (B, H, N) hold one value <= 0 per head at every token that
    counts (the first one only with an initial state), as a decay by position over consecutive positions gives
    (PermuteFormer's): the ungated chunked product then applies it itself, much faster than the general gated
    product. None otherwise, and for gates that want a gradient."""
    if log_gates is None or resets is not None or (log_gates.requires_grad and torch.is_grad_enabled()):
        return None
    counted = log_gates if initial_state is not None else log_gates[..., 1:]
    per_head = counted[:1, :, :1]  # (1, H, 1)
    if not bool(((counted == per_head) & (per_head <= 0)).all()):
        return None
    return per_head[0, :, 0]


def recurrent_step(q, k, v, log_gates, initial_state, resets):
    """One decoding step, in its recurrent form: S = exp(g) S_0 + k^T v (no S_0 after a reset), out = q S.
    q, k (B, H, 1, m); v (B, H, 1, dv); log_gates (B, H, 1) or None; initial_state (B, H, m, dv) or None."""
    state = k.transpose(-1, -2) @ v
    if initial_state is not None:
        previous = initial_state.to(state.dtype)
        if log_gates is not None:
            keep = log_gates.exp() if resets is None else log_gates.exp().masked_fill(resets[:, None], 0.0)
            previous = previous * keep[..., None].to(state.dtype)
        state = state + previous
    return q @ state, state


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
