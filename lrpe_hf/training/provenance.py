"""Machine-written provenance: a JSON record beside the CSVs a tool writes, saying what produced them.

Every tool that writes data for the docs (``compare_encodings.py``, ``benchmarks/linearization_quality.py``, the
benchmarks under ``benchmarks/``) calls ``write_record`` once its CSVs are written; a sweep keeps a ``Record``
current after each run, so one stopped before its end has recorded how far it went. The record of ``X.csv`` is
``X.json`` beside it, or a record in the same folder that lists ``X.csv`` in its ``files``. A record::

    {"written_by": "run_scripts/compare_encodings.py",
     "files": ["results.csv", "comparisons.csv"],
     "invocations": [{"command": ..., "commit": <40 hex>, "clean": true, "changes": [], "device": ...,
                      "torch": ..., "transformers": ..., "python": ..., "threads": ..., "date": <UTC ISO time>,
                      "seconds": ...}, ...]}

``invocations`` holds one entry per run of the tool that wrote into the files: a sweep resumed later, or a
benchmark whose CSV keeps earlier invocations' rows, appends its own entry instead of replacing the first. ``clean``
says whether the git working tree had no change (tracked or untracked, ignored files aside) outside the folder the
tool writes into; ``changes`` lists those changes when it had some.
"""

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CHANGES = 20
_IMPORTED = time.time()


def git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


# What a copy of the tree without git history (a GPU machine's) is checked against its commit by: the code that runs
SOURCE_FOLDERS = ("lrpe_hf", "benchmarks", "run_scripts", "tests")
SOURCE_FILES = ("setup.cfg", "pyproject.toml", "Makefile")


def is_source(path: str) -> bool:
    """Whether a path (relative, posix) is part of the source hash: a Python file under ``SOURCE_FOLDERS``, or one
    of ``SOURCE_FILES``."""
    parts = path.split("/")
    in_folder = path.endswith(".py") and parts[0] in SOURCE_FOLDERS and not any(p.startswith(".") for p in parts)
    return path in SOURCE_FILES or in_folder


def source_hash(files: dict[str, bytes]) -> str:
    """sha256 over the sorted (path, content) pairs of the source files among ``files``."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in files if is_source(p)):
        digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return digest.hexdigest()


def working_source_hash(root: Path = ROOT) -> str:
    """The source hash of the files on disk under ``root`` (caches and hidden folders, e.g. a fetched test harness,
    aside)."""
    files = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            inside = path.relative_to(root).parts
            if "__pycache__" not in inside and not any(part.startswith(".") for part in inside):
                files[path.relative_to(root).as_posix()] = path.read_bytes()
    for name in SOURCE_FILES:
        if (root / name).exists():
            files[name] = (root / name).read_bytes()
    return source_hash(files)


def committed_source_hash(commit: str = "HEAD") -> str | None:
    """The source hash of ``commit``'s files (read from git), or None outside a git checkout."""
    listing = git("ls-tree", "-r", "--name-only", commit)
    if listing is None:
        return None
    files = {}
    for path in listing.splitlines():
        if is_source(path):
            done = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"], capture_output=True)
            files[path] = done.stdout
    return source_hash(files)


def working_tree(output_dir: Path) -> tuple[str | None, bool | None, list[str]]:
    """(the HEAD commit, whether the tree is clean outside ``output_dir``, the changed paths there), or
    (None, None, []) outside a git checkout."""
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    if commit is None or status is None:
        return None, None, []
    try:
        inside = Path(output_dir).resolve().relative_to(ROOT).as_posix().rstrip("/") + "/"
    except ValueError:  # writing outside the checkout: every change counts
        inside = None
    changes = []
    for line in status.splitlines():
        path = line[3:].split(" -> ")[-1].strip('"')
        if inside is None or not (path.rstrip("/") + "/").startswith(inside):
            changes.append(line.strip())
    return commit.strip(), not changes, changes[:MAX_CHANGES]


def device_name(device: str = "cpu") -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return f"{model or platform.processor() or 'CPU'}, {os.cpu_count()} cores"


def process_seconds() -> float:
    """Wall-clock seconds since this process started (from /proc), else since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


def command_line() -> str:
    """The command as it can be typed again from the checkout's root (``python -m lrpe_hf ...`` for the package's
    entry point)."""
    script = sys.argv[0]
    if Path(script).name == "__main__.py":
        return "python " + shlex.join(["-m", Path(script).resolve().parent.name, *sys.argv[1:]])
    try:
        script = os.path.relpath(script, ROOT) if os.path.isabs(script) or os.path.exists(script) else script
    except ValueError:
        pass
    return "python " + shlex.join([script, *sys.argv[1:]])


def invocation(output_dir: Path, device: str = "cpu", seconds: float | None = None, **extra) -> dict:
    import torch
    import transformers

    commit, clean, changes = working_tree(output_dir)
    entry = dict(
        command=command_line(),
        commit=commit,
        clean=clean,
        changes=changes,
        device=device_name(device),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        threads=torch.get_num_threads(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seconds=round(process_seconds() if seconds is None else seconds, 1),
    )
    entry.update(extra)
    return entry


class Record:
    """The record ``path`` of files in its folder, written by the tool ``written_by``: the invocations that wrote
    there before (kept with ``append``, when the same tool wrote them) and this one, whose entry each ``write``
    replaces, so a long invocation can keep its record current while it runs."""

    def __init__(self, path, written_by: str, append: bool = False):
        self.path, self.written_by = Path(path), written_by
        self.earlier_invocations, self.earlier_files = [], []
        if append and self.path.exists():
            try:
                earlier = json.loads(self.path.read_text())
            except ValueError:
                earlier = {}
            if earlier.get("written_by") == written_by:
                self.earlier_invocations = list(earlier.get("invocations", []))
                self.earlier_files = list(earlier.get("files", []))

    def write(self, files: list[str], device: str = "cpu", seconds: float | None = None, **extra) -> Path:
        """Write the record with this invocation's entry as it stands: command, commit and tree state, device,
        versions, threads, date and seconds (default: since the process started), and ``extra`` fields."""
        entry = invocation(self.path.parent, device, seconds, **extra)
        record = dict(
            written_by=self.written_by,
            files=sorted(set(files) | set(self.earlier_files)),
            invocations=[*self.earlier_invocations, entry],
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=2) + "\n")
        return self.path


def write_record(
    path, files: list[str], written_by: str, device: str = "cpu", seconds: float | None = None, append=False, **extra
) -> Path:
    """Write (or, with ``append``, extend) the record ``path`` of ``files`` (names in ``path``'s folder) with this
    invocation's entry (``Record.write``)."""
    return Record(path, written_by, append).write(files, device, seconds, **extra)


def record_of(csv_path) -> Path | None:
    """The record of a CSV: ``X.json`` beside ``X.csv``, else a JSON record beside it listing it in ``files``."""
    csv_path = Path(csv_path)
    same = csv_path.with_suffix(".json")
    if same.exists():
        return same
    for candidate in sorted(csv_path.parent.glob("*.json")):
        try:
            record = json.loads(candidate.read_text())
        except ValueError:
            continue
        if isinstance(record, dict) and csv_path.name in record.get("files", []):
            return candidate
    return None


if __name__ == "__main__":  # python -m lrpe_hf.training.provenance [COMMIT]: that commit's source hash
    print(committed_source_hash(sys.argv[1] if len(sys.argv) > 1 else "HEAD"))
