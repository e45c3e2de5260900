"""Local ``evaluate`` metric modules (loaded from disk: no Hub download)."""

from pathlib import Path

import evaluate

GLUE_TASKS = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli")


def load_glue_metric(task: str | None):
    """GLUE's metric for ``task`` (one of GLUE_TASKS), or accuracy and macro F1 for other classification
    data (``None``), or Pearson / Spearman for regression (``"regression"``)."""
    config = task or "classification"
    return evaluate.load(str(Path(__file__).parent / "glue"), config_name=config)
