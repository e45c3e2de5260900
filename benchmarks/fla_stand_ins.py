"""fla's kernels stood in for on the CPU: the causal product's GPU path run on CPU tensors, for counting its ops
(``count_ops.py``), estimating its time (``roofline.py``) and timing the host's work around it (``host_cost.py``).

``fla_path`` makes CPU tensors take the GPU path (``products_triton``'s mapping, as on a GPU) with fla's kernels
replaced by stand-ins: fla's own torch references (``naive.py``, which compute what the kernels compute:
``reference_kernels``), or functions that give results of the right shapes only (``shape_kernels``). Each stood-in
call runs in a profiler range named ``fla-launches:N:kernel``, which the counting rule counts as fla's N launches
(``FLA_LAUNCHES``), not as the reference's own ops.
"""

import contextlib
import importlib.util
import sys
from pathlib import Path

import torch
from torch.profiler import record_function

STAND_IN_PREFIX = "fla-launches:"  # a record_function range that counts as this many launches, its children not

# fla-core 0.6.0's chunk_simple_gla, as the stand-ins count it
FLA_CHUNK = 64  # chunk_simple_gla's chunk size (fla-core 0.6.0 default)
FLA_LAUNCHES = {"forward": 2, "backward": 4}  # chunk_simple_gla's kernels: chunk_fwd_h, chunk_fwd_o; backward
# chunk_fwd_h (recomputed), chunk_bwd_dh, chunk_bwd_dqkwg, chunk_bwd_dv (fla-core 0.6.0, ops/simple_gla/chunk.py);
# per-token gates add a chunk_local_cumsum each way
FLA_STEP_LAUNCHES = 1  # fused_recurrent_simple_gla: one kernel per decoding step


def fla_references():
    """fla-core's torch references of chunk_simple_gla and fused_recurrent_simple_gla (``naive.py``, loaded from its
    file: importing fla needs a GPU driver), or None where fla-core is not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        return None
    path = Path(spec.submodule_search_locations[0]) / "ops" / "simple_gla" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_simple_gla_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


STAND_IN_CALLS = []  # (kernel, direction, (B, N, H, K), V) of each stood-in call, for the roofline
_inside_stand_in = [0]  # > 0 while a stand-in computes: ``OpBytes`` records none of its ops


def gates(q, g, g_gamma):
    """fla's gate arguments as the references take them: per-token log gates (B, N, H) in float32."""
    if g is not None:
        return g.float()
    per_head = g_gamma.float() if g_gamma is not None else q.new_zeros(q.shape[2], dtype=torch.float32)
    return per_head.expand(*q.shape[:3])


class StandInKernel(torch.autograd.Function):
    """One of fla's kernels stood in by a torch function with its results: forward and backward each in one
    profiler range that counts as fla's launches (``STAND_IN_PREFIX``), the stand-in's own ops not counted."""

    @staticmethod
    def forward(ctx, reference, launches, q, k, v, g, g_gamma, initial_state, output_final_state=True):
        ctx.reference, ctx.launches = reference, launches
        ctx.save_for_backward(q, k, v, g, g_gamma, initial_state)
        STAND_IN_CALLS.append((reference.__name__, "forward", tuple(q.shape), v.shape[-1]))
        with record_function(f"{STAND_IN_PREFIX}{launches['forward']}:{reference.__name__}"):
            _inside_stand_in[0] += 1
            try:
                out, final = reference(q, k, v, gates(q, g, g_gamma), initial_state)
                # fla returns its output in q's dtype, contiguous (B, N, H, V), and no final state unless asked for one
                return out.to(q.dtype).contiguous(), final if output_final_state else None
            finally:
                _inside_stand_in[0] -= 1

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        needs = ctx.needs_input_grad[2:8]  # q, k, v, g, g_gamma, initial_state
        inputs = [
            x.detach().requires_grad_(need) if x is not None else None for x, need in zip(ctx.saved_tensors, needs)
        ]
        STAND_IN_CALLS.append((ctx.reference.__name__, "backward", tuple(inputs[0].shape), inputs[2].shape[-1]))
        with record_function(f"{STAND_IN_PREFIX}{ctx.launches['backward']}:{ctx.reference.__name__}_backward"):
            _inside_stand_in[0] += 1
            try:
                with torch.enable_grad():
                    q, k, v, g, g_gamma, initial_state = inputs
                    out, final = ctx.reference(q, k, v, gates(q, g, g_gamma), initial_state)
                    out = out.to(q.dtype)
                    wanted = [x for x, need in zip(inputs, needs) if need]
                    outputs = ((out, grad_out), (final, grad_final))
                    pairs = [(y, dy) for y, dy in outputs if y.requires_grad and dy is not None]
                    grads = torch.autograd.grad(
                        [y for y, _ in pairs], wanted, [dy for _, dy in pairs], allow_unused=True
                    )
                # fla writes each gradient into a new contiguous tensor of its input's shape
                grads = iter([None if g is None else g.contiguous() for g in grads])
                return (None, None, *[next(grads) if need else None for need in needs], None)
            finally:
                _inside_stand_in[0] -= 1


def reference_kernels():
    """fla's kernels as (chunk, step) torch functions of (q, k, v, g, initial_state) -> (out, final state): fla's own
    torch references (``naive.py``), which compute what the kernels compute."""
    naive = fla_references()
    if naive is None:
        raise SystemExit(
            "the fla path needs fla-core installed (pip install -e '.[gpu]'): its torch references stand in"
        )

    def chunk_simple_gla(q, k, v, g, initial_state):
        return naive.naive_chunk_simple_gla(q, k, v, g, initial_state, True, FLA_CHUNK, 1.0)

    def fused_recurrent_simple_gla(q, k, v, g, initial_state):
        return naive.naive_recurrent_simple_gla(q, k, v, g, 1.0, initial_state, True)

    return chunk_simple_gla, fused_recurrent_simple_gla


def shape_kernels():
    """fla's kernels as functions giving results of the right shapes and dtypes only (zeros): for the roofline's
    shape-only run, where values do not matter and the kernels' cost is fla_chunk_cost's."""

    def chunk_simple_gla(q, k, v, g, initial_state):
        B, N, H, K = q.shape
        V = v.shape[-1]
        out = q.new_zeros(B, N, H, V, dtype=torch.float32) + 0 * (q.sum() + k.sum() + v.sum())  # differentiable
        return out, q.new_zeros(B, H, K, V, dtype=torch.float32)

    chunk_simple_gla.__name__ = "chunk_simple_gla"
    return chunk_simple_gla, chunk_simple_gla


def stand_in_kernels(chunk_reference, step_reference):
    """(chunked, one_step) with fla's signatures, computing with the given references, each under
    ``torch.compiler.disable`` as fla's own entry points are (``chunk_simple_gla`` is decorated so, and fla's
    backend dispatch wraps ``fused_recurrent_simple_gla`` so), so that dynamo breaks its graph where it would on
    a GPU."""

    @torch.compiler.disable
    def chunked(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, **kwargs):
        extra = int(g is not None)  # chunk_local_cumsum of per-token gates, each way
        launches = {"forward": FLA_LAUNCHES["forward"] + extra, "backward": FLA_LAUNCHES["backward"] + extra}
        return StandInKernel.apply(chunk_reference, launches, q, k, v, g, g_gamma, initial_state, output_final_state)

    @torch.compiler.disable
    def one_step(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, **kwargs):
        launches = {"forward": FLA_STEP_LAUNCHES, "backward": 0}
        return StandInKernel.apply(step_reference, launches, q, k, v, g, g_gamma, initial_state, output_final_state)

    return chunked, one_step


@contextlib.contextmanager
def fla_path(kernels=None, stand_ins=None):
    """With ``kernels`` ((chunk, step) references), CPU tensors take the causal product's GPU path: the device test
    answers yes (``can_run``'s other reasons still count, on a GPU whose Triton runs fla's gated backward), and fla's
    kernels are stand-ins computing with them (``stand_in_kernels``); ``stand_ins``: (chunked, one_step) with fla's
    signatures, taken as they are instead."""
    if kernels is None and stand_ins is None:
        yield
        return
    from lrpe_hf.modeling import products_triton

    # every module that tests for fla's device, products_triton's own and those importing its test by name
    device_tests = [
        m for n, m in list(sys.modules.items()) if n.startswith("lrpe_hf.") and hasattr(m, "on_kernel_device")
    ]
    stand_ins = stand_ins or stand_in_kernels(*kernels)
    saved = [(module, "on_kernel_device", module.on_kernel_device) for module in device_tests]
    saved += [(products_triton, name, getattr(products_triton, name)) for name in ("load_fla", "gated_backward_fails")]
    for module in device_tests:
        module.on_kernel_device = lambda x: True
    products_triton.gated_backward_fails = lambda dtype: False  # Triton >= 3.7.1 runs fla's gated backward
    products_triton.load_fla = lambda: (stand_ins, None)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def on_fla(name: str):
    """The references a ``+fla`` model's product computes with, or None for the torch path."""
    return reference_kernels() if name.endswith("+fla") else None
