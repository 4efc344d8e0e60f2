"""The state of a parameter that an optimizer keeps in a compute dtype of its own (an fp32 master for a bf16
parameter, fp32 moments): the compute dtype, the signature of what a step last left in a parameter, following a
parameter that was cast, moved or written since, and putting a loaded state back in its compute dtype. Cayley-Adam
and MasterAdamW share it.

May import: optim.dtensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from .dtensor import local_rows


__all__ = ["compute_dtype", "follow_parameter", "restore_compute_state", "signature"]


def compute_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype the state of ``p`` is computed and kept in: fp64 for an fp64 ``p``, else fp32."""
    # fp32 at least: in bf16/fp16 the Gram matrices and the 2r x 2r solve lose orthogonality within a few steps, and
    # a bf16 Adam moment rounds away most updates.
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def signature(p: torch.Tensor) -> tuple:
    """What a step last left in ``p``: its version counter (bumped by every in-place write), its storage, dtype and
    device. Host-side metadata only: reading it syncs nothing."""
    if torch.compiler.is_compiling():
        # Dynamo reads a version counter only as data (a graph break): a compiled step follows casts and moves of
        # its parameters, not in-place writes.
        return None, None, p.dtype, p.device
    local = local_rows(p)
    return local._version, local.untyped_storage()._cdata, p.dtype, p.device


def follow_parameter(
    state: dict[str, Any],
    p: torch.Tensor,
    last: tuple | None,
    compute_keys: Iterable[str],
    host_keys: Iterable[str] = (),
) -> bool:
    """Bring ``p``'s state in line with ``p`` where something outside the step changed ``p`` since the step last
    wrote it (``last``, its :func:`signature` then; None if unknown, e.g. after ``load_state_dict``). Returns whether
    ``p``'s storage or any tensor of its state is another one now: a step captured as a CUDA graph reads the old ones
    and must be captured anew (a write in place, refreshed in place, leaves it valid).

    - Moved (``.to(device)``): the state moves with it, but for a ``host_keys`` entry kept on the host (torch's AdamW
      keeps its step count there).
    - Cast (``.to(dtype)``): the ``compute_keys`` entries take ``p``'s compute dtype; a ``p`` cast down from it gets a
      master made from its values, one cast up becomes its own point (the master's value where ``p`` still holds it).
    - Written in place (``load_state_dict``, a user's edit): the master takes ``p``'s new values. Where ``p`` still
      equals the master rounded, the master's extra bits are kept, so a spurious refresh changes nothing.
    """
    now = signature(p)
    if last == now:
        return False
    replaced = last is None or last[1:] != now[1:]
    tensors = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
    device, dtype = p.device, compute_dtype(p)
    compute_keys, host_keys = set(compute_keys), set(host_keys)
    for key, value in list(state.items()):
        if not isinstance(value, torch.Tensor) or (key in host_keys and value.device.type == "cpu"):
            continue
        target = dtype if key in compute_keys else value.dtype
        if value.device != device or value.dtype != target:
            state[key] = value.to(device=device, dtype=target)
    master = state.get("master")
    local = local_rows(p)
    if master is not None:
        # The master rounded as the step last stored it in p (p's dtype then), in p's dtype now.
        stored = local_rows(master).to(p.dtype if last is None else last[2]).to(p.dtype)
        point = torch.where(local == stored, local_rows(master), local.to(dtype))
        if p.dtype == dtype:  # cast up to the compute dtype: p is its own point again
            local.copy_(point)
            del state["master"]
        else:
            local_rows(master).copy_(point)
    elif p.dtype != dtype:  # cast down from the compute dtype: the master starts from the values p holds now
        state["master"] = p.detach().to(dtype)
    now_tensors = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
    return replaced or now_tensors.keys() != tensors.keys() or any(now_tensors[k] is not v for k, v in tensors.items())


def restore_compute_state(
    optimizer: Optimizer,
    state_dict: dict[str, Any],
    owns: Callable[[dict[str, Any]], bool],
    compute_keys: Iterable[str],
    device_keys: Iterable[str] = (),
    kept_keys: Iterable[str] = (),
) -> None:
    """After ``Optimizer.load_state_dict(state_dict)``: put the saved state of every group that ``owns`` back as it
    was saved: the ``compute_keys`` entries in the parameter's compute dtype and the ``device_keys`` ones in their
    own, on the parameter's device; the ``kept_keys`` ones as torch's loader left them (a host step count), copied.

    ``Optimizer.load_state_dict`` casts floating state to the parameter's dtype: a bf16 parameter would get its fp32
    master and moments rounded to bf16. Each entry is a copy: the loaded state must not share storage with the
    state_dict it came from (another optimizer's live state, when one loads another's state_dict). A parameter without
    a state entry gets none (FSDP2 swaps the parameters after a load).
    """
    for saved_group, group in zip(state_dict["param_groups"], optimizer.param_groups):
        if not owns(group):
            continue
        for saved_id, p in zip(saved_group["params"], group["params"]):
            saved, state = state_dict["state"].get(saved_id), optimizer.state.get(p)
            if not saved or state is None:
                continue
            for key in compute_keys:
                if key in saved:
                    state[key] = saved[key].to(dtype=compute_dtype(p), device=p.device, copy=True)
            for key in device_keys:
                if key in saved:
                    state[key] = saved[key].to(device=p.device, copy=True)
            for key in kept_keys:
                if key in state:
                    state[key] = state[key].clone()
