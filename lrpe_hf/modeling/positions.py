"""Attention masks and default positions, the one place the models and the attention layer read them from."""

import torch
from torch.nn import functional as F

from .kept_tensors import KeptForInput

# packed rows: how many documents a row holds at most, for each tensor of document starts (read once by the model, on
# the host, with whether any token starts a document; the layers' bidirectional products take it from here)
DOCUMENT_COUNTS = KeptForInput()


def check_values(condition: torch.Tensor, message: str):
    """Raise ``ValueError(message)`` unless the bool tensor ``condition`` holds everywhere. Compiled or on a GPU, the
    check runs on the device (``torch._assert_async``: a RuntimeError on a CPU, a device-side assert on a GPU)
    without reading a value back, which would break the graph or wait for the device."""
    if torch.compiler.is_compiling() or condition.is_cuda:
        torch._assert_async(condition.all(), message)
    elif not bool(condition.all()):
        raise ValueError(message)


def mask_as_bool(attention_mask, batch_size: int, num_tokens: int, past: int | None = 0) -> torch.Tensor | None:
    """A (B, N) bool mask (True = token, False = padding) from ``attention_mask`` of shape (B, N) or, while
    decoding with ``past`` cached tokens, (B, past + N), holding 1 (or True) for tokens and 0 for padding; None
    stays None. ``past=None``: a cached count not known here (a compiled decoding step), so any length from N up
    is accepted (``check_mask_against_cache`` checks its past then)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool:
        check_values(
            (attention_mask == 0) | (attention_mask == 1),
            "attention_mask must hold 1 for tokens and 0 for padding; it holds other values. Soft (fractional) and "
            "additive (0 / -inf) masks are not supported",
        )
    length = attention_mask.shape[-1]
    if past is None:
        fits, expected = length >= num_tokens, f"({batch_size}, {num_tokens} or more)"
    else:
        lengths = (num_tokens, past + num_tokens) if past else (num_tokens,)
        fits = length in lengths
        expected = " or ".join(f"({batch_size}, {n})" for n in lengths) + (" (past + tokens)" if past else "")
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or not fits:
        raise ValueError(
            f"attention_mask must have shape (batch, tokens) = {expected}, got {tuple(attention_mask.shape)}"
        )
    return attention_mask[:, -num_tokens:].bool()


def check_mask_against_cache(attention_mask, num_tokens: int, real_past):
    """The check of ``mask_as_bool`` for a compiled decoding step, which cannot read the cache's count: a mask
    longer than the N new tokens must hold, before them, as many real tokens per row as the cache has seen
    (``real_past`` (B,), None before any), since positions are counted from it. A failure raises from the device
    (``torch._assert_async``)."""
    if attention_mask is None or attention_mask.shape[1] == num_tokens:
        return
    seen = attention_mask[:, :-num_tokens].long().sum(-1)
    expected = real_past if real_past is not None else torch.zeros_like(seen)
    matches = (seen == expected).all()
    torch._assert_async(matches, "attention_mask's past tokens do not match the cache's: pass (batch, past + tokens)")


def default_position_ids(attention_mask, batch_size: int, num_tokens: int, device, past=0) -> torch.Tensor:
    """(B, N) positions that count the real tokens of each row, so left or right padding leaves the real
    tokens' positions unchanged (padding takes its neighbour's position; its outputs are zeroed anyway).

    ``attention_mask`` covers the N new tokens or, while decoding, the past and new ones (then ``past`` is
    read from it). ``past`` is the number of real tokens before, an int or a (B,) tensor. An int is added as a
    number: a tensor made from it would be a copy from the host, which on a GPU waits for the queued kernels.
    """
    if isinstance(past, torch.Tensor):
        past = past.reshape(-1, 1)
    if attention_mask is None:
        if not isinstance(past, torch.Tensor):  # one row for every row (the layers see its stride: ``distinct_rows``)
            return torch.arange(past, past + num_tokens, device=device).expand(batch_size, -1)
        return (past + torch.arange(num_tokens, device=device)).expand(batch_size, -1)
    real_so_far = attention_mask.long().cumsum(-1)
    if attention_mask.shape[1] == num_tokens:  # padding before a row's first real token here takes the last before
        real_so_far = real_so_far + past
    return (real_so_far - 1).clamp_min(0)[:, -num_tokens:]


def given_position_ids(position_ids, batch_size: int, num_tokens: int):
    """A model's ``position_ids`` as (B or 1, N): (N,) (GPT-2 and RoBERTa take it) stands for every row. They count
    tokens from 0: negative ones are refused, and so is any other shape, saying which fit."""
    if position_ids is None:
        return None
    position_ids = torch.as_tensor(position_ids)
    shape = tuple(position_ids.shape)
    if shape not in ((num_tokens,), (1, num_tokens), (batch_size, num_tokens)):
        raise ValueError(
            f"position_ids must have shape (batch, tokens) = ({batch_size}, {num_tokens}), (1, {num_tokens}) or "
            f"({num_tokens},) for these inputs; got {shape}"
        )
    check_values(position_ids >= 0, "position_ids must be 0 or more (positions count from 0)")
    return position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids


def first_real_tokens(attention_mask, batch_size: int, num_tokens: int, device) -> torch.Tensor:
    """(B,) the index of each row's first real token, wherever padding stands (0 without a mask)."""
    if attention_mask is None:
        return torch.zeros(batch_size, dtype=torch.long, device=device)
    return attention_mask[:, -num_tokens:].bool().long().argmax(-1)


def last_real_tokens(attention_mask, input_ids, pad_token_id, batch_size: int, num_tokens: int, device):
    """(B,) the index of each row's last real token: the last position of ``attention_mask``, else the last token
    that is not ``pad_token_id`` (transformers' convention), else the last token."""
    positions = torch.arange(num_tokens, device=device)
    if attention_mask is not None:
        return (attention_mask[:, -num_tokens:].bool() * positions).argmax(-1)
    if input_ids is not None and pad_token_id is not None:
        return ((input_ids != pad_token_id) * positions).argmax(-1)
    return torch.full((batch_size,), num_tokens - 1, device=device)


def check_position_ids(position_ids, batch_size: int, num_tokens: int, position_dims: int, device) -> torch.Tensor:
    """Integer positions (B, N, A) from ``position_ids`` of shape (B or 1, N) or (N,) in 1D (GPT-2 and RoBERTa take
    both), (B or 1, N, 2) or (N, 2) in 2D."""
    positions = torch.as_tensor(position_ids, device=device)
    if positions.is_floating_point():
        raise ValueError("position_ids must be integers")
    if positions.dim() == position_dims:  # one row of positions for every row of the batch
        positions = positions.unsqueeze(0)
    if position_dims == 1 and positions.dim() == 2:
        positions = positions[..., None]
    if positions.dim() != 3 or positions.shape[1:] != (num_tokens, position_dims):
        expected = (
            f"(batch, {num_tokens}) or ({num_tokens},)"
            if position_dims == 1
            else f"(batch, {num_tokens}, 2) or ({num_tokens}, 2) with (row, col)"
        )
        raise ValueError(f"position_ids must have shape {expected}; got {tuple(position_ids.shape)}")
    return positions.expand(batch_size, -1, -1).long()


def find_documents(positions, mask, state=None, given_positions=True):
    """(starts, documents) as ``packed_documents`` returns them. Only given positions can restart, and default ones
    that follow given ones (in ``state``) can fall back: those are searched. Positions that were never given only
    grow, so no token starts a document and there is nothing to search (a data-dependent branch, which a compiled
    decoding step cannot take). Records in ``state`` that positions were given."""
    if state is not None and given_positions:
        state.given_positions = True
    if given_positions or (state is not None and state.given_positions):
        return packed_documents(positions, mask, state)
    if state is None:
        return None, None
    B, N = positions.shape[:2]
    current = state.document if state.document is not None else positions.new_zeros(B)
    return None, current[:, None].expand(B, N)


def packed_documents(positions, mask, state=None):
    """The documents of packed rows (1D): a real token whose position is not greater than the previous real
    token's (in this call, or the state's last one) starts a new document.

    positions (B, N, 1); mask (B, N) bool or None; state: a ``LinearAttentionState`` or None. Returns (starts,
    documents): the starting tokens (B, N) bool, None if none starts, and every token's document (B, N) counted
    across calls, None for unpacked rows without a state.
    """
    p = positions[..., 0]
    real = mask if mask is not None else torch.ones_like(p, dtype=torch.bool)
    previous, has_previous = previous_real_positions(positions, mask, state)
    starts = real & has_previous & (p <= previous)
    count = document_count(starts)
    any_start = count is None or count > 1
    if state is None:
        return (starts, starts.long().cumsum(-1)) if any_start else (None, None)
    base = state.document if state.document is not None else torch.zeros_like(p[:, 0])
    return (starts if any_start else None), base[:, None] + starts.long().cumsum(-1)


def document_count(starts: torch.Tensor) -> int | None:
    """The most documents a row holds: one more than its tokens that start one (starts (B, N) bool). Read on the
    host once per starts tensor (``DOCUMENT_COUNTS``); the first read is the model's, when it finds the documents.
    None while compiling, where nothing is read back (the products then take every row as packed)."""
    if torch.compiler.is_compiling():
        return None
    return DOCUMENT_COUNTS.get(starts, "documents", lambda: int(starts.sum(-1).max()) + 1 if starts.numel() else 1)


def previous_real_positions(positions, mask, state=None):
    """Each token's previous real token's position (B, N), in this call or the state's last one, and whether it
    has one (B, N) bool. positions (B, N, A) (the first axis is read); mask (B, N) bool or None; state: a
    ``LinearAttentionState`` or None."""
    B, N = positions.shape[:2]
    p = positions[..., 0]
    real = mask if mask is not None else torch.ones_like(p, dtype=torch.bool)
    index = torch.arange(N, device=p.device).expand(B, N).masked_fill(~real, -1)
    previous_index = F.pad(index.cummax(-1).values, (1, 0), value=-1)[:, :-1]
    previous = p.gather(-1, previous_index.clamp_min(0))
    has_previous = previous_index >= 0
    if state is not None and state.num_tokens is not None:
        previous = torch.where(has_previous, previous, state.last_position[:, None])
        has_previous = has_previous | (state.num_tokens[:, None] > 0)
    return previous, has_previous


def position_steps(positions, mask, state=None):
    """How far each real token lies from the previous real token, p_t - p_prev >= 0 (B, N); 0 for padding and for
    a row's first real token: what a decay by distance advances by at each token, so that padding, wherever it
    stands and whatever position it was given, decays nothing. Arguments as ``previous_real_positions``."""
    p = positions[..., 0]
    if mask is None and (state is None or state.num_tokens is None):  # every token real, no earlier call
        return (p - torch.cat([p[:, :1], p[:, :-1]], dim=-1)).clamp_min(0)
    if mask is None:  # every token real, after an earlier call (decoding): each follows the one before it
        last = state.last_position[:, None]
        previous = last if p.shape[1] == 1 else torch.cat([last, p[:, :-1]], dim=-1)
        steps = (p - previous).clamp_min_(0)
        steps[:, :1].masked_fill_(state.num_tokens[:, None] == 0, 0)  # no real token yet: nothing to step from
        return steps
    previous, has_previous = previous_real_positions(positions, mask, state)
    return (p - previous).clamp_min(0).masked_fill(~(has_previous & mask), 0)
