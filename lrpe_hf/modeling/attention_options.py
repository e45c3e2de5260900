"""Every option of the attention layer, defined once and validated in one place.

The three model configs take their attention fields from this dataclass (``config_fields()``): the fields whose
metadata says ``per_family`` (``causal``, ``position_dims``, ``max_positions``) follow from the model family
instead, and ``eps`` is called ``attention_eps`` in a config.
"""

from dataclasses import asdict, dataclass, field, fields

from .products_dispatch import kernel_backends
from .registry import (
    FEATURE_MAP_REGISTRY,
    NORMALIZATIONS,
    P_MATRIX_REGISTRY,
    POSITIONAL_ENCODING_REGISTRY,
    lookup,
    positional_encoding_entry,
)

ABSOLUTE_POSITION_EMBEDDINGS = ("none", "sinusoidal", "learned")
ATTENTION_KINDS = ("linear", "softmax")
WINDOW_NORMALIZATIONS = ("denominator", "unrotated_denominator")  # those local_window can share (local_window.py)


def option(default, help: str, **metadata):
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class AttentionOptions:
    """Every option of :class:`LinearAttention` besides its size. ``None`` means "the default for this encoding"."""

    positional_encoding: str = option("none", "a registered positional encoding (lrpe_hf.POSITIONAL_ENCODINGS)")
    feature_map: str | None = option(
        None,
        "linear attention's kernel feature map (lrpe_hf.FEATURE_MAPS); default: the encoding's paper's (elu; "
        "relu for permute, exp for fastrpb)",
    )
    attention: str = option("linear", "linear, or softmax (the quadratic baseline)")
    normalization: str | None = option(
        None,
        "denominator, unrotated_denominator, output_norm or output_layer_norm (linear attention); default per encoding",
    )
    causal: bool = option(False, "attend to past tokens only", per_family=True)
    position_dims: int = option(1, "1 for sequences, 2 for image patches carrying (row, col)", per_family=True)
    max_positions: int | None = option(None, "fastrpb: the longest span of positions (per axis in 2D)", per_family=True)
    layer_index: int = option(0, "the layer's place in its model: random tables differ per layer", per_family=True)
    num_heads: int | None = option(None, "the layer's number of heads (set by the layer)", per_family=True)
    chunk_size: int | None = option(None, "causal chunk length; default 64 at every length")
    kernel_backend: str = option(
        "auto",
        "the causal product's kernels: auto (Triton kernels of fla-core for CUDA tensors where installed and able, "
        "else torch), torch, or triton (raises where it cannot run)",
    )
    local_window: int = option(
        0,
        "exact softmax over each token's W nearest tokens (causal: the W latest up to itself; bidirectional: those "
        "less than W tokens away) and linear attention beyond, under one normaliser with a learned factor per head "
        "(linear attention only, 1D; needs normalization denominator or unrotated_denominator); 0: off",
    )
    eps: float = option(
        1e-6,
        "added to denominators (and to the output norm's mean square), on the unstabilised scale",
        config_name="attention_eps",
    )
    relu_eps: float = option(1e-3, "relu feature map: phi(x) = relu(x) + relu_eps")
    dpfp_nu: int = option(1, "dpfp feature map: number of rolls (width 2 D nu)")
    performer_features: int | None = option(None, "performer feature map: number of random features (default D)")
    performer_redraw: bool = option(False, "performer: redraw the random features at every training step")
    performer_seed: int = option(0, "performer: seed of the initial random features")
    t2r_features: int | None = option(None, "t2r feature map: number of learned ReLU features (default D)")
    rope_base: float = option(10000.0, "rope and lrpe_*: frequencies (initial angles) base^(-2i/m)")
    lrpe_p_matrix: str = option("householder", "LRPE's P: a registered P matrix (lrpe_hf.LRPE_P_MATRICES)")
    lrpe_learnable_p: bool = option(False, "LRPE: learn P (the Householder vector)")
    lrpe_learnable_angles: bool = option(True, "LRPE: learn the angles (Types 1 and 2)")
    permute_decay: float | None = option(None, "permute: decay r in (0, 1]; causal default per head 0.88..0.99")
    permute_seed: int = option(0, "permute and lrpe_permutation: seed of the per-head random permutations")
    spe_realizations: int = option(32, "SPE: number of realizations R (query/key width)")
    spe_sines: int = option(10, "spe_sine: number of sines K per dimension (the paper's K = 10)")
    spe_kernel_size: int = option(128, "spe_conv: filter length (the paper's 128)")
    spe_gated: bool = option(True, "SPE: learnable gates between the positional and a position-free code")
    spe_seed: int = option(0, "SPE: seed of the evaluation-mode draw")
    fastrpb_init_std: float = option(0.0, "fastrpb: standard deviation of the initial bias weights")

    def __post_init__(self):
        """Every rule, in one place. Raises ValueError naming what is wrong and what is valid."""
        encoding = positional_encoding_entry(self.positional_encoding)
        self._choice("attention", self.attention, ATTENTION_KINDS)
        lookup("lrpe_p_matrix", self.lrpe_p_matrix, P_MATRIX_REGISTRY)
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
            self._set_feature_map_and_normalization(encoding)
        if encoding.causal_only and not self.causal:
            raise ValueError(
                f"{self.positional_encoding!r} decays with distance: it is for causal attention only (LinearGPT, or "
                "LinearAttention(causal=True)); bidirectional models (LinearRoberta, LinearViT) cannot use it"
            )
        if self.position_dims == 2:
            if self.causal:
                raise ValueError("position_dims=2 (image patches) has no causal order; use causal=False")
            if not encoding.supports_2d:
                raise ValueError(
                    f"{self.positional_encoding!r} has no 2D form for image patches' (row, col) positions (its "
                    "registration did not declare supports_2d=True)"
                )
        if encoding.needs_max_positions and not self.max_positions:
            raise ValueError(
                f"{self.positional_encoding} needs max_positions: it learns one bias per relative distance up to "
                "that span"
            )
        if self.permute_decay is not None:
            if not 0.0 < self.permute_decay <= 1.0:
                raise ValueError(f"permute_decay must be in (0, 1], got {self.permute_decay}")
            if self.permute_decay < 1.0 and not self.causal:
                raise ValueError("permute_decay < 1 is for causal models (PermuteFormer uses r = 1 bidirectionally)")
        self._choice("kernel_backend", self.kernel_backend, kernel_backends())
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer (or None for automatic), got {self.chunk_size}")
        for name in ("spe_realizations", "spe_sines", "spe_kernel_size"):  # dpfp_nu and performer_features: their maps
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.eps <= 0 or self.relu_eps < 0:
            raise ValueError("eps must be > 0 and relu_eps >= 0")
        self._check_local_window()

    def _check_local_window(self):
        """``local_window``: a whole number >= 0; where it is on, linear attention over 1D sequences with a
        normalisation whose denominator the window can share."""
        window = self.local_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"local_window must be a whole number of tokens >= 0 (0: off), got {window!r}")
        if window == 0:
            return
        if self.attention != "linear":
            raise ValueError(
                "local_window mixes exact softmax nearby with linear attention beyond: it needs attention='linear' "
                "(attention='softmax' attends to every token exactly already)"
            )
        if self.position_dims != 1:
            raise ValueError(
                "local_window counts the nearest tokens along a sequence; image patches' (row, col) positions have no "
                "such order, and a 2D window (patches within W rows and columns) is not implemented: use "
                "local_window=0 with position_dims=2 (LinearViT)"
            )
        if self.normalization not in WINDOW_NORMALIZATIONS:
            positive = [name for name, entry in FEATURE_MAP_REGISTRY.items() if entry.is_positive(self)]
            raise ValueError(
                f"local_window shares one normaliser between its softmax and linear parts: it needs normalization "
                f"{' or '.join(WINDOW_NORMALIZATIONS)}, got {self.normalization!r}, which has no denominator to "
                "share. (Signed encodings, rope and lrpe_*, take only the output norms with a feature map whose "
                f"features can be exactly zero: use a strictly positive one, {', '.join(positive)}.)"
            )

    def _set_feature_map_and_normalization(self, encoding):
        """Linear attention: the feature map (the encoding's paper's by default) and a normalisation that cannot
        vanish with it (the encoding's default, or the output LayerNorm where the map's features can be 0)."""
        self.feature_map = self.feature_map or encoding.default_feature_map
        positive = lookup("feature_map", self.feature_map, FEATURE_MAP_REGISTRY).is_positive(self)
        default = encoding.default_normalization
        if default == "unrotated_denominator" and not positive:
            default = "output_layer_norm"  # the unrotated denominator could vanish (below)
        self.normalization = self.normalization or default
        self._choice("normalization", self.normalization, NORMALIZATIONS)
        pe = self.positional_encoding
        if self.normalization == "unrotated_denominator" and not positive:
            raise ValueError(
                f"normalization='unrotated_denominator' is invalid with feature_map={self.feature_map!r}: its "
                "features can be exactly zero, so a query whose features share no support with its keys' gets "
                "a zero denominator under a non-zero rotated numerator (outputs of 1/eps); use "
                "'output_layer_norm' (its default here) or 'output_norm', or a strictly positive map"
            )
        if self.normalization == "denominator" and encoding.signed_features:
            raise ValueError(
                f"normalization='denominator' is invalid with {pe!r}: its rotated features can be negative, so the "
                "denominator can vanish; use 'unrotated_denominator' or 'output_norm'"
            )
        if self.normalization == "unrotated_denominator" and not encoding.signed_features:
            signed = [name for name, entry in POSITIONAL_ENCODING_REGISTRY.items() if entry.signed_features]
            raise ValueError(
                f"normalization='unrotated_denominator' is meant for {', '.join(signed)}; "
                f"with {pe!r} use 'denominator' or 'output_norm'"
            )

    @staticmethod
    def _choice(name, value, valid):
        if value not in valid:
            raise ValueError(f"Unknown {name} {value!r}; valid values: {', '.join(map(str, valid))}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def config_fields(cls):
        """(config name, option name, dataclass field) of every option a model config carries."""
        return [
            (f.metadata.get("config_name", f.name), f.name, f) for f in fields(cls) if not f.metadata.get("per_family")
        ]
