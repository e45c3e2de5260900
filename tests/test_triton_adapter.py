"""The Triton path's argument mapping, checked on the CPU through fla's own torch references.

``products_triton.fla_causal_product`` hands our products to fla's ``chunk_simple_gla`` and
``fused_recurrent_simple_gla``, which need a GPU. fla-core ships torch references of both (``naive.py``, beside
the kernels); fed to the adapter in their place, they check every mapping (layout, scale, gates, constant decays,
the denominator column, initial and final states, packed documents as ``cu_seqlens``) against our torch path and
the O(N^2) reference, forward and backward. The references take neither ``g_gamma`` nor ``cu_seqlens``: the
wrappers below give them what those arguments mean (a constant gate per head; one call per sequence).
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import make_layer
from reference import reference_attention

from lrpe_hf import LinearAttentionState
from lrpe_hf.modeling import products_triton
from lrpe_hf.modeling.attention_kernels import causal_linear_attention


def load_fla_references():
    """fla's naive.py for simple_gla, loaded from its file: importing the package needs a GPU driver."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("fla-core is not installed (pip install -e '.[test]')")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "simple_gla" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_simple_gla_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def reference_kernels():
    """fla's references as the adapter's kernels. They compute in float32 whatever their inputs, so the comparisons
    with our torch path below allow float32's rounding (1e-5), not float64's."""
    naive = load_fla_references()

    def gates_of(q, g, g_gamma):
        if g is not None:
            return g
        per_head = g_gamma if g_gamma is not None else q.new_zeros(q.shape[2])
        return per_head.float().expand(*q.shape[:3])

    def chunked(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None):  # fmt: skip
        g = gates_of(q, g, g_gamma)
        if cu_seqlens is None:
            return naive.naive_chunk_simple_gla(q, k, v, g, initial_state, output_final_state, 16, scale)
        outs, finals = [], []
        for index, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            state = initial_state[index : index + 1] if initial_state is not None else None
            part = slice(start, end)
            out, final = naive.naive_chunk_simple_gla(
                q[:, part], k[:, part], v[:, part], g[:, part], state, True, 16, scale
            )
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1), torch.cat(finals)

    def one_step(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False):
        return naive.naive_recurrent_simple_gla(
            q, k, v, gates_of(q, g, g_gamma), scale, initial_state, output_final_state
        )

    return chunked, one_step


@pytest.fixture
def kernels():
    return reference_kernels()


def inputs(N, seed=0, B=2, H=3, m=8, dv=5):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(B, H, N, m, generator=g) for _ in range(2))
    v = torch.randn(B, H, N, dv, generator=g)
    return q, k, v


@pytest.mark.parametrize("with_denominator", [False, True])
@pytest.mark.parametrize("gating", ["none", "gates", "decay"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_the_adapter_computes_the_torch_product(kernels, tokens, gating, with_denominator):
    """Every argument the adapter maps, against the torch path: gates, a constant decay per head, the denominator,
    an initial state in and the final state out; 37 tokens take the chunked kernel, 1 the one-step kernel."""
    q, k, v = inputs(tokens)
    log_gates = {
        "none": None,
        "gates": -torch.rand(2, 3, tokens, generator=torch.Generator().manual_seed(1)),
        "decay": torch.tensor([-0.1, -0.02, -0.5])[None, :, None].expand(2, 3, tokens),
    }[gating]
    log_decay = log_gates[0, :, -1] if gating == "decay" else None
    initial = torch.randn(2, 3, 8, 5 + with_denominator, generator=torch.Generator().manual_seed(2)).abs()
    torch_path = causal_linear_attention(q, k, v, log_gates, initial, 8, None, with_denominator, backend="torch")
    adapted = products_triton.fla_causal_product(
        q, k, v, None if log_decay is not None else log_gates, log_decay, initial, None, with_denominator,
        torch.float32, kernels,
    )  # fmt: skip
    for got, want in zip(adapted, torch_path):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_packed_documents_become_sequences_and_keep_each_rows_states(kernels):
    """Resets inside rows, one at a row's first token (whose initial state must not reach it), gates, the
    denominator, and each row's final state from its last document."""
    q, k, v = inputs(20)
    resets = torch.zeros(2, 20, dtype=torch.bool)
    resets[0, [6, 13]] = True
    resets[1, [0, 9]] = True
    log_gates = -torch.rand(2, 3, 20, generator=torch.Generator().manual_seed(3))
    initial = torch.rand(2, 3, 8, 6, generator=torch.Generator().manual_seed(4))
    torch_path = causal_linear_attention(q, k, v, log_gates, initial, 8, resets, True, backend="torch")
    adapted = products_triton.fla_causal_product(
        q, k, v, log_gates, None, initial, resets, True, torch.float32, kernels
    )
    for got, want in zip(adapted, torch_path):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_adapter_has_the_torch_products_gradients(kernels):
    q, k, v = (x.double().requires_grad_() for x in inputs(19))
    log_gates = (-torch.rand(2, 3, 19, dtype=torch.float64)).requires_grad_()
    initial = torch.rand(2, 3, 8, 6, dtype=torch.float64, requires_grad=True)

    def gradients(run):
        out, denominator, final = run()
        loss = (out * torch.linspace(-1, 1, 5)).sum() + denominator.pow(2).sum() + final.sum()
        return torch.autograd.grad(loss, (q, k, v, log_gates, initial))

    want = gradients(lambda: causal_linear_attention(q, k, v, log_gates, initial, 8, None, True, backend="torch"))
    got = gradients(
        lambda: products_triton.fla_causal_product(
            q, k, v, log_gates, None, initial, None, True, torch.float32, kernels
        )
    )  # the references compute in float32
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4)


@pytest.fixture
def triton_path_on_the_cpu(kernels, monkeypatch):
    """The layers' dispatch takes the Triton path for CPU tensors, with fla's references as its kernels. Yields
    the names of the kernels called."""
    calls = []

    def counted(kernel):
        def call(*args, **kwargs):
            calls.append(kernel.__name__)
            return kernel(*args, **kwargs)

        return call

    monkeypatch.setattr("lrpe_hf.modeling.attention_kernels.can_run", lambda q, v, with_denominator: None)
    monkeypatch.setattr(products_triton, "fla_kernels", lambda: tuple(counted(kernel) for kernel in kernels))
    yield calls


@pytest.mark.parametrize(
    "encoding,feature_map", [("none", "elu"), ("permute", "relu"), ("rope", "exp"), ("lrpe_orthogonal", "elu")]
)
def test_layers_on_the_triton_path_match_the_torch_path_and_the_formula(triton_path_on_the_cpu, encoding, feature_map):
    """Through the layer's own dispatch (kernel_backend='triton'): padding, packed documents (row 0 restarts at
    its 8th token), PermuteFormer's decay (a constant per head), the exp map's gates, the unrotated denominator;
    prefill then decoding. Against the torch path (the same weights), and the O(N^2) formula for one document."""
    layer = make_layer(encoding, feature_map=feature_map, causal=True, kernel_backend="triton")
    torch_layer = make_layer(encoding, feature_map=feature_map, causal=True, kernel_backend="torch")
    x = torch.randn(2, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :3] = False
    positions = torch.tensor([list(range(7)) + list(range(5)), list(range(12))])[..., None]
    want = torch_layer(x, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(layer(x, attention_mask=mask, position_ids=positions), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x[1:], attention_mask=mask[1:]), reference_attention(layer, x[1:], mask[1:]))
    state = LinearAttentionState()
    prefill = layer(x[:, :9], attention_mask=mask[:, :9], position_ids=positions[:, :9], state=state)
    steps = [
        layer(x[:, t : t + 1], attention_mask=mask[:, t : t + 1], position_ids=positions[:, t : t + 1], state=state)
        for t in range(9, 12)
    ]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), want, atol=1e-5, rtol=1e-5)
    assert {"chunked", "one_step"} <= set(triton_path_on_the_cpu)


def test_a_forced_triton_backend_says_why_it_cannot_run():
    layer = make_layer("none", causal=True, kernel_backend="triton")
    with pytest.raises(ValueError, match="'triton' cannot run this product: its inputs are not on a CUDA device"):
        layer(torch.randn(1, 5, 16, dtype=torch.float64))


# fla's kernels compute their dot products in TF32 (fp32 inputs) or bf16, and keep states in fp32: tolerances
# relative to the outputs' scale, from those precisions
GPU_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not products_triton.fla_installed(), reason="needs a CUDA device and fla-core"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "encoding,feature_map", [("none", "elu"), ("permute", "relu"), ("rope", "exp"), ("lrpe_orthogonal", "elu")]
)
def test_the_triton_path_on_a_gpu_matches_the_torch_path(encoding, feature_map, dtype):
    """fla's real kernels against the torch path on the same GPU: forward and gradients, with padding and packed
    documents, then prefill and decoding."""
    torch.manual_seed(0)
    layers = {
        backend: make_layer(encoding, hidden_size=128, num_heads=2, feature_map=feature_map, causal=True,
                            kernel_backend=backend).float().cuda()
        for backend in ("triton", "torch")
    }  # fmt: skip
    x = torch.randn(2, 300, 128, device="cuda")
    mask = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    mask[1, :20] = False
    positions = torch.cat([torch.arange(150), torch.arange(150)]).expand(2, -1)[..., None].cuda()
    outputs, gradients = {}, {}
    for backend, layer in layers.items():
        inputs = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = layer(inputs, attention_mask=mask, position_ids=positions)
        out.float().square().mean().backward()
        outputs[backend], gradients[backend] = out.float(), inputs.grad
    tolerance = GPU_TOLERANCE[dtype]
    for got, want in ((outputs["triton"], outputs["torch"]), (gradients["triton"], gradients["torch"])):
        torch.testing.assert_close(got, want, atol=tolerance * want.abs().mean(), rtol=tolerance)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        state = LinearAttentionState()
        layer = layers["triton"]
        pieces = [layer(x[:, :290], attention_mask=mask[:, :290], position_ids=positions[:, :290], state=state)]
        for t in range(290, 300):
            pieces.append(
                layer(x[:, t : t + 1], attention_mask=mask[:, t : t + 1], position_ids=positions[:, t : t + 1],
                      state=state)
            )  # fmt: skip
    want = outputs["torch"]
    torch.testing.assert_close(torch.cat(pieces, 1).float(), want, atol=tolerance * want.abs().mean(), rtol=tolerance)
