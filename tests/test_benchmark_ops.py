"""benchmarks/count_ops.py and roofline.py: the counting rule, the per-layer share, the fla stand-ins and the
roofline's inputs, on tiny models (the figures themselves are the scripts', run by hand)."""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import lrpe_hf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
count_ops = importlib.import_module("count_ops")
fla_stand_ins = importlib.import_module("fla_stand_ins")
roofline = importlib.import_module("roofline")

TINY = dict(layers=2, hidden=32, heads=2, ffn=128, vocab=64)  # ffn = 4 x hidden, as GPT-2's


def counted(fn):
    return [name for name, _, _ in count_ops.profile_ops(fn)]


class OnlyViews(torch.nn.Module):
    def forward(self, x):
        y = x.view(2, 3, 4).transpose(0, 1).unsqueeze(0).expand(5, -1, -1, -1)[1:, :, 0].permute(2, 0, 1)
        z = x.reshape(4, 6).t().t().contiguous()  # reshape and contiguous where the layout allows: no copy
        return y, z, x.to(x.dtype), x.detach(), torch.empty_like(x), x.flatten().unflatten(0, (6, 4)), x.unbind(1)


def test_copies_behind_views_count():
    x = torch.randn(6, 4)
    expanded = x.unsqueeze(0).expand(3, -1, -1)
    assert counted(lambda: expanded.reshape(-1, 4)) == ["aten::clone"]  # reshape is composite: its copy counts


def test_a_forward_of_views_counts_nothing():
    x = torch.randn(6, 4)
    assert counted(lambda: OnlyViews()(x)) == []


def test_each_op_that_computes_counts_once_not_its_children():
    x, w, b = torch.randn(5, 4), torch.randn(3, 4), torch.randn(3)
    assert counted(lambda: F.linear(x, w, b)) == ["aten::addmm"]  # linear is composite: its addmm counts
    assert counted(lambda: x.to(torch.float64)) == ["aten::_to_copy"]  # not its empty_strided and copy_
    assert counted(lambda: x.t().contiguous()) == ["aten::clone"]
    assert counted(lambda: (x + 1).exp_().sum()) == ["aten::add", "aten::exp_", "aten::sum"]
    assert counted(lambda: F.dropout(x, 0.5, training=False)) == []
    assert counted(lambda: F.dropout(x, 0.5, training=True)) == ["aten::dropout"]  # fused: 1, whatever the CPU ran
    q = torch.randn(1, 2, 8, 4)
    assert counted(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)) == [
        "aten::scaled_dot_product_attention"
    ]


def test_the_key_sums_helpers_count_their_products_only():
    """The prefix sums: one product with the (kept) triangle of ones and the carry across chunks, and no copy of a
    slice into itself (``x[:, 1:] += y`` writes the sum back through ``__setitem__``: one more launch). ``row_dot``:
    one batched product where the elementwise product and its sum are two."""
    from lrpe_hf.modeling.products_chunked import chunk_prefix_sums
    from lrpe_hf.modeling.products_shared import row_dot

    x = torch.randn(2, 32, 4)
    for reverse in (False, True):
        chunk_prefix_sums(x, 8, reverse)  # the triangle, made once and kept
    assert counted(lambda: chunk_prefix_sums(x, 8)) == ["aten::bmm", "aten::cumsum", "aten::add_"]
    carry = ["aten::flip", "aten::cumsum", "aten::flip", "aten::add_"]
    assert counted(lambda: chunk_prefix_sums(x, 8, reverse=True)) == ["aten::bmm", *carry]
    a, b = (torch.randn(2, 5, 3, 4).transpose(1, 2) for _ in range(2))  # stored tokens first, as the layers' are
    row_dot(a, b)
    assert counted(lambda: row_dot(a, b, alpha=-1.0)) == ["aten::baddbmm"]


@pytest.mark.parametrize("encoding", ["lrpe_orthogonal", "lrpe_unitary"])
def test_learnable_rotations_make_no_hidden_copies(encoding):
    """The default encoding's P and rotation (and Type 1's lift), forward and backward, on two rows of features in
    the projections' layout: no op copies a tensor behind the counted ones' backs (a product with a conjugated
    view materialises it, a matmul broadcasting per-head vectors copies them and the features), and the features
    they hand on stay in that layout."""
    from torch.profiler import ProfilerActivity, profile

    from lrpe_hf.modeling.registry import build_positional_encoding

    torch.manual_seed(0)
    options = lrpe_hf.AttentionOptions(positional_encoding=encoding)
    encoding = build_positional_encoding(options, num_heads=2, head_dim=8, feature_dim=8)
    q, k = (torch.rand(2, 16, 2, 8).transpose(1, 2).requires_grad_() for _ in range(2))
    positions = torch.arange(16)[None, :, None].expand(2, -1, -1)

    def step():
        tq, tk = encoding.encode_features(q, k, positions)
        assert tq.transpose(1, 2).is_contiguous() and tk.transpose(1, 2).is_contiguous()
        weights = [torch.randn(2, 16, 2, x.shape[-1]).transpose(1, 2) for x in (tq, tk)]  # gradients laid out so too
        torch.autograd.backward((tq, tk), weights)

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    assert not [e.name for e in prof.events() if e.name in ("aten::clone", "aten::_conj_physical")]


def test_backward_ops_count_and_the_product_is_told_apart():
    from lrpe_hf.modeling.attention_kernels import causal_linear_attention

    q, k, v = (torch.rand(1, 2, 16, 4, requires_grad=True) for _ in range(3))

    def step():
        out, _, _ = causal_linear_attention(q, k, v, chunk_size=8)
        (out * 2).sum().backward()

    ops = count_ops.profile_ops(step)
    inside = [name for name, _, product in ops if product]
    outside = [name for name, _, product in ops if not product]
    assert inside and sorted(outside) == ["aten::mul", "aten::mul", "aten::ones_like", "aten::sum"]  # the loss


@pytest.mark.parametrize("task", ["decode", "train"])
def test_per_layer_is_the_share_each_layer_adds(task):
    """Layers are alike: a third adds what the second added; the per-layer count and what lies outside the layers
    make up the whole model's count."""
    name = "rope"
    counts = count_ops.op_counts(task, name, TINY)  # 2 layers against 1
    three = count_ops.tally(count_ops.step_ops(task, name, 3, TINY))[0]
    assert three - counts["whole"] == counts["per_layer"] > 0
    assert counts["whole"] == TINY["layers"] * counts["per_layer"] + counts["outside"]
    assert 0 < counts["product_per_layer"] < counts["per_layer"]
    assert sum(counts["by_name"].values()) == counts["per_layer"]


@pytest.mark.parametrize("name", ["lrpe_orthogonal+fla", "lrpe_unitary+fla", "rope+fla", "none+fla"])
def test_a_train_step_takes_as_many_ops_for_two_rows_as_for_one(name):
    """The counts are of one row; a GPU trains on several. Nothing a layer does per step depends on the batch size (a
    broadcasting matmul would copy its operands for every row, a sum over rows would add one op)."""
    one = count_ops.op_counts("train", name, TINY)
    two = count_ops.op_counts("train", name, TINY | {"batch": 2})
    assert two["per_layer"] == one["per_layer"], (two["by_name"], one["by_name"])


@pytest.mark.parametrize("name", ["lrpe_orthogonal+fla", "rope+fla", "permute+fla", "none+fla"])
def test_a_padded_train_step_on_fla_s_path_reads_nothing_on_the_host_per_layer(name, monkeypatch):
    """Two rows, one padded, on the GPU's path: a layer adds no read on the host (a sync on a GPU) to the step. Whether
    the rows' positions are the same is looked at once for every layer and both directions; fla's kernels take a
    decay's per-token gates without a look for one decay per head."""
    reads = []
    for method in ("__bool__", "item"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, original=original: reads.append(1) or original(self))

    def step_reads(layers):
        with count_ops.one_block(), fla_stand_ins.fla_path(fla_stand_ins.on_fla(name)):
            model = count_ops.build(name, layers, 64, TINY)
            ids = torch.randint(0, TINY["vocab"], (2, 40))
            mask = torch.ones(2, 40, dtype=torch.long)
            mask[1, :7] = 0
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()  # a warm-up step
            reads.clear()
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            return len(reads)

    assert step_reads(3) == step_reads(1)


def test_gpt2_counts_one_attention_per_layer_and_more_ops_in_training():
    decode = count_ops.op_counts("decode", count_ops.GPT2, TINY)
    train = count_ops.op_counts("train", count_ops.GPT2, TINY)
    assert 0 < decode["per_layer"] < train["per_layer"]
    assert decode["by_name"]["aten::scaled_dot_product_attention"] == 1
    assert decode["product_per_layer"] == 0 and decode["outside"] > 0


def test_the_fla_path_reaches_every_device_test():
    """Every module of the library that tests for fla's device (imported by name where it is used) is told yes."""
    q = torch.zeros(1, 2, 3, 4)
    modules = [m for n, m in sys.modules.items() if n.startswith("lrpe_hf.") and hasattr(m, "on_kernel_device")]
    assert len(modules) >= 2  # products_triton's, and the backend table's (products_dispatch) by name
    with fla_stand_ins.fla_path(fla_stand_ins.reference_kernels()):
        assert all(module.on_kernel_device(q) for module in modules)
    assert not any(module.on_kernel_device(q) for module in modules)


def test_the_fla_path_counts_fla_launches_and_computes_what_the_torch_path_does():
    fla = count_ops.op_counts("train", "none+fla", TINY)
    assert fla["by_name"]["fla::chunk_simple_gla"] == fla_stand_ins.FLA_LAUNCHES["forward"]
    assert fla["by_name"]["fla::chunk_simple_gla_backward"] == fla_stand_ins.FLA_LAUNCHES["backward"]
    assert fla["product_per_layer"] >= sum(fla_stand_ins.FLA_LAUNCHES.values())
    gated = count_ops.op_counts("train", "fastrpb+fla", TINY)  # the exp map's running maximum: per-token gates
    launches = gated["by_name"]["fla::chunk_simple_gla"]  # each call's kernels and the gates' cumsum
    assert launches > 0 and launches % (fla_stand_ins.FLA_LAUNCHES["forward"] + 1) == 0
    losses, grads = [], []
    for name in ("none", "none+fla"):
        with fla_stand_ins.fla_path(fla_stand_ins.on_fla(name)):
            model = count_ops.build(name, 2, 64, TINY).eval()  # eval: no dropout
            ids = torch.randint(0, TINY["vocab"], (1, 40), generator=torch.Generator().manual_seed(0))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        losses.append(loss.detach())
        grads.append(model.model.stack.layers[0].self_attn.qkv_proj.weight.grad)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_graph_counter_counts_each_graph_run_and_the_breaks():
    counter = count_ops.GraphCounter(backward=False)

    def fn(x):
        x = x.sin()
        torch._dynamo.graph_break()
        return x.cos()

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counter.backend())
    compiled(torch.randn(4))
    runs = counter.runs
    compiled(torch.randn(4))
    assert counter.runs - runs == 2 and counter.compiled == 2
    torch._dynamo.reset()


def test_one_block_sets_every_blocking_constant_and_restores_it():
    from lrpe_hf.modeling import products_shared

    before = products_shared.BLOCK_ELEMENTS
    with count_ops.one_block():
        assert products_shared.heads_per_block(8, 32768 // 64, 64) == 8  # every head of a 32k input at once
    assert products_shared.BLOCK_ELEMENTS == before


def test_the_roofline_gemms_are_the_projections_and_mlp_and_fake_bytes_are_real_bytes():
    """GPT-2's layer: 72 N d^2 GEMM FLOPs (forward + backward of 12 d^2 per token); a shape-only (fake) run records
    the ops and bytes a real run records."""
    tokens, d = 64, TINY["hidden"]
    ops, _ = roofline.layer_ops(count_ops.GPT2, tokens, TINY)
    assert sum(flops for _, kind, flops, _ in ops if kind == "gemm") == 72 * tokens * d * d
    for name in (count_ops.GPT2, "rope"):
        fake, fake_calls = roofline.layer_ops(name, tokens, TINY)
        real, real_calls = roofline.layer_ops(name, tokens, TINY, fake=False)
        assert [(n, kind, moved) for n, kind, _, moved in fake] == [(n, kind, moved) for n, kind, _, moved in real]
        assert fake_calls == real_calls
    assert [call[1] for call in fake_calls] == ["forward", "backward"]


def test_fla_cost_is_linear_in_tokens_and_flash_attention_quadratic():
    one, two = roofline.fla_chunk_cost(8192, 8, 64, 64), roofline.fla_chunk_cost(16384, 8, 64, 64)
    assert two["flops"] == 2 * one["flops"] and two["bytes"] == 2 * one["bytes"]
    assert roofline.flash_attention_flops(16384, 512) == 4 * roofline.flash_attention_flops(8192, 512)
    # per head: 14 N K V + 8 N C K + 6 N C V
    assert one["flops"] == 8 * 8192 * (14 * 64 * 64 + 8 * 64 * 64 + 6 * 64 * 64)
