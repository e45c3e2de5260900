"""The causal product as torch custom ops, for compiled graphs.

The products (``products_dispatch.eager_causal_product``: the torch chunked product, a custom autograd Function
that writes into scratch buffers, or fla's Triton kernels on a GPU) are made for eager execution: a compiler cannot
trace their buffers and ``out=`` writes, and would break the graph around them. Compiled, the layer calls them
through ``lrpe_hf::causal_product_*`` instead: one opaque op in the graph (and ``causal_product_backward_*`` in
the backward graph; ``*`` names this file's copy), around which the compiler fuses the elementwise work (feature
map, rotations, divisions) into few kernels; ``torch.compile(fullgraph=True)`` then holds for a training layer.

The backward op recomputes the product's forward with autograd and differentiates it (the eager products keep
their own saved tensors, which an op boundary cannot carry): one more forward of the product in each backward.

Shapes: q, k (B, H, N, m); v (B, H, N, dv); log_gates (B, H, N); initial_state (B, H, m, dv'); resets (B, N) bool.
Inputs arrive in the product's dtype (the caller casts them: autocast does not reach into an op); the final state
comes back in float32 whatever the inputs' dtype (fla's states are float32), the outputs in the inputs' dtype.
"""

import contextlib
from typing import Optional

import torch
from torch import Tensor

from .products_dispatch import ProductCall, eager_causal_product

EMPTY = (0,)  # the shape standing for "none" among an op's tensor outputs, which cannot be None
# One pair of ops per copy of this file: lrpe_hf's and a checkpoint's remote code can be loaded side by side.
COPY = __name__.replace(".", "_")


def eager_product(q, k, v, log_gates, initial_state, resets, chunk_size, with_denominator, backend):
    with torch.autocast(q.device.type, enabled=False):
        chunk_size = chunk_size or None
        return eager_causal_product(
            ProductCall(q, k, v, log_gates, initial_state, chunk_size, resets, with_denominator, backend=backend)
        )


@torch.library.custom_op(f"lrpe_hf::causal_product_{COPY}", mutates_args=())
def causal_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_gates: Optional[Tensor],
    initial_state: Optional[Tensor],
    resets: Optional[Tensor],
    chunk_size: int,
    with_denominator: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out (B, H, N, dv), the denominator (B, H, N, 1) or an empty tensor, the final state (B, H, m, dv') in
    float32): ``causal_linear_attention``'s results; ``chunk_size`` 0 for its default."""
    out, denominator, final = eager_product(
        q, k, v, log_gates, initial_state, resets, chunk_size, with_denominator, backend
    )
    # contiguous, as the fake implementation says, and no output aliasing another (out and the denominator can be
    # two views of one tensor)
    denominator = denominator.clone(memory_format=torch.contiguous_format) if denominator is not None else None
    return out.contiguous(), q.new_empty(EMPTY) if denominator is None else denominator, final.float().contiguous()


@causal_product.register_fake
def _(q, k, v, log_gates, initial_state, resets, chunk_size, with_denominator, backend):
    B, H, N, m = q.shape
    dv = v.shape[-1]
    denominator = q.new_empty((B, H, N, 1) if with_denominator else EMPTY)
    final = q.new_empty(B, H, m, dv + with_denominator, dtype=torch.float32)
    return q.new_empty(B, H, N, dv), denominator, final


@contextlib.contextmanager
def recording_autograd():
    """A context in which autograd records inside an op's body: the dispatcher runs a custom op's body below
    autograd (its keys excluded from dispatch, grad mode off), which ``torch.enable_grad`` alone does not undo."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        excluded = excluded.remove(getattr(torch._C.DispatchKey, key))
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, excluded), torch.enable_grad():
        yield


@torch.library.custom_op(f"lrpe_hf::causal_product_backward_{COPY}", mutates_args=())
def causal_product_backward(
    grad_out: Tensor,
    grad_denominator: Tensor,
    grad_final: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_gates: Optional[Tensor],
    initial_state: Optional[Tensor],
    resets: Optional[Tensor],
    chunk_size: int,
    with_denominator: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of q, k, v, log_gates and initial_state (an empty tensor for an input that is None)."""
    inputs = [x.detach().requires_grad_() if x is not None else None for x in (q, k, v, log_gates, initial_state)]
    with recording_autograd():
        out, denominator, final = eager_product(*inputs, resets, chunk_size, with_denominator, backend)
        outputs, grads = [out, final.float()], [grad_out, grad_final]
        if with_denominator:
            outputs.append(denominator)
            grads.append(grad_denominator)
        wanted = [x for x in inputs if x is not None]
        computed = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
    results = []
    for x in inputs:
        grad = next(computed) if x is not None else None
        if x is None:
            results.append(q.new_empty(EMPTY))
        else:  # in the input's memory layout, as the fake implementation says
            results.append(torch.zeros_like(x) if grad is None else torch.empty_like(x).copy_(grad))
    return tuple(results)


@causal_product_backward.register_fake
def _(grad_out, grad_denominator, grad_final, q, k, v, log_gates, initial_state, resets, *options):
    return tuple(q.new_empty(EMPTY) if x is None else torch.empty_like(x) for x in (q, k, v, log_gates, initial_state))


def save_inputs(ctx, inputs, output):
    q, k, v, log_gates, initial_state, resets, chunk_size, with_denominator, backend = inputs
    ctx.save_for_backward(q, k, v, log_gates, initial_state, resets)
    ctx.options = chunk_size, with_denominator, backend


def backward(ctx, grad_out, grad_denominator, grad_final):
    q, k, v, log_gates, initial_state, resets = ctx.saved_tensors
    grads = causal_product_backward(
        grad_out, grad_denominator, grad_final, q, k, v, log_gates, initial_state, resets, *ctx.options
    )
    kept = [grad if x is not None else None for grad, x in zip(grads, (q, k, v, log_gates, initial_state))]
    return (*kept, None, None, None, None)


causal_product.register_autograd(backward, setup_context=save_inputs)


def compiled_causal_product(q, k, v, log_gates, initial_state, chunk_size, resets, with_denominator, dtype, backend):
    """``causal_linear_attention``'s results through the custom op: q, k, v cast to ``dtype`` (the product's) first,
    the final state back in that dtype. Returns out, the denominator or None, the final state."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    out, denominator, final = causal_product(
        q, k, v, log_gates, initial_state, resets, chunk_size or 0, with_denominator, backend
    )
    return out, denominator if with_denominator else None, final.to(dtype)
