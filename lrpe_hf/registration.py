"""Registers the three families with the Auto classes (on ``import lrpe_hf``) and for remote code.

Remote-code registration makes ``save_pretrained`` copy each model's file and the sibling files it imports
into the checkpoint, and write an ``auto_map``, so that the checkpoint loads with ``trust_remote_code=True``
where lrpe_hf is not installed.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .modeling import modeling_linear_gpt as gpt
from .modeling import modeling_linear_roberta as roberta
from .modeling import modeling_linear_vit as vit

FAMILIES = {
    roberta.LinearRobertaConfig: {
        AutoModel: roberta.LinearRobertaModel,
        AutoModelForMaskedLM: roberta.LinearRobertaForMaskedLM,
        AutoModelForSequenceClassification: roberta.LinearRobertaForSequenceClassification,
        AutoModelForTokenClassification: roberta.LinearRobertaForTokenClassification,
        AutoModelForQuestionAnswering: roberta.LinearRobertaForQuestionAnswering,
    },
    gpt.LinearGPTConfig: {
        AutoModel: gpt.LinearGPTModel,
        AutoModelForCausalLM: gpt.LinearGPTForCausalLM,
        AutoModelForSequenceClassification: gpt.LinearGPTForSequenceClassification,
    },
    vit.LinearViTConfig: {
        AutoModel: vit.LinearViTModel,
        AutoModelForImageClassification: vit.LinearViTForImageClassification,
    },
}


def register_all():
    for config_class, models in FAMILIES.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for auto_class, model_class in models.items():
            auto_class.register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_class.__name__)
