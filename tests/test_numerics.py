"""The exponential maps' stabiliser at extreme scales and in low precision, against the same layer in float64."""

import pytest
import torch

from lrpe_hf import LinearAttention, LinearAttentionState


def layer_at(query_level, key_level, spread=1.0, feature_map="exp", causal=True, normalization=None, seed=0):
    """A float32 layer whose queries sit near ``query_level`` and keys near ``key_level``, each entry spread with
    standard deviation about ``spread`` (for inputs of unit variance)."""
    torch.manual_seed(seed)
    layer = LinearAttention(16, 2, feature_map=feature_map, causal=causal, normalization=normalization)
    with torch.no_grad():
        for rows, level in ((slice(0, 16), query_level), (slice(16, 32), key_level)):  # qkv_proj's q, k rows
            layer.qkv_proj.weight[rows].normal_(0.0, spread / 16**0.5)
            layer.qkv_proj.bias[rows].fill_(level)
    return layer.eval()


def inputs(tokens, seed=1):
    return torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(seed))


def test_a_call_without_real_keys_leaves_the_running_key_maximum_unset():
    """Three padded tokens in one call, five real ones in the next (q about +100, k about -110): the first call
    saw no key, so the second divides its keys by their own maximum, not by e^0 (which underflows them)."""
    layer = layer_at(100.0, -110.0, spread=0.3)
    x, mask = inputs(8), torch.tensor([[False] * 3 + [True] * 5])
    with torch.no_grad():
        reference = layer.double()(x.double(), attention_mask=mask)
        layer.float()
        full = layer(x, attention_mask=mask)
        state = LinearAttentionState()
        first = layer(x[:, :3], attention_mask=mask[:, :3], state=state)
        assert torch.isneginf(state.path.key_max).all()
        second = layer(x[:, 3:], attention_mask=mask[:, 3:], state=state)
    assert reference[0, 3:].abs().min() > 1e-3
    torch.testing.assert_close(full, reference.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([first, second], dim=1), reference.float(), atol=1e-4, rtol=1e-4)


# (feature map, query and key level, spread): exp with every logit near -7.5 x 8 = -60 (the eps term exp(60) eps
# overflows float16 while the true denominators are thousands of times eps); FAVOR+ with logits of spread 2.5
LOW_PRECISION_CASES = {"exp-negative": ("exp", -7.5, -7.5, 0.3), "performer-wide": ("performer", 0.0, 0.0, 2.5)}
# half precision keeps about 3 significant digits (float16) or 2 (bfloat16): tolerances relative to the outputs' scale
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("normalization", ["denominator", "output_norm", "output_layer_norm"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("case", LOW_PRECISION_CASES)
def test_stabilised_maps_under_half_precision_autocast_match_float64(case, causal, normalization, dtype):
    feature_map, query_level, key_level, spread = LOW_PRECISION_CASES[case]
    layer = layer_at(query_level, key_level, spread, feature_map, causal, normalization)
    x = inputs(512)
    with torch.no_grad():
        reference = layer.double()(x.double()).float()
        layer.float()
        with torch.autocast("cpu", dtype=dtype):
            got = layer(x).float()
    assert reference.abs().mean() > 1e-3
    # LayerNorm divides each row by its spread over the heads, which magnifies the rounding of rows whose heads
    # nearly agree: twice the room there
    room = 8 if normalization == "output_layer_norm" else 4
    # each token's output within the rounding of its own size: one entry, a sum of 512 signed terms, may cancel to
    # near zero and keep little of its relative precision (FAVOR+'s wide features: up to 0.2x the outputs' mean
    # size in bfloat16 over seeds), where the token's output as a whole is right; a token or a head gone wrong is not
    error = torch.linalg.vector_norm(got - reference, dim=-1) / torch.linalg.vector_norm(reference, dim=-1)
    assert torch.isfinite(got).all() and error.max() <= TOLERANCE[dtype] * room, float(error.max())


@pytest.mark.parametrize("encoding", ["none", "permute", "rope"])
def test_bf16_autocast_error_does_not_grow_along_a_long_causal_sequence(encoding):
    """Under bf16 autocast the causal product carries its running state across 64 chunks of 64 tokens: the
    outputs stay within bf16's precision (8 bits: 0.4%) of float64, and the last tokens are no worse than the
    first, so the state does not accumulate rounding."""
    torch.manual_seed(0)
    layer = LinearAttention(256, 4, positional_encoding=encoding, causal=True).eval()
    x = torch.randn(1, 4096, 256)
    with torch.no_grad():
        reference = layer.double()(x.double()).float()
        layer.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = layer(x).float()
    error = (got - reference).abs().mean(-1)[0] / reference.abs().mean()
    assert error.mean() < 0.01
    assert error[-512:].mean() < 1.5 * error[:512].mean()
