"""One verdict rule for every comparison: a paired test over seeds.

A claim says that one encoding scores better than another on a metric (the paper's direction). The runs of the two
with the same seed form a pair, and d_i = (score of the claimed better - score of the other) on seed i, signed so
that d > 0 means the claim's direction (for a lower-is-better metric, the score is negated). Over n pairs:

- the mean paired difference, its 95% confidence interval mean +- t(0.975, n - 1) sd / sqrt(n) (Student's t with
  n - 1 degrees of freedom), and the two-sided p-value of the paired t-test;
- the verdict: *reproduced* when the interval lies above 0 (the paper's direction holds), *contradicted* when it
  lies below 0 (the opposite holds), *inconclusive* otherwise, or with fewer than two pairs.

The comparison tool writes this table for a preset's claims (``presets.PRESETS[...]["claims"]``); run this module on
a results.csv to recompute it::

    python -m lrpe_hf.training.verdicts --preset lrpe_table2 docs/data/medium/lrpe_table2.csv
"""

import argparse
import csv
import math
import statistics
from dataclasses import dataclass

from .presets import PRESETS, Claim


@dataclass(frozen=True)
class PairedTest:
    pairs: int
    mean: float
    low: float
    high: float
    p_value: float

    @property
    def verdict(self) -> str:
        if self.pairs < 2 or math.isnan(self.low):
            return "inconclusive"
        if self.low > 0:
            return "reproduced"
        if self.high < 0:
            return "contradicted"
        return "inconclusive"


def lower_is_better(metric: str) -> bool:
    return "perplexity" in metric or "loss" in metric


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom: the density integrated by Simpson's rule."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x):
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))

    steps = 4000  # even
    width = abs(t) / steps
    total = density(0.0) + density(abs(t))
    total += sum((4 if i % 2 else 2) * density(i * width) for i in range(1, steps))
    half = total * width / 3
    return 0.5 + math.copysign(half, t)


def student_t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (0.5 <= p < 1), by bisection."""
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if student_t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


def paired_test(differences: list[float]) -> PairedTest:
    n = len(differences)
    if n < 2:
        mean = differences[0] if differences else math.nan
        return PairedTest(n, mean, math.nan, math.nan, math.nan)
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    error = sd / math.sqrt(n)
    if error == 0:
        return PairedTest(n, mean, mean, mean, 0.0 if mean else 1.0)
    half_width = student_t_quantile(0.975, n - 1) * error
    p_value = 2 * (1 - student_t_cdf(abs(mean) / error, n - 1))
    return PairedTest(n, mean, mean - half_width, mean + half_width, p_value)


def paired_claim(rows: list[dict], claim: Claim) -> PairedTest:
    """rows: one per run, with ``encoding``, ``seed`` and the claim's metric (results.csv's columns, or the
    comparison's results with their ``metrics``)."""

    def scores(encoding):
        by_seed = {}
        for row in rows:
            metrics = row.get("metrics", row)
            if row["encoding"] == encoding and metrics.get(claim.metric) not in (None, ""):
                by_seed[str(row["seed"])] = float(metrics[claim.metric])
        return by_seed

    better, worse = scores(claim.better), scores(claim.worse)
    sign = -1.0 if lower_is_better(claim.metric) else 1.0
    return paired_test([sign * (better[seed] - worse[seed]) for seed in better if seed in worse])


def claims_table(rows: list[dict], claims: list[Claim]) -> list[str]:
    """Markdown lines: one row per claim whose encodings both ran."""
    encodings = {row["encoding"] for row in rows}
    lines = [
        "| claim | metric | paper | pairs | paired difference, the claim's direction positive | 95% interval | p | "
        "verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for claim in claims:
        if claim.better not in encodings or claim.worse not in encodings:
            continue
        test = paired_claim(rows, claim)
        lines.append(
            f"| {claim.better} better than {claim.worse} | {claim.metric} | {claim.paper} | {test.pairs} | "
            f"{test.mean:+.4g} | [{test.low:+.3g}, {test.high:+.3g}] | {test.p_value:.2g} | {test.verdict} |"
        )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, choices=[name for name in PRESETS if PRESETS[name].get("claims")])
    parser.add_argument("results_csv")
    args = parser.parse_args()
    with open(args.results_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    print("\n".join(claims_table(rows, PRESETS[args.preset]["claims"])))


if __name__ == "__main__":
    main()
