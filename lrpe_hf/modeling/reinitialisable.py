"""Modules that can re-create their own parameters and buffers.

A model built on the meta device (``from_pretrained``, accelerate's ``init_empty_weights``, FSDP) holds empty
tensors until they are loaded or initialised. Transformers' ``init_weights`` calls the model's ``_init_weights``
on every module; for these modules that calls ``reset_parameters``, which writes the values of
``initial_values()`` in place and leaves alone what a checkpoint already loaded (``transformers.initialization``
checks each tensor's ``_is_hf_initialized`` flag). Random tables that are buffers draw from a seeded generator,
so that they are re-created identically.

Buffers are not saved in checkpoints unless a module says so (``persistent``): they follow from the config, and
sharded loading (accelerate's FSDP2 ``cpu_ram_efficient_loading``) only handles sharded tensors in a state dict.
"""

import torch
from torch import nn
from transformers import initialization as init


class Reinitialisable(nn.Module):
    """Base class: ``initial_values()`` gives each parameter and buffer of the module itself (not its children)."""

    def initial_values(self) -> dict[str, torch.Tensor]:
        return {}

    def register_initial_values(self, trainable: dict[str, bool] | None = None, persistent: tuple[str, ...] = ()):
        """Register every initial value: as a parameter when ``trainable`` names it (with that requires_grad),
        else as a buffer, saved with the model only when ``persistent`` names it."""
        trainable = trainable or {}
        for name, value in self.initial_values().items():
            if name in trainable:
                setattr(self, name, nn.Parameter(value, requires_grad=trainable[name]))
            else:
                self.register_buffer(name, value, persistent=name in persistent)

    @torch.no_grad()
    def reset_parameters(self):
        for name, value in self.initial_values().items():
            tensor = getattr(self, name)
            init.copy_(tensor, value.to(device=tensor.device, dtype=tensor.dtype))


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded by a tuple of integers (a seed and, e.g., a head index)."""
    state = 0
    for value in key:
        state = (state * 6364136223846793005 + int(value) + 1442695040888963407) % (2**63)
    return torch.Generator(device="cpu").manual_seed(state)


def unrestorable_buffers(module: nn.Module) -> list[str]:
    """The buffers of ``module`` and its children that ``from_pretrained`` would leave as uninitialised memory: not
    saved with the weights (``persistent=False``) and not given by their module's ``initial_values()``."""
    unrestorable = []
    for prefix, child in module.named_modules():
        not_saved = [name for name in child._non_persistent_buffers_set if child._buffers.get(name) is not None]
        if not not_saved:
            continue
        declared = child.initial_values() if isinstance(child, Reinitialisable) else {}
        unrestorable += [f"{prefix}.{name}" if prefix else name for name in not_saved if name not in declared]
    return unrestorable


def refuse_unrestorable_buffers(module: nn.Module, what: str):
    """Raise where ``module`` (a registered component, ``what`` naming it) keeps a buffer that a model loaded with
    ``from_pretrained`` would not get back."""
    unrestorable = unrestorable_buffers(module)
    if unrestorable:
        raise ValueError(
            f"{what} keeps buffer(s) {', '.join(unrestorable)} that a model loaded with from_pretrained would hold as "
            "uninitialised memory: not saved with the weights (persistent=False) and not given by the module's "
            "initial_values(). Return each from initial_values() and call self.register_initial_values() in "
            "__init__ (lrpe_hf.PositionalEncoding and lrpe_hf.FeatureMap support both), or register it with "
            "persistent=True (docs/extending.md)"
        )
