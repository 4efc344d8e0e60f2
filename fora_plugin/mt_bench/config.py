"""How MT-Bench answers are made and judged: :class:`MTBenchConfig`, its checks, and its ``fora eval`` flags.

``fora eval --mt-bench`` builds the config from its flags (one flag per field, same help) and ``fora ablate`` from its
``eval.mt_bench`` block; both are checked here, before any model loads.

May import: errors, validation.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from ..errors import FoRAInputError, refuse
from ..validation import check_block, is_integer, is_real


__all__ = [
    "ALPACA_CHAT_TEMPLATE",
    "ALPACA_PREAMBLE",
    "CHAT_TEMPLATES",
    "DEFAULT_KEY_ENV",
    "FLAGS",
    "MTBenchConfig",
    "JUDGING_FIELDS",
    "add_arguments",
    "check_args",
    "config_from_args",
    "flag",
]

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
# The fields that say how answers are judged: without judge_model (answers only) they would be ignored.
JUDGING_FIELDS = (
    "judge_base_url",
    "judge_api_key_env",
    "reference",
    "judge_max_tokens",
    "judge_retries",
    "judge_retry_wait",
    "judge_timeout",
    "judge_parallel",
)


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
            raise FoRAInputError(f"judge_model={self.judge_model!r} is empty: name the judge model (e.g. gpt-4).")
        for name in ("max_new_tokens", "judge_max_tokens", "judge_retries", "judge_parallel"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise FoRAInputError(f"{name}={value!r} must be a positive integer.")
        if self.first_n is not None and (not is_integer(self.first_n) or self.first_n < 1):
            raise FoRAInputError(f"first_n={self.first_n!r} must be a positive integer (or unset for all questions).")
        for name in ("judge_retry_wait", "judge_timeout"):
            if not is_real(getattr(self, name)) or getattr(self, name) < 0:
                raise FoRAInputError(f"{name}={getattr(self, name)!r} must be a number of seconds >= 0.")
        if self.judge_base_url is not None and not re.match(r"^https?://", self.judge_base_url):
            raise FoRAInputError(
                f"judge_base_url={self.judge_base_url!r} is not an http(s) URL: give e.g. http://localhost:8000/v1."
            )
        if self.chat_template is not None and self.chat_template not in CHAT_TEMPLATES:
            if not Path(self.chat_template).is_file():
                raise FoRAInputError(
                    f"chat_template={self.chat_template!r} is neither one of {sorted(CHAT_TEMPLATES)} nor a file."
                )
        for name in ("questions", "reference"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise FoRAInputError(f"{name}={value!r} is not a file: give the path of an existing JSONL file.")

    @classmethod
    def from_dict(cls, block: dict[str, Any], where: str) -> MTBenchConfig:
        """From a config block (``fora ablate``'s ``eval.mt_bench``), refusing keys that are not fields (with the
        closest field)."""
        check_block(block, [f.name for f in dataclasses.fields(cls)], where)
        _check_judging([k for k in block if block[k] is not None], block.get("judge_model"), lambda n: f"{where}.{n}")
        return cls(**block)

    @property
    def judge_file_name(self) -> str:
        """FastChat names the judgment file after the judge; a path-like name keeps only safe characters."""
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.judge_model).strip("_") or "judge"


# Flag of each MTBenchConfig field on `fora eval` (the rest are `--` + the field name with dashes).
FLAGS = {
    "questions": "--mt-bench",
    "reference": "--mt-bench-reference",
    "first_n": "--mt-bench-first-n",
    "max_new_tokens": "--mt-bench-max-new-tokens",
    "chat_template": "--mt-bench-chat-template",
}


def flag(name: str) -> str:
    """The ``fora eval`` flag of MTBenchConfig field ``name``."""
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


def _check_judging(given: list[str], judge_model: str | None, name) -> None:
    """Refuse judging settings (``given`` names the fields set; ``name``: how a field is shown) without a judge."""
    if judge_model is not None:
        return
    unused = [f for f in JUDGING_FIELDS if f in given]
    if unused:
        raise FoRAInputError(
            f"{name(unused[0])} is set but no judge is ({name('judge_model')} is not): without one the answers are "
            f"not judged and it would be ignored. Set {name('judge_model')}, or drop {name(unused[0])}."
        )


def check_args(args) -> None:
    """Refuse ``fora eval`` MT-Bench flags that would be ignored or that contradict each other, before anything runs:
    an MT-Bench flag without ``--mt-bench``, a judging flag without ``--judge-model``, ``--mt-bench-compare``
    without a judge, ``--mt-bench-pairwise`` without ``--mt-bench-compare`` (nothing to pair), and a compared
    model_id given twice or equal to ``--model-id`` (one answer file: the model would be judged against itself)."""
    given = [f.name for f in dataclasses.fields(MTBenchConfig) if getattr(args, f"mt_bench_{f.name}") is not None]
    asked = "questions" in given
    extra = [flag(n) for n in given if n != "questions"]
    if args.mt_bench_compare:
        extra.append("--mt-bench-compare")
    if args.mt_bench_pairwise:
        extra.append("--mt-bench-pairwise")
    if not asked and extra:
        raise FoRAInputError(
            f"{extra[0]} applies to MT-Bench answers, and --mt-bench is not given: add --mt-bench "
            "[QUESTIONS], or drop it."
        )
    _check_judging(given, args.mt_bench_judge_model, flag)
    compare = list(args.mt_bench_compare)
    if compare and args.mt_bench_judge_model is None:
        raise FoRAInputError("--mt-bench-compare needs --judge-model: comparing means judging.")
    if args.mt_bench_pairwise and not compare:
        refuse(
            "--mt-bench-pairwise",
            True,
            "it judges --model-id head to head against each --mt-bench-compare model, and none is given",
            "Add --mt-bench-compare MODEL_ID (answered earlier into the same --output), or drop --mt-bench-pairwise.",
        )
    twice = sorted({m for m in compare if compare.count(m) > 1} | ({args.model_id} & set(compare)))
    if twice:
        refuse(
            "--mt-bench-compare",
            compare,
            f"{twice[0]!r} is named twice (or is --model-id itself), and its answers are one file: it would be "
            "judged against itself",
            "Name each other model once, none of them --model-id.",
        )


def config_from_args(args) -> MTBenchConfig:
    """The MTBenchConfig of parsed ``fora eval`` flags: unset flags keep the dataclass defaults, and a bare
    ``--mt-bench`` means the bundled questions."""
    values = {f.name: getattr(args, f"mt_bench_{f.name}") for f in dataclasses.fields(MTBenchConfig)}
    values = {k: v for k, v in values.items() if v is not None}
    if values.get("questions") == "":
        values.pop("questions")
    return MTBenchConfig(**values)
