"""Speed and memory of the attention layer, per positional encoding, next to softmax attention (SDPA).

Two parts, measured side by side in one run (the machine may be shared and noisy, so compare ratios):

1. Kernels: causal attention alone from q, k, v (B=1, 8 heads x 64), forward and forward+backward: SDPA against
   the chunked linear-attention product (elu features) as the layers run it, with its denominator, its division
   and its final state (``kernel_backend`` auto: fla-core's Triton kernels for CUDA tensors where installed) and,
   on CUDA with fla-core, fla's own normalised linear attention doing the same work (``chunk_linear_attn`` with
   ``normalize=True``: the denominator from key prefix sums, and the final state).
2. Layers: ``LinearAttention`` (hidden 512, 8 heads) per encoding, causal and bidirectional: forward time,
   forward+backward time and peak memory of forward+backward, next to the same layer with softmax attention,
   and next to the layer's floor: its four projections alone (forward, and forward+backward), in the same child.
   On CUDA with the ``flash-linear-attention`` package, fla's own layer (``fla.layers.LinearAttention``, elu map,
   the same denominator, no output norm) is the layer baseline (row ``fla-layer``).

On a CPU every configuration runs in a child process, so that its peak resident memory can be read; on
CUDA it runs in this process and its memory is the allocator's peak, reset before it.
Writes ``results.csv``, every timed round in ``results_rounds.csv``, ``results.md``, ``results.png`` and
``results.json`` (the command, commit, machine and date) to ``--out`` and prints the summary of ratios.

    python benchmarks/benchmark_attention.py                   # 512 ... 32k tokens, every encoding
    python benchmarks/benchmark_attention.py --lengths 512 2048 --encodings none rope --device cuda
    python benchmarks/benchmark_attention.py --lengths 16384 --encodings none --compile   # and under torch.compile
    python benchmarks/benchmark_attention.py --device cuda --dtype bf16                    # bf16 autocast on a GPU
"""

import argparse
import importlib.util
from pathlib import Path

import torch
from measure import (
    allocator_note,
    in_child,
    medians_with_rounds,
    peak_memory_mb,
    resident_mb,
    round_rows,
    sample_alternately,
    write_csv,
    write_provenance,
)
from torch.nn import functional as F

import lrpe_hf
from lrpe_hf.modeling import products_triton
from lrpe_hf.modeling.attention_kernels import causal_linear_attention

HIDDEN, HEADS = 512, 8
FLOOR_KEYS = ("forward_ms", "train_ms", "floor_forward_ms", "floor_train_ms")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def kernel_call(kind, q, k, v):
    """One causal attention from q, k, v (B, H, N, 64) (features made beforehand for the linear kinds): the output,
    and for the linear kinds the final state, as a layer needs them."""
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if kind == "fla":  # fla's normalised linear attention, in its own layout (B, N, H, 64)
        from fla.ops.linear_attn import chunk_linear_attn

        out, _ = chunk_linear_attn(q, k, v, scale=1.0, output_final_state=True, normalize=True)
        return out
    out, denominator, _ = causal_linear_attention(q, k, v, with_denominator=True)
    return out / (denominator + 1e-6)


def measure_kernel(kind, tokens, device, reps, dtype=torch.float32):
    """One kernel row, in the child: forward and forward+backward milliseconds (median rounds; every round under
    ``rounds``)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, tokens, 64, device=device, dtype=dtype) for _ in range(3))
    if kind != "sdpa":
        q, k = F.elu(q) + 1, F.elu(k) + 1
    if kind == "fla":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]

    def train_step():
        kernel_call(kind, *inputs).float().sum().backward()

    with torch.no_grad():
        (forward,) = sample_alternately([lambda: kernel_call(kind, q, k, v)], device, reps)
    (train,) = sample_alternately([train_step], device, reps)
    return medians_with_rounds({"forward_ms": forward, "train_ms": train})


def kernel_row(kind, tokens, device, reps, dtype=torch.float32):
    return in_child(measure_kernel, device, kind, tokens, device, reps, dtype)


def fla_layer(hidden, heads):
    """flash-linear-attention's own linear-attention layer, configured as ours: elu features, the denominator
    (``do_feature_map_norm``), no output norm."""
    from fla.layers import LinearAttention as FlaLinearAttention

    return FlaLinearAttention(
        mode="chunk", hidden_size=hidden, num_heads=heads, feature_map="elu", do_feature_map_norm=True,
        output_norm="identity",
    )  # fmt: skip


def measure_layer(encoding, attention, causal, tokens, device, reps, compile_layer=False, dtype=torch.float32):
    """One layer row, in the child: forward and forward+backward milliseconds, the projections' floor (median
    rounds; every round under ``rounds``), peak memory."""
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    baseline = resident_mb()
    if attention == "fla":
        layer = fla_layer(HIDDEN, HEADS).to(device)
    else:
        options = dict(positional_encoding=encoding, causal=causal, attention=attention, max_positions=tokens)
        layer = lrpe_hf.LinearAttention(HIDDEN, HEADS, **options).to(device)
    run_layer = torch.compile(layer) if compile_layer else layer
    x = torch.randn(1, tokens, HIDDEN, device=device, requires_grad=True)

    autocast = torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32)

    def train_step():
        with autocast:
            out = run_layer(x)
        out = out[0] if isinstance(out, tuple) else out  # fla's layer returns (out, attentions, cache)
        out.float().sum().backward()

    names = ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj")  # ours: qkv_proj and o_proj; fla's: four
    own_projections = [getattr(layer, name) for name in names if hasattr(layer, name)]

    def projections():  # the floor: the layer's projections alone, on inputs of the same shape
        return [proj(x) for proj in own_projections]

    def projections_step():
        with autocast:
            outs = projections()
        sum(out.float().sum() for out in outs).backward()

    train_step()
    memory = peak_memory_mb(device, baseline)
    with torch.no_grad(), autocast:
        forward, floor_forward = sample_alternately([lambda: run_layer(x), projections], device, reps)
    train, floor_train = sample_alternately([train_step, projections_step], device, reps)
    samples = dict(forward_ms=forward, train_ms=train, floor_forward_ms=floor_forward, floor_train_ms=floor_train)
    return {"peak_mb": memory} | medians_with_rounds(samples)


def layer_row(encoding, attention, causal, tokens, device, reps, compile_layer=False, dtype=torch.float32):
    return in_child(measure_layer, device, encoding, attention, causal, tokens, device, reps, compile_layer, dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--encodings", nargs="+", default=list(lrpe_hf.POSITIONAL_ENCODINGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--softmax-max", type=int, default=16384, help="longest input for softmax attention")
    parser.add_argument("--spe-conv-max", type=int, default=8192, help="longest input for spe_conv (H*N*D*R codes)")
    parser.add_argument("--modes", nargs="+", default=["causal", "bidirectional"], choices=["causal", "bidirectional"])
    parser.add_argument("--compile", action="store_true", help="also time each linear layer under torch.compile")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="bf16: autocast (layers) and bf16 kernels")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[args.dtype]
    print(f"device: {args.device}, dtype {args.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.device == "cpu":
        print(allocator_note())

    rows, timed_rounds = [], []

    def add_row(key, result):
        timed_rounds.extend(round_rows(key, result.pop("rounds", {})))  # a failed child has none
        rows.append(key | result)
        print(rows[-1], flush=True)

    for tokens in args.lengths:
        kinds = ["sdpa", "linear"] + (["fla"] if args.device == "cuda" and products_triton.fla_installed() else [])
        for kind in kinds:
            if kind == "sdpa" and tokens > args.softmax_max:
                continue
            key = {"part": "kernel", "name": kind, "mode": "causal", "tokens": tokens}
            add_row(key, kernel_row(kind, tokens, args.device, args.reps, dtype))
    variants = [(e, "linear") for e in args.encodings] + [("none", "softmax"), ("rope", "softmax")]
    if args.compile:
        variants += [(e, "compiled") for e in args.encodings]
    if args.device == "cuda" and importlib.util.find_spec("fla.layers") is not None:
        variants += [("none", "fla")]
    for causal in [mode == "causal" for mode in args.modes]:
        for tokens in args.lengths:
            for encoding, attention in variants:
                if attention == "softmax" and tokens > args.softmax_max:
                    continue
                if encoding == "spe_conv" and tokens > args.spe_conv_max:
                    continue
                if attention == "fla" and not causal:
                    continue
                compiled = attention == "compiled"
                result = layer_row(
                    encoding,
                    "linear" if compiled else attention,
                    causal,
                    tokens,
                    args.device,
                    args.reps,
                    compiled,
                    dtype,
                )
                names = {"linear": encoding, "softmax": f"softmax+{encoding}", "compiled": f"compiled {encoding}"}
                name = names.get(attention, "fla-layer")
                mode = "causal" if causal else "bidirectional"
                add_row({"part": "layer", "name": name, "mode": mode, "tokens": tokens}, result)

    files = write_tables(rows, timed_rounds, args.out)
    write_provenance(args.out / "results.json", args.device, files=files)
    plot(rows, args.out)
    print("\n".join(summary(rows)))


def write_tables(rows, timed_rounds, out):
    """``results.csv``, ``results_rounds.csv`` (every timed round) and ``results.md``; returns the CSVs' names."""
    fields = ["part", "name", "mode", "tokens", "forward_ms", "train_ms", "peak_mb", *FLOOR_KEYS[2:], "error"]
    files = [write_csv(out / "results.csv", fields, rows)]
    if timed_rounds:
        files.append(write_csv(out / "results_rounds.csv", list(timed_rounds[0]), timed_rounds))
    lines = [
        "| part | name | mode | tokens | forward ms | forward+backward ms | peak MB | floor forward ms | floor f+b ms"
        " |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["part"], r["name"], r["mode"], str(r["tokens"])]
        cells += [
            f"{r[k]:.1f}" if isinstance(r.get(k), float) else r.get("error", "")
            for k in ("forward_ms", "train_ms", "peak_mb", "floor_forward_ms", "floor_train_ms")
        ]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines + [""] + summary(rows)) + "\n")
    return files


def lookup(rows, part, name, mode, tokens, key):
    for r in rows:
        if (r["part"], r["name"], r["mode"], r["tokens"]) == (part, name, mode, tokens) and key in r:
            return r[key]
    return None


def summary(rows):
    lines = ["", "Summary (ratios from this run):"]
    for tokens in (1024, 4096, 16384):
        sdpa, linear = (lookup(rows, "kernel", k, "causal", tokens, "forward_ms") for k in ("sdpa", "linear"))
        if sdpa and linear:
            lines.append(
                f"- causal kernel at {tokens}: SDPA {sdpa:.1f} ms, linear {linear:.1f} ms, "
                f"speed-up {sdpa / linear:.1f}x"
            )
        ours, fla = (lookup(rows, "kernel", k, "causal", tokens, "train_ms") for k in ("linear", "fla"))
        if ours and fla:
            lines.append(f"- causal kernel forward+backward at {tokens}: ours {ours / fla:.2f}x fla's ({fla:.1f} ms)")
        ours, fla = (lookup(rows, "layer", k, "causal", tokens, "train_ms") for k in ("none", "fla-layer"))
        if ours and fla:
            lines.append(f"- causal layer fwd+bwd at {tokens}: none {ours / fla:.2f}x fla-layer ({fla:.0f} ms)")
    for mode in ("causal", "bidirectional"):
        for tokens in sorted({r["tokens"] for r in rows if r["part"] == "layer" and r["mode"] == mode}):
            row = {k: lookup(rows, "layer", "none", mode, tokens, k) for k in FLOOR_KEYS}
            if not all(row.values()):
                continue
            floor = row["floor_forward_ms"]
            line = (
                f"- {mode} layer (none) at {tokens}: forward {row['forward_ms']:.1f} ms = "
                f"{row['forward_ms'] / floor:.2f}x its projections ({floor:.1f} ms); "
                f"forward+backward {row['train_ms']:.1f} ms = {row['train_ms'] / row['floor_train_ms']:.2f}x theirs "
                f"({row['floor_train_ms']:.1f} ms)"
            )
            softmax = lookup(rows, "layer", "softmax+none", mode, tokens, "forward_ms")
            if softmax:
                ratio = softmax / row["forward_ms"]
                line += f"; softmax (SDPA) layer forward {softmax:.1f} ms: {ratio:.1f}x the linear layer's time"
            compiled = {k: lookup(rows, "layer", "compiled none", mode, tokens, k) for k in FLOOR_KEYS}
            if all(compiled.values()):  # over the projections measured beside the compiled layer, in its child
                line += (
                    f"; under torch.compile: forward {compiled['forward_ms'] / compiled['floor_forward_ms']:.2f}x, "
                    f"forward+backward {compiled['train_ms'] / compiled['floor_train_ms']:.2f}x"
                )
            lines.append(line)
    for mode in ("causal", "bidirectional"):
        base = lookup(rows, "layer", "none", mode, 4096, "train_ms")
        base_floor = lookup(rows, "layer", "none", mode, 4096, "floor_train_ms")
        if not base:
            continue
        for name in sorted({r["name"] for r in rows if r["part"] == "layer"}):
            t = lookup(rows, "layer", name, mode, 4096, "train_ms")
            floor = lookup(rows, "layer", name, mode, 4096, "floor_train_ms")
            if t:
                # also over the projections timed alternately beside each layer, which cancels the load the
                # machine had while that configuration ran
                steady = (
                    f", {100 * (t / floor / (base / base_floor) - 1):+.0f}% each over its floor"
                    if floor and base_floor
                    else ""
                )
                lines.append(
                    f"- {mode} forward+backward at 4096, {name}: {t:.0f} ms, "
                    f"overhead over none {100 * (t / base - 1):+.0f}%{steady}"
                )
    for name in sorted({r["name"] for r in rows if r["part"] == "layer"}):
        small, large = (lookup(rows, "layer", name, "causal", n, "peak_mb") for n in (8192, 32768))
        if small and large:
            lines.append(
                f"- peak memory {name}: {small:.0f} MB at 8k, {large:.0f} MB at 32k, ratio {large / small:.2f}"
            )
    return lines


def plot(rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    layer_rows = [r for r in rows if r["part"] == "layer" and r["mode"] == "causal" and "train_ms" in r]
    for name in dict.fromkeys(r["name"] for r in layer_rows):
        points = [(r["tokens"], r["train_ms"], r["peak_mb"]) for r in layer_rows if r["name"] == name]
        style = "--" if name.startswith("softmax") else "-"
        axes[0].plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=name)
        axes[1].plot([p[0] for p in points], [p[2] for p in points], style, marker="o", label=name)
    for kind in ("sdpa", "linear"):
        points = [
            (r["tokens"], r["forward_ms"])
            for r in rows
            if r["part"] == "kernel" and r["name"] == kind and "forward_ms" in r
        ]
        axes[2].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=kind)
    titles = [
        "causal layer, forward+backward (ms)",
        "causal layer, peak memory of forward+backward (MB)",
        "causal kernel alone, forward (ms)",
    ]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=110)


if __name__ == "__main__":
    main()
