"""Fetch transformers' own common model tests (``ModelTesterMixin``, ``ConfigTester``) for the installed version.

The test harness is not part of the transformers wheel; it ships in the source distribution. This script asks
pip for the sdist of the installed ``transformers.__version__`` (PyPI only, no Hub), extracts the two harness
files and whatever they import relatively from the tests folder, and lays them out as the package
``transformers_tests`` under::

    tests/.transformers_harness/<version>/transformers_tests/

(``tests/.transformers_harness/`` is git-ignored, and pytest does not collect dot folders.) It is idempotent:
once a version is there (``HARNESS_OK`` written last), it returns at once. ``make test`` runs it before pytest;
``tests/test_transformers_common.py`` skips, with the reason, while the harness is missing.

Modules the harness imports that the sdist does not ship (it has only the top level of ``tests/``) are replaced
by the small stand-ins below, written by this script and never by transformers' code:

- ``exporters/test_export.py``: ``ExportTesterMixin``, the base of ``ModelTesterMixin``, runs the export tests
  (torch.export, ONNX, ...). The stand-in is empty, so those tests do not run here.
- ``generation/test_utils.py``: ``GenerationTesterMixin``. The stand-in is empty; its generate tests assume a
  tensor key/value cache, and ``tests/test_generation.py`` covers LinearGPT's generation.
- ``utils/test_configuration_utils.py``: ``config_common_kwargs``, non-default values of the attributes common to
  every ``PreTrainedConfig``, which ``ConfigTester.check_config_arguments_init`` sets and reads back.

A relative import that is neither in the sdist nor among the stand-ins fails the fetch with its name.

Usage: python tests/fetch_transformers_harness.py [--force] [--root DIR]. Exit status 0 when the harness is
ready, 1 when it could not be fetched (the reason is printed and kept in FETCH_FAILED.txt for the skip message).
"""

import argparse
import ast
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from importlib import metadata
from pathlib import Path

DEFAULT_ROOT = Path(__file__).resolve().parent / ".transformers_harness"
PACKAGE = "transformers_tests"
ENTRY_POINTS = ("test_modeling_common.py", "test_configuration_common.py")
OK_MARKER = "HARNESS_OK"
FAILED_NOTE = "FETCH_FAILED.txt"

_STAND_IN_HEADER = (
    '"""Stand-in written by tests/fetch_transformers_harness.py: the transformers sdist does not ship {path}."""\n'
)

STAND_INS = {
    "exporters/test_export.py": '''
        class ExportTesterMixin:
            """Empty: the export tests (torch.export, ONNX, ...) are not run by this harness."""
        ''',
    "generation/test_utils.py": '''
        class GenerationTesterMixin:
            """Empty: the generate tests assume a tensor key/value cache; LinearGPT's generation has its own tests."""
        ''',
    "utils/test_configuration_utils.py": """
        from transformers import PreTrainedConfig

        # Non-default values for the attributes every PreTrainedConfig has, restricted to those the installed
        # version knows (ConfigTester.check_config_arguments_init passes them and reads them back).
        _CANDIDATES = {
            "return_dict": False,
            "output_hidden_states": True,
            "output_attentions": True,
            "dtype": "float16",
            "chunk_size_feed_forward": 5,
            "architectures": ["BertModel"],
            "id2label": {0: "label"},
            "label2id": {"label": "0"},
            "problem_type": "regression",
        }
        _COMMON = PreTrainedConfig().to_dict()
        config_common_kwargs = {key: value for key, value in _CANDIDATES.items() if key in _COMMON}
        """,
}


def installed_version() -> str:
    """The installed transformers' version (the same string as ``transformers.__version__``)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        import transformers

        return transformers.__version__


def harness_dir(version: str, root: Path = DEFAULT_ROOT) -> Path:
    """The folder to put on sys.path: it holds the package ``transformers_tests``."""
    return root / version


def is_ready(version: str, root: Path = DEFAULT_ROOT) -> bool:
    return (harness_dir(version, root) / PACKAGE / OK_MARKER).is_file()


def failure_note(version: str, root: Path = DEFAULT_ROOT) -> str | None:
    note = harness_dir(version, root) / FAILED_NOTE
    return note.read_text().strip() if note.is_file() else None


def download_sdist(version: str, into: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
        "--no-binary", ":all:", "--no-deps", f"transformers=={version}", "-d", str(into),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {result.returncode}"
        raise RuntimeError(f"`pip download` of the transformers {version} sdist failed: {last[:300]}")
    archives = sorted(into.glob("transformers-*.tar.gz"))
    if not archives:
        raise RuntimeError(f"`pip download` left no transformers-*.tar.gz in {into}")
    return archives[0]


def relative_imports(source: str, module_path: str) -> list[str]:
    """Paths, relative to tests/, of the modules that ``from .x import y`` statements in the file name."""
    package = Path(module_path).parent.parts
    paths = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(package[: len(package) - (node.level - 1)] if node.level > 1 else package)
            if node.module:
                paths.append("/".join(base + node.module.split(".")) + ".py")
            else:  # from . import a, b
                paths.extend("/".join(base + [alias.name]) + ".py" for alias in node.names)
    return paths


def extract_harness(archive: Path, version: str, package_dir: Path) -> dict:
    """Extracts the entry points and their relative imports into package_dir; returns what came from where."""
    prefix = f"transformers-{version}/tests/"
    report = {"version": version, "from_sdist": [], "stand_ins": []}
    with tarfile.open(archive) as tar:
        members = {
            m.name[len(prefix) :]: m
            for m in tar.getmembers()
            if m.isfile() and m.name.startswith(prefix) and ".." not in Path(m.name).parts
        }
        pending, seen = list(ENTRY_POINTS), set()
        while pending:
            path = pending.pop()
            if path in seen:
                continue
            seen.add(path)
            package_init = path[: -len(".py")] + "/__init__.py"
            target = package_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if path in members or package_init in members:
                name = path if path in members else package_init
                source = tar.extractfile(members[name]).read().decode("utf-8")
                (package_dir / name).parent.mkdir(parents=True, exist_ok=True)
                (package_dir / name).write_text(source)
                report["from_sdist"].append(name)
                pending.extend(relative_imports(source, name))
            elif path in STAND_INS:
                target.write_text(_STAND_IN_HEADER.format(path=f"tests/{path}") + textwrap.dedent(STAND_INS[path]))
                report["stand_ins"].append(path)
            else:
                raise RuntimeError(
                    f"the harness imports tests/{path}, which the transformers {version} sdist does not ship and "
                    "which has no stand-in in tests/fetch_transformers_harness.py"
                )
    # Every folder becomes a package (the sdist has no tests/__init__.py; ConfigTester also executes that file).
    for folder in [package_dir, *(p for p in package_dir.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return report


def fetch(version: str, root: Path = DEFAULT_ROOT, force: bool = False) -> Path:
    """Makes harness_dir(version, root) ready (idempotent) and returns it; raises with the reason otherwise."""
    destination = harness_dir(version, root)
    if is_ready(version, root) and not force:
        return destination
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".partial-") as scratch:
        scratch = Path(scratch)
        archive = download_sdist(version, scratch / "download")
        package_dir = scratch / "build" / PACKAGE
        report = extract_harness(archive, version, package_dir)
        (package_dir / OK_MARKER).write_text(json.dumps(report, indent=2) + "\n")
        if destination.exists():
            shutil.rmtree(destination)
        (scratch / "build").rename(destination)  # atomic on one file system: no half-written harness is seen
    return destination


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="fetch again even if the harness is there")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"cache folder (default {DEFAULT_ROOT})")
    parser.add_argument("--version", default=None, help="transformers version (default: the installed one)")
    args = parser.parse_args(argv)
    version = args.version or installed_version()
    if is_ready(version, args.root) and not args.force:
        print(f"transformers {version} test harness: already in {harness_dir(version, args.root)}")
        return 0
    try:
        destination = fetch(version, args.root, force=args.force)
    except Exception as error:  # no network, no sdist for this version, a layout change: say so and go on
        reason = f"{type(error).__name__}: {error}"
        harness_dir(version, args.root).mkdir(parents=True, exist_ok=True)
        (harness_dir(version, args.root) / FAILED_NOTE).write_text(reason + "\n")
        print(f"Could not fetch the transformers {version} test harness: {reason}", file=sys.stderr)
        return 1
    (destination / FAILED_NOTE).unlink(missing_ok=True)
    report = json.loads((destination / PACKAGE / OK_MARKER).read_text())
    print(
        f"transformers {version} test harness: {', '.join(report['from_sdist'])} from the sdist, stand-ins for "
        f"{', '.join(report['stand_ins']) or 'nothing'}; in {destination}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
