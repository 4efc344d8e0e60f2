"""FoRA under DeepSpeed ZeRO-1/2: Stiefel ``lora_B`` replicated beside the ZeRO partition.

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

:func:`check_deepspeed_config` names the DeepSpeed settings that would silently turn FoRA into something else.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import AdamW

from .config import FoRAConfig
from .optim import CayleyAdam, fora_optimizer_parts, stiefel_step_with_gradients


__all__ = [
    "STIEFEL_STATE_FILE",
    "ZeroFoRAOptimizer",
    "build_zero_fora_optimizer",
    "find_zero_client",
    "check_deepspeed_config",
    "load_deepspeed_config",
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
        self._clip_coef = 1.0
        self.steps = 0
        self.last_grad_norm: float | None = None

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.param_groups[0][_FIRST_GROUP] = True

    @torch.no_grad()
    def step(self, closure=None):
        first = next((group for group in self.param_groups if group.get(_FIRST_GROUP)), None)
        if first is not None:
            self._clip_coef = self._stiefel_step(first["lr"])
        if self._clip_coef != 1.0:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            torch._foreach_mul_(grads, self._clip_coef)
        return super().step(closure)

    def _stiefel_step(self, lr: float) -> float:
        """Average, clip and apply the Stiefel gradients; returns the clip factor for the Euclidean slices."""
        params = self.stiefel_parameters
        grads = _averaged_gradients(params, self.process_group)  # fp32 or None (no rank had one); one all-reduce
        live = [g for g in grads if g is not None]
        coef = 1.0
        euclid = self._euclidean_grad_norm()
        if euclid is not None:
            stiefel_sq = float(sum(g.square().sum() for g in live)) if live else 0.0
            self.last_grad_norm = total = math.sqrt(euclid**2 + stiefel_sq)
            if self.max_grad_norm > 0:
                # torch.nn.utils.clip_grad_norm_'s rule, which HF Trainer applies without DeepSpeed.
                coef = min(1.0, self.max_grad_norm / (total + 1e-6))
                if coef < 1.0 and live:
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

    def _euclidean_grad_norm(self) -> float | None:
        """DeepSpeed's norm of the partitioned gradients; None where it is not needed and not there."""
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
        return None if norm is None else float(norm)

    @torch.no_grad()
    def broadcast_stiefel_state(self) -> None:
        """Give every rank rank 0's ``lora_B``, fp32 master and Cayley-Adam moments."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        tensors = []
        for p in self.stiefel_parameters:
            state = self.stiefel.state.get(p, {})
            tensors.append(p.data)
            tensors.extend(state[key] for key in ("master", "exp_avg", "exp_avg_sq") if key in state)
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for tensor in tensors:
            dist.broadcast(tensor, src=src, group=self.process_group)

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


def find_zero_client(optimizer: Any) -> ZeroFoRAOptimizer | None:
    """The ZeroFoRAOptimizer inside a trainer's optimizer (accelerate's wrapper, then DeepSpeed's), if any."""
    for _ in range(3):
        if isinstance(optimizer, ZeroFoRAOptimizer):
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
    return [g.view_as(p) if count > 0 else None for g, p, count in zip(grads, params, counts.tolist())]


# ---------------------------------------------------------------------------------------------- configuration
def load_deepspeed_config(deepspeed: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config given as a path to a JSON file or as a dict."""
    if isinstance(deepspeed, Mapping):
        return dict(deepspeed)
    path = Path(deepspeed)
    if not path.is_file():
        raise ValueError(f"deepspeed={str(deepspeed)!r} is not a file: give the path of a DeepSpeed JSON config.")
    return json.loads(path.read_text())


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
        raise ValueError(f"{name} has zero_optimization.stage={stage!r}: use 1 or 2 with FoRA (0-3 exist).")
    if stage == 3:
        raise ValueError(
            f"{name} is ZeRO-3 (zero_optimization.stage=3): it shards the weights, but the Fisher score needs whole "
            "base-weight gradients and a Cayley step whole lora_B matrices, so FoRA does not support ZeRO-3. Use "
            "ZeRO-2 (example_configs/deepspeed/zero2.json), or mode 'lora'."
        )
    if not fora.uses_stiefel:
        return  # fg-lora is LoRA with AdamW on the chosen layers: DeepSpeed's ZeRO-1/2 as it is.
    if stage == 0:
        raise ValueError(
            f"{name} has zero_optimization.stage=0: FoRA's Stiefel lora_B are supported under ZeRO-1 and ZeRO-2. "
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
    if offload not in (None, "none") and ds.get("zero_force_ds_cpu_optimizer", True):
        raise ValueError(
            f"{name} offloads the optimizer to {offload!r} with zero_force_ds_cpu_optimizer true (its default): "
            'DeepSpeed then replaces FoRA\'s optimizer by its CPU Adam. Add "zero_force_ds_cpu_optimizer": false '
            "(example_configs/deepspeed/zero2_offload.json), or remove offload_optimizer."
        )
    if (ds.get("fp16") or {}).get("enabled") is True:
        raise ValueError(
            f"{name} enables fp16 (fp16.enabled={ds['fp16']['enabled']!r}): its loss scaling is applied to the "
            "partitioned lora_A gradients only, not to the Stiefel lora_B. Use bf16 (the paper's setting) or fp32."
        )
