"""What a causal attention layer carries between calls, for incremental decoding.

``LinearAttentionState`` is one layer's state: position counters, the state of its attention path
(``KernelAttentionState`` or ``SoftmaxAttentionState``, made on first use) and, for encodings that add a
bias over past values (FastRPB), a ``ValueHistory``. B batch, H heads, d head dim.
"""

from dataclasses import dataclass, fields

import torch


class TensorState:
    """A dataclass of tensors (and nested states) whose batch rows can be selected or repeated together."""

    def apply(self, fn):
        """Replace every tensor t (recursively) by fn(t)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, fn(value))
            elif isinstance(value, TensorState):
                value.apply(fn)

    def select(self, index: torch.Tensor):
        """Keep the batch rows ``index`` (beam search)."""
        self.apply(lambda t: t.index_select(0, index.to(t.device)))

    def repeat_interleave(self, repeats: int):
        self.apply(lambda t: t.repeat_interleave(repeats, dim=0))


@dataclass
class ValueHistory(TensorState):
    """The values (B, H, T, d) and positions (B, T, A) seen so far. Without autograd (generation) the storage
    doubles when full, so each step copies only its own tokens."""

    values: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    length: int = 0

    def append(self, values: torch.Tensor, positions: torch.Tensor):
        """Append values (B, H, n, d) and positions (B, n, A); return everything so far."""
        if torch.is_grad_enabled():  # keep autograd's saved tensors intact: no writes into shared storage
            if self.values is not None:
                values = torch.cat([self.values[:, :, : self.length], values], dim=2)
                positions = torch.cat([self.positions[:, : self.length], positions], dim=1)
            self.values, self.positions, self.length = values, positions, values.shape[2]
            return values, positions
        end = self.length + values.shape[2]
        if self.values is None or end > self.values.shape[2]:
            capacity = max(64, 2 * end)
            grown = values.new_zeros(values.shape[:2] + (capacity,) + values.shape[3:])
            grown_positions = positions.new_zeros(positions.shape[0], capacity, positions.shape[2])
            if self.values is not None:
                grown[:, :, : self.length] = self.values[:, :, : self.length]
                grown_positions[:, : self.length] = self.positions[:, : self.length]
            self.values, self.positions = grown, grown_positions
        self.values[:, :, self.length : end] = values
        self.positions[:, self.length : end] = positions
        self.length = end
        return self.values[:, :, :end], self.positions[:, :end]


@dataclass
class LinearAttentionState(TensorState):
    """One causal layer's state; pass the same object to successive calls of the layer.

    ``num_tokens`` (B,): real tokens seen per row (the next default position); ``last_position`` (B,): the last
    real token's position; ``path``: the attention path's own state; ``value_history``: past values for an
    encoding with a value bias.
    """

    num_tokens: torch.Tensor | None = None
    last_position: torch.Tensor | None = None
    path: TensorState | None = None
    value_history: ValueHistory | None = None

    def count(self, positions: torch.Tensor, mask: torch.Tensor | None):
        """Advance the counters past this call's tokens: positions (B, N, A), mask (B, N) or None."""
        if mask is None:
            real = torch.full(positions.shape[:1], positions.shape[1], device=positions.device)
            last = positions[:, -1, 0]
        else:
            real = mask.long().sum(-1)
            last = positions[..., 0].masked_fill(~mask, -1).amax(-1)
        self.num_tokens = real if self.num_tokens is None else self.num_tokens + real
        self.last_position = last if self.last_position is None else torch.maximum(self.last_position, last)
