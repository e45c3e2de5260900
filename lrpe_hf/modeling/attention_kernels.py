"""Linear-attention products, free of any positional logic.

Shapes: B batch, H heads, N tokens, m feature dim, dv value dim.

- ``bidirectional_linear_attention``: out_s = q_s^T (sum_t k_t v_t^T), two matmuls, O(N m dv); with
  ``documents``, the sum runs over the tokens of s's document only.
- ``causal_linear_attention``: the one function the attention paths call for a causal product; it runs the torch
  products or, for CUDA tensors, fla's Triton kernels (``products_triton.py``, ``backend``).
  out_s = sum_{t<=s} exp(G_s - G_t) (q_s . k_t) v_t, plus the contribution of an initial state, where G is the
  running sum of per-token log gates g <= 0 (a decay such as PermuteFormer's r^(s-t), or the rescaling of a
  running maximum). A token with ``resets`` set starts a new document: no earlier token (nor the initial state)
  reaches it or anything after it. Chunkwise: a masked C x C product inside each chunk of C tokens, and a running
  (m x dv) state across chunks. Memory O(N C + (N / C) m dv); gates are only ever exponentiated as differences
  inside a chunk, so nothing overflows however long the sequence. Ungated inputs, and gates that are one constant
  per head (a decay by position over consecutive positions), take one product (``products_chunked.py``:
  ``ChunkedCausalProduct``, the decay as fixed weights, ``ChunkDecay``); other gates the general gated product
  (``products_gated.py``: ``gated_chunks``).
"""

import torch
from torch.nn import functional as F

from .gradients import wants_gradient
from .products_chunked import ChunkedCausalProduct
from .products_custom_op import compiled_causal_product
from .products_gated import gated_chunks, recurrent_step
from .products_shared import chunk_length, divide_rows, product_dtype
from .products_triton import can_run, fla_causal_product, on_kernel_device


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
    update_in_place: bool = False,
    known_decay=None,
    final_state: bool = True,
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

    ``update_in_place`` (where no gradient is wanted): a one-token step on the torch path may write the final
    state over ``initial_state`` (a decoding cache's stored state, overwritten with it anyway).

    ``known_decay`` (H,): where the caller knows that ``log_gates`` hold this log decay per head at every token that
    counts (a decay by distance over default positions without padding), ``uniform_decay`` takes it without
    looking at the gates (on a GPU, a host sync per call).

    ``final_state`` False: the caller keeps no final state (a call with no cache to continue); it is returned as
    None, and fla's path neither makes it (nor its key sums) nor is handed zeros for its gradient.

    ``backend``: ``torch`` (the products below), ``triton`` (fla's kernels, ``products_triton.py``; raises where
    they cannot run) or ``auto`` (fla's kernels where they can run, torch otherwise). The chunk size is the torch
    path's.
    """
    if divide_eps is not None and (not with_denominator or wants_gradient(q, k, v, initial_state, log_gates)):
        raise ValueError("divide_eps needs with_denominator=True and inputs that want no gradient")
    B, H, N, m = q.shape
    C, dtype = chunk_length(N, chunk_size), product_dtype(q, v)
    # Compiled, the product is one opaque op in the graph: over several tokens, and for a decoding step that would
    # call fla's one-step kernel (which fla keeps out of compiled graphs); the torch path's step is plain ops.
    if torch.compiler.is_compiling() and (N > 1 or backend != "torch" and on_kernel_device(q)):
        out, denominator, final = compiled_causal_product(
            q, k, v, log_gates, initial_state, chunk_size, resets, with_denominator, dtype, backend
        )
        if divide_eps is not None:
            out = divide_rows(out, denominator, divide_eps)[0]
        return out, denominator, final if final_state else None
    # fla's kernels take per-token gates as they are, at about the cost of one decay per head: where they will run
    # with them, no look at the gates (a read on the host) for one decay per head; the torch path's ungated product
    # is much faster than its gated one, so there the look pays
    gated_backward = log_gates is not None and wants_gradient(q, k, v, log_gates, initial_state)
    why_not = "the torch backend was chosen" if backend == "torch" else can_run(q, v, dtype, gated_backward)
    look = why_not is not None or known_decay is not None
    decay = uniform_decay(log_gates, initial_state, resets, known_decay) if N > 1 and look else None
    if why_not is not None and decay is not None and backend != "torch":  # one decay per head: no gated backward
        why_not = can_run(q, v, dtype, gated_backward=False)
    if backend == "triton" and why_not:
        raise ValueError(f"kernel_backend='triton' cannot run this product: {why_not}; 'auto' falls back to torch")
    if why_not is None:
        out, denominator, final = fla_causal_product(
            q, k, v, None if decay is not None else log_gates, decay, initial_state, resets, with_denominator, dtype,
            final_state=final_state,
        )  # fmt: skip
        if divide_eps is not None:
            out = divide_rows(out, denominator, divide_eps)[0]
        return out, denominator, final if final_state else None
    if resets is not None and log_gates is None:
        log_gates = q.new_zeros(B, H, N, dtype=torch.promote_types(q.dtype, torch.float32))
    device = q.device.type
    pad = (-N) % C
    if pad and initial_state is not None:
        decay = None
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
        denominator = None if denominator is None else denominator[:, :, kept]
        return out[:, :, kept], denominator, final if final_state else None
    if pad and N > 1:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        log_gates = F.pad(log_gates, (0, pad))
        resets = F.pad(resets, (0, pad)) if resets is not None else None
    if N == 1:  # the step appends the ones column itself (or adds the key to its state's)
        out, final = recurrent_step(q, k, v, log_gates, initial_state, resets, update_in_place, with_denominator)
    else:
        if with_denominator:  # a ones column: these paths' products are per chunk, not the bulk
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        out, final = gated_chunks(q, k, v, log_gates, initial_state, C, resets, dtype)
        out = out[:, :, :N]
    if with_denominator:  # one split: its backward joins the two gradients, where slices would each fill a zero one
        out, denominator = out.split([out.shape[-1] - 1, 1], dim=-1)
        if divide_eps is not None:
            out = divide_rows(out, denominator, divide_eps)[0]
        return out, denominator, final if final_state else None
    return out, None, final if final_state else None


def uniform_decay(log_gates, initial_state, resets, known=None):
    """The log decay per head (H,) when ``log_gates`` (B, H, N) hold one value <= 0 per head at every token that
    counts (the first one only with an initial state), as a decay by position over consecutive positions gives
    (PermuteFormer's): the ungated chunked product then applies it itself, much faster than the general gated
    product. None otherwise, and for gates that want a gradient. ``known`` (H,): that value where the caller
    knows it, taken without the look at every gate (a read on the host)."""
    if log_gates is None or resets is not None or (log_gates.requires_grad and torch.is_grad_enabled()):
        return None
    if known is not None:
        return known.to(log_gates.dtype)
    counted = log_gates if initial_state is not None else log_gates[..., 1:]
    per_head = counted[:1, :, :1]  # (1, H, 1)
    if not bool(((counted == per_head) & (per_head <= 0)).all()):
        return None
    return per_head[0, :, 0]
