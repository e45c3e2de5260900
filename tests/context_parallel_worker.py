"""One rank of tests/test_context_parallel.py: ``python context_parallel_worker.py CASES_JSON`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. For every case, every rank builds the same float64 layer and inputs, runs the whole
sequence in this one process (the reference), then its own slice under ``context_parallel``; the slice's outputs,
the input gradients of its tokens and the parameters' gradients summed over the ranks must equal the reference's.
Prints one line per case; exits non-zero at the first difference."""

import json
import os
import sys

import torch
import torch.distributed as dist

from lrpe_hf import LinearAttention
from lrpe_hf.modeling.context_parallel import context_parallel

TOKENS = 48


def inputs(case, generator):
    """hidden (1 or 2, N, 32), mask (or None), position_ids (or None) of a case."""
    batch = 2
    x = torch.randn(batch, TOKENS, 32, generator=generator, dtype=torch.float64)
    mask = None
    if case.get("padded"):  # row 1: padding on both sides, inside the second rank's slice too
        mask = torch.ones(batch, TOKENS, dtype=torch.bool)
        mask[1, :5] = False
        mask[1, TOKENS // 2 + 1 : TOKENS // 2 + 4] = False
    positions = None
    if case.get("packed"):  # documents of 20, 11 and 17 tokens: the first crosses every boundary of 2 or 4 ranks
        positions = torch.cat([torch.arange(20), torch.arange(11), torch.arange(17)]).expand(batch, -1)
    elif case.get("gaps"):  # given positions with gaps: a decay and the rotations read the distances
        positions = (torch.arange(TOKENS) * 3 + 7).expand(batch, -1)
    return x, mask, positions


def run_case(case, rank, size):
    torch.manual_seed(0)
    options = {key: case[key] for key in ("positional_encoding", "feature_map", "causal") if key in case}
    layer = LinearAttention(32, 4, max_positions=256, spe_realizations=8, chunk_size=8, **options).double().eval()
    with torch.no_grad():  # the learnable parts away from their initialisation, so that they are read
        for name, param in layer.named_parameters():
            if "angles" in name or "frequencies" in name or "gate" in name:
                param.mul_(1.0 + 0.3 * torch.rand(param.shape, dtype=param.dtype))
    x, mask, positions = inputs(case, torch.Generator().manual_seed(1))
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    reference_input = x.clone().requires_grad_()
    reference = layer(reference_input, attention_mask=mask, position_ids=positions)
    (reference * weights).sum().backward()
    reference_grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)

    piece = slice(rank * TOKENS // size, (rank + 1) * TOKENS // size)
    local_input = x[:, piece].clone().requires_grad_()
    with context_parallel():
        out = layer(
            local_input,
            attention_mask=None if mask is None else mask[:, piece],
            position_ids=None if positions is None else positions[:, piece],
        )
    (out * weights[:, piece]).sum().backward()
    errors = {"outputs": (out - reference[:, piece]).abs().max().item()}
    errors["input gradients"] = (local_input.grad - reference_input.grad[:, piece]).abs().max().item()
    for name, p in layer.named_parameters():
        if name in reference_grads:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            errors[name] = (grad - reference_grads[name]).abs().max().item()
    worst = max(errors, key=errors.get)
    scale = reference.abs().max().item()
    print(f"rank {rank}/{size} {case}: largest difference {errors[worst]:.2e} ({worst}), outputs up to {scale:.2f}")
    if errors[worst] > 1e-10:
        sys.exit(f"rank {rank}: {case}: {worst} differ by {errors[worst]:.3e}")


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    for case in json.loads(sys.argv[1]):
        run_case(case, rank, size)
    dist.barrier()
    # every rank has passed every case: leave without tearing gloo down (its teardown at exit aborts now and then,
    # "terminate called without an active exception", after the work is done)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
