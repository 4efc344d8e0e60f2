"""FastChat's ``llm_judge`` protocol, one loop for both kinds of grading: single-answer and pairwise.

May import: mt_bench.cache, mt_bench.client, mt_bench.config, mt_bench.questions.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .cache import JudgmentFile
from .client import JudgeClient
from .config import MTBenchConfig
from .questions import NEED_REF_CATS, answer_turns, load_judge_prompts


__all__ = [
    "judgment_path",
    "PAIR_GRADING",
    "PAIR_PROMPTS",
    "RATING_PATTERNS",
    "SINGLE_GRADING",
    "SINGLE_PROMPTS",
    "UNPARSABLE",
    "Grading",
    "judge_all",
    "judge_pairwise",
    "judge_single",
    "pair_prompt",
    "parse_rating",
    "parse_verdict",
    "single_prompt",
]

# (needs a reference, second turn) -> judge prompt name.
SINGLE_PROMPTS = {
    (False, False): "single-v1",
    (False, True): "single-v1-multi-turn",
    (True, False): "single-math-v1",
    (True, True): "single-math-v1-multi-turn",
}
PAIR_PROMPTS = {
    (False, False): "pair-v2",
    (False, True): "pair-v2-multi-turn",
    (True, False): "pair-math-v1",
    (True, True): "pair-math-v1-multi-turn",
}
# FastChat's rating patterns: "[[7]]", and "[7]" when the judge drops a bracket pair.
RATING_PATTERNS = (re.compile(r"\[\[(\d+\.?\d*)\]\]"), re.compile(r"\[(\d+\.?\d*)\]"))
UNPARSABLE = -1


# ------------------------------------------------------------------------------------------------------- parsing
def parse_rating(judgment: str) -> int | float:
    """The rating of a single-answer judgment, as FastChat reads it: ``[[r]]``, else ``[r]``, else -1."""
    for pattern in RATING_PATTERNS:
        match = pattern.search(judgment)
        if match:
            value = float(match.group(1))
            return int(value) if value.is_integer() and "." not in match.group(1) else value
    return UNPARSABLE


def parse_verdict(judgment: str) -> str:
    """The verdict of a pairwise judgment, as FastChat reads it: ``A``, ``B``, ``tie`` or ``error``."""
    for token, verdict in (("[[A]]", "A"), ("[[B]]", "B"), ("[[C]]", "tie")):
        if token in judgment:
            return verdict
    return "error"


# ------------------------------------------------------------------------------------------------------- prompts
def _fill(
    template: dict[str, Any],
    question: dict[str, Any],
    ref: dict[str, Any] | None,
    turn: int,
    answers: dict[str, dict[str, Any]],
) -> str:
    """A judge prompt filled as FastChat fills it: on turn 1 ``question`` and each ``<name>``; on turn 2
    ``question_1/2`` and each ``<name>_1/2``; with a reference (math, reasoning, coding) ``ref_answer_1``, and
    ``ref_answer_2`` on turn 2."""
    fields: dict[str, str] = {}
    if ref is not None:
        ref_turns = answer_turns(ref)
        fields["ref_answer_1"] = ref_turns[0]
        if turn == 2:
            fields["ref_answer_2"] = ref_turns[1]
    if turn == 2:
        fields |= {"question_1": question["turns"][0], "question_2": question["turns"][1]}
        fields |= {f"{name}_{i}": answer_turns(a)[i - 1] for name, a in answers.items() for i in (1, 2)}
    else:
        fields |= {"question": question["turns"][0]} | {name: answer_turns(a)[0] for name, a in answers.items()}
    return template["prompt_template"].format(**fields)


def single_prompt(
    template: dict[str, Any], question: dict[str, Any], answer: dict[str, Any], ref: dict[str, Any] | None, turn: int
) -> str:
    """The user prompt of a single-answer judgment, filled as FastChat's ``run_judge_single`` fills it."""
    return _fill(template, question, ref, turn, {"answer": answer})


def pair_prompt(
    template: dict[str, Any],
    question: dict[str, Any],
    answer_a: dict[str, Any],
    answer_b: dict[str, Any],
    ref: dict[str, Any] | None,
    turn: int,
) -> str:
    """The user prompt of a pairwise judgment (A shown first), as FastChat's ``run_judge_pair`` fills it."""
    return _fill(template, question, ref, turn, {"answer_a": answer_a, "answer_b": answer_b})


# ------------------------------------------------------------------------------------------------------ gradings
@dataclasses.dataclass(frozen=True)
class Grading:
    """What one kind of grading is, as data: the loop in :func:`judge_all` is the same for every kind."""

    name: str  # the judgment file's suffix: <judge>_<name>.jsonl
    desc: str  # the progress bar's label
    prompts: Mapping[tuple[bool, bool], str]  # (needs a reference, second turn) -> judge prompt name
    replies: Mapping[str, str]  # each user prompt's field -> the field of the judge's reply to it
    identity: tuple[str, ...]  # the fields that make a record's cache key (the exact prompts among them)
    fields: tuple[str, ...]  # a record's fields, in FastChat's order
    read: Callable[[dict[str, Any]], dict[str, Any]]  # a record's replies -> its verdict fields
    announce_cache: bool = False  # print how many judgments the file already holds

    def key(self, record: dict[str, Any]) -> tuple:
        """A record's identity in the cache: a changed answer or reference changes the prompt and is judged again,
        never served stale."""
        return tuple(tuple(record[f]) if f == "judge" else record[f] for f in self.identity)


def _read_winners(record: dict[str, Any]) -> dict[str, str]:
    # g1 shows model_1 as A, g2 shows model_2 as A.
    g1, g2 = parse_verdict(record["g1_judgment"]), parse_verdict(record["g2_judgment"])
    return {
        "g1_winner": {"A": "model_1", "B": "model_2"}.get(g1, g1),
        "g2_winner": {"A": "model_2", "B": "model_1"}.get(g2, g2),
    }


SINGLE_GRADING = Grading(
    name="single",
    desc="judging",
    prompts=SINGLE_PROMPTS,
    replies={"user_prompt": "judgment"},
    identity=("question_id", "model", "judge", "turn", "user_prompt"),
    fields=("question_id", "model", "judge", "user_prompt", "judgment", "score", "turn", "tstamp"),
    read=lambda record: {"score": parse_rating(record["judgment"])},
    announce_cache=True,
)
PAIR_GRADING = Grading(
    name="pair",
    desc="pairwise",
    prompts=PAIR_PROMPTS,
    replies={"g1_user_prompt": "g1_judgment", "g2_user_prompt": "g2_judgment"},
    identity=("question_id", "model_1", "model_2", "judge", "turn", "g1_user_prompt", "g2_user_prompt"),
    fields=(
        "question_id",
        "model_1",
        "model_2",
        "g1_winner",
        "g2_winner",
        "judge",
        "g1_user_prompt",
        "g1_judgment",
        "g2_user_prompt",
        "g2_judgment",
        "turn",
        "tstamp",
    ),
    read=_read_winners,
)

# A grading's matches on one question and turn: (judge prompt, question, reference or None, turn) -> records that
# hold the models and the user prompts, to be judged.
Matches = Callable[[dict[str, Any], dict[str, Any], dict[str, Any] | None, int], Iterable[dict[str, Any]]]


# ---------------------------------------------------------------------------------------------------------- loop
def _run_all(tasks: list[Callable[[], None]], parallel: int, desc: str) -> None:
    with tqdm(total=len(tasks), desc=desc, disable=not tasks) as bar:
        if parallel == 1:
            for task in tasks:
                task()
                bar.update()
            return
        pool = ThreadPoolExecutor(parallel)
        try:
            for future in as_completed([pool.submit(task) for task in tasks]):
                future.result()  # the first failure stops the run; judgments already made are in the file
                bar.update()
        finally:
            # On a failure, what has not started is dropped rather than retried against a dead server.
            pool.shutdown(wait=True, cancel_futures=True)


def judgment_path(judgment_dir: Path, config: MTBenchConfig, grading: Grading) -> Path:
    """FastChat's judgment file of one grading: ``<judgment_dir>/<judge>_single.jsonl`` or ``<judge>_pair.jsonl``."""
    return judgment_dir / f"{config.judge_file_name}_{grading.name}.jsonl"


def judge_all(
    client: JudgeClient,
    grading: Grading,
    matches: Matches,
    questions: Sequence[dict[str, Any]],
    references: dict[int, dict[str, Any]],
    judgment_dir: Path,
    prompts: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every match of ``grading`` on both turns of ``questions``, judged unless the judgment file already holds it:
    this run's records (cached or new), with FastChat's fields.

    The protocol is FastChat's ``llm_judge`` (lm-sys/FastChat ``fastchat/llm_judge``), reimplemented on the
    ``openai`` v1 client so that any OpenAI-compatible server can judge (OpenAI itself, vLLM,
    ``transformers serve``, llama.cpp): single-answer grading and pairwise (both orders, a verdict that changes with
    the order counted as a tie).

    - single-answer: ``single-v1`` for turn 1, ``single-v1-multi-turn`` for turn 2, and for the categories with
      reference answers ``single-math-v1`` and ``single-math-v1-multi-turn``; temperature 0; the rating is read from
      ``[[rating]]``, else ``[rating]``, else it is -1 (counted, left out of the means, as FastChat's
      ``show_result.py`` does);
    - pairwise: ``pair-v2`` / ``pair-math-v1`` and their multi-turn forms, each match judged in both orders
      (FastChat's g1 and g2).

    What differs between the two is data (:class:`Grading`: prompt names, record fields, how replies are read) and
    the matches each builds; :func:`judge_all` asks for every judgment not in the cache and writes each as it comes.

    Files are FastChat's, so ``show_result.py`` reads them unchanged: ``model_answer/<model_id>.jsonl``,
    ``model_judgment/<judge>_single.jsonl`` and ``<judge>_pair.jsonl``. Each judgment is appended (and fsynced) as it
    comes; a judgment whose exact prompt is already in the file is never asked for again, so a re-run asks only for
    what is missing and an interrupted run loses nothing. The API key is read from an environment variable and never
    written.
    """
    prompts = prompts or load_judge_prompts()
    judge = client.config.judge_model
    store = JudgmentFile(judgment_path(judgment_dir, client.config, grading), grading.key)
    records: dict[tuple, dict[str, Any]] = {}
    tasks = []
    for turn in (1, 2):
        for q in questions:
            needs_ref = q["category"] in NEED_REF_CATS
            ref = references.get(q["question_id"]) if needs_ref else None
            template = prompts[grading.prompts[needs_ref, turn == 2]]
            for match in matches(template, q, ref, turn):
                match = match | {"judge": [judge, template["name"]], "turn": turn}
                identity = grading.key(match)
                cached = store.get(identity)
                if cached is not None:
                    records[identity] = cached
                    continue

                def task(match=match, identity=identity, system_prompt=template["system_prompt"]):
                    replies = {
                        reply: client.complete(system_prompt, match[prompt], store.kept)
                        for prompt, reply in grading.replies.items()
                    }
                    full = match | replies
                    full |= grading.read(full) | {"tstamp": time.time()}
                    record = {f: full[f] for f in grading.fields}
                    store.add(record)
                    records[identity] = record

                tasks.append(task)
    if grading.announce_cache and records:
        print(f"MT-Bench judge {judge}: {len(records)} judgments cached in {store.path}, {len(tasks)} to ask for.")
    _run_all(tasks, client.config.judge_parallel, f"{grading.desc} ({judge})")
    return list(records.values())


def judge_single(
    client: JudgeClient,
    questions: Sequence[dict[str, Any]],
    answers: dict[str, dict[int, dict[str, Any]]],
    references: dict[int, dict[str, Any]],
    judgment_dir: Path,
    prompts: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Single-answer grades of every model's two turns: this run's records (cached or new), with FastChat's fields."""

    def matches(template, q, ref, turn):
        for model, model_answers in answers.items():
            user_prompt = single_prompt(template, q, model_answers[q["question_id"]], ref, turn)
            yield {"question_id": q["question_id"], "model": model, "user_prompt": user_prompt}

    return judge_all(client, SINGLE_GRADING, matches, questions, references, judgment_dir, prompts)


def judge_pairwise(
    client: JudgeClient,
    questions: Sequence[dict[str, Any]],
    model_1: str,
    answers_1: dict[int, dict[str, Any]],
    model_2: str,
    answers_2: dict[int, dict[str, Any]],
    references: dict[int, dict[str, Any]],
    judgment_dir: Path,
    prompts: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Head-to-head verdicts of ``model_1`` vs ``model_2`` on both turns, each judged in both orders (FastChat's g1:
    model_1 shown as A; g2: model_2 shown as A). Winners are ``model_1``, ``model_2``, ``tie`` or ``error``."""

    def matches(template, q, ref, turn):
        a1, a2 = answers_1[q["question_id"]], answers_2[q["question_id"]]
        yield {
            "question_id": q["question_id"],
            "model_1": model_1,
            "model_2": model_2,
            "g1_user_prompt": pair_prompt(template, q, a1, a2, ref, turn),
            "g2_user_prompt": pair_prompt(template, q, a2, a1, ref, turn),
        }

    return judge_all(client, PAIR_GRADING, matches, questions, references, judgment_dir, prompts)
