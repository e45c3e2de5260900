"""Eager decoding against GPT-2 at a short context, decided by paired rounds in one process.

Is one LinearGPT decoding step as fast as GPT-2's (SDPA) at 256 context? At this size a step takes a few
milliseconds, and models timed one after another in processes of their own (``benchmark_models.py``) do not decide
it: their decoding ratios to GPT-2 moved by 34-128% over ten runs (docs/performance.md). Here every model lives in
this one process (the same size as ``benchmark_models.py``: 6 x 512, 8 heads, FFN 2,048, vocabulary 8,192; batch 1,
fp32, eval mode, no gradient), and each round times every model in turn (the order rotating from round to round):

- untimed: the model's weights moved to fresh memory (where the allocator puts a weight moves a one-row product's
  time, and runs that kept one placement disagreed with each other beyond their own intervals: each round now
  samples a placement), a fresh prefill of the same ``--context``-token prompt (a new cache), then one step;
- timed: ``--new_tokens`` one-token steps, greedy.

Each encoding's time over GPT-2's in the same round is one paired sample. Over the rounds: the geometric mean of
the ratios with its 95% interval (Student's t over the log ratios, ``lrpe_hf.training.verdicts.paired_test``) and
the verdict *faster* (the interval lies below 1), *slower* (above 1) or *inconclusive*.

Writes ``decode_latency.csv``, every round's time per model in ``decode_latency_rounds.csv`` and their record
``decode_latency.json`` to ``--out``, and prints the table.

    OMP_NUM_THREADS=1 python benchmarks/decode_latency.py --out docs/data/benchmarks/decode_latency
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from benchmark_models import SIZE, build
from measure import time_ratio, write_table
from transformers import DynamicCache

from lrpe_hf import LinearAttentionCache
from lrpe_hf.modeling.forward_arguments import CACHE_OUTPUT_FIELD

GPT2 = "gpt2-sdpa"
ENCODINGS = ["none", "rope", "lrpe_orthogonal", "lrpe_unitary", "permute", "spe_sine", "fastrpb"]
FIELDS = ["model", "context", "new_tokens", "rounds", "ms_per_token", "over_gpt2", "low", "high", "p_value", "verdict"]


class Decoder:
    """One model, its prompt, and a timed round of greedy one-token steps after a fresh prefill."""

    def __init__(self, name: str, prompt: torch.Tensor, max_tokens: int):
        self.name, self.prompt = name, prompt
        self.model = build(name, max_tokens, "cpu").eval()

    def new_cache(self):
        return DynamicCache() if self.name == GPT2 else LinearAttentionCache(SIZE["layers"])

    def step(self, token, cache):
        out = self.model(input_ids=token, use_cache=True, **{CACHE_OUTPUT_FIELD: cache})
        return out.logits[:, -1:].argmax(-1), out[CACHE_OUTPUT_FIELD]

    @torch.no_grad()
    def reallocate(self):
        """Every weight moved to fresh memory, its values and strides (a decoding step's layout) kept."""
        for parameter in self.model.parameters():
            parameter.data = parameter.data.clone()

    @torch.no_grad()
    def round_ms(self, new_tokens: int) -> float:
        """Milliseconds per token of ``new_tokens`` steps after an untimed reallocation, prefill and first step."""
        self.reallocate()
        out = self.model(
            input_ids=self.prompt, use_cache=True, logits_to_keep=1, **{CACHE_OUTPUT_FIELD: self.new_cache()}
        )
        token, cache = self.step(out.logits[:, -1:].argmax(-1), out[CACHE_OUTPUT_FIELD])
        start = time.perf_counter()
        for _ in range(new_tokens):
            token, cache = self.step(token, cache)
        return 1000 * (time.perf_counter() - start) / new_tokens


def measure(encodings, context: int, new_tokens: int, rounds: int) -> dict[str, list[float]]:
    """Per model, its milliseconds per token in each of ``rounds`` rounds (after one untimed warm-up round)."""
    torch.manual_seed(0)
    prompt = torch.randint(0, SIZE["vocab"], (1, context))
    decoders = [Decoder(name, prompt, context + new_tokens + 2) for name in [GPT2, *encodings]]
    times = {decoder.name: [] for decoder in decoders}
    for round_index in range(rounds + 1):
        shift = round_index % len(decoders)
        for decoder in decoders[shift:] + decoders[:shift]:
            ms = decoder.round_ms(new_tokens)
            if round_index:
                times[decoder.name].append(ms)
    return times


def rows_of(times: dict[str, list[float]], context: int, new_tokens: int) -> list[dict]:
    rows = []
    for name, samples in times.items():
        ratio = time_ratio(samples, times[GPT2])
        if name == GPT2:
            ratio.update(low="", high="", p_value="", verdict="-")
        over_gpt2 = ratio.pop("ratio")
        rows.append(dict(
            model=name, context=context, new_tokens=new_tokens, rounds=len(samples),
            ms_per_token=round(statistics.median(samples), 3), over_gpt2=over_gpt2, **ratio,
        ))  # fmt: skip
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encodings", nargs="+", default=ENCODINGS, help="LinearGPT positional encodings")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    parser.add_argument("--new_tokens", type=int, default=16, help="timed one-token steps per model and round")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (each model once per round)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode_latency")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2 for an interval, got {args.rounds}")
    times = measure(args.encodings, args.context, args.new_tokens, args.rounds)
    rows = rows_of(times, args.context, args.new_tokens)
    rounds = [
        dict(round=i, model=name, ms_per_token=ms) for name, samples in times.items() for i, ms in enumerate(samples)
    ]
    write_table(args.out, "decode_latency", FIELDS, rows, rounds)


if __name__ == "__main__":
    main()
