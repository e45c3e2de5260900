"""Teach a linearized student the teacher's computation at lengths the teacher can see, so that it can be used at
lengths the teacher cannot (the teacher's learned position table ends at ``max_position_embeddings``).

    student = lrpe_hf.linearize(teacher, feature_map="hedgehog", absolute_position_embedding="none")
    batches = text_blocks(tokenizer, texts, block_size=512, batch_size=4)
    attention_transfer(student, teacher, batches, steps=100)        # feature maps and encodings only
    distill_hidden_states(student, teacher, batches, steps=200)     # every weight: each layer's output

Attention transfer alone matches each layer's attention given the teacher's inputs to that layer; a student that
dropped the teacher's position table (or grew it) does not receive those inputs, so the second stage trains every
weight to reproduce the teacher's hidden states from the student's own embeddings. Both run on unlabelled text, once,
before any task; the student then reads documents of any length.
"""

import random
from collections.abc import Iterator

import torch

from ..linearize import attention_transfer_loss, transfer_parameters


def with_special_tokens(tokenizer, tokens: list[int]) -> list[int]:
    """``tokens`` between the tokenizer's classification and separator tokens (BERT's [CLS] ... [SEP], RoBERTa's
    <s> ... </s>)."""
    if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise ValueError(f"{type(tokenizer).__name__} has no cls_token / sep_token: an encoder's tokenizer is needed")
    return [tokenizer.cls_token_id, *tokens, tokenizer.sep_token_id]


def text_blocks(tokenizer, texts: list[str], block_size: int, batch_size: int, seed: int = 0) -> Iterator[dict]:
    """Endless batches of ``input_ids`` (batch_size, block_size): the texts' tokens, shuffled and concatenated,
    cut into blocks, each between the tokenizer's special tokens (``[CLS] ... [SEP]`` for BERT)."""
    rng = random.Random(seed)
    inner = block_size - 2
    if inner < 1:
        raise ValueError(f"block_size {block_size} leaves no room beside the tokenizer's special tokens")
    tokens = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    total = sum(map(len, tokens))
    if total < inner * batch_size:
        raise ValueError(f"{total} tokens of text make fewer than {batch_size} blocks of {block_size}")
    while True:
        order = rng.sample(range(len(tokens)), len(tokens))
        stream = [token for i in order for token in tokens[i]]
        blocks = [
            with_special_tokens(tokenizer, stream[start : start + inner])
            for start in range(0, len(stream) - inner + 1, inner)
        ]
        rng.shuffle(blocks)
        for start in range(0, len(blocks) - batch_size + 1, batch_size):
            yield {"input_ids": torch.tensor(blocks[start : start + batch_size])}


def train(parameters: list, loss_of_batch, batches: Iterator[dict], steps: int, learning_rate: float) -> list[float]:
    """AdamW on ``parameters`` for ``steps`` batches, the learning rate decaying linearly to 0; the losses."""
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    losses = []
    for _, batch in zip(range(steps), batches):
        loss = loss_of_batch(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def attention_transfer(
    student, teacher, batches: Iterator[dict], steps: int, learning_rate: float = 1e-2, loss: str = "output_mse"
) -> list[float]:
    """Stage 1: only the feature maps and encodings train (``attention_transfer_loss``); the losses per step."""
    parameters = transfer_parameters(student)
    if not parameters:
        return []
    teacher.eval().requires_grad_(False)
    student.train()

    def loss_of_batch(batch):
        with torch.no_grad():
            hidden_states = teacher(**batch, output_hidden_states=True).hidden_states
        return attention_transfer_loss(student, hidden_states, batch.get("attention_mask"), loss)

    return train(parameters, loss_of_batch, batches, steps, learning_rate)


def hidden_state_loss(student_states: tuple, teacher_states: tuple) -> torch.Tensor:
    """The mean over layers of the mean squared difference of each layer's output (B, N, hidden), the
    embeddings' output left out (the student's has no position table to match)."""
    pairs = list(zip(student_states[1:], teacher_states[1:], strict=True))
    return sum(torch.nn.functional.mse_loss(s, t) for s, t in pairs) / len(pairs)


def distill_hidden_states(
    student, teacher, batches: Iterator[dict], steps: int, learning_rate: float = 1e-4
) -> list[float]:
    """Stage 2: every student weight trains so that each layer's output matches the teacher's; the losses."""
    teacher.eval().requires_grad_(False)
    student.train().requires_grad_(True)

    def loss_of_batch(batch):
        with torch.no_grad():
            target = teacher(**batch, output_hidden_states=True).hidden_states
        return hidden_state_loss(student(**batch, output_hidden_states=True).hidden_states, target)

    return train([p for p in student.parameters()], loss_of_batch, batches, steps, learning_rate)
