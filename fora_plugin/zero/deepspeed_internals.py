"""The one reader of DeepSpeed's internals, and the one importer of ``deepspeed`` (optional: imported lazily).

FoRA's ZeRO clients need what DeepSpeed does not document: the gradient norm its ZeRO optimizer computed, its clipping
setting and data-parallel group, ZeRO-3's flat fp32 partitions and sub-groups, and the ``ds_*`` attributes of a
partitioned parameter. Each is read here, behind a small named function, so that a DeepSpeed release that moves one
is followed in this module alone.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist


__all__ = [
    "clip_norm",
    "data_parallel_group",
    "engine_without_optimizer",
    "full_shape",
    "gathered_parameters",
    "gathered_trainable_parameters",
    "init_deepspeed_comm",
    "is_partitioned",
    "missing_optimizer_attributes",
    "partition_numel",
    "turn_off_clipping",
    "zero3_optimizer",
    "zero3_sub_group",
    "zero3_sub_groups_holding",
    "zero_config",
    "zero_grad_norm",
]

# What a ZeRO-3 engine leaves on each module for its backward hooks (DeepSpeed's parameter_offload.py), bound to it.
_ZERO3_MODULE_STATE = ("pre_bwd_fn", "post_bwd_fn", "applied_pre_backward_ref_cnt")
# What FoRA's clients read from DeepSpeed's ZeRO optimizer (engine.optimizer), by stage.
_OPTIMIZER_ATTRIBUTES = {
    1: ("_global_grad_norm", "clip_grad"),
    2: ("_global_grad_norm", "clip_grad"),
    3: ("fp16_groups", "fp32_partitioned_groups_flat", "sub_group_process_groups", "clip_grad"),
}


# ---------------------------------------------------------------------------------------------- parameters
def is_partitioned(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ZeRO-3 partitioned parameter (``zero.Init`` or a ZeRO-3 engine made it one)."""
    return hasattr(p, "ds_id")


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``p`` whole: a ZeRO-3 partitioned parameter's own shape is empty, ``ds_shape`` holds the real."""
    return tuple(getattr(p, "ds_shape", p.shape))


def partition_numel(p: torch.Tensor) -> int:
    """How many elements of a ZeRO-3 parameter each rank holds (``ceil(numel / world)``, the last slice padded)."""
    return p.partition_numel()


def gathered_parameters(params: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager:
    """A context manager holding the ZeRO-3 partitioned parameters among ``params`` whole for its duration (a
    collective: every rank enters it), read-only; the other parameters stay as they are, and without any partitioned
    one it does nothing (and needs no DeepSpeed)."""
    partitioned = [p for p in params if is_partitioned(p)]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)


def zero_config(zero: Mapping[str, Any]) -> Any:
    """A ``zero_optimization`` block as DeepSpeed reads it: its ``DeepSpeedZeroConfig`` (defaults filled, the
    stage-dependent ones included, aliases and ``5e8``-style numbers resolved). Raises ``ValueError`` (pydantic's) on
    a block DeepSpeed refuses, such as an ``"auto"`` that only HF's Trainer fills."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(**zero)


def gathered_trainable_parameters(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Under ZeRO-3, the trainable parameters (LoRA: small) gathered whole, read-only, for diagnostics and logs;
    elsewhere nothing. Every rank must enter it (it is a collective)."""
    return gathered_parameters(p for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------- ZeRO optimizer
def missing_optimizer_attributes(engine_optimizer: Any, stage: int) -> list[str]:
    """The attributes of DeepSpeed's ZeRO optimizer for ``stage`` (1, 2 or 3) that FoRA's client reads and
    ``engine_optimizer`` lacks: empty for DeepSpeed's own (``engine.optimizer``)."""
    return [name for name in _OPTIMIZER_ATTRIBUTES[stage] if not hasattr(engine_optimizer, name)]


def zero_grad_norm(engine_optimizer: Any) -> torch.Tensor | float | None:
    """The global gradient norm DeepSpeed's ZeRO optimizer formed for this step, before it calls the client's
    ``step``: a tensor on the device, or a float (inf for a step it skips); None where it formed none
    (``compute_grad_norm`` false) or ``engine_optimizer`` is None."""
    return getattr(engine_optimizer, "_global_grad_norm", None)


def clip_norm(engine_optimizer: Any) -> float:
    """The norm DeepSpeed's ZeRO optimizer clips the gradients to (``gradient_clipping``); 0 = no clipping."""
    return float(engine_optimizer.clip_grad or 0.0)


def turn_off_clipping(engine_optimizer: Any) -> None:
    """Turn DeepSpeed's own clipping off (until a checkpoint load restores ``gradient_clipping``)."""
    engine_optimizer.clip_grad = 0.0


def data_parallel_group(engine_optimizer: Any) -> dist.ProcessGroup | None:
    """The data-parallel process group of DeepSpeed's ZeRO-1/2 optimizer (None: the whole world)."""
    return getattr(engine_optimizer, "dp_process_group", None)


def zero3_optimizer(p: torch.Tensor) -> Any | None:
    """DeepSpeed's ZeRO-3 optimizer that holds the partitioned parameter ``p``; None before ``deepspeed.initialize``
    (or for a parameter no ZeRO-3 engine holds)."""
    return getattr(p, "_z3_optimizer", None)


def zero3_sub_group(zero: Any, flat: torch.Tensor) -> tuple[list[torch.Tensor], dist.ProcessGroup] | None:
    """The sub-group of DeepSpeed's ZeRO-3 optimizer ``zero`` whose flat fp32 partition is ``flat``: its parameters,
    in the partition's order, and its process group. None if ``flat`` is none of ``zero``'s partitions."""
    flats = getattr(zero, "fp32_partitioned_groups_flat", ())
    sub = next((i for i, f in enumerate(flats) if f is flat), None)
    if sub is None:
        return None
    return zero.fp16_groups[sub], zero.sub_group_process_groups[sub]


def zero3_sub_groups_holding(zero: Any, params: list[torch.Tensor]) -> list[int]:
    """The indices of the sub-groups of DeepSpeed's ZeRO-3 optimizer ``zero`` that hold one of ``params``."""
    return sorted({i for i, sub in enumerate(zero.fp16_groups) for p in sub if any(p is q for q in params)})


# ---------------------------------------------------------------------------------------------- engine, comm
def init_deepspeed_comm() -> None:
    """Have DeepSpeed's comm layer join the ``torch.distributed`` process group already set up (same backend)."""
    from deepspeed import comm

    if not comm.is_initialized():
        comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


@contextlib.contextmanager
def engine_without_optimizer(model: torch.nn.Module, config: dict[str, Any]) -> Iterator[Any]:
    """A DeepSpeed engine on ``model`` built with no optimizer (its ZeRO-3 hooks gather the weights for forward and
    backward); on exit its hooks come off (``engine.destroy()``), and so do the autograd Functions its hooks left on
    every module. Yields the engine.

    ZeRO-3 puts a pre- and a post-backward Function on each module (``pre_bwd_fn``, ``post_bwd_fn``), bound to the
    engine that made them, and a later engine keeps the ones it finds: the training engine's backward would then
    fetch the weights through this destroyed engine's coordinator, and a layer recomputed by non-reentrant activation
    checkpointing would find its weights released (torch's CheckpointError, "Recomputed values ... have different
    metadata": shape [0] for the weight). Removing them lets the next engine make its own."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=config)
    try:
        yield engine
    finally:
        engine.destroy()
        for module in model.modules():
            for name in _ZERO3_MODULE_STATE:
                module.__dict__.pop(name, None)
