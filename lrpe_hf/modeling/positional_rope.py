"""RoPE in its linear-attention form (RoFormer eq. 19): rotate phi(q) and phi(k) by position.

Feature pairs (2i, 2i+1) are rotated by the angle s * theta_i with theta_i = base^(-2i/m). In 2D the first
half of the pairs follows the row and the second half the column, each half with its own frequency ladder.
"""

import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .gradients import wants_gradient
from .kept_tensors import KeptForInput, KeptUntilChanged, kept_tensor
from .positional_encoding import (
    CachedRates,
    PositionalEncoding,
    angle_blocks,
    axis_of_each,
    frequency_gradient,
    new_angle_gradient,
    radian_rates,
    reference_rotation,
    turn_rates,
    unit_angles,
    unit_coordinates,
    units_per_axis,
)

COMPLEX_READY = (torch.float32, torch.float64)  # dtypes read as complex pairs in place; half precision is upcast


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` (..., m) by angles given as ``cos``, ``sin`` (..., P), P <= m // 2;
    the remaining features pass through. The real form, under ``torch.compile`` (which fuses it; complex ops would
    not be); everywhere else the complex product of ``multiply_pairs``."""
    num_pairs = cos.shape[-1]
    pairs, rest = x[..., : 2 * num_pairs], x[..., 2 * num_pairs :]
    even, odd = pairs[..., 0::2], pairs[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


def as_pairs(x: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """The first ``num_pairs`` pairs of x (..., m) as complex numbers (..., P): a view where the layout of x
    allows one (pairs adjacent, every other stride and the offset even), else a copy (always under
    ``torch.compile``, which fuses it). Half precision is read as complex64, through a float32 copy."""
    if x.dtype not in COMPLEX_READY:
        x = x.float()
    pairs = (x if 2 * num_pairs == x.shape[-1] else x[..., : 2 * num_pairs]).unflatten(-1, (num_pairs, 2))
    if torch.compiler.is_compiling() or not viewable_as_complex(pairs):
        pairs = pairs.contiguous()
    return torch.view_as_complex(pairs)


def viewable_as_complex(pairs: torch.Tensor) -> bool:
    """Whether ``torch.view_as_complex`` accepts ``pairs`` (..., 2) as it is."""
    # every other stride even: their greatest common divisor is (gcd() of none is 0)
    return pairs.stride(-1) == 1 and pairs.storage_offset() % 2 == 0 and math.gcd(*pairs.stride()[:-1]) % 2 == 0


def multiply_pairs(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., m) with its first P pairs read as complex numbers and multiplied by ``factor`` (..., P) complex;
    written into ``out`` (x's shape) if given (through a copy while compiling: a compiled graph takes no complex
    views of an output). Half precision: the product in float32 (or the factor's precision), rounded once into
    x's dtype: three ops (upcast, product, rounding copy) where the real form takes seven, and no rounding of the
    cosines and sines to half precision."""
    num_pairs = factor.shape[-1]
    if x.dtype not in COMPLEX_READY:
        rotated = multiply_pairs(x.float(), factor)
        return rotated.to(x.dtype) if out is None else out.copy_(rotated)
    if out is not None:
        target = out[..., : 2 * num_pairs].unflatten(-1, (num_pairs, 2))
        if torch.compiler.is_compiling() or not viewable_as_complex(target):
            return out.copy_(multiply_pairs(x, factor))
        torch.mul(as_pairs(x, num_pairs), factor, out=torch.view_as_complex(target))
        if 2 * num_pairs < x.shape[-1]:
            out[..., 2 * num_pairs :] = x[..., 2 * num_pairs :]
        return out
    rotated = torch.view_as_real(as_pairs(x, num_pairs) * factor).flatten(-2)
    if 2 * num_pairs == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., 2 * num_pairs :]], dim=-1)


FEW_ANGLES = 1 << 12  # below this (a decoding step), exp(i angle) takes one op (polar), not three
CPU_POLAR_ANGLES = FEW_ANGLES  # on a CPU, polar below this many angles only; elsewhere polar at every size


def polar_one(angles: torch.Tensor) -> torch.Tensor:
    """exp(i angles) by one op (``torch.polar``), complex of ``angles``' precision; its modulus, a 0-dim one, is
    made once per dtype and device (``kept_tensor``)."""
    one = kept_tensor("one", angles, lambda: torch.ones((), dtype=angles.dtype, device=angles.device))
    return torch.polar(one, angles)


def unit_factors(angles: torch.Tensor, dtype) -> torch.Tensor:
    """exp(i angles) as the complex dtype that multiplies features of ``dtype``: one op (``torch.polar``) off the CPU
    and for a CPU's few angles (a decoding step's), else three (cos, sin and their pairing), which a CPU runs six
    times faster (1.9 ms against 11 ms for 1M angles). Compiled, the three, which the compiler fuses."""
    complex_dtype = torch.promote_types(dtype, torch.complex64)
    if not torch.compiler.is_compiling() and not angles.requires_grad:
        if not angles.is_cpu or angles.numel() < CPU_POLAR_ANGLES:
            return polar_one(angles).to(complex_dtype)
    return torch.complex(angles.cos(), angles.sin()).to(complex_dtype)


def few_angles(positions: torch.Tensor, theta: torch.Tensor) -> bool:
    """Whether the rotation of these positions (B, N, A) has few angles (a decoding step's), outside compilation:
    counted for every row (no host read to find the distinct ones)."""
    return positions.shape[0] * positions.shape[1] * theta.numel() < FEW_ANGLES and not torch.compiler.is_compiling()


def rotate_few(q, k, positions, theta, axis, radians=None):
    """The pair rotation of q and k for few angles, without gradient: the angles
    position * theta formed in float64 and left unreduced (float64's cos and sin reduce them; at position 10^6 the
    product's rounding is about 10^-10 radians), exp(i angle) in complex128 by one polar, and each product rounded
    once into the features' dtype. Four ops where ``unit_angles`` and ``rotate_by_angles`` take six: the step's
    cost on a GPU is its launches. ``radians``: ``radian_rates(theta)`` where the caller keeps them."""
    factor = few_factors(positions, theta, axis, radians)
    return tuple(multiply_pairs(x, factor, out=torch.empty_like(x)) for x in (q, k))


def rotate_stacked(x, factor):
    """q and k stacked along the heads, x (B, 2H, N, m) (the queries' heads first), rotated by ``factor``
    (B', H or 1, N, P) complex, without gradient: one product for both, rounded once into x's dtype."""
    pairs = x.unflatten(1, (2, -1))  # (B, 2, H, N, m)
    return multiply_pairs(pairs, factor[:, None], out=torch.empty_like(pairs)).flatten(1, 2)


def few_factors(positions, theta, axis, radians=None):
    """exp(i position * theta) (B', H, N, P), complex128, for a decoding step's few angles: the angles formed in
    float64 from the radian rates (``radian_rates(theta)``, or ``radians`` where the caller keeps them) and left
    unreduced, one ``torch.polar``."""
    radians = radian_rates(theta) if radians is None else radians
    return polar_one(unit_coordinates(positions, axis) * radians)


def rotate_by_angles(q, k, angles):
    """The pair rotation of q and k by the same ``angles``, in complex arithmetic."""
    factor = unit_factors(angles, q.dtype)
    return multiply_pairs(q, factor), multiply_pairs(k, factor)


def real_parts(y: torch.Tensor, g: torch.Tensor, num_pairs: int, dtype):
    """The real and imaginary parts of the first ``num_pairs`` pairs of y and g (..., m), views in ``dtype`` (half
    precision upcast once): real arithmetic on them takes no conjugate (a product with ``conj()`` of a tensor
    copies it first, a hidden launch)."""
    y, g = (x[..., : 2 * num_pairs].to(dtype) for x in (y, g))
    return y[..., 0::2], y[..., 1::2], g[..., 0::2], g[..., 1::2]


class RotateQueriesAndKeys(torch.autograd.Function):
    """The pair rotation of q and k (any float dtype) by the angles position * theta (``unit_angles`` of
    positions (B, N, A), theta (H, P), axis (P,)), saving only the rotated outputs (the attention saves them too)
    and the positions: backward recomputes the angles, turns the gradient back by -angle, and gives theta's
    gradient from the angles', Im(conj(y) grad) for each rotated pair y (``frequency_gradient``). ``rates``:
    ``turn_rates(theta)`` where the caller keeps them (fixed frequencies), else None: theta multiplies the positions'
    ``turn_coordinates``, made by the first layer for all.

    Both directions work a block of tokens at a time (``angle_blocks``): the block's angles, factors and products
    stay in cache, and each result is written into its place in the output, which keeps its input's layout."""

    BLOCK_ELEMENTS = 1 << 18  # feature elements of one block (1 MB in float32)

    @staticmethod
    def forward(ctx, q, k, positions, theta, axis, rates):
        rotated = [torch.empty_like(x) for x in (q, k)]
        theta = theta.detach()
        blocks = angle_blocks(positions, theta, rates, axis, q.dtype, q.shape, RotateQueriesAndKeys.BLOCK_ELEMENTS)
        for tokens, angles in blocks:
            factor = unit_factors(angles, q.dtype)
            for x, y in zip((q, k), rotated):
                multiply_pairs(x[:, :, tokens], factor, out=y[:, :, tokens])
        ctx.save_for_backward(*rotated, positions, theta, axis, rates)
        return tuple(rotated)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        *rotated, positions, theta, axis, rates = ctx.saved_tensors
        num_pairs, dtype = theta.shape[-1], rotated[0].dtype
        grads = [None if g is None else torch.empty_like(g) for g in (grad_q, grad_k)]
        terms = [(y, g, grad_x) for y, g, grad_x in zip(rotated, (grad_q, grad_k), grads) if g is not None]
        want_theta = ctx.needs_input_grad[3]
        wide = torch.promote_types(dtype, torch.float32)  # the angles' gradient, as the product, at least float32
        grad_angles = new_angle_gradient(rotated[0], num_pairs, wide) if want_theta else None
        shape = terms[0][2].shape
        blocks = angle_blocks(
            positions, theta, rates, axis, dtype, shape, RotateQueriesAndKeys.BLOCK_ELEMENTS, negated=True
        )
        for tokens, negated_angles in blocks:
            inverse = unit_factors(negated_angles, dtype)  # the rotation is orthogonal: its transpose turns back
            for index, (y, grad, grad_x) in enumerate(terms):
                block = grad[:, :, tokens]
                multiply_pairs(block, inverse, out=grad_x[:, :, tokens])
                if want_theta:  # d y / d angle = i y: the angle's gradient is Im(conj(y) grad) = y_re g_im - y_im g_re
                    y_re, y_im, g_re, g_im = real_parts(y[:, :, tokens], block, num_pairs, wide)
                    slope = grad_angles[:, :, tokens]
                    if index == 0:
                        torch.mul(y_re, g_im, out=slope)
                    else:
                        slope.addcmul_(y_re, g_im)
                    slope.addcmul_(y_im, g_re, value=-1.0)
        grad_theta = None
        if want_theta:
            grad_theta = frequency_gradient(grad_angles, positions, axis).to(theta.dtype)
        return *grads, None, grad_theta, None, None


class RotateByFactor(torch.autograd.Function):
    """The pair rotation of q and k (B, H, N, m) by a factor exp(i angle) (B', H or 1, N, P) complex that wants no
    gradient (fixed frequencies), given with its conjugate for backward: nothing else is saved and no angle is
    recomputed. The layers of a model share both (``shared_factors``)."""

    @staticmethod
    def forward(ctx, q, k, factor, inverse):
        ctx.save_for_backward(inverse)
        return tuple(multiply_pairs(x, factor, out=torch.empty_like(x)) for x in (q, k))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        (inverse,) = ctx.saved_tensors  # the rotation is orthogonal: its transpose turns back
        grads = [None if g is None else multiply_pairs(g, inverse, out=torch.empty_like(g)) for g in (grad_q, grad_k)]
        return *grads, None, None


class FixedRates(NamedTuple):
    """The rates of RoPE's ladder of frequencies, float64 (1, 1, U), in turns and in radians per unit of position
    (one row: every head has the same ladder), with their axes (U,). ``key`` names the ladder: layers with the same
    one share their rotations' factors."""

    turns: torch.Tensor
    radians: torch.Tensor
    axis: torch.Tensor
    key: tuple


def ladder_rates(num_units: int, base: float, position_dims: int, axis: torch.Tensor, like: torch.Tensor):
    """The ``FixedRates`` of the ladder ``rotary_frequencies(num_units, base, position_dims)`` in ``like``'s dtype
    (its values as a buffer of that dtype holds them) and on its device, made once (``kept_tensor``)."""
    name = f"rope ladder {num_units} {base} {position_dims}"

    def ladder():
        return rotary_frequencies(num_units, base, position_dims)[None].to(like.dtype).to(like.device)

    turns = kept_tensor(f"{name} turns", like, lambda: turn_rates(ladder()))
    radians = kept_tensor(f"{name} radians", like, lambda: radian_rates(ladder()))
    return FixedRates(turns, radians, axis, (name, like.dtype, like.device))


SHARED_FACTORS = KeptForInput()  # the last positions' factors: made by a model's first layer, taken by the others


def shared_factors(positions, rates: FixedRates, dtype, few: bool, inverse: bool):
    """(exp(i position * theta) (B', H or 1, N, U), its conjugate or None) for features of ``dtype``: made by the
    first layer that rotates these positions (B, N, A) and taken by the other layers with the same frequencies. The
    conjugate only with ``inverse`` (for backward). ``few``: a decoding step's few angles, complex128 formed from the
    radian rates and left unreduced (``few_factors``), else ``unit_angles``' factors."""

    def derive():
        if few:
            return few_factors(positions, None, rates.axis, rates.radians), None
        factor = unit_factors(unit_angles(positions, None, rates.axis, dtype, rates.turns), dtype)
        return factor, factor.conj_physical() if inverse else None

    return SHARED_FACTORS.get(positions, (rates.key, dtype, few, inverse), derive)


def rotate_by_fixed(q, k, positions, rates: FixedRates, few: bool):
    """q and k (B, H, N, m) rotated by fixed frequencies' ``shared_factors``, each product rounded once into their
    dtype; through ``RotateByFactor`` where a gradient is wanted. ``few``: a decoding step's few angles."""
    if wants_gradient(q, k):
        return RotateByFactor.apply(q, k, *shared_factors(positions, rates, q.dtype, few=False, inverse=True))
    factor, _ = shared_factors(positions, rates, q.dtype, few, inverse=False)
    return tuple(multiply_pairs(x, factor, out=torch.empty_like(x)) for x in (q, k))


def rotate_queries_and_keys(q, k, positions, theta, axis, rates=None, radians=None):
    """q and k (B, H, N, m) with their feature pairs rotated by the angles position * theta (positions (B, N, A),
    theta (H, P), axis (P,) the position axis of each pair; ``rates`` and ``radians``: theta's ``turn_rates`` and
    ``radian_rates`` where the caller keeps them): through ``RotateQueriesAndKeys`` where a gradient is wanted,
    ``rotate_few`` for a decoding step's few angles, else ``rotate_by_angles``, all as complex products (half
    precision in float32, rounded once); in the real form (``rotate_pairs``) under ``torch.compile``, whose code
    generation takes no complex operators (inductor falls back to eager ones for them, warning), and for q and k of
    different dtypes."""
    if k.dtype != q.dtype or torch.compiler.is_compiling():
        angles = unit_angles(positions, theta, axis, q.dtype, rates)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
    if wants_gradient(q, k, theta):
        return RotateQueriesAndKeys.apply(q, k, positions, theta, axis, rates)
    if few_angles(positions, theta):
        return rotate_few(q, k, positions, theta, axis, radians)
    return rotate_by_angles(q, k, unit_angles(positions, theta, axis, q.dtype, rates))


def rotary_frequencies(num_units: int, base: float, position_dims: int) -> torch.Tensor:
    """theta_i = base^(-2i/m) per unit, a separate ladder for each position axis. Returns (num_units,)."""
    ladder = [base ** (-i / units) for units in units_per_axis(num_units, position_dims) for i in range(units)]
    return torch.tensor(ladder, dtype=torch.float32)


def learnable_angle_dtype() -> torch.dtype:
    """The dtype LRPE's learnable angles are made in (holding the ladder's float32 values): torch's default dtype
    where it is wider than float32, so that a model built in float64 (``from_config(..., dtype=torch.float64)``,
    ``from_pretrained``, or under ``torch.set_default_dtype``) holds them and takes their gradients in float64, as
    every other parameter (float32 angles would round each gradient, and each context-parallel rank's share of it,
    to float32); else float32, so that a half-precision build keeps them in float32."""
    return torch.promote_types(torch.get_default_dtype(), torch.float32)


class RotaryPositionalEncoding(PositionalEncoding):
    """Block-diagonal 2x2 rotations R_s of the features. ``learnable`` turns the angles into parameters
    (LRPE's orthogonal solution); otherwise they are RoPE's fixed ladder, whose rotation of a forward pass's
    positions every layer shares (``shared_factors``)."""

    def __init__(
        self, num_heads: int, feature_dim: int, base: float = 10000.0, position_dims: int = 1, learnable: bool = False
    ):
        super().__init__()
        self.num_heads, self.num_pairs, self.base, self.position_dims = num_heads, feature_dim // 2, base, position_dims
        self.learnable = learnable
        self.register_initial_values(trainable={"frequencies": True} if learnable else {})
        self.turn_rates, self.radian_rates = CachedRates(), CachedRates(radian_rates)
        self.kept_ladder_check = KeptUntilChanged()

    def initial_values(self):
        frequencies = rotary_frequencies(self.num_pairs, self.base, self.position_dims).repeat(self.num_heads, 1)
        if self.learnable:  # fixed ones stay RoPE's float32 ladder (``fixed_rates``)
            frequencies = frequencies.to(learnable_angle_dtype())
        return {"frequencies": frequencies, "axis": axis_of_each(self.num_pairs, self.position_dims)}

    @classmethod
    def from_options(cls, options, num_heads, head_dim, feature_dim):
        return cls(num_heads, feature_dim, options.rope_base, options.position_dims)

    def fixed_rates(self) -> FixedRates | None:
        """The ladder's ``FixedRates`` where the frequencies are fixed (no gradient: RoPE's) and hold the ladder, one
        row repeated for every head (a buffer made from it, not saved with the model: checked once per change, on
        the host); None otherwise (learnable or overwritten frequencies: each layer rotates by its own), and while
        compiling (the compiler fuses the factors' derivation into each layer). A shape-only (fake) run reads no
        values: its buffer was made from the ladder."""
        frequencies = self.frequencies
        if frequencies.requires_grad or torch.compiler.is_compiling():
            return None
        if type(frequencies) is torch.Tensor and not self.kept_ladder_check.get((frequencies,), self.holds_ladder):
            return None
        return ladder_rates(self.num_pairs, self.base, self.position_dims, self.axis, frequencies)

    def holds_ladder(self) -> bool:
        ladder = rotary_frequencies(self.num_pairs, self.base, self.position_dims).to(self.frequencies)
        return torch.equal(self.frequencies, ladder.expand_as(self.frequencies))

    def encode_features(self, q, k, positions):
        fixed = self.fixed_rates() if k.dtype == q.dtype else None
        if fixed is not None:
            return rotate_by_fixed(q, k, positions, fixed, few_angles(positions, self.frequencies))
        rates = self.turn_rates(self.frequencies)
        radians = self.radian_rates(self.frequencies)
        return rotate_queries_and_keys(q, k, positions, self.frequencies, self.axis, rates, radians)

    def reference_transform(self, head, position, width):
        """Pair i turned by p theta_i (the row's or the column's coordinate in 2D), theta_i = base^(-2i/m) over each
        axis's pairs (RoFormer), or the learned angles of LRPE's orthogonal solution."""
        units = units_per_axis(width // 2, self.position_dims)
        if self.learnable:
            theta = self.frequencies[head].detach().double()
        else:
            ladder = [self.base ** (-2 * i / (2 * n)) for n in units for i in range(n)]
            theta = torch.tensor(ladder, dtype=torch.float64)
        coordinates = torch.tensor([position[a] for a, n in enumerate(units) for _ in range(n)], dtype=torch.float64)
        return reference_rotation(coordinates * theta, width).to(torch.complex128)

    def encode_stacked(self, x, positions):
        if wants_gradient(x, self.frequencies) or not few_angles(positions, self.frequencies):
            return super().encode_stacked(x, positions)
        fixed = self.fixed_rates()
        if fixed is not None:
            factor, _ = shared_factors(positions, fixed, x.dtype, few=True, inverse=False)
        else:
            factor = few_factors(positions, self.frequencies, self.axis, self.radian_rates(self.frequencies))
        return rotate_stacked(x, factor)
