"""The benchmark scripts run end to end (at tiny sizes: their figures are measured by hand, not in tests)."""

import csv
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_encodings_benchmark_reports_every_encoding_over_none(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "benchmark_encodings.py"), "--tokens", "64", "--rounds", "1"]
    command += ["--encodings", "rope", "fastrpb", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "encodings.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["encoding"] for r in rows] == ["none", "rope", "fastrpb"]  # none first: the others are over it
    assert all(float(r["fastest_ms"]) > 0 for r in rows)
    assert [r["target"] for r in rows] == ["1.15", "1.15", "1.15"]
    assert "| fastrpb |" in (tmp_path / "encodings.md").read_text()
