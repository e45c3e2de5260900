"""The causal language-modelling loss, computed without the full-size temporaries of ``F.cross_entropy``.

``F.cross_entropy`` on (tokens, vocabulary) logits keeps its log-softmax for backward and builds two more
tensors of that size in backward; at 8k tokens and a vocabulary of 8k that is about 0.8 GB next to the logits
themselves. ``causal_lm_loss`` keeps only one float per token (the log-partition) and, in backward, writes
softmax minus one-hot into a single buffer, a block of rows at a time. Same value and gradients as Transformers'
``ForCausalLMLoss``, whose arguments it takes. Given the head's input and weight as well, it keeps neither the
logits nor their gradient for backward: it recomputes them a block of rows at a time (one more matmul of the head).
"""

import torch
from torch.nn import functional as F

ROWS_PER_BLOCK = 1024


class CrossEntropySum(torch.autograd.Function):
    """The sum over rows with ``targets != ignore_index`` of logsumexp(logits) - logits[target], in float32 (or
    float64 for float64 logits).

    logits (T, V), any float dtype (computed in that precision a block of rows at a time); targets (T,) long.
    With ``hidden`` (T, D) and ``weight`` (V, D), the logits are hidden @ weight^T (a bias-free head): backward
    then recomputes them a block of rows at a time, under the autocast state of forward, and returns the
    gradients of hidden and weight; neither the logits nor their full gradient are kept.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, hidden=None, weight=None):
        precision = torch.promote_types(logits.dtype, torch.float32)
        log_partition = torch.empty(logits.shape[0], dtype=precision, device=logits.device)
        for block in range(0, logits.shape[0], ROWS_PER_BLOCK):
            rows = slice(block, block + ROWS_PER_BLOCK)
            log_partition[rows] = torch.logsumexp(logits[rows].to(precision), dim=-1)
        kept = targets != ignore_index
        safe_targets = targets.masked_fill(~kept, 0)
        picked = logits.gather(1, safe_targets[:, None])[:, 0].to(precision)
        ctx.recompute = hidden is not None
        if ctx.recompute:
            device = logits.device.type
            ctx.autocast = device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)
            ctx.logits_dtype = logits.dtype
            ctx.save_for_backward(hidden, weight, safe_targets, kept, log_partition)
        else:
            ctx.save_for_backward(logits, safe_targets, kept, log_partition)
        return torch.where(kept, log_partition - picked, 0.0).sum()  # where, not * kept: ignored rows may be inf

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.recompute:
            return CrossEntropySum.backward_through_the_head(ctx, grad_loss)
        logits, targets, kept, log_partition = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for block in range(0, logits.shape[0], ROWS_PER_BLOCK):
            rows = slice(block, block + ROWS_PER_BLOCK)
            grad[rows] = softmax_minus_one_hot(logits[rows], targets[rows], kept[rows], log_partition[rows], grad_loss)
        return grad, None, None, None, None

    @staticmethod
    def backward_through_the_head(ctx, grad_loss):
        hidden, weight, targets, kept, log_partition = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[3] else None
        precision = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=precision) if ctx.needs_input_grad[4] else None
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for block in range(0, hidden.shape[0], ROWS_PER_BLOCK):
                rows = slice(block, block + ROWS_PER_BLOCK)
                logits = F.linear(hidden[rows], weight)
                grad = softmax_minus_one_hot(logits, targets[rows], kept[rows], log_partition[rows], grad_loss)
                grad = grad.to(ctx.logits_dtype)
                if grad_hidden is not None:
                    grad_hidden[rows] = grad @ weight.to(grad.dtype)
                if grad_weight is not None:
                    grad_weight += grad.T @ hidden[rows].to(grad.dtype)
        return None, None, None, grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None


def softmax_minus_one_hot(logits, targets, kept, log_partition, grad_loss):
    """grad_loss * (softmax(logits) - one_hot(targets)) on kept rows, 0 on the others, in the precision of
    ``log_partition``: (rows, V)."""
    probabilities = torch.exp(logits.to(log_partition.dtype) - log_partition[:, None])
    probabilities.scatter_add_(1, targets[:, None], -torch.ones_like(probabilities[:, :1]))
    return torch.where(kept[:, None], probabilities * grad_loss, 0.0)


def causal_lm_loss(
    logits,
    labels,
    vocab_size,
    num_items_in_batch=None,
    ignore_index=-100,
    shift_labels=None,
    hidden=None,
    weight=None,
    **kwargs,
):
    """logits (B, N, V); labels (B, N), shifted here so that position n predicts n + 1 (or ``shift_labels`` given
    already shifted). Mean over the counted tokens, or their sum over ``num_items_in_batch`` (gradient
    accumulation, as the Trainer passes it). With the head's input ``hidden`` (B, N, D) and ``weight`` (V, D)
    (logits = hidden @ weight^T), backward recomputes the logits in blocks instead of keeping them."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    if torch.compiler.is_compiling():  # the plain loss, which the compiler differentiates and fuses
        flat = logits.reshape(-1, vocab_size).float()
        total = F.cross_entropy(flat, targets, ignore_index=ignore_index, reduction="sum")
    else:
        hidden = hidden.reshape(-1, hidden.shape[-1]) if hidden is not None else None
        total = CrossEntropySum.apply(logits.reshape(-1, vocab_size), targets, ignore_index, hidden, weight)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()  # the mean; of no token, nan (as F.cross_entropy)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
