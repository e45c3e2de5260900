"""Kernel feature maps phi: R^D -> R^m for linear attention.

Every map works per head on tensors of shape (batch, heads, tokens, D) and returns (batch, heads, tokens, m)
with m = ``output_dim``. All features are non-negative.

Exponential maps (``exp``/SIKF and ``performer``/FAVOR+) expose ``log_features`` instead of plain features:
the attention layer subtracts a stabiliser before exponentiating (a per-query maximum, and for keys a
maximum over the keys seen so far), which keeps exp() finite without changing the attention weights.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F


class FeatureMap(nn.Module):
    """Base class. ``is_exponential`` maps implement ``log_features``; the others implement ``forward``."""

    is_exponential = False

    def __init__(self, input_dim: int):
        super().__init__()
        self.input_dim = input_dim

    @property
    def output_dim(self) -> int:
        return self.input_dim

    def log_features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} is not an exponential feature map")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Plain features of an exponential map, without stabilisation (for references and small inputs).
        return self.log_features(x).exp()


class EluFeatureMap(FeatureMap):
    """phi(x) = 1 + elu(x) (Katharopoulos et al.), the LRPE paper's baseline kernel."""

    def forward(self, x):
        return F.elu(x) + 1.0


class ReluFeatureMap(FeatureMap):
    """phi(x) = max(x, 0) + eps (PermuteFormer eq. 15, eps = 1e-3)."""

    def __init__(self, input_dim: int, eps: float = 1e-3):
        super().__init__(input_dim)
        self.eps = eps

    def forward(self, x):
        return F.relu(x) + self.eps


class ExpFeatureMap(FeatureMap):
    """phi(x) = exp(x): the shift-invariant kernel function (SIKF) of FastRPB."""

    is_exponential = True

    def log_features(self, x):
        return x


class DPFPFeatureMap(FeatureMap):
    """Deterministic parameter-free projection (Schlag et al.): width 2 * D * nu.

    r = [relu(x), relu(-x)]; phi(x) = concat_{i=1..nu} r * roll(r, i).
    """

    def __init__(self, input_dim: int, nu: int = 1):
        super().__init__(input_dim)
        if nu < 1 or nu >= 2 * input_dim:
            raise ValueError(f"dpfp_nu must be in [1, {2 * input_dim - 1}] for head dimension {input_dim}, got {nu}")
        self.nu = nu

    @property
    def output_dim(self):
        return 2 * self.input_dim * self.nu

    def forward(self, x):
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
        return torch.cat([r * r.roll(shifts=i, dims=-1) for i in range(1, self.nu + 1)], dim=-1)


class PerformerFeatureMap(FeatureMap):
    """FAVOR+ positive orthogonal random features (Choromanski et al.).

    phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m) with x' = x / D^(1/4), so that E[phi(q) . phi(k)] = exp(q . k / sqrt(D)).
    W (m x D) has orthogonal blocks of Gaussian rows rescaled to chi-distributed norms. It is a buffer: saved
    with the model and fixed in eval mode. With ``redraw=True`` the owner of the layer calls ``redraw_projection``
    once per training step (the attention layer does it itself when standalone; a model does it before its
    layers run, so that gradient checkpointing replays the same features).
    """

    is_exponential = True

    def __init__(self, input_dim: int, num_features: int | None = None, redraw: bool = False):
        super().__init__(input_dim)
        self.num_features = num_features or input_dim
        self.redraw = redraw
        self.register_buffer("projection", self.draw_projection(), persistent=True)

    @property
    def output_dim(self):
        return self.num_features

    def draw_projection(self, device=None) -> torch.Tensor:
        """(m, D) orthogonal random features."""
        blocks, remaining = [], self.num_features
        while remaining > 0:
            gaussian = torch.randn(self.input_dim, self.input_dim, device=device)
            orthogonal, _ = torch.linalg.qr(gaussian)
            blocks.append(orthogonal.T[: min(remaining, self.input_dim)])
            remaining -= self.input_dim
        norms = torch.randn(self.num_features, self.input_dim, device=device).norm(dim=-1, keepdim=True)
        return torch.cat(blocks) * norms

    @torch.no_grad()
    def redraw_projection(self):
        self.projection.copy_(self.draw_projection(self.projection.device))

    def log_features(self, x):
        x = x * self.input_dim**-0.25
        projected = x @ self.projection.to(x.dtype).T
        return projected - 0.5 * x.pow(2).sum(-1, keepdim=True) - 0.5 * math.log(self.num_features)


FEATURE_MAPS = ("elu", "relu", "exp", "dpfp", "performer")


def build_feature_map(
    name: str, input_dim: int, *, relu_eps=1e-3, dpfp_nu=1, performer_features=None, performer_redraw=False
) -> FeatureMap:
    if name == "elu":
        return EluFeatureMap(input_dim)
    if name == "relu":
        return ReluFeatureMap(input_dim, relu_eps)
    if name == "exp":
        return ExpFeatureMap(input_dim)
    if name == "dpfp":
        return DPFPFeatureMap(input_dim, dpfp_nu)
    if name == "performer":
        return PerformerFeatureMap(input_dim, performer_features, performer_redraw)
    raise ValueError(f"Unknown feature_map {name!r}; valid feature maps: {', '.join(FEATURE_MAPS)}")
