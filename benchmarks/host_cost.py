"""The host's cost of a step: LinearGPT against GPT-2 at a size where a step's arithmetic is nil.

On a GPU a small or medium model's step is paced by its host (Python, dispatch, launches, reads of values) when
the host takes longer to queue the step's kernels than the device takes to run them: the first H100 run trained
LinearGPT at 0.63x GPT-2's speed for that reason. On the CPU at tiny sizes (6 layers x 64, 4 heads of 16, FFN 256,
vocabulary 512; 64 tokens, batch 1) a step's time is almost all that host work, so the ratio of two models' times
here is the ratio of their host costs. Every model lives in this one process, and each round times every model in
turn (the order rotating from round to round):

- ``train``: forward, backward and an AdamW step (``foreach``) of the LM loss on one row, train mode;
- ``decode``: one greedy step after a prompt of 64 tokens, batch 1, eval mode, no gradient.

Beside GPT-2, the floor: a plain linear-attention GPT of the same shape (``plain_linear_gpt.py``: one projection,
1 + elu, a ones column for the denominator, one call of the same stand-in kernel; ``S += k v^T`` and ``q S`` in
decoding), the least host work a linear-attention model of this shape needs. Each model's time over GPT-2's (SDPA)
in the same round is one paired sample, and over the floor's another; over the rounds the geometric mean
with its 95% interval and the verdict (``measure.time_ratio``). ``--compiled`` adds the same steps under
``torch.compile`` (inductor; the whole train step's forward and backward, AdamW eager; the decoding forward), for
GPT-2 and every encoding alike (torch's limit of 8 graphs a function raised, so that no model falls back to eager
unseen). Beside the times: the Python calls of a step (forward, backward and the optimiser's step; cProfile's count,
C calls from Python included: a count of host work that does not depend on the machine's load); and of the model's
forward and backward, the host reads (``host_reads.HostReads``, those a GPU would wait for: device-side checks not
counted) and the ATen ops (``count_ops``'s counting rule, CPU-sized blocks set to one block as on a GPU). Each for
the whole model and per layer (the 6-layer model's less the 1-layer model's, over 5); and the first step's wall time
in seconds (``first_step_s``; compiled, the time to compile the step's graphs, forward and backward, and run it once).

Targets, over GPT-2's (eager, fla's path on the stand-ins; ``TARGETS``): Python calls and host time per step, by
encoding group (``none``; rope, LRPE and PermuteFormer; SPE and FastRPB) and kind of step; compiled decoding at most
1.5x GPT-2's compiled step for ``none``, rope and LRPE.

Writes ``host_cost.csv``, every round in ``host_cost_rounds.csv`` and their record ``host_cost.json`` to ``--out``.

    OMP_NUM_THREADS=1 python benchmarks/host_cost.py --out docs/data/benchmarks/host_cost
"""

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch
from count_ops import GPT2, build, one_block, profile_ops, tally
from fla_stand_ins import fla_path, shape_kernels
from host_reads import HostReads
from measure import time_ratio, write_table
from plain_linear_gpt import PlainLinearGPT
from transformers import DynamicCache

from lrpe_hf import POSITIONAL_ENCODINGS, LinearAttentionCache
from lrpe_hf.modeling.forward_arguments import CACHE_OUTPUT_FIELD

SIZE = dict(layers=6, hidden=64, heads=4, ffn=256, vocab=512)
TOKENS = 64  # a train step's tokens, and the prompt before a decoding step
PLAIN = "plain-linear+fla"  # the floor (plain_linear_gpt.py), on the same stand-in kernel
# Targets over GPT-2's: (what, step, mode) -> {encoding group: most}. Groups: an encoding's name up to its first "_".
TARGETS = {
    ("calls", "train", "eager"): {"none": 1.2, "rope": 1.5, "lrpe": 1.5, "permute": 1.5, "spe": 2.0, "fastrpb": 2.0},
    ("calls", "decode", "eager"): {"none": 1.0, "rope": 1.2, "lrpe": 1.2, "permute": 1.2, "spe": 1.5, "fastrpb": 1.5},
    ("time", "train", "eager"): {"none": 1.0, "rope": 1.2, "lrpe": 1.2, "permute": 1.2, "fastrpb": 1.2, "spe": 1.5},
    ("time", "decode", "eager"): {"none": 0.9, "rope": 1.1, "lrpe": 1.1, "permute": 1.1, "spe": 1.4, "fastrpb": 1.4},
    ("time", "decode", "compiled"): {"none": 1.5, "rope": 1.5, "lrpe": 1.5},
}
FIELDS = ["step", "mode", "model", "rounds", "ms", "over_gpt2", "low", "high", "verdict", "target", "met",
          "over_floor", "calls", "calls_per_layer", "calls_over_gpt2", "calls_over_floor", "calls_target", "calls_met",
          "host_reads", "ops", "ops_per_layer", "first_step_s"]  # fmt: skip


class EmptyKernel(torch.autograd.Function):
    """fla's chunked or one-step kernel at its least host cost: results and gradients of the right shapes, not
    computed. fla's own entry points are autograd Functions too, with more Python and 2-6 launches a call, so the
    host time measured around this one is a lower bound of a GPU's."""

    @staticmethod
    def forward(ctx, q, k, v, initial_state, output_final_state):
        B, N, H, K = q.shape
        ctx.inputs = [(x.shape, x.dtype) if x is not None else None for x in (q, k, v, initial_state)]
        final = q.new_empty(B, H, K, v.shape[-1], dtype=torch.float32) if output_final_state else None
        return v.new_empty(B, N, H, v.shape[-1]), final

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        grads = [
            grad_out.new_empty(x[0], dtype=x[1]) if x is not None and needed else None
            for x, needed in zip(ctx.inputs, ctx.needs_input_grad)
        ]
        return (*grads, None)


def empty_kernels():
    """(chunked, one_step) with fla's signatures, each an ``EmptyKernel``, under ``torch.compiler.disable`` as fla's
    entry points are."""

    @torch.compiler.disable
    def kernel(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, **kwargs):
        return EmptyKernel.apply(q, k, v, initial_state, output_final_state)

    return kernel, kernel


class Stepper:
    """One model and one kind of step (``train`` or ``decode``), eager or compiled: ``step()`` runs one."""

    def __init__(self, name: str, task: str, compiled: bool, layers: int = SIZE["layers"]):
        self.name, self.task, self.compiled = name, task, compiled
        self.on_fla = name.endswith("+fla") and name != PLAIN
        if name == PLAIN:
            torch.manual_seed(0)
            self.model = PlainLinearGPT(layers, SIZE["hidden"], SIZE["heads"],
                                        SIZE["ffn"], SIZE["vocab"], product=empty_kernels()[0])  # fmt: skip
        else:
            self.model = build(name, layers, 2 * TOKENS + 64, SIZE)
        self.layers = layers
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, SIZE["vocab"], (1, TOKENS), generator=generator)
        self.forward = torch.compile(self.model) if compiled else self.model
        if task == "train":
            self.model.train()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        else:
            self.model.eval()
            self.restart()

    def restart(self):
        """A fresh prompt in a fresh cache (decoding): each round decodes from the same context."""
        cache = {GPT2: DynamicCache(), PLAIN: None}.get(self.name, LinearAttentionCache(self.layers))
        with torch.no_grad(), self.path():
            out = self.model(input_ids=self.ids, use_cache=True, logits_to_keep=1, **{CACHE_OUTPUT_FIELD: cache})
        self.cache, self.token = out[CACHE_OUTPUT_FIELD], out.logits[:, -1:].argmax(-1)

    @contextlib.contextmanager
    def path(self, counting: bool = False):
        """The path a GPU takes: every input one block and, for ``+fla``, fla's kernels stood in: timed, by the
        cheapest functions with their results' shapes (``empty_kernels``); counting, by ``count_ops``'s stand-ins,
        whose calls count as fla's launches."""
        if not self.on_fla:
            stand_ins = {}
        elif counting:
            stand_ins = {"kernels": shape_kernels()}
        else:
            stand_ins = {"stand_ins": empty_kernels()}
        with one_block(), fla_path(**stand_ins):
            yield

    def step(self):
        with self.path():
            self.model_step()
            self.update()

    def model_step(self, reads: HostReads | None = None):
        """The model's forward (and backward, training); ``reads`` counts the backward's host reads too."""
        if self.task == "train":
            loss = self.forward(input_ids=self.ids, labels=self.ids, use_cache=False).loss
            reads.backward(loss) if reads is not None else loss.backward()
            return
        with torch.no_grad():
            out = self.forward(input_ids=self.token, use_cache=True, **{CACHE_OUTPUT_FIELD: self.cache})
        self.token = out.logits[:, -1:].argmax(-1)

    def update(self):
        """Training: the AdamW step."""
        if self.task == "train":
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def round_ms(self, steps: int) -> float:
        """Milliseconds per step over ``steps`` steps (decoding: after a fresh prefill and one untimed step)."""
        if self.task == "decode":
            self.restart()
            self.step()
        with self.path():
            start = time.perf_counter()
            for _ in range(steps):
                self.model_step()
                self.update()
            return 1000 * (time.perf_counter() - start) / steps

    def calls(self) -> int:
        """Python calls (cProfile's count, C calls included) of one step: forward, backward and the optimiser's
        step, the stand-ins' context entered outside it (as in ``round_ms``)."""
        profiler = cProfile.Profile()
        with self.path():
            profiler.enable()
            self.model_step()
            self.update()
            profiler.disable()
        return pstats.Stats(profiler).total_calls

    def counts(self) -> dict:
        """The Python calls of a step, and the host reads and ATen ops of the model's forward and backward (eager;
        the optimiser's step apart): the whole model's and per layer (the 6-layer model's less a 1-layer one's)."""
        calls = self.calls()
        with self.path(counting=True):
            with HostReads().watch(self.model) as reads:
                self.model_step(reads)
            self.update()
            launches, _, _ = tally(profile_ops(self.model_step))
            self.update()
        found = reads.inside_layers() + reads.outside_layers()
        one_layer = Stepper(self.name, self.task, False, layers=1)
        one_layer.step()  # what is made once
        calls_of_one = one_layer.calls()
        with one_layer.path(counting=True):
            launches_of_one, _, _ = tally(profile_ops(one_layer.model_step))
        per_layer = (launches - launches_of_one) / (self.layers - 1)
        return dict(
            calls=calls, calls_per_layer=(calls - calls_of_one) / (self.layers - 1),
            host_reads=sum(found.values()), ops=launches, ops_per_layer=per_layer,
        )  # fmt: skip


def target_of(what: str, task: str, mode: str, name: str) -> float | None:
    """The most ``name``'s ``what`` ("calls" or "time") may be over GPT-2's, or None where no target is set."""
    if name in (GPT2, PLAIN):
        return None
    group = name.partition("+")[0].partition("_")[0]
    return TARGETS.get((what, task, mode), {}).get(group)


def measure(task: str, names: list[str], compiled: bool, rounds: int, steps: int) -> tuple[list[dict], list[dict]]:
    """Rows of the table and every timed round, for one kind of step and mode."""
    torch.manual_seed(0)
    steppers = [Stepper(name, task, compiled) for name in names]
    first_step_s = {}  # compiled: the graphs are made in the first step, before any round
    for stepper in steppers:
        start = time.perf_counter()
        stepper.step()
        first_step_s[stepper.name] = round(time.perf_counter() - start, 2)
        for _ in range(2):
            stepper.step()
    counts = {s.name: s.counts() for s in steppers} if not compiled else {}
    times = {s.name: [] for s in steppers}
    for round_index in range(rounds + 1):
        shift = round_index % len(steppers)
        for stepper in steppers[shift:] + steppers[:shift]:
            ms = stepper.round_ms(steps)
            if round_index:
                times[stepper.name].append(ms)
    mode = "compiled" if compiled else "eager"
    rows, timed = [], []
    no_counts = dict(calls="", calls_per_layer="", host_reads="", ops="", ops_per_layer="")
    for name, samples in times.items():
        ratio = time_ratio(samples, times[GPT2])
        if name == GPT2:
            ratio.update(low="", high="", verdict="-")
        target, calls_target = target_of("time", task, mode, name), target_of("calls", task, mode, name)
        count = counts.get(name, no_counts)
        calls_over = dict(calls_over_gpt2="", calls_over_floor="")  # compiled: not counted
        if count["calls"]:
            calls_over = dict(calls_over_gpt2=round(count["calls"] / counts[GPT2]["calls"], 3),
                              calls_over_floor=round(count["calls"] / counts[PLAIN]["calls"], 3))  # fmt: skip
        rows.append(dict(
            step=task, mode=mode, model=name, rounds=len(samples), ms=round(statistics.median(samples), 3),
            over_gpt2=ratio["ratio"], low=ratio["low"], high=ratio["high"], verdict=ratio["verdict"],
            target=target or "", met="" if target is None else ratio["high"] <= target,
            over_floor=time_ratio(samples, times[PLAIN])["ratio"], **count, **calls_over,
            calls_target=calls_target or "",
            calls_met="" if calls_target is None else calls_over["calls_over_gpt2"] <= calls_target,
            first_step_s=first_step_s[name],
        ))  # fmt: skip
        timed += [dict(step=task, mode=mode, model=name, round=i, ms=ms) for i, ms in enumerate(samples)]
        print(rows[-1], flush=True)
    return rows, timed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encodings", nargs="+", default=list(POSITIONAL_ENCODINGS), help="LinearGPT encodings")
    parser.add_argument(
        "--paths", nargs="+", default=["fla"], choices=["fla", "torch"],
        help="the product's path: fla (a GPU's: fla's kernels stood in, the host's work around them timed) or torch",
    )  # fmt: skip
    parser.add_argument("--steps", nargs="+", default=["train", "decode"], choices=["train", "decode"])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (each model once per round)")
    parser.add_argument("--steps_per_round", type=int, default=5, help="steps timed together in a round")
    parser.add_argument("--compiled", action="store_true", help="also under torch.compile (inductor)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host_cost")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compiled:  # every model compiles the same forward: past torch's 8 graphs a frame, it would run eager
        torch._dynamo.config.recompile_limit = 1000
        torch._dynamo.config.accumulated_recompile_limit = 10000
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2 for an interval, got {args.rounds}")
    suffixes = {"fla": "+fla", "torch": ""}
    names = [GPT2, PLAIN, *[encoding + suffixes[path] for path in args.paths for encoding in args.encodings]]
    rows, rounds = [], []
    for compiled in [False, True] if args.compiled else [False]:
        for task in args.steps:
            new_rows, new_rounds = measure(task, names, compiled, args.rounds, args.steps_per_round)
            rows += new_rows
            rounds += new_rounds
    write_table(args.out, "host_cost", FIELDS, rows, rounds)


if __name__ == "__main__":
    main()
