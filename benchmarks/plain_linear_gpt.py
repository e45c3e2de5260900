"""A plain linear-attention GPT, written as a reader would write it: the host-cost benchmark's floor.

Per layer: one projection to q, k, v; phi = 1 + elu; the denominator as a ones column appended to the values; one
causal product (fla's ``chunk_simple_gla`` signature, (B, N, H, d) tensors, handed in by the caller); the division;
the output projection; a ReLU MLP; pre-norm, dropout on the residual branches (LinearGPT ``none``'s defaults). A
decoding step updates each layer's state (B, H, d, d + 1) as ``S += phi(k) [v, 1]^T`` and reads ``phi(q) S``. No
positions (LinearGPT ``none`` adds none), no padding, no checks: the least host work a model of this shape needs.

    model = PlainLinearGPT(layers=6, hidden=64, heads=4, ffn=256, vocab=512, product=chunk_simple_gla)
    loss = model(ids, labels=ids).loss; out = model(token, use_cache=True, cache=states)
"""

import torch
import torch.nn.functional as F
from torch import nn


class Output(dict):
    """What a step returns (loss, logits, cache), by key or attribute."""

    __getattr__ = dict.__getitem__


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, product):
        super().__init__()
        self.heads, self.product = heads, product
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x, state=None):
        """x (B, N, hidden); state (B, H, d, d + 1) or None: a decoding step (N = 1) updates it in place."""
        B, N, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, -1).unbind(2)  # (B, N, H, d) each
        q, k = F.elu(q) + 1, F.elu(k) + 1
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # the denominator as a ones column
        if state is None:
            y = self.product(q, k, v)[0]
        else:
            state += k[:, 0, :, :, None] * v[:, 0, :, None, :]  # S += k v^T
            y = (q[:, 0, :, None, :] @ state)[:, None, :, 0]  # q S
        y = (y[..., :-1] / (y[..., -1:] + 1e-6)).reshape(B, N, -1)
        x = x + self.dropout(self.out(y))
        return x + self.dropout(self.fc2(F.relu(self.fc1(self.norm2(x)))))


class PlainLinearGPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int, product):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, product) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.state_shape = (heads, hidden // heads, hidden // heads + 1)

    def forward(self, input_ids, labels=None, use_cache=False, logits_to_keep=0, **cache):
        """input_ids (B, N); labels (B, N), shifted here; with ``use_cache``, the states (one a layer) given as
        ``cache`` or ``past_key_values`` are continued, or a prompt makes them."""
        states = next((c for c in cache.values() if c is not None), None)
        if use_cache and states is None:
            return self.prompt(input_ids)
        x = self.embed(input_ids)
        for block, state in zip(self.blocks, states or [None] * len(self.blocks)):
            x = block(x, state)
        logits = F.linear(self.norm(x)[:, -logits_to_keep:], self.embed.weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return Output(loss=loss, logits=logits, cache=states, past_key_values=states)  # either release's name

    def prompt(self, input_ids):
        """A prompt's logits and states, one token at a time (not timed: only decoding steps are)."""
        states = [self.embed.weight.new_zeros(input_ids.shape[0], *self.state_shape) for _ in self.blocks]
        logits = [self(input_ids[:, t : t + 1], use_cache=True, cache=states).logits for t in range(input_ids.shape[1])]
        return Output(logits=torch.cat(logits, dim=1), cache=states, past_key_values=states)
