"""lrpe_hf.training.distillation: a linearized encoder without the teacher's position table learns the teacher's
hidden states on blocks the teacher can read, then reads past them."""

import pytest
import torch
from transformers import BertConfig, BertModel, BertTokenizerFast

import lrpe_hf
from lrpe_hf.training import distillation

WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture
def tokenizer(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return BertTokenizerFast(vocab=str(tmp_path / "vocab.txt"))


def teacher_model():
    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=45,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertModel(config).eval()


def texts(count=60, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, 40, (12,), generator=generator)) for _ in range(count)]


def test_text_blocks_are_full_blocks_between_special_tokens(tokenizer):
    batch = next(distillation.text_blocks(tokenizer, texts(), block_size=16, batch_size=3))
    ids = batch["input_ids"]
    assert ids.shape == (3, 16)
    assert (ids[:, 0] == tokenizer.cls_token_id).all() and (ids[:, -1] == tokenizer.sep_token_id).all()
    assert ((ids[:, 1:-1] >= 5) & (ids[:, 1:-1] < 45)).all()  # words only: no padding, no unknown token
    with pytest.raises(ValueError, match="fewer than 3 blocks of 16"):
        next(distillation.text_blocks(tokenizer, texts(count=2), block_size=16, batch_size=3))


def held_out_loss(student, teacher, batch, loss):
    with torch.no_grad():
        if loss == "hidden_states":
            return distillation.hidden_state_loss(
                student.eval()(**batch, output_hidden_states=True).hidden_states,
                teacher(**batch, output_hidden_states=True).hidden_states,
            ).item()
        hidden_states = teacher(**batch, output_hidden_states=True).hidden_states
        return lrpe_hf.attention_transfer_loss(student.eval(), hidden_states).item()


def test_attention_transfer_trains_only_the_feature_maps_and_encodings(tokenizer):
    teacher = teacher_model()
    student = lrpe_hf.linearize(
        teacher, feature_map="hedgehog", positional_encoding="lrpe_orthogonal", absolute_position_embedding="none"
    )
    kept = {
        n: p.detach().clone() for n, p in student.named_parameters() if "feature_map" not in n and "positional" not in n
    }
    held_out = next(distillation.text_blocks(tokenizer, texts(seed=1), block_size=32, batch_size=4))
    before = held_out_loss(student, teacher, held_out, "attention")
    batches = distillation.text_blocks(tokenizer, texts(), block_size=32, batch_size=4)
    losses = distillation.attention_transfer(student, teacher, batches, steps=30)
    assert len(losses) == 30
    assert held_out_loss(student, teacher, held_out, "attention") < 0.7 * before
    for name, parameter in student.named_parameters():
        if name in kept:
            torch.testing.assert_close(parameter, kept[name], rtol=0, atol=0, msg=name)


def test_hidden_state_distillation_finds_the_teacher_again(tokenizer):
    """A student that computes exactly what the teacher does (softmax attention and the teacher's table), its
    layers' weights then perturbed: distillation brings its hidden states back to the teacher's, every weight
    training; the teacher does not move."""
    teacher = teacher_model()
    student = lrpe_hf.linearize(
        teacher, attention="softmax", positional_encoding="none", absolute_position_embedding="learned"
    )
    student.config.hidden_dropout_prob = 0.0
    for module in student.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    held_out = next(distillation.text_blocks(tokenizer, texts(seed=1), block_size=32, batch_size=4))
    assert held_out_loss(student, teacher, held_out, "hidden_states") < 1e-10
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in student.named_parameters():
            if ".layers." in name and name.endswith("weight") and parameter.dim() == 2:
                parameter.add_(0.05 * torch.randn_like(parameter))
    before = held_out_loss(student, teacher, held_out, "hidden_states")
    batches = distillation.text_blocks(tokenizer, texts(), block_size=32, batch_size=4)
    losses = distillation.distill_hidden_states(student, teacher, batches, steps=40, learning_rate=2e-3)
    assert len(losses) == 40
    after = held_out_loss(student, teacher, held_out, "hidden_states")
    assert after < 0.2 * before, (before, after)
    assert all(not p.requires_grad for p in teacher.parameters())
