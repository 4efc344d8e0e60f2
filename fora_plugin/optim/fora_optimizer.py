"""The single optimizer FoRA trains with: AdamW groups (lora_A and every other trainable parameter) and Cayley-Adam
groups (the Stiefel ``lora_B``) over one ``param_groups``, built from a PEFT model.

HF's LR scheduler and gradient clipping act on all groups at once, which two separate optimizers would not give; the
schedulers that would break the ratio of the two learning rates are refused by name.

May import: adapter, errors, optim.cayley_adam.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import AdamW, Optimizer

from ..adapter import stiefel_num_experts, stiefel_parameters
from ..errors import FoRAInputError
from .cayley_adam import REPROJECT_THRESHOLD, CayleyAdam, counter_total, restore_compute_state


__all__ = [
    "UNSUPPORTED_LR_SCHEDULERS",
    "FoRAOptimizer",
    "build_fora_optimizer",
    "check_lr_scheduler_type",
    "fora_optimizer_parts",
    "wrapped_optimizers",
]


_ADAMW_DEFAULT_LR = 1e-3  # torch.optim.AdamW's

# transformers' lr_scheduler_type values that cannot keep the Stiefel group's rate at lr_stiefel / lr of the AdamW
# groups' rate. Every other one scales all groups by one factor (LambdaLR) or each by the same factor.
UNSUPPORTED_LR_SCHEDULERS = {
    "greedy": "GreedyLR clips each group's rate to absolute bounds (min_lr, max_lr), so the two groups reach them "
    "at different steps and their ratio changes",
}


def check_lr_scheduler_type(name: Any) -> None:
    """Refuse, by name, an HF ``lr_scheduler_type`` that would break the ratio of FoRA's two learning rates."""
    name = getattr(name, "value", name)  # a transformers SchedulerType
    if name in UNSUPPORTED_LR_SCHEDULERS:
        raise FoRAInputError(
            f"lr_scheduler_type={name!r} cannot be used with FoRA: {UNSUPPORTED_LR_SCHEDULERS[name]}, while FoRA "
            "trains lora_B at fora_lr_stiefel and lora_A at learning_rate. Use another schedule, e.g. 'cosine', "
            "'linear', 'cosine_with_min_lr' or 'reduce_lr_on_plateau'."
        )


class FoRAOptimizer(Optimizer):
    """One optimizer over AdamW groups and Cayley-Adam groups (a group with ``"stiefel": True``).

    The Euclidean groups are stepped by ``torch.optim.AdamW`` itself and the Stiefel groups by :class:`CayleyAdam`;
    both share this object's ``param_groups`` dicts and ``state``, so LR schedulers, checkpointing and
    ``accelerate`` see one ordinary optimizer. Build it with :func:`build_fora_optimizer`.

    Args:
        params: param-group dicts; ``"stiefel": True`` marks a Stiefel group.
        adamw_defaults: keyword arguments of ``torch.optim.AdamW`` for the Euclidean groups.
        stiefel_defaults: keyword arguments of :class:`CayleyAdam` for the Stiefel groups.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        adamw_defaults: dict[str, Any] | None = None,
        stiefel_defaults: dict[str, Any] | None = None,
    ) -> None:
        self._delegate_defaults = {False: dict(adamw_defaults or {}), True: dict(stiefel_defaults or {})}
        self._delegates: dict[bool, Optimizer] = {}
        # The AdamW rate is "the" learning rate: HF's polynomial and min-lr schedulers and accelerate's DeepSpeed
        # scheduler read defaults["lr"] and scale every group by one factor relative to it, which keeps the
        # Stiefel group's lr_stiefel / lr ratio. Only lr: the other keys would leak into the Stiefel groups.
        super().__init__(params, defaults={"lr": self._delegate_defaults[False].get("lr", _ADAMW_DEFAULT_LR)})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # The delegate fills in its defaults and validates; the same dict then joins this optimizer's groups.
        stiefel = bool(param_group.get("stiefel", False))
        param_group["stiefel"] = stiefel
        delegate = self._delegates.get(stiefel)
        if delegate is None:
            delegate_cls = CayleyAdam if stiefel else AdamW
            self._delegates[stiefel] = delegate_cls([param_group], **self._delegate_defaults[stiefel])
        else:
            delegate.add_param_group(param_group)
        super().add_param_group(param_group)

    def _sync_delegates(self) -> None:
        # load_state_dict() rebinds self.state and self.param_groups: point the delegates at the current objects.
        for stiefel, delegate in self._delegates.items():
            delegate.param_groups = [g for g in self.param_groups if g["stiefel"] == stiefel]
            delegate.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        restore_compute_state(self, state_dict)
        self._sync_delegates()
        if True in self._delegates:
            self._delegates[True].forget_writes()  # as CayleyAdam.load_state_dict

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_delegates()
        for delegate in self._delegates.values():
            delegate.step()
        return loss

    @property
    def stiefel_groups(self) -> list[dict[str, Any]]:
        return [g for g in self.param_groups if g["stiefel"]]

    def skipped_steps(self) -> int:
        """Stiefel matrix steps skipped for a non-finite gradient so far (one host sync)."""
        return counter_total(self, "skipped_steps")

    def reprojections(self) -> int:
        """Stiefel matrices re-projected for drifting from the manifold so far (one host sync)."""
        return counter_total(self, "reprojections")


# Weight decay skips biases and normalisation weights, as transformers.Trainer.get_decay_parameter_names does.
_NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def _decay_parameter_names(model: nn.Module) -> set[str]:
    from transformers.trainer_pt_utils import get_parameter_names  # lazy: transformers' trainer is slow to import

    return set(get_parameter_names(model, [nn.LayerNorm], list(_NO_DECAY_PATTERNS)))


def fora_optimizer_parts(
    model: nn.Module,
    lr: float = 2e-4,
    lr_stiefel: float = 1e-3,
    weight_decay: float = 0.0,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    stiefel_betas: tuple[float, float] = (0.9, 0.99),
    stiefel_eps: float = 1e-8,
    qr_period: int = 200,
    reproject_threshold: float = REPROJECT_THRESHOLD,
    cayley_solver: str = "exact",
    cayley_iters: int = 5,
    cuda_graph: bool | None = None,
    stiefel_params: Collection[torch.Tensor] | None = None,
    decay_parameter_names: Collection[str] | None = None,
    **adamw_kwargs: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The param groups of FoRA's optimizer for ``model``, with the AdamW and the Cayley-Adam defaults.

    Groups, in order: AdamW with ``weight_decay`` (lora_A and other trainable weights), AdamW without decay
    (biases, norms), and the Stiefel groups (Cayley-Adam at ``lr_stiefel``), one per number of expert blocks of
    the ``lora_B`` (``num_experts``: 1, then E for fused-MoE adapters, see
    :func:`fora_plugin.stiefel_num_experts`). Empty groups are left out; HF logs the first group's lr. Stiefel
    parameters are ``stiefel_params`` if given, else every ``lora_B`` made Stiefel by
    :func:`fora_plugin.make_stiefel`. ``decay_parameter_names`` defaults to HF Trainer's rule; a trainer passes
    its own ``get_decay_parameter_names(model)``. Extra keyword arguments go to AdamW (e.g. ``foreach``, ``fused``).
    """
    if stiefel_params is None:
        stiefel_params = [p for _, p in stiefel_parameters(model)]
    stiefel_ids = {id(p) for p in stiefel_params}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable_ids = {id(p) for _, p in trainable}
    frozen = [p for p in stiefel_params if id(p) not in trainable_ids]
    if frozen:
        raise FoRAInputError(
            f"{len(frozen)} Stiefel parameter(s) (first shape {tuple(frozen[0].shape)}) are not "
            "trainable parameters of the model: set requires_grad=True or leave them out."
        )
    if not trainable:
        raise FoRAInputError(
            "build_fora_optimizer found no trainable parameter in the model: were the LoRA adapters "
            "added (get_peft_model) before building the optimizer?"
        )
    decay_names = set(decay_parameter_names) if decay_parameter_names is not None else _decay_parameter_names(model)
    decay, no_decay = [], []
    for name, p in trainable:
        if id(p) not in stiefel_ids:
            (decay if name in decay_names else no_decay).append(p)
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    # One Stiefel group per number of expert blocks E: a fused-MoE lora_B (d_out, r·E) is E Stiefel matrices.
    experts = stiefel_num_experts(model)
    stiefel_by_experts: dict[int, list[torch.Tensor]] = {}
    for _, p in trainable:
        if id(p) in stiefel_ids:
            stiefel_by_experts.setdefault(experts.get(id(p), 1), []).append(p)
    for num_experts, params in sorted(stiefel_by_experts.items()):
        # Cayley-Adam has no weight decay (the norm is fixed on the manifold); the key is there because trainers
        # read it from every group (Axolotl's resume restores it group by group).
        groups.append({"params": params, "stiefel": True, "weight_decay": 0.0, "num_experts": num_experts})
    adamw_defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **adamw_kwargs)
    stiefel_defaults = dict(
        lr=lr_stiefel,
        betas=stiefel_betas,
        eps=stiefel_eps,
        qr_period=qr_period,
        reproject_threshold=reproject_threshold,
        cayley_solver=cayley_solver,
        cayley_iters=cayley_iters,
        cuda_graph=cuda_graph,
    )
    return groups, adamw_defaults, stiefel_defaults


def build_fora_optimizer(model: nn.Module, *args: Any, **kwargs: Any) -> FoRAOptimizer:
    """The single FoRA optimizer for ``model``'s trainable parameters; arguments as :func:`fora_optimizer_parts`."""
    groups, adamw_defaults, stiefel_defaults = fora_optimizer_parts(model, *args, **kwargs)
    return FoRAOptimizer(groups, adamw_defaults=adamw_defaults, stiefel_defaults=stiefel_defaults)


def wrapped_optimizers(optimizer: Any) -> Iterator[Any]:
    """``optimizer`` and every optimizer it wraps, outermost first: accelerate's ``AcceleratedOptimizer``, DeepSpeed's
    ZeRO optimizer and FoRA's ZeRO client each keep the one inside as ``.optimizer``. Stops at a cycle."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        yield optimizer
        optimizer = getattr(optimizer, "optimizer", None)
