"""The three families behave like in-tree Transformers models."""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from conftest import second_feature_map
from torch.nn import functional as F
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import lrpe_hf
from lrpe_hf import (
    LinearGPTConfig,
    LinearGPTForCausalLM,
    LinearGPTForSequenceClassification,
    LinearRobertaConfig,
    LinearRobertaForMaskedLM,
    LinearRobertaForQuestionAnswering,
    LinearRobertaForSequenceClassification,
    LinearRobertaForTokenClassification,
    LinearViTConfig,
    LinearViTForImageClassification,
)

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, spe_realizations=8)


def roberta_config(**kw):
    return LinearRobertaConfig(**{**TINY, "vocab_size": 60, "max_position_embeddings": 64, **kw})


def gpt_config(**kw):
    return LinearGPTConfig(
        **{**TINY, "vocab_size": 60, "max_position_embeddings": 64, "pad_token_id": 0, "hidden_dropout_prob": 0.0, **kw}
    )


def vit_config(**kw):
    return LinearViTConfig(**{**TINY, "image_size": 32, "patch_size": 8, "num_labels": 3, **kw})


def text_batch(batch=2, tokens=9, seed=0):
    return torch.randint(3, 60, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def images(batch=2, size=32, seed=0):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


FAMILIES = {
    "roberta": (roberta_config, LinearRobertaForMaskedLM, AutoModelForMaskedLM, lambda: {"input_ids": text_batch()}),
    "gpt": (gpt_config, LinearGPTForCausalLM, AutoModelForCausalLM, lambda: {"input_ids": text_batch()}),
    "vit": (
        vit_config,
        LinearViTForImageClassification,
        AutoModelForImageClassification,
        lambda: {"pixel_values": images()},
    ),
}


def labels_for(family, inputs):
    if family == "vit":
        return torch.tensor([0, 2])
    return inputs["input_ids"].clone()


@pytest.mark.parametrize("encoding", lrpe_hf.POSITIONAL_ENCODINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_encoding_trains_and_round_trips(family, encoding, tmp_path):
    make_config, model_class, auto_class, make_inputs = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(make_config(positional_encoding=encoding))
    inputs = make_inputs()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    first = model(**inputs, labels=labels_for(family, inputs)).loss
    first.backward()
    optimizer.step()
    assert torch.isfinite(first)
    model.eval()
    with torch.no_grad():
        expected = model(**inputs).logits
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = auto_class.from_pretrained(tmp_path).eval()
    assert type(loaded) is model_class
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_and_return_dict(family):
    make_config, model_class, _, make_inputs = FAMILIES[family]
    model = model_class(make_config()).eval()
    out = model(**make_inputs(), output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    as_tuple = model(**make_inputs(), return_dict=False)
    torch.testing.assert_close(as_tuple[0], out.logits)


@pytest.mark.parametrize("encoding", ["lrpe_orthogonal", "permute", "spe_conv", "fastrpb", "rope"])
def test_roberta_padded_batch_equals_unbatched(encoding):
    model = LinearRobertaForSequenceClassification(roberta_config(positional_encoding=encoding)).eval()
    ids = text_batch(batch=2, tokens=10)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ids[1, 6:] = 1  # pad id
    batched = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(batched[0], model(ids[:1]).logits[0])
    torch.testing.assert_close(batched[1], model(ids[1:, :6]).logits[0])


@pytest.mark.parametrize("encoding", ["lrpe_unitary", "permute", "spe_sine", "fastrpb"])
def test_gpt_left_padded_batch_equals_unbatched(encoding):
    model = LinearGPTForCausalLM(gpt_config(positional_encoding=encoding)).eval()
    ids = text_batch(batch=2, tokens=10)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0
    batched = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(batched[0], model(ids[:1]).logits[0])
    torch.testing.assert_close(batched[1, 4:], model(ids[1:, 4:]).logits[0])


def test_losses_match_their_definitions():
    torch.manual_seed(0)
    ids = text_batch()
    mlm = LinearRobertaForMaskedLM(roberta_config()).eval()
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    out = mlm(ids, labels=labels)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[:, 2], ids[:, 2]))

    clm = LinearGPTForCausalLM(gpt_config()).eval()
    out = clm(ids, labels=ids)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[:, :-1].reshape(-1, 60), ids[:, 1:].reshape(-1)))

    single = LinearRobertaForSequenceClassification(roberta_config(num_labels=3)).eval()
    out = single(ids, labels=torch.tensor([0, 2]))
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, torch.tensor([0, 2])))
    multi = LinearRobertaForSequenceClassification(
        roberta_config(num_labels=3, problem_type="multi_label_classification")
    ).eval()
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    out = multi(ids, labels=targets)
    torch.testing.assert_close(out.loss, F.binary_cross_entropy_with_logits(out.logits, targets))
    regression = LinearRobertaForSequenceClassification(roberta_config(num_labels=1)).eval()
    out = regression(ids, labels=torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits.squeeze(-1), torch.tensor([0.5, -1.0])))

    tokens = LinearRobertaForTokenClassification(roberta_config(num_labels=4)).eval()
    tags = torch.randint(0, 4, ids.shape)
    out = tokens(ids, labels=tags)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits.reshape(-1, 4), tags.reshape(-1)))
    qa = LinearRobertaForQuestionAnswering(roberta_config()).eval()
    start, end = torch.tensor([1, 3]), torch.tensor([2, 5])
    out = qa(ids, start_positions=start, end_positions=end)
    expected = (F.cross_entropy(out.start_logits, start) + F.cross_entropy(out.end_logits, end)) / 2
    torch.testing.assert_close(out.loss, expected)

    gpt_classifier = LinearGPTForSequenceClassification(gpt_config(num_labels=2)).eval()
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    out = gpt_classifier(ids, attention_mask=mask)
    last_hidden = gpt_classifier.model(ids[:1, :7]).last_hidden_state[0, -1]
    torch.testing.assert_close(out.logits[0], gpt_classifier.score(last_hidden))


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(family):
    make_config, model_class, _, make_inputs = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(make_config(positional_encoding="spe_sine", hidden_dropout_prob=0.0))
    model.train()
    inputs = make_inputs()

    def gradients():
        model.zero_grad()
        torch.manual_seed(123)  # the same SPE draw in both runs
        model(**inputs, labels=labels_for(family, inputs)).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    # transformers 5.24 renamed gradient_checkpointing_enable (kept as a deprecated alias)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    checkpointed = gradients()
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name)


def test_tied_embeddings_and_resize():
    for model in (LinearRobertaForMaskedLM(roberta_config()), LinearGPTForCausalLM(gpt_config())):
        output = model.get_output_embeddings()
        assert output.weight is model.get_input_embeddings().weight
        model.resize_token_embeddings(75)
        assert model.get_input_embeddings().weight.shape[0] == 75
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert model.config.vocab_size == 75
        ids = torch.tensor([[1, 74, 5]])
        assert model(ids).logits.shape == (1, 3, 75)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast(family):
    make_config, model_class, _, make_inputs = FAMILIES[family]
    model = model_class(make_config()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. a norm whose input and weight dtypes differ loses its fused kernel
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(**make_inputs()).logits
    assert torch.isfinite(logits.float()).all()
    reference = model(**make_inputs()).logits
    assert (logits.float() - reference).abs().max() < 0.1 * reference.abs().max() + 0.1


FLOAT16_STEPS = [
    ("lrpe_orthogonal", "autocast", False),
    ("lrpe_orthogonal", "half", False),
    ("none", "autocast", False),
    ("rope", "half", False),
    ("lrpe_orthogonal", "autocast", True),
]


@pytest.mark.parametrize("encoding, precision, compiled", FLOAT16_STEPS)
def test_a_float16_train_step_over_padding_has_the_float32_loss_and_gradients(encoding, precision, compiled):
    """A padded row's denominator is 0 + eps, whose reciprocal (1e6) overflows float16 (largest 65504): the division
    takes it in float32, so that a float16 train step (under autocast, or a model cast to float16) over a left-padded
    batch gives finite gradients, those of the float32 step within float16's rounding. Tolerance: each of the
    step's ~6 matmul stages from the loss to a weight, forward and backward (2 layers, the head), rounds its inputs
    and output to float16, a relative error up to u = 2**-11 each: some tens of u (20 u = 1e-2) at most, where a
    NaN, or a padded row leaking into the real ones, is off by O(1). Measured: about 2 u."""
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(gpt_config(positional_encoding=encoding)).train()
    ids = text_batch()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    weights = [p for p in model.parameters() if p.requires_grad]
    loss = model(ids, attention_mask=mask, labels=labels).loss
    expected = torch.autograd.grad(loss, weights)
    half = model
    if precision == "half":
        half = LinearGPTForCausalLM(model.config).train()
        half.load_state_dict(model.state_dict())
        half.half()
    if compiled:
        torch._dynamo.reset()
        half = torch.compile(half, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.float16, enabled=precision == "autocast"):
        half_loss = half(ids, attention_mask=mask, labels=labels).loss
    got = torch.autograd.grad(half_loss, [p for p in half.parameters() if p.requires_grad])
    assert torch.isfinite(half_loss) and all(torch.isfinite(g).all() for g in got)
    u = 2.0**-11
    assert abs(half_loss.float() - loss) <= 20 * u * loss
    error = sum((g.float() - w).square().sum() for g, w in zip(got, expected)).sqrt()
    assert error <= 20 * u * sum(w.square().sum() for w in expected).sqrt()


def test_torch_compile_forward():
    model = LinearGPTForCausalLM(gpt_config(positional_encoding="rope")).eval()
    ids = text_batch()
    expected = model(ids, use_cache=False).logits
    compiled = torch.compile(model)
    torch.testing.assert_close(compiled(ids, use_cache=False).logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("encoding", ["lrpe_orthogonal", "lrpe_unitary"])
def test_compiled_training_layer_has_the_eager_values_and_gradients(encoding, monkeypatch):
    """The rotation and the Type 1 lift take one block of tokens while compiling, written without complex views of
    their outputs: a compiled training layer (traced by dynamo and AOT autograd) gives the outputs and gradients,
    the learned angles' included, of the eager layer working in blocks of a few tokens."""
    from lrpe_hf.modeling.positional_lrpe import UnitaryLift
    from lrpe_hf.modeling.positional_rope import RotateQueriesAndKeys

    for function in (UnitaryLift, RotateQueriesAndKeys):
        monkeypatch.setattr(function, "BLOCK_ELEMENTS", 1000)  # 2 rows x 4 heads x 8 features: 15 tokens a block
    torch.manual_seed(0)
    layer = lrpe_hf.LinearAttention(32, 4, positional_encoding=encoding, causal=True)
    x = torch.randn(2, 70, 32, requires_grad=True)
    inputs = [x] + [p for p in layer.parameters() if p.requires_grad]
    expected = layer(x)
    grad = torch.randn_like(expected)
    torch._dynamo.reset()
    got = torch.compile(layer, backend="aot_eager")(x)
    torch.testing.assert_close(got, expected)
    for g, w in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(g, w)


COMPILED_LAYERS = [(encoding, feature_map) for encoding in lrpe_hf.POSITIONAL_ENCODINGS if encoding != "spe_conv"
                   for feature_map in ("elu", second_feature_map(encoding))]  # fmt: skip
COMPILED_LAYERS += [("lrpe_orthogonal", "hedgehog"), ("none", "t2r")]  # the learnable maps, which linearize uses
COMPILED_LAYERS += [  # every other registered map, with no encoding
    ("none", feature_map) for feature_map in lrpe_hf.FEATURE_MAPS if feature_map not in {f for _, f in COMPILED_LAYERS}
]


@pytest.mark.parametrize("encoding, feature_map", COMPILED_LAYERS)
def test_a_causal_layer_compiles_to_one_graph_with_the_eager_values_and_gradients(encoding, feature_map):
    """torch.compile(fullgraph=True) of a causal layer with gradients: one graph (no break, no host read), the
    causal product one custom op in it (lrpe_hf::causal_product), and the eager layer's outputs and gradients over
    padding and several chunks. (convSPE reads its noise at the positions' values: it breaks the graph.)"""
    torch.manual_seed(0)
    layer = lrpe_hf.LinearAttention(32, 4, positional_encoding=encoding, feature_map=feature_map, causal=True,
                                    max_positions=256, spe_realizations=8).eval()  # fmt: skip
    x = torch.randn(2, 130, 32, requires_grad=True)
    mask = torch.ones(2, 130, dtype=torch.bool)
    mask[0, :5] = False
    inputs = [x] + [p for p in layer.parameters() if p.requires_grad]
    expected = layer(x, attention_mask=mask)
    grad = torch.randn_like(expected)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x, attention_mask=mask)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert "lrpe_hf.causal_product" in explained.graphs[0].code
    got = torch.compile(layer, backend="aot_eager", fullgraph=True)(x, attention_mask=mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    for g, w in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        # a gradient summed over tokens is rounded relative to its largest terms: the absolute room scales with
        # the tensor's size (compiled and eager were each within 3e-5 of float64 there, relative to the largest)
        torch.testing.assert_close(g, w, atol=1e-5 * max(1.0, w.abs().max().item()), rtol=1e-4)


@pytest.mark.parametrize("encoding", ["lrpe_orthogonal", "permute", "fastrpb"])
def test_a_causal_lm_train_step_compiles_to_one_graph_with_the_eager_loss_and_gradients(encoding):
    """LinearGPT's forward with its loss under torch.compile(fullgraph=True): one graph (the MLP and the loss take
    their plain forms there, which the compiler differentiates), the eager loss and gradients."""
    model = LinearGPTForCausalLM(gpt_config(positional_encoding=encoding, max_position_embeddings=128)).train()
    ids = text_batch(tokens=100)
    weights = [p for p in model.parameters() if p.requires_grad]
    loss = model(ids, labels=ids).loss
    expected = torch.autograd.grad(loss, weights)
    torch._dynamo.reset()
    compiled_loss = torch.compile(model, backend="aot_eager", fullgraph=True)(ids, labels=ids).loss
    torch.testing.assert_close(compiled_loss, loss)
    for got, want in zip(torch.autograd.grad(compiled_loss, weights), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("encoding", ["permute", "fastrpb", "spe_sine", "lrpe_orthogonal"])
def test_bidirectional_layer_compiled_equals_eager(encoding):
    """The branches taken while compiling (permute's decay, FastRPB's span check, SPE's table and caches) give the
    eager layer's outputs in bidirectional attention too."""
    torch.manual_seed(0)
    layer = lrpe_hf.LinearAttention(32, 4, positional_encoding=encoding, causal=False, max_positions=64).eval()
    x = torch.randn(2, 12, 32)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, -3:] = 0
    with torch.no_grad():
        expected = layer(x, attention_mask=mask)
        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="eager")(x, attention_mask=mask)
    torch.testing.assert_close(compiled, expected)


def test_auto_classes_resolve():
    for config, auto_class, family in [
        (roberta_config(), AutoModelForSequenceClassification, "LinearRobertaForSequenceClassification"),
        (roberta_config(), AutoModelForTokenClassification, "LinearRobertaForTokenClassification"),
        (roberta_config(), AutoModelForQuestionAnswering, "LinearRobertaForQuestionAnswering"),
        (roberta_config(), AutoModel, "LinearRobertaModel"),
        (gpt_config(), AutoModelForSequenceClassification, "LinearGPTForSequenceClassification"),
        (gpt_config(), AutoModel, "LinearGPTModel"),
        (vit_config(), AutoModel, "LinearViTModel"),
    ]:
        assert type(auto_class.from_config(config)).__name__ == family
    assert isinstance(AutoConfig.for_model("linear_gpt"), LinearGPTConfig)


def test_vit_accepts_other_image_sizes_with_relative_encodings():
    model = LinearViTForImageClassification(vit_config(positional_encoding="lrpe_orthogonal")).eval()
    assert model(pixel_values=images(size=48)).logits.shape == (2, 3)
    learned = LinearViTForImageClassification(
        vit_config(positional_encoding="none", absolute_position_embedding="learned")
    ).eval()
    with pytest.raises(ValueError, match="32x32 images; got 48x48. Pass interpolate_pos_encoding=True"):
        learned(pixel_values=images(size=48))
    fastrpb = LinearViTForImageClassification(vit_config(positional_encoding="fastrpb")).eval()
    with pytest.raises(ValueError, match=r"32x32 images \(image_size=32\); got 48x48.*image_size >= 48"):
        fastrpb(pixel_values=images(size=48))


def test_vit_interpolates_its_learned_table_as_vit_does():
    """interpolate_pos_encoding=True resizes the learned table's patch grid bicubically (the class token's row
    kept), as transformers' ViT does; at the trained size it changes nothing."""
    model = LinearViTForImageClassification(
        vit_config(positional_encoding="none", absolute_position_embedding="learned")
    ).eval()
    same = images(size=32)
    torch.testing.assert_close(model(same, interpolate_pos_encoding=True).logits, model(same).logits)
    embeddings = model.model.embeddings
    table = embeddings.position_embedding.tables[0].weight.detach()  # (1 + 4 * 4, hidden)
    grid = table[1:].T.reshape(1, -1, 4, 4)
    expected = F.interpolate(grid, size=(6, 5), mode="bicubic", align_corners=False).reshape(-1, 30).T
    resized = embeddings.learned_table(6, 5, interpolate=True)[0].detach()
    torch.testing.assert_close(resized, torch.cat([table[:1], expected]))
    assert model(images(size=48)[..., :40], interpolate_pos_encoding=True).logits.shape == (2, 3)


def sinusoids(positions, dim):
    """Vaswani et al.'s table written out: [sin(p w_i), cos(p w_i)], w_i = 10000^(-2i/dim). positions (N,)."""
    w = 10000.0 ** (-torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angles = positions.double()[:, None] * w
    return torch.cat([angles.sin(), angles.cos()], dim=-1).float()


@pytest.mark.parametrize("multiplier", [1.0, 32**0.5])
def test_sinusoidal_positions_keep_vaswanis_ratio_to_the_token_embeddings(multiplier):
    """Vaswani et al. add unit sinusoids to token embeddings of std 1; here the sinusoids take the token
    embeddings' std at initialisation (initializer_range x embedding_multiplier), so the ratio stays theirs."""
    torch.manual_seed(0)
    config = gpt_config(absolute_position_embedding="sinusoidal", embedding_multiplier=multiplier)
    model = LinearGPTForCausalLM(config).eval()
    ids = text_batch(tokens=12)
    embedded = model(ids, output_hidden_states=True).hidden_states[0]
    tokens = model.model.embed_tokens(ids) * multiplier
    token_std = float(model.model.embed_tokens.weight.detach().std())
    assert abs(token_std / 0.02 - 1) < 0.05  # the init (initializer_range) the amplitude is tied to
    expected = tokens + 0.02 * multiplier * sinusoids(torch.arange(12), 32)
    torch.testing.assert_close(embedded, expected)
    position_rms = float((embedded - tokens).detach().pow(2).mean().sqrt())
    assert abs(position_rms / (token_std * multiplier) - 2**-0.5) < 0.05


def test_vit_sinusoids_take_the_scale_of_its_learned_table():
    model = LinearViTForImageClassification(
        vit_config(positional_encoding="none", absolute_position_embedding="sinusoidal")
    ).eval()
    plain = LinearViTForImageClassification(vit_config(positional_encoding="none")).eval()
    plain.load_state_dict(model.state_dict())
    pixels = images()
    added = model.model.embeddings(pixels)[0] - plain.model.embeddings(pixels)[0]
    rows = torch.tensor([-1] + [r for r in range(4) for _ in range(4)])  # the class token at (-1, -1)
    cols = torch.tensor([-1] + [c for _ in range(4) for c in range(4)])
    expected = 0.02 * torch.cat([sinusoids(rows, 16), sinusoids(cols, 16)], dim=-1)
    torch.testing.assert_close(added[0], expected)


def test_bad_configs_and_inputs(tmp_path):
    with pytest.raises(ValueError, match="valid values"):
        roberta_config(positional_encoding="alibi")
    with pytest.raises(ValueError, match="valid values: none, sinusoidal, learned"):
        gpt_config(absolute_position_embedding="rotary")
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        roberta_config(hidden_size=30)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        vit_config(image_size=30)
    model = LinearGPTForCausalLM(gpt_config(absolute_position_embedding="learned"))
    with pytest.raises(ValueError, match="positions 0..63"):
        model(torch.randint(3, 60, (1, 70)))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(text_batch(), attention_mask=torch.ones(2, 3))
    # a checkpoint whose config does not match its weights
    LinearGPTForCausalLM(gpt_config()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hidden_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="(?i)size mismatch|mismatch"):
        LinearGPTForCausalLM.from_pretrained(tmp_path)


REMOTE_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.modules["lrpe_hf"] = None  # lrpe_hf cannot be imported in this process
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForImageClassification
    kind, path, expected_path, inputs_path = sys.argv[1:]
    auto = {"gpt": AutoModelForCausalLM, "roberta": AutoModelForMaskedLM, "vit": AutoModelForImageClassification}[kind]
    model = auto.from_pretrained(path, trust_remote_code=True).eval()
    assert "lrpe_hf" not in type(model).__module__, type(model).__module__
    inputs = torch.load(inputs_path)
    with torch.no_grad():
        logits = model(**inputs).logits
    torch.testing.assert_close(logits, torch.load(expected_path))
    if kind == "gpt":  # the library's tokens, with its settings and mask
        expected_generation = torch.load(Path(expected_path).with_name("generation.pt"))
        for name, settings in expected_generation["settings"].items():
            out = model.generate(
                inputs["input_ids"], attention_mask=expected_generation["mask"], max_new_tokens=5, **settings
            )
            assert torch.equal(out, expected_generation["tokens"][name]), (name, out)
    print("remote ok", type(model).__name__)
""")
# The remote code must generate the library's tokens: greedy and beam search over a left-padded batch.
GENERATION = {"greedy": dict(do_sample=False), "beams": dict(do_sample=False, num_beams=3)}
LEFT_PADDING = torch.tensor([[0, 0, 0] + [1] * 6, [1] * 9])


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loads_as_remote_code_without_lrpe_hf(family, tmp_path):
    make_config, model_class, _, make_inputs = FAMILIES[family]
    model = model_class(make_config(positional_encoding="spe_conv" if family == "gpt" else "lrpe_unitary")).eval()
    inputs = make_inputs()
    with torch.no_grad():
        torch.save(model(**inputs).logits, tmp_path / "expected.pt")
    torch.save(inputs, tmp_path / "inputs.pt")
    if family == "gpt":
        tokens = {
            name: model.generate(inputs["input_ids"], attention_mask=LEFT_PADDING, max_new_tokens=5, **settings)
            for name, settings in GENERATION.items()
        }
        torch.save(dict(settings=GENERATION, mask=LEFT_PADDING, tokens=tokens), tmp_path / "generation.pt")
    model.save_pretrained(tmp_path / "checkpoint")
    assert (tmp_path / "checkpoint" / "linear_attention.py").exists()
    script = tmp_path / "remote.py"
    script.write_text(REMOTE_SCRIPT)
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            family,
            str(tmp_path / "checkpoint"),
            str(tmp_path / "expected.pt"),
            str(tmp_path / "inputs.pt"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote ok" in result.stdout


def test_token_type_ids_are_checked_not_ignored():
    model = LinearRobertaForSequenceClassification(roberta_config()).eval()
    ids = text_batch()
    torch.testing.assert_close(model(ids, token_type_ids=torch.zeros_like(ids)).logits, model(ids).logits)
    with pytest.raises(ValueError, match="no token type embeddings"):
        model(ids, token_type_ids=torch.ones_like(ids))


@pytest.mark.parametrize("encoding", ["lrpe_orthogonal", "lrpe_permutation", "permute", "spe_conv", "fastrpb"])
@pytest.mark.parametrize("family", FAMILIES)
def test_meta_device_initialisation_recreates_every_buffer(family, encoding):
    """As from_pretrained, init_empty_weights and FSDP do: build on the meta device, allocate, init_weights."""
    make_config, model_class, _, make_inputs = FAMILIES[family]
    config = make_config(positional_encoding=encoding, feature_map="performer")
    built = model_class(config).eval()
    with torch.device("meta"):
        empty = model_class(config)
    empty.to_empty(device="cpu")
    empty.init_weights()
    empty.eval()
    buffers = dict(built.named_buffers())
    assert buffers, "the encodings and the performer map keep tables in buffers"
    for name, buffer in empty.named_buffers():
        torch.testing.assert_close(buffer, buffers[name], msg=name)
    for name, parameter in empty.named_parameters():
        assert torch.isfinite(parameter).all(), name
    with torch.no_grad():
        assert torch.isfinite(empty(**make_inputs()).logits).all()
    if encoding in ("permute", "lrpe_permutation"):  # seeded per layer: every layer has its own permutations
        first, second = (name for name in buffers if name.endswith("permutations.0.members"))
        assert not torch.equal(buffers[first], buffers[second])


@pytest.mark.parametrize("family", ["gpt", "roberta"])
def test_embedding_multiplier_scales_the_token_embeddings(family):
    """embedding_multiplier=m computes what multiplier 1 computes on m times the token embeddings."""
    make_config, model_class, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    scaled = model_class(make_config(embedding_multiplier=3.0, hidden_dropout_prob=0.0)).eval()
    plain = model_class(make_config(hidden_dropout_prob=0.0)).eval()
    plain.load_state_dict(scaled.state_dict())
    ids = text_batch()
    with torch.no_grad():
        expected = plain(inputs_embeds=3.0 * plain.get_input_embeddings()(ids)).logits
        torch.testing.assert_close(scaled(ids).logits, expected)


@pytest.mark.parametrize("head", [LinearRobertaForSequenceClassification, LinearRobertaForMaskedLM])
def test_trainer_gradient_accumulation_equals_one_large_batch(head, tmp_path):
    """The Trainer divides a loss by the accumulation steps unless the model says it divides by the batch's token
    count itself (``accepts_loss_kwargs``): two half batches must step like the whole batch, for a classification
    head (which takes no token count) as for an LM head (which does)."""
    from transformers import Trainer, TrainingArguments

    ids = text_batch(batch=4, tokens=8)
    labels = torch.tensor([0, 1, 1, 0]) if head is LinearRobertaForSequenceClassification else ids
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)]

    def trained(batch_size, accumulation):
        torch.manual_seed(0)
        model = head(roberta_config(hidden_dropout_prob=0.0, classifier_dropout=0.0))
        args = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
            max_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", report_to="none",
            save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        )  # fmt: skip
        Trainer(model=model, args=args, train_dataset=rows).train()
        return dict(model.named_parameters())

    whole, halves = trained(4, 1), trained(2, 2)
    for name, param in whole.items():
        torch.testing.assert_close(halves[name], param, msg=name)
