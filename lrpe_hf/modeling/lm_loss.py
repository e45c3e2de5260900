"""The causal language-modelling loss, computed without the full-size temporaries of ``F.cross_entropy``.

``F.cross_entropy`` on (tokens, vocabulary) logits keeps its log-softmax for backward and builds two more
tensors of that size in backward; at 8k tokens and a vocabulary of 8k that is about 0.8 GB next to the logits
themselves. ``causal_lm_loss`` keeps only one float per token (the log-partition) and, in backward, writes
softmax minus one-hot into a single buffer, a block of rows at a time. Same value and gradients as Transformers'
``ForCausalLMLoss``, whose arguments it takes.
"""

import torch
from torch.nn import functional as F

ROWS_PER_BLOCK = 1024


class CrossEntropySum(torch.autograd.Function):
    """The sum over rows with ``targets != ignore_index`` of logsumexp(logits) - logits[target], in float32.

    logits (T, V), any float dtype (computed in float32 a block of rows at a time); targets (T,) long.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        log_partition = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for block in range(0, logits.shape[0], ROWS_PER_BLOCK):
            rows = slice(block, block + ROWS_PER_BLOCK)
            log_partition[rows] = torch.logsumexp(logits[rows].float(), dim=-1)
        kept = targets != ignore_index
        safe_targets = targets.masked_fill(~kept, 0)
        picked = logits.gather(1, safe_targets[:, None])[:, 0].float()
        ctx.save_for_backward(logits, safe_targets, kept, log_partition)
        return torch.where(kept, log_partition - picked, 0.0).sum()  # where, not * kept: ignored rows may be inf

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, kept, log_partition = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for block in range(0, logits.shape[0], ROWS_PER_BLOCK):
            rows = slice(block, block + ROWS_PER_BLOCK)
            probabilities = torch.exp(logits[rows].float() - log_partition[rows, None])
            probabilities.scatter_add_(1, targets[rows, None], -torch.ones_like(probabilities[:, :1]))
            grad[rows] = torch.where(kept[rows, None], probabilities * grad_loss, 0.0)
        return grad, None, None


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
    """logits (B, N, V); labels (B, N), shifted here so that position n predicts n + 1 (or ``shift_labels`` given
    already shifted). Mean over the counted tokens, or their sum over ``num_items_in_batch`` (gradient
    accumulation, as the Trainer passes it)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    total = CrossEntropySum.apply(logits.reshape(-1, vocab_size), targets, ignore_index)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()  # the mean; of no token, nan (as F.cross_entropy)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
