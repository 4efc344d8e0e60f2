"""A checkpoint a run resumes from: its saved LoRA adapter checked against the run's LoRA settings up front.

May import: errors, files, targets, validation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import refuse
from .files import read_json
from .targets import fused_target_names
from .validation import ADAPTER_CONFIG


__all__ = ["check_resumed_adapter"]


def _leaves(targets: Any) -> set[str] | None:
    """The module names a list of targets ends in; None for what cannot be compared without the model (unset: PEFT's
    default for the architecture; a regex or ``all-linear``)."""
    if not isinstance(targets, list | tuple | set):
        return None
    return {str(t).rsplit(".", 1)[-1] for t in targets}


def check_resumed_adapter(
    checkpoint: str, model_args: Any, model_type: str | None = None, key: str = "resume_from_checkpoint"
) -> None:
    """Refuse resuming ``checkpoint`` with other LoRA settings than it was trained with, before the model loads.

    The resumed run builds its adapter from the config, then loads the checkpoint's weights into it: another
    ``lora_r`` fails on their shapes after the model loaded, other targets leave modules at their initial weights
    (PEFT loads what matches), another ``lora_alpha``, ``use_dora`` or ``use_rslora`` trains on at another scaling.
    Read from the checkpoint's adapter_config.json (``model_type``: the model's, for PEFT's renaming of fused MoE
    expert targets); a checkpoint without one is left to the trainer.
    """
    config_file = Path(checkpoint, ADAPTER_CONFIG)
    if not config_file.is_file():
        return
    saved = read_json(config_file, key=f"{key} {ADAPTER_CONFIG}")
    if not isinstance(saved, dict):
        return
    pairs = [
        ("lora_r", model_args.lora_r, saved.get("r")),
        ("lora_alpha", model_args.lora_alpha, saved.get("lora_alpha")),
        ("use_dora", bool(model_args.use_dora), bool(saved.get("use_dora"))),
        ("use_rslora", bool(model_args.use_rslora), bool(saved.get("use_rslora"))),
    ]
    renamed = {old: new for old, (new, _) in fused_target_names(model_type).items()}
    given = [_leaves(model_args.lora_target_modules), _leaves(model_args.lora_target_parameters or [])]
    kept = [_leaves(saved.get("target_modules")), _leaves(saved.get("target_parameters") or [])]
    if None not in given and None not in kept:
        # PEFT saves fused expert targets under their fused names (gate_proj + up_proj -> gate_up_proj).
        given_names = sorted({renamed.get(n, n) for n in given[0] | given[1]})
        kept_names = sorted({renamed.get(n, n) for n in kept[0] | kept[1]})
        pairs.append(("lora_target_modules", given_names, kept_names))
    for name, value, trained in pairs:
        if trained is not None and value != trained:
            refuse(
                name,
                value,
                f"checkpoint {checkpoint} was trained with {name} {trained} (its {ADAPTER_CONFIG}), and a resumed run "
                "keeps its adapter",
                f"Set {name}: {trained} to resume it, or drop resume_from_checkpoint to start a new run with {name} "
                f"{value}.",
            )
