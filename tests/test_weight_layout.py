"""Decoding lays the projection weights out for one-row products: only strides change, and only where they should."""

import copy

import torch
from torch import nn

from lrpe_hf import LinearAttentionCache, LinearGPTConfig, LinearGPTForCausalLM
from lrpe_hf.modeling.weight_layout import lay_out_for_one_row_products

CONFIG = dict(
    vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=128, pad_token_id=0, eos_token_id=None, hidden_dropout_prob=0.0,
)  # fmt: skip


def tiny_model():
    torch.manual_seed(0)
    return LinearGPTForCausalLM(LinearGPTConfig(**CONFIG)).eval()


def projection_weights(model):
    return {name: m.weight for name, m in model.model.stack.named_modules() if isinstance(m, nn.Linear)}


def is_column_major(weight):
    return weight.t().is_contiguous() and not weight.is_contiguous()


def decode(model, ids, steps):
    """Greedy steps after a prefill of ``ids`` (B, N): the steps' logits (B, steps, V)."""
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:]
    out = []
    for _ in range(steps):
        logits = model(logits.argmax(-1), past_key_values=cache, use_cache=True).logits
        out.append(logits)
    return torch.cat(out, dim=1)


def test_a_decoding_step_stores_float32_cpu_weights_column_major_with_the_same_values_and_logits():
    model = tiny_model()
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, use_cache=True)  # a prefill alone (as a Trainer's evaluation) keeps the layout
        assert not any(is_column_major(w) for w in projection_weights(model).values())
        logits = decode(model, ids, steps=4)
    with torch.enable_grad():  # a forward that records gradients keeps the layout
        expected = decode(reference, ids, steps=4)
    weights, reference_weights = projection_weights(model), projection_weights(reference)
    assert len(weights) == 2 * 4  # qkv, o, fc1, fc2 per layer
    assert all(is_column_major(w) for w in weights.values())
    assert not any(is_column_major(w) for w in reference_weights.values())
    for name, weight in weights.items():
        assert torch.equal(weight, reference_weights[name]) and type(weight) is nn.Parameter
    assert model.lm_head.weight.is_contiguous()  # tied to the embeddings, whose rows a lookup gathers
    # the GEMMs read the other layout in another summation order: float32 rounding apart (1e-7 here), no more
    torch.testing.assert_close(logits, expected.detach(), rtol=0, atol=1e-6)


def test_weights_laid_out_under_inference_mode_train_and_save_as_before(tmp_path):
    model = tiny_model()
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        decode(model, ids, steps=2)
    assert all(is_column_major(w) for w in projection_weights(model).values())
    model.train()
    loss = model(ids, labels=ids).loss  # would raise if a weight were an inference tensor
    loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    assert all(w.grad.shape == w.shape and torch.isfinite(w.grad).all() for w in projection_weights(model).values())
    model.save_pretrained(tmp_path)
    loaded = LinearGPTForCausalLM.from_pretrained(tmp_path)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0)


def test_moving_the_model_to_half_precision_lays_the_weights_out_row_major_again():
    """Half precision's one-row products run slower on column-major weights, and ``to`` keeps strides."""
    model = tiny_model()
    ids = torch.randint(3, 60, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        decode(model, ids, steps=1)
        model.to(torch.bfloat16)
        assert all(is_column_major(w) for w in projection_weights(model).values())  # to() kept them
        decode(model, ids, steps=1)
    assert all(w.is_contiguous() for w in projection_weights(model).values())


def test_the_layout_rule_by_dtype_and_leaves_subclass_weights_alone():
    layers = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 8, dtype=torch.float64), nn.Linear(4, 4))
    layers[2].weight = nn.Parameter(layers[2].weight.detach().t().contiguous().t())  # column-major float32
    values = [layer.weight.detach().clone() for layer in layers]
    lay_out_for_one_row_products(layers)
    assert is_column_major(layers[0].weight) and is_column_major(layers[2].weight)
    assert layers[1].weight.is_contiguous()  # float64: no faster either way
    layers.to(torch.float16)
    lay_out_for_one_row_products(layers)
    assert all(layer.weight.is_contiguous() for layer in layers)
    assert all(torch.equal(layer.weight.float(), value.half().float()) for layer, value in zip(layers, values))

    class Marked(torch.Tensor):
        pass

    layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(layer.weight.detach().as_subclass(Marked))
    lay_out_for_one_row_products(layer)
    assert layer.weight.is_contiguous()
