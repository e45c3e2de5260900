"""Absolute position embeddings added to the token (or patch) embeddings: the baselines of the papers.

Both take integer positions (B, N) or (B, N, 2) and return (B, N, hidden_size). In 2D the first half of the
embedding encodes the row and the second half the column.

Scale. Vaswani et al. and fairseq add unit-amplitude sinusoids to token embeddings of std 1 (initialised at std
d^-1/2, multiplied by sqrt(d)). Hugging Face models initialise token embeddings at std ``initializer_range`` (0.02),
where unit sinusoids would drown the tokens (measured: perplexity 1,245 against 290 without them). So the sinusoids
here have the amplitude of the token embeddings at initialisation, ``initializer_range * embedding_multiplier``,
which keeps the papers' ratio of position to token in every setup.
"""

import math

import torch
from torch import nn


def sinusoidal_table(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Vaswani et al.: [sin(p w_i), cos(p w_i)] with w_i = 10000^(-2i/dim). positions (...) -> (..., dim)."""
    half = dim // 2
    frequencies = torch.exp(
        -math.log(10000.0) * torch.arange(half, dtype=torch.float64, device=positions.device) / half
    )
    angles = positions.to(torch.float64)[..., None] * frequencies
    table = torch.cat([angles.sin(), angles.cos()], dim=-1)
    if dim % 2:
        table = torch.cat([table, torch.zeros_like(table[..., :1])], dim=-1)
    return table.float()


class SinusoidalPositionEmbedding(nn.Module):
    """Fixed sinusoids of any position (no maximum length), of amplitude ``scale`` (see the module docstring)."""

    def __init__(self, hidden_size: int, position_dims: int = 1, scale: float = 1.0):
        super().__init__()
        self.hidden_size, self.position_dims, self.scale = hidden_size, position_dims, scale

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if self.position_dims == 1:
            return self.scale * sinusoidal_table(positions, self.hidden_size)
        rows = (self.hidden_size + 1) // 2
        table = torch.cat(
            [sinusoidal_table(positions[..., 0], rows), sinusoidal_table(positions[..., 1], self.hidden_size - rows)],
            dim=-1,
        )
        return self.scale * table


class LearnedPositionEmbedding(nn.Module):
    """A learned table of ``max_positions`` rows (per axis in 2D)."""

    def __init__(self, hidden_size: int, max_positions: int, position_dims: int = 1):
        super().__init__()
        self.max_positions, self.position_dims = max_positions, position_dims
        if position_dims == 1:
            self.tables = nn.ModuleList([nn.Embedding(max_positions, hidden_size)])
        else:
            rows = (hidden_size + 1) // 2
            self.tables = nn.ModuleList(
                [nn.Embedding(max_positions, rows), nn.Embedding(max_positions, hidden_size - rows)]
            )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the same check without reading a number back (a graph break)
            covered = ((positions >= 0) & (positions < self.max_positions)).all()
            torch._assert_async(covered, f"learned absolute position embeddings cover 0..{self.max_positions - 1}")
        elif positions.numel() and (int(positions.max()) >= self.max_positions or int(positions.min()) < 0):
            raise ValueError(
                f"learned absolute position embeddings cover positions 0..{self.max_positions - 1}, got positions "
                f"{int(positions.min())}..{int(positions.max())}; shorten the input or use a relative encoding"
            )
        if self.position_dims == 1:
            return self.tables[0](positions)
        return torch.cat([table(positions[..., a]) for a, table in enumerate(self.tables)], dim=-1)


def build_absolute_position_embedding(
    name: str, hidden_size: int, max_positions: int | None, token_std: float, position_dims: int = 1
) -> nn.Module | None:
    """``token_std``: the std of the token embeddings at initialisation, the amplitude of the sinusoids."""
    if name == "none":
        return None
    if name == "sinusoidal":
        return SinusoidalPositionEmbedding(hidden_size, position_dims, scale=token_std)
    if name == "learned":
        if not max_positions:
            raise ValueError("learned absolute position embeddings need max_positions")
        return LearnedPositionEmbedding(hidden_size, max_positions, position_dims)
    raise ValueError(f"Unknown absolute_position_embedding {name!r}; valid values: none, sinusoidal, learned")
