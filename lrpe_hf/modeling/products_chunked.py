"""The causal product in chunks, ungated or with one constant decay per head (PermuteFormer's r^(s - t)), and the
ungated causal key sums (the unrotated denominator).

Inside each chunk of C tokens a masked C x C product, across chunks a running (m x dv) state: memory
O(N C + (N / C) m dv). ``ChunkedCausalProduct`` computes the values' product and, alongside, the denominator (what a
ones column appended to the values would give); the decay enters as fixed weights (``ChunkDecay``).

Shapes: B batch, H heads, N tokens, m feature dim, dv value dim.
"""

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from .kept_tensors import kept_tensor
from .products_shared import (
    Scratch,
    batch_head_blocks,
    block_of,
    chunk_length,
    chunks_of,
    heads_first,
    product_dtype,
    row_dot,
)


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
        blocks[:, :, row].add_(blocks[:, :, row - 1])
    totals = blocks[:, :, -1]  # each block's last row: after this loop, the running sum up to it
    for index in range(1, totals.shape[1]):
        totals[:, index].add_(totals[:, index - 1])
    if full > block:
        blocks[:, 1:, :-1].add_(totals[:, :-1, None])
    rest = x[:, full:]
    if rest.shape[1]:
        if full:
            rest[:, 0].add_(totals[:, -1])
        for row in range(1, rest.shape[1]):
            rest[:, row].add_(rest[:, row - 1])
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
        chunk_states[::num_chunks].add_(start if decay is None else start * decay[:, None, None])
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


def triangle_of_ones(chunk_size: int, like: torch.Tensor, upper: bool) -> torch.Tensor:
    """The C x C lower (or ``upper``) triangle of ones, inclusive, in ``like``'s dtype and device, made once per
    kind (``kept_tensor``): two kernel launches fewer per prefix sum on a GPU."""

    def make():
        ones = torch.ones(chunk_size, chunk_size, dtype=like.dtype, device=like.device)
        return ones.triu() if upper else ones.tril()

    return kept_tensor(f"triangle {chunk_size} {'upper' if upper else 'lower'}", like, make)


def chunk_prefix_sums(x, chunk_size: int, reverse: bool = False, out=None):
    """Inclusive prefix sums of x (G, N, m) along the tokens, or suffix sums with ``reverse``; N a multiple of C;
    written into ``out`` (G, N, m, contiguous) if given. Within each chunk one product with a triangular matrix of
    ones, across chunks the running totals of the chunks. (``cumsum`` along the tokens runs one serial thread per
    column on CUDA, and was slower on the CPU too.)
    """
    G, N, m = x.shape
    chunks = x.view(G, N // chunk_size, chunk_size, m)
    triangle = triangle_of_ones(chunk_size, x, reverse)
    sums = torch.matmul(triangle, chunks) if out is None else torch.matmul(triangle, chunks, out=out.view(chunks.shape))
    if reverse:  # each chunk's total is its first row; every chunk adds the totals of the chunks after it
        carried = sums[:, :, 0].flip(1).cumsum(1).flip(1)
        sums[:, :-1].add_(carried[:, 1:, None])
    else:
        carried = sums[:, :, -1].cumsum(1)
        sums[:, 1:].add_(carried[:, :-1, None])
    return sums.view(G, N, m)


def tokens_first(*xs) -> bool:
    """Whether each x (B, H, N, m) lies in memory as (B, N, H, m): as the projections and fla's kernels lay it."""
    return all(x.transpose(1, 2).is_contiguous() for x in xs)


def pad_tokens(x, pad: int):
    """x (B, H, N, m) with ``pad`` zero tokens appended, in x's layout where it is ``tokens_first`` (not while
    compiling: torch 2.7's compiled backward of that pad laid its gradient out wrongly)."""
    if tokens_first(x) and not torch.compiler.is_compiling():
        return F.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
    return F.pad(x, (0, 0, 0, pad))


class CausalKeySums(torch.autograd.Function):
    """The ungated causal denominator q_s . (z_0 + sum_{t<=s} k_t) and the final key sum z_0 + sum_t k_t, by prefix
    sums of the keys (``chunk_prefix_sums``): O(N m), where the chunked product with a ones column computes every
    C x C score. Saves its inputs, and backward recomputes the prefix sums (the keys' gradient is a suffix sum).

    q, k (B, H, N, m), N a multiple of C; initial (B, H, m, 1) or None; ``dtype``: the dtype of the sums;
    ``final_state``: whether the final key sum is wanted (a caller with no cache to continue wants none). Returns
    (B, H, N, 1) and (B, H, m, 1) or None. An output whose gradient does not come (the final key sum, unused) is not
    given one as zeros (no launch to make them, none to add them).

    Two layouts. q and k stored tokens first (``tokens_first``), off the CPU or where one block holds them: every row
    and head at once, in that layout (the prefix sums of a row's (N, H m) keys), without a copy into another; the
    outputs and gradients are laid out so too. Otherwise blocks of rows and heads at a time, as
    ``ChunkedCausalProduct``, each copied heads first where it is not (a CPU's caches hold a block).
    """

    @staticmethod
    def forward(ctx, q, k, initial, chunk_size, dtype, final_state=True):
        B, H, N, m = q.shape
        ctx.save_for_backward(q, k, initial)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        ctx.set_materialize_grads(False)
        one_block = len(batch_head_blocks(B, H, N // chunk_size, chunk_size)) == 1
        ctx.whole = tokens_first(q, k) and (not q.is_cpu or one_block)
        if ctx.whole:
            sums = CausalKeySums.whole_key_sums(k, initial, chunk_size, dtype)  # (B, N, H * m)
            denominator = row_dot(q.transpose(1, 2).to(dtype), sums.view(B, N, H, m))  # (B, N, H, 1)
            final = sums[:, -1].view(B, H, m, 1).clone() if final_state else None
            return denominator.transpose(1, 2), final
        denominator = heads_first(B, H, N, 1, q, dtype)
        final = heads_first(B, H, m, 1, q, dtype) if final_state else None
        scratch = Scratch()
        for rows, heads in batch_head_blocks(B, H, N // chunk_size, chunk_size):
            qf = chunks_of(q, rows, heads, N, dtype, scratch, "q")  # (h * b, N, m)
            sums = CausalKeySums.key_sums(k, initial, rows, heads, N, chunk_size, dtype, scratch)
            torch.linalg.vecdot(qf, sums, out=block_of(denominator, rows, heads).view(-1, N))
            if final is not None:
                block_of(final, rows, heads).view(-1, m).copy_(sums[:, -1])
        return denominator, final

    @staticmethod
    def key_sums(k, initial, rows, heads, num_tokens, chunk_size, dtype, scratch):
        """z_0 + sum_{t<=s} k_t for a block: (h * b, N, m)."""
        sums = chunk_prefix_sums(chunks_of(k, rows, heads, num_tokens, dtype, scratch, "k"), chunk_size)
        if initial is not None:
            sums += block_of(initial, rows, heads).reshape(sums.shape[0], 1, -1).to(dtype)
        return sums

    @staticmethod
    def whole_key_sums(k, initial, chunk_size, dtype):
        """z_0 + sum_{t<=s} k_t for every row and head of k (B, H, N, m) stored tokens first: (B, N, H * m)."""
        B, H, N, m = k.shape
        sums = chunk_prefix_sums(k.transpose(1, 2).to(dtype).view(B, N, H * m), chunk_size)
        if initial is not None:
            sums += initial.to(dtype).reshape(B, 1, H * m)
        return sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, grad_final):
        q, k, initial = ctx.saved_tensors
        if grad is None:  # only the final key sum reaches the loss
            grad = q.new_zeros(*q.shape[:3], 1, dtype=ctx.dtype)
        if ctx.whole:
            grads = CausalKeySums.whole_backward(q, k, initial, grad, grad_final, ctx.chunk_size, ctx.dtype)
            return *grads, None, None, None
        C, dtype = ctx.chunk_size, ctx.dtype
        B, H, N, m = q.shape
        grad_q, grad_k = (heads_first(B, H, N, m, x) for x in (q, k))
        grad_initial = heads_first(B, H, m, 1, initial) if initial is not None else None
        scratch = Scratch()
        for rows, heads in batch_head_blocks(B, H, N // C, C):
            qf = chunks_of(q, rows, heads, N, dtype, scratch, "q")
            gd = chunks_of(grad, rows, heads, N, dtype, scratch, "grad")  # (h * b, N, 1)
            sums = CausalKeySums.key_sums(k, initial, rows, heads, N, C, dtype, scratch)
            dq, dk = block_of(grad_q, rows, heads), block_of(grad_k, rows, heads)  # (h, b, N, m), contiguous
            direct = dq.dtype == dtype  # the gradients are written where they go, not copied there
            if direct:
                torch.mul(sums, gd, out=dq.view(sums.shape))
            else:
                dq.copy_(sums.mul_(gd).view(dq.shape))
            later = chunk_prefix_sums(qf * gd, C, reverse=True, out=dk.view(sums.shape) if direct else None)
            if grad_final is not None:  # (a sum over s >= t)
                later += block_of(grad_final, rows, heads).reshape(later.shape[0], 1, m).to(dtype)
            if not direct:
                dk.copy_(later.view(dk.shape))
            if grad_initial is not None:  # z_0 reaches every query
                block_of(grad_initial, rows, heads).view(-1, m).copy_(later[:, 0])
        return grad_q, grad_k, grad_initial, None, None, None

    @staticmethod
    def whole_backward(q, k, initial, grad, grad_final, chunk_size, dtype):
        """The gradients of q, k and z_0 for the tokens-first layout, each laid out as its input."""
        B, H, N, m = q.shape
        per_token = grad.transpose(1, 2)  # (B, N, H, 1)
        sums = CausalKeySums.whole_key_sums(k, initial, chunk_size, dtype).view(B, N, H, m)
        grad_q = torch.mul(sums, per_token, out=q.new_empty(B, N, H, m))  # rounded once into q's dtype
        later = chunk_prefix_sums((q.transpose(1, 2) * per_token).view(B, N, H * m), chunk_size, reverse=True)
        if grad_final is not None:  # (a sum over s >= t)
            later += grad_final.to(dtype).reshape(B, 1, H * m)
        grad_initial = None if initial is None else later[:, 0].reshape(B, H, m, 1).to(initial.dtype, copy=True)
        grad_k = later.view(B, N, H, m).to(k.dtype)
        return grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_initial


def causal_key_sums(
    q, k, initial=None, chunk_size: int | None = None, update_in_place: bool = False, final_state: bool = True
):
    """q_s . (z_0 + sum_{t<=s} k_t), the denominator of ungated causal attention without a positional transform,
    and the final key sum: q, k (B, H, N, m); initial (B, H, m, 1) or None. Returns (B, H, N, 1) and
    (B, H, m, 1), or None for the final key sum where ``final_state`` is False (a caller with no cache to
    continue). ``update_in_place`` (no gradient wanted): one decoding step adds its key to ``initial`` itself."""
    N = q.shape[2]
    if N == 1 and update_in_place and initial is not None and initial.dtype == k.dtype:
        final = initial.add_(k.transpose(-1, -2))
        return q @ final, final
    if N == 1:  # one decoding step, in its recurrent form
        final = k.transpose(-1, -2) if initial is None else initial + k.transpose(-1, -2)
        return q @ final, final if final_state else None
    C, dtype = chunk_length(N, chunk_size), product_dtype(q, k)
    device = q.device.type
    pad = (-N) % C
    if pad:
        q, k = (pad_tokens(x, pad) for x in (q, k))
    with torch.autocast(device, enabled=False):
        # compiled, the Function makes every output (dynamo takes no None among them), and an unwanted one is dropped
        made = final_state or torch.compiler.is_compiling()
        denominator, final = CausalKeySums.apply(q, k, initial, C, dtype, made)
    return denominator[:, :, :N], final if final_state else None
