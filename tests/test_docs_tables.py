"""The docs' tables are built from the CSVs under docs/data/ (docs/build_tables.py), and every CSV says where it
came from: a table edited by hand, or data without its command, fails here."""

import importlib.util
import math
import re
from pathlib import Path

import pytest

from lrpe_hf.training import tables

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("build_tables", ROOT / "docs" / "build_tables.py")
build_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_tables)

T_975_2 = 4.302652729911275  # Student's t, 97.5% quantile, 2 degrees of freedom (published tables)


@pytest.mark.parametrize("document", build_tables.DOCUMENTS, ids=lambda p: p.name)
def test_every_table_matches_its_data(document):
    text = document.read_text()
    _, changed = build_tables.rebuilt(text)
    assert not changed, f"{document.name}: run python docs/build_tables.py; out of date: {changed}"


def test_the_docs_build_their_tables_from_data():
    specs = [m.group(2) for d in build_tables.DOCUMENTS for m in build_tables.BLOCK.finditer(d.read_text())]
    kinds = {s.split()[0] for s in specs}
    assert {"verdicts", "encodings", "linearization", "floors", "models"} <= kinds, kinds


def test_every_csv_under_docs_data_says_where_it_came_from():
    """docs/data/README.md names each CSV in a row that gives its command, commit, device and date."""
    readme = (ROOT / "docs/data/README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in readme.splitlines() if line.startswith("| `")}
    for path in sorted((ROOT / "docs/data").rglob("*.csv")):
        name = str(path.relative_to(ROOT / "docs/data"))
        assert name in rows, f"docs/data/README.md has no row for {name}"
        cells = [c.strip() for c in rows[name].split("|")[2:-1]]
        assert len(cells) >= 5 and all(cells), f"{name}: command, profile/seeds, device, code, date: {cells}"
        assert re.search(r"20\d\d-\d\d-\d\d", rows[name]), f"{name}: no date"


def test_a_table_naming_missing_data_or_an_unknown_kind_fails():
    with pytest.raises(FileNotFoundError, match="not under docs/data"):
        build_tables.build("encodings nowhere.csv perplexity none")
    with pytest.raises(ValueError, match="Unknown table kind 'pie'"):
        build_tables.build("pie medium/lrpe_table2.csv")


def rows_of(encoding, values, feature_map="elu", metric="perplexity"):
    return [dict(encoding=encoding, feature_map=feature_map, seed=s, **{metric: v}) for s, v in enumerate(values)]


def test_encodings_table_pairs_by_seed_with_the_t_interval():
    rows = rows_of("none", [10.0, 12.0, 14.0]) + rows_of("rope", [8.0, 11.0, 11.0])
    table = tables.encodings_table(rows, "perplexity", "none")
    # differences -2, -1, -3: mean -2, sample sd 1, half-width t * 1 / sqrt(3)
    half = T_975_2 / math.sqrt(3)
    assert table[2].split(" | ")[3] == "0"
    assert table[3] == f"| rope | elu | 10 ± 1.7 | -2 [{-2 - half:+.3g}, {-2 + half:+.3g}] | 3 |"


def test_encodings_table_pairs_only_the_seeds_both_ran():
    rows = rows_of("none", [10.0, 12.0]) + rows_of("rope", [9.0, 11.0, 50.0])
    assert tables.encodings_table(rows, "perplexity", "none")[3].split(" | ")[3].startswith("-1 [")


def test_lengths_table_change_is_the_mean_of_each_runs_change():
    rows = [
        dict(encoding="rope", feature_map="elu", seed=0, perplexity_at_128=100.0, perplexity_at_1024=110.0),
        dict(encoding="rope", feature_map="elu", seed=1, perplexity_at_128=200.0, perplexity_at_1024=260.0),
    ]
    line = tables.lengths_table(rows)[2]
    assert line.split(" | ")[3] == f"{100 * (0.10 + 0.30) / 2:+.1f}%"


def test_linearization_table_recovery_is_the_mean_per_seed_ratio():
    common = dict(feature_map="-", encoding="-", steps=10)
    rows = [
        dict(common, seed=0, model="softmax, same steps", eval_accuracy=0.80),
        dict(common, seed=1, model="softmax, same steps", eval_accuracy=0.50),
        dict(common, seed=0, model="linearized", eval_accuracy=0.40, accuracy_after_transfer=0.3),
        dict(common, seed=1, model="linearized", eval_accuracy=0.50, accuracy_after_transfer=0.5),
    ]
    line = tables.linearization_table(rows)[3].split(" | ")
    assert line[5] == f"{100 * (0.40 / 0.80 + 0.50 / 0.50) / 2:.1f}%"  # 75.0%, not the ratio of means (69.2%)
    assert line[7] == "0.4 ± 0.14"
