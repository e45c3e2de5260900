"""Machine-written records (lrpe_hf.training.provenance): what they hold, and which changes make a tree unclean."""

import json

from lrpe_hf.training import provenance


def test_a_record_names_its_files_and_appends_each_invocation(tmp_path):
    path = provenance.write_record(tmp_path / "results.json", ["results.csv"], "tool.py", seconds=1.5, jobs=2)
    record = json.loads(path.read_text())
    assert record["written_by"] == "tool.py" and record["files"] == ["results.csv"]
    (entry,) = record["invocations"]
    assert entry["seconds"] == 1.5 and entry["jobs"] == 2 and entry["command"].startswith("python ")
    provenance.write_record(path, ["other.csv"], "tool.py", append=True)
    record = json.loads(path.read_text())
    assert len(record["invocations"]) == 2 and record["files"] == ["other.csv", "results.csv"]
    provenance.write_record(path, ["results.csv"], "tool.py")  # without append: a new record
    assert len(json.loads(path.read_text())["invocations"]) == 1


def test_a_record_is_found_beside_its_csv_or_by_its_files(tmp_path):
    (tmp_path / "a.csv").write_text("x\n")
    (tmp_path / "b.csv").write_text("x\n")
    (tmp_path / "c.csv").write_text("x\n")
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "run.json").write_text(json.dumps({"files": ["b.csv"]}))
    assert provenance.record_of(tmp_path / "a.csv") == tmp_path / "a.json"
    assert provenance.record_of(tmp_path / "b.csv") == tmp_path / "run.json"
    assert provenance.record_of(tmp_path / "c.csv") is None


def test_changes_inside_the_output_folder_leave_the_tree_clean(monkeypatch):
    status = " M lrpe_hf/x.py\n?? out/sweep/results.csv\n?? docs/data/new/\n"
    monkeypatch.setattr(provenance, "git", lambda *args: "f" * 40 + "\n" if args[0] == "rev-parse" else status)
    commit, clean, changes = provenance.working_tree(provenance.ROOT / "docs/data/new")
    assert commit == "f" * 40 and clean is False and changes == ["M lrpe_hf/x.py", "?? out/sweep/results.csv"]
    monkeypatch.setattr(
        provenance, "git", lambda *args: "f" * 40 if args[0] == "rev-parse" else "?? docs/data/new/a.csv\n"
    )
    assert provenance.working_tree(provenance.ROOT / "docs/data/new") == ("f" * 40, True, [])
    monkeypatch.setattr(provenance, "git", lambda *args: None)  # not a git checkout
    assert provenance.working_tree(provenance.ROOT / "out") == (None, None, [])


def test_the_command_is_written_as_it_is_typed(monkeypatch):
    monkeypatch.setattr(
        provenance.sys, "argv", [str(provenance.ROOT / "run_scripts/compare_encodings.py"), "--seeds", "5"]
    )
    assert provenance.command_line() == "python run_scripts/compare_encodings.py --seeds 5"
    monkeypatch.setattr(provenance.sys, "argv", [str(provenance.ROOT / "lrpe_hf/__main__.py"), "compare_encodings"])
    assert provenance.command_line() == "python -m lrpe_hf compare_encodings"
