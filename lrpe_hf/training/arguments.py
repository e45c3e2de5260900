"""Command-line arguments that build a model config, shared by the run scripts (parsed by HfArgumentParser)."""

import argparse
import json
import sys
from dataclasses import dataclass, field

import torch
import transformers
from transformers import set_seed
from transformers.hf_argparser import string_to_bool
from transformers.utils import is_torch_bf16_gpu_available

from ..modeling.registry import FEATURE_MAPS, POSITIONAL_ENCODINGS


@dataclass
class ModelArguments:
    """Start from a checkpoint (``model_name_or_path``) or build a new model from a config file and/or fields."""

    _argument_group_name = "model: start from a checkpoint, or build a new model from these fields"

    model_name_or_path: str | None = field(default=None, metadata={"help": "checkpoint folder or Hub name"})
    config_file: str | None = field(default=None, metadata={"help": "a config.json to build a new model from"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "tokenizer folder or Hub name"})
    positional_encoding: str | None = field(
        default=None, metadata={"help": f"one of {', '.join(POSITIONAL_ENCODINGS)}"}
    )
    feature_map: str | None = field(default=None, metadata={"help": f"one of {', '.join(FEATURE_MAPS)}"})
    absolute_position_embedding: str | None = field(default=None, metadata={"help": "none, sinusoidal or learned"})
    attention: str | None = field(default=None, metadata={"help": "linear or softmax"})
    local_window: int | None = field(
        default=None,
        metadata={"help": "W: exact softmax over each query's W nearest tokens, linear attention beyond (0: off)"},
    )
    hidden_size: int | None = field(default=None, metadata={"help": "model width (new models)"})
    num_hidden_layers: int | None = field(default=None, metadata={"help": "number of layers (new models)"})
    num_attention_heads: int | None = field(default=None, metadata={"help": "attention heads (new models)"})
    intermediate_size: int | None = field(default=None, metadata={"help": "MLP width (new models)"})
    max_position_embeddings: int | None = field(
        default=None, metadata={"help": "table size of learned absolute embeddings and FastRPB's longest span"}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "JSON of further config fields, e.g. '{\"permute_decay\": 0.95}'"}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "load a checkpoint's own model code (not needed with lrpe_hf installed)"}
    )
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 (default) trains every weight"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling alpha (the update is scaled by alpha/r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA branch"})
    lora_target_modules: str = field(
        default="qkv_proj",
        metadata={"help": "comma-separated module names that get LoRA adapters (qkv_proj, o_proj, fc1, fc2)"},
    )

    def config_fields(self) -> dict:
        """The config fields given on the command line."""
        names = [
            "positional_encoding",
            "feature_map",
            "absolute_position_embedding",
            "attention",
            "local_window",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ]
        fields_ = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return fields_ | parse_config_overrides(self.config_overrides)


def parse_config_overrides(text: str | None) -> dict:
    """``--config_overrides``' fields (a JSON object; none when empty)."""
    try:
        overrides = json.loads(text) if text else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"--config_overrides must be a JSON object: {error}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--config_overrides must be a JSON object, got {text!r}")
    return overrides


def parse_script_arguments(parser, args=None):
    """Parse a script's dataclasses (the last one ``TrainingArguments``), set the seed and the log level.

    ``--do_train`` and ``--do_eval`` are honoured as in Transformers' example scripts; a run that gives neither
    trains and then evaluates (a ``--eval_strategy`` alone also turns ``do_eval`` on, as in Transformers).
    """
    argv = sys.argv[1:] if args is None else [str(a) for a in args]
    argv = with_cpu_for_bf16(argv)
    parsed = parser.parse_args_into_dataclasses(args=argv)
    training_args = parsed[-1]
    if not any(a.split("=")[0] in ("--do_train", "--do_eval") for a in argv):
        training_args.do_train = training_args.do_eval = True
    if training_args.include_num_input_tokens_seen in (False, "no"):  # the model card reports the tokens seen
        training_args.include_num_input_tokens_seen = "non_padding"
    if not torch.cuda.is_available():  # pinned memory needs an accelerator (torch warns otherwise)
        training_args.dataloader_pin_memory = False
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    set_seed(training_args.seed)
    return parsed


def with_cpu_for_bf16(argv: list[str]) -> list[str]:
    """``argv`` with ``--use_cpu`` added when it asks for ``--bf16`` on a machine with no GPU that runs bf16:
    transformers would stop with "Your setup doesn't support bf16/gpu"; here the CPU is the only device, and it
    runs bf16 autocast (fast on CPUs with AMX, several times slower than float32 on others)."""
    flags = argparse.ArgumentParser(add_help=False)
    for flag in ("--bf16", "--bf16_full_eval", "--use_cpu"):
        flags.add_argument(flag, nargs="?", const="true", default="false", type=string_to_bool)
    given, _ = flags.parse_known_args(argv)
    if (given.bf16 or given.bf16_full_eval) and not given.use_cpu and not is_torch_bf16_gpu_available():
        print("--bf16 on a machine without a GPU that runs bf16: training on the CPU (--use_cpu added)")
        return argv + ["--use_cpu"]
    return argv


def build_config(model_args: ModelArguments, config_class, **task_fields):
    """A new config from --config_file and the command-line fields (which win), plus the task's fields. A field
    typed on the command line that the config does not have is refused; a config file's are kept as transformers
    keeps them (files saved by other releases carry fields of their own)."""
    values = {}
    if model_args.config_file:
        with open(model_args.config_file) as f:
            values = json.load(f)
        values.pop("model_type", None)
        values.pop("auto_map", None)
    given = model_args.config_fields()
    values.update(given)
    values.update(task_fields)
    known = config_class()
    unknown = [name for name in given if not hasattr(known, name)]
    if unknown:  # a config keeps any keyword as an attribute, which no layer would read
        valid = ", ".join(sorted(known.to_dict()))
        raise ValueError(
            f"{config_class.__name__} has no field {', '.join(unknown)} (in --config_overrides); its fields: {valid}"
        )
    return config_class(**values)
