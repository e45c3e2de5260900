"""The model code's files stand one above the other: no file of lrpe_hf/modeling imports, at the top or inside a
function, a sibling that imports it back (directly or through others)."""

import ast
from pathlib import Path

MODELING = Path(__file__).resolve().parents[1] / "lrpe_hf" / "modeling"


def sibling_imports() -> dict[str, set[str]]:
    files = {path.stem: path for path in MODELING.glob("*.py")}
    graph = {}
    for name, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        graph[name] = imported & set(files)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done = set()

    def visit(name, path):
        for sibling in sorted(graph[name]):
            if sibling in path:
                return path[path.index(sibling) :] + [sibling]
            if sibling not in done:
                found = visit(sibling, path + [sibling])
                if found:
                    return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name, [name])
        if found:
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_file_of_the_model_code_imports_one_that_imports_it():
    assert find_cycle(sibling_imports()) is None
