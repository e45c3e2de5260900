"""Tensors made once and kept. Small constants (``kept_tensor``): the triangles of ones of the chunked prefix sums,
the unit modulus of the rotations' ``torch.polar``, the zero of ``row_dot``'s product. Values derived from parameters
that want no gradient (``KeptUntilChanged``): a normalised vector, a table of rates, a log of decays, SPE's seeded
products. Values derived from an input that every layer of a forward pass receives (``KeptForInput``): fixed
rotations of the positions, the positions in turns. On a GPU each one made afresh is a kernel launch per call (or a
host read)."""

import operator
import weakref

import torch

from .gradients import version_of

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


class KeptUntilChanged:
    """Values derived from some source tensors, each made once and again only after a source changes: another
    tensor object, or the same one written in place, moved or given other data (``version_of``). Nothing is reused
    from a source without a version (an inference tensor, a fake one). Made outside ``torch.inference_mode``: a
    later training step may save them for backward. ``key`` tells apart values derived from the same sources.
    Callers make the value directly where a gradient is wanted or while compiling (the compiler reads no version
    counters, and fuses the derivation)."""

    def __init__(self):
        self.sources, self.versions, self.values = (), (), {}

    def get(self, sources: tuple, derive, key=None):
        versions = tuple(map(version_of, sources))
        same = len(sources) == len(self.sources) and all(map(operator.is_, sources, self.sources))
        if not same or None in versions or versions != self.versions:
            self.sources, self.versions, self.values = sources, versions, {}
        if key not in self.values:
            with torch.inference_mode(False):
                self.values[key] = derive()
        return self.values[key]


class KeptForInput:
    """One value derived from an input tensor that each layer of a forward pass receives as its own view (the
    positions, each layer's view of the model's ``position_ids``): made by the first layer, taken by the others. The
    input is the same while its root tensor (the one all views share, held by a weak reference) is the same object,
    unchanged since (``version_of``) and viewed the same way (shape, strides, offset); ``key`` tells apart values
    derived from it. One value is kept at a time, the last one made, so a model's next forward pass replaces it.
    Made afresh and not kept while compiling, for an inference tensor (no version counter) and for a tensor
    subclass; made outside ``torch.inference_mode`` (a later training step may save it for backward)."""

    def __init__(self):
        self.entry = None  # (weak reference to the root, its version, the view and the key, the value)

    def get(self, tensor: torch.Tensor, key, derive):
        root = tensor if tensor._base is None else tensor._base
        version = None if torch.compiler.is_compiling() or type(tensor) is not torch.Tensor else version_of(root)
        if version is None:
            return derive()
        view = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), key)
        entry = self.entry
        if entry is not None and entry[0]() is root and entry[1] == version and entry[2] == view:
            return entry[3]
        with torch.inference_mode(False):
            value = derive()
        self.entry = (weakref.ref(root), version, view, value)
        return value
