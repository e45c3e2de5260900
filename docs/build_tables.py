"""Build the tables of README.md and docs/*.md from the per-run CSVs under docs/data/, so that no table can drift
from its data (``tests/test_docs_tables.py`` fails when one differs).

A built table sits between two markers; the first names the kind of table and its sources (paths relative to
docs/data/):

    <!-- table: encodings medium_cpu/lrpe_table2/results.csv perplexity none -->
    | ... |
    <!-- end table -->

Kinds (``lrpe_hf/training/tables.py`` renders them):

- ``verdicts PRESET CSV``: the paired test of each of the preset's claims (``verdicts.py``);
- ``encodings CSV METRIC BASELINE``: per encoding x feature map, mean ± std and the paired difference to BASELINE;
- ``grid CSV METRIC``: encodings down, feature maps across;
- ``lengths CSV``: perplexity at each evaluation length, and its change from the first to the last;
- ``changes CSV BASELINE``: each encoding's change of perplexity from the first length to the last, paired with
  BASELINE's (the verdict rule's interval, p-value and word);
- ``columns LABEL=CSV:METRIC ...``: several sweeps side by side (LABEL's underscores become spaces);
- ``linearization CSV``: accuracy recovered by linearized students (``benchmarks/linearization_quality.py``);
- ``floors CSV``: each attention layer over its own projections (``benchmarks/benchmark_attention.py``);
- ``rows CSV COLUMN ...``: the CSV's rows as they are, those columns;
- ``repeats FOLDER CSV KEYS COLUMN [KEY=VALUE] [KEY==VALUE ...]``: one benchmark run several times
  (``FOLDER/run_*/CSV``): per row (KEYS: its identifying columns, comma-separated; KEY==VALUE: only the rows with
  that value), COLUMN's median, range and spread over the runs, and with KEY=VALUE each run's ratio to the row that
  has VALUE for KEY.

    python docs/build_tables.py           # rewrite every table
    python docs/build_tables.py --check   # list the tables that differ from their data, exit 1 if any
"""

import argparse
import csv
import re
import shlex
import sys
from pathlib import Path

from lrpe_hf.training import tables
from lrpe_hf.training.presets import PRESETS
from lrpe_hf.training.verdicts import claims_table

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- table: (.*?) -->\n)(.*?)(<!-- end table -->)", re.S)


def read(name: str) -> list[dict]:
    path = DATA / name
    if not path.exists():
        raise FileNotFoundError(f"A table names {name}, which is not under docs/data/")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def build(spec: str) -> list[str]:
    kind, *args = shlex.split(spec)
    if kind == "verdicts":
        preset, name = args
        return claims_table(read(name), PRESETS[preset]["claims"])
    if kind == "encodings":
        name, metric, baseline = args
        return tables.encodings_table(read(name), metric, baseline)
    if kind == "grid":
        name, metric = args
        return tables.grid_table(read(name), metric)
    if kind == "lengths":
        return tables.lengths_table(read(*args))
    if kind == "changes":
        name, baseline = args
        return tables.length_change_table(read(name), baseline)
    if kind == "columns":
        sources = []
        for arg in args:
            label, source = arg.split("=")
            name, metric = source.split(":")
            sources.append((label.replace("_", " "), read(name), metric))
        return tables.columns_table(sources)
    if kind == "linearization":
        return tables.linearization_table(read(*args))
    if kind == "floors":
        return tables.attention_floors_table(read(*args))
    if kind == "repeats":
        folder, name, keys, column, *options = args
        runs = [read(str(path.relative_to(DATA))) for path in sorted((DATA / folder).glob(f"run_*/{name}"))]
        if not runs:
            raise FileNotFoundError(f"A table names {folder}/run_*/{name}, which is not under docs/data/")
        only = dict(option.partition("==")[::2] for option in options if "==" in option)
        over = [tuple(option.partition("=")[::2]) for option in options if "==" not in option]
        if len(over) > 1:
            raise ValueError(f"'<!-- table: {spec} -->' names more than one KEY=VALUE reference")
        return tables.repeats_table(runs, keys.split(","), column, over[0] if over else None, only)
    if kind == "rows":
        name, *columns = args
        return tables.csv_table(read(name), columns)
    raise ValueError(f"Unknown table kind {kind!r} in '<!-- table: {spec} -->'")


def rebuilt(text: str) -> tuple[str, list[str]]:
    """The document with every table rebuilt, and the specs of those that changed."""
    changed = []

    def replace(match):
        table = "\n".join(build(match.group(2))) + "\n"
        if table != match.group(3):
            changed.append(match.group(2))
        return match.group(1) + table + match.group(4)

    return BLOCK.sub(replace, text), changed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    args = parser.parse_args()
    stale = []
    for path in DOCUMENTS:
        text, changed = rebuilt(path.read_text())
        stale += [f"{path.relative_to(ROOT)}: {spec}" for spec in changed]
        if changed and not args.check:
            path.write_text(text)
    print("\n".join(stale) if stale else "Every table matches its data.")
    if args.check and stale:
        sys.exit(1)


if __name__ == "__main__":
    main()
