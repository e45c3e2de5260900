"""One run of an encoding comparison (lrpe_hf.training.compare): train through the task's pipeline, evaluate, and
write ``result.json`` (the run's done marker) last.

``execute_run`` is the entry point of the fresh process each run gets; it sends the process's output to the
run's ``log.txt``. The pipelines are the run scripts' own functions, called with argument lists:

- ``clm``: ``language_modeling.main("clm")``; metric ``perplexity``, and ``perplexity_at_<L>`` for each
  evaluation length L (the saved model on validation blocks of L tokens);
- ``mlm``: ``language_modeling.main("mlm")`` then ``glue.main`` on the pretrained checkpoint; metrics
  ``finetune_accuracy`` and ``pretrain_perplexity``;
- ``image``: ``image_classification.main``; metric ``accuracy``;
- ``copy`` and ``recall``: ``synthetic.main``; metric ``accuracy`` on the answer tokens.
"""

import json
import math
import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch
from datasets import DatasetDict
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

from . import glue, image_classification, language_modeling, synthetic
from .arguments import parse_config_overrides
from .data import load_files_or_hub, select_samples
from .presets import AUTHORS_SETUPS, split_setup
from .provenance import working_tree

ABSOLUTE_BASELINES = ("sinusoidal", "learned")


def as_strings(args: list) -> list[str]:
    return [str(a) for a in args]


def encoding_arguments(encoding: str, feature_map: str) -> list[str]:
    """The config flags of a comparison's encoding name (see ``compare.encoding_names``)."""
    args = []
    if encoding.startswith("softmax:"):
        args += ["--attention", "softmax"]
        encoding = encoding.removeprefix("softmax:")
    else:
        args += ["--feature_map", feature_map]
    if encoding in ABSOLUTE_BASELINES:
        return args + ["--positional_encoding", "none", "--absolute_position_embedding", encoding]
    if encoding == "none":  # no position at all, whatever the family's default absolute embedding
        return args + ["--positional_encoding", "none", "--absolute_position_embedding", "none"]
    return args + ["--positional_encoding", encoding]


def model_arguments(run: dict) -> list[str]:
    s = run["settings"]
    encoding, setup = split_setup(run["encoding"])
    args = encoding_arguments(encoding, run["feature_map"])
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        args += [f"--{name}", s[name]]
    if run["task"] != "image":  # learned tables and FastRPB's span cover the longest evaluation length
        args += ["--max_position_embeddings", max([s["block_size"], *s.get("eval_lengths", [])])]
    overrides = parse_config_overrides(s["config_overrides"])
    if setup:  # the sweep's --config_overrides win over the authors' setup or change
        hidden_size = overrides.get("hidden_size", s["hidden_size"])
        overrides = {**AUTHORS_SETUPS[encoding](setup.removeprefix("@"), hidden_size), **overrides}
    if overrides:
        args += ["--config_overrides", json.dumps(overrides)]
    return args


def training_arguments(run: dict, output_dir: Path, max_steps: int) -> list[str]:
    s = run["settings"]
    return [
        "--output_dir", output_dir,
        "--seed", run["seed"],
        "--max_steps", max_steps,
        "--per_device_train_batch_size", s["batch_size"],
        "--per_device_eval_batch_size", s["batch_size"],
        "--learning_rate", s["learning_rate"],
        "--warmup_steps", s["warmup_steps"],
        "--logging_steps", s["logging_steps"],
        "--save_strategy", "no",
        "--report_to", "none",
        "--disable_tqdm", "true",
    ]  # fmt: skip


def text_data_arguments(s: dict) -> list[str]:
    if s["dataset_name"]:
        args = ["--dataset_name", s["dataset_name"]]
        return args + (["--dataset_config", s["dataset_config"]] if s["dataset_config"] else [])
    return ["--train_file", s["train_file"], "--validation_file", s["validation_file"]]


def language_model_arguments(run: dict, output_dir: Path) -> list[str]:
    s = run["settings"]
    data = text_data_arguments(s) + ["--text_column", s["text_column"], "--block_size", s["block_size"]]
    data += ["--max_eval_samples", s["max_eval_samples"]] if s["max_eval_samples"] else []
    training = training_arguments(run, output_dir, s["max_steps"])
    return ["--tokenizer_name", s["tokenizer_name"], *data, *model_arguments(run), *training]


def perplexities_at_lengths(model_dir: Path, lengths: list[int], s: dict) -> dict:
    """Validation perplexity of the saved causal LM on blocks of each length, each over as many tokens as the
    training-length evaluation used (``max_eval_samples`` blocks of ``block_size``; all when unset)."""
    if not lengths:
        return {}
    data = load_files_or_hub(s["dataset_name"], s["dataset_config"], s["train_file"], s["validation_file"])
    if "validation" not in data:
        raise ValueError("--eval_lengths needs validation text (--validation_file, or a Hub validation split)")
    tokenizer = AutoTokenizer.from_pretrained(s["tokenizer_name"])  # the same for every run: cached blocks
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    results = {}
    for length in lengths:
        batch_size = max(1, s["batch_size"] * s["block_size"] // length)  # as many tokens per batch as in training
        args = TrainingArguments(
            output_dir=str(model_dir), per_device_eval_batch_size=batch_size, report_to="none", disable_tqdm=True
        )
        trainer = Trainer(model=model, args=args, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
        blocks = language_modeling.group_into_blocks(
            DatasetDict(train=data["validation"]), tokenizer, s["text_column"], length
        )["train"]
        if len(blocks) == 0:
            raise ValueError(f"The validation text is shorter than one block of {length} tokens")
        count = max(1, s["max_eval_samples"] * s["block_size"] // length) if s["max_eval_samples"] else None
        loss = trainer.evaluate(eval_dataset=select_samples(blocks, count))["eval_loss"]
        results[f"perplexity_at_{length}"] = math.exp(min(loss, 50))
    return results


def run_clm(run: dict, run_dir: Path) -> dict:
    metrics = language_modeling.main("clm", as_strings(language_model_arguments(run, run_dir)))
    lengths = run["settings"]["eval_lengths"]
    return {"perplexity": metrics["eval_perplexity"], **perplexities_at_lengths(run_dir, lengths, run["settings"])}


def run_mlm(run: dict, run_dir: Path) -> dict:
    s = run["settings"]
    pretrained = language_modeling.main("mlm", as_strings(language_model_arguments(run, run_dir / "pretrain")))
    if s["finetune_task_name"]:
        data = ["--task_name", s["finetune_task_name"]]
    else:
        data = ["--train_file", s["finetune_train_file"], "--validation_file", s["finetune_validation_file"]]
    data += ["--max_seq_length", s["block_size"]]
    data += ["--max_eval_samples", s["finetune_max_eval_samples"]] if s["finetune_max_eval_samples"] else []
    training = training_arguments(run, run_dir / "finetune", s["finetune_max_steps"])
    finetuned = glue.main(as_strings(["--model_name_or_path", run_dir / "pretrain", *data, *training]))
    return {"finetune_accuracy": finetuned["eval_accuracy"], "pretrain_perplexity": pretrained["eval_perplexity"]}


def run_image(run: dict, run_dir: Path) -> dict:
    s = run["settings"]
    if s["dataset_name"]:
        data = ["--dataset_name", s["dataset_name"]]
        data += ["--dataset_config", s["dataset_config"]] if s["dataset_config"] else []
    else:
        data = ["--data_dir", s["data_dir"]]
    for name in ("image_size", "patch_size", "num_channels"):
        data += [f"--{name}", s[name]]
    data += ["--max_eval_samples", s["max_eval_samples"]] if s["max_eval_samples"] else []
    training = training_arguments(run, run_dir, s["max_steps"])
    metrics = image_classification.main(as_strings([*data, *model_arguments(run), *training]))
    return {"accuracy": metrics["eval_accuracy"]}


def run_synthetic(run: dict, run_dir: Path) -> dict:
    s = run["settings"]
    data = ["--task", run["task"], "--sequence_length", s["block_size"], "--vocab_size", s["synthetic_vocab_size"]]
    data += ["--num_train_examples", s["max_steps"] * s["batch_size"]]
    data += ["--copy_lag", s["copy_lag"]] if run["task"] == "copy" else []
    data += ["--num_eval_examples", s["max_eval_samples"] or 1000]
    training = training_arguments(run, run_dir, s["max_steps"])
    metrics = synthetic.main(as_strings([*data, *model_arguments(run), *training]))
    return {"accuracy": metrics["eval_accuracy"]}


RUNNERS = {"clm": run_clm, "mlm": run_mlm, "image": run_image, "copy": run_synthetic, "recall": run_synthetic}


def tokens_per_example(task: str, s: dict) -> int:
    if task == "image":
        return (s["image_size"] // s["patch_size"]) ** 2 + 1  # patches and the class token
    return s["block_size"]


def training_figures(state_file: Path) -> tuple[float, float, list]:
    """(train seconds, training samples per second, [[step, loss], ...]) from a Trainer's state."""
    history = json.loads(state_file.read_text())["log_history"]
    summary = next(entry for entry in history if "train_samples_per_second" in entry)
    curve = [[entry["step"], entry["loss"]] for entry in history if "loss" in entry]
    return summary["train_runtime"], summary["train_samples_per_second"], curve


def code_version(run_dir: Path) -> str:
    """The commit this run's code came from, with ``+changes`` where the working tree had changes (outside the run's
    folder), or ``unknown`` outside a git checkout: a resumed sweep tells its runs' code apart by it."""
    commit, clean, _ = working_tree(run_dir)
    if commit is None:
        return "unknown"
    return commit if clean else f"{commit}+changes"


def load_result(run_dir: Path) -> dict | None:
    """A finished run's result, or None."""
    path = Path(run_dir) / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def exit_with_the_sweep(sweep_pid: int):
    """End this run's process when the sweep that started it is gone (killed): an orphaned run would go on writing
    into a folder that the next sweep restarts."""

    def watch():
        while True:
            time.sleep(1)
            try:
                os.kill(sweep_pid, 0)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def execute_run(run: dict):
    """Train and evaluate one run in this (fresh) process; its output goes to ``<run_dir>/log.txt``."""
    exit_with_the_sweep(run["sweep_pid"])
    run_dir = Path(run["run_dir"])
    run_dir.mkdir(parents=True)
    log = open(run_dir / "log.txt", "w")
    os.dup2(log.fileno(), sys.stdout.fileno())
    os.dup2(log.fileno(), sys.stderr.fileno())
    if run["threads"]:
        torch.set_num_threads(run["threads"])
    task = run["task"]
    metrics = RUNNERS[task](run, run_dir)
    first_phase = run_dir / "pretrain" if task == "mlm" else run_dir
    seconds, samples_per_second, curve = training_figures(first_phase / "trainer_state.json")
    if task == "mlm":
        seconds += training_figures(run_dir / "finetune" / "trainer_state.json")[0]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "task": task,
        "encoding": run["encoding"],
        "feature_map": run["feature_map"],
        "seed": run["seed"],
        "metrics": metrics,
        "train_time_s": seconds,
        "train_tokens_per_s": samples_per_second * tokens_per_example(task, run["settings"]),
        "peak_memory_mb": usage.ru_maxrss / 1024,
        "process_cpu_s": usage.ru_utime + usage.ru_stime,  # with the wall time: how contended the machine was
        "loss_curve": curve,
        "settings": run["settings"],
        "code": code_version(run_dir),
    }
    partial = run_dir / "result.json.partial"
    partial.write_text(json.dumps(result, indent=1))
    partial.rename(run_dir / "result.json")  # last: a run is finished exactly when result.json exists
    sys.stdout.flush()
    sys.stderr.flush()
