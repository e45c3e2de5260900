"""Context parallelism: one sequence split over the ranks of a process group, rank i holding the i-th contiguous
slice of every row's tokens, each rank running the layers on its slice alone but for one collective of the states
per product (LASP-2's single gather, here with decays, packed documents and every position-based encoding).

Inside ``with context_parallel(group):`` every linear-attention layer computes what it computes on the whole
sequence in one process. What crosses ranks, and why that is all:

- Positions. Rotations (RoPE, LRPE) and permutation powers read each token's global position and nothing else.
  Given ``position_ids`` are global already; default ones continue from the real tokens of the earlier ranks. A
  decay by distance and the start of a packed document read the previous real token's position, which for a
  rank's first token lies on an earlier rank. So the layer first gathers, per rank and row, its real-token count
  and its last real position (``incoming_counters``: a few numbers), and runs as if it continued a recurrent
  state that had seen the earlier ranks' tokens.
- Causal products. Per head, with features q_s, k_t, per-token log gates g_t (the decay r^(p_t - p_prev) of
  PermuteFormer is g_t = (p_t - p_prev) log r; no decay is g = 0) and resets at document starts, the recurrence
  S_t = a_t S_{t-1} + k_t v_t^T (a_t = exp(g_t), or 0 at a reset, where the state restarts) gives
  out_s = q_s S_s. Split the tokens into ranks; on rank r write S^in_r for the state after every earlier rank's
  tokens. Unrolling the recurrence over rank r's own tokens,
      S_s = A_r(s) S^in_r + L_r(s),   A_r(s) = prod_{t <= s in rank r} a_t,
  where L_r(s) is the state rank r would have from its own tokens alone (the local product, from no initial
  state). So out_s = q_s L_r(s) + A_r(s) q_s S^in_r: the local product plus one (N x m) by (m x d) product per
  rank. A_r(s) is exp(G_s) with G the running sum of the gates, and 0 from the rank's first reset on. At the rank's
  end, S^out_r = D_r S^in_r + E_r with D_r = A_r(last token) and E_r = L_r(last token), so
      S^in_r = sum_{j < r} (prod_{j < i < r} D_i) E_j,
  a prefix combination of the pairs (E_j, D_j), which is associative: (E, D) then (E', D') is (D' E + E', D' D).
  Every rank gathers every (E_j, D_j) (one all-gather of (m x d) states per head: the traffic does not grow with
  the sequence) and combines those before its own. The denominator's key sums are a last column of the values
  (or the unrotated key sums a product of their own), so they combine the same way. The gather carries
  gradients (``torch.distributed.nn.functional.all_gather``): backward sends each rank's state gradient back to
  the rank that made it, which is the same sum over later ranks that backward through one process takes.
- Bidirectional products. Every token sees every other: the states sum_t k_t v_t^T and sum_t k_t of all ranks are
  summed (one all-reduce, with gradients). Packed documents in a bidirectional row are refused here: a document
  that crosses a rank boundary would need per-document states.

Refused, with the reason: the softmax baseline (accelerate's own context parallelism splits SDPA), FastRPB (its
bias reads every earlier value), feature maps stabilised by a running key maximum (exp, performer), convSPE and
sineSPE while training (their codes are random draws, which the ranks would make apart), and a recurrent state
that has seen tokens (a split call starts a sequence; generation continues on one process), a split that leaves a
rank no tokens, and what reads tokens of other ranks: pooled heads (sequence classification, question answering,
LinearViT's class token), attention weights (``output_attentions``) and a token classifier's mean loss (given
``num_items_in_batch`` it takes each rank's share instead).

Gradient checkpointing recomputes each layer in backward, after the ``context_parallel`` block has closed: each
model layer keeps the group it ran in (``LinearTransformerLayer``'s ``context_group``) and rejoins it
(``rejoined``), so the recomputation makes the same collectives, in the same order on every rank.

A prefill can be split: a fresh state (a layer's ``LinearAttentionState``, or LinearGPT's cache with
``use_cache=True``) given inside ``context_parallel`` ends holding S^out_r and the counters after this rank's last
token, so the last rank's is the whole prompt's, from which generation continues on that process.

The models (LinearGPT, LinearRoberta) split too: their default positions continue from the earlier ranks' real
tokens (``real_tokens_before``), packed documents are found against the earlier ranks' last positions, and the
causal LM takes ``shift_labels``, the labels shifted over the whole sequence and then sliced like the inputs (a
slice's last token is scored against the next rank's first). Each rank's loss is its tokens' sum over
``num_items_in_batch`` when that is the whole sequence's count of scored tokens, so the ranks' losses and gradients
add up to one process's.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .attention_kernels import causal_linear_attention
from .attention_state import LinearAttentionState
from .registry import positional_encoding_entry


@dataclass(frozen=True)
class ContextParallelGroup:
    """The process group one sequence is split over: this process holds slice ``rank`` of ``size``."""

    group: object
    rank: int
    size: int


_active: list[ContextParallelGroup] = []


@contextlib.contextmanager
def context_parallel(group=None):
    """Inside, linear-attention layers treat their inputs as this process's contiguous slice of a sequence split
    over ``group`` (a ``torch.distributed`` process group, default the whole world), slice i on its rank i."""
    if not dist.is_initialized():
        raise RuntimeError("context_parallel needs torch.distributed to be initialised (init_process_group)")
    group = group if group is not None else dist.group.WORLD
    _active.append(ContextParallelGroup(group, dist.get_rank(group), dist.get_world_size(group)))
    try:
        yield _active[-1]
    finally:
        _active.pop()


def active_group() -> ContextParallelGroup | None:
    """The group of the innermost ``context_parallel`` block, or None outside any."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def rejoined(cp: ContextParallelGroup):
    """Inside, ``cp`` is the active group again: a layer that ran inside ``context_parallel`` and is recomputed by
    gradient checkpointing in backward, outside the block, splits as it did (the same collectives, in the same
    order on every rank, since every rank recomputes the same layers)."""
    _active.append(cp)
    try:
        yield cp
    finally:
        _active.pop()


def gathered(x: torch.Tensor, cp: ContextParallelGroup) -> list[torch.Tensor]:
    """Every rank's x (no gradient), in rank order."""
    parts = [torch.empty_like(x) for _ in range(cp.size)]
    dist.all_gather(parts, x.contiguous(), group=cp.group)
    return parts


class SummedOverRanks(torch.autograd.Function):
    """The sum of x over the ranks; backward sums the gradients the same way (every rank's output reads every x)."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        x = x.clone()
        dist.all_reduce(x, group=cp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.cp.group)
        return grad, None


def summed(x: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    """The sum of x over the ranks, with gradients where x wants one."""
    return SummedOverRanks.apply(x, cp)


class IncomingState(torch.autograd.Function):
    """S^in for this rank from every rank's (E_j, D_j) (module docstring): forward gathers the pairs and combines
    those before this rank, S^in_{j+1} = D_j S^in_j + E_j from S^in_0 = 0. Backward gathers every rank's gradient
    g_r of its S^in_r and runs the combination in reverse, h_r = g_r + D_r h_{r+1}, which gives
    dL/dE_j = h_{j+1} and dL/dD_j = <h_{j+1}, S^in_j>: one all-gather each way, and every rank takes part in both
    (its S^in is in its outputs, zero on rank 0), so no rank waits on another's backward."""

    @staticmethod
    def forward(ctx, local_state, local_decay, cp):
        states, decays = gathered(local_state, cp), gathered(local_decay, cp)
        incoming = [torch.zeros_like(local_state)]
        for j in range(cp.size - 1):
            incoming.append(decays[j][..., None, None] * incoming[j] + states[j])
        ctx.cp, ctx.decays, ctx.incoming = cp, decays, incoming
        return incoming[cp.rank]

    @staticmethod
    def backward(ctx, grad):
        cp, decays, incoming = ctx.cp, ctx.decays, ctx.incoming
        grads = gathered(grad, cp)
        h = grads[cp.size - 1]  # h_r for r = size - 1, then downwards
        grad_state = torch.zeros_like(grad) if cp.rank == cp.size - 1 else None
        grad_decay = torch.zeros_like(decays[0]) if cp.rank == cp.size - 1 else None
        for j in range(cp.size - 2, -1, -1):  # h is h_{j+1} here
            if j == cp.rank:
                grad_state, grad_decay = h, (h * incoming[j]).sum((-1, -2))
            h = grads[j] + decays[j][..., None, None] * h
        return grad_state, grad_decay if ctx.needs_input_grad[1] else None, None


def real_tokens_before(mask, batch_size: int, num_tokens: int, device):
    """(B,) the real tokens of the earlier ranks' slices inside a ``context_parallel`` block (where a model's default
    positions continue from), 0 outside any. mask (B, N) bool or None."""
    cp = active_group()
    if cp is None:
        return 0
    count = mask.long().sum(-1) if mask is not None else torch.full((batch_size,), num_tokens, device=device)
    return torch.stack(gathered(count, cp))[: cp.rank].sum(0)


def tokens_through(num_tokens: int, device, cp: ContextParallelGroup) -> int:
    """The tokens (padding included) of the slices of ranks 0..this one: how far a prefill split over the ranks has
    gone after this rank's slice (one all-gather of one number)."""
    counts = gathered(torch.tensor([num_tokens], device=device), cp)
    return int(torch.cat(counts)[: cp.rank + 1].sum())


def refuse_unsplit_layer(layer, state):
    """Raise, saying why, where context parallelism cannot split ``layer`` (a ``LinearAttention``; the module's
    docstring lists what and why): ``state`` a recurrent state given to it, or None."""
    encoding = layer.options.positional_encoding
    why = None
    if state is not None and state.num_tokens is not None:
        why = "a recurrent state that has seen tokens was passed: a split call starts a sequence"
    elif layer.options.attention == "softmax":
        why = "softmax attention is the quadratic baseline: accelerate's own context parallelism splits SDPA"
    elif layer.positional_encoding.has_value_bias:
        why = f"{encoding} biases with every earlier value, which this rank does not hold"
    elif layer.training and positional_encoding_entry(encoding).build_shared is not None:
        why = f"{encoding} draws random codes in training, which the ranks would draw apart"
    if why:
        raise ValueError(f"Context parallelism cannot run this layer: {why}")


def refuse_in_context_parallel(what: str):
    """Raise inside a ``context_parallel`` block: ``what`` reads tokens that lie on other ranks."""
    if active_group() is not None:
        raise ValueError(f"Context parallelism cannot split {what}: call it outside context_parallel")


def refuse_a_mean_over_one_rank(labels, num_items_in_batch, loss: str):
    """Inside ``context_parallel``, a loss over tokens with ``labels`` is each rank's share only with
    ``num_items_in_batch`` (the whole sequence's scored tokens); without it each rank would take the mean of its own
    slice, and the ranks' losses would sum to several times one process's."""
    if labels is not None and num_items_in_batch is None:
        refuse_in_context_parallel(
            f"{loss} as a mean over one rank's tokens: pass num_items_in_batch, the whole sequence's scored tokens, "
            "and each rank's loss is its share"
        )


def incoming_counters(positions, mask, batch_size: int, num_tokens: int, device, cp: ContextParallelGroup):
    """The counters a recurrent state would hold after the earlier ranks' tokens: a ``LinearAttentionState`` with
    ``num_tokens`` (B,) real tokens before this rank and ``last_position`` (B,) the last of them's position (one
    all-gather: the rank's tokens, and a row's real tokens and last real position). positions
    (B, N, A) given ones, or None for defaults; mask (B, N) bool or None. A model gathers them once for all its
    layers. Raises on every rank where a rank holds no tokens."""
    B, N, given_positions = batch_size, num_tokens, positions is not None
    real = mask if mask is not None else torch.ones(B, N, dtype=torch.bool, device=device)
    count = real.long().sum(-1)
    last = torch.full((B,), -1, dtype=torch.long, device=device)
    if given_positions and N:
        index = torch.arange(N, device=device).expand(B, N).masked_fill(~real, -1).amax(-1)
        last = torch.where(index >= 0, positions[..., 0].gather(-1, index.clamp_min(0)[:, None])[:, 0], last)
    mine = torch.cat([torch.full((1,), N, dtype=torch.long, device=device), count, last])
    every = torch.stack(gathered(mine, cp))  # (ranks, 1 + 2B)
    # one read of the ranks' token counts on the host (a model gathers once per call, at the stack's entry, before
    # any layer; a standalone layer once per call): a refusal must be raised on every rank alike
    refuse_empty_ranks(every[:, 0].tolist())
    counts, lasts = every[:, 1 : 1 + B], every[:, 1 + B :]  # (ranks, B)
    before = counts[: cp.rank].sum(0)
    state = LinearAttentionState()
    state.num_tokens = before
    if given_positions:  # the last real position of the latest earlier rank that had a real token
        seen = counts[: cp.rank] > 0
        latest = torch.where(seen, torch.arange(cp.rank, device=device)[:, None], -1).amax(0) if cp.rank else None
        previous = lasts[latest.clamp_min(0), torch.arange(B, device=device)] if cp.rank else before - 1
        state.last_position = previous
    else:  # default positions count the real tokens
        state.last_position = before - 1
    state.document = torch.zeros_like(before)
    state.given_positions = given_positions
    return state


def refuse_empty_ranks(tokens_per_rank: list[int]):
    """Raise (on every rank: each holds the same list) where a rank's slice holds no tokens."""
    if 0 in tokens_per_rank:
        raise ValueError(
            f"Context parallelism needs every rank to hold tokens of the sequence; the slices hold {tokens_per_rank} "
            f"tokens: split fewer tokens over fewer ranks, or pad the sequence to a multiple of the ranks (as "
            "--context_parallel_size does)"
        )


def refuse_packed_bidirectional_rows(starts, device, cp: ContextParallelGroup):
    """Raise on every rank where any rank's bidirectional rows hold packed documents (``starts`` (B, N) bool or
    None): a document that crosses a rank boundary would need a state per document. One all-reduce, read here."""
    if summed(torch.tensor(float(starts is not None), device=device), cp) > 0:
        raise ValueError(
            "Context parallelism does not take packed documents in bidirectional attention (a document that "
            "crosses a rank boundary would need a state per document); give each row one document"
        )


def causal_product(q, k, v, log_gates, resets, with_denominator, chunk_size, backend, cp: ContextParallelGroup):
    """``causal_linear_attention`` over a sequence split across ``cp``'s ranks, this rank holding q, k (B, H, N, m),
    v (B, H, N, dv), log_gates (B, H, N) or None and resets (B, N) bool or None for its tokens. Returns out and the
    denominator (B, H, N, 1) or None, as the one-process product gives them for these tokens (module docstring),
    and S^out_r = D_r S^in_r + E_r (B, H, m, dv'): the state after this rank's last token, which on the last rank
    is the whole sequence's final state (a prefill split over ranks, continued on one process)."""
    out, denominator, local = causal_linear_attention(
        q, k, v, log_gates, None, chunk_size, resets, with_denominator, backend=backend
    )
    B, H, N = q.shape[:3]
    dtype = local.dtype
    running = log_gates.to(dtype).cumsum(-1) if log_gates is not None else q.new_zeros(B, H, N, dtype=dtype)
    live = torch.ones(B, N, dtype=torch.bool, device=q.device) if resets is None else resets.long().cumsum(-1) == 0
    through = running.exp() * live[:, None, :].to(dtype)  # A_r(s) (B, H, N)
    incoming = IncomingState.apply(local, through[..., -1], cp)  # zero on rank 0, still part of its graph
    carried = (q.to(dtype) * through[..., None]) @ incoming  # A_r(s) q_s S^in_r (B, H, N, dv')
    out = out + carried[..., : v.shape[-1]].to(out.dtype)
    if with_denominator:
        denominator = denominator + carried[..., v.shape[-1] :].to(denominator.dtype)
    return out, denominator, through[..., -1, None, None] * incoming + local


def bidirectional_product(q, k, v, with_denominator, cp: ContextParallelGroup):
    """q @ (sum over every rank's tokens of k_t v_t^T) (B, H, N, dv), and the denominator q . sum_t k_t."""
    state = summed(k.transpose(-1, -2) @ v, cp)
    out = q @ state
    if not with_denominator:
        return out, None
    return out, q @ summed(k.sum(-2), cp).unsqueeze(-1)
