"""FoRA's client optimizer for DeepSpeed ZeRO-1/2: the Stiefel ``lora_B`` replicated beside the partition.

ZeRO-1/2 flattens each group of the client optimizer into one fp32 vector and steps every rank's slice of it: a
Cayley step needs a whole ``lora_B``, so :class:`ZeroFoRAOptimizer` shows DeepSpeed only the Euclidean groups and steps
the ``lora_B`` itself, whole and alike on every rank (see :mod:`fora_plugin.zero`).

May import: errors, optim, validation, zero.client, zero.deepspeed_internals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..errors import FoRAInputError
from ..optim import CayleyAdam, fora_optimizer_parts, stiefel_step_with_gradients
from ..validation import check_int
from .client import ZeroClientOptimizer, eager_unless_asked
from .deepspeed_internals import data_parallel_group, turn_off_clipping, zero_grad_norm


__all__ = ["ZeroFoRAOptimizer", "build_zero_fora_optimizer"]

# Marks the first Euclidean group (see ZeroFoRAOptimizer.__init__).
_FIRST_GROUP = "fora_first_group"


class ZeroFoRAOptimizer(ZeroClientOptimizer):
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

    zero_stage = 2
    engine = "ZeRO-1/2"

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
        super().__init__(params, max_grad_norm=max_grad_norm, **adamw_kwargs)
        if any(group.get("stiefel") for group in self.param_groups):
            raise FoRAInputError(
                "ZeroFoRAOptimizer got a group with stiefel=True in params: DeepSpeed would flatten it. Pass the "
                "Stiefel lora_B through `stiefel` (a CayleyAdam) instead."
            )
        check_int("sync_period", sync_period, 0, "0 = never broadcast")
        self.stiefel = stiefel
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

    def _bind(self, engine_optimizer: Any) -> None:
        """Its gradient norm (which DeepSpeed's engine reads as well) is the norm of the Euclidean gradients over all
        ranks, computed before the client's ``step`` is called. Its own clipping (``clip_grad``, from
        ``gradient_clipping``, by that norm alone) is turned off: this optimizer clips both parts by one norm, as
        ``max_grad_norm`` does without DeepSpeed. Bind again after a DeepSpeed checkpoint load, which restores it."""
        turn_off_clipping(engine_optimizer)
        if self.process_group is None:
            self.process_group = data_parallel_group(engine_optimizer)
        self._engine_optimizer = engine_optimizer

    def last_grad_norm_unread(self) -> torch.Tensor | None:
        return self._last_grad_norm

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.param_groups[0][_FIRST_GROUP] = True

    def step_stiefel(self) -> None:
        first = next((group for group in self.param_groups if group.get(_FIRST_GROUP)), None)
        if first is not None:  # a new optimizer step; the later calls of the same step reuse its clip factor
            self._clip_coef = self._stiefel_step(first["lr"])

    def step_euclidean(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self._clip_coef is not None and grads:
            # Always multiplied (by exactly 1 when the norm is below max_grad_norm), as clip_grad_norm_ does: a test
            # of the factor would read it back to the host. Offloaded partitions sit on the CPU.
            torch._foreach_mul_(grads, self._clip_coef.to(grads[0].device))
        return super().step_euclidean(closure)

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
            # DeepSpeed's norm is a tensor or a float; a float is filled in on the device (torch.as_tensor would copy
            # it from the host, a synchronous copy on CUDA).
            if isinstance(euclid, torch.Tensor):
                euclid = euclid.to(device=device, dtype=torch.float32)
            else:
                euclid = torch.full((), float(euclid), dtype=torch.float32, device=device)
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
                raise FoRAInputError(
                    "ZeroFoRAOptimizer.step() needs the Euclidean gradient norm to clip with max_grad_norm="
                    f"{self.max_grad_norm}, and was not bound: call bind(engine.optimizer) after deepspeed.initialize "
                    "(an HF Trainer: fora_plugin.zero.prepare_deepspeed does it), or set max_grad_norm=0."
                )
            return None
        norm = zero_grad_norm(self._engine_optimizer)
        if norm is None and self.max_grad_norm > 0:
            raise FoRAInputError(
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

    def load_stiefel_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_stiefel_state_dict(state_dict)
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
        raise FoRAInputError(
            "The model has no Stiefel lora_B (fora_plugin.make_stiefel marks them): build the ordinary optimizer "
            "(build_fora_optimizer) for it; DeepSpeed partitions all of its groups as usual."
        )
    if not euclidean:
        raise FoRAInputError(
            "Every trainable parameter is a Stiefel lora_B: DeepSpeed needs at least one parameter to partition "
            "(lora_A is one). Check that lora_A is trainable."
        )
    return ZeroFoRAOptimizer(
        euclidean,
        CayleyAdam(stiefel, **eager_unless_asked(stiefel_defaults)),
        max_grad_norm=max_grad_norm,
        sync_period=sync_period,
        process_group=process_group,
        **adamw_defaults,
    )


def _averaged_gradients(params: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor | None]:
    """fp32 gradients of ``params`` averaged over the ranks of ``group`` (one flat all-reduce), as DDP averages:
    a rank without a gradient for a parameter adds zeros; None for a parameter no rank has a gradient for."""
    if not params:
        return []
    # Every rank sends the same layout: the gradients (zeros where absent), then one has-gradient count each. The
    # counts are filled in on the device: a tensor made from a host list is a synchronous copy on CUDA.
    # fp32 as the gradients are: under another default dtype torch.cat would promote the whole buffer.
    has_grad = torch.ones(len(params), dtype=torch.float32, device=params[0].device)
    for i, p in enumerate(params):
        if p.grad is None:
            has_grad[i] = 0.0
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1) for p in params] + [has_grad]
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
