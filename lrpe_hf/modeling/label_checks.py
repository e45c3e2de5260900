"""Checks of the labels a head takes, made before its loss: a wrong dtype or shape gets a message that names the
head, what it takes and what it got, instead of torch's error from inside the loss."""

import torch


def check_token_labels(labels, batch_size: int, num_tokens: int, head: str, what: str = "token ids"):
    """labels (B, N) integer ``what``, -100 where no loss is wanted: one per input token."""
    if labels is None:
        return
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"{head} takes labels as integer {what} (-100 where no loss is wanted), got {labels.dtype}")
    if tuple(labels.shape) != (batch_size, num_tokens):
        raise ValueError(
            f"{head} takes one label per input token, labels of shape (batch, tokens) = ({batch_size}, {num_tokens}); "
            f"got {tuple(labels.shape)}"
        )


def check_sequence_labels(labels, batch_size: int, head: str):
    """labels (B,) class ids or regression targets, or (B, num_labels) multi-hot floats: one row per example."""
    if labels is None:
        return
    if labels.dim() not in (1, 2) or labels.shape[0] != batch_size:
        raise ValueError(
            f"{head} takes one label per example, labels of shape ({batch_size},) or ({batch_size}, num_labels); got "
            f"{tuple(labels.shape)}"
        )
