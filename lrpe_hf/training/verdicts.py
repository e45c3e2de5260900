"""One verdict rule for every comparison: a paired test over seeds.

A claim says that one encoding scores better than another on a metric (the paper's direction). The runs of the two
with the same seed form a pair, and d_i = (score of the claimed better - score of the other) on seed i, signed so
that d > 0 means the claim's direction (for a lower-is-better metric, the score is negated). Over n pairs:

- the mean paired difference, its 95% confidence interval mean +- t(0.975, n - 1) sd / sqrt(n) (Student's t with
  n - 1 degrees of freedom), and the two-sided p-value of the paired t-test;
- the verdict: *reproduced* when the interval lies above 0 (the paper's direction holds), *contradicted* when it
  lies below 0 (the opposite holds), *inconclusive* otherwise, with fewer than two pairs, or when every pair
  differs by the same amount (zero variance: the seeds changed nothing that the comparison measures, so they give
  no interval, and no p-value of 0 is read from them).

Any comparison gets the same rule: every encoding x feature map of a sweep against a baseline encoding (the first
listed, or ``--baseline``), per metric, paired by seed: the difference (encoding - baseline, in the metric's
units), its interval and p-value, and the verdict *better* (the interval, signed so that positive is better, lies
above 0), *worse* (below 0) or *inconclusive*. One seed gives no interval, and says so.

The comparison tool writes the claims' table for a preset (``presets.PRESETS[...]["claims"]``) and the baseline
table for every sweep; run this module on a results.csv to recompute either::

    python -m lrpe_hf.training.verdicts --preset lrpe_table2 docs/data/medium_cpu/lrpe_table2/results.csv
    python -m lrpe_hf.training.verdicts --baseline none docs/data/medium_cpu/lrpe_table2/results.csv
"""

import argparse
import csv
import functools
import math
import statistics
from dataclasses import dataclass

import numpy as np

from .presets import PRESETS, Claim, with_authors_setups


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


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom. With t = sqrt(df) tan(theta) the density becomes
    Gamma((df + 1) / 2) / (sqrt(pi) Gamma(df / 2)) cos(theta)^(df - 1) on theta in (-pi/2, pi/2): smooth and on a
    bounded interval, so Simpson's rule integrates it at any t, however far out (within 1e-8 of scipy's for df of
    1 and from 2 up; 1e-5 for df between 1 and 2 beyond t = 1e3)."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(math.pi)

    def density(angle):
        cosine = math.cos(angle)
        return math.exp(log_norm + (df - 1) * math.log(cosine)) if cosine > 0 else (1.0 if df == 1 else 0.0) / math.pi

    steps = 400  # even
    width = theta / steps
    total = density(0.0) + density(theta)
    total += sum((4 if i % 2 else 2) * density(i * width) for i in range(1, steps))
    half = min(total * width / 3, 0.5)
    return 0.5 + math.copysign(half, t)


@functools.lru_cache(maxsize=256)
def student_t_quantile(p: float, df: float) -> float:
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
    if same_up_to_rounding(sd, mean):  # every pair differs alike: the seeds measured no spread
        return PairedTest(n, mean, math.nan, math.nan, math.nan)
    half_width = student_t_quantile(0.975, n - 1) * error
    p_value = 2 * (1 - student_t_cdf(abs(mean) / error, n - 1))
    return PairedTest(n, mean, mean - half_width, mean + half_width, p_value)


def same_up_to_rounding(spread: float, mean: float) -> bool:
    """A spread of differences no larger than float64 rounding of their size (2/60 - 0/60 and 4/60 - 2/60 differ
    by 1e-17): no variation measured."""
    return spread <= 1e-9 * max(1.0, abs(mean))


def paired_over_seeds_and_items(differences) -> PairedTest:
    """Paired differences over seeds and items (documents) together: ``differences[i, j]`` is one method's score
    on item j minus the other's, both from seed i, and every seed saw the same items. The mean over all, and its
    95% interval from the two sources of variation: which items were drawn (the standard error of the mean of the
    seed-averaged per-item differences, with Student's t at items - 1 degrees of freedom) and which seeds (that of
    the per-seed means, t at seeds - 1), the two half-widths added in quadrature. With seeds that agree it is the
    paired t-interval over the items, with items that agree within each seed the one over the seeds; simulated
    with both varying at 3 seeds x 60 items it covers 94-98% (tests/test_verdicts.py). p is the normal tail of the
    mean over the half-width scaled to 1.96, so p < 0.05 exactly when the interval excludes 0. ``pairs`` counts
    the seeds: one seed, or no variation at all, gives no interval, as in ``paired_test``."""
    d = np.asarray(differences, dtype=float)
    seeds, items = d.shape
    mean = float(d.mean()) if d.size else math.nan
    if seeds < 2 or items < 2:
        return PairedTest(seeds, mean, math.nan, math.nan, math.nan)
    item_error = math.sqrt(float(d.mean(0).var(ddof=1)) / items)
    seed_error = math.sqrt(float(d.mean(1).var(ddof=1)) / seeds)
    if same_up_to_rounding(math.hypot(item_error, seed_error), mean):
        return PairedTest(seeds, mean, math.nan, math.nan, math.nan)
    half_width = math.hypot(
        student_t_quantile(0.975, items - 1) * item_error, student_t_quantile(0.975, seeds - 1) * seed_error
    )
    p_value = math.erfc(NORMAL_975 * abs(mean) / half_width / math.sqrt(2))
    return PairedTest(seeds, mean, mean - half_width, mean + half_width, p_value)


NORMAL_975 = 1.959963984540054  # the standard normal's 97.5% point


def paired_claim(rows: list[dict], claim: Claim) -> PairedTest:
    """rows: one per run, with ``encoding``, ``seed`` and the claim's metric (results.csv's columns, or the
    comparison's results with their ``metrics``)."""

    better, worse = scores(rows, claim.metric, claim.better), scores(rows, claim.metric, claim.worse)
    sign = -1.0 if lower_is_better(claim.metric) else 1.0
    return paired_test([sign * (better[seed] - worse[seed]) for seed in better if seed in worse])


def scores(rows: list[dict], metric: str, encoding: str, feature_map: str | None = None) -> dict[str, float]:
    """{seed: ``metric``} of ``encoding``'s runs (with ``feature_map`` where given); rows are results.csv's rows or
    the comparison's results (their ``metrics``)."""
    by_seed = {}
    for row in rows:
        metrics = row.get("metrics", row)
        if row["encoding"] != encoding or (feature_map is not None and str(row.get("feature_map", "-")) != feature_map):
            continue
        if metrics.get(metric) not in (None, ""):
            by_seed[str(row["seed"])] = float(metrics[metric])
    return by_seed


def versus_baseline(values: dict[str, float], reference: dict[str, float], metric: str) -> tuple[PairedTest, str]:
    """The paired test of ``values - reference`` over the seeds both have (the raw difference, in the metric's
    units), and its verdict under the claims' rule, read as *better* (the interval of the difference, signed so
    that positive is better, lies above 0), *worse* (below 0) or *inconclusive*."""
    seeds = [seed for seed in values if seed in reference]
    sign = -1.0 if lower_is_better(metric) else 1.0
    raw = paired_test([values[seed] - reference[seed] for seed in seeds])
    signed = paired_test([sign * (values[seed] - reference[seed]) for seed in seeds])
    return raw, {"reproduced": "better", "contradicted": "worse"}.get(signed.verdict, "inconclusive")


def baseline_comparisons(rows: list[dict], baseline: str, metrics: list[str]) -> list[dict]:
    """Every other encoding x feature map against ``baseline``, per metric, paired by seed: one record each
    (encoding, feature_map, baseline, baseline_feature_map, metric, pairs, difference, low, high, p_value,
    verdict). Each is paired with the baseline's runs of its own feature map where the baseline ran with it, else
    with the baseline's first feature map (softmax runs have none, ``-``)."""
    groups = []
    for row in rows:
        key = (row["encoding"], str(row.get("feature_map", "-")))
        if key not in groups:
            groups.append(key)
    baseline_maps = [feature_map for encoding, feature_map in groups if encoding == baseline]
    if not baseline_maps:
        raise ValueError(f"The baseline {baseline!r} has no runs; encodings run: {', '.join(e for e, _ in groups)}")
    records = []
    for encoding, feature_map in groups:
        if encoding == baseline:
            continue
        reference_map = feature_map if feature_map in baseline_maps else baseline_maps[0]
        for metric in metrics:
            values = scores(rows, metric, encoding, feature_map)
            reference = scores(rows, metric, baseline, reference_map)
            test, verdict = versus_baseline(values, reference, metric)
            if test.pairs == 0:
                continue
            records.append(
                dict(encoding=encoding, feature_map=feature_map, baseline=baseline, baseline_feature_map=reference_map,
                     metric=metric, pairs=test.pairs, difference=test.mean, low=test.low, high=test.high,
                     p_value=test.p_value, verdict=verdict)
            )  # fmt: skip
    return records


ONE_PAIR = "no interval: one seed (run --seeds 2 or more)"
NO_SPREAD = "no interval: the same on every seed"


def interval_and_p(test: PairedTest) -> tuple[str, str]:
    """A test's interval and p-value as the tables print them, or why it has none."""
    if test.pairs < 2:
        return ONE_PAIR, "-"
    if math.isnan(test.low):
        return NO_SPREAD, "-"
    return f"[{test.low:+.3g}, {test.high:+.3g}]", f"{test.p_value:.2g}"


def comparisons_table(records: list[dict]) -> list[str]:
    """Markdown lines of ``baseline_comparisons``' records."""
    lines = [
        "| encoding | feature map | metric | against | pairs | paired difference (encoding - baseline) | "
        "95% interval | p | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        against = (
            r["baseline"] if r["baseline_feature_map"] == "-" else f"{r['baseline']} ({r['baseline_feature_map']})"
        )
        interval, p_value = interval_and_p(PairedTest(r["pairs"], r["difference"], r["low"], r["high"], r["p_value"]))
        lines.append(
            f"| {r['encoding']} | {r['feature_map']} | {r['metric']} | {against} | {r['pairs']} | "
            f"{r['difference']:+.4g} | {interval} | {p_value} | {r['verdict']} |"
        )
    return lines


def claims_table(rows: list[dict], claims: list[Claim]) -> list[str]:
    """Markdown lines: one row per claim whose encodings both ran, and again for each form of it whose encodings
    ran in their authors' setup (``presets.with_authors_setups``)."""
    encodings = {row["encoding"] for row in rows}
    lines = [
        "| claim | metric | paper | pairs | paired difference, the claim's direction positive | 95% interval | p | "
        "verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for claim in with_authors_setups(claims, encodings):
        if claim.better not in encodings or claim.worse not in encodings:
            continue
        test = paired_claim(rows, claim)
        interval, p_value = interval_and_p(test)
        lines.append(
            f"| {claim.better} better than {claim.worse} | {claim.metric} | {claim.paper} | {test.pairs} | "
            f"{test.mean:+.4g} | {interval} | {p_value} | {test.verdict} |"
        )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=[name for name in PRESETS if PRESETS[name].get("claims")])
    parser.add_argument("--baseline", help="every other encoding against this one, per metric")
    parser.add_argument("results_csv")
    args = parser.parse_args()
    if not (args.preset or args.baseline):
        parser.error("give --preset (its claims) or --baseline (every encoding against it)")
    with open(args.results_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    if args.preset:
        print("\n".join(claims_table(rows, PRESETS[args.preset]["claims"])))
    if args.baseline:
        fixed = ("task", "encoding", "feature_map", "seed", "train_time_s", "train_tokens_per_s", "peak_memory_mb")
        metrics = [name for name in rows[0] if name not in fixed]
        print("\n".join(comparisons_table(baseline_comparisons(rows, args.baseline, metrics))))


if __name__ == "__main__":
    main()
