"""The package's layering, read from its source: what each module says it may import, and what it does import; and
the one home of each concept.

Every module of ``fora_plugin`` opens with a docstring whose ``May import:`` paragraph names the package modules it
may import, and ``fora_plugin/__init__.py`` gives the order of the layers. These tests hold the code to both, so a new
import that breaks the layering fails here rather than as a cycle found at run time. :data:`HOMES` names the module
of each concept (a file, a model, a checkpoint, the selection record, ...): its names are defined there only and
imported from there only, and no module passes on names it does not define.
"""

import ast
import re
from pathlib import Path

import pytest

import fora_plugin


PACKAGE = Path(fora_plugin.__file__).resolve().parent
REPO = PACKAGE.parent
# Imports of the package's own modules inside functions: allowed where start-up time or a real cycle demands it,
# each with a `# lazy: <reason>` comment on its line. None is needed: raising this bound is a decision to make in
# review.
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


# ------------------------------------------------------------------------------------------ one home per concept
# Each concept's one home: the module that defines its names. A name below defined a second time anywhere in the
# package (a copy), or imported from another module than its home (a re-export, an alias), fails here; a package's
# __init__ that re-exports it is its public face and counts as home too.
HOMES = {
    "what a user gives as a file or folder": (
        "fora_plugin.files",
        ["check_chat_template", "check_file", "check_nonblank_text", "check_output_folder", "check_text_file"]
        + ["json_error_position", "read_chat_template", "read_json"],
    ),
    "model folders, config.json, the meta-device model, loading a model": (
        "fora_plugin.models",
        ["check_model", "check_model_config", "check_model_folder", "load_model", "load_model_config"]
        + ["load_tokenizer", "meta_model", "resolve_model_path"],
    ),
    "target names against the model": ("fora_plugin.targets", ["check_target_modules", "check_target_parameters"]),
    "checkpoints": (
        "fora_plugin.checkpoints",
        ["RESUME_LAST", "RESUME_OFF", "STIEFEL_STATE_FILE", "check_checkpoint", "check_checkpoint_files"]
        + ["check_resumed_adapter", "checkpoint_folder", "resolve_checkpoint", "resumes"],
    ),
    "the layer choice and its record": (
        "fora_plugin.selection",
        ["SCORES_FILE", "SCORES_PLOT", "FoRASelection", "check_layer_indices", "load_scores", "select_layers"],
    ),
    "adapter folders": ("fora_plugin.report", ["check_adapter_folder"]),
    "datasets": (
        "fora_plugin.data",
        ["check_chat_rows", "check_column_types", "check_columns", "check_completions", "check_json_rows_file"]
        + ["check_rows_fit", "load_train_dataset"],
    ),
    "the number rules and config blocks": (
        "fora_plugin.validation",
        ["NUMBER_RULES", "check_block", "check_known_keys", "check_list", "check_number", "check_numbers"],
    ),
    "a `fora train` config": ("fora_plugin.recipe", ["check_lora_arguments", "load_yaml_config", "parse_config"]),
    "`fora eval`'s flags": ("fora_plugin.cli", ["check_eval_arguments"]),
    "the ablation block": ("fora_plugin.ablate", ["ABLATION_EVAL_KEYS", "ABLATION_KEYS", "check_ablation_block"]),
    "the Axolotl keys": ("fora_plugin.axolotl.args", ["AXOLOTL_KEYS", "FoRAArgs", "fora_config_from"]),
    "DeepSpeed configs": ("fora_plugin.zero.checks", ["check_deepspeed_config", "load_deepspeed_config"]),
    "FoRA on a Trainer under DeepSpeed": ("fora_plugin.zero.prepare", ["ZeroStiefelCallback", "prepare_deepspeed"]),
    "FoRA on a Trainer under FSDP2": ("fora_plugin.fsdp", ["FSDP2Callback", "check_fsdp", "prepare_fsdp2"]),
    "the steps both front ends take on a Trainer": (
        "fora_plugin.training",
        ["checkpoint_as_in_training", "fora_optimizer", "prepare_fora_training", "score_on_trainer"],
    ),
    "the TRL trainer": ("fora_plugin.trainer", ["FoRASFTTrainer"]),
    "FoRA's optimizer": ("fora_plugin.optim.fora_optimizer", ["build_fora_optimizer", "create_fora_optimizer"]),
    "the planner's memory tracker": ("fora_plugin.plan.memory", ["LiveTensorTracker", "storage_bytes"]),
    "what each engine shards, for the planner": ("fora_plugin.plan.engine_rules", ["ENGINES", "EngineSharding"]),
}
# Words of the selection record (fora_scores.json) that no other module has reason to write.
RECORD_WORDS = ("fora_scores.json", "fora_scores.png")
COMMON_RECORD_KEYS = {
    "mode",
    "source",
    "k",
    "scores",
    "fisher_params",
    "seconds",
    "target_modules",
    "target_parameters",
}
MAX_VALIDATION_LINES = 249


def _definitions(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments), not those it imports."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _faces(module: str) -> set[str]:
    """A module and the packages above it, whose __init__ may re-export its names."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _absolute_imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) of each `from fora_plugin... import name` in a test or bench file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("fora_plugin"):
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
    return found


def test_each_concept_is_defined_in_its_home_and_nowhere_else():
    defined = {module: _definitions(path) for module, path in MODULES.items()}
    for concept, (home, names) in HOMES.items():
        missing = [n for n in names if n not in defined[home]]
        assert not missing, f"{concept}: {home} does not define {missing}"
        copies = [f"{m}.{n}" for m in defined for n in names if m != home and n in defined[m]]
        assert not copies, f"{concept} lives in {home}; defined again in {copies}"


def test_each_concept_is_imported_from_its_home():
    homes = {name: home for home, names in HOMES.values() for name in names}
    stray = []
    for module, path in MODULES.items():
        for target, names, node, _ in _imports(path):
            stray += [
                f"{module}:{node.lineno} {n} from {target}"
                for n in names
                if n in homes and target not in _faces(homes[n])
            ]
    for path in [*sorted((REPO / "tests").rglob("*.py")), *sorted((REPO / "bench").glob("*.py"))]:
        for target, name, line in _absolute_imports(path):
            if name in homes and target not in _faces(homes[name]):
                stray.append(f"{path.relative_to(REPO)}:{line} {name} from {target}")
    assert not stray, f"imported from another module than their home (HOMES): {stray}"


def test_no_module_passes_on_another_modules_names():
    """A name is imported from the module that defines it (or a package __init__ that re-exports it), never through a
    module that only imports it: so a check cannot be taken from a module other than the one of what it checks."""
    definers: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for name in _definitions(path):
            definers.setdefault(name, set()).add(module)
    passed_on = []
    for module, path in MODULES.items():
        for target, names, node, _ in _imports(path):
            if target not in MODULES or MODULES[target].name == "__init__.py":
                continue
            for name in names:
                if name in definers and target not in definers[name] and f"{target}.{name}" not in MODULES:
                    passed_on.append(
                        f"{module}:{node.lineno} {name} via {target} (defined in {sorted(definers[name])})"
                    )
    for path in [*sorted((REPO / "tests").rglob("*.py")), *sorted((REPO / "bench").glob("*.py"))]:
        for target, name, line in _absolute_imports(path):
            if target in MODULES and MODULES[target].name != "__init__.py" and name in definers:
                if target not in definers[name]:
                    passed_on.append(f"{path.relative_to(REPO)}:{line} {name} via {target}")
    assert not passed_on, f"names taken from a module that does not define them: {passed_on}"


def _strings_outside_docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_the_selection_files_name_and_keys_appear_in_its_module_only():
    from fora_plugin.selection import FoRASelection

    keys = set(FoRASelection([0], 1, "model.layers").to_dict()) - COMMON_RECORD_KEYS
    home = MODULES["fora_plugin.selection"]
    found = []
    for module, path in MODULES.items():
        if path == home:
            continue
        for line, text in _strings_outside_docstrings(path):
            if text in keys or any(word in text for word in RECORD_WORDS):
                found.append(f"{module}:{line} {text!r}")
    assert not found, f"the selection record's file name or keys outside fora_plugin/selection.py: {found}"
    assert sum(text in keys for _, text in _strings_outside_docstrings(home)) >= len(keys)  # the check sees them


def test_validation_keeps_the_primitives_only():
    lines = len(MODULES["fora_plugin.validation"].read_text().splitlines())
    assert lines <= MAX_VALIDATION_LINES, f"validation.py runs {lines} lines: a check of a thing belongs to its module"
    assert _declared(MODULES["fora_plugin.validation"]) == {"errors"}
