"""ATen ops per layer, eager and compiled: a figure that stands in for a GPU's kernel launches.

No GPU is needed. It compares LinearGPT (every positional encoding, its default feature map and
normalisation; 6 layers x 512, 8 heads x 64, FFN 2,048, vocabulary 8,192) with Transformers' GPT-2 of the same
size under SDPA (``gpt2-sdpa``; its attention-probability dropout off: the CPU's SDPA takes dropout only on its
math path, a GPU's flash kernel takes it inside).

1. **Op counts** (``ops.csv``, ``top_ops.csv``): ATen ops counted by ``torch.profiler`` on the CPU, a stand-in for
   the kernel launches of the same step on a GPU, for

   - a decoding step: one new token after a prompt of 256 tokens (prefill with the cache, then two warm-up
     steps), batch 1, eval mode, no gradient;
   - a train step: forward and backward of the LM loss on one sequence of 128 tokens, batch 1, train mode
     (dropout on), fp32 (``--bf16`` adds one under bf16 autocast, as a GPU trains: its casts are ops too, and
     the MLP takes its plain path, eager and compiled). The CPU path splits long inputs into blocks sized for a
     CPU's caches; ``one_block`` sets every constant that sizes them (``products_shared.BLOCK_ELEMENTS`` for the
     chunked products' heads, ``feature_maps.ELEMENTWISE_BLOCK``, ``lm_loss.ROWS_PER_BLOCK``,
     ``positional_fastrpb.TRANSPOSE_BLOCK``, the positional transforms' ``BLOCK_ELEMENTS``...) to 2**62, so that
     every input is one block, as a GPU wants. At 128 tokens nothing would split anyway; the roofline's 8k and 32k
     inputs would.

   **The counting rule** (``counted_ops``). The profiler's events form a call tree. Walking it from the top, an
   ATen op (an event named ``aten::*``) is

   - in ``FUSED_OPS`` (SDPA, dropout): counted once whatever the CPU runs inside it (on a GPU, one fused
     kernel: flash attention, native_dropout), or 0 where it ran nothing (dropout in eval mode);
   - skipped with its children when it is in ``METADATA_OPS`` (empty, empty_like, new_empty, empty_strided,
     resize_, _unsafe_view, _reshape_alias, alias, detach_, promote_types, the in-place views...);
   - looked through when it is a CompositeImplicitAutograd op (every functional overload is; it has no kernel of
     its own and calls other ATen ops: linear, matmul, to, contiguous, reshape, flatten, layer_norm, item...):
     its children are counted by this rule instead (``to`` to the same dtype counts 0, ``linear`` its addmm);
   - skipped with its children when it only makes a view: every functional schema of it taking a tensor returns
     aliases of its inputs that it does not write (view, transpose, expand, as_strided, slice, select, unsqueeze,
     squeeze, permute, t, detach, alias, unbind, split, view_as_real, view_as_complex...);
   - otherwise counted once, its children not: the top-level op that computes (addmm, bmm, add_, copy_,
     _to_copy, native_layer_norm, native_dropout, cat, _local_scalar_dense...). Each launches at least one kernel
     on a GPU (``_local_scalar_dense``, a value read by the host, is a device-to-host copy and a sync).

   Events that are not ATen ops (Python frames, modules, autograd nodes) are walked through; a range named
   ``fla-launches:N:kernel`` counts N (a stood-in fla kernel, below). **Per layer**: the count of the model with L
   = 6 layers minus that of the same model with one, over the layers it adds, ``(count(L) - count(1)) / (L - 1)``;
   what is not the layers' (embeddings, final norm, head, loss, masks) is ``count(L) - L * per_layer`` (``ops.md``
   also lists the whole-model counts). **Product**: the ops inside ``causal_linear_attention`` and the backward
   of the autograd Functions it applies (``PRODUCT_FUNCTIONS``).

   The counts are of the CPU's eager path. A GPU runs the same Python except where the code tests the device:
   the causal product (fla's Triton kernels where fla-core is installed) and a few CPU-only branches (1 + elu
   takes 4 ops per tensor of 4,096 elements or more on a CPU, as in the train step, 2 elsewhere). ``+fla`` rows
   (``--fla``, the default where fla-core is installed) take the product's GPU path on the CPU: ``products_triton``'s
   mapping runs as on a GPU, and fla's kernels are stood in (``fla_stand_ins.py``) by fla's own torch references
   (``naive.py``), under
   ``torch.compiler.disable`` as fla's entry points are, each call counted as fla's launches (``FLA_LAUNCHES``: 2
   forward, 4 backward; 1 per decoding step).

   **Compiled**: the same steps under ``torch.compile`` with a backend that only counts the graphs it is handed
   and runs them as they are (no code generation: seconds, not minutes): for decoding, whether the step compiles
   with ``fullgraph=True`` (or its first reason why not); the graphs run per step after two warm-up steps (a
   train step's forward and backward graphs, through AOTAutograd); graphs compiled during the counted step
   (recompilations); and dynamo's graph-break reasons. The train step is compiled for GPT-2 and the torch path.

   Targets (the issue's): eager decoding at most 1.5x GPT-2's ops per layer, compiled decoding one graph per
   step, an eager train step at most 2x GPT-2's ops per layer.

Writes ``ops.csv``, ``top_ops.csv``, ``compiled.csv``, ``ops.md`` and ``ops.json`` (the command, commit, machine
and date) to ``--output_dir`` and prints the tables. ``roofline.py`` estimates an H100 train step from the same
steps (its own script).

    python benchmarks/count_ops.py                                    # every encoding (~5 minutes)
    python benchmarks/count_ops.py --encodings none rope --no-compiled
    python benchmarks/count_ops.py --bf16 --no-fla                    # and the train step under bf16 autocast
"""

import argparse
import collections
import contextlib
import csv
import functools
import importlib.util
import logging
from pathlib import Path

import torch
from fla_stand_ins import STAND_IN_PREFIX, fla_path, on_fla
from measure import write_provenance
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config

import lrpe_hf
from lrpe_hf import LinearAttentionCache, LinearGPTConfig, LinearGPTForCausalLM
from lrpe_hf.modeling.forward_arguments import CACHE_OUTPUT_FIELD

SIZE = dict(layers=6, hidden=512, heads=8, ffn=2048, vocab=8192)
DECODE_CONTEXT = 256  # tokens of prompt before the counted decoding step
TRAIN_TOKENS = 128  # tokens of the counted train step
TARGETS = {"decode": 1.5, "train": 2.0}  # eager ops per layer over GPT-2's, at most (the issue's)
GPT2 = "gpt2-sdpa"

# What the counting rule skips besides the ops whose every schema returns an alias of an input it does not write:
# allocations (no kernel: the memory is handed out by the caching allocator) and metadata-only ops.
METADATA_OPS = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
    "aten::resize_", "aten::resize_as_", "aten::detach_", "aten::set_", "aten::promote_types", "aten::result_type",
    "aten::squeeze_", "aten::unsqueeze_", "aten::transpose_", "aten::t_", "aten::as_strided_", "aten::_unsafe_view",
    "aten::_reshape_alias", "aten::lift_fresh", "aten::alias", "aten::is_same_size", "aten::size", "aten::stride",
    "aten::numel", "aten::dim", "aten::is_contiguous", "aten::_has_compatible_shallow_copy_type",
}  # fmt: skip
# Ops that are one fused kernel on a GPU whatever the CPU runs inside them.
FUSED_OPS = {"aten::scaled_dot_product_attention", "aten::dropout"}
# The autograd Functions ``causal_linear_attention`` applies on the torch path (their backward is the product's).
PRODUCT_FUNCTIONS = ("ChunkedCausalProduct", "GatedIntraChunkProduct", "GatedChunkStates")


# ---------------------------------------------------------------------------------------------------------------
# Counting rule


@functools.cache
def _overloads(name: str):
    packet = getattr(torch.ops.aten, name.split("::", 1)[1], None)
    if packet is None:
        return []
    overloads = [getattr(packet, overload) for overload in packet.overloads()]
    return [op for op in overloads if not any(a.is_out for a in op._schema.arguments)]


@functools.cache
def is_view(name: str) -> bool:
    """Every (functional) schema of the op taking a tensor returns only aliases of an input, unwritten."""
    schemas = [op._schema for op in _overloads(name)]
    schemas = [s for s in schemas if any(isinstance(a.type, torch.TensorType) for a in s.arguments)]
    return bool(schemas) and all(
        s.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in s.returns) for s in schemas
    )


@functools.cache
def is_composite(name: str) -> bool:
    """Every (functional) overload of the op is CompositeImplicitAutograd: no kernel, it calls other ATen ops."""
    flags = []
    for op in _overloads(name):
        try:
            flags.append(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"))
        except RuntimeError:  # TorchScript-only overloads (aten::to.prim_Device) are not in the dispatcher
            pass
    return bool(flags) and all(flags)


def computes(name: str) -> str:
    """How the rule treats an ATen op: 'skip', 'through' (count its children), 'fused' or 'count'."""
    if name in FUSED_OPS:
        return "fused"
    if name in METADATA_OPS:
        return "skip"
    if is_composite(name):
        return "through"
    if is_view(name):
        return "skip"
    return "count"


def counted_ops(events) -> list[tuple[str, int, bool]]:
    """The ops the rule counts among the profiler's ``events``: (name, launches, in the causal product) each."""

    def walk(event, in_product) -> list:
        name = event.name
        if name.startswith(STAND_IN_PREFIX):  # a stood-in fla kernel: its launches, not the reference's ops
            _, launches, kernel = name.split(":")
            return [(f"fla::{kernel}", int(launches), True)]
        # the product: the entry of every causal product, or a short decoding step's recurrent update and readout
        in_product = in_product or name.endswith((": causal_linear_attention", ": recurrent_step"))
        in_product = in_product or any(name.endswith(f"{function}Backward") for function in PRODUCT_FUNCTIONS)
        if name.startswith("aten::"):
            how = computes(name)
            if how == "skip":
                return []
            if how == "count":
                return [(name, 1, in_product)]
            if how == "fused":
                inside = [op for child in event.cpu_children for op in walk(child, in_product)]
                return [(name, 1, in_product)] if inside else []
        return [op for child in event.cpu_children for op in walk(child, in_product)]

    return [op for event in events if event.cpu_parent is None for op in walk(event, False)]


def profile_ops(fn) -> list[tuple[str, int, bool]]:
    """Run ``fn`` once under the profiler (with Python frames, to see the product) and count its ops."""
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fn()
    return counted_ops(prof.events())


def tally(ops) -> tuple[int, int, collections.Counter]:
    """(launches, launches in the product, launches per op name)."""
    by_name = collections.Counter()
    for name, launches, _ in ops:
        by_name[name] += launches
    return sum(n for _, n, _ in ops), sum(n for _, n, product in ops if product), by_name


@contextlib.contextmanager
def one_block():
    """Every constant that splits the CPU path's work into cache-sized blocks, set so large that any input is one
    block (a GPU wants whole tensors: each block costs launches). Set on the class or module that reads it at
    call time; restored on exit. The positional transforms' ``angle_blocks`` and the feature maps already take one
    block off the CPU (they test ``is_cpu``); FastRPB's transposing copy and the LM loss's rows split on every
    device. ``feature_maps.FEW_ELEMENTS`` is set with them: 1 + elu then takes the branch a GPU takes (elu and an
    add), not the CPU's cache-friendly four passes."""
    import lrpe_hf.modeling.positional_rope as positional_rope
    import lrpe_hf.modeling.positional_spe as positional_spe
    from lrpe_hf.modeling import feature_maps, lm_loss, positional_fastrpb, products_shared
    from lrpe_hf.modeling.positional_lrpe import UnitaryLift
    from lrpe_hf.modeling.positional_permute import CyclicPermutations
    from lrpe_hf.modeling.positional_rope import RotateQueriesAndKeys
    from lrpe_hf.modeling.positional_spe import SineMixing

    huge = 1 << 62
    settings = [
        (products_shared, "BLOCK_ELEMENTS"),  # heads per block of the chunked products' C x C scores
        (feature_maps, "ELEMENTWISE_BLOCK"),  # elements per block of 1 + elu
        (feature_maps, "FEW_ELEMENTS"),  # below it, 1 + elu takes a GPU's two ops (elu, add), not the CPU's four
        (lm_loss, "ROWS_PER_BLOCK"),  # rows of logits per block of the LM loss
        (positional_fastrpb, "TRANSPOSE_BLOCK"),  # tokens per block of FastRPB's copy into its FFT buffer
        (RotateQueriesAndKeys, "BLOCK_ELEMENTS"),  # RoPE's rotation
        (positional_rope, "CPU_POLAR_ANGLES"),  # below it, exp(i angle) takes a GPU's one op (polar), not three
        (UnitaryLift, "BLOCK_ELEMENTS"),  # LRPE's unitary lift
        (CyclicPermutations, "BLOCK_ELEMENTS"),  # PermuteFormer's permutation (on every device)
        (SineMixing, "BLOCK_ELEMENTS"),  # sineSPE's mixing
        (positional_spe, "SINE_TABLE_BLOCK_ELEMENTS"),  # sineSPE's position table
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in settings]  # fails loudly if one was renamed
    try:
        for owner, name in settings:
            setattr(owner, name, huge)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


# ---------------------------------------------------------------------------------------------------------------
# Models and steps


def build(name: str, layers: int, max_tokens: int, size=SIZE):
    """``gpt2-sdpa`` or a LinearGPT positional encoding (a ``+fla`` suffix changes nothing here: see
    ``fla_path``), ``layers`` deep."""
    torch.manual_seed(0)
    encoding = name.partition("+")[0]
    if encoding == GPT2:
        config = GPT2Config(
            n_layer=layers, n_embd=size["hidden"], n_head=size["heads"], n_inner=size["ffn"],
            vocab_size=size["vocab"], n_positions=max_tokens, bos_token_id=None, eos_token_id=None,
            attn_pdrop=0.0,  # SDPA's dropout sends the CPU to its math path; a GPU's flash kernel takes dropout
        )  # fmt: skip
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    config = LinearGPTConfig(
        num_hidden_layers=layers, hidden_size=size["hidden"], num_attention_heads=size["heads"],
        intermediate_size=size["ffn"], vocab_size=size["vocab"], max_position_embeddings=max_tokens,
        positional_encoding=encoding,
    )  # fmt: skip
    return LinearGPTForCausalLM(config)


def decode_step(model, name: str, context: int, vocab: int):
    """A function running one decoding step (batch 1) after a prompt of ``context`` tokens, and two warm-up steps."""
    model.eval()
    ids = torch.randint(0, vocab, (1, context))
    with torch.no_grad():
        cache = DynamicCache() if name.startswith(GPT2) else LinearAttentionCache(model.config.num_hidden_layers)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{CACHE_OUTPUT_FIELD: cache})
        cache = out[CACHE_OUTPUT_FIELD]
        token = out.logits[:, -1:].argmax(-1)

    def step(forward=model):
        nonlocal token
        with torch.no_grad():
            out = forward(input_ids=token, use_cache=True, **{CACHE_OUTPUT_FIELD: cache})
        token = out.logits[:, -1:].argmax(-1)

    return step


def train_step(model, tokens: int, vocab: int, batch: int = 1):
    """A function running forward and backward of the LM loss on ``batch`` sequences (train mode)."""
    model.train()
    ids = torch.randint(0, vocab, (batch, tokens))

    def step(forward=model):
        model.zero_grad(set_to_none=True)
        forward(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return step


def make_step(task: str, model, name: str, size=SIZE):
    if task == "decode":
        return decode_step(model, name, DECODE_CONTEXT, size["vocab"])
    return train_step(model, TRAIN_TOKENS, size["vocab"], size.get("batch", 1))


def step_ops(task: str, name: str, layers: int, size=SIZE):
    """The counted ops of one step of ``task`` ('decode' or 'train') of model ``name`` with ``layers`` layers."""
    with one_block(), fla_path(on_fla(name)):
        model = build(name, layers, DECODE_CONTEXT + 8, size)
        step = make_step(task, model, name, size)
        step()  # warm-up: lazily built tables, the first step's allocations
        return profile_ops(step)


def op_counts(task: str, name: str, size=SIZE) -> dict:
    """Whole-model and per-layer counts of ``task`` for ``name``: per layer = (count(L) - count(1)) / (L - 1)."""
    layers = size["layers"]
    whole, whole_product, by_name = tally(step_ops(task, name, layers, size))
    one, one_product, one_by_name = tally(step_ops(task, name, 1, size))
    per_layer = (whole - one) / (layers - 1)
    per_layer_by_name = {op: (by_name[op] - one_by_name[op]) / (layers - 1) for op in by_name | one_by_name}
    return {
        "whole": whole,
        "per_layer": per_layer,
        "outside": whole - layers * per_layer,
        "product_per_layer": (whole_product - one_product) / (layers - 1),
        "by_name": {op: n for op, n in per_layer_by_name.items() if n},
    }


# ---------------------------------------------------------------------------------------------------------------
# Compiled


class GraphCounter:
    """A torch.compile backend that runs each graph it is handed as it is, counting graphs compiled and runs. With
    ``backward``, through AOTAutograd: forward and backward graphs, each counted."""

    def __init__(self, backward: bool):
        self.compiled = self.runs = 0
        self.backward = backward

    def counting(self, graph_module, example_inputs):
        self.compiled += 1
        if self.backward:  # AOTAutograd calls its compiled graphs with one list of arguments
            from functorch.compile import make_boxed_func

            boxed = make_boxed_func(graph_module.forward)

            def run_boxed(args):
                self.runs += 1
                return boxed(args)

            run_boxed._boxed_call = True
            return run_boxed

        def run(*args):
            self.runs += 1
            return graph_module.forward(*args)

        return run

    def backend(self):
        if not self.backward:
            return self.counting
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=self.counting, bw_compiler=self.counting)


def first_line(error: BaseException, width: int = 160) -> str:
    text = " ".join(str(error).split(" Explanation:")[0].split())
    return f"{type(error).__name__}: {text}"[:width]


def compiled_counts(task: str, name: str, size=SIZE) -> dict:
    """``task``'s step under torch.compile after two warm-up steps: whether ``fullgraph=True`` compiles it (or its
    first reason why not), the graphs run per step (a train step's forward and backward graphs, through
    AOTAutograd), graphs compiled during the counted step (recompilations) and dynamo's graph-break reasons."""
    from torch._dynamo.utils import counters

    result = {}
    with one_block(), fla_path(on_fla(name)):
        model = build(name, size["layers"], DECODE_CONTEXT + 8, size)
        step = make_step(task, model, name, size)
        for fullgraph in (True, False) if task == "decode" else (False,):  # the targets ask it of decoding
            torch._dynamo.reset()
            counters.clear()
            counter = GraphCounter(backward=task == "train")
            compiled = torch.compile(model, backend=counter.backend(), fullgraph=fullgraph)
            try:
                step(compiled)
                step(compiled)
                compiled_before, runs_before = counter.compiled, counter.runs
                step(compiled)
            except Exception as error:  # fullgraph=True refused a break: say why, then count without it
                if fullgraph:
                    result["fullgraph"] = first_line(error)
                    continue
                result["error"] = first_line(error)
                break
            result.setdefault("fullgraph", "yes" if fullgraph else "not tried")
            reasons = collections.Counter()
            for reason, n in counters["graph_break"].items():
                reasons[" ".join(reason.split(" Explanation:")[0].split())[:100]] += n
            result.update(
                graphs_per_step=counter.runs - runs_before,
                recompiles=counter.compiled - compiled_before,
                graph_breaks=sum(reasons.values()),
                break_reasons="; ".join(f"{reason} (x{n})" for reason, n in reasons.most_common(3)),
            )
            break
    torch._dynamo.reset()
    return result


# ---------------------------------------------------------------------------------------------------------------
# The run


def ratio(value, baseline):
    return value / baseline if baseline else float("nan")


def eager_row(name: str, gpt2: dict | None, size=SIZE, bf16: bool = False) -> tuple[dict, dict]:
    """The eager counts of ``name`` (over ``gpt2``'s, the GPT-2 row's counts; None for GPT-2 itself), and the
    per-layer counts by op name of each step; with ``bf16``, a train step under bf16 autocast too (``train_bf16``:
    autocast's casts are ops; on this CPU bf16 matmuls are slow, so it takes longer)."""
    counts = {
        "decode": op_counts("decode", name, size),
        "train": op_counts("train", name, size),
    }
    if bf16:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            counts["train_bf16"] = op_counts("train", name, size)
    gpt2 = gpt2 or counts
    row = {"model": name}
    for step, target in (("decode", TARGETS["decode"]), ("train", TARGETS["train"]), ("train_bf16", TARGETS["train"])):
        if step not in counts:
            continue
        per_layer, over = counts[step]["per_layer"], ratio(counts[step]["per_layer"], gpt2[step]["per_layer"])
        row[f"{step}_per_layer"] = per_layer
        row[f"{step}_over_gpt2"] = round(over, 3)
        row[f"{step}_met"] = over <= target
        if step != "train_bf16":
            row[f"{step}_product_per_layer"] = counts[step]["product_per_layer"]
            row[f"{step}_whole"] = counts[step]["whole"]
            row[f"{step}_outside_layers"] = counts[step]["outside"]
    return row, counts


def compiled_rows(name: str, steps, size=SIZE) -> list[dict]:
    """``compiled_counts`` of each of ``steps``: 'decode', 'train', or 'train_bf16' (the train step under bf16
    autocast, as a GPU trains: some paths differ, the MLP's recomputing Function is for fp32)."""
    rows = []
    for step in steps:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step == "train_bf16"):
            result = compiled_counts(step.removesuffix("_bf16"), name, size)
        graphs = result.get("graphs_per_step")
        rows.append(
            {
                "model": name,
                "step": step,
                "fullgraph": result.get("fullgraph", ""),
                "graphs_per_step": graphs if graphs is not None else "",
                "target": 1 if step == "decode" else "",
                "met": (graphs == 1) if step == "decode" and graphs is not None else "",
                "recompiles": result.get("recompiles", ""),
                "graph_breaks": result.get("graph_breaks", ""),
                "break_reasons": result.get("break_reasons", "") or result.get("error", ""),
            }
        )
    return rows


def top_ops(by_name: dict, n: int = 8) -> str:
    ranked = sorted(by_name.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return ", ".join(f"{op.removeprefix('aten::')} {count:g}" for op, count in ranked)


def markdown(rows: list[dict], columns: list[str]) -> list[str]:
    def show(value):
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(show(r.get(c, "")) for c in columns) + " |" for r in rows]
    return lines


def write_csv(path: Path, rows: list[dict]):
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


EAGER_COLUMNS = {
    "decode": ["model", "decode_per_layer", "decode_over_gpt2", "decode_met", "decode_product_per_layer",
               "decode_whole"],
    "train": ["model", "train_per_layer", "train_over_gpt2", "train_met", "train_product_per_layer", "train_whole",
              "train_bf16_per_layer", "train_bf16_over_gpt2", "train_bf16_met"],
}  # fmt: skip
COMPILED_COLUMNS = ["model", "step", "fullgraph", "graphs_per_step", "met", "recompiles", "graph_breaks",
                    "break_reasons"]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encodings", nargs="+", default=list(lrpe_hf.POSITIONAL_ENCODINGS))
    parser.add_argument(
        "--fla",
        action=argparse.BooleanOptionalAction,
        default=importlib.util.find_spec("fla") is not None,
        help="add +fla rows: the product on fla's path, fla's kernels stood in by its torch references (default: "
        "where fla-core is installed)",
    )
    parser.add_argument(
        "--compiled",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count graphs: decoding for every model, the train step for GPT-2 and the torch path",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="add the train step under bf16 autocast, eager and compiled (slow on a CPU)"
    )
    default_encoding = LinearGPTConfig().positional_encoding
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the counts do not depend on it)")
    parser.add_argument("--output_dir", "--out", type=Path, default=Path(__file__).parent / "results" / "ops")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._logging.set_logs(dynamo=logging.ERROR)  # graph breaks are counted, not printed
    args.output_dir.mkdir(parents=True, exist_ok=True)
    names = [GPT2] + args.encodings + ([f"{e}+fla" for e in args.encodings] if args.fla else [])
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; models: {' '.join(names)}", flush=True)

    eager, compiled, per_op, gpt2 = [], [], {}, None
    for name in names:
        row, counts = eager_row(name, gpt2, SIZE, args.bf16)
        gpt2 = gpt2 or counts
        eager.append(row)
        per_op[name] = counts
        print(
            f"{name}: decode {row['decode_per_layer']:g} ops/layer ({row['decode_over_gpt2']:.2f}x GPT-2), train "
            f"{row['train_per_layer']:g} ({row['train_over_gpt2']:.2f}x)",
            flush=True,
        )
        if args.compiled:
            steps = ("decode",) if name.endswith("+fla") else ("decode", "train") + ("train_bf16",) * args.bf16
            rows = compiled_rows(name, steps, SIZE)
            compiled += rows
            print("  compiled: " + "; ".join(f"{r['step']} {r['graphs_per_step']} graphs/step, fullgraph "
                                             f"{r['fullgraph'][:60]}" for r in rows), flush=True)  # fmt: skip

    shown = {GPT2, default_encoding, "none", f"{default_encoding}+fla", "none+fla"}
    top = [
        {"model": name, "step": step, "ops_per_layer": per_op[name][step]["per_layer"],
         "top_ops_per_layer": top_ops(per_op[name][step]["by_name"])}
        for step in ("decode", "train") for name in names if name in shown
    ]  # fmt: skip

    csvs = ["ops.csv", "top_ops.csv", *(["compiled.csv"] if compiled else [])]
    write_provenance(args.output_dir / "ops.json", "cpu", files=csvs)
    write_csv(args.output_dir / "ops.csv", eager)
    write_csv(args.output_dir / "top_ops.csv", top)
    if compiled:
        write_csv(args.output_dir / "compiled.csv", compiled)

    report = [
        "ATen ops per layer, counted by torch.profiler on the CPU (a stand-in for a GPU's kernel launches), per layer "
        "= (count(6 layers) - count(1 layer)) / 5; targets: decoding <= 1.5x GPT-2, train step <= 2x.",
        "",
        f"Decoding step (batch 1, after {DECODE_CONTEXT} tokens, fp32):",
        "",
        *markdown(eager, EAGER_COLUMNS["decode"]),
        "",
        f"Train step (forward + backward, batch 1, {TRAIN_TOKENS} tokens, one block; fp32, and bf16 autocast with "
        "--bf16):",
        "",
        *markdown(eager, [c for c in EAGER_COLUMNS["train"] if c in eager[0]]),
    ]
    if compiled:
        report += ["", "Compiled (graphs dynamo hands its backend; target: decoding one graph per step):", ""]
        report += markdown(compiled, COMPILED_COLUMNS)
    report += ["", "Top ops per layer:", "", *markdown(top, ["model", "step", "ops_per_layer", "top_ops_per_layer"])]
    print("\n" + "\n".join(report))
    details = ["", "Per-layer counts by op, every model:", ""]
    for name in names:
        for step in per_op[name]:
            details.append(f"- {name}, {step}: {top_ops(per_op[name][step]['by_name'], n=100)}")
    (args.output_dir / "ops.md").write_text("\n".join(report + details) + "\n")


if __name__ == "__main__":
    main()
