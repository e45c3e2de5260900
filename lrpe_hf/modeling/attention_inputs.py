"""What flows down the attention path, as two records.

A model finds once per forward what all its layers read alike: a ``LayerCall`` (the documents of packed rows,
whether the positions are the consecutive defaults, the context-parallel counters, the softmax kernel). Each
``LinearAttention`` turns its own call into ``AttentionInputs`` (``attention_inputs``): the bool mask, integer
positions, the state its positions continue from and the state its path keeps, a decay's steps, the packed
documents. Its attention path (``KernelAttention``, ``SoftmaxAttention``) takes q, k, v and that record, and whether
q and k are the layer's own temporaries (``reuse_inputs``: a fact about q and k, known only once the encoding has
acted on them). A layer called on its own, without a ``LayerCall``, finds every field itself.
"""

from typing import NamedTuple

import torch

from .context_parallel import active_group, incoming_counters, refuse_packed_bidirectional_rows, refuse_unsplit_layer
from .positional_encoding import NoPositionalEncoding
from .positions import check_position_ids, default_position_ids, find_documents, position_steps


class LayerCall(NamedTuple):
    """What a model finds once per forward for every layer; the defaults let the layer find each itself.

    documents: ``find_documents(...)`` of the call's positions, (starts, documents) (B, N) each;
    consecutive: whether every row's positions are the defaults without padding (each token one past the one
        before), which a caller that made the positions knows; None: whether no positions and no padding were given;
    counters: inside ``context_parallel``, ``incoming_counters(...)`` of the call (gathered once for all layers);
    count_tokens: whether the layer advances its state's token counters (False: a model advances its layers'
        shared counters once per call, ``LinearAttentionCache.count``);
    softmax_implementation: "sdpa" or "eager", the softmax path's kernel;
    plain_positions: the call's positions (B, N, 1) where it is a plain one, which a layer may attend by its plain
        road (``LinearAttention.plain_attend``): no cache, default positions, no attention weights, no context
        parallelism; else None.
    """

    documents: tuple | None = None
    consecutive: bool | None = None
    counters: object | None = None
    count_tokens: bool = True
    softmax_implementation: str = "sdpa"
    plain_positions: torch.Tensor | None = None


class AttentionInputs(NamedTuple):
    """What an attention path reads beside q, k and v.

    mask (B, N) bool or None; positions (B, N, A) integer; encoding: the layer's positional encoding; state: the
    path's own state (causal decoding) or None; counted_state: the state the positions continue from (the layer's,
    or inside ``context_parallel`` the earlier ranks' counters), or None; count_tokens: whether ``counted_state``
    advances past these tokens; position_steps (B, N): each real token's distance from the previous real one, for
    an encoding that decays with distance, else None; starts (B, N) bool: the tokens that start a document of a
    packed row, and documents (B, N): their running count across calls (both None: one document); consecutive: the
    positions are the default ones without padding (a decay by distance is the same at every token);
    softmax_implementation: as ``LayerCall``'s.
    """

    mask: torch.Tensor | None
    positions: torch.Tensor
    encoding: torch.nn.Module
    state: object | None = None
    counted_state: object | None = None
    count_tokens: bool = True
    position_steps: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    consecutive: bool = False
    softmax_implementation: str = "sdpa"


def attention_inputs(layer, mask, position_ids, state, call: LayerCall, batch_size: int, num_tokens: int, device):
    """``layer``'s (a ``LinearAttention``) inputs for one call: mask (B, N) bool or None, the caller's position_ids
    or None, its state or None, the model's ``call``."""
    options = layer.options
    positions, counted_state, count_tokens = positions_and_state(
        layer, position_ids, mask, state, call, batch_size, num_tokens, device
    )
    starts, documents = call.documents if call.documents is not None else (None, None)
    if call.documents is None and options.position_dims == 1:  # images' 2D positions hold one document
        starts, documents = find_documents(positions, mask, counted_state, given_positions=position_ids is not None)
        cp = active_group()
        if cp is not None and not options.causal and position_ids is not None:
            refuse_packed_bidirectional_rows(starts, device, cp)
    path_state = None
    if state is not None:
        state.path = state.path if state.path is not None else layer.attention.State()
        path_state = state.path
    encoding = layer.positional_encoding
    steps = position_steps(positions, mask, counted_state) if encoding.log_decay is not None else None
    consecutive = call.consecutive if call.consecutive is not None else position_ids is None and mask is None
    return AttentionInputs(
        mask, positions, encoding, path_state, counted_state, count_tokens, steps, starts, documents,
        consecutive and options.position_dims == 1, call.softmax_implementation,
    )  # fmt: skip


def positions_and_state(layer, position_ids, mask, state, call: LayerCall, B: int, N: int, device):
    """(positions (B, N, A), the state to read counters from, whether it counts these tokens). Inside
    ``context_parallel``, this rank's slice: positions continue from the earlier ranks' tokens, as from a recurrent
    state holding their counters (gathered here where the caller has not)."""
    count_tokens = call.count_tokens
    cp = active_group()
    if cp is None:
        return positions_of(layer, position_ids, mask, state, B, N, device), state, count_tokens
    refuse_unsplit_layer(layer, state)
    given = None if position_ids is None else positions_of(layer, position_ids, mask, None, B, N, device)
    counters = call.counters
    counters = counters if counters is not None else incoming_counters(given, mask, B, N, device, cp)
    if state is None:
        state, count_tokens = counters, False  # read for positions and documents, kept by nobody
    else:  # a fresh state continues from the earlier ranks' tokens (a prefill split over the ranks)
        state.share_counters(counters)
    positions = given if given is not None else positions_of(layer, None, mask, state, B, N, device)
    return positions, state, count_tokens


def positions_of(layer, position_ids, mask, state, batch_size: int, num_tokens: int, device):
    """Integer positions (B, N, A): the given ones checked, or the defaults (counting each row's real tokens on from
    the state's count)."""
    position_dims = layer.options.position_dims
    if position_ids is not None:
        return check_position_ids(position_ids, batch_size, num_tokens, position_dims, device)
    if position_dims == 2:
        if isinstance(layer.positional_encoding, NoPositionalEncoding):
            return torch.zeros(batch_size, num_tokens, 2, dtype=torch.long, device=device)
        raise ValueError("2D positional encodings need position_ids of shape (batch, tokens, 2) with (row, col)")
    past = state.num_tokens if state is not None and state.num_tokens is not None else 0
    return default_position_ids(mask, batch_size, num_tokens, device, past)[..., None]
