"""The one kind of error that means "what you gave is wrong": the ``fora`` command prints it as one line, exit code 2.

:class:`FoRAInputError` is a ``ValueError`` (callers and tests that catch ``ValueError`` keep working) and
:class:`FoRAInputTypeError` also a ``TypeError``; every check of a user's value raises one of them, and the CLI
recognises a user's mistake by that type alone, wherever it is raised, or as a path the operating system refuses
(:func:`path_refusal`).

May import: nothing of fora_plugin.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, NoReturn


__all__ = ["FoRAInputError", "FoRAInputTypeError", "path_refusal", "refuse"]

# What the operating system says of a path itself (not of the disk or the process): the fix is another path.
_PATH_FIXES = {
    errno.ENAMETOOLONG: "Use a shorter path (a file or folder name is at most 255 bytes on most file systems).",
    errno.ENOTDIR: "A part of the path is a file, not a folder: fix the path.",
    errno.EACCES: "Give a path you may read and write, or fix its permissions.",
    errno.EPERM: "Give a path you may read and write, or fix its permissions.",
    errno.EROFS: "Give a path on a writable file system.",
    errno.ELOOP: "The path has a loop of symbolic links: fix the links or give the real path.",
    errno.EISDIR: "It is a folder: give a file's path.",
}


class FoRAInputError(ValueError):
    """A user's input refused: the message names the key or flag, the value, what is accepted and the fix."""


class FoRAInputTypeError(FoRAInputError, TypeError):
    """A user's input of the wrong type (a ``TypeError`` too, as Python's own checks raise)."""


def refuse(key: str, value: Any, accepted: str, fix: str = "") -> NoReturn:
    """Raise the one form of refusal: ``key=value`` is invalid, what is accepted, and the fix."""
    raise FoRAInputError(f"{key}={value!r} is invalid: {accepted}." + (f" {fix}" if fix else ""))


def path_refusal(error: OSError, key: str | None = None) -> FoRAInputError | None:
    """``error`` as the one-line refusal of a path the operating system refuses (too long, a file where a folder
    must be, no permission, ...), naming ``key`` when given and the path; None for any other OSError (a full disk,
    a missing file: the caller's to word)."""
    fix = _PATH_FIXES.get(error.errno)
    if fix is None or error.filename is None:
        return None
    path = os.fsdecode(error.filename)
    if error.errno == errno.ENOTDIR:
        file = next((p for p in Path(path).parents if _is_file(p)), None)
        fix = f"{file} is a file, not a folder: fix the path." if file is not None else fix
    what = f"{key}={path!r} is invalid" if key else f"the path {path!r} is refused"
    return FoRAInputError(f"{what}: the operating system refuses it ({error.strerror}). {fix}")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False
