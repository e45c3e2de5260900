"""The verdict rule: a paired t-test over seeds, its interval and p-value against published values."""

import math
import statistics

import numpy as np
import pytest

from lrpe_hf.training import presets
from lrpe_hf.training.tables import paired_cell
from lrpe_hf.training.verdicts import (
    ONE_PAIR,
    Claim,
    baseline_comparisons,
    claims_table,
    comparisons_table,
    paired_claim,
    paired_over_seeds_and_items,
    paired_test,
    student_t_cdf,
    student_t_quantile,
)


@pytest.mark.parametrize("df,critical", [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)])
def test_t_quantile_matches_the_published_table(df, critical):
    """Two-sided 95% critical values of Student's t, as printed in every statistics table."""
    assert student_t_quantile(0.975, df) == pytest.approx(critical, abs=1e-3)


def test_t_cdf_matches_closed_forms():
    """df = 1 is the Cauchy distribution, P(T <= t) = 1/2 + atan(t)/pi; df = 2: 1/2 + t / (2 sqrt(2 + t^2))."""
    for t in (-3.0, -0.5, 0.0, 1.0, 7.0):
        assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-7)
        assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-7)


def test_paired_test_interval_and_p_value():
    test = paired_test([1.0, 2.0, 3.0])  # mean 2, sd 1, n 3: half width 4.303 / sqrt(3)
    assert test.mean == 2.0
    assert test.low == pytest.approx(2 - 4.303 / math.sqrt(3), abs=1e-3)
    assert test.high == pytest.approx(2 + 4.303 / math.sqrt(3), abs=1e-3)
    # t = 2 sqrt(3) = 3.464 with 2 degrees of freedom: p = 1 - 3.464 / sqrt(2 + 12) = 0.0742
    assert test.p_value == pytest.approx(1 - 2 * math.sqrt(3) / math.sqrt(14), abs=1e-6)
    assert test.verdict == "inconclusive"  # three seeds all positive, yet the interval reaches below 0


def rows(scores: dict[str, list[float]], metric: str) -> list[dict]:
    return [{"encoding": e, "seed": s, metric: v} for e, values in scores.items() for s, v in enumerate(values)]


def test_verdicts_follow_the_sign_of_the_interval_and_the_metrics_direction():
    perplexity = rows({"a": [10.0, 11.0, 12.0, 10.5, 11.5], "b": [12.0, 13.1, 13.9, 12.4, 13.6]}, "perplexity")
    assert paired_claim(perplexity, Claim("a", "b", "perplexity", "")).verdict == "reproduced"  # a lower: better
    assert paired_claim(perplexity, Claim("b", "a", "perplexity", "")).verdict == "contradicted"
    accuracy = rows({"a": [0.5, 0.6, 0.7], "b": [0.52, 0.58, 0.71]}, "accuracy")
    assert paired_claim(accuracy, Claim("a", "b", "accuracy", "")).verdict == "inconclusive"
    assert paired_claim(rows({"a": [0.5], "b": [0.4]}, "accuracy"), Claim("a", "b", "accuracy", "")).verdict == (
        "inconclusive"  # one pair has no interval
    )
    same_gap = rows({"a": [0.6, 0.6, 0.6], "b": [0.5, 0.5, 0.5]}, "accuracy")  # seeds that changed nothing
    test = paired_claim(same_gap, Claim("a", "b", "accuracy", ""))
    assert test.verdict == "inconclusive" and math.isnan(test.low) and math.isnan(test.p_value)
    assert paired_cell({"0": 0.6, "1": 0.7}, {"0": 0.5, "1": 0.6}) == "+0.1 (no interval: the same on every seed)"
    (line,) = claims_table(same_gap, [Claim("a", "b", "accuracy", "")])[2:]
    assert "| no interval: the same on every seed | - | inconclusive |" in line


def test_the_presets_claims_name_their_encodings_and_the_table_skips_what_did_not_run():
    for name, preset in presets.PRESETS.items():
        for claim in preset.get("claims", []):
            assert {claim.better, claim.worse} <= set(preset["encodings"]), (name, claim)
    table = claims_table(rows({"rope": [1.0, 2.0], "none": [2.0, 3.0]}, "perplexity"), presets.TABLE2_CLAIMS)
    assert len(table) == 3 and "rope better than none" in table[2]


def test_claims_are_tested_again_for_the_encodings_run_in_their_authors_setup():
    """The LRPE claims of Table 2 against the authors' LRPE, where only those ran, and beside the default's."""
    ran = {"rope": [3.0, 4.0, 5.0], "lrpe_orthogonal@authors": [1.0, 2.5, 3.0], "lrpe_permutation@authors": [5, 6, 8]}
    table = claims_table(rows(ran, "perplexity"), presets.TABLE2_CLAIMS)
    claims = [line.split(" | ")[0].removeprefix("| ") for line in table[2:]]
    assert claims == [
        "lrpe_orthogonal@authors better than rope",
        "lrpe_orthogonal@authors better than lrpe_permutation@authors",
    ]
    assert "Type 2 32.02 against RoPE 33.36" in table[2] and "| 3 | +1.833 |" in table[2]  # mean of 2, 1.5, 2
    both = rows(
        {"lrpe_orthogonal": [1.0, 2.0], "lrpe_orthogonal@authors": [2.0, 3.0], "rope": [3.0, 3.5]}, "perplexity"
    )
    claims = [line.split(" | ")[0] for line in claims_table(both, presets.TABLE2_CLAIMS)[2:]]
    assert claims == ["| lrpe_orthogonal better than rope", "| lrpe_orthogonal@authors better than rope"]
    mixed = rows({"lrpe_orthogonal": [1.0, 2.0], "lrpe_permutation@authors": [2.0, 3.0]}, "perplexity")
    assert len(claims_table(mixed, presets.TABLE2_CLAIMS)) == 2  # two setups are not compared


def test_a_free_comparison_matches_scipys_paired_t_test():
    """Every encoding against the baseline: the paired difference, interval and p-value of an independent
    computation (scipy's ttest_rel and the explicit t formula), and the verdict words."""
    stats = pytest.importorskip("scipy.stats")
    none = [300.0, 296.5, 301.2, 299.0, 297.7]
    scores = {"none": none, "rope": [290.1, 288.0, 293.9, 289.2, 290.5], "spe": [301.0, 295.0, 303.1, 300.2, 296.9]}
    records = baseline_comparisons(rows(scores, "perplexity"), "none", ["perplexity"])
    assert [(r["encoding"], r["baseline"], r["pairs"]) for r in records] == [("rope", "none", 5), ("spe", "none", 5)]
    for record in records:
        values = scores[record["encoding"]]
        differences = [a - b for a, b in zip(values, none)]
        mean, sd, n = sum(differences) / 5, statistics.stdev(differences), 5
        half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
        assert record["difference"] == pytest.approx(mean, abs=1e-12)
        assert (record["low"], record["high"]) == (pytest.approx(mean - half, abs=1e-6), pytest.approx(mean + half))
        assert record["p_value"] == pytest.approx(stats.ttest_rel(values, none).pvalue, abs=1e-6)
    assert records[0]["verdict"] == "better"  # rope's perplexity lower on every seed: its interval below 0
    assert records[1]["verdict"] == "inconclusive"
    accuracy = baseline_comparisons(rows({"a": [0.5, 0.6, 0.7], "b": [0.6, 0.71, 0.79]}, "accuracy"), "a", ["accuracy"])
    assert accuracy[0]["verdict"] == "better"  # higher accuracy, interval above 0
    worse = baseline_comparisons(rows({"a": [0.5, 0.6, 0.7], "b": [0.4, 0.49, 0.61]}, "accuracy"), "a", ["accuracy"])
    assert worse[0]["verdict"] == "worse"


def test_a_free_comparison_with_one_seed_says_there_is_no_interval():
    records = baseline_comparisons(rows({"a": [0.5], "b": [0.7]}, "accuracy"), "a", ["accuracy"])
    assert records[0]["pairs"] == 1 and records[0]["verdict"] == "inconclusive" and math.isnan(records[0]["low"])
    line = comparisons_table(records)[2]
    assert ONE_PAIR in line and "nan" not in line


def test_a_free_comparison_pairs_each_feature_map_with_the_baselines_own():
    grid = [
        {"encoding": e, "feature_map": m, "seed": s, "perplexity": v}
        for e, m, values in [
            ("none", "elu", [10.0, 11.0]), ("none", "relu", [20.0, 21.0]),
            ("rope", "elu", [9.0, 10.0]), ("rope", "relu", [19.0, 20.5]), ("softmax:rope", "-", [8.0, 8.5]),
        ]
        for s, v in enumerate(values)
    ]  # fmt: skip
    records = baseline_comparisons(grid, "none", ["perplexity"])
    against = {(r["encoding"], r["feature_map"]): (r["baseline_feature_map"], r["difference"]) for r in records}
    assert against == {("rope", "elu"): ("elu", -1.0), ("rope", "relu"): ("relu", -0.75), ("softmax:rope", "-"): (
        "elu", -2.25)}  # fmt: skip
    with pytest.raises(ValueError, match="baseline 'learned' has no runs"):
        baseline_comparisons(grid, "learned", ["perplexity"])


def test_seeds_and_documents_together_reduce_to_the_paired_t_test_of_either_alone_and_cover_both():
    """The two-way interval: with seeds that agree it is the paired t-interval over the documents, with documents
    that agree within each seed it is the one over the seeds' means; where both vary, 95% intervals cover the true
    difference about 95% of the time (simulated), where the interval of one source alone covers far less."""
    rng = np.random.default_rng(0)
    per_document = rng.normal(0.05, 0.4, 400)
    over_documents = paired_test(list(per_document))
    alike = paired_over_seeds_and_items(np.stack([per_document] * 3))
    assert (alike.mean, alike.low, alike.high) == pytest.approx(
        (over_documents.mean, over_documents.low, over_documents.high)
    )
    assert (alike.p_value < 0.05) == (over_documents.p_value < 0.05) == (alike.verdict != "inconclusive")
    per_seed = [0.02, 0.10, 0.06]
    only_seeds = paired_over_seeds_and_items(np.repeat(np.array(per_seed)[:, None], 60, axis=1))
    over_seeds = paired_test(per_seed)
    assert (only_seeds.low, only_seeds.high) == pytest.approx((over_seeds.low, over_seeds.high))
    # 3 seeds x 60 documents, truth 0: seed sd, document sd, the rest; which single-source interval falls short
    for seed_sd, document_sd, alone in ((0.1, 0.05, "documents"), (0.005, 0.3, "seeds")):
        covered = {"both": 0, "seeds": 0, "documents": 0}
        for _ in range(400):
            d = rng.normal(0, seed_sd, (3, 1)) + rng.normal(0, document_sd, (1, 60)) + rng.normal(0, 0.05, (3, 60))
            tests = dict(both=paired_over_seeds_and_items(d), seeds=paired_test(list(d.mean(1))))
            tests["documents"] = paired_test(list(d.mean(0)))
            for name, test in tests.items():
                covered[name] += test.low <= 0 <= test.high
        # 95% of 400 give or take two binomial standard deviations (4.4): at least 371
        assert covered["both"] >= 371 and covered[alone] < 0.9 * 400, covered
    constant = paired_over_seeds_and_items(np.full((3, 60), 1 / 60))  # 1 document in 60, on every seed
    assert constant.verdict == "inconclusive" and math.isnan(constant.low)
    assert paired_over_seeds_and_items(np.stack([per_document])).verdict == "inconclusive"  # one seed: no interval
    clear = paired_over_seeds_and_items(rng.normal(0.3, 0.1, (3, 200)))
    assert clear.verdict == "reproduced" and 0 <= clear.p_value < 1e-3


def test_a_spread_within_rounding_is_no_spread_and_far_tails_keep_p_in_range():
    rounded = paired_test([58 / 60 - 56 / 60, 28 / 60 - 26 / 60, 4 / 60 - 2 / 60])  # 2 documents in 60, each seed
    assert rounded.verdict == "inconclusive" and math.isnan(rounded.p_value)
    for t in (6000.0, 2e4, 1e8):  # df 2: P(T <= t) = 1/2 + t / (2 sqrt(2 + t^2))
        assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-10)
    tight = paired_test([1.0, 1.0 + 1e-6, 1.0 - 1e-6])
    assert tight.verdict == "reproduced" and 0 <= tight.p_value < 1e-5
