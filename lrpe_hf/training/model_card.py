"""Model cards for trained checkpoints: Hub metadata plus a filled-in template (package data in model_cards/)."""

from importlib import resources
from pathlib import Path
from string import Template

from huggingface_hub import ModelCard, ModelCardData


def results_table(metrics: dict) -> str:
    if not metrics:
        return "No evaluation was run."
    rows = [
        f"| {name} | {value:.4f} |" if isinstance(value, float) else f"| {name} | {value} |"
        for name, value in sorted(metrics.items())
    ]
    return "\n".join(["| metric | value |", "|---|---|"] + rows)


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
