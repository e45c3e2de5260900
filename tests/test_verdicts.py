"""The verdict rule: a paired t-test over seeds, its interval and p-value against published values."""

import math

import pytest

from lrpe_hf.training import presets
from lrpe_hf.training.verdicts import (
    Claim,
    claims_table,
    paired_claim,
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


def test_the_presets_claims_name_their_encodings_and_the_table_skips_what_did_not_run():
    for name, preset in presets.PRESETS.items():
        for claim in preset.get("claims", []):
            assert {claim.better, claim.worse} <= set(preset["encodings"]), (name, claim)
    table = claims_table(rows({"rope": [1.0, 2.0], "none": [2.0, 3.0]}, "perplexity"), presets.TABLE2_CLAIMS)
    assert len(table) == 3 and "rope better than none" in table[2]
