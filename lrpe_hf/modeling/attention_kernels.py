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

from .gradients import wants_gradient
from .products_custom_op import compiled_causal_product
from .products_dispatch import ProductCall, eager_causal_product, kernel_backend_serves
from .products_shared import divide_rows, product_dtype


def bidirectional_linear_attention(q, k, v, documents=None, with_denominator=False, num_documents=None):
    """q, k (B, H, N, m); v (B, H, N, dv); documents (B, N) long document index per token, counted from each row's
    first, or None; ``num_documents``: more than any row's last index, where the caller knows it (else read on the
    host). Returns out (B, H, N, dv) and, ``with_denominator``, the denominator sum_t q_s . k_t (B, H, N, 1), else
    None."""
    if documents is None:
        out = q @ (k.transpose(-1, -2) @ v)
        return out, (q @ k.sum(-2).unsqueeze(-1)) if with_denominator else None
    if with_denominator:
        ones = torch.ones_like(v[..., :1])
        out, _ = bidirectional_linear_attention(q, k, torch.cat([v, ones], dim=-1), documents, False, num_documents)
        return out[..., :-1], out[..., -1:]
    documents = documents - documents[:, :1]
    if num_documents is None and torch.compiler.is_compiling():  # a count would be read on the host: none needed
        return documents_in_two_passes(q, k, v, documents), None
    num_documents = num_documents or int(documents.max()) + 1
    labels = torch.arange(num_documents, device=documents.device)
    one_hot = (documents[..., None] == labels).to(k.dtype)  # (B, N, D); F.one_hot would check its input on the host
    per_document = torch.einsum("bnd,bhnm,bhne->bhdme", one_hot, k, v)  # (B, H, D, m, dv)
    out = q[:, :, None] @ per_document  # (B, H, D, N, dv)
    return torch.einsum("bhdne,bnd->bhne", out, one_hot), None


def documents_in_two_passes(q, k, v, documents):
    """``bidirectional_linear_attention`` over documents (B, N) without their count: the causal product over each
    document (t <= s), the same over the tokens reversed (t >= s), less the token itself (counted twice)."""
    restarts = documents[:, 1:] != documents[:, :-1]  # (B, N - 1): token i + 1 starts a document
    no_restart = restarts.new_zeros(restarts.shape[0], 1)
    starts, reversed_starts = torch.cat([no_restart, restarts], 1), torch.cat([no_restart, restarts.flip(1)], 1)
    forward = causal_linear_attention(q, k, v, resets=starts, final_state=False)[0]
    flipped = (x.flip(2) for x in (q, k, v))
    backward = causal_linear_attention(*flipped, resets=reversed_starts, final_state=False)[0].flip(2)
    return forward + backward - (q * k).sum(-1, keepdim=True).to(v.dtype) * v


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
    counts (a decay by distance over default positions without padding), the product applies it as one decay per
    head (``uniform_decay``); without it the gates are taken as per-token gates, never looked at (on a GPU a look
    would be a host sync per call).

    ``final_state`` False: the caller keeps no final state (a call with no cache to continue); it is returned as
    None, and fla's path neither makes it (nor its key sums) nor is handed zeros for its gradient.

    ``backend``: ``torch`` (the products below), ``triton`` (fla's kernels, ``products_triton.py``; raises where
    they cannot run) or ``auto`` (fla's kernels where they can run, torch otherwise). The chunk size is the torch
    path's.
    """
    if divide_eps is not None and (not with_denominator or wants_gradient(q, k, v, initial_state, log_gates)):
        raise ValueError("divide_eps needs with_denominator=True and inputs that want no gradient")
    N, dtype = q.shape[2], product_dtype(q, v)
    # Compiled, the product is one opaque op in the graph: over several tokens, and for a decoding step that would
    # call fla's one-step kernel (which fla keeps out of compiled graphs); the torch path's step is plain ops.
    if torch.compiler.is_compiling() and (N > 1 or kernel_backend_serves(q, backend)):
        out, denominator, final = compiled_causal_product(
            q, k, v, log_gates, initial_state, chunk_size, resets, with_denominator, dtype, backend
        )
        if divide_eps is not None:
            out = divide_rows(out, denominator, divide_eps)[0]
        return out, denominator, final if final_state else None
    call = ProductCall(
        q, k, v, log_gates, initial_state, chunk_size, resets, with_denominator, divide_eps, backend, update_in_place,
        known_decay, final_state,
    )  # fmt: skip
    return eager_causal_product(call)
