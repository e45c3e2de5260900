"""Turn a pretrained GPT-2, RoBERTa, BERT or ViT checkpoint into a linear-attention model, in two stages.

    python -m lrpe_hf run_linearize --model_name_or_path gpt2 --positional_encoding lrpe_orthogonal \
        --feature_map hedgehog --train_file data/wikipedia_leads/train.txt \
        --validation_file data/wikipedia_leads/validation.txt --output_dir out/linear-gpt2 --max_steps 1000

1. ``linearize``: the teacher's weights in the matching LinearGPT / LinearRoberta / LinearViT model
   (``<output_dir>/linearized``), with the encoding and feature map of the model fields given.
2. Attention transfer (``<output_dir>/attention_transfer``): only the feature maps' and encodings' parameters
   train, so that each layer's linear attention matches the teacher's softmax attention on the task's data
   (``--transfer_loss output_mse`` as LoLCATs, or ``attention_ce`` as Hedgehog).
3. Fine-tuning (``<output_dir>/finetune``): the task's own training, in full or with LoRA (``--lora_r``).

The task (``--task``) follows the teacher's head unless given: GPT-2 -> causal LM, RoBERTa/BERT -> masked LM
(``classification`` fine-tunes on sentence tasks instead), ViT -> image classification. Its data and training
flags are those of run_clm / run_mlm / run_glue / run_image_classification; ``--max_steps`` and the learning
rate are stage 3's, ``--transfer_steps`` and ``--transfer_learning_rate`` stage 2's. Each stage writes its
metrics, loss-curve PNG and model card; ``linearize_results.json`` collects the stages' metrics.
"""

import argparse
import copy
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, HfArgumentParser, TrainingArguments

from ..linearize import attention_transfer_loss, linearize, load_source, transfer_parameters
from . import glue, image_classification, language_modeling
from .arguments import ModelArguments, parse_script_arguments
from .trainer import CardTrainer

TASKS = {
    "clm": (language_modeling.LanguageModelingDataArguments, lambda *a, **k: language_modeling.run("clm", *a, **k)),
    "mlm": (language_modeling.LanguageModelingDataArguments, lambda *a, **k: language_modeling.run("mlm", *a, **k)),
    "classification": (glue.GlueDataArguments, glue.run),
    "image": (image_classification.ImageDataArguments, image_classification.run),
}
STAGES = ("attention_transfer", "finetune")
TRANSFER_LOSSES = ("output_mse", "attention_ce")


@dataclass
class LinearizeArguments:
    _argument_group_name = "linearizing: the task and the attention-transfer stage"

    task: str | None = field(
        default=None,
        metadata={"help": f"one of {', '.join(TASKS)}; default: from the teacher's architecture"},
    )
    transfer_loss: str = field(
        default="output_mse",
        metadata={"help": "output_mse (LoLCATs: attention outputs) or attention_ce (Hedgehog: attention rows)"},
    )
    transfer_steps: int = field(default=200, metadata={"help": "attention-transfer optimiser steps"})
    transfer_learning_rate: float = field(default=1e-2, metadata={"help": "attention-transfer learning rate"})
    table_extension: str | None = field(
        default=None,
        metadata={
            "help": "with a --max_position_embeddings above the teacher's and its learned table kept: copy (repeat "
            "the teacher's rows) or interpolate (stretch them); or drop the table with "
            "--absolute_position_embedding none"
        },
    )
    stages: str = field(
        default="attention_transfer,finetune",
        metadata={"help": f"the stages to run, comma-separated: {', '.join(STAGES)}"},
    )


def task_of(architecture: str) -> str:
    if architecture.startswith("GPT2"):
        return "clm"
    if architecture.startswith("ViT"):
        return "image"
    return "classification" if architecture.endswith("ForSequenceClassification") else "mlm"


def chosen_task(argv: list[str]) -> str:
    """``--task`` if given, else the task of the teacher's architecture (``--model_name_or_path``)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--task")
    pre.add_argument("--model_name_or_path")
    known, _ = pre.parse_known_args(argv)
    if known.task:
        if known.task not in TASKS:
            raise ValueError(f"Unknown --task {known.task!r}; valid values: {', '.join(TASKS)}")
        return known.task
    if not known.model_name_or_path:
        return "clm"  # only --help gets here (the teacher is required below): show the language-model flags
    architectures = AutoConfig.from_pretrained(known.model_name_or_path).architectures or [""]
    return task_of(architectures[0])


def argument_parser(task: str = "clm") -> HfArgumentParser:
    return HfArgumentParser((LinearizeArguments, ModelArguments, TASKS[task][0], TrainingArguments))


class AttentionTransferTrainer(CardTrainer):
    """Trains only the student's feature maps and encodings (``linearize_transfer_parameters``) so that its
    attention matches ``teacher``'s, layer by layer on the teacher's hidden states. The loss is the transfer
    loss in training and evaluation (``eval_loss``)."""

    def __init__(self, *args, teacher, transfer_loss: str, **kwargs):
        super().__init__(*args, **kwargs)
        trainable = {id(p) for p in transfer_parameters(self.model)}
        if not trainable:
            raise ValueError("The student has no feature-map or encoding parameters for attention transfer to train")
        for parameter in self.model.parameters():
            parameter.requires_grad_(id(parameter) in trainable)
        self.teacher = teacher.eval().requires_grad_(False).to(self.args.device)
        self.transfer_loss = transfer_loss
        self.compute_metrics = None  # the evaluation loss is the transfer loss; there are no predictions
        self.card["task_description"] = (
            f"linearized from {teacher.name_or_path} and trained by attention transfer ({transfer_loss}: stage 2 of "
            f"3), on the data of a model {self.card['task_description']}"
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        teacher_inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "pixel_values")}
        with torch.no_grad():
            hidden_states = self.teacher(**teacher_inputs, output_hidden_states=True).hidden_states
        student = self.accelerator.unwrap_model(model)
        loss = attention_transfer_loss(student, hidden_states, inputs.get("attention_mask"), self.transfer_loss)
        return (loss, None) if return_outputs else loss

    def evaluate(self, *args, **kwargs):
        """The metrics with ``eval_transfer_loss`` in place of ``eval_loss`` (it is not the task's loss)."""
        metrics = super().evaluate(*args, **kwargs)
        metrics["eval_transfer_loss"] = metrics.pop("eval_loss")
        return metrics

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            return self.compute_loss(model, inputs).detach(), None, None


def with_output_dir(training_args: TrainingArguments, folder: Path, **changes) -> TrainingArguments:
    """A copy of ``training_args`` writing to ``folder``, with ``changes`` applied."""
    args = copy.deepcopy(training_args)
    args.output_dir = str(folder)
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def save_linearized(teacher, student, model_path: str, folder: Path):
    """The converted student and the teacher's tokenizer or image processor, as a checkpoint folder."""
    student.save_pretrained(folder)
    if type(teacher).__name__.startswith("ViT"):
        AutoImageProcessor.from_pretrained(model_path).save_pretrained(folder)
    else:
        AutoTokenizer.from_pretrained(model_path).save_pretrained(folder)


def main(args=None):
    argv = sys.argv[1:] if args is None else [str(a) for a in args]
    task = chosen_task(argv)
    linearize_args, model_args, data_args, training_args = parse_script_arguments(argument_parser(task), argv)
    stages = [s.strip() for s in linearize_args.stages.split(",") if s.strip()]
    if unknown := [s for s in stages if s not in STAGES]:
        raise ValueError(f"Unknown --stages {', '.join(unknown)}; valid values: {', '.join(STAGES)}")
    if linearize_args.transfer_loss not in TRANSFER_LOSSES:
        raise ValueError(
            f"Unknown --transfer_loss {linearize_args.transfer_loss!r}; valid values: {', '.join(TRANSFER_LOSSES)}"
        )
    if not model_args.model_name_or_path:
        raise ValueError("Give the pretrained teacher with --model_name_or_path (a GPT-2, RoBERTa, BERT or ViT)")
    if training_args.world_size > 1 and "attention_transfer" in stages:
        raise ValueError("Attention transfer runs in one process; launch the finetune stage alone on several")

    output = Path(training_args.output_dir)
    teacher = load_source(model_args.model_name_or_path)
    student = linearize(teacher, linearize_args.table_extension, **model_args.config_fields())
    save_linearized(teacher, student, model_args.model_name_or_path, output / "linearized")
    transformers.set_seed(training_args.seed)
    run_task = TASKS[task][1]
    results, checkpoint = {}, output / "linearized"

    if "attention_transfer" in stages:
        transfer_args = with_output_dir(
            training_args,
            output / "attention_transfer",
            max_steps=linearize_args.transfer_steps,
            learning_rate=linearize_args.transfer_learning_rate,
            push_to_hub=False,
        )

        def trainer_class(*a, **k):
            return AttentionTransferTrainer(*a, teacher=teacher, transfer_loss=linearize_args.transfer_loss, **k)

        transfer_model_args = replace(model_args, model_name_or_path=str(checkpoint), lora_r=0)
        results["attention_transfer"] = run_task(transfer_model_args, data_args, transfer_args, trainer_class)
        checkpoint = output / "attention_transfer"

    if "finetune" in stages:
        finetune_args = with_output_dir(training_args, output / "finetune")
        results["finetune"] = run_task(
            replace(model_args, model_name_or_path=str(checkpoint)), data_args, finetune_args
        )

    if training_args.process_index == 0:
        names = (
            "attention", "positional_encoding", "feature_map", "normalization", "local_window",
            "absolute_position_embedding",
        )  # fmt: skip
        student_fields = {name: getattr(student.config, name) for name in names}
        summary = dict(teacher=model_args.model_name_or_path, task=task, student=student_fields, **results)
        (output / "linearize_results.json").write_text(json.dumps(summary, indent=2, default=str))
    return results
