"""Compiled steps that a GPU can replay as CUDA graphs, proven as far as the CPU can prove it.

A CUDA graph replays fixed kernels at fixed addresses: the compiled step must be one graph (no break: a break is a
return to Python, ``fullgraph=True`` raises at one), read nothing back, make no shape from values, and write in
place only into inputs whose addresses are fixed, which the compiler knows as static (parameters, buffers, and
tensors marked with ``torch._dynamo.mark_static_address``): CUDA-graph trees skip a graph that mutates any other
input ("mutated inputs"). Here a dynamo backend hands each graph to AOTAutograd, which functionalises it and
records which inputs it mutates; the test compares them with the inputs dynamo marked static. What only a GPU can
confirm: that the graphs are captured and replayed (no CUDA-graph skip, ``benchmarks/gpu_check.py``'s decoding
part counts them), and their speed.
"""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._guards import TracingContext
from transformers import CompileConfig

import lrpe_hf

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, spe_realizations=8)
LENGTH = 70  # two chunks of 64 and a ragged one


class MutationRecorder:
    """A ``torch.compile`` backend that runs each graph as traced (through AOTAutograd) and records, per graph, the
    shapes of the inputs it mutates that are not static."""

    def __init__(self):
        self.graphs = []  # per graph: the shapes of its mutated inputs that are not static

    def __deepcopy__(self, memo):  # transformers' CompileConfig deep-copies its backend: the copy is this recorder
        return self

    def __call__(self, graph, example_inputs, **options):
        static = {i for i, t in enumerate(example_inputs) if getattr(t, "_dynamo_static_input_type", None)}

        def forward_compiler(functional_graph, inputs):
            info = TracingContext.try_get().fw_metadata.input_info
            mutated = {i for i, one in enumerate(info) if one.mutates_data}
            self.graphs.append([tuple(example_inputs[i].shape) for i in sorted(mutated - static)])
            return functional_graph

        return aot_autograd(
            fw_compiler=forward_compiler, bw_compiler=lambda backward_graph, inputs: backward_graph,
            keep_inference_input_mutations=True,
        )(graph, example_inputs)  # fmt: skip


def train_configurations():
    pairs = [(encoding, None) for encoding in lrpe_hf.POSITIONAL_ENCODINGS]
    return pairs + [("rope", feature_map) for feature_map in lrpe_hf.FEATURE_MAPS]


@pytest.mark.parametrize("rows", ["padded", "packed"])
@pytest.mark.parametrize(("encoding", "feature_map"), train_configurations())
def test_a_compiled_train_step_is_one_graph_that_mutates_only_static_inputs(encoding, feature_map, rows):
    """LinearGPT's forward with its loss under ``torch.compile(fullgraph=True)`` and its backward, as users write a
    train step: one graph (its backward compiled with it) whose only mutated inputs are static, with the eager step's
    loss and gradients. (The optimiser's step is torch's: ``torch.optim`` breaks its own graph.) Packed rows with
    convSPE are left out: its noise grid is sized by given positions' range, which a graph cannot read (the model's
    defaults need none)."""
    if encoding == "spe_conv" and rows == "packed":
        pytest.skip("convSPE's noise grid is sized by given positions' range, read on the host (a graph break)")
    torch.manual_seed(0)
    fields = {} if feature_map is None else {"feature_map": feature_map}
    config = lrpe_hf.LinearGPTConfig(
        vocab_size=60, max_position_embeddings=128, positional_encoding=encoding, **fields, **TINY
    )
    model = lrpe_hf.LinearGPTForCausalLM(config).train()
    ids = torch.randint(3, 60, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    kwargs = {}
    if rows == "padded":
        kwargs["attention_mask"] = torch.ones(2, LENGTH, dtype=torch.long)
        kwargs["attention_mask"][0, :9] = 0
    else:
        kwargs["position_ids"] = torch.cat([torch.arange(30), torch.arange(LENGTH - 30)]).expand(2, -1)
    weights = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(1)  # the same dropout masks and random features in both steps
    loss = model(ids, labels=ids, **kwargs).loss
    expected = torch.autograd.grad(loss, weights)

    torch._dynamo.reset()
    recorder = MutationRecorder()
    compiled_model = torch.compile(model, backend=recorder, fullgraph=True)
    torch.manual_seed(1)
    compiled_loss = compiled_model(ids, labels=ids, **kwargs).loss
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss)
    for weight, want in zip(weights, expected):  # float32 sums in the graph's order (as tests/test_models.py's)
        torch.testing.assert_close(weight.grad, want, atol=1e-5, rtol=1e-4)
    assert recorder.graphs == [[]], f"mutated inputs that are not static: {recorder.graphs}"


@pytest.mark.parametrize("compiled_by", ["user", "generate"])
@pytest.mark.parametrize("encoding", [e for e in lrpe_hf.POSITIONAL_ENCODINGS if e != "spe_conv"])
def test_generate_with_a_compiled_forward_mutates_only_static_inputs(encoding, compiled_by):
    """``generate`` with the forward compiled by the user (as for ``mode="reduce-overhead"``: the prefill's graph
    makes the cache's states) or by ``generate`` itself where a ``compile_config`` asks (the steps compiled, and the
    prompt too where it goes in chunks, ``prefill_chunk_size``): every decoding step's graph writes the states in
    place. Before each step the cache gives them addresses of their own, marked static
    (``LinearAttentionCache.make_static``); without that, the steps' graphs mutate inputs that are not static, and
    CUDA-graph trees skip them (as on the first H100 run). The tokens are eager's. (convSPE reads its noise at the
    step's positions: its steps are not graphs to replay.)"""
    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(vocab_size=60, positional_encoding=encoding, **TINY)
    model = lrpe_hf.LinearGPTForCausalLM(config).eval()
    ids = torch.randint(3, 60, (1, 8), generator=torch.Generator().manual_seed(0))
    eager = model.generate(ids, max_new_tokens=5, do_sample=False)
    torch._dynamo.reset()
    recorder = MutationRecorder()
    if compiled_by == "user":
        model.forward = torch.compile(model.forward, backend=recorder)
        compiled = model.generate(ids, max_new_tokens=5, do_sample=False)
    else:
        compile_config = CompileConfig(backend=recorder, mode=None)
        compile_config._compile_all_devices = True  # transformers compiles on its own on GPUs only
        compiled = model.generate(
            ids, max_new_tokens=5, do_sample=False, compile_config=compile_config, prefill_chunk_size=4
        )
    assert torch.equal(compiled, eager)
    assert len(recorder.graphs) >= (2 if compiled_by == "user" else 1)  # the prefill's (by the user), the steps'
    assert all(not mutated for mutated in recorder.graphs), f"mutated inputs that are not static: {recorder.graphs}"


@pytest.mark.parametrize("made_static", [False, True])
def test_a_compiled_prefills_states_are_mutated_inputs_until_made_static(made_static):
    """The check above can fail: states that a compiled prefill made are mutated by the next step's graph (the token
    counter, the layers' counters and states) as inputs that are not static, unless the cache makes them static
    before that step (as ``generate`` does, and a decoding loop of one's own should)."""
    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(vocab_size=60, positional_encoding="none", **TINY)
    model = lrpe_hf.LinearGPTForCausalLM(config).eval()
    ids = torch.randint(3, 60, (1, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    recorder = MutationRecorder()
    forward = torch.compile(model, backend=recorder, fullgraph=True)
    cache = lrpe_hf.LinearAttentionCache(config.num_hidden_layers)
    with torch.no_grad():
        token = forward(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if made_static:
            cache.make_static()
        forward(token, past_key_values=cache, use_cache=True)
    prefill, step = recorder.graphs
    assert prefill == []
    if made_static:
        assert step == []
    else:
        assert () in step and (1,) in step  # the cache's token count, the layers' real-token counts


@pytest.mark.parametrize("training", [True, False], ids=["train", "decode"])
@pytest.mark.parametrize("encoding", [e for e in lrpe_hf.POSITIONAL_ENCODINGS if e not in ("spe_conv", "fastrpb")])
def test_no_complex_tensor_in_a_compiled_graph(encoding, training):
    """Inductor generates no code for complex operators (it falls back to eager ones and warns): compiled, the
    rotations (rope, the LRPE types) take their real form, in a train step's graph (autograd Functions' subgraphs
    included) and in a decoding step's. (convSPE's and FastRPB's FFTs have complex spectra by nature; inductor runs
    FFTs as library kernels.)"""
    found = []

    def backend(graph, example_inputs):
        for _, module in graph.named_modules():
            for node in getattr(module, "graph", None).nodes if hasattr(module, "graph") else ():
                value = node.meta.get("example_value")
                if isinstance(value, torch.Tensor) and value.is_complex():
                    found.append(str(node.target))
        return graph

    torch.manual_seed(0)
    config = lrpe_hf.LinearGPTConfig(vocab_size=60, positional_encoding=encoding, **{**TINY, "num_hidden_layers": 1})
    model = lrpe_hf.LinearGPTForCausalLM(config).train(training)
    ids = torch.randint(3, 60, (2, 20), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    if training:
        compiled(ids, labels=ids).loss.backward()
    else:
        cache = lrpe_hf.LinearAttentionCache(config.num_hidden_layers)
        with torch.no_grad():
            compiled(ids, past_key_values=cache, use_cache=True)
            compiled(ids[:, :1], past_key_values=cache, use_cache=True)
    assert not found, f"complex tensors in the compiled graphs: {sorted(set(found))}"


def test_generate_with_a_compiled_forward_reads_no_token_count_back(monkeypatch):
    """After a compiled step the cache's count lives on the device only; preparing each next step asks whether the
    cache has seen tokens without reading it back (a sync per generated token on a GPU)."""
    from lrpe_hf.modeling.cache import LinearAttentionCache

    reads = []
    count = LinearAttentionCache.seen_tokens.fget

    def counted(cache):
        reads.append(cache.host_count is None)  # None: the count is read from the device
        return count(cache)

    monkeypatch.setattr(LinearAttentionCache, "seen_tokens", property(counted))
    torch.manual_seed(0)
    model = lrpe_hf.LinearGPTForCausalLM(lrpe_hf.LinearGPTConfig(vocab_size=60, **TINY)).eval()
    ids = torch.randint(3, 60, (1, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager")
    model.generate(ids, max_new_tokens=6, do_sample=False)
    assert not any(reads), f"{sum(reads)} reads of the token count from the device"
