"""A roofline of an H100 train step: an estimate that stands in for a GPU, from the ops ``count_ops.py`` counts.

An ESTIMATE, not a measurement, of one layer's bf16 train step (forward and
backward) on an H100 at 8k and 32k tokens, batch 1, for LinearGPT's default layer (``--encodings``:
the default encoding and ``none``) and GPT-2's. Components:

- GEMMs: FLOPs of every matmul outside the attention product, from its shapes (the projections and the MLP:
  72 N d^2 for both models), each at ``GEMM_FRACTION`` of the dense bf16 peak or its bytes at HBM speed,
  whichever is slower;
- attention: fla's ``chunk_simple_gla`` for LinearGPT (``fla_chunk_cost``: FLOPs and bytes from its
  algorithm), SDPA's flash attention for GPT-2 (``flash_attention_flops``: 4 N^2 d per head forward, halved
  by the causal mask, backward 2.5x forward);
- other: the bytes every other op reads and writes, at ``HBM_FRACTION`` of HBM bandwidth;
- launches: the ops counted (fla's and flash attention's as their kernels), ``LAUNCH_SECONDS`` of host time
  each when not captured in a CUDA graph.

The ops, their shapes and dtypes come from a ``TorchDispatchMode`` (``OpBytes``; the profiler records each op's
input shapes but not its outputs nor, per tensor, its dtype) over a train step of the
layer (its input wanting a gradient, as inside a stack) at the same shapes under CPU bf16 autocast, run on
fake tensors (the same CPU code, shapes and dtypes, no arithmetic: bf16 matmuls run at ~9 GFLOP/s on this
CPU), the product on fla's path, dropout as a GPU runs it (``native_dropout``). The mode sees what reaches
the kernels (composite ops decomposed) and leaves out views and metadata as the counting rule does; each
op's bytes are its input and output tensors' (a broadcast dimension read once, an argument it writes counted
once). GPU time is the sum of the three kernel times (one stream); ``gpu_ms`` is also the step under a CUDA
graph, and eagerly the step takes the larger of it and the launches' host time. Every assumption is a named
constant below, with its source or reasoning.

Writes ``roofline.csv``, ``roofline.md`` and ``roofline.json`` (the command, commit, machine and date) to
``--output_dir`` and prints the table. ``benchmarks/gpu_check.py`` measures what this estimates, where a GPU is lent.

    python benchmarks/roofline.py                                     # the default encoding, none and GPT-2
"""

import argparse
import contextlib
import math
import sys
from pathlib import Path

import torch
from count_ops import GPT2, SIZE, build, computes, markdown, one_block, write_csv
from fla_stand_ins import FLA_CHUNK, FLA_LAUNCHES, STAND_IN_CALLS, _inside_stand_in, fla_path, shape_kernels
from measure import write_provenance
from torch.utils._python_dispatch import TorchDispatchMode

from lrpe_hf import LinearGPTConfig

# ---- The roofline's assumptions (one H100 SXM5, bf16) ----
H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak, FLOP/s (NVIDIA H100 SXM5 datasheet: 989.4 TFLOPS)
GEMM_FRACTION = 0.5  # of that peak reached by the layer's GEMMs (M = 8k..32k tokens, N and K 512 or 2,048); an
# assumption: large square bf16 GEMMs reach well above half, but a K of 512 leaves each output tile few steps of the
# K loop to hide its loads behind, and the weight-gradient GEMMs reduce over the 8k..32k tokens
H100_HBM_BYTES_PER_S = 3.35e12  # HBM3 bandwidth, bytes/s (NVIDIA H100 SXM5 datasheet)
HBM_FRACTION = 0.8  # of that bandwidth reached by elementwise and reduction kernels (an assumption: streaming
# kernels over tensors of megabytes and more come within 10-20% of the peak; the small ones do worse)
LAUNCH_SECONDS = 4e-6  # host time per kernel launch through PyTorch's eager dispatch when not in a CUDA graph (the
# issue's figure; the Python, dispatcher and driver overheads of one eager op add up to a few microseconds)
FLASH_ATTENTION_FLOPS = 290e12  # FLOP/s reached by FlashAttention-2 (SDPA's flash kernel) on an H100 SXM5 at head
# dim 64 and 8k-16k tokens: 284-324 TFLOPS/s forward, 287-291 backward (FlashAttention-3 paper, Shah et al. 2024,
# "Attention forward/backward speed, head dim 64" figures), counted with causal halving as below
FLASH_BACKWARD_OVER_FORWARD = 2.5  # backward FLOPs over forward's: 5 matmuls of N^2 d against 2 (with QK^T redone)
FLA_FLOP_FRACTION = 0.3  # of the bf16 peak reached by fla's chunk kernels (an assumption: C x C = 64 x 64 tiles,
# several small products per chunk); at these widths they are bound by memory anyway (about 40 FLOP per byte against
# the H100's ridge point of 989 / 3.35 = 295)
FLASH_LAUNCHES = {"forward": 1, "backward": 3}  # flash forward; backward: the dO . O preprocess, the main kernel,
# dq's conversion from float32
ROOFLINE_TOKENS = (8192, 32768)
BF16 = 2  # bytes per element of the attention product's inputs and outputs


GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv", "aten::addmv"}
ATTENTION_OPS = ("aten::_scaled_dot_product",)  # SDPA's kernels, forward and backward (flash_attention_for_cpu...)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (a broadcast dimension, stride 0, is read once)."""
    return math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0) * t.element_size()


def gemm_flops(name: str, args) -> int:
    """2 x the multiply-adds of a matmul-family op from its inputs' shapes."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    a, b = tensors[-2], tensors[-1]  # addmm/baddbmm/addbmm/addmv: (self, mat1, mat2)
    if name in ("aten::mv", "aten::addmv"):
        return 2 * a.shape[0] * a.shape[1]
    batch = a.shape[0] if a.dim() == 3 and name != "aten::addbmm" else 1
    if name == "aten::addbmm":
        batch = a.shape[0]
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class OpBytes(TorchDispatchMode):
    """Every ATen op that reaches the dispatcher's backends (composite ops arrive decomposed; views, metadata and the
    fla stand-ins' own work are left out, as the counting rule leaves them): its kind (gemm, attention, other),
    its FLOPs (matmuls) and the bytes of its input and output tensors (an argument it writes counted once, as an
    output)."""

    def __init__(self):
        super().__init__()
        self.ops = []  # (name, kind, flops, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if _inside_stand_in[0] or not name.startswith("aten::") or computes(name) == "skip":  # prim:: is metadata
            return out
        written = {id(value) for argument, value in zip(func._schema.arguments, args) if argument.alias_info
                   and argument.alias_info.is_write} | {id(kwargs[a.name]) for a in func._schema.arguments
                   if a.name in kwargs and a.alias_info and a.alias_info.is_write}  # fmt: skip
        leaves = torch.utils._pytree.tree_leaves
        inputs = [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) not in written]
        outputs = [t for t in leaves(out) if isinstance(t, torch.Tensor)]
        moved = sum(tensor_bytes(t) for t in inputs) + sum(tensor_bytes(t) for t in outputs)
        if name in GEMM_OPS:
            self.ops.append((name, "gemm", gemm_flops(name, args), moved))
        elif name.startswith(ATTENTION_OPS):
            self.ops.append((name, "attention", 0, moved))
        else:
            self.ops.append((name, "other", 0, moved))
        return out


def fla_chunk_cost(N: int, H: int, K: int, V: int, C: int = FLA_CHUNK, batch: int = 1) -> dict:
    """FLOPs and HBM bytes of fla's chunk_simple_gla, forward and backward, from its algorithm (fla-core 0.6.0,
    ops/simple_gla/chunk.py; N tokens, H heads, K query/key width, V value width, chunks of C, bf16 inputs):

    - forward: chunk_fwd_h runs the state across the N/C chunks, h <- h + K_c^T V_c (2 C K V per chunk) and stores
      each chunk's starting state (K x V, bf16); chunk_fwd_o computes O_c = Q_c h_c + tril(Q_c K_c^T) V_c
      (2 C K V + 2 C^2 K + 2 C^2 V per chunk): 4 N K V + 2 N C (K + V) FLOPs;
    - backward: chunk_fwd_h again (states in float32), chunk_bwd_dh (dh <- dh + Q_c^T dO_c), chunk_bwd_dqkwg
      (dq = dO h^T + (dO V^T o mask) K, dk = V dh^T + (dO V^T o mask)^T Q), chunk_bwd_dv
      (dv = tril(Q K^T)^T dO + K dh): 10 N K V + 6 N C K + 4 N C V FLOPs;

    in all 14 N K V + 8 N C K + 6 N C V FLOPs per head. Bytes: each kernel reads its inputs and writes its
    outputs once (tokens x width for q, k, v, o and their gradients at 2 bytes, the N/C states at 2 bytes in
    forward and 4 in backward)."""
    states = N // C * K * V  # elements of the per-chunk states
    flops = 14 * N * K * V + 8 * N * C * K + 6 * N * C * V
    forward = BF16 * (N * (K + V) + states) + (BF16 * (N * (2 * K + V) + states) + BF16 * N * V)
    backward = (
        BF16 * N * (K + V) + 4 * states  # chunk_fwd_h: k, v in; h out (float32)
        + BF16 * N * (K + V) + 4 * states  # chunk_bwd_dh: q, dO in; dh out
        + BF16 * N * (2 * K + 2 * V) + 2 * 4 * states + BF16 * 2 * N * K  # chunk_bwd_dqkwg: q, k, v, dO, h, dh; dq, dk
        + BF16 * N * (2 * K + V) + 4 * states + BF16 * N * V  # chunk_bwd_dv: q, k, dO, dh in; dv out
    )  # fmt: skip
    return {"flops": batch * H * flops, "bytes": batch * H * (forward + backward)}


def flash_attention_flops(N: int, d_model: int, batch: int = 1) -> float:
    """Causal flash attention's FLOPs, forward and backward, summed over heads: 4 N^2 d per head forward (QK^T and
    PV), halved by the causal mask, times 1 + FLASH_BACKWARD_OVER_FORWARD."""
    return batch * 4 * N * N * d_model / 2 * (1 + FLASH_BACKWARD_OVER_FORWARD)


@contextlib.contextmanager
def gpu_dropout():
    """``F.dropout`` in training as a GPU runs it, one ``native_dropout`` (on a CPU ATen's dropout makes a Bernoulli
    mask and multiplies twice)."""
    from torch.nn import functional as F

    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1:
            return torch.native_dropout(input, p, True)[0]
        return input

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


@contextlib.contextmanager
def kept_as_fakes(fake_mode):
    """In a shape-only run (``fake_mode``), the constant tensors the layers keep (``kept_tensors.kept_tensor``: the
    prefix sums' triangles of ones, the rotations' unit modulus) as fakes of the real ones: a real step reads them
    made once, so a fake one must not make them either (their ops would count as launches and bytes a real step
    does not have). Patched where the modules imported it; restored on exit."""
    from torch.utils._python_dispatch import _disable_current_modes

    from lrpe_hf.modeling import kept_tensors

    original = kept_tensors.kept_tensor

    def fake_of_the_kept(name, like, make):
        with _disable_current_modes():  # neither fake nor recorded: made (once) as a real step would have
            kept = original(name, torch.empty(0, dtype=like.dtype, device=like.device), make)
        return fake_mode.from_tensor(kept)

    users = [m for m in list(sys.modules.values()) if getattr(m, "kept_tensor", None) is original]
    for module in users if fake_mode is not None else []:
        module.kept_tensor = fake_of_the_kept
    try:
        yield
    finally:
        for module in users:
            module.kept_tensor = original


def layer_ops(name: str, tokens: int, size=SIZE, fake: bool = True) -> tuple[list, list]:
    """The ops (``OpBytes``) of one layer's bf16 train step (forward and backward of a random output gradient,
    the input wanting its gradient as inside a stack) at ``tokens`` tokens, batch 1, and the fla stand-in calls:
    a shape-only run (FakeTensorMode: the CPU code with the same shapes and dtypes, no arithmetic; a real bf16 run
    at 32k takes minutes on a CPU), after one unrecorded warm-up step, under CPU bf16 autocast, every input one
    block, the causal product on fla's path (LinearGPT) and dropout as a GPU runs it. ``fake=False``: a real run
    (the tests compare the two)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    STAND_IN_CALLS.clear()
    kernels = None if name == GPT2 else shape_kernels()
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode, kept_as_fakes(mode if fake else None), one_block(), fla_path(kernels), gpu_dropout():
        model = build(name, 1, tokens, size)
        layer = model.transformer.h[0] if name == GPT2 else model.model.stack.layers[0]
        layer.train()
        x = torch.randn(1, tokens, size["hidden"], requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a warm-up step: what a layer makes once is made
            warm = layer(x)
        (warm[0] if isinstance(warm, tuple) else warm).sum().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)  # as an optimizer step leaves them: the next backward writes, not adds
        STAND_IN_CALLS.clear()
        recorded = OpBytes()
        with recorded, torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        grad = torch.randn_like(out)
        with recorded:
            out.backward(grad)
    return recorded.ops, list(STAND_IN_CALLS)


def roofline_row(name: str, tokens: int, size=SIZE) -> dict:
    """One layer's estimated H100 bf16 train step, by component (see the module's docstring)."""
    ops, calls = layer_ops(name, tokens, size)
    gemm_time = sum(
        max(flops / (H100_BF16_FLOPS * GEMM_FRACTION), moved / (H100_HBM_BYTES_PER_S * HBM_FRACTION))
        for _, kind, flops, moved in ops
        if kind == "gemm"
    )
    gemm_flops_ = sum(flops for _, kind, flops, _ in ops if kind == "gemm")
    other_bytes = sum(moved for _, kind, _, moved in ops if kind == "other")
    launches = sum(1 for _, kind, _, _ in ops if kind != "attention")
    if name == GPT2:
        attention_flops = flash_attention_flops(tokens, size["hidden"])
        attention_bytes = sum(moved for _, kind, _, moved in ops if kind == "attention")
        attention_time = max(attention_flops / FLASH_ATTENTION_FLOPS, attention_bytes / H100_HBM_BYTES_PER_S)
        launches += sum(FLASH_LAUNCHES.values())
        attention = "SDPA flash"
    else:
        attention_flops = attention_bytes = attention_time = 0.0
        for _, direction, (B, N, H, K), V in calls:
            if direction != "forward":
                continue  # fla_chunk_cost counts forward and backward
            cost = fla_chunk_cost(N, H, K, V, batch=B)
            attention_flops += cost["flops"]
            attention_bytes += cost["bytes"]
            attention_time += max(
                cost["flops"] / (H100_BF16_FLOPS * FLA_FLOP_FRACTION),
                cost["bytes"] / (H100_HBM_BYTES_PER_S * HBM_FRACTION),
            )
            launches += sum(FLA_LAUNCHES.values())
        widths = sorted({f"{K}x{V}" for _, _, (_, _, _, K), V in calls})
        attention = f"fla chunk_simple_gla (K x V {', '.join(widths)})"
    other_time = other_bytes / (H100_HBM_BYTES_PER_S * HBM_FRACTION)
    gpu_time = gemm_time + attention_time + other_time
    launch_time = launches * LAUNCH_SECONDS
    return {
        "model": name,
        "length": f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens),
        "tokens": tokens,
        "gemm_gflop": gemm_flops_ / 1e9,
        "gemm_ms": 1e3 * gemm_time,
        "attention": attention,
        "attention_gflop": attention_flops / 1e9,
        "attention_gb": attention_bytes / 1e9,
        "attention_ms": 1e3 * attention_time,
        "other_gb": other_bytes / 1e9,
        "other_ms": 1e3 * other_time,
        "launches": launches,
        "launch_ms": 1e3 * launch_time,
        "gpu_ms": 1e3 * gpu_time,
        "eager_ms": 1e3 * max(gpu_time, launch_time),
    }


ROOFLINE_COLUMNS = ["model", "length", "gemm_gflop", "gemm_ms", "attention_gflop", "attention_gb", "attention_ms",
                    "other_gb", "other_ms", "launches", "launch_ms", "gpu_ms", "eager_ms", "gpt2_over_it"]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_encoding = LinearGPTConfig().positional_encoding
    parser.add_argument("--encodings", nargs="+", default=[default_encoding, "none"])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(ROOFLINE_TOKENS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the estimate does not depend on it)")
    parser.add_argument("--output_dir", "--out", type=Path, default=Path(__file__).parent / "results" / "roofline")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    roofline = []
    for tokens in args.tokens:
        rows = [roofline_row(name, tokens, SIZE) for name in [GPT2] + args.encodings]
        for row in rows:
            row["gpt2_over_it"] = round(rows[0]["gpu_ms"] / row["gpu_ms"], 3)
        roofline += rows
    write_provenance(args.output_dir / "roofline.json", "cpu", files=["roofline.csv"])
    write_csv(args.output_dir / "roofline.csv", roofline)
    report = [
        "Roofline ESTIMATE of one layer's bf16 train step on an H100 (not measured; assumptions in the script):",
        "",
        *markdown(roofline, ROOFLINE_COLUMNS),
    ]
    print("\n".join(report))
    (args.output_dir / "roofline.md").write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
