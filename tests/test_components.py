"""Building blocks against second implementations and the statistics they promise."""

import fractions
import math

import pytest
import torch
from torch.nn import functional as F

import lrpe_hf
from lrpe_hf import LearnedPositionEmbedding, SinusoidalPositionEmbedding
from lrpe_hf.modeling.feature_maps import PerformerFeatureMap
from lrpe_hf.modeling.positional_encoding import unit_angles
from lrpe_hf.modeling.positional_fastrpb import FastRelativePositionBias
from lrpe_hf.modeling.positional_permute import CyclicPermutations
from lrpe_hf.modeling.positional_spe import ConvSPECodes, SineMixing, SineSPECodes, sine_table


# ---------------------------------------------------------------- FastRPB
@pytest.mark.parametrize("causal", [False, True])
def test_fft_toeplitz_equals_dense_toeplitz_1d(causal):
    torch.manual_seed(0)
    bias = FastRelativePositionBias(num_heads=3, max_positions=300, init_std=1.0).double()
    values = torch.randn(2, 3, 257, 5, dtype=torch.float64)
    positions = torch.arange(257)[None, :, None].expand(2, -1, -1)
    w = bias.weights[0].detach()
    lags = torch.arange(257)[:, None] - torch.arange(257)[None, :]
    dense = w[:, 299 + lags]  # (H, N, N): W[s, t] = w[s - t]
    if causal:
        dense = dense * (lags >= 0)
    expected = dense[None] @ values
    fft = bias.fft(values, positions, positions, causal)
    torch.testing.assert_close(fft, expected, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(bias.dense(values, positions, positions, causal), expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_fft_toeplitz_gradients_equal_the_dense_product(causal):
    """The FFT product's own backward (mirrored lags for the values, a cross-correlation for the weights)
    against autograd through the dense W V, with the lag table learnable."""
    torch.manual_seed(0)
    bias = FastRelativePositionBias(num_heads=3, max_positions=300, init_std=1.0).double()
    values = torch.randn(2, 3, 257, 5, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(257)[None, :, None].expand(2, -1, -1)
    lags = torch.arange(257)[:, None] - torch.arange(257)[None, :]
    dense = bias.weights[0][:, 299 + lags] * (lags >= 0 if causal else 1)  # (H, N, N), W[s, t] = w[s - t]
    expected = dense[None] @ values
    fft = bias.fft(values, positions, positions, causal)
    grad = torch.randn_like(expected)
    inputs = (values, bias.weights)
    got, want = (torch.autograd.grad(out, inputs, grad) for out in (fft, expected))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9)


def test_fft_toeplitz_equals_dense_2d_separable_bias():
    torch.manual_seed(0)
    bias = FastRelativePositionBias(num_heads=2, max_positions=9, position_dims=2, init_std=1.0).double()
    rows, cols = torch.meshgrid(torch.arange(7), torch.arange(9), indexing="ij")
    positions = torch.stack([rows.flatten(), cols.flatten()], -1)[None]  # (1, 63, 2)
    values = torch.randn(1, 2, 63, 4, dtype=torch.float64)
    p = positions[0]
    w_row, w_col = bias.weights[0].detach(), bias.weights[1].detach()
    drow = p[:, None, 0] - p[None, :, 0]
    dcol = p[:, None, 1] - p[None, :, 1]
    dense = w_row[:, 8 + drow] + w_col[:, 8 + dcol]  # (H, 63, 63)
    torch.testing.assert_close(bias.fft(values, positions, positions, False), dense[None] @ values)


def test_fastrpb_memory_is_linear_in_length():
    """The FFT path never builds an N x N matrix: 100k tokens run in a few hundred MB."""
    bias = FastRelativePositionBias(num_heads=2, max_positions=100_000, init_std=0.1)
    values = torch.randn(1, 2, 100_000, 8)
    positions = torch.arange(100_000)[None, :, None]
    with torch.no_grad():
        out = bias.value_bias(values, positions, positions, causal=True)
    assert out.shape == values.shape and torch.isfinite(out).all()


# ---------------------------------------------------------------- SPE
def spe_monte_carlo_error(codes, realizations, draws=200):
    """Relative error of the mean q_hat . k_hat against sqrt(R/D) sum_d q_d k_d P_d(m - n)."""
    torch.manual_seed(0)
    D = codes.head_dim
    q = torch.randn(1, 1, 6, D, dtype=torch.float64)
    k = torch.randn(1, 1, 6, D, dtype=torch.float64)
    positions = torch.tensor([0, 3, 7, 12, 20, 33])[None, :, None]
    codes.double().train()
    total = 0
    with torch.no_grad():
        for _ in range(draws):
            draw = codes.draw()
            total = (
                total
                + codes.encode(q, positions, draw, None, True)[0, 0]
                @ codes.encode(k, positions, draw, None, False)[0, 0].T
            )
    estimate = total / draws
    lags = (positions[0, :, None, :] - positions[0, None, :, :]).reshape(-1, 1)  # m - n for every pair
    with torch.no_grad():
        kernel = codes.kernel(lags)[0].reshape(D, 6, 6)
    expected = math.sqrt(realizations / D) * torch.einsum("md,nd,dmn->mn", q[0, 0], k[0, 0], kernel)
    return float((estimate - expected).norm() / expected.norm())


@pytest.mark.parametrize("variant", ["sine", "conv"])
def test_spe_monte_carlo_kernel_converges_as_realizations_grow(variant):
    errors = []
    for R in (4, 64, 1024):
        torch.manual_seed(1)
        if variant == "sine":
            codes = SineSPECodes(num_heads=1, head_dim=4, num_realizations=R, num_sines=3)
        else:
            codes = ConvSPECodes(num_heads=1, head_dim=4, num_realizations=R, kernel_size=8)
        errors.append(spe_monte_carlo_error(codes, R))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.05


def written_out_sine_table(rows, frequencies):
    """[cos, sin](2 pi f . p) from the formula, differentiable in f: rows (B', N, A), f (A, H, D, K) ->
    (B', H, N, 2K, D)."""
    phase = 2 * math.pi * torch.einsum("bna,ahdk->bhnkd", rows.to(frequencies.dtype), frequencies)
    return torch.cat([phase.cos(), phase.sin()], dim=3)


@pytest.mark.parametrize("table_rows, position_dims", [(1, 1), (2, 1), (2, 2)])
def test_sine_spe_mixing_in_blocks_has_the_values_and_gradients_of_the_written_out_product(
    table_rows, position_dims, monkeypatch
):
    """sum_{j,d} x_d table_jd M_(jd)r with table = [cos, sin](2 pi f . p), one token per block, the table shared by
    the batch or one per row, 1D and 2D positions: values, and the gradients of x, M and the frequencies f, against
    autograd through the written-out table."""
    monkeypatch.setattr(SineMixing, "BLOCK_ELEMENTS", 1)
    torch.manual_seed(0)
    B, H, N, D, K, R = 2, 3, 7, 4, 3, 5
    x = torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True)
    frequencies = (0.3 * torch.rand(position_dims, H, D, K, dtype=torch.float64)).requires_grad_()
    mixing = torch.randn(H, 2 * K * D, R, dtype=torch.float64, requires_grad=True)
    rows = torch.randint(0, 50, (table_rows, N, position_dims))
    table = sine_table(rows, frequencies.detach(), torch.float64)
    written_out = written_out_sine_table(rows, frequencies)
    torch.testing.assert_close(table, written_out.detach())
    got = SineMixing.apply(x, mixing, frequencies, table, rows)
    expected = torch.einsum(
        "bhnd,bhnjd,hjdr->bhnr", x, written_out.expand(B, -1, -1, -1, -1), mixing.view(H, 2 * K, D, R)
    )
    torch.testing.assert_close(got, expected)
    grad = torch.randn_like(got)
    inputs = (x, mixing, frequencies)
    for g, w in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(g, w)


def test_sine_spe_table_is_exact_at_large_positions():
    """The phase 2 pi f p is reduced modulo one cycle exactly (float32 frequencies, positions past a million):
    against Python's exact rational arithmetic."""
    torch.manual_seed(0)
    frequencies = 0.5 * torch.rand(1, 1, 2, 3)
    rows = torch.tensor([[[0], [7], [1_000_003], [16_777_215]]])
    table = sine_table(rows, frequencies, torch.float32)
    for n, p in enumerate(rows[0, :, 0].tolist()):
        for d in range(2):
            for k in range(3):
                cycles = fractions.Fraction(float(frequencies[0, 0, d, k])) * p
                phase = 2 * math.pi * float(cycles - math.floor(cycles))
                # 1e-6: the reduced phase is rounded to float32 (2 pi 2^-24 = 4e-7) before cos and sin; an unreduced
                # one would be off by up to f p 2^-24 cycles, 0.5 rad at 16.7M
                assert abs(float(table[0, 0, n, k, d]) - math.cos(phase)) < 1e-6
                assert abs(float(table[0, 0, n, 3 + k, d]) - math.sin(phase)) < 1e-6


@pytest.mark.parametrize("sign", [1.0, -1.0])  # learned frequencies may turn negative
def test_rotation_angles_are_exact_at_large_positions(sign):
    """position * theta is reduced to less than one turn without losing the angle (float32 frequencies, positions
    past a million): cos and sin against Python's of the exact product (p < 2^24 times a 24-bit mantissa fits
    a float64), 1D and each axis of 2D positions."""
    torch.manual_seed(0)
    frequencies = sign * torch.rand(2, 4)  # (H, U): units 0, 1 follow the row, 2, 3 the column
    axis = torch.tensor([0, 0, 1, 1])
    rows = torch.tensor([[[0, 16_777_215], [7, 1_000_003], [1_000_003, 7], [16_777_215, 0]]])
    for positions, unit_axis in ((rows[..., :1], torch.zeros(4, dtype=torch.long)), (rows, axis)):
        angles = unit_angles(positions, frequencies, unit_axis, torch.float32)
        for h in range(2):
            for n in range(4):
                for u in range(4):
                    exact = float(positions[0, n, unit_axis[u]]) * float(frequencies[h, u])
                    # 1e-6: the reduced angle is rounded to float32 (2 pi 2^-24 = 4e-7) before cos and sin
                    assert abs(math.cos(float(angles[0, h, n, u])) - math.cos(exact)) < 1e-6
                    assert abs(math.sin(float(angles[0, h, n, u])) - math.sin(exact)) < 1e-6


def test_spe_draws_are_random_in_training_and_repeatable_in_eval():
    codes = SineSPECodes(num_heads=2, head_dim=4, num_realizations=8, num_sines=2, seed=7)
    q = torch.randn(1, 2, 5, 4)
    positions = torch.arange(5)[None, :, None]

    def encode():
        return codes.encode(q, positions, codes.draw(), None, True)

    codes.train()
    assert not torch.allclose(encode(), encode())
    codes.eval()
    torch.testing.assert_close(encode(), encode())
    again = SineSPECodes(num_heads=2, head_dim=4, num_realizations=8, num_sines=2, seed=7)
    again.load_state_dict(codes.state_dict())
    torch.testing.assert_close(again.eval().encode(q, positions, again.draw(), None, True), encode())


def test_a_kept_value_is_made_again_after_any_change_of_its_source():
    """``KeptUntilChanged`` (the Householder unit vectors, the rotations' rates, PermuteFormer's log decay, SPE's
    seeded products): one derivation per source state and key; again after an in-place write, new data or another
    tensor; never reused from an inference tensor; never itself an inference tensor."""
    from lrpe_hf.modeling.kept_tensors import KeptUntilChanged

    kept, made = KeptUntilChanged(), []

    def get(source, key=None):
        return kept.get((source,), lambda: made.append(key) or source * 2, key=key)

    source = torch.ones(3)
    assert get(source).tolist() == [2, 2, 2] and get(source) is get(source) and len(made) == 1
    get(source, key="other")
    assert len(made) == 2
    source.add_(1)  # an optimizer step
    assert get(source).tolist() == [4, 4, 4] and len(made) == 3
    source.data = torch.zeros(3)  # what module.to() and a loaded state dict may do
    assert get(source).tolist() == [0, 0, 0] and len(made) == 4
    assert get(torch.zeros(3)).tolist() == [0, 0, 0] and len(made) == 5  # another tensor, equal values
    with torch.inference_mode():
        assert not get(torch.ones(3)).is_inference()  # a later training step may save it for backward
        frozen = torch.ones(3)
        get(frozen), get(frozen)
    assert len(made) == 8  # no version counter to watch: made every time


def test_a_value_kept_for_an_input_is_taken_by_every_view_of_it_until_it_changes():
    """``KeptForInput`` (the positions' rotation factors, shared by the layers): views of one tensor viewed the same
    way take the value made first; another key, another view, an in-place write, another tensor with the same
    values, an inference tensor each make it again; the value is never an inference tensor."""
    from lrpe_hf.modeling.kept_tensors import KeptForInput

    kept, made = KeptForInput(), []

    def get(tensor, key=None):
        return kept.get(tensor, key, lambda: made.append(key) or tensor * 2)

    ids = torch.arange(6)[None]
    first = get(ids[..., None])
    assert get(ids[..., None]) is first and get(ids.expand(1, -1)[..., None]) is first and len(made) == 1
    get(ids[..., None], key="other"), get(ids[:, :3, None])
    assert len(made) == 3
    ids.add_(1)
    assert get(ids[..., None]).flatten().tolist() == [2, 4, 6, 8, 10, 12] and len(made) == 4
    get(torch.arange(1, 7)[None, :, None])
    assert len(made) == 5
    with torch.inference_mode():
        frozen = torch.arange(6)
        get(frozen), get(frozen)
        assert len(made) == 7 and not get(ids[..., None], key="in inference mode").is_inference()


@pytest.mark.parametrize("gated", [False, True])
def test_eval_spe_reuses_its_mixing_until_a_parameter_changes(gated):
    """Without gradients, an eval-mode draw builds sineSPE's mixing matrices once and keeps them across forwards;
    an in-place update of a parameter (an optimizer step, a loaded state dict) rebuilds them. Checked against the
    forward with gradients on, which never reuses them; the gate scales x or the mixing, whichever is smaller."""
    torch.manual_seed(0)
    layer = lrpe_hf.LinearAttention(16, 2, positional_encoding="spe_sine", spe_gated=gated, causal=True).eval()
    codes = layer.shared_codes
    for x in (torch.randn(1, 3, 16), torch.randn(1, 300, 16)):  # x smaller, then larger, than the mixing matrix
        with torch.no_grad():
            first = layer(x)
            codes.amplitudes.mul_(1.5)
            codes.phases.add_(0.3)
            updated = layer(x)
        assert not torch.allclose(first, updated)
        torch.testing.assert_close(updated, layer(x).detach())


def test_spe_built_under_inference_mode_sees_its_parameters_change():
    """Parameters made under ``torch.inference_mode`` have no version counter: the mixing is then rebuilt at
    every forward, never kept stale; and noise drawn under inference_mode is not cached for a later forward with
    gradients, which could not save it for backward."""
    x = torch.randn(1, 5, 16)
    with torch.inference_mode():
        layer = lrpe_hf.LinearAttention(16, 2, positional_encoding="spe_sine", causal=True).eval()
        first = layer(x)
        layer.shared_codes.amplitudes.mul_(2.0)
        assert not torch.allclose(layer(x), first)
    trained = lrpe_hf.LinearAttention(16, 2, positional_encoding="spe_sine", causal=True).eval()
    with torch.inference_mode():
        trained(x)
    trained(x).sum().backward()  # eval mode with gradients after an inference-mode forward: nothing cached is kept
    assert trained.shared_codes.amplitudes.grad is not None


def test_conv_spe_codes_depend_on_position_not_on_the_batch_window():
    """Eval-mode noise is a function of absolute position: a token gets the same codes in any window."""
    codes = ConvSPECodes(num_heads=1, head_dim=4, num_realizations=8, kernel_size=5).eval()
    q = torch.randn(1, 1, 1, 4)
    alone = codes.encode(q, torch.tensor([[[300]]]), codes.draw(), None, True)
    window = codes.encode(
        q.expand(1, 1, 400, 4).contiguous(), torch.arange(400)[None, :, None], codes.draw(), None, True
    )
    torch.testing.assert_close(window[:, :, 300:301], alone)


@pytest.mark.parametrize("batch, code_rows", [(1, 1), (2, 1), (2, 2)])  # rows sharing their codes, or not
def test_conv_spe_code_mixing_has_the_values_and_gradients_of_the_einsum(batch, code_rows):
    """convSPE's sum_d x_d codes_dr, x in the projections' layout and codes as a view with gaps (as the filtered
    noise is), against autograd through the einsum: the values and the gradients of x and of the codes."""
    from lrpe_hf.modeling.positional_spe import CodeMixing

    torch.manual_seed(0)
    x = torch.randn(batch, 7, 3, 4, dtype=torch.float64).transpose(1, 2).requires_grad_()  # (B, H, N, D)
    full = torch.randn(code_rows, 3, 9, 4, 5, dtype=torch.float64, requires_grad=True)
    codes = full[:, :, 2:]  # (B', H, N, D, R)
    ours = CodeMixing.mix(x, codes)
    expected = torch.einsum("bhnd,bhndr->bhnr", x, codes.expand(batch, -1, -1, -1, -1))
    torch.testing.assert_close(ours, expected)
    grad = torch.randn_like(expected)
    for got, want in zip(torch.autograd.grad(ours, (x, full), grad), torch.autograd.grad(expected, (x, full), grad)):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(CodeMixing.mix(x, codes), expected)


# ---------------------------------------------------------------- Performer
def test_performer_features_approximate_the_softmax_kernel():
    torch.manual_seed(0)
    D = 16
    fm = PerformerFeatureMap(D, num_features=8192).double()
    q = 0.5 * torch.randn(20, D, dtype=torch.float64)
    k = 0.5 * torch.randn(20, D, dtype=torch.float64)
    approx = fm(q) @ fm(k).T
    exact = torch.exp(q @ k.T / math.sqrt(D))
    assert float(((approx - exact).abs() / exact).mean()) < 0.05


@pytest.fixture(scope="module")
def performer_draws():
    """A D = 4 map and 3,000 of its projections (draws, m, D)."""
    torch.manual_seed(0)
    fm = PerformerFeatureMap(4)
    return fm, torch.stack([fm.draw_projection() for _ in range(3000)]).double()


@pytest.mark.parametrize(
    "q,k",
    [
        ([1.5, 0.0, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0]),  # the case that exposed QR's sign bias (2.08 against 3.08)
        ([0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, -1.0]),
        ([0.5, -0.5, 0.5, -0.5], [-0.5, 0.5, 0.0, 1.0]),
        ([1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]),
        ([0.3, 0.1, -0.2, 0.4], [0.2, -0.3, 0.5, 0.1]),
    ],
)
def test_performer_features_are_unbiased(q, k, performer_draws):
    """FAVOR+ (Choromanski et al., Lemma 1): E[phi(q) . phi(k)] = exp(q . k / sqrt(D)) over the random features.
    The mean of 3,000 independent draws lies within 4 standard errors of the exact kernel."""
    q, k = torch.tensor(q, dtype=torch.float64), torch.tensor(k, dtype=torch.float64)
    fm, W = performer_draws

    def phi(x):  # the paper's positive random features, with x' = x / D^(1/4)
        x = x / 4**0.25
        return torch.exp(W @ x - x @ x / 2) / math.sqrt(W.shape[1])

    samples = (phi(q) * phi(k)).sum(-1)
    fm.projection = W[-1].clone()  # the module's features are the formula's, for any draw
    torch.testing.assert_close(fm.double()(q), phi(q)[-1])
    exact = math.exp(float(q @ k) / 2.0)
    standard_error = float(samples.std()) / math.sqrt(len(samples))
    assert abs(float(samples.mean()) - exact) < 4 * standard_error, (float(samples.mean()), exact, standard_error)


def test_performer_rows_are_haar_distributed(performer_draws):
    """Each row of an orthogonal block is uniform on the sphere: every entry is positive half of the time."""
    positive = (performer_draws[1] > 0).double().mean(0)
    assert bool(((positive - 0.5).abs() < 0.05).all()), positive


def test_performer_projection_is_fixed_until_redrawn():
    fm = PerformerFeatureMap(8, redraw=True)
    x = torch.randn(3, 8)
    fm.eval()
    torch.testing.assert_close(fm(x), fm(x))
    before = fm(x)
    fm.redraw_projection()
    assert not torch.allclose(fm(x), before)
    assert "projection" in fm.state_dict()


# ---------------------------------------------------------------- permutations
def compose_power(perm, s):
    """pi^s by repeated squaring of index arrays (pi^s(i) = pi(pi(...)))."""
    result = list(range(len(perm)))
    base = list(perm)
    while s:
        if s & 1:
            result = [base[i] for i in result]  # apply base after result: pi^a then pi^b commute
        base = [base[i] for i in base]
        s >>= 1
    return result


def test_permutation_powers_for_any_position():
    torch.manual_seed(0)
    cyclic = CyclicPermutations(num_heads=3, size=64)
    positions = torch.tensor([[0, 1, 2, 999, 100_003, 2**40 + 5]])
    indices = cyclic.power_indices(positions)
    for h in range(3):
        m, st, ln, ix = cyclic.members[h], cyclic.start[h], cyclic.length[h], cyclic.index[h]
        perm = [int(m[st[i] + (ix[i] + 1) % ln[i]]) for i in range(64)]
        assert sorted(perm) == list(range(64))
        for j, s in enumerate(positions[0].tolist()):
            assert indices[0, h, j].tolist() == compose_power(perm, s)


# ---------------------------------------------------------------- absolute embeddings
def test_sinusoidal_embedding_formula():
    emb = SinusoidalPositionEmbedding(8, scale=0.25)
    out = emb(torch.tensor([[0, 3]]))
    expected = [math.sin(3 * 10000 ** (-i / 4)) for i in range(4)] + [math.cos(3 * 10000 ** (-i / 4)) for i in range(4)]
    torch.testing.assert_close(out[0, 1], 0.25 * torch.tensor(expected))


def test_learned_embedding_refuses_positions_beyond_its_table():
    emb = LearnedPositionEmbedding(8, max_positions=16)
    assert emb(torch.arange(16)[None]).shape == (1, 16, 8)
    with pytest.raises(ValueError, match="0..15"):
        emb(torch.arange(17)[None])


def test_rope_rotation_matches_rotary_embedding_torch():
    """A second implementation: rotary-embedding-torch (interleaved pairs, theta_i = 10000^(-2i/m))."""
    rotary = pytest.importorskip("rotary_embedding_torch")
    from lrpe_hf.modeling.positional_rope import RotaryPositionalEncoding

    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 50, 16), torch.randn(2, 1, 50, 16)
    positions = torch.arange(50)[None, :, None].expand(2, -1, -1)
    ours_q, ours_k = RotaryPositionalEncoding(num_heads=1, feature_dim=16).encode_features(q, k, positions)
    oracle = rotary.RotaryEmbedding(dim=16)
    torch.testing.assert_close(ours_q, oracle.rotate_queries_or_keys(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_k, oracle.rotate_queries_or_keys(k), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [6, 7])  # 7: one feature passes through unrotated
@pytest.mark.parametrize("tokens_first", [False, True])  # the projections' layout: pairs read in place (width 6)
@pytest.mark.parametrize("block_elements", [None, 80])  # 80: blocks of 2 tokens (1 at width 7), the last one short
@pytest.mark.parametrize("rows", ["same", "distinct", "one"])  # batch rows sharing their positions or not; one row
@pytest.mark.parametrize("factors", ["cos and sin", "polar"])  # a CPU's unit factors, and a GPU's (one polar)
def test_rotation_of_queries_and_keys_has_the_gradients_of_the_written_out_rotation(
    width, tokens_first, block_elements, rows, factors, monkeypatch
):
    """The lighter backward (outputs turned back by the conjugate factors, the angles recomputed from the positions)
    against autograd through the real 2x2 rotation [e cos - o sin, e sin + o cos], angles position * theta, theta
    learnable as for LRPE's Type 2, in one block of tokens and in several, with the unit factors a CPU makes (cos
    and sin) and a GPU's (polar), for the gradients of q and k together and of either alone; and the plain path
    without autograd (decoding) gives the same rotation."""
    from lrpe_hf.modeling import positional_rope
    from lrpe_hf.modeling.positional_rope import RotateQueriesAndKeys, rotate_queries_and_keys

    if block_elements:
        monkeypatch.setattr(RotateQueriesAndKeys, "BLOCK_ELEMENTS", block_elements)
    if factors == "polar":
        monkeypatch.setattr(positional_rope, "CPU_POLAR_ANGLES", 1 << 62)
    torch.manual_seed(0)

    B = 1 if rows == "one" else 2

    def features():  # (B, 3, 5, width): batch, heads, tokens
        if tokens_first:
            return torch.randn(B, 5, 3, width, dtype=torch.float64).transpose(1, 2).requires_grad_()
        return torch.randn(B, 3, 5, width, dtype=torch.float64, requires_grad=True)

    q, k = features(), features()
    theta = torch.rand(3, 3, dtype=torch.float64, requires_grad=True)  # (heads, pairs)
    positions = (
        torch.randint(0, 40, (1, 5, 1)).expand(B, -1, -1) if rows != "distinct" else torch.randint(0, 40, (2, 5, 1))
    )
    angles = positions.double()[:, None, :, 0, None] * theta[:, None, :]  # (B, 3, 5, 3)

    def written_out(x, cos, sin):
        even, odd, rest = x[..., 0:6:2], x[..., 1:6:2], x[..., 6:]
        rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        return torch.cat([rotated, rest], dim=-1)

    axis = torch.zeros(3, dtype=torch.long)
    ours = rotate_queries_and_keys(q, k, positions, theta, axis)
    expected = written_out(q, angles.cos(), angles.sin()), written_out(k, angles.cos(), angles.sin())
    grads = [torch.randn_like(x) for x in expected]
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        for got, want in zip(rotate_queries_and_keys(q, k, positions, theta, axis), expected):
            torch.testing.assert_close(got, want)
    inputs = (q, k, theta)
    got = torch.autograd.grad(ours, inputs, grads, retain_graph=True)
    want = torch.autograd.grad(expected, inputs, grads, retain_graph=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    # with the rates a module keeps for fixed frequencies (rope's), handed in rather than made: the same numbers but
    # for the rounding of the float64 turns, p (theta / 2 pi) against (p / 2 pi) theta (a few ulps of p theta <= 40)
    from lrpe_hf.modeling.positional_encoding import turn_rates

    rounding = 8 * 40 * torch.finfo(torch.float64).eps
    kept = rotate_queries_and_keys(q, k, positions, theta, axis, rates=turn_rates(theta.detach()))
    for a, b in zip(kept, ours):
        torch.testing.assert_close(a, b, rtol=0, atol=rounding * b.abs().max().item())
    for a, b in zip(torch.autograd.grad(kept, (q, k), grads, retain_graph=True), got[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=rounding * b.abs().max().item())
    for alone in range(2):  # only the queries' output used, then only the keys'
        got = torch.autograd.grad(ours[alone], (inputs[alone], theta), grads[alone], retain_graph=True)
        want = torch.autograd.grad(expected[alone], (inputs[alone], theta), grads[alone], retain_graph=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_layers_with_learnable_angles_share_the_positions_in_turns(monkeypatch):
    """LRPE's learnable angles (Types 1 and 2): each layer's angles are its own, but the positions over 2 pi they
    multiply are made once per forward pass for all layers (and again for other positions, or positions written
    in place); each layer's rotation and angle gradients are the written-out ones."""
    from lrpe_hf.modeling import positional_encoding
    from lrpe_hf.modeling.positional_rope import RotaryPositionalEncoding

    made = []
    derive = positional_encoding.unit_coordinates
    monkeypatch.setattr(positional_encoding, "unit_coordinates", lambda *args: made.append(1) or derive(*args))
    torch.manual_seed(0)
    layers = [RotaryPositionalEncoding(num_heads=3, feature_dim=8, learnable=True).double() for _ in range(3)]
    for layer in layers:
        with torch.no_grad():
            layer.frequencies.mul_(torch.rand_like(layer.frequencies) + 0.5)  # each layer's angles its own
    position_ids = torch.arange(7, 47)[None].expand(2, -1)

    def views():
        return position_ids[..., None].expand(2, -1, -1)

    q, k = (torch.randn(2, 3, 40, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grads = [torch.randn(2, 3, 40, 8, dtype=torch.float64) for _ in range(2)]
    for layer in layers:
        ours = layer.encode_features(q, k, views())
        angles = position_ids[:, None, :, None].double() * layer.frequencies[:, None]  # (B, H, N, 4)
        cos, sin = angles.cos(), angles.sin()
        expected = [
            torch.stack([x[..., 0::2] * cos - x[..., 1::2] * sin, x[..., 0::2] * sin + x[..., 1::2] * cos], -1)
            .flatten(-2) for x in (q, k)
        ]  # fmt: skip
        for got, want in zip(ours, expected):
            torch.testing.assert_close(got, want)
        inputs = (q, k, layer.frequencies)
        for g, w in zip(torch.autograd.grad(ours, inputs, grads), torch.autograd.grad(expected, inputs, grads)):
            torch.testing.assert_close(g, w)
    assert len(made) == 1  # forward and backward of three layers
    position_ids = position_ids.clone()
    layers[0].encode_features(q, k, views())
    position_ids.add_(1)
    layers[1].encode_features(q, k, views())
    assert len(made) == 3


def test_layers_with_fixed_frequencies_share_one_rotation_of_their_positions(monkeypatch):
    """RoPE's fixed frequencies: the layers of a forward pass, each with its own view of the model's positions,
    take the rotation factors the first layer made (one derivation for a whole train step, eval pass or decoding
    step), and each layer's rotation and gradients are the written-out 2x2 rotation's. A layer with other
    frequencies, positions written in place, or other positions with the same values get factors of their own, and
    a layer whose fixed frequencies were written over rotates by its own values."""
    from lrpe_hf.modeling import positional_rope
    from lrpe_hf.modeling.positional_rope import RotaryPositionalEncoding

    made = []

    def counted(derive):
        return lambda *args: made.append(1) or derive(*args)

    for name in ("unit_factors", "few_factors"):  # the derivations of the factors: full, and a decoding step's
        monkeypatch.setattr(positional_rope, name, counted(getattr(positional_rope, name)))
    torch.manual_seed(0)
    layers = [RotaryPositionalEncoding(num_heads=3, feature_dim=8).double() for _ in range(3)]
    position_ids = torch.arange(7, 47)[None].expand(2, -1)  # (B, N): what a model hands every layer

    def views():  # each layer's own (B, N, 1) view, as the attention takes it
        return position_ids[..., None].expand(2, -1, -1)

    def written_out(x, positions, layer=layers[0]):  # the layer's ladder as stored (float32, then float64)
        theta = layer.frequencies[0]
        angles = positions[..., 0, None].double()[:, None] * theta  # (B, 1, N, 4)
        even, odd = x[..., 0::2], x[..., 1::2]
        cos, sin = angles.cos(), angles.sin()
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    q, k = (torch.randn(2, 3, 40, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grads = [torch.randn(2, 3, 40, 8, dtype=torch.float64) for _ in range(2)]
    for layer in layers:  # a train step: forward and backward through every layer
        ours = layer.encode_features(q, k, views())
        expected = [written_out(x, views()) for x in (q, k)]
        for got, want in zip(ours, expected):
            torch.testing.assert_close(got, want)
        got = torch.autograd.grad(ours, (q, k), grads)
        for g, w in zip(got, torch.autograd.grad(expected, (q, k), grads)):
            torch.testing.assert_close(g, w)
    assert len(made) == 1
    with torch.no_grad():  # an evaluation, then a decoding step's few angles
        for layer in layers:
            for got, want in zip(layer.encode_features(q, k, views()), (written_out(x, views()) for x in (q, k))):
                torch.testing.assert_close(got, want)
        last = position_ids[:, -1:]
        for layer in layers:
            step = layer.encode_features(q[:, :, -1:], k[:, :, -1:], last[..., None])
            torch.testing.assert_close(step[0], written_out(q, views())[:, :, -1:])
        assert len(made) == 3
        other = RotaryPositionalEncoding(num_heads=3, feature_dim=8, base=100.0).double()
        torch.testing.assert_close(other.encode_features(q, k, views())[0], written_out(q, views(), other))
        position_ids = position_ids.clone()
        for layer in layers[:2]:
            layer.encode_features(q, k, views())
        position_ids[1].add_(5)  # written in place: the same tensor, other values
        torch.testing.assert_close(layers[2].encode_features(q, k, views())[0], written_out(q, views()))
        position_ids = position_ids.clone()  # equal values, another tensor: made again, not read on the host
        layers[0].encode_features(q, k, views())
        assert len(made) == 7
        layers[1].frequencies[1:].mul_(0.5)  # written over (its heads now differ): rotated by its own values
        theta = layers[1].frequencies[:, None, None, :].double()  # (H, 1, 1, 4)
        angles = position_ids[:, None, :, None].double() * theta.transpose(0, 1)  # (B, H, N, 4)
        even, odd = q[..., 0::2], q[..., 1::2]
        own = torch.stack([even * angles.cos() - odd * angles.sin(), even * angles.sin() + odd * angles.cos()], -1)
        torch.testing.assert_close(layers[1].encode_features(q, k, views())[0], own.flatten(-2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rotation_is_the_float64_rotation_rounded_once(dtype):
    """Half-precision q and k are rotated as complex products in float32 and rounded once into their dtype (the
    real form rounded cos and sin to half precision first): with and without a gradient, and a decoding step, each
    output lies within one rounding (half an ulp, plus float32's own rounding where an output cancels far below its
    inputs) of the float64 rotation of the same inputs, and the gradients of q, k and theta match the float64
    rotation's."""
    from lrpe_hf.modeling.positional_rope import rotate_queries_and_keys

    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, 40, 9, dtype=dtype, requires_grad=True) for _ in range(2))  # 9: one passes through
    theta = torch.rand(3, 4, requires_grad=True)
    axis, positions = torch.zeros(4, dtype=torch.long), torch.arange(40)[None, :, None].expand(2, -1, -1)
    angles = positions.double()[:, None, :, 0, None] * theta.double()[:, None, :]  # (2, 3, 40, 4)

    def exact(x):  # float64, the written-out 2x2 rotation of the first 4 pairs
        x = x.double()
        even, odd, rest = x[..., 0:8:2], x[..., 1:8:2], x[..., 8:]
        cos, sin = angles.cos(), angles.sin()
        return torch.cat([torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2), rest], -1)

    unit = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]  # the ulp of [1, 2): 8 and 11 bits

    def rounded_once(got, want):  # within half an ulp of the exact value (the ulp of the binade it lies in), plus
        # float32's rounding of the products (inputs below 4: 2^-21), seen where an output cancels far below them
        mantissa, exponent = torch.frexp(want)  # |want| in [2^(e-1), 2^e): ulp unit * 2^(e-1)
        ulp = (unit * torch.exp2(exponent.double() - 1)).clamp_min(2.0**-24 if dtype == torch.float16 else 0)
        return ((got.double() - want).abs() <= ulp / 2 * 1.001 + 2.0**-21).all()

    expected = exact(q), exact(k)
    for got, want in zip(rotate_queries_and_keys(q, k, positions, theta, axis), expected):
        assert got.dtype == dtype and rounded_once(got, want)
    with torch.no_grad():
        for got, want in zip(rotate_queries_and_keys(q, k, positions, theta, axis), expected):
            assert rounded_once(got, want)
        last = positions[:, -1:]
        for got, want in zip(rotate_queries_and_keys(q[:, :, -1:], k[:, :, -1:], last, theta, axis), expected):
            assert rounded_once(got, want[:, :, -1:])
    grads = [torch.randn(2, 3, 40, 9, dtype=torch.float64) for _ in range(2)]
    ours = rotate_queries_and_keys(q, k, positions, theta, axis)
    got = torch.autograd.grad(sum((y.double() * g).sum() for y, g in zip(ours, grads)), (q, k, theta))
    want = torch.autograd.grad(sum((y * g).sum() for y, g in zip(expected, grads)), (q, k, theta))
    for g, w in zip(got[:2], want[:2]):  # the gradient rotated back, rounded once
        torch.testing.assert_close(g.double(), w.double(), atol=unit * 4, rtol=unit)
    # theta's: sum over rows and tokens of position x (grad_odd y_even - grad_even y_odd), y the outputs; each y and
    # each grad reaches it rounded to half precision (at most unit / 2 relative), so the error is within unit x
    # the sum of position x (|grad_odd y_even| + |grad_even y_odd|)
    terms = sum(
        g[..., 1:8:2].abs() * y[..., 0:8:2].abs() + g[..., 0:8:2].abs() * y[..., 1:8:2].abs()
        for y, g in zip(expected, grads)
    )
    bound = unit * (positions.double()[:, None, :, 0, None] * terms.detach()).sum((0, 2))  # (heads, pairs)
    assert ((got[2].double() - want[2].double()).abs() <= bound).all()


@pytest.mark.parametrize("position_dims", [1, 2])
def test_a_decoding_steps_rotation_matches_the_turn_reduced_rotation_far_out(position_dims, monkeypatch):
    """A decoding step's few angles take ``rotate_few``'s factors (unreduced float64 angles, one polar, products
    rounded once); every other no-gradient call reduces the angles in turns first (``unit_angles``). At positions
    near 10^6, in float64 features, the two agree to 1e-9; in float32 each output is the float64 rotation rounded
    once (within half a float32 ulp of it); and the encoding's own call takes those factors (``few_factors``) for
    one token, not for many."""
    from lrpe_hf.modeling import positional_rope
    from lrpe_hf.modeling.positional_encoding import axis_of_each, unit_angles

    torch.manual_seed(0)
    theta = positional_rope.rotary_frequencies(8, 10000.0, position_dims).repeat(2, 1)  # (2 heads, 8 pairs)
    theta[:, 0] = 1.0  # the fastest pair turns a radian per position: about 160,000 turns at 10^6
    axis = axis_of_each(8, position_dims)
    positions = torch.randint(999_000, 1_000_000, (3, 1, position_dims))  # 3 rows, one token each
    q, k = torch.randn(3, 2, 1, 17, dtype=torch.float64), torch.randn(3, 2, 1, 17, dtype=torch.float64)  # 17: one
    reduced = positional_rope.rotate_by_angles(q, k, unit_angles(positions, theta, axis, torch.float64))  # passes
    for got, want in zip(positional_rope.rotate_few(q, k, positions, theta, axis), reduced):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    q32, k32 = q.float(), k.float()
    exact = positional_rope.rotate_few(q32.double(), k32.double(), positions, theta, axis)  # the same inputs
    for got, want in zip(positional_rope.rotate_few(q32, k32, positions, theta, axis), exact):
        assert got.dtype == torch.float32
        rounded = want.float()
        half_ulp = (torch.nextafter(rounded.abs(), torch.tensor(float("inf"))) - rounded.abs()).double() / 2
        assert ((got.double() - want).abs() <= half_ulp * 1.001 + 1e-12).all()
    calls, few_factors = [], positional_rope.few_factors
    monkeypatch.setattr(positional_rope, "few_factors", lambda *a: calls.append(a) or few_factors(*a))
    encoding = positional_rope.RotaryPositionalEncoding(2, 16, position_dims=position_dims)
    q16, k16 = q[..., :16], k[..., :16]
    with torch.no_grad():
        encoding.encode_features(q16, k16, positions)
        assert len(calls) == 1 and torch.equal(calls[0][2], encoding.axis)  # one token a row: the few-angle path
        many = torch.randint(0, 1000, (1, 4096, position_dims))
        assert not positional_rope.few_angles(many, theta)
        encoding.encode_features(torch.randn(1, 2, 4096, 16), torch.randn(1, 2, 4096, 16), many)
        assert len(calls) == 1


def test_a_decoding_steps_unitary_lift_is_the_float64_lift_rounded_once_far_out():
    """LRPE Type 1 in a decoding step (few angles, no gradient): [x cos(s alpha), x sin(s alpha)] from unreduced
    float64 angles, each product rounded once into float32: within half a float32 ulp of the float64 lift of the
    same inputs at positions near 10^6, apart and stacked along the heads alike."""
    from torch import nn

    from lrpe_hf.modeling.positional_lrpe import LRPEUnitary

    torch.manual_seed(0)
    encoding = LRPEUnitary(num_heads=2, feature_dim=8, p=nn.Identity())
    with torch.no_grad():
        encoding.angles[:, 0] = 1.0  # a radian per position: about 160,000 turns at 10^6
    positions = torch.randint(999_000, 1_000_000, (3, 1, 1))
    q, k = torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8)
    angles = positions.double()[:, None, :, 0, None] * encoding.angles.detach().double()[:, None, :]  # (3, 2, 1, 8)

    def exact(x):
        return torch.cat([x.double() * angles.cos(), x.double() * angles.sin()], dim=-1)

    def within_half_ulp(got, want):
        rounded = want.float()
        half_ulp = (torch.nextafter(rounded.abs(), torch.tensor(float("inf"))) - rounded.abs()).double() / 2
        return ((got.double() - want).abs() <= half_ulp * 1.001 + 1e-12).all()

    with torch.no_grad():
        apart = encoding.encode_features(q, k, positions)
        stacked = encoding.encode_stacked(torch.cat([q, k], dim=1), positions)
    for got, want in zip((*apart, stacked[:, :2], stacked[:, 2:]), (exact(q), exact(k), exact(q), exact(k))):
        assert got.dtype == torch.float32 and within_half_ulp(got, want)


@pytest.mark.parametrize("position_dims, same_rows", [(1, True), (1, False), (2, False)])
@pytest.mark.parametrize("block_elements", [None, 40])  # 40: blocks of one token
def test_unitary_lift_has_the_gradients_of_the_written_out_lift(position_dims, same_rows, block_elements, monkeypatch):
    """LRPE Type 1's [x cos, x sin], x = q, k, with angles position * alpha and the lighter backward (x read back
    from the outputs, the angles recomputed from the positions) against autograd through the written-out
    expression: the gradients of q, k and the learnable alpha, also when only the keys' output is used; 1D and
    2D positions, rows sharing them or not; in one block of tokens and in several."""
    from lrpe_hf.modeling.positional_encoding import axis_of_each
    from lrpe_hf.modeling.positional_lrpe import UnitaryLift

    if block_elements:
        monkeypatch.setattr(UnitaryLift, "BLOCK_ELEMENTS", block_elements)
    torch.manual_seed(0)
    B, H, N, m = 2, 3, 5, 4
    q, k = (torch.randn(B, H, N, m, dtype=torch.float64, requires_grad=True) for _ in range(2))
    alpha = torch.rand(H, m, dtype=torch.float64, requires_grad=True)
    axis = axis_of_each(m, position_dims)
    positions = torch.randint(0, 40, (1 if same_rows else B, N, position_dims))
    ours = UnitaryLift.apply(q, k, positions.expand(B, -1, -1), alpha, axis, None)
    angles = positions.double()[:, None, :, axis] * alpha[:, None, :]  # (B', H, N, m)
    expected = [torch.cat([x * angles.cos(), x * angles.sin()], dim=-1) for x in (q, k)]
    grads = [torch.randn_like(x) for x in expected]
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want)
    for g, w in zip(
        torch.autograd.grad(ours, (q, k, alpha), grads, retain_graph=True),
        torch.autograd.grad(expected, (q, k, alpha), grads, retain_graph=True),
    ):
        torch.testing.assert_close(g, w)
    keys_only = torch.autograd.grad(ours[1], (k, alpha), grads[1])
    for g, w in zip(keys_only, torch.autograd.grad(expected[1], (k, alpha), grads[1])):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("tokens_first", [True, False])  # the projections' layout (read in place), and heads first
def test_householder_p_has_the_values_and_gradients_of_its_matrix(learnable, tokens_first):
    """LRPE's Householder P, x -> x - 2 (x . v) v / |v|^2 per head (fixed v: the backward that reflects the gradient;
    learnable v: autograd), against the explicit matrix I - 2 v v^T / v^T v applied by a matmul, values and the
    gradients of x (two rows, in the projections' layout or heads first) and of v."""
    from lrpe_hf.modeling.positional_lrpe import HouseholderReflection

    torch.manual_seed(0)
    p = HouseholderReflection(num_heads=3, dim=5, learnable=learnable).double()
    with torch.no_grad():
        p.vector.mul_(2.5)  # not unit length: the normalisation is part of P
    if tokens_first:
        x = torch.randn(2, 7, 3, 5, dtype=torch.float64).transpose(1, 2).requires_grad_()
    else:
        x = torch.randn(2, 3, 7, 5, dtype=torch.float64, requires_grad=True)
    v = p.vector
    matrices = torch.eye(5, dtype=torch.float64) - 2 * v[:, :, None] * v[:, None, :] / (v * v).sum(-1)[:, None, None]
    expected = x @ matrices.transpose(-1, -2)[None]
    ours = p(x)
    torch.testing.assert_close(ours, expected)
    grad = torch.randn_like(ours)
    inputs = (x, v) if learnable else (x,)
    for got, want in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("same_rows", [True, False])
@pytest.mark.parametrize("block_elements", [None, 40])  # 40: blocks of 2 tokens (1 with distinct rows)
def test_permutation_powers_have_the_gradients_of_gather(same_rows, block_elements, monkeypatch):
    """P_pi^s q and P_pi^s k, a block of tokens at a time, with the backward that permutes the gradients by
    pi^-s, against autograd through gather with the indices written out; batch rows sharing their positions or
    not; q and k in the projections' (tokens, heads) layout."""
    from lrpe_hf.modeling.positional_permute import CyclicPermutations

    if block_elements:
        monkeypatch.setattr(CyclicPermutations, "BLOCK_ELEMENTS", block_elements)
    torch.manual_seed(0)
    permutations = CyclicPermutations(num_heads=3, size=6, seed=1)
    q, k = (torch.randn(2, 7, 3, 6, dtype=torch.float64).transpose(1, 2).requires_grad_() for _ in range(2))
    positions = torch.arange(7)[None].repeat(2, 1) + (0 if same_rows else torch.tensor([[0], [40]]))
    ours = permutations.apply(q, k, positions)
    index = permutations.power_indices(positions)  # (B, H, N, size): pi_h^s(i)
    expected = q.gather(-1, index), k.gather(-1, index)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want)
    grads = [torch.randn_like(x) for x in expected]
    for g, w in zip(torch.autograd.grad(ours, (q, k), grads), torch.autograd.grad(expected, (q, k), grads)):
        torch.testing.assert_close(g, w)


# ---------------------------------------------------------------- language-modelling loss
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_items", [None, 7])
def test_causal_lm_loss_equals_transformers_for_causal_lm_loss(dtype, num_items):
    """Value and gradient against Transformers' own ForCausalLMLoss (F.cross_entropy), ignored labels included,
    over more rows than one block."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lrpe_hf.modeling import lm_loss

    torch.manual_seed(0)
    logits = (3 * torch.randn(3, lm_loss.ROWS_PER_BLOCK // 2 + 5, 37)).to(dtype).requires_grad_()
    labels = torch.randint(0, 37, logits.shape[:2])
    labels[0, :10] = -100
    labels[2, 100:] = -100
    ours = lm_loss.causal_lm_loss(logits, labels, 37, num_items_in_batch=num_items)
    theirs = ForCausalLMLoss(logits, labels, 37, num_items_in_batch=num_items)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    grad_ours, grad_theirs = (torch.autograd.grad(loss, logits)[0] for loss in (ours, theirs))
    assert grad_ours.dtype == dtype
    torch.testing.assert_close(grad_ours.float(), grad_theirs.float(), atol=1e-6, rtol=0.01)
    shifted = torch.randint(0, 37, labels.shape)  # labels given already shifted
    torch.testing.assert_close(
        lm_loss.causal_lm_loss(logits, None, 37, shift_labels=shifted),
        ForCausalLMLoss(logits, None, 37, shift_labels=shifted),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("autocast", [False, True])
def test_causal_lm_loss_from_the_head_input_has_the_gradients_of_transformers_loss(autocast):
    """Given the head's input and weight, backward recomputes the logits in blocks: the gradients of hidden and
    weight equal those through Transformers' ForCausalLMLoss on F.linear(hidden, weight), in float32 and under
    bfloat16 autocast (where both recompute the same bfloat16 logits)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lrpe_hf.modeling import lm_loss

    torch.manual_seed(0)
    hidden = torch.randn(2, lm_loss.ROWS_PER_BLOCK // 2 + 5, 16, requires_grad=True)
    weight = (0.5 * torch.randn(37, 16)).requires_grad_()
    labels = torch.randint(0, 37, hidden.shape[:2])
    labels[0, :10] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = F.linear(hidden, weight)
        ours = lm_loss.causal_lm_loss(logits, labels, 37, num_items_in_batch=11, hidden=hidden, weight=weight)
        theirs = ForCausalLMLoss(logits, labels, 37, num_items_in_batch=11)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    got, want = (torch.autograd.grad(loss, (hidden, weight), retain_graph=True) for loss in (ours, theirs))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        # under bfloat16 autocast Transformers' weight gradient is one bfloat16 product over every row, ours a
        # float32 sum of per-block products: they differ by bfloat16's rounding (2^-8) of the largest terms
        bf16_rounding = dict(atol=2**-8 * w.abs().max().item(), rtol=2**-8)
        torch.testing.assert_close(g, w, **(bf16_rounding if autocast else dict(atol=1e-6, rtol=1e-5)))


def test_causal_lm_model_loss_and_gradients_equal_transformers_loss_on_its_logits():
    """LinearGPTForCausalLM's own loss (recomputing its head in backward) against ForCausalLMLoss applied to the
    logits it returns: the loss and every parameter's gradient."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM

    torch.manual_seed(0)
    config = LinearGPTConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=20
    )
    model = LinearGPTForCausalLM(config)
    ids = torch.randint(0, 20, (2, 6))
    out = model(input_ids=ids, labels=ids)
    theirs = ForCausalLMLoss(out.logits, ids, 20)
    torch.testing.assert_close(out.loss, theirs)
    params = [p for p in model.parameters() if p.requires_grad]
    got, want = (torch.autograd.grad(loss, params, retain_graph=True) for loss in (out.loss, theirs))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_causal_lm_loss_of_no_counted_token_is_nan_like_cross_entropy():
    from lrpe_hf.modeling.lm_loss import causal_lm_loss

    assert torch.isnan(causal_lm_loss(torch.randn(1, 4, 5), torch.full((1, 4), -100), 5))


def test_causal_lm_loss_ignores_non_finite_logits_of_ignored_rows():
    """An ignored row may hold -inf or inf (a masked vocabulary, an overflow on padding): no nan may leak."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lrpe_hf.modeling.lm_loss import causal_lm_loss

    logits = torch.randn(1, 5, 7)
    logits[0, 1, 0], logits[0, 3] = float("-inf"), float("inf")
    logits.requires_grad_()
    labels = torch.tensor([[1, 2, -100, 4, -100]])  # rows 1 and 3 predict the ignored labels 2 and 4
    ours = causal_lm_loss(logits, labels, 7)
    torch.testing.assert_close(ours, ForCausalLMLoss(logits.detach(), labels, 7))
    (grad,) = torch.autograd.grad(ours, logits)
    assert torch.isfinite(grad).all() and (grad[0, 1] == 0).all() and (grad[0, 3] == 0).all()


def test_a_user_loss_function_replaces_the_default_causal_lm_loss():
    from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM

    model = LinearGPTForCausalLM(
        LinearGPTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=20)
    )
    ids = torch.randint(0, 20, (2, 6))
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum() * 0 + 42.0
    assert float(model(input_ids=ids, labels=ids).loss.detach()) == 42.0


# ---------------------------------------------------------------- dropout
def test_dropout_drops_at_rate_p_scales_the_rest_and_keeps_a_one_byte_mask():
    """Inverted dropout (kept values / (1 - p), gradient the same mask), identity in eval mode, and a bool mask
    (not a float one) saved for backward."""
    from lrpe_hf.modeling.transformer_layer import Dropout

    torch.manual_seed(0)
    x = torch.randn(256, 512, requires_grad=True)
    dropout = Dropout(0.25).train()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = dropout(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    torch.testing.assert_close(grad, kept.float() / 0.75)
    assert [t.dtype for t in saved] == [torch.bool]
    assert dropout.eval()(x) is x
    assert torch.all(Dropout(1.0).train()(x) == 0)


@pytest.mark.parametrize("name", ["elu", "relu"])
def test_feature_maps_written_into_their_inputs_equal_the_plain_maps(name):
    """With ``reuse_inputs`` and no gradient wanted (evaluation, decoding), elu and relu write phi into q and k:
    the same features as the plain map, in the projections' layout; with a gradient wanted, q and k stay."""
    feature_map = lrpe_hf.LinearAttention(24, 3, feature_map=name).feature_map
    q, k = (torch.randn(2, 5, 3, 8).transpose(1, 2) for _ in "qk")  # (B, H, N, D) as the projections give them
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    expected = feature_map.features(q, k, mask)
    with torch.no_grad():
        reused = q.clone(), k.clone()
        got = feature_map.features(*reused, mask, reuse_inputs=True)
    torch.testing.assert_close(got.query, expected.query)
    torch.testing.assert_close(got.key, expected.key)
    assert got.query.data_ptr() == reused[0].data_ptr()
    wanting = q.clone().requires_grad_(), k.clone().requires_grad_()
    feature_map.features(*wanting, mask, reuse_inputs=True)
    torch.testing.assert_close(wanting[0].detach(), q)
    torch.testing.assert_close(wanting[1].detach(), k)


def test_the_layer_lets_the_feature_map_overwrite_only_its_own_projections():
    """An encoding's ``encode_query_key`` may return tensors it keeps (here: stores): the layer then keeps the
    feature map from writing into them, while the projections' own outputs are reused."""

    class KeepsItsOutputs(lrpe_hf.PositionalEncoding):
        def encode_query_key(self, q, k, positions, shared_draw=None):
            self.kept = q * 2, k * 2
            return self.kept

    layer = lrpe_hf.LinearAttention(24, 3, causal=True).eval()
    layer.positional_encoding = KeepsItsOutputs()
    x = torch.randn(2, 5, 24)
    with torch.no_grad():
        layer(x)
        q, k, _ = layer.qkv_proj(x).view(2, 5, 3, 3, 8).transpose(1, 3).unbind(2)  # rows: q's, k's, v's
        for kept, projected in zip(layer.positional_encoding.kept, (q, k)):
            torch.testing.assert_close(kept, 2 * projected)


@pytest.mark.parametrize(
    "encoding, options",
    [
        ("none", {}), ("rope", {}), ("lrpe_orthogonal", {}), ("lrpe_unitary", {}),
        ("lrpe_orthogonal", {"lrpe_p_matrix": "dct"}),  # a P without its own ``stacked``: the (2B, H) view
        ("rope", {"feature_map": "hedgehog"}),  # a map with per-head parameters
        ("permute", {}), ("lrpe_permutation", {}),
        ("fastrpb", {}),  # no ``encode_stacked`` of its own
    ],
)  # fmt: skip
def test_a_decoding_step_with_queries_and_keys_stacked_equals_the_step_with_them_apart(encoding, options, monkeypatch):
    """The encodings that transform q and k as one tensor in a decoding step (``encode_stacked``) give what their
    ``encode_features`` gives (a left-padded row included); one that does not override it is never handed one."""
    from lrpe_hf import LinearAttentionCache, LinearGPTConfig, LinearGPTForCausalLM
    from lrpe_hf.modeling.kernel_attention import KernelAttention

    config = LinearGPTConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        positional_encoding=encoding, hidden_dropout_prob=0.0, **options,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(config).eval()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    original, taken = KernelAttention.stacks, []

    def spy(self, q, k, encoding):
        taken.append(original(self, q, k, encoding))
        return taken[-1]

    def steps():
        cache = LinearAttentionCache(config.num_hidden_layers)
        with torch.no_grad():
            model(ids, attention_mask=mask[:, :7], past_key_values=cache, use_cache=True)
            first = model(ids[:, -1:], attention_mask=mask[:, :8], past_key_values=cache, use_cache=True).logits
            second = model(ids[:, -2:-1], attention_mask=mask, past_key_values=cache, use_cache=True).logits
        return torch.cat([first, second], dim=1)

    monkeypatch.setattr(KernelAttention, "stacks", spy)
    stacked = steps()
    stacks = model.model.stack.layers[0].self_attn.positional_encoding.stacks_features
    assert taken and any(taken) == stacks and stacks == (encoding != "fastrpb")
    monkeypatch.setattr(KernelAttention, "stacks", lambda self, q, k, encoding: False)
    # the same ops on the same numbers: equal to the bit, but where the DCT matrix multiplies 2B rows at once, which
    # its GEMM may sum in another order (a float32 ulp)
    exact = options.get("lrpe_p_matrix") != "dct"
    torch.testing.assert_close(stacked, steps(), rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)


def heads_apart(layer):
    """The layer's ``heads`` as three projections apart, each by its own rows of ``qkv_proj`` (q's, k's, v's), each
    output in memory of its own: the reference for the one projection."""

    def heads(hidden_states, mask, values=None):
        B, N, _ = hidden_states.shape
        biases = (None,) * 3 if layer.qkv_proj.bias is None else layer.qkv_proj.bias.chunk(3)
        q, k, v = (
            F.linear(hidden_states, weight, bias).view(B, N, layer.num_heads, layer.head_dim).transpose(1, 2)
            for weight, bias in zip(layer.qkv_proj.weight.chunk(3), biases)
        )  # fmt: skip
        return q, k, v if mask is None else v.masked_fill(~mask[:, None, :, None], 0.0)

    return heads


@pytest.mark.parametrize("bias", [True, False])
def test_one_input_projection_gives_the_values_and_gradients_of_three_apart(bias, monkeypatch):
    """The layer projects q, k and v in one product (``qkv_proj``, rows q's, k's, v's): its output and every
    parameter's gradient are those of three projections apart, with one linear op where three would be, in
    training and without a gradient."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layer = lrpe_hf.LinearAttention(16, 2, positional_encoding="lrpe_orthogonal", causal=True, bias=bias).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    grad = torch.randn(2, 9, 16, dtype=torch.float64)
    parameters = [x, *(p for p in layer.parameters() if p.requires_grad)]

    def linear_ops(step):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = step()
        return result, sum(e.name == "aten::linear" for e in prof.events())

    def forward():
        return layer(x, attention_mask=mask)

    joined, joined_linear = linear_ops(forward)
    joined_grads = torch.autograd.grad(joined, parameters, grad)
    with torch.no_grad():
        joined_without_gradient = linear_ops(forward)
    monkeypatch.setattr(layer, "heads", heads_apart(layer))
    apart = forward()
    torch.testing.assert_close(joined, apart)
    for got, want in zip(joined_grads, torch.autograd.grad(apart, parameters, grad)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(joined_without_gradient[0], apart)
    assert (joined_linear, joined_without_gradient[1]) == (2, 2)  # q, k and v in one, and the output projection


@pytest.mark.parametrize(
    "encoding",
    [
        "lrpe_orthogonal",
        "lrpe_unitary",
        "lrpe_permutation",
        "none",
        "rope",
        "permute",
        "fastrpb",
        "spe_sine",
        "spe_conv",
    ],
)
def test_one_input_projection_keeps_no_more_memory_for_backward_than_projections_apart(encoding, monkeypatch):
    """A train step with q, k and v from one projection keeps no more bytes for backward than with three apart
    (``heads_apart``): the memory behind every tensor autograd saves, each storage counted once. A v that stayed a
    view of the joined output kept q's and k's columns alive until backward (3x v's memory a layer: 7% of the
    default's peak at 8k). SPE keeps q and k themselves, views of the joined output, so a copy of v there kept one
    v more."""
    torch.manual_seed(0)
    layer = lrpe_hf.LinearAttention(64, 4, positional_encoding=encoding, causal=True, max_positions=64)
    x = torch.randn(2, 64, 64, requires_grad=True)

    def saved_bytes():
        storages = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(x)
        return sum(storages.values())

    joined = saved_bytes()
    monkeypatch.setattr(layer, "heads", heads_apart(layer))
    assert joined <= saved_bytes()
