"""The causal product outside compiled graphs: the torch products or fla's Triton kernels, chosen per call.

``attention_kernels.causal_linear_attention`` says what it computes and is the one entry the attention paths call;
compiled, it reaches this dispatch through the custom op (``products_custom_op.py``), so the dispatch sits below
both and imports neither.
"""

import torch
from torch.nn import functional as F

from .gradients import wants_gradient
from .products_chunked import ChunkedCausalProduct
from .products_gated import gated_chunks, recurrent_step
from .products_shared import chunk_length, divide_rows, product_dtype
from .products_triton import can_run, fla_causal_product


def eager_causal_product(
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
    """``attention_kernels.causal_linear_attention`` outside compiled graphs: the same arguments and results."""
    B, H, N, m = q.shape
    C, dtype = chunk_length(N, chunk_size), product_dtype(q, v)
    # One decay per head (the torch path's ungated product, much faster than its gated one; no gated backward for
    # fla) only where the caller knows it: looking at the gates would be a read on the host (a sync) per call
    gated_backward = log_gates is not None and wants_gradient(q, k, v, log_gates, initial_state)
    why_not = "the torch backend was chosen" if backend == "torch" else can_run(q, v, dtype, gated_backward)
    decay = uniform_decay(log_gates, resets, known_decay) if N > 1 else None
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


def uniform_decay(log_gates, resets, known=None):
    """The log decay per head (H,) that ``log_gates`` (B, H, N) hold at every token that counts, where the caller
    knows it (``known`` (H,): a decay by distance over default positions without padding, PermuteFormer's), for
    gates that want no gradient and rows without resets; None otherwise. The gates themselves are never looked at
    (on a GPU, a read on the host per call)."""
    if known is None or log_gates is None or resets is not None:
        return None
    if log_gates.requires_grad and torch.is_grad_enabled():
        return None
    return known.to(log_gates.dtype)
