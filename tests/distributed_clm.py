"""run_scripts/run_clm.py with a record of what each process saw, for tests/test_distributed.py.

    accelerate launch --use_fsdp ... tests/distributed_clm.py <run_clm.py arguments> --use_cpu
    python tests/distributed_clm.py <run_clm.py arguments>          (the single-process reference)

Every process writes <output_dir>/record-rank<N>.json with, per training step: whether each parameter was a
DTensor (an FSDP2 shard), its placements and its local and full shapes (read at ``on_step_end``); a
fingerprint of torch's global RNG state at the step's start; fingerprints of the step's SPE noise draws (the
codes that every layer shares, drawn from that RNG); and fingerprints of the token ids of the step's batch
rows. Two runs that should train alike can then be told apart by data order, RNG or arithmetic.

Environment:
- DISTRIBUTED_CLM_DTYPE=float64 builds the model in that dtype (torch's default dtype), for comparisons in
  which rounding is negligible.
- DISTRIBUTED_CLM_SCRAMBLE_OTHER_RANKS=1 overwrites the model's weights with noise on every process but rank 0
  before training, to show that rank 0's weights reach the others (FSDP's cpu_ram_efficient_loading: the
  model is moved to the meta device, sharded there, and filled from rank 0's state dict by broadcast).

Accelerate (1.15) turns ``--use_fsdp`` into FSDP only on accelerators: with ``--use_cpu`` the state stays
MULTI_CPU and the Trainer wraps the model in DDP, without a word. ``allow_fsdp_on_cpu`` hands the CPU state the
FSDP plugin that accelerate has already built, as its GPU path does; the sharding, the gradient reduction and
the full state dict are then accelerate's and torch's own code (FSDP2 runs on CPU with gloo).
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from lrpe_hf.modeling import positional_spe
from lrpe_hf.training import trainer as trainer_module
from lrpe_hf.training.language_modeling import main


def fingerprint(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


RECORDING = [None]  # the record of the step under way, which the wrapped functions below append to


class Recorder(TrainerCallback):
    def __init__(self, trainer, scrambled: bool):
        self.trainer = trainer
        self.scrambled = scrambled
        self.steps = []
        self.current = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.current = RECORDING[0] = {"rng": fingerprint(torch.random.get_rng_state()), "rows": [], "spe_draws": []}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        parameters = {}
        for name, parameter in (model if model is not None else self.trainer.model).named_parameters():
            sharded = isinstance(parameter, DTensor)
            parameters[name] = {
                "dtensor": sharded,
                "placements": [str(p) for p in parameter.placements] if sharded else None,
                "local_shape": list((parameter.to_local() if sharded else parameter).shape),
                "shape": list(parameter.shape),
            }
        record = self.current or {}
        record.update(step=state.global_step, parameters=parameters)
        self.steps.append(record)
        self.current = RECORDING[0] = None
        folder = Path(args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        summary = dict(rank=args.process_index, world_size=args.world_size, scrambled=self.scrambled)
        (folder / f"record-rank{args.process_index}.json").write_text(json.dumps({**summary, "steps": self.steps}))


_init = trainer_module.CardTrainer.__init__
_training_step = trainer_module.CardTrainer.training_step
_spe_tensor = positional_spe.SPEDraw.tensor


def init(self, *args, **kwargs):
    scramble = os.environ.get("DISTRIBUTED_CLM_SCRAMBLE_OTHER_RANKS") == "1" and int(os.environ.get("RANK", "0")) > 0
    if scramble:  # from a generator of its own: torch's global RNG must stay as on rank 0
        generator = torch.Generator().manual_seed(1234 + int(os.environ["RANK"]))
        with torch.no_grad():
            for parameter in kwargs["model"].parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    _init(self, *args, **kwargs)
    self.add_callback(Recorder(self, scramble))


def training_step(self, model, inputs, *args, **kwargs):
    if RECORDING[0] is not None:
        RECORDING[0]["rows"] += [fingerprint(row) for row in inputs["input_ids"]]
    return _training_step(self, model, inputs, *args, **kwargs)


def spe_tensor(self, name, shape):
    fresh = name not in self._tensors
    value = _spe_tensor(self, name, shape)
    if fresh and not self.seeded and RECORDING[0] is not None:
        RECORDING[0]["spe_draws"].append(f"{name}:{fingerprint(value)}")
    return value


def allow_fsdp_on_cpu():
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = __init__


if __name__ == "__main__":
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        allow_fsdp_on_cpu()
    if os.environ.get("DISTRIBUTED_CLM_DTYPE"):
        torch.set_default_dtype(getattr(torch, os.environ["DISTRIBUTED_CLM_DTYPE"]))
    trainer_module.CardTrainer.__init__ = init
    trainer_module.CardTrainer.training_step = training_step
    positional_spe.SPEDraw.tensor = spe_tensor
    main("clm")
    # Everything this process had to write is written, and every process has passed the stage's closing barrier
    # (``train_and_evaluate``). The interpreter's teardown of gloo's process group under FSDP on the CPU (a path
    # only this test takes: see above) aborted one process of two once in a while on fresh machines ("terminate
    # called without an active exception"), after all of that; the test checks what the run wrote, not that
    # teardown, so the process ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
