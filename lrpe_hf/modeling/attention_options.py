"""The attention fields shared by the layer and the three model configs, validated in one place."""

from dataclasses import asdict, dataclass, fields

from .feature_maps import FEATURE_MAPS

POSITIONAL_ENCODINGS = (
    "none",
    "rope",
    "lrpe_unitary",
    "lrpe_orthogonal",
    "lrpe_permutation",
    "permute",
    "spe_sine",
    "spe_conv",
    "fastrpb",
)
ABSOLUTE_POSITION_EMBEDDINGS = ("none", "sinusoidal", "learned")
ATTENTION_KINDS = ("linear", "softmax")
NORMALIZATIONS = ("denominator", "unrotated_denominator", "output_norm")
LRPE_P_MATRICES = ("householder", "identity", "odd_even", "dct")

# Encodings whose transformed features can be negative (rotations): a plain denominator could vanish.
SIGNED_FEATURE_ENCODINGS = ("rope", "lrpe_unitary", "lrpe_orthogonal", "lrpe_permutation")
TWO_D_ENCODINGS = ("none",) + SIGNED_FEATURE_ENCODINGS + ("permute", "spe_sine", "spe_conv", "fastrpb")


def default_normalization(positional_encoding: str) -> str:
    """RoFormer eq. 19 for rope, the LRPE authors' output norm for lrpe_*, a plain denominator otherwise."""
    if positional_encoding == "rope":
        return "unrotated_denominator"
    if positional_encoding.startswith("lrpe_"):
        return "output_norm"
    return "denominator"


def _choice(name, value, valid):
    if value not in valid:
        raise ValueError(f"Unknown {name} {value!r}; valid values: {', '.join(map(str, valid))}")


@dataclass
class AttentionOptions:
    """Every option of :class:`LinearAttention` besides its size. ``None`` means "the default for this encoding"."""

    positional_encoding: str = "none"
    feature_map: str | None = None  # linear attention only; default "elu"
    attention: str = "linear"
    normalization: str | None = None  # linear attention only; default from default_normalization()
    causal: bool = False
    position_dims: int = 1  # 2 for image patches carrying (row, col)
    max_positions: int | None = None  # fastrpb: the longest span of positions (per axis in 2D)
    chunk_size: int | None = None  # causal chunk length; None: 64 up to 8k tokens, 128 beyond (measured on CPU)
    eps: float = 1e-6  # added to denominators
    relu_eps: float = 1e-3
    dpfp_nu: int = 1
    performer_features: int | None = None  # default: head_dim
    performer_redraw: bool = False
    rope_base: float = 10000.0
    lrpe_p_matrix: str = "householder"
    lrpe_learnable_p: bool = False
    lrpe_learnable_angles: bool = True
    permute_decay: float | None = None  # causal default: per-head r spread over [0.88, 0.99]
    spe_realizations: int = 32
    spe_sines: int = 1
    spe_kernel_size: int = 64
    spe_gated: bool = True
    spe_seed: int = 0
    fastrpb_init_std: float = 0.0

    def __post_init__(self):
        _choice("positional_encoding", self.positional_encoding, POSITIONAL_ENCODINGS)
        _choice("attention", self.attention, ATTENTION_KINDS)
        _choice("lrpe_p_matrix", self.lrpe_p_matrix, LRPE_P_MATRICES)
        if self.position_dims not in (1, 2):
            raise ValueError(f"position_dims must be 1 (sequences) or 2 (image patches), got {self.position_dims}")
        if self.attention == "softmax":
            if self.feature_map is not None:
                raise ValueError(
                    "feature_map applies to linear attention only; leave it unset with attention='softmax'"
                )
            if self.normalization is not None:
                raise ValueError("normalization applies to linear attention only; softmax normalises by itself")
        else:
            self.feature_map = self.feature_map or "elu"
            _choice("feature_map", self.feature_map, FEATURE_MAPS)
            self.normalization = self.normalization or default_normalization(self.positional_encoding)
            _choice("normalization", self.normalization, NORMALIZATIONS)
            pe = self.positional_encoding
            if self.normalization == "denominator" and pe in SIGNED_FEATURE_ENCODINGS:
                raise ValueError(
                    f"normalization='denominator' is invalid with {pe!r}: its rotated features can be negative, so the "
                    "denominator can vanish; use 'unrotated_denominator' or 'output_norm'"
                )
            if self.normalization == "unrotated_denominator" and pe not in SIGNED_FEATURE_ENCODINGS:
                raise ValueError(
                    f"normalization='unrotated_denominator' is meant for {', '.join(SIGNED_FEATURE_ENCODINGS)}; "
                    f"with {pe!r} use 'denominator' or 'output_norm'"
                )
        if self.position_dims == 2:
            if self.causal:
                raise ValueError("position_dims=2 (image patches) has no causal order; use causal=False")
            if self.positional_encoding not in TWO_D_ENCODINGS:
                raise ValueError(f"{self.positional_encoding!r} has no 2D form")
        if self.positional_encoding == "fastrpb" and not self.max_positions:
            raise ValueError("fastrpb needs max_positions: it learns one bias per relative distance up to that span")
        if self.permute_decay is not None:
            if not 0.0 < self.permute_decay <= 1.0:
                raise ValueError(f"permute_decay must be in (0, 1], got {self.permute_decay}")
            if self.permute_decay < 1.0 and not self.causal:
                raise ValueError("permute_decay < 1 is for causal models (PermuteFormer uses r = 1 bidirectionally)")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer (or None for automatic), got {self.chunk_size}")
        for name in ("dpfp_nu", "spe_realizations", "spe_sines", "spe_kernel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.performer_features is not None and self.performer_features < 1:
            raise ValueError(f"performer_features must be a positive integer, got {self.performer_features}")
        if self.eps <= 0 or self.relu_eps < 0:
            raise ValueError("eps must be > 0 and relu_eps >= 0")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
