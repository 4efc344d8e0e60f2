"""FoRA's client optimizer for DeepSpeed ZeRO-3: each Stiefel ``lora_B`` stays in DeepSpeed's partition and is
gathered whole, with its gradient, for its Cayley step (see :mod:`fora_plugin.zero`).

May import: errors, optim, zero.client, zero.deepspeed_internals.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..errors import FoRAInputError, FoRAInputTypeError
from ..optim import CayleyAdam, fora_optimizer_parts, stiefel_step_with_gradients
from .client import ZeroClientOptimizer, eager_unless_asked
from .deepspeed_internals import (
    clip_norm,
    full_shape,
    partition_numel,
    zero3_optimizer,
    zero3_sub_group,
    zero3_sub_groups_holding,
    zero_grad_norm,
)


__all__ = ["Zero3FoRAOptimizer", "build_zero3_fora_optimizer"]

# torch 2.13 renamed it (and warns at every call of the old name); older versions have only the old one.
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Marks a Stiefel group of Zero3FoRAOptimizer with the index of its CayleyAdam group (survives load_state_dict).
_STIEFEL_INDEX = "fora_stiefel_index"
# The Cayley-Adam hyperparameters a group can carry: CayleyAdam's own keyword arguments (num_experts included, which
# makes each expert's (d_out, r) block of a fused-MoE lora_B its own Stiefel matrix).
_CAYLEY_KEYS = tuple(name for name in inspect.signature(CayleyAdam).parameters if name != "params")


class Zero3FoRAOptimizer(ZeroClientOptimizer):
    """The client optimizer to hand DeepSpeed ZeRO-3: AdamW groups, and Stiefel groups stepped whole by Cayley-Adam.

    Unlike ZeRO-1/2 (:class:`~fora_plugin.zero.ZeroFoRAOptimizer`), the Stiefel ``lora_B`` stay in DeepSpeed's groups
    here: ZeRO-3 partitions every parameter, the module's included, so a replica beside the partition would undo what
    ZeRO-3 is for. DeepSpeed then gives ``lora_B``'s gradients its own reduce-scatter, clips every group by one global
    norm (``gradient_clipping``: lora_A and lora_B together, before the client's ``step``) and skips the whole step on
    all ranks when that norm is not finite. What ZeRO-3 hands the client for a group is one flat fp32 partition per
    sub-group, cut without regard to rows, so the Cayley step for a Stiefel group:

    - all-gathers the sub-group's fp32 partition and its (averaged, clipped) gradient in one collective, and cuts
      every whole ``lora_B`` and its gradient out of it (DeepSpeed's layout: rank k holds elements
      ``[kP, (k+1)P)`` of each parameter, ``P = ceil(numel / world)``);
    - runs the ordinary Cayley-Adam step (:func:`~fora_plugin.optim.stiefel_step_with_gradients`) on every rank
      alike, on fp32 copies (the Gram matrices and the 2r x 2r solve need fp32), at the group's scheduled lr;
    - writes each rank's own slice of the new ``lora_B`` back into the fp32 partition, which DeepSpeed copies into the
      module's (bf16) partition right after.

    Every rank holds the full fp32 ``lora_B`` (``stiefel_parameters``, refreshed from the partition at each step)
    and its Cayley-Adam moments: 2 x 4 bytes per ``lora_B`` entry, small next to the model (a 4096 x 32 ``lora_B`` is
    0.5 MB). ``lora_B`` itself cannot drift between ranks: the partition is the truth and is gathered again at every
    step. The Cayley state is kept out of DeepSpeed's checkpoint like under ZeRO-1/2:
    :meth:`stiefel_state_dict` / :meth:`load_stiefel_state_dict` (``lora_B`` itself comes back with DeepSpeed's
    checkpoint, in the fp32 partition, and is gathered at each step).

    Args:
        params: param groups; a group with ``"stiefel": True`` is stepped by Cayley-Adam.
        stiefel_defaults: :class:`~fora_plugin.optim.CayleyAdam` keyword arguments for the Stiefel groups.
        max_grad_norm: the clipping norm the run asks for; :meth:`bind` checks that DeepSpeed's
            ``gradient_clipping`` is the same (DeepSpeed does the clipping under ZeRO-3).
        **adamw_kwargs: ``torch.optim.AdamW`` keyword arguments for the other groups.
    """

    zero_stage = 3
    engine = "ZeRO-3"

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        stiefel_defaults: Mapping[str, Any] | None = None,
        *,
        max_grad_norm: float = 0.0,
        **adamw_kwargs: Any,
    ) -> None:
        groups = [dict(group) for group in params]
        stiefel_defaults = eager_unless_asked(stiefel_defaults or {})
        stiefel_groups = []
        for group in groups:
            if group.get("stiefel"):
                # The Cayley hyperparameters ride in DeepSpeed's group, so the LR scheduler scales this group's lr
                # like the AdamW groups' and DeepSpeed's checkpoint keeps them.
                for key, value in stiefel_defaults.items():
                    group.setdefault(key, value)
                group[_STIEFEL_INDEX] = len(stiefel_groups)
                stiefel_groups.append(group)
        super().__init__(groups, max_grad_norm=max_grad_norm, **adamw_kwargs)
        # One fp32 (d, r) tensor per lora_B, keyed by the module's parameter: the point Cayley-Adam steps. Under
        # zero.Init the parameter is already partitioned (its own shape is empty).
        self._full: dict[torch.Tensor, torch.Tensor] = {}
        cayley_groups = []
        for group in stiefel_groups:
            full = [self._full_copy(p) for p in group["params"]]
            self._full.update(zip(group["params"], full))
            hyper = {key: group[key] for key in _CAYLEY_KEYS if key in group}
            cayley_groups.append({"params": full, **hyper})
        if not cayley_groups:
            raise FoRAInputError(
                "Zero3FoRAOptimizer got no group with stiefel=True: build the ordinary optimizer "
                "(build_fora_optimizer) for a model without Stiefel lora_B."
            )
        self.stiefel = CayleyAdam(cayley_groups)
        self.bytes_gathered = 0  # what this rank received in the Stiefel all-gathers, for the cost figures

    @staticmethod
    def _full_copy(p: torch.Tensor) -> torch.Tensor:
        shape = full_shape(p)
        if len(shape) != 2:
            raise FoRAInputError(f"A Stiefel lora_B has shape {shape}: Cayley-Adam steps 2-D (d_out, r) matrices.")
        if tuple(p.shape) == shape:
            return p.detach().float().clone()
        return torch.zeros(shape, dtype=torch.float32, device=p.device)  # partitioned: filled at the first step

    def _zero3_optimizer(self) -> Any | None:
        return zero3_optimizer(next(iter(self._full)))

    def last_grad_norm_unread(self) -> torch.Tensor | float | None:
        # DeepSpeed's norm over every group (lora_A and lora_B); inf for a step it skipped.
        return zero_grad_norm(self._zero3_optimizer())

    def stiefel_points(self) -> dict[torch.Tensor, torch.Tensor]:
        """The module's ``lora_B`` parameters -> their full fp32 values (the points on the manifold, as of the last
        step): what a log of the orthogonality drift reads, where the module's own copy is partitioned or bf16."""
        return dict(self._full)

    def _bind(self, engine_optimizer: Any) -> None:
        """Check DeepSpeed's ZeRO-3 optimizer against FoRA's settings. Under ZeRO-3 DeepSpeed's own clipping is the
        right one (one norm over every group it holds, lora_B included), so its ``clip_grad`` must equal
        ``max_grad_norm``; a Stiefel group must fit in one sub-group."""
        clip = clip_norm(engine_optimizer)
        if not math.isclose(clip, self.max_grad_norm):
            raise FoRAInputError(
                f"DeepSpeed's gradient_clipping={clip} differs from FoRA's max_grad_norm={self.max_grad_norm}: under "
                "ZeRO-3 DeepSpeed clips lora_A and lora_B by one norm, so set gradient_clipping to max_grad_norm "
                '("auto" under HF Trainer).'
            )
        for group in self.param_groups:
            if group.get("stiefel"):
                self._check_one_sub_group(engine_optimizer, group)

    def _check_one_sub_group(self, zero: Any, group: dict[str, Any]) -> None:
        index = group[_STIEFEL_INDEX]
        members = {id(p) for p in self.stiefel.param_groups[index]["params"]}
        params = [p for p, full in self._full.items() if id(full) in members]
        found = zero3_sub_groups_holding(zero, params)
        if len(found) > 1:
            numel = sum(full.numel() for full in self.stiefel.param_groups[index]["params"])
            raise FoRAInputError(
                f"zero_optimization.sub_group_size splits FoRA's Stiefel group ({numel} elements) over {len(found)} "
                f"sub-groups: set sub_group_size >= {numel} (DeepSpeed's default is 1e9)."
            )

    def step_stiefel(self) -> None:
        # DeepSpeed calls step() once per sub-group, with only that sub-group's flat partition in its group's params
        # (bind() checks that a Stiefel group lies in one sub-group): each Cayley group steps once per step.
        stiefel = [group for group in self.param_groups if group.get("stiefel")]
        for group in stiefel:
            for flat in group["params"]:
                self._step_sub_group(group, flat)
        if any(group[_STIEFEL_INDEX] == 0 and group["params"] for group in stiefel):
            self.steps += 1  # counted at the first Stiefel group's call: one per optimizer step, however many groups

    def step_euclidean(self, closure=None):
        # AdamW steps the other groups; DeepSpeed restores every group's params list after the call.
        stiefel = [group for group in self.param_groups if group.get("stiefel")]
        held = [group["params"] for group in stiefel]
        for group in stiefel:
            group["params"] = []
        try:
            return super().step_euclidean(closure)
        finally:
            for group, params in zip(stiefel, held):
                group["params"] = params

    def _step_sub_group(self, group: dict[str, Any], flat: torch.Tensor) -> None:
        """Gather whole lora_B and gradients of one sub-group, Cayley-Adam step, write this rank's slice back."""
        sub_group = zero3_sub_group(self._zero3_optimizer(), flat)
        if sub_group is None:
            raise FoRAInputTypeError(
                "Zero3FoRAOptimizer.step() got a Stiefel group that is not a DeepSpeed ZeRO-3 partition: hand it to "
                "deepspeed.initialize with zero_optimization.stage=3 (use build_fora_optimizer without DeepSpeed)."
            )
        if flat.grad is None:
            return
        params, process_group = sub_group
        world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        sizes = [partition_numel(p) for p in params]
        local = torch.stack((flat.detach().float(), flat.grad.float()))  # (2, S): fp32 partition and its gradient
        gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
        _all_gather_into_tensor(gathered, local.reshape(-1), group=process_group)
        gathered = gathered.view(world, *local.shape)  # (W, 2, S)
        self.bytes_gathered += (world - 1) * local.numel() * local.element_size()
        grads = {}
        for p, whole in zip(params, gathered.split(sizes, dim=-1)):  # whole: (W, 2, P)
            full = self._full[p]
            both = whole.transpose(0, 1).reshape(2, -1)[:, : full.numel()]  # (2, numel): rank k's slice at kP
            full.copy_(both[0].view_as(full))
            grads[full] = both[1].view_as(full)
        cayley = self.stiefel.param_groups[group[_STIEFEL_INDEX]]
        cayley["lr"] = group["lr"]  # the LR schedule's value for this group
        # This group's Cayley group alone: stepping them all here would advance the other groups' step counts
        # (and so their periodic QR) once per sub-group.
        stiefel_step_with_gradients(self.stiefel, grads, groups=[cayley])
        offset = 0
        for p, size in zip(params, sizes):
            new = self._full[p].reshape(-1)
            start = rank * size
            valid = max(0, min(size, new.numel() - start))  # the last slice may be partly padding
            flat.data[offset : offset + valid].copy_(new[start : start + valid])
            offset += size


def build_zero3_fora_optimizer(
    model: torch.nn.Module, *args: Any, max_grad_norm: float = 0.0, **kwargs: Any
) -> Zero3FoRAOptimizer:
    """FoRA's optimizer for ``model`` as a DeepSpeed ZeRO-3 client; other arguments as
    :func:`fora_plugin.optim.fora_optimizer_parts`, so the groups and rates equal those of the single-process one."""
    groups, adamw_defaults, stiefel_defaults = fora_optimizer_parts(model, *args, **kwargs)
    return Zero3FoRAOptimizer(groups, stiefel_defaults, max_grad_norm=max_grad_norm, **adamw_defaults)
