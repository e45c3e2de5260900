"""Stochastic Positional Encoding (Liutkus et al., ICML 2021), applied before the feature map.

For each head and query/key dimension d, random positional codes Qbar_d(m), Kbar_d(n) in R^R are drawn so
that E[Qbar_d(m) . Kbar_d(n)] / R = P_d(m - n), a learnable relative kernel. Queries and keys become
(eq. 16-17)

    q_hat_m = sum_d q_md Qbar_d(m) / (D R)^(1/4),     k_hat_n = sum_d k_nd Kbar_d(n) / (D R)^(1/4),

so that E[q_hat_m . k_hat_n] = sqrt(R / D) sum_d q_md k_nd P_d(m - n): relative attention in expectation, at
linear cost, with R-dimensional queries and keys.

- sineSPE (eq. 18-21): P_d(tau) = sum_k lambda_dk^2 cos(2 pi f_dk tau + theta_dk) / K, codes
  Omega(m) diag(lambda) Z_d / sqrt(K) with Z_d a (2K x R) Gaussian draw. (The paper divides by sqrt(2K);
  sqrt(K) makes P_d(0) = 1 at initialisation, a constant absorbed by lambda.) In 2D the phase is
  2 pi (f_row * row + f_col * col).
- convSPE (eq. 22): codes = white noise over positions filtered by learnable filters Phi^Q_d, Phi^K_d of
  ``kernel_size`` taps (2D filters over the patch grid), computed by FFT. Noise before the first position is
  part of the draw, so the kernel is vanishing and relative everywhere.
- gating (eq. 23-25): codes <- sqrt(1 - delta_d) codes + sqrt(delta_d) eps_d, the same eps for queries and
  keys, so that the kernel becomes delta_d + (1 - delta_d) P_d.
- sharing: the learnable kernels (``SPECodes``, the registry's ``build_shared``) and one noise draw
  (``SPEDraw``) serve every layer of a model; each layer has its own gates.

In training mode every draw is fresh (from torch's RNG, so seeding reproduces it); in eval mode the draw
is a deterministic function of ``seed`` and of the positions, so inference is repeatable and incremental
decoding sees the same codes as a full forward.
"""

import copy
import itertools
import math
import zlib

import torch
from torch.autograd.function import once_differentiable

from .gradients import version_of, wants_gradient
from .kept_tensors import KeptUntilChanged
from .positional_encoding import PositionalEncoding, distinct_rows, token_blocks
from .reinitialisable import Reinitialisable


def _mix(seed: int, key: tuple) -> int:
    state = seed & (2**63 - 1)
    for value in key:
        state = (state * 6364136223846793005 + int(value) + 1442695040888963407) % (2**63)
    return state


def seeded_normal(seed: int, key: tuple, shape: tuple) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_mix(seed, key))
    return torch.randn(shape, generator=generator)


class SPEDraw:
    """One draw of the SPE noise for one forward pass; every layer that uses it sees the same codes.

    The position tables built from the shared kernels (``cached``) can carry gradients to them (convSPE's codes;
    sineSPE's table is a constant that its mixing differentiates). ``tables()`` lists them and ``with_tables()``
    swaps them, so that a model can hand them to each layer as explicit tensor inputs: reentrant gradient
    checkpointing then routes each layer's gradient into the shared graph once.
    """

    GRID_BLOCK = {1: 256, 2: 16}

    def __init__(self, codes: "SPECodes", device: torch.device):
        self.codes = codes
        self.device = device
        self.seeded = not codes.training
        self._tensors = {}
        self._tables = {}
        self._ranges = []
        # (N, in order) where the caller knows that the positions are its defaults counted from 0 in a call of N
        # tokens (in order: one row 0..N-1, no padding); None where they must be read
        self.default_positions = None

    def tables(self) -> list[torch.Tensor]:
        """The position tables built so far, in a fixed order."""
        return [value for name in sorted(self._tables) for _, _, value in self._tables[name]]

    def with_tables(self, tables) -> "SPEDraw":
        """A view of this draw whose position tables are ``tables`` (as ``tables()`` lists them)."""
        view = copy.copy(self)
        remaining = iter(tables)
        view._tables = {
            name: [(root, key, next(remaining)) for root, key, _ in self._tables[name]] for name in sorted(self._tables)
        }
        return view

    def tensor(self, name: str, shape: tuple) -> torch.Tensor:
        """A named position-independent noise tensor of the given shape."""
        if name not in self._tensors:
            if self.seeded:
                self._tensors[name] = self.codes.seeded_tensor(name, shape, self.device)
            else:
                self._tensors[name] = torch.randn(shape, device=self.device)
        return self._tensors[name]

    def shared_by_layers(self, name: str, build):
        """``build()``, once for every layer of this draw where no gradient is wanted (evaluation, decoding);
        where one is, each layer builds its own, so that its graph stays its own (as gradient checkpointing
        replays it)."""
        if torch.is_grad_enabled():
            return build()
        if name not in self._tensors:
            self._tensors[name] = self.codes.seeded_product(name, build) if self.seeded else build()
        return self._tensors[name]

    def cached(self, name: str, positions: torch.Tensor, build):
        """``build()`` evaluated once per positions input; identical batch rows are built once. Each layer's
        positions are its own view of the model's: they are the input built for when they view the same root tensor
        the same way (shape, strides, offset) and the root is unchanged since (its version; an inference tensor has
        none, and a draw lives for one forward pass). Values are never compared (on a GPU that would be a read on
        the host in every layer). Compiled, built at every call (the compiler reads no versions; the build is a
        function of positions and of this draw, so every layer still reads the same values)."""
        rows = distinct_rows(positions)
        if torch.compiler.is_compiling():
            return build(rows)
        return self._kept(self._tables.setdefault(name, []), rows, build)

    def position_range(self, positions: torch.Tensor) -> list[list[int]]:
        """The lowest and highest position per axis, [[lo...], [hi...]]: read on the host once per positions input
        (as ``cached`` tells them apart)."""

        def read(rows):
            return torch.stack([rows.amin(dim=(0, 1)), rows.amax(dim=(0, 1))]).tolist()

        rows = distinct_rows(positions)
        return read(rows) if torch.compiler.is_compiling() else self._kept(self._ranges, rows, read)

    @staticmethod
    def _kept(kept: list, rows: torch.Tensor, build):
        root = rows if rows._base is None else rows._base
        key = (version_of(root), tuple(rows.shape), rows.stride(), rows.storage_offset())
        for kept_root, kept_key, value in kept:
            if kept_root is root and kept_key == key:
                return value
        value = build(rows)
        kept.append((root, key, value))
        return value

    def grid(self, start: tuple, stop: tuple, channels: tuple) -> torch.Tensor:
        """White noise on the integer grid [start, stop) (one range per axis): (*sizes, *channels)."""
        key = ("grid", start, stop)
        if key in self._tensors:
            return self._tensors[key]
        sizes = tuple(b - a for a, b in zip(start, stop))
        if not self.seeded:
            noise = torch.randn(sizes + channels, device=self.device)
        else:
            block = self.GRID_BLOCK[len(start)]
            noise = torch.empty(sizes + channels)
            ranges = [range(a // block, (b - 1) // block + 1) for a, b in zip(start, stop)]
            for index in itertools.product(*ranges):
                tile = self.codes.seeded_block(index, block, channels)
                src, dst = [], []
                for i, a, b in zip(index, start, stop):
                    lo, hi = max(a, i * block), min(b, (i + 1) * block)
                    src.append(slice(lo - i * block, hi - i * block))
                    dst.append(slice(lo - a, hi - a))
                noise[tuple(dst)] = tile[tuple(src)]
            noise = noise.to(self.device)
        self._tensors[key] = noise
        return noise


class SPECodes(Reinitialisable):
    """The learnable kernels shared across layers; ``draw`` makes the noise for one forward pass."""

    def __init__(self, num_heads: int, head_dim: int, num_realizations: int, position_dims: int, seed: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_realizations, self.position_dims, self.seed = num_realizations, position_dims, seed
        self._block_cache, self._seeded_cache = {}, {}
        self.kept_products = KeptUntilChanged()

    def draw(self, device=None) -> SPEDraw:
        return SPEDraw(self, device or next(self.parameters()).device)

    def seeded_tensor(self, name: str, shape: tuple, device) -> torch.Tensor:
        """The deterministic noise named ``name`` (cached: eval-mode draws reuse it at every forward; not a tensor
        made under inference_mode, which a later forward with gradients could not save for backward)."""
        key = (name, shape, str(device))
        if key in self._seeded_cache:
            return self._seeded_cache[key]
        noise = seeded_normal(self.seed, (zlib.crc32(name.encode()),), shape).to(device)
        if not torch.is_inference_mode_enabled():
            self._seeded_cache[key] = noise
        return noise

    def seeded_product(self, name: str, build) -> torch.Tensor:
        """``build()`` from the deterministic noise and the parameters, cached until a parameter changes (its
        storage or its version counter, which every in-place update such as an optimizer step advances): one
        build for every decoding step of an eval-mode model."""
        if torch.compiler.is_compiling():  # a compiled graph reads no version counters: it builds (and fuses) it
            return build()
        return self.kept_products.get(tuple(self.parameters()), build, key=name)

    def seeded_block(self, index: tuple, block: int, channels: tuple) -> torch.Tensor:
        """Deterministic noise of the grid block ``index`` (cached; at most 64 blocks are kept)."""
        key = (index, block, channels)
        if key not in self._block_cache:
            if len(self._block_cache) >= 64:
                self._block_cache.pop(next(iter(self._block_cache)))
            shape = (block,) * len(index) + channels
            self._block_cache[key] = seeded_normal(self.seed, (1,) + index, shape)
        return self._block_cache[key]

    def prepare(self, draw: SPEDraw, positions: torch.Tensor):
        """Build the draw's position-dependent tables before the layers run, so that every layer (and a
        gradient-checkpointing replay) reads the same cached tensors. positions (B, N, A)."""
        raise NotImplementedError

    def gate_noise(self, draw: SPEDraw) -> torch.Tensor:
        return draw.tensor("gate", (self.num_heads, self.head_dim, self.num_realizations))

    def positional_codes(self, positions, draw, is_query):
        raise NotImplementedError

    def encode(self, x, positions, draw, gate, is_query):
        """x (B, H, N, D), positions (B, N, A), gate (H, D) or None -> (B, H, N, R)."""
        raise NotImplementedError

    def _normalise(self, out):
        return out * (self.head_dim * self.num_realizations) ** -0.25


class SineSPECodes(SPECodes):
    @classmethod
    def from_options(cls, options, num_heads, head_dim):
        o = options
        return cls(num_heads, head_dim, o.spe_realizations, o.spe_sines, o.position_dims, o.spe_seed)

    def __init__(self, num_heads, head_dim, num_realizations=32, num_sines=5, position_dims=1, seed=0):
        super().__init__(num_heads, head_dim, num_realizations, position_dims, seed)
        self.num_sines = num_sines
        self.register_initial_values(trainable={"frequencies": True, "phases": True, "amplitudes": True})

    def initial_values(self):
        H, D, K = self.num_heads, self.head_dim, self.num_sines
        # Frequencies (cycles per position) spread log-uniformly over [1e-4, 0.5] for every (head, dim).
        exponents = torch.rand(self.position_dims, H, D, K)
        return {
            "frequencies": 0.5 * (2e-4) ** exponents,
            "phases": torch.zeros(H, D, K),
            "amplitudes": torch.ones(H, D, K),
        }

    def kernel(self, lags: torch.Tensor) -> torch.Tensor:
        """P_d(tau) for lags (T, A): (H, D, T). The expectation the codes are built to match."""
        phase = 2 * math.pi * torch.einsum("ta,ahdk->hdtk", lags.double(), self.frequencies.double())
        phase = phase + self.phases.double()[:, :, None, :]
        return (self.amplitudes.double()[:, :, None, :] ** 2 * phase.cos()).mean(-1)

    def position_table(self, positions, draw):
        """[cos, sin](2 pi f . p) for every (head, sine, dim): (B', H, N, 2K, D), the cosines first, shared by
        queries, keys and every layer using the draw. A constant: the frequencies' gradient comes from the mixing
        (``SineMixing``), which knows the table's derivative."""
        dtype = torch.promote_types(self.frequencies.dtype, torch.float32)
        return draw.cached("sine_table", positions, lambda rows: sine_table(rows, self.frequencies.detach(), dtype))

    def prepare(self, draw, positions):
        self.position_table(positions, draw)

    def mixing_matrix(self, draw, is_query, dtype):
        """The noise Z folded with amplitudes / sqrt(K) and, for queries, the phase rotation
        cos(a + theta) = cos a cos theta - sin a sin theta: (H, 2K, D, R), in the table's order, shared by the
        layers of a draw where no gradient is wanted."""
        H, D, K, R = self.num_heads, self.head_dim, self.num_sines, self.num_realizations

        def build():
            noise = draw.tensor("sine", (H, D, 2, K, R))
            cos_part, sin_part = noise[:, :, 0], noise[:, :, 1]
            if is_query:
                c, s = self.phases.cos()[..., None], self.phases.sin()[..., None]
                cos_part, sin_part = c * cos_part + s * sin_part, c * sin_part - s * cos_part
            scale = self.amplitudes[..., None] / math.sqrt(K)
            mixing = torch.cat([scale * cos_part, scale * sin_part], dim=2)  # (H, D, 2K, R)
            return mixing.transpose(1, 2).contiguous().to(dtype)

        return draw.shared_by_layers(f"sine_{'query' if is_query else 'key'}_mixing_{dtype}", build)

    def encode(self, x, positions, draw, gate, is_query):
        table = self.position_table(positions, draw).to(x.dtype)  # (B', H, N, 2K, D)
        rows = positions[: table.shape[0]]  # the positions the table was built from (see distinct_rows)
        mixing = self.mixing_matrix(draw, is_query, x.dtype)
        mixed_x = x
        if gate is not None:  # the gate's sqrt(1 - delta_d) scales x or the mixing matrix, whichever is smaller
            keep = (1 - gate).sqrt().to(x.dtype)  # (H, D)
            if x.numel() < mixing.numel():
                mixed_x = x * keep[None, :, None]
            else:
                mixing = mixing * keep[:, None, :, None]
        mixing = mixing.flatten(1, 2)  # (H, 2K * D, R)
        if wants_gradient(mixed_x, mixing, self.frequencies):
            out = SineMixing.apply(mixed_x, mixing, self.frequencies, table, rows)
        else:
            out = SineMixing.mix(mixed_x, table, mixing)
        if gate is not None:
            out = out + (x * gate.sqrt().to(x.dtype)[None, :, None]) @ self.gate_noise(draw).to(x.dtype)[None]
        return self._normalise(out)


SINE_TABLE_BLOCK_ELEMENTS = 1 << 17  # float64 cycles of one block: 1 MB, so the block's passes stay in cache


def sine_table(rows: torch.Tensor, frequencies: torch.Tensor, dtype) -> torch.Tensor:
    """[cos, sin](2 pi f . p): rows (B', N, A), frequencies (A, H, D, K) -> (B', H, N, 2K, D). The cycles f . p are
    reduced modulo 1 in float64, so large positions stay exact, a block of tokens at a time."""
    B, N, A = rows.shape
    _, H, D, K = frequencies.shape
    f = frequencies.transpose(-1, -2).double()[:, :, None]  # (A, H, 1, K, D)

    def phase(tokens):  # (B', H, T, K, D)
        p = rows[:, None, tokens, None, None, :].double()  # (B', 1, T, 1, 1, A)
        cycles = p[..., 0] * f[0]
        for a in range(1, A):
            cycles += p[..., a] * f[a]
        return cycles.frac_().to(dtype).mul_(2 * math.pi)

    if torch.compiler.is_compiling():  # in one piece: a compiled graph takes no out= views of the table
        angles = phase(slice(None))
        return torch.cat([angles.cos(), angles.sin()], dim=3)
    table = torch.empty(B, H, N, 2 * K, D, dtype=dtype, device=frequencies.device)
    for tokens in token_blocks(N, B * H * K * D, SINE_TABLE_BLOCK_ELEMENTS):
        angles = phase(tokens)
        torch.cos(angles, out=table[:, :, tokens, :K])
        torch.sin(angles, out=table[:, :, tokens, K:])
    return table


def sine_reference_codes(codes, draw, positions, head, is_query):
    """``SineSPECodes``' Qbar_d(p) (N, D, R) float64 for one head at ``positions`` (N coordinate tuples), from eq. 19
    with the draw's noise: sum_k lambda_k (cos(2 pi f_k . p + phase) Z_k + sin(...) Z'_k) / sqrt(K), the phase for
    queries only."""
    K, D, R = codes.num_sines, codes.head_dim, codes.num_realizations
    noise = draw.tensor("sine", (codes.num_heads, D, 2, K, R))[head].double()
    out = torch.zeros(len(positions), D, R, dtype=torch.float64)
    for n, p in enumerate(positions):
        for d in range(D):
            for k in range(K):
                f = codes.frequencies[:, head, d, k].detach().double()
                phase = 2 * math.pi * float((f * torch.tensor(p, dtype=torch.float64)).sum())
                if is_query:
                    phase += float(codes.phases[head, d, k].detach())
                amplitude = float(codes.amplitudes[head, d, k].detach())
                sines = math.cos(phase) * noise[d, 0, k] + math.sin(phase) * noise[d, 1, k]
                out[n, d] += amplitude * sines / math.sqrt(K)
    return out


class SineMixing(torch.autograd.Function):
    """sum_{j, d} x_d table_jd M_(jd)r for sineSPE: x (B, H, N, D), the table [cos, sin](2 pi f . p) (B', H, N, 2K, D)
    with B' 1 or B, M (H, 2K * D, R) -> (B, H, N, R), stored heads-first. The gradient goes to x, M and the
    frequencies f (A, H, D, K) the table was built from, through d cos(2 pi f . p) / df_a = -2 pi p_a sin and
    d sin / df_a = 2 pi p_a cos: the table itself is a constant here, and neither its gradient nor the products
    x_d table_jd (20 times the size of x for the defaults) are ever made for the whole input. Forward and backward
    work a block of tokens at a time, small enough to stay in cache; backward recomputes the products. Every
    product is a matmul batched over the heads, with the batch rows and tokens as its rows: a broadcast matmul of
    (B, H, T, 2K D) by (H, 2K D, R) copies M once per batch row (1.8 ms against 39 us for one token at batch 8)."""

    BLOCK_ELEMENTS = 1 << 19  # elements of one block's products (2 MB in float32)

    @staticmethod
    def blocks(x, table):
        B, H, N, D = x.shape
        return token_blocks(N, B * H * D * table.shape[3], SineMixing.BLOCK_ELEMENTS)

    @staticmethod
    def products(x, table, tokens):
        """x_d table_jd for a block of tokens, heads first: (H, B * T, 2K * D)."""
        x, table = x.transpose(0, 1)[:, :, tokens, None, :], table.transpose(0, 1)[:, :, tokens]
        H, B, T, _, D = x.shape
        out = x.new_empty(H, B, T, table.shape[3], D, dtype=torch.promote_types(x.dtype, table.dtype))
        return torch.mul(x, table, out=out).view(H, B * T, -1)

    @staticmethod
    def mix(x, table, mixing):
        """The product itself, without autograd's bookkeeping."""
        B, H, N, _ = x.shape
        blocks = SineMixing.blocks(x, table)
        if len(blocks) == 1:
            return torch.bmm(SineMixing.products(x, table, blocks[0]), mixing).view(H, B, N, -1).transpose(0, 1)
        out = x.new_empty(H, B, N, mixing.shape[-1])
        for tokens in blocks:
            out[:, :, tokens] = torch.bmm(SineMixing.products(x, table, tokens), mixing).view(H, B, -1, out.shape[-1])
        return out.transpose(0, 1)

    @staticmethod
    def forward(ctx, x, mixing, frequencies, table, rows):
        ctx.save_for_backward(x, mixing, table, rows)
        ctx.frequencies_dtype = frequencies.dtype
        return SineMixing.mix(x, table, mixing)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, mixing, table, rows = ctx.saved_tensors
        B, H, N, D = x.shape
        K = table.shape[3] // 2
        accumulate = torch.promote_types(x.dtype, torch.float32)  # positions times gradients: never in bf16
        grad_x = x.new_empty(H, B, N, D)
        grad_mixing = torch.zeros_like(mixing) if ctx.needs_input_grad[1] else None
        grad_frequencies = 0 if ctx.needs_input_grad[2] else None
        for tokens in SineMixing.blocks(x, table):
            g = grad.transpose(0, 1)[:, :, tokens].reshape(H, -1, grad.shape[-1])  # (H, B * T, R)
            block = table.transpose(0, 1)[:, :, tokens]  # (H, B', T, 2K, D)
            grad_products = torch.bmm(g, mixing.transpose(1, 2)).view(H, B, -1, *block.shape[3:])  # (H, B, T, 2K, D)
            grad_x[:, :, tokens] = (grad_products * block).sum(-2)
            if grad_mixing is not None:
                grad_mixing.baddbmm_(SineMixing.products(x, table, tokens).transpose(1, 2), g)
            if grad_frequencies is not None:
                # the table's gradient x_d dL/d(products), folded at once into the frequencies':
                # sum_{b, t} p_a x_d (g_sin cos - g_cos sin), for each (head, sine, dim)
                cos, sin = block[..., :K, :], block[..., K:, :]
                slope = torch.addcmul(grad_products[..., K:, :] * cos, grad_products[..., :K, :], sin, value=-1)
                slope = (slope * x.transpose(0, 1)[:, :, tokens, None, :]).to(accumulate).reshape(H, -1, K * D)
                p = rows[:, tokens].to(accumulate).expand(B, -1, -1).reshape(-1, rows.shape[-1])  # (B * T, A)
                grad_frequencies = grad_frequencies + p.T @ slope  # (H, A, K * D)
        if grad_frequencies is not None:
            grad_frequencies = (2 * math.pi) * grad_frequencies.unflatten(-1, (K, -1)).permute(1, 0, 3, 2)
            grad_frequencies = grad_frequencies.to(ctx.frequencies_dtype)
        return grad_x.transpose(0, 1), grad_mixing, grad_frequencies, None, None


class ConvSPECodes(SPECodes):
    @classmethod
    def from_options(cls, options, num_heads, head_dim):
        o = options
        return cls(num_heads, head_dim, o.spe_realizations, o.spe_kernel_size, o.position_dims, o.spe_seed)

    def __init__(self, num_heads, head_dim, num_realizations=32, kernel_size=64, position_dims=1, seed=0):
        super().__init__(num_heads, head_dim, num_realizations, position_dims, seed)
        self.kernel_size = kernel_size
        self.register_initial_values(trainable={"query_filters": True, "key_filters": True})

    def initial_values(self):
        H, D, L, A = self.num_heads, self.head_dim, self.kernel_size, self.position_dims
        # Start from decaying unit-norm windows with random time constants, so P_d(0) = 1 and P_d vanishes.
        taps = torch.stack(torch.meshgrid(*[torch.arange(L, dtype=torch.float)] * A, indexing="ij")).norm(dim=0)
        scale = L * torch.rand(H, D).clamp_min(0.05)
        window = torch.exp(-taps / scale.view(H, D, *([1] * A)))
        window = window / window.flatten(2).norm(dim=-1).view(H, D, *([1] * A))
        return {"query_filters": window.clone(), "key_filters": window + 0.01 * torch.randn(window.shape)}

    def kernel(self, lags: torch.Tensor) -> torch.Tensor:
        """Cross-correlation of the filters at lags (T, A) (1D and 2D): (H, D, T)."""
        L, A = self.kernel_size, self.position_dims
        q = self.query_filters.double().flatten(2)
        k = self.key_filters.double()
        taps = torch.stack(torch.meshgrid(*[torch.arange(L, device=q.device)] * A, indexing="ij"), dim=-1)
        taps = taps.reshape(-1, A)
        out = []
        for lag in lags.tolist():
            # E[Qbar(m) Kbar(n)] / R = sum_j PhiQ[j] PhiK[j + (n - m)] with n - m = -lag
            shifted = taps - torch.tensor(lag, device=q.device)
            valid = ((shifted >= 0) & (shifted < L)).all(-1)
            idx = shifted[valid]
            values = k[(slice(None), slice(None)) + tuple(idx[:, a] for a in range(A))]
            out.append((q[:, :, valid] * values).sum(-1))
        return torch.stack(out, dim=-1)

    def codes(self, positions, draw, is_query):
        """Filtered noise Qbar_d(p) (or Kbar) at every position: (B', H, N, D, R), cached in the draw."""

        def build(rows):
            L, A = self.kernel_size, self.position_dims
            if draw.default_positions is not None:  # the caller's defaults, 0..N-1: nothing to read
                num_tokens, in_order = draw.default_positions
                lo_values, hi_values = [0] * A, [num_tokens - 1] * A
            else:  # the noise grid is sized by the positions' range: one read on the host per draw
                lo_values, hi_values = draw.position_range(positions)
                in_order = False
            start = tuple(v - L + 1 for v in lo_values)
            stop = tuple(v + 1 for v in hi_values)
            dtype = torch.promote_types(self.query_filters.dtype, torch.float32)
            noise = draw.grid(start, stop, (self.head_dim, self.num_realizations)).to(dtype)  # (*G, D, R)
            sizes = noise.shape[:A]
            fft_sizes = tuple(fast_fft_size(n) for n in sizes)  # no wrap-around reaches the kept outputs
            filters = (self.query_filters if is_query else self.key_filters).to(dtype)
            noise_f = torch.fft.rfftn(noise, s=fft_sizes, dim=tuple(range(A)))  # (*F, D, R)
            filter_f = torch.fft.rfftn(filters, s=fft_sizes, dim=tuple(range(2, 2 + A)))  # (H, D, *F)
            filter_f = filter_f.permute(0, *range(2, 2 + A), 1).unsqueeze(-1)  # (H, *F, D, 1)
            full = torch.fft.irfftn(noise_f[None] * filter_f, s=fft_sizes, dim=tuple(range(1, 1 + A)))
            grid = full[(slice(None),) + tuple(slice(L - 1, n) for n in sizes)]  # (H, *P, D, R): positions lo..hi
            if in_order:  # one row 0..N-1: the grid itself
                codes = grid[None]
            else:
                index = tuple(rows[..., a] - lo_values[a] for a in range(A))  # numbers: no copy to the device
                codes = grid[(slice(None),) + index].transpose(0, 1)
            return codes.contiguous()  # once for every layer: their products fold (head, token) into one batch

        return draw.cached("conv_query" if is_query else "conv_key", positions, build)

    def prepare(self, draw, positions):
        self.codes(positions, draw, True)
        self.codes(positions, draw, False)

    def encode(self, x, positions, draw, gate, is_query):
        codes = self.codes(positions, draw, is_query).to(x.dtype)
        if gate is None:
            return self._normalise(CodeMixing.mix(x, codes))
        # sum_d x_d (sqrt(1 - delta_d) Qbar_d + sqrt(delta_d) eps_d), without building the gated codes
        gated = x * (1 - gate).sqrt().to(x.dtype)[None, :, None]
        out = CodeMixing.mix(gated, codes)
        out = out + (x * gate.sqrt().to(x.dtype)[None, :, None]) @ self.gate_noise(draw).to(x.dtype)[None]
        return self._normalise(out)


def conv_reference_codes(codes, draw, positions, head, is_query):
    """``ConvSPECodes``' Qbar_d(p) (N, D, R) float64 for one head at ``positions`` (N coordinate tuples): the query's
    or key's filter convolved with the draw's noise grid, tap by tap (eq. 22)."""
    L, A, D, R = codes.kernel_size, codes.position_dims, codes.head_dim, codes.num_realizations
    filters = (codes.query_filters if is_query else codes.key_filters)[head].double()
    coordinates = torch.tensor(positions)
    start = tuple(int(v) - L + 1 for v in coordinates.amin(0))
    stop = tuple(int(v) + 1 for v in coordinates.amax(0))
    grid = draw.grid(start, stop, (D, R)).double()
    out = torch.zeros(len(positions), D, R, dtype=torch.float64)
    for n, p in enumerate(positions):
        for taps in itertools.product(range(L), repeat=A):
            cell = tuple(p[a] - taps[a] - start[a] for a in range(A))
            out[n] += filters[(slice(None), *taps)][:, None] * grid[cell]
    return out


class CodeMixing(torch.autograd.Function):
    """sum_d x_d codes_dr for convSPE: x (B, H, N, D), codes (B', H, N, D, R) with B' 1 or B -> (B, H, N, R). Every
    token has its own (D x R) codes, so this is one small product per (head, token), batched over them, with the
    batch rows as its rows where the rows share the codes. The codes (N D R per head: 32 times the size of x for
    the defaults, and shared by every layer) are never copied; their gradient, sum_b x_d grad_r, is made in their
    own layout (as a plain outer product for one batch row), where the einsum it replaces permuted and copied it."""

    @staticmethod
    def mix(x, codes):
        if wants_gradient(x, codes):
            return CodeMixing.apply(x, codes)
        return CodeMixing.product(x, codes)

    @staticmethod
    def product(x, codes):
        if codes.shape[0] == 1:  # (H, N, B, D) @ (H, N, D, R): the rows share the codes
            return (x.permute(1, 2, 0, 3) @ codes[0]).permute(2, 0, 1, 3)
        return (x.unsqueeze(-2) @ codes).squeeze(-2)

    @staticmethod
    def forward(ctx, x, codes):
        ctx.save_for_backward(x, codes)
        return CodeMixing.product(x, codes)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, codes = ctx.saved_tensors
        grad_x = grad_codes = None
        if codes.shape[0] == 1:
            rows_grad, rows_x = grad.permute(1, 2, 0, 3), x.permute(1, 2, 0, 3)  # (H, N, B, R), (H, N, B, D)
            if ctx.needs_input_grad[0]:
                grad_x = (rows_grad @ codes[0].transpose(-1, -2)).permute(2, 0, 1, 3)
            if ctx.needs_input_grad[1]:
                if x.shape[0] == 1:
                    grad_codes = rows_x[..., 0, :, None] * rows_grad[..., 0, None, :]  # (H, N, D, R)
                else:
                    grad_codes = rows_x.transpose(-1, -2) @ rows_grad
                grad_codes = grad_codes.unsqueeze(0)
        else:
            if ctx.needs_input_grad[0]:
                grad_x = (grad.unsqueeze(-2) @ codes.transpose(-1, -2)).squeeze(-2)
            if ctx.needs_input_grad[1]:
                grad_codes = x.unsqueeze(-1) * grad.unsqueeze(-2)
        return grad_x, grad_codes


def fast_fft_size(n: int) -> int:
    """The smallest 2^a 3^b 5^c >= n (FFT lengths with large prime factors are slow)."""
    best = 1 << (n - 1).bit_length()
    power5 = 1
    while power5 < best:
        power35 = power5
        while power35 < best:
            size = power35
            while size < n:
                size *= 2
            best = min(best, size)
            power35 *= 3
        power5 *= 5
    return best


class StochasticPositionalEncoding(PositionalEncoding):
    """The per-layer part of SPE: the gates (eq. 24-25). The codes come from the shared draw; queries and keys
    leave with ``num_realizations`` (R) dimensions."""

    keeps_query_key = True  # mixing them with the trainable codes and gates

    def __init__(self, num_heads: int, head_dim: int, num_realizations: int, gated: bool):
        super().__init__()
        self.num_heads, self.head_dim, self.num_realizations, self.gated = num_heads, head_dim, num_realizations, gated
        self.gate_logits = None
        self.register_initial_values(trainable={"gate_logits": True})

    def initial_values(self):
        return {"gate_logits": torch.zeros(self.num_heads, self.head_dim)} if self.gated else {}

    @classmethod
    def from_options(cls, options, num_heads, head_dim, feature_dim):
        return cls(num_heads, head_dim, options.spe_realizations, options.spe_gated)

    def reference_codes(self, positions, head, shared_draw, is_query):
        """The codes (N, D, R) float64 of one head at ``positions`` (N coordinate tuples), gated (eq. 24-25:
        sqrt(1 - delta) Qbar + sqrt(delta) eps, delta = sigmoid(gate logit) per feature), from the shared codes'
        formula (``sine_reference_codes``, ``conv_reference_codes``)."""
        codes = shared_draw.codes
        formula = sine_reference_codes if isinstance(codes, SineSPECodes) else conv_reference_codes
        out = formula(codes, shared_draw, positions, head, is_query)
        if self.gate_logits is None:
            return out
        delta = torch.sigmoid(self.gate_logits[head].detach().double())
        noise = shared_draw.tensor("gate", (codes.num_heads, self.head_dim, self.num_realizations))[head].double()
        return (1 - delta).sqrt()[None, :, None] * out + (delta.sqrt()[:, None] * noise)[None]

    def reference_query_key(self, x, positions, head, shared_draw, is_query):
        """x (N, D) mixed by its codes into R dimensions, scaled by (D R)^(-1/4) (eq. 14)."""
        codes = self.reference_codes(positions, head, shared_draw, is_query)
        return torch.einsum("nd,ndr->nr", x, codes) / (self.head_dim * self.num_realizations) ** 0.25

    def encode_query_key(self, q, k, positions, shared_draw=None):
        if shared_draw is None:
            raise ValueError("SPE needs the draw of its shared codes: pass shared_draw=codes.draw()")
        codes = shared_draw.codes
        gate = torch.sigmoid(self.gate_logits) if self.gate_logits is not None else None
        return codes.encode(q, positions, shared_draw, gate, True), codes.encode(k, positions, shared_draw, gate, False)
