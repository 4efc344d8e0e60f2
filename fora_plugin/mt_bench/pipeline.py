"""An MT-Bench run from start to end: check everything first, then answer, judge and tabulate.

``fora eval --mt-bench`` and ``fora ablate``'s ``eval.mt_bench`` both call :func:`prepare` before the model loads (so
every refusal comes before hours of generation), then :func:`run` per model, or :func:`score` for a closing table.

May import: files, mt_bench.config, mt_bench.questions, mt_bench.client, mt_bench.judge, mt_bench.results,
mt_bench.answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..files import read_chat_template
from .answers import generate_answers
from .client import JudgeClient
from .config import CHAT_TEMPLATES, MTBenchConfig, flag
from .judge import SINGLE_GRADING, judge_pairwise, judge_single, judgment_path
from .questions import (
    BUNDLED_REFERENCE,
    answers_of,
    check_references,
    load_answers,
    load_judge_prompts,
    load_questions,
)
from .results import pairwise_summary, plot_categories, results_markdown, single_summary


__all__ = ["Prepared", "prepare", "run", "score"]


@dataclasses.dataclass
class Prepared:
    """What is checked before any answer is generated: the data files and the judge server."""

    config: MTBenchConfig
    questions: list[dict[str, Any]]
    references: dict[int, dict[str, Any]]
    prompts: dict[str, dict[str, Any]]
    client: JudgeClient | None  # None: answers only


def prepare(config: MTBenchConfig, out: Path | None = None, compare: Sequence[str] = ()) -> Prepared:
    """Read and check the questions, the chat template, the answers of the ``compare`` model_ids in ``out`` and the
    references, then the key and the judge server: every refusal comes before the model loads and hours of
    generation."""
    questions = load_questions(config.questions, config.first_n)
    if config.chat_template is not None and config.chat_template not in CHAT_TEMPLATES:
        read_chat_template(config.chat_template, flag("chat_template"))  # UTF-8, and Jinja that compiles
    for model_id in compare:
        answers_of(out, model_id, questions, "--mt-bench-compare")
    references, client = {}, None
    if config.judge_model is not None:
        reference_file = config.reference or BUNDLED_REFERENCE
        references = load_answers(reference_file, "reference answer")
        check_references(questions, references, str(reference_file))
        client = JudgeClient(config)
        client.check()
    return Prepared(config, questions, references, load_judge_prompts(), client)


def score(
    prepared: Prepared,
    out: Path,
    model_ids: Sequence[str],
    *,
    pairwise: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """Judge the answers of ``model_ids`` in ``out/model_answer``, then write results.md, results.json (under
    ``out``... by the caller) and mt_bench.png; returns ``{"summary", "pairwise", "markdown", "plot"}``."""
    answers = {model_id: answers_of(out, model_id, prepared.questions) for model_id in model_ids}
    judgment_dir = out / "model_judgment"
    records = judge_single(
        prepared.client, prepared.questions, answers, prepared.references, judgment_dir, prepared.prompts
    )
    summary = single_summary(records, prepared.questions, prepared.config.judge_model)
    summary = {m: summary[m] for m in model_ids if m in summary}
    pairs = []
    for m1, m2 in pairwise:
        pair_records = judge_pairwise(
            prepared.client,
            prepared.questions,
            m1,
            answers[m1],
            m2,
            answers[m2],
            prepared.references,
            judgment_dir,
            prepared.prompts,
        )
        pairs.append(pairwise_summary(pair_records, prepared.config.judge_model) | {"model_1": m1, "model_2": m2})
    plot = plot_categories(out / "mt_bench.png", summary)
    return {
        "summary": summary,
        "pairwise": pairs,
        "markdown": results_markdown(summary, pairs),
        "plot": str(plot),
        "judgment_file": str(judgment_path(judgment_dir, prepared.config, SINGLE_GRADING)),
    }


def run(
    prepared: Prepared,
    model,
    tokenizer,
    out: Path,
    model_id: str,
    source: dict[str, Any],
    *,
    compare: Sequence[str] = (),
    pairwise: bool = False,
) -> dict[str, Any]:
    """Answer (what is not answered yet), then judge (what is not judged yet) and tabulate: ``fora eval --mt-bench``
    and ``fora ablate``'s ``eval.mt_bench`` both run this. Returns what results.json keeps."""
    answer_file = out / "model_answer" / f"{model_id}.jsonl"
    generate_answers(model, tokenizer, prepared.questions, model_id, answer_file, prepared.config, source)
    result: dict[str, Any] = {"answers": str(answer_file)}
    if prepared.client is None:
        return result
    scored = score(prepared, out, [model_id, *compare], pairwise=[(model_id, c) for c in compare] if pairwise else ())
    return result | scored
