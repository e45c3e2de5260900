"""The GPU check: speed and memory side by side, then correctness of fla's path against the torch path on the same
GPU, in one command that stays under about 9 minutes on one H100 and writes everything under one folder.

    make gpu-check                                                   # on a CUDA machine: out/gpu_check/
    python benchmarks/gpu_check.py --dry-run --out out/gpu_check_dry # the rehearsal: CPU, tiny sizes (CI runs it)

Each part runs in a process of its own under its own time limit and is recorded as it ends: a part that fails,
crashes or runs out of time leaves its status, its log (``<part>.log``) and the rows it wrote, and the others still
run. The speed comes first: it is what a short lease must not lose.

fla's kernels search their Triton configurations on the first call of each shape and dtype, compiling every
candidate: on a fresh H100 one train step's kernels took about 100 s (48 candidates for some kernels). So the check
keeps at most 4 candidates a kernel in the speed parts (the same ones for fla's kernel alone and for our layers, so
the ratios are fair; the preferred are 4 or 8 warps, 2 or 3 stages, the largest tiles) and 1 in the correctness
parts (a result does not depend on the tiling); ``--full-autotune`` keeps fla's whole search. The record says which.

0. ``fla_shapes.csv``: fla's chunked kernel alone, bf16, forward and backward, at the widths our layers hand it
   (64x64 heads, the 64x2 key sums of a decayed denominator, SPE's 32x64), ungated and with one decay per head, on
   one 8k sequence and on packed documents, with ``CUDA_LAUNCH_BLOCKING=1``: which of them run, raise or crash (an
   illegal memory access ended the first H100 run's speed parts, at permute's decayed product and at an SPE
   backward). A case that kills its process is recorded and the next one starts in a new process.
0. ``overhead_syncs.csv``, ``overhead_top_ops.csv``: a LinearGPT bf16 train step at 4k for none, lrpe_orthogonal
   and permute: every host synchronisation our code asks for (CUDA's sync debug mode, by source line) and the
   profiler's top ops by CPU time; ``overhead_counted_reads.csv``: the host reads ``host_reads.HostReads`` counts in
   the same step (the CPU's stand-in, which tests/test_host_reads.py holds at none inside the layers), to set beside
   CUDA's own count; ``overhead_summary.csv``: per encoding, the syncs CUDA saw beside the reads the CPU's count
   predicts, the kernels a step launches, their device time, and the host's time to queue a step (wall time without a
   sync inside: a step whose host time exceeds its device time is paced by its host). The first H100 run's steps
   took about as long at 2k tokens as at 8k, and the linear product alone 2.4 ms at 4k against fla's 0.47 ms: fixed
   costs on the host, which this part locates.
1. ``benchmarks/benchmark_attention.py`` (bf16, causal, 4k/16k/32k, none, rope, lrpe_orthogonal, permute, fastrpb,
   spe_sine): each layer against its projections, fla's kernel alone and SDPA's softmax layer.
2. ``benchmarks/benchmark_models.py`` (bf16): LinearGPT against GPT-2 (SDPA), training at 2k/8k/32k (GPT-2 up
   to 8k), decoding at 256, 4k and 64k context, eager and as CUDA graphs, peak memory; at the benchmark's size
   (6 x 512) unless ``--models-size`` gives another.
3. ``train_steps.csv``: a LinearGPT train step (2 x 256, 4 heads, 1,024 tokens, batch 2) for every encoding, and
   the exp, relu and hedgehog maps once each, in fp32 (torch's default precision: fla's kernels then do not run, as
   they would multiply in TF32), in fp32 with TF32 allowed (``torch.set_float32_matmul_precision("high")``, both
   paths) and under bf16 autocast, on padded rows and on packed rows
   (restarting position_ids): ``kernel_backend="auto"`` (fla's kernels where they run) against ``"torch"`` with
   the same weights and batch: the losses' relative difference, the gradients' cosine similarity and relative
   error, finiteness, and how many causal products went to fla's kernels (``fla_calls``: 0 means the torch path
   ran, as it does for gated backward passes on Hopper with Triton < 3.7.1).
4. ``families.csv``: LinearRoberta and LinearViT forward+backward under bf16 autocast, finite.
5. ``decoding.csv``: 64 greedy tokens from ``generate`` eager, with the forward compiled by the user
   (``compiled_by="user"``: ``torch.compile(model.forward, mode="reduce-overhead")``, CUDA graphs on a GPU), and
   compiled by ``generate`` itself (``compiled_by="generate"``: ``compile_config=CompileConfig()``, transformers'
   default ``mode="reduce-overhead"``, the opt-in the models' default waits on): the same tokens, the largest logit
   difference, the graphs, recompilations, graph breaks and CUDA-graph skips dynamo and inductor counted, and ms per
   token of each (after a warm-up call). Where ``compiled_by="generate"`` runs without a crash or a CUDA-graph skip
   and is faster than eager, its default can be turned on.
6. ``pytest -m gpu``: the GPU tests (tests/test_properties.py, tests/test_triton_adapter.py).

A benchmark stopped before its end (a crash, its time limit) leaves the rows it printed in
``<part>_rows_before_stop.csv``. ``record.json`` (the docs' provenance format) holds the command, the commit (where
the machine's copy of the tree has no git history, ``--commit`` or ``GPU_CHECK_COMMIT``, the commit it is a copy
of), the copy's source hash (``provenance.working_source_hash``) and whether it is clean: its hash equals the
commit's, given as ``--commit-source-hash`` or ``GPU_CHECK_SOURCE_HASH`` from a checkout (``make gpu-check`` computes
both where git is), the device, driver and versions (torch, Triton, fla-core, transformers), the
candidates kept per kernel and each part's status and seconds. Everything is packed into ``gpu_check.tar.gz``
beside the folder's files, one file to bring back.
"""

import argparse
import ast
import csv
import faulthandler
import importlib.metadata
import json
import os
import platform
import runpy
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

import lrpe_hf
from lrpe_hf.modeling import products_dispatch

ROOT = Path(__file__).resolve().parents[1]
MAPS_ONCE = ("exp", "relu", "hedgehog")  # with the none encoding; every encoding runs with its default map
SPEED_ENCODINGS = ["none", "rope", "lrpe_orthogonal", "permute", "fastrpb", "spe_sine"]


def sizes(dry_run: bool) -> dict:
    """The sizes of every part: the GPU's, or the rehearsal's (CPU, seconds)."""
    if dry_run:
        return dict(
            device="cpu", tokens=96, hidden=32, layers=1, heads=2, new_tokens=4, decoding=["none"],
            attention=["--lengths", "64", "--reps", "1", "--encodings", "none", "rope", "--modes", "causal"],
            models=["--lengths", "64", "--contexts", "32", "--batch-contexts", "--reps", "1", "--encodings", "none",
                    "none+compile", "--gpt2-max", "64"],
            shape_tokens=256, overhead_tokens=64, overhead=["none"],
            limits=dict(fla_shapes=300, overhead=300, attention=300, models=300, train_steps=300, families=120,
                        decoding=300, pytest=300),
        )  # fmt: skip
    return dict(
        device="cuda", tokens=1024, hidden=256, layers=2, heads=4, new_tokens=64,
        decoding=["none", "lrpe_orthogonal", "permute"],
        attention=["--lengths", "4096", "16384", "32768", "--reps", "3", "--encodings", *SPEED_ENCODINGS,
                   "--modes", "causal", "--softmax-max", "32768"],
        models=["--lengths", "2048", "8192", "32768", "--contexts", "256", "4096", "65536", "--batch-contexts", "256",
                "--reps", "3", "--encodings", "none", "rope", "permute", "none+graphs", "rope+graphs",
                "--gpt2-max", "8192"],
        shape_tokens=8192, overhead_tokens=4096, overhead=["none", "lrpe_orthogonal", "permute"],
        limits=dict(fla_shapes=60, overhead=40, attention=110, models=130, train_steps=80, families=25, decoding=45,
                    pytest=45),
    )  # fmt: skip


class FlaCalls:
    """Counts the causal products that go to fla's kernels while inside (the dispatch's call of
    ``fla_causal_product``, eager or inside the compiled custom op)."""

    def __init__(self):
        self.count = 0
        self.original = products_dispatch.fla_causal_product

    def __enter__(self):
        def counted(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        products_dispatch.fla_causal_product = counted
        return self

    def __exit__(self, *exc):
        products_dispatch.fla_causal_product = self.original


def gpt(encoding, feature_map, backend, s, device):
    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(
        vocab_size=512, hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        intermediate_size=4 * s["hidden"], max_position_embeddings=2 * s["tokens"], hidden_dropout_prob=0.0,
        positional_encoding=encoding, feature_map=feature_map, kernel_backend=backend, eos_token_id=None,
    )  # fmt: skip
    return lrpe_hf.LinearGPTForCausalLM(config).to(device)


def batches(s, device):
    """Padded rows (row 1 left-padded by a tenth) and packed rows (three documents a row, restarting positions)."""
    generator = torch.Generator().manual_seed(0)
    n = s["tokens"]
    ids = torch.randint(3, 512, (2, n), generator=generator)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, : n // 10] = 0
    labels = ids.masked_fill(mask == 0, -100)
    lengths = [n // 2, n // 3, n - n // 2 - n // 3]
    positions = torch.cat([torch.arange(length) for length in lengths]).expand(2, -1)
    padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
    packed = dict(input_ids=ids, position_ids=positions.contiguous(), labels=ids)
    layouts = {"padded": padded, "packed": packed}
    return {name: {k: v.to(device) for k, v in batch.items()} for name, batch in layouts.items()}


def train_step(model, batch, dtype, device):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(**batch, use_cache=False).loss
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return loss.float().item(), grads


# fp32 at torch's default matmul precision ("highest") runs the torch path on a GPU (fla's kernels multiply in TF32);
# "high" allows TF32 for both paths
PRECISIONS = (("fp32", torch.float32, "highest"), ("tf32", torch.float32, "high"), ("bf16", torch.bfloat16, "highest"))


def part_train_steps(out: Path, s: dict):
    device = s["device"]
    cases = [(encoding, None) for encoding in lrpe_hf.POSITIONAL_ENCODINGS] + [("none", m) for m in MAPS_ONCE]
    rows = []
    for encoding, feature_map in cases:
        models = {backend: gpt(encoding, feature_map, backend, s, device).train() for backend in ("auto", "torch")}
        for dtype_name, dtype, precision in PRECISIONS:
            torch.set_float32_matmul_precision(precision)
            for layout, batch in batches(s, device).items():
                torch.manual_seed(1)  # SPE draws fresh codes in training mode: the same draw for both paths
                with FlaCalls() as calls:
                    loss, grads = train_step(models["auto"], batch, dtype, device)
                torch.manual_seed(1)
                reference_loss, reference = train_step(models["torch"], batch, dtype, device)
                rows.append(
                    dict(
                        encoding=encoding, feature_map=feature_map or "default", dtype=dtype_name, rows=layout,
                        loss=loss, torch_loss=reference_loss,
                        loss_relative_difference=abs(loss - reference_loss) / abs(reference_loss),
                        gradient_cosine=torch.nn.functional.cosine_similarity(grads, reference, dim=0).item(),
                        gradient_relative_error=((grads - reference).norm() / reference.norm()).item(),
                        finite=bool(torch.isfinite(grads).all() and torch.isfinite(torch.tensor(loss))),
                        fla_calls=calls.count,
                    )
                )  # fmt: skip
                print(rows[-1], flush=True)
                write_csv(out / "train_steps.csv", rows)  # after every row: a part stopped for time keeps them


def part_families(out: Path, s: dict):
    device, rows = s["device"], []
    shapes = dict(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"])
    torch.manual_seed(0)
    roberta = lrpe_hf.LinearRobertaForMaskedLM(lrpe_hf.LinearRobertaConfig(vocab_size=512, **shapes))
    vit = lrpe_hf.LinearViTForImageClassification(lrpe_hf.LinearViTConfig(image_size=64, patch_size=8, **shapes))
    ids = torch.randint(3, 512, (2, s["tokens"]))
    cases = {
        "roberta": (roberta, dict(input_ids=ids, labels=ids)),
        "vit": (vit, dict(pixel_values=torch.randn(2, 3, 64, 64), labels=torch.tensor([0, 1]))),
    }
    for name, (model, batch) in cases.items():
        model, batch = model.to(device), {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        rows.append(dict(family=name, loss=loss.float().item(), finite=bool(finite and torch.isfinite(loss))))
        print(rows[-1], flush=True)
    write_csv(out / "families.csv", rows)


def part_decoding(out: Path, s: dict):
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    device, rows = s["device"], []
    for encoding in s["decoding"]:
        model = gpt(encoding, None, "auto", s, device).eval()
        prompt = torch.randint(3, 512, (1, 32), generator=torch.Generator().manual_seed(1)).to(device)

        def generate(model=model, prompt=prompt, **options):
            out = model.generate(
                prompt, max_new_tokens=s["new_tokens"], do_sample=False, return_dict_in_generate=True,
                output_logits=True, **options,
            )  # fmt: skip
            return out.sequences, torch.stack(out.logits).float()

        def timed(**options):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = generate(**options)
            if device == "cuda":
                torch.cuda.synchronize()
            return result, 1000 * (time.perf_counter() - start) / s["new_tokens"]

        generate()  # warm-up
        (eager_tokens, eager_logits), eager_ms = timed()
        eager_forward = model.forward
        for compiled_by in ("user", "generate"):
            torch._dynamo.reset()
            counters.clear()
            options = {}
            if compiled_by == "user":
                model.forward = torch.compile(eager_forward, mode="reduce-overhead")
            else:
                options["compile_config"] = CompileConfig()
                options["compile_config"]._compile_all_devices = device != "cuda"  # the CPU rehearsal compiles too
            generate(**options)  # compiles, records the graphs
            graphs_before = counters["stats"]["unique_graphs"]
            (tokens, logits), compiled_ms = timed(**options)
            model.forward = eager_forward
            rows.append(
                dict(
                    encoding=encoding, compiled_by=compiled_by, same_tokens=bool(torch.equal(tokens, eager_tokens)),
                    largest_logit_difference=(logits - eager_logits).abs().max().item(),
                    unique_graphs=counters["stats"]["unique_graphs"],
                    graphs_in_timed_call=counters["stats"]["unique_graphs"] - graphs_before,
                    recompilations=sum(counters["recompiles"].values()),
                    graph_breaks=sum(counters["graph_break"].values()),
                    cudagraph_skips=counters["inductor"]["cudagraph_skips"], eager_ms_per_token=eager_ms,
                    compiled_ms_per_token=compiled_ms,
                )
            )  # fmt: skip
            print(rows[-1], flush=True)
            write_csv(out / "decoding.csv", rows)


# fla's chunk_simple_gla alone, bf16, forward and backward, at the widths our layers hand it: (key width, value width):
# a 64-wide head, the width-2 key-sum product of a decayed denominator (one value column made even), SPE's 32
# realizations; with no gate and with one decay per head (g_gamma), over one 8k sequence and over packed documents
FLA_SHAPES = [
    dict(widths=widths, gating=gating, layout=layout)
    for widths in ((64, 64), (64, 2), (32, 64))
    for gating in ("none", "g_gamma")
    for layout in ("dense", "packed")
]


def fla_shape_case(case: dict, tokens: int, device: str):
    """Run one FLA_SHAPES case: fla's chunked product forward and backward, 8 heads, bf16 (fp32 on the CPU)."""
    from lrpe_hf.modeling.products_triton import fla_kernels

    chunked, _ = fla_kernels()
    (K, V), H = case["widths"], 8
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.rand(1, tokens, H, K, generator=generator).to(device, dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, tokens, H, V, generator=generator).to(device, dtype).requires_grad_()
    gates = {"g_gamma": -torch.linspace(0.01, 0.5, H, device=device)} if case["gating"] == "g_gamma" else {}
    if case["layout"] == "packed":
        gates["cu_seqlens"] = torch.tensor([0, tokens // 2, tokens // 2 + tokens // 3, tokens], device=device)
    out, final = chunked(q, k, v, **gates, scale=1.0, output_final_state=True)
    (out.float().square().mean() + final.float().square().mean()).backward()
    finite = all(torch.isfinite(x).all() for x in (out, q.grad, k.grad, v.grad))
    if device == "cuda":
        torch.cuda.synchronize()
    return bool(finite)


def part_fla_shapes(out: Path, s: dict):
    """Each FLA_SHAPES case in a process that runs the cases from one index on, with CUDA_LAUNCH_BLOCKING=1 (an
    illegal access is reported at the kernel that made it): a case that kills its process is recorded as crashed
    and the next process starts after it."""
    rows, start = [], 0
    environment = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    while start < len(FLA_SHAPES):
        command = [sys.executable, __file__, "--fla-shapes-from", str(start), "--tokens", str(s["shape_tokens"])]
        command += ["--dry-run"] * (s["device"] == "cpu")
        result = subprocess.run(command, capture_output=True, text=True, env=environment)
        print(result.stdout + result.stderr[-3000:], flush=True)
        done = [json.loads(line[len("CASE ") :]) for line in result.stdout.splitlines() if line.startswith("CASE ")]
        rows += done
        start += len(done)
        if result.returncode != 0 and start < len(FLA_SHAPES):
            error = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            rows.append(dict(**FLA_SHAPES[start], status=f"crashed (exit code {result.returncode}): {error}"))
            start += 1
        write_csv(out / "fla_shapes.csv", [dict(row, widths="x".join(map(str, row["widths"]))) for row in rows])


def run_fla_shapes_from(start: int, tokens: int, device: str):
    """The cases of FLA_SHAPES from ``start`` on, one line ``CASE {json}`` each as it ends."""
    faulthandler.enable()
    for case in FLA_SHAPES[start:]:
        try:
            status = "ok" if fla_shape_case(case, tokens, device) else "not finite"
        except Exception as error:  # noqa: BLE001 -- a raised error is a finding to record; a CUDA error ends here
            status = f"raised {type(error).__name__}: {str(error).splitlines()[0][:300]}"
            if device == "cuda" and "CUDA" in str(error):
                raise
        print("CASE " + json.dumps(dict(case, status=status)), flush=True)


def part_overhead(out: Path, s: dict):
    """Where a train step's time goes besides the GPU's work: a LinearGPT bf16 train step (the train-step sizes,
    ``overhead_tokens`` tokens) per encoding, after two warm-ups: each host synchronisation our code asks for (CUDA's
    sync debug mode, one row per source line) and the profiler's top ops by CPU time, with the step's CPU and CUDA
    totals."""
    import warnings

    from host_reads import HostReads
    from torch.profiler import ProfilerActivity, profile

    device, syncs, top, counted_reads, summary = s["device"], [], [], [], []
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (1, s["overhead_tokens"]), generator=generator).to(device)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device == "cuda")
    for encoding in s["overhead"]:
        model = gpt(encoding, None, "auto", dict(s, tokens=s["overhead_tokens"]), device).train()
        for _ in range(2):
            train_step(model, dict(input_ids=ids, labels=ids), torch.bfloat16, device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            train_step(model, dict(input_ids=ids, labels=ids), torch.bfloat16, device)
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        places = {}
        for warning in caught:
            if "synchroniz" in str(warning.message):
                place = f"{Path(warning.filename).name}:{warning.lineno}"
                places[place] = places.get(place, 0) + 1
        syncs += [dict(encoding=encoding, place=place, count=count) for place, count in places.items()]
        # the CPU's stand-in for the same step (benchmarks/host_reads.py): what tests/test_host_reads.py predicts
        with HostReads().watch(model) as reads:
            train_step(model, dict(input_ids=ids, labels=ids), torch.bfloat16, device)
        counted_reads += [
            dict(encoding=encoding, op=op, place=where, inside_layers=inside, count=count)
            for (op, where, inside), count in reads.reads.items()
        ]
        with profile(activities=activities) as profiler:
            train_step(model, dict(input_ids=ids, labels=ids), torch.bfloat16, device)
            if device == "cuda":
                torch.cuda.synchronize()
        events = profiler.key_averages()
        kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        host_ms = []
        for _ in range(3):  # the host's time to queue a step: wall time up to the last launch, no sync inside
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.bfloat16):
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            host_ms.append(1000 * (time.perf_counter() - start))
        if device == "cuda":
            torch.cuda.synchronize()
        summary.append(dict(
            encoding=encoding, cuda_syncs=sum(places.values()), counted_reads=sum(reads.reads.values()),
            counted_reads_inside_layers=sum(n for (_, _, inside), n in reads.reads.items() if inside),
            kernels_per_step=len(kernels), device_ms_per_step=sum(e.device_time_total for e in kernels) / 1e3,
            host_ms_per_step=min(host_ms),
        ))  # fmt: skip
        for event in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]:
            top.append(
                dict(
                    encoding=encoding, op=event.key, calls=event.count, self_cpu_ms=event.self_cpu_time_total / 1e3,
                    device_ms=getattr(event, "self_device_time_total", 0) / 1e3,
                )
            )  # fmt: skip
        print(f"{encoding}: {sum(places.values())} host syncs at {places}", flush=True)
    write_csv(out / "overhead_syncs.csv", syncs or [dict(encoding="", place="none found", count=0)])
    write_csv(out / "overhead_top_ops.csv", top)
    write_csv(out / "overhead_counted_reads.csv", counted_reads or [dict(encoding="", op="none found", count=0)])
    write_csv(out / "overhead_summary.csv", summary)


def rows_from_log(log: Path) -> list[dict]:
    """The rows a benchmark printed (one dict a line) before it stopped: what a crash leaves of its CSV."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{'"):
            try:
                rows.append(ast.literal_eval(line))
            except (ValueError, SyntaxError):
                continue
    return rows


def benchmark(script: str, folder: str, dtype_arguments: list):
    """A part that runs one of the benchmark scripts (in this process, so that the autotuning limit applies)."""

    def run(out: Path, s: dict):
        path = ROOT / "benchmarks" / script
        sys.argv = [str(path), "--device", s["device"], *dtype_arguments, *s[folder], "--out", str(out / folder)]
        runpy.run_path(str(path), run_name="__main__")

    return run


def part_pytest(out: Path, s: dict):
    import pytest

    arguments = [
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "tests/test_properties.py",
        "tests/test_triton_adapter.py",
    ]
    os.chdir(ROOT)
    code = pytest.main(arguments)
    if code not in (0, 5):  # 5: every test deselected or skipped (no GPU)
        raise RuntimeError(f"pytest -m gpu exited {code}")


def write_csv(path: Path, rows: list[dict]):
    """rows (dicts, their keys the columns in order of first appearance; a missing value is left empty)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def versions() -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton", "fla-core", "accelerate"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def device_facts(device: str) -> dict:
    """The GPU's facts beyond its name (which the record's ``device`` gives): memory, capability, driver, CUDA."""
    if device != "cuda":
        return {}
    properties = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    )
    return {
        "memory_gib": round(properties.total_memory / 2**30, 1), "capability": f"{properties.major}.{properties.minor}",
        "driver": smi.stdout.strip() or None, "cuda": torch.version.cuda,
    }  # fmt: skip


PARTS = {
    "fla_shapes": part_fla_shapes,
    "overhead": part_overhead,
    "attention": benchmark("benchmark_attention.py", "attention", ["--dtype", "bf16"]),
    "models": benchmark("benchmark_models.py", "models", ["--dtype", "bf16"]),
    "train_steps": part_train_steps,
    "families": part_families,
    "decoding": part_decoding,
    "pytest": part_pytest,
}
SPEED_PARTS = ("attention", "models")


def limit_autotuning(candidates: int):
    """Let every Triton autotuner (fla's kernels') try at most ``candidates`` configurations: those with 4 or 8 warps
    and 2 or 3 stages where it has some, the largest tiles first. With one left, Triton compiles it and times none."""
    from triton.runtime.autotuner import Autotuner

    search = Autotuner.prune_configs

    def preferred(config):
        tile = 1
        for value in config.kwargs.values():
            tile *= value if isinstance(value, int) else 1
        return (config.num_warps not in (4, 8), config.num_stages not in (2, 3), -tile, config.num_warps)

    def prune_configs(self, kwargs):
        return sorted(search(self, kwargs), key=preferred)[:candidates]

    Autotuner.prune_configs = prune_configs


def autotune_candidates(name: str, full_autotune: bool) -> int | None:
    """How many configurations each kernel may try in part ``name``: None for fla's whole search."""
    if full_autotune:
        return None
    return 4 if name in SPEED_PARTS else 1


def models_size_item(item: str) -> tuple[str, int]:
    """One ``--models-size`` item, checked as ``benchmark_models.py --size`` checks it."""
    from benchmark_models import size_item

    return size_item(item)


def run_child(name: str, args) -> None:
    """One part, in this (child) process: its rows go to args.out, its output to the parent's log of it (with the
    Python stack of a crash: the first H100 run's compiled decoding died of a segmentation fault, unlocated)."""
    faulthandler.enable()
    s = sizes(args.dry_run)
    if args.models_size:
        s["models"] = [*s["models"], "--size", *(f"{key}={n}" for key, n in args.models_size)]
    candidates = autotune_candidates(name, args.full_autotune)
    if candidates is not None and s["device"] == "cuda":
        limit_autotuning(candidates)
    PARTS[name](args.out, s)


def run_part(name: str, args, s: dict) -> str:
    """Run part ``name`` in a child process under its time limit; return its status."""
    command = [sys.executable, __file__, "--child", name, "--out", str(args.out)]
    command += ["--dry-run"] * args.dry_run + ["--full-autotune"] * args.full_autotune
    command += ["--models-size", *(f"{key}={n}" for key, n in args.models_size)] * bool(args.models_size)
    log = args.out / f"{name}.log"
    with open(log, "w") as output:
        try:
            result = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=s["limits"][name])
            status = "ok" if result.returncode == 0 else f"failed: exit code {result.returncode}: "
        except subprocess.TimeoutExpired:
            status = f"stopped at its time limit ({s['limits'][name]} s): "
    if name in SPEED_PARTS and not list((args.out / name).glob("*.csv")) and rows_from_log(log):
        write_csv(args.out / f"{name}_rows_before_stop.csv", rows_from_log(log))  # a benchmark writes at its end
    if status != "ok":
        status += " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
    return status


def write_check_record(args, facts: dict):
    """``record.json`` in the docs' provenance format (``lrpe_hf.training.provenance``), listing the CSVs beside it,
    with the check's own facts (driver, versions, autotuning, each part's status) in its invocation's entry."""
    from lrpe_hf.training import provenance

    files = sorted(path.name for path in args.out.glob("*.csv"))
    entry = provenance.invocation(args.out, "cuda" if not args.dry_run else "cpu", **facts)
    entry["source_hash"] = provenance.working_source_hash(ROOT)
    if entry["commit"] is None and args.commit:  # a copy without git history: clean where its source is the commit's
        expected = args.commit_source_hash
        entry["commit"], entry["clean"] = args.commit, expected == entry["source_hash"]
        if not entry["clean"]:
            why = "no source hash of the commit given" if not expected else f"the commit's source hash is {expected}"
            entry["changes"] = [f"source hash {entry['source_hash']} not checked against the commit: {why}"]
    record = dict(written_by="benchmarks/gpu_check.py", files=files, invocations=[entry])
    (args.out / "record.json").write_text(json.dumps(record, indent=2) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gpu_check")
    parser.add_argument("--dry-run", action="store_true", help="the rehearsal: CPU, tiny sizes, seconds")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--full-autotune", action="store_true", help="let fla's kernels try all their configurations")
    parser.add_argument(
        "--models-size", nargs="+", type=models_size_item, default=[], metavar="KEY=N",
        help="the models part's size, as benchmark_models.py --size takes it (default: the benchmark's, 6 x 512); "
        "layers=1 hidden=32 heads=2 ffn=64 vocab=256 rehearses that part in seconds",
    )  # fmt: skip
    parser.add_argument(
        "--commit", default=os.environ.get("GPU_CHECK_COMMIT"),
        help="where the machine's copy of the tree has no git history: the commit it is a copy of",
    )  # fmt: skip
    parser.add_argument(
        "--commit-source-hash", default=os.environ.get("GPU_CHECK_SOURCE_HASH"),
        help="with --commit: the commit's source hash (python -m lrpe_hf.training.provenance COMMIT, where git "
        "is); the record is clean only where the copy's own hash equals it",
    )  # fmt: skip
    parser.add_argument("--child", choices=list(PARTS), help=argparse.SUPPRESS)  # one part, run by the parent
    parser.add_argument("--fla-shapes-from", type=int, help=argparse.SUPPRESS)  # part_fla_shapes' runner
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_child(args.child, args)
    if args.fla_shapes_from is not None:
        return run_fla_shapes_from(args.fla_shapes_from, args.tokens, sizes(args.dry_run)["device"])
    s = sizes(args.dry_run)
    if s["device"] == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run the rehearsal with --dry-run")
    args.out.mkdir(parents=True, exist_ok=True)
    facts = {
        "dry_run": args.dry_run, **device_facts(s["device"]), "versions": versions(),
        "autotune_candidates_per_kernel": {name: autotune_candidates(name, args.full_autotune) for name in PARTS},
        "parts": {},
    }  # fmt: skip
    if s["device"] == "cuda":
        from lrpe_hf.modeling import products_triton

        facts["fla"] = products_triton.load_fla()[1] or "fla's kernels import"
        if products_triton.load_fla()[0] is not None:
            facts["fla_gated_backward_fails_bf16"] = products_triton.gated_backward_fails(torch.bfloat16)
    for name in args.parts:
        start = time.perf_counter()
        status = run_part(name, args, s)
        facts["parts"][name] = {"status": status, "seconds": round(time.perf_counter() - start, 1)}
        print(f"== {name}: {status} ({facts['parts'][name]['seconds']} s)", flush=True)
        write_check_record(args, facts)
    archive = args.out / "gpu_check.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(args.out.rglob("*")):
            if path.is_file() and path != archive:
                tar.add(path, arcname=str(path.relative_to(args.out)))
    failed = [name for name, part in facts["parts"].items() if part["status"] != "ok"]
    print(f"gpu check: {len(facts['parts']) - len(failed)} parts ok, {len(failed)} failed {failed}; {archive}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
