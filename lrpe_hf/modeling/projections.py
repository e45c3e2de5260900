"""The attention layer's input projections: q, k and v from the hidden states, in training as one product by the
projections' weights joined (one GEMM forward and one of each kind backward, where three projections take three of
each and two sums of the input's gradients)."""

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


def project(projections, hidden_states, keep_views: bool = False) -> tuple:
    """Each projection (``nn.Linear``, 2 or 3 of them: q, k and maybe v) of hidden_states (B, N, d), each output
    (B, N, its width): joined where ``joinable``, each its own product otherwise. A joined v (the third) is copied
    into memory of its own: the products keep v for backward, and a view would keep q's and k's columns alive with
    it (3x the memory); fla's path would make that copy anyway. Not with ``keep_views``, where the encoding keeps q
    and k themselves (``keeps_query_key``): their columns stay alive then, and a copy would keep one v more."""
    if not joinable(projections):
        return tuple(projection(hidden_states) for projection in projections)
    outputs = joined_projections(projections, hidden_states).split([p.out_features for p in projections], dim=-1)
    if len(projections) == 3 and not keep_views:
        return (*outputs[:2], outputs[2].contiguous())
    return outputs


def joinable(projections) -> bool:
    """Whether ``joined_projections`` computes these projections: in training (a weight wants its gradient), for
    plain ``nn.Linear`` layers (not adapters) with plain weights (not quantised or sharded: a shape-only run's fakes
    are plain) and no hooks of their own or global ones, one dtype and device, and biases all or none."""
    if not torch.is_grad_enabled() or nn.modules.module._global_forward_hooks:
        return False
    if nn.modules.module._global_forward_pre_hooks:
        return False
    first = projections[0]
    dtype, device, unbiased = first.weight.dtype, first.weight.device, first.bias is None
    wanted = False
    for projection in projections:  # a plain loop: asked at every training forward of every layer
        if type(projection) is not nn.Linear or projection._forward_hooks or projection._forward_pre_hooks:
            return False
        weight = projection.weight
        if type(weight) is not nn.Parameter and not isinstance(weight, FakeTensor):
            return False
        if weight.dtype != dtype or weight.device != device or (projection.bias is None) != unbiased:
            return False
        wanted = wanted or weight.requires_grad
    return wanted


def joined_projections(projections, x):
    """x (B, N, d) through the projections' weights joined into one (sum of outs, d): one product forward and one
    of each kind backward (the input's gradient, the weights', the biases'), where three projections take three of
    each and two sums of the input's gradients; the joining copy is of the weights, not of the activations.
    Returns (B, N, sum of outs): the projections' outputs side by side."""
    weight = torch.cat([p.weight for p in projections])
    bias = None if projections[0].bias is None else torch.cat([p.bias for p in projections])
    return nn.functional.linear(x, weight, bias)
