"""MT-Bench's files, read and checked line by line: questions, model answers, reference answers, judge prompts.

The formats are FastChat's (``question.jsonl``, ``model_answer/<model_id>.jsonl``, ``judge_prompts.jsonl``); the 80
questions, GPT-4 reference answers and judge prompts ship in ``fora_plugin/data/mt_bench`` (Apache-2.0, see NOTICE).
A malformed file is refused naming the file and the line.

May import: errors, files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import FoRAInputError, refuse
from ..files import check_text_file, read_json


__all__ = [
    "BUNDLED_JUDGE_PROMPTS",
    "BUNDLED_QUESTIONS",
    "BUNDLED_REFERENCE",
    "CATEGORIES",
    "DATA_DIR",
    "NEED_REF_CATS",
    "answer_turns",
    "answers_of",
    "check_references",
    "load_answers",
    "load_judge_prompts",
    "load_questions",
]

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "mt_bench"
BUNDLED_QUESTIONS = DATA_DIR / "question.jsonl"
BUNDLED_REFERENCE = DATA_DIR / "reference_answer" / "gpt-4.jsonl"
BUNDLED_JUDGE_PROMPTS = DATA_DIR / "judge_prompts.jsonl"

# Categories graded against a reference answer (FastChat's NEED_REF_CATS, less its arena-hard-200 set).
NEED_REF_CATS = ("math", "reasoning", "coding")
# MT-Bench's eight categories, in the order of its paper's figures.
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def _jsonl_rows(path: str | Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-empty line; a file that is not UTF-8 or not JSON Lines, or a line that is
    not a JSON object, is refused by file and line."""
    documents = read_json(path, lines=True)  # refuses a non-UTF-8 or malformed file naming file, line and column
    numbers = [n for n, line in enumerate(check_text_file(path).splitlines(), 1) if line.strip()]
    rows = []
    for number, obj in zip(numbers, documents):
        if not isinstance(obj, dict):
            raise FoRAInputError(f"{path} line {number}: a {what} must be a JSON object, not {type(obj).__name__}.")
        rows.append((number, obj))
    if not rows:
        raise FoRAInputError(f"{path} holds no {what}s: it is empty.")
    return rows


def _text_list(value: Any, count: int) -> bool:
    return isinstance(value, list) and len(value) >= count and all(isinstance(t, str) for t in value)


def load_questions(path: str | Path | None = None, first_n: int | None = None) -> list[dict[str, Any]]:
    """MT-Bench questions (``question_id``, ``category``, two ``turns``), checked line by line."""
    path = path or BUNDLED_QUESTIONS
    questions, seen = [], {}
    for number, q in _jsonl_rows(path, "question"):
        problem = None
        if not isinstance(q.get("question_id"), int):
            problem = f"question_id must be an integer, got {q.get('question_id')!r}"
        elif not isinstance(q.get("category"), str):
            problem = f"category must be a string, got {q.get('category')!r}"
        elif not _text_list(q.get("turns"), 2) or len(q["turns"]) != 2:
            problem = f"turns must be a list of 2 strings (MT-Bench has two turns), got {q.get('turns')!r:.80}"
        elif q["question_id"] in seen:
            problem = f"question_id {q['question_id']} repeats line {seen[q['question_id']]}"
        if problem:
            raise FoRAInputError(f"{path} line {number}: {problem}. Fix the line (FastChat question.jsonl format).")
        seen[q["question_id"]] = number
        questions.append(q)
    return questions[:first_n]


def load_answers(path: str | Path, what: str = "answer") -> dict[int, dict[str, Any]]:
    """FastChat ``model_answer`` records by question id (the last one of an id wins, as in FastChat)."""
    answers = {}
    for number, a in _jsonl_rows(path, what):
        choices = a.get("choices")
        if not isinstance(a.get("question_id"), int):
            problem = f"question_id must be an integer, got {a.get('question_id')!r}"
        elif not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
            problem = f"choices must be a list like [{{'index': 0, 'turns': [...]}}], got {choices!r:.80}"
        elif not _text_list(choices[0].get("turns"), 1):
            problem = f"choices[0].turns must be a list of strings, got {choices[0].get('turns')!r:.80}"
        else:
            problem = None
        if problem:
            raise FoRAInputError(f"{path} line {number}: {problem}. Fix the line (FastChat model_answer format).")
        answers[a["question_id"]] = a
    return answers


def load_judge_prompts(path: str | Path = BUNDLED_JUDGE_PROMPTS) -> dict[str, dict[str, Any]]:
    """FastChat's judge prompts by name (``single-v1``, ``pair-v2``, ...)."""
    return {p["name"]: p for _, p in _jsonl_rows(path, "judge prompt")}


def check_references(questions: Sequence[dict[str, Any]], references: dict[int, dict[str, Any]], path: str) -> None:
    """Every question graded against a reference has one with both turns."""
    for q in questions:
        if q["category"] in NEED_REF_CATS:
            ref = references.get(q["question_id"])
            if ref is None or len(ref["choices"][0]["turns"]) < 2:
                raise FoRAInputError(
                    f"{path} has no two-turn reference answer for question {q['question_id']} "
                    f"({q['category']}): {', '.join(NEED_REF_CATS)} questions are graded against one."
                )


def answer_turns(answer: dict[str, Any]) -> list[str]:
    """The turns of a FastChat ``model_answer`` record (its first choice)."""
    return answer["choices"][0]["turns"]


def answers_of(
    out: Path, model_id: str, questions: Sequence[dict[str, Any]], key: str = "model_id"
) -> dict[int, dict[str, Any]]:
    """The MT-Bench answers of ``model_id`` in ``out``, refused (as ``key``'s value) unless they answer every one of
    ``questions``."""
    file = Path(out) / "model_answer" / f"{model_id}.jsonl"
    if not file.is_file():
        refuse(
            key,
            model_id,
            f"there are no MT-Bench answers of model_id {model_id!r} at {file}",
            f"Answer the questions with --model-id {model_id} and this --output first, or leave it out.",
        )
    answers = load_answers(file)
    missing = [q["question_id"] for q in questions if q["question_id"] not in answers]
    if missing:
        refuse(
            key,
            model_id,
            f"{file} has no answers to questions {missing[:10]}",
            f"Answer them with --model-id {model_id} and this --output first.",
        )
    return answers
