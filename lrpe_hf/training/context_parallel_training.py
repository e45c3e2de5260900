"""Context parallelism in the run scripts: ``--context_parallel_size P`` splits every training sequence over P
processes (``lrpe_hf.modeling.context_parallel``), under ``accelerate launch`` and ``Trainer`` as usual.

The W processes form W / P groups of P consecutive ranks (0..P-1, P..2P-1, ...). The processes of one group hold
the same batch, each its contiguous slice of every row's tokens; the groups are data-parallel, each with its own
batches. Three pieces make Trainer do that without knowing it:

- ``SharedBatchSampler`` yields each batch of the Trainer's own seeded random order P times in a row, so that
  accelerate's round-robin sharding of batches over the W processes hands one batch to every process of a group
  (the groups together see, step by step, the batches one process with a P-times smaller world would see).
- ``ContextParallelCollator`` builds the whole batch with the script's collator, adds ``shift_labels`` for a
  causal LM (the labels shifted over the whole sequence, so that a slice's last token is scored against the next
  slice's first), pads the sequence to a multiple of P where needed, and keeps this process's slice.
- ``ContextParallelTrainer`` runs each training forward inside ``context_parallel(group)``.

Each process then counts its own slice's scored tokens, which Trainer sums over all processes into the loss's
``num_items_in_batch``; each process's loss is its tokens' share of the global batch's loss, and the gradients that
DDP averages (Trainer scales the loss by the world size) add up to one process's gradient of the whole batch. So
nothing else changes: the optimizer, clipping, logging and checkpoints are Trainer's.

Why not accelerate's ``ParallelismConfig(cp_size=...)``: it splits attention through torch's context parallelism,
which rewrites SDPA calls (a ring over the keys and values, under FSDP2); a linear-attention layer makes no SDPA
call and needs its own collective of states, and its sharding of the data is the same as the sampler's here.

Evaluation and prediction run each sequence whole on one process (data-parallel over all W): without a gradient a
sequence needs no stored activations, so a length that training must split usually fits.
"""

import torch
import torch.distributed as dist
from accelerate.data_loader import SeedableRandomSampler
from torch.nn import functional as F
from torch.utils.data import RandomSampler, Sampler, SequentialSampler

from ..modeling.context_parallel import context_parallel
from .trainer import CardTrainer


class SharedBatchSampler(Sampler[int]):
    """The indices of ``order`` (a sampler) cut into batches of ``batch_size``, each batch given ``copies`` times in
    a row; the last incomplete batch is dropped (repeated, it would be merged with its copy into one batch)."""

    def __init__(self, order: Sampler, batch_size: int, copies: int):
        self.order, self.batch_size, self.copies = order, batch_size, copies

    def __len__(self) -> int:
        return len(self.order) // self.batch_size * self.batch_size * self.copies

    def __iter__(self):
        indices = list(self.order)
        for start in range(0, len(indices) // self.batch_size * self.batch_size, self.batch_size):
            for _ in range(self.copies):
                yield from indices[start : start + self.batch_size]

    def set_epoch(self, epoch: int):
        if hasattr(self.order, "set_epoch"):
            self.order.set_epoch(epoch)


class ContextParallelCollator:
    """``collator``'s whole batch (B, N), then this process's slice (B, N / size) of every per-token tensor:
    ``rank`` of ``size``. ``causal``: add ``shift_labels`` before slicing. A length that does not divide by
    ``size`` is padded at the end: padding tokens (mask 0, or a document of their own where the batch has
    position_ids and no mask) with ignored labels."""

    def __init__(self, collator, rank: int, size: int, causal: bool, pad_token_id: int):
        self.collator, self.rank, self.size, self.causal, self.pad_token_id = collator, rank, size, causal, pad_token_id

    def __call__(self, features):
        batch = dict(self.collator(features))
        B, N = batch["input_ids"].shape
        if self.causal and "labels" in batch and "shift_labels" not in batch:
            batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        per_token = [key for key, value in batch.items() if torch.is_tensor(value) and value.shape[:2] == (B, N)]
        extra = -N % self.size
        if extra:
            if "attention_mask" not in batch and "position_ids" not in batch:
                batch["attention_mask"] = torch.ones(B, N, dtype=torch.long)
                per_token.append("attention_mask")
            fill = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": -100, "shift_labels": -100}
            for key in per_token:
                if key == "position_ids":  # the padding as a document of its own, after every real one
                    tail = torch.arange(extra, dtype=batch[key].dtype).expand(B, extra)
                    batch[key] = torch.cat([batch[key], tail], dim=1)
                elif key in fill:
                    batch[key] = F.pad(batch[key], (0, extra), value=fill[key])
                else:
                    raise ValueError(f"context parallelism cannot pad the batch's {key!r} to a multiple of {self.size}")
        length = (N + extra) // self.size
        kept = slice(self.rank * length, (self.rank + 1) * length)
        return {key: value[:, kept] if key in per_token else value for key, value in batch.items()}


def context_parallel_groups(size: int):
    """This process's group of ``size`` consecutive ranks (every process makes every group, in one order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
    return groups[rank // size], rank % size


class ContextParallelTrainer(CardTrainer):
    """``CardTrainer`` whose training steps split each sequence over ``context_parallel_size`` processes (see the
    module's docstring). ``causal``: the model is a causal LM (its labels are shifted over the whole sequence);
    ``pad_token_id``: what pads a sequence to a multiple of the size."""

    def __init__(self, *args, context_parallel_size: int, causal: bool, pad_token_id: int, **kwargs):
        super().__init__(*args, **kwargs)
        size, world = context_parallel_size, self.args.world_size
        if not dist.is_initialized() or world % size:
            raise ValueError(
                f"--context_parallel_size {size} needs a number of processes that it divides (accelerate launch "
                f"--num_processes, a multiple of {size}); this run has {world}"
            )
        strategy = getattr(self.args, "train_sampling_strategy", None)  # transformers >= 5.20; group_by_length before
        if strategy not in (None, "random") or getattr(self.args, "group_by_length", False):
            raise ValueError(
                "--context_parallel_size keeps Trainer's random order of examples; grouping by length or "
                "rebalancing batches is not supported with it"
            )
        self.context_parallel_size = size
        self.context_parallel_group, self.context_parallel_rank = context_parallel_groups(size)
        self.whole_batch_collator = ContextParallelCollator(
            self.data_collator, self.context_parallel_rank, size, causal, pad_token_id
        )

    def _get_train_sampler(self, *args, **kwargs):
        """The Trainer's order (accelerate's seeded random sampler, as it would make it), its batches shared by the
        processes of each group."""
        order = super()._get_train_sampler(*args, **kwargs)
        if isinstance(order, RandomSampler) and self.args.accelerator_config.use_seedable_sampler:
            order = SeedableRandomSampler(
                data_source=order.data_source, replacement=order.replacement, num_samples=order._num_samples,
                generator=order.generator, data_seed=self.args.data_seed,
            )  # fmt: skip
        elif not isinstance(order, (RandomSampler, SequentialSampler)):
            raise ValueError(f"--context_parallel_size cannot share the batches of a {type(order).__name__}")
        return SharedBatchSampler(order, self._train_batch_size, self.context_parallel_size)

    def get_train_dataloader(self):
        whole, self.data_collator = self.data_collator, self.whole_batch_collator
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = whole

    def compute_loss(self, model, inputs, *args, **kwargs):
        if not model.training:  # evaluation: whole sequences, one a process
            return super().compute_loss(model, inputs, *args, **kwargs)
        with context_parallel(self.context_parallel_group):
            return super().compute_loss(model, inputs, *args, **kwargs)
