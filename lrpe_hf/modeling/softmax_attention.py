"""The quadratic baseline: softmax attention (Vaswani et al. 2017; LRPE eq. 1-2) through SDPA, with the same
positional encodings.

The encoding transforms the raw queries and keys; the temperature is 1 / sqrt(width of the queries before the
transform), so an encoding that reduces to the identity gives plain softmax attention (LRPE Type 1's real form
doubles the width without changing q . k). PermuteFormer's decay becomes the additive log bias
log_decay (p_s - p_t) for p_s >= p_t.

Two implementations, transformers' ``attn_implementation``: ``"sdpa"`` (the default: PyTorch's fused kernels) and
``"eager"`` (the same maths in plain PyTorch ops: scores, softmax in float32, weighted sum).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .attention_state import TensorState


@dataclass
class SoftmaxAttentionState(TensorState):
    """Every past key (B, H, T, D'), value (B, H, T, d), padding mask (B, T), position (B, T, A) and document
    (B, T)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    key_documents: torch.Tensor | None = None


IMPLEMENTATIONS = ("sdpa", "eager")


def scaled_dot_product(q, k, v, scale: float, bias=None, is_causal=False, implementation="sdpa"):
    """softmax(q k^T scale + bias) v, causal (N = T) or not. q (B, H, N, D'), k (B, H, T, D'), v (B, H, T, d); bias
    (B, 1 or H, N, T) additive (-inf where a key is not allowed) or None."""
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=is_causal, scale=scale)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if is_causal:
        N, T = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(N, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if bias is not None:
        scores = scores + bias
    return scores.softmax(-1).to(v.dtype) @ v


class SoftmaxAttention(nn.Module):
    """q, k (B, H, N, D'), v (B, H, N, d) -> out (B, H, N, d)."""

    State = SoftmaxAttentionState

    def __init__(self, options, head_dim: int, query_key_dim: int):
        super().__init__()
        self.causal = options.causal
        self.scale = 1.0 / math.sqrt(query_key_dim)

    def takes_plain_road(self, encoding) -> bool:
        """This path has one road, its ``forward`` (no plain road, no short decoding step, as ``KernelAttention``'s)."""
        return False

    takes_short_steps = takes_plain_road

    def forward(self, q, k, v, inputs, reuse_inputs=False):
        """``inputs``: the layer's ``AttentionInputs``; of them this path reads the mask, positions, encoding, its
        state, the documents of a packed row (counted across calls, always given with a state; None: one document)
        and the softmax implementation ("sdpa" or "eager"). ``reuse_inputs`` is unused (see ``KernelAttention``)."""
        mask, positions, encoding, state = inputs.mask, inputs.positions, inputs.encoding, inputs.state
        documents, implementation = inputs.documents, inputs.softmax_implementation
        q, k = encoding.encode_features(q, k, positions)
        B, H, N, _ = q.shape
        key_mask = mask if mask is not None else torch.ones(B, N, dtype=torch.bool, device=q.device)
        key_positions, key_documents = positions, documents
        if state is not None:
            if state.keys is not None:
                k = torch.cat([state.keys, k], dim=2)
                v = torch.cat([state.values, v], dim=2)
                key_mask = torch.cat([state.key_mask, key_mask], dim=1)
                key_positions = torch.cat([state.key_positions, positions], dim=1)
                key_documents = torch.cat([state.key_documents, documents], dim=1)
            state.keys, state.values, state.key_mask = k, v, key_mask
            state.key_positions, state.key_documents = key_positions, key_documents
        log_decay = encoding.log_decay
        if log_decay is not None and not self.causal:
            raise ValueError(f"{type(encoding).__name__} decays with distance: it is for causal attention only")
        if mask is None and state is None and log_decay is None and documents is None:
            return scaled_dot_product(q, k, v, self.scale, is_causal=self.causal, implementation=implementation)
        T = k.shape[2]
        allowed = key_mask[:, None, None, :].expand(B, 1, N, T)
        if self.causal:
            order = torch.arange(T - N, T, device=q.device)[:, None] >= torch.arange(T, device=q.device)[None, :]
            allowed = allowed & order
        if documents is not None:
            allowed = allowed & (documents[:, None, :, None] == key_documents[:, None, None, :])
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # rows with no key (padding): outputs are zeroed later
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        if log_decay is not None:
            distance = (positions[:, :, 0, None] - key_positions[:, None, :, 0]).clamp_min(0)  # (B, N, T)
            bias = bias + log_decay.to(q.dtype)[None, :, None, None] * distance[:, None].to(q.dtype)
        return scaled_dot_product(q, k, v, self.scale, bias, implementation=implementation)
