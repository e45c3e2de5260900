"""LinearGPT generation: recurrent cache, incremental == full forward, padding, strategies, unsupported modes."""

import contextlib
import copy

import pytest
import torch

import lrpe_hf
from lrpe_hf import LinearAttentionCache, LinearGPTConfig, LinearGPTForCausalLM
from lrpe_hf.modeling.forward_arguments import CACHE_OUTPUT_FIELD

CONFIG = dict(
    vocab_size=60,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
    pad_token_id=0,
    eos_token_id=None,
    hidden_dropout_prob=0.0,
    spe_realizations=8,
)


def model_with(encoding="lrpe_orthogonal", **kw):
    torch.manual_seed(0)
    return LinearGPTForCausalLM(LinearGPTConfig(**{**CONFIG, "positional_encoding": encoding, **kw})).eval()


def prompt(batch=2, tokens=7, seed=0):
    return torch.randint(3, 60, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def left_padded_batch(padding: int, short: int, long: int):
    """Two prompts as one batch, (2, long) ids and mask: ``short`` tokens after ``padding`` masked pad tokens, and
    ``long`` tokens (padding + short == long)."""
    ids = torch.cat([torch.cat([torch.zeros(1, padding, dtype=torch.long), prompt(1, short)], dim=1), prompt(1, long)])
    mask = torch.ones_like(ids)
    mask[0, :padding] = 0
    return ids, mask


@contextlib.contextmanager
def forward_argument(model, name: str):
    """The list of the ``name`` argument of every forward call of ``model`` while inside (None where not given)."""
    given = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: given.append(kwargs.get(name)), with_kwargs=True
    )
    try:
        yield given
    finally:
        hook.remove()


@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("encoding", lrpe_hf.POSITIONAL_ENCODINGS)
def test_incremental_decoding_equals_full_forward(encoding, attention):
    feature_map = "exp" if attention == "linear" and encoding in ("rope", "spe_sine") else None
    model = model_with(encoding, attention=attention, feature_map=feature_map)
    ids = prompt(tokens=12)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        pieces = [model(ids[:, :5], past_key_values=cache, use_cache=True).logits]
        for t in range(5, 12):
            pieces.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == 12


@pytest.mark.parametrize(
    "encoding, attention", [(e, "linear") for e in lrpe_hf.POSITIONAL_ENCODINGS] + [("rope", "softmax")]
)
def test_left_padded_batched_generation_equals_each_prompt_alone(encoding, attention):
    """Compared on every step's logits, which read the whole context (an untrained model's tokens barely do: a
    changed first token moves them by far more than the tolerance). Its decoding steps go without the mask (see the
    next test): the padding's place is known from the cache."""
    model = model_with(encoding, attention=attention)
    short, long = prompt(batch=1, tokens=4, seed=1), prompt(batch=1, tokens=7, seed=2)
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1), long])
    mask = (ids != 0).long()
    mask[1] = 1

    def generate(ids, **kwargs):
        out = model.generate(
            ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs
        )
        return out.sequences, torch.stack(out.logits, dim=1)

    batched, batched_logits = generate(ids, attention_mask=mask)
    alone_short, short_logits = generate(short)
    alone_long, long_logits = generate(long)
    assert batched[0, 3:].tolist() == alone_short[0].tolist()
    assert batched[1].tolist() == alone_long[0].tolist()
    torch.testing.assert_close(batched_logits[0], short_logits[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(batched_logits[1], long_logits[0], atol=1e-5, rtol=1e-4)
    _, changed_logits = generate(torch.cat([short[:, :1] % 50 + 3, short[:, 1:]], dim=1))
    assert (changed_logits - short_logits).abs().max() > 1e-3  # the comparison can fail


def test_generate_hands_the_mask_to_the_prefill_only():
    """generate's mask is ones for the tokens it appends: its decoding steps go without one (the layers' every-token-
    real path); the prompt's call keeps it, and so does a call that continues a cache with a new, padded piece."""
    model = model_with("permute")
    ids, mask = left_padded_batch(3, 4, 7)
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    with forward_argument(model, "attention_mask") as given:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **{CACHE_OUTPUT_FIELD: cache})
    assert len(given) == 4 and given[0] is not None and given[0].shape == (2, 7)
    assert all(m is None for m in given[1:])
    more = torch.cat([out, torch.tensor([[0, 0, 5], [6, 7, 8]])], dim=1)
    more_mask = torch.cat([mask, torch.ones(2, 4, dtype=torch.long), torch.tensor([[0, 0, 1], [1, 1, 1]])], dim=1)
    with forward_argument(model, "attention_mask") as given:
        model.generate(more, attention_mask=more_mask, max_new_tokens=2, do_sample=False, **{CACHE_OUTPUT_FIELD: cache})
    assert len(given) == 2 and given[0] is not None and given[1] is None


def test_sampling_and_beam_search():
    model = model_with("permute")
    ids = prompt()
    torch.manual_seed(5)
    first = model.generate(ids, max_new_tokens=5, do_sample=True, top_k=10)
    torch.manual_seed(5)
    again = model.generate(ids, max_new_tokens=5, do_sample=True, top_k=10)
    assert first.tolist() == again.tolist()
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False)
    single_beam = model.generate(ids, max_new_tokens=5, num_beams=1, do_sample=False)
    assert greedy.tolist() == single_beam.tolist()
    beams = model.generate(ids, max_new_tokens=5, num_beams=3, do_sample=False, num_return_sequences=2)
    assert beams.shape == (4, 12)
    # beam search over a batch equals beam search over each prompt alone
    for row in range(2):
        alone = model.generate(
            ids[row : row + 1], max_new_tokens=5, num_beams=3, do_sample=False, num_return_sequences=2
        )
        assert beams[2 * row : 2 * row + 2].tolist() == alone.tolist()


def test_beam_search_scores_match_a_full_forward():
    """The best beam's score is the log-probability of its tokens under a full (non-cached) forward."""
    model = model_with("lrpe_orthogonal")
    ids = prompt(batch=1)
    out = model.generate(
        ids,
        max_new_tokens=4,
        num_beams=3,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        length_penalty=0.0,
    )
    sequence = out.sequences[0:1]
    with torch.no_grad():
        logprobs = model(sequence, use_cache=False).logits.log_softmax(-1)
    new = sequence[0, ids.shape[1] :]
    expected = sum(logprobs[0, ids.shape[1] - 1 + i, token] for i, token in enumerate(new.tolist()))
    torch.testing.assert_close(out.sequences_scores[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("encoding", lrpe_hf.POSITIONAL_ENCODINGS)
def test_decoding_under_inference_mode_equals_decoding_under_no_grad(encoding):
    """inference_mode tracks no views: a state first stored from a view (the positions' last column, expanded
    over the batch) must still be a tensor of its own, which later steps overwrite in place."""
    model = model_with(encoding)
    ids = prompt(batch=2, tokens=6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row

    def decode(context):
        cache, tokens, logits = LinearAttentionCache(model.config.num_hidden_layers), ids, []
        with context():
            for step in range(4):
                step_mask = torch.cat([mask, torch.ones(2, step, dtype=torch.long)], dim=1)
                out = model(tokens, attention_mask=step_mask, past_key_values=cache, use_cache=True).logits[:, -1:]
                logits.append(out.clone())
                tokens = out.argmax(-1)
        return torch.cat(logits, dim=1)

    torch.testing.assert_close(decode(torch.inference_mode), decode(torch.no_grad), rtol=0, atol=0)


@pytest.mark.parametrize("encoding", ["lrpe_orthogonal", "permute", "spe_sine"])
def test_state_size_does_not_grow_with_context(encoding):
    model = model_with(encoding)

    def cache_numbers(tokens):
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        with torch.no_grad():
            model(prompt(tokens=tokens), past_key_values=cache, use_cache=True)
        return sum(v.numel() for s in cache.states for v in vars(s).values() if isinstance(v, torch.Tensor))

    assert cache_numbers(5) == cache_numbers(80)


def test_unsupported_generation_modes_raise():
    """Strategies that roll rejected tokens back are refused by generate, naming the mode, before any decoding;
    the cache refuses a rollback by itself too (a recurrent state cannot forget tokens)."""
    model = model_with()
    with pytest.raises(ValueError, match="(?i)assisted_generation"):
        model.generate(prompt(batch=1), max_new_tokens=5, prompt_lookup_num_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="(?i)assisted_generation"):
        model.generate(prompt(batch=1), max_new_tokens=5, assistant_model=model_with(), do_sample=False)
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    model(prompt(), past_key_values=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(3)
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="LinearAttentionCache"):
        model(prompt(), past_key_values=DynamicCache(), use_cache=True)


def test_fastrpb_history_mixing_grad_and_no_grad_steps():
    """The history buffer grows by doubling without autograd and concatenates with it; mixing both is exact."""
    from lrpe_hf import LinearAttention, LinearAttentionState

    torch.manual_seed(0)
    layer = LinearAttention(
        16, 2, positional_encoding="fastrpb", causal=True, max_positions=256, fastrpb_init_std=0.3
    ).eval()
    x = torch.randn(1, 150, 16)
    full = layer(x)
    state = LinearAttentionState()
    pieces = []
    for t in range(150):
        if t % 3 == 0:
            pieces.append(layer(x[:, t : t + 1], state=state))
        else:
            with torch.no_grad():
                pieces.append(layer(x[:, t : t + 1], state=state))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_decoding_with_a_mask_of_the_new_tokens_only_continues_each_rows_real_positions():
    """With a cache, a mask may cover the new tokens only: positions then continue from each row's real tokens
    (padding not counted), as a mask over every token would give them."""
    model = model_with("lrpe_orthogonal", absolute_position_embedding="learned")
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt(batch=1, tokens=4)], dim=1)
    ids = torch.cat([ids, prompt(batch=1, tokens=7, seed=3)])
    mask = (ids != 0).long()
    mask[1] = 1
    following = prompt(tokens=3, seed=4)
    logits = {}
    with torch.no_grad():
        for covers in ("new tokens", "every token"):
            cache = LinearAttentionCache(model.config.num_hidden_layers)
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            steps, seen = [], mask
            for t in range(3):
                seen = torch.cat([seen, torch.ones(2, 1, dtype=torch.long)], dim=1)
                step_mask = seen[:, -1:] if covers == "new tokens" else seen
                out = model(following[:, t : t + 1], attention_mask=step_mask, past_key_values=cache, use_cache=True)
                steps.append(out.logits)
            logits[covers] = torch.cat(steps, dim=1)
    torch.testing.assert_close(logits["new tokens"], logits["every token"])


def test_default_positions_after_given_ones_start_a_document_where_they_fall_back():
    """Only given positions restart a document, but default positions (counting real tokens) that follow given ones
    can fall back to or below them: they start a new document, as given positions would."""
    from lrpe_hf import LinearAttention, LinearAttentionState

    torch.manual_seed(0)
    layer = LinearAttention(16, 2, positional_encoding="rope", causal=True).eval()
    first, second = torch.randn(1, 3, 16), torch.randn(1, 2, 16)
    with torch.no_grad():
        state = LinearAttentionState()
        layer(first, position_ids=torch.tensor([[10, 11, 12]]), state=state)
        continued = layer(second, state=state)  # default positions 3, 4: not after 12
        alone = layer(second, position_ids=torch.tensor([[3, 4]]), state=LinearAttentionState())
    torch.testing.assert_close(continued, alone)


@pytest.mark.parametrize(
    "encoding",
    ["none", "rope", "lrpe_orthogonal", "lrpe_unitary", "lrpe_permutation", "permute", "fastrpb", "spe_sine"],
)
def test_a_compiled_decoding_step_is_one_graph_traced_once_that_decodes_as_eager(encoding):
    """Under torch.compile(fullgraph=True) a decoding step is one graph: it reads no Python token count, takes no
    data-dependent branch and breaks nowhere (the cache counts tokens in a tensor). After the first steps (the first
    trace, then the state's layout after the prompt, then the mask's length made dynamic) no step traces again; its
    logits are those of eager decoding. Every state tensor keeps its address from step to step (written in place),
    as a CUDA graph replaying the step needs."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = model_with(encoding, absolute_position_embedding="learned")
    ids = prompt(batch=2, tokens=6)
    caches = [LinearAttentionCache(model.config.num_hidden_layers) for _ in range(2)]
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    # a limit far above the steps taken: a step that traced again would show in the count, not fall back to eager
    # (torch renamed cache_size_limit to recompile_limit in 2.7)
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch.no_grad(), torch._dynamo.config.patch(**{limit: 64}):
        first = [model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1) for cache in caches]
        mask = torch.ones(2, 7, dtype=torch.long)
        explained = torch._dynamo.explain(model)(
            first[0], attention_mask=mask, past_key_values=copy.deepcopy(caches[0])
        )
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        tokens, mask = first, mask[:, :6]
        traced_after_warm_up = None
        addresses = [state_addresses(cache) for cache in caches]
        for step in range(8):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            logits = [
                run(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True).logits
                for run, token, cache in zip((compiled, model), tokens, caches)
            ]
            torch.testing.assert_close(logits[0], logits[1])
            tokens = [logits[0][:, -1:].argmax(-1)] * 2
            if step == 3:
                traced_after_warm_up = counter.frame_count
            assert [state_addresses(cache) for cache in caches] == addresses  # each step (a freed block can return)
    assert counter.frame_count == traced_after_warm_up
    assert [cache.get_seq_length() for cache in caches] == [14, 14]


def test_a_models_layers_share_one_set_of_token_counters():
    """Every layer of a model sees the same tokens: their states hold the first one's counters (the same tensors),
    advanced once per call after every layer has read them. Over a left-padded prompt, decoding steps and a
    continuation with packed positions, they hold each row's real tokens, its last real position and its document;
    PermuteFormer (which reads the last position in every layer) decodes as the full forward does."""
    model = model_with("permute")
    ids, mask = left_padded_batch(2, 4, 6)
    cache = LinearAttentionCache(model.config.num_hidden_layers)

    def counters(state):
        return state.num_tokens, state.last_position, state.document

    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        steps = []
        for _ in range(2):
            token = logits[:, -1:].argmax(-1)
            steps.append(token)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            logits = model(token, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        first = counters(cache.states[0])
        assert all(a is b for state in cache.states[1:] for a, b in zip(counters(state), first))
        assert first[0].tolist() == [6, 8] and first[1].tolist() == [5, 7] and first[2].tolist() == [0, 0]
        full = model(torch.cat([ids, *steps], dim=1), attention_mask=mask).logits
        torch.testing.assert_close(logits[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
        piece = prompt(2, 3, seed=1)  # a new document starts at each row's second token (positions restart)
        model(piece, position_ids=torch.tensor([[8, 0, 1], [9, 0, 1]]), past_key_values=cache, use_cache=True)
        assert first[0].tolist() == [9, 11] and first[1].tolist() == [1, 1] and first[2].tolist() == [1, 1]
        assert all(a is b for state in cache.states[1:] for a, b in zip(counters(state), counters(cache.states[0])))


def state_addresses(cache):
    """{name: data pointer} of the cache's token count and every layer's state tensor but FastRPB's value history
    (which grows: doubling its storage when full)."""
    addresses = {"token_count": cache.token_count.data_ptr()}
    for index, state in enumerate(cache.states):
        for holder, prefix in ((state, "state"), (state.path, "path")):
            for name, value in vars(holder).items():
                if isinstance(value, torch.Tensor):
                    addresses[f"{index}.{prefix}.{name}"] = value.data_ptr()
    assert any(".path.kv" in name for name in addresses)
    return addresses


def test_generate_leaves_positions_to_the_model_and_generates_the_same_compiled():
    """generate passes no position_ids (the model's defaults, counted from the mask, are the ones it would build),
    so each step skips the search for packed documents; a compiled forward generates what eager does."""
    model = model_with("rope")
    ids, mask = left_padded_batch(2, 4, 6)
    with forward_argument(model, "position_ids") as given:
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert len(given) == 6 and all(positions is None for positions in given)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager")
    assert model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False).tolist() == expected.tolist()


def test_a_compiled_decoding_step_refuses_a_mask_that_disagrees_with_the_cache():
    """Compiled, the mask's past cannot be checked against the cache's count; it is checked against the real tokens
    the cache has seen per row, from which the positions are counted."""
    model = model_with("rope")
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    with torch.no_grad():
        token = model(prompt(batch=2, tokens=6), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager")
        with pytest.raises(RuntimeError, match="past tokens do not match the cache"):
            compiled(token, attention_mask=torch.ones(2, 6, dtype=torch.long), past_key_values=copy.deepcopy(cache))
        compiled(token, attention_mask=torch.ones(2, 7, dtype=torch.long), past_key_values=cache)
    assert cache.get_seq_length() == 7


@pytest.mark.parametrize("name", ["cache", "past_key_values", "cache_params"])
def test_the_cache_is_taken_under_every_name_transformers_has_given_it(name):
    """transformers 5.24 hands the cache over as ``cache``; earlier releases as ``past_key_values`` (and recurrent
    models' ``cache_params``). Under each name, incremental decoding equals the full forward."""
    model = model_with("permute")
    ids = prompt(tokens=8)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        pieces = [model(ids[:, :5], use_cache=True, **{name: cache}).logits]
        for t in range(5, 8):
            pieces.append(model(ids[:, t : t + 1], use_cache=True, **{name: cache}).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="Pass the cache once"):
        model(ids, past_key_values=cache, cache=cache)


def test_an_argument_the_model_does_not_use_raises_naming_it():
    model = model_with()
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    with pytest.raises(TypeError, match="does not use: recurrent_state"):
        model(prompt(), recurrent_state=cache)
    with pytest.raises(TypeError, match="read packed rows from position_ids alone"):
        model.model(prompt(), cu_seq_lens_q=torch.tensor([0, 7]))
    # what transformers passes and the model understands or has no use for: the loss's token count, cache slots,
    # return_dict, generate's tokenizer (for stop strings)
    out = model(
        prompt(),
        labels=prompt(),
        num_items_in_batch=10,
        cache_position=torch.arange(7),
        return_dict=True,
        tokenizer=None,
    )
    assert out.loss is not None


@pytest.mark.parametrize("handover", ["renamed", "dropped"])
def test_a_generation_step_that_lost_its_cache_raises(handover, monkeypatch):
    """A future release that hands the cache over under a name the model does not know, or not at all, must stop
    generate at its prompt (the renamed cache, an argument the forward refuses) or its first decoding step (the cache
    dropped), not let the model decode each new token without its context."""
    from transformers.generation import GenerationMixin

    prepare = GenerationMixin.prepare_inputs_for_generation

    def moved_cache(self, *args, **kwargs):
        inputs = prepare(self, *args, **kwargs)
        for name in ("cache", "past_key_values"):
            if inputs.get(name) is not None:
                cache = inputs.pop(name)
                if handover == "renamed":
                    inputs["recurrent_state"] = cache
        return inputs

    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", moved_cache)
    refusal = "does not use: recurrent_state" if handover == "renamed" else "without the cache"
    with pytest.raises((RuntimeError, TypeError), match=refusal):
        model_with().generate(prompt(batch=1), max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("encoding", lrpe_hf.POSITIONAL_ENCODINGS)
def test_training_after_inference_mode_decoding_works_and_matches_a_fresh_model(encoding):
    """Values an encoding caches for evaluation (normalised vectors, rates, decays, noise) made under
    inference_mode would be inference tensors, which a later training step cannot save for backward."""
    model, fresh = model_with(encoding), model_with(encoding)
    ids = prompt(batch=2, tokens=6)
    with torch.inference_mode():
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        model(ids, past_key_values=cache, use_cache=True)
        model(ids[:, :1], past_key_values=cache, use_cache=True)
    losses = []
    for m in (model, fresh):
        m.train()
        torch.manual_seed(1)  # the same training-mode draws (SPE's noise)
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("encoding", ["none", "lrpe_orthogonal", "permute"])
def test_generate_with_a_compiled_forward_breaks_no_graph(encoding):
    """model.forward compiled, as a user does before generate: the prefill and the steps are one graph each, with
    no graph break (``fullgraph=True`` raises at one: the in-place feature map's write into a strided view, and the
    state's question about inference mode, each broke the prefill's graph) and no recompilation after the first
    step; the tokens are eager's."""
    from torch._dynamo.testing import CompileCounter

    model = model_with(encoding)
    ids = prompt(batch=1)
    eager = model.generate(ids, max_new_tokens=5, do_sample=False)
    torch._dynamo.reset()
    counter = CompileCounter()
    model.forward = torch.compile(model.forward, backend=counter, fullgraph=True)
    compiled = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert counter.frame_count == 2  # the prefill's graph and the step's
    assert torch.equal(compiled, eager)


class GraphCounter:
    """A ``torch.compile`` backend that counts the graphs it compiles and runs them as traced. ``CompileConfig``
    deep-copies its backend: the copy is this counter."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs, **options):
        self.graphs += 1
        return graph.forward

    def __deepcopy__(self, memo):
        return self


def compile_everywhere(backend):
    """What a user writes to have ``generate`` compile decoding on any device (transformers compiles on its own on
    GPUs only, and this model only where a compile_config asks)."""
    from transformers import CompileConfig

    config = CompileConfig(backend=backend, mode=None, fullgraph=True)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("encoding", ["none", "rope", "lrpe_orthogonal", "permute"])
@pytest.mark.parametrize("strategy", [dict(do_sample=False), dict(do_sample=True, top_k=8)])
def test_generate_compiles_decoding_when_asked_into_one_graph_with_the_eager_tokens(encoding, strategy):
    """With a compile_config, generate compiles the decoding steps itself (its prompt runs eagerly): every step of
    a left-padded batch runs one graph, traced once with no recompile per step, and gives eager's tokens (greedy,
    and sampling from the same seed)."""
    model = model_with(encoding)
    ids, mask = left_padded_batch(3, 5, 8)
    torch.manual_seed(1)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=6, **strategy)
    torch._dynamo.reset()
    counter = GraphCounter()
    torch.manual_seed(1)
    compiled = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, compile_config=compile_everywhere(counter), **strategy
    )
    assert torch.equal(compiled, eager)
    assert counter.graphs == 1


def test_generate_stays_eager_unless_asked_and_where_told_not_to():
    """No compile_config (the default, on a GPU too: compiled decoding has not been measured on one yet),
    ``disable_compile=True``, and beam search (which transformers runs eagerly) compile nothing, and give the same
    tokens as the eager model."""
    model = model_with("rope")
    ids, mask = left_padded_batch(3, 5, 8)
    counter = GraphCounter()
    asked = compile_everywhere(counter)
    eager_beams = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False)
    torch._dynamo.reset()
    beams = model.generate(
        ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, compile_config=asked
    )
    assert torch.equal(beams, eager_beams)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, compile_config=asked, disable_compile=True)
    assert counter.graphs == 0
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    default = copy.deepcopy(model.generation_config)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
        assert not model._valid_auto_compile_criteria({CACHE_OUTPUT_FIELD: cache}, default)
        default.compile_config = asked
        assert model._valid_auto_compile_criteria({CACHE_OUTPUT_FIELD: cache}, default)


def short_step_cases():
    cases = [(encoding, {}) for encoding in lrpe_hf.POSITIONAL_ENCODINGS]
    cases += [("rope", {"feature_map": feature_map}) for feature_map in lrpe_hf.FEATURE_MAPS if feature_map != "elu"]
    cases += [
        ("permute", {"normalization": "output_norm"}),
        ("lrpe_orthogonal", {"normalization": "output_layer_norm"}),
    ]
    return cases


@pytest.mark.parametrize(("encoding", "fields"), short_step_cases())
def test_a_decoding_step_takes_its_short_path_where_it_can_and_equals_the_general_one(encoding, fields, monkeypatch):
    """generate's steps (one token, default positions, no mask) take the layers' short decoding step where the layer
    can (``takes_short_steps``: a feature map without a stabiliser, an encoding acting on the features alone); its
    logits equal the general path's, step by step, on a left-padded batch, for every encoding, feature map and
    normalisation, and a layer that cannot take it says so (SPE, FastRPB, the stabilised exponential maps)."""
    from lrpe_hf.modeling.linear_attention import LinearAttention
    from lrpe_hf.modeling.transformer_stack import LinearTransformerStack

    model = model_with(encoding, **fields)
    ids, mask = left_padded_batch(3, 5, 8)
    short_steps = []
    step = LinearAttention.decoding_step
    monkeypatch.setattr(LinearAttention, "decoding_step", lambda *a: short_steps.append(1) or step(*a))
    options = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True)
    short = model.generate(ids, return_dict_in_generate=True, **options)
    monkeypatch.setattr(LinearTransformerStack, "is_short_step", lambda *a: False)
    general = model.generate(ids, return_dict_in_generate=True, **options)
    stabilised = fields.get("feature_map") in ("exp", "performer")
    can = encoding not in ("spe_sine", "spe_conv", "fastrpb") and not stabilised
    assert model.model.stack.layers[0].self_attn.takes_short_steps == can
    assert len(short_steps) == (5 * model.config.num_hidden_layers if can else 0)  # every step after the first
    assert torch.equal(short.sequences, general.sequences)
    for short_logits, general_logits in zip(short.logits, general.logits):
        torch.testing.assert_close(short_logits, general_logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("road", ["short", "general"])
@pytest.mark.parametrize("encoding", ["none", "rope", "permute"])
def test_a_decoding_step_keeps_a_float32_state_beside_bfloat16_features(encoding, road, monkeypatch):
    """fla's kernels leave a prompt's state in float32 beside a bfloat16 model: a decoding step, short or general,
    updates it in float32 (it stays float32) and decodes what the float32 model decodes, to bfloat16's precision."""
    from lrpe_hf.modeling.transformer_stack import LinearTransformerStack

    if road == "general":
        monkeypatch.setattr(LinearTransformerStack, "is_short_step", lambda *a: False)
    model = model_with(encoding)
    ids = prompt(batch=2, tokens=8)
    with torch.no_grad():
        reference = model(torch.cat([ids, ids[:, :1]], dim=1)).logits[:, -1]
        model.to(torch.bfloat16)
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        model(ids, use_cache=True, **{CACHE_OUTPUT_FIELD: cache})
        for state in cache.states:  # as fla's prompt leaves it (the unrotated key sums are the torch path's own)
            state.path.kv = state.path.kv.float()
        logits = model(ids[:, :1], use_cache=True, **{CACHE_OUTPUT_FIELD: cache}).logits[:, -1]
    assert all(state.path.kv.dtype == torch.float32 for state in cache.states)
    torch.testing.assert_close(logits.float(), reference, rtol=0.05, atol=0.05)


def test_a_layer_whose_encoding_was_replaced_after_it_was_built_decodes_by_the_general_road():
    """Whether a layer takes the short decoding step is asked at each step: an encoding swapped in after the model
    was built that acts before the feature map (``encode_query_key``, which the short step does not call) is
    honoured, as the same encoding built into the layers would be."""

    class ScaledQueries(lrpe_hf.PositionalEncoding):
        def encode_query_key(self, q, k, positions, shared_draw=None):
            return 2 * q, k

    model = model_with("none")
    ids = prompt(batch=1, tokens=6)
    for layer in model.model.stack.layers:
        layer.self_attn.positional_encoding = ScaledQueries()
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        model(ids[:, :-1], use_cache=True, **{CACHE_OUTPUT_FIELD: cache})
        step = model(ids[:, -1:], use_cache=True, **{CACHE_OUTPUT_FIELD: cache}).logits[:, -1]
    assert not model.model.stack.layers[0].takes_short_steps()
    torch.testing.assert_close(step, full)
