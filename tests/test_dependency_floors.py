"""The dependency floors in pyproject.toml are the versions the suite is tested with, as the README says.

pyproject.toml holds the floors; the README's "Tested versions" table repeats them beside the versions each CI
virtualenv runs; .ci/axolotl-constraints.txt pins the Axolotl virtualenv and .ci/run installs torch. These tests read
all four, so that none of them can drift from the others.
"""

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version


tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")

ROOT = Path(__file__).parent.parent
# The extras a user installs; `dev` (pytest, ruff, the extras above) is the developers' tooling.
USER_EXTRAS = ("deepspeed", "qlora", "axolotl", "quickstart", "mt-bench")
# The one floor below the versions tested: no other torch build than the CPU wheel can be installed on CI's machine.
UNTESTED_FLOORS = {"torch"}
NOT_INSTALLED = "—"


def declared() -> dict[str, tuple[str, SpecifierSet]]:
    """Every runtime and user-extra requirement with a version floor: name -> (extra or "", specifier)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = [("", project["dependencies"])] + [(e, project["optional-dependencies"][e]) for e in USER_EXTRAS]
    floors = {}
    for extra, requirements in groups:
        for text in requirements:
            requirement = Requirement(text)
            if requirement.specifier:  # ninja: any version
                floors[canonicalize_name(requirement.name)] = (extra, requirement.specifier)
    return floors


def readme_table() -> dict[str, dict[str, str]]:
    """The "Tested versions" table of docs/testing.md: package -> its cells by column header."""
    text = (ROOT / "docs" / "testing.md").read_text()
    section = re.search(r"^### Tested versions\n(.*?)(?=^#)", text, re.M | re.S)
    assert section, "docs/testing.md has no '### Tested versions' section"
    rows = [
        [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        for line in section.group(1).splitlines()
        if line.startswith("|")
    ]
    header, _rule, *body = rows
    return {canonicalize_name(row[0]): dict(zip(header, row)) for row in body}


def versions_run_on(row: dict[str, str]) -> list[Version]:
    """The versions a row says the suite ran on, one per virtualenv that has the package."""
    versions = [cell for column, cell in row.items() if column.endswith("virtualenv") and cell != NOT_INSTALLED]
    assert versions, row
    return [Version(v) for v in versions]


def test_the_readme_lists_every_floor_as_pyproject_declares_it():
    floors, table = declared(), readme_table()
    assert set(table) == set(floors), set(table) ^ set(floors)
    for name, (extra, specifier) in floors.items():
        assert SpecifierSet(table[name]["declared"]) == specifier, (name, table[name]["declared"], str(specifier))
        assert table[name]["extra"] == (extra or NOT_INSTALLED), name


def test_no_floor_is_below_the_oldest_version_tested():
    floors, table = declared(), readme_table()
    for name, (_extra, specifier) in floors.items():
        versions = versions_run_on(table[name])
        # Every version the suite runs on is allowed by the requirement (an upper bound included) ...
        assert all(specifier.contains(v, prereleases=True) for v in versions), (name, str(specifier), versions)
        # ... and the lowest version allowed is one the suite runs on.
        (floor,) = [Version(s.version) for s in specifier if s.operator == ">="]
        if name in UNTESTED_FLOORS:
            assert floor < min(versions)  # documented in the README as untested
        else:
            assert floor == min(versions), (name, str(floor), [str(v) for v in versions])


def test_the_axolotl_virtualenv_column_is_what_ci_installs():
    pins = {}
    for line in (ROOT / ".ci" / "axolotl-constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    torch_installs = set(re.findall(r"pip install torch==(\S+)", (ROOT / ".ci" / "run").read_text()))
    assert len(torch_installs) == 1, torch_installs  # every virtualenv gets the same torch wheel first
    pins["torch"] = torch_installs.pop()
    for name, row in readme_table().items():
        cell = row["Axolotl virtualenv"]
        assert cell == pins.get(name, NOT_INSTALLED) or cell == f"{pins.get(name)}+cpu", (name, cell, pins.get(name))


@pytest.mark.parametrize("checkpointing", [None, "true"])
def test_a_config_runs_on_the_floor_and_the_newest_transformers(checkpointing):
    """The configs write `activation_checkpointing`, transformers 5.23's name; the Axolotl virtualenv runs this test
    with transformers 5.20.1, the floor, which knows `gradient_checkpointing` only and reads it in its place."""
    from trl import SFTConfig

    from fora_plugin.recipe import RENAMED_TRAINING_ARGUMENTS, parse_config

    overrides = [] if checkpointing is None else ["--activation_checkpointing", checkpointing]
    quickstart = ROOT / "example_configs" / "quickstart.yaml"
    assert "activation_checkpointing: false" in quickstart.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # neither name reported as deprecated
        _, training_args, _, _ = parse_config(str(quickstart), overrides)
    names = {f.name for f in dataclasses.fields(SFTConfig)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    assert getattr(training_args, name) is (checkpointing == "true")
    assert set(RENAMED_TRAINING_ARGUMENTS.values()) <= names  # the old names: in every supported transformers
