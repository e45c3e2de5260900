"""PermuteFormer (Chen, 2021): position-dependent permutations of the query/key features.

sim(q_s, k_t) = (r^s P_pi^s phi(q_s)) . (r^-t P_pi^t phi(k_t)) (eq. 11) with a random permutation pi per head
and a per-head decay r (r = 1 bidirectional, r < 1 causal). Powers of pi for any position come from its
cycle decomposition, so there is no maximum length. The decay is applied by the attention kernel as
r^(s-t) relative to chunk starts (``log_decay``), never as r^s over the whole sequence. In 2D two
permutations act on the two halves of the features, one driven by the row and one by the column (eq. 14).
"""

import math

import torch

from .gradients import wants_gradient
from .kept_tensors import KeptUntilChanged
from .positional_encoding import PositionalEncoding, distinct_rows, reference_permutation, token_blocks
from .reinitialisable import Reinitialisable, seeded_generator


class CyclicPermutations(Reinitialisable):
    """One random permutation pi_h of ``size`` elements per head, applied to the power ``s`` of any position
    (the P_pi^s of PermuteFormer eq. 11-13).

    (P_pi^s x)_i = x[pi^s(i)]; pi^s(i) = cycle(i)[(index of i in its cycle + s) mod cycle length].
    The permutations are drawn from ``seed`` (and the head and size), so they can be re-created.
    """

    def __init__(self, num_heads: int, size: int, seed: int = 0):
        super().__init__()
        self.num_heads, self.size, self.seed = num_heads, size, seed
        self.register_initial_values()

    def initial_values(self):
        num_heads, size = self.num_heads, self.size
        # Built on the CPU explicitly: from_pretrained constructs models on the meta device (values then load).
        members, start, length, index = (torch.zeros(num_heads, size, dtype=torch.long, device="cpu") for _ in range(4))
        for h in range(num_heads):
            generator = seeded_generator(self.seed, size, h)
            permutation = torch.randperm(size, generator=generator, device="cpu").tolist()
            seen, offset = [False] * size, 0
            for first in range(size):
                if seen[first]:
                    continue
                cycle, i = [], first
                while not seen[i]:
                    seen[i] = True
                    cycle.append(i)
                    i = permutation[i]
                for j, element in enumerate(cycle):
                    members[h, offset + j] = element
                    start[h, element], length[h, element], index[h, element] = offset, len(cycle), j
                offset += len(cycle)
        return {"members": members, "start": start, "length": length, "index": index}

    def power_indices(self, positions: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor:
        """positions (B, N) int -> indices pi_h^s(i) of shape (B, H, N, size). ``workspace``: int64 storage of at
        least 2 B H N size elements to compute in (reused block after block; a fresh tensor of this size is
        mapped and page-faulted anew), or None."""
        B, N = positions.shape
        shape = (B, self.num_heads, N, self.size)
        if workspace is None:
            workspace = positions.new_empty(2 * math.prod(shape))
        steps, index = workspace[: 2 * math.prod(shape)].view(2, *shape).unbind(0)
        torch.add(self.index[None, :, None, :], positions[:, None, :, None], out=steps)
        steps.remainder_(self.length[None, :, None, :]).add_(self.start[None, :, None, :])
        members = self.members[None].expand(B, -1, -1)
        torch.gather(members, -1, steps.flatten(2), out=index.flatten(2))
        return index

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q, k (B, H, N, size), positions (B, N) -> P_pi^s q, P_pi^s k (indices computed once for both)."""
        if wants_gradient(q, k):
            return PermuteQueriesAndKeys.apply(q, k, self, positions)
        return self.permute(positions, q, k)

    def permute_stacked(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """P_pi^s of q and k stacked along the heads, x (B, 2H, N, size) (the queries' heads first), positions
        (B, N): one gather for both, by the same indices."""
        B, _, N, size = x.shape
        index = self.power_indices(distinct_rows(positions))[:, None].expand(B, 2, -1, -1, -1)  # (B, 2, H, N, size)
        return torch.gather(x.view(B, 2, self.num_heads, N, size), -1, index).view(B, 2 * self.num_heads, N, size)

    BLOCK_ELEMENTS = 1 << 20  # the int64 indices of one block of tokens: 8 MB

    def permute(self, positions, *tensors, inverse: bool = False):
        """P_pi^s x for each x (B, H, N, size) of ``tensors`` (None stays None), or P_pi^-s with ``inverse``, without
        autograd's bookkeeping. A block of tokens at a time: the (B', H, T, size) int64 indices are never made for
        the whole input (at 32k tokens they would be 134 MB, built from as many temporaries). Outputs are stored
        heads-first."""
        rows = distinct_rows(positions)
        if inverse:  # negated after ``distinct_rows``, which reads the rows' strides
            rows = -rows
        present = [x for x in tensors if x is not None]
        B, H, N, size = present[0].shape
        one_block = rows.shape[0] * H * N * size <= self.BLOCK_ELEMENTS  # a decoding step, say
        if one_block or torch.compiler.is_compiling():  # no output buffers (nor out= views, which compiling refuses)
            index = self.power_indices(rows).expand(B, -1, -1, -1)
            outputs = [torch.gather(x, -1, index) for x in present]
        else:
            outputs = self.permute_in_blocks(rows, present)
        permuted = iter(outputs)
        return tuple(None if x is None else next(permuted) for x in tensors)

    def permute_in_blocks(self, rows, tensors):
        """``permute`` of ``tensors`` (B, H, N, size), a block of tokens at a time into output buffers, the indices
        built in one workspace reused block after block. rows (B', N)."""
        B, H, N, size = tensors[0].shape
        outputs = [x.new_empty(B, H, N, size) for x in tensors]
        blocks = token_blocks(N, rows.shape[0] * H * size, self.BLOCK_ELEMENTS)
        longest = max(tokens.stop - tokens.start for tokens in blocks)
        workspace = rows.new_empty(2 * rows.shape[0] * H * longest * size)
        for tokens in blocks:
            index = self.power_indices(rows[:, tokens], workspace).expand(B, -1, -1, -1)
            for x, out in zip(tensors, outputs):
                torch.gather(x[:, :, tokens], -1, index, out=out[:, :, tokens])
        return outputs


class PermuteQueriesAndKeys(torch.autograd.Function):
    """P_pi^s q and P_pi^s k through ``permutations`` (a ``CyclicPermutations``), saving only the positions. The
    permutation is orthogonal, so backward is the inverse permutation, pi^-s: a gather by the powers of the
    negated positions, where ``gather``'s own backward would keep the (B, H, N, size) int64 indices and scatter."""

    @staticmethod
    def forward(ctx, q, k, permutations, positions):
        ctx.permutations = permutations
        ctx.save_for_backward(positions)
        return permutations.permute(positions, q, k)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        (positions,) = ctx.saved_tensors
        return *ctx.permutations.permute(positions, grad_q, grad_k, inverse=True), None, None


def default_decays(num_heads: int) -> torch.Tensor:
    """Per-head r spread over [0.88, 0.99], the range the PermuteFormer paper used for language modelling."""
    if num_heads == 1:
        return torch.tensor([0.99])
    return torch.linspace(0.88, 0.99, num_heads)


class PermutePositionalEncoding(PositionalEncoding):
    def __init__(
        self,
        num_heads: int,
        feature_dim: int,
        position_dims: int = 1,
        causal: bool = False,
        decay: float | None = None,
        seed: int = 0,
    ):
        super().__init__()
        self.num_heads, self.position_dims, self.causal, self.decay = num_heads, position_dims, causal, decay
        if position_dims == 1:
            self.split = [feature_dim]
        else:
            rows = (feature_dim + 1) // 2
            self.split = [rows, feature_dim - rows]
        self.permutations = torch.nn.ModuleList(
            [CyclicPermutations(num_heads, n, seed=2 * seed + axis) for axis, n in enumerate(self.split)]
        )
        self.register_initial_values()
        self.kept_log_decay = KeptUntilChanged()

    def initial_values(self):
        if self.decay is not None:
            return {"decays": torch.full((self.num_heads,), float(self.decay))}
        return {"decays": default_decays(self.num_heads) if self.causal else torch.ones(self.num_heads)}

    @classmethod
    def from_options(cls, options, num_heads, head_dim, feature_dim):
        o = options
        seed = o.permute_seed * 1000 + o.layer_index  # every layer draws its own permutations
        return cls(num_heads, feature_dim, o.position_dims, o.causal, o.permute_decay, seed)

    @property
    def log_decay(self):
        """log r per head, None where every r is 1. Compiled, where the values cannot be looked at: None for
        bidirectional attention (whose r must be 1), the log otherwise (a log of 0 decays nothing)."""
        if torch.compiler.is_compiling():
            if self.causal:
                return self.decays.log()
            torch._assert_async((self.decays == 1.0).all(), "PermuteFormer decays only in causal attention")
            return None
        decays = self.decays
        if decays.requires_grad:
            return None if bool((decays == 1.0).all()) else decays.log()
        # fixed decays: looked at (a host read) and their log taken once, again only after they change
        return self.kept_log_decay.get((decays,), lambda: None if bool((decays == 1.0).all()) else decays.log())

    def reference_transform(self, head, position, width):
        """P_pi^p for each axis's block of features (its coordinate's power), pi read from the cycles kept."""
        blocks = []
        for axis, cyclic in enumerate(self.permutations):
            members, start, length, index = (getattr(cyclic, n)[head] for n in ("members", "start", "length", "index"))
            pi = [int(members[start[i] + (index[i] + 1) % length[i]]) for i in range(cyclic.size)]  # i's next
            blocks.append(torch.linalg.matrix_power(reference_permutation(pi), int(position[axis])))
        return torch.block_diag(*blocks).to(torch.complex128)

    def reference_decay(self, head):
        return float(self.decays[head])

    def encode_features(self, q, k, positions):
        if len(self.permutations) == 1:
            return self.permutations[0].apply(q, k, positions[..., 0])
        parts = [
            perm.apply(q_part, k_part, positions[..., a])
            for a, (perm, q_part, k_part) in enumerate(
                zip(self.permutations, q.split(self.split, dim=-1), k.split(self.split, dim=-1))
            )
        ]
        return torch.cat([p[0] for p in parts], dim=-1), torch.cat([p[1] for p in parts], dim=-1)

    def encode_stacked(self, x, positions):
        if len(self.permutations) > 1:  # 2D: each half of the features by its own axis, as encode_features
            return super().encode_stacked(x, positions)
        return self.permutations[0].permute_stacked(x, positions[..., 0])

    def extra_repr(self):
        return f"position_dims={self.position_dims}, decays={[round(d, 4) for d in self.decays.tolist()]}"
