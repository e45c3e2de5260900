"""docs/architecture.md stays true where a test can tell: its Layout names every file of lrpe_hf/ (and each file its
patterns stand for), every name it gives in backticks and in the layer diagram is in the code, the hooks it lists are
the encoding's and the feature map's base classes', its table of what each autograd Function saves is what the code
saves, the modeling files import their siblings as the page says transformers copies them, and the attention path
keeps the shape it describes (every forward reads top to bottom: no function of lrpe_hf/ over 60 lines, the
attention layer at most 120 lines of code). Each failure says what is stale and where on the page."""

import ast
import importlib
import inspect
import keyword
import re
from pathlib import Path

import torch

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


# --- the page held to the code: every name it gives resolves, its lists are the code's -----------------------------

PACKAGE = ROOT / "lrpe_hf"
MODELING = PACKAGE / "modeling"
SOURCES = {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py")) if "model_cards" not in path.parts}
TREES = {path: ast.parse(source) for path, source in SOURCES.items()}
TEST_TREES = [ast.parse(path.read_text()) for path in sorted((ROOT / "tests").glob("*.py"))]
# Names in backticks that are other libraries': where each is (checked), or None for a key that is no attribute
OUTSIDE_NAMES = {
    "compile_config": "transformers.GenerationConfig",  # generate's
    "get_relative_imports": "transformers.dynamic_module_utils",
    "ctx.save_for_backward": "torch.autograd.function.FunctionCtx",
    "auto_map": None,  # a saved config's key
    "token_type_ids": None,  # a model's input
}


def outside(name: str) -> bool:
    if name not in OUTSIDE_NAMES:
        return False
    if OUTSIDE_NAMES[name] is None:
        return True
    module, _, owner = OUTSIDE_NAMES[name].rpartition(".")
    value = getattr(importlib.import_module(module), owner)
    if owner == "GenerationConfig":
        value = value()
    return resolves_on(value, name.split(".")[-1:])


def where(position: int) -> str:
    """'line N, section S' of a character position of the page."""
    line = PAGE.count("\n", 0, position) + 1
    headings = [m for m in re.finditer(r"^#+ (.+)$", PAGE, flags=re.M) if m.start() <= position]
    return f"line {line} ({headings[-1].group(1) if headings else 'top'})"


def paragraph(start: str) -> tuple[str, int]:
    """The paragraph of the page that begins with ``start``, and where it begins."""
    assert start in PAGE, f"docs/architecture.md has no paragraph that begins {start!r}"
    index = PAGE.index(start)
    return PAGE[index:].split("\n\n")[0], index


def modeling_modules():
    return {path.stem: importlib.import_module(f"lrpe_hf.modeling.{path.stem}") for path in MODELING.glob("*.py")}


def code_names() -> set[str]:
    """Every name the package's code (and the tests', which the page names too) defines: modules, module-level names,
    class attributes (methods, fields, assignments), attributes set on a class from outside it, and parameters of
    functions."""
    names = {path.stem for path in SOURCES}
    for tree in [*TREES.values(), *TEST_TREES]:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.FunctionDef):
                names.update(a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for inner in ast.walk(target):
                        if isinstance(inner, ast.Name):
                            names.add(inner.id)
                        elif isinstance(inner, ast.Attribute):
                            names.add(inner.attr)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lrpe_hf"):
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def resolves(dotted: str, modules: dict, names: set[str]) -> bool:
    """Whether ``a.b.c`` names something: a module of the package (``lrpe_hf.x``, or a file's stem) or a class of
    lrpe_hf.modeling, then attributes of it (getattr, inherited ones included); for a module of lrpe_hf.training or
    the top level (not imported here), a name its file defines."""
    head, *rest = dotted.split(".")
    if head == "lrpe_hf":
        head, *rest = rest or ["__init__"]
        if hasattr(lrpe_hf, head):
            return resolves_on(getattr(lrpe_hf, head), rest)
    if head in modules:
        return resolves_on(modules[head], rest)
    classes = [c for m in modules.values() for c in vars(m).values() if inspect.isclass(c) and c.__name__ == head]
    if classes:
        return any(resolves_on(c, rest) for c in classes)
    files = [path for path in SOURCES if path.stem == head]
    if files:
        return all(part in names and re.search(rf"\b{part}\b", SOURCES[files[0]]) for part in rest)
    if rest:  # another library's module (importlib.import_module)
        try:
            return resolves_on(importlib.import_module(head), rest)
        except ImportError:
            return False
    return head in names


def resolves_on(value, attributes: list[str]) -> bool:
    for attribute in attributes:
        if not hasattr(value, attribute):
            return False
        value = getattr(value, attribute)
    return True


def path_exists(name: str) -> bool:
    """A file or folder the page names: from the root, or from lrpe_hf/, lrpe_hf/modeling/, lrpe_hf/training/,
    tests/ or benchmarks/; ``*``, ``<name>`` and ``{a,b}`` as in a shell, matching at least one."""
    patterns = [name.replace("<name>", "*").replace("<family>", "*").replace("<command>", "*")]
    braces = re.search(r"\{([\w,]+)\}", patterns[0])
    if braces:
        patterns = [patterns[0].replace(braces.group(0), part) for part in braces.group(1).split(",")]
    folders = [ROOT, PACKAGE, MODELING, PACKAGE / "training", ROOT / "tests", ROOT / "benchmarks"]
    return all(any(any(folder.glob(pattern.rstrip("/"))) for folder in folders) for pattern in patterns)


def test_every_name_the_page_gives_in_backticks_is_in_the_code():
    """A `name`, `module.name`, `Class.attribute` or `path/file.py` in backticks names something that exists: a file
    of the checkout, a module, class, function, attribute or parameter of lrpe_hf (getattr for lrpe_hf.modeling,
    whose classes inherit from torch and transformers), or a registered value (a backend, encoding, map)."""
    from lrpe_hf.modeling.products_dispatch import kernel_backends

    modules, names = modeling_modules(), code_names()
    values = {*kernel_backends(), *lrpe_hf.POSITIONAL_ENCODINGS, *lrpe_hf.FEATURE_MAPS, *lrpe_hf.NORMALIZATIONS}
    stale = []
    for match in re.finditer(r"`([^`\n]+)`", PAGE):
        name = match.group(1).removesuffix("()")
        if re.fullmatch(r"[\w./*<>{},-]+\.(py|md|csv)|[\w./-]+/", name) or "/" in name:
            found = path_exists(name.split()[0])
        elif keyword.iskeyword(name):
            continue
        elif re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*", name):
            found = outside(name) or name in values or resolves(name, modules, names)
        else:  # code with arguments, a command, an op's name: not a name to look up
            continue
        if not found:
            stale.append(f"`{name}` at {where(match.start())}")
    assert not stale, "docs/architecture.md names what the code does not have:\n" + "\n".join(stale)


def test_the_layer_diagram_names_files_and_classes_that_exist():
    """The diagram's files (``x.py``, ``products_x``) are in lrpe_hf/modeling/ and its classes are the code's."""
    diagram = PAGE[PAGE.index("## The layers") : PAGE.index("A decoding step takes")]
    start = PAGE.index("## The layers")
    names = code_names()
    stale = []
    for match in re.finditer(r"\b(\w+\.py)\b|\b([A-Z][a-z]+[A-Z]\w+)\b|\b(products_\w+|_gated)\b", diagram):
        file, cls, product = match.groups()
        if file:
            found = path_exists(file)
        elif cls:
            found = cls in names or cls in {"LinearGPT", "LinearRoberta", "LinearViT"}
        else:
            found = (MODELING / f"{'products' if product == '_gated' else ''}{product}.py").exists()
        if not found:
            stale.append(f"{match.group(0)} at {where(start + match.start())}")
    assert not stale, "docs/architecture.md's layer diagram names what the code does not have:\n" + "\n".join(stale)


def public_names(cls, base) -> list[str]:
    """The names ``cls`` defines itself, not private, not ``base``'s (Reinitialisable's: initial values)."""
    return [name for name in vars(cls) if not name.startswith("_") and name not in vars(base)]


def test_the_encoding_s_hooks_and_attributes_are_the_base_class_s():
    """The hooks paragraph lists every public name of PositionalEncoding, each as a hook or as one of the attributes
    the layer and its path read (their number in words), and names nothing else; each attribute is read outside
    the encodings' own files."""
    from lrpe_hf.modeling.reinitialisable import Reinitialisable

    base = lrpe_hf.PositionalEncoding
    text, start = paragraph("The hooks (")
    hooks_part, _, attributes_part = text.partition("attributes the layer")
    listed = set(re.findall(r"`(\w+)`", text)) - {"PositionalEncoding"}
    public = set(public_names(base, Reinitialisable))
    assert listed == public, (
        f"docs/architecture.md, {where(start)}: the hooks paragraph lists {sorted(listed - public)} that "
        f"PositionalEncoding has not, and not {sorted(public - listed)} that it has"
    )
    hooks = re.findall(r"`(\w+)`", hooks_part)
    attributes = [name for name in dict.fromkeys(re.findall(r"`(\w+)`", attributes_part)) if name not in hooks]
    number = re.search(r"(\w+) attributes the layer", text).group(1).lower()
    words = ["one", "two", "three", "four", "five", "six"]
    assert number in words and words.index(number) + 1 == len(attributes), (
        f"docs/architecture.md, {where(start)}: '{number} attributes', and it lists {attributes}"
    )
    readers = "\n".join(s for p, s in SOURCES.items() if p.parent == MODELING and not p.stem.startswith("positional_"))
    unread = [name for name in attributes if not re.search(rf"\.{name}\b", readers)]
    assert not unread, f"docs/architecture.md, {where(start)}: no file outside the encodings reads {unread}"


def test_the_feature_map_s_hooks_are_the_base_class_s():
    from lrpe_hf.modeling.feature_maps import ExponentialFeatureMap, FeatureMap
    from lrpe_hf.modeling.reinitialisable import Reinitialisable

    text, start = paragraph("A feature map's hooks (")
    listed = set(re.findall(r"`(\w+)`", text)) - {"FeatureMap", "ExponentialFeatureMap"}
    public = set(public_names(FeatureMap, Reinitialisable) + public_names(ExponentialFeatureMap, Reinitialisable))
    assert listed == public, (
        f"docs/architecture.md, {where(start)}: the feature map's hooks list {sorted(listed - public)} that "
        f"FeatureMap and ExponentialFeatureMap have not, and not {sorted(public - listed)} that they have"
    )


def autograd_functions() -> dict[str, tuple[Path, ast.ClassDef]]:
    """Every torch.autograd.Function subclass of lrpe_hf, by inspection of the imported modeling modules and by its
    source in every file (training's included), with its file and class node."""
    found = {}
    for module in modeling_modules().values():
        for name, value in vars(module).items():
            is_function = inspect.isclass(value) and issubclass(value, torch.autograd.Function)
            if is_function and value.__module__ == module.__name__:
                found[name] = None
    for path, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Function") for b in node.bases):
                found[node.name] = (path, node)
    missing = [name for name, place in found.items() if place is None]
    assert not missing, f"Functions whose source was not found: {missing}"
    return found


def saved(node: ast.AST) -> list[str]:
    """What ``ctx.save_for_backward`` is given inside ``node``, as written (``*rotated``, ``x > 0``)."""
    return [
        ast.unparse(argument)
        for call in ast.walk(node)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "save_for_backward"
        for argument in call.args
    ]


def functions_table() -> dict[str, tuple[str, list[str], int]]:
    """The page's table of what each Function saves: name -> (file cell, backticked names of the saves cell, where)."""
    heading = "## What each Function keeps for backward"
    assert heading in PAGE, f"docs/architecture.md has no section {heading!r}"
    start = PAGE.index(heading)
    section = PAGE[start:].split("\n## ")[0]
    rows = {}
    for match in re.finditer(r"^\| `([\w.]+)` \| ([^|]+) \| ([^|]+) \|", section, flags=re.M):
        rows[match.group(1)] = (match.group(2).strip(), re.findall(r"`([^`]+)`", match.group(3)), start + match.start())
    return rows


def test_the_page_says_what_every_autograd_function_saves():
    """Every custom autograd Function of lrpe_hf (and the causal product's custom op, whose ``save_inputs`` is its
    autograd) has a row in the table, in its file, with exactly what its forward hands ``ctx.save_for_backward``."""
    functions = autograd_functions()
    op_path = MODELING / "products_custom_op.py"
    (op,) = [n for n in ast.walk(TREES[op_path]) if isinstance(n, ast.FunctionDef) and n.name == "save_inputs"]
    functions["products_custom_op.save_inputs"] = (op_path, op)
    rows = functions_table()
    stale = [f"`{name}` ({path.name}) has no row" for name, (path, _) in functions.items() if name not in rows]
    stale += [f"`{name}` at {where(rows[name][2])} is no Function of lrpe_hf" for name in rows if name not in functions]
    for name, (path, node) in functions.items():
        if name in rows:
            file, saves, position = rows[name]
            if path.name not in file:
                stale.append(f"`{name}` at {where(position)} is in {path.name}, not {file}")
            if sorted(saves) != sorted(saved(node)):
                stale.append(f"`{name}` at {where(position)} saves {saved(node)}, not {saves}")
    assert not stale, "docs/architecture.md's table of what Functions save is stale:\n" + "\n".join(stale)


def test_the_modeling_files_import_siblings_as_transformers_copies_them():
    """How a checkpoint carries its code: transformers copies the siblings it finds by its own text search
    (``get_relative_imports``), which sees ``from .module import name`` and not ``from . import module``; every
    import of a sibling is found so, and none reaches outside lrpe_hf/modeling/."""
    from transformers.dynamic_module_utils import get_relative_imports

    _, start = paragraph("`lrpe_hf/modeling/` is model code only")
    wrong = []
    for path, tree in TREES.items():
        if path.parent != MODELING:
            continue
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported.update([node.module] if node.module else [alias.name for alias in node.names])
            if isinstance(node, ast.ImportFrom) and (node.level > 1 or (node.module or "").startswith("lrpe_hf")):
                wrong.append(f"{path.name} imports from outside lrpe_hf/modeling/: {ast.unparse(node)}")
        unseen = imported - set(get_relative_imports(path))
        if unseen:
            wrong.append(f"{path.name} imports {sorted(unseen)} as transformers does not see (from . import ...)")
    assert not wrong, f"docs/architecture.md, {where(start)}, says otherwise:\n" + "\n".join(wrong)


def test_the_layout_names_each_file_its_patterns_stand_for():
    """``positional_*.py`` and ``products_*.py`` in the Layout name each file they stand for (by the part the star
    stands for) where the Layout does not name it whole."""
    start = PAGE.index("## Layout")
    layout = PAGE[start:]
    for pattern in ("positional_", "products_"):
        at = layout.index(f"{pattern}*.py")
        entry = re.split(r"\n    \w+(\.py|/)", layout[at:])[0]
        unnamed = [
            path.name
            for path in MODELING.glob(f"{pattern}*.py")
            if path.name not in layout and not re.search(rf"\b{path.stem.removeprefix(pattern)}\b", entry)
        ]
        assert not unnamed, f"docs/architecture.md, {where(start + at)}: {pattern}*.py does not name {unnamed}"
