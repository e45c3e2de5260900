"""Compare positional encodings: train the same model with each encoding (and baselines) under the same budget
and seeds, through the run scripts' Trainer pipelines, and tabulate and plot the results.

    python -m lrpe_hf compare_encodings --preset lrpe_table2                      # a paper's comparison
    python -m lrpe_hf compare_encodings --task recall --encodings none,rope,lrpe_orthogonal,softmax:rope \
        --seeds 3 --max_steps 300 --output_dir out/recall
    python -m lrpe_hf compare_encodings --task clm --encodings rope,permute --feature_maps elu,relu \
        --train_file my_train.txt --validation_file my_valid.txt --eval_lengths 256,512

Encodings: any registered ``positional_encoding`` (``lrpe_hf.POSITIONAL_ENCODINGS``); ``sinusoidal`` and
``learned`` (no relative encoding, that absolute embedding); ``softmax:<name>`` (quadratic softmax attention with
that encoding; feature maps do not apply); ``<name>@authors`` (the LRPE types in the model their authors' code
builds: output LayerNorm instead of the unrotated denominator, token embeddings scaled by sqrt(d), sinusoidal
absolute positions; ``presets.AUTHORS_SETUPS``); ``<name>@output_layer_norm``, ``@embedding_multiplier`` or
``@sinusoidal`` (one of those changes alone). ``none`` is no position at all. Without ``--feature_maps`` each
encoding gets the feature map its config picks by default (its paper's: relu for permute, exp for fastrpb).

Tasks: ``clm`` (LinearGPT, validation perplexity), ``mlm`` (LinearRoberta masked-LM pretraining, then fine-tuning
on a sentence task: fine-tune accuracy and pretraining perplexity), ``image`` (LinearViT, accuracy), ``copy`` and
``recall`` (LinearGPT on the synthetic tasks of ``lrpe_hf.training.synthetic``, accuracy on the answers).

Settings come, from weakest to strongest, from the task's profile (``--profile quick``: sizes for 2 CPU cores;
``medium``: 8x to 10x the quick budget, for a GPU or a patient CPU; ``full``: the papers' model sizes, for a GPU), the
preset, and the flags given. Defaults use the embedded data
(``data/``); ``--train_file``/``--validation_file``/``--dataset_name``, ``--finetune_*`` and ``--data_dir`` pass
through to the pipelines as in the run scripts. Without ``--tokenizer_name``, text tasks train a BPE tokenizer
into ``<output_dir>/tokenizer`` once.

Profiles:

- ``quick`` (2 CPU cores; ``make reproduce``): 2 layers x 64, 4 heads; text: blocks of 64 tokens, batch 16, 60
  steps (mlm: 50 pretraining and 30 fine-tuning steps), a 2,048-token BPE vocabulary; image: 28 px in 4 px
  patches, batch 32, 50 steps; synthetic: 32 tokens, batch 32, 120 steps; two one-thread runs at once. Enough to
  separate encodings on the synthetic tasks; on text, the models stay close to unigram statistics.
- ``medium`` (one GPU, 7 to 26 s of training a run; or 2 CPU cores, 1 to 12 min a run): 2 layers x 128, 4 heads,
  FFN 512; text: blocks of 128 tokens, batch 16, 400 steps (mlm: 400 pretraining and 200 fine-tuning steps), an
  8,192-token BPE vocabulary; image: batch 64, 400 steps; synthetic: 64 tokens, batch 64, 400 steps. The text models
  get past unigram statistics (perplexity about 250 to 320 for the causal LM), so the encodings separate.
- ``full`` (one GPU): the papers' sizes: causal LM 6 x 512, 8 heads, FFN 2048, 512 tokens, batch 32, 50k steps
  (LRPE Appendix E); masked LM RoBERTa-base (12 x 768), 23k steps, then 3k fine-tuning steps; image DeiT-small
  (12 x 384, 6 heads), batch 128, 10k steps; synthetic 4 x 256 at 256 tokens, 20k steps. The embedded corpus
  (about a million tokens) is far too small for these: give a larger one (e.g. ``--dataset_name
  Salesforce/wikitext --dataset_config wikitext-103-raw-v1``).

Presets (the papers' headline comparisons, at small scale):

- ``lrpe_table2``: LRPE Table 2, autoregressive language modelling (WikiText-103 validation perplexity in the
  paper; here the embedded Wikipedia leads): none, sinusoidal, learned, rope, permute, spe_sine, the three LRPE
  types, fastrpb and softmax with rope.
- ``lrpe_table1``: LRPE Table 1, bidirectional: RoBERTa masked-LM pretraining, then GLUE fine-tuning in the paper;
  here masked-LM pretraining on the Wikipedia leads, then fine-tuning on the embedded tweet sentiment task. The
  paper's rows: sinusoidal (its "Base"), rope, spe_sine, permute (r = 1) and the three LRPE types.
- ``image``: LRPE Table 3 (DeiT on ImageNet), PermuteFormer's and FastRPB's image results: LinearViT on the
  embedded Fashion-MNIST subset (28 px, 4 px patches) with every 2D encoding, none, learned, sinusoidal (the
  paper's Base), and softmax with learned absolute positions (ViT itself).
- ``extrapolation``: train LinearGPT at 64 tokens, evaluate at 64 to 1024 (1x to 16x): perplexity against
  evaluation length per encoding (``extrapolation.png``).
- ``synthetic_copy``: output the token 4 positions back (content cannot tell which token that is).
- ``synthetic_recall``: multi-query associative recall (find a key, read the value right after it).

Outputs in ``--output_dir``: ``runs/<run>/`` (each run's own output: checkpoint, metrics, ``log.txt``,
``result.json``), ``results.csv`` (one row per run), ``results.md`` (one row per encoding x feature map, mean +-
std over seeds; every other encoding against the baseline, the first listed or ``--baseline``, per metric, paired by
seed: difference, 95% interval, p-value and the verdict better / worse / inconclusive, as ``verdicts.py`` decides
the papers' claims; and the preset's claims), ``comparisons.csv`` (that baseline table), ``results.json`` (the
record of every invocation that wrote them: command, commit and whether the tree was clean, device, torch and
transformers versions, threads, date, seconds, runs trained and whether it finished; ``provenance.py``),
``metric_<name>.png``, ``loss_curves.png`` and, with ``--eval_lengths``, ``extrapolation.png``. The sweep prints
the baseline table when it ends.

Each run trains in a fresh process, forked from a server process that has already imported the libraries
(``multiprocessing``'s forkserver): the run's peak resident memory is its own, its state (seeds, threads) starts
clean, a crash or a memory kill shows as that run's failure (with the end of its log), and the import cost (seconds)
is paid once per sweep, not per run. ``--jobs N`` runs N at once, each with ``--threads`` torch threads (quick
profile: two one-thread runs on 2 cores). A run is finished when its ``result.json`` exists: a sweep run again with
the same arguments skips finished runs and restarts unfinished ones from scratch. ``results.csv`` and
``results.json`` are rewritten after each run, so a sweep stopped part-way has recorded how far it went. Each run's
result names the commit its code came from (``+changes`` for a changed tree); ``results.json`` counts the runs of
each (``run_code``), and a sweep whose runs came from different code says so when it ends.
"""

import multiprocessing
import os
import shutil
import time
from argparse import RawDescriptionHelpFormatter
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

import torch
from transformers import HfArgumentParser

from .. import LinearGPTConfig, LinearRobertaConfig, LinearViTConfig
from ..modeling.registry import POSITIONAL_ENCODINGS, positional_encoding_entry
from . import compare_report
from .arguments import ModelArguments, build_config
from .compare_tasks import ABSOLUTE_BASELINES, RUNNERS, as_strings, execute_run, load_result, model_arguments
from .presets import AUTHORS_SETUPS, PRESETS, SETUP_NAMES, split_setup
from .provenance import Record
from .tokenizer import TokenizerArguments, train_tokenizer
from .verdicts import baseline_comparisons

TASKS = tuple(RUNNERS)
PROFILES = ("quick", "medium", "full")
DATA = Path(__file__).resolve().parents[2] / "data"

TEXT_QUICK = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, block_size=64, batch_size=16,
    learning_rate=2e-3, warmup_steps=10, max_steps=60, max_eval_samples=50, tokenizer_vocab_size=2048,
)  # fmt: skip
TEXT_MEDIUM = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, block_size=128, batch_size=16,
    learning_rate=2e-3, warmup_steps=40, max_steps=400, max_eval_samples=200, tokenizer_vocab_size=8192,
)  # fmt: skip
TEXT_FULL = dict(  # the LRPE paper's autoregressive LM (Appendix E): 6 layers x 512, 8 heads, FFN 2048, 512 tokens
    hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=2048, block_size=512, batch_size=32,
    learning_rate=5e-4, warmup_steps=2000, max_steps=50000, max_eval_samples=None, tokenizer_vocab_size=16384,
)  # fmt: skip
SYNTHETIC_QUICK = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, block_size=32, batch_size=32,
    learning_rate=3e-3, warmup_steps=20, max_steps=120, max_eval_samples=500,
)  # fmt: skip
SYNTHETIC_MEDIUM = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, block_size=64, batch_size=64,
    learning_rate=2e-3, warmup_steps=40, max_steps=400, max_eval_samples=1000,
)  # fmt: skip
SYNTHETIC_FULL = dict(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, block_size=256,
    batch_size=64, learning_rate=1e-3, warmup_steps=500, max_steps=20000, max_eval_samples=2000,
)  # fmt: skip

IMAGE_QUICK = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, batch_size=32,
    learning_rate=2e-3, warmup_steps=10, max_steps=50, max_eval_samples=None, image_size=28, patch_size=4,
)  # fmt: skip

# The task's settings in each profile (the weakest layer of settings).
TASK_PROFILES = {
    "clm": {"quick": TEXT_QUICK, "medium": TEXT_MEDIUM, "full": TEXT_FULL},
    "mlm": {
        "quick": dict(TEXT_QUICK, max_steps=50, finetune_max_steps=30, finetune_max_eval_samples=300),
        "medium": dict(TEXT_MEDIUM, finetune_max_steps=200, finetune_max_eval_samples=None),
        # the LRPE paper's bidirectional model is RoBERTa-base: 12 layers x 768, 12 heads, FFN 3072
        "full": dict(
            TEXT_FULL,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_steps=23000,
            finetune_max_steps=3000,
            finetune_max_eval_samples=None,
        ),  # fmt: skip
    },
    "image": {
        "quick": IMAGE_QUICK,
        "medium": dict(
            IMAGE_QUICK, hidden_size=128, intermediate_size=512, batch_size=64, warmup_steps=40, max_steps=400
        ),
        # the LRPE paper's image model is DeiT-small: 12 layers x 384, 6 heads, FFN 1536
        "full": dict(
            IMAGE_QUICK,
            hidden_size=384,
            num_hidden_layers=12,
            num_attention_heads=6,
            intermediate_size=1536,
            batch_size=128,
            learning_rate=5e-4,
            warmup_steps=500,
            max_steps=10000,
        ),  # fmt: skip
    },
    "copy": {"quick": SYNTHETIC_QUICK, "medium": SYNTHETIC_MEDIUM, "full": SYNTHETIC_FULL},
    "recall": {"quick": SYNTHETIC_QUICK, "medium": SYNTHETIC_MEDIUM, "full": SYNTHETIC_FULL},
}

# How a sweep uses the machine, per profile: runs at once, and torch threads per run (0: torch's default). Tiny
# models gain nothing from a second thread, and two-thread runs on a busy 2-core machine slow down many-fold
# (measured 8x: OpenMP threads wait on each other), so the quick profile runs two one-thread runs at once.
MACHINE = {"quick": dict(jobs=2, threads=1), "medium": dict(jobs=2, threads=1), "full": dict(jobs=1, threads=0)}

# Settings every task starts from, under its profile.
DEFAULTS = dict(
    seeds=3,
    logging_steps=10,
    eval_lengths=[],
    config_overrides=None,
    dataset_name=None,
    dataset_config=None,
    text_column="text",
    tokenizer_name=None,
    finetune_task_name=None,
    num_channels=1,
    synthetic_vocab_size=32,
    copy_lag=4,
)
SWEEP_FIELDS = (
    "preset", "profile", "task", "encodings", "feature_maps", "baseline", "seeds", "output_dir", "jobs", "threads",
)  # fmt: skip
# The settings each run depends on: those of every task, then the task's own.
RUN_SETTINGS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "batch_size", "learning_rate",
    "warmup_steps", "logging_steps", "max_steps", "max_eval_samples", "config_overrides",
)  # fmt: skip
TEXT_SETTINGS = (
    "block_size", "train_file", "validation_file", "dataset_name", "dataset_config", "text_column",
    "tokenizer_name", "tokenizer_vocab_size",
)  # fmt: skip
TASK_SETTINGS = {
    "clm": TEXT_SETTINGS + ("eval_lengths",),
    "mlm": TEXT_SETTINGS
    + ("finetune_train_file", "finetune_validation_file", "finetune_task_name", "finetune_max_steps")
    + ("finetune_max_eval_samples",),
    "image": ("dataset_name", "dataset_config", "data_dir", "image_size", "patch_size", "num_channels"),
    "copy": ("block_size", "synthetic_vocab_size", "copy_lag"),
    "recall": ("block_size", "synthetic_vocab_size"),
}


def help_for(text: str) -> dict:
    return {"help": text}


@dataclass
class CompareArguments:
    """Every setting left unset comes from the preset, else the task's profile (see the module docstring)."""

    _argument_group_name = "comparison: the sweep, the model and training budget, the data"

    preset: str | None = field(default=None, metadata=help_for(f"one of {', '.join(PRESETS)}"))
    profile: str = field(
        default="quick", metadata=help_for("quick (2 CPU cores), medium (a GPU or a patient CPU), full (papers' sizes)")
    )
    task: str | None = field(default=None, metadata=help_for(f"one of {', '.join(TASKS)}"))
    encodings: str | None = field(
        default=None,
        metadata=help_for(
            "comma-separated: registered names, sinusoidal, learned, softmax:<name>, <lrpe type>@authors (or "
            "@output_layer_norm, @embedding_multiplier, @sinusoidal: one of the authors' changes alone)"
        ),
    )
    feature_maps: str | None = field(
        default=None, metadata=help_for("comma-separated (default: each encoding's own, as its config picks)")
    )
    baseline: str | None = field(
        default=None,
        metadata=help_for("every other encoding against it, per metric, paired by seed (default: the first listed)"),
    )
    seeds: int | None = field(default=None, metadata=help_for("seeds 0..N-1 per encoding (default 3)"))
    jobs: int | None = field(default=None, metadata=help_for("runs at once (quick, medium: 2; full: 1)"))
    threads: int | None = field(default=None, metadata=help_for("torch threads per run (quick: 1; 0: torch's)"))
    output_dir: str | None = field(default=None, metadata=help_for("default out/compare/<preset or task>"))
    max_steps: int | None = field(default=None, metadata=help_for("training steps per run (pretraining for mlm)"))
    hidden_size: int | None = field(default=None, metadata=help_for("model width"))
    num_hidden_layers: int | None = field(default=None, metadata=help_for("layers"))
    num_attention_heads: int | None = field(default=None, metadata=help_for("attention heads"))
    intermediate_size: int | None = field(default=None, metadata=help_for("MLP width"))
    block_size: int | None = field(default=None, metadata=help_for("training sequence length (text, synthetic)"))
    batch_size: int | None = field(default=None, metadata=help_for("per-device batch size"))
    learning_rate: float | None = field(default=None, metadata=help_for("peak learning rate (AdamW, linear decay)"))
    warmup_steps: int | None = field(default=None, metadata=help_for("learning-rate warm-up steps"))
    logging_steps: int | None = field(default=None, metadata=help_for("training loss logged every N steps"))
    max_eval_samples: int | None = field(default=None, metadata=help_for("evaluation examples (blocks, images)"))
    eval_lengths: str | None = field(
        default=None, metadata=help_for("clm: comma-separated lengths to evaluate the trained model at")
    )
    config_overrides: str | None = field(default=None, metadata=help_for("JSON of further config fields, every run"))
    train_file: str | None = field(default=None, metadata=help_for("clm/mlm text (default the Wikipedia leads)"))
    validation_file: str | None = field(default=None, metadata=help_for("clm/mlm validation text"))
    dataset_name: str | None = field(default=None, metadata=help_for("a Hub data set (online) for clm/mlm/image"))
    dataset_config: str | None = field(default=None, metadata=help_for("the Hub data set's configuration"))
    text_column: str | None = field(default=None, metadata=help_for("clm/mlm: the text column"))
    tokenizer_name: str | None = field(default=None, metadata=help_for("default: trained into output_dir/tokenizer"))
    tokenizer_vocab_size: int | None = field(default=None, metadata=help_for("vocabulary of that trained tokenizer"))
    finetune_train_file: str | None = field(default=None, metadata=help_for("mlm: fine-tuning csv (tweet sentiment)"))
    finetune_validation_file: str | None = field(default=None, metadata=help_for("mlm: fine-tuning validation csv"))
    finetune_task_name: str | None = field(default=None, metadata=help_for("mlm: a GLUE task instead (online)"))
    finetune_max_steps: int | None = field(default=None, metadata=help_for("mlm: fine-tuning steps"))
    finetune_max_eval_samples: int | None = field(default=None, metadata=help_for("mlm: fine-tuning evaluation rows"))
    data_dir: str | None = field(default=None, metadata=help_for("image: an imagefolder tree (Fashion-MNIST)"))
    image_size: int | None = field(default=None, metadata=help_for("image: side in pixels"))
    patch_size: int | None = field(default=None, metadata=help_for("image: patch side in pixels"))
    num_channels: int | None = field(default=None, metadata=help_for("image: 1 grey-scale, 3 RGB"))
    synthetic_vocab_size: int | None = field(default=None, metadata=help_for("copy: symbols; recall: keys"))
    copy_lag: int | None = field(default=None, metadata=help_for("copy: the token this many positions back"))


def argument_parser() -> HfArgumentParser:
    return HfArgumentParser(CompareArguments, description=__doc__, formatter_class=RawDescriptionHelpFormatter)


def split_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def encoding_names() -> list[str]:
    """Every valid ``--encodings`` name."""
    plain = [*POSITIONAL_ENCODINGS, *ABSOLUTE_BASELINES]
    setups = [f"{name}@{setup}" for name in AUTHORS_SETUPS for setup in SETUP_NAMES]
    return plain + setups + [f"softmax:{name}" for name in plain]


def embedded(relative: str) -> str:
    path = DATA / relative
    if not path.exists():
        raise FileNotFoundError(f"The embedded data {path} is missing (it ships with a source checkout): give the data")
    return str(path)


def resolve(args: CompareArguments) -> dict:
    """The sweep's settings: the task's profile, then the preset, then the flags given."""
    if args.profile not in PROFILES:
        raise ValueError(f"Unknown --profile {args.profile!r}; valid values: {', '.join(PROFILES)}")
    preset = {}
    if args.preset is not None:
        if args.preset not in PRESETS:
            raise ValueError(f"Unknown --preset {args.preset!r}; valid presets: {', '.join(PRESETS)}")
        preset = PRESETS[args.preset]
    task = args.task or preset.get("task")
    if task not in TASKS:
        raise ValueError(f"Unknown or missing --task {task!r}; valid tasks: {', '.join(TASKS)}")
    settings = dict(DEFAULTS, **MACHINE[args.profile], **TASK_PROFILES[task][args.profile])
    if preset:
        settings.update(encodings=preset["encodings"], **preset[args.profile])
    given = {f.name: getattr(args, f.name) for f in fields(args) if getattr(args, f.name) is not None}
    valid = RUN_SETTINGS + TASK_SETTINGS[task]
    foreign = [name for name in given if name not in SWEEP_FIELDS + valid]
    if foreign:
        raise ValueError(f"Not a setting of task {task}: --{', --'.join(foreign)}; its settings: {', '.join(valid)}")
    settings.update(given, task=task)
    for name in ("encodings", "feature_maps"):
        if isinstance(settings.get(name), str):
            settings[name] = split_names(settings[name])
    if isinstance(settings["eval_lengths"], str):
        settings["eval_lengths"] = [int(length) for length in split_names(settings["eval_lengths"])]
    settings.setdefault("feature_maps", None)
    settings.setdefault("output_dir", f"out/compare/{args.preset or task}")
    add_data_defaults(settings)
    check(settings)
    return settings


def add_data_defaults(s: dict):
    """The embedded data wherever the user gave none."""
    task = s["task"]
    if task in ("clm", "mlm") and not s["dataset_name"]:
        s.setdefault("train_file", embedded("wikipedia_leads/train.txt"))
        s.setdefault("validation_file", embedded("wikipedia_leads/validation.txt"))
    if task == "mlm" and not s["finetune_task_name"]:
        s.setdefault("finetune_train_file", embedded("tweet_sentiment/train.csv"))
        s.setdefault("finetune_validation_file", embedded("tweet_sentiment/validation.csv"))
    if task == "image" and not s["dataset_name"]:
        s.setdefault("data_dir", embedded("fashion_mnist"))


def check(s: dict):
    if not s.get("encodings"):
        raise ValueError("Give --encodings (comma-separated) or a --preset")
    valid = encoding_names()
    unknown = [name for name in s["encodings"] if name not in valid]
    if unknown:
        raise ValueError(f"Unknown encoding(s) {', '.join(unknown)}; valid names: {', '.join(valid)}")
    s["baseline"] = s.get("baseline") or s["encodings"][0]
    if s["baseline"] not in s["encodings"]:
        raise ValueError(
            f"--baseline {s['baseline']} is not among the encodings compared ({', '.join(s['encodings'])}): add it to "
            "--encodings or name one of them"
        )
    for name in ("seeds", "jobs"):
        if s[name] < 1:
            raise ValueError(f"--{name} must be at least 1, got {s[name]}")


def default_feature_map(encoding: str) -> str:
    """The feature map a config picks for ``encoding`` when none is given (its paper's)."""
    name, _ = split_setup(encoding.removeprefix("softmax:"))
    return positional_encoding_entry("none" if name in ABSOLUTE_BASELINES else name).default_feature_map


def plan_runs(s: dict) -> list[dict]:
    """One run per (seed, encoding, feature map), seed-major so that a partial sweep covers every encoding.
    Softmax runs have no feature map (``-``)."""
    run_settings = {name: s.get(name) for name in RUN_SETTINGS + TASK_SETTINGS[s["task"]]}
    runs = []
    for seed in range(s["seeds"]):
        for encoding in s["encodings"]:
            if encoding.startswith("softmax:"):
                feature_maps = ["-"]
            else:
                feature_maps = s["feature_maps"] or [default_feature_map(encoding)]
            for feature_map in feature_maps:
                parts = [encoding.replace(":", "_").replace("@", "_")] + ([] if feature_map == "-" else [feature_map])
                name = "-".join([*parts, f"seed{seed}"])
                runs.append(
                    dict(
                        task=s["task"],
                        encoding=encoding,
                        feature_map=feature_map,
                        seed=seed,
                        name=name,
                        run_dir=str(Path(s["output_dir"]) / "runs" / name),
                        threads=s["threads"],
                        sweep_pid=os.getpid(),
                        settings=run_settings,
                    )
                )
    return runs


def check_configs(runs: list[dict]):
    """Build each distinct model config before anything trains: an invalid combination fails now."""
    family = {"clm": LinearGPTConfig, "copy": LinearGPTConfig, "recall": LinearGPTConfig}
    family.update(mlm=LinearRobertaConfig, image=LinearViTConfig)
    seen = set()
    for run in runs:
        key = (run["encoding"], run["feature_map"])
        if key in seen:
            continue
        seen.add(key)
        (model_args,) = HfArgumentParser(ModelArguments).parse_args_into_dataclasses(
            args=as_strings(model_arguments(run))
        )
        image_fields = {}
        if run["task"] == "image":
            s = run["settings"]
            image_fields = dict(image_size=s["image_size"], patch_size=s["patch_size"], num_channels=s["num_channels"])
        try:
            build_config(model_args, family[run["task"]], **image_fields)
        except ValueError as error:
            raise ValueError(f"{run['encoding']} with feature map {run['feature_map']}: {error}") from None


def default_tokenizer(s: dict) -> Path | None:
    """Text tasks without --tokenizer_name use a BPE tokenizer trained once into <output_dir>/tokenizer."""
    if s["task"] not in ("clm", "mlm") or s["tokenizer_name"]:
        return None
    folder = Path(s["output_dir"]) / "tokenizer"
    s["tokenizer_name"] = str(folder)
    return folder


def train_default_tokenizer(folder: Path, s: dict):
    if (folder / "tokenizer.json").exists():
        return
    print(f"Training a {s['tokenizer_vocab_size']}-token BPE tokenizer into {folder}", flush=True)
    args = TokenizerArguments(
        output_dir=str(folder),
        train_files=[s["train_file"]] if s.get("train_file") else [],
        dataset_name=s["dataset_name"],
        dataset_config=s["dataset_config"],
        text_column=s["text_column"],
        vocab_size=s["tokenizer_vocab_size"],
    )
    train_tokenizer(args)


def summary(result: dict) -> str:
    metrics = ", ".join(f"{name} {value:.4g}" for name, value in result["metrics"].items())
    return (
        f"{metrics}; train {result['train_time_s']:.1f} s, {result['train_tokens_per_s']:,.0f} tokens/s, "
        f"peak {result['peak_memory_mb']:,.0f} MB"
    )


def finished_result(run: dict) -> dict | None:
    """The run's result if it finished earlier (with the same settings), else None."""
    result = load_result(Path(run["run_dir"]))
    if result is not None and result["settings"] != run["settings"]:
        raise ValueError(f"{run['run_dir']} was trained with other settings; use another --output_dir or delete it")
    return result


def code_counts(results: list[dict]) -> dict[str, int]:
    """How many of the runs each commit's code trained (``+changes`` marks a changed tree)."""
    return dict(Counter(result.get("code", "unknown") for result in results))


def sweep(runs: list[dict], jobs: int, after_each_run: Callable[[list[dict]], None]) -> list[dict]:
    """Run every unfinished run, each in a fresh process, ``jobs`` at a time; print one line per run start and
    finish, and call ``after_each_run`` with the results so far (in the runs' order) after each."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([execute_run.__module__, "matplotlib.pyplot"])  # the runs' loss plots
    results, waiting, active = {}, deque(), {}
    for index, run in enumerate(runs, 1):
        result = finished_result(run)
        if result is None:
            waiting.append((index, run))
        else:
            results[index] = result
            print(f"[{index}/{len(runs)}] {run['name']}: finished earlier, skipped", flush=True)
    while waiting or active:
        while waiting and len(active) < jobs:
            index, run = waiting.popleft()
            if Path(run["run_dir"]).exists():
                shutil.rmtree(run["run_dir"])  # an unfinished run restarts from scratch
            print(f"[{index}/{len(runs)}] {run['name']}: started", flush=True)
            process = context.Process(target=execute_run, args=(run,))
            process.start()
            active[process.sentinel] = (index, run, process, time.time())
        for sentinel in wait(list(active)):
            index, run, process, start = active.pop(sentinel)
            process.join()
            tag, result = f"[{index}/{len(runs)}] {run['name']}", load_result(Path(run["run_dir"]))
            if process.exitcode != 0 or result is None:
                for _, _, other, _ in active.values():
                    other.terminate()  # left unfinished: a rerun restarts them
                log = Path(run["run_dir"]) / "log.txt"
                tail = log.read_text()[-3000:] if log.exists() else ""
                raise RuntimeError(f"{tag} failed (exit code {process.exitcode}); the end of {log}:\n{tail}")
            print(f"{tag}: finished in {time.time() - start:.1f} s: {summary(result)}", flush=True)
            results[index] = result
            after_each_run([results[i] for i in sorted(results)])
    return [results[i] for i in sorted(results)]


def main(args=None):
    (parsed,) = argument_parser().parse_args_into_dataclasses(args=None if args is None else as_strings(args))
    settings = resolve(parsed)
    tokenizer = default_tokenizer(settings)
    runs = plan_runs(settings)
    check_configs(runs)  # everything that can be wrong is checked before anything trains
    output_dir = Path(settings["output_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        train_default_tokenizer(tokenizer, settings)
    preset = PRESETS.get(parsed.preset, {})
    print(f"{len(runs)} runs of task {settings['task']} into {output_dir}", flush=True)
    trained_before = sum(load_result(Path(run["run_dir"])) is not None for run in runs)
    record = Record(output_dir / "results.json", "run_scripts/compare_encodings.py", append=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def record_sweep(results: list[dict], files=("results.csv",), finished=False) -> Path:
        """This invocation's entry in results.json, as far as the sweep has gone."""
        facts = dict(jobs=settings["jobs"], threads_per_run=settings["threads"], runs=len(runs), finished=finished)
        facts.update(runs_trained=len(results) - trained_before, run_code=code_counts(results))
        return record.write(list(files), device, **facts)

    def after_each_run(results: list[dict]):
        compare_report.write_csv(output_dir / "results.csv", results)
        record_sweep(results)

    results = sweep(runs, settings["jobs"], after_each_run)
    title = f"Preset {parsed.preset}" if parsed.preset else f"Task {settings['task']}"
    feature_maps = ",".join(settings["feature_maps"] or ["each encoding's default"])
    shown = {"seeds": settings["seeds"], "feature_maps": feature_maps, **runs[0]["settings"]}
    written = compare_report.write_report(
        output_dir, results, title, preset.get("mirrors", ""), shown, preset.get("claims", []), settings["baseline"]
    )
    csvs = [path.name for path in written if path.suffix == ".csv"]
    written.append(record_sweep(results, csvs, finished=True))
    if len(code_counts(results)) > 1:
        versions = ", ".join(f"{code[:12]}: {count}" for code, count in code_counts(results).items())
        print(f"Note: these runs were trained by different code ({versions} runs); results.json records it. Delete "
              "the runs' folders under runs/ to train them again with today's.", flush=True)  # fmt: skip
    baseline = settings["baseline"]
    comparisons = baseline_comparisons(results, baseline, compare_report.metric_names(results))
    print("\n".join(["", *compare_report.comparison_lines(comparisons, baseline), ""]), flush=True)
    print("Wrote " + ", ".join(str(path) for path in written), flush=True)
    return results
