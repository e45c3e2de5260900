"""lrpe-hf: linear-attention transformers with relative positional encodings for Hugging Face Transformers."""

from .modeling.attention_options import (
    ABSOLUTE_POSITION_EMBEDDINGS,
    NORMALIZATIONS,
    POSITIONAL_ENCODINGS,
    AttentionOptions,
)
from .modeling.feature_maps import FEATURE_MAPS, build_feature_map
from .modeling.linear_attention import LinearAttention, LinearAttentionState, build_spe_codes
from .modeling.positional_absolute import LearnedPositionEmbedding, SinusoidalPositionEmbedding

__all__ = [
    "ABSOLUTE_POSITION_EMBEDDINGS",
    "FEATURE_MAPS",
    "NORMALIZATIONS",
    "POSITIONAL_ENCODINGS",
    "AttentionOptions",
    "LearnedPositionEmbedding",
    "LinearAttention",
    "LinearAttentionState",
    "SinusoidalPositionEmbedding",
    "build_feature_map",
    "build_spe_codes",
]
