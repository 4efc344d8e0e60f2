"""MT-Bench scored end to end: answers, an LLM judge behind any OpenAI-compatible endpoint, FastChat's files.

The protocol is FastChat's ``llm_judge`` (lm-sys/FastChat ``fastchat/llm_judge``), reimplemented on the ``openai`` v1
client so that any OpenAI-compatible server can judge (OpenAI itself, vLLM, ``transformers serve``, llama.cpp):

- single-answer grading: ``single-v1`` for turn 1, ``single-v1-multi-turn`` for turn 2, and for the categories with
  reference answers (math, reasoning, coding) ``single-math-v1`` and ``single-math-v1-multi-turn``; temperature 0;
  the rating is read from ``[[rating]]``, else ``[rating]``, else it is -1 (counted, left out of the means, as
  FastChat's ``show_result.py`` does);
- pairwise: ``pair-v2`` / ``pair-math-v1`` and their multi-turn forms, each match judged in both orders, a verdict
  that changes with the order counted as a tie.

Files are FastChat's, so ``show_result.py`` reads them unchanged: ``model_answer/<model_id>.jsonl``,
``model_judgment/<judge>_single.jsonl`` and ``<judge>_pair.jsonl``. Each judgment is appended (and fsynced) as it
comes; a judgment whose exact prompt is already in the file is never asked for again, so a re-run asks only for what
is missing and an interrupted run loses nothing. The API key is read from an environment variable and never written.

Questions, GPT-4 reference answers and judge prompts ship in ``fora_plugin/data/mt_bench`` (Apache-2.0, see NOTICE).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .errors import refuse
from .plots import pyplot
from .validation import check_text_file, read_json


DATA_DIR = Path(__file__).resolve().parent / "data" / "mt_bench"
BUNDLED_QUESTIONS = DATA_DIR / "question.jsonl"
BUNDLED_REFERENCE = DATA_DIR / "reference_answer" / "gpt-4.jsonl"
BUNDLED_JUDGE_PROMPTS = DATA_DIR / "judge_prompts.jsonl"

# Categories graded against a reference answer (FastChat's NEED_REF_CATS, less its arena-hard-200 set).
NEED_REF_CATS = ("math", "reasoning", "coding")
# MT-Bench's eight categories, in the order of its paper's figures.
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
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
# A model without a chat template gets the Alpaca prompt it was fine-tuned on, turn after turn.
ALPACA_PREAMBLE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
)
ALPACA_CHAT_TEMPLATE = (
    ALPACA_PREAMBLE.replace("\n", "\\n").join(["{{ '", "' }}"]) + "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ '### Instruction:\\n' + m['content'] + '\\n\\n### Response:\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
)
CHAT_TEMPLATES = {"alpaca": ALPACA_CHAT_TEMPLATE}
DEFAULT_KEY_ENV = "OPENAI_API_KEY"
# What a local server without authentication gets as a key (the client needs one; vLLM's docs use this word).
NO_KEY = "EMPTY"


@dataclasses.dataclass
class MTBenchConfig:
    """How MT-Bench answers are made and judged: ``fora eval --mt-bench`` flags and ``fora ablate``'s
    ``eval.mt_bench`` block both build this (the flags are the field names with dashes)."""

    judge_model: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Judge model name as the server serves it (e.g. gpt-4). Unset: answers only, no judging."},
    )
    judge_base_url: str | None = dataclasses.field(
        default=None,
        metadata={"help": "OpenAI-compatible base URL (e.g. http://localhost:8000/v1). Default: OpenAI's API."},
    )
    judge_api_key_env: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": f"Environment variable holding the API key (never written anywhere). Default: {DEFAULT_KEY_ENV}, "
            "which a --judge-base-url server without authentication may leave unset."
        },
    )
    questions: str | None = dataclasses.field(
        default=None, metadata={"help": "MT-Bench question.jsonl. Default: the 80 questions shipped in the package."}
    )
    reference: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Reference answers (FastChat model_answer JSONL). Default: the shipped GPT-4 answers."},
    )
    first_n: int | None = dataclasses.field(
        default=None, metadata={"help": "Only the first N questions (FastChat's --first-n). Default: all."}
    )
    max_new_tokens: int = dataclasses.field(
        default=1024, metadata={"help": "Answer length per turn, in tokens (FastChat's default: 1024)."}
    )
    chat_template: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Chat template for a model without one: 'alpaca' (the Alpaca prompt, turn after turn) or a "
            "Jinja file. Default: the tokenizer's."
        },
    )
    judge_max_tokens: int = dataclasses.field(
        default=2048, metadata={"help": "Longest judgment, in tokens (FastChat: 2048)."}
    )
    judge_retries: int = dataclasses.field(
        default=4, metadata={"help": "Tries per judgment on transport errors (connection, timeout, 429, 5xx)."}
    )
    judge_retry_wait: float = dataclasses.field(
        default=2.0, metadata={"help": "Seconds before the first retry; doubled at each retry."}
    )
    judge_timeout: float = dataclasses.field(
        default=600.0, metadata={"help": "Seconds to wait for one judgment before it counts as a transport error."}
    )
    judge_parallel: int = dataclasses.field(default=1, metadata={"help": "Judgments requested at once."})

    def __post_init__(self):
        if self.judge_model is not None and not (isinstance(self.judge_model, str) and self.judge_model.strip()):
            raise ValueError(f"judge_model={self.judge_model!r} is empty: name the judge model (e.g. gpt-4).")
        for name in ("max_new_tokens", "judge_max_tokens", "judge_retries", "judge_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        if self.first_n is not None and (not isinstance(self.first_n, int) or self.first_n < 1):
            raise ValueError(f"first_n={self.first_n!r} must be a positive integer (or unset for all questions).")
        for name in ("judge_retry_wait", "judge_timeout"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a number of seconds >= 0.")
        if self.judge_base_url is not None and not re.match(r"^https?://", self.judge_base_url):
            raise ValueError(
                f"judge_base_url={self.judge_base_url!r} is not an http(s) URL: give e.g. http://localhost:8000/v1."
            )
        if self.chat_template is not None and self.chat_template not in CHAT_TEMPLATES:
            if not Path(self.chat_template).is_file():
                raise ValueError(
                    f"chat_template={self.chat_template!r} is neither one of {sorted(CHAT_TEMPLATES)} nor a file."
                )
        for name in ("questions", "reference"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise ValueError(f"{name}={value!r} is not a file: give the path of an existing JSONL file.")

    @classmethod
    def from_dict(cls, block: dict[str, Any], where: str) -> MTBenchConfig:
        """From a config block (``fora ablate``'s ``eval.mt_bench``), refusing keys that are not fields."""
        if not isinstance(block, dict):
            raise ValueError(f"{where} must be a mapping of MTBenchConfig keys, not {block!r}.")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(block) - set(names))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; accepted: {names}.")
        return cls(**block)

    @property
    def judge_file_name(self) -> str:
        """FastChat names the judgment file after the judge; a path-like name keeps only safe characters."""
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.judge_model).strip("_") or "judge"


# ---------------------------------------------------------------------------------------------------------- files
def _jsonl_rows(path: str | Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-empty line; a file that is not UTF-8 or not JSON Lines, or a line that is
    not a JSON object, is refused by file and line."""
    documents = read_json(path, lines=True)  # refuses a non-UTF-8 or malformed file naming file, line and column
    numbers = [n for n, line in enumerate(check_text_file(path).splitlines(), 1) if line.strip()]
    rows = []
    for number, obj in zip(numbers, documents):
        if not isinstance(obj, dict):
            raise ValueError(f"{path} line {number}: a {what} must be a JSON object, not {type(obj).__name__}.")
        rows.append((number, obj))
    if not rows:
        raise ValueError(f"{path} holds no {what}s: it is empty.")
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
            raise ValueError(f"{path} line {number}: {problem}. Fix the line (FastChat question.jsonl format).")
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
            raise ValueError(f"{path} line {number}: {problem}. Fix the line (FastChat model_answer format).")
        answers[a["question_id"]] = a
    return answers


def load_judge_prompts(path: str | Path = BUNDLED_JUDGE_PROMPTS) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for _, p in _jsonl_rows(path, "judge prompt")}


def check_references(questions: Sequence[dict[str, Any]], references: dict[int, dict[str, Any]], path: str) -> None:
    """Every question graded against a reference has one with both turns."""
    for q in questions:
        if q["category"] in NEED_REF_CATS:
            ref = references.get(q["question_id"])
            if ref is None or len(ref["choices"][0]["turns"]) < 2:
                raise ValueError(
                    f"{path} has no two-turn reference answer for question {q['question_id']} "
                    f"({q['category']}): {', '.join(NEED_REF_CATS)} questions are graded against one."
                )


def answer_turns(answer: dict[str, Any]) -> list[str]:
    return answer["choices"][0]["turns"]


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


# ---------------------------------------------------------------------------------------------------------- prompts
def _reference_fields(ref: dict[str, Any] | None, turn: int) -> dict[str, str]:
    """The reference answers a math/reasoning/coding judge prompt shows: turn 1's, and turn 2's on the second turn."""
    if ref is None:
        return {}
    ref_turns = answer_turns(ref)
    return {"ref_answer_1": ref_turns[0], **({"ref_answer_2": ref_turns[1]} if turn == 2 else {})}


def single_prompt(
    template: dict[str, Any], question: dict[str, Any], answer: dict[str, Any], ref: dict[str, Any] | None, turn: int
) -> str:
    """The user prompt of a single-answer judgment, filled as FastChat's ``run_judge_single`` fills it."""
    turns, kwargs = answer_turns(answer), _reference_fields(ref, turn)
    if turn == 2:
        return template["prompt_template"].format(
            question_1=question["turns"][0],
            question_2=question["turns"][1],
            answer_1=turns[0],
            answer_2=turns[1],
            **kwargs,
        )
    return template["prompt_template"].format(question=question["turns"][0], answer=turns[0], **kwargs)


def pair_prompt(
    template: dict[str, Any],
    question: dict[str, Any],
    answer_a: dict[str, Any],
    answer_b: dict[str, Any],
    ref: dict[str, Any] | None,
    turn: int,
) -> str:
    """The user prompt of a pairwise judgment (A shown first), as FastChat's ``run_judge_pair`` fills it."""
    a, b, kwargs = answer_turns(answer_a), answer_turns(answer_b), _reference_fields(ref, turn)
    if turn == 2:
        return template["prompt_template"].format(
            question_1=question["turns"][0],
            question_2=question["turns"][1],
            answer_a_1=a[0],
            answer_b_1=b[0],
            answer_a_2=a[1],
            answer_b_2=b[1],
            **kwargs,
        )
    return template["prompt_template"].format(question=question["turns"][0], answer_a=a[0], answer_b=b[0], **kwargs)


# ----------------------------------------------------------------------------------------------------------- client
class JudgeClient:
    """One judge model behind an OpenAI-compatible endpoint, with bounded retries on transport errors.

    Transport errors (no connection, timeout, 429, 5xx) are retried ``judge_retries`` times in all, waiting
    ``judge_retry_wait`` seconds doubled each time; then the run stops with a message. Any other refusal of the server
    (bad key, unknown model, a rejected request) stops it at once: retrying cannot fix it.
    """

    def __init__(self, config: MTBenchConfig):
        try:
            import openai
        except ImportError as err:
            raise ImportError(
                'MT-Bench judging needs the openai client (v1 or later): pip install "fora-plugin[mt-bench]"'
            ) from err
        self.config = config
        self.url = config.judge_base_url or "https://api.openai.com/v1"
        env = config.judge_api_key_env or DEFAULT_KEY_ENV
        key = os.environ.get(env)
        if not key:
            if config.judge_api_key_env is not None or config.judge_base_url is None:
                raise ValueError(
                    f"the judge's API key variable ${env} is not set (or empty): export {env}=<your key>, or name "
                    "the variable that holds it with --judge-api-key-env."
                )
            key = NO_KEY  # a local server with no authentication; the variable was not asked for
        self.key_env = env
        self.requests = 0
        # The HTTP client logs every request at INFO, which would bury the progress bar; errors still show.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # Retries are ours (bounded, counted, named in the message); the client's own would hide them.
        self._client = openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=config.judge_timeout)
        self._openai = openai

    def __repr__(self) -> str:  # never shows the key
        return f"JudgeClient(model={self.config.judge_model!r}, url={self.url!r}, key from ${self.key_env})"

    def _refusal(self, error: Exception) -> ValueError:
        openai = self._openai
        if isinstance(error, openai.AuthenticationError | openai.PermissionDeniedError):
            return ValueError(
                f"the judge at {self.url} refused the API key in ${self.key_env} ({error.status_code}): set "
                f"{self.key_env} to a valid key for that server."
            )
        if isinstance(error, openai.NotFoundError):
            return ValueError(
                f"the judge at {self.url} does not serve judge model {self.config.judge_model!r} (404): name a "
                "model it serves (GET /v1/models lists them)."
            )
        detail = getattr(error, "message", str(error))
        return ValueError(
            f"the judge at {self.url} refused a request for judge model {self.config.judge_model!r} "
            f"({getattr(error, 'status_code', '?')}): {detail:.300}"
        )

    def _transport(self, error: Exception) -> bool:
        openai = self._openai
        return isinstance(error, openai.APIConnectionError | openai.RateLimitError | openai.InternalServerError)

    def check(self) -> None:
        """Refuse, before any answer is generated, a server that is unreachable or does not serve the judge."""
        openai = self._openai
        try:
            served = [m.id for m in self._client.models.list()]
        except openai.APIConnectionError as error:
            raise ValueError(
                f"the judge URL {self.url} is unreachable ({type(error).__name__}: {error}): start the server or fix "
                "--judge-base-url."
            ) from None
        except openai.NotFoundError:
            return  # a server without GET /v1/models: the first judgment will tell
        except openai.APIStatusError as error:
            raise self._refusal(error) from None
        if served and self.config.judge_model not in served:
            raise ValueError(
                f"the judge at {self.url} does not serve judge model {self.config.judge_model!r}; it serves: "
                f"{', '.join(served[:20])}{' ...' if len(served) > 20 else ''}."
            )

    def complete(self, system_prompt: str, user_prompt: str, kept: Callable[[], str]) -> str:
        """The judge's reply at temperature 0; ``kept()`` says where finished judgments are, for the message."""
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": user_prompt}]
        wait = self.config.judge_retry_wait
        for attempt in range(1, self.config.judge_retries + 1):
            try:
                self.requests += 1
                response = self._client.chat.completions.create(
                    model=self.config.judge_model,
                    messages=messages,
                    n=1,
                    temperature=0,
                    max_tokens=self.config.judge_max_tokens,
                )
                return response.choices[0].message.content or ""
            except self._openai.APIStatusError as error:
                if not self._transport(error):
                    raise self._refusal(error) from None
                last = error
            except self._openai.APIConnectionError as error:
                last = error
            if attempt < self.config.judge_retries:
                time.sleep(wait)
                wait *= 2
        raise ValueError(
            f"the judge URL {self.url} failed {self.config.judge_retries} tries in a row ({type(last).__name__}: "
            f"{last}); {kept()}. Bring the server back and re-run the same command: it resumes."
        ) from None


# --------------------------------------------------------------------------------------------------------- judgments
class JudgmentFile:
    """A FastChat judgment JSONL that doubles as the cache: appended and fsynced one judgment at a time."""

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
                        raise ValueError(
                            f"{path} line {number} is not a judgment record ({error}): move the file away to judge "
                            "again from scratch."
                        ) from None

    def get(self, key: tuple) -> dict[str, Any] | None:
        return self.records.get(key)

    def add(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.records[self.key(record)] = record
            self.added += 1

    def kept(self) -> str:
        return f"the {len(self.records)} judgments made so far are kept in {self.path}"


def _single_key(record: dict[str, Any]) -> tuple:
    # The exact prompt is part of the key: a changed answer or reference is judged again, never served stale.
    return (record["question_id"], record["model"], tuple(record["judge"]), record["turn"], record["user_prompt"])


def _pair_key(record: dict[str, Any]) -> tuple:
    return (
        record["question_id"],
        record["model_1"],
        record["model_2"],
        tuple(record["judge"]),
        record["turn"],
        record["g1_user_prompt"],
        record["g2_user_prompt"],
    )


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


def _template_and_reference(
    prompts: dict[str, dict[str, Any]],
    names: dict[tuple[bool, bool], str],
    question: dict[str, Any],
    references: dict[int, dict[str, Any]],
    turn: int,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The judge prompt for this question's category and turn, and its reference answer where the category has one."""
    needs_ref = question["category"] in NEED_REF_CATS
    ref = references.get(question["question_id"]) if needs_ref else None
    return prompts[names[needs_ref, turn == 2]], ref


def judge_single(
    client: JudgeClient,
    questions: Sequence[dict[str, Any]],
    answers: dict[str, dict[int, dict[str, Any]]],
    references: dict[int, dict[str, Any]],
    judgment_dir: Path,
    prompts: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Single-answer grades of every model's two turns: this run's records (cached or new), with FastChat's fields."""
    prompts = prompts or load_judge_prompts()
    judge = client.config.judge_model
    store = JudgmentFile(judgment_dir / f"{client.config.judge_file_name}_single.jsonl", _single_key)
    records: dict[tuple, dict[str, Any]] = {}
    tasks = []
    for turn in (1, 2):
        for q in questions:
            template, ref = _template_and_reference(prompts, SINGLE_PROMPTS, q, references, turn)
            for model, model_answers in answers.items():
                user_prompt = single_prompt(template, q, model_answers[q["question_id"]], ref, turn)
                identity = (q["question_id"], model, (judge, template["name"]), turn, user_prompt)
                cached = store.get(identity)
                if cached is not None:
                    records[identity] = cached
                    continue

                def task(q=q, model=model, template=template, user_prompt=user_prompt, turn=turn, identity=identity):
                    judgment = client.complete(template["system_prompt"], user_prompt, store.kept)
                    record = {
                        "question_id": q["question_id"],
                        "model": model,
                        "judge": [judge, template["name"]],
                        "user_prompt": user_prompt,
                        "judgment": judgment,
                        "score": parse_rating(judgment),
                        "turn": turn,
                        "tstamp": time.time(),
                    }
                    store.add(record)
                    records[identity] = record

                tasks.append(task)
    if records:
        print(f"MT-Bench judge {judge}: {len(records)} judgments cached in {store.path}, {len(tasks)} to ask for.")
    _run_all(tasks, client.config.judge_parallel, f"judging ({judge})")
    return list(records.values())


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
    prompts = prompts or load_judge_prompts()
    judge = client.config.judge_model
    store = JudgmentFile(judgment_dir / f"{client.config.judge_file_name}_pair.jsonl", _pair_key)
    records: dict[tuple, dict[str, Any]] = {}
    tasks = []
    for turn in (1, 2):
        for q in questions:
            template, ref = _template_and_reference(prompts, PAIR_PROMPTS, q, references, turn)
            a1, a2 = answers_1[q["question_id"]], answers_2[q["question_id"]]
            g1_prompt = pair_prompt(template, q, a1, a2, ref, turn)
            g2_prompt = pair_prompt(template, q, a2, a1, ref, turn)
            identity = (q["question_id"], model_1, model_2, (judge, template["name"]), turn, g1_prompt, g2_prompt)
            cached = store.get(identity)
            if cached is not None:
                records[identity] = cached
                continue

            def task(q=q, template=template, g1_prompt=g1_prompt, g2_prompt=g2_prompt, turn=turn, identity=identity):
                g1 = client.complete(template["system_prompt"], g1_prompt, store.kept)
                g2 = client.complete(template["system_prompt"], g2_prompt, store.kept)
                g1_winner = {"A": "model_1", "B": "model_2"}.get(parse_verdict(g1), parse_verdict(g1))
                g2_winner = {"A": "model_2", "B": "model_1"}.get(parse_verdict(g2), parse_verdict(g2))
                record = {
                    "question_id": q["question_id"],
                    "model_1": model_1,
                    "model_2": model_2,
                    "g1_winner": g1_winner,
                    "g2_winner": g2_winner,
                    "judge": [judge, template["name"]],
                    "g1_user_prompt": g1_prompt,
                    "g1_judgment": g1,
                    "g2_user_prompt": g2_prompt,
                    "g2_judgment": g2,
                    "turn": turn,
                    "tstamp": time.time(),
                }
                store.add(record)
                records[identity] = record

            tasks.append(task)
    _run_all(tasks, client.config.judge_parallel, f"pairwise ({judge})")
    return list(records.values())


# ----------------------------------------------------------------------------------------------------------- tables
def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def single_summary(
    records: Sequence[dict[str, Any]], questions: Sequence[dict[str, Any]], judge: str
) -> dict[str, dict[str, Any]]:
    """Per model: mean, turn-1 and turn-2 means and each category's mean over parsable scores (FastChat's
    ``show_result.py`` drops -1), with the count of unparsable judgments beside them and the judge named."""
    category = {q["question_id"]: q["category"] for q in questions}
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_model.setdefault(r["model"], []).append(r)
    summary = {}
    for model, rows in by_model.items():
        scored = [r for r in rows if r["score"] != UNPARSABLE]
        present = [c for c in CATEGORIES if any(category[r["question_id"]] == c for r in rows)]
        present += sorted({category[r["question_id"]] for r in rows} - set(present))
        summary[model] = {
            "judge": judge,
            "score": _mean([r["score"] for r in scored]),
            "turn_1": _mean([r["score"] for r in scored if r["turn"] == 1]),
            "turn_2": _mean([r["score"] for r in scored if r["turn"] == 2]),
            "categories": {c: _mean([r["score"] for r in scored if category[r["question_id"]] == c]) for c in present},
            "judgments": len(rows),
            "unparsable": len(rows) - len(scored),
            "unparsable_judgments": sorted([r["question_id"], r["turn"]] for r in rows if r["score"] == UNPARSABLE),
        }
    return summary


def pairwise_summary(records: Sequence[dict[str, Any]], judge: str) -> dict[str, Any]:
    """Win/tie/loss of model_1 against model_2, as FastChat's ``show_result.py`` counts them: a judgment with an
    unparsable verdict is dropped (and counted), a tie or an order-dependent verdict is a tie."""
    win = tie = loss = errors = 0
    for r in records:
        if "error" in (r["g1_winner"], r["g2_winner"]):
            errors += 1
        elif r["g1_winner"] == "tie" or r["g1_winner"] != r["g2_winner"]:
            tie += 1
        elif r["g1_winner"] == "model_1":
            win += 1
        else:
            loss += 1
    first = records[0] if records else {}
    return {
        "judge": judge,
        "model_1": first.get("model_1"),
        "model_2": first.get("model_2"),
        "win": win,
        "tie": tie,
        "loss": loss,
        "error": errors,
        "win_rate": win / (win + tie + loss) if win + tie + loss else None,
    }


def format_score(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def results_markdown(summary: dict[str, dict[str, Any]], pairwise: Sequence[dict[str, Any]] = ()) -> str:
    """The score table (one row per model, the judge in every row) and the pairwise counts."""
    categories = [c for c in CATEGORIES if any(c in s["categories"] for s in summary.values())]
    categories += sorted({c for s in summary.values() for c in s["categories"]} - set(categories))
    head = ["model", "judge", "MT-Bench", "turn 1", "turn 2", *categories, "judgments", "unparsable (-1)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for model, s in summary.items():
        cells = [model, s["judge"], format_score(s["score"]), format_score(s["turn_1"]), format_score(s["turn_2"])]
        cells += [format_score(s["categories"].get(c)) for c in categories]
        cells += [str(s["judgments"]), str(s["unparsable"])]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    if pairwise:
        rows = ["| model_1 | model_2 | judge | win | tie | loss | unparsable |", "|---|---|---|---:|---:|---:|---:|"]
        for p in pairwise:
            rows.append(
                f"| {p['model_1']} | {p['model_2']} | {p['judge']} | {p['win']} | {p['tie']} | {p['loss']} | "
                f"{p['error']} |"
            )
        text += "\n\nPairwise (both orders; an order-dependent verdict is a tie):\n\n" + "\n".join(rows)
    judges = sorted({s["judge"] for s in summary.values()})
    return (
        text + f"\n\nScores are 1-10 from judge {', '.join(judges)}; scores from different judges are not comparable."
    )


def plot_categories(path: str | Path, summary: dict[str, dict[str, Any]]) -> Path:
    """Per-category scores of one or more models side by side (grouped bars), the judge in the title."""
    plt = pyplot()

    categories = [c for c in CATEGORIES if any(c in s["categories"] for s in summary.values())]
    categories += sorted({c for s in summary.values() for c in s["categories"]} - set(categories))
    models = list(summary)
    width = 0.8 / max(1, len(models))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(categories) + 2), 4), dpi=120)
    for i, model in enumerate(models):
        values = [summary[model]["categories"].get(c) for c in categories]
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(categories))]
        score = summary[model]["score"]
        label = f"{model} ({format_score(score)})"
        ax.bar(xs, [v if v is not None else 0 for v in values], width, label=label)
        for x, v in zip(xs, values):
            if v is None:
                ax.text(x, 0.1, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylim(0, 10)
    ax.set_ylabel("score (1-10)")
    judges = ", ".join(sorted({s["judge"] for s in summary.values()}))
    ax.set_title(f"MT-Bench by category (judge: {judges})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------- command line
# Flag of each MTBenchConfig field on `fora eval` (the rest are `--` + the field name with dashes).
FLAGS = {
    "questions": "--mt-bench",
    "reference": "--mt-bench-reference",
    "first_n": "--mt-bench-first-n",
    "max_new_tokens": "--mt-bench-max-new-tokens",
    "chat_template": "--mt-bench-chat-template",
}


def flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def add_arguments(parser) -> None:
    """`fora eval`'s MT-Bench flags, one per MTBenchConfig field (same help), plus the comparison flags."""
    group = parser.add_argument_group("MT-Bench (answers, then an LLM judge behind an OpenAI-compatible endpoint)")
    fields = sorted(dataclasses.fields(MTBenchConfig), key=lambda f: f.name != "questions")  # --mt-bench first
    for f in fields:
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        help_ = f.metadata["help"]
        kwargs: dict[str, Any] = {
            "dest": f"mt_bench_{f.name}",
            "default": None,
            "type": kind,
            "metavar": f.name.upper(),
        }
        if f.name == "questions":
            # `--mt-bench` alone: the bundled questions.
            kwargs.update(nargs="?", const="")
            help_ = "write two-turn MT-Bench answers (judged if --judge-model is given) to the questions in " + help_
        group.add_argument(flag(f.name), help=help_, **kwargs)
    group.add_argument(
        "--mt-bench-compare",
        nargs="+",
        default=[],
        metavar="MODEL_ID",
        help="other model_ids answered earlier into the same --output (model_answer/<id>.jsonl): judged alongside, "
        "in one table and one plot",
    )
    group.add_argument(
        "--mt-bench-pairwise",
        action="store_true",
        help="also judge --model-id against each --mt-bench-compare model head to head (pair-v2, both orders)",
    )


def config_from_args(args) -> MTBenchConfig:
    values = {f.name: getattr(args, f"mt_bench_{f.name}") for f in dataclasses.fields(MTBenchConfig)}
    values = {k: v for k, v in values.items() if v is not None}
    if values.get("questions") == "":
        values.pop("questions")
    return MTBenchConfig(**values)


# ------------------------------------------------------------------------------------------------------------ runs
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
        check_text_file(config.chat_template, flag("chat_template"))
    for model_id in compare:
        _answers_of(out, model_id, questions, "--mt-bench-compare")
    references, client = {}, None
    if config.judge_model is not None:
        reference_file = config.reference or BUNDLED_REFERENCE
        references = load_answers(reference_file, "reference answer")
        check_references(questions, references, str(reference_file))
        client = JudgeClient(config)
        client.check()
    return Prepared(config, questions, references, load_judge_prompts(), client)


def apply_chat_template(tokenizer, name_or_file: str | None) -> None:
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
    from .evaluation import mt_bench_answers

    source_file = answer_file.with_suffix(".source.json")
    if source_file.is_file():
        earlier = json.loads(source_file.read_text())
        if earlier != source:
            changed = sorted(k for k in set(earlier) | set(source) if earlier.get(k) != source.get(k))
            raise ValueError(
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
        with open(answer_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        answers[q["question_id"]] = record
    return answers


def score(
    prepared: Prepared,
    out: Path,
    model_ids: Sequence[str],
    *,
    pairwise: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """Judge the answers of ``model_ids`` in ``out/model_answer``, then write results.md, results.json (under
    ``out``... by the caller) and mt_bench.png; returns ``{"summary", "pairwise", "markdown", "plot"}``."""
    answers = {model_id: _answers_of(out, model_id, prepared.questions) for model_id in model_ids}
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
        "judgment_file": str(judgment_dir / f"{prepared.config.judge_file_name}_single.jsonl"),
    }


def _answers_of(
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
