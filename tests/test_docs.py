"""The README and the pages under docs/ show only commands and links that work.

Every `fora <subcommand> ...` (or `-m fora_plugin.cli <subcommand> ...`) in a shell block or inline code names a real
subcommand of `fora_plugin.cli.build_parser()`, and each of its `--flags` is one that subcommand's parser knows or,
for the subcommands that take `--key value` overrides, a field of trl's ScriptArguments, SFTConfig or ModelConfig or
of FoRAArguments. Every `bench/` script a command runs exists and knows the flags given to it. Every relative link
resolves to a file of the repository, and its #anchor to a heading there (GitHub's slugs). The README stays within
300 lines, and each docs page links back to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
# Code blocks holding commands; `text` blocks hold their output ("fora plan: meta-llama/..."), `python` blocks code.
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
# What the pages write for "any config key": `fora train CONFIG.yaml [--key value ...]`.
PLACEHOLDER_FLAGS = {"--key"}
# The subcommands whose extra `--key value` pairs override config keys (cli.main passes them on; eval and report
# refuse them).
OVERRIDE_COMMANDS = {"train", "score", "plan", "ablate"}

FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
BENCH_SCRIPT = re.compile(r"^(?:\./)?bench/[\w./-]+\.(?:py|sh)$")
SEGMENT_BREAK = re.compile(r"\s*(?:&&|\|\||;|\|)\s*")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# What runs a bench/ script: python, python3, torchrun, bash.
SCRIPT_RUNNERS = ("python", "torchrun", "bash")


# ----------------------------------------------------------------------------------------------- reading a page
def split_page(text: str) -> tuple[list[tuple[str, str]], str]:
    """The fenced code blocks of a page as (language, body), and the page's prose with each block blanked out (its
    lines kept empty, so that what follows keeps its line numbers)."""
    blocks, prose, body, fence, language = [], [], [], None, ""
    for line in text.splitlines():
        opened = FENCE.match(line.strip())
        if fence is None and opened:
            fence, language, body = opened.group(1), opened.group(2).strip().split(" ")[0].lower(), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            blocks.append((language, "\n".join(body)))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return blocks, "\n".join(prose)


def shell_lines(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            lines.append(line)
    return lines


def commands_of(text: str) -> list[str]:
    """Every command line a page shows: the lines of its shell blocks and its inline code spans."""
    blocks, prose = split_page(text)
    commands = [line for language, body in blocks if language in SHELL_LANGUAGES for line in shell_lines(body)]
    commands += [" ".join(span.split()) for _ticks, span in INLINE_CODE.findall(prose)]
    return commands


def tokens_of(segment: str) -> list[str]:
    try:
        return shlex.split(segment)
    except ValueError:  # an unbalanced quote in prose-like inline code
        return segment.split()


def flag_of(token: str) -> str | None:
    """`[--gpus` -> `--gpus`, `--fora_layers=1` -> `--fora_layers`; None for what is not a long flag."""
    token = token.strip("[]()")
    if not re.match(r"^--[A-Za-z]", token):
        return None
    return token.split("=", 1)[0]


# ------------------------------------------------------------------------------------------ what the code knows
@functools.cache
def fora_parser() -> argparse.ArgumentParser:
    from fora_plugin.cli import build_parser

    return build_parser()


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@functools.cache
def subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in fora_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@functools.cache
def override_flags() -> frozenset[str]:
    """`--<field>` for every field of the argument classes `fora train` parses its config into, and the new names of
    the training arguments transformers renamed (`fora` reads them on an older transformers too)."""
    from trl import ModelConfig, ScriptArguments, SFTConfig

    from fora_plugin.config import FoRAArguments
    from fora_plugin.recipe import RENAMED_TRAINING_ARGUMENTS

    classes = (ScriptArguments, SFTConfig, ModelConfig, FoRAArguments)
    return frozenset(f"--{field.name}" for cls in classes for field in dataclasses.fields(cls)) | frozenset(
        f"--{name}" for name in RENAMED_TRAINING_ARGUMENTS
    )


@functools.cache
def script_help(script: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    return result.stdout + result.stderr


def script_knows(script: Path, flag: str) -> bool:
    """The flag is written in the script (argparse's add_argument, a shell case), or its --help lists it."""
    pattern = re.escape(flag) + r"(?![\w-])"
    if re.search(pattern, script.read_text()):
        return True
    return script.suffix == ".py" and re.search(pattern, script_help(script)) is not None


# --------------------------------------------------------------------------------------------------- the checks
def check_fora_command(tokens: list[str], shown: str) -> list[str]:
    """tokens: what follows `fora` (or `-m fora_plugin.cli`)."""
    if not tokens:
        return []
    subcommand = tokens[0]
    if subcommand.startswith("-"):
        flags, allowed, name = [subcommand], options_of(fora_parser()), "fora"
    elif subcommand not in subcommands():
        return [f"`{shown}`: `fora {subcommand}` is no subcommand (they are {sorted(subcommands())})"]
    else:
        flags = [flag for flag in map(flag_of, tokens[1:]) if flag]
        allowed = options_of(subcommands()[subcommand])
        if subcommand in OVERRIDE_COMMANDS:
            allowed |= override_flags() | PLACEHOLDER_FLAGS
        name = f"fora {subcommand}"
    return [f"`{shown}`: `{name}` knows no flag {flag}" for flag in flags if flag not in allowed]


def check_bench_command(tokens: list[str], at: int, shown: str) -> list[str]:
    script = ROOT / tokens[at]
    if not script.is_file():
        return [f"`{shown}`: {tokens[at]} does not exist"]
    flags = [flag for flag in map(flag_of, tokens[at + 1 :]) if flag]
    return [f"`{shown}`: {tokens[at]} knows no flag {flag}" for flag in flags if not script_knows(script, flag)]


def command_problems(text: str) -> list[str]:
    """What is wrong with the `fora` and `bench/` commands a page shows."""
    problems = []
    for command in commands_of(text):
        for segment in SEGMENT_BREAK.split(command):
            tokens = tokens_of(segment)
            # `fora` where a shell runs a command: first, after VAR=value assignments.
            first = next((i for i, token in enumerate(tokens) if not ENV_ASSIGNMENT.match(token)), None)
            if first is not None and tokens[first] == "fora":
                problems += check_fora_command(tokens[first + 1 :], segment)
            for token in tokens:
                if token.startswith("example_configs/") and not (ROOT / token).exists():
                    problems.append(f"`{segment}`: {token} does not exist")
            for i, token in enumerate(tokens[:-1]):
                if token in ("-m", "--module") and tokens[i + 1] == "fora_plugin.cli":
                    problems += check_fora_command(tokens[i + 2 :], segment)
                if BENCH_SCRIPT.match(tokens[i + 1]) and Path(token).name.startswith(SCRIPT_RUNNERS):
                    problems += check_bench_command(tokens, i + 1, segment)
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower-cased, punctuation but hyphens and underscores dropped,
    spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated one gets -1, -2, ... as on GitHub."""
    _blocks, prose = split_page(text)
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose.splitlines():
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def link_problems(page: Path, text: str) -> list[str]:
    """What is wrong with the relative links of a page: a missing file, or an anchor no heading has."""
    _blocks, prose = split_page(text)
    prose = INLINE_CODE.sub("code", prose)
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"({target}): {path} does not exist")
            continue
        if not anchor:
            continue
        if resolved.suffix != ".md":
            if not re.fullmatch(r"L\d+(-L\d+)?", anchor):  # a line of a source file
                problems.append(f"({target}): #{anchor} on a file that is not Markdown")
        elif anchor not in anchors_of(resolved.read_text()):
            problems.append(f"({target}): {path or page.name} has no heading #{anchor}")
    return problems


# ---------------------------------------------------------------------------------------------------- the tests
def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_command_names_a_real_subcommand_and_flag(page):
    assert command_problems(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_resolves(page):
    assert link_problems(page, page.read_text()) == []


def test_the_readme_is_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move a section to docs/"


def test_the_readme_keeps_its_two_fresh_machine_commands_and_ci_runs_its_main_job_as_written():
    # .ci/run runs the test command's steps, and the quickstart (the main job on the embedded default model) verbatim.
    text = README.read_text()
    install = 'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[{}]"'
    quickstart = install.format("quickstart") + " && fora train example_configs/quickstart.yaml\n"
    assert quickstart in text
    assert install.format("dev") + " && python -m pytest -q\n" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\n" + quickstart in ci
    assert '"$quickstart_status"' in ci, "the main job's exit status is not among those .ci/run exits with"


@pytest.mark.parametrize("page", PAGES[1:], ids=page_id)
def test_each_docs_page_has_a_title_and_links_back_to_the_readme(page):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), lines[0]
    assert "](../README.md)" in "\n".join(lines[:12]), "no link back to the README near the top"
    assert f"](docs/{page.name})" in README.read_text() or f"](docs/{page.name}#" in README.read_text()


def test_the_api_pages_layout_lists_the_packages_layers_in_their_import_order():
    import fora_plugin

    text = (ROOT / "docs" / "api.md").read_text()
    layout = text[text.index("## Layout") :]
    rows = re.findall(r"^\| `fora_plugin/([\w]+)(?:\.py|/)`", layout, re.M)
    match = re.search(r"each importing only those before it: (.*?)\.\n", fora_plugin.__doc__, re.S)
    order = [name.strip() for name in " ".join(match.group(1).split()).split(",")]
    assert rows == order, "docs/api.md's Layout table lists the layers of fora_plugin/__init__.py, in that order"


def test_the_checks_catch_a_made_up_flag_subcommand_script_link_and_anchor():
    made_up = {
        "```bash\nfora train example_configs/quickstart.yaml --fora_made_up 1\n```": "knows no flag --fora_made_up",
        "```bash\naccelerate launch -m fora_plugin.cli train c.yaml \\\n  --learning_rat 1e-4\n```": "--learning_rat",
        "Run `fora plan c.yaml --gpu-mem 80` first.": "knows no flag --gpu-mem",
        "Run `fora eval --base m --fora_layers 1`.": "`fora eval` knows no flag --fora_layers",
        "`fora trian c.yaml`": "is no subcommand",
        "```sh\nOMP_NUM_THREADS=1 python bench/optimizer.py --no-such-flag\n```": "knows no flag --no-such-flag",
        "`python bench/no_such_bench.py`": "does not exist",
        "`fora train example_configs/no_such_config.yaml`": "example_configs/no_such_config.yaml does not exist",
    }
    for text, expected in made_up.items():
        problems = command_problems(text)
        assert len(problems) == 1 and expected in problems[0], (text, problems)
    real = "```bash\nfora plan c.yaml --gpus 8 --fora_layers 1 2 --deepspeed z.json  # a comment --not-checked\n```"
    assert command_problems(real + "\n`python bench/optimizer.py --device cuda`") == []
    assert link_problems(README, "[x](docs/plan.md#no-such-heading)") == [
        "(docs/plan.md#no-such-heading): docs/plan.md has no heading #no-such-heading"
    ]
    assert link_problems(README, "[x](docs/no_such_page.md) and [y](#no-such-heading)") == [
        "(docs/no_such_page.md): docs/no_such_page.md does not exist",
        "(#no-such-heading): README.md has no heading #no-such-heading",
    ]
    assert slug("DeepSpeed ZeRO-1/2 (2 CPU processes)") == "deepspeed-zero-12-2-cpu-processes"
    assert slug("The `fora_*` keys") == "the-fora_-keys"
