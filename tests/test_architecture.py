"""docs/architecture.md stays true where a test can tell: its Layout names every file of lrpe_hf/, the hooks it
lists are the positional-encoding base class's, and the attention path keeps the shape it describes (every forward
reads top to bottom: no function of lrpe_hf/ over 60 lines, the attention layer at most 120 lines of code)."""

import ast
import re
from pathlib import Path

import lrpe_hf

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def layout_patterns() -> list[str]:
    """The file names the Layout section gives, as regular expressions (``positional_*.py`` is a pattern,
    ``modeling_linear_{roberta,gpt,vit}.py`` three names)."""
    layout = PAGE[PAGE.index("## Layout") :]
    names = re.findall(r"[\w*{},]+\.py|[\w]+/", layout)
    patterns = []
    for name in names:
        pattern = re.escape(name).replace(r"\*", r"\w*")
        pattern = re.sub(r"\\\{([\w,]+)\\\}", lambda m: "(" + m.group(1).replace(",", "|") + ")", pattern)
        patterns.append(pattern)
    return patterns


def test_the_layout_names_every_file_of_the_package():
    patterns = layout_patterns()
    package = ROOT / "lrpe_hf"
    files = [p for p in package.rglob("*.py") if p.name != "__init__.py" and "model_cards" not in p.parts]
    folders = {p.name + "/" for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    missing = [str(p.relative_to(package)) for p in files if not any(re.fullmatch(q, p.name) for q in patterns)]
    missing += [f for f in folders if not any(re.fullmatch(q, f) for q in patterns) and f not in ("glue/",)]
    assert not missing, f"docs/architecture.md's Layout does not name: {missing}"


def test_the_hooks_listed_are_the_base_class_s():
    hooks = [name for name, value in vars(lrpe_hf.PositionalEncoding).items()
             if not name.startswith("_") and (callable(value) or isinstance(value, property))]  # fmt: skip
    hooks = [name for name in hooks if name != "initial_values"]
    hooks_paragraph = PAGE[PAGE.index("The hooks (") :].split("\n\n")[0]
    for hook in hooks:
        assert f"`{hook}`" in hooks_paragraph or hook == "stacks_features", hook
    for named in re.findall(r"`(\w+)`", hooks_paragraph):
        assert named in vars(lrpe_hf.PositionalEncoding) or named == "PositionalEncoding", named


def code_lines(source: str, node: ast.AST) -> int:
    """The lines of ``node`` that hold code: not blank, not a comment, not a docstring."""
    docstrings = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(inner) is not None:
            first = inner.body[0]
            docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    return sum(
        1
        for number, line in enumerate(lines, node.lineno)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def test_no_function_of_lrpe_hf_is_over_60_lines():
    long = []
    package = ROOT / "lrpe_hf"
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(package)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_the_attention_layer_is_at_most_120_lines_of_code():
    source = (ROOT / "lrpe_hf" / "modeling" / "linear_attention.py").read_text()
    (layer,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "LinearAttention"]
    assert code_lines(source, layer) <= 120
