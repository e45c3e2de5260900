"""Registries of positional encodings, kernel feature maps and LRPE P matrices: the one place that maps a name
to a builder and to the facts the rest of the library needs about it.

The built-in components register at the bottom of this file through the same public functions a user calls::

    register_positional_encoding("alibi", builder, default_normalization="denominator")
    register_feature_map("squared_relu", builder)

Builders:
- a positional encoding: ``builder(options, num_heads, head_dim, feature_dim) -> PositionalEncoding``, where
  ``feature_dim`` is the width of the features it transforms (the feature map's output for linear attention,
  the query/key width for softmax attention);
- a feature map: ``builder(options, input_dim) -> FeatureMap``;
- an LRPE P matrix: ``builder(num_heads, dim, learnable) -> nn.Module`` acting on the last dimension.
"""

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .feature_maps import (
    DPFPFeatureMap,
    EluFeatureMap,
    ExpFeatureMap,
    HedgehogFeatureMap,
    PerformerFeatureMap,
    ReluFeatureMap,
    T2RFeatureMap,
)
from .positional_encoding import NoPositionalEncoding
from .positional_fastrpb import FastRelativePositionBias
from .positional_lrpe import (
    DCTMatrix,
    HouseholderReflection,
    LRPEOrthogonal,
    LRPEPermutation,
    LRPEUnitary,
    OddEvenPermutation,
)
from .positional_permute import PermutePositionalEncoding
from .positional_rope import RotaryPositionalEncoding
from .positional_spe import ConvSPECodes, SineSPECodes, StochasticPositionalEncoding
from .reinitialisable import refuse_unrestorable_buffers

NORMALIZATIONS = ("denominator", "unrotated_denominator", "output_norm", "output_layer_norm")


@dataclass(frozen=True)
class PositionalEncodingEntry:
    """A registered positional encoding.

    Attributes:
        builder: ``builder(options, num_heads, head_dim, feature_dim) -> PositionalEncoding``.
        signed_features: its transformed features can be negative (rotations), so the plain ``denominator``
            normalisation is refused: it could vanish.
        default_normalization: the normalisation used when the config leaves it unset.
        needs_max_positions: it learns one weight per relative distance up to ``max_positions``.
        build_shared: ``build_shared(options, num_heads, head_dim)`` -> a module that every layer of a model
            shares (SPE's kernels), with ``draw(device)`` and ``prepare(draw, positions)``; ``None`` if none.
        supports_2d: it has a form for (row, col) positions of image patches (declared by its registration;
            LinearViT refuses an encoding without one rather than hand it 2D positions).
        query_key_dim: ``query_key_dim(options, head_dim)``, the width of queries and keys after
            ``encode_query_key`` when the encoding changes it (SPE: its number of realizations); ``None``: head_dim.
        default_feature_map: the feature map its paper pairs it with, used when ``feature_map`` is not set.
        causal_only: it weighs keys by how far back they are (a ``log_decay``), so a bidirectional config
            (LinearRoberta, LinearViT) is refused when built.
        relative: the attention depends on positions only through their differences, exactly (shifting every
            position changes nothing); SPE's random codes are relative in expectation only.
    """

    builder: Callable
    signed_features: bool = False
    default_normalization: str = "denominator"
    needs_max_positions: bool = False
    build_shared: Callable | None = None
    supports_2d: bool = False
    query_key_dim: Callable | None = None
    default_feature_map: str = "elu"
    causal_only: bool = False
    relative: bool = True

    def width_of_queries_and_keys(self, options, head_dim: int) -> int:
        return self.query_key_dim(options, head_dim) if self.query_key_dim else head_dim


@dataclass(frozen=True)
class FeatureMapEntry:
    """A registered feature map: ``builder(options, input_dim) -> FeatureMap``; ``positive``: every feature is
    strictly positive, so the unrotated denominator <phi(q_s), sum_t phi(k_t)> cannot vanish while the rotated
    numerator does not (maps that can be exactly zero, as t2r's and dpfp's, are not); a bool, or a function of
    the options (relu is positive only with relu_eps > 0)."""

    builder: Callable
    positive: bool | Callable = False

    def is_positive(self, options) -> bool:
        return self.positive(options) if callable(self.positive) else self.positive


POSITIONAL_ENCODING_REGISTRY: dict[str, PositionalEncodingEntry] = {}
FEATURE_MAP_REGISTRY: dict[str, FeatureMapEntry] = {}
P_MATRIX_REGISTRY: dict[str, Callable] = {}


class RegisteredNames:
    """A live, read-only tuple-like view of a registry's names, in registration order."""

    def __init__(self, registry: dict):
        self._registry = registry

    def __iter__(self):
        return iter(tuple(self._registry))

    def __len__(self):
        return len(self._registry)

    def __getitem__(self, index):
        return tuple(self._registry)[index]

    def __contains__(self, name):
        return name in self._registry

    def __eq__(self, other):
        return tuple(self) == tuple(other)

    def __repr__(self):
        return repr(tuple(self))


POSITIONAL_ENCODINGS = RegisteredNames(POSITIONAL_ENCODING_REGISTRY)
FEATURE_MAPS = RegisteredNames(FEATURE_MAP_REGISTRY)
LRPE_P_MATRICES = RegisteredNames(P_MATRIX_REGISTRY)


def _check_new_name(kind: str, name: str, registry: dict, overwrite: bool):
    if not isinstance(name, str) or not name:
        raise ValueError(f"A {kind} name must be a non-empty string, got {name!r}")
    if name in registry and not overwrite:
        raise ValueError(f"{kind} {name!r} is already registered; pass overwrite=True to replace it")


def register_positional_encoding(
    name: str,
    builder: Callable,
    *,
    signed_features: bool = False,
    default_normalization: str | None = None,
    needs_max_positions: bool = False,
    build_shared: Callable | None = None,
    supports_2d: bool = False,
    query_key_dim: Callable | None = None,
    default_feature_map: str = "elu",
    causal_only: bool = False,
    relative: bool = True,
    overwrite: bool = False,
):
    """Make ``positional_encoding=name`` available to every config, layer and model family.

    ``builder(options, num_heads, head_dim, feature_dim)`` returns a ``PositionalEncoding``. The default
    normalisation is ``unrotated_denominator`` for encodings with signed features and ``denominator`` otherwise;
    ``default_feature_map`` is used when a config leaves ``feature_map`` unset; ``supports_2d=True`` declares a form
    for (row, col) positions (LinearViT takes no other); ``causal_only=True`` (an encoding that
    decays with distance) makes bidirectional configs refuse it when built; ``relative=False`` says that shifting
    every position changes its attention (the tests check the shift for the others).
    """
    _check_new_name("positional encoding", name, POSITIONAL_ENCODING_REGISTRY, overwrite)
    if default_normalization is None:
        default_normalization = "unrotated_denominator" if signed_features else "denominator"
    if default_normalization not in NORMALIZATIONS:
        raise ValueError(f"default_normalization {default_normalization!r} is not one of {', '.join(NORMALIZATIONS)}")
    if signed_features and default_normalization == "denominator":
        raise ValueError(f"{name!r} has signed features: its default normalisation cannot be 'denominator'")
    POSITIONAL_ENCODING_REGISTRY[name] = PositionalEncodingEntry(
        builder,
        signed_features,
        default_normalization,
        needs_max_positions,
        build_shared,
        supports_2d,
        query_key_dim,
        default_feature_map,
        causal_only,
        relative,
    )


def register_feature_map(name: str, builder: Callable, *, positive: bool | Callable = False, overwrite: bool = False):
    """Make ``feature_map=name`` available; ``builder(options, input_dim)`` returns a ``FeatureMap``.
    ``positive=True`` declares every feature strictly positive (see ``FeatureMapEntry``)."""
    _check_new_name("feature map", name, FEATURE_MAP_REGISTRY, overwrite)
    FEATURE_MAP_REGISTRY[name] = FeatureMapEntry(builder, positive)


def register_lrpe_p_matrix(name: str, builder: Callable, *, overwrite: bool = False):
    """Make ``lrpe_p_matrix=name`` available; ``builder(num_heads, dim, learnable)`` returns a module."""
    _check_new_name("LRPE P matrix", name, P_MATRIX_REGISTRY, overwrite)
    P_MATRIX_REGISTRY[name] = builder


def lookup(kind: str, name: str, registry: dict):
    """The entry for ``name``, or a ValueError listing the registered names."""
    if name not in registry:
        raise ValueError(
            f"Unknown {kind} {name!r}; valid values: {', '.join(registry)} (custom ones must be registered, in every "
            f"process, before a config or model that uses them is built or loaded)"
        )
    return registry[name]


def positional_encoding_entry(name: str) -> PositionalEncodingEntry:
    return lookup("positional_encoding", name, POSITIONAL_ENCODING_REGISTRY)


def build_positional_encoding(options, num_heads: int, head_dim: int, feature_dim: int):
    encoding = positional_encoding_entry(options.positional_encoding).builder(options, num_heads, head_dim, feature_dim)
    refuse_unrestorable_buffers(encoding, f"positional_encoding {options.positional_encoding!r}")
    return encoding


def build_shared_codes(options, num_heads: int, head_dim: int):
    """The module every layer of a model shares for its encoding (SPE's codes), or None where it has none."""
    build_shared = positional_encoding_entry(options.positional_encoding).build_shared
    if build_shared is None:
        return None
    shared = build_shared(options, num_heads, head_dim)
    refuse_unrestorable_buffers(shared, f"positional_encoding {options.positional_encoding!r}'s shared module")
    return shared


def build_feature_map(options, input_dim: int):
    feature_map = lookup("feature_map", options.feature_map, FEATURE_MAP_REGISTRY).builder(options, input_dim)
    refuse_unrestorable_buffers(feature_map, f"feature_map {options.feature_map!r}")
    return feature_map


def build_p_matrix(options, num_heads: int, dim: int):
    builder = lookup("lrpe_p_matrix", options.lrpe_p_matrix, P_MATRIX_REGISTRY)
    return builder(num_heads, dim, options.lrpe_learnable_p)


# ---------------------------------------------------------------- the built-in components
register_feature_map("elu", lambda options, dim: EluFeatureMap(dim), positive=True)
register_feature_map(
    "relu", lambda options, dim: ReluFeatureMap(dim, options.relu_eps), positive=lambda options: options.relu_eps > 0
)
register_feature_map("exp", lambda options, dim: ExpFeatureMap(dim), positive=True)
register_feature_map("dpfp", lambda options, dim: DPFPFeatureMap(dim, options.dpfp_nu))
register_feature_map(
    "performer",
    lambda options, dim: PerformerFeatureMap(
        dim, options.performer_features, options.performer_redraw, options.performer_seed * 1000 + options.layer_index
    ),
    positive=True,
)

register_feature_map("hedgehog", lambda options, dim: HedgehogFeatureMap(dim, options.num_heads), positive=True)
register_feature_map("t2r", lambda options, dim: T2RFeatureMap(dim, options.num_heads, options.t2r_features))

register_lrpe_p_matrix("householder", HouseholderReflection)
register_lrpe_p_matrix("identity", lambda num_heads, dim, learnable: nn.Identity())
register_lrpe_p_matrix("odd_even", lambda num_heads, dim, learnable: OddEvenPermutation(dim))
register_lrpe_p_matrix("dct", lambda num_heads, dim, learnable: DCTMatrix(dim))


def spe_width(options, head_dim):
    return options.spe_realizations


register_positional_encoding(
    "none", lambda options, num_heads, head_dim, feature_dim: NoPositionalEncoding(), supports_2d=True
)
register_positional_encoding("rope", RotaryPositionalEncoding.from_options, signed_features=True, supports_2d=True)
register_positional_encoding(
    "lrpe_unitary",
    lambda o, h, d, m: LRPEUnitary.from_options(o, h, d, m, build_p_matrix(o, h, m)),
    signed_features=True,
    supports_2d=True,
)
register_positional_encoding(
    "lrpe_orthogonal",
    lambda o, h, d, m: LRPEOrthogonal.from_options(o, h, d, m, build_p_matrix(o, h, m)),
    signed_features=True,
    supports_2d=True,
)
register_positional_encoding(
    "lrpe_permutation",
    lambda o, h, d, m: LRPEPermutation.from_options(o, h, d, m, build_p_matrix(o, h, m)),
    signed_features=True,
    supports_2d=True,
)
register_positional_encoding(  # relu: its eq. 15
    "permute", PermutePositionalEncoding.from_options, default_feature_map="relu", supports_2d=True
)
register_positional_encoding(
    "spe_sine",
    StochasticPositionalEncoding.from_options,
    build_shared=SineSPECodes.from_options,
    query_key_dim=spe_width,
    supports_2d=True,
    relative=False,  # in expectation over its random codes only
)
register_positional_encoding(
    "spe_conv",
    StochasticPositionalEncoding.from_options,
    build_shared=ConvSPECodes.from_options,
    query_key_dim=spe_width,
    supports_2d=True,
    relative=False,  # in expectation over its random codes only
)
register_positional_encoding(  # with its paper's shift-invariant kernel, SIKF
    "fastrpb",
    FastRelativePositionBias.from_options,
    needs_max_positions=True,
    default_feature_map="exp",
    supports_2d=True,
)
