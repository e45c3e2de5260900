"""The encoding comparison tool: a tiny sweep end to end, resuming a killed sweep, the synthetic tasks, bad input."""

import csv
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from lrpe_hf.training import compare, synthetic
from lrpe_hf.training.synthetic import copy_examples, recall_examples, synthetic_dataset

TINY = [
    "--hidden_size", "16", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--intermediate_size", "32",
    "--batch_size", "4", "--max_steps", "2", "--warmup_steps", "0", "--logging_steps", "1", "--max_eval_samples", "8",
]  # fmt: skip
SWEEP = ["--task", "copy", "--encodings", "rope,softmax:rope", "--seeds", "2", "--block_size", "16", *TINY]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A finished tiny sweep: 2 encodings (one a softmax baseline) x 2 seeds on the copy task."""
    out = tmp_path_factory.mktemp("compare") / "sweep"
    compare.main([*SWEEP, "--output_dir", out])
    return out


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_tiny_sweep_writes_the_table_the_csv_and_the_plots(sweep):
    rows = read_csv(sweep / "results.csv")
    assert [(r["encoding"], r["feature_map"], r["seed"]) for r in rows] == [
        ("rope", "elu", "0"), ("softmax:rope", "-", "0"), ("rope", "elu", "1"), ("softmax:rope", "-", "1"),
    ]  # fmt: skip
    for row in rows:
        assert row["task"] == "copy"
        for column in ("accuracy", "train_time_s", "train_tokens_per_s", "peak_memory_mb"):
            assert math.isfinite(float(row[column])), (column, row)
        assert 0 <= float(row["accuracy"]) <= 1 and float(row["peak_memory_mb"]) > 10

    table = (sweep / "results.md").read_text().split("Every encoding against")[0].splitlines()  # the first table
    body = [line for line in table if line.startswith("| rope") or line.startswith("| softmax:rope")]
    assert len(body) == 2
    for line in body:
        cells = [c.strip() for c in line.strip("|").split("|")]
        mean, std = cells[2].split(" ± ")
        accuracies = [float(r["accuracy"]) for r in rows if r["encoding"] == cells[0]]
        assert float(mean) == pytest.approx(np.mean(accuracies), abs=1e-3)
        assert float(std) == pytest.approx(np.std(accuracies, ddof=1), abs=1e-2)
        assert cells[-1] == "2"  # seeds

    for name in ("metric_accuracy.png", "loss_curves.png"):
        assert (sweep / name).read_bytes()[:8] == PNG_SIGNATURE, name
    for run in ("rope-elu-seed0", "softmax_rope-seed1"):
        result = json.loads((sweep / "runs" / run / "result.json").read_text())
        assert result["loss_curve"] and (sweep / "runs" / run / "model.safetensors").exists()


def test_a_sweep_compares_every_encoding_with_the_first_paired_by_seed(sweep):
    """comparisons.csv and results.md: softmax:rope against rope (the first listed), the paired difference of the
    runs' own accuracies, with the verdict rule's interval and word."""
    rows = read_csv(sweep / "results.csv")
    accuracy = {(r["encoding"], r["seed"]): float(r["accuracy"]) for r in rows}
    differences = [accuracy[("softmax:rope", s)] - accuracy[("rope", s)] for s in ("0", "1")]
    (record,) = [r for r in read_csv(sweep / "comparisons.csv") if r["metric"] == "accuracy"]
    assert (record["encoding"], record["baseline"], record["baseline_feature_map"], record["pairs"]) == (
        "softmax:rope", "rope", "elu", "2",
    )  # fmt: skip
    assert float(record["difference"]) == pytest.approx(np.mean(differences), abs=1e-9)
    half = 12.706 * np.std(differences, ddof=1) / math.sqrt(2)  # t(0.975, 1 degree of freedom)
    if half > 1e-9 * max(1.0, abs(np.mean(differences))):
        assert float(record["low"]) == pytest.approx(np.mean(differences) - half, abs=1e-3)
        assert float(record["high"]) == pytest.approx(np.mean(differences) + half, abs=1e-3)
        expected = "better" if float(record["low"]) > 0 else "worse" if float(record["high"]) < 0 else "inconclusive"
    else:  # the same difference on both seeds: no interval
        assert record["low"] == record["high"] == ""
        expected = "inconclusive"
    assert record["verdict"] == expected
    markdown = (sweep / "results.md").read_text()
    assert "Every encoding against rope" in markdown
    record = json.loads((sweep / "results.json").read_text())
    assert record["written_by"] == "run_scripts/compare_encodings.py"
    assert record["files"] == ["comparisons.csv", "results.csv"]
    (entry,) = record["invocations"]
    assert entry["runs"] == entry["runs_trained"] == 4 and entry["jobs"] == 2 and entry["threads_per_run"] == 1
    assert entry["finished"] is True  # one entry for the invocation, however often the sweep rewrote it
    (code,) = entry["run_code"]  # every run trained by this checkout's code
    assert entry["run_code"][code] == 4 and code.split("+")[0] == entry["commit"]
    for field in ("command", "commit", "clean", "device", "torch", "transformers", "threads", "date", "seconds"):
        assert field in entry, field
    assert "| softmax:rope | - | accuracy | rope (elu) | 2 |" in markdown


def test_a_killed_sweep_resumes_without_retraining_finished_runs(sweep, tmp_path, capsys):
    out = tmp_path / "sweep"
    shutil.copytree(sweep, out)
    killed = out / "runs" / "rope-elu-seed1"
    (killed / "result.json").unlink()  # as if killed mid-run: a partial folder without its done marker
    (killed / "stale.txt").write_text("left by the killed run")
    older = out / "runs" / "softmax_rope-seed1" / "result.json"  # a run finished by other code: kept, and told
    older.write_text(json.dumps(json.loads(older.read_text()) | {"code": "0" * 40}))
    finished = [out / "runs" / name / "result.json" for name in ("rope-elu-seed0", "softmax_rope-seed0")]
    finished.append(out / "runs" / "softmax_rope-seed1" / "model.safetensors")
    mtimes = [path.stat().st_mtime_ns for path in finished]

    compare.main([*SWEEP, "--output_dir", out])

    assert [path.stat().st_mtime_ns for path in finished] == mtimes
    assert (killed / "result.json").exists() and not (killed / "stale.txt").exists()
    assert len(read_csv(out / "results.csv")) == 4
    printed = capsys.readouterr().out
    assert printed.count("finished earlier, skipped") == 3
    invocations = json.loads((out / "results.json").read_text())["invocations"]
    assert len(invocations) == 2 and invocations[1]["runs_trained"] == 1  # the resumed sweep's own entry
    assert invocations[0]["finished"] is invocations[1]["finished"] is True
    assert invocations[1]["run_code"]["0" * 40] == 1 and sum(invocations[1]["run_code"].values()) == 4
    assert "these runs were trained by different code" in printed
    assert "Every encoding against rope" in printed and "| softmax:rope | - | accuracy | rope (elu) | 2 |" in printed
    assert "[3/4] rope-elu-seed1: started" in printed and "[3/4] rope-elu-seed1: finished in" in printed


def test_a_stopped_sweep_has_recorded_how_far_it_went(sweep, tmp_path, monkeypatch):
    """results.csv and results.json are rewritten after each run, so a sweep stopped part-way leaves the rows of its
    finished runs and its own entry: how many runs it trained itself, and that it did not finish."""
    out = tmp_path / "sweep"
    shutil.copytree(sweep, out)
    (out / "results.json").unlink()
    for name in ("rope-elu-seed1", "softmax_rope-seed1"):
        (out / "runs" / name / "result.json").unlink()  # two runs left to train
    names = ("rope-elu-seed0", "softmax_rope-seed0", "rope-elu-seed1")
    so_far = [json.loads((sweep / "runs" / name / "result.json").read_text()) for name in names]

    def stopped_after_one_run(runs, jobs, after_each_run):
        after_each_run(so_far)  # the two found finished and one trained
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "sweep", stopped_after_one_run)
    with pytest.raises(KeyboardInterrupt):
        compare.main([*SWEEP, "--output_dir", out])
    rows = read_csv(out / "results.csv")
    assert [(r["encoding"], r["seed"]) for r in rows] == [("rope", "0"), ("softmax:rope", "0"), ("rope", "1")]
    record = json.loads((out / "results.json").read_text())
    (entry,) = record["invocations"]
    assert record["files"] == ["results.csv"] and entry["command"].startswith("python ")
    assert (entry["runs"], entry["runs_trained"], entry["finished"]) == (4, 1, False)


def test_a_sweep_refuses_to_mix_runs_of_other_settings(sweep, tmp_path):
    out = tmp_path / "sweep"
    shutil.copytree(sweep, out)
    with pytest.raises(ValueError, match="trained with other settings"):
        compare.main([*SWEEP, "--learning_rate", "0.5", "--output_dir", out])


def test_copy_labels_are_the_tokens_lag_positions_back():
    lag, length = 3, 12
    columns = copy_examples(5, length, vocab_size=7, lag=lag, seed=0)
    for tokens, labels in zip(columns["input_ids"], columns["labels"]):
        # labels[t] is the output after reading tokens 0..t-1: the token lag positions before t-1
        expected = [tokens[t - 1 - lag] if t - 1 - lag >= 0 else -100 for t in range(length)]
        assert labels.tolist() == expected
    assert columns["input_ids"].min() >= 0 and columns["input_ids"].max() < 7


def test_recall_labels_are_the_values_of_the_queried_keys():
    vocab, length = 10, 24
    pairs = length // 4
    columns = recall_examples(20, length, vocab_size=vocab, seed=0)
    for tokens, labels in zip(columns["input_ids"].tolist(), columns["labels"].tolist()):
        keys, values = tokens[0 : 2 * pairs : 2], tokens[1 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and all(0 <= k < vocab for k in keys)
        assert all(vocab <= v < 2 * vocab for v in values)
        lookup = dict(zip(keys, values))
        expected = [-100] * length
        for position in range(2 * pairs, length, 2):  # query key, then its value
            assert tokens[position] in lookup and tokens[position + 1] == lookup[tokens[position]]
            expected[position + 1] = lookup[tokens[position]]
        assert labels == expected


def test_synthetic_datasets_are_seeded():
    first = synthetic_dataset("recall", 4, 16, 8, lag=1, seed=3)
    assert first.column_names == ["input_ids", "labels"]
    assert first["input_ids"] == synthetic_dataset("recall", 4, 16, 8, lag=1, seed=3)["input_ids"]
    assert first["input_ids"] != synthetic_dataset("recall", 4, 16, 8, lag=1, seed=4)["input_ids"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "copy", "--encodings", "rope,nosuch"], "Unknown encoding.*nosuch.*valid names: none, rope"),
        (["--preset", "table9"], "Unknown --preset 'table9'; valid presets: lrpe_table2, lrpe_table1"),
        (["--task", "translate", "--encodings", "rope"], "valid tasks: clm, mlm, image, copy, recall"),
        (["--task", "copy", "--encodings", "rope", "--feature_maps", "nosuch"], "valid values: elu, relu"),
        (["--task", "copy"], "Give --encodings"),
        (
            ["--task", "copy", "--encodings", "rope,none", "--baseline", "learned"],
            "--baseline learned is not among the encodings compared \\(rope, none\\)",
        ),
        (["--task", "copy", "--encodings", "rope", "--profile", "huge"], "valid values: quick, medium, full"),
        (["--task", "copy", "--encodings", "rope", "--config_overrides", "{bad"], "--config_overrides must be a JSON"),
        (
            ["--task", "copy", "--encodings", "rope", "--config_overrides", "[1]"],
            "must be a JSON object, got '\\[1\\]'",
        ),
        (["--task", "copy", "--encodings", "rope", "--config_overrides", '{"nosuch": 1}'], "has no field nosuch"),
        (
            ["--task", "copy", "--encodings", "rope", "--eval_lengths", "64"],
            "Not a setting of task copy: --eval_lengths",
        ),
    ],
)
def test_bad_input_says_what_is_valid(args, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        compare.main([*args, "--output_dir", tmp_path / "out"])
    assert not (tmp_path / "out").exists()  # nothing ran


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(compare.PRESETS))
def test_every_preset_runs_end_to_end_at_a_tiny_size(preset, workspace, tmp_path):
    """Each preset with its first encoding and its last (a baseline), one seed, a tiny model, two steps."""
    encodings = compare.PRESETS[preset]["encodings"]
    args = ["--preset", preset, "--encodings", f"{encodings[0]},{encodings[-1]}", "--seeds", "1", *TINY]
    task = compare.PRESETS[preset]["task"]
    if task in ("clm", "mlm"):
        args += ["--tokenizer_name", workspace / "tokenizer", "--train_file", workspace / "train.txt"]
        args += ["--validation_file", workspace / "validation.txt"]
    if task == "mlm":
        args += ["--finetune_max_steps", "2", "--finetune_max_eval_samples", "16"]
    if task != "image":
        args += ["--block_size", "16"]
    if preset == "extrapolation":
        args += ["--eval_lengths", "16,32"]
    if preset == "image":
        args += ["--image_size", "8", "--patch_size", "4"]
    results = compare.main([*args, "--output_dir", tmp_path / preset])
    assert len(results) == 2
    for result in results:
        assert result["metrics"] and all(math.isfinite(v) for v in result["metrics"].values())
    assert (tmp_path / preset / "results.md").exists()
    if preset == "extrapolation":
        assert (tmp_path / preset / "extrapolation.png").read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize("module", [compare, synthetic])
def test_help_is_grouped_and_every_option_explained(module):
    text = module.argument_parser().format_help()
    groups = re.findall(r"^(\w+): .*:$", text, flags=re.M)
    assert groups, "options come in named groups"
    ours = text.split(f"{groups[0]}: ")[1]
    options = re.findall(r"^  (--\w+)", ours, flags=re.M)
    undocumented = [o for o in options if re.search(rf"^  {o}[^\n]*\n\s+\(default", ours, flags=re.M)]
    assert options and not undocumented, undocumented


def test_flags_override_the_preset_which_overrides_the_profile(tmp_path):
    args = compare.CompareArguments(preset="extrapolation", block_size=32, seeds=2, output_dir=str(tmp_path))
    settings = compare.resolve(args)
    assert settings["task"] == "clm" and settings["block_size"] == 32 and settings["seeds"] == 2  # flags
    assert settings["eval_lengths"] == [64, 128, 256, 512, 1024]  # the preset
    assert settings["max_steps"] == compare.TASK_PROFILES["clm"]["quick"]["max_steps"]  # the profile
    assert settings["encodings"] == compare.PRESETS["extrapolation"]["encodings"]
    assert settings["train_file"].endswith("data/wikipedia_leads/train.txt")  # the embedded data
    full = compare.resolve(compare.CompareArguments(preset="lrpe_table2", profile="full"))
    assert full["hidden_size"] == 512 and full["jobs"] == 1 and full["output_dir"] == "out/compare/lrpe_table2"
    # the medium profile: the setup of the 400-step runs in docs/results.md, every preset and task defined
    medium = compare.resolve(compare.CompareArguments(preset="extrapolation", profile="medium"))
    assert (medium["hidden_size"], medium["block_size"], medium["max_steps"]) == (128, 128, 400)
    assert medium["eval_lengths"] == [128, 256, 512, 1024, 2048] and medium["tokenizer_vocab_size"] == 8192
    for preset in compare.PRESETS:
        assert compare.resolve(compare.CompareArguments(preset=preset, profile="medium"))["max_steps"] == 400


def test_without_feature_maps_each_encoding_gets_its_default(tmp_path):
    settings = compare.resolve(
        compare.CompareArguments(task="copy", encodings="rope,permute,learned,softmax:rope", output_dir=str(tmp_path))
    )
    runs = compare.plan_runs(settings)
    expected = ["elu", "relu", "elu", "-"]  # rope: 1 + elu; permute: its paper's relu; learned: none's elu
    assert [run["feature_map"] for run in runs[:4]] == expected
    assert [run["name"] for run in runs[:4]][-1] == "softmax_rope-seed0"
    assert len(runs) == 4 * settings["seeds"]


def test_an_encoding_in_its_authors_setup_builds_the_authors_model(tmp_path):
    """``lrpe_orthogonal@authors``: the output LayerNorm, token embeddings times sqrt(d), sinusoidal positions,
    for the causal and the masked LM; the sweep's own --config_overrides still win; elsewhere a clear refusal."""
    from lrpe_hf import LinearGPTConfig, LinearRobertaConfig
    from lrpe_hf.training.arguments import ModelArguments, build_config
    from lrpe_hf.training.compare_tasks import model_arguments

    for task, config_class in (("clm", LinearGPTConfig), ("mlm", LinearRobertaConfig)):
        settings = compare.resolve(
            compare.CompareArguments(
                task=task, encodings="lrpe_orthogonal@authors,rope", hidden_size=64, output_dir=str(tmp_path)
            )
        )
        runs = compare.plan_runs(settings)
        assert runs[0]["name"] == "lrpe_orthogonal_authors-elu-seed0" and runs[0]["feature_map"] == "elu"
        configs = []
        for run in runs[:2]:
            (parsed,) = compare.HfArgumentParser(ModelArguments).parse_args_into_dataclasses(
                args=[str(a) for a in model_arguments(run)]
            )
            configs.append(build_config(parsed, config_class))
        authors, rope = configs
        assert authors.positional_encoding == "lrpe_orthogonal" and authors.normalization == "output_layer_norm"
        assert authors.embedding_multiplier == 8.0 and authors.absolute_position_embedding == "sinusoidal"
        assert rope.normalization is None or rope.normalization == "unrotated_denominator"
        assert rope.embedding_multiplier == 1.0
    run = dict(runs[0], settings=dict(runs[0]["settings"], config_overrides='{"embedding_multiplier": 2.0}'))
    (parsed,) = compare.HfArgumentParser(ModelArguments).parse_args_into_dataclasses(
        args=[str(a) for a in model_arguments(run)]
    )
    assert build_config(parsed, LinearRobertaConfig).embedding_multiplier == 2.0
    with pytest.raises(ValueError, match="Unknown encoding.*rope@authors.*lrpe_unitary@authors"):
        compare.resolve(compare.CompareArguments(task="clm", encodings="rope@authors", output_dir=str(tmp_path)))
    image = compare.resolve(compare.CompareArguments(task="image", encodings="lrpe_unitary@authors"))
    with pytest.raises(ValueError, match="LinearViTConfig has no field embedding_multiplier"):
        compare.check_configs(compare.plan_runs(image))


def test_each_change_of_the_authors_setup_runs_alone(tmp_path):
    """``lrpe_orthogonal@output_layer_norm``, ``@embedding_multiplier`` and ``@sinusoidal`` each change one field of
    the default model, the one the authors' setup changes, and leave the others at the default's."""
    from lrpe_hf import LinearGPTConfig
    from lrpe_hf.training.arguments import ModelArguments, build_config
    from lrpe_hf.training.compare_tasks import model_arguments

    names = "lrpe_orthogonal,lrpe_orthogonal@output_layer_norm,lrpe_orthogonal@embedding_multiplier,"
    names += "lrpe_orthogonal@sinusoidal"
    settings = compare.resolve(compare.CompareArguments(task="clm", encodings=names, hidden_size=64,
                                                        output_dir=str(tmp_path)))  # fmt: skip
    configs = {}
    for run in compare.plan_runs(settings)[:4]:
        (parsed,) = compare.HfArgumentParser(ModelArguments).parse_args_into_dataclasses(
            args=[str(a) for a in model_arguments(run)]
        )
        configs[run["encoding"]] = build_config(parsed, LinearGPTConfig)
    fields = ("normalization", "embedding_multiplier", "absolute_position_embedding")
    default = {field: getattr(configs["lrpe_orthogonal"], field) for field in fields}
    assert default["embedding_multiplier"] == 1.0 and default["absolute_position_embedding"] == "none"
    changed = {"output_layer_norm": ("normalization", "output_layer_norm"),
               "embedding_multiplier": ("embedding_multiplier", 8.0),
               "sinusoidal": ("absolute_position_embedding", "sinusoidal")}  # fmt: skip
    for change, (field, value) in changed.items():
        config = configs[f"lrpe_orthogonal@{change}"]
        assert getattr(config, field) == value
        assert {f: getattr(config, f) for f in fields if f != field} == {f: default[f] for f in fields if f != field}
