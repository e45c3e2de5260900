"""Bad names, invalid combinations and bad inputs give errors that say what is wrong and what is valid."""

import pytest
import torch

import lrpe_hf
from lrpe_hf import LinearAttention, LinearAttentionState
from lrpe_hf.modeling.registry import positional_encoding_entry


def test_public_name_lists_are_the_registries():
    """The public lists are the registries' names, live and in the order they were registered: a component
    registered now is listed last, and is gone once removed."""
    from lrpe_hf.modeling.registry import FEATURE_MAP_REGISTRY, POSITIONAL_ENCODING_REGISTRY

    assert lrpe_hf.POSITIONAL_ENCODINGS == tuple(POSITIONAL_ENCODING_REGISTRY)
    assert lrpe_hf.FEATURE_MAPS == tuple(FEATURE_MAP_REGISTRY)
    lrpe_hf.register_positional_encoding("listed_last", lambda o, h, d, m: lrpe_hf.PositionalEncoding())
    lrpe_hf.register_feature_map("listed_last", lambda o, d: lrpe_hf.FeatureMap(d))
    try:
        assert lrpe_hf.POSITIONAL_ENCODINGS[-1] == lrpe_hf.FEATURE_MAPS[-1] == "listed_last"
    finally:
        POSITIONAL_ENCODING_REGISTRY.pop("listed_last")
        FEATURE_MAP_REGISTRY.pop("listed_last")
    assert "listed_last" not in lrpe_hf.POSITIONAL_ENCODINGS and "listed_last" not in lrpe_hf.FEATURE_MAPS


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(positional_encoding="alibi"), "valid values: " + ", ".join(lrpe_hf.POSITIONAL_ENCODINGS)),
        (dict(feature_map="tanh"), "valid values: " + ", ".join(lrpe_hf.FEATURE_MAPS)),
        (dict(attention="flash"), "valid values: linear, softmax"),
        (dict(normalization="l2"), "valid values: denominator, unrotated_denominator, output_norm"),
        (dict(lrpe_p_matrix="fourier", positional_encoding="lrpe_unitary"), "valid values: householder, identity"),
        (dict(positional_encoding="rope", normalization="denominator"), "can be negative"),
        (dict(positional_encoding="permute", normalization="unrotated_denominator"), "meant for rope"),
        (dict(attention="softmax", feature_map="elu"), "linear attention only"),
        (dict(attention="softmax", normalization="output_norm"), "linear attention only"),
        (dict(position_dims=3), "position_dims must be 1"),
        (dict(position_dims=2, causal=True), "no causal order"),
        (dict(positional_encoding="fastrpb"), "needs max_positions"),
        (dict(positional_encoding="permute", permute_decay=1.5, causal=True), r"permute_decay must be in \(0, 1\]"),
        (dict(positional_encoding="permute", permute_decay=0.9), "for causal models"),
        (dict(chunk_size=0), "chunk_size must be a positive integer"),
        (dict(spe_realizations=0, positional_encoding="spe_sine"), "spe_realizations must be a positive integer"),
        (dict(feature_map="dpfp", dpfp_nu=100), "dpfp_nu must be in"),
    ],
)
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=message):
        LinearAttention(16, 2, **options)


def test_hidden_size_must_split_into_heads():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        LinearAttention(10, 3)


@pytest.mark.parametrize(
    "config_class", [lrpe_hf.LinearGPTConfig, lrpe_hf.LinearRobertaConfig, lrpe_hf.LinearViTConfig]
)
@pytest.mark.parametrize(
    "typo,field",
    [("positional_encodng", "positional_encoding"), ("feature_mapp", "feature_map"), ("chunksize", "chunk_size")],
)
def test_a_config_refuses_a_misspelt_field_and_names_the_field(config_class, typo, field):
    with pytest.raises(ValueError, match=f"no field '{typo}'; did you mean '{field}'"):
        config_class(**{typo: "rope"})


def test_a_config_keeps_the_fields_of_other_transformers_releases_and_saves_them(tmp_path):
    # Transformers' own keys from other releases and a user's own note are kept, as every Transformers config keeps
    # them; only names close to this library's fields are refused
    # (GPT-2's layer_norm_epsilon and a ViT's in_channels lie close to fields of ours that other configs share)
    config = lrpe_hf.LinearGPTConfig(tie_encoder_decoder=False, experiment="run 7", layer_norm_epsilon=1e-5)
    config.save_pretrained(tmp_path)
    loaded = lrpe_hf.LinearGPTConfig.from_pretrained(tmp_path)
    assert (loaded.tie_encoder_decoder, loaded.experiment, loaded.layer_norm_epsilon) == (False, "run 7", 1e-5)
    assert lrpe_hf.LinearViTConfig(in_channels=3).in_channels == 3


def test_fastrpb_refuses_spans_beyond_max_positions():
    layer = LinearAttention(16, 2, positional_encoding="fastrpb", max_positions=8)
    layer(torch.randn(1, 8, 16))
    with pytest.raises(ValueError, match="max_positions=8"):
        layer(torch.randn(1, 9, 16))
    compiled = torch.compile(layer, backend="eager")
    assert compiled(torch.randn(1, 8, 16)).shape == (1, 8, 16)
    with pytest.raises(RuntimeError, match="relative distances below max_positions=8"):
        compiled(torch.randn(1, 9, 16))


def test_learned_absolute_positions_refuse_positions_beyond_their_table_eager_and_compiled():
    from lrpe_hf.modeling.positional_absolute import LearnedPositionEmbedding

    table = LearnedPositionEmbedding(8, max_positions=16)
    assert table(torch.tensor([[0, 15]])).shape == (1, 2, 8)
    with pytest.raises(ValueError, match="cover positions 0..15, got positions 0..16"):
        table(torch.tensor([[0, 16]]))
    compiled = torch.compile(table, backend="eager", fullgraph=True)  # one graph: the check reads nothing back
    assert compiled(torch.tensor([[0, 15]])).shape == (1, 2, 8)
    with pytest.raises(RuntimeError, match="cover 0..15"):
        compiled(torch.tensor([[-1, 3]]))


@pytest.mark.parametrize("family", ["gpt", "roberta"])
def test_position_ids_of_another_shape_are_refused_at_the_models_entry(family):
    """A 0-d tensor, another batch size or another length: a ValueError naming the shapes that fit (a 0-d tensor
    overflowed in a reshape, and a batch of 3 for 2 rows failed in an expand, before)."""
    fields = dict(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    if family == "gpt":
        model = lrpe_hf.LinearGPTForCausalLM(lrpe_hf.LinearGPTConfig(**fields))
    else:
        model = lrpe_hf.LinearRobertaForMaskedLM(lrpe_hf.LinearRobertaConfig(**fields))
    ids = torch.randint(3, 60, (2, 5))
    for position_ids in (torch.tensor(3), torch.arange(5).expand(3, -1), torch.arange(4), torch.arange(6)[None]):
        with pytest.raises(ValueError, match=r"position_ids must have shape \(batch, tokens\) = \(2, 5\), \(1, 5\)"):
            model(ids, position_ids=position_ids)
    for position_ids in (torch.arange(5), torch.arange(5)[None], torch.arange(5).expand(2, -1)):
        assert model(ids, position_ids=position_ids).logits.shape[:2] == (2, 5)


SMALL_SIZES = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)


@pytest.mark.parametrize("family", ["gpt", "roberta"])
def test_token_inputs_of_another_shape_dtype_or_range_are_refused_at_the_models_entry(family):
    """input_ids of one or three dimensions, of floats, with no tokens, or outside the vocabulary, and inputs_embeds of
    another width: a ValueError naming the argument, what came and what fits (before, errors from inside a layer or
    from torch's embedding)."""
    if family == "gpt":
        model = lrpe_hf.LinearGPTForCausalLM(lrpe_hf.LinearGPTConfig(vocab_size=60, **SMALL_SIZES))
    else:
        model = lrpe_hf.LinearRobertaForMaskedLM(lrpe_hf.LinearRobertaConfig(vocab_size=60, **SMALL_SIZES))
    refused = [
        (
            dict(input_ids=torch.arange(5)),
            r"input_ids must be a \(batch, tokens\) tensor .* shape \(5,\).*input_ids\[None\]",
        ),
        (dict(input_ids=torch.zeros(2, 3, 4, dtype=torch.long)), r"got shape \(2, 3, 4\)"),
        (dict(input_ids=torch.ones(2, 5)), "integer token ids, got shape .* dtype torch.float32"),
        (dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), r"input_ids has no tokens \(shape \(2, 0\)\)"),
        (dict(input_ids=torch.tensor([[3, 60]])), r"input_ids must lie in \[0, 60\) \(the model's vocab_size\)"),
        (dict(input_ids=torch.tensor([[3, -100]])), r"input_ids must lie in \[0, 60\)"),
        (dict(inputs_embeds=torch.randn(2, 5, 16)), r"inputs_embeds must be a \(batch, tokens, 32\) .* \(2, 5, 16\)"),
        (dict(inputs_embeds=torch.randn(2, 0, 32)), "inputs_embeds has no tokens"),
    ]
    for inputs, message in refused:
        with pytest.raises(ValueError, match=message):
            model(**inputs)
    assert model(input_ids=torch.tensor([[0, 59]])).logits.shape == (1, 2, 60)  # the ends of the vocabulary
    assert model(inputs_embeds=torch.randn(2, 5, 32)).logits.shape == (2, 5, 60)


def test_generate_refuses_an_empty_prompt_asking_for_one_token():
    """An empty prompt with no cache asks for a prompt of at least one token (it spoke of continuing a cache before,
    though none was given)."""
    model = lrpe_hf.LinearGPTForCausalLM(lrpe_hf.LinearGPTConfig(vocab_size=60, bos_token_id=0, **SMALL_SIZES)).eval()
    with pytest.raises(ValueError, match="generate needs a prompt of at least one token") as refusal:
        model.generate(torch.ones(1, 0, dtype=torch.long), max_new_tokens=2)
    assert "cache" not in str(refusal.value)
    assert model.generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=2, do_sample=False).shape == (1, 3)


def test_pixel_values_of_another_shape_or_dtype_are_refused_at_the_models_entry():
    model = lrpe_hf.LinearViTForImageClassification(lrpe_hf.LinearViTConfig(image_size=32, patch_size=8, **SMALL_SIZES))
    refused = [
        (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), r"pixel_values must be a \(batch, 3, height, width\) floating"),
        (torch.zeros(3, 32, 32), r"got shape \(3, 32, 32\)"),
        (torch.zeros(1, 1, 32, 32), r"got shape \(1, 1, 32, 32\)"),
        (torch.zeros(1, 3, 30, 32), "positive multiples of patch_size=8, got 30x32"),
        (torch.zeros(1, 3, 0, 32), "positive multiples of patch_size=8, got 0x32"),
    ]
    for pixel_values, message in refused:
        with pytest.raises(ValueError, match=message):
            model(pixel_values=pixel_values)
    assert model(pixel_values=torch.zeros(1, 3, 32, 32)).logits.shape == (1, 2)


CONFIG_CLASSES = (lrpe_hf.LinearGPTConfig, lrpe_hf.LinearRobertaConfig, lrpe_hf.LinearViTConfig)


@pytest.mark.parametrize(
    "config_class, field",
    [
        (config_class, field)
        for config_class in CONFIG_CLASSES
        for field in ("num_attention_heads", "num_hidden_layers", "hidden_size", "intermediate_size")
    ]
    + [(lrpe_hf.LinearViTConfig, field) for field in ("image_size", "patch_size", "num_channels")],
)
@pytest.mark.parametrize("value", [0, -1, 2.5])
def test_a_config_refuses_a_size_below_one_naming_the_field(config_class, field, value):
    with pytest.raises(ValueError, match=f"{config_class.__name__}: {field} must be a whole number of at least 1, got"):
        config_class(**{field: value})


@pytest.mark.parametrize(
    "config_class, field",
    [(config_class, "hidden_dropout_prob") for config_class in CONFIG_CLASSES]
    + [(lrpe_hf.LinearRobertaConfig, "classifier_dropout")],
)
@pytest.mark.parametrize("value", [1.5, -0.1, float("nan"), "0.1", True])
def test_a_config_refuses_a_dropout_probability_outside_zero_one_naming_the_field(config_class, field, value):
    with pytest.raises(ValueError, match=rf"{config_class.__name__}: {field} must be a number in \[0, 1\], got"):
        config_class(**{field: value})


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1, 1.0])
def test_a_config_takes_a_dropout_probability_in_zero_one(value):
    for config_class in CONFIG_CLASSES:
        assert config_class(hidden_dropout_prob=value).hidden_dropout_prob == value
    assert lrpe_hf.LinearRobertaConfig(classifier_dropout=value).classifier_dropout == value
    assert lrpe_hf.LinearRobertaConfig().classifier_dropout is None


def test_a_config_refuses_another_familys_field_by_its_name():
    with pytest.raises(ValueError, match="LinearViTConfig has no field 'embedding_multiplier': another model family"):
        lrpe_hf.LinearViTConfig(embedding_multiplier=2.0)


def test_the_package_says_its_version():
    import importlib.metadata

    assert lrpe_hf.__version__ == importlib.metadata.version("lrpe-hf")


def test_bad_inputs():
    layer = LinearAttention(16, 2, positional_encoding="rope")
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        layer(x, attention_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match="position_ids must have shape"):
        layer(x, position_ids=torch.arange(4)[None])
    with pytest.raises(ValueError, match="integers"):
        layer(x, position_ids=torch.arange(5.0)[None])
    with pytest.raises(ValueError, match="only meaningful for causal"):
        layer(x, state=LinearAttentionState())
    image_layer = LinearAttention(16, 2, positional_encoding="rope", position_dims=2)
    with pytest.raises(ValueError, match=r"\(row, col\)"):
        image_layer(x)


def test_shared_spe_codes_need_a_draw():
    layer = LinearAttention(16, 2, positional_encoding="spe_sine", standalone=False)
    with pytest.raises(ValueError, match="shared_draw"):
        layer(torch.randn(1, 4, 16))
    codes = positional_encoding_entry("spe_sine").build_shared(layer.options, 2, 8)
    assert layer(torch.randn(1, 4, 16), shared_draw=codes.draw()).shape == (1, 4, 16)


def test_standalone_layer_redraws_performer_features_in_training():
    layer = LinearAttention(16, 2, feature_map="performer", performer_redraw=True)
    x = torch.randn(1, 5, 16)
    layer.train()
    assert not torch.allclose(layer(x), layer(x))
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))


@pytest.mark.parametrize("feature_map", ["t2r", "dpfp"])
@pytest.mark.parametrize("encoding", ["rope", "lrpe_orthogonal"])
def test_rotations_with_a_map_that_can_be_zero_never_divide_by_the_unrotated_denominator(encoding, feature_map):
    """With features that can be exactly zero, <phi(q_s), sum_t phi(k_t)> vanishes while the rotated numerator does
    not (one output of 85,082 against a typical 0.46): such a map takes the output LayerNorm by default, and the
    unrotated denominator is refused, naming the map."""
    options = lrpe_hf.AttentionOptions(positional_encoding=encoding, feature_map=feature_map)
    assert options.normalization == "output_layer_norm"
    with pytest.raises(ValueError, match=f"feature_map='{feature_map}': its features can be exactly zero"):
        lrpe_hf.AttentionOptions(
            positional_encoding=encoding, feature_map=feature_map, normalization="unrotated_denominator"
        )
    assert lrpe_hf.AttentionOptions(positional_encoding=encoding).normalization == "unrotated_denominator"  # elu


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("encoding", lrpe_hf.POSITIONAL_ENCODINGS)
def test_an_empty_batch_gives_an_empty_output(encoding, causal):
    layer = LinearAttention(16, 2, positional_encoding=encoding, causal=causal, max_positions=64, spe_realizations=4)
    assert layer(torch.randn(0, 7, 16)).shape == (0, 7, 16)
    config = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=40)
    model_class = lrpe_hf.LinearGPTForCausalLM if causal else lrpe_hf.LinearRobertaForMaskedLM
    config_class = lrpe_hf.LinearGPTConfig if causal else lrpe_hf.LinearRobertaConfig
    model = model_class(config_class(positional_encoding=encoding, spe_realizations=4, **config))
    assert model(torch.zeros(0, 7, dtype=torch.long)).logits.shape == (0, 7, 40)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("encoding", lrpe_hf.POSITIONAL_ENCODINGS)
def test_double_backward_works_or_says_it_is_not_supported(encoding, causal):
    """The custom kernels give first-order gradients: differentiating twice (a gradient penalty, create_graph=True)
    either works or stops with torch's once_differentiable message, not an error from inside a kernel."""
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, positional_encoding=encoding, causal=causal, max_positions=64, spe_realizations=4)
    x = torch.randn(1, 9, 16, requires_grad=True)
    (grad,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    try:
        grad.pow(2).sum().backward()
    except RuntimeError as error:
        assert "differentiate twice a function that was marked with @once_differentiable" in str(error)
    else:
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    "head",
    [
        lrpe_hf.LinearRobertaForMaskedLM,
        lrpe_hf.LinearRobertaForSequenceClassification,
        lrpe_hf.LinearRobertaForTokenClassification,
        lrpe_hf.LinearGPTForSequenceClassification,
    ],
)
def test_a_text_head_takes_what_transformers_passes_for_nothing_and_refuses_the_rest(head):
    """transformers' neutral arguments (cache_position) reach a head's forward and are set aside, not handed to its
    loss or output; an argument of no meaning here raises, naming it."""
    family = lrpe_hf.LinearGPTConfig if "GPT" in head.__name__ else lrpe_hf.LinearRobertaConfig
    config = family(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    model = head(config).eval()
    ids = torch.randint(3, 50, (2, 5))
    plain = model(ids).logits
    torch.testing.assert_close(model(ids, cache_position=torch.arange(5)).logits, plain)
    with pytest.raises(TypeError, match="does not use: past_lengths"):
        model(ids, past_lengths=3)
