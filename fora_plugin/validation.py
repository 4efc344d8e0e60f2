"""Up-front checks of what a user gives ``fora`` and the Axolotl plugin: numbers, paths and names.

Every check runs before the libraries see the value (PEFT, TRL, ``datasets``, torch) and before heavy work (the model
is loaded only after everything that can be checked without it). A refusal is a ``ValueError`` naming the key, the
value, what is accepted and the fix; the CLI prints it as one line and exits with 2. A library error that still
reaches a user is a bug of ours: a check belongs in the module of the thing it checks (models, data, ...).

The numeric rules are one table, :data:`NUMBER_RULES`, that ``fora train``/``score``/``ablate`` (SFTConfig and
ModelConfig keys), ``fora eval``/``report`` flags and ``ablation.eval`` read.

May import: errors.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import FoRAInputError, refuse


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AXOLOTL_KEYS",
    "LORA_KEYS",
    "NUMBER_KEYS_OF_A_CONFIG",
    "NUMBER_RULES",
    "TRAINING_KEYS",
    "Rule",
    "check_adapter_folder",
    "check_block",
    "check_choice",
    "check_eval_arguments",
    "check_float",
    "check_int",
    "check_known_keys",
    "check_list",
    "check_lora_arguments",
    "check_number",
    "check_numbers",
    "check_training_arguments",
    "is_integer",
    "is_real",
    "suggestion",
]


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


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


# key -> Rule. Keys are as the user writes them: SFTConfig/ModelConfig keys, `fora eval`/`fora report` flags (with
# dashes), and the `ablation: eval:` keys.
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
_OPTIMIZER_KEYS = (
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
    *_OPTIMIZER_KEYS,
    "label_smoothing_factor",
    "logging_steps",
    "save_steps",
    "eval_steps",
    "save_total_limit",
    "dataloader_num_workers",
    "dataset_num_proc",
    "seed",
)
NUMBER_KEYS_OF_A_CONFIG = LORA_KEYS + TRAINING_KEYS
# An Axolotl YAML's keys, checked when it enables the plugin (unset = None = Axolotl's default).
AXOLOTL_KEYS = LORA_KEYS + (
    "micro_batch_size",
    "gradient_accumulation_steps",
    "sequence_len",
    "num_epochs",
    "max_steps",
    *_OPTIMIZER_KEYS,
    "logging_steps",
    "save_steps",
    "eval_steps",
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


def check_training_arguments(training_args: Any, model_args: Any) -> None:
    """The numbers of a ``fora train`` config: LoRA (ModelConfig) and training (SFTConfig) keys."""
    check_numbers(model_args, LORA_KEYS)
    check_numbers(training_args, TRAINING_KEYS)


def check_lora_arguments(model_args: Any) -> None:
    """The LoRA keys' rules across keys (ModelConfig), checked before PEFT meets them on the loaded model."""
    if not model_args.lora_target_modules and model_args.lora_target_modules is not None:
        if not model_args.lora_target_parameters:
            refuse(
                "lora_target_modules",
                model_args.lora_target_modules,
                "name at least one module to adapt (or fused expert parameters in lora_target_parameters)",
                "E.g. lora_target_modules: [q_proj, k_proj, v_proj, up_proj, down_proj], or leave it unset for PEFT's "
                "default of the architecture.",
            )
    if model_args.lora_target_parameters and model_args.lora_dropout:
        refuse(
            "lora_dropout",
            model_args.lora_dropout,
            "LoRA on lora_target_parameters (fused MoE experts) takes no dropout: PEFT's ParamWrapper refuses "
            "lora_dropout != 0",
            "Set lora_dropout: 0.0.",
        )


def check_eval_arguments(args: Any) -> None:
    """The numbers of ``fora eval``'s flags."""
    for flag in ("--max-examples", "--batch-size", "--max-new-tokens", "--ppl-max-length", "--ppl-stride"):
        check_number(flag, getattr(args, flag[2:].replace("-", "_")))
    check_number("--ppl-max-tokens", args.ppl_max_tokens)
    if args.ppl_stride > args.ppl_max_length:
        refuse(
            "--ppl-stride",
            args.ppl_stride,
            f"the stride must be at most --ppl-max-length ({args.ppl_max_length}), or tokens between windows are "
            "never scored",
            "Use e.g. --ppl-stride 512 with --ppl-max-length 1024.",
        )


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
    refuse(
        key,
        value,
        "give a list",
        f"Write it as a YAML list: `{key.rsplit('.', 1)[-1]}: [{', '.join(map(str, items))}]`.",
    )


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


# ------------------------------------------------------------------------------------------------------- paths
def check_adapter_folder(path: str | os.PathLike, key: str) -> dict[str, Any]:
    """Refuse a LoRA adapter folder whose adapter_config.json disagrees with its weights; returns the config.

    Each module's rank (lora_A's rows) must be the config's ``r`` (or its ``rank_pattern`` entry): a config copied
    from another run reports the wrong scaling and fails in ``load_state_dict``.
    """
    from peft.utils.other import get_pattern_key
    from safetensors import safe_open

    folder = Path(path)
    config_file = folder / ADAPTER_CONFIG
    weights = next((folder / n for n in ADAPTER_WEIGHTS if (folder / n).is_file()), None)
    if not config_file.is_file() or weights is None:
        refuse(
            key,
            str(path),
            f"it is not a PEFT adapter folder: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS[0]}",
            "Give a folder that save_pretrained / fora train wrote.",
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        refuse(key, str(path), f"its {ADAPTER_CONFIG} is not valid JSON ({error})", "Save the adapter again.")
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        refuse(key, str(path), f"it holds a {found} adapter, not LoRA", "Give a LoRA adapter folder.")
    for name in ("r", "lora_alpha"):
        if not (is_real(config.get(name)) and config[name] > 0):
            refuse(f"{key} {ADAPTER_CONFIG} {name}", config.get(name), "use a number > 0", "Save the adapter again.")
    if weights.suffix != ".safetensors":
        return config
    pattern = config.get("rank_pattern") or {}
    wrong = []
    with safe_open(str(weights), framework="pt") as tensors:
        for tensor_key in tensors.keys():
            if ".lora_A." not in tensor_key:
                continue
            rows = tensors.get_slice(tensor_key).get_shape()[0]
            module = tensor_key.split(".lora_A.")[0].removeprefix("base_model.model.")
            expected = pattern.get(get_pattern_key(pattern.keys(), module), config["r"])
            if rows != expected:
                wrong.append((module, rows, expected))
    if wrong:
        module, rows, expected = wrong[0]
        refuse(
            f"{key} {ADAPTER_CONFIG} r",
            config["r"],
            f"the weights of {len(wrong)} modules have another rank (e.g. {module}: rank {rows}, the config says "
            f"{expected}), so the config does not belong to these weights",
            f"Put the adapter_config.json that was saved with these weights back (r: {rows}), or save the adapter "
            "again.",
        )
    return config
