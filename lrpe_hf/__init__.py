"""lrpe-hf: linear-attention transformers with relative positional encodings for Hugging Face Transformers."""

import importlib.metadata

from .linearize import attention_transfer_loss, linearize
from .linearize import transfer_parameters as linearize_transfer_parameters
from .modeling.attention_options import ABSOLUTE_POSITION_EMBEDDINGS, AttentionOptions
from .modeling.attention_state import LinearAttentionState
from .modeling.cache import LinearAttentionCache
from .modeling.configuration_linear_attention import LinearAttentionConfig
from .modeling.configuration_linear_gpt import LinearGPTConfig
from .modeling.configuration_linear_roberta import LinearRobertaConfig
from .modeling.configuration_linear_vit import LinearViTConfig
from .modeling.context_parallel import context_parallel
from .modeling.feature_maps import ExponentialFeatureMap, FeatureMap
from .modeling.linear_attention import LinearAttention
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
from .modeling.positional_encoding import PositionalEncoding
from .modeling.registry import (
    FEATURE_MAPS,
    LRPE_P_MATRICES,
    NORMALIZATIONS,
    POSITIONAL_ENCODINGS,
    register_feature_map,
    register_lrpe_p_matrix,
    register_positional_encoding,
)
from .registration import register_all

register_all()

try:
    __version__ = importlib.metadata.version("lrpe-hf")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"

__all__ = [
    "__version__",
    "ABSOLUTE_POSITION_EMBEDDINGS",
    "FEATURE_MAPS",
    "LRPE_P_MATRICES",
    "NORMALIZATIONS",
    "POSITIONAL_ENCODINGS",
    "AttentionOptions",
    "ExponentialFeatureMap",
    "FeatureMap",
    "LearnedPositionEmbedding",
    "LinearAttention",
    "LinearAttentionCache",
    "LinearAttentionConfig",
    "LinearAttentionState",
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
    "PositionalEncoding",
    "SinusoidalPositionEmbedding",
    "attention_transfer_loss",
    "context_parallel",
    "linearize",
    "linearize_transfer_parameters",
    "register_feature_map",
    "register_lrpe_p_matrix",
    "register_positional_encoding",
]
