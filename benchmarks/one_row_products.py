"""One-row products on row-major and column-major weights: the rule ``lrpe_hf.modeling.weight_layout`` follows.

A decoding step multiplies one row per sequence by each projection weight (out, in). This times the products of one
LinearGPT stack of ``benchmark_models.py``'s size (6 layers x q, k, v, o (512 x 512), fc1 (2,048 x 512) and fc2
(512 x 2,048), ``F.linear`` with bias), the weights stored row-major (as ``nn.Linear`` makes them) and column-major
(as a decoding step lays them out in float32 on a CPU), per dtype and number of rows, the two layouts taking turns
in every round, each round with weights made afresh. Each round's column-major time over its row-major time is one
paired sample: the geometric mean with its 95% interval (``lrpe_hf.training.verdicts.paired_test``) and the verdict
*faster* / *slower* / *inconclusive* for column-major.

Writes ``one_row_products.csv``, each round's pair in ``one_row_products_rounds.csv`` and their record
``one_row_products.json`` to ``--out``, and prints the table.

    OMP_NUM_THREADS=1 python benchmarks/one_row_products.py --threads 1 --out docs/data/benchmarks/one_row_products
"""

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from benchmark_models import SIZE
from measure import time_ratio, write_table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
FIELDS = ["dtype", "rows", "rounds", "row_major_ms", "column_major_ms", "ratio", "low", "high", "p_value", "verdict"]


def stack_weights(dtype, column_major: bool, hidden: int, ffn: int, layers: int):
    """Every (weight (out, in), bias (out,)) of the stack, the weights in the given layout."""
    shapes = [(hidden, hidden)] * 4 + [(ffn, hidden), (hidden, ffn)]
    weights = []
    for _ in range(layers):
        for out_features, in_features in shapes:
            weight = torch.randn(out_features, in_features, dtype=dtype) / math.sqrt(in_features)
            weight = weight.t().contiguous().t() if column_major else weight
            weights.append((weight, torch.randn(out_features, dtype=dtype)))
    return weights


def products(weights, inputs):
    """The stack's products of ``inputs`` ({in_features: (rows, in)}) in order."""

    def run():
        for weight, bias in weights:
            F.linear(inputs[weight.shape[1]], weight, bias)

    return run


def measure(dtype_name: str, rows: int, rounds: int, repeats: int) -> tuple[dict, list[dict]]:
    """Both layouts' milliseconds per pass over the stack, ``rounds`` paired samples (after one warm-up round): the
    table's row, and each round's pair. Each round makes both stacks afresh, so that where the allocator happens to
    put a weight varies from round to round as it does from process to process: a one-row product's time depends on
    it (runs that kept one allocation disagreed with each other beyond their own intervals)."""
    dtype = DTYPES[dtype_name]
    hidden, ffn, layers = SIZE["hidden"], SIZE["ffn"], SIZE["layers"]
    inputs = {n: torch.randn(rows, n, dtype=dtype) for n in (hidden, ffn)}
    row_major, column_major = [], []
    for round_index in range(rounds + 1):
        runs = [products(stack_weights(dtype, layout, hidden, ffn, layers), inputs) for layout in (False, True)]
        order = [0, 1] if round_index % 2 else [1, 0]
        times = [0.0, 0.0]
        for layout in order:
            runs[layout]()  # its weights into the caches they will be read from, as in a decoding loop
            start = time.perf_counter()
            for _ in range(repeats):
                runs[layout]()
            times[layout] = 1000 * (time.perf_counter() - start) / repeats
        if round_index:
            row_major.append(times[0])
            column_major.append(times[1])
    row = dict(
        dtype=dtype_name, rows=rows, rounds=rounds,
        row_major_ms=round(statistics.median(row_major), 4), column_major_ms=round(statistics.median(column_major), 4),
        **time_ratio(column_major, row_major),
    )  # fmt: skip
    pairs = [dict(dtype=dtype_name, rows=rows, round=i, row_major_ms=r, column_major_ms=c)
             for i, (r, c) in enumerate(zip(row_major, column_major))]  # fmt: skip
    return row, pairs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument(
        "--rows", nargs="+", type=int, default=[1, 16], help="rows per product (a batch of decoding steps)"
    )
    parser.add_argument("--rounds", type=int, default=20, help="paired rounds (each layout once per round)")
    parser.add_argument("--repeats", type=int, default=5, help="passes over the stack per timed sample")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "one_row_products")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2 for an interval, got {args.rounds}")
    torch.manual_seed(0)
    measured = [measure(dtype, n, args.rounds, args.repeats) for dtype in args.dtypes for n in args.rows]
    rows = [row for row, _ in measured]
    write_table(args.out, "one_row_products", FIELDS, rows, [pair for _, pairs in measured for pair in pairs])


if __name__ == "__main__":
    main()
