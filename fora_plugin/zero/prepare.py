"""FoRA's part of a transformers ``Trainer`` under DeepSpeed, as :mod:`fora_plugin.fsdp` is under FSDP2: the checks
and set-up before scoring (:func:`prepare_deepspeed`) and the callback that binds FoRA's ZeRO client optimizer to the
engine's and keeps its Cayley-Adam state in checkpoints (:class:`ZeroStiefelCallback`).

May import: checkpoints, config, errors, zero.checks, zero.client.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from transformers import Trainer, TrainerCallback

from ..checkpoints import STIEFEL_STATE_FILE, checkpoint_folder
from ..config import FoRAConfig
from ..errors import FoRAInputError, FoRAInputTypeError
from .checks import check_deepspeed_config
from .client import ZeroClientOptimizer, find_zero_client


__all__ = ["ZeroStiefelCallback", "prepare_deepspeed"]


def prepare_deepspeed(trainer: Trainer, fora: FoRAConfig, resume_checkpoint: Callable[[], str | None]) -> None:
    """Check ``trainer``'s DeepSpeed config for FoRA and set up the Stiefel ``lora_B`` beside ZeRO-1/2.

    Call it before scoring. Refuses what would silently turn FoRA into something else
    (:func:`fora_plugin.zero.check_deepspeed_config`), puts the model on the trainer's device, and adds the
    :class:`ZeroStiefelCallback`. ``resume_checkpoint`` gives the checkpoint training resumes from, if any.
    """
    if not trainer.is_deepspeed_enabled or fora.mode == "lora":
        return
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config  # HF filled its "auto" values
    check_deepspeed_config(config, fora, name="the DeepSpeed config")
    model = trainer.model
    if not getattr(model, "is_loaded_in_4bit", False) and not getattr(model, "is_loaded_in_8bit", False):
        # Under DeepSpeed neither HF nor TRL places the model (DeepSpeed does, at initialize), but the scoring
        # batches are already on the device; ZeRO-1/2 keeps the whole model on every rank anyway. bitsandbytes
        # placed a k-bit model when loading it.
        model.to(trainer.args.device)
    if fora.uses_stiefel:
        trainer.add_callback(ZeroStiefelCallback(trainer, resume_checkpoint))


class ZeroStiefelCallback(TrainerCallback):
    """Under DeepSpeed: binds FoRA's client optimizer to the engine's (which turns DeepSpeed's own clipping off), and
    keeps its Cayley-Adam state in checkpoints.

    DeepSpeed's checkpoint holds the partitioned lora_A state only; the Cayley-Adam state (moments, fp32 masters)
    goes to ``STIEFEL_STATE_FILE`` in each checkpoint folder and comes back on resume.
    """

    def __init__(self, trainer: Trainer, resume_checkpoint: Callable[[], str | None]) -> None:
        self.trainer = trainer
        self.resume_checkpoint = resume_checkpoint

    def _client(self) -> ZeroClientOptimizer:
        engine_optimizer = self.trainer.model_wrapped.optimizer
        client = find_zero_client(engine_optimizer)
        if client is None:
            inner = getattr(engine_optimizer, "optimizer", None)
            raise FoRAInputTypeError(
                f"DeepSpeed's optimizer wraps a {type(inner).__name__}, not FoRA's ZeroFoRAOptimizer: something "
                "replaced FoRA's optimizer (a DeepSpeed `optimizer` block, or offload with "
                "zero_force_ds_cpu_optimizer true)."
            )
        return client

    def on_train_begin(self, args, state, control, **kwargs):
        client = self._client()
        client.bind(self.trainer.model_wrapped.optimizer)
        checkpoint = self.resume_checkpoint()
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STIEFEL_STATE_FILE)
        if not os.path.isfile(path):
            raise FoRAInputError(
                f"Resuming from {checkpoint} under DeepSpeed, but it has no {STIEFEL_STATE_FILE} (the Cayley-Adam "
                "state of the Stiefel lora_B): it was not saved by FoRA under DeepSpeed. Resume it without "
                "DeepSpeed, or start a new run."
            )
        device = client.stiefel_parameters[0].device
        client.load_stiefel_state_dict(torch.load(path, map_location=device, weights_only=True))

    def on_save(self, args, state, control, **kwargs):
        if args.should_save:  # the same state on every rank; saved where HF saves (one process, or each node's)
            torch.save(self._client().stiefel_state_dict(), checkpoint_folder(args, state) / STIEFEL_STATE_FILE)
