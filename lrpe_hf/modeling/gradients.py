"""When the custom autograd Functions run: only where a gradient is wanted. Without one (decoding, evaluation)
the plain computation runs, without a Function's bookkeeping or its saved tensors."""

import torch


def wants_gradient(*inputs) -> bool:
    """Whether autograd is recording and any of ``inputs`` (tensors, numbers or None) requires a gradient."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write), or None for an inference tensor, which has
    none: a value cached from it is then never reused."""
    return None if tensor.is_inference() else tensor._version
