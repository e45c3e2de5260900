"""Encodings and feature maps registered from user code work in every family, like the built-in ones."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import lrpe_hf
from lrpe_hf.modeling.registry import FEATURE_MAP_REGISTRY, POSITIONAL_ENCODING_REGISTRY


class ALiBiDecay(lrpe_hf.PositionalEncoding):
    """ALiBi-style decay (Press et al. 2022) for causal linear attention: key t weighs exp(-m_h (s - t)) at query s,
    with learnable per-head slopes m_h starting at ALiBi's 2^(-8 h / H)."""

    def __init__(self, num_heads: int):
        super().__init__()
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])
        self.log_slopes = nn.Parameter(slopes.log())

    @property
    def log_decay(self):
        return -self.log_slopes.exp()


class ParitySigns(lrpe_hf.PositionalEncoding):
    """Flips the sign of the first half of the features at odd positions (the sum of the coordinates in 2D):
    (-1)^p_s (-1)^p_t = (-1)^(p_s - p_t), so the encoding is relative; its features are signed."""

    def encode_features(self, q, k, positions):
        sign = (1 - 2 * (positions.sum(-1) % 2)).to(q.dtype)[:, None, :, None]  # (B, 1, N, 1)
        half = q.shape[-1] // 2
        flip = torch.cat(
            [sign.expand(-1, -1, -1, half), torch.ones_like(sign).expand(-1, -1, -1, q.shape[-1] - half)], -1
        )
        return q * flip, k * flip


class SignedReLU(lrpe_hf.FeatureMap):
    """phi(x) = [relu(x), relu(-x)]: non-negative, twice the width."""

    @property
    def output_dim(self):
        return 2 * self.input_dim

    def forward(self, x):
        return torch.cat([F.relu(x), F.relu(-x)], dim=-1)


@pytest.fixture
def registered():
    lrpe_hf.register_positional_encoding(
        "alibi", lambda options, num_heads, head_dim, feature_dim: ALiBiDecay(num_heads), causal_only=True
    )
    lrpe_hf.register_positional_encoding(
        "parity",
        lambda options, num_heads, head_dim, feature_dim: ParitySigns(),
        signed_features=True,
        supports_2d=True,
    )
    lrpe_hf.register_feature_map("signed_relu", lambda options, input_dim: SignedReLU(input_dim))
    yield
    for name in ("alibi", "parity"):
        POSITIONAL_ENCODING_REGISTRY.pop(name)
    FEATURE_MAP_REGISTRY.pop("signed_relu")


TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0)
FAMILIES = {
    "roberta": (
        lambda **kw: lrpe_hf.LinearRobertaConfig(**TINY, vocab_size=50, **kw),
        lrpe_hf.LinearRobertaForMaskedLM,
        lambda: {"input_ids": torch.randint(3, 50, (2, 9))},
    ),
    "gpt": (
        lambda **kw: lrpe_hf.LinearGPTConfig(**TINY, vocab_size=50, **kw),
        lrpe_hf.LinearGPTForCausalLM,
        lambda: {"input_ids": torch.randint(3, 50, (2, 9))},
    ),
    "vit": (
        lambda **kw: lrpe_hf.LinearViTConfig(**TINY, image_size=16, patch_size=4, num_labels=3, **kw),
        lrpe_hf.LinearViTForImageClassification,
        lambda: {"pixel_values": torch.randn(2, 3, 16, 16)},
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_custom_encoding_and_feature_map_train_and_round_trip_in_every_family(registered, family, tmp_path):
    make_config, model_class, make_inputs = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(make_config(positional_encoding="parity", feature_map="signed_relu"))
    layer = model.model.stack.layers[0].self_attn
    assert isinstance(layer.positional_encoding, ParitySigns) and isinstance(layer.feature_map, SignedReLU)
    # signed features take the unrotated denominator by default, but [relu(x), relu(-x)] can be exactly zero
    assert layer.options.normalization == "output_layer_norm"
    inputs = make_inputs()
    labels = torch.tensor([0, 2]) if family == "vit" else inputs["input_ids"]
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.stack.layers[-1].self_attn.qkv_proj.weight.grad.abs().sum() > 0
    model.eval().save_pretrained(tmp_path)
    reloaded = model_class.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits)


def test_alibi_decay_matches_its_formula_and_generates(registered, tmp_path):
    torch.manual_seed(0)
    layer = lrpe_hf.LinearAttention(16, 2, positional_encoding="alibi", causal=True, chunk_size=4).double()
    x = torch.randn(1, 11, 16, dtype=torch.float64)
    q, k, v = layer.qkv_proj(x).view(1, 11, 3, 2, 8).transpose(1, 3).unbind(2)
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    slopes = layer.positional_encoding.log_slopes.exp()
    lag = torch.arange(11)[:, None] - torch.arange(11)[None, :]
    weights = (phi_q @ phi_k.transpose(-1, -2)) * torch.exp(-slopes[:, None, None] * lag) * (lag >= 0)
    expected = (weights @ v) / (weights.sum(-1, keepdim=True) + layer.options.eps)
    expected = layer.o_proj(expected.transpose(1, 2).reshape(1, 11, 16))
    torch.testing.assert_close(layer(x), expected)

    model = lrpe_hf.LinearGPTForCausalLM(FAMILIES["gpt"][0](positional_encoding="alibi")).eval()
    prompt = torch.randint(3, 50, (1, 5))
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        full = model(generated).logits
    assert torch.equal(full[0, 4:-1].argmax(-1), generated[0, 5:])
    model.save_pretrained(tmp_path)
    assert torch.equal(
        lrpe_hf.LinearGPTForCausalLM.from_pretrained(tmp_path).generate(prompt, max_new_tokens=4), generated
    )


def test_a_decay_in_a_bidirectional_model_is_refused_when_built(registered):
    """Registered causal_only, as the ALiBi of docs/extending.md: the bidirectional configs refuse it when built;
    registered without the flag, the layer refuses it when built (before, the first forward raised)."""
    for config_class in (lrpe_hf.LinearRobertaConfig, lrpe_hf.LinearViTConfig):
        with pytest.raises(ValueError, match="'alibi' decays with distance: it is for causal attention only"):
            config_class(positional_encoding="alibi")
    lrpe_hf.LinearGPTConfig(positional_encoding="alibi")
    lrpe_hf.register_positional_encoding(
        "alibi_unflagged", lambda options, num_heads, head_dim, feature_dim: ALiBiDecay(num_heads)
    )
    try:
        with pytest.raises(ValueError, match="register it with causal_only=True"):
            lrpe_hf.LinearAttention(16, 2, positional_encoding="alibi_unflagged", causal=False)
        lrpe_hf.LinearAttention(16, 2, positional_encoding="alibi_unflagged", causal=True)
    finally:
        POSITIONAL_ENCODING_REGISTRY.pop("alibi_unflagged")


def test_registration_errors_and_names(registered):
    assert "parity" in lrpe_hf.POSITIONAL_ENCODINGS and "signed_relu" in lrpe_hf.FEATURE_MAPS
    with pytest.raises(ValueError, match="already registered"):
        lrpe_hf.register_positional_encoding("rope", lambda *args: None)
    with pytest.raises(ValueError, match="cannot be 'denominator'"):
        lrpe_hf.register_positional_encoding(
            "x", lambda *a: None, signed_features=True, default_normalization="denominator"
        )
    with pytest.raises(ValueError, match="valid values: .*alibi, parity"):
        lrpe_hf.LinearGPTConfig(positional_encoding="xpos")
    with pytest.raises(ValueError, match="valid values: .*signed_relu"):
        lrpe_hf.LinearAttention(16, 2, feature_map="cosine")


def test_a_custom_component_does_not_travel_as_remote_code(registered, tmp_path):
    """Its module is not part of the checkpoint: loading elsewhere stops with a message that says what to do."""
    lrpe_hf.LinearGPTForCausalLM(FAMILIES["gpt"][0](positional_encoding="alibi")).save_pretrained(tmp_path)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["lrpe_hf"] = None
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)
        except ValueError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "Unknown positional_encoding 'alibi'" in result.stdout and "must be registered" in result.stdout, result


class ScaledFeatures(lrpe_hf.PositionalEncoding):
    """Scales the features by a fixed per-feature buffer (relative trivially: no position enters), made as the
    caller says: from ``initial_values()``, as a persistent buffer, or in ``__init__`` as a non-persistent one."""

    def __init__(self, width: int, how: str):
        super().__init__()
        self.width = width
        if how == "initial_values":
            self.register_initial_values()
        else:
            self.register_buffer("scales", self.initial_values()["scales"], persistent=how == "persistent")

    def initial_values(self):
        return {"scales": torch.linspace(0.5, 2.0, self.width)}

    def encode_features(self, q, k, positions):
        return q * self.scales.to(q.dtype), k * self.scales.to(k.dtype)


class PlainBufferEncoding(lrpe_hf.PositionalEncoding):
    """A buffer made as plain PyTorch code makes one: in ``__init__``, not saved, no ``initial_values()``."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width), persistent=False)

    def encode_features(self, q, k, positions):
        return q * self.scale, k * self.scale


class PlainBufferMap(lrpe_hf.FeatureMap):
    def __init__(self, width: int):
        super().__init__(width)
        self.inner = torch.nn.Module()  # in a child module too
        self.inner.register_buffer("shift", torch.ones(width), persistent=False)

    def forward(self, x):
        return F.relu(x) + self.inner.shift


def test_a_buffer_from_pretrained_could_not_restore_is_refused_when_the_model_is_built():
    """A registered component's buffer that is neither saved (persistent) nor given by initial_values() would come
    back from from_pretrained as uninitialised memory: the model refuses to build, naming the buffer and the way."""
    lrpe_hf.register_positional_encoding(
        "plain_buffer", lambda options, heads, head_dim, width: PlainBufferEncoding(width)
    )
    lrpe_hf.register_feature_map("plain_buffer_map", lambda options, width: PlainBufferMap(width))
    try:
        with pytest.raises(ValueError, match=r"'plain_buffer' keeps buffer\(s\) scale .*initial_values\(\)"):
            lrpe_hf.LinearGPTForCausalLM(
                lrpe_hf.LinearGPTConfig(**TINY, vocab_size=50, positional_encoding="plain_buffer")
            )
        with pytest.raises(ValueError, match=r"'plain_buffer_map' keeps buffer\(s\) inner.shift .*persistent=True"):
            lrpe_hf.LinearAttention(16, 2, feature_map="plain_buffer_map")
    finally:
        POSITIONAL_ENCODING_REGISTRY.pop("plain_buffer")
        FEATURE_MAP_REGISTRY.pop("plain_buffer_map")


def test_an_encoding_registered_without_a_2d_form_is_refused_by_images():
    """supports_2d is declared by the registration: without it, LinearViT refuses the encoding rather than hand it
    (row, col) positions; with it, the image model builds."""
    lrpe_hf.register_positional_encoding(
        "one_d", lambda options, heads, head_dim, width: ScaledFeatures(width, "initial_values")
    )
    lrpe_hf.register_positional_encoding(
        "two_d", lambda options, heads, head_dim, width: ScaledFeatures(width, "initial_values"), supports_2d=True
    )
    try:
        with pytest.raises(ValueError, match="'one_d' has no 2D form"):
            lrpe_hf.LinearViTConfig(positional_encoding="one_d")
        lrpe_hf.LinearViTForImageClassification(lrpe_hf.LinearViTConfig(**TINY, positional_encoding="two_d"))
    finally:
        POSITIONAL_ENCODING_REGISTRY.pop("one_d")
        POSITIONAL_ENCODING_REGISTRY.pop("two_d")


@pytest.mark.parametrize("how", ["initial_values", "persistent", "in_init"])
def test_a_custom_encodings_buffer_comes_back_from_from_pretrained(how, tmp_path):
    """A custom encoding's buffer comes back from from_pretrained with its values, however it was made: remade from
    initial_values(), saved with the weights (persistent), or made in __init__ and not saved (transformers builds the
    buffers for real while it builds the parameters on the meta device, at both ends of the supported range); the
    reloaded model gives the saved one's logits."""
    name = f"scaled_{how}"
    lrpe_hf.register_positional_encoding(name, lambda options, heads, head_dim, width: ScaledFeatures(width, how))
    try:
        config = lrpe_hf.LinearGPTConfig(**TINY, vocab_size=50, positional_encoding=name)
        model = lrpe_hf.LinearGPTForCausalLM(config).eval()
        ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(0))
        model.save_pretrained(tmp_path)
        loaded = lrpe_hf.LinearGPTForCausalLM.from_pretrained(tmp_path).eval()
        scales = loaded.model.stack.layers[0].self_attn.positional_encoding.scales
        torch.testing.assert_close(scales, torch.linspace(0.5, 2.0, scales.shape[0]), rtol=0, atol=0)
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    finally:
        POSITIONAL_ENCODING_REGISTRY.pop(name)
