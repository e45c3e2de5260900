"""lrpe-hf: linear-attention transformers with relative positional encodings for Hugging Face Transformers."""

from .modeling.attention_options import (
    ABSOLUTE_POSITION_EMBEDDINGS,
    NORMALIZATIONS,
    POSITIONAL_ENCODINGS,
    AttentionOptions,
)
from .modeling.cache import LinearAttentionCache
from .modeling.configuration_linear_attention import LinearAttentionConfig
from .modeling.configuration_linear_gpt import LinearGPTConfig
from .modeling.configuration_linear_roberta import LinearRobertaConfig
from .modeling.configuration_linear_vit import LinearViTConfig
from .modeling.feature_maps import FEATURE_MAPS, build_feature_map
from .modeling.linear_attention import LinearAttention, LinearAttentionState, build_spe_codes
from .modeling.modeling_linear_gpt import (
    LinearGPTForCausalLM,
    LinearGPTForSequenceClassification,
    LinearGPTModel,
    LinearGPTPreTrainedModel,
)
from .modeling.modeling_linear_roberta import (
    LinearRobertaForMaskedLM,
    LinearRobertaForQuestionAnswering,
    LinearRobertaForSequenceClassification,
    LinearRobertaForTokenClassification,
    LinearRobertaModel,
    LinearRobertaPreTrainedModel,
)
from .modeling.modeling_linear_vit import LinearViTForImageClassification, LinearViTModel, LinearViTPreTrainedModel
from .modeling.positional_absolute import LearnedPositionEmbedding, SinusoidalPositionEmbedding
from .registration import register_all

register_all()

__all__ = [
    "ABSOLUTE_POSITION_EMBEDDINGS",
    "FEATURE_MAPS",
    "NORMALIZATIONS",
    "POSITIONAL_ENCODINGS",
    "AttentionOptions",
    "LinearAttentionCache",
    "LinearAttentionConfig",
    "LinearGPTConfig",
    "LinearGPTForCausalLM",
    "LinearGPTForSequenceClassification",
    "LinearGPTModel",
    "LinearGPTPreTrainedModel",
    "LinearRobertaConfig",
    "LinearRobertaForMaskedLM",
    "LinearRobertaForQuestionAnswering",
    "LinearRobertaForSequenceClassification",
    "LinearRobertaForTokenClassification",
    "LinearRobertaModel",
    "LinearRobertaPreTrainedModel",
    "LinearViTConfig",
    "LinearViTForImageClassification",
    "LinearViTModel",
    "LinearViTPreTrainedModel",
    "LearnedPositionEmbedding",
    "LinearAttention",
    "LinearAttentionState",
    "SinusoidalPositionEmbedding",
    "build_feature_map",
    "build_spe_codes",
]
