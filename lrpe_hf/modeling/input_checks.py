"""The models' checks of their inputs at the entry, before anything reads them: shapes, dtypes and token ids, each
refused with a message that names the argument, what it got and what is valid (a wrong shape would otherwise fail
deep inside a layer, and an id past the vocabulary in torch's embedding)."""

import torch

from .context_parallel import active_group
from .positions import check_values


def token_embeddings(embed_tokens, input_ids, inputs_embeds, hidden_size: int, multiplier: float = 1.0):
    """The tokens' embeddings (B, N, hidden_size) times ``multiplier``, from exactly one of input_ids (B, N) integer
    ids in [0, vocab_size) and inputs_embeds (B, N, hidden_size) floating point; N at least 1."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        check_input_ids(input_ids, embed_tokens.num_embeddings)
        hidden_states = embed_tokens(input_ids)
    else:
        check_inputs_embeds(inputs_embeds, hidden_size)
        hidden_states = inputs_embeds
    return hidden_states * multiplier if multiplier != 1.0 else hidden_states


def check_input_ids(input_ids, vocab_size: int):
    """input_ids (B, N) of integers in [0, vocab_size), N at least 1. The range is checked on the CPU, where the
    check reads nothing back from a device; on a GPU the embedding's own device-side assert stops such an id."""
    integer = not (input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool)
    if input_ids.dim() != 2 or not integer:
        hint = " (one sequence: add its batch dimension, input_ids[None])" if input_ids.dim() == 1 else ""
        raise ValueError(
            f"input_ids must be a (batch, tokens) tensor of integer token ids, got shape {tuple(input_ids.shape)} "
            f"and dtype {input_ids.dtype}{hint}"
        )
    refuse_empty("input_ids", input_ids.shape)
    if not input_ids.is_cuda and not torch.compiler.is_compiling():
        check_values(
            (input_ids >= 0) & (input_ids < vocab_size),
            f"input_ids must lie in [0, {vocab_size}) (the model's vocab_size); an id outside it comes from another "
            "tokenizer than the model's, or from padding with -100",
        )


def check_inputs_embeds(inputs_embeds, hidden_size: int):
    """inputs_embeds (B, N, hidden_size) floating point, N at least 1."""
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size or not inputs_embeds.is_floating_point():
        raise ValueError(
            f"inputs_embeds must be a (batch, tokens, {hidden_size}) floating-point tensor (the model's hidden_size), "
            f"got shape {tuple(inputs_embeds.shape)} and dtype {inputs_embeds.dtype}"
        )
    refuse_empty("inputs_embeds", inputs_embeds.shape)


def check_pixel_values(pixel_values, num_channels: int, patch_size: int):
    """pixel_values (B, num_channels, H, W) floating point, H and W positive multiples of patch_size."""
    if pixel_values.dim() != 4 or pixel_values.shape[1] != num_channels or not pixel_values.is_floating_point():
        raise ValueError(
            f"pixel_values must be a (batch, {num_channels}, height, width) floating-point tensor, as the model's "
            f"image processor returns, got shape {tuple(pixel_values.shape)} and dtype {pixel_values.dtype}"
        )
    height, width = pixel_values.shape[-2:]
    if height % patch_size or width % patch_size or not height or not width:
        raise ValueError(
            f"image height and width must be positive multiples of patch_size={patch_size}, got {height}x{width}"
        )


def refuse_empty(name: str, shape):
    """A sequence of no tokens. Inside ``context_parallel`` a rank's empty slice is refused by every rank together
    (``incoming_counters``): one rank raising alone here would leave the others waiting in a collective."""
    if shape[1] == 0 and active_group() is None:
        raise ValueError(f"{name} has no tokens (shape {tuple(shape)}): a sequence needs at least one")
