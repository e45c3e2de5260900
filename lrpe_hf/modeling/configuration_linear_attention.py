"""The attention fields shared by LinearRobertaConfig, LinearGPTConfig and LinearViTConfig.

The fields are those of ``AttentionOptions`` (its ``config_fields()``: same names, types and defaults; ``eps`` is
``attention_eps``), so each option is defined once. ``causal``, ``position_dims`` and ``max_positions`` follow
from the model family and are not config fields. Validation is ``AttentionOptions``'s, run when the config is
built.
"""

import difflib
from dataclasses import field, make_dataclass

from transformers import PreTrainedConfig

from .attention_options import ABSOLUTE_POSITION_EMBEDDINGS, AttentionOptions

AttentionConfigFields = make_dataclass(
    "AttentionConfigFields",
    [(name, option.type, field(default=option.default)) for name, _, option in AttentionOptions.config_fields()],
    kw_only=True,
)


# The config fields only this library has besides the attention options (the typo check matches these).
OWN_FIELDS = ("positional_encoding", "absolute_position_embedding", "embedding_multiplier")

# Sizes a model is built from, where a family's config has them: each a whole number of at least 1.
SIZE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "max_position_embeddings", "type_vocab_size", "image_size", "patch_size", "num_channels",
)  # fmt: skip

# Dropout probabilities, where a family's config has them: each a number in [0, 1] (classifier_dropout may be None).
PROBABILITY_FIELDS = ("hidden_dropout_prob", "classifier_dropout")


class LinearAttentionConfig(PreTrainedConfig, AttentionConfigFields):
    """Base class: the positional encoding, feature map and attention options of every layer.

    Args:
        positional_encoding: one of ``lrpe_hf.POSITIONAL_ENCODINGS`` (the registered encodings).
        absolute_position_embedding: ``none``, ``sinusoidal`` or ``learned``, added to the input embeddings (the
            sinusoids at the amplitude of the token embeddings at initialisation: see ``positional_absolute``).
        feature_map: one of ``lrpe_hf.FEATURE_MAPS`` (linear attention; default: the encoding's paper's, ``elu``
            except ``relu`` for ``permute`` and ``exp`` for ``fastrpb``).
        attention: ``linear`` or ``softmax`` (the quadratic baseline).
        normalization: ``denominator``, ``unrotated_denominator`` or ``output_norm`` (default per encoding).
        The other fields are those of ``lrpe_hf.AttentionOptions`` (chunk size, LRPE, PermuteFormer, SPE,
        Performer, DPFP and FastRPB options), documented there.
    """

    positional_encoding: str = "lrpe_orthogonal"
    absolute_position_embedding: str = "none"

    # Set by each family.
    is_causal_model = False
    position_dims = 1

    def __post_init__(self, **kwargs):
        self._refuse_misspelt_fields(kwargs)
        super().__post_init__(**kwargs)
        self._check_sizes()
        self._check_probabilities()
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

    def _check_sizes(self):
        """Every size the config has (``SIZE_FIELDS``) a whole number of at least 1, refused by its name otherwise
        (zero heads would divide by zero, a negative layer count build a model without layers)."""
        for name in (name for name in SIZE_FIELDS if name in self.__dataclass_fields__):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be a whole number of at least 1, got {value!r}")

    def _check_probabilities(self):
        """Every dropout probability the config has (``PROBABILITY_FIELDS``) a number in [0, 1], refused by its name
        otherwise (torch's Dropout would refuse it only when the model is built, without naming the field)."""
        for name in (name for name in PROBABILITY_FIELDS if name in self.__dataclass_fields__):
            value = getattr(self, name)
            if value is None and name == "classifier_dropout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{type(self).__name__}: {name} must be a number in [0, 1], got {value!r}")

    def _refuse_misspelt_fields(self, extra: dict):
        """A config keeps any other keyword as an attribute (as every Transformers config does: files saved by other
        releases carry fields of their own), which nothing reads; one spelt almost like a field only this library has
        (the attention options, ``positional_encoding``, ``absolute_position_embedding``, ``embedding_multiplier``;
        not the sizes and token ids other Transformers configs name alike) is a typo that would leave the field at
        its default, so it is refused."""
        names = [name for name, _, _ in AttentionOptions.config_fields()] + list(OWN_FIELDS)
        for key in extra:
            if key in names:  # another family's field (embedding_multiplier: the text families')
                raise ValueError(
                    f"{type(self).__name__} has no field {key!r}: another model family's config has it, this one "
                    "would keep it as an attribute that nothing reads"
                )
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.85)
            if close:
                raise ValueError(
                    f"{type(self).__name__} has no field {key!r}; did you mean {close[0]!r}? (an unknown keyword "
                    "would be kept as an attribute that nothing reads)"
                )

    @property
    def max_relative_positions(self) -> int:
        """The span FastRPB learns biases for (per axis in 2D)."""
        return self.max_position_embeddings

    def attention_options(self) -> AttentionOptions:
        values = {option_name: getattr(self, name) for name, option_name, _ in AttentionOptions.config_fields()}
        return AttentionOptions(
            causal=self.is_causal_model,
            position_dims=self.position_dims,
            max_positions=self.max_relative_positions,
            **values,
        )
