"""LoRA fine-tuning with peft: the adapter is what the run saves and pushes; the merged model is written beside it.

Adapters train on ``--lora_target_modules`` (default: the attention's input projection ``qkv_proj``, which holds
q, k and v side by side, as GPT-2's ``c_attn`` does);
a classification head is trained in full (peft's ``modules_to_save`` for SEQ_CLS: ``classifier`` / ``score``).
"""

import copy
from pathlib import Path

TASK_TYPES = {"clm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS", "mlm": None}


def apply_lora(model, model_args, task: str):
    """``model`` wrapped in a peft LoRA adapter when ``--lora_r`` > 0, else ``model`` itself."""
    if not model_args.lora_r:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("--lora_r needs peft: pip install peft (or lrpe-hf[train])") from None
    targets = [name.strip() for name in model_args.lora_target_modules.split(",") if name.strip()]
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [name for name in targets if name not in names]
    if missing:
        raise ValueError(
            f"--lora_target_modules {', '.join(missing)}: no such module in the model; the attention's are "
            "qkv_proj (q, k and v side by side) and o_proj, the MLP's fc1 and fc2"
        )
    config = LoraConfig(
        task_type=TASK_TYPES[task],
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=targets,
    )
    return get_peft_model(model, config)


def is_adapter(model) -> bool:
    return hasattr(model, "peft_config")


def save_merged_model(model, processing_class, folder: Path) -> Path:
    """The base model with the adapter merged in, saved as a plain checkpoint (weights, model code, tokenizer or
    image processor) that loads with ``trust_remote_code=True`` where peft and lrpe-hf are not installed."""
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(folder)
    if processing_class is not None:
        processing_class.save_pretrained(folder)
    return folder
