"""Files that survive an interrupted run: every MT-Bench answer and judgment is appended as one fsynced JSON line.

:func:`append_jsonl` is the one way this package appends a record; :class:`JudgmentFile` is a FastChat judgment
file that doubles as the cache, so a re-run asks only for what is missing.

May import: errors.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import FoRAInputError


__all__ = ["JudgmentFile", "append_jsonl"]


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` to ``path`` as one JSON line, on disk before this returns: a run killed a moment later
    keeps it (its folder is made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


class JudgmentFile:
    """A FastChat judgment JSONL that doubles as the cache: appended and fsynced one judgment at a time.

    ``key`` names a record's identity; a record whose key is in the file is never asked for again.
    """

    def __init__(self, path: Path, key: Callable[[dict[str, Any]], tuple]):
        self.path, self.key, self.lock = path, key, threading.Lock()
        self.records: dict[tuple, dict[str, Any]] = {}
        self.added = 0
        if path.is_file():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                # Cut off mid-line by an interrupted write: drop the partial record, it is asked for again.
                data = data[: data.rfind(b"\n") + 1]
                path.write_bytes(data)
            for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                        self.records[self.key(record)] = record
                    except (json.JSONDecodeError, KeyError, TypeError) as error:
                        raise FoRAInputError(
                            f"{path} line {number} is not a judgment record ({error}): move the file away to judge "
                            "again from scratch."
                        ) from None

    def get(self, key: tuple) -> dict[str, Any] | None:
        return self.records.get(key)

    def add(self, record: dict[str, Any]) -> None:
        # Judgments come from several threads at once (judge_parallel): one line each, never interleaved.
        with self.lock:
            append_jsonl(self.path, record)
            self.records[self.key(record)] = record
            self.added += 1

    def kept(self) -> str:
        """Where the judgments made so far are, for a message that stops the run."""
        return f"the {len(self.records)} judgments made so far are kept in {self.path}"
