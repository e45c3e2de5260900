"""The interface every relative positional encoding implements, and shared helpers.

An encoding can act at up to four places of the attention computation (shapes per head, B batch, H heads,
N tokens, D head dim, m feature dim); each default is "does nothing":

- ``encode_query_key(q, k, positions, spe_draw)``: before the feature map (SPE). (B,H,N,D) -> (B,H,N,D').
- ``encode_features(x, positions)``: after the feature map, the same transform for queries and keys
  (rope, lrpe_*, permute). (B,H,N,m) -> (B,H,N,m').
- ``log_decay``: a per-head log decay per position, ``(H,)`` or ``None`` (PermuteFormer's causal r).
- ``value_bias(values, key_positions, query_positions, causal)``: an additive ``W V`` term (FastRPB).

``positions`` are integer tensors of shape (B, N, A) with A = 1 (sequences) or 2 (row, col of image patches).
"""

import torch
from torch import nn


class PositionalEncoding(nn.Module):
    def query_key_dim(self, head_dim: int) -> int:
        """Width of queries/keys after ``encode_query_key``."""
        return head_dim

    def feature_dim(self, feature_dim: int) -> int:
        """Width of features after ``encode_features``."""
        return feature_dim

    def encode_query_key(self, q, k, positions, spe_draw=None):
        return q, k

    def encode_features(self, x, positions):
        return x

    @property
    def log_decay(self):
        return None

    def value_bias(self, values, key_positions, query_positions, causal):
        return None


class NoPositionalEncoding(PositionalEncoding):
    """``positional_encoding="none"``: content-only attention (NoPE, or absolute embeddings added to inputs)."""


def axis_of_each(num_units: int, position_dims: int) -> torch.Tensor:
    """Which position axis drives each of ``num_units`` feature units: all axis 0 in 1D; in 2D the first
    half follows the row, the second half the column. Returns a (num_units,) long tensor."""
    if position_dims == 1:
        return torch.zeros(num_units, dtype=torch.long)
    return (torch.arange(num_units) >= (num_units + 1) // 2).long()


def unit_angles(positions: torch.Tensor, frequencies: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """Angles position * frequency for every (head, unit), in float64 so that large positions stay exact.

    positions (B, N, A) int, frequencies (H, U), axis (U,) -> (B, H, N, U) float64.
    """
    coordinates = positions.to(torch.float64)[..., axis]  # (B, N, U)
    return coordinates[:, None] * frequencies.to(torch.float64)[None, :, None, :]
