"""The attention fields shared by LinearRobertaConfig, LinearGPTConfig and LinearViTConfig.

The values are validated by ``AttentionOptions`` (one place for every rule); ``causal``, ``position_dims`` and
``max_positions`` follow from the model family and are not config fields.
"""

from transformers import PreTrainedConfig

from .attention_options import ABSOLUTE_POSITION_EMBEDDINGS, AttentionOptions


class LinearAttentionConfig(PreTrainedConfig):
    """Base class: the positional encoding, feature map and attention options of every layer.

    Args:
        positional_encoding: one of ``lrpe_hf.POSITIONAL_ENCODINGS``.
        absolute_position_embedding: ``none``, ``sinusoidal`` or ``learned``, added to the input embeddings.
        feature_map: one of ``lrpe_hf.FEATURE_MAPS`` (linear attention; default ``elu``).
        attention: ``linear`` or ``softmax`` (the quadratic baseline).
        normalization: ``denominator``, ``unrotated_denominator`` or ``output_norm`` (default per encoding).
        The other fields are those of ``lrpe_hf.AttentionOptions`` (chunk size, LRPE, PermuteFormer, SPE,
        Performer, DPFP and FastRPB options).
    """

    positional_encoding: str = "lrpe_orthogonal"
    absolute_position_embedding: str = "none"
    feature_map: str | None = None
    attention: str = "linear"
    normalization: str | None = None
    chunk_size: int | None = None
    attention_eps: float = 1e-6
    relu_eps: float = 1e-3
    dpfp_nu: int = 1
    performer_features: int | None = None
    performer_redraw: bool = False
    rope_base: float = 10000.0
    lrpe_p_matrix: str = "householder"
    lrpe_learnable_p: bool = False
    lrpe_learnable_angles: bool = True
    permute_decay: float | None = None
    spe_realizations: int = 32
    spe_sines: int = 1
    spe_kernel_size: int = 64
    spe_gated: bool = True
    spe_seed: int = 0
    fastrpb_init_std: float = 0.0

    # Set by each family.
    is_causal_model = False
    position_dims = 1

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.absolute_position_embedding not in ABSOLUTE_POSITION_EMBEDDINGS:
            raise ValueError(
                f"Unknown absolute_position_embedding {self.absolute_position_embedding!r}; valid values: "
                f"{', '.join(ABSOLUTE_POSITION_EMBEDDINGS)}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        self.attention_options()  # raises ValueError on any invalid value or combination

    @property
    def max_relative_positions(self) -> int:
        """The span FastRPB learns biases for (per axis in 2D)."""
        return self.max_position_embeddings

    def attention_options(self) -> AttentionOptions:
        return AttentionOptions(
            positional_encoding=self.positional_encoding,
            feature_map=self.feature_map,
            attention=self.attention,
            normalization=self.normalization,
            causal=self.is_causal_model,
            position_dims=self.position_dims,
            max_positions=self.max_relative_positions,
            chunk_size=self.chunk_size,
            eps=self.attention_eps,
            relu_eps=self.relu_eps,
            dpfp_nu=self.dpfp_nu,
            performer_features=self.performer_features,
            performer_redraw=self.performer_redraw,
            rope_base=self.rope_base,
            lrpe_p_matrix=self.lrpe_p_matrix,
            lrpe_learnable_p=self.lrpe_learnable_p,
            lrpe_learnable_angles=self.lrpe_learnable_angles,
            permute_decay=self.permute_decay,
            spe_realizations=self.spe_realizations,
            spe_sines=self.spe_sines,
            spe_kernel_size=self.spe_kernel_size,
            spe_gated=self.spe_gated,
            spe_seed=self.spe_seed,
            fastrpb_init_std=self.fastrpb_init_std,
        )
