"""FoRA on a transformers ``Trainer``: scoring through its batches and loss, its optimizer; and FoRASFTTrainer.

:func:`score_on_trainer` and :func:`fora_optimizer` work on any ``transformers.Trainer``: FoRASFTTrainer calls them,
and so does the Axolotl plugin on Axolotl's trainer. The steps that need no trainer are in :mod:`fora_plugin.wiring`.

May import: backward, checkpoints, compatibility, config, errors, fisher, fsdp, monitor, optim, selection, wiring,
zero.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
from collections.abc import Callable

import torch
from peft import LoraConfig, PeftModel
from torch import nn
from transformers import Trainer, TrainerCallback
from trl import SFTTrainer

from .backward import (
    BackwardStop,
    checkpointing_settings,
    disable_input_require_grads,
    stop_backward_at_lowest_adapted_layer,
)
from .checkpoints import STIEFEL_STATE_FILE, check_checkpoint_files, checkpoint_folder, resolve_checkpoint
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
from .fisher import FisherScores, fisher_scores
from .fsdp import check_fsdp, fsdp_setting, prepare_fsdp2
from .monitor import DivergenceMonitor
from .optim import FoRAOptimizer, build_fora_optimizer, check_lr_scheduler_type
from .selection import FoRASelection
from .wiring import (
    FoRALogs,
    SaveSelectionCallback,
    choose_layers,
    format_selection_table,
    readapt_lora,
    set_input_cast,
)
from .zero import (
    Zero3FoRAOptimizer,
    ZeroClientOptimizer,
    ZeroFoRAOptimizer,
    build_zero3_fora_optimizer,
    build_zero_fora_optimizer,
    check_deepspeed_config,
    deepspeed_zero_stage,
    find_zero_client,
    gathered_parameters,
    join_deepspeed_process_group,
    zero3_scoring_engine,
)


__all__ = [
    "FoRASFTTrainer",
    "FoRATraining",
    "ZeroStiefelCallback",
    "checkpoint_as_in_training",
    "fora_optimizer",
    "prepare_deepspeed",
    "prepare_fora_training",
    "score_on_trainer",
]

# Loss scales tried in turn while scoring under fp16: GradScaler's initial scale first, lower ones if it overflows.
_FP16_LOSS_SCALES = (2.0**16, 2.0**8, 1.0)
# What a compute_loss call changes besides returning the loss: TRL's training metrics and token count. (Axolotl's
# token counters start again with the TrainerState that train() creates.)
_LOSS_SIDE_EFFECTS = ("_metrics", "_total_train_tokens")


def score_on_trainer(
    trainer: Trainer, model: nn.Module, fora: FoRAConfig, peft_config: LoraConfig | None = None
) -> FisherScores:
    """Fisher scores of ``model`` on ``trainer``'s own train batches through its ``compute_loss``.

    The batches are the ones training will see (dataset processing, completion masks, packing, collator), the loss is
    the training loss, and the passes run as training steps will: activation checkpointing if training has it
    (:func:`checkpoint_as_in_training`), accelerate's mixed-precision autocast around each forward. ``model`` is the
    base model, or a PeftModel whose adapters are off while it is scored.

    Under fp16 (``args.fp16``, or fp16 base weights) the loss is multiplied by a scale before the backward, as a
    GradScaler does, and the squared norms divided by its square: fp16 flushes gradients below 6e-8 to zero, which
    would bias the scores towards the layers with large gradients. The scale starts at GradScaler's 2**16 and is
    lowered if a gradient overflows (non-finite scores), as GradScaler would.
    """
    targets = _target_names(peft_config) if fora.fisher_params == "targets" else None
    # Fused MoE experts that LoRA reaches through target_parameters count in a "targets" score too.
    target_parameters = None
    if fora.fisher_params == "targets" and peft_config is not None:
        target_parameters = list(peft_config.target_parameters or [])
    saved = {name: copy.deepcopy(getattr(trainer, name)) for name in _LOSS_SIDE_EFFECTS if hasattr(trainer, name)}
    scales = _FP16_LOSS_SCALES if _uses_fp16(trainer, model) else (1.0,)
    zero3 = deepspeed_zero_stage(trainer) == 3
    stack = contextlib.ExitStack()
    try:
        checkpoint_as_in_training(trainer)
        if zero3:
            # zero.Init partitioned the weights: ZeRO-3's hooks gather them around each module, and the linears are
            # scored from their inputs and output gradients, so no weight gradient is formed.
            stack.enter_context(
                zero3_scoring_engine(model, trainer.accelerator.state.deepspeed_plugin.deepspeed_config)
            )
        for scale in scales:

            def loss_fn(model: nn.Module, batch: dict, scale: float = scale) -> torch.Tensor:
                return trainer.compute_loss(model, trainer._prepare_inputs(batch)) * scale

            scores = fisher_scores(
                model,
                trainer.get_train_dataloader(),
                fora.fisher_batches,
                loss_fn=loss_fn,
                fisher_params=fora.fisher_params,
                target_modules=targets,
                target_parameters=target_parameters,
                linear_grad="activations" if zero3 else "auto",
                gather=gathered_parameters if zero3 else None,
                # The mixed-precision autocast accelerate's prepare_model puts around every training forward
                # (compute_loss_context_manager is a null context in transformers 5).
                autocast=trainer.accelerator.autocast,
                progress=trainer.is_local_process_zero() and not trainer.args.disable_tqdm,
            )
            if all(math.isfinite(s) for s in scores.scores):
                break
    finally:
        stack.close()
        # Scoring batches are not training.
        for name, value in saved.items():
            setattr(trainer, name, value)
    if not all(math.isfinite(s) for s in scores.scores):
        raise FoRAInputError(
            f"The Fisher scores are not finite ({scores.scores}): the loss or its gradients are NaN/inf on the "
            "scoring batches, so the layers cannot be chosen. Check the model weights and the data (an fp16 model "
            "that overflows: load it in bf16 or fp32)."
        )
    if scale != 1.0:
        scores = dataclasses.replace(scores, scores=[s / scale**2 for s in scores.scores])
        scores.extra["loss_scale"] = scale
    return scores


def checkpoint_as_in_training(trainer: Trainer) -> None:
    """Switch activation checkpointing on now if ``trainer.train()`` will, with the call ``Trainer.train`` makes.

    FoRA scores before ``train()`` (in ``__init__``, or Axolotl's ``post_trainer_create``): without this, scoring keeps
    every layer's activations, far more memory than a checkpointed training step. It is left on, as ``train()``
    would switch it on anyway.
    """
    args, model = trainer.args, trainer.model
    new_names = hasattr(model, "activation_checkpointing_enable")
    enabled, kwargs = checkpointing_settings(args, model)
    active = model.is_activation_checkpointing if new_names else model.is_gradient_checkpointing
    if not enabled or active:
        return
    # The enable call adds an embeddings hook (enable_input_require_grads) and keeps only its handle: the hook TRL or
    # Axolotl added before would stay on with its handle lost, out of reach of disable_input_require_grads.
    disable_input_require_grads(model)
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    if new_names:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
        )
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
        )


def _uses_fp16(trainer: Trainer, model: nn.Module) -> bool:
    return bool(trainer.args.fp16) or any(p.dtype == torch.float16 for p in model.parameters())


def fora_optimizer(
    trainer: Trainer, model: nn.Module, fora: FoRAConfig
) -> FoRAOptimizer | ZeroFoRAOptimizer | Zero3FoRAOptimizer:
    """The FoRA optimizer for ``model`` under ``trainer``'s arguments (lr, weight decay, betas, eps, decay rule).

    Under DeepSpeed the Stiefel modes get the ZeRO client optimizer, which clips lora_A and lora_B by one norm at
    ``max_grad_norm`` (the :class:`ZeroStiefelCallback` that :func:`prepare_deepspeed` adds turns DeepSpeed's own
    clipping, of lora_A alone, off).
    """
    args = trainer.args
    # bf16 adapters step through fp32 masters; under DeepSpeed its fp32 partitions are lora_A's masters.
    build = functools.partial(build_fora_optimizer, master_weights=fora.adapter_dtype == "bfloat16")
    if deepspeed_zero_stage(trainer) == 3 and fora.uses_stiefel:
        build = functools.partial(build_zero3_fora_optimizer, max_grad_norm=args.max_grad_norm)
    elif trainer.is_deepspeed_enabled and fora.uses_stiefel:
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
        stiefel_betas=(fora.stiefel_beta1, fora.stiefel_beta2),
        stiefel_eps=fora.stiefel_eps,
        qr_period=fora.qr_period,
        cayley_solver=fora.cayley_solver,
        cayley_iters=fora.cayley_iters,
        cuda_graph=fora.cuda_graph,
        decay_parameter_names=trainer.get_decay_parameter_names(model),
        fused=True if args.optim == "adamw_torch_fused" else None,
        # The mode decides: a mode without Stiefel lora_B steps them by AdamW even where they carry the mark.
        **({} if fora.uses_stiefel else {"stiefel_params": ()}),
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


@dataclasses.dataclass
class FoRATraining:
    """What :func:`prepare_fora_training` set up on a trainer: the selection, where the backward stops (None: it
    cannot stop early) and the log entries to add at every log."""

    selection: FoRASelection
    backward_stop: BackwardStop | None
    logs: FoRALogs


def prepare_fora_training(
    trainer: Trainer,
    fora: FoRAConfig,
    *,
    score: Callable[[], FisherScores],
    checkpoint: str | None,
    resume_checkpoint: Callable[[], str | None],
    fsdp2: bool,
    autocast_adapter_dtype: bool | None = None,
    reentrant: bool | None = None,
) -> FoRATraining:
    """The steps FoRASFTTrainer and the Axolotl plugin both take once the trainer holds its LoRA-wrapped model and
    before it builds its optimizer, in this order:

    1. the DeepSpeed checks and ZeRO-1/2 Stiefel callback (:func:`prepare_deepspeed`), the FSDP2 ones if ``fsdp2``;
    2. the layers: ``checkpoint``'s saved selection when resuming, else ``score()`` (the base model, adapters off);
    3. the adapter moved onto those layers only, its ``lora_B`` made Stiefel (:func:`readapt_lora`), in the dtype
       ``fora.adapter_dtype`` asks for (``autocast_adapter_dtype``: PEFT's, as the front end's trainer passed it;
       None: as TRL does, False under ZeRO-3), and PEFT's input cast set by ``fora.input_cast``
       (:func:`set_input_cast`);
    4. the backward made to stop at the lowest adapted layer (``reentrant``: see
       :func:`stop_backward_at_lowest_adapted_layer`);
    5. the callbacks that save the selection and watch for divergence, and the selection table printed.

    The optimizer and the log entries are left to the caller: each front end hands them to its trainer its own way.
    """
    prepare_deepspeed(trainer, fora, resume_checkpoint)
    if fsdp2:
        prepare_fsdp2(trainer, fora)
    seed = fora.seed if fora.seed is not None else trainer.args.seed
    model = trainer.model
    selection = choose_layers(model.get_base_model(), fora, seed=seed, checkpoint=checkpoint, score=score)
    if autocast_adapter_dtype is None:
        autocast_adapter_dtype = deepspeed_zero_stage(trainer) != 3
    readapt_lora(model, selection, fora, seed, autocast_adapter_dtype=autocast_adapter_dtype)
    set_input_cast(model, fora.input_cast)
    # With activation checkpointing the backward would run through every layer (TRL's and Axolotl's embeddings
    # hook): it stops at the lowest adapted layer instead, now and at every train().
    backward_stop = stop_backward_at_lowest_adapted_layer(trainer, reentrant=reentrant)
    trainer.add_callback(SaveSelectionCallback(selection))
    trainer.add_callback(DivergenceMonitor())
    if trainer.is_world_process_zero():
        # The files follow when training ends (SaveSelectionCallback): a failed run leaves output_dir as it was.
        print(format_selection_table(selection))
    return FoRATraining(selection, backward_stop, FoRALogs(selection))


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


class FoRASFTTrainer(SFTTrainer):
    """``trl.SFTTrainer`` that trains FoRA: LoRA on the Fisher-selected layers, Stiefel ``lora_B`` by Cayley-Adam.

    FoRASFTTrainer first lets SFTTrainer do all of its work, LoRA wrap included (dataset processing,
    completion/assistant masks, packing, collator, loss, a k-bit base's adapter dtype), then scores the base model
    (adapters disabled) on batches of its own train dataloader through its own ``compute_loss``, then moves the
    adapter onto the chosen layers only. Under DeepSpeed ZeRO-1/2 the Stiefel ``lora_B`` are stepped beside the
    partition (:mod:`fora_plugin.zero`); under FSDP2 each rank steps its rows of every ``lora_B``
    (:mod:`fora_plugin.fsdp`).

    Overridden, and why:

    - ``__init__``: the selection and the re-adapt described above, and the DeepSpeed and FSDP checks; then the
      backward is made to stop at the lowest adapted layer, with activation checkpointing too
      (:mod:`fora_plugin.backward`: TRL's embeddings hook off, a pre-hook on that layer under reentrant
      checkpointing).
    - ``create_optimizer``: the single AdamW + Cayley-Adam optimizer (``build_fora_optimizer``; under DeepSpeed its
      ZeRO client form).
    - ``log``: adds the largest ‖BᵀB − I‖ and the mean effective rank of ΔW to every log, and the selection once
      (under FSDP2 from the adapters gathered whole for the log).
    - ``train``: refuses to resume a checkpoint trained on other layers, or one whose state files are truncated;
      notes the checkpoint for the Cayley state.

    Scoring runs the way a training step does (:func:`score_on_trainer`): the activation checkpointing and the
    autocast that ``Trainer.train`` switches on, and, under fp16, a loss scale so that small gradients do not
    underflow.

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

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
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
        return super().train(checkpoint, *args, **kwargs)


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


def _target_names(config: LoraConfig | None) -> list[str] | None:
    if config is None or isinstance(config.target_modules, str):
        return None
    return list(config.target_modules)
