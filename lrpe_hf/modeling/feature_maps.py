"""Kernel feature maps phi: R^D -> R^m for linear attention.

Every map works per head on tensors of shape (batch, heads, tokens, D) and returns (batch, heads, tokens, m)
with m = ``output_dim``. The base class is the identity map; a subclass overrides ``forward`` (and
``output_dim`` when the width changes).

Exponential maps (``exp``/SIKF and ``performer``/FAVOR+) subclass ``ExponentialFeatureMap``: they give
``log_features`` and compute features with a stabiliser that keeps exp() finite. Queries are divided by
exp(their own maximum) and keys by exp(the maximum over the keys seen so far, causal) or over all keys
(bidirectional). Output s is then a ratio of sums that are all divided by exp(``log_scale[s]``); the
attention layer multiplies its eps by exp(-``log_scale``), so eps keeps its meaning on the unstabilised
scale and the stabiliser never changes an output.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from .gradients import wants_gradient
from .products_dispatch import kernel_backend_serves
from .reinitialisable import Reinitialisable, seeded_generator


@dataclass
class Features:
    """phi(q), phi(k) (B, H, N, m), keys zero where padded, plus what a stabiliser adds:
    ``log_gates`` (B, H, N), a decay of the past at each token (<= 0), or None;
    ``log_scale`` (B, H, N, 1), the log of the factor every term of output s was divided by, or None;
    ``key_max`` (B, H), the running key maximum to carry to the next call (causal), or None."""

    query: torch.Tensor
    key: torch.Tensor
    log_gates: torch.Tensor | None = None
    log_scale: torch.Tensor | None = None
    key_max: torch.Tensor | None = None


class FeatureMap(Reinitialisable):
    """Base class: the identity map. Subclasses override ``forward`` and, if the width changes, ``output_dim``;
    one with parameters or buffers gives their values in ``initial_values()``.

    The contract of ``forward(x)``: x (B, H, N, D) in the projections' dtype, often a strided view (q and k are
    views of one joined projection, tokens first in memory), never to be written into (``in_place`` may); it returns
    a new tensor (B, H, N, m) in any layout and, under autocast, any float dtype (the path takes the layout and dtype
    it is given). A plain function of x (``F.softplus(x)``) meets it, eagerly and compiled: compiled, the path hands
    such a map contiguous q and k (the copy fused into the map), because an elementwise op's backward on a strided
    view can come out in other strides than the compiler traced (its decomposition's), and a view of the gradient
    then fails; a map whose compiled form was tested on the strided views says ``compiles_on_strided_inputs``."""

    compiles_on_strided_inputs = False

    def __init__(self, input_dim: int):
        super().__init__()
        self.input_dim = input_dim

    @property
    def output_dim(self) -> int:
        return self.input_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reference(self, x: torch.Tensor, head: int) -> torch.Tensor:
        """phi of one head's queries or keys x (N, D) float64 -> (N, m), from the map's formula written apart from
        ``forward`` (the tests hold every registered map's layers to it, an O(N^2) sweep). The base map's: the
        identity; a map that overrides ``forward`` gives its own."""
        if type(self).forward is not FeatureMap.forward:
            raise NotImplementedError(f"{type(self).__name__} overrides forward but gives no reference formula")
        return x

    def redraw(self):
        """Called once per training step by the model (or a standalone layer); random maps redraw here."""

    def in_place(self, x: torch.Tensor) -> torch.Tensor:
        """phi(x), written into x where the map can; this default returns a new tensor."""
        return self(x)

    def features(self, q, k, mask=None, causal=False, key_max=None, documents=None, reuse_inputs=False) -> Features:
        """phi(q), phi(k) with padded keys (``mask`` (B, N) bool, False = padding) zeroed. ``documents`` (B, N)
        numbers the documents of a packed row (0 continues the previous call's), or is None. ``reuse_inputs``:
        q and k are the caller's temporaries, which the map may overwrite (``in_place``) when no gradient is
        wanted: two full-size allocations fewer in evaluation and decoding. Not while compiling: the compiler plans
        the buffers itself, and a write into a strided view of the projections breaks its graph."""
        compiling = torch.compiler.is_compiling()
        if reuse_inputs and not wants_gradient(q, k) and not compiling:
            fq, fk = self.in_place(q), self.in_place(k)
        elif compiling and not self.compiles_on_strided_inputs:  # see the class's contract
            fq, fk = self.of_both(q.contiguous(), k.contiguous())
        else:
            fq, fk = self.of_both(q, k)
        if mask is not None:
            fk = fk.masked_fill(~mask[:, None, :, None], 0.0)
        return Features(fq, fk)

    def of_both(self, q, k) -> tuple:
        """(phi(q), phi(k)); a map that can compute both in one call (one autograd Function, not two) overrides
        it, and takes that call only where no hook on the map would be passed by (``unhooked``)."""
        return self(q), self(k)

    def unhooked(self) -> bool:
        """Whether no forward hook, of this map or global, would run if the map were not called as a module."""
        hooks = nn.modules.module
        return not (self._forward_hooks or self._forward_pre_hooks or hooks._global_forward_hooks) and not (
            hooks._global_forward_pre_hooks
        )


ELEMENTWISE_BLOCK = 1 << 18  # elements ``shifted_elu`` handles at a time: 1 MB in float32, so its passes stay in cache
FEW_ELEMENTS = 1 << 12  # below this (a decoding step) ``shifted_elu`` takes elu and an add: 2 ops, 10 us, not 4, 44


def in_memory_order(x: torch.Tensor) -> torch.Tensor | None:
    """x's elements as a 1-D view, in the order they lie in memory; None where x has gaps or overlaps."""
    order = sorted(range(x.dim()), key=x.stride, reverse=True)
    permuted = x.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else None


def shifted_elu(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """1 + elu(x) = max(x, 0) + exp(min(x, 0)), into ``out`` (x itself is allowed; by default a new tensor in x's
    memory layout: the chunked products copy a block at a time into theirs). A block of memory at a time, so that
    its three passes stay in cache: ATen's elu goes through expm1, which took twice as long (13 against 6.4 ms
    for 8M floats on a CPU). Below ``FEW_ELEMENTS`` (a decoding step's features), elu and an add, as on a GPU:
    there the ops' fixed cost dominates."""
    out = torch.empty_like(x) if out is None else out
    if not x.is_cpu or x.numel() < FEW_ELEMENTS:
        return torch.add(F.elu(x), 1.0, out=out)
    source, target = in_memory_order(x), in_memory_order(out)
    if source is None or target is None or x.stride() != out.stride():  # blocks are for a CPU's caches
        return torch.add(F.elu(x), 1.0, out=out)
    below = x.new_empty(min(ELEMENTWISE_BLOCK, source.numel()))  # one buffer: a fresh one per block is faulted in
    for start in range(0, source.numel(), ELEMENTWISE_BLOCK):
        block, block_out = source[start : start + ELEMENTWISE_BLOCK], target[start : start + ELEMENTWISE_BLOCK]
        exp_below = torch.clamp(block, max=0.0, out=below[: block.numel()]).exp_()
        torch.clamp(block, min=0.0, out=block_out).add_(exp_below)
    return out


class ShiftedElu(torch.autograd.Function):
    """``shifted_elu`` of each of its inputs (queries and keys in one call), saving only the outputs: the derivative
    is min(1 + elu(x), 1)."""

    @staticmethod
    def forward(ctx, *inputs):
        outputs = tuple(map(shifted_elu, inputs))
        ctx.save_for_backward(*outputs)
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return tuple(map(ShiftedElu.input_gradient, grads, ctx.saved_tensors))

    @staticmethod
    def input_gradient(grad, out):
        """grad * min(out, 1) (None for an unused output's None), into one new tensor, a block of memory at a time on
        a CPU where grad and out share a layout."""
        if grad is None:
            return None
        result = torch.empty_like(out)
        if not out.is_cpu or out.numel() < FEW_ELEMENTS or grad.stride() != out.stride():
            return torch.clamp(out, max=1.0, out=result).mul_(grad)
        slope, source, target = in_memory_order(out), in_memory_order(grad), in_memory_order(result)
        if slope is None or source is None or target is None:
            return torch.clamp(out, max=1.0, out=result).mul_(grad)
        for start in range(0, slope.numel(), ELEMENTWISE_BLOCK):
            block = slice(start, start + ELEMENTWISE_BLOCK)
            torch.clamp(slope[block], max=1.0, out=target[block]).mul_(source[block])
        return result


class EluFeatureMap(FeatureMap):
    """phi(x) = 1 + elu(x) (Katharopoulos et al. 2020, eq. 7), the LRPE paper's baseline kernel."""

    compiles_on_strided_inputs = True

    def forward(self, x):
        if torch.compiler.is_compiling():  # plain ops, which the compiler fuses and differentiates (not elu's
            return x.clamp_min(0.0) + x.clamp_max(0.0).exp()  # backward: its strides disagree with its meta's)
        return ShiftedElu.apply(x)[0] if wants_gradient(x) else shifted_elu(x)

    def of_both(self, q, k):
        if wants_gradient(q, k) and not torch.compiler.is_compiling() and self.unhooked():
            return ShiftedElu.apply(q, k)
        return self(q), self(k)

    def in_place(self, x):
        return shifted_elu(x, out=x)

    def reference(self, x, head):
        return torch.where(x > 0, x + 1, torch.exp(x))


def shifted_relu(x: torch.Tensor, eps: float) -> torch.Tensor:
    """max(x, 0) + eps, in the memory layout of x (as ``shifted_elu``)."""
    return F.relu(x).add_(eps)


class ShiftedRelu(torch.autograd.Function):
    """``shifted_relu`` saving a one-byte mask of x > 0 for backward, not a float tensor."""

    @staticmethod
    def forward(ctx, x, eps):
        ctx.save_for_backward(x > 0)
        return shifted_relu(x, eps)

    @staticmethod
    def backward(ctx, grad):
        (positive,) = ctx.saved_tensors
        return grad * positive, None


class ReluFeatureMap(FeatureMap):
    """phi(x) = max(x, 0) + eps (PermuteFormer eq. 15, eps = 1e-3)."""

    compiles_on_strided_inputs = True

    def __init__(self, input_dim: int, eps: float = 1e-3):
        super().__init__(input_dim)
        if eps < 0:
            raise ValueError(f"relu_eps must be >= 0, got {eps}")
        self.eps = eps

    def forward(self, x):
        if wants_gradient(x):
            return ShiftedRelu.apply(x, self.eps)
        return shifted_relu(x, self.eps)

    def in_place(self, x):
        return F.relu_(x).add_(self.eps)

    def reference(self, x, head):
        return torch.clamp(x, min=0) + self.eps


class DPFPFeatureMap(FeatureMap):
    """Deterministic parameter-free projection (Schlag et al. 2021, eq. 37-38): width 2 * D * nu.

    r = [relu(x), relu(-x)]; phi(x) = concat_{i=1..nu} r * roll(r, i).
    """

    compiles_on_strided_inputs = True

    def __init__(self, input_dim: int, nu: int = 1):
        super().__init__(input_dim)
        if not 1 <= nu < 2 * input_dim:
            raise ValueError(f"dpfp_nu must be in [1, {2 * input_dim - 1}] for head dimension {input_dim}, got {nu}")
        self.nu = nu

    @property
    def output_dim(self):
        return 2 * self.input_dim * self.nu

    def forward(self, x):
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
        return torch.cat([r * r.roll(shifts=i, dims=-1) for i in range(1, self.nu + 1)], dim=-1)

    def reference(self, x, head):  # r_j r_{j - i} for each shift i, by explicit indices
        r = torch.cat([x.clamp(min=0), (-x).clamp(min=0)], dim=-1)
        n = r.shape[-1]
        return torch.cat([r * r[..., [(j - i) % n for j in range(n)]] for i in range(1, self.nu + 1)], dim=-1)


class ExponentialFeatureMap(FeatureMap):
    """phi(x) = exp(log_features(x)), computed with the stabiliser described in the module docstring."""

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x):
        return self.log_features(x).exp()  # unstabilised: for references and small inputs

    def features(self, q, k, mask=None, causal=False, key_max=None, documents=None, reuse_inputs=False) -> Features:
        # the running maximum makes the causal product gated: off fla's device heads-first and contiguous from here on
        # (the torch path's gated products copy their inputs to this layout once, and keep the copies, unless they
        # are so already); fla's kernels read the projections' tokens-first layout in place
        lq, lk = self.log_features(q), self.log_features(k)
        if not kernel_backend_serves(q):
            lq, lk = lq.contiguous(), lk.contiguous()
        query_max = lq.amax(-1, keepdim=True).detach()
        fq = (lq - query_max).exp()
        wide = torch.promote_types(lk.dtype, torch.float32)
        token_max = lk.amax(-1).detach().to(wide)  # (B, H, N)
        if mask is not None:
            token_max = token_max.masked_fill(~mask[:, None], float("-inf"))
        gates, carried = None, None
        if causal:
            # Keys are divided by exp(running maximum); each growth of the maximum rescales the past by a log
            # gate <= 0. Only keys up to s set the scale of output s: no future token leaks in. A new document
            # starts its own maximum (an offset of 1e6 per document, exact in float64, separates them).
            previous = key_max if key_max is not None else token_max[..., 0]
            sequence = torch.cat([previous[..., None], token_max], dim=-1)
            if documents is None:
                running = torch.cummax(sequence, dim=-1).values
            else:
                offset = 1e6 * torch.cat([documents[:, :1] * 0, documents], dim=-1)[:, None].double()
                running = (torch.cummax(sequence.double() + offset, dim=-1).values - offset).to(wide)
            carried = running[..., -1]  # -inf while a row has seen no real key: its maximum is still unset
            finite = running.isfinite()
            first = running.masked_fill(~finite, float("inf")).amin(-1, keepdim=True)  # the first real key
            running = torch.where(finite, running, first.masked_fill(first.isinf(), 0.0))
            gates = running[..., :-1] - running[..., 1:]
            key_scale = running[..., 1:]
        elif documents is None:
            key_scale = token_max.amax(-1, keepdim=True)
            key_scale = key_scale.masked_fill(key_scale.isinf(), 0.0).expand_as(token_max)
        else:  # the maximum over each document's keys
            index = documents[:, None].expand_as(token_max)
            per_document = token_max.new_full(token_max.shape, float("-inf")).scatter_reduce(
                -1, index, token_max, "amax"
            )
            key_scale = per_document.gather(-1, index)
            key_scale = key_scale.masked_fill(key_scale.isinf(), 0.0)
        fk = (lk - key_scale[..., None].to(lk.dtype)).exp()
        if mask is not None:
            fk = fk.masked_fill(~mask[:, None, :, None], 0.0)
        log_scale = query_max.to(wide) + key_scale[..., None]
        return Features(fq, fk, gates, log_scale, carried)


class ExpFeatureMap(ExponentialFeatureMap):
    """phi(x) = exp(x): the shift-invariant kernel function (SIKF) of FastRPB (eq. 9)."""

    def log_features(self, x):
        return x

    def reference(self, x, head):
        return torch.exp(x)


class PerformerFeatureMap(ExponentialFeatureMap):
    """FAVOR+ positive orthogonal random features (Choromanski et al. 2021, Lemma 1 and section 2.4).

    phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m) with x' = x / D^(1/4), so that E[phi(q) . phi(k)] = exp(q . k / sqrt(D)).
    W (m x D) stacks orthogonal blocks whose rows are uniform on the sphere (Haar: the Q of a Gaussian matrix's
    QR with the signs fixed by diag(R)), rescaled to chi(D)-distributed norms, so that each row is marginally
    N(0, I). It is a buffer: saved with the model and fixed in eval mode. With ``redraw=True`` it is redrawn
    once per training step (by the model before its layers run, so gradient checkpointing replays the same
    features; by the layer itself when standalone).
    """

    def __init__(self, input_dim: int, num_features: int | None = None, redraw: bool = False, seed: int = 0):
        super().__init__(input_dim)
        if num_features is not None and num_features < 1:
            raise ValueError(f"performer_features must be a positive integer, got {num_features}")
        self.num_features = num_features or input_dim
        self.redraw_in_training, self.seed = redraw, seed
        # redrawn features are part of the trained model: save them; the seeded first draw follows from the config
        self.register_initial_values(persistent=("projection",) if redraw else ())

    def initial_values(self):
        """The first projection, drawn from ``seed``; redraws in training use torch's global generator."""
        return {"projection": self.draw_projection(generator=seeded_generator(self.seed, self.input_dim))}

    @property
    def output_dim(self):
        return self.num_features

    def draw_projection(self, device=None, generator=None) -> torch.Tensor:
        """(m, D) orthogonal random features."""
        if generator is not None:
            device = "cpu"
        blocks, remaining = [], self.num_features
        while remaining > 0:
            gaussian = torch.randn(self.input_dim, self.input_dim, device=device, generator=generator)
            orthogonal, upper = torch.linalg.qr(gaussian)
            orthogonal = orthogonal * torch.sign(torch.diagonal(upper))[None, :]  # Haar-distributed columns
            blocks.append(orthogonal.T[: min(remaining, self.input_dim)])
            remaining -= self.input_dim
        norms = torch.randn(self.num_features, self.input_dim, device=device, generator=generator).norm(
            dim=-1, keepdim=True
        )
        return torch.cat(blocks) * norms

    @torch.no_grad()
    def redraw_projection(self):
        self.projection.copy_(self.draw_projection(self.projection.device))

    def redraw(self):
        if self.redraw_in_training:
            self.redraw_projection()

    def log_features(self, x):
        x = x * self.input_dim**-0.25
        projected = x @ self.projection.to(x.dtype).T
        return projected - 0.5 * x.pow(2).sum(-1, keepdim=True) - 0.5 * math.log(self.num_features)

    def reference(self, x, head):  # Lemma 1: exp(W x' - |x'|^2 / 2) / sqrt(m), x' = x / D^(1/4)
        w = self.projection.double()
        scaled = x / x.shape[-1] ** 0.25
        return torch.exp(scaled @ w.T - (scaled**2).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])


class HedgehogFeatureMap(FeatureMap):
    """phi(x) = [softmax(W_h x), softmax(-W_h x)] with a learned map W_h per head, initialised to the identity
    (Zhang et al. 2024, "The Hedgehog & the Porcupine", section 4.1): spiky, non-negative features that can be
    trained to mimic softmax attention. Width 2 D."""

    compiles_on_strided_inputs = True

    def __init__(self, input_dim: int, num_heads: int):
        super().__init__(input_dim)
        self.num_heads = num_heads
        self.register_initial_values(trainable={"weight": True})

    def initial_values(self):
        return {"weight": torch.eye(self.input_dim).repeat(self.num_heads, 1, 1)}  # (H, D, D)

    @property
    def output_dim(self):
        return 2 * self.input_dim

    def forward(self, x):  # (B, H, N, D)
        y = torch.einsum("bhnd,hde->bhne", x, self.weight.to(x.dtype))
        return torch.cat([y.softmax(-1), (-y).softmax(-1)], dim=-1)

    def reference(self, x, head):  # [softmax(W x), softmax(-W x)]
        y = x @ self.weight[head].double()
        return torch.cat([torch.softmax(y, -1), torch.softmax(-y, -1)], dim=-1)


class T2RFeatureMap(FeatureMap):
    """phi(x) = relu(W_h x + b_h), a learned single-layer ReLU map per head (Kasai et al. 2021, "Finetuning
    Pretrained Transformers into RNNs", eq. 5), with m = ``num_features`` outputs (default D)."""

    compiles_on_strided_inputs = True

    def __init__(self, input_dim: int, num_heads: int, num_features: int | None = None):
        super().__init__(input_dim)
        self.num_heads, self.num_features = num_heads, num_features or input_dim
        self.register_initial_values(trainable={"weight": True, "bias": True})

    def initial_values(self):
        weight = torch.randn(self.num_heads, self.input_dim, self.num_features) / self.input_dim**0.5
        return {"weight": weight, "bias": torch.zeros(self.num_heads, self.num_features)}

    @property
    def output_dim(self):
        return self.num_features

    def forward(self, x):  # (B, H, N, D)
        y = torch.einsum("bhnd,hdm->bhnm", x, self.weight.to(x.dtype)) + self.bias.to(x.dtype)[:, None]
        return F.relu(y)

    def reference(self, x, head):  # relu(W x + b)
        return torch.clamp(x @ self.weight[head].double() + self.bias[head].double(), min=0)
