"""How the projections' weights lie in memory for decoding's one-row products.

A decoding step multiplies one row per sequence by every projection's weight, a product that reads the whole weight
to do little work, so its speed depends on how the weight is laid out. ``nn.Linear`` keeps its weight (out, in)
row-major. On a CPU in float32, MKL reads the same weight stored column-major (the layout in which transformers'
GPT-2 keeps its Conv1D weights) about 1.2x faster for one row (about the same for 16); in bfloat16 and float16
column-major is slower (about 1.4x and 16x, for one row as for 16), and in float64 it is at most a few percent
faster for one row (one run decided 4%, another did not) and slower for 16.
``benchmarks/one_row_products.py`` measures this on the machine at hand (one CPU's MKL: another may differ).

So a LinearGPT decoding step lays its stack's projection weights out for the device and dtype they are on:
column-major for float32 on a CPU, row-major everywhere else. Only strides change: values, shapes, parameter
names, optimiser references and saved checkpoints (``save_pretrained`` stores them contiguous) stay as they were.
"""

import torch
from torch import nn


def wants_column_major(weight: torch.Tensor) -> bool:
    """Whether a one-row product reads ``weight`` (out, in) faster column-major: float32 on a CPU."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def lay_out_for_one_row_products(module: nn.Module) -> None:
    """Lays out every plain ``nn.Linear`` weight (out, in) under ``module`` as ``wants_column_major`` says.

    Weights that are tensor subclasses (quantised, sharded, fake) are left alone. Call it outside autograd and
    outside compilation: the new storage is made outside ``torch.inference_mode``, so a later training step may
    use it."""
    with torch.no_grad(), torch.inference_mode(False):
        for linear in module.modules():
            weight = linear.weight if isinstance(linear, nn.Linear) else None
            if type(weight) is not nn.Parameter or weight.dim() != 2:
                continue
            column_major = weight.t().is_contiguous()
            if wants_column_major(weight) and not column_major:
                weight.data = weight.data.t().contiguous().t()
            elif column_major and not wants_column_major(weight) and not weight.is_contiguous():
                weight.data = weight.data.contiguous()
