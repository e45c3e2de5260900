"""Attention masks and default positions, the one place the models and the attention layer read them from."""

import torch


def mask_as_bool(attention_mask, batch_size: int, num_tokens: int, past: int = 0) -> torch.Tensor | None:
    """A (B, N) bool mask (True = token, False = padding) from ``attention_mask`` of shape (B, N) or, while
    decoding with ``past`` cached tokens, (B, past + N); None stays None."""
    if attention_mask is None:
        return None
    lengths = (num_tokens, past + num_tokens) if past else (num_tokens,)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or attention_mask.shape[1] not in lengths:
        expected = " or ".join(f"({batch_size}, {n})" for n in lengths)
        raise ValueError(
            f"attention_mask must have shape (batch, tokens) = {expected}{' (past + tokens)' if past else ''}, "
            f"got {tuple(attention_mask.shape)}"
        )
    return attention_mask[:, -num_tokens:].bool()


def default_position_ids(attention_mask, batch_size: int, num_tokens: int, device, past=0) -> torch.Tensor:
    """(B, N) positions that count the real tokens of each row, so left or right padding leaves the real
    tokens' positions unchanged (padding takes its neighbour's position; its outputs are zeroed anyway).

    ``attention_mask`` covers the N new tokens or, while decoding, the past and new ones (then ``past`` is
    read from it). ``past`` is the number of real tokens before, an int or a (B,) tensor.
    """
    if attention_mask is None:
        past = torch.as_tensor(past, device=device).reshape(-1, 1)
        return (past + torch.arange(num_tokens, device=device)).expand(batch_size, -1)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    if attention_mask.shape[1] == num_tokens:
        positions = positions + torch.as_tensor(past, device=device).reshape(-1, 1)
    return positions[:, -num_tokens:]


def check_position_ids(position_ids, batch_size: int, num_tokens: int, position_dims: int, device) -> torch.Tensor:
    """Integer positions (B, N, A) from ``position_ids`` of shape (B or 1, N) in 1D or (B or 1, N, 2) in 2D."""
    positions = torch.as_tensor(position_ids, device=device)
    if positions.is_floating_point():
        raise ValueError("position_ids must be integers")
    if position_dims == 1 and positions.dim() == 2:
        positions = positions[..., None]
    if positions.dim() != 3 or positions.shape[1:] != (num_tokens, position_dims):
        expected = f"(batch, {num_tokens})" if position_dims == 1 else f"(batch, {num_tokens}, 2) with (row, col)"
        raise ValueError(f"position_ids must have shape {expected}; got {tuple(position_ids.shape)}")
    return positions.expand(batch_size, -1, -1).long()
