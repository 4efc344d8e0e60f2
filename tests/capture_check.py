"""Cayley-Adam's captured step against its eager step, through everything a run does to an optimizer: the check of
tests/test_optim.py on the CPU (with tests/graph_replay.py's stand-in graph) and of bench/optimizer.py on a GPU (with
CUDA graphs).

:func:`captured_against_eager` runs the same 20 steps twice from the same seed, eagerly and captured: a learning rate
that changes at every step, a non-finite gradient on one matrix, periodic re-projection, a resume from a saved state
and a cast of one lora_B after a step; it returns the largest differences and what the captured run did.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from fora_plugin import CayleyAdam, FoRAOptimizer
from fora_plugin.stiefel import random_stiefel


__all__ = ["KINDS", "captured_against_eager"]

KINDS = ("fp32", "bf16", "experts", "fora")
STEPS = 20
NAN_STEP, RESUME_STEP, CAST_STEP = 7, 10, 14


def _interleave(blocks: list[torch.Tensor]) -> torch.Tensor:
    """E (d, r) blocks -> PEFT's (d, r·E) lora_B, expert e in columns e, e + E, ..."""
    d, r = blocks[0].shape
    return torch.stack(blocks, dim=-1).reshape(d, r * len(blocks))


def _parameters(kind: str, device: torch.device, seed: int = 80) -> tuple[list[torch.nn.Parameter], int]:
    """The run's parameters (the last one AdamW's for ``fora``) and how many are plain Stiefel matrices."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    shapes = [(32, 4), (32, 4), (12, 4), (20, 2)]
    params = [
        torch.nn.Parameter(random_stiefel(d, r, generator=gen).to(dtype=dtype, device=device)) for d, r in shapes
    ]
    if kind == "experts":
        for _ in range(2):
            blocks = [random_stiefel(16, 2, generator=gen) for _ in range(3)]
            params.append(torch.nn.Parameter(_interleave(blocks).to(device)))
    if kind == "fora":
        params.append(torch.nn.Parameter(torch.randn(4, 8, generator=gen).to(device)))
    return params, len(shapes)


def _optimizer(kind: str, params: list[torch.nn.Parameter], plain: int, cuda_graph: bool):
    stiefel = {"lr": 0.05, "qr_period": 5, "cuda_graph": cuda_graph}
    if kind == "fora":
        return FoRAOptimizer(
            [{"params": params[-1:]}, {"params": params[:plain], "stiefel": True}],
            adamw_defaults={"lr": 1e-2, "fused": True},  # torch.optim.AdamW reads its step count back otherwise
            stiefel_defaults=stiefel,
        )
    groups = [{"params": params[:plain]}]
    if kind == "experts":
        groups.append({"params": params[plain:], "num_experts": 3})
    return CayleyAdam(groups, **stiefel)


def _run(kind: str, device: torch.device, cuda_graph: bool, sync_counter) -> dict[str, Any]:
    params, plain = _parameters(kind, device)
    opt = _optimizer(kind, params, plain, cuda_graph)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + 0.1 * step))
    gen = torch.Generator().manual_seed(90)
    syncs = 0
    for step in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype=p.dtype, device=device)
        if step == NAN_STEP:
            params[1].grad[2, 1] = float("nan")
        if step == RESUME_STEP:  # a new optimizer loads the saved state, as a resumed run does
            saved = copy.deepcopy(opt.state_dict())
            opt = _optimizer(kind, params, plain, cuda_graph)
            opt.load_state_dict(saved)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s), last_epoch=step - 1)
        if step == CAST_STEP:  # the state follows the cast, and a captured step is captured anew
            with torch.no_grad():
                params[0].data = params[0].data.to(torch.float32 if kind == "bf16" else torch.bfloat16)
            params[0].grad = params[0].grad.to(params[0].dtype)
        if sync_counter is not None and step > RESUME_STEP + 1:
            with sync_counter() as counter:
                opt.step()
            syncs += counter.count
        else:
            opt.step()
        schedule.step()
    return {"params": params, "optimizer": opt, "syncs": syncs, "skipped": opt.skipped_steps()}


def captured_against_eager(kind: str, device: torch.device, sync_counter=None) -> dict[str, Any]:
    """The largest differences between the eager and the captured run of ``kind`` (one of :data:`KINDS`) on
    ``device``, in parameters and in optimizer state, and the captured run's host syncs (counted with
    ``sync_counter``, a context manager with ``.count``, at the steps after the resume's capture) and skipped steps."""
    eager = _run(kind, device, False, None)
    captured = _run(kind, device, True, sync_counter)
    param_diff = state_diff = 0.0
    dtypes_match = True
    for p, q in zip(eager["params"], captured["params"]):
        dtypes_match &= p.dtype == q.dtype
        param_diff = max(param_diff, (p.detach().double() - q.detach().double()).abs().max().item())
        for key, value in eager["optimizer"].state[p].items():
            other = captured["optimizer"].state[q][key]
            state_diff = max(state_diff, (value.double() - other.double()).abs().max().item())
    return {
        "kind": kind,
        "max_param_diff": param_diff,
        "max_state_diff": state_diff,
        "dtypes_match": dtypes_match,
        "skipped": (eager["skipped"], captured["skipped"]),
        "syncs": captured["syncs"],
    }
