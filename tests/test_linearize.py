"""lrpe_hf.linearize: a GPT-2, RoBERTa, BERT or ViT checkpoint becomes the matching linear-attention model.

With softmax attention, no relative encoding and the learned absolute table, the converted model computes what
the original does (small random checkpoints built here, every head, padding included); with a relative
encoding and linear attention it keeps every pretrained weight and runs on inputs longer than the table.
"""

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaForQuestionAnswering,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
    RobertaModel,
    ViTConfig,
    ViTForImageClassification,
)

import lrpe_hf

EXACT = dict(attention="softmax", positional_encoding="none", absolute_position_embedding="learned")
TEXT = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=37, vocab_size=60)


def gpt2(model_class=GPT2LMHeadModel):
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=60, n_positions=24, bos_token_id=0, eos_token_id=0)
    config.pad_token_id = 0
    return model_class(config)


def roberta(model_class, num_labels=3):
    config = RobertaConfig(**TEXT, max_position_embeddings=26, pad_token_id=1, num_labels=num_labels, type_vocab_size=1)
    return model_class(config)  # one segment type, as RoBERTa's checkpoints (transformers' default config has 2)


def bert(model_class):
    return model_class(BertConfig(**TEXT, max_position_embeddings=24, pad_token_id=0, num_labels=3))


def text_inputs(pad_token_id, padded=True):
    torch.manual_seed(1)
    ids = torch.randint(3, 60, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    if padded:
        ids[1, -3:], mask[1, -3:] = pad_token_id, 0
    return {"input_ids": ids, "attention_mask": mask}


def outputs(model, inputs):
    with torch.no_grad():
        out = model.eval()(**inputs)
    names = ("logits", "start_logits", "end_logits", "last_hidden_state")
    return {name: getattr(out, name) for name in names if getattr(out, name, None) is not None}


def assert_same_outputs(original, converted, inputs, mask=None):
    want, got = outputs(original, inputs), outputs(converted, inputs)
    assert want.keys() == got.keys()
    for name in want:
        a, b = want[name], got[name]
        if mask is not None and a.dim() >= 2 and a.shape[1] == mask.shape[1]:  # compare real tokens only
            a, b = a[mask.bool()], b[mask.bool()]
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=name)


CASES = {
    "gpt2-lm": (lambda: gpt2(GPT2LMHeadModel), lrpe_hf.LinearGPTForCausalLM, 0),
    "gpt2-base": (lambda: gpt2(GPT2Model), lrpe_hf.LinearGPTModel, 0),
    "gpt2-classification": (lambda: gpt2(GPT2ForSequenceClassification), lrpe_hf.LinearGPTForSequenceClassification, 0),
    "roberta-mlm": (lambda: roberta(RobertaForMaskedLM), lrpe_hf.LinearRobertaForMaskedLM, 1),
    "roberta-base": (lambda: roberta(RobertaModel), lrpe_hf.LinearRobertaModel, 1),
    "roberta-classification": (
        lambda: roberta(RobertaForSequenceClassification),
        lrpe_hf.LinearRobertaForSequenceClassification,
        1,
    ),
    "roberta-tokens": (lambda: roberta(RobertaForTokenClassification), lrpe_hf.LinearRobertaForTokenClassification, 1),
    "roberta-qa": (lambda: roberta(RobertaForQuestionAnswering, 2), lrpe_hf.LinearRobertaForQuestionAnswering, 1),
    "bert-mlm": (lambda: bert(BertForMaskedLM), lrpe_hf.LinearRobertaForMaskedLM, 0),
    "bert-classification": (
        lambda: bert(BertForSequenceClassification),
        lrpe_hf.LinearRobertaForSequenceClassification,
        0,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_softmax_conversion_of_text_models_is_exact(case):
    make, target_class, pad = CASES[case]
    torch.manual_seed(0)
    original = make()
    converted = lrpe_hf.linearize(original, **EXACT)
    assert type(converted) is target_class
    inputs = text_inputs(pad, padded=not case.startswith("gpt2"))  # GPT-2 ignores padding when placing positions
    assert_same_outputs(original, converted, inputs, inputs["attention_mask"])


@pytest.mark.parametrize("case", ["gpt2-lm", "roberta-classification", "bert-mlm"])
def test_a_student_whose_local_window_covers_the_input_is_its_teacher(case):
    """``linearize(..., local_window=W)``: with W at least the input's length every query attends by exact softmax
    to every key it sees (no token is left to the linear part), so the student, causal or bidirectional, gives its
    teacher's outputs, whatever its feature map; the window's factor is among the parameters attention transfer
    trains."""
    make, _, pad = CASES[case]
    torch.manual_seed(0)
    original = make()
    student = lrpe_hf.linearize(original, **{**EXACT, "attention": "linear", "local_window": 64})
    inputs = text_inputs(pad, padded=not case.startswith("gpt2"))
    assert_same_outputs(original, student, inputs, inputs["attention_mask"])
    factors = [name for name, _ in student.named_parameters() if name.endswith("local_window.log_linear_weight")]
    trained = {id(p) for p in lrpe_hf.linearize_transfer_parameters(student)}
    assert factors and all(id(student.get_parameter(name)) in trained for name in factors)


def test_run_linearize_takes_the_local_window():
    """``run_linearize --local_window 64`` (as every run script) builds the student with the window."""
    from transformers import HfArgumentParser

    from lrpe_hf.training.arguments import ModelArguments

    (arguments,) = HfArgumentParser(ModelArguments).parse_args_into_dataclasses(["--local_window", "64"])
    assert arguments.config_fields() == {"local_window": 64}


@pytest.mark.parametrize("model_class", [BertForMaskedLM, BertForSequenceClassification])
def test_a_linearized_bert_reads_sentence_pairs_as_bert_does(model_class, tmp_path):
    """BERT's tokenizer gives the second sentence of a pair token type 1: the segment table carries over, so the
    converted model computes what BERT does on pairs, saved and loaded again too."""
    torch.manual_seed(0)
    original = bert(model_class)
    converted = lrpe_hf.linearize(original, **EXACT)
    assert converted.config.type_vocab_size == 2
    inputs = text_inputs(0)
    inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    inputs["token_type_ids"][:, 4:] = 1
    assert_same_outputs(original, converted, inputs, inputs["attention_mask"])
    with torch.no_grad():  # the segments are read: type 0 throughout gives other hidden states
        pairs = converted.model(**inputs).last_hidden_state
        one_segment = converted.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    assert (one_segment.last_hidden_state - pairs).abs().max() > 1e-2
    converted.save_pretrained(tmp_path)
    assert_same_outputs(original, type(converted).from_pretrained(tmp_path), inputs, inputs["attention_mask"])
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, 2\)"):
        converted(input_ids=inputs["input_ids"], token_type_ids=torch.full_like(inputs["input_ids"], 2))


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_softmax_conversion_of_vit_is_exact(qkv_bias):
    torch.manual_seed(0)
    config = ViTConfig(
        **{k: v for k, v in TEXT.items() if k != "vocab_size"}, image_size=16, patch_size=4, num_labels=3,
        qkv_bias=qkv_bias,
    )  # fmt: skip
    original = ViTForImageClassification(config)
    converted = lrpe_hf.linearize(original, **EXACT)
    assert isinstance(converted, lrpe_hf.LinearViTForImageClassification)
    assert_same_outputs(original, converted, {"pixel_values": torch.randn(2, 3, 16, 16)})


def test_conversion_from_a_saved_checkpoint_and_round_trip(tmp_path):
    torch.manual_seed(0)
    original = roberta(RobertaForSequenceClassification)
    original.save_pretrained(tmp_path / "roberta")
    converted = lrpe_hf.linearize(str(tmp_path / "roberta"), **EXACT)
    inputs = text_inputs(1)
    assert_same_outputs(original, converted, inputs, inputs["attention_mask"])
    converted.save_pretrained(tmp_path / "linear")
    reloaded = lrpe_hf.LinearRobertaForSequenceClassification.from_pretrained(tmp_path / "linear")
    assert_same_outputs(converted, reloaded, inputs)
    assert (tmp_path / "linear" / "linear_attention.py").exists()  # the model code travels: remote code


def test_relative_linear_student_keeps_the_weights_and_runs_past_the_table():
    """The default student: lrpe_orthogonal, linear attention, no absolute table; 4x the teacher's positions."""
    torch.manual_seed(0)
    teacher = gpt2()
    student = lrpe_hf.linearize(teacher, absolute_position_embedding="none")
    assert student.config.positional_encoding == "lrpe_orthogonal" and student.config.attention == "linear"
    torch.testing.assert_close(
        student.model.stack.layers[1].self_attn.qkv_proj.weight,
        teacher.transformer.h[1].attn.c_attn.weight.T,
    )
    with torch.no_grad():
        logits = student(torch.randint(3, 60, (1, 4 * teacher.config.n_positions))).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("model_class", [BertForSequenceClassification, RobertaForMaskedLM])
@pytest.mark.parametrize("encoding", ["rope", "lrpe_orthogonal", "permute"])
def test_a_converted_encoder_without_the_table_reads_8x_past_it(model_class, encoding):
    """Dropping the table: the relative encoding alone orders the tokens, at 8x the teacher's positions. Swapping two
    tokens moves a far token's output, where without an encoding (the order-blind reference) it moves by rounding
    only: the positions are not lost."""
    torch.manual_seed(0)
    teacher = bert(model_class) if model_class.__name__.startswith("Bert") else roberta(model_class)
    with torch.no_grad():  # attention as peaked as a pretrained model's: at the init's scale every query is flat
        for name, weight in teacher.named_parameters():
            if name.endswith(("query.weight", "key.weight")):
                weight.mul_(30)
    ids = torch.randint(3, 60, (1, 8 * teacher.config.max_position_embeddings))
    swapped = ids.clone()
    swapped[0, [10, 11]] = ids[0, [11, 10]]

    def change_at_token_100(positional_encoding):
        student = lrpe_hf.linearize(
            teacher, feature_map="hedgehog", positional_encoding=positional_encoding, absolute_position_embedding="none"
        ).eval()
        with torch.no_grad():
            out, out_swapped = (
                student(input_ids=x, output_hidden_states=True).hidden_states[-1] for x in (ids, swapped)
            )
        assert torch.isfinite(out).all()
        return (out[0, 100] - out_swapped[0, 100]).abs().max().item()

    # Without an encoding the swap moves token 100 by float rounding only (measured: 1e-9 to 6e-8); with one, by
    # 2.7e-5 to 3e-4 here: the bounds sit between the two.
    assert change_at_token_100("none") < 1e-6
    assert change_at_token_100(encoding) > 1e-5


def test_the_learned_table_is_extended_only_when_asked_and_never_wrapped():
    """``table_extension``: ``copy`` repeats the teacher's T rows (row p = row p mod T), ``interpolate`` samples them
    linearly at p (T - 1) / (rows - 1); the extended model runs at 8x, and past its own table it refuses."""
    torch.manual_seed(0)
    teacher = bert(BertForMaskedLM)
    T = teacher.config.max_position_embeddings
    table = teacher.bert.embeddings.position_embeddings.weight  # BERT's segment table carries over apart
    with pytest.raises(
        ValueError, match="table_extension .'copy' or 'interpolate'.*absolute_position_embedding='none'"
    ):
        lrpe_hf.linearize(teacher, max_position_embeddings=8 * T)
    with pytest.raises(ValueError, match="Unknown table_extension 'wrap'"):
        lrpe_hf.linearize(teacher, max_position_embeddings=8 * T, table_extension="wrap")
    with pytest.raises(ValueError, match="a shorter table is not made"):
        lrpe_hf.linearize(teacher, max_position_embeddings=T // 2, table_extension="copy")
    with pytest.raises(ValueError, match="absolute_position_embedding='none' keeps none"):
        lrpe_hf.linearize(teacher, absolute_position_embedding="none", table_extension="copy")  # never ignored

    copied = lrpe_hf.linearize(teacher, max_position_embeddings=8 * T, table_extension="copy").eval()
    grown = copied.model.position_embedding.tables[0].weight
    assert grown.shape == (8 * T, table.shape[1])
    for p in (0, T - 1, T, 3 * T + 5, 8 * T - 1):
        torch.testing.assert_close(grown[p], table[p % T])

    stretched = lrpe_hf.linearize(teacher, max_position_embeddings=8 * T, table_extension="interpolate")
    grown = stretched.model.position_embedding.tables[0].weight
    for p in (0, 1, 100, 8 * T - 1):
        x = p * (T - 1) / (8 * T - 1)
        below = min(int(x), T - 2)
        torch.testing.assert_close(grown[p], table[below] + (x - below) * (table[below + 1] - table[below]))

    with torch.no_grad():
        assert torch.isfinite(copied(input_ids=torch.randint(3, 60, (1, 8 * T))).logits).all()
    with pytest.raises(ValueError, match=f"cover positions 0..{8 * T - 1}"):
        copied(input_ids=torch.randint(3, 60, (1, 8 * T + 1)))


def test_without_absolute_positions_the_segment_vector_moves_into_the_token_embeddings():
    torch.manual_seed(0)
    original = roberta(RobertaForMaskedLM)
    converted = lrpe_hf.linearize(
        original, attention="softmax", positional_encoding="none", absolute_position_embedding="none"
    )
    assert not converted.config.tie_word_embeddings
    segment = original.roberta.embeddings.token_type_embeddings.weight[0]
    torch.testing.assert_close(
        converted.model.embed_tokens.weight, original.roberta.embeddings.word_embeddings.weight + segment
    )
    torch.testing.assert_close(converted.lm_head.decoder.weight, original.lm_head.decoder.weight)


def test_unsupported_architectures_are_named():
    from transformers import OPTConfig, OPTForCausalLM

    with pytest.raises(ValueError, match="supported architectures: GPT2Model, GPT2LMHeadModel"):
        lrpe_hf.linearize(
            OPTForCausalLM(
                OPTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=4, ffn_dim=32, vocab_size=40)
            )
        )


@pytest.mark.parametrize(
    "loss,fields",
    [
        ("output_mse", dict(feature_map="hedgehog")),  # the default student: lrpe_orthogonal
        ("output_mse", dict(positional_encoding="spe_sine", feature_map="t2r")),
        ("attention_ce", dict(positional_encoding="none", feature_map="hedgehog")),
        ("attention_ce", dict(positional_encoding="permute", feature_map="hedgehog")),
        ("output_mse", dict(feature_map="hedgehog", local_window=4)),  # the window's factor trains too
    ],
)
def test_one_attention_transfer_step_lowers_the_transfer_loss(loss, fields):
    """Stage 1 of linearizing: only the feature maps and encodings train, towards the teacher's attention."""
    torch.manual_seed(0)
    teacher = gpt2().eval()
    student = lrpe_hf.linearize(teacher, **fields).eval()
    trainable = lrpe_hf.linearize_transfer_parameters(student)
    assert trainable and all(p.requires_grad for p in trainable)
    frozen = {name: p.detach().clone() for name, p in student.named_parameters() if "qkv_proj" in name}
    ids = torch.randint(3, 60, (4, 16))
    with torch.no_grad():
        hidden_states = teacher(ids, output_hidden_states=True).hidden_states
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    before = lrpe_hf.attention_transfer_loss(student, hidden_states, loss=loss)
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = lrpe_hf.attention_transfer_loss(student, hidden_states, loss=loss)
    assert after < before
    for name, p in student.named_parameters():  # the teacher's weights did not move
        if name in frozen:
            assert torch.equal(p, frozen[name])


def test_attention_ce_needs_non_negative_weights():
    student = lrpe_hf.linearize(gpt2())  # lrpe_orthogonal: signed features
    hidden_states = (torch.randn(1, 5, 32),) * 3
    with pytest.raises(ValueError, match="non-negative"):
        lrpe_hf.attention_transfer_loss(student, hidden_states, loss="attention_ce")


@pytest.mark.parametrize("loss", ["output_mse", "attention_ce"])
@pytest.mark.parametrize("family", ["gpt2", "roberta"])
def test_attention_transfer_loss_of_a_padded_batch_is_the_token_weighted_loss_of_each_row_alone(family, loss):
    """Padded queries enter neither loss (left padding for the causal student, right for the bidirectional one):
    the batch's loss is the mean over its real tokens of what each row gives alone, and finite."""
    torch.manual_seed(0)
    teacher = gpt2().eval() if family == "gpt2" else roberta(RobertaForMaskedLM).eval()
    student = lrpe_hf.linearize(teacher, positional_encoding="permute", feature_map="hedgehog").eval()
    ids = torch.randint(3, 60, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0 if family == "gpt2" else 1
    mask[1, -4:] = 1 if family == "gpt2" else 0
    real = mask.bool()
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # GPT-2 counts left padding otherwise
        hidden = teacher(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True).hidden_states
        batch = lrpe_hf.attention_transfer_loss(student, hidden, mask, loss=loss)
        alone = []
        for row in range(2):
            row_ids = ids[row : row + 1, real[row]]
            row_hidden = teacher(row_ids, output_hidden_states=True).hidden_states
            alone.append(lrpe_hf.attention_transfer_loss(student, row_hidden, loss=loss))
    counts = real.sum(-1).double()
    assert torch.isfinite(batch)
    # the losses are float32: compared at float32's tolerance
    torch.testing.assert_close(batch, ((torch.stack(alone).double() * counts).sum() / counts.sum()).float())


@pytest.mark.parametrize("fields", [dict(feature_map="exp"), dict(feature_map="performer"), dict(feature_map="elu")])
def test_attention_weights_are_the_ones_the_layer_applies(fields):
    """Weights times values, through the output projection, give the explicit O(N^2) formula's output: the
    stabiliser's gates (exp, performer) and PermuteFormer's decay (causal) are in them."""
    from conftest import make_layer
    from reference import reference_attention

    layer = make_layer("permute", causal=True, chunk_size=4, **fields)
    x = torch.randn(2, 11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = False
    weights = layer.attention_weights(x, mask)  # (B, H, N, N)
    values = layer.qkv_proj(x).view(2, 11, 3, 2, 8)[:, :, 2].transpose(1, 2) * mask[:, None, :, None]  # v's rows
    out = layer.o_proj((weights @ values).transpose(1, 2).reshape(2, 11, 16))
    torch.testing.assert_close(out, reference_attention(layer, x, mask))
    assert weights[1, :, :3].abs().max() == 0 and weights[1, :, :, :3].abs().max() == 0


@pytest.mark.parametrize(
    "make,field,value",
    [
        (gpt2, "scale_attn_weights", False),
        (gpt2, "scale_attn_by_inverse_layer_idx", True),
        (gpt2, "reorder_and_upcast_attn", True),
        (lambda: bert(BertForMaskedLM), "position_embedding_type", "relative_key"),
        (lambda: bert(BertForMaskedLM), "is_decoder", True),
        (lambda: roberta(RobertaForMaskedLM), "position_embedding_type", "relative_key_query"),
    ],
)
def test_a_source_field_that_changes_the_attention_is_refused_by_name(make, field, value):
    """GPT-2 without its 1/sqrt(d) scale converted to a model with it differed from the source by 1.8e-3: every
    field that changes the attention's maths is honoured or refused, naming it."""
    source = make()
    setattr(source.config, field, value)
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        lrpe_hf.linearize(source, **EXACT)
