"""MT-Bench answers of the model under test: two turns per question, each appended to FastChat's
``model_answer/<model_id>.jsonl`` as it is made, so an interrupted run answers only what is missing.

May import: errors, files, evaluation, mt_bench.config, mt_bench.questions, mt_bench.cache.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..errors import FoRAInputError
from ..evaluation import mt_bench_answers
from ..files import check_text_file
from .cache import append_jsonl
from .config import CHAT_TEMPLATES, MTBenchConfig, flag
from .questions import load_answers


__all__ = ["apply_chat_template", "generate_answers"]


def apply_chat_template(tokenizer, name_or_file: str | None) -> None:
    """Give ``tokenizer`` the chat template ``name_or_file`` names (``alpaca`` or a Jinja file); None keeps its own."""
    if name_or_file is not None:
        tokenizer.chat_template = CHAT_TEMPLATES.get(name_or_file) or check_text_file(
            name_or_file, flag("chat_template")
        )


def generate_answers(
    model,
    tokenizer,
    questions: Sequence[dict[str, Any]],
    model_id: str,
    answer_file: Path,
    config: MTBenchConfig,
    source: dict[str, Any],
) -> dict[int, dict[str, Any]]:
    """Two-turn answers for the questions not answered yet in ``answer_file``, each appended as it is made.

    ``source`` (base, adapter, generation settings) is kept beside the answers: answers made by another model or with
    other settings under the same model_id are refused, never judged as if they were this model's.
    """
    source_file = answer_file.with_suffix(".source.json")
    if source_file.is_file():
        earlier = json.loads(source_file.read_text())
        if earlier != source:
            changed = sorted(k for k in set(earlier) | set(source) if earlier.get(k) != source.get(k))
            raise FoRAInputError(
                f"{answer_file} holds answers of model_id {model_id!r} made with other settings ({', '.join(changed)}"
                f": {[earlier.get(k) for k in changed]} then, {[source.get(k) for k in changed]} now): give another "
                "--model-id or --output, or delete the file to answer again."
            )
    answers = load_answers(answer_file) if answer_file.is_file() and answer_file.stat().st_size else {}
    missing = [q for q in questions if q["question_id"] not in answers]
    answer_file.parent.mkdir(parents=True, exist_ok=True)
    source_file.write_text(json.dumps(source, indent=2))
    apply_chat_template(tokenizer, config.chat_template)
    for q in tqdm(missing, desc=f"MT-Bench answers ({model_id})", disable=not missing):
        (record,) = mt_bench_answers(
            model, tokenizer, [q], model_id, max_new_tokens=config.max_new_tokens, progress=False
        )
        append_jsonl(answer_file, record)
        answers[q["question_id"]] = record
    return answers
