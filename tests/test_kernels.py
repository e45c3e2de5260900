"""The linear-attention products, the MLP and the elu feature map: values and gradients against plain formulas."""

import pytest
import torch

from lrpe_hf.modeling import attention_kernels
from lrpe_hf.modeling.attention_kernels import bidirectional_linear_attention, causal_linear_attention
from lrpe_hf.modeling.feature_maps import EluFeatureMap, ReluFeatureMap
from lrpe_hf.modeling.kernel_attention import DivideByDenominator, nonzero
from lrpe_hf.modeling.transformer_layer import MLP


def quadratic_causal(q, k, v, log_gates, initial, resets):
    """out_s = sum_{t<=s, same document} exp(G_s - G_t) (q_s . k_t) v_t + exp(G_s) q_s S_0 (S_0 only before the
    first reset), and the final state, by explicit N x N products."""
    N = q.shape[2]
    G = log_gates.cumsum(-1) if log_gates is not None else q.new_zeros(q.shape[:3])
    allowed = torch.ones(N, N, dtype=torch.bool).tril()[None, None]
    reaches_start = torch.ones(q.shape[0], 1, N, dtype=torch.bool)
    if resets is not None:
        document = resets.long().cumsum(-1)[:, None]  # (B, 1, N)
        allowed = allowed & (document[..., :, None] == document[..., None, :])
        reaches_start = document == 0
    weights = (G[..., :, None] - G[..., None, :]).exp() * allowed
    out = ((q @ k.transpose(-1, -2)) * weights) @ v
    to_end = (G[..., -1:] - G).exp() * (allowed[..., -1, :] if resets is not None else 1)
    final = (k * to_end[..., None]).transpose(-1, -2) @ v
    if initial is not None:
        from_start = (G.exp() * reaches_start)[..., None]
        out = out + (q * from_start) @ initial
        final = final + initial * (G[..., -1:, None].exp() * reaches_start[..., -1:, None])
    return out, final


@pytest.mark.parametrize("num_tokens, chunk_size", [(29, 1), (29, 4), (29, 7), (29, 64), (1, 64)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("with_resets", [False, True])
def test_causal_values_and_gradients_equal_the_quadratic_formula(
    num_tokens, chunk_size, gated, with_initial, with_resets
):
    check_causal_against_quadratic(num_tokens, chunk_size, gated, with_initial, with_resets)


@pytest.mark.parametrize("heads_at_once", [1, 4])
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("gated, with_resets", [(False, False), (True, False), (True, True)])
def test_causal_product_in_blocks_of_heads_equals_the_quadratic_formula(
    heads_at_once, with_initial, gated, with_resets, monkeypatch
):
    """Long inputs go through the chunked products a few heads at a time (6 heads: blocks of 1, and of 4 then 2),
    documents' visibility following each head's batch row."""
    monkeypatch.setattr(attention_kernels, "heads_per_block", lambda *shape: heads_at_once)
    check_causal_against_quadratic(29, 4, gated, with_initial, with_resets)


def check_causal_against_quadratic(num_tokens, chunk_size, gated, with_initial, with_resets):
    torch.manual_seed(0)
    B, H, N, m, dv = 2, 3, num_tokens, 5, 6
    q, k = (torch.rand(B, H, N, m, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, N, dv, dtype=torch.float64, requires_grad=True)
    gates = (-torch.rand(B, H, N, dtype=torch.float64)).requires_grad_() if gated else None
    initial = torch.randn(B, H, m, dv, dtype=torch.float64, requires_grad=True) if with_initial else None
    resets = (torch.rand(B, N) < (0.15 if N > 1 else 0.5)) if with_resets else None
    inputs = [x for x in (q, k, v, gates, initial) if x is not None]

    out, final = causal_linear_attention(q, k, v, gates, initial, chunk_size, resets)
    expected_out, expected_final = quadratic_causal(q, k, v, gates, initial, resets)
    torch.testing.assert_close(out, expected_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final, expected_final, atol=1e-10, rtol=1e-10)
    grad_out, grad_final = torch.randn_like(out), torch.randn_like(final)
    for with_final in (True, False):  # the final state used downstream, or not
        loss = (out * grad_out).sum() + with_final * (final * grad_final).sum()
        expected_loss = (expected_out * grad_out).sum() + with_final * (expected_final * grad_final).sum()
        grads = torch.autograd.grad(loss, inputs, retain_graph=True, materialize_grads=True)  # a first gate is unused
        expected = torch.autograd.grad(expected_loss, inputs, retain_graph=True)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_bidirectional_values_and_gradients_equal_the_quadratic_formula():
    torch.manual_seed(0)
    q, k = (torch.rand(2, 3, 17, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 17, 6, dtype=torch.float64, requires_grad=True)
    out = bidirectional_linear_attention(q, k, v)
    expected = (q @ k.transpose(-1, -2)) @ v
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
def test_mlp_that_recomputes_its_activation_has_the_plain_gradients(activation):
    torch.manual_seed(0)
    mlp = MLP(6, 10, activation).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    out = mlp(x)
    expected = mlp.fc2(mlp.activation(mlp.fc1(x)))
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    inputs = (x, *mlp.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(got, want)


def test_shifted_elu_feature_map_is_contiguous_with_the_plain_gradient():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 5, dtype=torch.float64).transpose(1, 2).requires_grad_()  # heads not leading
    x.data[0, 0, 0, :2] = 0.0  # the kink at 0: derivative 1
    out = EluFeatureMap(5)(x)
    expected = torch.nn.functional.elu(x) + 1.0
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])


def test_shifted_relu_feature_map_is_contiguous_with_the_plain_gradient():
    """max(x, 0) + eps (PermuteFormer eq. 15) through its one-byte-mask backward, against autograd; x = 0 takes
    relu's derivative 0, as F.relu."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 5, dtype=torch.float64).transpose(1, 2).requires_grad_()
    x.data[0, 0, 0, :2] = 0.0
    out = ReluFeatureMap(5, eps=1e-3)(x)
    expected = torch.nn.functional.relu(x) + 1e-3
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])


@pytest.mark.parametrize("folded", [True, False])
@pytest.mark.parametrize("eps_kind", ["number", "tensor", "guarded"])
def test_division_by_the_denominator_has_the_plain_values_and_gradients(eps_kind, folded):
    """out[..., :-1] / (out[..., -1:] + eps), the denominator folded in as the last column or given apart,
    written in the heads-merged memory order: values and gradients of the plain expression, eps a number or a
    per-row tensor; the guard turns an underflowed row into 0."""
    torch.manual_seed(0)
    out = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    out[..., -1] = out[..., -1].abs() + 0.5
    eps = 1e-3 if eps_kind == "number" else torch.rand(2, 3, 5, 1, dtype=torch.float64, requires_grad=True)
    guard = nonzero if eps_kind == "guarded" else None
    if guard:
        out[0, 0, 0, -1] = 1e-320  # a row whose denominator underflowed
        eps = eps.detach().clone()
        eps[0, 0, 0] = 0.0
        eps.requires_grad_()
    out.requires_grad_()
    numerator, given = (out, None) if folded else (out[..., :-1], out[..., -1:])
    got = DivideByDenominator.apply(numerator, given, eps, guard)
    denominator = out[..., -1:] + eps
    expected = out[..., :-1] / (guard(denominator) if guard else denominator)
    torch.testing.assert_close(got, expected)
    assert got.transpose(1, 2).is_contiguous()  # heads merge with a view
    with torch.no_grad():  # without autograd (decoding): the same division, no Function
        torch.testing.assert_close(DivideByDenominator.divide(numerator, given, eps, guard), expected)
    if guard:
        assert torch.all(got[0, 0, 0] == 0)
    inputs = [x for x in (out, eps) if isinstance(x, torch.Tensor)]
    grad = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 33, 64, 100])
def test_running_sum_in_blocks_equals_cumsum(length):
    from lrpe_hf.modeling.attention_kernels import running_sum_

    x = torch.randn(3, length, 4, 5, dtype=torch.float64)
    torch.testing.assert_close(running_sum_(x.clone()), x.cumsum(1))
