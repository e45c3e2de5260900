"""Host reads counted on the CPU: the ops of a step that would make a GPU's host wait for the device.

On a GPU, every op that reads a tensor's value on the host (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``) or
makes a shape from values (``nonzero``, ``masked_select``, boolean indexing, ``unique``...) waits for every kernel
queued before it: the host stops feeding the device, and a CUDA graph cannot hold the step. A
``TorchDispatchMode`` sees every ATen op of a step on the CPU too, so these can be counted there and traced to
their line. ``.tolist()`` and ``.numpy()`` read without an ATen op; they are counted by wrapping them.

Where each read happens matters: ``HostReads`` records whether a ``LinearTransformerLayer`` was running (its
forward, or any backward: the layers' custom autograd Functions) and the innermost frames of the library. Reads
inside ``positions.check_values`` are listed apart (``device_checks``): on a GPU and in compiled graphs that
check runs on the device (``torch._assert_async``), and only a CPU reads it on the host, where a read costs
nothing.
"""

import collections
import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops that read a value on the host or make a shape from values
READING_OPS = {
    "_local_scalar_dense", "is_nonzero", "item", "equal", "nonzero", "nonzero_static", "argwhere", "masked_select",
    "masked_scatter", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount", "histc",
    "repeat_interleave",
}  # fmt: skip


def reads_values(func, args, kwargs) -> bool:
    """Whether the ATen op ``func`` called with ``args`` reads values on the host."""
    name = func._schema.name.split("::")[-1]
    if name == "repeat_interleave":  # a tensor of repeats: the output's length is read from it, unless given
        return func._overloadname in ("Tensor", "self_Tensor") and (kwargs or {}).get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # boolean indices select by value
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return name in READING_OPS


class HostReads(TorchDispatchMode):
    """Counts host reads while active (``with HostReads() as reads:``). ``reads``: a Counter of (op, where, inside a
    layer) -> count, ``where`` the library's innermost frames; ``inside_layers()``, ``outside_layers()`` and
    ``device_checks()`` sum them."""

    def __init__(self, library: str = "lrpe_hf"):
        super().__init__()
        self.library = library
        self.reads = collections.Counter()
        self.layer_depth = 0
        self.in_backward = False
        self._hooks = []
        self._patched = contextlib.ExitStack()

    def watch(self, model: torch.nn.Module) -> "HostReads":
        """Mark the forwards of ``model``'s ``LinearTransformerLayer``s as inside the layers."""
        for module in model.modules():
            if type(module).__name__ == "LinearTransformerLayer":
                self._hooks.append(module.register_forward_pre_hook(self._enter))
                self._hooks.append(module.register_forward_hook(self._leave))
        return self

    def _enter(self, module, args):
        self.layer_depth += 1

    def _leave(self, module, args, output):
        self.layer_depth -= 1

    def backward(self, loss: torch.Tensor):
        """``loss.backward()``, its reads counted as inside the layers (the model's backward is theirs but for a
        few ops of the loss, which read nothing)."""
        self.in_backward = True
        try:
            loss.backward()
        finally:
            self.in_backward = False

    def __enter__(self):
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched.enter_context(_patched(torch.Tensor, name, self._wrap(name, original)))
        return super().__enter__()

    def __exit__(self, *exc):
        self._patched.close()
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def _wrap(self, name, original):
        def reading(tensor, *args, **kwargs):
            self.record(name)
            return original(tensor, *args, **kwargs)

        return reading

    def record(self, op: str):
        frames = [f for f in traceback.extract_stack() if f"/{self.library}/" in f.filename]
        where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:3])
        inside = self.layer_depth > 0 or self.in_backward
        self.reads[(op, where or "(outside the library)", inside)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if reads_values(func, args, kwargs):
            self.record(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))

    def device_checks(self) -> int:
        return sum(n for (_, where, _), n in self.reads.items() if " check_values" in where.split(" < ")[0])

    def inside_layers(self) -> collections.Counter:
        """The reads inside the layers that are not device checks."""
        return collections.Counter(
            {key: n for key, n in self.reads.items() if key[2] and " check_values" not in key[1].split(" < ")[0]}
        )

    def outside_layers(self) -> collections.Counter:
        """The reads outside the layers (the model's entry) that are not device checks."""
        return collections.Counter(
            {key: n for key, n in self.reads.items() if not key[2] and " check_values" not in key[1].split(" < ")[0]}
        )


@contextlib.contextmanager
def _patched(owner, name, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)
