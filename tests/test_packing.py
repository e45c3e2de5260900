"""Packed rows: a position that does not increase starts a new document, and nothing crosses the boundary.

One rule for every path (bidirectional, chunked causal, recurrent decoding, softmax) and every encoding, so a
padding-free batch (transformers' DataCollatorWithFlattening) equals each document run alone.
"""

import pytest
import torch
from conftest import make_layer, second_feature_map
from transformers import DataCollatorWithFlattening

from lrpe_hf import (
    POSITIONAL_ENCODINGS,
    LinearAttentionState,
    LinearGPTConfig,
    LinearGPTForCausalLM,
    LinearRobertaConfig,
    LinearRobertaForMaskedLM,
)

LENGTHS = [5, 1, 6]  # a one-token document too: its position 0 repeats the previous one's


def packed_inputs(hidden=16, seed=0):
    x = torch.randn(1, sum(LENGTHS), hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return x, positions


def run(layer, x, **kwargs):
    if layer.shared_codes is not None:
        kwargs.setdefault("shared_draw", layer.shared_codes.draw())
    return layer(x, **kwargs)


def each_document_alone(layer, x):
    pieces, start = [], 0
    for n in LENGTHS:
        pieces.append(run(layer, x[:, start : start + n]))
        start += n
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_a_packed_row_equals_each_document_alone(encoding, attention, causal):
    feature_map = second_feature_map(encoding) if attention == "linear" else None
    layer = make_layer(encoding, causal=causal, attention=attention, feature_map=feature_map, chunk_size=4)
    x, positions = packed_inputs()
    packed = run(layer, x, position_ids=positions)
    torch.testing.assert_close(packed, each_document_alone(layer, x), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("encoding", POSITIONAL_ENCODINGS)
def test_decoding_a_packed_row_token_by_token_equals_the_full_forward(encoding, attention):
    feature_map = second_feature_map(encoding) if attention == "linear" else None
    layer = make_layer(encoding, causal=True, attention=attention, feature_map=feature_map, chunk_size=4)
    x, positions = packed_inputs()
    full = run(layer, x, position_ids=positions)
    state = LinearAttentionState()
    pieces = [run(layer, x[:, :3], position_ids=positions[:, :3], state=state)]
    for t in range(3, x.shape[1]):
        pieces.append(run(layer, x[:, t : t + 1], position_ids=positions[:, t : t + 1], state=state))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-10, rtol=1e-8)


def test_documents_in_a_padded_batch():
    """Padding between documents neither starts nor ends one; rows keep their own documents."""
    layer = make_layer("permute", causal=True, chunk_size=4)
    x, positions = packed_inputs()
    padded = torch.zeros(2, 14, 16, dtype=torch.float64)
    padded[0, 2:] = x[0]
    padded[1, :12] = x[0]
    mask = torch.zeros(2, 14, dtype=torch.bool)
    mask[0, 2:] = mask[1, :12] = True
    padded_positions = torch.zeros(2, 14, dtype=torch.long)
    padded_positions[0, 2:] = padded_positions[1, :12] = positions[0]
    out = run(layer, padded, attention_mask=mask, position_ids=padded_positions)
    alone = each_document_alone(layer, x)
    torch.testing.assert_close(out[0, 2:], alone[0])
    torch.testing.assert_close(out[1, :12], alone[0])


@pytest.mark.parametrize("encoding", ["lrpe_orthogonal", "permute", "spe_sine", "fastrpb"])
@pytest.mark.parametrize("family", ["gpt", "roberta"])
def test_flattened_batch_loss_equals_the_documents_run_alone(family, encoding):
    """transformers' DataCollatorWithFlattening packs documents into one row with restarting position_ids;
    the loss equals the token-weighted mean of each document's loss, and the hidden states agree."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    sizes.update(vocab_size=50, max_position_embeddings=64, spe_realizations=8, hidden_dropout_prob=0.0)
    if family == "gpt":
        model = LinearGPTForCausalLM(LinearGPTConfig(positional_encoding=encoding, **sizes)).eval()
    else:
        model = LinearRobertaForMaskedLM(LinearRobertaConfig(positional_encoding=encoding, **sizes)).eval()
    documents = [torch.randint(3, 50, (n,)).tolist() for n in (7, 3, 9)]
    features = [{"input_ids": ids, "labels": ids} for ids in documents]
    batch = DataCollatorWithFlattening(return_position_ids=True)(features, return_tensors="pt")
    with torch.no_grad():
        packed = model(**batch, output_hidden_states=True)
        total, count, start = 0.0, 0, 0
        for ids in documents:
            ids = torch.tensor([ids])
            labels = ids.clone()
            labels[0, 0] = -100  # the collator leaves each document's first token out of the labels
            alone = model(input_ids=ids, labels=labels, output_hidden_states=True)
            n = ids.shape[1]
            predicted = n - 1  # causal: the labels shift by one; masked LM: the first token is left out
            total, count = total + alone.loss * predicted, count + predicted
            torch.testing.assert_close(packed.hidden_states[-1][:, start : start + n], alone.hidden_states[-1])
            start += n
    torch.testing.assert_close(packed.loss, total / count)


@pytest.mark.parametrize("keywords", [dict(return_flash_attn_kwargs=True), dict(return_seq_idx=True)])
def test_the_flattening_collators_kernel_keywords_are_refused_naming_position_ids(keywords):
    """Its flash-attention (cu_seq_lens_*, max_length_*) and recurrent-kernel (seq_idx) keywords repeat what
    position_ids say: refused with the collator call that works, not taken as an unknown argument."""
    model = LinearGPTForCausalLM(
        LinearGPTConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    features = [{"input_ids": ids, "labels": ids} for ids in ([5, 6, 7], [8, 9])]
    batch = DataCollatorWithFlattening(**keywords)(features, return_tensors="pt")
    with pytest.raises(TypeError, match=r"from position_ids alone .*: use DataCollatorWithFlattening\(\) without"):
        model(**batch)
