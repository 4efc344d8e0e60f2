"""``FoRASFTTrainer``: TRL's ``SFTTrainer`` that trains FoRA, through the steps it shares with the Axolotl plugin
(:mod:`fora_plugin.training`).

May import: backward, checkpoints, compatibility, config, errors, fisher, fsdp, optim, selection, training, wiring,
zero.
"""

from __future__ import annotations

import copy

from peft import LoraConfig, PeftModel
from trl import SFTTrainer

from .backward import BackwardStop
from .checkpoints import check_checkpoint_files, resolve_checkpoint
from .compatibility import (
    check_cuda_graph,
    check_dora,
    check_init_lora_weights,
    check_layers_unset,
    check_learning_rate,
    check_liger,
    check_optimizer,
)
from .config import FoRAConfig
from .errors import FoRAInputError, FoRAInputTypeError
from .fisher import FisherScores
from .fsdp import check_fsdp, fsdp_setting
from .optim import check_lr_scheduler_type
from .selection import FoRASelection
from .training import fora_optimizer, prepare_fora_training, score_on_trainer
from .wiring import FoRALogs, set_input_cast
from .zero import join_deepspeed_process_group


__all__ = ["FoRASFTTrainer"]


class FoRASFTTrainer(SFTTrainer):
    """``trl.SFTTrainer`` that trains FoRA: LoRA on the Fisher-selected layers, Stiefel ``lora_B`` by Cayley-Adam.

    FoRASFTTrainer first lets SFTTrainer do all of its work, LoRA wrap included (dataset processing,
    completion/assistant masks, packing, collator, loss, a k-bit base's adapter dtype), then scores the base model
    (adapters disabled) on batches of its own train dataloader through its own ``compute_loss``, then moves the
    adapter onto the chosen layers only. Under DeepSpeed ZeRO-1/2 the Stiefel ``lora_B`` are stepped beside the
    partition (:mod:`fora_plugin.zero`); under FSDP2 each rank steps its rows of every ``lora_B``
    (:mod:`fora_plugin.fsdp`).

    Overridden, each through ``Trainer``'s public signature, and why:

    - ``__init__``: the selection and the re-adapt described above, and the DeepSpeed and FSDP checks; then the
      backward is made to stop at the lowest adapted layer, with activation checkpointing too
      (:mod:`fora_plugin.backward`: TRL's embeddings hook off, a pre-hook on that layer under reentrant
      checkpointing).
    - ``create_optimizer``: the single AdamW + Cayley-Adam optimizer (:func:`fora_plugin.training.fora_optimizer`;
      under DeepSpeed its ZeRO client form).
    - ``log``: adds the largest ‖BᵀB − I‖ and the mean effective rank of ΔW to every log, and the selection once
      (under FSDP2 from the adapters gathered whole for the log).
    - ``train``: refuses to resume a checkpoint trained on other layers, or one whose state files are truncated;
      notes the checkpoint for the Cayley state.

    Scoring runs the way a training step does (:func:`fora_plugin.training.score_on_trainer`): the activation
    checkpointing and the autocast that ``Trainer.train`` switches on, and, under fp16, a loss scale so that small
    gradients do not underflow.

    Args are SFTTrainer's, plus:
        peft_config: a ``peft.LoraConfig`` (rank, alpha, dropout, target modules). Required: FoRA is a LoRA method.
            Its ``layers_to_transform`` must be unset: FoRA chooses the layers.
        fora_config: a :class:`FoRAConfig` (mode, layer budget, Fisher batches, Stiefel settings). Default:
            ``FoRAConfig()``, the paper's FoRA with K = L/2.

    With ``mode="lora"`` the trainer is exactly SFTTrainer with the LoraConfig (the ablation's baseline), its LoRA
    layers' input cast set by ``input_cast`` as in the other modes (the same numbers).
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
            raise FoRAInputTypeError(f"fora_config must be a FoRAConfig, got {type(fora_config).__name__}.")
        if isinstance(model, PeftModel):
            raise FoRAInputError(
                "FoRASFTTrainer got a PeftModel: FoRA decides which layers carry LoRA, so it needs the base model. "
                "Pass the base model with peft_config=LoraConfig(...); if the PeftModel holds trained weights to "
                "keep, merge_and_unload() it first."
            )
        if not isinstance(peft_config, LoraConfig):
            raise FoRAInputTypeError(
                f"FoRASFTTrainer needs peft_config=LoraConfig(...), got {type(peft_config).__name__}: FoRA is a LoRA "
                "method (its rank, alpha, dropout and target modules come from the LoraConfig)."
            )
        self.fora_selection: FoRASelection | None = None
        self.fora_backward_stop: BackwardStop | None = None
        self._fora_logs: FoRALogs | None = None
        if args is not None:
            check_learning_rate(args.learning_rate)
            check_liger(args.use_liger_kernel, "use_liger_kernel", cpu=args.use_cpu)
            sharded = fsdp_setting(args) is not None
            check_cuda_graph(fora_config.cuda_graph, "cuda_graph", cpu=args.use_cpu, sharded=sharded)
            # Before SFTTrainer loads a model given by name (under ZeRO-3, inside zero.Init).
            join_deepspeed_process_group(args)
        if fora_config.mode == "lora":
            super().__init__(model, args, *pos, peft_config=peft_config, **kwargs)
            set_input_cast(self.model, fora_config.input_cast)  # the same numbers: SFTTrainer's LoRA, one copy less
            return
        _check_lora_config(peft_config, fora_config)
        if args is not None:
            check_fsdp(args, fora_config)
            check_lr_scheduler_type(args.lr_scheduler_type)
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise FoRAInputError(
                "FoRASFTTrainer builds its own optimizer (AdamW for lora_A, Cayley-Adam for lora_B): "
                "leave optimizers=(None, None) and set learning_rate / fora lr_stiefel instead."
            )
        # SFTTrainer wraps every layer the LoraConfig targets, as it would for LoRA (k-bit bases included); once the
        # layers are chosen the adapter moves onto those only. The caller's LoraConfig is left as it was.
        super().__init__(model, args, *pos, peft_config=copy.deepcopy(peft_config), **kwargs)
        check_optimizer(self.args.optim, "optim")
        self._fora_resume: str | None = None
        training = prepare_fora_training(
            self,
            fora_config,
            score=lambda: self.fora_score(peft_config),
            checkpoint=resolve_checkpoint(self.args.resume_from_checkpoint, self.args.output_dir),
            resume_checkpoint=lambda: self._fora_resume,
            fsdp2=check_fsdp(self.args, fora_config) == 2,
        )
        self.fora_selection = training.selection
        self.fora_backward_stop = training.backward_stop
        self._fora_logs = training.logs

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

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        self._fora_resume = checkpoint
        if checkpoint is not None:
            check_checkpoint_files(checkpoint)
        if checkpoint is not None and self.fora_selection is not None and self.fora_config.selects_layers:
            saved = FoRASelection.load(checkpoint)
            if saved.chosen != self.fora_selection.chosen:
                raise FoRAInputError(
                    f"Checkpoint {checkpoint} was trained with LoRA on layers {saved.chosen}, but this "
                    f"trainer adapts layers {self.fora_selection.chosen}. Build the trainer with "
                    f"args.resume_from_checkpoint={str(checkpoint)!r} so it reuses the checkpoint's selection, and "
                    "leave FoRAConfig.layers unset (or equal to those layers)."
                )
        # The resolved folder: Trainer.train reads a string such as "true" (from the command line) as a path.
        return super().train(checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)


# ------------------------------------------------------------------------------------------------------- checks
def _check_lora_config(config: LoraConfig, fora: FoRAConfig) -> None:
    check_layers_unset(
        {
            "LoraConfig.layers_to_transform": config.layers_to_transform,
            "LoraConfig.layers_pattern": config.layers_pattern,
        },
        "unset them and use FoRAConfig(layers=[...]) for a fixed set.",
    )
    if config.target_modules is None or config.target_modules == "all-linear":
        raise FoRAInputError(
            f"LoraConfig.target_modules={config.target_modules!r}: name the target linears explicitly, e.g. "
            "['q_proj', 'k_proj', 'v_proj', 'up_proj', 'down_proj'] (the paper's five)."
        )
    check_dora(config.use_dora, fora, "LoraConfig.use_dora", "mode", "Use use_dora=False, or mode='fg-lora'.")
    check_init_lora_weights(config.init_lora_weights, fora)
