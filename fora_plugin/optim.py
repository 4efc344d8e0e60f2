"""Cayley-Adam on the Stiefel manifold, and the single two-group optimizer FoRA trains with.

`CayleyAdam` follows the paper's Appendix C ("Adam moments on the manifold"): a first moment m of the Euclidean
gradient, a scalar second moment v of its squared Frobenius norm, Adam's bias correction, the skew direction
W(m̂) / (√v̂ + ε) and a Cayley step of size lr. After the step the first moment is replaced by W(m) B_{t+1}, its
tangent part carried to the new point (Q commutes with W, so this is Q·W(m)B_t: the momentum moves with the
point). Matrices of one shape are stacked and updated together, so the kernel launches per step do not grow with
the number of adapters.

`FoRAOptimizer` is the one `torch.optim.Optimizer` a trainer sees: AdamW groups first (lora_A and every other
trainable parameter), the Stiefel group last. HF's LR scheduler and gradient clipping act on all groups at once,
which two separate optimizers would not give.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import AdamW, Optimizer

from .stiefel import CAYLEY_SOLVERS, cayley_coefficients, qr_retraction


# State entries kept in the compute dtype (fp32, or fp64 for fp64 parameters), whatever the parameter's dtype.
_COMPUTE_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")


def _compute_dtype(p: torch.Tensor) -> torch.dtype:
    # fp32 at least: in bf16/fp16 the Gram matrices and the 2r x 2r solve lose orthogonality within a few steps.
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _check_hyperparameters(group: dict[str, Any]) -> None:
    lr, eps, qr_period = group["lr"], group["eps"], group["qr_period"]
    if not isinstance(lr, (float, int)) or lr < 0:
        raise ValueError(f"CayleyAdam lr={lr!r} is invalid: use a float >= 0 (the paper uses 1e-3).")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"CayleyAdam betas={betas!r} is invalid: use two floats in [0, 1), e.g. (0.9, 0.99).")
    if eps < 0:
        raise ValueError(f"CayleyAdam eps={eps!r} is invalid: use a float >= 0, e.g. 1e-8.")
    if isinstance(qr_period, bool) or not isinstance(qr_period, int) or qr_period < 0:
        raise ValueError(f"CayleyAdam qr_period={qr_period!r} is invalid: use an int >= 0 (0 = never re-project).")
    if group["cayley_solver"] not in CAYLEY_SOLVERS:
        raise ValueError(
            f"CayleyAdam cayley_solver={group['cayley_solver']!r} is invalid: use one of "
            f"{CAYLEY_SOLVERS} ('exact' is the Woodbury solve, 'fixed_point' the paper's iteration)."
        )
    iters = group["cayley_iters"]
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"CayleyAdam cayley_iters={iters!r} is invalid: use an int >= 1 (the paper uses 5).")


def _check_stiefel_parameter(p: torch.Tensor, index: int) -> None:
    if not p.is_floating_point():
        raise TypeError(f"CayleyAdam parameter #{index} has dtype {p.dtype}; a Stiefel matrix must be floating point.")
    if p.ndim != 2:
        raise ValueError(
            f"CayleyAdam parameter #{index} has shape {tuple(p.shape)}: only 2-D (d_out, r) matrices "
            "can be kept column-orthonormal. Put 1-D parameters (biases, norms) in an AdamW group."
        )
    d, r = p.shape
    if d < r:
        raise ValueError(
            f"CayleyAdam parameter #{index} has shape {tuple(p.shape)} with d_out={d} < r={r}: it "
            f"cannot have {r} orthonormal columns. Use a LoRA rank r <= {d} for this module."
        )


class CayleyAdam(Optimizer):
    """Adam on the Stiefel manifold St(d, r) with an exact O(d·r²) Cayley retraction.

    Every parameter is a ``(d_out, r)`` matrix (a LoRA ``lora_B`` weight) kept column-orthonormal, BᵀB = I_r. A
    parameter off the manifold at its first step is projected onto it (QR). All math runs in fp32 (fp64 for an fp64
    parameter): a bf16/fp16 parameter gets an fp32 master copy in the optimizer state, and its stored value is the
    master rounded.

    A matrix whose gradient holds inf/NaN skips its step (B, m and v unchanged) and its ``skipped_steps`` state
    counter grows; the other matrices of the batch step as usual.

    Args:
        params: iterable of parameters or of param-group dicts.
        lr: Cayley step size (the paper's lr_B, 1e-3).
        betas: decay of the first moment and of the scalar second moment.
        eps: added to √v̂.
        qr_period: re-project every matrix onto the manifold by QR every ``qr_period`` steps; 0 = never.
        cayley_solver: ``"exact"`` (Woodbury, one 2r x 2r solve) or ``"fixed_point"`` (the paper's iteration; its
            step is capped at 1/‖W‖_F so that the iteration contracts).
        cayley_iters: iterations of the fixed-point solver.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        qr_period: int = 200,
        cayley_solver: str = "exact",
        cayley_iters: int = 5,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            qr_period=qr_period,
            cayley_solver=cayley_solver,
            cayley_iters=cayley_iters,
            stiefel=True,
            steps=0,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group)
        for index, p in enumerate(group["params"]):
            _check_stiefel_parameter(p, index)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        _restore_fp32_state(self, state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _cayley_adam_group_step(self.state, group)
        return loss

    def skipped_steps(self) -> int:
        """Matrix steps skipped for a non-finite gradient so far, over all parameters (one host sync)."""
        return _count_skipped(self)


def _count_skipped(optimizer: Optimizer) -> int:
    counts = [s["skipped_steps"] for s in optimizer.state.values() if "skipped_steps" in s]
    return int(torch.stack(counts).sum()) if counts else 0


def _restore_fp32_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    # Optimizer.load_state_dict casts floating state to the parameter's dtype; a bf16 lora_B would get its fp32
    # master and moments rounded to bf16 and stop being orthonormal. Put the saved values back as they were.
    saved_groups = state_dict["param_groups"]
    for saved_group, group in zip(saved_groups, optimizer.param_groups):
        if not group.get("stiefel"):
            continue
        for saved_id, p in zip(saved_group["params"], group["params"]):
            saved_state = state_dict["state"].get(saved_id, {})
            for key in _COMPUTE_STATE_KEYS:
                if key in saved_state:
                    optimizer.state[p][key] = saved_state[key].to(dtype=_compute_dtype(p), device=p.device)
            # torch leaves "step" where the file put it (a CPU tensor stacked with CUDA ones would fail).
            for key in ("step", "skipped_steps"):
                if key in saved_state:
                    optimizer.state[p][key] = saved_state[key].to(device=p.device)


def _init_state(state: dict[str, Any], p: torch.Tensor) -> None:
    device, dtype = p.device, _compute_dtype(p)
    point = qr_retraction(p.detach().to(dtype))  # (d, r) on the manifold
    if p.dtype != dtype:
        state["master"] = point
    p.copy_(point)
    state["step"] = torch.zeros((), dtype=torch.float32, device=device)
    state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=device)  # (d, r)
    state["exp_avg_sq"] = torch.zeros((), dtype=dtype, device=device)
    state["skipped_steps"] = torch.zeros((), dtype=torch.int64, device=device)


def stiefel_step_with_gradients(optimizer: CayleyAdam, grads: Mapping[torch.Tensor, torch.Tensor]) -> None:
    """One :class:`CayleyAdam` step with ``grads[p]`` as the gradient of ``p`` in place of ``p.grad``.

    For gradients kept outside ``.grad``: an fp32 gradient of a bf16 parameter (``.grad`` must have the
    parameter's dtype), such as the all-reduced gradient of a replicated ``lora_B`` under DeepSpeed.
    """
    with torch.no_grad():
        for group in optimizer.param_groups:
            _cayley_adam_group_step(optimizer.state, group, grads)


def _cayley_adam_group_step(
    state: dict[torch.Tensor, dict[str, Any]],
    group: dict[str, Any],
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    group["steps"] += 1
    period = group["qr_period"]
    reproject = period > 0 and group["steps"] % period == 0
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in group["params"]:
        grad = p.grad if grads is None else grads.get(p)
        if grad is None:
            continue
        if grad.is_sparse:
            raise TypeError("CayleyAdam does not support sparse gradients.")
        if not state[p]:
            _init_state(state[p], p)
        buckets[(tuple(p.shape), p.device, _compute_dtype(p))].append(p)
    for params in buckets.values():
        bucket_grads = [p.grad if grads is None else grads[p] for p in params]
        _cayley_adam_bucket_step(state, params, bucket_grads, group, reproject)


def _cayley_adam_bucket_step(
    state: dict[torch.Tensor, dict[str, Any]],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    group: dict[str, Any],
    reproject: bool,
) -> None:
    """One Cayley-Adam step for n matrices of one shape, stacked: a fixed number of kernels whatever n is."""
    beta1, beta2 = group["betas"]
    states = [state[p] for p in params]
    masters = [s.get("master", p) for p, s in zip(params, states)]
    exp_avgs = [s["exp_avg"] for s in states]
    d, r = params[0].shape
    dtype = exp_avgs[0].dtype
    # B and m side by side in one scratch buffer: the Cayley step reads [B, m] as a whole, with no extra copy.
    packed = torch.empty((len(params), d, 2 * r), dtype=dtype, device=params[0].device)  # (n, d, 2r)
    B, m = packed[..., :r], packed[..., r:]  # (n, d, r) views
    torch._foreach_copy_(list(B.unbind(0)), masters)
    torch._foreach_copy_(list(m.unbind(0)), exp_avgs)
    G = torch.stack(grads).to(dtype)  # (n, d, r)
    v = torch.stack([s["exp_avg_sq"] for s in states])  # (n,)
    step = torch.stack([s["step"] for s in states])  # (n,)
    skipped = torch.stack([s["skipped_steps"] for s in states])  # (n,)

    grad_sq = G.square().sum(dim=(-2, -1))  # (n,) inf/nan iff some entry is (or the norm overflows)
    finite = torch.isfinite(grad_sq)
    live = finite.to(dtype)  # (n,) 1 = step, 0 = skip
    G.masked_fill_(~finite[:, None, None], 0.0)
    step += live
    skipped += (~finite).long()
    m.lerp_(G, (1 - beta1) * live[:, None, None])
    v.lerp_(torch.where(finite, grad_sq, 0.0), (1 - beta2) * live)

    # W is linear in m, so the bias-corrected W(m̂)/(√v̂ + ε) step of size lr is a step of size tau along W(m).
    t = step.to(dtype).clamp_min(1.0)
    bias1, bias2 = 1 - beta1**t, 1 - beta2**t
    tau = live * group["lr"] / (bias1 * ((v / bias2).sqrt() + group["eps"]))  # (n,) 0 where skipped
    coef = cayley_coefficients(packed, tau, solver=group["cayley_solver"], iters=group["cayley_iters"])
    # Applied as B + [B, m] (P_B − e_B): adding a small step to B keeps ~10x less drift than forming [B, m] P_B.
    # A skipped matrix gets a zero step and keeps m: products with exact 0 and 1 reproduce both bit for bit.
    e_b = torch.eye(2 * r, r, dtype=dtype, device=coef.device)  # (2r, r): B = [B, m] e_b
    e_m = torch.eye(2 * r, dtype=dtype, device=coef.device)[:, r:]  # (2r, r): m = [B, m] e_m
    coef = torch.where(finite[:, None, None], coef - torch.cat((e_b, 0 * e_b), -1), torch.cat((0 * e_b, e_m), -1))
    out = packed @ coef  # (n, d, 2r): [B_{t+1} − B_t, W(m) B_{t+1}]
    # The first moment becomes W(m) B_{t+1}: its tangent part, carried to the new point.
    B, m = B + out[..., :r], out[..., r:]
    if reproject:
        B = torch.where(finite[:, None, None], qr_retraction(B), B)

    torch._foreach_copy_(masters, list(B.unbind(0)))
    low_precision = [(p, b) for p, s, b in zip(params, states, B.unbind(0)) if "master" in s]
    if low_precision:
        torch._foreach_copy_([p for p, _ in low_precision], [b for _, b in low_precision])
    torch._foreach_copy_(exp_avgs, list(m.unbind(0)))
    for key, values in (("exp_avg_sq", v), ("step", step), ("skipped_steps", skipped)):
        torch._foreach_copy_([s[key] for s in states], list(values.unbind(0)))


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
        super().__init__(params, defaults={})

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
        _restore_fp32_state(self, state_dict)
        self._sync_delegates()

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
        return _count_skipped(self)


# Weight decay skips biases and normalisation weights, as transformers.Trainer.get_decay_parameter_names does.
_NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def _decay_parameter_names(model: nn.Module) -> set[str]:
    from transformers.trainer_pt_utils import get_parameter_names

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
    cayley_solver: str = "exact",
    cayley_iters: int = 5,
    stiefel_params: Collection[torch.Tensor] | None = None,
    decay_parameter_names: Collection[str] | None = None,
    **adamw_kwargs: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The param groups of FoRA's optimizer for ``model``, with the AdamW and the Cayley-Adam defaults.

    Groups, in order: AdamW with ``weight_decay`` (lora_A and other trainable weights), AdamW without decay
    (biases, norms), and the Stiefel group (Cayley-Adam at ``lr_stiefel``). Empty groups are left out; HF logs the
    first group's lr. Stiefel parameters are ``stiefel_params`` if given, else every ``lora_B`` made Stiefel by
    :func:`fora_plugin.make_stiefel`. ``decay_parameter_names`` defaults to HF Trainer's rule; a trainer passes its
    own ``get_decay_parameter_names(model)``. Extra keyword arguments go to AdamW (e.g. ``foreach``, ``fused``).
    """
    from .adapter import stiefel_parameters

    if stiefel_params is None:
        stiefel_params = [p for _, p in stiefel_parameters(model)]
    stiefel_ids = {id(p) for p in stiefel_params}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable_ids = {id(p) for _, p in trainable}
    frozen = [p for p in stiefel_params if id(p) not in trainable_ids]
    if frozen:
        raise ValueError(
            f"{len(frozen)} Stiefel parameter(s) (first shape {tuple(frozen[0].shape)}) are not "
            "trainable parameters of the model: set requires_grad=True or leave them out."
        )
    if not trainable:
        raise ValueError(
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
    stiefel = [p for _, p in trainable if id(p) in stiefel_ids]
    if stiefel:
        # Cayley-Adam has no weight decay (the norm is fixed on the manifold); the key is there because trainers
        # read it from every group (Axolotl's resume restores it group by group).
        groups.append({"params": stiefel, "stiefel": True, "weight_decay": 0.0})
    adamw_defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **adamw_kwargs)
    stiefel_defaults = dict(
        lr=lr_stiefel,
        betas=stiefel_betas,
        eps=stiefel_eps,
        qr_period=qr_period,
        cayley_solver=cayley_solver,
        cayley_iters=cayley_iters,
    )
    return groups, adamw_defaults, stiefel_defaults


def build_fora_optimizer(model: nn.Module, *args: Any, **kwargs: Any) -> FoRAOptimizer:
    """The single FoRA optimizer for ``model``'s trainable parameters; arguments as :func:`fora_optimizer_parts`."""
    groups, adamw_defaults, stiefel_defaults = fora_optimizer_parts(model, *args, **kwargs)
    return FoRAOptimizer(groups, adamw_defaults=adamw_defaults, stiefel_defaults=stiefel_defaults)
