"""The model a plan runs: built from its config.json on the ``meta`` device, LoRA-wrapped as SFTTrainer wraps it, then
on fake tensors (shape, dtype and device, no data), checkpointed and hooked as in training.

PEFT cannot move modules under FakeTensorMode, so the model is wrapped on ``meta`` first; fake tensors, unlike meta
ones, answer the ``.item()`` calls of checkpointing and masking. A 4-bit bitsandbytes base is a float linear marked
quantized for fisher.py (scored from x and g, no weight gradient), with one dequantized weight alive during each of
its matmuls. Also here: the pieces of a Trainer the plan's steps use (its view, batch, autocast, LoRA's AdamW).

May import: backward, models, optim, plan.setup, targets, training, wiring.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from peft import get_peft_model
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from transformers import Trainer
from trl.trainer import sft_trainer

from ..backward import disable_input_require_grads, stop_backward_at_lowest_adapted_layer
from ..models import meta_model
from ..optim import MasterAdamW
from ..targets import find_decoder_layers
from ..training import checkpoint_as_in_training
from ..wiring import choose_layers, set_input_cast
from .setup import PlanSetup, planned_layers


__all__ = [
    "add_sft_loss_head",
    "cast_lora",
    "dequantized_during_matmul",
    "four_bit_linears",
    "lora_optimizer",
    "meta_model_of",
    "plan_selection",
    "planned_autocast",
    "planned_batch",
    "prepare_fake_model",
    "sft_training_loss",
    "trainer_view",
    "wrap_lora",
]


def meta_model_of(setup: PlanSetup) -> nn.Module:
    """``setup``'s base model on the ``meta`` device, in its planned dtype, without a KV cache (training has none)."""
    model = meta_model(setup.model_config, dtype=setup.dtype)
    model.config.use_cache = False
    return model


def wrap_lora(setup: PlanSetup, base: nn.Module):
    """The base wrapped with LoRA on every target layer, as SFTTrainer wraps it (adapter dtype included)."""
    with torch.device("meta"):  # adapters made on the host and moved would cost minutes at MoE scale
        model = get_peft_model(base, copy.deepcopy(setup.lora))
    if setup.four_bit is not None:  # SFTTrainer casts a k-bit base's adapters to bf16 (QLoRA)
        cast_lora(model, torch.bfloat16)
    add_sft_loss_head(model)
    return model


def cast_lora(model: nn.Module, dtype: torch.dtype) -> None:
    """Every trainable parameter of ``model`` (its LoRA weights) in ``dtype``."""
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)


# TRL's add_fused_lm_head, where the installed SFTTrainer computes its loss through it (TRL 1.16: chunked
# log-probabilities, never the (batch, seq, vocab) logits), and the outputs SFTTrainer asks of it; else None.
_ADD_FUSED_LM_HEAD = getattr(sft_trainer, "add_fused_lm_head", None)
_FUSED_LM_HEAD_OUTPUTS = ("log_probs", "entropy", "is_top1")


def add_sft_loss_head(model: nn.Module) -> None:
    """Give a PEFT ``model`` the loss head SFTTrainer gives it: TRL's fused LM head on its base model, where the
    installed TRL has one (nothing otherwise: the model's own loss is SFTTrainer's then)."""
    if _ADD_FUSED_LM_HEAD is not None:
        _ADD_FUSED_LM_HEAD(model.get_base_model(), outputs=_FUSED_LM_HEAD_OUTPUTS)


def sft_training_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of ``batch`` as SFTTrainer.compute_loss forms it, on a model given :func:`add_sft_loss_head`."""
    if _ADD_FUSED_LM_HEAD is None:
        return model(**batch).loss
    return model(**batch, fused_lm_head=True).loss


def plan_selection(setup: PlanSetup, model: nn.Module, planned: list[int] | None = None):
    """The selection of ``planned`` layers (default: :func:`~fora_plugin.plan.setup.planned_layers`) of ``model``
    (a base model), as the trainer would make it: what ``readapt_lora`` takes to restrict LoRA to them."""
    _, layers = find_decoder_layers(model)
    planned = planned_layers(setup, len(layers)) if planned is None else planned
    # A plan reads no scores file and scores nothing: the planned layers stand in for the run's choice.
    fora = dataclasses.replace(setup.fora, layers=list(planned), layer_strategy="fisher", scores_path=None)

    def unused_score():  # fora.layers is set: choose_layers never scores
        raise ValueError("fora plan scores nothing to choose its layers: it plans the layers given to it")

    return choose_layers(model, fora, seed=0, checkpoint=None, score=unused_score)


def _fakeify(model: nn.Module, fake_mode, device: torch.device) -> None:
    """Every parameter and buffer becomes a fake tensor on ``device`` (module by module: no Module._apply)."""
    made: dict[int, torch.Tensor] = {}  # id of the original (kept alive in `originals`) -> its fake
    originals = []

    def fake(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            originals.append(t)
            meta = t.detach() if t.device.type == "meta" else t.detach().to("meta")
            made[id(t)] = FakeTensor(fake_mode, meta, device)
            if parameter:
                made[id(t)] = nn.Parameter(made[id(t)], requires_grad=t.requires_grad)
        return made[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = fake(p, True)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b, False)


def four_bit_linears(model: nn.Module) -> list[nn.Linear]:
    """The linears bitsandbytes quantizes: every nn.Linear but the output head and LoRA's own."""
    head = model.get_output_embeddings()
    return [
        m
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m is not head and not any(p.startswith("lora_") for p in name.split("."))
    ]


@contextlib.contextmanager
def dequantized_during_matmul(linears: list[nn.Linear], dtype: torch.dtype):
    """One dequantized weight alive beside each 4-bit matmul's output, in the forward and in the backward, as
    bitsandbytes' dequantize + matmul holds it. Allocated and dropped at once: nothing stays on the module (a
    checkpoint recompute that stops early never reaches a forward's end)."""

    def dequantized(weight: torch.Tensor) -> None:
        torch.empty(weight.shape, dtype=dtype, device=weight.device)

    def post(module, args, output):
        dequantized(module.weight)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g, w=module.weight: dequantized(w))

    handles = [m.register_forward_hook(post) for m in linears]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def planned_batch(setup: PlanSetup, device: torch.device) -> dict[str, torch.Tensor]:
    """One training batch of ``setup``'s shape (batch size x sequence length), every token kept.

    No attention mask: of a batch with every token kept, the run's mask is all ones, which transformers drops (SDPA
    then takes ``is_causal`` and runs grouped-query attention on the key/value heads as they are). A fake mask would
    not be dropped (transformers cannot read its values), and SDPA would keep k and v repeated to every query head.
    """
    ids = torch.zeros((setup.batch_size, setup.seq_len), dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids}


def planned_autocast(setup: PlanSetup, device: torch.device):
    """The autocast the run's bf16/fp16 setting puts its forward under (none without either)."""
    if setup.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=setup.autocast_dtype)


def trainer_view(setup: PlanSetup, model: nn.Module):
    """What training.checkpoint_as_in_training, training.fora_optimizer and the backward stop use of a Trainer: its
    args, decay parameter names and callbacks, for ``model``, without building a Trainer."""

    class View:
        args = setup.training_args
        is_deepspeed_enabled = False

        def get_decay_parameter_names(self, m):
            return Trainer.get_decay_parameter_names(self, m)

        def add_callback(self, callback):
            pass  # the plan runs one step and no train(): nothing for a callback to do

    view = View()
    view.model = model
    return view


def prepare_fake_model(
    setup: PlanSetup, model: nn.Module, fake_mode, device: torch.device, *, stop_backward: bool = False
) -> list[nn.Linear]:
    """``model`` on fake tensors, checkpointed as in training; its 4-bit linears returned (score them as quantized:
    ``fisher_scores(..., quantized=...)``).

    ``stop_backward``: FoRA's training step, whose backward stops at the lowest adapted layer
    (:mod:`fora_plugin.backward`), where scoring and plain LoRA keep SFTTrainer's embeddings hook and run the
    backward through every layer. PEFT's input cast is set by ``fora_input_cast``, as the trainer sets it.
    """
    _fakeify(model, fake_mode, device)
    linears = four_bit_linears(model) if setup.four_bit is not None else []
    view = trainer_view(setup, model)
    checkpoint_as_in_training(view)
    if setup.checkpointing:
        # SFTTrainer's call, for PEFT + checkpointing. activation_checkpointing_enable has just added the same hook:
        # taken off first, or its handle would be overwritten and the hook stay out of the backward stop's reach.
        disable_input_require_grads(model)
        model.enable_input_require_grads()
    if stop_backward:
        stop_backward_at_lowest_adapted_layer(view, verbose=False)
    set_input_cast(model, setup.fora.input_cast)  # as the trainer sets it, in every mode
    model.train()
    return linears


def lora_optimizer(setup: PlanSetup, model: nn.Module):
    """The optimizer transformers.Trainer.create_optimizer builds for plain LoRA (decay and no-decay groups).

    Where the engine casts LoRA to ``setup.lora_dtype`` (DeepSpeed's bf16 / fp16), its ZeRO or mixed-precision
    optimizer steps the Trainer's AdamW on fp32 masters of the weights: planned as :class:`MasterAdamW` (an fp32 master
    and fp32 moments per weight, the same bytes; the plan's sharding divides them under ZeRO)."""
    view = trainer_view(setup, model)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(setup.training_args, model)
    if setup.lora_dtype is not None and issubclass(cls, torch.optim.AdamW):
        cls = MasterAdamW
    decay = set(view.get_decay_parameter_names(model))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": setup.training_args.weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    return cls([g for g in groups if g["params"]], **kwargs)
