"""FoRA on a transformers ``Trainer``: scoring through its batches and loss, its optimizer; and FoRASFTTrainer.

:func:`score_on_trainer` and :func:`fora_optimizer` work on any ``transformers.Trainer``: FoRASFTTrainer calls them,
and so does the Axolotl plugin on Axolotl's trainer. The steps that need no trainer are in :mod:`fora_plugin.wiring`.

FoRASFTTrainer first lets SFTTrainer do all of its work, LoRA wrap included (dataset processing, completion/assistant
masks, packing, collator, loss, a k-bit base's adapter dtype), then scores the base model (adapters disabled) on
batches of its own train dataloader through its own ``compute_loss``, then moves the adapter onto the chosen layers
only. Under DeepSpeed ZeRO-1/2 the Stiefel ``lora_B`` are stepped beside the partition (:mod:`fora_plugin.zero`).
Overridden, and why:

- ``__init__``: the selection and the re-adapt described above, and the DeepSpeed checks.
- ``create_optimizer``: the single AdamW + Cayley-Adam optimizer (``build_fora_optimizer``; under DeepSpeed its
  ZeRO client form).
- ``log``: adds the largest ‖BᵀB − I‖ and the mean effective rank of ΔW to every log, and the selection once.
- ``train``: refuses to resume a checkpoint trained on other layers; notes the checkpoint for the Cayley state.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable

import torch
from peft import LoraConfig, PeftModel
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import SFTTrainer

from .config import FoRAConfig
from .fisher import FisherScores, fisher_scores
from .optim import FoRAOptimizer, build_fora_optimizer
from .wiring import (
    SCORES_FILE,
    SCORES_PLOT,
    FoRALogs,
    FoRASelection,
    SaveSelectionCallback,
    checkpoint_folder,
    choose_layers,
    format_selection_table,
    readapt_lora,
    write_selection,
)
from .zero import (
    STIEFEL_STATE_FILE,
    ZeroFoRAOptimizer,
    build_zero_fora_optimizer,
    check_deepspeed_config,
    find_zero_client,
)


__all__ = [
    "ADAMW_OPTIMS",
    "SCORES_FILE",
    "SCORES_PLOT",
    "FoRASFTTrainer",
    "FoRASelection",
    "ZeroStiefelCallback",
    "fora_optimizer",
    "format_selection_table",
    "prepare_deepspeed",
    "score_on_trainer",
]

# transformers.Trainer's default optimizers, which FoRA's optimizer replaces with the same AdamW maths.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# What a compute_loss call changes besides returning the loss: TRL's training metrics and token count. (Axolotl's
# token counters start again with the TrainerState that train() creates.)
_LOSS_SIDE_EFFECTS = ("_metrics", "_total_train_tokens")


def score_on_trainer(
    trainer: Trainer, model: nn.Module, fora: FoRAConfig, peft_config: LoraConfig | None = None
) -> FisherScores:
    """Fisher scores of ``model`` on ``trainer``'s own train batches through its ``compute_loss``.

    The batches are the ones training will see (dataset processing, completion masks, packing, collator), and the
    loss is the training loss. ``model`` is the base model, or a PeftModel whose adapters are off while it is scored.
    """
    targets = _target_names(peft_config) if fora.fisher_params == "targets" else None
    saved = {name: copy.deepcopy(getattr(trainer, name)) for name in _LOSS_SIDE_EFFECTS if hasattr(trainer, name)}

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        return trainer.compute_loss(model, trainer._prepare_inputs(batch))

    try:
        return fisher_scores(
            model,
            trainer.get_train_dataloader(),
            fora.fisher_batches,
            loss_fn=loss_fn,
            fisher_params=fora.fisher_params,
            target_modules=targets,
            autocast=trainer.compute_loss_context_manager,
            progress=trainer.is_local_process_zero() and not trainer.args.disable_tqdm,
        )
    finally:
        # Scoring batches are not training.
        for name, value in saved.items():
            setattr(trainer, name, value)


def fora_optimizer(trainer: Trainer, model: nn.Module, fora: FoRAConfig) -> FoRAOptimizer | ZeroFoRAOptimizer:
    """The FoRA optimizer for ``model`` under ``trainer``'s arguments (lr, weight decay, betas, eps, decay rule).

    Under DeepSpeed the Stiefel modes get the ZeRO client optimizer, which clips lora_A and lora_B by one norm at
    ``max_grad_norm`` (the :class:`ZeroStiefelCallback` that :func:`prepare_deepspeed` adds turns DeepSpeed's own
    clipping, of lora_A alone, off).
    """
    args = trainer.args
    build = build_fora_optimizer
    if trainer.is_deepspeed_enabled and fora.uses_stiefel:
        build = functools.partial(
            build_zero_fora_optimizer, max_grad_norm=args.max_grad_norm, sync_period=fora.qr_period
        )
    return build(
        model,
        lr=args.learning_rate,
        lr_stiefel=fora.lr_stiefel,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        qr_period=fora.qr_period,
        cayley_solver=fora.cayley_solver,
        cayley_iters=fora.cayley_iters,
        decay_parameter_names=trainer.get_decay_parameter_names(model),
        fused=True if args.optim == "adamw_torch_fused" else None,
    )


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

    def _client(self) -> ZeroFoRAOptimizer:
        engine_optimizer = self.trainer.model_wrapped.optimizer
        client = find_zero_client(engine_optimizer)
        if client is None:
            inner = getattr(engine_optimizer, "optimizer", None)
            raise TypeError(
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
            raise ValueError(
                f"Resuming from {checkpoint} under DeepSpeed, but it has no {STIEFEL_STATE_FILE} (the Cayley-Adam "
                "state of the Stiefel lora_B): it was not saved by FoRA under DeepSpeed. Resume it without "
                "DeepSpeed, or start a new run."
            )
        device = client.stiefel_parameters[0].device
        client.load_stiefel_state_dict(torch.load(path, map_location=device, weights_only=True))

    def on_save(self, args, state, control, **kwargs):
        if args.should_save:  # the same state on every rank; saved where HF saves (one process, or each node's)
            torch.save(self._client().stiefel_state_dict(), checkpoint_folder(args, state) / STIEFEL_STATE_FILE)


class FoRASFTTrainer(SFTTrainer):
    """``trl.SFTTrainer`` that trains FoRA: LoRA on the Fisher-selected layers, Stiefel ``lora_B`` by Cayley-Adam.

    Args are SFTTrainer's, plus:
        peft_config: a ``peft.LoraConfig`` (rank, alpha, dropout, target modules). Required: FoRA is a LoRA method.
            Its ``layers_to_transform`` must be unset: FoRA chooses the layers.
        fora_config: a :class:`FoRAConfig` (mode, layer budget, Fisher batches, Stiefel settings). Default:
            ``FoRAConfig()``, the paper's FoRA with K = L/2.

    With ``mode="lora"`` the trainer is exactly SFTTrainer with the LoraConfig (the ablation's baseline).
    """

    def __init__(
        self,
        model,
        args=None,
        *pos,
        peft_config: LoraConfig | None = None,
        fora_config: FoRAConfig | None = None,
        **kwargs,
    ) -> None:
        self.fora_config = fora_config = fora_config or FoRAConfig()
        if not isinstance(fora_config, FoRAConfig):
            raise TypeError(f"fora_config must be a FoRAConfig, got {type(fora_config).__name__}.")
        if isinstance(model, PeftModel):
            raise ValueError(
                "FoRASFTTrainer got a PeftModel: FoRA decides which layers carry LoRA, so it needs the base model. "
                "Pass the base model with peft_config=LoraConfig(...); if the PeftModel holds trained weights to "
                "keep, merge_and_unload() it first."
            )
        if not isinstance(peft_config, LoraConfig):
            raise TypeError(
                f"FoRASFTTrainer needs peft_config=LoraConfig(...), got {type(peft_config).__name__}: FoRA is a LoRA "
                "method (its rank, alpha, dropout and target modules come from the LoraConfig)."
            )
        self.fora_selection: FoRASelection | None = None
        self._fora_logs: FoRALogs | None = None
        if fora_config.mode == "lora":
            super().__init__(model, args, *pos, peft_config=peft_config, **kwargs)
            return
        _check_lora_config(peft_config, fora_config)
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise ValueError(
                "FoRASFTTrainer builds its own optimizer (AdamW for lora_A, Cayley-Adam for lora_B): "
                "leave optimizers=(None, None) and set learning_rate / fora lr_stiefel instead."
            )
        # SFTTrainer wraps every layer the LoraConfig targets, as it would for LoRA (k-bit bases included); once the
        # layers are chosen the adapter moves onto those only. The caller's LoraConfig is left as it was.
        super().__init__(model, args, *pos, peft_config=copy.deepcopy(peft_config), **kwargs)
        optim = getattr(self.args.optim, "value", self.args.optim)  # an OptimizerNames enum after __post_init__
        if optim not in ADAMW_OPTIMS:
            raise ValueError(
                f"optim={optim!r} cannot be combined with FoRA, whose optimizer is AdamW on "
                f"lora_A plus Cayley-Adam on lora_B: use optim in {ADAMW_OPTIMS}."
            )
        self._fora_resume: str | None = None
        prepare_deepspeed(self, fora_config, lambda: self._fora_resume)
        self._fora_seed = fora_config.seed if fora_config.seed is not None else self.args.seed
        selection = choose_layers(
            self.model.get_base_model(),
            fora_config,
            seed=self._fora_seed,
            checkpoint=_resolve_checkpoint(self.args.resume_from_checkpoint, self.args.output_dir),
            score=lambda: self.fora_score(peft_config),
        )
        readapt_lora(self.model, selection, fora_config, self._fora_seed)
        self.fora_selection = selection
        self._fora_logs = FoRALogs(selection)
        self.add_callback(SaveSelectionCallback(selection))
        if self.is_world_process_zero():
            write_selection(selection, self.args.output_dir)

    def fora_score(self, peft_config: LoraConfig | None = None) -> FisherScores:
        """Fisher scores of the base model (LoRA adapters disabled) on the trainer's own batches and loss."""
        return score_on_trainer(self, self.model, self.fora_config, peft_config)

    def create_optimizer(self, model=None):
        if self.fora_config.mode == "lora":
            return super().create_optimizer(model)
        if self.optimizer is None:
            self.optimizer = fora_optimizer(self, self.model, self.fora_config)
        return self.optimizer

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._fora_logs is not None:
            logs.update(self._fora_logs(self.model, self.optimizer))
        super().log(logs, start_time)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        checkpoint = _resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        self._fora_resume = checkpoint
        if checkpoint is not None and self.fora_selection is not None and self.fora_config.selects_layers:
            saved = FoRASelection.read(checkpoint)
            if saved["chosen_layers"] != self.fora_selection.chosen:
                raise ValueError(
                    f"Checkpoint {checkpoint} was trained with LoRA on layers {saved['chosen_layers']}, but this "
                    f"trainer adapts layers {self.fora_selection.chosen}. Build the trainer with "
                    f"args.resume_from_checkpoint={str(checkpoint)!r} so it reuses the checkpoint's selection."
                )
        return super().train(resume_from_checkpoint, *args, **kwargs)


def _check_lora_config(config: LoraConfig, fora: FoRAConfig) -> None:
    if config.layers_to_transform is not None or config.layers_pattern is not None:
        raise ValueError(
            f"LoraConfig.layers_to_transform={config.layers_to_transform!r} / layers_pattern="
            f"{config.layers_pattern!r} are set, but FoRA chooses the layers: unset them and use FoRAConfig("
            "layers=[...]) for a fixed set."
        )
    if config.target_modules is None or config.target_modules == "all-linear":
        raise ValueError(
            f"LoraConfig.target_modules={config.target_modules!r}: name the target linears explicitly, e.g. "
            "['q_proj', 'k_proj', 'v_proj', 'up_proj', 'down_proj'] (the paper's five)."
        )
    if fora.uses_stiefel and config.use_dora:
        raise ValueError(
            f"LoraConfig.use_dora=True cannot be combined with mode={fora.mode!r}: DoRA's magnitude "
            "rescales lora_B's columns. Use use_dora=False, or mode='fg-lora'."
        )


def _target_names(config: LoraConfig | None) -> list[str] | None:
    if config is None or isinstance(config.target_modules, str):
        return None
    return list(config.target_modules)


def _resolve_checkpoint(value: str | bool | None, output_dir: str) -> str | None:
    if value in (None, False, "", "false", "False"):
        return None
    if value in (True, "true", "True"):
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(f"resume_from_checkpoint=True but {output_dir} holds no checkpoint.")
        return last
    return str(value)
