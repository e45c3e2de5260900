"""The docs' tables are built from the CSVs under docs/data/ (docs/build_tables.py), and every CSV says where it
came from: a table edited by hand, or data without its command, fails here."""

import importlib.util
import json
import math
import re
import subprocess
from pathlib import Path

import pytest

from lrpe_hf.training import provenance, tables

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
    assert {"verdicts", "encodings", "linearization", "floors", "repeats"} <= kinds, kinds


DATA = ROOT / "docs" / "data"
MACHINE_FIELDS = ("command", "commit", "clean", "device", "torch", "transformers", "threads", "date", "seconds")


def git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except OSError:
        return None


def in_history(commit: str) -> bool | None:
    """Whether ``commit`` is HEAD or one of its ancestors; None without a git checkout."""
    head = git("rev-parse", "HEAD")
    if head is None or head.returncode != 0:
        return None
    if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        return None  # a shallow clone lacks the history to look in
    return (
        bool(re.fullmatch(r"[0-9a-f]{40}", commit))
        and git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0
    )


def record_problems(name: str, record: dict) -> list[str]:
    """What is wrong with ``record`` as the provenance of docs/data/``name``: it must say which tool wrote it, and
    name every fact of every invocation, a commit in this repository's history and a clean tree."""
    invocations = record.get("invocations") or []
    problems = [] if invocations else [f"{name}: its record lists no invocation"]
    if not record.get("written_by"):
        problems.append(f"{name}: its record does not say what wrote it (written_by)")
    for entry in invocations:
        missing = [field for field in MACHINE_FIELDS if entry.get(field) is None]
        if missing:
            problems.append(f"{name}: its record lacks {', '.join(missing)}")
        commit = entry.get("commit")
        if commit is not None and in_history(commit) is False:
            problems.append(f"{name}: commit {commit} is not in this repository's history")
        if entry.get("clean") is False:
            problems.append(f"{name}: written from a tree with uncommitted changes: {entry.get('changes')}")
    return problems


def csv_names() -> list[str]:
    return [str(path.relative_to(DATA)) for path in sorted(DATA.rglob("*.csv"))]


@pytest.mark.parametrize("name", csv_names())
def test_every_csv_under_docs_data_has_its_record(name):
    """Beside each CSV, the JSON record the tool that wrote it wrote (``lrpe_hf.training.provenance``)."""
    path = provenance.record_of(DATA / name)
    assert path is not None, f"docs/data/{name} has no record beside it (X.json, or a record listing it in files)"
    record = json.loads(path.read_text())
    assert Path(name).name in record.get("files", []), f"{path.name} does not list {Path(name).name}"
    assert not record_problems(name, record)


def test_a_record_without_a_clean_known_commit_fails():
    head = git("rev-parse", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else "f" * 40
    good = dict(command="python x.py", commit=commit, clean=True, device="cpu", torch="2", transformers="5",
                threads=1, date="2026-11-25", seconds=1.0)  # fmt: skip
    assert not record_problems("new/x.csv", dict(written_by="x.py", invocations=[good]))
    dirty = dict(good, clean=False, changes=["M lrpe_hf/x.py"])
    assert "uncommitted changes" in " ".join(record_problems("new/x.csv", dict(written_by="x.py", invocations=[dirty])))
    if in_history(commit) is not None:
        unknown = dict(good, commit="0" * 40)
        assert (
            "not in this repository's history"
            in record_problems("new/x.csv", dict(written_by="x.py", invocations=[unknown]))[0]
        )
    assert (
        "lacks seconds"
        in record_problems("new/x.csv", dict(written_by="x.py", invocations=[dict(good, seconds=None)]))[0]
    )
    unknown_commit = dict(good, commit=None)  # a record written by hand after the fact knows no commit
    assert "lacks commit" in record_problems("new/x.csv", dict(written_by="x.py", invocations=[unknown_commit]))[0]
    assert "what wrote it" in record_problems("new/x.csv", dict(invocations=[good]))[0]


def test_every_csv_under_docs_data_says_where_it_came_from():
    """docs/data/README.md names each CSV in a row that gives its command, commit, device and date, and agrees
    with its record: the row's code names each invocation's commit, and its date each invocation's date."""
    readme = (DATA / "README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in readme.splitlines() if line.startswith("| `")}
    for name in csv_names():
        assert name in rows, f"docs/data/README.md has no row for {name}"
        cells = [c.strip() for c in rows[name].split("|")[2:-1]]
        assert len(cells) >= 5 and all(cells), f"{name}: command, profile/seeds, device, code, date: {cells}"
        assert re.search(r"20\d\d-\d\d-\d\d", rows[name]), f"{name}: no date"
        code, date = cells[-2], cells[-1]
        for entry in json.loads(provenance.record_of(DATA / name).read_text())["invocations"]:
            assert entry["date"][:10] in date, f"{name}: the row's date {date!r}, the record's {entry['date']}"
            assert entry["commit"][:7] in code, f"{name}: the row's code {code!r}, the record's {entry['commit']}"


def test_a_table_naming_missing_data_or_an_unknown_kind_fails():
    with pytest.raises(FileNotFoundError, match="not under docs/data"):
        build_tables.build("encodings nowhere.csv perplexity none")
    with pytest.raises(ValueError, match="Unknown table kind 'pie'"):
        build_tables.build("pie medium_cpu/lrpe_table1/results.csv")


def test_repeats_table_gives_each_rows_median_range_and_each_runs_own_ratio():
    def run(none_ms, rope_ms, met):
        return [dict(encoding="none", ms=none_ms, met=True), dict(encoding="rope", ms=rope_ms, met=met)]

    # rope over none per run: 1.2, 1.5, 1.1 (median 1.2), whereas the medians' ratio would be 14 / 10 = 1.4
    runs = [run(10, 12, True), run(8, 12, False), run(20, 22, True)]
    table = tables.repeats_table(runs, ["encoding"], "ms", ("encoding", "none"))
    assert table[0] == "| encoding | runs | ms: median (range), spread | over none: median (range), spread | met |"
    assert table[2] == "| none | 3 | 10 (8-20), 120% | - | 3 of 3 |"
    assert table[3] == "| rope | 3 | 12 (12-22), 83% | 1.20x (1.10-1.50x), 33% | 2 of 3 |"
    only_rope = tables.repeats_table(runs, ["encoding"], "ms", only={"encoding": "rope"})
    assert only_rope[2:] == ["| rope | 3 | 12 (12-22), 83% | 2 of 3 |"]
    for failed in ([*runs, run(10, "", True)], [run(10, "", True), *runs]):  # a failure in any run, first or later
        with pytest.raises(ValueError, match="no ms for rope"):
            tables.repeats_table(failed, ["encoding"], "ms")
    with pytest.raises(ValueError, match="do not tell the rows of a run apart"):
        tables.repeats_table([run(10, 12, True) + run(11, 13, True)], ["encoding"], "ms")
    with pytest.raises(ValueError, match="has no rows with"):
        tables.repeats_table(runs, ["encoding"], "ms", only={"encoding": "alibi"})
    with pytest.raises(FileNotFoundError, match="not under docs/data"):
        build_tables.build("repeats benchmarks/nowhere results.csv name forward_ms")


def rows_of(encoding, values, feature_map="elu", metric="perplexity"):
    return [dict(encoding=encoding, feature_map=feature_map, seed=s, **{metric: v}) for s, v in enumerate(values)]


def test_encodings_table_pairs_by_seed_with_the_t_interval():
    rows = rows_of("none", [10.0, 12.0, 14.0]) + rows_of("rope", [8.0, 11.0, 11.0])
    table = tables.encodings_table(rows, "perplexity", "none")
    # differences -2, -1, -3: mean -2, sample sd 1, half-width t * 1 / sqrt(3)
    half = T_975_2 / math.sqrt(3)
    assert table[2].split(" | ")[3] == "0"
    assert table[3] == f"| rope | elu | 10 ± 1.7 | -2 [{-2 - half:+.3g}, {-2 + half:+.3g}] | 3 |"


def test_encodings_table_pairs_each_feature_map_with_the_baselines_runs_of_that_map():
    """A grid's baseline ran with every feature map: each encoding's difference is to the baseline with its own map
    (both runs' numbers chosen so that a pairing across maps would give other differences); an encoding whose map
    the baseline lacks is paired with the baseline's first."""
    rows = rows_of("none", [10.0, 12.0]) + rows_of("none", [20.0, 30.0], feature_map="relu")
    rows += rows_of("rope", [9.0, 11.0]) + rows_of("rope", [18.0, 27.0], feature_map="relu")
    rows += rows_of("rope", [7.0, 9.0], feature_map="exp")
    lines = [line.split(" | ") for line in tables.encodings_table(rows, "perplexity", "none")[2:]]
    differences = {cells[1]: cells[3] for cells in lines if cells[0] == "| rope"}
    assert differences["elu"] == "-1 (no interval: the same on every seed)"  # 9 - 10, 11 - 12: no spread
    assert differences["relu"].startswith("-2.5 [")  # 18 - 20, 27 - 30
    assert (
        differences["exp"] == "-3 (no interval: the same on every seed)"
    )  # 7 - 10, 9 - 12: none with elu, its first map


def test_encodings_table_pairs_only_the_seeds_both_ran():
    rows = rows_of("none", [10.0, 12.0]) + rows_of("rope", [9.0, 11.0, 50.0])
    assert (
        tables.encodings_table(rows, "perplexity", "none")[3].split(" | ")[3]
        == "-1 (no interval: the same on every seed)"
    )


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


def test_length_change_table_pairs_each_runs_change_with_the_baselines():
    def run(encoding, seed, start, end):
        return dict(encoding=encoding, feature_map="elu", seed=seed, perplexity_at_128=start, perplexity_at_2048=end)

    rows = [run("none", 0, 100.0, 110.0), run("none", 1, 100.0, 120.0), run("none", 2, 200.0, 230.0)]
    rows += [run("rope", 0, 100.0, 112.0), run("rope", 1, 100.0, 125.0), run("rope", 2, 200.0, 232.0)]
    line = tables.length_change_table(rows, "none")[3].split(" | ")
    # changes (%): none 10, 20, 15; rope 12, 25, 16; differences 2, 5, 1: mean 8/3, sd sqrt(13/3)
    mean, half = 8 / 3, T_975_2 * math.sqrt(13 / 3) / math.sqrt(3)
    assert line[3] == f"{mean:+.4g} [{mean - half:+.3g}, {mean + half:+.3g}]" and line[5] == "inconclusive"
