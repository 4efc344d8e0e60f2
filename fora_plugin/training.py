"""FoRA on any transformers ``Trainer``: the steps both front ends take on their trainer (FoRASFTTrainer on TRL's, the
Axolotl plugin on Axolotl's), in :func:`prepare_fora_training`; scoring through the trainer's own batches and loss
(:func:`score_on_trainer`); and its optimizer (:func:`fora_optimizer`). The steps that need no trainer are in
:mod:`fora_plugin.wiring`.

May import: backward, config, errors, fisher, fsdp, monitor, optim, selection, wiring, zero.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from peft import LoraConfig
from torch import nn
from transformers import Trainer

from .backward import (
    BackwardStop,
    checkpointing_settings,
    disable_input_require_grads,
    stop_backward_at_lowest_adapted_layer,
)
from .config import FoRAConfig
from .errors import FoRAInputError
from .fisher import FisherScores, fisher_scores
from .fsdp import launched, prepare_fsdp2
from .monitor import DivergenceMonitor
from .optim import FoRAOptimizer, create_fora_optimizer, default_cuda_graph
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
    ZeroFoRAOptimizer,
    build_zero3_fora_optimizer,
    build_zero_fora_optimizer,
    deepspeed_zero_stage,
    gathered_parameters,
    prepare_deepspeed,
    zero3_scoring_engine,
)


__all__ = ["FoRATraining", "checkpoint_as_in_training", "fora_optimizer", "prepare_fora_training", "score_on_trainer"]

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

    Two private members of the trainer are used, each for want of a public one: ``_prepare_inputs``, which readies a
    batch as ``training_step`` does (onto the device, and under DeepSpeed into its input dtype); and the state that
    TRL's ``compute_loss`` appends to on every call (``_metrics``, ``_total_train_tokens``: no switch turns that off),
    copied before scoring and put back after, since scoring batches are not training.
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
    ``max_grad_norm`` (the :class:`~fora_plugin.zero.ZeroStiefelCallback` that
    :func:`~fora_plugin.zero.prepare_deepspeed` adds turns DeepSpeed's own clipping, of lora_A alone, off).
    """
    args = trainer.args
    # bf16 adapters step through fp32 masters; under DeepSpeed its fp32 partitions are lora_A's masters.
    build = functools.partial(create_fora_optimizer, master_weights=fora.adapter_dtype == "bfloat16")
    if deepspeed_zero_stage(trainer) == 3 and fora.uses_stiefel:
        build = functools.partial(build_zero3_fora_optimizer, max_grad_norm=args.max_grad_norm)
    elif trainer.is_deepspeed_enabled and fora.uses_stiefel:
        build = functools.partial(
            build_zero_fora_optimizer, max_grad_norm=args.max_grad_norm, sync_period=fora.qr_period
        )
    # DDP and FSDP2 run in a launcher's process group; a DeepSpeed engine is data-parallel however it is launched.
    data_parallel = launched(args) or trainer.is_deepspeed_enabled
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
        cuda_graph=default_cuda_graph(fora.cuda_graph, data_parallel=data_parallel),
        decay_parameter_names=trainer.get_decay_parameter_names(model),
        fused=True if args.optim == "adamw_torch_fused" else None,
        # The mode decides: a mode without Stiefel lora_B steps them by AdamW even where they carry the mark.
        **({} if fora.uses_stiefel else {"stiefel_params": ()}),
    )


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

    1. the DeepSpeed checks and ZeRO-1/2 Stiefel callback (:func:`fora_plugin.zero.prepare_deepspeed`), the FSDP2
       ones if ``fsdp2`` (:func:`fora_plugin.fsdp.prepare_fsdp2`);
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


def _target_names(config: LoraConfig | None) -> list[str] | None:
    if config is None or isinstance(config.target_modules, str):
        return None
    return list(config.target_modules)
