"""Markdown tables from per-run result rows (a comparison's or a benchmark's ``results.csv``, read as dicts).

The docs' tables are built by these functions from the CSVs under ``docs/data/`` (``docs/build_tables.py``), so a
table cannot drift from its data. Every paired difference is taken between runs of the same seed, with the 95%
interval of ``verdicts.paired_test``.
"""

import math
import statistics

from .compare_report import cell
from .verdicts import NO_SPREAD, lower_is_better, paired_test, versus_baseline

ROW_KEYS = ("encoding", "feature_map")


def number(value) -> float | None:
    return None if value in (None, "", "-") else float(value)


def by_seed(rows: list[dict], metric: str, **match) -> dict[str, float]:
    """{seed: value of ``metric``} over the rows whose fields equal ``match``."""
    values = {}
    for row in rows:
        if all(str(row.get(k)) == str(v) for k, v in match.items()) and number(row.get(metric)) is not None:
            values[str(row["seed"])] = number(row[metric])
    return values


def groups(rows: list[dict], keys=ROW_KEYS) -> list[tuple]:
    """The distinct values of ``keys``, in the rows' order."""
    seen = []
    for row in rows:
        key = tuple(str(row[k]) for k in keys)
        if key not in seen:
            seen.append(key)
    return seen


def paired_cell(values: dict[str, float], baseline: dict[str, float]) -> str:
    """The mean paired difference to ``baseline`` over the seeds both have, with its 95% interval."""
    test = paired_test([values[s] - baseline[s] for s in values if s in baseline])
    if test.pairs < 2:
        return "-" if test.pairs == 0 else f"{test.mean:+.4g} (one seed)"
    if math.isnan(test.low):
        return f"{test.mean:+.4g} ({NO_SPREAD})"
    return f"{test.mean:+.4g} [{test.low:+.3g}, {test.high:+.3g}]"


def markdown(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


def encodings_table(rows: list[dict], metric: str, baseline: str) -> list[str]:
    """One row per encoding x feature map: ``metric`` mean ± std over seeds, and the paired difference to the
    ``baseline`` encoding's runs with the same feature map where the baseline ran with it, else with the baseline's
    first feature map (as ``verdicts.baseline_comparisons`` pairs them)."""
    baseline_maps = [feature_map for encoding, feature_map in groups(rows) if encoding == baseline]
    better = "lower" if lower_is_better(metric) else "higher"
    header = ["encoding", "feature map", f"{metric} ({better} is better)", f"paired difference to {baseline}", "seeds"]
    body = []
    for encoding, feature_map in groups(rows):
        values = by_seed(rows, metric, encoding=encoding, feature_map=feature_map)
        reference_map = feature_map if feature_map in baseline_maps or not baseline_maps else baseline_maps[0]
        reference = by_seed(rows, metric, encoding=baseline, feature_map=reference_map)
        difference = "0" if encoding == baseline else paired_cell(values, reference)
        body.append([encoding, feature_map, cell(list(values.values())), difference, str(len(values))])
    return markdown(header, body)


def grid_table(rows: list[dict], metric: str) -> list[str]:
    """Encodings down, feature maps across: ``metric`` mean ± std over seeds."""
    encodings = [e for (e,) in groups(rows, ("encoding",))]
    feature_maps = [m for (m,) in groups(rows, ("feature_map",))]
    body = []
    for encoding in encodings:
        cells = []
        for feature_map in feature_maps:
            values = list(by_seed(rows, metric, encoding=encoding, feature_map=feature_map).values())
            cells.append(cell(values) if values else "-")
        body.append([encoding, *cells])
    return markdown(["encoding", *feature_maps], body)


def lengths_table(rows: list[dict], prefix: str = "perplexity_at_") -> list[str]:
    """Perplexity at each evaluation length (columns ``<prefix><length>``), and the change from the first length
    to the last (mean over seeds of each run's own change)."""
    lengths = sorted({int(k.removeprefix(prefix)) for row in rows for k in row if k.startswith(prefix)})
    first, last = f"{prefix}{lengths[0]}", f"{prefix}{lengths[-1]}"
    header = ["encoding", *(f"at {n:,}" for n in lengths), f"change {lengths[0]:,} -> {lengths[-1]:,}", "seeds"]
    body = []
    for encoding, feature_map in groups(rows):
        match = dict(encoding=encoding, feature_map=feature_map)
        cells = [cell(list(by_seed(rows, f"{prefix}{n}", **match).values())) for n in lengths]
        start, end = by_seed(rows, first, **match), by_seed(rows, last, **match)
        change = statistics.fmean(end[s] / start[s] - 1 for s in start)
        body.append([encoding, *cells, f"{100 * change:+.1f}%", str(len(start))])
    return markdown(header, body)


def length_change_table(rows: list[dict], baseline: str, prefix: str = "perplexity_at_") -> list[str]:
    """Each run's change of perplexity from the first evaluation length to the last (percent), per encoding, and
    its paired difference to ``baseline``'s change in percentage points, with the verdict rule's interval, p-value
    and word (better: degrades less)."""
    lengths = sorted({int(k.removeprefix(prefix)) for row in rows for k in row if k.startswith(prefix)})
    first, last = f"{prefix}{lengths[0]}", f"{prefix}{lengths[-1]}"

    def changes(encoding: str, feature_map: str | None = None) -> dict[str, float]:
        match = dict(encoding=encoding) if feature_map is None else dict(encoding=encoding, feature_map=feature_map)
        start, end = by_seed(rows, first, **match), by_seed(rows, last, **match)
        return {seed: 100 * (end[seed] / start[seed] - 1) for seed in start if seed in end}

    reference = changes(baseline)
    span = f"{lengths[0]:,} -> {lengths[-1]:,}"
    header = [
        "encoding", "feature map", f"change {span}, % (lower is better)",
        f"paired difference to {baseline} (points)", "p", "verdict", "seeds",
    ]  # fmt: skip
    body = []
    for encoding, feature_map in groups(rows):
        values = changes(encoding, feature_map)
        if encoding == baseline:
            body.append([encoding, feature_map, cell(list(values.values())), "0", "-", "-", str(len(values))])
            continue
        test, verdict = versus_baseline(values, reference, "perplexity change")
        p_value = f"{test.p_value:.2g}" if test.pairs > 1 else "-"
        body.append(
            [encoding, feature_map, cell(list(values.values())), paired_cell(values, reference), p_value, verdict,
             str(len(values))]
        )  # fmt: skip
    return markdown(header, body)


def columns_table(sources: list[tuple[str, list[dict], str]]) -> list[str]:
    """Several sweeps side by side: one column per (label, rows, metric), one row per encoding."""
    encodings = []
    for _, rows, _ in sources:
        encodings += [e for (e,) in groups(rows, ("encoding",)) if e not in encodings]
    body = []
    for encoding in encodings:
        cells = []
        for _, rows, metric in sources:
            values = list(by_seed(rows, metric, encoding=encoding).values())
            cells.append(cell(values) if values else "-")
        body.append([encoding, *cells])
    return markdown(["encoding", *(label for label, _, _ in sources)], body)


def linearization_table(rows: list[dict]) -> list[str]:
    """``benchmarks/linearization_quality.py``'s runs: accuracy, and the share of the softmax model of the same
    steps it recovers (mean over seeds of the per-seed ratio), with the paired difference to that model."""
    reference = by_seed(rows, "eval_accuracy", model="softmax, same steps")
    header = [
        "model", "feature map", "encoding", "steps", "accuracy", "recovered",
        "paired difference to softmax, same steps", "accuracy after transfer, before fine-tuning",
        "transfer loss: first 10 steps -> held-out, after", "seeds",
    ]  # fmt: skip
    body = []
    for model, feature_map, encoding in groups(rows, ("model", "feature_map", "encoding")):
        match = dict(model=model, feature_map=feature_map, encoding=encoding)
        accuracy = by_seed(rows, "eval_accuracy", **match)
        ratios = [accuracy[s] / reference[s] for s in accuracy if s in reference]
        recovered = f"{100 * statistics.fmean(ratios):.1f}%" if ratios else "-"
        difference = "0" if model == "softmax, same steps" else paired_cell(accuracy, reference)
        after = list(by_seed(rows, "accuracy_after_transfer", **match).values())
        first = list(by_seed(rows, "transfer_loss_first", **match).values())
        held_out = list(by_seed(rows, "transfer_loss_eval", **match).values())
        loss = f"{statistics.fmean(first):.3g} -> {statistics.fmean(held_out):.3g}" if first and held_out else "-"
        steps = {str(r["steps"]) for r in rows if all(str(r[k]) == v for k, v in match.items())}
        body.append(
            [model, feature_map, encoding, "/".join(sorted(steps)), cell(list(accuracy.values())), recovered,
             difference, cell(after) if after else "-", loss, str(len(accuracy))]
        )  # fmt: skip
    return markdown(header, body)


def csv_table(rows: list[dict], columns: list[str], digits: int = 4) -> list[str]:
    """The rows as they are, the given columns, numbers to ``digits`` significant digits."""

    def show(value) -> str:
        try:
            x = float(value)
        except (TypeError, ValueError):
            return str(value)
        if math.isnan(x):
            return "-"
        return f"{x:,.{digits}g}" if abs(x) >= 1 else f"{x:.{digits}g}"

    return markdown(columns, [[show(row.get(c, "")) for c in columns] for row in rows])


def attention_floors_table(rows: list[dict]) -> list[str]:
    """``benchmark_attention.py``'s layer rows: each layer's time over its own four projections' (its floor,
    timed in the same child), and softmax attention's (SDPA) forward over the linear layer's."""

    def layer(name, mode, tokens):
        return next((r for r in rows if (r["part"], r["name"], r["mode"], str(r["tokens"])) == ("layer", name, mode,
                     str(tokens)) and number(r.get("forward_ms"))), None)  # fmt: skip

    header = [
        "layer", "mode", "tokens", "forward ms", "over its projections", "forward+backward ms",
        "over its projections'", "peak MB", "SDPA layer forward over it",
    ]  # fmt: skip
    body = []
    for name, mode, tokens in groups([r for r in rows if r["part"] == "layer"], ("name", "mode", "tokens")):
        row = layer(name, mode, tokens)
        if row is None or name.startswith("softmax"):
            continue
        forward, train = number(row["forward_ms"]), number(row["train_ms"])
        softmax = layer(f"softmax+{name}", mode, tokens) or layer("softmax+none", mode, tokens)
        sdpa = f"{number(softmax['forward_ms']) / forward:.1f}x" if softmax and name == "none" else "-"
        body.append(
            [name, mode, f"{int(tokens):,}", f"{forward:,.1f}", f"{forward / number(row['floor_forward_ms']):.2f}x",
             f"{train:,.1f}", f"{train / number(row['floor_train_ms']):.2f}x", f"{number(row['peak_mb']):,.0f}", sdpa]
        )  # fmt: skip
    return markdown(header, body)


def repeats_table(
    runs: list[list[dict]],
    keys: list[str],
    column: str,
    over: tuple[str, str] | None = None,
    only: dict[str, str] | None = None,
) -> list[str]:
    """One benchmark run several times: per row (identified by its ``keys`` columns; with ``only``, the rows whose
    columns have those values), ``column``'s median over the runs with its range and spread ((max - min) / median);
    with ``over`` = (key, value), also the row's ``column`` over that of the row of the same run that has ``value``
    for ``key`` and the same other columns (each run's ratio, then their median, range and spread). A ``met``
    column, where the CSV has one, is counted."""
    only = only or {}
    runs = [[r for r in run if all(str(r.get(k)) == v for k, v in only.items())] for run in runs]

    def identity(row):
        return tuple(str(row[k]) for k in keys)

    def spread_cell(values: list[float], unit: str = "") -> str:
        middle = statistics.median(values)
        is_ratio = unit == "x" or "_over_" in column
        form = "{:.2f}" if is_ratio else "{:,.0f}" if abs(middle) >= 100 else "{:.3g}"
        shown = [form.format(v) for v in (middle, min(values), max(values))]
        return f"{shown[0]}{unit} ({shown[1]}-{shown[2]}{unit}), {100 * (max(values) - min(values)) / middle:.0f}%"

    if not all(runs):
        raise ValueError(f"A run of the repeats has no rows{' with ' + str(only) if only else ''}")
    for run in runs:
        if len({identity(r) for r in run}) != len(run):
            raise ValueError(f"The columns {', '.join(keys)} do not tell the rows of a run apart")
    order = list(dict.fromkeys(identity(r) for run in runs for r in run if number(r.get(column)) is not None))
    values, ratios, met = {key: [] for key in order}, {key: [] for key in order}, {key: 0 for key in order}
    for run in runs:
        by_identity = {identity(r): r for r in run}
        for key in order:
            row = by_identity.get(key)
            if row is None or number(row.get(column)) is None:
                raise ValueError(f"A run of the repeats has no {column} for {', '.join(key)}")
            values[key].append(number(row[column]))
            met[key] += str(row.get("met")) == "True"
            if over is not None:
                reference = dict(zip(keys, key)) | {over[0]: over[1]}
                base = by_identity.get(tuple(reference[k] for k in keys))
                if base is not None and base is not row:
                    ratios[key].append(number(row[column]) / number(base[column]))
    label = column.replace("_", " ")
    header = [*keys, "runs", f"{label}: median (range), spread"]
    header += [f"over {over[1]}: median (range), spread"] if over else []
    header += ["met"] if "met" in runs[0][0] else []
    body = []
    for key in order:
        line = [*key, str(len(values[key])), spread_cell(values[key])]
        if over:
            line.append(spread_cell(ratios[key], "x") if ratios[key] else "-")
        if "met" in runs[0][0]:
            line.append(f"{met[key]} of {len(runs)}")
        body.append(line)
    return markdown(header, body)
