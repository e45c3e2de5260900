"""The interface every positional encoding implements, and shared helpers.

An encoding can act at up to four places of the attention computation (shapes per head, B batch, H heads,
N tokens, D head dim, m feature dim). Every hook defaults to "does nothing", so a subclass overrides only
what it changes:

- ``encode_query_key(q, k, positions, shared_draw)``: before the feature map (SPE). (B,H,N,D) -> (B,H,N,D').
  ``shared_draw`` is the draw of the module a model shares across its layers (see ``build_shared`` in the
  registry), or None.
- ``encode_features(q, k, positions)``: after the feature map, the same transform for queries and keys
  (rope, lrpe_*, permute). (B,H,N,m) -> (B,H,N,m'); position tables built once for both. It must be linear in
  the features: the features of padded keys are 0 and must stay 0, so that they add nothing to any sum.
  ``encode_stacked(x, positions)``, optional: the same transform of q and k stacked along the heads, x
  (B,2H,N,m), queries' heads first: one op for both where ``encode_features`` takes two (a decoding step's cost on
  a GPU is its launches). An encoding that overrides it is handed a decoding step's features that way.
- ``log_decay``: a per-head log decay per unit of position, ``(H,)`` or ``None`` (PermuteFormer's causal r):
  the weight of key t at query s is multiplied by exp(log_decay (p_s - p_t)).
- ``value_bias(values, key_positions, query_positions, causal, key_documents, query_documents)``: an additive
  ``W V`` term (FastRPB); in a packed row a query sees the values of its own document only.

``positions`` are integer tensors of shape (B, N, A) with A = 1 (sequences) or 2 (row, col of image patches).
Packed rows hold several documents: a token whose position is not past the previous token's starts a new
one; the layer keeps every sum inside its document, so an encoding needs no extra care (only ``value_bias``
receives the documents).
Encodings register with ``lrpe_hf.register_positional_encoding`` (see ``registry.py``).
"""

import math

import torch

from .kept_tensors import KeptForInput, KeptUntilChanged
from .reinitialisable import Reinitialisable


class PositionalEncoding(Reinitialisable):
    """Base class: the identity at every hook. A subclass with parameters or buffers gives their values in
    ``initial_values()`` (so that a model built on the meta device can re-create them)."""

    # Whether ``encode_query_key`` saves q and k themselves for backward. In training with joined projections the
    # layer then leaves v a view of the joined output, whose q and k columns stay alive anyway (else it copies v).
    keeps_query_key = False

    def encode_query_key(self, q, k, positions, shared_draw=None):
        return q, k

    def encode_features(self, q, k, positions):
        return q, k

    def encode_stacked(self, x, positions):
        """``encode_features`` of q and k stacked along the heads: x (B, 2H, N, m), the queries' H heads first,
        the keys' after them; see ``stacks_features``."""
        q, k = x.chunk(2, dim=1)
        return torch.cat(self.encode_features(q, k, positions), dim=1)

    @property
    def stacks_features(self) -> bool:
        """Whether this encoding overrides ``encode_stacked`` (the layer then hands it a decoding step's queries
        and keys as one tensor)."""
        return type(self).encode_stacked is not PositionalEncoding.encode_stacked

    @property
    def log_decay(self) -> torch.Tensor | None:
        return None

    def value_bias(self, values, key_positions, query_positions, causal, key_documents=None, query_documents=None):
        """W V at the queries, (B, H, N, d), for an encoding that adds one; see ``has_value_bias``."""
        return None

    @property
    def has_value_bias(self) -> bool:
        """Whether this encoding overrides ``value_bias`` (the layer then keeps the past values when decoding)."""
        return type(self).value_bias is not PositionalEncoding.value_bias

    # The reference: each hook's formula written apart from it, explicit and in float64, to which the tests hold
    # every registered encoding (an O(N^2) sweep). An encoding that overrides a hook gives its reference too.

    def reference_transform(self, head: int, position: tuple, width: int) -> torch.Tensor:
        """M_p (width, width) complex128 of one head at one position (its coordinates): ``encode_features``' form,
        the features becoming M_p phi. The base's: the identity."""
        refuse_a_missing_reference(self, "encode_features", "reference_transform")
        return torch.eye(width, dtype=torch.complex128)

    def reference_decay(self, head: int) -> float:
        """r of one head: key t's weight at query s is multiplied by r^(p_s - p_t) (causal), ``log_decay``'s form.
        The base's: 1."""
        refuse_a_missing_reference(self, "log_decay", "reference_decay")
        return 1.0

    def reference_query_key(self, x, positions: list, head: int, shared_draw, is_query: bool) -> torch.Tensor:
        """One head's queries (``is_query``) or keys x (N, D) float64 at ``positions`` (N coordinate tuples) ->
        (N, D'): ``encode_query_key``'s form. The base's: x."""
        refuse_a_missing_reference(self, "encode_query_key", "reference_query_key")
        return x

    def reference_value_bias(self, values, positions: list, mask, head: int, causal: bool) -> torch.Tensor | None:
        """``value_bias``' form at every query of one head, (N, d) float64, from its values (N, d), positions (N
        coordinate tuples) and mask (N,) bool; None where the encoding adds no bias (the base)."""
        refuse_a_missing_reference(self, "value_bias", "reference_value_bias")
        return None


def refuse_a_missing_reference(encoding: PositionalEncoding, hook: str, reference: str):
    """Raises where ``encoding`` overrides ``hook`` but not its ``reference``."""
    overrides = getattr(type(encoding), hook) is not getattr(PositionalEncoding, hook)
    if overrides and getattr(type(encoding), reference) is getattr(PositionalEncoding, reference):
        raise NotImplementedError(f"{type(encoding).__name__} overrides {hook} but gives no {reference}")


def reference_rotation(angles: torch.Tensor, width: int) -> torch.Tensor:
    """Block-diagonal 2x2 rotations by ``angles`` (P,) of pairs (0, 1), (2, 3), ..., the identity on the rest of
    ``width``: (width, width) float64, for references."""
    matrix = torch.eye(width, dtype=torch.float64)
    for i, angle in enumerate(angles.tolist()):
        c, s = math.cos(angle), math.sin(angle)
        matrix[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    return matrix


def reference_permutation(permutation: list) -> torch.Tensor:
    """The matrix P of (P x)_i = x[pi(i)] (P[i, pi(i)] = 1), float64, for references."""
    n = len(permutation)
    matrix = torch.zeros(n, n, dtype=torch.float64)
    matrix[torch.arange(n), torch.as_tensor(permutation)] = 1.0
    return matrix


class NoPositionalEncoding(PositionalEncoding):
    """``positional_encoding="none"``: content-only attention (NoPE, or absolute embeddings added to inputs)."""

    def encode_stacked(self, x, positions):
        return x


def axis_of_each(num_units: int, position_dims: int) -> torch.Tensor:
    """Which position axis drives each of ``num_units`` feature units: all axis 0 in 1D; in 2D the first
    half follows the row, the second half the column. Returns a (num_units,) long tensor."""
    counts = units_per_axis(num_units, position_dims)
    return torch.tensor([a for a, count in enumerate(counts) for _ in range(count)], dtype=torch.long)


def units_per_axis(num_units: int, position_dims: int) -> list[int]:
    """How many units each axis drives: [n] in 1D, [ceil(n/2), floor(n/2)] in 2D. Plain integers, so that
    modules can be built on the meta device (as ``from_pretrained`` does)."""
    return [num_units] if position_dims == 1 else [(num_units + 1) // 2, num_units // 2]


def token_blocks(num_tokens: int, elements_per_token: int, block_elements: int) -> list[slice]:
    """Slices of consecutive tokens, within ``num_tokens``, holding about ``block_elements`` elements each (at
    least one token): the blocks the positional transforms work in, small enough for a CPU's caches and for the
    allocator's reused memory. Compiled, one block of every token (the compiler plans the memory, and a slice
    cannot hold a symbolic length)."""
    if torch.compiler.is_compiling():
        return [slice(None)]
    step = max(1, block_elements // max(1, elements_per_token))  # an empty batch holds no elements
    return [slice(start, min(start + step, num_tokens)) for start in range(0, num_tokens, step)]


def distinct_rows(positions: torch.Tensor) -> torch.Tensor:
    """``positions[:1]`` when the batch rows are one row expanded (a model's default positions without padding, or
    positions given as one row for every row), else ``positions``: position tables are then built once and broadcast
    over the batch. Known from the tensor's strides alone: rows that merely hold the same values are not compared,
    since on a GPU the comparison would be a read on the host (a sync) in every layer."""
    if positions.shape[0] > 1 and positions.stride(0) == 0:
        return positions[:1]
    return positions


def turn_rates(frequencies: torch.Tensor) -> torch.Tensor:
    """Frequencies (H, U) in turns per unit of position, float64 (H, 1, U): what ``unit_angles`` multiplies the
    positions by."""
    return frequencies[:, None].to(torch.float64) / (2 * math.pi)


def radian_rates(frequencies: torch.Tensor) -> torch.Tensor:
    """Frequencies (H, U) in radians per unit of position, float64 (H, 1, U): the rates of a decoding step's
    rotation (``positional_rope.rotate_few``)."""
    return frequencies[:, None].to(torch.float64)


class CachedRates:
    """``convert(frequencies)`` (``turn_rates`` by default) of a module's frequencies where no gradient is wanted
    (decoding, evaluation), computed once and again only after the frequencies change (their tensor or its
    version); None where one is wanted."""

    def __init__(self, convert=turn_rates):
        self.convert, self.kept = convert, KeptUntilChanged()

    def __call__(self, frequencies: torch.Tensor) -> torch.Tensor | None:
        if torch.is_grad_enabled() and frequencies.requires_grad or torch.compiler.is_compiling():
            return None
        return self.kept.get((frequencies,), lambda: self.convert(frequencies))


def unit_coordinates(positions: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """The integer position that drives each unit, (B', 1, N, U) (B' from distinct_rows; in 1D (B', 1, N, 1), the one
    axis broadcasting over the units): what the frequencies multiply (a product with float64 converts the integers
    exactly)."""
    coordinates = distinct_rows(positions)  # (B', N, A)
    if coordinates.shape[-1] > 1:
        coordinates = coordinates[..., axis]  # (B', N, U)
    return coordinates[:, None]


TURN_COORDINATES = KeptForInput()  # the positions over 2 pi: made by a forward pass's first layer for all layers


def turn_coordinates(positions: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """``unit_coordinates`` over 2 pi, float64 (B', 1, N, U or 1): times frequencies in radians per unit of position,
    the angles in turns, in one product per layer (exact but for its one rounding: float32 frequencies convert
    exactly). In 1D made once for all layers from their shared positions (``TURN_COORDINATES``)."""

    def derive():
        return unit_coordinates(positions, axis).to(torch.float64).div_(2 * math.pi)

    return TURN_COORDINATES.get(positions, "turns", derive) if positions.shape[-1] == 1 else derive()


def unit_angles(positions: torch.Tensor, frequencies: torch.Tensor, axis: torch.Tensor, dtype, rates=None):
    """position * frequency for every (head, unit), reduced to less than one turn: (B', H, N, U), B' from
    distinct_rows; negative where position * frequency is.

    positions (B, N, A) int, frequencies (H, U), axis (U,); ``rates``: ``turn_rates(frequencies)`` where the caller
    keeps them (fixed frequencies), else the frequencies multiply the ``turn_coordinates``. The angle is formed in
    turns and reduced in float64, so that large positions stay exact, and returned in ``dtype`` (at least float32).
    (The fractional part of the turns took a quarter of the time of ``torch.remainder`` by 2 pi on a CPU.)
    """
    if rates is None:
        return reduced_angles(turn_coordinates(positions, axis) * frequencies[:, None], dtype)
    return reduced_angles(unit_coordinates(positions, axis) * rates, dtype)


def reduced_angles(turns: torch.Tensor, dtype, negated: bool = False) -> torch.Tensor:
    """Angles in turns (float64) reduced to less than one turn, in radians of ``dtype`` (at least float32); their
    negatives with ``negated`` (the sign taken in the same product)."""
    turns = turns.frac_()
    dtype = torch.promote_types(dtype, torch.float32)
    radians = -2 * math.pi if negated else 2 * math.pi
    if torch.compiler.is_compiling() or turns.requires_grad:  # (out= takes no gradient)
        return turns.mul_(radians).to(dtype)
    return torch.mul(turns, radians, out=turns.new_empty(turns.shape, dtype=dtype))  # rounded once, as .to()


def angle_blocks(positions, frequencies, rates, axis, dtype, shape, block_elements, negated=False):
    """``(tokens, unit_angles(positions[:, tokens], ...))`` for consecutive blocks of the tokens of features of
    ``shape`` (B, H, N, width), each holding about ``block_elements`` feature elements, from the frequencies (H, U)
    or their ``turn_rates`` (H, 1, U) where the caller keeps them; the angles' negatives with ``negated``. On a CPU,
    the angles of a rotation made and used a block at a time, so that neither they nor the float64 turns behind
    them are made whole and a block's passes stay in cache. On an accelerator one block: there each block costs
    kernel launches."""
    rows = distinct_rows(positions)
    B, H, N, width = shape
    blocks = token_blocks(N, B * H * width, block_elements) if positions.is_cpu else [slice(None)]
    if rates is None:  # the turn coordinates made whole (one row of positions, small), each block a slice of them
        coordinates = turn_coordinates(rows, axis)
        for tokens in blocks:
            yield tokens, reduced_angles(coordinates[:, :, tokens] * frequencies[:, None], dtype, negated)
        return
    for tokens in blocks:
        yield tokens, reduced_angles(unit_coordinates(rows[:, tokens], axis) * rates, dtype, negated)


def new_angle_gradient(like: torch.Tensor, num_units: int, dtype) -> torch.Tensor:
    """An empty (B, H, N, U) tensor for the angles' gradient of features ``like`` (B, H, N, ·), stored heads
    outermost (H, B, N, U): ``frequency_gradient`` reads each head's (row, token) pairs as one matrix. Compiled,
    contiguous (a compiled graph writes no ``out=`` into a non-contiguous view; the compiler lays it out)."""
    B, H, N = like.shape[:3]
    if torch.compiler.is_compiling():
        return like.new_empty(B, H, N, num_units, dtype=dtype)
    return like.new_empty(H, B, N, num_units, dtype=dtype).transpose(0, 1)


FLOAT_POSITIONS = KeptForInput()  # the positions as floats, made by the first layer's backward for all layers


def frequency_gradient(grad_angles: torch.Tensor, positions: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """The gradient of the frequencies (H, U) of ``unit_angles`` from that of its angles (B, H, N, U): for each unit,
    the sum over rows and tokens of the position along the unit's axis times the angle's gradient (the reduction to
    less than one turn has derivative one). One product per head over every (row, token) at once: the positions
    (B, N, A) as floats (A, B N), made once for every layer (``FLOAT_POSITIONS``), and the angles' gradient read in
    place where it is stored heads outermost (``new_angle_gradient``); one axis takes no gather."""
    B, H, N, U = grad_angles.shape
    wide = torch.promote_types(grad_angles.dtype, torch.float32)
    coordinates = FLOAT_POSITIONS.get(positions, wide, lambda: positions.to(wide).permute(2, 0, 1).reshape(-1, B * N))
    per_head = grad_angles.to(wide).transpose(0, 1).reshape(H, B * N, U)  # a view where stored heads outermost
    per_axis = torch.bmm(coordinates.expand(H, -1, -1), per_head)  # (H, A, U)
    if per_axis.shape[1] == 1:  # one position axis: every unit follows it
        return per_axis[:, 0]
    return per_axis.gather(1, axis.expand(per_axis.shape[0], 1, -1)).squeeze(1)
