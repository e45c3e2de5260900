"""What each positional encoding costs: one attention layer per encoding, forward+backward, all in one process.

Every layer (hidden 512, 8 heads x 64, fp32, batch 1, each encoding with its default feature map and
normalisation) is built once, and in every round each layer runs one forward+backward on the same input, the
layers taking turns, so that a shared machine's changing load touches them alike. Reported per encoding: the
fastest and the median round, each over ``none``'s (the fastest is the figure least moved by the load), and the
issue's target for it (15% over none; 50% for SPE).

    python benchmarks/benchmark_encodings.py                                  # causal, 4,096 tokens, 8 rounds
    python benchmarks/benchmark_encodings.py --tokens 16384 --mode bidirectional --encodings none rope permute

Writes ``encodings.csv``, every round's time per encoding in ``encodings_rounds.csv``, ``encodings.md`` and
``encodings.json`` (the command, commit, machine and date) to ``--out``. ``spe_conv`` is left out by default: its
codes are (tokens x head dim x realizations) per head, shared by a model's layers, so its cost is measured inside a
model (``benchmark_models.py --encodings none spe_conv``).
"""

import argparse
import statistics
from pathlib import Path

import torch
from measure import allocator_note, round_rows, sample_alternately, write_csv, write_provenance

import lrpe_hf

HIDDEN, HEADS = 512, 8
TARGETS = {"spe_sine": 1.5, "spe_conv": 1.5}  # over none; every other encoding: 1.15


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def encoding_rows(encodings, tokens, causal, device, rounds, dtype=torch.float32):
    """Per encoding, its table row and the rounds behind it (``round_rows``: milliseconds of each round's
    forward+backward)."""
    torch.manual_seed(0)
    x = torch.randn(1, tokens, HIDDEN, device=device, requires_grad=True)

    def train_step(layer):
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            out = layer(x)
        out.float().sum().backward()

    steps = []
    for encoding in encodings:
        options = dict(positional_encoding=encoding, causal=causal, max_positions=tokens)
        layer = lrpe_hf.LinearAttention(HIDDEN, HEADS, **options).to(device)
        steps.append(lambda layer=layer: train_step(layer))
    samples = sample_alternately(steps, device, rounds)
    fastest_none, median_none = min(samples[0]), statistics.median(samples[0])
    rows, timed_rounds = [], []
    for encoding, times in zip(encodings, samples):
        timed_rounds += round_rows({"encoding": encoding}, {"forward+backward": times})
        fastest, median = min(times), statistics.median(times)
        target = TARGETS.get(encoding, 1.15)
        rows.append(
            {
                "encoding": encoding,
                "fastest_ms": fastest,
                "median_ms": median,
                "fastest_over_none": fastest / fastest_none,
                "median_over_none": median / median_none,
                "target": target,
                "met": fastest / fastest_none <= target,
            }
        )
    return rows, timed_rounds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_encodings = [e for e in lrpe_hf.POSITIONAL_ENCODINGS if e != "spe_conv"]
    parser.add_argument("--encodings", nargs="+", default=default_encodings, help="none is always measured first")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--mode", choices=["causal", "bidirectional"], default="causal")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="bf16: under autocast")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    encodings = ["none"] + [e for e in args.encodings if e != "none"]
    print(f"device: {args.device}, dtype {args.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.device == "cpu":
        print(allocator_note())

    rows, timed_rounds = encoding_rows(
        encodings, args.tokens, args.mode == "causal", args.device, args.rounds, DTYPES[args.dtype]
    )
    lines = [
        f"{args.mode} layer forward+backward at {args.tokens} tokens ({args.dtype}), {args.rounds} rounds, layers "
        "taking turns:",
        "",
        "| encoding | fastest ms | median ms | fastest over none | median over none | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['encoding']} | {r['fastest_ms']:.1f} | {r['median_ms']:.1f} | {r['fastest_over_none']:.2f}x "
            f"| {r['median_over_none']:.2f}x | {r['target']:.2f}x | {'yes' if r['met'] else 'no'} |"
        )
    print("\n".join(lines))
    (args.out / "encodings.md").write_text("\n".join(lines) + "\n")
    files = [
        write_csv(args.out / "encodings.csv", list(rows[0]), rows),
        write_csv(args.out / "encodings_rounds.csv", list(timed_rounds[0]), timed_rounds),
    ]
    write_provenance(args.out / "encodings.json", args.device, files=files)


if __name__ == "__main__":
    main()
