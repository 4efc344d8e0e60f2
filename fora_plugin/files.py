"""Reading what a user writes in a file's own language: a Jinja chat template, compiled where it is named.

May import: errors, validation.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import FoRAInputError
from .validation import check_file, check_text_file


__all__ = ["check_chat_template", "read_chat_template"]


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
