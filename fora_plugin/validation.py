"""The primitives of a user's value: numbers (one rule table per key), choices, known keys and config blocks.

A refusal is a ``FoRAInputError`` naming the key, the value, what is accepted and the fix; the CLI prints it as one
line and exits with 2. :data:`NUMBER_RULES` holds the rule of every number a user gives, under each name it is given
by: SFTConfig/ModelConfig keys, their Axolotl names, ``fora eval``/``report`` flags and ``ablation: eval:`` keys.
Nothing here knows a file, a model, a checkpoint or a dataset: each of those is checked in its own module.

May import: errors.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import FoRAInputError, refuse


__all__ = [
    "LORA_KEYS",
    "NUMBER_RULES",
    "OPTIMIZER_KEYS",
    "TRAINING_KEYS",
    "Rule",
    "check_block",
    "check_choice",
    "check_float",
    "check_int",
    "check_known_keys",
    "check_list",
    "check_number",
    "check_numbers",
    "is_integer",
    "is_real",
    "suggestion",
]


# ------------------------------------------------------------------------------------------------------ numbers
def is_real(value: Any) -> bool:
    """A finite int or float (not a bool: YAML's `true` is not 1)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def is_integer(value: Any) -> bool:
    """An int (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int)


@dataclass(frozen=True)
class Rule:
    """What a number must be: ``test`` on the value, ``accepted`` in words, ``fix`` when a mistake has a usual cause;
    ``optional``: None is accepted (the key's "unset")."""

    test: Callable[[Any], bool]
    accepted: str
    fix: str = ""
    optional: bool = False


def _int_at_least(minimum: int, accepted: str = "", fix: str = "", optional: bool = False) -> Rule:
    return Rule(lambda v: is_integer(v) and v >= minimum, accepted or f"use an int >= {minimum}", fix, optional)


def _below_one(accepted: str) -> Rule:
    """A probability or decay rate in [0, 1)."""
    return Rule(lambda v: is_real(v) and 0 <= v < 1, accepted)


def check_choice(key: str, value: Any, choices: tuple) -> None:
    """Refuse ``value`` unless it is one of ``choices``."""
    if value not in choices:
        raise FoRAInputError(f"{key}={value!r} is invalid: use one of {choices}.")


def check_float(key: str, value: Any, in_range: Callable[[float], bool], accepted: str) -> None:
    """Refuse ``value`` unless it is a finite real number (not a bool) for which ``in_range`` holds."""
    # NaN and inf are refused before the range check: NaN passes every `<` test and trains a NaN adapter.
    if not (is_real(value) and in_range(value)):
        refuse(key, value, f"use {accepted}")


def check_int(key: str, value: Any, minimum: int, hint: str) -> None:
    """Refuse ``value`` unless it is an int (not a bool) >= ``minimum``; ``hint`` says what the number means."""
    if not (is_integer(value) and value >= minimum):
        refuse(key, value, f"use an int >= {minimum} ({hint})")


# key (as the user writes it: a config key, a `--flag` of `fora eval`/`report`, an `ablation: eval:` key) -> Rule.
NUMBER_RULES: dict[str, Rule] = {
    # --- LoRA (ModelConfig)
    "lora_r": _int_at_least(1, "use an int >= 1, the LoRA rank (e.g. 16)"),
    "lora_alpha": Rule(
        lambda v: is_real(v) and v > 0,
        "use a finite number > 0 (e.g. 2 * lora_r)",
        "lora_alpha scales ΔW = (lora_alpha / r) B A: at 0 the adapter does nothing, below 0 it flips its sign.",
    ),
    "lora_dropout": _below_one("use a probability in [0, 1) (e.g. 0.05)"),
    # --- training (SFTConfig / TrainingArguments)
    "per_device_train_batch_size": _int_at_least(1, "use an int >= 1 (examples per device and step)"),
    "per_device_eval_batch_size": _int_at_least(1, "use an int >= 1 (examples per device and step)"),
    "gradient_accumulation_steps": _int_at_least(1, "use an int >= 1 (1 = no accumulation)"),
    "max_steps": Rule(
        lambda v: is_integer(v) and (v == -1 or v >= 1),
        "use an int >= 1, or -1 to train num_train_epochs epochs",
    ),
    "num_train_epochs": Rule(lambda v: is_real(v) and v > 0, "use a finite number > 0 (e.g. 3)"),
    "max_length": _int_at_least(1, "use an int >= 1 (tokens per example; e.g. 1024), or null for no limit", "", True),
    "warmup_steps": Rule(lambda v: is_real(v) and v >= 0, "use a number >= 0 (an int: steps; a float < 1: a ratio)"),
    "warmup_ratio": Rule(lambda v: is_real(v) and 0 <= v <= 1, "use a fraction in [0, 1]", optional=True),
    "weight_decay": Rule(lambda v: is_real(v) and v >= 0, "use a finite number >= 0 (e.g. 0.0 or 0.01)"),
    "max_grad_norm": Rule(lambda v: is_real(v) and v >= 0, "use a finite number >= 0 (e.g. 1.0; 0 = no clipping)"),
    "adam_beta1": _below_one("use a float in [0, 1) (e.g. 0.9)"),
    "adam_beta2": _below_one("use a float in [0, 1) (e.g. 0.999)"),
    "adam_epsilon": Rule(lambda v: is_real(v) and v >= 0, "use a finite number >= 0 (e.g. 1e-8)"),
    "label_smoothing_factor": _below_one("use a float in [0, 1) (0 = no smoothing)"),
    "logging_steps": Rule(lambda v: is_real(v) and v > 0, "use a number > 0 (an int: steps; a float < 1: a ratio)"),
    "save_steps": Rule(lambda v: is_real(v) and v > 0, "use a number > 0 (an int: steps; a float < 1: a ratio)"),
    "eval_steps": Rule(
        lambda v: is_real(v) and v > 0, "use a number > 0 (an int: steps; a float < 1: a ratio)", optional=True
    ),
    "save_total_limit": _int_at_least(1, "use an int >= 1 (checkpoints kept), or null to keep all", "", True),
    "dataloader_num_workers": _int_at_least(0, "use an int >= 0 (0 = load in the main process)"),
    "dataset_num_proc": _int_at_least(1, "use an int >= 1, or null for one process", "", True),
    "seed": Rule(lambda v: is_integer(v) and 0 <= v < 2**32, "use an int in [0, 2**32)"),
    # --- Axolotl's names of training keys
    "micro_batch_size": _int_at_least(1, "use an int >= 1 (examples per device and step)"),
    "sequence_len": _int_at_least(1, "use an int >= 1 (tokens per example; e.g. 2048)"),
    "num_epochs": Rule(lambda v: is_real(v) and v > 0, "use a finite number > 0 (e.g. 3)"),
    # --- `fora eval` / `fora report` flags
    "--max-examples": _int_at_least(1, "use an int >= 1 (examples per task), or leave it out for all", "", True),
    "--batch-size": _int_at_least(1, "use an int >= 1 (prompts generated together)"),
    "--max-new-tokens": _int_at_least(1, "use an int >= 1 (tokens of each answer)"),
    "--ppl-max-length": _int_at_least(2, "use an int >= 2 (tokens per perplexity window)"),
    "--ppl-stride": _int_at_least(1, "use an int >= 1, at most --ppl-max-length"),
    "--ppl-max-tokens": _int_at_least(2, "use an int >= 2, or leave it out for the whole text", "", True),
    "--kl-max-tokens": _int_at_least(1, "use an int >= 1 (tokens of the KL text)"),
    # --- `ablation: eval:` keys of `fora ablate`
    "max_examples": _int_at_least(1, "use an int >= 1 (examples per task), or leave it out for all", "", True),
    "batch_size": _int_at_least(1, "use an int >= 1 (prompts generated together)"),
    "max_new_tokens": _int_at_least(1, "use an int >= 1 (tokens of each answer)"),
    "kl_max_tokens": _int_at_least(1, "use an int >= 1 (tokens of the KL text)"),
    "eval_loss_examples": _int_at_least(0, "use an int >= 0 (0 = no held-out loss)"),
}

# The NUMBER_RULES keys each set of arguments holds.
LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout")
# Named alike in TRL's TrainingArguments and in Axolotl's YAML.
OPTIMIZER_KEYS = (
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
)
TRAINING_KEYS = (
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "num_train_epochs",
    "max_length",
    *OPTIMIZER_KEYS,
    "label_smoothing_factor",
    "logging_steps",
    "save_steps",
    "eval_steps",
    "save_total_limit",
    "dataloader_num_workers",
    "dataset_num_proc",
    "seed",
)


def check_number(key: str, value: Any, name: str | None = None) -> None:
    """Refuse ``value`` unless it passes ``NUMBER_RULES[key]``; the message names it as ``name`` (default: key)."""
    rule = NUMBER_RULES[key]
    if value is None and rule.optional:
        return
    if not rule.test(value):
        refuse(name or key, value, rule.accepted, rule.fix)


def check_numbers(values: Any, keys: Iterable[str], prefix: str = "") -> None:
    """``check_number`` on each of ``keys`` that ``values`` (a mapping or an object with attributes) has."""
    for key in keys:
        if isinstance(values, Mapping):
            if key not in values:
                continue
            value = values[key]
        elif hasattr(values, key):
            value = getattr(values, key)
        else:
            continue
        check_number(key, value, prefix + key)


# ---------------------------------------------------------------------------------------------- names and keys
def suggestion(name: str, known: Iterable[str]) -> str:
    """' Did you mean X?' for the closest of ``known`` (difflib), or else the one known name that ``name`` begins
    with or that begins with ``name`` (``evaluation`` -> ``eval``), or ''."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    if not close and len(name) >= 3:
        close = [k for k in known if len(k) >= 3 and (name.startswith(k) or k.startswith(name))]
    return f" Did you mean {close[0]}?" if len(close) == 1 else ""


def check_known_keys(given: Iterable[str], known: Iterable[str], where: str, what: str, known_as: str) -> None:
    """Refuse keys of ``given`` not in ``known`` (``known_as`` says what they are), each with its closest known key;
    the known keys are not all listed."""
    known = list(known)
    unknown = [k for k in given if k not in known]
    if unknown:
        hints = "".join(suggestion(k, known).replace("Did you mean", f"For {k}, did you mean") for k in unknown)
        raise FoRAInputError(f"{where} has unknown {what} {unknown}: they are none of {known_as}.{hints}")


def check_list(key: str, value: Any) -> None:
    """Refuse ``value`` for ``key``, a key that holds a list, unless it is a list: a string would be read as its
    characters (or dropped); the fix writes it as a YAML list."""
    if isinstance(value, list):
        return
    items = value.replace(",", " ").split() if isinstance(value, str) else [value]
    fix = f"Write it as a YAML list: `{key.rsplit('.', 1)[-1]}: [{', '.join(map(str, items))}]`."
    refuse(key, value, "give a list", fix)


def check_block(block: Any, known: Iterable[str], where: str, *, lists: Iterable[str] = ()) -> Mapping[str, Any]:
    """Refuse a config block (an ``ablation:`` block, its ``eval:``, MT-Bench's options) that is not a mapping, that
    holds a key not in ``known`` (each with its closest known key: a misspelt key would be ignored), or whose key of
    ``lists`` is given something else than a list. Returns the block."""
    known = list(known)
    if not isinstance(block, Mapping):
        refuse(where, block, f"give a mapping of its keys ({', '.join(known)})")
    check_known_keys(list(block), known, where, "keys", f"its keys ({', '.join(known)})")
    for key in lists:
        if block.get(key) is not None:
            check_list(f"{where}.{key}", block[key])
    return block
