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
    if error == 0:  # every pair differs alike: nothing varied between seeds, so they measured no spread
        return PairedTest(n, mean, math.nan, math.nan, math.nan)
    half_width = student_t_quantile(0.975, n - 1) * error
    p_value = 2 * (1 - student_t_cdf(abs(mean) / error, n - 1))
    return PairedTest(n, mean, mean - half_width, mean + half_width, p_value)


def paired_bootstrap(differences, replicates: int = 10_000, seed: int = 0) -> PairedTest:
    """Paired differences over seeds and items together: ``differences[i, j]`` is one method's score on item j (a
    document) minus the other's, both from seed i. The mean over all, and its 95% percentile interval from
    ``replicates`` resamplings of the seeds and of the items, with replacement (the items drawn once per replicate
    and shared by its seeds: an item is the same for every seed); p is twice the smaller share of replicates on one
    side of 0 (at least 2 / replicates). ``pairs`` counts the seeds: one seed, or zero variance, gives no interval,
    as in ``paired_test``."""
    d = np.asarray(differences, dtype=float)
    seeds, items = d.shape
    mean = float(d.mean()) if d.size else math.nan
    if seeds < 2 or items < 1 or np.all(d == d.flat[0]):
        return PairedTest(seeds, mean, math.nan, math.nan, math.nan)
    rng = np.random.default_rng(seed)
    item_draws = rng.integers(0, items, (replicates, items))
    seed_draws = rng.integers(0, seeds, (replicates, seeds))
    per_seed = d[:, item_draws].mean(-1)  # (seeds, replicates): each seed's mean over the replicate's items
    means = per_seed[seed_draws, np.arange(replicates)[:, None]].mean(-1)
    low, high = np.quantile(means, [0.025, 0.975])
    p_value = min(1.0, 2 * max(min((means <= 0).mean(), (means >= 0).mean()), 1 / replicates))
    return PairedTest(seeds, mean, float(low), float(high), float(p_value))


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
        if r["pairs"] < 2:
            interval, p_value = ONE_PAIR, "-"
        else:
            interval, p_value = f"[{r['low']:+.3g}, {r['high']:+.3g}]", f"{r['p_value']:.2g}"
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
        lines.append(
            f"| {claim.better} better than {claim.worse} | {claim.metric} | {claim.paper} | {test.pairs} | "
            f"{test.mean:+.4g} | [{test.low:+.3g}, {test.high:+.3g}] | {test.p_value:.2g} | {test.verdict} |"
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
