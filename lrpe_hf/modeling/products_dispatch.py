"""The causal product outside compiled graphs: a table of backends, one chosen per call.

``attention_kernels.causal_linear_attention`` says what it computes and is the entry the attention paths call;
compiled, it reaches this dispatch through the custom op (``products_custom_op.py``), so the dispatch sits below
both and imports neither.

Each backend is registered here once (``register_causal_product_backend``) with the three things the rest of the
library asks of it: whether it can compute a call's product (``why_not``), how (``run``) and whether it serves a
tensor's device (``serves``: the device question, asked of this table only, through ``kernel_backend_serves``; a
served device's product reads the projections' tokens-first layout in place, and compiled, a decoding step's
product stays one op). ``kernel_backend`` names one, or ``auto`` takes the first that can run, in the table's
order, ``torch`` (which runs everything) last, as transformers picks an attention implementation. A third backend
(a CUDA kernel of one's own, fla's newer ops) registers before ``torch`` and must pass what fla's does:
``tests/test_triton_adapter.py`` against the torch path and the O(N^2) reference.
"""

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch.nn import functional as F

from .gradients import wants_gradient
from .products_chunked import ChunkedCausalProduct
from .products_gated import gated_chunks, recurrent_step
from .products_shared import chunk_length, divide_rows, product_dtype
from .products_triton import can_run, fla_causal_product, on_kernel_device


class ProductCall(NamedTuple):
    """One causal product's arguments, as ``attention_kernels.causal_linear_attention`` takes them (see it for each),
    carried as one record from there to the backend that runs it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    log_gates: torch.Tensor | None = None
    initial_state: torch.Tensor | None = None
    chunk_size: int | None = None
    resets: torch.Tensor | None = None
    with_denominator: bool = False
    divide_eps: float | None = None
    backend: str = "auto"
    update_in_place: bool = False
    known_decay: torch.Tensor | None = None
    final_state: bool = True


@dataclass(frozen=True)
class CausalProductBackend:
    """One implementation of the causal product.

    why_not(q, v, dtype, gated_backward): None where it computes this call's product correctly, else the reason;
        q (B, H, N, m), v (B, H, N, dv), ``dtype`` the product's, ``gated_backward``: per-token gates that will want
        a gradient.
    run(call, dtype, decay): (out, denominator or None, final state or None) as ``causal_linear_attention`` returns
        them, for ``call`` (a ``ProductCall``) in the product's ``dtype``; ``decay`` (H,): one log decay per head,
        to be taken instead of the call's per-token ``log_gates``, or None.
    serves(x): whether it runs products on x's device (one the torch products are the fallback for).
    """

    why_not: Callable
    run: Callable
    serves: Callable


CAUSAL_PRODUCT_BACKENDS: dict[str, CausalProductBackend] = {}


def register_causal_product_backend(name: str, backend: CausalProductBackend):
    """Add ``backend`` as ``kernel_backend=name``; ``auto`` tries it after those registered before it, before
    ``torch``."""
    if name in CAUSAL_PRODUCT_BACKENDS or name == "auto":
        raise ValueError(f"the causal product backend {name!r} is registered already")
    CAUSAL_PRODUCT_BACKENDS[name] = backend


def kernel_backends() -> tuple[str, ...]:
    """The valid ``kernel_backend`` values."""
    return ("auto", *CAUSAL_PRODUCT_BACKENDS)


def in_auto_order() -> list[str]:
    return [name for name in CAUSAL_PRODUCT_BACKENDS if name != "torch"] + ["torch"]


def kernel_backend_serves(x, backend: str = "auto") -> bool:
    """Whether a backend other than torch's, among those ``backend`` allows, serves x's device (q or its features):
    its product reads the tokens-first layout in place (the paths keep it rather than copy heads-first)."""
    names = in_auto_order() if backend == "auto" else [backend]
    return any(CAUSAL_PRODUCT_BACKENDS[name].serves(x) for name in names if name != "torch")


def chosen_backend(backend: str, q, v, dtype, gated_backward: bool) -> str:
    """The backend that runs this call: ``backend`` itself (raising, with the reason, where it cannot run), or for
    ``auto`` the first in order that can."""
    if backend != "auto":
        why_not = CAUSAL_PRODUCT_BACKENDS[backend].why_not(q, v, dtype, gated_backward)
        if why_not:
            raise ValueError(
                f"kernel_backend={backend!r} cannot run this product: {why_not}; 'auto' falls back to torch"
            )
        return backend
    return next(n for n in in_auto_order() if CAUSAL_PRODUCT_BACKENDS[n].why_not(q, v, dtype, gated_backward) is None)


def eager_causal_product(call: ProductCall):
    """``attention_kernels.causal_linear_attention`` outside compiled graphs, for its ``call``: the same results."""
    q, v, log_gates = call.q, call.v, call.log_gates
    dtype = product_dtype(q, v)
    # One decay per head (the torch path's ungated product, much faster than its gated one; no gated backward for
    # fla) only where the caller knows it: looking at the gates would be a read on the host (a sync) per call
    decay = uniform_decay(log_gates, call.resets, call.known_decay) if q.shape[2] > 1 else None
    gated_backward = (
        log_gates is not None and decay is None and wants_gradient(q, call.k, v, log_gates, call.initial_state)
    )
    return CAUSAL_PRODUCT_BACKENDS[chosen_backend(call.backend, q, v, dtype, gated_backward)].run(call, dtype, decay)


def fla_run(call: ProductCall, dtype, decay):
    """fla-core's Triton kernels (``products_triton``); the division, where asked, after them."""
    log_gates = None if decay is not None else call.log_gates
    out, denominator, final = fla_causal_product(
        call.q, call.k, call.v, log_gates, decay, call.initial_state, call.resets, call.with_denominator, dtype,
        final_state=call.final_state,
    )  # fmt: skip
    if call.divide_eps is not None:
        out = divide_rows(out, denominator, call.divide_eps)[0]
    return out, denominator, final if call.final_state else None


def torch_run(call: ProductCall, dtype, decay):
    """The torch products: ungated inputs and one decay per head take ``ChunkedCausalProduct`` (dividing as it goes
    where asked), per-token gates ``gated_chunks``, a one-token step ``recurrent_step``."""
    q, k, v, log_gates, initial_state, resets = call.q, call.k, call.v, call.log_gates, call.initial_state, call.resets
    with_denominator, divide_eps, final_state = call.with_denominator, call.divide_eps, call.final_state
    B, H, N, m = q.shape
    C = chunk_length(N, call.chunk_size)
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
        out, final = recurrent_step(q, k, v, log_gates, initial_state, resets, call.update_in_place, with_denominator)
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


register_causal_product_backend(
    "triton", CausalProductBackend(why_not=can_run, run=fla_run, serves=lambda x: on_kernel_device(x))
)
register_causal_product_backend(
    "torch",
    CausalProductBackend(why_not=lambda q, v, dtype, gated_backward: None, run=torch_run, serves=lambda x: True),
)
