"""When the custom autograd Functions run: only where a gradient is wanted. Without one (decoding, evaluation)
the plain computation runs, without a Function's bookkeeping or its saved tensors."""

import torch
from torch._subclasses.fake_tensor import FakeTensor


def wants_gradient(*inputs) -> bool:
    """Whether autograd is recording and any of ``inputs`` (tensors, numbers or None) requires a gradient. A plain
    loop: asked several times a layer, where a generator's frames were most of its host cost."""
    if not torch.is_grad_enabled():
        return False
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return True
    return False


def version_of(tensor: torch.Tensor):
    """What a value cached from ``tensor`` is valid for: its version counter (bumped by every in-place write), dtype,
    device and memory (``module.to()`` and ``.data =`` swap a parameter's data, keeping the object and its version).
    None where there is no such thing (an inference tensor has no version counter, a fake one no memory): a value
    cached from it is then never reused."""
    if tensor.is_inference() or isinstance(tensor, FakeTensor):
        return None
    return tensor._version, tensor.dtype, tensor.device, tensor.data_ptr()
