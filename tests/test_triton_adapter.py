"""The Triton path on the CPU: the adapter's argument mapping, and every encoding's layer through it.

``products_triton.fla_causal_product`` hands our products to fla's ``chunk_simple_gla`` and
``fused_recurrent_simple_gla``, Triton kernels for a GPU. Two stand-ins run them here (the ``kernels`` fixture):

- ``references``: fla-core's torch references of both (``naive.py``, beside the kernels), in every ``make test``.
  They take neither ``g_gamma`` nor ``cu_seqlens``: the wrappers below give them what those arguments mean (a
  constant gate per head; one call per sequence).
- ``interpreted``: fla's real kernels under Triton's interpreter (``triton_interpreter.py``), fla's own checks
  (even widths in half precision, the Hopper backward) included; ``make test-triton`` runs them, elsewhere they
  skip.

Against our torch path and the O(N^2) reference, forward and backward, they check every mapping (layout, scale,
gates, constant decays, the denominator, initial and final states, packed documents as ``cu_seqlens``), and every
test checks that each width handed to fla is even (``fla_calls``). The layer tests take the Triton path for CPU
tensors through the layers' own dispatch, whose device check alone is patched.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import make_layer, second_feature_map
from reference import reference_attention
from triton_interpreter import interpreted_fla_kernels, why_not_available

from lrpe_hf import POSITIONAL_ENCODINGS, LinearAttentionState, LinearGPTConfig, LinearGPTForCausalLM
from lrpe_hf.modeling import products_dispatch, products_triton
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
            out, final = naive.naive_chunk_simple_gla(q, k, v, g, initial_state, output_final_state, 16, scale)
            return out.to(v.dtype), final  # in the values' dtype, as fla's
        outs, finals = [], []
        for index, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            state = initial_state[index : index + 1] if initial_state is not None else None
            part = slice(start, end)
            out, final = naive.naive_chunk_simple_gla(
                q[:, part], k[:, part], v[:, part], g[:, part], state, True, 16, scale
            )
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1).to(v.dtype), torch.cat(finals) if output_final_state else None

    def one_step(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False):
        return naive.naive_recurrent_simple_gla(
            q, k, v, gates_of(q, g, g_gamma), scale, initial_state, output_final_state
        )

    return chunked, one_step


@pytest.fixture(scope="session")
def interpreted_kernels(tmp_path_factory):
    why_not = why_not_available()
    if why_not is not None:
        pytest.skip(why_not)
    return interpreted_fla_kernels(tmp_path_factory.mktemp("interpreted"))


@pytest.fixture(params=["references", "interpreted"])
def kernels(request, monkeypatch):
    """fla's (chunked, one-step) kernels as the adapter calls them: its torch references (standing for a GPU where
    fla's gated backward runs), or its Triton kernels under the interpreter."""
    if request.param == "references":
        monkeypatch.setattr(products_triton, "gated_backward_fails", lambda dtype: False)
        return reference_kernels()
    return request.getfixturevalue("interpreted_kernels")


@pytest.fixture
def fla_calls(kernels):
    """``kernels`` recording every call as (kernel, dtype, key width, value width): yields the recording kernels and
    the calls. After the test, every width handed to fla must have been even."""
    calls = []

    def recording(kernel, name):
        def call(q, k, v, **options):
            calls.append((name, q.dtype, q.shape[-1], v.shape[-1]))
            return kernel(q, k, v, **options)

        return call

    yield (recording(kernels[0], "chunked"), recording(kernels[1], "one_step")), calls
    assert not odd_widths(calls)


def odd_widths(calls):
    return [call for call in calls if call[2] % 2 or call[3] % 2]


def inputs(N, seed=0, B=2, H=3, m=7, dv=5):
    """q, k (B, H, N, m), v (B, H, N, dv): odd widths, which the adapter pads."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(B, H, N, m, generator=g) for _ in range(2))
    v = torch.randn(B, H, N, dv, generator=g)
    return q, k, v


@pytest.mark.parametrize("with_denominator", [False, True])
@pytest.mark.parametrize("gating", ["none", "gates", "decay"])
@pytest.mark.parametrize("tokens", [1, 70])
def test_the_adapter_computes_the_torch_product(fla_calls, tokens, gating, with_denominator):
    """Every argument the adapter maps, against the torch path: gates, a constant decay per head, the denominator,
    an initial state in and the final state out; 70 tokens take the chunked kernel (over two of fla's 64-token
    chunks), 1 the one-step kernel."""
    kernels, calls = fla_calls
    q, k, v = inputs(tokens)
    log_gates = {
        "none": None,
        "gates": -torch.rand(2, 3, tokens, generator=torch.Generator().manual_seed(1)),
        "decay": torch.tensor([-0.1, -0.02, -0.5])[None, :, None].expand(2, 3, tokens),
    }[gating]
    log_decay = log_gates[0, :, -1] if gating == "decay" else None
    initial = torch.randn(2, 3, 7, 5 + with_denominator, generator=torch.Generator().manual_seed(2)).abs()
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
    # one call of fla's kernels, the denominator from a ones column in its values: 5 value columns and the ones
    # column, or a zero column (fla wants even widths)
    assert len(calls) == 1 and calls[0][-1] == 6
    # a caller that keeps no state: the same outputs, and fla is asked for no final state
    without_final = products_triton.fla_causal_product(
        q, k, v, None if log_decay is not None else log_gates, log_decay, initial, None, with_denominator,
        torch.float32, kernels, final_state=False,
    )  # fmt: skip
    assert without_final[2] is None
    for got, want in zip(without_final[:2], adapted[:2]):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_packed_documents_become_sequences_and_keep_each_rows_states(fla_calls):
    """Resets inside rows, one at a row's first token (whose initial state must not reach it), gates, the
    denominator, and each row's final state from its last document; documents over one of fla's chunks."""
    kernels, _ = fla_calls
    q, k, v = inputs(80)
    resets = torch.zeros(2, 80, dtype=torch.bool)
    resets[0, [6, 13]] = True
    resets[1, [0, 9]] = True
    log_gates = -torch.rand(2, 3, 80, generator=torch.Generator().manual_seed(3))
    initial = torch.rand(2, 3, 7, 6, generator=torch.Generator().manual_seed(4))
    for gates in (log_gates, None):
        torch_path = causal_linear_attention(q, k, v, gates, initial, 8, resets, True, backend="torch")
        adapted = products_triton.fla_causal_product(
            q, k, v, gates, None, initial, resets, True, torch.float32, kernels
        )
        for got, want in zip(adapted, torch_path):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        without_final = products_triton.fla_causal_product(
            q, k, v, gates, None, initial, resets, True, torch.float32, kernels, final_state=False
        )
        assert without_final[2] is None
        for got, want in zip(without_final[:2], adapted[:2]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("gating", ["gates", "none"])
def test_the_adapter_has_the_torch_products_gradients(fla_calls, gating):
    kernels, _ = fla_calls
    q, k, v = (x.double().requires_grad_() for x in inputs(70))
    log_gates = (-torch.rand(2, 3, 70, dtype=torch.float64)).requires_grad_() if gating == "gates" else None
    initial = torch.rand(2, 3, 7, 6, dtype=torch.float64, requires_grad=True)
    wanted = [x for x in (q, k, v, log_gates, initial) if x is not None]

    def gradients(run, final_state=True):
        out, denominator, final = run(final_state)
        loss = (out * torch.linspace(-1, 1, 5)).sum() + denominator.pow(2).sum()
        return torch.autograd.grad(loss + final.sum() if final_state else loss, wanted)

    for final_state in (True, False):  # the final state reaching the loss, or not asked for
        want = gradients(
            lambda final: causal_linear_attention(
                q, k, v, log_gates, initial, 8, None, True, backend="torch", final_state=final
            ),
            final_state,
        )
        got = gradients(
            lambda final: products_triton.fla_causal_product(
                q, k, v, log_gates, None, initial, None, True, torch.float32, kernels, final_state=final
            ),
            final_state,
        )  # the kernels compute in float32
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4)


@pytest.fixture
def triton_path_on_the_cpu(fla_calls, monkeypatch):
    """The layers' dispatch takes the Triton path for CPU tensors (only its device check is patched), with
    ``fla_calls``'s kernels as fla's. Yields the calls."""
    kernels, calls = fla_calls
    for module in (products_triton, products_dispatch):  # (where it was imported by name too)
        monkeypatch.setattr(module, "on_kernel_device", lambda x: True)
    monkeypatch.setattr(products_triton, "load_fla", lambda: (kernels, None))
    yield calls


def layer_on(backend, encoding, feature_map):
    """A float32 layer with heads of odd width 9 (so odd key and value widths reach the adapter); the same weights
    on every backend."""
    layer = make_layer(
        encoding, hidden_size=18, feature_map=feature_map, causal=True, kernel_backend=backend, max_positions=128
    )
    return layer.float()


def shared_draw(layer):
    """SPE's draw of codes (seeded in eval mode: the same for two layers with the same weights), or None."""
    return layer.shared_codes.draw() if layer.shared_codes is not None else None


def packed_inputs(tokens=100):
    """x (2, tokens, 18); row 0 holds two documents (positions restart at its 71st token), row 1 is left-padded by 3
    tokens. Returns x, the mask and the positions (2, tokens, 1)."""
    x = torch.randn(2, tokens, 18, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, tokens, dtype=torch.bool)
    mask[1, :3] = False
    positions = torch.stack([torch.cat([torch.arange(70), torch.arange(tokens - 70)]), torch.arange(tokens)])
    return x, mask, positions[..., None]


def forward_and_gradients(layer, x, **kwargs):
    """The layer's output and the gradients of a loss over it: of x, then of every parameter (zeros where none)."""
    x = x.clone().requires_grad_()
    out = layer(x, shared_draw=shared_draw(layer), **kwargs)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()  # large enough for fp16
    grads = [x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in layer.parameters()]
    return out.detach(), grads


@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_every_encodings_layer_on_the_triton_path(triton_path_on_the_cpu, encoding):
    """Through the layer's own dispatch (kernel_backend='triton'), each encoding with its second feature map (exp's
    gates, PermuteFormer's decay, the unrotated denominator among them): padding and packed documents, forward and
    gradients against the torch path (the same weights); a single document against the O(N^2) formula; prefill
    then decoding against the full forward."""
    feature_map = second_feature_map(encoding)
    layer, torch_layer = (layer_on(backend, encoding, feature_map) for backend in ("triton", "torch"))
    x, mask, positions = packed_inputs()
    out, grads = forward_and_gradients(layer, x, attention_mask=mask, position_ids=positions)
    want, want_grads = forward_and_gradients(torch_layer, x, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-4)
    with torch.no_grad():
        draw = shared_draw(layer)
        one_document = layer(x[1:], attention_mask=mask[1:], shared_draw=draw)
        formula = reference_attention(layer, x[1:], mask[1:], shared_draw=draw)
        torch.testing.assert_close(one_document.double(), formula, atol=1e-5, rtol=1e-4)
        state = LinearAttentionState()

        def tokens(start, end):
            span = slice(start, end)
            return layer(x[:, span], attention_mask=mask[:, span], position_ids=positions[:, span], shared_draw=draw,
                         state=state)  # fmt: skip

        pieces = [tokens(0, 96)] + [tokens(t, t + 1) for t in range(96, 100)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), want, atol=1e-5, rtol=1e-4)
    assert {"chunked", "one_step"} <= {name for name, *_ in triton_path_on_the_cpu}


@pytest.mark.parametrize("feature_map", ["elu", "exp"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_half_precision_training_steps_hand_fla_even_widths(triton_path_on_the_cpu, encoding, feature_map):
    """A half-precision training step (fp16 autocast, forward and backward) of every encoding on the Triton path,
    with heads of odd width and packed documents, ungated (elu) and gated (exp): every width handed to fla is even
    (fla's chunked backward asserts it in fp16 and bf16; the interpreted kernels run that assertion), and the step
    matches the float32 torch path to fp16's precision. fp16, not bf16: Triton's interpreter (3.9) reads and writes
    bf16 tensors wrongly. No padding: a padded token's denominator is 0, and fp16's 1 / eps (1e6) overflows on
    either path."""
    layer, torch_layer = (layer_on(backend, encoding, feature_map) for backend in ("triton", "torch"))
    x, _, positions = packed_inputs()
    with torch.autocast("cpu", dtype=torch.float16):
        out, grads = forward_and_gradients(layer, x, position_ids=positions)
    want, want_grads = forward_and_gradients(torch_layer, x, position_ids=positions)
    calls = triton_path_on_the_cpu
    assert calls and all(dtype == torch.float16 for _, dtype, *_ in calls)
    assert not odd_widths(calls)
    for got, expected in zip([out] + grads, [want] + want_grads):
        scale = float(expected.abs().max())
        torch.testing.assert_close(got.float(), expected, atol=5e-2 * scale, rtol=0)


@pytest.mark.parametrize("encoding", ["none", "rope", "lrpe_orthogonal", "lrpe_unitary"])
def test_one_rows_decoding_hands_fla_its_stacked_queries_and_keys(triton_path_on_the_cpu, encoding, monkeypatch):
    """A batch of one row decodes with q and k through the map and the encoding as one tensor on the Triton path
    too (each half is then contiguous in fla's layout): its steps' logits are the torch path's."""
    from lrpe_hf.modeling.kernel_attention import KernelAttention

    config = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  pad_token_id=0, eos_token_id=None, positional_encoding=encoding)  # fmt: skip
    original, stacked = KernelAttention.stacks, []
    monkeypatch.setattr(KernelAttention, "stacks", lambda *args: stacked.append(original(*args)) or stacked[-1])
    logits = []
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        model = LinearGPTForCausalLM(LinearGPTConfig(**config, kernel_backend=backend)).eval()
        out = model.generate(
            torch.tensor([[5, 9, 11, 3, 8]]), max_new_tokens=4, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        logits.append(torch.stack(out.logits))
    # fla's kernels sum the float32 products in their own order (the file's tolerance for fp32 fla against torch)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-4)
    steps = [name for name, *_ in triton_path_on_the_cpu]
    assert steps.count("one_step") == 2 * 3 and any(stacked)  # 3 steps after the prompt's, 2 layers


@pytest.mark.parametrize("encoding,feature_map", [("permute", "relu"), ("none", "exp")])
def test_generation_from_a_one_token_prompt(triton_path_on_the_cpu, encoding, feature_map):
    """The first call holds one token with gates (PermuteFormer's decay, the exp map's rescaling) and no state:
    generate continues it on the Triton path as on the torch path."""
    config = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  pad_token_id=0, eos_token_id=None, positional_encoding=encoding, feature_map=feature_map)  # fmt: skip
    generated = []
    for backend in ("triton", "torch"):
        torch.manual_seed(0)
        model = LinearGPTForCausalLM(LinearGPTConfig(**config, kernel_backend=backend)).eval()
        generated.append(model.generate(torch.tensor([[5], [7]]), max_new_tokens=4, do_sample=False))
    torch.testing.assert_close(*generated)
    assert [name for name, *_ in triton_path_on_the_cpu[:2]] == ["one_step", "one_step"]


def test_float64_takes_the_torch_path_or_says_why(triton_path_on_the_cpu):
    """fla's kernels accumulate in float32: a float64 product runs on the torch path on 'auto', and 'triton' says
    why it cannot run."""
    x = torch.randn(1, 70, 16, dtype=torch.float64)
    auto, torch_layer = (make_layer("none", causal=True, kernel_backend=backend) for backend in ("auto", "torch"))
    torch.testing.assert_close(auto(x), torch_layer(x))
    assert not triton_path_on_the_cpu
    with pytest.raises(ValueError, match="'triton' cannot run this product: fla's kernels compute in float32"):
        make_layer("none", causal=True, kernel_backend="triton")(x)


def test_a_gated_backward_fla_cannot_run_takes_the_torch_path_or_says_why(triton_path_on_the_cpu, monkeypatch):
    """Where fla's gated backward would raise (Hopper with Triton >= 3.4, < 3.7.1), per-token gates that want a
    gradient take the torch path on 'auto', and 'triton' says why; without a gradient, or with one constant decay
    per head, fla's kernels run."""
    monkeypatch.setattr(products_triton, "gated_backward_fails", lambda dtype: True)
    x, mask, _ = packed_inputs(70)
    gated = layer_on("auto", "none", "exp")
    forward_and_gradients(gated, x, attention_mask=mask)
    assert not triton_path_on_the_cpu
    with torch.no_grad():
        gated(x, attention_mask=mask)
    assert triton_path_on_the_cpu
    triton_path_on_the_cpu.clear()
    forward_and_gradients(layer_on("auto", "permute", "relu"), x)  # no padding: one decay per head, fla's g_gamma
    assert triton_path_on_the_cpu
    with pytest.raises(ValueError, match="'triton' cannot run this product: fla's gated backward raises on Hopper"):
        forward_and_gradients(layer_on("triton", "none", "exp"), x)


def test_the_hopper_check_is_flas_own(interpreted_kernels, monkeypatch):
    """fla 0.6 raises in its gated backward on Hopper GPUs with Triton >= 3.4, < 3.7.1: with fla's flags set so,
    ``gated_backward_fails`` says so (there is no tilelang here) and fla's own backward raises; a constant decay per
    head's backward runs."""
    from fla.ops.common import chunk_o

    assert not products_triton.gated_backward_fails(torch.bfloat16)
    for flag, value in (("IS_NVIDIA_HOPPER", True), ("TRITON_ABOVE_3_4_0", True), ("TRITON_ABOVE_3_7_1", False)):
        monkeypatch.setattr(chunk_o, flag, value)
    assert products_triton.gated_backward_fails(torch.bfloat16) and products_triton.gated_backward_fails(torch.float32)
    chunked, _ = interpreted_kernels
    q, k, v = (x.transpose(1, 2).requires_grad_() for x in inputs(70, m=8, dv=8))
    out, _ = chunked(q, k, v, g=-torch.rand(2, 70, 3), scale=1.0)
    with pytest.raises(RuntimeError, match="Hopper"):
        out.sum().backward()
    out, _ = chunked(q, k, v, g_gamma=torch.tensor([-0.1, -0.02, -0.5]), scale=1.0)
    out.sum().backward()


def test_a_forced_triton_backend_says_why_it_cannot_run():
    layer = make_layer("none", causal=True, kernel_backend="triton")
    with pytest.raises(ValueError, match="'triton' cannot run this product: its inputs are not on a CUDA device"):
        layer(torch.randn(1, 5, 16, dtype=torch.float64))


# fla's kernels compute their dot products in TF32 (fp32 inputs) or bf16, and keep states in fp32: tolerances
# relative to the outputs' scale, from those precisions
GPU_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}
needs_gpu_and_fla = pytest.mark.skipif(
    not torch.cuda.is_available() or not products_triton.fla_installed(), reason="needs a CUDA device and fla-core"
)


@pytest.fixture
def float32_matmul_precision():
    """Set torch's float32 matmul precision for one test: yields the setter, restores the precision after."""
    previous = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(previous)


@pytest.mark.gpu
@needs_gpu_and_fla
def test_float32_on_a_gpu_takes_flas_kernels_only_where_tf32_is_allowed(float32_matmul_precision, monkeypatch):
    """fla's kernels multiply float32 in TF32: at torch's default precision ('highest') a float32 product takes the
    torch path on 'auto' and 'triton' says why; with TF32 allowed ('high') fla's kernels take it."""

    calls = []
    original = products_dispatch.fla_causal_product
    monkeypatch.setattr(products_dispatch, "fla_causal_product", lambda *a, **k: calls.append(1) or original(*a, **k))
    backends = ("auto", "torch", "triton")
    layers = {b: make_layer("none", causal=True, kernel_backend=b).float().cuda() for b in backends}
    x = torch.randn(1, 70, 16, device="cuda")
    float32_matmul_precision("highest")
    torch.testing.assert_close(layers["auto"](x), layers["torch"](x), rtol=0, atol=0)
    assert not calls
    with pytest.raises(ValueError, match="'triton' cannot run this product: fla's kernels multiply float32 inputs"):
        layers["triton"](x)
    float32_matmul_precision("high")
    layers["auto"](x)
    assert calls


@pytest.mark.gpu
@needs_gpu_and_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["tf32", "bf16"])
@pytest.mark.parametrize(
    "encoding,feature_map", [("none", "elu"), ("permute", "relu"), ("rope", "exp"), ("lrpe_orthogonal", "elu")]
)
def test_the_triton_path_on_a_gpu_matches_the_torch_path(
    encoding, feature_map, dtype, float32_matmul_precision, monkeypatch
):
    """fla's real kernels against the torch path on the same GPU: forward and gradients, with padding and packed
    documents, then prefill and decoding. float32 with TF32 allowed, as fla's kernels need it; 'auto', so that a
    gated backward fla refuses here (Hopper, Triton < 3.7.1) takes the torch path, and fla's kernels run the rest."""

    calls = []
    original = products_dispatch.fla_causal_product
    monkeypatch.setattr(products_dispatch, "fla_causal_product", lambda *a, **k: calls.append(1) or original(*a, **k))
    float32_matmul_precision("high")
    torch.manual_seed(0)
    layers = {
        backend: make_layer(encoding, hidden_size=128, num_heads=2, feature_map=feature_map, causal=True,
                            kernel_backend=backend).float().cuda()
        for backend in ("auto", "torch")
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
    for got, want in ((outputs["auto"], outputs["torch"]), (gradients["auto"], gradients["torch"])):
        torch.testing.assert_close(got, want, atol=tolerance * want.abs().mean().item(), rtol=tolerance)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        state = LinearAttentionState()
        layer = layers["auto"]
        pieces = [layer(x[:, :290], attention_mask=mask[:, :290], position_ids=positions[:, :290], state=state)]
        for t in range(290, 300):
            pieces.append(
                layer(x[:, t : t + 1], attention_mask=mask[:, t : t + 1], position_ids=positions[:, t : t + 1],
                      state=state)
            )  # fmt: skip
    want = outputs["torch"]
    atol = tolerance * want.abs().mean().item()
    torch.testing.assert_close(torch.cat(pieces, 1).float(), want, atol=atol, rtol=tolerance)
    assert calls
