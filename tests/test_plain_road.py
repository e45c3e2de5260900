"""The plain road: a model's plain call (no cache, default positions, no attention weights, no context parallelism)
takes each layer's ``plain_attend`` where the layer can, and gives what the general road gives, forward and backward,
for every encoding, feature map and normalisation, causal and bidirectional, with padding and without."""

import pytest
import torch

import lrpe_hf
from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM, LinearRobertaConfig, LinearRobertaForMaskedLM
from lrpe_hf.modeling.linear_attention import LinearAttention
from lrpe_hf.modeling.registry import positional_encoding_entry
from lrpe_hf.modeling.transformer_stack import LinearTransformerStack

SIZES = dict(
    vocab_size=60,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    spe_realizations=8,
)
FAMILIES = {"gpt": (LinearGPTConfig, LinearGPTForCausalLM), "roberta": (LinearRobertaConfig, LinearRobertaForMaskedLM)}


def cases():
    cases = [(family, encoding, {}) for family in FAMILIES for encoding in lrpe_hf.POSITIONAL_ENCODINGS]
    cases = [(f, e, o) for f, e, o in cases if f == "gpt" or not positional_encoding_entry(e).causal_only]
    cases += [
        (family, "rope", {"feature_map": feature_map})
        for family in FAMILIES
        for feature_map in lrpe_hf.FEATURE_MAPS
        if feature_map != "elu"
    ]
    cases += [
        ("gpt", "permute", {"normalization": "output_norm"}),
        ("gpt", "rope", {"normalization": "unrotated_denominator"}),
        ("roberta", "lrpe_orthogonal", {"normalization": "output_layer_norm"}),
    ]
    return cases


def ids_and_mask(padded: bool):
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0  # left padding in one row
        mask[1, -3:] = 0  # right padding in the other
    return ids, mask


def loss_and_gradients(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = (logits * torch.linspace(-1, 1, logits.shape[-1])).sum()  # every logit weighs in the gradients
    loss.backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("family", "encoding", "fields"), cases())
def test_a_plain_call_takes_the_plain_road_where_it_can_and_equals_the_general_one(
    family, encoding, fields, padded, monkeypatch
):
    """Logits and every parameter's gradient of a training forward equal the general road's; the layers that can
    (``takes_plain_road``: a feature map without a stabiliser, an encoding acting on the features alone) take the
    plain road, the others (SPE, FastRPB, the stabilised exponential maps) say they cannot."""
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**SIZES, positional_encoding=encoding, **fields)).train()
    ids, mask = ids_and_mask(padded)
    plain_calls = []
    plain_attend = LinearAttention.plain_attend
    monkeypatch.setattr(LinearAttention, "plain_attend", lambda *a: plain_calls.append(1) or plain_attend(*a))
    torch.manual_seed(1)  # random feature maps redraw at each training forward: the same draw on both roads
    plain_logits, plain_gradients = loss_and_gradients(model, ids, mask)
    monkeypatch.setattr(LinearTransformerStack, "is_plain_call", staticmethod(lambda *a: False))
    torch.manual_seed(1)
    general_logits, general_gradients = loss_and_gradients(model, ids, mask)

    stabilised = fields.get("feature_map") in ("exp", "performer")
    can = encoding not in ("spe_sine", "spe_conv", "fastrpb") and not stabilised
    assert model.base_model.stack.layers[0].self_attn.takes_plain_road == can
    assert len(plain_calls) == (SIZES["num_hidden_layers"] if can else 0)
    torch.testing.assert_close(plain_logits, general_logits)
    assert plain_gradients.keys() == general_gradients.keys()
    for name, gradient in plain_gradients.items():
        torch.testing.assert_close(gradient, general_gradients[name], msg=lambda m, name=name: f"{name}: {m}")


def test_a_call_with_a_cache_given_positions_or_attention_weights_takes_the_general_road(monkeypatch):
    """What the plain road does not do (continue a state, restart at given positions, probe attention weights) is
    left to the general road: none of those calls reaches ``plain_attend``."""
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(LinearGPTConfig(**SIZES, positional_encoding="rope")).eval()
    ids, _ = ids_and_mask(False)
    monkeypatch.setattr(LinearAttention, "plain_attend", lambda *a: pytest.fail("took the plain road"))
    with torch.no_grad():
        model(ids, use_cache=True)
        model(ids, position_ids=torch.arange(12).repeat(2, 1))
        model(ids, output_attentions=True)


def test_a_hook_on_the_attention_path_sends_the_call_down_the_general_road():
    """A forward hook on a layer's attention path (``KernelAttention``), which the plain road does not call as a
    module, still runs: that layer takes the general road."""
    torch.manual_seed(0)
    model = LinearGPTForCausalLM(LinearGPTConfig(**SIZES, positional_encoding="rope")).eval()
    seen = []
    model.model.stack.layers[1].self_attn.attention.register_forward_hook(lambda *a: seen.append(1))
    with torch.no_grad():
        model(ids_and_mask(False)[0])
    assert seen == [1]
    assert model.model.stack.layers[0].self_attn.takes_plain_road
    assert not model.model.stack.layers[1].self_attn.takes_plain_road
