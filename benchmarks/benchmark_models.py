"""LinearGPT against Transformers' GPT-2 (SDPA) at the same size: training step and generation latency.

Both models: 6 layers x 512, 8 heads, FFN 2048, vocabulary 8192 (``--size`` changes some of these), batch 1, fp32
(or bf16 autocast with ``--dtype bf16``). Measured side by side in
one run, each configuration on a CPU in a child (peak memory of its own; on CUDA in this process, from a
reset allocator peak):

- forward+backward of one sequence of N tokens (LM loss): seconds, tokens/s, peak memory (growth, and on a CPU
  the child's VmHWM: its peak resident memory, the first step included);
- generation: milliseconds per new token after a prompt of C tokens (prefill with the cache, then one token
  at a time), and tokens/s at batch 8.

Writes ``models.csv``, every timed round in ``models_rounds.csv``, ``models.md``, ``models.png`` and ``models.json``
(the command, commit, machine and date) to ``--out`` and prints the summary of ratios.

    python benchmarks/benchmark_models.py
    python benchmarks/benchmark_models.py --lengths 512 4096 --contexts 256 4096 --encodings none permute
    python benchmarks/benchmark_models.py --device cuda --dtype bf16 --encodings none none+graphs   # CUDA graphs
    python benchmarks/benchmark_models.py --lengths 32 --contexts 8 --size layers=1 hidden=32 heads=2 ffn=64 vocab=256
"""

import argparse
import statistics
from pathlib import Path

import torch
from measure import (
    allocator_note,
    high_water_mark_mb,
    in_child,
    peak_memory_mb,
    resident_mb,
    round_rows,
    sample_alternately,
    write_csv,
    write_provenance,
)
from transformers import AutoModelForCausalLM, GPT2Config

from lrpe_hf import LinearAttentionCache, LinearGPTConfig, LinearGPTForCausalLM
from lrpe_hf.modeling.forward_arguments import CACHE_OUTPUT_FIELD  # the installed release's name for the cache

SIZE = dict(layers=6, hidden=512, heads=8, ffn=2048, vocab=8192)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def autocast(device, dtype):
    return torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32)


def size_item(item: str) -> tuple[str, int]:
    """One ``--size`` item, ``KEY=N``: an entry of SIZE replaced."""
    key, _, number = item.partition("=")
    if key not in SIZE or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"{item!r}: KEY=N, N > 0, KEY one of {', '.join(SIZE)}")
    return key, int(number)


def build(name, max_tokens, device, size=SIZE):
    """``gpt2-sdpa``, or a LinearGPT positional encoding, of ``size``; a ``+ckpt`` suffix turns on gradient
    checkpointing (a ``+compile`` suffix, decoding under ``torch.compile``, is applied by ``generation_row``)."""
    torch.manual_seed(0)
    encoding, _, variant = name.partition("+")
    if encoding == "gpt2-sdpa":
        config = GPT2Config(
            n_layer=size["layers"],
            n_embd=size["hidden"],
            n_head=size["heads"],
            n_inner=size["ffn"],
            vocab_size=size["vocab"],
            n_positions=max_tokens,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    else:
        config = LinearGPTConfig(
            num_hidden_layers=size["layers"],
            hidden_size=size["hidden"],
            num_attention_heads=size["heads"],
            intermediate_size=size["ffn"],
            vocab_size=size["vocab"],
            max_position_embeddings=max_tokens,
            positional_encoding=encoding,
        )
        model = LinearGPTForCausalLM(config)
    if variant == "ckpt":
        model.activation_checkpointing_enable()
    return model.to(device)


def measure_training(name, tokens, device, reps, dtype=torch.float32, size=SIZE):
    """One training row, in the child: seconds a step (the median round), tokens/s, peak memory, and every timed
    round's milliseconds (``rounds``)."""
    baseline = resident_mb()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = build(name, tokens, device, size).train()
    ids = torch.randint(0, size["vocab"], (1, tokens), device=device)

    def step():
        model.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()

    step()
    memory, high_water_mark = peak_memory_mb(device, baseline), high_water_mark_mb()
    (samples,) = sample_alternately([step], device, reps)
    seconds = statistics.median(samples) / 1000
    result = {"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_mb": memory}
    return result | ({"vm_hwm_mb": high_water_mark} if device == "cpu" else {}) | {"rounds": {"train step": samples}}


def train_row(name, tokens, device, reps, dtype=torch.float32, size=SIZE):
    return in_child(measure_training, device, name, tokens, device, reps, dtype, size)


def measure_generation(name, context, device, reps, batch=1, new_tokens=16, dtype=torch.float32, size=SIZE):
    """One decoding row, in the child (``generation_row`` says how it is timed), with every timed round's
    milliseconds per token (``rounds``)."""
    model = build(name, context + (reps + 1) * new_tokens + 1, device, size).eval()
    step = model
    if name.endswith("+compile"):
        step = torch.compile(model)
    elif name.endswith("+graphs"):
        step = torch.compile(model, mode="reduce-overhead")
    ids = torch.randint(0, size["vocab"], (batch, context), device=device)
    with torch.no_grad(), autocast(device, dtype):
        cache = LinearAttentionCache(size["layers"]) if not name.startswith("gpt2") else None
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_OUTPUT_FIELD: cache})  # prefill
        cache = out[CACHE_OUTPUT_FIELD]
        token = out.logits[:, -1:].argmax(-1)

        def one_token():
            nonlocal token
            out = step(input_ids=token, use_cache=True, **{CACHE_OUTPUT_FIELD: cache})
            token = out.logits[:, -1:].argmax(-1)

        (samples,) = sample_alternately([lambda: [one_token() for _ in range(new_tokens)]], device, reps)
    per_token = [ms / new_tokens for ms in samples]
    ms_per_token = statistics.median(per_token)
    rounds = {f"token (mean of {new_tokens} steps)": per_token}
    return {"ms_per_token": ms_per_token, "tokens_per_s": 1000 * batch / ms_per_token, "rounds": rounds}


def generation_row(name, context, device, reps, batch=1, new_tokens=16, dtype=torch.float32, size=SIZE):
    """Milliseconds per token of rounds of ``new_tokens`` one-token steps: a warm-up round, then the median of
    ``reps`` timed rounds (the context grows by ``new_tokens`` each round). With a ``+compile`` suffix the steps
    (not the prefill) run through ``torch.compile``, compiled during the warm-up round; with ``+graphs``, through
    ``torch.compile(mode="reduce-overhead")``, which on a GPU replays each step as a CUDA graph."""
    return in_child(measure_generation, device, name, context, device, reps, batch, new_tokens, dtype, size)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--contexts", type=int, nargs="*", default=[256, 4096, 16384, 65536])
    parser.add_argument("--batch-contexts", type=int, nargs="*", default=[256], help="contexts for batch-8 decoding")
    parser.add_argument(
        "--encodings",
        nargs="+",
        help="LinearGPT encodings; a +ckpt suffix adds gradient checkpointing (train steps only), a +compile suffix "
        "decodes under torch.compile, a +graphs suffix under torch.compile(mode='reduce-overhead') (decoding only)",
        default=[
            "none",
            "none+ckpt",
            "rope",
            "lrpe_orthogonal",
            "lrpe_unitary",
            "permute",
            "spe_sine",
            "fastrpb",
            "rope+compile",
            "lrpe_orthogonal+compile",
            "permute+compile",
        ],
    )
    parser.add_argument(
        "--gpt2-max",
        type=int,
        default=4096,
        help="longest GPT-2 input (at 8192, SDPA's math path keeps 12.9 GB of attention probabilities)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="bf16: under autocast")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--size",
        nargs="+",
        type=size_item,
        default=[],
        metavar="KEY=N",
        help="both models' size, some of its defaults (layers=6 hidden=512 heads=8 ffn=2048 vocab=8192) replaced: "
        "layers=1 hidden=32 heads=2 ffn=64 vocab=256, for example, runs every row in moments",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    size = SIZE | dict(args.size)
    args.out.mkdir(parents=True, exist_ok=True)
    names = ["gpt2-sdpa"] + args.encodings
    if args.device == "cpu":
        print(allocator_note(), flush=True)
    rows, timed_rounds = [], []

    def add_row(task, name, tokens, result):
        key = {"task": task, "model": name, "tokens": tokens}
        timed_rounds.extend(round_rows(key, result.pop("rounds", {})))  # a failed child has none
        rows.append(key | result)
        print(rows[-1], flush=True)

    for tokens in args.lengths:
        for name in [n for n in names if not n.endswith(("+compile", "+graphs"))]:
            if name == "gpt2-sdpa" and tokens > args.gpt2_max:
                continue
            add_row("train", name, tokens, train_row(name, tokens, args.device, args.reps, dtype, size))
    for context in args.contexts:
        for name in [n for n in names if not n.endswith("+ckpt")]:
            if name == "gpt2-sdpa" and context > args.gpt2_max:
                continue
            result = generation_row(name, context, args.device, args.reps, dtype=dtype, size=size)
            add_row("generate", name, context, result)
    for context in args.batch_contexts:
        for name in [n for n in names if not n.endswith("+ckpt")]:
            if name == "gpt2-sdpa" and context > args.gpt2_max:
                continue
            result = generation_row(name, context, args.device, args.reps, batch=8, dtype=dtype, size=size)
            add_row("generate-batch8", name, context, result)
    fields = ["task", "model", "tokens", "seconds", "tokens_per_s", "peak_mb", "vm_hwm_mb", "ms_per_token", "error"]
    files = [write_csv(args.out / "models.csv", fields, rows)]
    if timed_rounds:
        files.append(write_csv(args.out / "models_rounds.csv", list(timed_rounds[0]), timed_rounds))
    write_provenance(args.out / "models.json", args.device, files=files)
    lines = [
        "| task | model | tokens | seconds | tokens/s | peak MiB | VmHWM MiB | ms/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["task"], r["model"], str(r["tokens"])] + [
            f"{r[k]:.2f}" if isinstance(r.get(k), float) else r.get("error", "") if k == "seconds" else ""
            for k in ("seconds", "tokens_per_s", "peak_mb", "vm_hwm_mb", "ms_per_token")
        ]
        lines.append("| " + " | ".join(cells) + " |")
    report = lines + [""] + ([allocator_note(), ""] if args.device == "cpu" else []) + summary(rows, args.encodings)
    (args.out / "models.md").write_text("\n".join(report) + "\n")
    plot(rows, args.out)
    print("\n".join(summary(rows, args.encodings)))


def value(rows, task, model, tokens, key):
    for r in rows:
        if (r["task"], r["model"], r["tokens"]) == (task, model, tokens) and key in r:
            return r[key]
    return None


def summary(rows, encodings):
    lines = ["Summary (ratios from this run):"]
    gpt2 = value(rows, "train", "gpt2-sdpa", 4096, "seconds")
    none = value(rows, "train", "none", 4096, "seconds")
    gpt2_latency = value(rows, "generate", "gpt2-sdpa", 256, "ms_per_token")
    gpt2_batch = value(rows, "generate-batch8", "gpt2-sdpa", 256, "tokens_per_s")
    for name in encodings:
        at4k = value(rows, "train", name, 4096, "seconds")
        if gpt2 and at4k:
            lines.append(
                f"- {name}: train step at 4096 {at4k:.2f} s vs GPT-2 {gpt2:.2f} s, speed-up {gpt2 / at4k:.1f}x"
            )
        if none and at4k and name != "none":
            lines.append(f"- {name}: train step at 4096, overhead over none {100 * (at4k / none - 1):+.0f}%")
        memory = value(rows, "train", name, 8192, "peak_mb")
        if memory:
            lines.append(f"- {name}: peak memory of a train step at 8192: {memory / 1024:.2f} GiB")
        hwm, hwm_32k = value(rows, "train", name, 8192, "vm_hwm_mb"), value(rows, "train", name, 32768, "vm_hwm_mb")
        if hwm:
            lines.append(f"- {name}: VmHWM of a train step at 8192 (first step included): {hwm / 1024:.2f} GiB")
        if hwm and hwm_32k:
            lines.append(f"- {name}: VmHWM at 32768 = {hwm_32k / 1024:.2f} GiB, {hwm_32k / hwm:.2f}x that at 8192")
        at8k, at32k = value(rows, "train", name, 8192, "seconds"), value(rows, "train", name, 32768, "seconds")
        if at8k and at32k:
            lines.append(f"- {name}: train step at 32768 {at32k:.1f} s = {at32k / at8k:.2f}x that at 8192")
        latency = value(rows, "generate", name, 256, "ms_per_token")
        if gpt2_latency and latency:
            lines.append(
                f"- {name}: {latency:.1f} ms per token at 256 context vs GPT-2 {gpt2_latency:.1f} ms "
                f"({latency / gpt2_latency:.2f}x)"
            )
        batch = value(rows, "generate-batch8", name, 256, "tokens_per_s")
        if gpt2_batch and batch:
            lines.append(
                f"- {name}: batch 8 at 256 context, {batch:.0f} tokens/s vs GPT-2 {gpt2_batch:.0f} "
                f"({batch / gpt2_batch:.2f}x)"
            )
        small, large = value(rows, "train", name, 512, "tokens_per_s"), value(rows, "train", name, 8192, "tokens_per_s")
        if small and large:
            lines.append(f"- {name}: tokens/s at 8192 = {100 * large / small:.0f}% of tokens/s at 512")
        short = value(rows, "generate", name, 256, "ms_per_token")
        for context in sorted({r["tokens"] for r in rows if r["task"] == "generate" and r["tokens"] > 256}):
            long = value(rows, "generate", name, context, "ms_per_token")
            if short and long:
                lines.append(
                    f"- {name}: generation {long:.1f} ms/token at {context} context vs {short:.1f} at 256: "
                    f"ratio {long / short:.2f}"
                )
    return lines


def plot(rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for name in dict.fromkeys(r["model"] for r in rows):
        train = [r for r in rows if r["task"] == "train" and r["model"] == name and "seconds" in r]
        gen = [r for r in rows if r["task"] == "generate" and r["model"] == name and "ms_per_token" in r]
        style = "--" if name.startswith("gpt2") else "-"
        for ax, points, key in (
            (axes[0], train, "seconds"),
            (axes[1], train, "peak_mb"),
            (axes[2], gen, "ms_per_token"),
        ):
            if points:  # an empty series would still count as data on a log axis
                ax.plot([r["tokens"] for r in points], [r[key] for r in points], style, marker="o", label=name)
    titles = ["train step (s)", "peak memory of a train step (MB)", "generation latency (ms per new token)"]
    for ax, title, xlabel in zip(axes, titles, ["tokens", "tokens", "context tokens"]):
        if not ax.has_data():
            ax.set_title(f"{title}: not measured")
            continue
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "models.png", dpi=110)


if __name__ == "__main__":
    main()
