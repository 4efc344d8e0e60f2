"""What a launched run needs to know about DeepSpeed: the ZeRO stage of an HF trainer's config, and joining DeepSpeed's
comm layer to the launcher's process group before a model loads (:func:`join_deepspeed_process_group`).

May import: errors, zero.deepspeed_internals.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from ..errors import FoRAInputError
from .deepspeed_internals import init_deepspeed_comm


__all__ = ["deepspeed_zero_stage", "join_deepspeed_process_group"]


def deepspeed_zero_stage(trainer: Any) -> int:
    """The ZeRO stage of an HF trainer's DeepSpeed config (``zero_optimization.stage``); 0 without DeepSpeed."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return 0
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def join_deepspeed_process_group(args: Any) -> None:
    """Before a model loads under DeepSpeed: DeepSpeed's comm layer joins the process group the launcher's ranks
    already share, so that ``zero.Init`` (HF's ``from_pretrained`` under ZeRO-3) counts the ranks HF counts.

    On GPUs accelerate initialises DeepSpeed's comm layer itself. On CPU ranks (``use_cpu``) it sets up
    ``torch.distributed`` alone, and ``zero.Init`` then reads a world size of 1 while HF filled the batch sizes for
    all ranks: "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size". A launch
    that HF does not count as distributed at all (a CPU-only machine without ``use_cpu``: HF sees one process while
    the launcher started several) is refused by name: each rank would train the whole batch on its own.
    """
    if not getattr(args, "deepspeed", None):
        return
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    world = args.world_size  # sets up accelerate's process state (and torch.distributed under a launcher)
    if launched > 1 and world == 1:
        name = f"deepspeed={args.deepspeed!r}:" if isinstance(args.deepspeed, str) else "the deepspeed config:"
        raise FoRAInputError(
            f"{name} the launcher started WORLD_SIZE={launched} processes, but the training "
            f"arguments count world_size={world} (use_cpu={args.use_cpu}; accelerate counts the ranks of a "
            "machine without a GPU only with use_cpu true). Set use_cpu true on a CPU-only machine, or launch on "
            "GPUs."
        )
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    init_deepspeed_comm()
