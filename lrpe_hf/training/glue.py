"""Fine-tune a LinearRoberta (or LinearGPT) checkpoint on a GLUE task or on your own csv/json files.

    # the embedded single-sentence task (3 classes)
    python -m lrpe_hf run_glue --model_name_or_path out/mlm --train_file data/tweet_sentiment/train.csv \
        --validation_file data/tweet_sentiment/validation.csv --output_dir out/tweets --num_train_epochs 1
    # the embedded sentence-pair task
    python -m lrpe_hf run_glue --model_name_or_path out/mlm --train_file data/wikipedia_topic_pairs/train.csv \
        --validation_file data/wikipedia_topic_pairs/validation.csv --output_dir out/pairs
    # a GLUE task (downloads the data set, so online only); the metric is computed locally
    python -m lrpe_hf run_glue --model_name_or_path out/mlm --task_name mrpc --output_dir out/mrpc

Local files: one text column (``sentence``, ``text``) or two (``sentence1``/``sentence2``, or name them with
--sentence1_key/--sentence2_key) and a ``label`` column: strings or integers for classification, floats for
regression.
"""

from dataclasses import dataclass, field

import numpy as np
from datasets import DatasetDict
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
    TrainingArguments,
)

from .. import LinearRobertaConfig, LinearRobertaForSequenceClassification
from .arguments import ModelArguments, build_config, parse_script_arguments
from .data import check_columns, check_tokenizer_fits, load_files_or_hub, load_tokenizer, select_samples
from .lora import apply_lora
from .metrics import GLUE_TASKS, load_glue_metric
from .trainer import CardTrainer, train_and_evaluate

TASK_KEYS = {
    "cola": ("sentence", None),
    "sst2": ("sentence", None),
    "mrpc": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"),
    "stsb": ("sentence1", "sentence2"),
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}


@dataclass
class GlueDataArguments:
    _argument_group_name = "data: a GLUE task (online) or your own csv/json files"

    task_name: str | None = field(default=None, metadata={"help": f"a GLUE task: {', '.join(GLUE_TASKS)}"})
    train_file: str | None = field(default=None, metadata={"help": "csv or json with the text column(s) and labels"})
    validation_file: str | None = field(default=None, metadata={"help": "csv or json, as the train file"})
    sentence1_key: str | None = field(default=None, metadata={"help": "first text column (default: guessed)"})
    sentence2_key: str | None = field(default=None, metadata={"help": "second text column, for sentence pairs"})
    label_column: str = field(default="label", metadata={"help": "labels: strings or integers; floats = regression"})
    max_seq_length: int = field(default=128, metadata={"help": "longer inputs are truncated to this many tokens"})
    max_train_samples: int | None = field(default=None, metadata={"help": "use only the first N training examples"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "use only the first N evaluation examples"})


def text_columns(args: GlueDataArguments, columns: list[str]) -> tuple[str, str | None]:
    if args.task_name:
        return TASK_KEYS[args.task_name]
    if args.sentence1_key:
        return args.sentence1_key, args.sentence2_key
    if "sentence1" in columns and "sentence2" in columns:
        return "sentence1", "sentence2"
    for name in ("sentence", "text"):
        if name in columns:
            return name, None
    raise ValueError(
        f"Cannot tell the text columns among {columns}: name them with --sentence1_key (and --sentence2_key for pairs)"
    )


def argument_parser() -> HfArgumentParser:
    return HfArgumentParser((ModelArguments, GlueDataArguments, TrainingArguments))


def check_segment_types(datasets, type_vocab_size: int, tokenizer):
    """Stop before training where the tokenizer gives token types (BERT's: 1 for a pair's second sentence) that the
    model has no embedding for (RoBERTa's layout has one segment type)."""
    typed = [data["token_type_ids"] for data in datasets if data is not None and "token_type_ids" in data.column_names]
    highest = max((max(map(max, rows), default=0) for rows in typed), default=0)
    if highest >= type_vocab_size:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) gives token_type_ids up to {highest}, and the model has "
            f"type_vocab_size={type_vocab_size}: its segment embeddings cannot read them. Use a tokenizer of the "
            "model's own layout (RoBERTa's separates a pair by tokens alone), or a model with segment types (a BERT "
            "converted by run_linearize keeps them; a new model takes --config_overrides '{\"type_vocab_size\": 2}')"
        )


def main(args=None):
    return run(*parse_script_arguments(argument_parser(), args))


def run(model_args, data_args, training_args, trainer_class=CardTrainer):
    """Fine-tune and evaluate with parsed arguments; ``trainer_class`` builds the trainer (as ``CardTrainer``)."""

    dataset = load_splits(data_args)
    key1, key2 = text_columns(data_args, dataset["train"].column_names)
    check_columns(dataset, [c for c in (key1, key2, data_args.label_column) if c])
    is_regression, label_names, label_to_id = read_labels(data_args, dataset["train"])

    tokenizer = load_tokenizer(model_args, ["pad_token"], "batching sentences of different lengths")
    model = build_model(model_args, tokenizer, label_config(label_names, is_regression))

    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples}
    dataset = DatasetDict({name: select_samples(split, limits.get(name)) for name, split in dataset.items()})
    with training_args.main_process_first(desc="tokenizing"):  # only the examples kept
        encoded = encode(dataset, tokenizer, data_args, (key1, key2), label_to_id)
    train, evaluation = encoded["train"], encoded.get("validation")
    check_segment_types([train, evaluation], getattr(model.config, "type_vocab_size", 1), tokenizer)

    compute_metrics = metrics_function(data_args.task_name, is_regression)
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        card=model_card(data_args),
    )
    return train_and_evaluate(trainer)


def load_splits(data_args: GlueDataArguments) -> DatasetDict:
    """The train and validation splits: the GLUE task's (its name lower-cased in ``data_args``) or the files'."""
    if data_args.task_name is not None:
        data_args.task_name = data_args.task_name.lower()
        if data_args.task_name not in TASK_KEYS:
            raise ValueError(f"Unknown --task_name {data_args.task_name!r}; GLUE tasks: {', '.join(GLUE_TASKS)}")
        dataset = load_files_or_hub("nyu-mll/glue", data_args.task_name)
        if data_args.task_name == "mnli":
            dataset["validation"] = dataset["validation_matched"]
        return DatasetDict({split: dataset[split] for split in ("train", "validation")})  # GLUE tests are unlabelled
    return load_files_or_hub(train_file=data_args.train_file, validation_file=data_args.validation_file)


def read_labels(data_args: GlueDataArguments, train) -> tuple[bool, list | None, dict | None]:
    """Whether the task is a regression, the label names (None for a regression) and the map from the label
    column's values to class ids (None where the column holds ids already: a ClassLabel, or a regression)."""
    label_feature = train.features[data_args.label_column]
    is_regression = data_args.task_name == "stsb" or label_feature.dtype in ("float32", "float64")
    if is_regression:
        return True, None, None
    if hasattr(label_feature, "names"):
        return False, label_feature.names, None
    label_names = sorted(set(train[data_args.label_column]))
    if len(label_names) < 2:
        raise ValueError(f"The label column {data_args.label_column!r} has a single value: nothing to classify")
    return False, label_names, {n: i for i, n in enumerate(label_names)}


def label_config(label_names: list | None, is_regression: bool) -> dict:
    """The config fields of the labels: ``num_labels``, and ``id2label``/``label2id`` or ``problem_type``."""
    fields = {"num_labels": 1 if is_regression else len(label_names)}
    if label_names:
        fields.update(
            id2label={i: str(n) for i, n in enumerate(label_names)},
            label2id={str(n): i for i, n in enumerate(label_names)},
        )
    if is_regression:
        fields["problem_type"] = "regression"
    return fields


def build_model(model_args, tokenizer, label_fields: dict):
    """The sequence classifier to fine-tune: the checkpoint's, or a new LinearRoberta; with LoRA where asked."""
    if model_args.model_name_or_path:
        model = AutoModelForSequenceClassification.from_pretrained(
            model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code, **label_fields
        )
    else:
        config = build_config(
            model_args,
            LinearRobertaConfig,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            **label_fields,
        )
        model = LinearRobertaForSequenceClassification(config)
    check_tokenizer_fits(tokenizer, model)
    return apply_lora(model, model_args, "sequence_classification")


def encode(dataset, tokenizer, data_args: GlueDataArguments, keys: tuple[str, str | None], label_to_id: dict | None):
    """``dataset`` tokenized (truncated to ``max_seq_length``), with the labels as class ids (or floats)."""
    key1, key2 = keys

    def preprocess(batch):
        texts = (batch[key1],) if key2 is None else (batch[key1], batch[key2])
        encoded = tokenizer(*texts, truncation=True, max_length=data_args.max_seq_length)
        labels = batch[data_args.label_column]
        encoded["labels"] = [label_to_id[label] for label in labels] if label_to_id else labels
        return encoded

    return dataset.map(preprocess, batched=True, remove_columns=dataset["train"].column_names, desc="Tokenizing")


def metrics_function(task_name: str | None, is_regression: bool):
    """The Trainer's ``compute_metrics``: the GLUE task's metric, Pearson / Spearman for a regression, or accuracy
    and macro F1."""
    metric = load_glue_metric(task_name or ("regression" if is_regression else None))

    def compute_metrics(prediction):
        logits = prediction.predictions
        predictions = np.squeeze(logits) if is_regression else np.argmax(logits, axis=-1)
        return metric.compute(predictions=predictions, references=prediction.label_ids)

    return compute_metrics


def model_card(data_args: GlueDataArguments) -> dict:
    """The model card's fields: the task, the auto class, the data set and the sequence length."""
    source = f"GLUE {data_args.task_name}" if data_args.task_name else data_args.train_file
    return dict(
        task_description=f"fine-tuned for sequence classification on {source}",
        auto_class="AutoModelForSequenceClassification",
        datasets=["nyu-mll/glue"] if data_args.task_name else [],
        pipeline_tag="text-classification",
        data_description=f"Sequences of at most {data_args.max_seq_length} tokens.",
    )
