"""Invariances users rely on: incremental decoding, relative shifts, causality, padding, long inputs."""

import pytest
import torch
from conftest import make_layer, second_feature_map

from lrpe_hf import FEATURE_MAPS, POSITIONAL_ENCODINGS, LinearAttentionState
from lrpe_hf.modeling.registry import positional_encoding_entry

RELATIVE = [encoding for encoding in POSITIONAL_ENCODINGS if positional_encoding_entry(encoding).relative]


def inputs(batch=2, tokens=13, hidden=16, seed=0):
    return torch.randn(batch, tokens, hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def run(layer, x, **kwargs):
    if layer.shared_codes is not None:
        kwargs.setdefault("shared_draw", layer.shared_codes.draw())
    return layer(x, **kwargs)


@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_token_by_token_decoding_equals_full_forward(encoding, attention):
    feature_map = second_feature_map(encoding) if attention == "linear" else None
    layer = make_layer(encoding, causal=True, attention=attention, feature_map=feature_map, chunk_size=4)
    x = inputs()
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, :4] = False  # a left-padded prompt, as in batched generation
    full = run(layer, x, attention_mask=mask)
    state = LinearAttentionState()
    pieces = [run(layer, x[:, :6], attention_mask=mask[:, :6], state=state)]  # prefill, then one token at a time
    for t in range(6, 13):
        pieces.append(run(layer, x[:, t : t + 1], attention_mask=mask[:, t : t + 1], state=state))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("encoding", RELATIVE)
def test_relative_encodings_ignore_a_constant_shift_of_positions(encoding, attention, causal):
    layer = make_layer(
        encoding,
        causal=causal,
        attention=attention,
        feature_map=second_feature_map(encoding) if attention == "linear" else None,
    )
    x = inputs()
    positions = torch.arange(13)[None].expand(2, -1)
    base = layer(x, position_ids=positions)
    shifted = layer(x, position_ids=positions + 1000)
    torch.testing.assert_close(shifted, base, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("offset", [10**6, 2**31], ids=["1e6", "2^31"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("encoding", RELATIVE)
def test_relative_encodings_ignore_large_shifts_in_float32(encoding, attention, causal, offset):
    """Angles and permutation powers are reduced exactly, so far-away positions cost no float32 precision.
    At the defaults (elu features). (With dpfp, whose phi(q) . phi(k) can be exactly 0, a signed encoding's
    unrotated denominator leaves rounding noise / eps in those rows: see docs/attention_layer.md, numerics.)"""
    layer = make_layer(encoding, causal=causal, attention=attention).float()
    x = inputs().float()
    positions = torch.arange(13)[None].expand(2, -1)
    with torch.no_grad():
        base = layer(x, position_ids=positions)
        shifted = layer(x, position_ids=positions + offset)
    torch.testing.assert_close(shifted, base, atol=2e-5, rtol=1e-4)


def test_absolute_positions_do_matter():
    """The shift test can fail: a layer whose sine SPE codes depend on absolute positions does see the shift."""
    layer = make_layer("spe_sine", causal=False)
    x = inputs()
    positions = torch.arange(13)[None].expand(2, -1)
    assert not torch.allclose(run(layer, x, position_ids=positions), run(layer, x, position_ids=positions + 1000))


@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_future_tokens_do_not_change_past_outputs(encoding, attention):
    feature_map = ("exp" if encoding != "permute" else "relu") if attention == "linear" else None
    layer = make_layer(encoding, causal=True, attention=attention, feature_map=feature_map, chunk_size=8)
    x = inputs(tokens=16)
    perturbed = x.clone()
    perturbed[:, 6:] = 50.0 * torch.randn_like(x[:, 6:])  # huge future keys: must not rescale the past away
    a, b = run(layer, x), run(layer, perturbed)
    torch.testing.assert_close(b[:, :6], a[:, :6], atol=1e-12, rtol=1e-10)
    assert not torch.allclose(b[:, 6:], a[:, 6:])


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_padded_batch_equals_each_sequence_alone(encoding, causal):
    layer = make_layer(encoding, causal=causal, feature_map=second_feature_map(encoding), chunk_size=4)
    x = inputs(batch=3, tokens=10)
    lengths = [10, 7, 4]
    mask = torch.zeros(3, 10, dtype=torch.bool)
    padded = torch.zeros_like(x)
    for i, n in enumerate(lengths):
        if i == 1:  # left padding
            mask[i, 10 - n :] = True
            padded[i, 10 - n :] = x[i, :n]
        else:  # right padding
            mask[i, :n] = True
            padded[i, :n] = x[i, :n]
    batched = run(layer, padded, attention_mask=mask)
    for i, n in enumerate(lengths):
        alone = run(layer, x[i : i + 1, :n])
        torch.testing.assert_close(batched[i : i + 1][mask[i : i + 1]].view(1, n, -1), alone, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("feature_map", ["exp", "performer"])
def test_exponential_feature_maps_survive_large_logits(feature_map):
    """exp() of raw logits of a few hundred overflows; the stabilised layer stays finite and correct."""
    layer = make_layer("none", causal=True, feature_map=feature_map).float()
    x = 200.0 * torch.randn(1, 64, 16)
    out = layer(x)
    assert torch.isfinite(out).all()
    state = LinearAttentionState()
    steps = torch.cat([layer(x[:, t : t + 1], state=state) for t in range(64)], dim=1)
    torch.testing.assert_close(steps, out, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("encoding", ["permute", "rope", "lrpe_unitary", "lrpe_permutation", "fastrpb", "spe_sine"])
def test_32k_positions_stay_finite(encoding):
    """PermuteFormer's decay at 32k tokens (r^32768 underflows, r^-32768 overflows if applied naively)."""
    torch.manual_seed(0)
    from lrpe_hf import LinearAttention

    layer = LinearAttention(
        64, 4, positional_encoding=encoding, causal=True, max_positions=32768, spe_realizations=8
    ).eval()
    x = torch.randn(1, 32768, 64)
    with torch.no_grad():
        out = layer(x)
    assert torch.isfinite(out).all()
    # the last outputs see a context, not zeros: the decay is relative, so late tokens are not wiped out
    assert out[0, -1].abs().sum() > 0


@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_bf16_forward_is_finite(encoding):
    torch.manual_seed(0)
    from lrpe_hf import LinearAttention

    for causal in (False, True):
        layer = LinearAttention(64, 4, positional_encoding=encoding, causal=causal, max_positions=256).to(
            torch.bfloat16
        )
        x = torch.randn(2, 200, 64, dtype=torch.bfloat16)
        # SPE draws its codes at every training forward: both forwards draw the same ones (the comparison is of the
        # precisions, not of two draws, which differed by up to 1.25x this bound between seeds)
        torch.manual_seed(1)
        out = layer(x)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        torch.manual_seed(1)
        reference = layer.float()(x.float())
        layer.to(torch.bfloat16)
        assert (out.float() - reference).abs().max() < 0.1 * reference.abs().max() + 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_cuda_matches_cpu(encoding):
    from lrpe_hf import LinearAttention

    torch.manual_seed(0)
    layer = LinearAttention(64, 4, positional_encoding=encoding, causal=True, max_positions=512).eval()
    x = torch.randn(2, 300, 64)
    cpu = layer(x)
    gpu = layer.cuda()(x.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.isfinite(layer(x.cuda())).all()


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_every_encoding_with_every_feature_map_trains(encoding, feature_map):
    """The full grid docs/attention_layer.md promises: forward and backward stay finite, both directions."""
    from lrpe_hf import LinearAttention

    for causal in (False, True):
        torch.manual_seed(0)
        layer = LinearAttention(
            32,
            4,
            positional_encoding=encoding,
            feature_map=feature_map,
            causal=causal,
            max_positions=64,
            spe_realizations=8,
        )
        x = torch.randn(2, 40, 32, requires_grad=True)
        out = layer(x, attention_mask=torch.ones(2, 40).index_fill_(1, torch.arange(35, 40), 0))
        out.square().mean().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
