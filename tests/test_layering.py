"""The package's layering, read from its source: what each module says it may import, and what it does import.

Every module of ``fora_plugin`` opens with a docstring whose ``May import:`` paragraph names the package modules it
may import, and ``fora_plugin/__init__.py`` gives the order of the layers. These tests hold the code to both, so a new
import that breaks the layering fails here rather than as a cycle found at run time.
"""

import ast
import re
from pathlib import Path

import pytest

import fora_plugin


PACKAGE = Path(fora_plugin.__file__).resolve().parent
REPO = PACKAGE.parent
# Imports of the package's own modules inside functions: allowed where start-up time or a real cycle demands it,
# each with a `# lazy: <reason>` comment on its line. None is needed today (issue 27 allowed 12): raising this bound is
# a decision to make in review.
MAX_LAZY_IMPORTS = 0
MAX_MODULE_DOCSTRING_LINES = 12


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> str:
    """The layer a module belongs to: its top-level name inside the package (``zero.stage3`` -> ``zero``)."""
    return module.split(".")[1] if module != "fora_plugin" else "fora_plugin"


def _imports(path: Path) -> list[tuple[str, list[str], ast.AST, bool]]:
    """(imported package module, the names taken from it, the node, inside a function) for each package import."""
    module = _module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    local = {
        id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(f)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != "fora_plugin" and not target.startswith("fora_plugin."):
                continue
            names = [alias.name for alias in node.names]
            if target == "fora_plugin":  # `from . import x`: modules, or names of the package's __init__
                for name in names:
                    sub = f"fora_plugin.{name}"
                    found.append((sub if sub in MODULES else "fora_plugin", [name], node, id(node) in local))
                continue
            found.append((target, names, node, id(node) in local))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fora_plugin"):
                    found.append((alias.name, [], node, id(node) in local))
    return found


def _declared(path: Path) -> set[str] | None:
    """The modules the docstring's ``May import:`` paragraph names (None: no such paragraph)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    match = re.search(r"^May import: (.*?)\.?$(?:\n\n|\Z)", doc, re.M | re.S)
    if match is None:
        return None
    text = " ".join(match.group(1).split())
    if text.startswith("nothing of fora_plugin"):
        return set()
    if text.startswith("every module of fora_plugin"):
        return {"*"}
    return {name.strip() for name in text.split(",")}


def _order() -> list[str]:
    doc = fora_plugin.__doc__
    match = re.search(r"each importing only those before it: (.*?)\.\n", doc, re.S)
    assert match, "fora_plugin/__init__.py's docstring names the order of the layers"
    return [name.strip() for name in " ".join(match.group(1).split()).split(",")]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_says_what_it_is_for_what_it_may_import_and_what_it_offers(module):
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split("\n\n")[0]) > 20, f"{path} opens with a docstring saying what it is for"
    # A few lines: what the module is for and what it may import. How a class or function works is said in its own
    # docstring, where it is read with the code.
    assert len(doc.splitlines()) <= MAX_MODULE_DOCSTRING_LINES, (
        f"{path}'s docstring runs {len(doc.splitlines())} lines"
    )
    assert _declared(path) is not None, f"{path}'s docstring has a `May import: ...` paragraph"
    assert any(
        any(getattr(t, "id", None) == "__all__" for t in getattr(node, "targets", [getattr(node, "target", None)]))
        for node in tree.body
    ), f"{path} states what it offers in __all__"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports_only_what_its_docstring_allows(module):
    path = MODULES[module]
    declared = _declared(path)
    assert declared is not None, f"{path}'s docstring has a `May import: ...` paragraph"
    if declared == {"*"}:
        return
    undeclared = set()
    for target, _, _, _ in _imports(path):
        if target == module or target.startswith(module + "."):
            continue  # a package's own modules
        if target == "fora_plugin":
            continue  # the package's __init__ (its __version__), which every module may read
        layer = _layer(target)
        own = _layer(module)
        name = ".".join(target.split(".")[1:]) if layer == own else layer
        if name not in declared and layer not in declared:
            undeclared.add(name)
    assert not undeclared, f"{path} imports {sorted(undeclared)}, which its `May import:` line does not name"


def test_the_layers_read_bottom_up():
    order = _order()
    assert sorted(order) == sorted({_layer(m) for m in MODULES} - {"fora_plugin"}), (
        "the layer order in fora_plugin/__init__.py names every top-level module and package once"
    )
    rank = {name: i for i, name in enumerate(order)}
    upward = []
    for module, path in MODULES.items():
        if module == "fora_plugin":
            continue
        for target, _, _, _ in _imports(path):
            if target == "fora_plugin":
                continue
            if _layer(target) != _layer(module) and rank[_layer(target)] > rank[_layer(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, f"imports of a later layer: {upward}"


def _module_aliases(tree: ast.AST) -> set[str]:
    """Names a file binds to package modules: ``from fora_plugin import plan as plan_module``, ``from . import x``,
    ``import fora_plugin.optim as optim``."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fora_plugin")):
            aliases |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {alias.asname for alias in node.names if alias.name.startswith("fora_plugin.") and alias.asname}
    return aliases


def test_no_module_imports_another_modules_private_names():
    private = []
    for module, path in MODULES.items():
        for target, names, node, _ in _imports(path):
            if target != module:
                private += [
                    f"{module}:{node.lineno} {target}.{n}" for n in names if n.startswith("_") and n[:2] != "__"
                ]
    # Private attributes of a package module (`optim._step`), here and in the bench/ scripts, and bench/'s imports.
    for path in [*MODULES.values(), *sorted((REPO / "bench").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        aliases = _module_aliases(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                private.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value.id}.{node.attr}")
            if path.parent.name == "bench" and isinstance(node, ast.ImportFrom):
                if (node.module or "").startswith("fora_plugin"):
                    private += [
                        f"{path.relative_to(REPO)}:{node.lineno} {a.name}" for a in node.names if a.name[0] == "_"
                    ]
    assert not private, f"uses of private names across modules: {private}"


def test_function_local_imports_of_the_package_are_few_and_each_says_why():
    lazy = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for target, _, node, local in _imports(path):
            if local:
                lazy.append(f"{path.relative_to(REPO)}:{node.lineno}")
                assert "# lazy:" in lines[node.lineno - 1] or "# lazy:" in lines[node.end_lineno - 1], (
                    f"{path}:{node.lineno} imports {target} inside a function without a `# lazy: <reason>` comment"
                )
    assert len(lazy) <= MAX_LAZY_IMPORTS, f"{len(lazy)} function-local imports of the package: {lazy}"


def test_no_module_is_a_stand_in_for_tests_only():
    # Code that only tests and benchmarks use lives beside them, not in the package users install.
    assert not (PACKAGE / "host_sync.py").exists()
    assert (REPO / "tests" / "host_sync.py").is_file()
