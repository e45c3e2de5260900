"""Every encoding, bidirectional and causal, several feature maps, against the explicit O(N^2) formulas."""

import pytest
import torch
from conftest import SECOND_FEATURE_MAP, make_layer
from reference import reference_attention

from lrpe_hf import POSITIONAL_ENCODINGS

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
    feature_map = "elu" if feature == "elu" else SECOND_FEATURE_MAP[encoding]
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
    ],
)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_other_normalizations(encoding, normalization, causal):
    layer = make_layer(encoding, normalization=normalization, causal=causal, chunk_size=3)
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
