"""A checkpoint: what ``resume_from_checkpoint`` names, whether it is one, its state files intact, the folder a
callback is saving, and its saved adapter against the run's LoRA settings, all checked before the model loads.

May import: errors, files, targets.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

from peft.utils.constants import CONFIG_NAME
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .errors import FoRAInputError, refuse
from .files import read_json
from .targets import fused_target_names


__all__ = [
    "RESUME_LAST",
    "RESUME_OFF",
    "STIEFEL_STATE_FILE",
    "check_checkpoint",
    "check_checkpoint_files",
    "check_resumed_adapter",
    "checkpoint_folder",
    "resolve_checkpoint",
    "resumes",
]

# The Cayley-Adam state of the Stiefel lora_B under DeepSpeed, which DeepSpeed's own checkpoint does not hold.
STIEFEL_STATE_FILE = "fora_stiefel_optimizer.pt"

# ``resume_from_checkpoint`` values that mean "start afresh" and "the last checkpoint in output_dir": YAML and the
# command line give strings, Python gives bools.
RESUME_OFF = (None, False, "", "false", "False")
RESUME_LAST = (True, "true", "True")


def resumes(value: Any) -> bool:
    """Whether a ``resume_from_checkpoint`` value asks to resume (the last checkpoint, or a given folder)."""
    return value not in RESUME_OFF


def resolve_checkpoint(value: Any, output_dir: str, key: str = "resume_from_checkpoint") -> str | None:
    """The checkpoint folder a ``resume_from_checkpoint`` value names: None to start afresh, the last checkpoint-N of
    ``output_dir`` for ``true`` (refused when there is none), else the value as a path."""
    if not resumes(value):
        return None
    if value not in RESUME_LAST:
        return str(value)
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is None:
        raise FoRAInputError(
            f"{key}=True but output_dir {output_dir} holds no checkpoint (no checkpoint-N folder) to resume: "
            "drop resume_from_checkpoint to start a new run, or give a checkpoint folder's path."
        )
    return last


def check_checkpoint(value: Any, output_dir: str, key: str = "resume_from_checkpoint") -> None:
    """Refuse a ``resume_from_checkpoint`` that is not a checkpoint folder (one holding ``trainer_state.json``).

    ``true`` needs a checkpoint-N folder in ``output_dir``; a path must be such a folder, not, say, a finished
    run's adapter folder (which HF Trainer would fail on after the model loaded and FoRA wrote its selection).
    """
    if value in RESUME_LAST:
        resolve_checkpoint(value, output_dir, key)
        return
    if not resumes(value):
        return
    folder = Path(str(value)).expanduser()
    if not folder.is_dir():
        refuse(key, str(value), "no such folder", "Give a checkpoint-N folder that an earlier run saved.")
    if not (folder / TRAINER_STATE_NAME).is_file():
        inside = get_last_checkpoint(str(folder))
        what = "a saved adapter" if (folder / CONFIG_NAME).is_file() else "a folder"
        fix = (
            f"Resume from {inside} (its last checkpoint), or `true` with output_dir: {folder}."
            if inside
            else "Give a checkpoint-N folder (saved during training with save_strategy steps/epoch), or drop "
            "resume_from_checkpoint to start a new run."
        )
        refuse(key, str(value), f"it is {what}, not a checkpoint: it has no {TRAINER_STATE_NAME}", fix)


def check_checkpoint_files(checkpoint: str | os.PathLike) -> None:
    """Refuse to resume from a checkpoint whose saved optimizer/scheduler/Cayley state is cut short or corrupt.

    A save interrupted by a crash or a full disk leaves a truncated file, which ``torch.load`` reports with a zip
    reader traceback that names neither the file nor the fix. torch saves a zip archive: its directory is at the end
    and every member has a CRC, so reading it through checks the whole file.
    """
    for name in (OPTIMIZER_NAME, SCHEDULER_NAME, STIEFEL_STATE_FILE):
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as file:
            head = file.read(4)
        if head and head != b"PK\x03\x04":
            continue  # torch's legacy (non-zip) format: torch.load checks it
        try:
            with zipfile.ZipFile(path) as archive:
                bad_member = archive.testzip()
            problem = None if bad_member is None else f"member {bad_member} fails its CRC check"
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            problem = f"{type(err).__name__}: {err}"
        if problem is not None:
            raise FoRAInputError(
                f"Cannot resume from {checkpoint}: {path} is truncated or corrupt ({problem}), probably a save cut "
                "short by a crash or a full disk. Resume from an earlier checkpoint (resume_from_checkpoint=<its "
                "folder>, after deleting this one), or start a new run in an empty output_dir."
            )


def checkpoint_folder(args: Any, state: Any) -> Path:
    """The checkpoint folder HF Trainer has just saved, in a callback's ``on_save``."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


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
    config_file = Path(checkpoint, CONFIG_NAME)
    if not config_file.is_file():
        return
    saved = read_json(config_file, key=f"{key} {CONFIG_NAME}")
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
                f"checkpoint {checkpoint} was trained with {name} {trained} (its {CONFIG_NAME}), and a resumed run "
                "keeps its adapter",
                f"Set {name}: {trained} to resume it, or drop resume_from_checkpoint to start a new run with {name} "
                f"{value}.",
            )
