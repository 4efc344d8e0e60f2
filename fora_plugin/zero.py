"""FoRA under DeepSpeed: ZeRO-1/2 with the Stiefel ``lora_B`` replicated beside the partition, ZeRO-3 with each
``lora_B`` gathered whole for its step (:class:`Zero3FoRAOptimizer`, :func:`zero3_scoring_engine`).

ZeRO-1/2 flattens each group of the client optimizer into one fp32 vector, gives every rank a slice of it, and calls
the client's ``step`` on the slices: a Cayley step, which needs a whole ``lora_B``, cannot run there. So
:class:`ZeroFoRAOptimizer` shows DeepSpeed only the Euclidean groups (``lora_A`` and any other trainable parameter),
which are partitioned and stepped by AdamW as usual, and keeps every Stiefel ``lora_B`` out of the partition:

- each rank holds all of them (small: a 4096 x 32 ``lora_B`` is 0.5 MB in fp32);
- at the gradient-accumulation boundary (the only time DeepSpeed calls the client's ``step``) their gradients are
  averaged over the data-parallel ranks in one all-reduce;
- gradient clipping uses one norm over ``lora_A``'s and ``lora_B``'s gradients, as ``max_grad_norm`` does without
  DeepSpeed, so :meth:`ZeroFoRAOptimizer.bind` turns the clipping of DeepSpeed's ZeRO optimizer (``lora_A`` by its
  own norm) off;
- every rank applies the same Cayley-Adam step from its fp32 master (DeepSpeed's bf16 mode makes the module's
  parameters bf16), with ``lr_stiefel`` scaled by the same LR-schedule factor as the AdamW groups;
- every ``sync_period`` steps rank 0 broadcasts ``lora_B``, its master and its moments, so that no float
  difference between ranks can build up (the all-reduce hands every rank the same values, so there is none
  expected).

The Cayley state is not in DeepSpeed's checkpoint (DeepSpeed's elastic checkpoints keep only the partitioned groups):
:meth:`ZeroFoRAOptimizer.stiefel_state_dict` / :meth:`~ZeroFoRAOptimizer.load_stiefel_state_dict` save and restore
it; FoRASFTTrainer writes it to ``STIEFEL_STATE_FILE`` in every checkpoint and reads it back on resume.

Under ZeRO-3 every parameter is partitioned, lora_B included: :class:`Zero3FoRAOptimizer` keeps lora_B in
DeepSpeed's groups (its reduce-scatter, its one clipping norm, its skip of a non-finite step) and gathers each whole
lora_B with its gradient for the Cayley step; :func:`zero3_scoring_engine` runs the Fisher scoring on a model that
``zero.Init`` partitioned.

:func:`check_deepspeed_config` names the DeepSpeed settings that would silently turn FoRA into something else.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import AdamW

from .config import FoRAConfig
from .errors import refuse
from .optim import CayleyAdam, fora_optimizer_parts, stiefel_step_with_gradients
from .validation import read_json


__all__ = [
    "STIEFEL_STATE_FILE",
    "Zero3FoRAOptimizer",
    "ZeroFoRAOptimizer",
    "build_zero3_fora_optimizer",
    "build_zero_fora_optimizer",
    "find_zero_client",
    "gathered_trainable_parameters",
    "check_deepspeed_config",
    "join_deepspeed_process_group",
    "deepspeed_zero_stage",
    "load_deepspeed_config",
    "zero3_scoring_engine",
]

# Marks the first Euclidean group (see ZeroFoRAOptimizer.__init__).
_FIRST_GROUP = "fora_first_group"
# Where FoRASFTTrainer keeps the Cayley-Adam state in a DeepSpeed checkpoint folder.
STIEFEL_STATE_FILE = "fora_stiefel_optimizer.pt"


class ZeroFoRAOptimizer(AdamW):
    """The client optimizer to hand DeepSpeed ZeRO-1/2: AdamW on the Euclidean groups, Cayley-Adam on the side.

    ``param_groups`` holds only the Euclidean groups: DeepSpeed partitions those. The Stiefel group lives in
    ``self.stiefel`` (a :class:`CayleyAdam`) and is stepped, whole and replicated, when DeepSpeed steps the first
    Euclidean group. After ``deepspeed.initialize`` (and after loading a DeepSpeed checkpoint) call :meth:`bind`
    with the engine's optimizer, whose gradient norm over the Euclidean partitions the clipping needs.

    DeepSpeed calls the client's ``step`` only for a step it takes: if it skips one (an fp16 overflow, which FoRA's
    config checks refuse), the Stiefel gradients stay until the engine's ``zero_grad`` (HF Trainer calls it).

    Args:
        params: the Euclidean param groups (AdamW).
        stiefel: the Cayley-Adam optimizer of the Stiefel ``lora_B``.
        max_grad_norm: clip the gradients of both parts by one global norm; 0 = no clipping.
        sync_period: broadcast the Stiefel state from rank 0 every ``sync_period`` steps; 0 = never.
        process_group: the data-parallel group (default: the bound DeepSpeed optimizer's, else the whole world).
        **adamw_kwargs: ``torch.optim.AdamW`` keyword arguments (lr, betas, eps, weight_decay, ...).
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        stiefel: CayleyAdam,
        *,
        max_grad_norm: float = 0.0,
        sync_period: int = 200,
        process_group: dist.ProcessGroup | None = None,
        **adamw_kwargs: Any,
    ) -> None:
        super().__init__(params, **adamw_kwargs)
        if any(group.get("stiefel") for group in self.param_groups):
            raise ValueError(
                "ZeroFoRAOptimizer got a group with stiefel=True in params: DeepSpeed would flatten it. Pass the "
                "Stiefel lora_B through `stiefel` (a CayleyAdam) instead."
            )
        if not isinstance(max_grad_norm, (int, float)) or max_grad_norm < 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} is invalid: use a float >= 0 (0 = no clipping).")
        if isinstance(sync_period, bool) or not isinstance(sync_period, int) or sync_period < 0:
            raise ValueError(f"sync_period={sync_period!r} is invalid: use an int >= 0 (0 = never broadcast).")
        self.stiefel = stiefel
        self.max_grad_norm = float(max_grad_norm)
        self.sync_period = sync_period
        self.process_group = process_group
        # DeepSpeed shows param_groups one group at a time while it steps them: the first group tells "a new
        # optimizer step starts", and its lr / base lr is the LR schedule's factor. A key, not the dict's identity,
        # marks it: load_state_dict (DeepSpeed's resume) replaces the dicts.
        self.param_groups[0][_FIRST_GROUP] = True
        self._base_lr = self.param_groups[0]["lr"]
        self._stiefel_base_lrs = [group["lr"] for group in stiefel.param_groups]
        self._engine_optimizer = None
        # The clip factor (a 0-dim tensor on the device; None = no clipping) and the norm it came from: kept on the
        # device, so that a step reads nothing back to the host.
        self._clip_coef: torch.Tensor | None = None
        self._last_grad_norm: torch.Tensor | None = None
        self.steps = 0

    def bind(self, engine_optimizer: Any) -> None:
        """Hand over the DeepSpeed ZeRO optimizer that wraps this one (``engine.optimizer``).

        Its ``_global_grad_norm``, which DeepSpeed's engine reads as well, is the norm of the Euclidean gradients
        over all ranks, computed before the client's ``step`` is called. Its own clipping (``clip_grad``, from
        ``gradient_clipping``, by that norm alone) is turned off: this optimizer clips both parts by one norm. Call
        it again after a DeepSpeed checkpoint load, which restores ``clip_grad``.
        """
        if not hasattr(engine_optimizer, "_global_grad_norm") or not hasattr(engine_optimizer, "clip_grad"):
            raise TypeError(
                f"{type(engine_optimizer).__name__} has no _global_grad_norm / clip_grad: bind() takes the DeepSpeed "
                "ZeRO-1/2 optimizer (engine.optimizer) that wraps this ZeroFoRAOptimizer."
            )
        engine_optimizer.clip_grad = 0.0
        if self.process_group is None:
            self.process_group = getattr(engine_optimizer, "dp_process_group", None)
        self._engine_optimizer = engine_optimizer

    @property
    def stiefel_parameters(self) -> list[torch.Tensor]:
        return [p for group in self.stiefel.param_groups for p in group["params"]]

    @property
    def last_grad_norm(self) -> float | None:
        """The norm of the last step's gradients, lora_A's and lora_B's together (one host read: for logs)."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.param_groups[0][_FIRST_GROUP] = True

    @torch.no_grad()
    def step(self, closure=None):
        first = next((group for group in self.param_groups if group.get(_FIRST_GROUP)), None)
        if first is not None:
            self._clip_coef = self._stiefel_step(first["lr"])
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self._clip_coef is not None and grads:
            # Always multiplied (by exactly 1 when the norm is below max_grad_norm), as clip_grad_norm_ does: a test
            # of the factor would read it back to the host. Offloaded partitions sit on the CPU.
            torch._foreach_mul_(grads, self._clip_coef.to(grads[0].device))
        return super().step(closure)

    def _stiefel_step(self, lr: float) -> torch.Tensor | None:
        """Average, clip and apply the Stiefel gradients; returns the clip factor for the Euclidean slices (None
        without clipping). Nothing is read back to the host: the norm and the factor stay tensors."""
        params = self.stiefel_parameters
        grads = _averaged_gradients(params, self.process_group)  # fp32 or None (no rank had one); one all-reduce
        live = [g for g in grads if g is not None]
        coef = None
        euclid = self._euclidean_grad_norm()
        if euclid is not None:
            device = params[0].device
            euclid = torch.as_tensor(euclid, dtype=torch.float32, device=device)  # DeepSpeed's: a tensor or a float
            # One norm over both parts, as clip_grad_norm_ forms it: the norm of the per-part norms.
            stiefel_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(live))) if live else 0 * euclid
            self._last_grad_norm = total = torch.linalg.vector_norm(torch.stack((euclid, stiefel_norm)))
            if self.max_grad_norm > 0:
                # torch.nn.utils.clip_grad_norm_'s rule, which HF Trainer applies without DeepSpeed. A NaN norm (a
                # lora_B with a non-finite gradient: DeepSpeed never sees it) clips nothing; that lora_B alone skips
                # its step in Cayley-Adam.
                coef = (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0).nan_to_num(nan=1.0)
                if live:
                    torch._foreach_mul_(live, coef)
        factor = lr / self._base_lr if self._base_lr else 1.0
        for group, base_lr in zip(self.stiefel.param_groups, self._stiefel_base_lrs):
            group["lr"] = base_lr * factor
        # A lora_B no rank has a gradient for is left alone, as CayleyAdam does with p.grad None.
        stiefel_step_with_gradients(self.stiefel, {p: g for p, g in zip(params, grads) if g is not None})
        for p in params:
            p.grad = None  # DeepSpeed zeroes only the gradients it partitions
        self.steps += 1
        if self.sync_period and self.steps % self.sync_period == 0:
            self.broadcast_stiefel_state()
        return coef

    def _euclidean_grad_norm(self) -> torch.Tensor | float | None:
        """DeepSpeed's norm of the partitioned gradients (as DeepSpeed keeps it: a tensor, or a float such as inf
        for a step it skips); None where it is not needed and not there."""
        if self._engine_optimizer is None:
            if self.max_grad_norm > 0:
                raise ValueError(
                    "ZeroFoRAOptimizer.step() needs the Euclidean gradient norm to clip with max_grad_norm="
                    f"{self.max_grad_norm}, and was not bound: call bind(engine.optimizer) after deepspeed.initialize "
                    "(an HF Trainer: fora_plugin.trainer.prepare_deepspeed does it), or set max_grad_norm=0."
                )
            return None
        norm = self._engine_optimizer._global_grad_norm
        if norm is None and self.max_grad_norm > 0:
            raise ValueError(
                "DeepSpeed computed no gradient norm (zero_optimization.compute_grad_norm=false), but FoRA clips "
                f"lora_A and lora_B by one norm (max_grad_norm={self.max_grad_norm}): set compute_grad_norm true, or "
                "max_grad_norm 0."
            )
        return norm

    @torch.no_grad()
    def broadcast_stiefel_state(self) -> None:
        """Give every rank rank 0's ``lora_B``, fp32 master and Cayley-Adam moments."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        tensors = self.stiefel.state_tensors()
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for tensor in tensors:
            # A collective writes only into contiguous memory; the step's own state always is, a lora_B may not be.
            buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
            dist.broadcast(buffer, src=src, group=self.process_group)
            if buffer is not tensor:
                tensor.copy_(buffer)

    def stiefel_state_dict(self) -> dict[str, Any]:
        """The Cayley-Adam state (moments, fp32 masters, step counts), the same on every rank."""
        return {"stiefel": self.stiefel.state_dict(), "steps": self.steps}

    def load_stiefel_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.stiefel.load_state_dict(state_dict["stiefel"])
        self.steps = int(state_dict["steps"])
        # DeepSpeed restored the module's (possibly bf16) lora_B: the fp32 master is the point on the manifold.
        with torch.no_grad():
            for p in self.stiefel_parameters:
                master = self.stiefel.state.get(p, {}).get("master")
                if master is not None:
                    p.copy_(master)


def build_zero_fora_optimizer(
    model: torch.nn.Module,
    *args: Any,
    max_grad_norm: float = 0.0,
    sync_period: int = 200,
    process_group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> ZeroFoRAOptimizer:
    """FoRA's optimizer for ``model`` as a DeepSpeed ZeRO-1/2 client; other arguments as
    :func:`fora_plugin.optim.fora_optimizer_parts`, so the groups and rates equal those of the single-process one."""
    groups, adamw_defaults, stiefel_defaults = fora_optimizer_parts(model, *args, **kwargs)
    euclidean = [group for group in groups if not group.get("stiefel")]
    stiefel = [group for group in groups if group.get("stiefel")]
    if not stiefel:
        raise ValueError(
            "The model has no Stiefel lora_B (fora_plugin.make_stiefel marks them): build the ordinary optimizer "
            "(build_fora_optimizer) for it; DeepSpeed partitions all of its groups as usual."
        )
    if not euclidean:
        raise ValueError(
            "Every trainable parameter is a Stiefel lora_B: DeepSpeed needs at least one parameter to partition "
            "(lora_A is one). Check that lora_A is trainable."
        )
    return ZeroFoRAOptimizer(
        euclidean,
        CayleyAdam(stiefel, **stiefel_defaults),
        max_grad_norm=max_grad_norm,
        sync_period=sync_period,
        process_group=process_group,
        **adamw_defaults,
    )


def find_zero_client(optimizer: Any) -> ZeroFoRAOptimizer | Zero3FoRAOptimizer | None:
    """FoRA's DeepSpeed client optimizer inside a trainer's optimizer (accelerate's wrapper, then DeepSpeed's)."""
    for _ in range(3):
        if isinstance(optimizer, (ZeroFoRAOptimizer, Zero3FoRAOptimizer)):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _averaged_gradients(params: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor | None]:
    """fp32 gradients of ``params`` averaged over the ranks of ``group`` (one flat all-reduce), as DDP averages:
    a rank without a gradient for a parameter adds zeros; None for a parameter no rank has a gradient for."""
    if not params:
        return []
    # Every rank sends the same layout: the gradients (zeros where absent), then one has-gradient count each.
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1) for p in params]
        + [torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)]
    )
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        if world > 1:
            dist.all_reduce(flat, group=group)
            flat[: -len(params)].div_(world)
    *grads, counts = flat.split([p.numel() for p in params] + [len(params)])
    if all(p.grad is not None for p in params):
        # This rank has every gradient, so every rank steps every lora_B: nothing to read back to the host.
        return [g.view_as(p) for g, p in zip(grads, params)]
    # A lora_B this rank has no gradient for (unused in its forwards): whether another rank has one is on the
    # device, and one host read tells (only in this case, never in an ordinary step).
    return [g.view_as(p) if count > 0 else None for g, p, count in zip(grads, params, counts.tolist())]


# --------------------------------------------------------------------------------------------------- ZeRO-3
class Zero3FoRAOptimizer(AdamW):
    """The client optimizer to hand DeepSpeed ZeRO-3: AdamW groups, and Stiefel groups stepped whole by Cayley-Adam.

    Unlike ZeRO-1/2 (:class:`ZeroFoRAOptimizer`), the Stiefel ``lora_B`` stay in DeepSpeed's groups here: ZeRO-3
    partitions every parameter, the module's included, so a replica beside the partition would undo what ZeRO-3 is
    for. DeepSpeed then gives ``lora_B``'s gradients its own reduce-scatter, clips every group by one global norm
    (``gradient_clipping``: lora_A and lora_B together, before the client's ``step``) and skips the whole step on all
    ranks when that norm is not finite. What ZeRO-3 hands the client for a group is one flat fp32 partition per
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
    :meth:`stiefel_state_dict` / :meth:`load_stiefel_state_dict`.

    Args:
        params: param groups; a group with ``"stiefel": True`` is stepped by Cayley-Adam.
        stiefel_defaults: :class:`~fora_plugin.optim.CayleyAdam` keyword arguments for the Stiefel groups.
        max_grad_norm: the clipping norm the run asks for; :meth:`bind` checks that DeepSpeed's
            ``gradient_clipping`` is the same (DeepSpeed does the clipping under ZeRO-3).
        **adamw_kwargs: ``torch.optim.AdamW`` keyword arguments for the other groups.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        stiefel_defaults: Mapping[str, Any] | None = None,
        *,
        max_grad_norm: float = 0.0,
        **adamw_kwargs: Any,
    ) -> None:
        if not isinstance(max_grad_norm, (int, float)) or max_grad_norm < 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} is invalid: use a float >= 0 (0 = no clipping).")
        groups = [dict(group) for group in params]
        stiefel_defaults = dict(stiefel_defaults or {})
        stiefel_groups = []
        for group in groups:
            if group.get("stiefel"):
                # The Cayley hyperparameters ride in DeepSpeed's group, so the LR scheduler scales this group's lr
                # like the AdamW groups' and DeepSpeed's checkpoint keeps them.
                for key, value in stiefel_defaults.items():
                    group.setdefault(key, value)
                group[_STIEFEL_INDEX] = len(stiefel_groups)
                stiefel_groups.append(group)
        super().__init__(groups, **adamw_kwargs)
        # One fp32 (d, r) tensor per lora_B, keyed by the module's parameter: the point Cayley-Adam steps. Under
        # zero.Init the parameter is already partitioned (its shape is empty; ds_shape holds the real one).
        self._full: dict[torch.Tensor, torch.Tensor] = {}
        cayley_groups = []
        for group in stiefel_groups:
            full = [self._full_copy(p) for p in group["params"]]
            self._full.update(zip(group["params"], full))
            hyper = {key: group[key] for key in _CAYLEY_KEYS if key in group}
            cayley_groups.append({"params": full, **hyper})
        if not cayley_groups:
            raise ValueError(
                "Zero3FoRAOptimizer got no group with stiefel=True: build the ordinary optimizer "
                "(build_fora_optimizer) for a model without Stiefel lora_B."
            )
        self.stiefel = CayleyAdam(cayley_groups)
        self.max_grad_norm = float(max_grad_norm)
        self.steps = 0
        self.bytes_gathered = 0  # what this rank received in the Stiefel all-gathers, for the cost figures

    @staticmethod
    def _full_copy(p: torch.Tensor) -> torch.Tensor:
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if len(shape) != 2:
            raise ValueError(f"A Stiefel lora_B has shape {shape}: Cayley-Adam steps 2-D (d_out, r) matrices.")
        if tuple(p.shape) == shape:
            return p.detach().float().clone()
        return torch.zeros(shape, dtype=torch.float32, device=p.device)  # partitioned: filled at the first step

    @property
    def stiefel_parameters(self) -> list[torch.Tensor]:
        """The full fp32 ``lora_B`` (every rank holds them all), as of the last step."""
        return [p for group in self.stiefel.param_groups for p in group["params"]]

    @property
    def last_grad_norm(self) -> float | None:
        """DeepSpeed's norm over every group (lora_A and lora_B) of the last step; inf for a step it skipped."""
        zero = getattr(next(iter(self._full)), "_z3_optimizer", None)
        norm = getattr(zero, "_global_grad_norm", None)
        return None if norm is None else float(norm)

    def stiefel_points(self) -> dict[torch.Tensor, torch.Tensor]:
        """The module's ``lora_B`` parameters -> their full fp32 values (the points on the manifold, as of the last
        step): what a log of the orthogonality drift reads, where the module's own copy is partitioned or bf16."""
        return dict(self._full)

    def bind(self, engine_optimizer: Any) -> None:
        """Check the DeepSpeed ZeRO-3 optimizer wrapping this one (``engine.optimizer``) against FoRA's settings.

        Under ZeRO-3 DeepSpeed's own clipping is the right one (one norm over every group it holds, lora_B
        included), so its ``clip_grad`` must equal ``max_grad_norm``; a Stiefel group must fit in one sub-group.
        """
        for attribute in ("fp16_groups", "fp32_partitioned_groups_flat", "sub_group_process_groups", "clip_grad"):
            if not hasattr(engine_optimizer, attribute):
                raise TypeError(
                    f"{type(engine_optimizer).__name__} has no {attribute}: bind() takes the DeepSpeed ZeRO-3 "
                    "optimizer (engine.optimizer) that wraps this Zero3FoRAOptimizer."
                )
        clip = float(engine_optimizer.clip_grad or 0.0)
        if not math.isclose(clip, self.max_grad_norm):
            raise ValueError(
                f"DeepSpeed's gradient_clipping={clip} differs from FoRA's max_grad_norm={self.max_grad_norm}: under "
                "ZeRO-3 DeepSpeed clips lora_A and lora_B by one norm, so set gradient_clipping to max_grad_norm "
                '("auto" under HF Trainer).'
            )
        for group in self.param_groups:
            if group.get("stiefel"):
                self._sub_groups(engine_optimizer, group)

    def _sub_groups(self, zero: Any, group: dict[str, Any]) -> list[int]:
        index = group[_STIEFEL_INDEX]
        members = {id(p) for p in self.stiefel.param_groups[index]["params"]}
        params = [p for p, full in self._full.items() if id(full) in members]
        found = sorted({i for i, sub in enumerate(zero.fp16_groups) for p in sub if any(p is q for q in params)})
        if len(found) > 1:
            numel = sum(full.numel() for full in self.stiefel.param_groups[index]["params"])
            raise ValueError(
                f"zero_optimization.sub_group_size splits FoRA's Stiefel group ({numel} elements) over {len(found)} "
                f"sub-groups: set sub_group_size >= {numel} (DeepSpeed's default is 1e9)."
            )
        return found

    @torch.no_grad()
    def step(self, closure=None):
        # DeepSpeed calls this once per sub-group, with only that sub-group's flat partition in its group's params
        # (bind() checks that a Stiefel group lies in one sub-group): each Cayley group steps once per step.
        stiefel = [group for group in self.param_groups if group.get("stiefel")]
        for group in stiefel:
            for flat in group["params"]:
                self._stiefel_step(group, flat)
        if any(group[_STIEFEL_INDEX] == 0 and group["params"] for group in stiefel):
            self.steps += 1  # counted at the first Stiefel group's call: one per optimizer step, however many groups
        # AdamW steps the other groups; DeepSpeed restores every group's params list after the call.
        held = [group["params"] for group in stiefel]
        for group in stiefel:
            group["params"] = []
        try:
            return super().step(closure)
        finally:
            for group, params in zip(stiefel, held):
                group["params"] = params

    def _stiefel_step(self, group: dict[str, Any], flat: torch.Tensor) -> None:
        """Gather whole lora_B and gradients of one sub-group, Cayley-Adam step, write this rank's slice back."""
        zero = getattr(next(iter(self._full)), "_z3_optimizer", None)
        flats = getattr(zero, "fp32_partitioned_groups_flat", ())
        sub = next((i for i, f in enumerate(flats) if f is flat), None)
        if sub is None:
            raise TypeError(
                "Zero3FoRAOptimizer.step() got a Stiefel group that is not a DeepSpeed ZeRO-3 partition: hand it to "
                "deepspeed.initialize with zero_optimization.stage=3 (use build_fora_optimizer without DeepSpeed)."
            )
        if flat.grad is None:
            return
        params = zero.fp16_groups[sub]
        process_group = zero.sub_group_process_groups[sub]
        world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        sizes = [p.partition_numel() for p in params]
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

    def stiefel_state_dict(self) -> dict[str, Any]:
        """The Cayley-Adam state (moments, step counts), the same on every rank."""
        return {"stiefel": self.stiefel.state_dict(), "steps": self.steps}

    def load_stiefel_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # lora_B itself comes back with DeepSpeed's checkpoint (the fp32 partition) and is gathered at each step.
        self.stiefel.load_state_dict(state_dict["stiefel"])
        self.steps = int(state_dict["steps"])


def deepspeed_zero_stage(trainer: Any) -> int:
    """The ZeRO stage of an HF trainer's DeepSpeed config (``zero_optimization.stage``); 0 without DeepSpeed."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return 0
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    return int((config.get("zero_optimization") or {}).get("stage", 0))


@contextlib.contextmanager
def zero3_scoring_engine(model: torch.nn.Module, deepspeed_config: Mapping[str, Any]) -> Iterator[Any]:
    """ZeRO-3's parameter gathering around ``model`` without an optimizer, for Fisher scoring before training.

    A model that ``zero.Init`` partitioned (HF's ``from_pretrained`` under a ZeRO-3 config) holds empty weights
    outside a ZeRO-3 engine, so a forward fails. This builds an optimizer-less engine on it, as TRL does for its
    ZeRO-3 reference models: its hooks gather each module's weights for forward and backward and release them after.
    Score with ``fisher_scores(..., linear_grad="activations")``: linears are scored from their inputs and output
    gradients, so no weight gradient (which the engine would neither reduce nor free) is formed. On exit the hooks
    come off (``engine.destroy()``); the parameters stay partitioned, and ``deepspeed.initialize`` can build the
    training engine on the model.

    Yields the engine (calling ``model`` itself runs through the hooks).
    """
    import deepspeed

    # HF fills some "auto" values only when it builds the training engine: leave those to DeepSpeed's defaults.
    config = {k: v for k, v in copy.deepcopy(dict(deepspeed_config)).items() if v != "auto"}
    zero = {k: v for k, v in config.get("zero_optimization", {}).items() if v != "auto"}
    config["zero_optimization"] = zero
    if zero.get("stage") != 3:
        raise ValueError(
            f"zero3_scoring_engine needs a ZeRO-3 config, got zero_optimization.stage={zero.get('stage')!r}: "
            "score a ZeRO-1/2 model directly (its weights are whole)."
        )
    # Training-only settings: without an optimizer DeepSpeed would build its own from them, and the batch sizes
    # (HF's "auto" values, or a global batch for another world size) do not apply to scoring.
    for key in ("optimizer", "scheduler", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping"):
        config.pop(key, None)
    zero.pop("offload_optimizer", None)
    config["train_micro_batch_size_per_gpu"] = 1
    engine, *_ = deepspeed.initialize(model=model, config=config)
    try:
        yield engine
    finally:
        engine.destroy()


@contextlib.contextmanager
def gathered_trainable_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Under ZeRO-3, the trainable parameters (LoRA: small) gathered whole, read-only, for diagnostics and logs;
    elsewhere nothing. Every rank must enter it (it is a collective)."""
    params = [p for p in model.parameters() if p.requires_grad and hasattr(p, "ds_id")]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        yield


# torch 2.13 renamed it (and warns at every call of the old name); older versions have only the old one.
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Marks a Stiefel group of Zero3FoRAOptimizer with the index of its CayleyAdam group (survives load_state_dict).
_STIEFEL_INDEX = "fora_stiefel_index"
# The Cayley-Adam hyperparameters a group can carry: CayleyAdam's own keyword arguments (num_experts included, which
# makes each expert's (d_out, r) block of a fused-MoE lora_B its own Stiefel matrix).
_CAYLEY_KEYS = tuple(name for name in inspect.signature(CayleyAdam).parameters if name != "params")


def build_zero3_fora_optimizer(
    model: torch.nn.Module, *args: Any, max_grad_norm: float = 0.0, **kwargs: Any
) -> Zero3FoRAOptimizer:
    """FoRA's optimizer for ``model`` as a DeepSpeed ZeRO-3 client; other arguments as
    :func:`fora_plugin.optim.fora_optimizer_parts`, so the groups and rates equal those of the single-process one."""
    groups, adamw_defaults, stiefel_defaults = fora_optimizer_parts(model, *args, **kwargs)
    return Zero3FoRAOptimizer(groups, stiefel_defaults, max_grad_norm=max_grad_norm, **adamw_defaults)


# ---------------------------------------------------------------------------------------------- launch
def join_deepspeed_process_group(args: Any) -> None:
    """Before a model loads under DeepSpeed: DeepSpeed's comm layer joins the process group the launcher's ranks
    already share, so that ``zero.Init`` (HF's ``from_pretrained`` under ZeRO-3) counts the ranks HF counts.

    On GPUs accelerate initialises DeepSpeed's comm layer itself. On CPU ranks (``use_cpu``) it sets up
    ``torch.distributed`` alone, and ``zero.Init`` then reads a world size of 1 while HF filled the batch sizes for
    all ranks: "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size". A launch
    that HF does not count as distributed at all (a CPU-only machine without ``use_cpu``: HF sees one process while
    the launcher started several) is refused by name: each rank would train the whole batch on its own.
    """
    if not getattr(args, "deepspeed", None):
        return
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    world = args.world_size  # sets up accelerate's process state (and torch.distributed under a launcher)
    if launched > 1 and world == 1:
        name = f"deepspeed={args.deepspeed!r}:" if isinstance(args.deepspeed, str) else "the deepspeed config:"
        raise ValueError(
            f"{name} the launcher started WORLD_SIZE={launched} processes, but the training "
            f"arguments count world_size={world} (use_cpu={args.use_cpu}; accelerate counts the ranks of a "
            "machine without a GPU only with use_cpu true). Set use_cpu true on a CPU-only machine, or launch on "
            "GPUs."
        )
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    from deepspeed import comm

    if not comm.is_initialized():
        comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


# ---------------------------------------------------------------------------------------------- configuration
# How a DeepSpeed config can spell fp32 (deepspeed.runtime.config.DtypeEnum).
_FP32_NAMES = ("fp32", "float32", "float", "torch.float32")


def load_deepspeed_config(deepspeed: str | Path | Mapping[str, Any], name: str = "deepspeed") -> dict[str, Any]:
    """A DeepSpeed config given as a path to a JSON file or as a dict; ``name`` is how the caller's config spells the
    setting, for the messages."""
    if isinstance(deepspeed, Mapping):
        return dict(deepspeed)
    path = Path(deepspeed)
    if not path.is_file():
        refuse(name, str(deepspeed), "it is not a file", "Give the path of a DeepSpeed JSON config.")
    return read_json(path, key=name)


def check_deepspeed_config(ds: Mapping[str, Any], fora: FoRAConfig, name: str = "deepspeed") -> None:
    """Refuse the DeepSpeed settings under which FoRA would silently become something else.

    ``name`` is how the caller's config spells the DeepSpeed setting, for the messages. ``mode="lora"`` is plain
    LoRA and accepts anything DeepSpeed does.
    """
    if fora.mode == "lora":
        return
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"{name} has zero_optimization.stage={stage!r}: use 1, 2 or 3 with FoRA (0-3 exist).")
    if not fora.uses_stiefel:
        return  # fg-lora is LoRA with AdamW on the chosen layers: DeepSpeed's ZeRO as it is.
    if stage == 0:
        raise ValueError(
            f"{name} has zero_optimization.stage=0: FoRA's Stiefel lora_B are supported under ZeRO-1, 2 and 3. "
            "Set stage 2 (example_configs/deepspeed/zero2.json), or train without DeepSpeed (plain DDP)."
        )
    if "optimizer" in ds:  # HF reads even `"optimizer": null` as a block
        kind = (ds["optimizer"] or {}).get("type")
        raise ValueError(
            f"{name} has an `optimizer` block ({kind!r}): DeepSpeed would then build its "
            "own optimizer in place of FoRA's AdamW + Cayley-Adam. Remove the block; learning_rate and "
            "lr_stiefel set the rates."
        )
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if stage == 3:
        for key in ("offload_optimizer", "offload_param"):
            device = (zero.get(key) or {}).get("device", "none")
            if device not in (None, "none"):
                raise ValueError(
                    f"{name} has zero_optimization.{key}.device={device!r} under ZeRO-3: FoRA's gathered Cayley step "
                    "for lora_B is not supported with ZeRO-3 offload. Remove the offload block "
                    "(example_configs/deepspeed/zero3.json), or use ZeRO-2 with optimizer offload "
                    "(example_configs/deepspeed/zero2_offload.json)."
                )
    elif offload not in (None, "none") and ds.get("zero_force_ds_cpu_optimizer", True):
        raise ValueError(
            f"{name} offloads the optimizer to {offload!r} with zero_force_ds_cpu_optimizer true (its default): "
            'DeepSpeed then replaces FoRA\'s optimizer by its CPU Adam. Add "zero_force_ds_cpu_optimizer": false '
            "(example_configs/deepspeed/zero2_offload.json), or remove offload_optimizer."
        )
    if (ds.get("fp16") or {}).get("enabled") is True:
        raise ValueError(
            f"{name} enables fp16 (fp16.enabled={ds['fp16']['enabled']!r}): FoRA under DeepSpeed is checked in bf16 "
            "(the paper's setting) and fp32 only; under ZeRO-1/2 the loss scaling would not reach the Stiefel "
            "lora_B. Use bf16 or fp32."
        )
    bf16_key = next((key for key in ("bf16", "bfloat16") if key in ds), "bf16")  # DeepSpeed reads both names
    accum = (ds.get("data_types") or {}).get("grad_accum_dtype")
    if (
        stage == 1
        and (ds.get(bf16_key) or {}).get("enabled") is True
        and accum in _FP32_NAMES
        and offload in (None, "none")
    ):
        # DeepSpeed's engine (_do_optimizer_sanity_check) then wraps the client in BF16_Optimizer instead of ZeRO-1's
        # optimizer: FoRA's replicated Cayley step is not checked there, and a custom matrix step has been reported
        # silently not to run under it (DeepSpeed #8461).
        raise ValueError(
            f"{name} has zero_optimization.stage=1 with {bf16_key}.enabled=true and data_types.grad_accum_dtype="
            f"{accum!r}: DeepSpeed then wraps the optimizer in its BF16_Optimizer rather than ZeRO-1's, and FoRA's "
            "Stiefel lora_B step is supported under ZeRO-1/2/3 only. Use stage 2 (example_configs/deepspeed/"
            "zero2.json, which accumulates in fp32 itself), or remove data_types.grad_accum_dtype."
        )
