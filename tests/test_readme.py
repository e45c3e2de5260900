"""The Python snippets of the README and of docs/ run as written, in a fresh interpreter each, as a newcomer would
paste them; every relative link in them leads to a file of the checkout; ``python -m lrpe_hf --help`` lists the
scripts and each script's --help explains its options."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_tiny_bert

from lrpe_hf.training import glue, image_classification, language_modeling, linearization, tokenizer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each snippet runs in a fresh interpreter
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = [snippet for page in PAGES for snippet in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]
HUB_TEACHER = "sentence-transformers/all-MiniLM-L6-v2"  # the long-document snippet's: run with a local stand-in
OFFLINE = [index for index, snippet in enumerate(SNIPPETS) if HUB_TEACHER not in snippet]


def test_the_readme_has_snippets():
    assert len(re.findall(r"```python\n", (ROOT / "README.md").read_text())) >= 2 and len(SNIPPETS) >= 6


def parenthesised(text: str) -> list[str]:
    """The outermost (...) groups of ``text``, across the lines of a paragraph (fenced code left out; each table row
    apart), so that a "(" never closed (a table cell's) hides nothing beyond its paragraph or row."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    units = [unit for paragraph in re.split(r"\n\s*\n", text) for unit in re.split(r"\n(?=\|)", paragraph)]
    groups = []
    for unit in units:
        depth, start = 0, 0
        for index, character in enumerate(unit):
            if character == "(":
                depth, start = depth + 1, index if depth == 0 else start
            elif character == ")" and depth:
                depth -= 1
                if depth == 0:
                    groups.append(unit[start : index + 1])
    return groups


def test_parenthesised_groups_stop_at_their_paragraph():
    text = "a (tested) b (x (y)) c\n| cell (cut off |\n| (next row) |\n\nnew (paragraph\nacross lines)"
    assert parenthesised(text) == ["(tested)", "(x (y))", "(next row)", "(paragraph\nacross lines)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_tested_claim_names_its_test(page):
    """A "(tested ...)" or "(...; tested)" in prose names, inside the same parentheses, the test file that covers it
    (``tests/test_*.py``, which exists) or the make target that runs it (which the Makefile has)."""
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
    unnamed = []
    for group in parenthesised(page.read_text()):
        if not re.search(r"(\(|; )tested\b", group):
            continue
        files = [name for name in re.findall(r"tests/(test_\w+\.py)", group) if (ROOT / "tests" / name).exists()]
        makes = [name for name in re.findall(r"`make ([\w-]+)`", group) if name in targets]
        if not (files or makes):
            unnamed.append(" ".join(group.split()))
    assert not unnamed, f"{page.name}: tested, but by what? {unnamed}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file(page):
    """[text](target): a target that is no URL and no anchor of the same page names a file or folder of the checkout,
    relative to the page."""
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    broken = [
        target
        for target in targets
        if not target.startswith(("http://", "https://", "#", "mailto:"))
        and not (page.parent / target.split("#")[0]).exists()
    ]
    assert not broken, f"{page.name}: links to nothing: {broken}"


@pytest.mark.parametrize("index", OFFLINE)
def test_readme_snippet_runs_as_written(index, tmp_path):
    result = subprocess.run(
        [sys.executable, "-W", "error::UserWarning:lrpe_hf", "-c", SNIPPETS[index]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_readme_long_document_snippet_runs_with_a_local_teacher(workspace, tmp_path):
    """The snippet as written, but for its teacher (a tiny BERT with the test tokenizer in place of the Hub's
    MiniLM), the corpus path (from the checkout) and its sizes (2 steps on 64-token blocks): the saved student
    reads the whole document through AutoModel and through sentence-transformers, past the teacher's table."""
    save_tiny_bert(workspace, tmp_path / "teacher", max_position_embeddings=64)
    (snippet,) = [snippet for snippet in SNIPPETS if HUB_TEACHER in snippet]
    replacements = {
        f'"{HUB_TEACHER}"': repr(str(tmp_path / "teacher")),
        '"data/wikipedia_leads/train.txt"': repr(str(ROOT / "data/wikipedia_leads/train.txt")),
        "block_size=512": "block_size=64",
        "steps=60": "steps=2",
        "steps=150": "steps=2",
    }
    for old, new in replacements.items():
        assert old in snippet, old
        snippet = snippet.replace(old, new)
    result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    shapes, encoded = result.stdout.splitlines()[-2:]
    tokens = int(re.match(r"torch.Size\(\[1, (\d+)\]\)", shapes).group(1))
    assert 64 * 8 < tokens <= 16384 and f"torch.Size([1, {tokens}, 32])" in shapes
    assert encoded == "16384 (1, 32)"


def test_python_m_lrpe_hf_lists_the_scripts():
    """``lrpe_hf.__main__.SCRIPTS`` is the one list of scripts: ``python -m lrpe_hf`` lists each, and run_scripts/
    holds one file of the same name for each, and no other."""
    from lrpe_hf.__main__ import SCRIPTS

    result = subprocess.run([sys.executable, "-m", "lrpe_hf", "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0
    for script in SCRIPTS:
        assert f"  {script} " in result.stdout
    assert not result.stderr  # no warning on the way
    assert {path.stem for path in (ROOT / "run_scripts").glob("*.py")} == set(SCRIPTS)


def test_python_m_lrpe_hf_lists_the_scripts_without_importing_the_training_stack():
    """The list comes from the package alone: no script's module, no data or metric library (seconds, not tens)."""
    check = (
        "import runpy, sys; sys.argv = ['lrpe_hf', '--help']; runpy.run_module('lrpe_hf', run_name='__main__'); "
        "print(sorted(m for m in ('lrpe_hf.training', 'datasets', 'evaluate', 'matplotlib') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("module", [tokenizer, language_modeling, glue, image_classification, linearization])
def test_script_help_is_grouped_and_explained(module):
    text = module.argument_parser().format_help()
    groups = re.findall(r"^(\w+): .*:$", text, flags=re.M)
    assert groups, "options come in named groups"
    ours = text.split(f"{groups[0]}: ")[1]  # the options this project adds (the Trainer's come first)
    options = re.findall(r"^  (--\w+)", ours, flags=re.M)
    undocumented = [o for o in options if re.search(rf"^  {o}[^\n]*\n\s+\(default", ours, flags=re.M)]
    assert options and not undocumented, undocumented
