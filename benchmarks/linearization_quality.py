"""How much of a softmax teacher's quality a linearized student recovers, on the embedded data (offline).

For each family, a small softmax teacher (GPT-2 on the Wikipedia leads as a causal LM, RoBERTa on them as a
masked LM, ViT on Fashion-MNIST) is trained from random weights with the run scripts. run_linearize then
converts it with each feature map (elu, hedgehog, t2r; the relative encoding ``--encoding``), trains the feature
maps and encodings by attention transfer, and fine-tunes the whole student. Baselines: the teacher itself, and
the same linear model trained from scratch for as many steps as teacher + transfer + fine-tuning together. For
GPT-2 the two transfer losses are also compared (output MSE against attention cross-entropy; the latter needs
non-negative weights, so that pair runs with ``positional_encoding=none``).

    python benchmarks/linearization_quality.py --output_dir out/linearization
    python benchmarks/linearization_quality.py --families gpt2 --teacher_steps 100   # a quicker look

Prints a table (eval perplexity, or accuracy for ViT) and writes it with every run's metrics to
``<output_dir>/results.json``. Finished runs are reused when the script is run again.
"""

import argparse
import json
import time
from pathlib import Path

from transformers import (
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaForMaskedLM,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
)

from lrpe_hf.training import image_classification, language_modeling, linearization, tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"
TEXT = ["--train_file", str(DATA / "wikipedia_leads/train.txt")]
TEXT += ["--validation_file", str(DATA / "wikipedia_leads/validation.txt"), "--max_eval_samples", "200"]
IMAGES = ["--data_dir", str(DATA / "fashion_mnist")]
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--seed", "0"]
FEATURE_MAPS = ("elu", "hedgehog", "t2r")
FAMILIES = {
    # family: (task, pipeline, data flags, batch flags, metric, higher is better)
    "gpt2": ("clm", lambda a: language_modeling.main("clm", a), TEXT, ["--block_size", "128"], "eval_perplexity", 0),
    "roberta": ("mlm", lambda a: language_modeling.main("mlm", a), TEXT, ["--block_size", "128"], "eval_perplexity", 0),
    "vit": ("image", image_classification.main, IMAGES, [], "eval_accuracy", 1),
}


def teacher_init(family: str, folder: Path, args, tokenizer_dir: Path) -> Path:
    """A random teacher checkpoint of ``args.hidden_size`` x ``args.layers`` (what the Hub would hold)."""
    if (folder / "config.json").exists():
        return folder
    size = dict(num_hidden_layers=args.layers, num_attention_heads=args.heads, intermediate_size=4 * args.hidden_size)
    if family == "vit":
        labels = sorted(p.name for p in (DATA / "fashion_mnist/train").iterdir())
        config = ViTConfig(
            image_size=28,
            patch_size=4,
            num_channels=1,
            hidden_size=args.hidden_size,
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={name: i for i, name in enumerate(labels)},
            **size,
        )
        ViTForImageClassification(config).save_pretrained(folder)
        ViTImageProcessor(size={"height": 28, "width": 28}, image_mean=[0.5], image_std=[0.5]).save_pretrained(folder)
        return folder
    text_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if family == "gpt2":
        config = GPT2Config(
            vocab_size=len(text_tokenizer),
            n_positions=args.positions,
            n_embd=args.hidden_size,
            n_layer=args.layers,
            n_head=args.heads,
            bos_token_id=text_tokenizer.bos_token_id,
            eos_token_id=text_tokenizer.eos_token_id,
        )
        GPT2LMHeadModel(config).save_pretrained(folder)
    else:
        config = RobertaConfig(
            vocab_size=len(text_tokenizer),
            hidden_size=args.hidden_size,
            max_position_embeddings=args.positions + text_tokenizer.pad_token_id + 1,
            pad_token_id=text_tokenizer.pad_token_id,
            bos_token_id=text_tokenizer.bos_token_id,
            eos_token_id=text_tokenizer.eos_token_id,
            **size,
        )
        RobertaForMaskedLM(config).save_pretrained(folder)
    text_tokenizer.save_pretrained(folder)
    return folder


def cached(folder: Path, run, arguments: list[str]) -> dict:
    """Metrics of a finished run in ``folder`` (``result.json``), or ``run(arguments)`` now and keep them."""
    result = folder / "result.json"
    if result.exists():
        return json.loads(result.read_text())
    start = time.perf_counter()
    metrics = run(arguments)
    metrics = dict(metrics, seconds=time.perf_counter() - start)
    folder.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(metrics, indent=2, default=str))
    return metrics


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="out/linearization")
    parser.add_argument("--families", default="gpt2,roberta,vit")
    parser.add_argument("--encoding", default="lrpe_orthogonal")
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--teacher_steps", type=int, default=300)
    parser.add_argument("--transfer_steps", type=int, default=50)
    parser.add_argument("--finetune_steps", type=int, default=150)
    parser.add_argument("--learning_rate", type=float, default=2e-3, help="teacher and from-scratch training")
    parser.add_argument("--finetune_learning_rate", type=float, default=1e-3)
    args = parser.parse_args()
    out = Path(args.output_dir)
    tokenizer_dir = out / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        corpus = [str(DATA / "wikipedia_leads/train.txt")]
        tokenizer.train_tokenizer(tokenizer.TokenizerArguments(str(tokenizer_dir), corpus, vocab_size=8192))
    rows, table = {}, []
    for family in args.families.split(","):
        task, pipeline, data, shape, metric, higher = FAMILIES[family]
        common = [*data, *shape, "--per_device_train_batch_size", "16", "--warmup_steps", "20", *QUIET]
        init = teacher_init(family, out / family / "teacher_init", args, tokenizer_dir)
        teacher = out / family / "teacher"
        train = ["--learning_rate", str(args.learning_rate), "--max_steps", str(args.teacher_steps)]
        teacher_run = ["--model_name_or_path", str(init), *train, *common, "--output_dir", str(teacher)]
        runs = {"teacher (softmax)": cached(teacher, pipeline, teacher_run)}
        total = args.teacher_steps + args.transfer_steps + args.finetune_steps
        scratch = out / family / "scratch"
        size = ["--hidden_size", str(args.hidden_size), "--num_hidden_layers", str(args.layers)]
        size += ["--num_attention_heads", str(args.heads), "--intermediate_size", str(4 * args.hidden_size)]
        size += ["--positional_encoding", args.encoding, "--absolute_position_embedding", "learned"]
        if family == "vit":
            size += ["--image_size", "28", "--patch_size", "4", "--num_channels", "1"]
        else:
            size += ["--tokenizer_name", str(tokenizer_dir)]
        from_scratch = [*size, "--learning_rate", str(args.learning_rate), "--max_steps", str(total)]
        runs[f"linear from scratch ({total} steps)"] = cached(
            scratch, pipeline, [*from_scratch, *common, "--output_dir", str(scratch)]
        )
        students = [(fm, args.encoding, "output_mse") for fm in FEATURE_MAPS]
        if family == "gpt2":
            students += [("hedgehog", "none", "output_mse"), ("hedgehog", "none", "attention_ce")]
        for feature_map, encoding, loss in students:
            name = f"{feature_map}-{encoding}-{loss}"
            folder = out / family / name
            linearize = [
                *["--model_name_or_path", str(teacher), "--task", task, "--feature_map", feature_map],
                *["--positional_encoding", encoding, "--transfer_loss", loss],
                *["--transfer_steps", str(args.transfer_steps), "--max_steps", str(args.finetune_steps)],
                *["--learning_rate", str(args.finetune_learning_rate), *common, "--output_dir", str(folder)],
            ]
            label = f"linearized: {feature_map}, {encoding}, {loss}"
            runs[label] = cached(folder, linearization.main, linearize)
        rows[family] = runs
        teacher_value = runs["teacher (softmax)"][metric]
        for label, metrics in runs.items():
            value = metrics["finetune"][metric] if "finetune" in metrics else metrics[metric]
            table.append((family, label, metric.removeprefix("eval_"), value, value / teacher_value))
    (out / "results.json").write_text(json.dumps(dict(settings=vars(args), runs=rows), indent=2, default=str))
    print("| family | model | metric | value | / teacher |\n|---|---|---|---|---|")
    for family, label, metric, value, ratio in table:
        print(f"| {family} | {label} | {metric} | {value:.4g} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
