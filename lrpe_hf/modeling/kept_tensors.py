"""Small constant tensors made once and kept: the triangles of ones of the chunked prefix sums, the unit modulus of
the rotations' ``torch.polar``. On a GPU each one made afresh is a kernel launch per call."""

import torch

_KEPT = {}  # (name, dtype, device) -> the tensor


def kept_tensor(name: str, like: torch.Tensor, make) -> torch.Tensor:
    """``make()`` (a tensor in ``like``'s dtype and on its device), made once per ``name``, dtype and device and
    kept. Made outside ``torch.inference_mode`` (a later training step may save it for backward). Made afresh and
    not kept while compiling (the compiler folds it) and where ``like`` is not a plain tensor (a fake tensor of a
    shape-only run, a tensor subclass): a kept real tensor must not meet those."""
    if torch.compiler.is_compiling() or type(like) is not torch.Tensor:
        return make()
    key = (name, like.dtype, like.device)
    tensor = _KEPT.get(key)
    if tensor is None:
        with torch.inference_mode(False):
            tensor = _KEPT[key] = make()
    return tensor
