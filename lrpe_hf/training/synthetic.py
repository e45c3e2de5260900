"""Synthetic sequence tasks that need position, and LinearGPT trained on them with Trainer (accuracy on answers).

Both tasks follow Transformers' causal-LM layout: ``labels[t]`` is what the model must output after reading
tokens ``0..t-1`` (the loss shifts labels by one), and it is -100 everywhere except at the answer positions.

- ``copy`` (lag k): uniformly random tokens; after reading ``x_0..x_s`` the model outputs ``x_{s-k}``, for every
  ``s >= k``, so ``labels[t] = x[t-1-k]`` for ``t >= k+1``. The tokens are independent, so nothing in their
  content says which one lies k positions back: attention that compares contents alone (no encoding) can only
  guess, while a relative encoding can single out the offset k directly.
- ``recall`` (associative recall, as in the "multi-query associative recall" of the Zoology/H3 line of work):
  ``n`` key-value pairs with distinct keys, ``k1 v1 k2 v2 ... kn vn``, then ``n`` queries ``kq vq`` whose keys are
  drawn from the pairs; the answer is each query's value, predicted after reading its key: ``labels`` holds
  ``vq`` at the value positions of the query half. Finding the pair needs content (the key), reading its value
  needs position (the token right after the key). Keys are tokens ``0..V-1``, values ``V..2V-1``.
"""

from dataclasses import dataclass, field

import numpy as np
from datasets import Dataset
from transformers import HfArgumentParser, TrainingArguments, default_data_collator

from .. import LinearGPTConfig, LinearGPTForCausalLM
from .arguments import ModelArguments, build_config, parse_script_arguments
from .trainer import CardTrainer, train_and_evaluate

TASKS = ("copy", "recall")
IGNORE = -100


def copy_examples(num_examples: int, sequence_length: int, vocab_size: int, lag: int, seed: int) -> dict:
    """``input_ids`` uniform over ``vocab_size`` tokens; ``labels[t] = input_ids[t-1-lag]`` for ``t >= lag+1``."""
    if not 1 <= lag <= sequence_length - 2:
        raise ValueError(f"copy_lag must be between 1 and sequence_length - 2 ({sequence_length - 2}), got {lag}")
    tokens = np.random.default_rng(seed).integers(0, vocab_size, size=(num_examples, sequence_length))
    labels = np.full_like(tokens, IGNORE)
    labels[:, lag + 1 :] = tokens[:, : sequence_length - lag - 1]
    return {"input_ids": tokens, "labels": labels}


def recall_examples(num_examples: int, sequence_length: int, vocab_size: int, seed: int) -> dict:
    """``sequence_length // 4`` key-value pairs then as many queries; ``labels`` holds the queries' values."""
    pairs = sequence_length // 4
    if pairs < 1 or sequence_length % 4:
        raise ValueError(f"recall needs a sequence_length that is a positive multiple of 4, got {sequence_length}")
    if pairs > vocab_size:
        raise ValueError(f"recall: {pairs} pairs need distinct keys, more than vocab_size {vocab_size}")
    rng = np.random.default_rng(seed)
    keys = np.argsort(rng.random((num_examples, vocab_size)), axis=1)[:, :pairs]  # distinct keys per example
    values = rng.integers(vocab_size, 2 * vocab_size, size=(num_examples, pairs))
    asked = rng.integers(0, pairs, size=(num_examples, pairs))  # which pair each query asks for
    query_keys = np.take_along_axis(keys, asked, axis=1)
    query_values = np.take_along_axis(values, asked, axis=1)
    tokens = np.empty((num_examples, sequence_length), dtype=np.int64)
    tokens[:, 0 : 2 * pairs : 2], tokens[:, 1 : 2 * pairs : 2] = keys, values
    tokens[:, 2 * pairs :: 2], tokens[:, 2 * pairs + 1 :: 2] = query_keys, query_values
    labels = np.full_like(tokens, IGNORE)
    labels[:, 2 * pairs + 1 :: 2] = query_values
    return {"input_ids": tokens, "labels": labels}


def synthetic_dataset(task: str, num_examples: int, sequence_length: int, vocab_size: int, lag: int, seed: int):
    """A ``datasets.Dataset`` of ``input_ids`` and ``labels`` for ``task`` (see the module docstring)."""
    if task == "copy":
        columns = copy_examples(num_examples, sequence_length, vocab_size, lag, seed)
    elif task == "recall":
        columns = recall_examples(num_examples, sequence_length, vocab_size, seed)
    else:
        raise ValueError(f"Unknown synthetic task {task!r}; valid values: {', '.join(TASKS)}")
    return Dataset.from_dict({name: values.tolist() for name, values in columns.items()})


def model_vocab_size(task: str, vocab_size: int) -> int:
    """Recall's values are a second vocabulary after the keys."""
    return 2 * vocab_size if task == "recall" else vocab_size


@dataclass
class SyntheticDataArguments:
    _argument_group_name = "data: the synthetic task"

    task: str = field(default="copy", metadata={"help": f"one of {', '.join(TASKS)}"})
    sequence_length: int = field(default=64, metadata={"help": "tokens per example"})
    vocab_size: int = field(default=32, metadata={"help": "copy: symbols; recall: keys (and as many values)"})
    copy_lag: int = field(default=4, metadata={"help": "copy: output the token this many positions back"})
    num_train_examples: int = field(default=20000, metadata={"help": "training sequences"})
    num_eval_examples: int = field(default=500, metadata={"help": "evaluation sequences (drawn apart)"})
    generator_seed: int = field(
        default=1234, metadata={"help": "seed of the training draw (evaluation: the next seed)"}
    )


def answer_accuracy(prediction) -> dict:
    """Accuracy over the answer positions: the output at ``t-1`` against ``labels[t]``."""
    predicted, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    answers = labels != IGNORE
    return {"accuracy": float((predicted[answers] == labels[answers]).mean())}


def argument_parser() -> HfArgumentParser:
    return HfArgumentParser((ModelArguments, SyntheticDataArguments, TrainingArguments))


def main(args=None):
    parser = argument_parser()
    model_args, data_args, training_args = parse_script_arguments(parser, args)
    training_args.include_num_input_tokens_seen = "all"  # no padding: every token counts
    if model_args.model_name_or_path:
        raise ValueError("The synthetic tasks train a new LinearGPT: leave --model_name_or_path unset")
    sizes = (data_args.sequence_length, data_args.vocab_size, data_args.copy_lag)
    train = synthetic_dataset(data_args.task, data_args.num_train_examples, *sizes, seed=data_args.generator_seed)
    evaluation = synthetic_dataset(
        data_args.task, data_args.num_eval_examples, *sizes, seed=data_args.generator_seed + 1
    )
    config = build_config(
        model_args, LinearGPTConfig, vocab_size=model_vocab_size(data_args.task, data_args.vocab_size)
    )
    model = LinearGPTForCausalLM(config)

    detail = f" (lag {data_args.copy_lag})" if data_args.task == "copy" else ""
    card = dict(
        task_description=f"trained on the synthetic {data_args.task} task{detail}",
        auto_class="AutoModelForCausalLM",
        datasets=[],
        pipeline_tag="text-generation",
        data_description=f"{data_args.num_train_examples} random sequences of {data_args.sequence_length} tokens "
        "(lrpe_hf.training.synthetic); accuracy on the answer tokens.",
    )
    trainer = CardTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=default_data_collator,
        compute_metrics=answer_accuracy,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        card=card,
    )
    return train_and_evaluate(trainer)
