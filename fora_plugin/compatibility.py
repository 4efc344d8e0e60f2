"""What FoRA cannot be combined with: LoRA settings, optimizers and learning rates, one rule each.

Both front ends ask the same questions of different keys: ``FoRASFTTrainer`` of a ``LoraConfig`` and
``TrainingArguments`` (``LoraConfig.use_dora``, ``optim``), the Axolotl plugin of its YAML (``peft_use_dora``,
``optimizer``). Each rule is written once here and takes the key names and the fix in the caller's words, so the two
cannot drift apart.

May import: errors, validation, config.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch

from .config import FoRAConfig
from .errors import FoRAInputError
from .validation import check_float


__all__ = [
    "ADAMW_OPTIMS",
    "BASE_PRESERVING_INITS",
    "check_dora",
    "check_init_lora_weights",
    "check_layers_unset",
    "check_learning_rate",
    "check_cuda_graph",
    "check_liger",
    "check_optimizer",
]

# transformers.Trainer's default optimizers, which FoRA's optimizer replaces with the same AdamW maths.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# PEFT 0.21's init_lora_weights that leave the base weights as they are. FoRA scores the base model and then rebuilds
# the adapter on the chosen layers with the same LoraConfig, so the init runs on a base it must not have changed.
BASE_PRESERVING_INITS = (True, False, "gaussian", "orthogonal")
# The others, and why FoRA cannot take them. pissa (and pissa_niter_N), olora, corda, loftq and lora_ga subtract the
# initial adapter from the base weights (W <- W - s·BA) when the model is wrapped.
_BASE_CHANGING_INITS = {
    "pissa": "subtracts",
    "olora": "subtracts",
    "corda": "subtracts",
    "loftq": "subtracts",
    "lora_ga": "subtracts",
    "eva": "data",
    "mica": "frozen",
}
_INIT_REASONS = {
    "subtracts": "it subtracts the initial adapter from the base weights when the model is wrapped, and FoRA "
    "would score that residual model and then rebuild the adapter on the chosen layers over a base that lost it",
    "data": "its data-driven initialisation runs on the wrapped model, and FoRA rebuilds the adapter on the chosen "
    "layers afterwards",
    "frozen": "it freezes lora_B, which FoRA trains",
}


def check_init_lora_weights(
    value: Any, fora: FoRAConfig, name: str = "LoraConfig.init_lora_weights", mode_name: str = "mode"
) -> None:
    """Refuse a LoRA initialisation FoRA cannot rebuild on the chosen layers (see ``BASE_PRESERVING_INITS``).

    Call it before the model is wrapped: once PiSSA-like inits have run, the base weights are already changed.
    """
    if fora.mode == "lora" or any(
        value is ok or (isinstance(value, str) and value == ok) for ok in BASE_PRESERVING_INITS
    ):
        return
    kind = _BASE_CHANGING_INITS.get(value.split("_niter_")[0] if isinstance(value, str) else None)
    reason = _INIT_REASONS[kind] if kind else "it is not one of PEFT 0.21's initialisations FoRA knows"
    raise FoRAInputError(
        f"{name}={value!r} cannot be combined with {mode_name}={fora.mode!r}: {reason}. Use one of "
        f"{BASE_PRESERVING_INITS} (they leave the base weights untouched), or {mode_name}='lora' for {value!r} on "
        "every layer."
    )


def check_learning_rate(value: Any, name: str = "learning_rate") -> None:
    """Refuse a learning rate that is not a finite number >= 0: a NaN or inf rate turns every adapter weight NaN."""
    check_float(name, value, lambda x: x >= 0, "a finite float >= 0 (the paper uses 2e-4)")


def check_optimizer(value: Any, key: str) -> None:
    """Refuse a trainer optimizer other than AdamW: FoRA's own optimizer replaces it (``key``: the front end's name,
    ``optim`` or ``optimizer``)."""
    value = getattr(value, "value", value)  # an OptimizerNames enum once TrainingArguments parsed it
    if value not in ADAMW_OPTIMS:
        raise FoRAInputError(
            f"{key}={value!r} cannot be combined with FoRA, whose optimizer is AdamW on lora_A plus Cayley-Adam on "
            f"lora_B: use {key} in {ADAMW_OPTIMS}."
        )


def check_layers_unset(settings: Mapping[str, Any], fix: str) -> None:
    """Refuse LoRA settings that choose the layers (``layers_to_transform``, ``layers_pattern``): FoRA chooses them.
    ``settings``: key -> value in the front end's names; ``fix``: how to unset them there."""
    given = {key: value for key, value in settings.items() if value is not None}
    if given:
        keys = ", ".join(f"{key}={value!r}" for key, value in given.items())
        raise FoRAInputError(f"{keys} {'is' if len(given) == 1 else 'are'} set, but FoRA chooses the layers: {fix}")


def check_dora(use_dora: Any, fora: FoRAConfig, key: str, mode_key: str, fix: str) -> None:
    """Refuse DoRA with a Stiefel mode: its magnitude vector rescales lora_B's columns, which must stay orthonormal."""
    if fora.uses_stiefel and use_dora:
        raise FoRAInputError(
            f"{key}=True cannot be combined with {mode_key}={fora.mode!r}: DoRA's magnitude rescales lora_B's "
            f"columns, which must stay orthonormal. {fix}"
        )


def check_liger(requested: Any, key: str, *, cpu: bool = False) -> None:
    """Refuse Liger's kernels where they cannot run: without the ``liger-kernel`` package, or without a CUDA GPU for
    the run (``cpu``: the run is told to use the CPU). Liger's RMSNorm, SwiGLU and RoPE are Triton kernels for GPUs:
    without this, transformers or Axolotl would stop later, after loading the model, with a traceback."""
    if not requested:
        return
    if importlib.util.find_spec("liger_kernel") is None:
        problem = "the liger-kernel package is not installed"
    elif cpu or not torch.cuda.is_available():
        problem = "this run has no CUDA GPU (Liger's kernels are Triton kernels for GPUs)"
    else:
        return
    raise FoRAInputError(
        f"{key}=True cannot run here: {problem}. Set {key} to false (FoRA trains the same without Liger's kernels, "
        "only slower), or run on a CUDA GPU with `pip install liger-kernel`."
    )


def check_cuda_graph(requested: Any, key: str, *, cpu: bool = False, sharded: bool = False) -> None:
    """Refuse Cayley-Adam's captured step (``FoRAConfig.cuda_graph``) where it cannot be had, before anything loads:
    without a CUDA GPU for the run (``cpu``: the run is told to use the CPU), or under FSDP2 (``sharded``), whose
    row-sharded lora_B step with an all-reduce a graph would have to replay in lockstep with every rank."""
    if requested is not True:
        return
    if cpu or not torch.cuda.is_available():
        problem = "this run has no CUDA GPU (a CUDA graph is captured on one)"
    elif sharded:
        problem = "FSDP2 shards every lora_B by rows, and their step all-reduces (it stays eager)"
    else:
        return
    raise FoRAInputError(f"{key}=True cannot be used here: {problem}. Leave {key} unset: Cayley-Adam steps eagerly.")
