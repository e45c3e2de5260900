"""A component added by the documented route (docs/extending.md: its module, one registration) runs through the
generic sweep: a toy relative encoding (RoPE on every other feature pair) and a toy feature map (softplus),
registered for this module's tests only, through the invariance tests every built-in encoding passes
(tests/test_properties.py, called with the toys' names), a model's generate and a save and reload. A new built-in
gets the same tests from the registry's names, with no list to update."""

import pytest
import test_against_reference as against_reference
import test_models as models
import test_properties as properties
import torch
from conftest import make_layer
from torch.nn import functional as F

import lrpe_hf
from lrpe_hf.modeling.positional_encoding import reference_rotation
from lrpe_hf.modeling.registry import FEATURE_MAP_REGISTRY, POSITIONAL_ENCODING_REGISTRY

TOY_ENCODING, TOY_MAP = "toy_every_other_pair_rope", "toy_softplus"


class EveryOtherPairRotation(lrpe_hf.PositionalEncoding):
    """Rotates feature pairs 0, 2, 4, ... by position x 10000^(-i / pairs); the odd pairs stay as they are."""

    def __init__(self, feature_dim: int):
        super().__init__()
        self.pairs = feature_dim // 2
        self.register_initial_values()

    def initial_values(self):
        index = torch.arange(self.pairs, dtype=torch.float64)
        return {"frequencies": torch.where(index % 2 == 0, 10000.0 ** (-index / self.pairs), 0.0)}

    def encode_features(self, q, k, positions):
        angles = positions[:, None, :, :1].to(self.frequencies.dtype) * self.frequencies  # (B, 1, N, pairs)
        return rotated(q, angles), rotated(k, angles)

    def reference_transform(self, head, position, width):
        turns = torch.zeros(width // 2, dtype=torch.float64)
        turns[: len(self.frequencies)] = position[0] * self.frequencies.double()
        return reference_rotation(turns, width).to(torch.complex128)


def rotated(x, angles):
    """x (B, H, N, 2 x pairs) with pair i turned by angles[..., i]."""
    pairs = x.unflatten(-1, (-1, 2))
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = pairs[..., 0], pairs[..., 1]
    return torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1).flatten(-2)


class Softplus(lrpe_hf.FeatureMap):
    def forward(self, x):
        return F.softplus(x)

    def reference(self, x, head):
        return torch.log1p(torch.exp(x))


@pytest.fixture(scope="module", autouse=True)
def registered_toys():
    lrpe_hf.register_positional_encoding(
        TOY_ENCODING, lambda options, heads, head_dim, width: EveryOtherPairRotation(width), signed_features=True,
        supports_2d=False,
    )  # fmt: skip
    lrpe_hf.register_feature_map(TOY_MAP, lambda options, width: Softplus(width), positive=True)
    yield
    POSITIONAL_ENCODING_REGISTRY.pop(TOY_ENCODING)
    FEATURE_MAP_REGISTRY.pop(TOY_MAP)


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_the_toy_encoding_passes_the_invariances(attention):
    properties.test_token_by_token_decoding_equals_full_forward(TOY_ENCODING, attention)
    properties.test_future_tokens_do_not_change_past_outputs(TOY_ENCODING, attention)
    for causal in (False, True):
        properties.test_relative_encodings_ignore_a_constant_shift_of_positions(TOY_ENCODING, attention, causal)
        if attention == "linear":
            properties.test_padded_batch_equals_each_sequence_alone(TOY_ENCODING, causal)


@pytest.mark.parametrize("encoding", [TOY_ENCODING, "none", "rope"])
def test_the_toy_feature_map_trains_with_encodings(encoding):
    properties.test_every_encoding_with_every_feature_map_trains(encoding, TOY_MAP)


@pytest.mark.parametrize("encoding", [TOY_ENCODING, "rope"])
def test_the_toys_train_compiled_in_one_graph(encoding):
    """The toy map, a plain ``F.softplus`` that takes no care of its input's layout (a strided view of the joined
    projections), and the toy encoding compile in one graph with the eager layer's values and gradients, as every
    built-in component does (the contract ``FeatureMap`` states)."""
    models.test_a_causal_layer_compiles_to_one_graph_with_the_eager_values_and_gradients(encoding, TOY_MAP)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_the_toys_match_their_own_formulas(causal):
    """Each toy carries its formula (``reference_transform``, ``reference``) as a registered component does, and
    the O(N^2) sweep every built-in passes holds the toys to theirs, with nothing to add to the sweep."""
    against_reference.test_linear_attention_matches_quadratic_formula(TOY_ENCODING, "elu", causal)
    layer = make_layer(TOY_ENCODING, feature_map=TOY_MAP, causal=causal, chunk_size=4)
    against_reference.check(layer, *against_reference.padded_inputs(causal))


def test_a_hook_overridden_without_its_formula_is_named():
    """An encoding (or map) that overrides a hook but gives no formula for it says which, where the sweep asks."""

    class Unformulated(lrpe_hf.PositionalEncoding):
        def encode_features(self, q, k, positions):
            return q, 2 * k

    with pytest.raises(NotImplementedError, match="Unformulated overrides encode_features but gives no reference"):
        Unformulated().reference_transform(0, (0,), 4)
    with pytest.raises(NotImplementedError, match="Softplus overrides forward but gives no reference formula"):
        type("Softplus", (lrpe_hf.FeatureMap,), {"forward": F.softplus})(4).reference(torch.zeros(1, 4), 0)


def test_the_shift_check_sees_the_toy_rotation():
    """The toys are not the identity: the rotation moves the output against the plain layer, and the map too."""
    x = properties.inputs()
    plain = lrpe_hf.LinearAttention(16, 2, feature_map="relu").double().eval()
    toy = lrpe_hf.LinearAttention(16, 2, positional_encoding=TOY_ENCODING, feature_map="relu").double().eval()
    toy.load_state_dict(plain.state_dict(), strict=False)
    assert not torch.allclose(toy(x), plain(x))


def test_a_model_with_the_toys_generates_and_reloads(tmp_path):
    config = lrpe_hf.LinearGPTConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        positional_encoding=TOY_ENCODING, feature_map=TOY_MAP,
    )  # fmt: skip
    torch.manual_seed(0)
    model = lrpe_hf.LinearGPTForCausalLM(config).eval()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    model.save_pretrained(tmp_path)
    loaded = lrpe_hf.LinearGPTForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(generated).logits, model(generated).logits, rtol=0, atol=0)
    # greedy decoding with the cache equals the argmax of one forward over the generated tokens
    logits = model(generated).logits
    torch.testing.assert_close(generated[:, 7:], logits[:, 6:-1].argmax(-1))
    with pytest.raises(ValueError, match=TOY_ENCODING):
        lrpe_hf.LinearViTConfig(positional_encoding=TOY_ENCODING)


def test_a_registered_product_backend_is_chosen_by_name_and_by_auto():
    """The causal product's backends are a table: a third one registers with its why_not, run and serves, is taken
    by kernel_backend=<its name> (refused with its reason where it cannot run) and by auto before torch, and gives
    the torch path's values (it delegates to it here, counting its calls)."""
    from lrpe_hf.modeling import products_dispatch
    from lrpe_hf.modeling.products_dispatch import CAUSAL_PRODUCT_BACKENDS, CausalProductBackend

    calls = []

    def run(*arguments):
        calls.append(1)
        return products_dispatch.torch_run(*arguments)

    def why_not(q, v, dtype, gated_backward):
        return None if dtype == torch.float64 else "it computes in float64 only"

    backend = CausalProductBackend(why_not=why_not, run=run, serves=lambda x: False)
    products_dispatch.register_causal_product_backend("toy_float64", backend)
    try:
        x = properties.inputs()
        reference = lrpe_hf.LinearAttention(16, 2, causal=True, kernel_backend="torch").double().eval()
        for name in ("toy_float64", "auto"):
            layer = lrpe_hf.LinearAttention(16, 2, causal=True, kernel_backend=name).double().eval()
            layer.load_state_dict(reference.state_dict())
            calls.clear()
            torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)
            assert calls, name
        with pytest.raises(ValueError, match="kernel_backend='toy_float64' cannot run.*float64 only"):
            lrpe_hf.LinearAttention(16, 2, causal=True, kernel_backend="toy_float64")(x.float())
        with pytest.raises(ValueError, match="valid values: auto, triton, torch, toy_float64"):
            lrpe_hf.LinearAttention(16, 2, kernel_backend="cuda_of_my_own")
    finally:
        CAUSAL_PRODUCT_BACKENDS.pop("toy_float64")
