"""What a user gives as a file or a folder, read or tried where it is named: UTF-8 text, JSON and JSON Lines, a Jinja
chat template, an input file, an output folder. Each refusal names the key, the file and (for a syntax error) the
line and column.

May import: errors.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import FoRAInputError, path_refusal, refuse


__all__ = [
    "check_chat_template",
    "check_file",
    "check_nonblank_text",
    "check_output_folder",
    "check_text_file",
    "json_error_position",
    "read_chat_template",
    "read_json",
]


# --------------------------------------------------------------------------------------------- text and JSON
def check_text_file(path: str | os.PathLike, key: str | None = None) -> str:
    """The UTF-8 text of ``path``: every reading of a user's text file goes through here. A file that is not UTF-8
    is refused naming the file, the first bad byte and its line (as ``key``'s value when given); so is a path the
    operating system refuses (too long, no permission)."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise (path_refusal(error, key) or error) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = error
    line = data[: bad.start].count(b"\n") + 1
    problem = f"the file is not UTF-8 text (byte 0x{data[bad.start]:02x} on line {line} is not valid UTF-8)"
    fix = "Save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8 in.json > out.json`)."
    if key is None:
        raise FoRAInputError(f"{path}: {problem}. {fix}")
    refuse(key, str(path), problem, fix)


def check_nonblank_text(path: str | os.PathLike, key: str) -> str:
    """The UTF-8 text of ``path`` (:func:`check_text_file`), refused when it holds nothing but whitespace: a text to
    score (perplexity, KL) is checked before the model loads, not found empty after."""
    text = check_text_file(path, key)
    if not text.strip():
        refuse(
            key,
            str(path),
            "the file is empty (or holds only whitespace): there is no text to score",
            "Give a text file, e.g. WikiText-2's wiki.test.raw.",
        )
    return text


def json_error_position(error: json.JSONDecodeError, first_line: int = 1) -> str:
    """``error`` as "<what> at line L, column C", its line counted from ``first_line`` (JSON Lines: the line the
    document starts on). json's own message may end in "starting at" (an unterminated string): no second "at"."""
    where = f"line {first_line + error.lineno - 1}, column {error.colno}"
    return f"{error.msg} {where}" if error.msg.endswith(" at") else f"{error.msg} at {where}"


def read_json(path: str | Path, *, lines: bool = False, key: str | None = None):
    """The JSON document in ``path`` (with ``lines``: the list of one document per non-empty line), read as UTF-8;
    a file that is not UTF-8 or is malformed is refused naming the file (as ``key``'s value when given), the line
    and the column."""
    text = check_text_file(path, key)
    chunks = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()] if lines else [(1, text)]
    documents = []
    for first_line, chunk in chunks:
        try:
            documents.append(json.loads(chunk))
        except json.JSONDecodeError as error:
            what = f"{key} {path}" if key else str(path)
            raise FoRAInputError(
                f"{what} is not valid JSON{' Lines' if lines else ''}: {json_error_position(error, first_line)}. "
                "Fix the file there."
            ) from None
    return documents if lines else documents[0]


# ------------------------------------------------------------------------------------------- chat templates
def _environment():
    """A Jinja environment that parses what transformers' chat templates may hold: its loop controls and its
    ``{% generation %}`` block (which marks the assistant's tokens)."""
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation])


def check_chat_template(text: Any, where: str) -> str:
    """Refuse a chat template that is not a string or that Jinja cannot compile (an unclosed tag, a stray ``endif``),
    naming ``where`` it comes from and the line: before any model loads, not at the first prompt. Returns it."""
    import jinja2

    if not isinstance(text, str):
        raise FoRAInputError(f"{where} is a {type(text).__name__}, not a Jinja template: give the template's text.")
    try:
        _environment().from_string(text)
    except jinja2.TemplateSyntaxError as error:
        problem = f"{error.message} (line {error.lineno})"
    except SyntaxError as error:  # Jinja's compiled Python refuses it: a `continue` outside a loop
        problem = error.msg
    else:
        return text
    raise FoRAInputError(f"{where} is not a valid Jinja template: {problem}. Fix the template there.")


def read_chat_template(path: str | os.PathLike, key: str) -> str:
    """The chat template in the file ``path`` (UTF-8), compiled: a missing file, or a syntax error naming the file
    and the line, is refused naming ``key``."""
    check_file(path, key)
    return check_chat_template(check_text_file(path, key), f"{key} {os.fspath(path)}")


# ------------------------------------------------------------------------------------------------------- paths
def check_output_folder(path: str | os.PathLike, key: str) -> None:
    """Refuse an output folder that is a file, or that cannot be created or written to, before any work.

    Writability is tried, not guessed from permission bits (which say nothing for root or read-only mounts): an
    unnamed temporary file in the folder, or in its nearest existing parent, which leaves no trace.
    """
    try:
        _check_output_folder(Path(path).expanduser(), str(path), key)
    except OSError as error:  # a path too long, or under a file: the operating system's refusal, named
        raise (path_refusal(error, key) or error) from None


def _check_output_folder(folder: Path, path: str, key: str) -> None:
    if folder.exists() and not folder.is_dir():
        raise FoRAInputError(
            f"{key}={str(path)!r} is a file, not a folder: the outputs (adapter, checkpoints, layer scores, "
            "results) go into a folder. Give a new or existing folder's path."
        )
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        refuse(key, path, f"{existing} is a file, so no folder can be made under it", "Give a folder's path.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        refuse(
            key,
            path,
            f"{existing} is not writable ({error.strerror or error})",
            "Give a folder you can write to, or fix its permissions.",
        )


def check_file(path: str | os.PathLike | None, key: str) -> None:
    """Refuse a path that is not an existing file."""
    if path is not None and not Path(path).is_file():
        refuse(key, str(path), "it is not a file", "Give the path of an existing file.")
