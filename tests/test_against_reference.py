"""Every encoding, bidirectional and causal, several feature maps, against the explicit O(N^2) formulas."""

import math

import pytest
import torch
from conftest import make_layer, second_feature_map
from reference import reference_attention
from torch.nn import functional as F

from lrpe_hf import POSITIONAL_ENCODINGS, LinearAttention, LinearAttentionState


def padded_inputs(causal, batch=2, tokens=11, hidden=16, seed=0):
    """Row 0 full; row 1 padded on the left (causal) or on the right (bidirectional)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, hidden, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, tokens, dtype=torch.bool)
    if causal:
        mask[1, :3] = False
    else:
        mask[1, -3:] = False
    return x, mask


def check(layer, x, mask, positions=None, atol=1e-8):
    draw = layer.shared_codes.draw() if layer.shared_codes is not None else None
    got = layer(x, attention_mask=mask, position_ids=positions, shared_draw=draw)
    want = reference_attention(layer, x, mask, positions, shared_draw=draw)
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("feature", ["elu", "second"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_linear_attention_matches_quadratic_formula(encoding, feature, causal):
    feature_map = "elu" if feature == "elu" else second_feature_map(encoding)
    layer = make_layer(encoding, feature_map=feature_map, causal=causal, chunk_size=4)
    check(layer, *padded_inputs(causal))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_softmax_baseline_matches_quadratic_formula(encoding, causal):
    layer = make_layer(encoding, attention="softmax", causal=causal)
    check(layer, *padded_inputs(causal))


@pytest.mark.parametrize(
    "encoding,normalization",
    [
        ("rope", "output_norm"),
        ("lrpe_orthogonal", "unrotated_denominator"),
        ("lrpe_unitary", "unrotated_denominator"),
        ("lrpe_permutation", "unrotated_denominator"),
        ("permute", "output_norm"),
        ("none", "output_norm"),
        ("lrpe_orthogonal", "output_layer_norm"),
        ("rope", "output_layer_norm"),
        ("fastrpb", "output_layer_norm"),
    ],
)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_other_normalizations(encoding, normalization, causal):
    layer = make_layer(encoding, normalization=normalization, causal=causal, chunk_size=3)
    check(layer, *padded_inputs(causal))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("feature_map", ["hedgehog", "t2r"])
@pytest.mark.parametrize("encoding", ["none", "lrpe_orthogonal", "permute", "spe_sine"])
def test_learned_feature_maps_for_conversion(encoding, feature_map, causal):
    layer = make_layer(encoding, feature_map=feature_map, causal=causal, chunk_size=4)
    check(layer, *padded_inputs(causal))


@pytest.mark.parametrize("p_matrix", ["identity", "odd_even", "householder", "dct"])
@pytest.mark.parametrize("encoding", ["lrpe_unitary", "lrpe_orthogonal", "lrpe_permutation"])
def test_lrpe_p_matrices(encoding, p_matrix):
    layer = make_layer(encoding, lrpe_p_matrix=p_matrix, lrpe_learnable_p=True, causal=True, chunk_size=5)
    check(layer, *padded_inputs(True))


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 11, 64])
@pytest.mark.parametrize(
    "encoding,feature_map", [("none", "elu"), ("permute", "relu"), ("rope", "exp"), ("lrpe_unitary", "elu")]
)
def test_chunk_sizes_that_do_and_do_not_divide_the_length(encoding, feature_map, chunk_size):
    layer = make_layer(encoding, feature_map=feature_map, causal=True, chunk_size=chunk_size)
    check(layer, *padded_inputs(True))


@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)  # every encoding has a 2D form
def test_2d_encodings_match_quadratic_formula(encoding, attention):
    layer = make_layer(encoding, position_dims=2, attention=attention, max_positions=8)
    g = torch.Generator().manual_seed(3)
    rows, cols = torch.meshgrid(torch.arange(3), torch.arange(4), indexing="ij")
    grid = torch.stack([rows.flatten(), cols.flatten()], -1)
    positions = torch.cat([torch.zeros(1, 2, dtype=torch.long), grid])[None].expand(2, -1, -1)  # class token at (0, 0)
    x = torch.randn(2, 13, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, -4:] = False
    check(layer, x, mask, positions)


# ---------------------------------------------------------------- default settings, large activations
@pytest.mark.parametrize(
    "dtype,tolerance",
    # bf16 keeps 8 bits of mantissa: q, k and v are already off by ~1% each after the projections
    [(torch.float32, 1e-4), (torch.bfloat16, 0.1)],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(
    "encoding,feature_map",
    [
        ("none", "exp"),
        ("none", "performer"),
        ("permute", "exp"),
        ("fastrpb", "performer"),
        ("spe_sine", "exp"),
        ("rope", "elu"),
        ("lrpe_orthogonal", "elu"),
        ("lrpe_unitary", "elu"),
        ("permute", "exp+output_layer_norm"),
        ("lrpe_permutation", "relu"),
    ],
)
def test_one_token_thirty_times_larger_matches_the_formula_at_default_eps(
    encoding, feature_map, causal, dtype, tolerance
):
    """The stabiliser of exponential maps must not change outputs: eps keeps its meaning at any activation scale.

    Exponential maps are checked with the encodings whose features stay non-negative. With signed features
    (rotations after P) and exp features at this scale, phi(q) . phi(k) is a cancellation of O(1) products down
    to ~1e-8: an ill-conditioned sum in float32 whatever the stabiliser (see docs/attention_layer.md, numerics)."""
    feature_map, _, normalization = feature_map.partition("+")
    layer = make_layer(
        encoding, feature_map=feature_map, causal=causal, chunk_size=4, normalization=normalization or None
    )
    x, mask = padded_inputs(causal)
    x[:, 5] *= 30.0
    draw = layer.shared_codes.draw() if layer.shared_codes is not None else None
    with torch.no_grad():
        want = reference_attention(layer, x, mask, shared_draw=draw)  # float64, unstabilised
        got = layer.to(dtype)(x.to(dtype), attention_mask=mask, shared_draw=draw).double()
    # fp32: every row to its own scale. bf16: to the output's overall scale; a row whose signed terms nearly cancel
    # (rotations after P, at this activation scale) is small, and bf16 rounds the terms, not the small sum.
    scale = want.abs().amax(-1, keepdim=True) if dtype == torch.float32 else want.abs().max()
    assert float(((got - want).abs() / scale).max()) < tolerance


# ---------------------------------------------------------------- softmax temperature
IDENTITY_SETTINGS = {  # options under which each encoding can be made the identity (see make_identity)
    "none": {},
    "rope": {},
    "lrpe_unitary": dict(lrpe_p_matrix="identity"),
    "lrpe_orthogonal": dict(lrpe_p_matrix="identity"),
    "lrpe_permutation": dict(lrpe_p_matrix="identity"),
    "permute": dict(permute_decay=1.0),
    "fastrpb": {},  # its bias weights start at zero
}


def make_identity(layer, tokens):
    """Zero the angles of rotations; return positions at which every permutation power is the identity
    (multiples of the cycle lengths' least common multiple)."""
    pe = layer.positional_encoding
    with torch.no_grad():
        for name, tensor in pe.named_parameters():
            if name.endswith("angles"):
                tensor.zero_()
        for name, tensor in pe.named_buffers():
            if name.endswith("frequencies"):
                tensor.zero_()
        for name, tensor in pe.named_parameters():
            if name.endswith("frequencies"):
                tensor.zero_()
    period = 1
    for name, lengths in pe.named_buffers():
        if name.endswith("length"):
            for length in lengths.unique().tolist():
                period = math.lcm(period, int(length))
    return (torch.arange(tokens) * period)[None].expand(2, -1)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("encoding", IDENTITY_SETTINGS)
def test_softmax_temperature_where_the_encoding_is_the_identity(encoding, causal):
    """Where an encoding is the identity, softmax attention is softmax(q k^T / sqrt(D)) v (no doubled width)."""
    torch.manual_seed(0)
    layer = LinearAttention(
        16,
        2,
        positional_encoding=encoding,
        attention="softmax",
        causal=causal,
        max_positions=1024,
        **IDENTITY_SETTINGS[encoding],
    ).double()
    positions = make_identity(layer, 7)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    q, k, v = layer.qkv_proj(x).view(2, 7, 3, 2, 8).transpose(1, 3).unbind(2)
    logits = q @ k.transpose(-1, -2) / math.sqrt(8)
    if causal:
        logits = logits.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 16)
    torch.testing.assert_close(layer(x, position_ids=positions), layer.o_proj(out))


# ---------------------------------------------------------------- FastRPB's FFT path inside the layer
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_fastrpb_fft_path_with_position_gaps_and_left_padding(causal):
    """600 tokens take the FFT path; the layer equals the explicit Toeplitz matrix W[s, t] = w[p_s - p_t] plus
    linear attention, with gaps between positions and a left-padded row."""
    torch.manual_seed(0)
    N, H, D = 600, 2, 8
    layer = LinearAttention(
        16, H, positional_encoding="fastrpb", feature_map="elu", causal=causal, max_positions=2048
    ).double()  # the bias path is under test; the default feature map (exp) is covered with the other encodings
    with torch.no_grad():
        layer.positional_encoding.weights.normal_(0.0, 0.05)
    x = torch.randn(2, N, 16, dtype=torch.float64)
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, :50] = False
    steps = torch.randint(1, 4, (2, N))
    positions = (steps * mask).cumsum(-1)
    assert N * N > 4096 * 64  # the FFT path, not the dense one
    q, k, v = layer.qkv_proj(x).view(2, N, 3, H, D).transpose(1, 3).unbind(2)
    v = v * mask[:, None, :, None]
    fq, fk = F.elu(q) + 1, (F.elu(k) + 1) * mask[:, None, :, None]
    allowed = mask[:, None, None, :] & (torch.ones(N, N, dtype=torch.bool).tril() if causal else True)
    scores = (fq @ fk.transpose(-1, -2)) * allowed
    attention = (scores @ v) / (scores.sum(-1, keepdim=True) + layer.options.eps)
    lags = positions[:, :, None] - positions[:, None, :]  # (B, N, N)
    w = layer.positional_encoding.weights[0].detach()  # (H, 2 * 2048 - 1)
    toeplitz = w[:, 2047 + lags].transpose(0, 1) * allowed  # (B, H, N, N)
    out = ((attention + toeplitz @ v) * mask[:, None, :, None]).transpose(1, 2).reshape(2, N, 16)
    torch.testing.assert_close(layer(x, attention_mask=mask, position_ids=positions), layer.o_proj(out))


@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("padded_position", [0, 1, 4])
def test_permute_decay_counts_real_tokens_whatever_position_padding_takes(padded_position, attention):
    """Positions [0, 1, 2, 3, 4, X, 5, 6] with the token at X padded: the decay r^(p_s - p_t) runs over real tokens
    only, whichever position the padding was given (1 is what ``masked_fill(mask == 0, 1)`` gives it)."""
    maps = {"feature_map": "relu"} if attention == "linear" else {}
    layer = make_layer("permute", causal=True, chunk_size=4, attention=attention, **maps)
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 5] = False
    positions = torch.tensor([[0, 1, 2, 3, 4, padded_position, 5, 6], list(range(8))])[..., None]
    check(layer, x, mask, positions)


@pytest.mark.parametrize("padded_position", [0, 1])
def test_permute_decoding_in_calls_that_end_in_padding_equals_the_full_forward(padded_position):
    """A call ending in a padded token, then the rest: the padding decays nothing in either call."""
    layer = make_layer("permute", causal=True, feature_map="relu")
    x = torch.randn(1, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[True] * 5 + [False] + [True] * 2])
    positions = torch.tensor([[0, 1, 2, 3, 4, padded_position, 5, 6]])
    full = layer(x, attention_mask=mask, position_ids=positions)
    state = LinearAttentionState()
    first = layer(x[:, :6], attention_mask=mask[:, :6], position_ids=positions[:, :6], state=state)
    rest = layer(x[:, 6:], attention_mask=mask[:, 6:], state=state)  # default positions continue from the cache
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full)
