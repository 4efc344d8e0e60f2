"""Where the backward stops: at the lowest adapted decoder layer, with activation checkpointing too. How and why:
:func:`stop_backward_at_lowest_adapted_layer`.

May import: targets.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, TrainerCallback

from .targets import find_decoder_layers


logger = logging.getLogger(__name__)

__all__ = [
    "BackwardStop",
    "BackwardStopCallback",
    "checkpointing_settings",
    "disable_input_require_grads",
    "is_reentrant",
    "lowest_adapted_layer",
    "stop_backward_at_lowest_adapted_layer",
    "trainable_below",
]


def checkpointing_settings(args: Any, model: nn.Module) -> tuple[bool, dict[str, Any]]:
    """Whether ``args`` (TrainingArguments) turn activation checkpointing on, and its kwargs as given.

    transformers 5.23 renamed ``gradient_checkpointing*`` to ``activation_checkpointing*`` (the old names are
    deprecated aliases); Axolotl 0.21 pins transformers 5.20, which has the old names only.
    """
    new_names = hasattr(model, "activation_checkpointing_enable")
    enabled = args.activation_checkpointing if new_names else args.gradient_checkpointing
    kwargs = (args.activation_checkpointing_kwargs if new_names else args.gradient_checkpointing_kwargs) or {}
    return bool(enabled), dict(kwargs)


def is_reentrant(checkpointing_kwargs: dict[str, Any] | None) -> bool:
    """Whether the checkpoint transformers builds from these ``*_checkpointing_kwargs`` is reentrant.

    No kwargs (after transformers' own ``every_n_layers`` and ``offload``): transformers passes
    ``use_reentrant=False``. Kwargs without ``use_reentrant``: ``torch.utils.checkpoint``'s default, reentrant.
    """
    kwargs = {k: v for k, v in (checkpointing_kwargs or {}).items() if k not in ("every_n_layers", "offload")}
    if not kwargs:
        return False
    return kwargs.get("use_reentrant") is not False


def lowest_adapted_layer(model: nn.Module) -> int | None:
    """The index of the lowest decoder layer that holds a trainable parameter; None if no layer does."""
    _, layers = find_decoder_layers(model)
    for index, layer in enumerate(layers):
        if any(p.requires_grad for p in layer.parameters()):
            return index
    return None


def trainable_below(model: nn.Module, index: int) -> list[str]:
    """Names of the trainable parameters that may run before decoder layer ``index`` in the forward.

    Inside the decoder layers the index says it. Outside them only the output embeddings (the LM head, with a
    ``modules_to_save`` copy) are known to run after the layers; anything else trainable there (input embeddings,
    trainable tokens, a prompt encoder, a vision tower, a final norm) counts as below: the backward must reach it.
    A head tied to the input embeddings runs before the layers too.
    """
    _, layers = find_decoder_layers(model)
    above = {id(p) for layer in layers[index:] for p in layer.parameters()}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        above |= {id(p) for p in head.parameters()}
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    if isinstance(embeddings, nn.Module):
        above -= {id(p) for p in embeddings.parameters()}
    return [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in above]


def disable_input_require_grads(model: nn.Module) -> int:
    """Remove every embeddings hook that ``enable_input_require_grads`` added to ``model`` or a model inside it.

    TRL and PEFT call it on the PeftModel, which hands it to the transformers model it wraps; a composite model keeps
    the handles on the part that added them. Returns how many models had hooks.
    """
    removed = 0
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and (
            getattr(module, "_require_grads_hooks", None) or hasattr(module, "_require_grads_hook")
        ):
            module.disable_input_require_grads()
            removed += 1
    return removed


def _hooks_run_inside_checkpoint(layer: nn.Module) -> bool:
    # transformers 5.23 checkpoints a GradientCheckpointingLayer's forward, so its module hooks stay outside; earlier
    # releases checkpoint __call__, with the hooks inside.
    return type(layer).__call__ is not nn.Module.__call__


class BackwardStop:
    """The backward stop on one model: the lowest adapted layer, its forward pre-hook, and how it is applied.

    The pre-hook, on every training forward with gradients: under reentrant checkpointing it makes the hidden state
    entering the layer require grad (plus a zero that requires grad, :meth:`_anchor_on`: the caller's tensor is left
    as it was, and the backward ends there). A hidden state that already
    requires grad (an input hook whose handle was lost, see :meth:`_pre_hook`) is detached there, since nothing
    below is trainable: the backward stops at the layer all the same.

    A hook whose handle was lost (a second ``enable_input_require_grads`` overwrites the first one's handle, as
    Axolotl's loader does after enabling checkpointing) cannot be taken off through the API: the pre-hook then detaches
    the hidden state entering the lowest adapted layer, so the backward stops there all the same.
    """

    def __init__(self, model: nn.Module, index: int) -> None:
        _, layers = find_decoder_layers(model)
        self.model = model
        self.index = index
        self.layer = layers[index]
        self.below = list(layers[:index])
        self._below_off: list[nn.Module] = []
        self.reentrant = False
        self._checkpoint_off = False
        self._anchor: torch.Tensor | None = None
        self._warned = False  # the lost-hook message is given once
        self._handle = self.layer.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def apply(self, checkpointing: bool, reentrant: bool, *, verbose: bool = True) -> None:
        """Take the embeddings hooks off and set the pre-hook for this checkpointing (call it after
        ``activation_checkpointing_enable``, which adds a hook again and resets the layers' flags); ``verbose``:
        say so in the log (INFO)."""
        removed = disable_input_require_grads(self.model)
        self.reentrant = checkpointing and reentrant
        if self.reentrant:
            self._anchor_on(next(self.layer.parameters()).device)
        self._checkpoint_off = False
        checkpointed = getattr(self.layer, "gradient_checkpointing", False)
        if self.reentrant and checkpointed and _hooks_run_inside_checkpoint(self.layer):
            self.layer.gradient_checkpointing = False
            self._checkpoint_off = True
        # No backward reaches the layers below, so a checkpoint there would keep nothing and recompute nothing; a
        # reentrant one would also put a no-grad checkpoint region into a compiled graph (torch.compile's
        # rematerialisation refuses one holding random ops).
        checkpointed_below = [layer for layer in self.below if getattr(layer, "gradient_checkpointing", False)]
        for layer in checkpointed_below:
            layer.gradient_checkpointing = False
        self._below_off = list(dict.fromkeys(self._below_off + checkpointed_below))
        (logger.info if verbose else logger.debug)(
            "FoRA: the backward stops at decoder layer %d (the lowest adapted one)%s; %s.",
            self.index,
            f", {removed} embeddings hook(s) of enable_input_require_grads removed" if removed else "",
            "its incoming hidden state requires grad (reentrant checkpointing)"
            if self.reentrant and not self._checkpoint_off
            else "it runs without checkpointing (reentrant checkpointing, hooks inside the checkpoint)"
            if self._checkpoint_off
            else "no input requires grad",
        )

    def remove(self) -> None:
        """Remove the pre-hook (the embeddings hooks stay off until ``enable_input_require_grads`` runs again)."""
        self._handle.remove()
        if self._checkpoint_off:
            self.layer.gradient_checkpointing = True
            self._checkpoint_off = False
        for layer in self._below_off:
            layer.gradient_checkpointing = True
        self._below_off = []

    def _anchor_on(self, device: torch.device) -> torch.Tensor:
        """A 0-dim zero that requires grad, on ``device``: added to the hidden state entering the layer, it makes that
        state require grad without a new leaf inside the forward (``requires_grad_`` on an intermediate tensor breaks
        a compiled graph). Made at :meth:`apply`, outside any compiled region; its gradient is dropped as it comes."""
        if self._anchor is None or self._anchor.device != device:
            self._anchor = torch.zeros((), device=device, requires_grad=True)
            self._anchor.register_post_accumulate_grad_hook(lambda anchor: setattr(anchor, "grad", None))
        return self._anchor

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        positional = bool(args) and isinstance(args[0], torch.Tensor)
        hidden = args[0] if positional else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
            return None
        if hidden.requires_grad:
            # Something below still makes it require grad although nothing below is trainable: an
            # enable_input_require_grads hook whose handle a second call overwrote (Axolotl's loader enables
            # checkpointing, which adds one, then calls enable_input_require_grads again), out of reach of
            # disable_input_require_grads. The backward is cut here instead: a detached copy enters the layer.
            if not self._warned:
                self._warned = True
                logger.info(
                    "FoRA: the hidden state entering decoder layer %d already requires grad (an input hook whose "
                    "handle was lost); nothing below is trainable, so the backward is cut there.",
                    self.index,
                )
            hidden = hidden.detach()
            if self.reentrant and not self._checkpoint_off:
                hidden = hidden + self._anchor_on(hidden.device)
        elif self.reentrant and not self._checkpoint_off:
            hidden = hidden + self._anchor_on(hidden.device)
        else:
            return None
        if positional:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}


class BackwardStopCallback(TrainerCallback):
    """Re-applies the :class:`BackwardStop` when training begins: ``Trainer.train`` has just called
    ``activation_checkpointing_enable``, which adds the embeddings hook again."""

    def __init__(self, stop: BackwardStop, reentrant: bool | None = None) -> None:
        self.stop = stop
        self.reentrant = reentrant

    def on_train_begin(self, args, state, control, **kwargs):
        checkpointing, checkpointing_kwargs = checkpointing_settings(args, self.stop.model)
        reentrant = is_reentrant(checkpointing_kwargs) if self.reentrant is None else self.reentrant
        self.stop.apply(checkpointing, reentrant, verbose=False)
        return control


def stop_backward_at_lowest_adapted_layer(
    trainer: Any, *, reentrant: bool | None = None, verbose: bool = True
) -> BackwardStop | None:
    """Make ``trainer``'s backward stop at the lowest adapted decoder layer of ``trainer.model``, now and at every
    ``train()``; None (and nothing changed) when a trainable parameter below that layer needs the gradient.

    Nothing below the lowest decoder layer that holds a trainable parameter needs a gradient, so a backward can stop
    there, and with activation checkpointing no layer below needs its recompute. Plain autograd stops there by itself;
    checkpointing does not, because TRL's ``SFTTrainer``, Axolotl and ``Trainer.train`` (through
    ``activation_checkpointing_enable``) all call ``enable_input_require_grads()``, which makes the embeddings' output
    require grad so that the backward, and every checkpointed layer's recompute, runs through all L layers.

    :func:`stop_backward_at_lowest_adapted_layer` undoes that for a trainer, through transformers' public API, and
    keeps it undone for every ``train()`` call (:class:`BackwardStopCallback`):

    - non-reentrant checkpointing: no input needs to require grad (the LoRA parameters inside each checkpointed layer
      carry the graph), so the embeddings hook comes off (``disable_input_require_grads``, which removes the handles
      ``enable_input_require_grads`` stored);
    - reentrant checkpointing (TRL forces it for PEFT + ZeRO-3): a layer's checkpoint builds a graph only when one of
      its tensor inputs requires grad, so a forward pre-hook on the lowest adapted layer makes the hidden state
      entering it require grad, and nothing below. transformers before 5.23 runs a layer's hooks inside its checkpoint,
      where they cannot do that; there the lowest adapted layer runs without checkpointing instead (its
      ``gradient_checkpointing`` flag, the switch ``every_n_layers`` uses), which costs one layer's activations.

    A trainable parameter below the lowest adapted layer (``modules_to_save`` such as ``embed_tokens``, trainable
    tokens, prompt-tuning-like extras) needs the gradient to reach it: then nothing changes, with a warning naming it.
    Scoring is not affected: it runs before, with its own hook that makes every layer's gradient reach the embeddings.

    ``reentrant``: whether the checkpoint function needs a tensor input that requires grad; None reads it from
    ``trainer.args`` (:func:`is_reentrant`). Pass True for a checkpoint function that replaces torch's (Axolotl's
    offloading ones are reentrant autograd Functions): True is right for either kind, only a little slower for a
    non-reentrant one (the gradient of the hidden state entering the layer is formed).
    ``verbose``: log where the backward stops (INFO; at every ``train()`` it is said again at DEBUG).
    Call it once the adapters are in place (after scoring: scoring needs the gradient at every layer).
    """
    model = trainer.model
    index = lowest_adapted_layer(model)
    if index is None:
        return None
    below = trainable_below(model, index)
    if below:
        shown = ", ".join(below[:5]) + (f" and {len(below) - 5} more" if len(below) > 5 else "")
        warnings.warn(
            f"Trainable parameters below decoder layer {index}, the lowest adapted one: {shown}. The backward "
            f"(and with activation checkpointing every layer's recompute) runs through all the layers below "
            f"{index}, as plain LoRA's does, so that they get their gradients. To stop it at layer {index}, keep "
            "them frozen (leave them out of modules_to_save / trainable_token_indices).",
            stacklevel=2,
        )
        return None
    stop = BackwardStop(model, index)
    callback = BackwardStopCallback(stop, reentrant)
    checkpointing, checkpointing_kwargs = checkpointing_settings(trainer.args, model)
    stop.apply(checkpointing, is_reentrant(checkpointing_kwargs) if reentrant is None else reentrant, verbose=verbose)
    trainer.add_callback(callback)
    return stop
