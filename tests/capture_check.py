"""Cayley-Adam's step against another, through everything a run does to an optimizer: the captured step against the
eager one (tests/test_optim.py on the CPU with tests/graph_replay.py's stand-in graph; bench/optimizer.py on a GPU
with CUDA graphs), and each implementation of today's step against the step of an earlier revision.

:func:`run` takes 20 steps from a fixed seed: a learning rate that changes at every step, a non-finite gradient on one
matrix, periodic re-projection, a resume from a saved state and a cast of one lora_B after a step. :func:`differences`
compares two runs. :func:`package_at` imports fora_plugin as it was at a git revision.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import math
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import fora_plugin
from fora_plugin.stiefel import random_stiefel


__all__ = ["KINDS", "captured_against_eager", "differences", "package_at", "run"]

KINDS = ("fp32", "bf16", "experts", "fora")
STEPS = 20
NAN_STEP, RESUME_STEP, CAST_STEP = 7, 10, 14


def package_at(rev: str) -> ModuleType | None:
    """``fora_plugin`` as it was at git revision ``rev``, imported as another package (its modules import each other
    relatively); None where git cannot give it (no git, a shallow clone)."""
    root = Path(__file__).resolve().parents[1]
    try:
        archive = subprocess.run(
            ["git", "-C", str(root), "archive", rev, "fora_plugin"], capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    target = Path(tempfile.mkdtemp(prefix="fora-plugin-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    name = f"fora_plugin_{rev}"
    spec = importlib.util.spec_from_file_location(
        name, target / "fora_plugin" / "__init__.py", submodule_search_locations=[str(target / "fora_plugin")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


def _optimizer(kind: str, params: list[torch.nn.Parameter], plain: int, package: ModuleType, options: dict):
    stiefel = {"lr": 0.05, "qr_period": 5, **options}
    if kind == "fora":
        return package.FoRAOptimizer(
            [{"params": params[-1:]}, {"params": params[:plain], "stiefel": True}],
            adamw_defaults={"lr": 1e-2, "fused": True},  # torch.optim.AdamW reads its step count back otherwise
            stiefel_defaults=stiefel,
        )
    groups = [{"params": params[:plain]}]
    if kind == "experts":
        groups.append({"params": params[plain:], "num_experts": 3})
    return package.CayleyAdam(groups, **stiefel)


def run(
    kind: str,
    device: torch.device,
    *,
    package: ModuleType = fora_plugin,
    options: dict[str, Any] | None = None,
    sync_counter=None,
) -> dict[str, Any]:
    """The 20 steps of ``kind`` (one of :data:`KINDS`) on ``device`` with ``package``'s optimizers (fora_plugin, or
    an earlier revision's from :func:`package_at`) built with ``options`` (CayleyAdam keywords); the host syncs of the
    steps after the resume's capture, counted with ``sync_counter`` (a context manager with ``.count``)."""
    options = options or {}
    params, plain = _parameters(kind, device)
    opt = _optimizer(kind, params, plain, package, options)
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
            opt = _optimizer(kind, params, plain, package, options)
            opt.load_state_dict(saved)
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s), last_epoch=step - 1)
        if step == CAST_STEP:  # the state follows the cast, and a captured step is captured anew
            with torch.no_grad():
                params[0].data = params[0].data.to(torch.float32 if kind == "bf16" else torch.bfloat16)
            params[0].grad = params[0].grad.to(params[0].dtype)
        if sync_counter is not None and step > RESUME_STEP + 2:
            with sync_counter() as counter:
                opt.step()
            syncs += counter.count
        else:
            opt.step()
        schedule.step()
    return {"params": params, "optimizer": opt, "syncs": syncs, "skipped": opt.skipped_steps()}


def _worse(a: float, b: float) -> float:
    """The larger difference, NaN if either is (``max`` would keep 0.0 over a NaN: a NaN'd run would pass)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The largest differences between two runs of one kind, in parameters and in optimizer state (the state both
    keep), whether the dtypes agree, and the skipped steps of each."""
    param_diff = state_diff = 0.0
    dtypes_match = True
    for p, q in zip(a["params"], b["params"]):
        dtypes_match &= p.dtype == q.dtype
        param_diff = _worse(param_diff, (p.detach().double() - q.detach().double()).abs().max().item())
        theirs = b["optimizer"].state[q]
        for key, value in a["optimizer"].state[p].items():
            if key in theirs:
                state_diff = _worse(state_diff, (value.double() - theirs[key].double()).abs().max().item())
    return {
        "max_param_diff": param_diff,
        "max_state_diff": state_diff,
        "dtypes_match": dtypes_match,
        "skipped": (a["skipped"], b["skipped"]),
    }


def captured_against_eager(
    kind: str, device: torch.device, sync_counter=None, implementation: str | None = None
) -> dict[str, Any]:
    """:func:`differences` between the eager and the captured run of ``kind`` on ``device`` (both with
    ``implementation``), and the captured run's host syncs."""
    eager = run(kind, device, options={"cuda_graph": False, "implementation": implementation})
    captured = run(
        kind, device, options={"cuda_graph": True, "implementation": implementation}, sync_counter=sync_counter
    )
    return {"kind": kind, **differences(eager, captured), "syncs": captured["syncs"]}
