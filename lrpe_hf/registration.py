"""Registers the three families with the Auto classes (on ``import lrpe_hf``) and for remote code.

Remote-code registration makes ``save_pretrained`` copy each model's file and the sibling files it imports
into the checkpoint, and write an ``auto_map`` naming every Auto class of the family (``auto_classes``, beside each
family's models), so that the checkpoint loads as any of its family's heads with ``trust_remote_code=True`` where
lrpe_hf is not installed.
"""

import transformers
from transformers import AutoConfig

from .modeling import modeling_linear_gpt as gpt
from .modeling import modeling_linear_roberta as roberta
from .modeling import modeling_linear_vit as vit

FAMILIES = {
    roberta.LinearRobertaConfig: roberta.LinearRobertaPreTrainedModel.auto_classes,
    gpt.LinearGPTConfig: gpt.LinearGPTPreTrainedModel.auto_classes,
    vit.LinearViTConfig: vit.LinearViTPreTrainedModel.auto_classes,
}


def register_all():
    for config_class, models in FAMILIES.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for auto_name, model_class in models.items():
            getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_name)
