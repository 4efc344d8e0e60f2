"""FoRA on a transformers ``Trainer``: scoring through its batches and loss, its optimizer; and FoRASFTTrainer.

:func:`score_on_trainer` and :func:`fora_optimizer` work on any ``transformers.Trainer``: FoRASFTTrainer calls them,
and so does the Axolotl plugin on Axolotl's trainer. The steps that need no trainer are in :mod:`fora_plugin.wiring`.

FoRASFTTrainer first lets SFTTrainer do all of its work without PEFT (dataset processing, completion/assistant
masks, packing, collator, loss), then scores the layers on batches of its own train dataloader through its own
``compute_loss``, then wraps the model with PEFT on the chosen layers only, doing what SFTTrainer does at its PEFT
step. Overridden, and why:

- ``__init__``: the selection and the PEFT wrap described above.
- ``create_optimizer``: the single AdamW + Cayley-Adam optimizer (``build_fora_optimizer``).
- ``log``: adds the largest ‖BᵀB − I‖ and the mean effective rank of ΔW to every log, and the selection once.
- ``train``: refuses to resume a checkpoint trained on other layers.
"""

from __future__ import annotations

import copy
import os

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import Trainer
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
    choose_layers,
    format_selection_table,
    init_fora_adapters,
    restrict_lora_config,
    write_selection,
)


__all__ = [
    "ADAMW_OPTIMS",
    "SCORES_FILE",
    "SCORES_PLOT",
    "FoRASFTTrainer",
    "FoRASelection",
    "fora_optimizer",
    "format_selection_table",
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


def fora_optimizer(trainer: Trainer, model: nn.Module, fora: FoRAConfig) -> FoRAOptimizer:
    """The FoRA optimizer for ``model`` under ``trainer``'s arguments (lr, weight decay, betas, eps, decay rule)."""
    args = trainer.args
    return build_fora_optimizer(
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
        super().__init__(model, args, *pos, peft_config=None, **kwargs)
        optim = getattr(self.args.optim, "value", self.args.optim)  # an OptimizerNames enum after __post_init__
        if optim not in ADAMW_OPTIMS:
            raise ValueError(
                f"optim={optim!r} cannot be combined with FoRA, whose optimizer is AdamW on "
                f"lora_A plus Cayley-Adam on lora_B: use optim in {ADAMW_OPTIMS}."
            )
        plugin = self.args.deepspeed_plugin
        if plugin is not None and (fora_config.uses_stiefel or plugin.zero_stage == 3):
            raise ValueError(
                f"DeepSpeed ZeRO-{plugin.zero_stage} with mode={fora_config.mode!r} is not supported yet: ZeRO hands "
                "the optimizer flat 1-D slices, so a Cayley step never sees a whole lora_B. Train without "
                "DeepSpeed (plain DDP: accelerate launch), or use mode='fg-lora' with ZeRO-1/2."
            )
        self._fora_seed = fora_config.seed if fora_config.seed is not None else self.args.seed
        selection = choose_layers(
            self.model,
            fora_config,
            seed=self._fora_seed,
            checkpoint=_resolve_checkpoint(self.args.resume_from_checkpoint, self.args.output_dir),
            score=lambda: self.fora_score(peft_config),
        )
        self._fora_wrap(peft_config, selection)
        self.fora_selection = selection
        self._fora_logs = FoRALogs(selection)
        self.add_callback(SaveSelectionCallback(selection))
        if self.is_world_process_zero():
            write_selection(selection, self.args.output_dir)

    def fora_score(self, peft_config: LoraConfig | None = None) -> FisherScores:
        """Fisher scores of the (still unwrapped) model on the trainer's own batches and loss."""
        return score_on_trainer(self, self.model, self.fora_config, peft_config)

    def _fora_wrap(self, peft_config: LoraConfig, selection: FoRASelection) -> None:
        base = self.model
        config = copy.deepcopy(peft_config)
        restrict_lora_config(config, base, selection)
        torch.manual_seed(self._fora_seed)
        model = get_peft_model(base, config)
        if self.args.gradient_checkpointing:
            model.enable_input_require_grads()  # as SFTTrainer does for PEFT + checkpointing
        if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
            for name, param in model.named_parameters():  # SFTTrainer's QLoRA adapter dtype
                if param.requires_grad and "lora_magnitude_vector" not in name:
                    param.data = param.data.to(torch.bfloat16)
        init_fora_adapters(model, selection, self.fora_config, self._fora_seed)
        self.model = self.model_wrapped = model
        self.callback_handler.model = model

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
