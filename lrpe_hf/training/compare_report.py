"""The tables and plots of an encoding comparison (lrpe_hf.training.compare) from its runs' results.

- ``results.csv``: one row per run;
- ``results.md``: one row per encoding x feature map, mean +- sample standard deviation over seeds, every other
  encoding against the baseline (the first encoding listed, or ``--baseline``) per metric, and the verdict on each
  of the preset's claims (``verdicts.py``: one paired test over seeds for both);
- ``comparisons.csv``: the baseline comparisons, one row per encoding x feature map x metric: pairs, the paired
  difference (encoding - baseline), its 95% interval, p-value and verdict (better, worse, inconclusive);
- ``metric_<name>.png``: each metric per encoding, error bars one standard deviation;
- ``loss_curves.png``: training loss against step per encoding, mean over seeds;
- ``extrapolation.png`` (when runs were evaluated at other lengths): perplexity against evaluation length.
"""

import csv
import math
import statistics
from pathlib import Path

from .verdicts import baseline_comparisons, claims_table, comparisons_table

LENGTH_PREFIX = "perplexity_at_"
FIGURES = ("train_time_s", "train_tokens_per_s", "peak_memory_mb")


def metric_names(results: list[dict]) -> list[str]:
    names = []
    for result in results:
        names += [name for name in result["metrics"] if name not in names]
    return names


def write_csv(path: Path, results: list[dict]) -> Path:
    names = metric_names(results)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "encoding", "feature_map", "seed", *names, *FIGURES])
        for r in results:
            metrics = [r["metrics"].get(name, "") for name in names]
            writer.writerow([r["task"], r["encoding"], r["feature_map"], r["seed"], *metrics, *(r[k] for k in FIGURES)])
    return path


def groups(results: list[dict]) -> dict[str, list[dict]]:
    """The runs of each encoding x feature map, in sweep order, keyed by a label (the feature map shows only when
    the sweep compares several)."""
    several = len({r["feature_map"] for r in results if r["feature_map"] != "-"}) > 1
    grouped = {}
    for r in results:
        label = f"{r['encoding']} ({r['feature_map']})" if several and r["feature_map"] != "-" else r["encoding"]
        grouped.setdefault(label, []).append(r)
    return grouped


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def cell(values: list[float]) -> str:
    mean, std = mean_std(values)
    return f"{mean:.4g} ± {std:.2g}" if len(values) > 1 else f"{mean:.4g}"


def direction(name: str) -> str:
    return " (lower is better)" if "perplexity" in name else " (higher is better)" if "accuracy" in name else ""


COMPARISON_COLUMNS = (
    "encoding", "feature_map", "baseline", "baseline_feature_map", "metric", "pairs", "difference", "low", "high",
    "p_value", "verdict",
)  # fmt: skip


def write_comparisons_csv(path: Path, records: list[dict]) -> Path:
    """``baseline_comparisons``' records; the interval and p-value are empty where there is none (one seed, or the
    same difference on every seed)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COMPARISON_COLUMNS)
        writer.writeheader()
        for record in records:
            shown = {k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}
            writer.writerow(shown)
    return path


def comparison_lines(records: list[dict], baseline: str) -> list[str]:
    """The baseline comparisons as results.md shows them (and the sweep prints them)."""
    if not records:
        return []
    lines = [
        f"Every encoding against {baseline}, per metric: a paired test over seeds (``lrpe_hf/training/verdicts.py``;"
    ]
    lines += ["better or worse when the 95% interval excludes 0, inconclusive otherwise):", ""]
    lines += comparisons_table(records)
    if any(r["pairs"] < 2 for r in records):
        lines += ["", "One seed gives no interval (run --seeds 2 or more), so those verdicts stay inconclusive."]
    if any(r["pairs"] >= 2 and math.isnan(r["low"]) for r in records):
        lines += ["", "A difference that is the same on every seed gives no interval (the seeds changed nothing it "
                  "measures), so it stays inconclusive."]  # fmt: skip
    return lines


def write_markdown(
    path: Path, results: list[dict], title: str, mirrors: str, settings: dict, claims=(), comparisons=(), baseline=""
) -> Path:
    names = metric_names(results)
    lines = [f"# {title}", ""]
    if mirrors:
        lines += [f"Mirrors: {mirrors}.", ""]
    shown = {k: v for k, v in settings.items() if v not in (None, [])}
    lines += ["Settings: " + ", ".join(f"{k}={v}" for k, v in shown.items()) + ".", ""]
    lines += ["Mean ± sample standard deviation over seeds.", ""]
    header = ["encoding", "feature map", *(n + direction(n) for n in names)]
    header += ["train time (s)", "train tokens/s", "peak memory (MB)", "seeds"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for runs in groups(results).values():
        row = [runs[0]["encoding"], runs[0]["feature_map"]]
        row += [cell([r["metrics"][n] for r in runs if n in r["metrics"]]) for n in names]
        row += [f"{statistics.fmean(r[k] for r in runs):,.1f}" for k in FIGURES]
        lines.append("| " + " | ".join(row + [str(len(runs))]) + " |")
    if comparisons:
        lines += ["", *comparison_lines(list(comparisons), baseline)]
    table = claims_table(results, list(claims))
    if len(table) > 2:
        lines += ["", "The papers' claims, each a paired test over seeds (``lrpe_hf/training/verdicts.py``):", ""]
        lines += table
    path.write_text("\n".join(lines) + "\n")
    return path


def new_figure(width: float = 7, height: float = 4.5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(width, height))


def save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_metric(path: Path, results: list[dict], name: str) -> Path:
    grouped = groups(results)
    stats = [mean_std([r["metrics"][name] for r in runs if name in r["metrics"]]) for runs in grouped.values()]
    plt, fig, ax = new_figure(max(6, 0.6 * len(grouped) + 2))
    errors = [0 if math.isnan(std) else std for _, std in stats]
    # points, not bars: a bar's zero baseline would hide differences of a few percent (perplexities)
    ax.errorbar(range(len(grouped)), [mean for mean, _ in stats], yerr=errors, fmt="o", capsize=4)
    ax.set_xticks(range(len(grouped)), list(grouped), rotation=45, ha="right")
    ax.set_ylabel(name + direction(name))
    ax.set_title(f"{name}: mean ± std over seeds")
    ax.grid(True, alpha=0.3)
    return save(plt, fig, path)


def plot_loss_curves(path: Path, results: list[dict]) -> Path:
    plt, fig, ax = new_figure()
    for label, runs in groups(results).items():
        losses = {}
        for r in runs:
            for step, loss in r["loss_curve"]:
                losses.setdefault(step, []).append(loss)
        steps = sorted(losses)
        ax.plot(steps, [statistics.fmean(losses[s]) for s in steps], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over seeds)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save(plt, fig, path)


def plot_extrapolation(path: Path, results: list[dict], lengths: list[int]) -> Path:
    plt, fig, ax = new_figure()
    for label, runs in groups(results).items():
        stats = [mean_std([r["metrics"][f"{LENGTH_PREFIX}{n}"] for r in runs]) for n in lengths]
        errors = [0 if math.isnan(std) else std for _, std in stats]
        ax.errorbar(lengths, [mean for mean, _ in stats], yerr=errors, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    low, high = ax.get_ylim()
    if low > 0 and high / low > 10:  # a blow-up at long lengths: a log scale keeps the short lengths readable
        ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("validation perplexity (lower is better)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save(plt, fig, path)


def write_report(
    output_dir: Path, results: list[dict], title: str, mirrors: str, settings: dict, claims=(), baseline=None
) -> list[Path]:
    """Every output of the sweep; ``baseline`` (default: the first encoding run) is what every other encoding is
    compared with."""
    baseline = baseline or results[0]["encoding"]
    comparisons = baseline_comparisons(results, baseline, metric_names(results))
    written = [write_csv(output_dir / "results.csv", results)]
    written.append(write_comparisons_csv(output_dir / "comparisons.csv", comparisons))
    written.append(
        write_markdown(output_dir / "results.md", results, title, mirrors, settings, claims, comparisons, baseline)
    )
    names = [name for name in metric_names(results) if not name.startswith(LENGTH_PREFIX)]  # those: extrapolation
    written += [plot_metric(output_dir / f"metric_{name}.png", results, name) for name in names]
    written.append(plot_loss_curves(output_dir / "loss_curves.png", results))
    if settings.get("eval_lengths"):
        written.append(plot_extrapolation(output_dir / "extrapolation.png", results, settings["eval_lengths"]))
    return written
