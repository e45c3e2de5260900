"""The linear-attention products, the MLP and the elu feature map: values and gradients against plain formulas."""

import pytest
import torch

import lrpe_hf
from lrpe_hf.modeling import feature_maps, products_chunked, products_dispatch, products_shared
from lrpe_hf.modeling.attention_kernels import bidirectional_linear_attention, causal_linear_attention
from lrpe_hf.modeling.feature_maps import EluFeatureMap, ReluFeatureMap
from lrpe_hf.modeling.kernel_attention import DivideByDenominator, nonzero
from lrpe_hf.modeling.products_chunked import causal_key_sums, chunk_prefix_sums
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


@pytest.mark.parametrize("block_elements", [128, 512])
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("gated, with_resets", [(False, False), (True, False), (True, True)])
def test_causal_product_in_blocks_equals_the_quadratic_formula(
    block_elements, with_initial, gated, with_resets, monkeypatch
):
    """Long inputs go through the chunked products a block at a time (2 rows x 3 heads of 8 chunks of 4 x 4
    scores: blocks of one head and one row, or of 2 heads then 1; gated, 6 flattened heads in blocks of 1, or of 4
    then 2), documents' visibility following each head's batch row."""
    monkeypatch.setattr(products_shared, "BLOCK_ELEMENTS", block_elements)
    check_causal_against_quadratic(29, 4, gated, with_initial, with_resets)


@pytest.mark.parametrize("block_elements", [128, 1 << 20])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("num_tokens", [29, 1])
def test_causal_product_with_its_denominator_from_the_projections_layout(
    gated, num_tokens, block_elements, monkeypatch
):
    """The layer's inputs: q, k, v tokens-first (B, N, H, ·) as the projections leave them, and the denominator
    computed alongside: the quadratic formula on [v, 1] (its last column is the denominator, the final state's
    last column the key sum), and the gradients of q, k, v and of the initial state, the denominator and the
    final state's key sum receiving gradients of their own."""
    monkeypatch.setattr(products_shared, "BLOCK_ELEMENTS", block_elements)
    check_causal_against_quadratic(num_tokens, 4, gated, True, False, tokens_first=True, with_denominator=True)


@pytest.mark.parametrize("num_tokens, chunk_size", [(28, 4), (28, 7), (16, 16), (76, 4), (29, 4)])
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("tokens_first, with_denominator", [(False, False), (True, True)])
@pytest.mark.parametrize("block_elements", [128, 1 << 20])
def test_causal_product_with_one_decay_per_head_equals_the_quadratic_formula(
    num_tokens, chunk_size, with_initial, tokens_first, with_denominator, block_elements, monkeypatch
):
    """PermuteFormer's decay over consecutive positions, one log gate per head at every token: the ungated chunked
    product applies it itself (the general gated product must not run), in blocks of one head and row or of
    several, the last chunk filled by zero tokens in front; except where 29 tokens in chunks of 4 follow an
    initial state, which take the gated product."""
    monkeypatch.setattr(products_shared, "BLOCK_ELEMENTS", block_elements)
    if num_tokens % chunk_size == 0 or not with_initial:
        monkeypatch.setattr(products_dispatch, "gated_chunks", None)  # calling it fails the test
    check_causal_against_quadratic(
        num_tokens, chunk_size, "per head", with_initial, False, tokens_first, with_denominator
    )


@pytest.mark.parametrize("block_elements", [128, 1 << 20])
@pytest.mark.parametrize("num_tokens, gated", [(29, False), (28, "per head"), (29, True), (1, False)])
def test_causal_product_divided_as_it_goes_equals_the_quadratic_ratio(num_tokens, gated, block_elements, monkeypatch):
    """Evaluation's path: with ``divide_eps`` the product returns out / (denominator + eps), the quadratic formula
    on [v, 1], stored tokens-first (B, N, H, dv) as the output projection reads it: from the ungated product,
    which divides each block (in blocks of one head and row, or all at once), with one decay per head, with
    gates (the general product) and for one token."""
    monkeypatch.setattr(products_shared, "BLOCK_ELEMENTS", block_elements)
    torch.manual_seed(0)
    B, H, N, m, dv, eps = 2, 3, num_tokens, 5, 6, 0.75  # an eps that moves the ratio, so its place is tested
    q, k = (torch.rand(B, N, H, m, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    v = torch.randn(B, N, H, dv, dtype=torch.float64).transpose(1, 2)
    gates = known_decay = None
    if gated == "per head":
        known_decay = -0.5 * torch.rand(H, dtype=torch.float64)
        gates = known_decay[None, :, None].expand(B, H, N).clone()
    elif gated:
        gates = -torch.rand(B, H, N, dtype=torch.float64)
    initial = torch.rand(B, H, m, dv + 1, dtype=torch.float64)
    out, denominator, final = causal_linear_attention(
        q, k, v, gates, initial, 4, None, True, divide_eps=eps, known_decay=known_decay
    )
    expected, expected_final = quadratic_causal(
        q, k, torch.cat([v, torch.ones_like(v[..., :1])], -1), gates, initial, None
    )
    torch.testing.assert_close(out, expected[..., :-1] / (expected[..., -1:] + eps), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(denominator, expected[..., -1:], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final, expected_final, atol=1e-10, rtol=1e-10)
    assert (out.stride(3), out.stride(1)) == (1, dv) and out.stride(2) == H * dv  # (B, N, H, dv) in memory


def test_causal_product_divides_as_it_goes_only_with_a_denominator_and_without_gradients():
    q, k, v = (torch.rand(1, 2, 8, 4) for _ in range(3))
    with pytest.raises(ValueError, match="divide_eps needs with_denominator=True"):
        causal_linear_attention(q, k, v, with_denominator=False, divide_eps=1e-6)
    with pytest.raises(ValueError, match="inputs that want no gradient"):
        causal_linear_attention(q, k, v.requires_grad_(), with_denominator=True, divide_eps=1e-6)


def check_causal_against_quadratic(
    num_tokens, chunk_size, gated, with_initial, with_resets, tokens_first=False, with_denominator=False
):
    """``gated``: False, True (random log gates, with their gradient) or "per head" (one constant log gate per
    head, without a gradient, as a decay by position gives)."""
    torch.manual_seed(0)
    B, H, N, m, dv = 2, 3, num_tokens, 5, 6
    shape = (B, N, H) if tokens_first else (B, H, N)
    leaves = [torch.rand(*shape, m, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    leaves.append(torch.randn(*shape, dv, dtype=torch.float64, requires_grad=True))
    q, k, v = (x.transpose(1, 2) if tokens_first else x for x in leaves)
    gates = known_decay = None
    if gated == "per head":  # as the caller that knows it passes it (the product never looks at the gates)
        known_decay = -0.5 * torch.rand(H, dtype=torch.float64)
        gates = known_decay[None, :, None].expand(B, H, N).clone()
    elif gated:
        gates = (-torch.rand(B, H, N, dtype=torch.float64)).requires_grad_()
    state_width = dv + with_denominator  # the key sum as the state's last column
    initial = torch.randn(B, H, m, state_width, dtype=torch.float64, requires_grad=True) if with_initial else None
    resets = (torch.rand(B, N) < (0.15 if N > 1 else 0.5)) if with_resets else None
    inputs = [x for x in (*leaves, gates, initial) if x is not None and x.requires_grad]

    out, denominator, final = causal_linear_attention(
        q, k, v, gates, initial, chunk_size, resets, with_denominator, known_decay=known_decay
    )
    assert (denominator is not None) == with_denominator
    if with_denominator:
        out = torch.cat([out, denominator], dim=-1)  # both outputs, each with a gradient of its own below
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) if with_denominator else v
    expected_out, expected_final = quadratic_causal(q, k, values, gates, initial, resets)
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


@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_prefix_sums_equal_cumsum(reverse):
    x = torch.randn(3, 24, 5, dtype=torch.float64)
    expected = x.flip(1).cumsum(1).flip(1) if reverse else x.cumsum(1)
    torch.testing.assert_close(chunk_prefix_sums(x, 4, reverse), expected)


def test_kept_constants_serve_training_after_inference_mode_and_never_meet_fake_tensors():
    """The prefix sums' C x C triangles and the rotations' unit modulus are made once and kept: one first made under
    ``inference_mode`` is kept as a normal tensor (a later training step saves it for backward) and reused there
    (no new one per call); a shape-only (fake) run after a real one gets fakes, never the kept real tensor (which
    it would refuse), and keeps none of its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lrpe_hf.modeling import kept_tensors
    from lrpe_hf.modeling.positional_rope import polar_one

    kept_tensors._KEPT.clear()
    with torch.inference_mode():
        lower = products_chunked.triangle_of_ones(8, torch.empty(0, dtype=torch.float64), upper=False)
        assert products_chunked.triangle_of_ones(8, torch.empty(0, dtype=torch.float64), upper=False) is lower
        polar_one(torch.zeros(3))
    assert len(kept_tensors._KEPT) == 2 and not any(t.is_inference() for t in kept_tensors._KEPT.values())
    x = torch.randn(2, 16, 3, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 16, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad((chunk_prefix_sums(x, 8) * weights).sum(), x)
    torch.testing.assert_close(grad, weights.flip(1).cumsum(1).flip(1))  # d/dx_t of sum_s w_s sum_{t<=s} x_t
    chunk_prefix_sums(x.detach().float(), 8, reverse=True)  # real triangles of the fake run's kind, kept first
    kept = dict(kept_tensors._KEPT)
    with FakeTensorMode() as mode:
        sums = chunk_prefix_sums(mode.from_tensor(torch.randn(2, 16, 3)), 8, reverse=True)
        angles = polar_one(mode.from_tensor(torch.zeros(3)))
    assert sums.shape == (2, 16, 3) and angles.shape == (3,) and kept_tensors._KEPT == kept
    torch.testing.assert_close(products_chunked.triangle_of_ones(8, x, upper=True), torch.ones(8, 8).triu().double())


@pytest.mark.parametrize(
    "num_tokens, chunk_size, block_elements", [(29, 4, 128), (29, 4, 1 << 20), (29, 64, 1 << 20), (1, 64, 1 << 20)]
)
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("layout", ["tokens first", "heads first"])
def test_causal_key_sums_equal_the_explicit_denominator(
    num_tokens, chunk_size, block_elements, with_initial, layout, monkeypatch
):
    """q_s . (z_0 + sum_{t<=s} k_t) and z_0 + sum_t k_t, from inputs stored tokens first (as the projections lay them:
    summed in that layout where one block holds them) or heads first, against the explicit masked N x N sum: values
    and the gradients of q, k and z_0, the final sum receiving a gradient of its own, each output alone, and without
    the final sum (``final_state=False``); in one block, and in blocks of one head and one row."""
    monkeypatch.setattr(products_shared, "BLOCK_ELEMENTS", block_elements)
    torch.manual_seed(0)
    B, H, N, m = 2, 3, num_tokens, 5
    if layout == "tokens first":
        leaves = [torch.rand(B, N, H, m, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        q, k = (x.transpose(1, 2) for x in leaves)
    else:
        leaves = [torch.rand(B, H, N, m, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        q, k = leaves
    initial = torch.rand(B, H, m, 1, dtype=torch.float64, requires_grad=True) if with_initial else None
    got, final = causal_key_sums(q, k, initial, chunk_size)
    start = initial if with_initial else torch.zeros(B, H, m, 1, dtype=torch.float64)
    expected = (q @ k.transpose(-1, -2)).tril().sum(-1, keepdim=True) + q @ start
    expected_final = k.sum(2).unsqueeze(-1) + start
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(final, expected_final)
    inputs = [*leaves, initial] if with_initial else leaves
    grad, grad_final = torch.randn_like(got), torch.randn_like(final)
    loss = (got * grad).sum() + (final * grad_final).sum()
    expected_final_loss = (expected_final * grad_final).sum()
    expected_loss = (expected * grad).sum() + expected_final_loss
    for g, w in zip(
        torch.autograd.grad(loss, inputs, retain_graph=True),
        torch.autograd.grad(expected_loss, inputs, retain_graph=True),
    ):
        torch.testing.assert_close(g, w)

    # each output alone reaching the loss (the other given no gradient, not zeros), and no final sum asked for
    def gradients(loss):  # zeros for an input the loss does not reach
        grads = torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]

    for ours, want in (
        ((got * grad).sum(), (expected * grad).sum()),
        ((final * grad_final).sum(), expected_final_loss),
    ):
        for g, w in zip(gradients(ours), gradients(want)):
            torch.testing.assert_close(g, w)
    denominator_only, no_final = causal_key_sums(q, k, initial, chunk_size, final_state=False)
    torch.testing.assert_close(denominator_only, expected)
    assert no_final is None
    for g, w in zip(gradients((denominator_only * grad).sum()), gradients((expected * grad).sum())):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("layout", ["tokens first", "heads first", "different", "strided"])
@pytest.mark.parametrize("alpha", [1.0, -1.0])
def test_row_dot_is_the_dot_product_of_each_row_in_any_layout(layout, alpha):
    """alpha * sum_i x_i y_i over the last dim, (..., w) -> (..., 1), against the written-out sum in float64: rows
    stored tokens first or heads first (one batched product), and x and y laid out differently or with gaps between
    rows (the elementwise product and its sum)."""
    from lrpe_hf.modeling.products_shared import row_dot

    torch.manual_seed(0)
    tokens_first, heads_first = torch.randn(2, 7, 3, 5).transpose(1, 2), torch.randn(2, 3, 7, 5)
    x, y = {
        "tokens first": (tokens_first, torch.randn(2, 7, 3, 5).transpose(1, 2)),
        "heads first": (heads_first, torch.randn(2, 3, 7, 5)),
        "different": (tokens_first, heads_first),
        "strided": (torch.randn(2, 3, 7, 8)[..., :5], torch.randn(2, 3, 7, 8)[..., :5]),
    }[layout]
    got = row_dot(x, y, alpha)
    expected = alpha * (x.double() * y.double()).sum(-1, keepdim=True)
    assert got.shape == (2, 3, 7, 1)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_key_sums_in_half_precision_keep_the_tokens_first_layout(dtype):
    """Half-precision q and k stored tokens first (a GPU's bf16 training): the denominator is the explicit masked sum
    to the dtype's precision (a few rounding steps relative to the largest entry, as for the products), and the
    gradients come back in the inputs' dtype and layout, not copied into another."""
    torch.manual_seed(0)
    leaves = [torch.rand(2, 40, 3, 8, dtype=dtype, requires_grad=True) for _ in range(2)]
    q, k = (x.transpose(1, 2) for x in leaves)
    got, final = causal_key_sums(q, k, chunk_size=16)
    exact_q, exact_k = (x.detach().double().requires_grad_() for x in (q, k))
    expected = (exact_q @ exact_k.transpose(-1, -2)).tril().sum(-1, keepdim=True)
    bound = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), expected, atol=bound * expected.abs().max().item(), rtol=0)
    torch.testing.assert_close(final.double(), exact_k.sum(2).unsqueeze(-1), atol=bound * 40, rtol=0)
    grad = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k), grad)
    wanted = torch.autograd.grad(expected, (exact_q, exact_k), grad.double())
    for got_grad, want in zip(grads, wanted):
        assert got_grad.dtype == dtype and got_grad.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(got_grad.double(), want, atol=bound * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_product_under_autocast_computes_in_the_autocast_dtype(dtype):
    """float32 inputs under autocast: the products run in the autocast dtype (as a matmul would), so the output
    is the quadratic formula to that dtype's precision, and every gradient keeps its input's dtype."""
    torch.manual_seed(0)
    q, k = (torch.rand(1, 2, 40, 8, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 40, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        out, denominator, final = causal_linear_attention(q, k, v, chunk_size=16, with_denominator=True)
    assert out.dtype == denominator.dtype == final.dtype == dtype
    out = torch.cat([out, denominator], dim=-1)
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    expected, _ = quadratic_causal(q, k, values, None, None, None)
    # the products round their inputs and outputs to the dtype, and sums of up to 40 terms accumulate it: a few of
    # the dtype's rounding steps relative to the largest entry (measured over 20 seeds: at most 0.7 eps for the
    # values, 1.5 eps for the gradients, in both dtypes)
    bound = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), expected, atol=bound * expected.abs().max().item(), rtol=0)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert [g.dtype for g in grads] == [torch.float32] * 3
    wanted = torch.autograd.grad(expected.sum(), (q, k, v))
    for got, want in zip(grads, wanted):
        torch.testing.assert_close(got, want, atol=bound * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("with_denominator", [False, True])
def test_bidirectional_values_and_gradients_equal_the_quadratic_formula(with_denominator):
    torch.manual_seed(0)
    q, k = (torch.rand(2, 3, 17, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 17, 6, dtype=torch.float64, requires_grad=True)
    out, denominator = bidirectional_linear_attention(q, k, v, with_denominator=with_denominator)
    if with_denominator:
        out = torch.cat([out, denominator], dim=-1)
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) if with_denominator else v
    expected = (q @ k.transpose(-1, -2)) @ values
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("with_denominator", [False, True])
def test_bidirectional_documents_equal_the_quadratic_formula_within_each_document(with_denominator, compiled):
    """Packed rows: each query sums over the keys of its own document only. Eager, with the count of documents the
    model reads; compiled, where nothing is read back, as two causal products (forward and reversed) less each
    token's own term. Values and gradients against the masked quadratic formula."""
    torch.manual_seed(0)
    q, k = (torch.rand(2, 3, 23, 5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 23, 6, dtype=torch.float64, requires_grad=True)
    lengths = [[5, 1, 9, 8], [23]]  # a one-token document, and a row that is one document
    documents = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in
                             [lengths[0], lengths[1]]]) + torch.tensor([[3], [0]])  # fmt: skip
    if compiled:
        attention = torch.compile(bidirectional_linear_attention, backend="aot_eager", fullgraph=True)
        out, denominator = attention(q, k, v, documents, with_denominator)
    else:
        out, denominator = bidirectional_linear_attention(q, k, v, documents, with_denominator, num_documents=4)
    if with_denominator:
        out = torch.cat([out, denominator], dim=-1)
    values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) if with_denominator else v
    same_document = (documents[:, :, None] == documents[:, None, :])[:, None]
    expected = ((q @ k.transpose(-1, -2)) * same_document) @ values
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


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
def test_mlp_keeps_one_intermediate_width_tensor_for_backward(activation):
    """In training the MLP keeps one (B, N, intermediate) tensor for backward, whatever the activation: relu's
    output (which fc2 keeps anyway), or h for an activation whose backward reads its input (recomputed then)."""
    mlp = MLP(6, 10, activation).train()
    x = torch.randn(2, 5, 6, requires_grad=True)
    kept = {}

    def pack(tensor):
        if tensor.shape[-1] == 10 and tensor.numel() == 2 * 5 * 10:  # (2, 5, 10), or a (10, 10) view of it
            kept[tensor.untyped_storage().data_ptr()] = tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        mlp(x).sum().backward()
    assert list(kept.values()) == [2 * 5 * 10]


@pytest.mark.parametrize("block", [1 << 18, 16, 7])
def test_shifted_elu_feature_map_keeps_the_layout_with_the_plain_gradient(block, monkeypatch):
    """1 + elu(x) a block of memory at a time (whole, in blocks of 16, in blocks of 7 with a shorter last one),
    new and in place, against ATen's elu; its gradient likewise, for a gradient in the output's layout or not."""
    monkeypatch.setattr(feature_maps, "ELEMENTWISE_BLOCK", block)
    monkeypatch.setattr(feature_maps, "FEW_ELEMENTS", 0)  # the blocks, as for a training step's features
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 5, dtype=torch.float64).transpose(1, 2).requires_grad_()  # heads not leading
    x.data[0, 0, 0, :2] = 0.0  # the kink at 0: derivative 1
    out = EluFeatureMap(5)(x)
    expected = torch.nn.functional.elu(x) + 1.0
    assert out.stride() == x.stride()  # no layout copy: the products take any layout
    torch.testing.assert_close(out, expected)
    for grad in (torch.randn_like(out), torch.randn(out.shape, dtype=out.dtype)):  # out's layout, and another
        got = torch.autograd.grad(out, x, grad, retain_graph=True)[0]
        torch.testing.assert_close(got, torch.autograd.grad(expected, x, grad, retain_graph=True)[0])
    with torch.no_grad():
        for tokens in (slice(None), slice(1, 5)):  # the projections' layout, and a view of it with gaps
            inputs = x.clone()[:, :, tokens]
            out = EluFeatureMap(5).in_place(inputs)
            assert out.data_ptr() == inputs.data_ptr()
            torch.testing.assert_close(out, expected[:, :, tokens])


def test_shifted_relu_feature_map_keeps_the_layout_with_the_plain_gradient():
    """max(x, 0) + eps (PermuteFormer eq. 15) through its one-byte-mask backward, against autograd; x = 0 takes
    relu's derivative 0, as F.relu."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 5, dtype=torch.float64).transpose(1, 2).requires_grad_()
    x.data[0, 0, 0, :2] = 0.0
    out = ReluFeatureMap(5, eps=1e-3)(x)
    expected = torch.nn.functional.relu(x) + 1e-3
    assert out.stride() == x.stride()  # no layout copy: the products take any layout
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])


@pytest.mark.parametrize("eps_kind", ["number", "tensor", "guarded"])
def test_division_by_the_denominator_has_the_plain_values_and_gradients(eps_kind):
    """numerator / (denominator + eps), written in the heads-merged memory order: values and gradients of the
    plain expression, eps a number or a per-row tensor; the guard turns an underflowed row into 0."""
    torch.manual_seed(0)
    numerator = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    denominator = torch.rand(2, 3, 5, 1, dtype=torch.float64) + 0.5
    eps = 1e-3 if eps_kind == "number" else torch.rand(2, 3, 5, 1, dtype=torch.float64, requires_grad=True)
    guard = nonzero if eps_kind == "guarded" else None
    if guard:
        denominator[0, 0, 0] = 1e-320  # a row whose denominator underflowed
        eps = eps.detach().clone()
        eps[0, 0, 0] = 0.0
        eps.requires_grad_()
    numerator.requires_grad_()
    denominator.requires_grad_()
    got = DivideByDenominator.apply(numerator, denominator, eps, guard)
    total = denominator + eps
    expected = numerator / (guard(total) if guard else total)
    torch.testing.assert_close(got, expected)
    assert got.transpose(1, 2).is_contiguous()  # heads merge with a view
    with torch.no_grad():  # without autograd (decoding): the same division, no Function
        torch.testing.assert_close(DivideByDenominator.divide(numerator, denominator, eps, guard), expected)
    if guard:
        assert torch.all(got[0, 0, 0] == 0)
    inputs = [x for x in (numerator, denominator, eps) if isinstance(x, torch.Tensor)]
    grad = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("trailing", [(4, 5), (16, 20)])  # one cumsum up to 256 trailing elements, blocks above
def test_running_sum_in_blocks_equals_cumsum(length, trailing):
    from lrpe_hf.modeling.products_chunked import running_sum_

    x = torch.randn(3, length, *trailing, dtype=torch.float64)
    torch.testing.assert_close(running_sum_(x.clone()), x.cumsum(1))


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 40])
@pytest.mark.parametrize("reverse", [False, True])
def test_decayed_running_sum_in_blocks_equals_the_step_by_step_recurrence(length, reverse):
    """s_i = x_i + f s_{i-1} (or s_{i+1} with ``reverse``) per group, f in [0, 1] (0: nothing carries; 1: a plain
    running sum), across the blocks of 16 steps and a ragged last block."""
    from lrpe_hf.modeling.products_chunked import decayed_running_sum_

    x = torch.randn(4, length, 3, 5, dtype=torch.float64)
    factor = torch.tensor([0.0, 0.3, 0.97, 1.0], dtype=torch.float64)
    expected = x.clone()
    order = range(length - 2, -1, -1) if reverse else range(1, length)
    for i in order:
        expected[:, i] += factor[:, None, None] * expected[:, i + 1 if reverse else i - 1]
    torch.testing.assert_close(decayed_running_sum_(x.clone(), factor, reverse), expected)


@pytest.mark.parametrize("with_state", [False, True])
def test_a_decay_known_from_consecutive_positions_gives_what_the_gates_give(with_state, monkeypatch):
    """PermuteFormer's decay over default positions is taken as known (``known_decay``, one decay per head, the
    ungated chunked product) without looking at the gates; the same model with the decay left unknown takes its
    per-token gates (the gated product): values and gradients agree, after a first call (a state) too."""
    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(
        vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        positional_encoding="permute", chunk_size=8,
    )  # fmt: skip
    # no dropout; gradients still wanted. float64: two algorithms (one decay per head in the ungated chunks, per-token
    # gates in the gated ones) agree to their rounding, which float32 would blur (before, both runs took one product
    # and were compared exactly)
    model = lrpe_hf.LinearGPTForCausalLM(config).double().eval()
    ids = torch.randint(3, 60, (2, 29), generator=torch.Generator().manual_seed(1))
    calls = []
    original = products_dispatch.uniform_decay

    def spy(log_gates, resets, known=None):
        calls.append(known is not None)
        return original(log_gates, resets, known)

    def run(known):
        monkeypatch.setattr(
            products_dispatch, "uniform_decay", spy if known else lambda g, r, known=None: original(g, r)
        )
        model.zero_grad()
        if with_state:
            cache = lrpe_hf.LinearAttentionCache(config.num_hidden_layers)
            model(ids[:, :11], past_key_values=cache, use_cache=True)
            logits = model(ids[:, 11:], past_key_values=cache, use_cache=True).logits
        else:
            logits = model(ids).logits
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    known_logits, known_grads = run(known=True)
    assert calls and all(calls)
    gated_logits, gated_grads = run(known=False)
    torch.testing.assert_close(known_logits, gated_logits, rtol=1e-10, atol=1e-12)
    for known, gated in zip(known_grads, gated_grads):
        torch.testing.assert_close(known, gated, rtol=1e-10, atol=1e-12)
