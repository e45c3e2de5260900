"""``local_window``: exact softmax over each query's W nearest tokens, linear attention beyond, one normaliser.

Every registered encoding and feature map, causal and bidirectional, padded and packed, against an explicit O(N^2)
formula written here (the encodings' and maps' matrices from ``tests/reference.py``); the two limits (W at least the
sequence: ``attention="softmax"`` with the same weights; W = 0: today's layer, its parameters unchanged);
gradients; decoding token by token and by ``generate``; the refusals."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import make_layer
from reference import feature_map, position_matrix, spe_codes
from test_against_reference import padded_inputs
from test_triton_adapter import fla_calls, interpreted_kernels, kernels, triton_path_on_the_cpu  # noqa: F401

from lrpe_hf import FEATURE_MAPS, POSITIONAL_ENCODINGS, LinearAttentionState

WINDOW = 3


def windowed_layer(encoding, causal, seed=0, **options):
    """A small float64 layer with a window (``make_layer``), its learned factor away from 1; skips a combination
    the options refuse for a reason other than the window (and checks that a window refusal names it)."""
    try:
        make_layer(encoding, causal=causal, **{**options, "local_window": 0})
    except ValueError as error:
        pytest.skip(f"not a valid combination without a window either: {error}")
    try:
        layer = make_layer(encoding, causal=causal, seed=seed, **{"local_window": WINDOW, **options})
    except ValueError as error:
        assert "local_window" in str(error)
        pytest.skip(f"refused with a window: {error}")
    with torch.no_grad():
        layer.attention.local_window.log_linear_weight.copy_(torch.tensor([-0.7, 0.4], dtype=torch.float64))
    return layer


def documents_of(positions, mask):
    """Each token's document: a real token whose position is not above the previous real token's starts one."""
    B, N = mask.shape
    documents = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        current, previous = 0, None
        for i in range(N):
            if mask[b, i]:
                if previous is not None and positions[b, i] <= previous:
                    current += 1
                previous = int(positions[b, i])
            documents[b, i] = current
    return documents


def windowed_reference(layer, x, mask, positions=None, draw=None):
    """The module docstring's formula of ``local_window.py``, term by term, in float64: (B, N, hidden)."""
    o = layer.options
    B, N, _ = x.shape
    H, D, W = layer.num_heads, layer.head_dim, o.local_window
    x = x.double()
    if positions is None:
        positions = ((mask.long().cumsum(-1) - 1).clamp(min=0))[..., None]
    documents = documents_of(positions[..., 0], mask)

    def proj(linear, t):
        return t @ linear.weight.double().T + linear.bias.double()

    q, k, v = proj(layer.qkv_proj, x).view(B, N, 3, H, D).unbind(2)
    v = v * mask[:, :, None, None]
    out = torch.zeros(B, N, H, D, dtype=torch.float64)
    window = layer.attention.local_window
    softmax_form = SimpleNamespace(options=o, positional_encoding=window.encoding or layer.positional_encoding)
    decays = getattr(layer.positional_encoding, "decays", None)
    index = torch.arange(N)
    near = (index[:, None] - index[None, :]).abs() < W
    if o.causal:
        near &= index[:, None] >= index[None, :]
    for b in range(B):
        pos = [tuple(int(c) for c in p) for p in positions[b]]
        lag = torch.tensor([[pos[s][0] - pos[t][0] for t in range(N)] for s in range(N)], dtype=torch.float64)
        allowed = mask[b][None, :] & (documents[b][:, None] == documents[b][None, :])
        if o.causal:
            allowed &= torch.ones(N, N, dtype=torch.bool).tril()
        inside, outside = allowed & near, allowed & ~near
        for h in range(H):
            qh, kh, vh = q[b, :, h], k[b, :, h], v[b, :, h]
            if o.positional_encoding in ("spe_sine", "spe_conv"):
                R = o.spe_realizations
                qh = torch.einsum("nd,ndr->nr", qh, spe_codes(layer, draw, pos, h, True)) / (D * R) ** 0.25
                kh = torch.einsum("nd,ndr->nr", kh, spe_codes(layer, draw, pos, h, False)) / (D * R) ** 0.25
            r = float(decays[h]) if decays is not None and o.causal else 1.0

            def transformed(holder, fq, fk, h=h, pos=pos):
                mats = [position_matrix(holder, h, p, fq.shape[-1]) for p in pos]
                tq = torch.stack([mats[s] @ fq[s].to(torch.complex128) for s in range(N)])
                tk = torch.stack([mats[t] @ fk[t].to(torch.complex128) for t in range(N)])
                return (tq.conj() @ tk.T).real

            scores = transformed(softmax_form, qh, kh) / math.sqrt(qh.shape[-1]) + math.log(r) * lag.clamp(min=0)
            fq, fk = feature_map(layer, qh, h), feature_map(layer, kh, h)
            linear = transformed(layer, fq, fk) * r**lag
            norm = linear if o.normalization == "denominator" else (fq @ fk.T) * r**lag
            g = float(window.log_linear_weight[h].detach().exp())
            soft = torch.where(inside, scores.exp(), torch.zeros_like(scores))
            linear, norm = (torch.where(outside, t, torch.zeros_like(t)) * g for t in (linear, norm))
            numerator = (soft + linear) @ vh
            denominator = soft.sum(-1, keepdim=True) + norm.sum(-1, keepdim=True)
            out[b, :, h] = numerator / torch.where(denominator == 0, 1.0, denominator)
            if o.positional_encoding == "fastrpb":  # FastRPB's W V, after the attention, as in every path
                weights = layer.positional_encoding.weights[0, h].detach().double()
                bias = weights[o.max_positions - 1 + lag.long()]
                seen = mask[b][None, :] & (documents[b][:, None] == documents[b][None, :])
                seen &= lag >= 0 if o.causal else torch.ones_like(seen)
                bias = torch.where(seen, bias, torch.zeros_like(bias))
                out[b, :, h] += bias @ vh
    out = out * mask[:, :, None, None]
    return proj(layer.o_proj, out.reshape(B, N, H * D))


def inputs(causal, packed, batch=2, tokens=11, hidden=16, seed=0):
    """``test_against_reference.padded_inputs`` (row 0 full, row 1 padded: left when causal, right otherwise);
    packed: positions restart mid-row."""
    x, mask = padded_inputs(causal, batch, tokens, hidden, seed)
    positions = None
    if packed:
        positions = torch.zeros(batch, tokens, 1, dtype=torch.long)
        positions[0, :, 0] = torch.cat([torch.arange(6), torch.arange(tokens - 6)])
        real = torch.arange(int(mask[1].sum()))
        positions[1, mask[1], 0] = torch.cat([real[:4], real[4:] - 4])
    return x, mask, positions


def check(layer, x, mask, positions=None, atol=1e-8):
    draw = layer.shared_codes.draw() if layer.shared_codes is not None else None
    got = layer(x, attention_mask=mask, position_ids=positions, shared_draw=draw)
    want = windowed_reference(layer, x, mask, positions, draw)
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-6)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("feature", FEATURE_MAPS)
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_window_matches_quadratic_formula(encoding, feature, causal, layout):
    layer = windowed_layer(encoding, causal, feature_map=feature, chunk_size=4)
    check(layer, *inputs(causal, layout == "packed"))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_a_window_over_the_whole_sequence_is_softmax_attention(encoding, causal):
    try:
        softmax = make_layer(encoding, attention="softmax", causal=causal)
    except ValueError as error:
        pytest.skip(str(error))
    layer = windowed_layer(encoding, causal, feature_map="elu", local_window=1000)
    missing, unexpected = layer.load_state_dict(softmax.state_dict(), strict=False)
    assert missing == ["attention.local_window.log_linear_weight"] and not unexpected
    x, mask, _ = inputs(causal, packed=False)
    draw = softmax.shared_codes.draw() if softmax.shared_codes is not None else None
    want = softmax(x, attention_mask=mask, shared_draw=draw)
    torch.testing.assert_close(layer(x, attention_mask=mask, shared_draw=draw), want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_no_window_is_todays_layer(encoding):
    causal = True
    today = make_layer(encoding, causal=causal)
    off = make_layer(encoding, causal=causal, local_window=0)
    assert list(off.state_dict()) == list(today.state_dict())
    assert off.attention.local_window is None
    x, mask, _ = inputs(causal, packed=False)
    draw = today.shared_codes.draw() if today.shared_codes is not None else None
    assert torch.equal(off(x, attention_mask=mask, shared_draw=draw), today(x, attention_mask=mask, shared_draw=draw))


def test_models_without_a_window_keep_their_parameters():
    from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM

    sizes = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    today = LinearGPTForCausalLM(LinearGPTConfig(**sizes))
    off = LinearGPTForCausalLM(LinearGPTConfig(**sizes, local_window=0))
    on = LinearGPTForCausalLM(LinearGPTConfig(**sizes, local_window=4))
    assert list(off.state_dict()) == list(today.state_dict())
    extra = set(on.state_dict()) - set(today.state_dict())
    name = "model.stack.layers.{}.self_attn.attention.local_window.log_linear_weight"
    assert extra == {name.format(i) for i in range(2)}, extra
    assert all(float(p.abs().max()) == 0 for n, p in on.named_parameters() if "log_linear_weight" in n)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("encoding", ["rope", "permute", "spe_sine", "fastrpb"])
def test_gradients_reach_the_factor_and_match_the_formula(encoding, causal):
    layer = windowed_layer(encoding, causal, feature_map="elu", chunk_size=4)
    x, mask, positions = inputs(causal, packed=True)
    draw = layer.shared_codes.draw() if layer.shared_codes is not None else None
    x = x.requires_grad_()
    got = layer(x, attention_mask=mask, position_ids=positions, shared_draw=draw)
    (grad_x,) = torch.autograd.grad(got.square().sum(), x, retain_graph=True)
    factor = layer.attention.local_window.log_linear_weight
    (grad_factor,) = torch.autograd.grad(got.square().sum(), factor)
    assert grad_factor.abs().min() > 0
    want = windowed_reference(layer, x, mask, positions, draw)
    torch.testing.assert_close(torch.autograd.grad(want.square().sum(), x)[0], grad_x, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("feature", ["elu", "exp"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_decoding_token_by_token_equals_the_full_forward(encoding, feature):
    """A prompt of 5 tokens, then one token a call (and a call of 3): the state keeps the last W tokens beside the
    linear state of the older ones, in tensors whose shapes never change."""
    layer = windowed_layer(encoding, True, feature_map=feature, chunk_size=4)
    x, mask, _ = inputs(True, packed=False, tokens=14)
    draw = layer.shared_codes.draw() if layer.shared_codes is not None else None
    want = layer(x, attention_mask=mask, shared_draw=draw)
    state = LinearAttentionState()
    pieces = [layer(x[:, :5], attention_mask=mask[:, :5], state=state, shared_draw=draw)]
    shapes = {n: t.shape for n, t in vars(state.path.window).items() if isinstance(t, torch.Tensor)}
    for start, end in [(5, 6), (6, 7), (7, 10), (10, 11), (11, 12), (12, 13), (13, 14)]:
        pieces.append(layer(x[:, start:end], attention_mask=mask[:, start:end], state=state, shared_draw=draw))
        window = state.path.window
        assert {n: t.shape for n, t in vars(window).items() if isinstance(t, torch.Tensor)} == shapes
    torch.testing.assert_close(torch.cat(pieces, dim=1), want, atol=1e-10, rtol=1e-8)


def test_decoding_packed_rows_equals_the_full_forward():
    layer = windowed_layer("permute", True, feature_map="relu", chunk_size=4)
    x, mask, positions = inputs(True, packed=True)
    want = layer(x, attention_mask=mask, position_ids=positions)
    state = LinearAttentionState()
    pieces = [layer(x[:, :4], attention_mask=mask[:, :4], position_ids=positions[:, :4], state=state)]
    for i in range(4, x.shape[1]):
        step = slice(i, i + 1)
        pieces.append(layer(x[:, step], attention_mask=mask[:, step], position_ids=positions[:, step], state=state))
    torch.testing.assert_close(torch.cat(pieces, dim=1), want, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("encoding", ["rope", "lrpe_orthogonal", "permute", "spe_sine", "fastrpb"])
def test_generate_on_a_left_padded_batch_equals_the_full_forward(encoding):
    from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM

    torch.manual_seed(0)
    config = LinearGPTConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        positional_encoding=encoding, local_window=4, max_position_embeddings=64, spe_realizations=4,
        spe_kernel_size=3, pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    model = LinearGPTForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "log_linear_weight" in name:
                parameter.normal_(0.0, 1.0)
    prompt = torch.randint(1, 40, (2, 7))
    mask = torch.ones_like(prompt)
    prompt[1, :3], mask[1, :3] = 0, 0
    out = model.generate(
        prompt, attention_mask=mask, max_new_tokens=9, do_sample=False, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    sequences = out.sequences
    full_mask = torch.cat([mask, torch.ones(2, sequences.shape[1] - 7, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        logits = model(sequences, attention_mask=full_mask).logits
    steps = torch.stack(out.logits, dim=1).to(logits.dtype)  # (B, new tokens, vocab)
    torch.testing.assert_close(steps, logits[:, 6:-1], atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(local_window=-1), "local_window must be a whole number of tokens >= 0"),
        (dict(local_window=2.5), "local_window must be a whole number"),
        (dict(local_window=True), "local_window must be a whole number"),
        (dict(local_window=4, attention="softmax"), "local_window .* needs attention='linear'"),
        (dict(local_window=4, position_dims=2, positional_encoding="rope"), "local_window counts .* 2D window"),
        (dict(local_window=4, normalization="output_norm"), "local_window shares one normaliser.*output_norm"),
        (dict(local_window=4, positional_encoding="rope", feature_map="dpfp"), "denominator or unrotated_denominator"),
    ],
)
def test_what_a_window_cannot_do_is_refused_by_name(options, message):
    from lrpe_hf import AttentionOptions, LinearRobertaConfig

    with pytest.raises(ValueError, match=message):
        AttentionOptions(**options)
    if "position_dims" not in options:
        config_options = {k: v for k, v in options.items() if k != "position_dims"}
        with pytest.raises(ValueError, match=message):
            LinearRobertaConfig(vocab_size=20, hidden_size=16, num_attention_heads=2, **config_options)


def test_vit_refuses_a_window():
    from lrpe_hf import LinearViTConfig

    with pytest.raises(ValueError, match="local_window counts .*LinearViT"):
        LinearViTConfig(hidden_size=16, num_attention_heads=2, local_window=4)


def test_context_parallelism_refuses_a_window():
    """One process as a group of one: the refusal comes before any collective."""
    from test_context_parallel import free_port

    from lrpe_hf.modeling.context_parallel import context_parallel

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        layer = make_layer("rope", causal=True, local_window=4)
        with context_parallel(), pytest.raises(ValueError, match="Context parallelism does not take local_window"):
            layer(torch.randn(1, 8, 16, dtype=torch.float64))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("encoding", ["rope", "permute", "fastrpb"])
def test_generate_with_a_compiled_forward_mutates_only_static_inputs(encoding):
    """The window's decoding state keeps its shapes: compiled steps write it in place, as the linear states."""
    from test_compiled_steps import TINY, MutationRecorder

    from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM

    torch.manual_seed(0)
    config = LinearGPTConfig(vocab_size=60, positional_encoding=encoding, local_window=3, max_position_embeddings=64,
                             **TINY)  # fmt: skip
    model = LinearGPTForCausalLM(config).eval()
    ids = torch.randint(3, 60, (1, 8), generator=torch.Generator().manual_seed(0))
    eager = model.generate(ids, max_new_tokens=5, do_sample=False)
    torch._dynamo.reset()
    recorder = MutationRecorder()
    model.forward = torch.compile(model.forward, backend=recorder)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), eager)
    if encoding != "fastrpb":  # FastRPB's value history grows (a new shape at each growth), as without a window
        assert all(not mutated for mutated in recorder.graphs), f"mutated inputs that are not static: {recorder.graphs}"


@pytest.mark.parametrize("encoding", ["rope", "permute", "none"])
def test_the_linear_part_runs_on_flas_kernels(triton_path_on_the_cpu, encoding):  # noqa: F811 (a fixture)
    """With kernel_backend='triton' the product beyond the window is fla's (its torch references, and its Triton
    kernels under the interpreter: ``tests/test_triton_adapter.py``'s fixtures), and the layer equals the torch
    path's, forward, gradients and decoding."""
    from test_triton_adapter import forward_and_gradients, packed_inputs

    calls = triton_path_on_the_cpu
    feature_map = {"none": "exp"}.get(encoding, "elu")
    layers = [
        make_layer(encoding, hidden_size=18, feature_map=feature_map, causal=True, kernel_backend=backend,
                   local_window=8).float()
        for backend in ("triton", "torch")
    ]  # fmt: skip
    x, mask, positions = packed_inputs()
    out, grads = forward_and_gradients(layers[0], x, attention_mask=mask, position_ids=positions)
    want, want_grads = forward_and_gradients(layers[1], x, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-4)
    state = LinearAttentionState()
    with torch.no_grad():
        pieces = [layers[0](x[:, :96], attention_mask=mask[:, :96], position_ids=positions[:, :96], state=state)]
        for t in range(96, 100):
            span = slice(t, t + 1)
            pieces.append(layers[0](x[:, span], attention_mask=mask[:, span], position_ids=positions[:, span],
                                    state=state))  # fmt: skip
    torch.testing.assert_close(torch.cat(pieces, dim=1), want, atol=1e-5, rtol=1e-4)
    assert "chunked" in {name for name, *_ in calls}
