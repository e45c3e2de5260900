"""GLUE metrics (accuracy, F1, Matthews correlation, Pearson and Spearman correlations), numpy only."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "The metric of each GLUE task, plus generic classification and regression metrics."
_CITATION = "Wang et al., GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding, 2019."
_INPUTS = "predictions and references: class ids (classification) or floats (stsb, regression)."

ACCURACY_TASKS = ("sst2", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli", "hans")
CONFIGS = ACCURACY_TASKS + ("cola", "mrpc", "qqp", "stsb", "classification", "regression")


def accuracy(p, r):
    return float((p == r).mean())


def f1_binary(p, r):
    tp = float(((p == 1) & (r == 1)).sum())
    fp = float(((p == 1) & (r == 0)).sum())
    fn = float(((p == 0) & (r == 1)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def f1_macro(p, r):
    labels = np.union1d(p, r)
    return float(np.mean([f1_binary((p == c).astype(int), (r == c).astype(int)) for c in labels]))


def matthews(p, r):
    labels = np.union1d(p, r)
    confusion = np.array([[np.sum((r == a) & (p == b)) for b in labels] for a in labels], dtype=np.float64)
    t, q = confusion.sum(1), confusion.sum(0)
    c, s = np.trace(confusion), confusion.sum()
    denominator = np.sqrt((s**2 - q @ q) * (s**2 - t @ t))
    return float((c * s - t @ q) / denominator) if denominator else 0.0


def ranks(x):
    """Average ranks (ties share the mean of their positions)."""
    order = np.argsort(x, kind="mergesort")
    ranked = np.empty(len(x))
    ranked[order] = np.arange(len(x))
    for value in np.unique(x):
        tied = x == value
        ranked[tied] = ranked[tied].mean()
    return ranked


def pearson(p, r):
    return float(np.corrcoef(p, r)[0, 1])


class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name not in CONFIGS:
            raise KeyError(f"Unknown GLUE metric config {self.config_name!r}; valid: {', '.join(CONFIGS)}")
        kind = "float32" if self.config_name in ("stsb", "regression") else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value(kind), "references": datasets.Value(kind)}),
        )

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions), np.asarray(references)
        task = self.config_name
        if task in ("stsb", "regression"):
            return {"pearson": pearson(p, r), "spearmanr": pearson(ranks(p), ranks(r))}
        if task == "cola":
            return {"matthews_correlation": matthews(p, r)}
        if task in ("mrpc", "qqp"):
            return {"accuracy": accuracy(p, r), "f1": f1_binary(p, r)}
        if task == "classification":
            return {"accuracy": accuracy(p, r), "f1_macro": f1_macro(p, r)}
        return {"accuracy": accuracy(p, r)}
