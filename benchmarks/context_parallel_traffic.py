"""Context parallelism's cost: the bytes a rank sends per layer (computed, and counted where it runs), and, on CPU
processes here, the time and peak memory of a causal layer's forward+backward split over 2 ranks against one
process holding the whole sequence.

Computed per causal layer, forward (backward sends as much again), for LinearGPT's default size (hidden 512,
8 heads of 64, elu features: m = 64) with P ranks and N tokens:
- ours (``lrpe_hf.context_parallel``): one all-gather of every head's state (m x (d + 1), the key sums as the last
  column) in float32, plus the unrotated denominator's key sums (m x 1) where the encoding rotates: a ring
  all-gather sends (P - 1) states per rank, whatever N;
- Ulysses (DeepSpeed's sequence parallelism, accelerate's ``sp_size``): four all-to-alls of N x hidden / P values
  (q, k, v before attention, the output after), each sending (P - 1) / P of a rank's N / P x hidden block;
- a ring of keys and values (Ring Attention): each rank passes its N / P x 2 hidden block of keys and values
  around the ring, (P - 1) times.
Activations in bf16 (2 bytes).

Measured (``--measure``): two gloo processes, each with half of an N-token sequence in float32 under
``context_parallel``, against one process with all N tokens; forward+backward of one causal ``LinearAttention``
(hidden 512, 8 heads, the given encoding), median of ``--reps`` after a warm-up; the growth of each process's peak
resident memory from before its inputs and layer were made (the first step included; the larger rank's); the
bytes ``context_parallel`` gathered per step, counted. Every timed round of each process: ``measured_rounds.csv``.

    python benchmarks/context_parallel_traffic.py --measure --tokens 16384 --out docs/data/benchmarks/context_parallel
"""

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from measure import round_rows, write_csv, write_provenance

import lrpe_hf
from lrpe_hf.modeling import context_parallel as cp_module

HIDDEN, HEADS, FEATURES = 512, 8, 64
HEAD_DIM = HIDDEN // HEADS


def computed_rows(lengths, ranks):
    rows = []
    for P in ranks:
        for N in lengths:
            state = HEADS * FEATURES * (HEAD_DIM + 1) * 4 + HEADS * FEATURES * 4  # kv with key sums, unrotated sums
            ours = (P - 1) * state
            ulysses = 4 * (P - 1) / P * (N / P) * HIDDEN * 2
            ring = (P - 1) * (N / P) * 2 * HIDDEN * 2
            rows.append(
                dict(ranks=P, tokens=N, ours_bytes=ours, ulysses_bytes=int(ulysses), ring_bytes=int(ring),
                     ulysses_over_ours=round(ulysses / ours, 1), ring_over_ours=round(ring / ours, 1))
            )  # fmt: skip
    return rows


def layer(encoding):
    torch.manual_seed(0)
    return lrpe_hf.LinearAttention(HIDDEN, HEADS, positional_encoding=encoding, causal=True)


def step_times(module, x, reps):
    """Milliseconds of each of ``reps`` forward+backward steps after a warm-up step."""
    times = []
    for round_index in range(reps + 1):
        start = time.perf_counter()
        module(x.requires_grad_()).square().mean().backward()
        if round_index:
            times.append(1000 * (time.perf_counter() - start))
    return times


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def split_rank(rank, size, rendezvous, encoding, tokens, reps, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    baseline = peak_mb()
    counted = []
    original = cp_module.gathered

    def counting(x, group):
        counted.append(x.numel() * x.element_size() * (group.size - 1))
        return original(x, group)

    cp_module.gathered = counting
    whole = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    x = whole[:, rank * tokens // size : (rank + 1) * tokens // size].contiguous()
    module = layer(encoding)
    with lrpe_hf.context_parallel():
        rounds = step_times(module, x, reps)
    calls = reps + 1
    results[rank] = dict(rounds=rounds, growth_mb=peak_mb() - baseline, sent_bytes_per_step=sum(counted) / calls)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown at exit can abort after the work is done


def whole_sequence(encoding, tokens, reps, results):
    torch.set_num_threads(1)
    baseline = peak_mb()
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    results["one"] = dict(rounds=step_times(layer(encoding), x, reps), growth_mb=peak_mb() - baseline)


def measured_row(encoding, tokens, reps):
    """One encoding's row (medians of each process's rounds; the two ranks' time is the slower rank's), and the
    rounds behind it."""
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        one = context.Process(target=whole_sequence, args=(encoding, tokens, reps, results))
        one.start()
        one.join()
        rendezvous = Path(tempfile.mkdtemp()) / "rendezvous"
        ranks = [
            context.Process(target=split_rank, args=(rank, 2, rendezvous, encoding, tokens, reps, results))
            for rank in (0, 1)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        results = dict(results)
    split = [results[0], results[1]]
    samples = {"one process": results["one"]["rounds"], "rank 0": split[0]["rounds"], "rank 1": split[1]["rounds"]}
    row = dict(
        encoding=encoding, tokens=tokens, one_process_ms=round(statistics.median(samples["one process"]), 1),
        two_ranks_ms=round(max(statistics.median(r["rounds"]) for r in split), 1),
        one_process_memory_growth_mb=round(results["one"]["growth_mb"]),
        two_ranks_memory_growth_mb=round(max(r["growth_mb"] for r in split)),
        sent_bytes_per_step=int(split[0]["sent_bytes_per_step"]),
    )  # fmt: skip
    return row, round_rows(dict(encoding=encoding, tokens=tokens), samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 1048576])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--measure", action="store_true", help="also time two CPU processes against one")
    parser.add_argument("--tokens", type=int, default=16384, help="the measured sequence's length")
    parser.add_argument("--encodings", nargs="+", default=["none", "permute", "lrpe_orthogonal"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "context_parallel")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = computed_rows(args.lengths, args.ranks)
    write_csv(args.out / "traffic.csv", None, rows)
    for row in rows:
        print(row)
    if args.measure:
        measured, measured_rounds = [], []
        for encoding in args.encodings:
            row, rounds = measured_row(encoding, args.tokens, args.reps)
            print(row)
            measured.append(row)
            measured_rounds += rounds
        write_csv(args.out / "measured.csv", None, measured)
        write_csv(args.out / "measured_rounds.csv", None, measured_rounds)
    write_provenance(args.out / "context_parallel.json", "cpu")


if __name__ == "__main__":
    main()
