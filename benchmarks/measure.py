"""Timing and peak-memory helpers shared by the benchmark scripts."""

import csv
import gc
import importlib.util
import math
import multiprocessing
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from lrpe_hf.training.provenance import process_seconds, write_record
from lrpe_hf.training.verdicts import paired_test


def medians_with_rounds(samples: dict[str, list[float]]) -> dict:
    """Each quantity's median round (milliseconds), and every round behind it under ``rounds``."""
    return {quantity: statistics.median(times) for quantity, times in samples.items()} | {"rounds": samples}


def sample_alternately(fns, device, reps):
    """Every one of ``reps`` wall-clock runs of each function after one warm-up each, in milliseconds: a list per
    function, the functions taking turns in every round."""
    times = [[] for _ in fns]
    for round_index in range(reps + 1):
        for fn, fn_times in zip(fns, times):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            if round_index:
                fn_times.append(1000 * (time.perf_counter() - start))
    return times


def allocator_note() -> str:
    """Which CPU allocation setting this run had: PyTorch's ``THP_MEM_ALLOC_ENABLE`` (read once, at the first
    allocation) puts tensors of 2 MB or more on transparent huge pages, which changes both the page-fault cost of
    fresh tensors and how much freed memory glibc's heap keeps resident."""
    if os.environ.get("THP_MEM_ALLOC_ENABLE", "0") not in ("0", ""):
        return "CPU allocator: THP_MEM_ALLOC_ENABLE=1 (tensors of 2 MB or more on transparent huge pages)"
    return "CPU allocator: default (THP_MEM_ALLOC_ENABLE unset)"


def time_ratio(samples, reference) -> dict:
    """Paired times: the geometric mean of ``samples[i] / reference[i]`` (``ratio``) with its 95% interval (``low``,
    ``high``; Student's t over the log ratios, ``paired_test``), the p-value, and the verdict *faster* (the interval
    lies below 1), *slower* (above 1) or *inconclusive*."""
    test = paired_test([math.log(ms / base) for ms, base in zip(samples, reference)])
    verdict = "faster" if test.high < 0 else "slower" if test.low > 0 else "inconclusive"
    return dict(
        ratio=round(math.exp(test.mean), 4), low=round(math.exp(test.low), 4), high=round(math.exp(test.high), 4),
        p_value=f"{test.p_value:.2g}", verdict=verdict,
    )  # fmt: skip


def write_csv(path: Path, fields: list[str] | None, rows: list[dict]) -> str:
    """``rows`` as the CSV ``path`` (a row's missing fields left empty; ``fields`` None: every key of the rows, in
    the order they first come); returns the file's name."""
    if fields is None:
        fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path.name


def round_rows(key: dict, samples: dict[str, list[float]]) -> list[dict]:
    """The timed rounds behind one table row: per round, the row's ``key`` fields, the quantity timed (a key of
    ``samples``), the round's index from 0 and its milliseconds."""
    return [
        key | {"quantity": quantity, "round": i, "ms": ms}
        for quantity, times in samples.items()
        for i, ms in enumerate(times)
    ]


def write_table(out: Path, name: str, fields: list[str], rows: list[dict], rounds: list[dict] | None = None):
    """``NAME.csv`` and its record ``NAME.json`` in ``out``, and the table printed in markdown; with ``rounds`` (one
    dict per timed sample behind the table's figures) also ``NAME_rounds.csv``, which the record covers too."""
    out.mkdir(parents=True, exist_ok=True)
    files = [write_csv(out / f"{name}.csv", fields, rows)]
    if rounds:
        files.append(write_csv(out / f"{name}_rounds.csv", list(rounds[0]), rounds))
    write_provenance(out / f"{name}.json", "cpu", files=files)
    print("| " + " | ".join(fields) + " |")
    for row in rows:
        print("| " + " | ".join(str(row[field]) for field in fields) + " |")


def write_provenance(path, device: str, files=None, append: bool = False):
    """``path`` (a JSON record beside the run's CSVs, ``lrpe_hf.training.provenance``): the command, the commit and
    whether the tree was clean, the machine, torch and transformers versions, threads, date and seconds. ``files``:
    the CSVs it covers (default: those this process wrote into ``path``'s folder, else the one named like
    ``path``); ``append``: keep the entries of earlier invocations whose kept results this one read back."""
    path = Path(path)
    if files is None:
        started = time.time() - process_seconds() - 1
        files = [table.name for table in sorted(path.parent.glob("*.csv")) if table.stat().st_mtime >= started]
    script = os.path.relpath(os.path.abspath(sys.argv[0]), Path(__file__).resolve().parents[1])
    allocator = allocator_note() if device == "cpu" else "CUDA caching allocator"
    return write_record(path, files or [path.stem + ".csv"], script, device, append=append, allocator=allocator)


def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def high_water_mark_mb():
    """VmHWM: the peak resident memory of this process so far."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def peak_memory_mb(device, baseline_mb):
    """Peak memory since the child started: CUDA's allocator peak, or the growth of resident memory on CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline_mb


def in_child(fn, device="cpu", *args):
    """``fn(*args)`` in a child process (so its peak memory is its own), its result dict returned, or
    {"error": ...} when it raised or was killed (for example for memory). ``fn`` is a top-level function of a
    benchmark file, which the child imports by path (the file may be run as __main__, or through runpy). Not forked
    from this process: a fork after torch's (or another library's) thread pools started can deadlock in the child.
    Children fork from multiprocessing's fork server, which has imported torch, transformers and lrpe_hf and run
    nothing (a spawned child would import them again, seconds a configuration); spawned where there is no fork
    server. On CUDA, which a child would have to initialise again, ``fn`` runs in this process: its peak memory is
    then read from the allocator's peak, reset inside ``fn``."""
    if device == "cuda":
        try:
            return fn(*args)
        except Exception as error:
            return {"error": f"{type(error).__name__}: {str(error)[:80]}"}
        finally:  # the next configuration starts clean: no tensors, no compiled graphs (dynamo caps recompiles)
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "transformers", "lrpe_hf"])
    else:
        context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    child = context.Process(target=run_from_file, args=(fn.__code__.co_filename, fn.__name__, args, results))
    child.start()
    child.join()
    if results.empty():
        return {"error": f"child died (exit code {child.exitcode}; out of memory?)"}
    return results.get()


def run_from_file(path: str, name: str, args: tuple, results):
    """A spawned child's work: import the benchmark file ``path`` as a module, call its ``name(*args)``, put the
    result (or the error) on ``results``."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        result = getattr(module, name)(*args)
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {str(error)[:80]}"}
    results.put(result)
