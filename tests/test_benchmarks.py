"""The benchmark scripts run end to end (at tiny sizes: their figures are measured by hand, not in tests)."""

import csv
import datetime
import gzip
import hashlib
import importlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import save_tiny_bert

import lrpe_hf

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def test_encodings_benchmark_reports_every_encoding_over_none(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "benchmark_encodings.py"), "--tokens", "64", "--rounds", "1"]
    command += ["--encodings", "rope", "fastrpb", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "encodings.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["encoding"] for r in rows] == ["none", "rope", "fastrpb"]  # none first: the others are over it
    assert all(float(r["fastest_ms"]) > 0 for r in rows)
    assert [r["target"] for r in rows] == ["1.15", "1.15", "1.15"]
    assert "| fastrpb |" in (tmp_path / "encodings.md").read_text()


def test_encodings_benchmark_keeps_the_rounds_behind_its_figures(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "benchmark_encodings.py"), "--tokens", "32", "--rounds", "3"]
    command += ["--encodings", "rope", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows, rounds = read_csv(tmp_path / "encodings.csv"), read_csv(tmp_path / "encodings_rounds.csv")
    assert [(r["encoding"], r["round"]) for r in rounds] == [(e, str(i)) for e in ("none", "rope") for i in range(3)]
    times = {e: [float(r["ms"]) for r in rounds if r["encoding"] == e] for e in ("none", "rope")}
    for row in rows:
        assert float(row["fastest_ms"]) == min(times[row["encoding"]])
        assert float(row["median_ms"]) == statistics.median(times[row["encoding"]])
        assert math.isclose(float(row["median_over_none"]), float(row["median_ms"]) / statistics.median(times["none"]))
    record = json.loads((tmp_path / "encodings.json").read_text())
    assert record["files"] == ["encodings.csv", "encodings_rounds.csv"]


def test_model_benchmark_keeps_the_rounds_behind_its_figures(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "benchmark_models.py"), "--lengths", "32", "--contexts", "8"]
    command += ["--batch-contexts", "8", "--encodings", "rope", "--reps", "3", "--out", str(tmp_path)]
    command += ["--size", "layers=1", "hidden=32", "heads=2", "ffn=64", "vocab=256"]  # the rounds, not the speed
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows, rounds = read_csv(tmp_path / "models.csv"), read_csv(tmp_path / "models_rounds.csv")
    tasks = [(r["task"], r["model"]) for r in rows]
    assert tasks == [(t, m) for t in ("train", "generate", "generate-batch8") for m in ("gpt2-sdpa", "rope")]
    for row in rows:
        mine = [r for r in rounds if (r["task"], r["model"], r["tokens"]) == (row["task"], row["model"], row["tokens"])]
        assert [r["round"] for r in mine] == ["0", "1", "2"]
        median = statistics.median(float(r["ms"]) for r in mine)
        if row["task"] == "train":
            assert {r["quantity"] for r in mine} == {"train step"}
            assert float(row["seconds"]) == median / 1000
        else:  # milliseconds per token: the median round of 16 one-token steps, over 16
            assert {r["quantity"] for r in mine} == {"token (mean of 16 steps)"}
            assert float(row["ms_per_token"]) == median
            batch = 8 if row["task"] == "generate-batch8" else 1
            assert math.isclose(float(row["tokens_per_s"]), 1000 * batch / median)
    record = json.loads((tmp_path / "models.json").read_text())
    assert record["files"] == ["models.csv", "models_rounds.csv"]


def test_attention_benchmark_keeps_the_rounds_behind_its_figures(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "benchmark_attention.py"), "--lengths", "64", "--modes", "causal"]
    command += ["--encodings", "rope", "--reps", "3", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows, rounds = read_csv(tmp_path / "results.csv"), read_csv(tmp_path / "results_rounds.csv")
    names = [(r["part"], r["name"]) for r in rows]
    assert names == [("kernel", "sdpa"), ("kernel", "linear"), ("layer", "rope")] + [
        ("layer", f"softmax+{e}") for e in ("none", "rope")
    ]
    for row in rows:
        mine = [r for r in rounds if (r["part"], r["name"], r["mode"]) == (row["part"], row["name"], row["mode"])]
        quantities = ["forward_ms", "train_ms"] + (
            ["floor_forward_ms", "floor_train_ms"] if row["part"] == "layer" else []
        )
        assert list(dict.fromkeys(r["quantity"] for r in mine)) == quantities
        for quantity in quantities:
            times = [float(r["ms"]) for r in mine if r["quantity"] == quantity]
            assert len(times) == 3 and float(row[quantity]) == statistics.median(times)
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["files"] == ["results.csv", "results_rounds.csv"]


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_each_benchmark_records_its_command_commit_machine_and_date(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "benchmark_encodings.py"), "--tokens", "32", "--rounds", "1"]
    command += ["--encodings", "rope", "--out", str(tmp_path)]
    assert subprocess.run(command, capture_output=True, text=True, timeout=300).returncode == 0
    record = json.loads((tmp_path / "encodings.json").read_text())
    assert record["written_by"] == "benchmarks/benchmark_encodings.py"
    (entry,) = record["invocations"]
    assert entry["command"].startswith("python benchmarks/benchmark_encodings.py --tokens 32")
    assert entry["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", entry["commit"])
    assert entry["clean"] in (True, False, None) and isinstance(entry["changes"], list)
    assert entry["date"].startswith(datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    assert entry["device"] and entry["torch"] == torch.__version__ and entry["transformers"] == transformers.__version__
    assert entry["threads"] >= 1 and entry["seconds"] > 0 and entry["allocator"].startswith("CPU allocator")


def test_linearization_benchmark_runs_every_stage_with_a_local_teacher(workspace, tmp_path):
    """A tiny random BERT stands in for the pretrained teacher (the benchmark itself fetches all-MiniLM-L6-v2; the
    tests never download): every model of the table is trained and evaluated, and the students that have no
    parameters for attention transfer skip it."""
    save_tiny_bert(workspace, tmp_path / "teacher", max_position_embeddings=80)
    tweets = tmp_path / "tweets"  # the first of the embedded tweets, every class among them: not 12,000 to tokenize
    tweets.mkdir()
    for split, count in (("train", 64), ("validation", 16)):
        rows = read_csv(ROOT / "data/tweet_sentiment" / f"{split}.csv")[:count]
        with open(tweets / f"{split}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    base = [sys.executable, str(BENCHMARKS / "linearization_quality.py"), "--teacher", str(tmp_path / "teacher")]
    base += ["--data_dir", str(tweets)]
    base += ["--output_dir", str(tmp_path / "out"), "--seeds", "0", "--teacher_steps", "2", "--finetune_steps", "2"]
    base += ["--max_eval_samples", "16", "--max_seq_length", "32", "--encodings", "none"]
    command = [*base, "--feature_maps", "elu,hedgehog", "--transfer_steps", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "out/results.csv") as f:
        rows = {(r["model"], r["feature_map"]): r for r in csv.DictReader(f)}
    transferred = ("linearized, 2 output_mse steps", "hedgehog")
    assert set(rows) == {
        ("softmax", "-"), ("softmax, same steps", "-"), ("linearized", "elu"), transferred,
        ("linear from scratch", "elu"),
    }  # fmt: skip
    assert [rows[k]["steps"] for k in sorted(rows)] == ["6", "4", "6", "2", "4"]
    assert rows[("linearized", "elu")]["transfer_loss"] == "-"  # nothing to train: no transfer stage
    assert rows[transferred]["transfer_loss"] == "output_mse"
    assert 0 <= float(rows[transferred]["accuracy_after_transfer"]) <= 1
    assert float(rows[transferred]["transfer_loss_eval"]) >= 0
    assert "| linearized, 2 output_mse steps | hedgehog | none |" in result.stdout
    record = json.loads((tmp_path / "out/results.json").read_text())
    assert record["written_by"] == "benchmarks/linearization_quality.py" and record["files"] == ["results.csv"]
    assert record["invocations"][0]["command"].startswith("python benchmarks/linearization_quality.py --teacher")

    # a variant of one student joins the table; the baselines are reused, the earlier rows kept
    variant = [*base, "--feature_maps", "hedgehog", "--transfer_steps", "3", "--scratch_encoding", ""]
    result = subprocess.run(variant, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "out/results.csv") as f:
        models = sorted(r["model"] for r in csv.DictReader(f))
    assert models == sorted([*(m for m, _ in rows), "linearized, 3 output_mse steps"])
    invocations = json.loads((tmp_path / "out/results.json").read_text())["invocations"]
    assert len(invocations) == 2 and "--transfer_steps 3" in invocations[1]["command"]  # both wrote into the CSV


def test_long_documents_benchmark_compares_students_with_the_teachers_workarounds(workspace, tmp_path):
    """A tiny random BERT (64 positions) stands in for all-MiniLM-L6-v2: every teacher method, the students of two
    encodings (one of them at two seeds, so that it gets an interval), the random-weight model, the short-text
    check and the costs are reported; the students read documents far past the teacher's table."""
    save_tiny_bert(workspace, tmp_path / "teacher", max_position_embeddings=520)
    command = [sys.executable, str(BENCHMARKS / "long_documents.py"), "--teacher", str(tmp_path / "teacher")]
    command += ["--output_dir", str(tmp_path / "out"), "--encodings", "rope,permute", "--seeds", "0,1"]
    command += ["--seeds_of", "permute=2", "--transfer_steps", "1", "--distill_steps", "1", "--batch_size", "1"]
    command += ["--documents", "11", "--short_text_rows", "64", "--cost_lengths", "512,1024"]  # 11: an 8k one
    command += ["--short_text_validation_rows", "64", "--distillation_file", str(workspace / "train.txt")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    methods = {(r["task"], r["method"], r["seed"]) for r in rows}
    for task in ("majority_topic", "dominant_topic"):
        for seed in ("0", "1"):
            assert (task, "teacher windows, mean+max", seed) in methods and (task, "student rope", seed) in methods
        assert (task, "student permute", "2") in methods and (task, "student permute", "0") not in methods
        assert (task, "teacher first 512", "2") in methods  # the teacher probed with the permute student's seed too
        assert (task, "random rope", "0") in methods
    assert all(0 <= float(r["accuracy"]) <= 1 for r in rows)
    with open(out / "comparisons.csv") as f:
        comparisons = {(r["task"], r["student"], r["against"]): r for r in csv.DictReader(f)}
    assert len(comparisons) == 2 * 2 * 6  # each student against 5 workarounds and its own first 512 tokens
    assert ("dominant_topic", "permute", "student permute, first 512") in comparisons
    assert comparisons["majority_topic", "rope", "teacher first 512"]["seeds"] == "2"
    assert comparisons["majority_topic", "permute", "teacher first 512"]["verdict"] == "inconclusive"  # one seed
    with open(out / "predictions.csv") as f:
        predictions = list(csv.DictReader(f))
    for (task, method, seed), row in {(r["task"], r["method"], r["seed"]): r for r in rows}.items():
        kept = [p for p in predictions if (p["task"], p["method"], p["seed"]) == (task, method, seed)]
        measured = [int(p["correct"]) for p in kept if p["length"] in ("1024", "2048", "4096")]
        assert float(row["accuracy"]) == pytest.approx(sum(measured) / len(measured))  # the documents' own mean
    compared = comparisons["majority_topic", "rope", "teacher first 512"]
    student, teacher = (
        [
            int(p["correct"])
            for p in predictions
            if p["task"] == "majority_topic" and p["method"] == m and p["length"] != "8192" and p["seed"] in ("0", "1")
        ]
        for m in ("student rope", "teacher first 512")
    )  # rope's two seeds (the teacher was probed with permute's too)
    assert float(compared["difference"]) == pytest.approx((sum(student) - sum(teacher)) / len(student))
    assert int(compared["documents"]) * 2 == len(student)  # two seeds
    with open(out / "costs.csv") as f:
        costs = {(r["method"], r["length"]): r for r in csv.DictReader(f)}
    assert set(costs) == {(m, n) for m in ("teacher first 512", "teacher windows", "student") for n in ("512", "1024")}
    assert all(float(r["ms"]) > 0 for r in costs.values())
    cost_rounds = read_csv(out / "costs_rounds.csv")
    for (method, length), row in costs.items():  # each cost is the median of its 3 kept rounds
        times = [float(r["ms"]) for r in cost_rounds if (r["method"], r["length"]) == (method, length)]
        assert len(times) == 3 and float(row["ms"]) == statistics.median(times)
    assert "### majority_topic" in result.stdout and "### Short texts" in result.stdout
    record = json.loads((out / "record.json").read_text())
    assert record["written_by"] == "benchmarks/long_documents.py"
    written = {"results.csv", "summary.csv", "comparisons.csv", "predictions.csv", "short_text.csv", "costs.csv"}
    written.add("costs_rounds.csv")
    assert set(record["files"]) == written


def test_attention_summary_gives_softmax_over_the_linear_layer_without_calling_it_slower():
    """SDPA's layer forward is stated as a multiple of the linear layer's time: 0.5x read "0.5x slower" before."""
    sys.path.insert(0, str(BENCHMARKS))
    benchmark_attention = importlib.import_module("benchmark_attention")
    layer = dict(part="layer", mode="causal", tokens=1024)
    times = dict(forward_ms=10.0, train_ms=30.0, floor_forward_ms=5.0, floor_train_ms=15.0)
    rows = [dict(layer, name="none", **times), dict(layer, name="softmax+none", forward_ms=5.0)]
    (line,) = [line for line in benchmark_attention.summary(rows) if "softmax (SDPA)" in line]
    assert "softmax (SDPA) layer forward 5.0 ms: 0.5x the linear layer's time" in line and "slower" not in line


def test_decode_latency_pairs_each_round_with_gpt2s():
    sys.path.insert(0, str(BENCHMARKS))
    decode_latency = importlib.import_module("decode_latency")
    gpt2 = [10.0, 12.0, 8.0, 11.0]
    twice = [2 * t * f for t, f in zip(gpt2, (1.0, 1.01, 0.99, 1.0))]
    times = {"gpt2-sdpa": gpt2, "twice": twice, "level": [10.5, 11.4, 8.4, 10.45]}
    rows = {r["model"]: r for r in decode_latency.rows_of(times, context=256, new_tokens=16)}
    # every round twice as slow within 1%: a ratio of 2, decided, though the rounds' own times vary by 50%
    assert abs(rows["twice"]["over_gpt2"] - 2.0) < 1e-3 and rows["twice"]["verdict"] == "slower"
    assert rows["twice"]["ms_per_token"] == round(statistics.median(twice), 3)
    same = {"gpt2-sdpa": gpt2, "twice": [2 * t for t in gpt2]}  # exactly 2 every round: no spread, no interval
    assert decode_latency.rows_of(same, context=256, new_tokens=16)[1]["verdict"] == "inconclusive"
    # ratios 1.05, 0.95, 1.05, 0.95: geometric mean sqrt(1.05 * 0.95), the t-interval of the log ratios around it
    logs = [math.log(r) for r in (1.05, 0.95, 1.05, 0.95)]
    half = 3.182446 * statistics.stdev(logs) / 2  # t(0.975, 3) sd / sqrt(4)
    assert rows["level"]["over_gpt2"] == round(math.sqrt(1.05 * 0.95), 4) and rows["level"]["verdict"] == "inconclusive"
    assert abs(rows["level"]["low"] - math.exp(statistics.fmean(logs) - half)) < 1e-4
    assert abs(rows["level"]["high"] - math.exp(statistics.fmean(logs) + half)) < 1e-4


def test_decode_latency_moves_each_weight_to_fresh_memory_keeping_values_strides_and_ties():
    sys.path.insert(0, str(BENCHMARKS))
    decode_latency = importlib.import_module("decode_latency")
    decoder = decode_latency.Decoder("none", torch.zeros(1, 4, dtype=torch.long), max_tokens=8)
    projection = decoder.model.model.stack.layers[0].self_attn.qkv_proj.weight
    projection.data = projection.data.t().contiguous().t()  # as a decoding step lays it out
    before = {name: (p.detach().clone(), p.data_ptr(), p.stride()) for name, p in decoder.model.named_parameters()}
    decoder.reallocate()
    for name, p in decoder.model.named_parameters():
        value, address, stride = before[name]
        assert torch.equal(p, value) and p.stride() == stride and p.data_ptr() != address, name
    assert decoder.model.lm_head.weight is decoder.model.model.embed_tokens.weight


def test_decode_latency_benchmark_writes_its_table_and_record(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "decode_latency.py"), "--encodings", "rope", "--rounds", "2"]
    command += ["--new_tokens", "2", "--context", "8", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "decode_latency.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == ["gpt2-sdpa", "rope"] and rows[1]["rounds"] == "2"
    assert float(rows[1]["low"]) <= float(rows[1]["over_gpt2"]) <= float(rows[1]["high"])
    with open(tmp_path / "decode_latency_rounds.csv") as f:
        rounds = list(csv.DictReader(f))
    for row in rows:  # the table's figures are its rounds' median and geometric mean
        mine = [float(r["ms_per_token"]) for r in rounds if r["model"] == row["model"]]
        gpt2 = [float(r["ms_per_token"]) for r in rounds if r["model"] == "gpt2-sdpa"]
        assert len(mine) == 2 and float(row["ms_per_token"]) == round(statistics.median(mine), 3)
        ratio = math.exp(statistics.fmean(math.log(m / g) for m, g in zip(mine, gpt2)))
        assert float(row["over_gpt2"]) == round(ratio, 4)
    record = json.loads((tmp_path / "decode_latency.json").read_text())
    assert record["written_by"] == "benchmarks/decode_latency.py"
    assert record["files"] == ["decode_latency.csv", "decode_latency_rounds.csv"]


def test_one_row_products_times_both_layouts_of_the_same_shapes_and_writes_its_record(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    one_row_products = importlib.import_module("one_row_products")
    for column_major in (False, True):
        weights = one_row_products.stack_weights(torch.float32, column_major, hidden=8, ffn=16, layers=2)
        assert [w.shape for w, _ in weights] == [(8, 8)] * 4 + [(16, 8), (8, 16)] + [(8, 8)] * 4 + [(16, 8), (8, 16)]
        assert all(w.t().is_contiguous() == column_major and w.is_contiguous() != column_major for w, _ in weights)
    command = [sys.executable, str(BENCHMARKS / "one_row_products.py"), "--dtypes", "float32", "--rows", "1"]
    command += ["--rounds", "2", "--repeats", "1", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "one_row_products.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["dtype"], row["rows"], row["rounds"]) == ("float32", "1", "2")
    assert float(row["low"]) <= float(row["ratio"]) <= float(row["high"])
    with open(tmp_path / "one_row_products_rounds.csv") as f:
        rounds = list(csv.DictReader(f))
    assert [r["round"] for r in rounds] == ["0", "1"]
    assert float(row["row_major_ms"]) == round(statistics.median(float(r["row_major_ms"]) for r in rounds), 4)
    record = json.loads((tmp_path / "one_row_products.json").read_text())
    assert record["written_by"] == "benchmarks/one_row_products.py"
    assert record["files"] == ["one_row_products.csv", "one_row_products_rounds.csv"]


def test_the_gpu_check_rehearses_every_part_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.py --dry-run: every part runs at tiny sizes, without the train extra's packages, so that
    a GPU's minutes never go to an import error or a typo; compiled decoding, by the user or by generate, is one graph
    a call, with no break."""
    blocked = tmp_path / "without_the_train_extra"  # as on a GPU machine with torch and transformers alone
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(
        "import sys\nfor name in ('datasets', 'evaluate', 'rotary_embedding_torch', 'parameterized'):\n"
        "    sys.modules[name] = None\n"
    )
    command = [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--dry-run", "--out", str(tmp_path / "out")]
    command += ["--models-size", "layers=1", "hidden=32", "heads=2", "ffn=64", "vocab=256"]  # not the 6 x 512 models
    environment = {**os.environ, "PYTHONPATH": str(blocked)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = tmp_path / "out"
    (facts,) = json.loads((out / "record.json").read_text())["invocations"]
    assert facts["dry_run"] and all(part["status"] == "ok" for part in facts["parts"].values())
    parts = {"fla_shapes", "overhead", "attention", "models", "train_steps", "families", "decoding", "pytest"}
    assert set(facts["parts"]) == parts
    with open(out / "fla_shapes.csv") as f:
        assert len(list(csv.DictReader(f))) == 12  # every case has its row, run or not (no fla kernels on a CPU)
    with open(out / "train_steps.csv") as f:
        steps = list(csv.DictReader(f))
    cases = {(row["encoding"], row["feature_map"]) for row in steps}
    assert len(cases) == len(lrpe_hf.POSITIONAL_ENCODINGS) + 3
    assert len(steps) == 6 * len(cases)  # fp32, tf32, bf16 x padded, packed
    assert all(row["finite"] == "True" and float(row["gradient_cosine"]) > 0.999 for row in steps)
    with open(out / "decoding.csv") as f:
        decoding = list(csv.DictReader(f))
    assert [row["compiled_by"] for row in decoding] == ["user", "generate"]  # the user's compile, and generate's own
    for row in decoding:
        assert row["same_tokens"] == "True" and row["graph_breaks"] == "0" and row["recompilations"] == "0"
    assert (out / "gpu_check.tar.gz").stat().st_size > 0


def test_the_context_parallel_benchmark_counts_what_it_computes(tmp_path):
    """Two gloo processes against one at a tiny size: the bytes counted through the gathers are the states the
    computed table names (kv with key sums per head, forward and backward) plus the counters, whatever the length."""
    command = [sys.executable, str(BENCHMARKS / "context_parallel_traffic.py"), "--measure", "--tokens", "256"]
    command += ["--reps", "2", "--encodings", "none", "--lengths", "32768", "--ranks", "2", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "measured.csv") as f:
        (row,) = list(csv.DictReader(f))
    rounds = read_csv(tmp_path / "measured_rounds.csv")
    times = {q: [float(r["ms"]) for r in rounds if r["quantity"] == q] for q in ("one process", "rank 0", "rank 1")}
    assert all(len(t) == 2 for t in times.values())
    assert float(row["one_process_ms"]) == round(statistics.median(times["one process"]), 1)
    slower = max(statistics.median(times["rank 0"]), statistics.median(times["rank 1"]))
    assert float(row["two_ranks_ms"]) == round(slower, 1)
    state = 8 * 64 * 65 * 4  # heads x features x (head width + key sums), float32
    # the total decay per head; the rank's token count, its real tokens and last real position per row (int64)
    decays, counters = 8 * 4, 3 * 8
    assert int(row["sent_bytes_per_step"]) == 2 * state + decays + counters  # forward gather, backward gather
    with open(tmp_path / "traffic.csv") as f:
        (computed,) = list(csv.DictReader(f))
    assert int(computed["ours_bytes"]) == state + 8 * 64 * 4  # and the unrotated key sums where the encoding rotates


def test_host_cost_benchmark_times_every_model_in_turn_and_counts_reads_and_ops(tmp_path):
    """benchmarks/host_cost.py: each model's step over GPT-2's in the same rounds, its interval around the ratio, the
    target met only where the whole interval lies at or below it, no host read in LinearGPT's steps, and the fla
    path (its kernels stood in) counting other ops than the torch path."""
    command = [sys.executable, str(BENCHMARKS / "host_cost.py"), "--encodings", "none", "permute", "--rounds", "2"]
    command += ["--steps_per_round", "1", "--paths", "fla", "torch", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "host_cost.csv") as f:
        rows = list(csv.DictReader(f))
    models = ["gpt2-sdpa", "plain-linear+fla", "none+fla", "permute+fla", "none", "permute"]
    assert [(r["step"], r["model"]) for r in rows] == [(step, m) for step in ("train", "decode") for m in models]
    for row in rows:
        assert row["rounds"] == "2" and row["mode"] == "eager"
        if row["model"] not in ("gpt2-sdpa", "plain-linear+fla"):
            assert float(row["low"]) <= float(row["over_gpt2"]) <= float(row["high"])
            assert row["met"] == str(float(row["high"]) <= float(row["target"]))
            assert row["calls_met"] == str(float(row["calls_over_gpt2"]) <= float(row["calls_target"]))
            assert row["host_reads"] == "0"
    calls = {(r["step"], r["model"]): int(r["calls"]) for r in rows}
    for step in ("train", "decode"):  # the floor is the least host work: fewer calls than any model here
        assert calls[(step, "plain-linear+fla")] < min(calls[(step, m)] for m in models if m != "plain-linear+fla")
    ops = {(r["step"], r["model"]): int(r["ops"]) for r in rows}
    assert ops[("train", "none+fla")] != ops[("train", "none")]
    with open(tmp_path / "host_cost_rounds.csv") as f:
        assert len(list(csv.DictReader(f))) == 2 * 2 * len(models)
    assert (tmp_path / "host_cost.json").exists()


def test_the_host_cost_floor_decodes_as_its_full_forward():
    """The plain linear-attention GPT (the host-cost benchmark's floor) computes causal linear attention: with an
    explicit O(N^2) causal product, decoding token by token gives its full forward's logits."""
    sys.path.insert(0, str(BENCHMARKS))
    from plain_linear_gpt import PlainLinearGPT

    def quadratic_product(q, k, v):  # (B, N, H, d) -> sum_{t <= s} (q_s . k_t) v_t
        scores = torch.einsum("bshd,bthd->bhst", q, k).tril()
        return torch.einsum("bhst,bthe->bshe", scores, v), None

    torch.manual_seed(0)
    model = PlainLinearGPT(2, 16, 2, 32, 50, quadratic_product).double().eval()
    ids = torch.randint(0, 50, (2, 9))
    full = model(ids).logits
    prompt = model(ids[:, :5], use_cache=True)
    steps = [prompt.logits] + [model(ids[:, t : t + 1], use_cache=True, cache=prompt.cache).logits for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_the_gpu_checks_record_is_clean_only_where_its_source_hash_is_the_commits(tmp_path, monkeypatch):
    """A GPU machine's copy of the tree has no git history: the record says clean only where the copy's source hash
    (computed there) equals the commit's (computed from git here), never on the caller's word."""
    import argparse

    from lrpe_hf.training import provenance

    sys.path.insert(0, str(BENCHMARKS))
    gpu_check = importlib.import_module("gpu_check")
    monkeypatch.setattr(provenance, "working_tree", lambda output_dir: (None, None, []))  # no git there
    here = provenance.working_source_hash()
    for given, clean in [(here, True), ("0" * 64, False), (None, False)]:
        args = argparse.Namespace(out=tmp_path, dry_run=True, commit="a" * 40, commit_source_hash=given)
        gpu_check.write_check_record(args, {})
        (entry,) = json.loads((tmp_path / "record.json").read_text())["invocations"]
        assert entry["commit"] == "a" * 40 and entry["source_hash"] == here and entry["clean"] is clean
        assert bool(entry["changes"]) is not clean


def test_a_commits_source_hash_is_its_checkouts():
    """The hash of HEAD's files read from git equals the hash of the files on disk where no source file changed
    (a clean clone, as CI's); a changed source file changes it."""
    from lrpe_hf.training import provenance

    status = provenance.git("status", "--porcelain")
    if status is None:
        pytest.skip("not a git checkout")
    if any(provenance.is_source(line[3:].strip('"')) for line in status.splitlines()):
        pytest.skip("source files changed in this checkout")
    assert provenance.committed_source_hash("HEAD") == provenance.working_source_hash()
    files = {"lrpe_hf/a.py": b"x = 1\n", "README.md": b"text"}
    assert provenance.source_hash(files) != provenance.source_hash({**files, "lrpe_hf/a.py": b"x = 2\n"})
    assert provenance.source_hash(files) == provenance.source_hash({**files, "README.md": b"other"})


def write_documentation(root, task, documents):
    """A Documentation/ folder of gzipped .rst files and the task's split files naming them, as
    data/build_embedded_data.py writes them: documents maps split -> [(path, label, text)]."""
    for split, rows in documents.items():
        with open(task / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "label", "words", "sha256"])
            for path, label, text in rows:
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                (root / path).write_bytes(gzip.compress(text.encode()))
                writer.writerow([path, label, len(text.split()), hashlib.sha256(text.encode()).hexdigest()])


@pytest.fixture
def kernel_corpus(workspace, tmp_path):
    """(a tiny Documentation/ folder, its task's split files, a tiny teacher): two subsystems whose documents differ
    in their words, each document over 512 tokens (two windows, the second shorter), four training documents of
    each (the probe's four folds), three to validate."""
    save_tiny_bert(workspace, tmp_path / "teacher", max_position_embeddings=520)
    leads = (ROOT / "data/wikipedia_leads/train.txt").read_text(encoding="utf-8").splitlines()
    words = {"net": " ".join(leads[:40]).split(), "fs": " ".join(leads[40:80]).split()}

    def document(label, index):
        return " ".join(words[label][index * 50 : index * 50 + 300])  # 300 words: about 850 tokens

    root, task = tmp_path / "Documentation", tmp_path / "task"
    task.mkdir()
    splits = {"train": range(4), "validation": range(8, 11), "distillation": range(11, 12)}
    write_documentation(root, task, {
        split: [(f"{label}/doc{i}.rst.gz", label, document(label, i)) for label in words for i in indices]
        for split, indices in splits.items()
    })  # fmt: skip
    return root, task, tmp_path / "teacher"


def test_natural_documents_reads_the_package_and_compares_every_method_with_tf_idf(kernel_corpus, tmp_path):
    """Every method, tf-idf and a student are probed on every validation document at two seeds, each prediction
    kept; the comparisons are the documents' own differences; a file whose text is not the task's stops the run,
    naming it."""
    root, task, teacher = kernel_corpus
    command = [sys.executable, str(BENCHMARKS / "natural_documents.py"), "--teacher", str(teacher)]
    command += ["--documentation", str(root), "--task_dir", str(task), "--output_dir", str(tmp_path / "out")]
    command += ["--encodings", "rope", "--seeds", "0,1", "--transfer_steps", "1", "--distill_steps", "1"]
    command += ["--batch_size", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    rows = read_csv(out / "results.csv")
    methods = {"tf-idf", "teacher first 512", "teacher head+tail", "teacher windows, mean", "teacher windows, max",
               "teacher windows, mean+max", "student rope"}  # fmt: skip
    assert {(r["method"], r["seed"]) for r in rows} == {(m, s) for m in methods for s in ("0", "1")}
    predictions = read_csv(out / "predictions.csv")
    for row in rows:
        kept = [int(p["correct"]) for p in predictions if (p["method"], p["seed"]) == (row["method"], row["seed"])]
        assert len(kept) == 6 and float(row["accuracy"]) == pytest.approx(sum(kept) / 6)
    comparisons = {(c["method"], c["against"]): c for c in read_csv(out / "comparisons.csv")}
    assert set(comparisons) == {(m, "tf-idf") for m in methods - {"tf-idf"}} | {
        ("student rope", t) for t in methods - {"tf-idf", "student rope"}
    }
    right = {m: [int(p["correct"]) for p in predictions if p["method"] == m] for m in ("student rope", "tf-idf")}
    difference = (sum(right["student rope"]) - sum(right["tf-idf"])) / len(right["tf-idf"])
    assert float(comparisons["student rope", "tf-idf"]["difference"]) == pytest.approx(difference)
    assert json.loads((out / "record.json").read_text())["written_by"] == "benchmarks/natural_documents.py"

    (root / "fs/doc8.rst.gz").write_bytes(gzip.compress(b"another text"))
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode != 0 and "fs/doc8.rst.gz: its text is not the one" in result.stderr


def test_natural_documents_summary_says_when_a_comparison_has_no_interval():
    """Over one seed a paired comparison has no interval: the summary says so rather than print nan, and prints the
    interval and p of a comparison over two seeds as the test computed them."""
    from lrpe_hf.training.verdicts import paired_over_seeds_and_items

    sys.path.insert(0, str(BENCHMARKS))
    natural_documents = importlib.import_module("natural_documents")
    rows = [dict(method=m, seed=0, accuracy=0.5) for m in ("student rope", "tf-idf")]
    differences = np.array([[1.0, 0.0, 1.0, 0.0, 1.0, -1.0], [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    for seeds in (1, 2):
        test = paired_over_seeds_and_items(differences[:seeds])
        comparison = dict(method="student rope", against="tf-idf", seeds=test.pairs, difference=test.mean,
                          low=test.low, high=test.high, p_value=test.p_value, verdict="inconclusive")  # fmt: skip
        report = "\n".join(natural_documents.summary(rows, [comparison], documents=6, protocol="probe"))
        assert "nan" not in report
        if seeds == 1:
            assert "| none | none |" in report and "has no interval" in report
        else:
            interval = f"[{100 * test.low:+.1f}, {100 * test.high:+.1f}] | {test.p_value:.3f}"
            assert interval in report and "has no interval" not in report


def test_natural_documents_fine_tuned_trains_every_method_and_resumes(kernel_corpus, tmp_path):
    """Each teacher method and a student fine-tuned at two seeds (the defaults but one epoch of 4 documents a step:
    two steps, one of them past the warm-up's), every validation document's prediction kept and compared as the
    probe's are, tf-idf among them; a rerun into the same folder trains nothing again, and its record keeps the first
    invocation's entry; one with other settings is refused."""
    root, task, teacher = kernel_corpus
    command = [sys.executable, str(BENCHMARKS / "natural_documents_fine_tuned.py"), "--teacher", str(teacher)]
    command += ["--documentation", str(root), "--task_dir", str(task), "--output_dir", str(tmp_path / "out")]
    command += ["--students_dir", str(tmp_path / "students"), "--encodings", "rope", "--seeds", "0,1"]
    command += ["--epochs", "1", "--accumulation", "4", "--transfer_steps", "1", "--distill_steps", "1"]
    command += ["--batch_size", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    methods = {"tf-idf", "teacher first 512", "teacher head+tail", "teacher windows, mean", "student rope"}
    rows = read_csv(out / "results.csv")
    assert {(r["method"], r["seed"]) for r in rows} == {(m, s) for m in methods for s in ("0", "1")}
    predictions = read_csv(out / "predictions.csv")
    for row in rows:
        kept = [int(p["correct"]) for p in predictions if (p["method"], p["seed"]) == (row["method"], row["seed"])]
        assert len(kept) == 6 and float(row["accuracy"]) == pytest.approx(sum(kept) / 6)
    comparisons = {(c["method"], c["against"]) for c in read_csv(out / "comparisons.csv")}
    assert comparisons == {(m, "tf-idf") for m in methods - {"tf-idf"}} | {
        ("student rope", t) for t in methods - {"tf-idf", "student rope"}
    }
    training = read_csv(out / "training.csv")
    assert {(r["method"], r["seed"]) for r in training} == {(m, s) for m in methods - {"tf-idf"} for s in ("0", "1")}
    assert all(math.isfinite(float(r["training_loss"])) for r in training)
    assert (tmp_path / "students" / "rope-seed1" / "losses.json").exists()  # made where it was missing

    kept_runs = {path: path.stat().st_mtime_ns for path in (out / "runs").iterdir()}
    assert len(kept_runs) == 8
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {path: path.stat().st_mtime_ns for path in (out / "runs").iterdir()} == kept_runs
    assert read_csv(out / "results.csv") == rows
    record = json.loads((out / "record.json").read_text())  # both invocations: the second read the first's runs
    assert record["written_by"] == "benchmarks/natural_documents_fine_tuned.py" and len(record["invocations"]) == 2
    result = subprocess.run([*command, "--fine_tuning_learning_rate", "1e-4"], capture_output=True, text=True)
    assert result.returncode != 0 and "was fine-tuned with other settings" in result.stderr


def test_a_fine_tuned_document_is_the_mean_of_its_windows_and_learns_from_each(workspace, tmp_path):
    """The classifier's vector of a document read in windows of unequal length is the mean of each window's
    mean-pooled vector computed alone (the probe's pooling, no padding), and the loss reaches the embeddings of
    tokens that only the last window holds."""
    from transformers import AutoModel, AutoTokenizer

    sys.path.insert(0, str(BENCHMARKS))
    fine_tuned = importlib.import_module("natural_documents_fine_tuned")
    long_documents = importlib.import_module("long_documents")
    folder = save_tiny_bert(workspace, tmp_path / "teacher", max_position_embeddings=520)
    tokenizer, encoder = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder)
    last, unseen = range(300, 350), range(350, encoder.config.vocab_size)  # only the last window holds 300-349
    tokens = [10 + i % 290 for i in range(510)] + list(last)
    rows = fine_tuned.rows_of("teacher windows, mean", tokens)
    assert [len(r) for r in rows] == [510, 50]
    classifier = fine_tuned.DocumentClassifier(encoder, labels=3).eval()
    batch = fine_tuned.OneDocument(tokenizer.pad_token_id)(
        [dict(input_ids=[fine_tuned.with_special_tokens(tokenizer, r) for r in rows], labels=1)]
    )
    output = classifier(**batch)
    alone = torch.cat([long_documents.mean_pooled(encoder, [row], tokenizer) for row in rows]).mean(0)
    torch.testing.assert_close(output["logits"][0], classifier.classifier(alone), rtol=1e-5, atol=1e-5)
    output["loss"].backward()
    gradient = encoder.embeddings.word_embeddings.weight.grad
    assert gradient[last].abs().sum(-1).min() > 0 and gradient[unseen].abs().sum() == 0
