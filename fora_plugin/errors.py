"""The one kind of error that means "what you gave is wrong": the ``fora`` command prints it as one line, exit code 2.

:class:`FoRAInputError` is a ``ValueError`` (callers and tests that catch ``ValueError`` keep working); the CLI
recognises it by its type, wherever it is raised, where it recognises a plain ``ValueError`` only when this package
raised it itself.
"""

from __future__ import annotations

from typing import Any, NoReturn


__all__ = ["FoRAInputError", "refuse"]


class FoRAInputError(ValueError):
    """A user's input refused: the message names the key or flag, the value, what is accepted and the fix."""


def refuse(key: str, value: Any, accepted: str, fix: str = "") -> NoReturn:
    """Raise the one form of refusal: ``key=value`` is invalid, what is accepted, and the fix."""
    raise FoRAInputError(f"{key}={value!r} is invalid: {accepted}." + (f" {fix}" if fix else ""))
