"""Pretraining pipeline shared by run_mlm.py (LinearRoberta) and run_clm.py (LinearGPT)."""

import copy
import functools
import math
from dataclasses import dataclass, field
from itertools import chain

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    HfArgumentParser,
    TrainingArguments,
)

from .. import LinearGPTConfig, LinearGPTForCausalLM, LinearRobertaConfig, LinearRobertaForMaskedLM
from .arguments import ModelArguments, build_config, parse_script_arguments
from .context_parallel_training import ContextParallelTrainer
from .data import check_columns, load_files_or_hub, load_tokenizer, select_samples
from .lora import apply_lora
from .tokenizer import causal_lm_tokenizer
from .trainer import CardTrainer, train_and_evaluate

KINDS = {
    "mlm": dict(
        config=LinearRobertaConfig,
        model=LinearRobertaForMaskedLM,
        auto=AutoModelForMaskedLM,
        needed=["mask_token", "pad_token"],
        pipeline_tag="fill-mask",
        auto_name="AutoModelForMaskedLM",
        what="pretrained with masked language modelling",
    ),
    "clm": dict(
        config=LinearGPTConfig,
        model=LinearGPTForCausalLM,
        auto=AutoModelForCausalLM,
        needed=["eos_token"],
        pipeline_tag="text-generation",
        auto_name="AutoModelForCausalLM",
        what="trained as a causal language model",
    ),
}


@dataclass
class LanguageModelingDataArguments:
    _argument_group_name = "data: text files or a Hub data set, and how documents become examples"

    train_file: str | None = field(default=None, metadata={"help": "text (one document per line), csv or json"})
    validation_file: str | None = field(default=None, metadata={"help": "as the train file"})
    dataset_name: str | None = field(default=None, metadata={"help": "a Hub data set (online)"})
    dataset_config: str | None = field(default=None, metadata={"help": "the Hub data set's configuration"})
    text_column: str = field(default="text", metadata={"help": "the column holding the text (csv/json/Hub)"})
    block_size: int = field(
        default=128, metadata={"help": "tokens per training example (per document if not concatenated)"}
    )
    document_layout: str = field(
        default="concatenated",
        metadata={
            "help": "concatenated: documents joined and cut into blocks of block_size; padded: one document (its first "
            "block_size tokens) per example, padded per batch; flattened: one document per example, a batch packed "
            "into one row without padding (DataCollatorWithFlattening; position_ids restart per document)"
        },
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "masked LM: the share of tokens to predict"})
    max_train_samples: int | None = field(default=None, metadata={"help": "use only the first N training examples"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "use only the first N evaluation examples"})


def tokenize_documents(tokenizer, texts, end_documents: bool, **options):
    """The tokenizer's ids of each text; ``end_documents``: each ending with the eos token (a causal LM's
    tokenizer leaves texts open, and training must still see where each document ends)."""
    if not end_documents:
        return tokenizer(texts, return_attention_mask=False, **options)
    if options.get("truncation"):
        options["max_length"] -= 1
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, return_attention_mask=False, **options)["input_ids"]
    return {"input_ids": [row if row[-1:] == [eos] else row + [eos] for row in ids]}


def group_into_blocks(dataset, tokenizer, text_column: str, block_size: int, end_documents: bool = False):
    """Tokenize every document, concatenate them and cut the stream into blocks of ``block_size`` tokens."""

    def tokenize(batch):
        return tokenize_documents(tokenizer, batch[text_column], end_documents)

    def group(batch):
        stream = list(chain.from_iterable(batch["input_ids"]))
        usable = len(stream) // block_size * block_size
        return {"input_ids": [stream[i : i + block_size] for i in range(0, usable, block_size)]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset["train"].column_names, desc="Tokenizing")
    return tokenized.map(group, batched=True, batch_size=1000, desc=f"Grouping into blocks of {block_size}")


LAYOUTS = ("concatenated", "padded", "flattened")


def one_document_per_example(dataset, tokenizer, text_column: str, block_size: int, end_documents: bool = False):
    """Tokenize every document on its own, truncated to ``block_size`` tokens; empty documents are dropped."""

    def tokenize(batch):
        return tokenize_documents(tokenizer, batch[text_column], end_documents, truncation=True, max_length=block_size)

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset["train"].column_names, desc="Tokenizing")
    return tokenized.filter(lambda example: len(example["input_ids"]) > 1, desc="Dropping empty documents")


class FlattenedMaskedLMCollator:
    """DataCollatorWithFlattening for masked language modelling: the batch's documents in one row with restarting
    position_ids, then BERT's masking of the flattened tokens."""

    def __init__(self, tokenizer, mlm_probability: float):
        self.flatten = DataCollatorWithFlattening(return_position_ids=True)
        self.masking = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability)

    def __call__(self, features):
        batch = self.flatten([{"input_ids": f["input_ids"]} for f in features], return_tensors="pt")
        special = torch.tensor(
            self.masking.tokenizer.get_special_tokens_mask(
                batch["input_ids"][0].tolist(), already_has_special_tokens=True
            ),
            dtype=torch.bool,
        )[None]
        batch["input_ids"], batch["labels"] = self.masking.torch_mask_tokens(batch["input_ids"], special)
        return batch


def build_collator(kind: str, layout: str, tokenizer, mlm_probability: float):
    if layout == "flattened":
        return FlattenedMaskedLMCollator(tokenizer, mlm_probability) if kind == "mlm" else DataCollatorWithFlattening()
    if kind == "clm" and tokenizer.padding_side != "right":  # training pads on the right; the saved tokenizer left
        tokenizer = copy.copy(tokenizer)
        tokenizer.padding_side = "right"
    return DataCollatorForLanguageModeling(tokenizer, mlm=kind == "mlm", mlm_probability=mlm_probability)


@dataclass
class LanguageModelingTrainingArguments(TrainingArguments):
    """Transformers' TrainingArguments and one more: how many processes share each training sequence."""

    context_parallel_size: int = field(
        default=1,
        metadata={
            "help": "split every training sequence over this many processes (context parallelism; under accelerate "
            "launch with a multiple of it as --num_processes, the groups of consecutive processes data-parallel). "
            "An epoch's last incomplete batch is dropped (as --dataloader_drop_last does: an epoch has one step "
            "fewer than one process takes where the batch size does not divide the examples). 1 (default): each "
            "process trains whole sequences"
        },
    )


def argument_parser() -> HfArgumentParser:
    return HfArgumentParser((ModelArguments, LanguageModelingDataArguments, LanguageModelingTrainingArguments))


def main(kind: str, args=None):
    """Masked ("mlm") or causal ("clm") language-model training from command-line arguments."""
    return run(kind, *parse_script_arguments(argument_parser(), args))


def run(kind: str, model_args, data_args, training_args, trainer_class=CardTrainer):
    """Train and evaluate with parsed arguments; ``trainer_class`` builds the trainer (as ``CardTrainer``)."""
    spec = KINDS[kind]
    if data_args.document_layout not in LAYOUTS:
        raise ValueError(f"Unknown --document_layout {data_args.document_layout!r}; valid values: {', '.join(LAYOUTS)}")

    # Everything that can be wrong is checked before any training starts.
    dataset = load_files_or_hub(
        data_args.dataset_name, data_args.dataset_config, data_args.train_file, data_args.validation_file
    )
    check_columns(dataset, [data_args.text_column])
    tokenizer, model = load_tokenizer_and_model(kind, model_args)

    with training_args.main_process_first(desc="preparing the data"):
        prepare = group_into_blocks if data_args.document_layout == "concatenated" else one_document_per_example
        blocks = prepare(dataset, tokenizer, data_args.text_column, data_args.block_size, end_documents=kind == "clm")
    train = select_samples(blocks["train"], data_args.max_train_samples)
    evaluation = select_samples(blocks.get("validation"), data_args.max_eval_samples)
    if len(train) == 0:
        raise ValueError(f"The training text is shorter than one block of {data_args.block_size} tokens")

    collator = build_collator(kind, data_args.document_layout, tokenizer, data_args.mlm_probability)
    context_parallel_size = getattr(training_args, "context_parallel_size", 1)
    if context_parallel_size > 1:
        trainer_class = context_parallel_trainer(
            trainer_class, context_parallel_size, kind, data_args.document_layout, tokenizer.pad_token_id
        )
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collator,
        processing_class=tokenizer,
        card=model_card(spec, data_args),
    )
    return train_and_evaluate(trainer, extra_metrics=perplexity)


def load_tokenizer_and_model(kind: str, model_args):
    """The tokenizer (a causal LM's leaving prompts open, its pad token the eos token where it has none) and the
    model to train: the checkpoint's, or a new one of ``kind``'s family; its embeddings grown to the tokenizer's
    size where smaller, with LoRA where asked."""
    spec = KINDS[kind]
    purpose = "masked language modelling" if kind == "mlm" else "causal LM"
    tokenizer = load_tokenizer(model_args, spec["needed"], purpose)
    if kind == "clm":  # prompts stay open: "<s> text", never "<s> text </s>"; the checkpoint saves this layout
        tokenizer = causal_lm_tokenizer(tokenizer)
    if model_args.model_name_or_path:
        model = spec["auto"].from_pretrained(
            model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code
        )
    else:
        special = dict(
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        model = spec["model"](build_config(model_args, spec["config"], vocab_size=len(tokenizer), **special))
    if len(tokenizer) > model.config.vocab_size:
        model.resize_token_embeddings(len(tokenizer))
    if kind == "clm" and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if kind == "clm":  # saved so: batched prompts end with their last token, where generate continues them
        tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"  # init_kwargs: what is saved
    return tokenizer, apply_lora(model, model_args, kind)


def model_card(spec: dict, data_args: LanguageModelingDataArguments) -> dict:
    """The model card's fields: the task, the auto class, the data set and the examples' layout and length."""
    source = data_args.dataset_name or data_args.train_file
    return dict(
        task_description=f"{spec['what']} on {source}",
        auto_class=spec["auto_name"],
        datasets=[data_args.dataset_name] if data_args.dataset_name else [],
        data_description=f"{data_args.document_layout.capitalize()} examples of at most {data_args.block_size} tokens.",
        pipeline_tag=spec["pipeline_tag"],
    )


def context_parallel_trainer(trainer_class, size: int, kind: str, layout: str, pad_token_id: int):
    """The trainer class that splits each training sequence over ``size`` processes, or why it cannot."""
    if size < 1:
        raise ValueError(f"--context_parallel_size must be at least 1, got {size}")
    if trainer_class is not CardTrainer:
        raise ValueError(f"--context_parallel_size is not supported with {trainer_class.__name__}")
    if kind == "mlm" and layout == "flattened":
        raise ValueError(
            "--context_parallel_size with a masked LM needs --document_layout concatenated or padded: a flattened "
            "row packs documents, and a bidirectional document split over processes would need states per document"
        )
    return functools.partial(ContextParallelTrainer, context_parallel_size=size, causal=kind == "clm",
                             pad_token_id=pad_token_id)  # fmt: skip


def perplexity(metrics: dict) -> dict:
    """exp(eval_loss), capped at exp(50); nothing when the evaluation has no language-model loss."""
    return {"eval_perplexity": math.exp(min(metrics["eval_loss"], 50))} if "eval_loss" in metrics else {}
