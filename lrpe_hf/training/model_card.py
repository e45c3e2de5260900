"""Model cards for trained checkpoints: Hub metadata, a filled-in template (package data in model_cards/) and a
training section that states what happened, read from the Trainer's state (steps, epochs, tokens seen, time,
hardware, hyperparameters, every evaluation, framework versions)."""

import os
from importlib import metadata, resources
from pathlib import Path
from string import Template

import torch
from huggingface_hub import ModelCard, ModelCardData
from transformers.modelcard import extract_hyperparameters_from_trainer, make_markdown_table

from ..registration import FAMILIES

# What the card's usage snippet does with the model, per pipeline tag: each prints a result when run.
USAGE = {
    "text-generation": """\
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{model_id}", trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained("{model_id}", trust_remote_code=True)
inputs = tokenizer("The", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0], skip_special_tokens=True))""",
    "fill-mask": """\
from transformers import pipeline

fill = pipeline("fill-mask", model="{model_id}", trust_remote_code=True)
print(fill(f"The river flows into the {{fill.tokenizer.mask_token}}."))""",
    "text-classification": """\
from transformers import pipeline

classify = pipeline("text-classification", model="{model_id}", trust_remote_code=True)
print(classify("What a wonderful day!"))""",
    "image-classification": """\
from PIL import Image
from transformers import pipeline

classify = pipeline("image-classification", model="{model_id}", trust_remote_code=True)
print(classify(Image.open("image.png")))""",
}

# A grey-scale model: the pipeline converts every image to RGB, so the card calls the image processor itself (its
# Pillow backend, which older transformers releases, whose AutoImageProcessor wants torchvision, load too).
GREY_IMAGE_USAGE = """\
import torch
from PIL import Image
from transformers import AutoModelForImageClassification, ViTImageProcessorPil

processor = ViTImageProcessorPil.from_pretrained("{model_id}")
model = AutoModelForImageClassification.from_pretrained("{model_id}", trust_remote_code=True)
inputs = processor(Image.open("image.png").convert("L"), return_tensors="pt")  # one channel, as the model reads
with torch.no_grad():
    print(model.config.id2label[model(**inputs).logits.argmax(-1).item()])"""


def usage_snippet(pipeline_tag: str, model_id: str, config) -> str:
    grey = pipeline_tag == "image-classification" and getattr(config, "num_channels", 3) == 1
    snippet = GREY_IMAGE_USAGE if grey else USAGE[pipeline_tag]
    return f"```python\n{snippet.format(model_id=model_id)}\n```"


def results_table(metrics: dict) -> str:
    if not metrics:
        return "No evaluation was run."
    rows = [
        f"| {name} | {value:.4f} |" if isinstance(value, float) else f"| {name} | {value} |"
        for name, value in sorted(metrics.items())
    ]
    return "\n".join(["| metric | value |", "|---|---|"] + rows)


def hardware(world_size: int) -> str:
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name()} GPU"
    else:
        model = ""
        if Path("/proc/cpuinfo").exists():
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
        device = f"CPU ({os.cpu_count()} cores{', ' + model if model else ''})"
    return f"{world_size} x {device}" if world_size > 1 else device


def evaluation_lines(log_history: list[dict]) -> list[dict]:
    """One row per evaluated step: step, epoch, the last training loss logged before it, and its metrics. The final
    evaluation of a run that also evaluated at its last step (``--eval_strategy epoch``) is that step's row once."""
    lines, training_loss = [], "-"
    for entry in log_history:
        if "loss" in entry:
            training_loss = entry["loss"]
        elif "train_loss" in entry and training_loss == "-":  # no step was logged: the run's mean loss
            training_loss = entry["train_loss"]
        if "eval_loss" in entry:
            row = {"Step": entry.get("step"), "Epoch": entry.get("epoch"), "Training loss": training_loss}
            for name, value in entry.items():
                if name.startswith("eval_") and not name.endswith(("runtime", "per_second")):
                    row[name.removeprefix("eval_").replace("_", " ").capitalize()] = value
            if lines and lines[-1]["Step"] == row["Step"]:
                lines.pop()  # the same weights evaluated again: the later row stands
            lines.append(row)
    return lines


def framework_versions() -> str:
    names = ["lrpe-hf", "transformers", "torch", "datasets", "tokenizers", "accelerate", "peft"]
    versions = []
    for name in names:
        try:
            versions.append(f"- {name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "\n".join(versions)


def training_section(trainer, data_description: str, examples: tuple[str, int] | None = None) -> str:
    """What the run did, with the figures the Trainer recorded. ``examples``: (what, how many a training epoch) for
    data the Trainer cannot count in tokens (images): the card then says how many were seen, from the epochs."""
    state, args = trainer.state, trainer.args
    summary = next((entry for entry in state.log_history if "train_loss" in entry), None)
    if summary is None:
        done = "This run did not train (evaluation only)."
    else:
        tokens = f", {state.num_input_tokens_seen:,} tokens seen" if state.num_input_tokens_seen else ""
        if examples is not None:
            what, per_epoch = examples
            tokens = f", about {round(state.epoch * per_epoch):,} {what} seen ({per_epoch:,} an epoch)"
        last = next((entry for entry in reversed(state.log_history) if "loss" in entry), None)
        final = f"the last logged training loss {last['loss']:.4f} (step {last['step']}), " if last else ""
        done = (
            f"Trained for {state.global_step} steps ({state.epoch:.4g} epochs{tokens}) in "
            f"{summary['train_runtime']:.1f} s on {hardware(args.world_size)}; {final}the training loss averaged "
            f"over the run {summary['train_loss']:.4f}."
        )
    hyperparameters = "\n".join(
        f"- {name}: {value}" for name, value in extract_hyperparameters_from_trainer(trainer).items()
    )
    table = make_markdown_table(evaluation_lines(state.log_history)) or "No evaluation was run.\n"
    # The plot exists where losses were logged (plot_loss_curves writes none otherwise): no link to a missing image.
    plot = (
        "![Training and evaluation loss](loss_curves.png)\n\n"
        if (Path(args.output_dir) / "loss_curves.png").exists()
        else ""
    )
    return (
        f"{done} {data_description}\n\n### Hyperparameters\n\n{hyperparameters}\n\n### Evaluations\n\n{table}\n"
        f"{plot}### Framework versions\n\n{framework_versions()}"
    )


def adapter_section(adapter, model_id: str, auto_class: str) -> str:
    modules = ", ".join(sorted(adapter.target_modules))
    return f"""
## LoRA adapter

This repository holds a LoRA adapter (rank {adapter.r}, alpha {adapter.lora_alpha}, on {modules}) for the base
model `{adapter.base_model_name_or_path}`; the training run also wrote the merged model to `merged/`.

```python
from peft import PeftModel
from transformers import {auto_class}

base = {auto_class}.from_pretrained("{adapter.base_model_name_or_path}", trust_remote_code=True)
model = PeftModel.from_pretrained(base, "{model_id}")
```
"""


def write_model_card(
    output_dir,
    model,
    *,
    model_id: str,
    task_description: str,
    auto_class: str,
    metrics: dict,
    datasets: list[str],
    training: str,
    pipeline_tag: str,
    license: str = "apache-2.0",
) -> Path:
    """Render the card template of the model's family into ``output_dir/README.md`` with Hub metadata."""
    config = model.config
    template = Template(resources.files(__package__).joinpath("model_cards", f"{config.model_type}.md").read_text())
    options = config.attention_options()
    adapter = getattr(model, "peft_config", {}).get("default")
    data = ModelCardData(
        license=license,
        library_name="peft" if adapter else "transformers",
        base_model=adapter.base_model_name_or_path if adapter else None,
        pipeline_tag=pipeline_tag,
        datasets=datasets or None,
        metrics=sorted(
            {name.removeprefix("eval_") for name in metrics if not name.endswith(("runtime", "per_second"))}
        ),
        tags=["lrpe-hf", config.model_type, f"positional-encoding-{config.positional_encoding}", "linear-attention"]
        + (["lora"] if adapter else []),
    )
    body = template.safe_substitute(
        model_name=model_id.split("/")[-1],
        model_id=model_id,
        task_description=task_description,
        auto_class=auto_class,
        usage=usage_snippet(pipeline_tag, model_id, config),
        family=type(config).__name__.removesuffix("Config"),
        auto_classes=", ".join(f"`{name}`" for name in FAMILIES[type(config)]),
        positional_encoding=config.positional_encoding,
        feature_map=options.feature_map or "-",
        attention=config.attention,
        normalization=options.normalization or "-",
        absolute_position_embedding=config.absolute_position_embedding,
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_parameters=f"{model.num_parameters():,}",
        results=results_table(metrics),
        training=training,
    )
    if adapter:
        body += adapter_section(adapter, model_id, auto_class)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")
    path = Path(output_dir) / "README.md"
    card.save(path)
    return path
