"""The one kind of error that means "what you gave is wrong": the ``fora`` command prints it as one line, exit code 2.

:class:`FoRAInputError` is a ``ValueError`` (callers and tests that catch ``ValueError`` keep working) and
:class:`FoRAInputTypeError` also a ``TypeError``; every check of a user's value raises one of them, and the CLI
recognises a user's mistake by that type alone, wherever it is raised.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

from typing import Any, NoReturn


__all__ = ["FoRAInputError", "FoRAInputTypeError", "refuse"]


class FoRAInputError(ValueError):
    """A user's input refused: the message names the key or flag, the value, what is accepted and the fix."""


class FoRAInputTypeError(FoRAInputError, TypeError):
    """A user's input of the wrong type (a ``TypeError`` too, as Python's own checks raise)."""


def refuse(key: str, value: Any, accepted: str, fix: str = "") -> NoReturn:
    """Raise the one form of refusal: ``key=value`` is invalid, what is accepted, and the fix."""
    raise FoRAInputError(f"{key}={value!r} is invalid: {accepted}." + (f" {fix}" if fix else ""))
