"""DTensor helpers of the row-sharded Cayley step (FSDP2's ``fully_shard`` shards every lora_B by rows): the local
rows, the process groups a sum over rows is all-reduced over, and the gradient laid out as its parameter.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed
    DTensor = None


__all__ = ["DTensor", "all_reduce_sum", "is_dtensor", "local_gradient", "local_rows", "reduce_groups"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a sharded parameter of FSDP2); False where torch has no DTensor."""
    return DTensor is not None and isinstance(t, DTensor)


def local_rows(t: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def reduce_groups(p: torch.Tensor) -> tuple:
    """The process groups over which a sum over ``p``'s rows must be all-reduced (empty for a plain tensor)."""
    if not is_dtensor(p):
        return ()
    groups = []
    for dim, placement in enumerate(p.placements):
        if placement.is_shard(0):
            groups.append(p.device_mesh.get_group(dim))
        elif not placement.is_replicate():
            raise ValueError(
                f"CayleyAdam got a DTensor lora_B of shape {tuple(p.shape)} with placements {p.placements}: the "
                "Cayley step needs whole rows on each rank. Shard it by rows (Shard(0), as FSDP2's fully_shard "
                "does) or replicate it."
            )
    return tuple(groups)


def all_reduce_sum(tensor: torch.Tensor, groups: tuple) -> None:
    """Sum ``tensor`` in place over each process group of ``groups`` (:func:`reduce_groups`); none: nothing."""
    for group in groups:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def local_gradient(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The rows of ``grad`` that this rank holds of ``p``: a DTensor gradient is first laid out as ``p`` is."""
    if is_dtensor(p):
        if not isinstance(grad, DTensor):
            raise TypeError(
                f"CayleyAdam: lora_B of shape {tuple(p.shape)} is a DTensor but its gradient is a plain tensor of "
                f"shape {tuple(grad.shape)}: pass the gradient as a DTensor with the parameter's placements."
            )
        if grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        return grad.to_local()
    return grad
