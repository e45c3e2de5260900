"""The README's Python snippets run as written, in a fresh interpreter each, as a newcomer would paste them;
``python -m lrpe_hf --help`` lists the scripts and each script's --help explains its options."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lrpe_hf.training import glue, image_classification, language_modeling, linearization, tokenizer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each snippet runs in a fresh interpreter
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_written(index, tmp_path):
    result = subprocess.run(
        [sys.executable, "-W", "error::UserWarning:lrpe_hf", "-c", SNIPPETS[index]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_python_m_lrpe_hf_lists_the_scripts():
    result = subprocess.run([sys.executable, "-m", "lrpe_hf", "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0
    for script in ("train_tokenizer", "run_mlm", "run_clm", "run_glue", "run_image_classification", "run_linearize"):
        assert script in result.stdout
    assert not result.stderr  # no warning on the way


@pytest.mark.parametrize("module", [tokenizer, language_modeling, glue, image_classification, linearization])
def test_script_help_is_grouped_and_explained(module):
    text = module.argument_parser().format_help()
    groups = re.findall(r"^(\w+): .*:$", text, flags=re.M)
    assert groups, "options come in named groups"
    ours = text.split(f"{groups[0]}: ")[1]  # the options this project adds (the Trainer's come first)
    options = re.findall(r"^  (--\w+)", ours, flags=re.M)
    undocumented = [o for o in options if re.search(rf"^  {o}[^\n]*\n\s+\(default", ours, flags=re.M)]
    assert options and not undocumented, undocumented
