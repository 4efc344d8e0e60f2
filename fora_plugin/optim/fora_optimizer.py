"""The single optimizer FoRA trains with: AdamW groups (lora_A and every other trainable parameter) and Cayley-Adam
groups (the Stiefel ``lora_B``) over one ``param_groups``, built from a PEFT model.

HF's LR scheduler and gradient clipping act on all groups at once, which two separate optimizers would not give; the
schedulers that would break the ratio of the two learning rates are refused by name. bf16 adapters step through fp32
masters (:class:`MasterAdamW`, and Cayley-Adam's own).

May import: adapter, errors, optim.cayley_adam, optim.dtensor, optim.masters.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import AdamW, Optimizer
from torch.optim.adam import adam

from ..adapter import stiefel_num_experts, stiefel_parameters
from ..errors import FoRAInputError, FoRAInputTypeError
from .cayley_adam import REPROJECT_THRESHOLD, CayleyAdam, counter_totals, restore_compute_state, run_settings_kept
from .dtensor import local_rows
from .masters import compute_dtype, follow_parameter, signature
from .masters import restore_compute_state as restore_state


__all__ = [
    "MASTER_STATE_KEYS",
    "UNSUPPORTED_LR_SCHEDULERS",
    "FoRAOptimizer",
    "MasterAdamW",
    "build_fora_optimizer",
    "check_lr_scheduler_type",
    "create_fora_optimizer",
    "fora_optimizer_parts",
    "restore_master_state",
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


# AdamW state kept in the compute dtype (fp32, fp64 for fp64) for a parameter with a master, whatever its own dtype.
MASTER_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class MasterAdamW(AdamW):
    """``torch.optim.AdamW`` for bf16/fp16 parameters: each steps through an fp32 master kept in its state.

    A low-precision parameter ``p`` keeps ``state[p]["master"]`` (fp32, its own storage) beside AdamW's moments, fp32
    too. Its step is torch's AdamW (the functional ``torch.optim.adam.adam`` with the group's ``foreach``, ``fused``,
    ``capturable`` and ``amsgrad`` flags, decoupled weight decay) on the master with the gradient in fp32; ``p`` then
    holds the master rounded. This is the precision of an fp32 parameter: the same update, where torch's AdamW on a
    bf16 parameter would keep bf16 moments and round every update into bf16 weights. fp32 and fp64 parameters step on
    themselves, as in torch's AdamW.

    The masters are optimizer state: ``state_dict`` carries them (so do accelerate's ``save_state`` and HF's
    checkpoints), and ``load_state_dict`` puts them and the moments back in fp32 (torch's casts state to the
    parameter's dtype). A parameter changed outside the step (a resumed checkpoint's weights, an edit) is found by its
    version counter: where it no longer equals its master rounded, the master takes its value; where it does, the
    master keeps its extra bits.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._written: dict[torch.Tensor, tuple] = {}  # p -> what the step last left in p (masters.signature)
        super().__init__(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        restore_master_state(self, state_dict)
        self.forget_writes()

    def forget_writes(self) -> None:
        """Forget what the step last wrote into each parameter: the next step reconciles each with its master."""
        self._written.clear()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        written = self._written
        for group in self.param_groups:
            params, targets, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise FoRAInputTypeError("MasterAdamW does not support sparse gradients.")
                state = self.state[p]
                if not state:
                    _init_master_state(state, p, group)
                else:
                    # torch's AdamW keeps its step count on the host unless fused or capturable: it stays there.
                    follow_parameter(state, p, written.get(p), MASTER_STATE_KEYS, host_keys=("step",))
                target = state.get("master", p)
                params.append(p)
                targets.append(target)
                grads.append(p.grad if p.grad.dtype == target.dtype else p.grad.to(target.dtype))
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if group["amsgrad"]:
                    max_exp_avg_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adam(
                targets,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                steps,
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                has_complex=False,
                decoupled_weight_decay=True,
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
            rounded = [(local_rows(p), local_rows(t)) for p, t in zip(params, targets) if t is not p]
            if rounded:
                torch._foreach_copy_([p for p, _ in rounded], [t for _, t in rounded])  # the master rounded
            for p in params:
                written[p] = signature(p)
        return loss


def _init_master_state(state: dict[str, Any], p: torch.Tensor, group: dict[str, Any]) -> None:
    """AdamW's state for ``p`` as torch's AdamW makes it, on an fp32 master (its own storage) for a bf16/fp16 ``p``."""
    dtype = compute_dtype(p)
    target = p if p.dtype == dtype else p.detach().to(dtype)
    if target is not p:
        state["master"] = target
    # torch keeps the step count on the host unless the step is fused or capturable.
    on_device = group["fused"] or group["capturable"]
    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
    state["exp_avg"] = torch.zeros_like(target, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(target, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(target, memory_format=torch.preserve_format)


def restore_master_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """After ``Optimizer.load_state_dict(state_dict)``: put the saved masters and moments of every group with
    ``"master_weights": True`` back in their compute dtype (torch's loader casts them to the bf16 parameter's)."""
    restore_state(optimizer, state_dict, lambda g: g.get("master_weights"), MASTER_STATE_KEYS, kept_keys=("step",))


class FoRAOptimizer(Optimizer):
    """One optimizer over AdamW groups and Cayley-Adam groups (a group with ``"stiefel": True``).

    The Euclidean groups are stepped by ``torch.optim.AdamW`` itself, or by :class:`MasterAdamW` where the group has
    ``"master_weights": True`` (bf16 adapters with fp32 masters), and the Stiefel groups by :class:`CayleyAdam`; all
    share this object's ``param_groups`` dicts and ``state``, so LR schedulers, checkpointing and ``accelerate`` see
    one ordinary optimizer. Build it with :func:`build_fora_optimizer`.

    Args:
        params: param-group dicts; ``"stiefel": True`` marks a Stiefel group, ``"master_weights": True`` an AdamW
            group whose bf16/fp16 parameters keep fp32 masters.
        adamw_defaults: keyword arguments of ``torch.optim.AdamW`` for the Euclidean groups.
        stiefel_defaults: keyword arguments of :class:`CayleyAdam` for the Stiefel groups.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        adamw_defaults: dict[str, Any] | None = None,
        stiefel_defaults: dict[str, Any] | None = None,
    ) -> None:
        adamw = dict(adamw_defaults or {})
        self._delegate_defaults = {"adamw": adamw, "master": adamw, "stiefel": dict(stiefel_defaults or {})}
        self._delegates: dict[str, Optimizer] = {}
        # The AdamW rate is "the" learning rate: HF's polynomial and min-lr schedulers and accelerate's DeepSpeed
        # scheduler read defaults["lr"] and scale every group by one factor relative to it, which keeps the
        # Stiefel group's lr_stiefel / lr ratio. Only lr: the other keys would leak into the Stiefel groups.
        super().__init__(params, defaults={"lr": adamw.get("lr", _ADAMW_DEFAULT_LR)})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # The delegate fills in its defaults and validates; the same dict then joins this optimizer's groups.
        param_group["stiefel"] = bool(param_group.get("stiefel", False))
        kind = _delegate_kind(param_group)
        delegate = self._delegates.get(kind)
        if delegate is None:
            self._delegates[kind] = _DELEGATES[kind]([param_group], **self._delegate_defaults[kind])
        else:
            delegate.add_param_group(param_group)
        super().add_param_group(param_group)

    def _sync_delegates(self) -> None:
        # load_state_dict() rebinds self.state and self.param_groups: point the delegates at the current objects.
        for kind, delegate in self._delegates.items():
            delegate.param_groups = [g for g in self.param_groups if _delegate_kind(g) == kind]
            delegate.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The groups come back as saved; whether they keep masters stays this run's choice (a checkpoint of fp32
        # adapters resumed with bf16 ones gets its masters made from the weights at the first step).
        masters = [g.get("master_weights", False) for g in self.param_groups]
        with run_settings_kept(self):
            super().load_state_dict(state_dict)
        for group, master in zip(self.param_groups, masters):
            group["master_weights"] = master
            if not master and not group["stiefel"]:
                # A checkpoint of bf16 adapters resumed with fp32 ones: torch's AdamW steps them, and a saved master
                # would stay in its state, stale, and be saved again at every checkpoint.
                for p in group["params"]:
                    self.state.get(p, {}).pop("master", None)
        restore_compute_state(self, state_dict)
        restore_master_state(self, state_dict)
        self._sync_delegates()
        for kind in ("stiefel", "master"):  # as their own load_state_dict does
            if kind in self._delegates:
                self._delegates[kind].forget_writes()

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
        return counter_totals(self, ("skipped_steps",))["skipped_steps"]

    def reprojections(self) -> int:
        """Stiefel matrices re-projected for drifting from the manifold so far (one host sync)."""
        return counter_totals(self, ("reprojections",))["reprojections"]


def _delegate_kind(group: dict[str, Any]) -> str:
    """Which optimizer steps ``group``: ``"stiefel"`` (Cayley-Adam), ``"master"`` (MasterAdamW) or ``"adamw"``."""
    if group["stiefel"]:
        return "stiefel"
    return "master" if group.get("master_weights") else "adamw"


_DELEGATES: dict[str, type[Optimizer]] = {"adamw": AdamW, "master": MasterAdamW, "stiefel": CayleyAdam}


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
    master_weights: bool = False,
    **adamw_kwargs: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The param groups of FoRA's optimizer for ``model``, with the AdamW and the Cayley-Adam defaults.

    Groups, in order: AdamW with ``weight_decay`` (lora_A and other trainable weights), AdamW without decay
    (biases, norms), and the Stiefel groups (Cayley-Adam at ``lr_stiefel``), one per number of expert blocks of
    the ``lora_B`` (``num_experts``: 1, then E for fused-MoE adapters, see
    :func:`fora_plugin.stiefel_num_experts`). Empty groups are left out; HF logs the first group's lr. Stiefel
    parameters are ``stiefel_params`` if given, else every ``lora_B`` made Stiefel by
    :func:`fora_plugin.make_stiefel`. ``decay_parameter_names`` defaults to HF Trainer's rule; a trainer passes
    its own ``get_decay_parameter_names(model)``. ``master_weights``: the AdamW groups step their bf16/fp16
    parameters through fp32 masters (:class:`MasterAdamW`; Cayley-Adam always does). Extra keyword arguments go to
    AdamW (e.g. ``foreach``, ``fused``).
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
    masters = {"master_weights": True} if master_weights else {}
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, **masters})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, **masters})
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


def create_fora_optimizer(
    model: nn.Module,
    *,
    lr: float,
    lr_stiefel: float,
    weight_decay: float = 0.0,
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
    master_weights: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> FoRAOptimizer:
    """FoRA's optimizer for ``model``, every setting an explicit keyword (PEFT's ``create_loraplus_optimizer`` form).

    ``lr`` steps lora_A and every other trainable parameter by AdamW (``weight_decay``, ``betas``, ``eps``;
    ``foreach``/``fused`` as torch's), ``lr_stiefel`` the Stiefel ``lora_B`` (:func:`fora_plugin.make_stiefel`) by
    Cayley-Adam (``stiefel_betas``, ``stiefel_eps``; QR every ``qr_period`` steps and past ``reproject_threshold``;
    ``cayley_solver``/``cayley_iters``; ``cuda_graph``). The groups, ``stiefel_params``, ``decay_parameter_names``
    and ``master_weights`` are :func:`fora_optimizer_parts`'s; :func:`build_fora_optimizer` takes the same settings.
    """
    return build_fora_optimizer(
        model,
        lr=lr,
        lr_stiefel=lr_stiefel,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        stiefel_betas=stiefel_betas,
        stiefel_eps=stiefel_eps,
        qr_period=qr_period,
        reproject_threshold=reproject_threshold,
        cayley_solver=cayley_solver,
        cayley_iters=cayley_iters,
        cuda_graph=cuda_graph,
        stiefel_params=stiefel_params,
        decay_parameter_names=decay_parameter_names,
        master_weights=master_weights,
        foreach=foreach,
        fused=fused,
    )


def wrapped_optimizers(optimizer: Any) -> Iterator[Any]:
    """``optimizer`` and every optimizer it wraps, outermost first: accelerate's ``AcceleratedOptimizer``, DeepSpeed's
    ZeRO optimizer and FoRA's ZeRO client each keep the one inside as ``.optimizer``. Stops at a cycle."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        yield optimizer
        optimizer = getattr(optimizer, "optimizer", None)


def find_stiefel_optimizer(optimizer: Any) -> CayleyAdam | FoRAOptimizer | None:
    """What steps the Stiefel ``lora_B`` inside ``optimizer`` and its wrappers (:func:`wrapped_optimizers`): a
    :class:`FoRAOptimizer` or :class:`CayleyAdam` (FoRA's ZeRO client keeps it as ``.stiefel``); None without one."""
    for wrapper in wrapped_optimizers(optimizer):
        for candidate in (wrapper, getattr(wrapper, "stiefel", None)):
            if isinstance(candidate, (CayleyAdam, FoRAOptimizer)):
                return candidate
    return None
