"""LRPE (Qin et al.): W_s = P^H Lambda(s) P, applied as Lambda(s) P to phi(q) and phi(k).

The trailing P^H of W_s cancels in (W_s q)^H (W_t k) (eq. 75), so each feature vector is multiplied by
Lambda(s) P only. Three solutions for Lambda(s):

- unitary (Type 1, eq. 22): diag(exp(i s alpha)). Re(q^H k) = [Re q, Im q] . [Re k, Im k], so the complex
  feature is stored as the real vector [y cos(s alpha), y sin(s alpha)] of twice the width.
- orthogonal (Type 2, eq. 23): block-diagonal 2x2 rotations with learnable (or fixed) angles, initialised
  like RoPE (q = 0 identity block).
- permutation (Type 3, eq. 24): P_pi^s with a fixed random permutation pi per head.

P is per head and comes from the P-matrix registry (``lrpe_p_matrix``): identity, Householder
(I - 2 v v^T / v^T v, v fixed or learnable), the odd/even permutation of eq. 74, or the orthonormal DCT-II (a
real stand-in for the Fourier P of Appendix D).
Angles are initialised to 10000^(-2i/m) as in Appendix D.
"""

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from .gradients import wants_gradient
from .kept_tensors import KeptUntilChanged
from .positional_encoding import (
    CachedRates,
    PositionalEncoding,
    angle_blocks,
    axis_of_each,
    frequency_gradient,
    new_angle_gradient,
    radian_rates,
    reference_permutation,
    unit_angles,
    unit_coordinates,
    units_per_axis,
)
from .positional_permute import PermutePositionalEncoding
from .positional_rope import RotaryPositionalEncoding, few_angles, learnable_angle_dtype, rotary_frequencies
from .reinitialisable import Reinitialisable


class HouseholderReflection(Reinitialisable):
    """x -> x - 2 (v . x) v / |v|^2 with one random unit v per head (eq. 73)."""

    def __init__(self, num_heads: int, dim: int, learnable: bool = False):
        super().__init__()
        self.num_heads, self.dim = num_heads, dim
        self.register_initial_values(trainable={"vector": learnable})
        self.kept_units = KeptUntilChanged()

    def initial_values(self):
        vector = torch.randn(self.num_heads, self.dim)
        return {"vector": vector / vector.norm(dim=-1, keepdim=True)}

    def forward(self, x):  # (B, H, N, m)
        return self.pair(x)[0]

    def reference(self, head, width):
        v = self.vector[head].detach().double()
        return torch.eye(width, dtype=torch.float64) - 2 * torch.outer(v, v) / (v @ v)

    def unit_vectors(self, copies: int = 1):
        """The vectors normalised (H, m), repeated ``copies`` times along the heads: for a fixed vector, once, again
        only after it changes."""
        vector = self.vector

        def units():
            unit = F.normalize(vector, dim=-1, eps=1e-6)
            return unit if copies == 1 else unit.repeat(copies, 1)

        if wants_gradient(vector) or torch.compiler.is_compiling():
            return units()
        return self.kept_units.get((vector,), units, key=copies)

    def pair(self, *xs):
        """Each of xs (B, H, N, m) reflected, the unit vectors normalised once for all."""
        v = self.unit_vectors().to(xs[0].dtype)[:, None, :]  # (H, 1, m)
        fixed = not wants_gradient(v)
        return tuple(FixedReflection.apply(x, v) if fixed and wants_gradient(x) else reflect(x, v) for x in xs)

    def stacked(self, x):
        """q and k stacked along the heads, x (B, 2H, N, m), reflected without gradient: by the vectors repeated
        for the keys' heads (kept), so the product takes no broadcast copy of them."""
        return reflect(x, self.unit_vectors(copies=2).to(x.dtype)[:, None, :])


def apply_p(p, q, k):
    """P applied to q and k: in one call where P has one for both (``pair``), so that what it derives from its
    parameters is made once."""
    pair = getattr(p, "pair", None)
    return pair(q, k) if pair is not None else (p(q), p(k))


def apply_p_stacked(p, x):
    """P applied to q and k stacked along the heads, x (B, 2H, N, m): by P's own ``stacked`` where it has one,
    else as to a batch of 2B rows of H heads (what any P takes)."""
    stacked = getattr(p, "stacked", None)
    if stacked is not None:
        return stacked(x)
    B, H = x.shape[0], x.shape[1] // 2
    return p(x.reshape(2 * B, H, *x.shape[2:])).reshape(B, 2 * H, *x.shape[2:])


def reflect(x, v):
    """x - 2 (x . v) v: x (B, H, N, m), a unit v (H, 1, m) per head."""
    return torch.addcmul(x, head_dots(x, v), v, value=-2.0)


def head_dots(x, v):
    """x . v with each head's own v (H, 1, m): (B, H, N, 1). One batched product over the heads, each taking all its
    rows at once where x's rows of a head lie evenly spaced (x stored tokens first, as the layers lay it out, or one
    row): x is read in place. Otherwise matmul, which copies x into heads-first batches and v for each row."""
    B, H, N, m = x.shape
    per_head = x.transpose(0, 1)  # (H, B, N, m)
    if per_head.stride(1) == N * per_head.stride(2) or B == 1:
        dots = torch.bmm(per_head.reshape(H, B * N, m), v.transpose(-1, -2))  # a view: no copy
        return dots.view(H, B, N, 1).transpose(0, 1)
    return x @ v.transpose(-1, -2)


class FixedReflection(torch.autograd.Function):
    """``reflect`` by a v that takes no gradient. I - 2 v v^T is symmetric, so backward reflects the gradient the
    same way: nothing is saved but v, and no full-size temporary is made."""

    @staticmethod
    def forward(ctx, x, v):
        ctx.save_for_backward(v)
        return reflect(x, v)

    @staticmethod
    def backward(ctx, grad):
        (v,) = ctx.saved_tensors
        return reflect(grad, v), None


class OddEvenPermutation(Reinitialisable):
    """Eq. 74: y[2k] = x[k], y[2k+1] = x[ceil(m/2) + k], the same for every head."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.register_initial_values()

    def initial_values(self):
        index = torch.arange(self.dim)
        source = torch.where(index % 2 == 0, index // 2, (index - 1) // 2 + (self.dim - self.dim // 2))
        return {"source": source}

    def forward(self, x):
        return x[..., self.source]

    def reference(self, head, width):
        half = width - width // 2
        return reference_permutation([i // 2 if i % 2 == 0 else half + (i - 1) // 2 for i in range(width)])


class DCTMatrix(Reinitialisable):
    """The orthonormal DCT-II matrix, a real orthogonal P: y[k] = sum_n C[k, n] x[n],
    C[k, n] = sqrt(2/m) cos(pi (2n + 1) k / (2m)), row 0 scaled by 1/sqrt(2)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.register_initial_values()

    def initial_values(self):
        m = self.dim
        rows = [
            [math.sqrt((1 if k == 0 else 2) / m) * math.cos(math.pi * (2 * n + 1) * k / (2 * m)) for n in range(m)]
            for k in range(m)
        ]
        return {"matrix": torch.tensor(rows, dtype=torch.float32)}

    def forward(self, x):
        return x @ self.matrix.to(x.dtype).T

    def reference(self, head, width):
        k, n = torch.arange(width, dtype=torch.float64)[:, None], torch.arange(width, dtype=torch.float64)[None, :]
        scale = torch.full((width, 1), math.sqrt(2 / width), dtype=torch.float64)
        scale[0] = math.sqrt(1 / width)
        return scale * torch.cos(math.pi * (2 * n + 1) * k / (2 * width))


def reference_p(p: nn.Module, head: int, width: int) -> torch.Tensor:
    """One head's P (width, width) float64 from its formula (the P matrix's ``reference``; the identity's own)."""
    return torch.eye(width, dtype=torch.float64) if isinstance(p, nn.Identity) else p.reference(head, width)


class LRPEUnitary(PositionalEncoding):
    """Type 1 (eq. 22): Lambda(s) = diag(exp(i s alpha)), as a real vector of twice the width."""

    def __init__(self, num_heads, feature_dim, p: nn.Module, position_dims=1, learnable_angles=True, base=10000.0):
        super().__init__()
        self.p = p
        self.num_heads, self.feature_dim, self.position_dims, self.base = num_heads, feature_dim, position_dims, base
        self.learnable_angles = learnable_angles
        self.register_initial_values(trainable={"angles": learnable_angles})
        self.turn_rates, self.radian_rates = CachedRates(), CachedRates(radian_rates)

    def initial_values(self):
        # One angle per feature dimension: alpha_i = base^(-2i/m) over each axis's share of the dimensions.
        angles = rotary_frequencies(self.feature_dim, self.base**2, self.position_dims).repeat(self.num_heads, 1)
        if self.learnable_angles:  # float64 in a model built in float64
            angles = angles.to(learnable_angle_dtype())
        return {"angles": angles, "axis": axis_of_each(self.feature_dim, self.position_dims)}

    @classmethod
    def from_options(cls, options, num_heads, head_dim, feature_dim, p):
        o = options
        return cls(num_heads, feature_dim, p, o.position_dims, o.lrpe_learnable_angles, o.rope_base)

    def encode_features(self, q, k, positions):
        q, k = apply_p(self.p, q, k)
        if wants_gradient(q, k, self.angles) and not torch.compiler.is_compiling():  # compiled: plain, fused ops
            return UnitaryLift.apply(q, k, positions, self.angles, self.axis, self.turn_rates(self.angles))
        if few_angles(positions, self.angles):
            cos, sin = self.few_cos_sin(positions)
            return tuple(lift_into(x, cos, sin, new_with_width(x, 2 * x.shape[-1])) for x in (q, k))
        return lift(q, k, unit_angles(positions, self.angles, self.axis, q.dtype, self.turn_rates(self.angles)))

    def encode_stacked(self, x, positions):
        """q and k stacked along the heads, x (B, 2H, N, m) -> (B, 2H, N, 2m): P once, and each of cos and sin
        multiplies both halves in one product, written into its half of the output (no concatenation)."""
        if wants_gradient(x, self.angles) or not few_angles(positions, self.angles):
            return super().encode_stacked(x, positions)
        cos, sin = (t[:, None] for t in self.few_cos_sin(positions))  # (B', 1, H, N, m)
        pairs = apply_p_stacked(self.p, x).unflatten(1, (2, -1))  # (B, 2, H, N, m): queries, then keys
        lifted = lift_into(pairs, cos, sin, pairs.new_empty(*pairs.shape[:-1], 2 * pairs.shape[-1]))
        return lifted.flatten(1, 2)

    def reference_transform(self, head, position, width):
        """diag(exp(i p alpha)) P, each feature's angle from its axis's coordinate (eq. 22)."""
        units = units_per_axis(width, self.position_dims)
        coordinates = torch.tensor([position[a] for a, n in enumerate(units) for _ in range(n)], dtype=torch.float64)
        lambda_p = torch.diag(torch.exp(1j * coordinates * self.angles[head].detach().double()))
        return lambda_p @ reference_p(self.p, head, width).to(torch.complex128)

    def few_cos_sin(self, positions):
        """cos and sin (B', H, N, m), float64, of a decoding step's few angles position * alpha, formed in float64
        from the kept radian rates and left unreduced (as ``positional_rope.few_factors``): three ops where the
        angles reduced in turns took five, and each product with them is rounded once into the features' dtype."""
        angles = unit_coordinates(positions, self.axis) * self.radian_rates(self.angles)
        return angles.cos(), angles.sin()


def new_with_width(x, width: int) -> torch.Tensor:
    """A new tensor of x's shape (..., m) but ``width`` wide, its dims laid out in x's order (x stored tokens first
    gives a tensor stored tokens first, which fla's kernels and the key sums read in place)."""
    order = sorted(range(x.dim() - 1), key=x.stride, reverse=True)  # outermost first
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return x.new_empty(*(x.shape[d] for d in order), width).permute(*inverse, -1)


def lift(q, k, angles):
    """[x cos, x sin] for x = q and k: (B, H, N, m) -> (B, H, N, 2m), with ``angles`` (B', H, N, m). Plain ops
    (autograd and the compiler take them)."""
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    return torch.cat([q * cos, q * sin], dim=-1), torch.cat([k * cos, k * sin], dim=-1)


def lift_into(x, cos, sin, out):
    """[x cos, x sin] written into ``out`` (..., 2m), each product into its half (no concatenation), for x (..., m);
    without gradient."""
    m = x.shape[-1]
    torch.mul(x, cos, out=out[..., :m])
    torch.mul(x, sin, out=out[..., m:])
    return out


class UnitaryLift(torch.autograd.Function):
    """[x cos, x sin] for x = q and k, (B, H, N, m) -> (B, H, N, 2m), with the angles position * alpha
    (``unit_angles`` of positions (B, N, A), alpha (H, m), axis (m,)). Saves the outputs (the attention keeps them
    anyway) and the positions: backward recomputes the angles, needs x only through the outputs, and turns the
    angles' gradient sum grad_sin * y_cos - grad_cos * y_sin into alpha's (``frequency_gradient``). ``rates``:
    ``turn_rates(alpha)`` where the caller keeps them (fixed angles), else None: alpha multiplies the positions'
    ``turn_coordinates``, made by the first layer for all.

    Both directions work a block of tokens at a time, writing each product into its place in the output: the
    block's cos, sin and products stay in cache, and no full-size temporary (nor the concatenation) is made."""

    BLOCK_ELEMENTS = 1 << 18  # elements of x in one block (1 MB in float32)

    @staticmethod
    def forward(ctx, q, k, positions, alpha, axis, rates):
        m = alpha.shape[-1]
        lifted = [new_with_width(x, 2 * m) for x in (q, k)]
        alpha = alpha.detach()
        blocks = angle_blocks(positions, alpha, rates, axis, q.dtype, q.shape, UnitaryLift.BLOCK_ELEMENTS)
        for tokens, angles in blocks:
            cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
            for x, y in zip((q, k), lifted):
                lift_into(x[:, :, tokens], cos, sin, y[:, :, tokens])
        ctx.save_for_backward(*lifted, positions, alpha, axis, rates)
        return tuple(lifted)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        *lifted, positions, alpha, axis, rates = ctx.saved_tensors
        m, dtype = alpha.shape[-1], lifted[0].dtype
        grads = [None if g is None else new_with_width(y, m) for y, g in zip(lifted, (grad_q, grad_k))]
        terms = [(y, g, grad_x) for y, g, grad_x in zip(lifted, (grad_q, grad_k), grads) if g is not None]
        want_alpha = ctx.needs_input_grad[3]
        grad_angles = new_angle_gradient(lifted[0], m, lifted[0].dtype) if want_alpha else None
        shape = terms[0][2].shape
        for tokens, angles in angle_blocks(positions, alpha, rates, axis, dtype, shape, UnitaryLift.BLOCK_ELEMENTS):
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            for index, (y, grad, grad_x) in enumerate(terms):
                grad_cos, grad_sin = grad[:, :, tokens, :m], grad[:, :, tokens, m:]
                torch.mul(grad_cos, cos, out=grad_x[:, :, tokens]).addcmul_(grad_sin, sin)
                if want_alpha:  # y_cos = x cos, y_sin = x sin: d/d angle = (-y_sin, y_cos)
                    along_cos, along_sin = y[:, :, tokens, :m], y[:, :, tokens, m:]
                    slope = grad_angles[:, :, tokens]
                    if index == 0:
                        torch.mul(grad_sin, along_cos, out=slope)
                    else:
                        slope.addcmul_(grad_sin, along_cos)
                    slope.addcmul_(grad_cos, along_sin, value=-1)
        grad_alpha = frequency_gradient(grad_angles, positions, axis).to(alpha.dtype) if want_alpha else None
        return *grads, None, grad_alpha, None, None


class LRPEOrthogonal(PositionalEncoding):
    """Type 2 (eq. 23): Lambda(s) = block-diagonal 2x2 rotations by s theta_i, theta learnable."""

    def __init__(self, num_heads, feature_dim, p: nn.Module, position_dims=1, learnable_angles=True, base=10000.0):
        super().__init__()
        self.p = p
        self.rotation = RotaryPositionalEncoding(num_heads, feature_dim, base, position_dims, learnable_angles)

    @classmethod
    def from_options(cls, options, num_heads, head_dim, feature_dim, p):
        o = options
        return cls(num_heads, feature_dim, p, o.position_dims, o.lrpe_learnable_angles, o.rope_base)

    def encode_features(self, q, k, positions):
        return self.rotation.encode_features(*apply_p(self.p, q, k), positions)

    def reference_transform(self, head, position, width):
        rotation = self.rotation.reference_transform(head, position, width)
        return rotation @ reference_p(self.p, head, width).to(torch.complex128)

    def encode_stacked(self, x, positions):
        return self.rotation.encode_stacked(apply_p_stacked(self.p, x), positions)


class LRPEPermutation(PositionalEncoding):
    """Type 3 (eq. 24): Lambda(s) = P_pi^s, a fixed random permutation pi per head."""

    def __init__(self, num_heads, feature_dim, p: nn.Module, position_dims=1, seed=0):
        super().__init__()
        self.p = p
        self.permutation = PermutePositionalEncoding(num_heads, feature_dim, position_dims, causal=False, seed=seed)

    @classmethod
    def from_options(cls, options, num_heads, head_dim, feature_dim, p):
        return cls(num_heads, feature_dim, p, options.position_dims, options.permute_seed * 1000 + options.layer_index)

    def encode_features(self, q, k, positions):
        return self.permutation.encode_features(*apply_p(self.p, q, k), positions)

    def reference_transform(self, head, position, width):
        permutation = self.permutation.reference_transform(head, position, width)
        return permutation @ reference_p(self.p, head, width).to(torch.complex128)

    def encode_stacked(self, x, positions):
        return self.permutation.encode_stacked(apply_p_stacked(self.p, x), positions)
