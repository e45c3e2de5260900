"""RoPE in its linear-attention form (RoFormer eq. 19): rotate phi(q) and phi(k) by position.

Feature pairs (2i, 2i+1) are rotated by the angle s * theta_i with theta_i = base^(-2i/m). In 2D the first
half of the pairs follows the row and the second half the column, each half with its own frequency ladder.
"""

import torch

from .positional_encoding import PositionalEncoding, axis_of_each, unit_cos_sin, units_per_axis


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` (..., m) by angles given as ``cos``, ``sin`` (..., P), P <= m // 2;
    the remaining features pass through. Each pair is a complex number multiplied by exp(i angle)."""
    num_pairs = cos.shape[-1]
    pairs, rest = x[..., : 2 * num_pairs], x[..., 2 * num_pairs :]
    if x.dtype in (torch.float32, torch.float64):  # complex multiply: half the passes of the real form
        as_complex = torch.view_as_complex(pairs.unflatten(-1, (num_pairs, 2)).contiguous())
        rotated = torch.view_as_real(as_complex * torch.complex(cos, sin)).flatten(-2)
    else:  # half precision has no complex kernels on every device
        even, odd = pairs[..., 0::2], pairs[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


def rotary_frequencies(num_units: int, base: float, position_dims: int) -> torch.Tensor:
    """theta_i = base^(-2i/m) per unit, a separate ladder for each position axis. Returns (num_units,)."""
    ladder = [base ** (-i / units) for units in units_per_axis(num_units, position_dims) for i in range(units)]
    return torch.tensor(ladder, dtype=torch.float32)


class RotaryPositionalEncoding(PositionalEncoding):
    """Block-diagonal 2x2 rotations R_s of the features. ``learnable`` turns the angles into parameters
    (LRPE's orthogonal solution); otherwise they are RoPE's fixed ladder."""

    def __init__(
        self, num_heads: int, feature_dim: int, base: float = 10000.0, position_dims: int = 1, learnable: bool = False
    ):
        super().__init__()
        self.num_heads, self.num_pairs, self.base, self.position_dims = num_heads, feature_dim // 2, base, position_dims
        self.register_initial_values(trainable={"frequencies": True} if learnable else {})

    def initial_values(self):
        frequencies = rotary_frequencies(self.num_pairs, self.base, self.position_dims).repeat(self.num_heads, 1)
        return {"frequencies": frequencies, "axis": axis_of_each(self.num_pairs, self.position_dims)}

    @classmethod
    def from_options(cls, options, num_heads, head_dim, feature_dim):
        return cls(num_heads, feature_dim, options.rope_base, options.position_dims)

    def encode_features(self, q, k, positions):
        cos, sin = unit_cos_sin(positions, self.frequencies, self.axis, q.dtype)
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
