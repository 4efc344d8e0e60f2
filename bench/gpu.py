"""FoRA on one GPU in one command: markdown tables on stdout, one JSON file naming the GPU, the driver and
every package version.

Sections, in this order (the open issues' first), each through the package's own code, each recorded in the JSON as
``ok``, ``skipped`` (with the reason) or ``error`` (with the traceback's end) so that one failure loses nothing else:

e. ``optimizer``: first tests/capture_check.py (the captured Cayley-Adam step against the eager one, 20 steps; if
   it fails, every trainer row below runs fora eager and says so), then bench/optimizer.py's Cayley-Adam against fused
   and foreach AdamW (the LLaMA-3.1-8B lora_B sets at r 32 and 16, the Qwen3-30B-A3B experts, the 3B top half, the
   dense d x d step), with the staged step's captured run against its eager one at those real shapes.
d. ``host_syncs``: ``torch.cuda.set_sync_debug_mode`` around 10 steps of the trainer's FoRA optimizer (fused AdamW on
   lora_A, Cayley-Adam on lora_B), captured and eager, and around one FoRALogs log; tests/host_sync.py's counter on
   any device; the CUDA runtime's synchronising calls in a profiler trace of the steps.
a. ``step_time``: the paper's efficiency table (bench/step_time.py): LLaMA-3.2-3B from the bundled config, random
   bf16 weights, batch 16 x 256, LoRA r 32 on q/k/v/up/down through FoRASFTTrainer; lora (all layers), fg-lora and
   fora on the top half and on every second layer, checkpointing off and on; ms/step, max_memory_allocated/reserved,
   the ratios beside the paper's figures, and the torch profiler's top kernels of the ckpt-off top-half rows.
h. ``engines``: bench/engines.py: ``fora train`` under ZeRO-2, ZeRO-3, QFoRA + ZeRO-2 and FSDP2 against one process.
a3. ``fast_path``: lora, fg-lora and fora (top half, checkpointing off) on the commonsense mix with each of PEFT's
   input cast, the cast off (the default), bf16 adapters with fp32 masters and Liger's kernels; then the fastest on
   the fixed 256-token rows, checkpointing off and on. ``fast_path_compile``: ``torch_compile`` and all together.
a2. ``step_rows``: beside (a), checkpointing off: gradient accumulation 4, the commonsense mix, the frozen base alone.
c., f., g., (memory_peak): ``scoring`` (8 Fisher batches as the trainer runs them), ``qfora`` (the 3B config as NF4,
   10 steps), ``cli_train`` (``fora train`` on a 4-layer Llama, reloaded), ``memory_peak`` (the allocator's trace at
   the peak of 2 steps): measured on the H100 before (docs/gpu.md), so late.
b. ``plan``: ``fora plan`` (a child process beside the GPU sections) of the same settings against the measured peaks.

A section starts only if the budget has its estimate left (:data:`ESTIMATES`), a row only if it has the row's. The
default --budget (430 s) keeps the whole device command (install, imports, sections) near 480 s: it covers optimizer,
host_syncs, step_time, engines and the first fast_path rows the rest allows, and leaves out the other fast_path rows,
step_rows, scoring, qfora, cli_train, memory_peak and fast_path_compile. A second call takes the first's rows as
measured (``--reuse FIRST/gpu.json``) and runs the sections left (``--only ...``); which ones the next lease runs, in
which calls: docs/gpu.md, "Running it".

    python bench/gpu.py --device cuda --out "$OUT"      # one H100/H200: about 7.5 minutes with the install
    python bench/gpu.py --device cpu --tiny            # every section at tiny shapes; CUDA-only parts skipped

bench/gpu_wheels.sh fetches the wheels the device image lacks and shows the one device command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))  # tests/host_sync.py: the host-sync counter the tests use too

import engines  # noqa: E402  (bench/engines.py: section (h))
import step_time  # noqa: E402  (bench/step_time.py: the rows of (a), and the trainers of (c), (d), (f))
from step_time import GIB, MODES, REPO, TARGETS, Setting  # noqa: E402


SECTIONS = (
    "optimizer",
    "host_syncs",
    "step_time",
    "engines",
    "fast_path",
    "step_rows",
    "scoring",
    "qfora",
    "cli_train",
    "memory_peak",
    "fast_path_compile",
    "plan",
)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A section's seconds on an H100 (where they come from in ``source``); ``start``: what must be left of the
    budget to start it (the whole for a section that cannot stop midway, one row for one that stops between rows)."""

    seconds: float
    start: float
    source: str


# Row-wise sections start each row only if its estimate is left: step_time's 10 rows took 101-109 s on the H100.
ROW_S = 11.0
COMPILE_ROW_S = 90.0  # a guess: the 3B model compiled by dynamo and inductor, forward and backward, then 13 steps
# What engines leaves of the budget for its reloads and plans after its last launch (besides what a launch started
# just before its end may overrun, engines.overrun_s).
ENGINES_MARGIN_S = 30.0
# What engines' first runs take: the single-process runs (37 s on the H100, 2026-11-28) and one launch (35-38 s). The
# section stops between launches, so it starts where these, its margin and one overrun are left.
ENGINES_FIRST_RUNS_S = 80.0
ESTIMATES = {
    "optimizer": Estimate(
        65,
        65,
        "58.4 s on the H100 (2026-11-28): each implementation eager and captured; 5 s more (a guess) for the rows "
        "added since: the staged step of 87eab16, the Gram products beside each set's and the phase profile",
    ),
    "host_syncs": Estimate(15, 15, "13.1 s on the H100 (2026-11-28): two trainers (captured, eager) and a profile"),
    "step_time": Estimate(100, ROW_S, "10 rows, 93-109 s on the H100"),
    "engines": Estimate(
        engines.BUDGET_S["cuda"] + ENGINES_MARGIN_S,
        ENGINES_FIRST_RUNS_S + ENGINES_MARGIN_S + engines.overrun_s("cuda"),
        "launches start until engines.BUDGET_S (those before the gloo row ended near 190 s on the H100), then reloads",
    ),
    "fast_path": Estimate(18 * ROW_S, ROW_S, "18 rows as step_time's; 10 new, Liger's compiles in, 61 s"),
    "step_rows": Estimate(11 * ROW_S, ROW_S, "8 rows, the 3 with 4 micro-batches about twice; 5 new in 42 s"),
    "scoring": Estimate(10, 10, "8.3 s on the H100"),
    "qfora": Estimate(25, 25, "21-25 s on the H100"),
    "cli_train": Estimate(35, 35, "35 s on the H100"),
    "memory_peak": Estimate(15, 15, "14.4 s on the H100"),
    "fast_path_compile": Estimate(6 * COMPILE_ROW_S, COMPILE_ROW_S, "a guess: 6 compiled rows"),
    "plan": Estimate(0, 0, "the child process ran beside the sections: 0 s of waiting on the H100"),
}
DEFAULT_BUDGET_S = {"cuda": 430.0, "cpu": 1800.0}
# What an earlier call's environment must share with this one for --reuse to take its rows: the same device, card,
# driver and package versions (a second call may land on a fresh machine, even an H200).
REUSE_SAME = ("device", "gpu", "driver", "packages")
PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "bitsandbytes",
    "deepspeed",
    "liger-kernel",
    "tokenizers",
    "safetensors",
    "huggingface-hub",
    "numpy",
    "pyarrow",
    "pandas",
    "fsspec",
    "regex",
)
# The paper's efficiency table (LLaMA-3.2-3B, batch 16 x 256, bf16, one H200) and our goals against it.
PAPER = {"lora_ms": 97.5, "lora_gb": 15.32, "half_ms": 67.1, "half_gb": 12.45, "half_over_lora": 0.688}
# The open issues' goals, each in one place: fora / lora and fora / fg-lora with the default step (top half,
# checkpointing off), fora / lora with the fastest fast-path combination, the optimizer phase fora − fg-lora (ms).
GOALS = {
    "fora_over_lora": 0.70,
    "fora_over_fg_lora": 1.03,
    "fast_path_fora_over_lora": 0.72,
    "optimizer_phase_ms": 1.5,
    "plan_error": engines.GOALS["plan_single"],
    "drift": engines.GOALS["drift"],
}
ALPACA = REPO / "example_configs" / "data" / "alpaca_en_demo.json"
# The goals for Cayley-Adam's step on the GPU, by set: ("ms", wall ms) or ("× foreach", over foreach AdamW).
OPTIMIZER_GOALS = {"LLaMA-3.2-3B, 14 layers, r=32": ("ms", 2.5), "LLaMA-3.1-8B, r=32": ("× foreach", 1.5)}


@dataclasses.dataclass(frozen=True)
class Scale:
    """The shapes and counts of a run: the GPU's (the paper's) or the tiny CPU smoke test's."""

    setting: Setting
    warmup: int
    steps: int
    fisher_batches: int
    profile_steps: int
    profile_modes: tuple[str, ...]  # the modes whose ckpt-off top-half (lora: all-layer) row is profiled
    sync_steps: int
    optimizer_sets: list  # bench/optimizer.py's (name, {d_out: count}, r, experts)
    optimizer_rounds: int
    dense_step: int  # d of bench/optimizer.py's d x d reference step (0: none; 4096 takes minutes on a CPU)
    profiled_set: tuple  # (name, {d_out: count}, r, experts): the lora_B set whose Cayley-Adam step is profiled
    cli_steps: int
    cli_hidden: int
    cli_batch: int
    cli_bf16: bool  # bf16 autocast is the GPU's; on a CPU it is emulated and slow


# The lora_B of step_time's fora rows (LLaMA-3.2-3B: hidden 3072, 8 KV heads of 128, intermediate 8192; q and down
# 3072, k and v 1024, up 8192) on 14 layers at r 32.
LLAMA_3B_TOP_HALF = ("LLaMA-3.2-3B, 14 layers, r=32", {3072: 28, 1024: 28, 8192: 14}, 32, 1)


def gpu_scale() -> Scale:
    import optimizer as optimizer_bench

    return Scale(
        step_time.SETTINGS["llama-3.2-3b"],
        warmup=3,
        steps=10,
        fisher_batches=8,
        profile_steps=3,
        profile_modes=step_time.MODES,
        sync_steps=10,
        optimizer_sets=[*optimizer_bench.SETS, LLAMA_3B_TOP_HALF],
        optimizer_rounds=10,
        dense_step=4096,
        profiled_set=LLAMA_3B_TOP_HALF,
        cli_steps=40,
        cli_hidden=256,
        cli_batch=8,
        cli_bf16=True,
    )


def tiny_scale() -> Scale:
    return Scale(
        step_time.SETTINGS["tiny"],
        warmup=1,
        steps=1,
        fisher_batches=2,
        profile_steps=1,
        profile_modes=("fora",),
        sync_steps=10,
        optimizer_sets=[("tiny lora_B set, r=8", {256: 4, 64: 4}, 8, 1), ("tiny experts, r=4", {64: 2}, 4, 4)],
        optimizer_rounds=2,
        dense_step=256,
        profiled_set=("tiny lora_B set, r=8", {256: 4, 64: 4}, 8, 1),
        cli_steps=8,
        cli_hidden=64,
        cli_batch=4,
        cli_bf16=False,
    )


class Skipped(Exception):
    """A section that cannot run here (the reason is its message)."""


def needs_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise Skipped(f"skipped: needs CUDA ({what})")


def python_path() -> str:
    """PYTHONPATH for a child process: the repository first (fora_plugin need not be installed), then the caller's
    (the device's wheels in /tmp/site)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def gib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / GIB:.2f}"


def size(nbytes: int | None) -> str:
    """GiB, or MiB below a tenth of one (the tiny mode's sizes)."""
    if nbytes is None:
        return "—"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------------- rows and time
def row_seconds(ctx: Run, row: step_time.Row) -> float:
    """What must be left of the budget to start ``row`` (nothing but some budget off CUDA: the tiny mode)."""
    if ctx.device.type != "cuda":
        return 0.0
    if dict(row.sft_options).get("torch_compile"):
        return COMPILE_ROW_S
    return ROW_S * (2 if row.accumulation > 1 else 1)


def row_name(row: step_time.Row) -> str:
    what = step_time._what(dataclasses.asdict(row))
    return f"{row.mode} {row.placement} ckpt {'on' if row.checkpointing else 'off'} {what}"


CAPTURED = ("cuda_graph", True)
# Named, not left out: unset, Cayley-Adam captures its step on CUDA.
EAGER = ("cuda_graph", False)


def eager(row: step_time.Row) -> step_time.Row:
    """``row`` with fora's step eager: :data:`EAGER` in place of :data:`CAPTURED`."""
    return dataclasses.replace(row, options=tuple(EAGER if o == CAPTURED else o for o in row.options))


@contextlib.contextmanager
def module_patches_undone(*modules):
    """Everything assigned at the top level of ``modules`` and on their classes inside, put back on exit.

    Liger's ``apply_liger_kernel_to_llama`` (as TRL's ``use_liger_kernel`` calls it) replaces
    ``modeling_llama.apply_rotary_pos_emb``, ``LlamaRMSNorm``, ``LlamaMLP`` (and a forward) for the whole process:
    without this, every Llama built after the first Liger row would run Liger's kernels."""
    saved = []
    for module in modules:
        classes = {
            name: (value, dict(vars(value)))
            for name, value in vars(module).items()
            if isinstance(value, type) and value.__module__ == module.__name__
        }
        saved.append((module, dict(vars(module)), classes))
    try:
        yield
    finally:
        for module, attributes, classes in saved:
            for name in set(vars(module)) - set(attributes):
                delattr(module, name)
            for name, value in attributes.items():
                if name not in vars(module) or vars(module)[name] is not value:
                    setattr(module, name, value)
            for cls, members in classes.values():
                for name in set(vars(cls)) - set(members):
                    delattr(cls, name)
                for name, value in members.items():
                    if name not in ("__dict__", "__weakref__") and vars(cls).get(name) is not value:
                        setattr(cls, name, value)


def liger_isolated(row: step_time.Row):
    """:func:`module_patches_undone` of transformers' Llama modelling around a row with Liger's kernels."""
    if not dict(row.sft_options).get("use_liger_kernel"):
        return contextlib.nullcontext()
    from transformers.models.llama import modeling_llama

    return module_patches_undone(modeling_llama)


def begin_rows(ctx: Run, section: str, **more: Any) -> dict[str, Any]:
    """The section's measured rows, failed rows and rows left out (for want of budget), saved as they grow."""
    state = {"rows": [], "failed": [], "left_out": [], **more}
    ctx.partial[section] = state
    return state


def measure_row(
    ctx: Run, state: dict[str, Any], row: step_time.Row, *, profile_steps: int = 0, live_memory: bool = False
) -> dict[str, Any] | None:
    """One row into ``state`` (see :func:`begin_rows`), the JSON rewritten after it: left out if the budget has not
    its estimate left; fora eager where the capture failed (a captured row that fails is measured again eager, and
    if that runs, the capture is off for the rest of the run); a row measured before at the same settings (another
    section's) reused; a failed row recorded with its error."""
    if CAPTURED in row.options and not capture_ok(ctx):
        row = eager(row)
    key = (dataclasses.replace(row, label=""), live_memory)
    if key in ctx.measured:
        result = {**ctx.measured[key], "label": row.label, "reused": True}
    elif ctx.remaining() <= 0 or ctx.remaining() < row_seconds(ctx, row):
        state["left_out"].append(row_name(row))
        return None
    else:
        errors: list[dict[str, Any]] = []
        with liger_isolated(row):
            if dict(row.sft_options).get("torch_compile"):
                torch._dynamo.reset()  # the compile caches of the last model are no use to this one
            results = step_time.measure_rows(
                ctx.scale.setting,
                ctx.device,
                [row],
                warmup=ctx.scale.warmup,
                steps=ctx.scale.steps,
                profile=lambda _: profile_steps,
                live_memory=live_memory,
                errors=errors,
            )
        if errors:
            state["failed"].append(errors[0])
            ctx.log(f"  {row_name(row)}: {errors[0]['exception']}: {errors[0]['message'][:200]}")
            ctx.save()
            if CAPTURED not in row.options:
                return None
            # The same row eager: only if that runs was the capture what failed (a Liger or memory error fails both),
            # and only then is the capture off for the rest of the run.
            result = measure_row(ctx, state, eager(row), profile_steps=profile_steps, live_memory=live_memory)
            if result is not None:  # run now or before
                ctx.capture = {"ok": False, "reason": f"the captured trainer row {row_name(row)} failed, eager it ran"}
                ctx.save()
            return result
        (result,) = results
        ctx.measured[key] = result
    state["rows"].append(result)
    ctx.log(f"  {row_name(row)}: {result['ms_per_step']:.1f} ms/step, {gib(result['max_memory_allocated'])} GiB")
    ctx.save()
    return result


def fora_step_line(ctx: Run) -> str:
    """How this run's fora rows stepped Cayley-Adam: captured, or eager and why."""
    if ctx.device.type != "cuda":
        return "fora's Cayley-Adam step: eager (the default off CUDA)."
    if capture_ok(ctx):
        return "fora's Cayley-Adam step: captured as a CUDA graph (`cuda_graph=True`; the capture check passed)."
    return f"fora's Cayley-Adam step: EAGER, the capture is off for this run: {ctx.capture['reason']}."


# --------------------------------------------------------------------------------------------------- environment
def environment(device: torch.device) -> dict[str, Any]:
    import fora_plugin

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "fora_plugin": fora_plugin.__version__,
        "packages": {},
        "device": str(device),
        # MAGMA's small solves synchronise the host; the eager CUDA step asks for cuSOLVER (read at the step, here
        # the process default).
        "has_magma": torch.cuda.has_magma,
    }
    with contextlib.suppress(RuntimeError, AttributeError):
        info["preferred_linalg_library"] = str(torch.backends.cuda.preferred_linalg_library())
    for name in PACKAGES:
        try:
            info["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info["packages"][name] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            cuda_runtime=torch.version.cuda,
        )
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            query = ["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"]
            info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
            info["driver"] = info["nvidia_smi"].split(",")[0].strip() or None
    return info


# ---------------------------------------------------------------------------------------------- (a) step time
def section_step_time(ctx: Run) -> dict[str, Any]:
    gpu = ctx.device.type == "cuda"

    def profile(row: step_time.Row) -> int:
        # Where the time goes in the rows the goals are about: ckpt off, top half (lora: all layers).
        wanted = row.mode in ctx.scale.profile_modes and not row.checkpointing and row.placement in ("all", "top half")
        return ctx.scale.profile_steps if wanted else 0

    state = begin_rows(ctx, "step_time")
    ctx.rows = state["rows"]  # scoring, step_rows and plan read them, whatever this section's end
    for row in step_time.grid(ctx.scale.setting, options=fora_options(ctx)):
        # On the CPU the measured side of (b) is the storage tracker's peak.
        measure_row(ctx, state, row, profile_steps=profile(row), live_memory=not gpu)
    rows = ctx.rows
    ratios = {}
    for ckpt in (False, True):
        lora, fg, fora = (step_time.find_row(rows, m, "top half", ckpt) for m in step_time.MODES)
        if lora is None or fg is None or fora is None:
            continue
        key = "checkpointing_on" if ckpt else "checkpointing_off"
        ratios[key] = {
            "fora_over_lora": fora["ms_per_step"] / lora["ms_per_step"],
            "fora_over_fg_lora": fora["ms_per_step"] / fg["ms_per_step"],
            "fg_lora_over_lora": fg["ms_per_step"] / lora["ms_per_step"],
        }
    off = ratios.get("checkpointing_off")
    goals = {
        name: {"value": off[name], "goal": GOALS[name], "met": off[name] <= GOALS[name]}
        for name in ("fora_over_lora", "fora_over_fg_lora")
        if off is not None
    }
    text = [
        step_time.describe(ctx.scale.setting, ctx.device, ctx.scale.warmup, ctx.scale.steps),
        "",
        step_time.format_ratio_table(rows),
        "",
        step_time.format_rows(rows),
        "",
        paper_table(rows, goals) if goals else "(no paper table: a row of it is missing)",
        "",
        fora_step_line(ctx),
        *failed_lines(state),
    ]
    for r in rows:
        if "profile" in r:
            text += ["", f"Top kernels, {r['mode']} ({r['placement']}, ckpt off), {r['profile_steps']} steps:", "```"]
            text += [r["profile"], "```"]
    return {**state, "ratios": ratios, "goals": goals, "fora_step": fora_step_line(ctx), "text": "\n".join(text)}


def failed_lines(state: dict[str, Any]) -> list[str]:
    """The rows that failed (their error's last line) and those the budget left out."""
    lines = [
        f"- failed: {row_name(step_time.Row(**row_fields(f)))}: {f['exception']}: {f['message']}"
        for f in state["failed"]
    ]
    return lines + [f"- left out (the budget was spent): {name}" for name in state["left_out"]]


def row_fields(result: dict[str, Any]) -> dict[str, Any]:
    """The :class:`step_time.Row` fields of a result (tuples again where JSON made lists)."""
    fields = {f.name: result[f.name] for f in dataclasses.fields(step_time.Row) if f.name in result}
    for key in ("options", "sft_options"):
        fields[key] = tuple(tuple(pair) for pair in fields.get(key, ()))
    return fields


def paper_table(rows: list[dict[str, Any]], goals: dict[str, Any]) -> str:
    """The paper's figures beside this run's (checkpointing off, the top half for the half-layer rows)."""
    lora, fg, fora = (step_time.find_row(rows, m, "top half", False) for m in step_time.MODES)

    def gb(row):  # the paper's GB; decimal and binary both shown, the paper does not say which
        nbytes = row["max_memory_allocated"]
        return "—" if nbytes is None else f"{nbytes / 1e9:.2f} GB ({nbytes / GIB:.2f} GiB)"

    lines = [
        "| checkpointing off | paper (H200) | this run |",
        "|---|---:|---:|",
        f"| LoRA, all layers: ms/step | {PAPER['lora_ms']} | {lora['ms_per_step']:.1f} |",
        f"| LoRA, all layers: max allocated | {PAPER['lora_gb']} GB | {gb(lora)} |",
        f"| LoRA on half the layers (fg-lora, top half): ms/step | {PAPER['half_ms']} | {fg['ms_per_step']:.1f} |",
        f"| LoRA on half the layers: max allocated | {PAPER['half_gb']} GB | {gb(fg)} |",
        f"| half / all | {PAPER['half_over_lora']} | {fg['ms_per_step'] / lora['ms_per_step']:.3f} |",
        f"| fora: ms/step | — | {fora['ms_per_step']:.1f} |",
        f"| fora: optimizer step + scheduler + zero_grad, ms | — | {fora['ms_optimizer']:.2f} |",
        f"| fg-lora: optimizer step + scheduler + zero_grad, ms | 1.8 (optimizer) | {fg['ms_optimizer']:.2f} |",
    ]
    for name, label in (("fora_over_lora", "fora / lora"), ("fora_over_fg_lora", "fora / fg-lora")):
        g = goals[name]
        verdict = "met" if g["met"] else f"missed by {100 * (g['value'] / g['goal'] - 1):.1f}%"
        paper = "0.688 (half / all)" if name == "fora_over_lora" else "1.10-1.15"
        lines.append(f"| {label} (goal ≤ {g['goal']}) | {paper} | **{g['value']:.3f}**: {verdict} |")
    return "\n".join(lines)


def fora_options(ctx: Run) -> dict[str, tuple]:
    """mode -> the FoRAConfig options of its rows: on a GPU, fora's Cayley-Adam step captured as a CUDA graph (the
    default there, named so that a row says it), or eager if the capture check failed; on the CPU, the default."""
    if ctx.device.type != "cuda":
        return {}
    return {"fora": (CAPTURED,) if capture_ok(ctx) else (EAGER,)}


# The capture check's goal: the captured run equals the eager one (parameters and fp32 state) after 20 steps.
CAPTURE_GOAL = 1e-6


def capture_ok(ctx: Run) -> bool:
    """Whether fora's trainer rows run the captured step: on CUDA, once tests/capture_check.py's captured runs equal
    the eager ones (checked here the first time it is asked, if the optimizer section has not)."""
    if ctx.device.type != "cuda":
        return False
    if ctx.capture is None:
        check_capture(ctx)
    return ctx.capture["ok"]


def check_capture(ctx: Run) -> str:
    """tests/capture_check.py on this device (every kind: fp32, bf16, experts, FoRAOptimizer) into ``ctx.capture``;
    its table (the markdown)."""
    import optimizer as optimizer_bench

    optimizer_bench.DEVICE = ctx.device
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            checks = optimizer_bench.capture_checks()
    except Exception as error:  # noqa: BLE001  (recorded: the trainer rows then run eager)
        tail = traceback.format_exc(limit=-6)
        ctx.capture = {
            "ok": False,
            "reason": f"the capture check raised {type(error).__name__}: {error}",
            "error": tail,
        }
        return f"Capture check raised (fora's trainer rows run eager):\n```\n{tail}\n```"
    diffs = [d for c in checks for d in (c["max_param_diff"], c["max_state_diff"])]
    worst = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)  # max() would keep a number over a NaN
    bad = [
        c["kind"]
        for c in checks
        if not all(d <= CAPTURE_GOAL for d in (c["max_param_diff"], c["max_state_diff"]))  # NaN fails too
        or not c["dtypes_match"]
        or c["skipped"][0] != c["skipped"][1]
    ]
    reason = f"the capture check missed (kinds {bad}; largest |Δ| {worst:.1e}, goal ≤ {CAPTURE_GOAL:.0e})"
    ctx.capture = {"ok": not bad, "reason": "" if not bad else reason, "checks": checks, "largest_diff": worst}
    verdict = "passed" if not bad else f"FAILED: fora's trainer rows run eager ({reason})"
    return f"{buffer.getvalue().rstrip()}\n\nCaptured against eager, 20 steps: largest |Δ| {worst:.1e}: {verdict}."


# ------------------------------------------------------------------------------------------- (a2) more step rows
def step_rows(ctx: Run) -> list[step_time.Row]:
    """More rows beside (a)'s grid, checkpointing off: lora (all layers), fg-lora and fora (top half) with
    gradient accumulation 4 (the paper's) and on the paper's kind of data (the commonsense mix, padded per batch up to
    seq_len); the frozen base alone on either data."""
    options = fora_options(ctx)
    rows = []
    for data in step_time.DATA:
        rows.append(step_time.Row("frozen", "all", False, data=data))
        if data != "random":
            rows += [
                step_time.Row(m, "all" if m == "lora" else "top half", False, data=data, options=options.get(m, ()))
                for m in MODES
            ]
    rows += [
        step_time.Row(m, "all" if m == "lora" else "top half", False, accumulation=4, options=options.get(m, ()))
        for m in MODES
    ]
    return rows


def section_step_rows(ctx: Run) -> dict[str, Any]:
    state = begin_rows(ctx, "step_rows")
    rows = state["rows"]
    for row in step_rows(ctx):
        measure_row(ctx, state, row)
    grid = ctx.rows or []
    frozen = step_time.find_row(rows, "frozen", "all", False)
    text = [
        step_time.format_ratio_table([*grid, *rows]),
        "",
        step_time.format_rows(rows),
        "",
        f"Optimizer phase, fora against fg-lora on the same layers (goal: fora − fg-lora ≤ "
        f"{GOALS['optimizer_phase_ms']} ms):",
        "",
        step_time.format_optimizer_phase([*grid, *rows]),
    ]
    if frozen is not None:
        lora = step_time.find_row(grid, "lora", "all", False)
        text += ["", f"Frozen base (random data, ckpt off): {frozen['ms_per_step']:.1f} ms of forward + backward"]
        if lora is not None:
            text[-1] += f"; LoRA on all layers adds {lora['ms_per_step'] - frozen['ms_per_step']:.1f} ms."
    text += ["", f"Paper (H200): LoRA all layers {PAPER['lora_ms']} ms, FG-LoRA/FoRA {PAPER['half_ms']} ms a step."]
    text += ["", fora_step_line(ctx), *failed_lines(state)]
    return {**state, "fora_step": fora_step_line(ctx), "text": "\n".join(text)}


# -------------------------------------------------------------------------------------------- (a3) the fast path
# The fast path's combinations: name -> (FoRAConfig fields, SFTConfig fields). The input cast is off by default.
FAST_PATH = {
    "PEFT's input cast": ((("input_cast", "peft"),), ()),
    "input cast off": ((), ()),
    "bf16 adapters": ((("adapter_dtype", "bfloat16"),), ()),
    "Liger": ((), (("use_liger_kernel", True),)),
    "compile": ((), (("torch_compile", True),)),
    "all": ((("adapter_dtype", "bfloat16"),), (("use_liger_kernel", True), ("torch_compile", True))),
}


def fast_path_rows(ctx: Run, compiled: bool) -> list[step_time.Row]:
    """The rows on the commonsense mix (top half, checkpointing off): those that compile, or the others. The tiny CPU
    mode leaves out what needs a bf16 base or compiles (minutes on a CPU); Liger is kept: it is refused there."""
    rows = []
    for name, (options, sft_options) in FAST_PATH.items():
        if any(key == "torch_compile" for key, _ in sft_options) != compiled:
            continue
        if not ctx.scale.setting.bf16 and (compiled or ("adapter_dtype", "bfloat16") in options):
            continue
        for mode in MODES:
            placement = "all" if mode == "lora" else "top half"
            rows.append(
                step_time.Row(
                    mode,
                    placement,
                    False,
                    data="commonsense",
                    options=options + fora_options(ctx).get(mode, ()),
                    sft_options=sft_options,
                    label=name,
                )
            )
    return rows


def measure_fast_path(ctx: Run, state: dict[str, Any], row: step_time.Row) -> None:
    """:func:`measure_row`, a row refused in one line (Liger where it cannot run) moved to ``state["refused"]``: the
    refusal is the row, and the label's other rows are not tried."""
    if row.label in state["refused"]:
        return
    failed = len(state["failed"])
    measure_row(ctx, state, row)
    if len(state["failed"]) > failed and state["failed"][-1]["exception"] == "FoRAInputError":
        state["refused"][row.label] = state["failed"].pop()["message"]


def section_fast_path(ctx: Run) -> dict[str, Any]:
    state = begin_rows(ctx, "fast_path", refused={})
    for row in fast_path_rows(ctx, compiled=False):
        measure_fast_path(ctx, state, row)
    rows = state["rows"]
    fora = [r for r in rows if r["mode"] == "fora"]
    fastest = min(fora, key=lambda r: r["ms_per_step"])["label"] if fora else "input cast off"
    state["fastest"] = fastest
    options, sft_options = FAST_PATH[fastest]
    for ckpt in (False, True):
        for mode in MODES:
            placement = "all" if mode == "lora" else "top half"
            mode_options = options + fora_options(ctx).get(mode, ())
            row = step_time.Row(mode, placement, ckpt, options=mode_options, sft_options=sft_options, label=fastest)
            measure_fast_path(ctx, state, row)
    return {**state, "text": fast_path_text(ctx, state)}


def section_fast_path_compile(ctx: Run) -> dict[str, Any]:
    """The compiled rows, last: each compiles the 3B model (dynamo's caches reset before each)."""
    rows = fast_path_rows(ctx, compiled=True)
    if not rows:
        raise Skipped(
            "skipped: no compiled row at this scale (the tiny fp32 setting compiles nothing: minutes on a CPU)"
        )
    earlier = ctx.results.get("fast_path") or {}
    state = begin_rows(ctx, "fast_path_compile", refused={}, fastest=earlier.get("fastest", "input cast off"))
    for row in rows:
        measure_fast_path(ctx, state, row)
    shown = {**state, "rows": [*earlier.get("rows", []), *state["rows"]]}
    return {**state, "text": fast_path_text(ctx, shown)}


def fast_path_table(rows: list[dict[str, Any]], fora_opts: dict[str, tuple]) -> list[str]:
    """A line per (data, checkpointing, combination): lora, fg-lora and fora and the ratios; ``fora_opts``: mode ->
    the FoRAConfig options its rows carry beside the combination's (:func:`fora_options`)."""
    lines = [
        "| data | checkpointing | with | lora, all layers | fg-lora | fora "
        f"| fora / lora (goal ≤ {GOALS['fast_path_fora_over_lora']}) | fora / fg-lora |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for data, ckpt, label in dict.fromkeys((r["data"], r["checkpointing"], r["label"]) for r in rows):
        found = {m: find_fast_row(rows, m, ckpt, data, label, fora_opts) for m in MODES}
        lines.append(
            f"| {data} | {'on' if ckpt else 'off'} | {label} | {step_time._ms(found['lora'])} "
            f"| {step_time._ms(found['fg-lora'])} | {step_time._ms(found['fora'])} "
            f"| {step_time._ratio(found['fora'], found['lora'])} "
            f"| {step_time._ratio(found['fora'], found['fg-lora'])} |"
        )
    return lines


def find_fast_row(
    rows: list[dict[str, Any]], mode: str, ckpt: bool, data: str, label: str, fora_opts: dict[str, tuple]
) -> dict[str, Any] | None:
    """The row of ``mode`` with combination ``label``: with the options ``fora_opts`` gives its mode, or eager (a
    row measured after the capture was turned off mid-run)."""
    options, sft_options = FAST_PATH[label]
    for extra in dict.fromkeys((fora_opts.get(mode, ()), (EAGER,), ())):
        found = step_time.find_row(
            rows, mode, "top half", ckpt, data=data, options=options + extra, sft_options=sft_options, label=label
        )
        if found is not None:
            return found
    return None


def fast_path_text(ctx: Run, state: dict[str, Any]) -> str:
    rows, fastest = state["rows"], state["fastest"]
    captured = {"fora": (CAPTURED,)} if ctx.device.type == "cuda" else {}  # fora captured, or eager (a fallback)
    lines = fast_path_table(rows, captured)
    best = find_fast_row(rows, "fora", False, "commonsense", fastest, captured)
    lines += ["", f"Fastest for fora on the commonsense mix (without compile): {fastest}."]
    if best is not None and ctx.device.type == "cuda":
        verdict = "met" if best["ms_per_step"] <= PAPER["half_ms"] else "not met"
        lines.append(
            f"Goal beyond: fora on the paper's kind of data at or under the paper's {PAPER['half_ms']} ms (its H200 "
            f"FG-LoRA/FoRA step): {best['ms_per_step']:.1f} ms, {verdict}."
        )
    lines += [f"- {label}: refused here: {reason}" for label, reason in state["refused"].items()]
    lines += ["", fora_step_line(ctx), *failed_lines(state), "", step_time.format_rows(rows)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- (b) plan
def plan_configs(ctx: Run) -> dict[str, dict[str, Any]]:
    """The `fora train` configs `fora plan` reads: the step-time settings, and QFoRA's on a GPU."""
    s = ctx.scale.setting
    if s.name == step_time.SETTINGS["llama-3.2-3b"].name:
        model = "meta-llama/Llama-3.2-3B"  # the bundled config.json
    else:
        model = str(ctx.tmp / "plan_model")
        s.model_config().save_pretrained(model)
    base = {
        "model_name_or_path": model,
        "dtype": "bfloat16" if s.bf16 else "float32",
        "bf16": s.bf16,
        "lora_r": s.lora_r,
        "lora_alpha": s.lora_alpha,
        "lora_dropout": 0.0,
        "lora_target_modules": list(TARGETS),
        "fora_mode": "fora",
        "fora_fisher_batches": ctx.scale.fisher_batches,
        "per_device_train_batch_size": s.batch_size,
        "max_length": s.seq_len,
        "learning_rate": 2e-4,
        "weight_decay": 0.01,
        "report_to": "none",
    }
    top = step_time.placements(s.model_config().num_hidden_layers)["top half"]
    configs = {}
    # fora's rows run the captured step on CUDA (its static gradient buffers and graph pool are planned), or eager
    # where the capture failed, which a row may find after the plans started: both planned, each row against its own.
    captured = ctx.gpu_measured
    for ckpt in (False, True):
        on = "on" if ckpt else "off"
        # Without fora_layers the plan scores and places the K layers every (L/K)-th from 0: "every 2nd".
        for name, keys in ((f"ckpt {on}, scoring + every 2nd", {}), (f"ckpt {on}, top half", {"fora_layers": top})):
            configs[name] = {**base, "activation_checkpointing": ckpt, **keys, "fora_cuda_graph": False}
            if captured:
                configs[f"{name}, captured"] = {**configs[name], "fora_cuda_graph": True}
    if ctx.gpu_measured:
        configs["qfora, ckpt on"] = {**base, **QFORA_KEYS, "activation_checkpointing": True}
    return configs


QFORA_KEYS = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": True}


def start_plans(ctx: Run) -> None:
    """Start `fora plan` of every config in a child process, on the other half of the cores where there are many."""
    import yaml

    configs = plan_configs(ctx)
    paths = {}
    for i, (name, config) in enumerate(configs.items()):
        folder = ctx.tmp / f"plan{i}"
        folder.mkdir()
        config["output_dir"] = str(folder / "out")
        paths[name] = str(folder / "config.yaml")
        Path(paths[name]).write_text(yaml.safe_dump(config))
    spec = ctx.tmp / "plans.json"
    gpu_memory = ctx.environment.get("gpu_memory_bytes") if ctx.gpu_measured else None
    gpu_memory = gpu_memory / GIB if gpu_memory else None
    spec.write_text(json.dumps({"configs": paths, "gpu_memory": gpu_memory}))
    ctx.plan_result = ctx.tmp / "plans_out.json"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": python_path()}
    preexec = None
    if len(cpus) >= 8:
        # The GPU sections are launch-bound on one host thread: keep the plans off their cores.
        half = len(cpus) // 2
        os.sched_setaffinity(0, cpus[:half])
        torch.set_num_threads(half)
        env["OMP_NUM_THREADS"] = str(len(cpus) - half)

        def preexec():
            os.sched_setaffinity(0, cpus[half:])

    # Its output goes to a file: a pipe nobody reads until the end could fill up and stop it.
    ctx.plan_log = ctx.tmp / "plans.log"
    with open(ctx.plan_log, "w") as log:
        ctx.plan_process = subprocess.Popen(
            [sys.executable, __file__, "--_plans", str(spec), "--_plans-out", str(ctx.plan_result)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )


def run_plans(spec_path: str, out_path: str) -> int:
    """The child process: fora plan of every config, each one's plan.json content (or its error)."""
    from fora_plugin.plan import plan

    spec = json.loads(Path(spec_path).read_text())
    out = {}
    for name, config in spec["configs"].items():
        started = time.perf_counter()
        try:
            text, payload = plan(config, [], gpu_memory=spec["gpu_memory"])
            out[name] = {"plan": payload, "text": text, "seconds": time.perf_counter() - started}
        except Exception:  # noqa: BLE001  (one failed plan must not lose the others)
            out[name] = {"error": traceback.format_exc(limit=-8)}
        Path(out_path).write_text(json.dumps(out))
    return 0


def section_plan(ctx: Run) -> dict[str, Any]:
    if ctx.plan_process is None:
        raise RuntimeError("the plan process was not started")
    try:
        ctx.plan_process.wait(timeout=max(30.0, ctx.remaining()))
    except subprocess.TimeoutExpired:
        ctx.plan_process.kill()
        ctx.plan_process.wait()
    plans = json.loads(ctx.plan_result.read_text()) if ctx.plan_result.exists() else {}
    if not plans:
        output = ctx.plan_log.read_text()
        raise RuntimeError(f"fora plan wrote nothing; its output ended with:\n{output[-3000:]}")
    gpu = ctx.gpu_measured
    measured_key = "max_memory_allocated" if gpu else "live_peak_bytes"
    comparisons = []

    def compare(what: str, plan_name: str, mode: str, phase: str, measured: int | None) -> None:
        entry = plans.get(plan_name, {})
        planned = entry.get("plan", {}).get("phases", {}).get(mode, {}).get(phase, {}).get("peak_bytes")
        error = None if planned is None or not measured else planned / measured - 1
        comparisons.append(
            {"row": what, "plan": plan_name, "planned_bytes": planned, "measured_bytes": measured, "error": error}
        )

    for r in ctx.rows or []:
        ckpt = "on" if r["checkpointing"] else "off"
        plan_name = f"ckpt {ckpt}, top half" if r["placement"] == "top half" else f"ckpt {ckpt}, scoring + every 2nd"
        if CAPTURED in row_fields(r)["options"]:
            plan_name += ", captured"
        compare(f"{r['mode']} {r['placement']} ckpt {ckpt}: step", plan_name, r["mode"], "step", r[measured_key])
    for s in (ctx.results.get("scoring") or {}).get("runs", []):
        ckpt = "on" if s["checkpointing"] else "off"
        compare(f"scoring ckpt {ckpt}", f"ckpt {ckpt}, scoring + every 2nd", "fora", "scoring", s["peak_bytes"])
    qfora = ctx.results.get("qfora") or {}
    if qfora.get("status") == "ok":
        compare("qfora ckpt on: scoring", "qfora, ckpt on", "fora", "scoring", qfora["scoring_peak_bytes"])
        compare("qfora ckpt on: step", "qfora, ckpt on", "fora", "step", qfora["max_memory_allocated"])
    measured_label = "max_memory_allocated" if gpu else "live tensor peak (storage tracker)"
    lines = [
        f"| row | plan | planned | measured ({measured_label}) | plan / measured − 1 |",
        "|---|---|---:|---:|---:|",
    ]
    for c in comparisons:
        error = "—" if c["error"] is None else f"{100 * c['error']:+.1f}%"
        lines.append(
            f"| {c['row']} | {c['plan']} | {size(c['planned_bytes'])} | {size(c['measured_bytes'])} | {error} |"
        )
    errors = [abs(c["error"]) for c in comparisons if c["error"] is not None]
    worst = max(errors) if errors else None
    if worst is not None:
        verdict = "within" if worst <= GOALS["plan_error"] else "NOT within"
        lines.append(f"\nlargest deviation {100 * worst:.1f}%: {verdict} the {100 * GOALS['plan_error']:.0f}% goal.")
    failed = {name: p["error"] for name, p in plans.items() if "error" in p}
    for name, error in failed.items():
        lines.append(f"\nplan {name!r} failed:\n```\n{error}\n```")
    if ctx.measured_from is not None:
        env = ctx.environment
        lines.insert(
            0,
            f"Planned here ({platform.node()}, {datetime.date.today()}), measured on the {env.get('gpu')} "
            f"({env.get('date_utc')}, {ctx.measured_from.name}).\n",
        )
    for name, p in plans.items():
        if "text" in p:
            lines += ["", f"`fora plan` ({name}, {p['seconds']:.0f} s):", "```", p["text"], "```"]
    return {
        "comparisons": comparisons,
        "largest_deviation": worst,
        "plans": {name: p.get("plan") for name, p in plans.items()},
        "failed": failed,
        "text": "\n".join(lines),
    }


# ------------------------------------------------------------------------------------------------- (c) scoring
def section_scoring(ctx: Run) -> dict[str, Any]:
    from step_time import build_trainer, live_memory, release

    gpu = ctx.device.type == "cuda"
    runs = []
    for ckpt in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            trainer = build_trainer(
                ctx.scale.setting,
                ctx.device,
                tmp,
                mode="fora",
                layers=None,
                checkpointing=ckpt,
                max_steps=1,
                fisher_batches=ctx.scale.fisher_batches,
            )
            scores = trainer.fora_selection.scores
            peak = scores.peak_memory_bytes
            if not gpu:
                # No allocator counter on the CPU: score again (LoRA now on the chosen layers only) under the
                # storage tracker that `fora plan` simulates.
                with live_memory(trainer.model) as tracker:
                    trainer.fora_score()
                peak = tracker.peak
            runs.append(
                {
                    "checkpointing": ckpt,
                    "batches": scores.num_batches,
                    "seconds": scores.seconds,
                    "ms_per_batch": 1e3 * scores.seconds / scores.num_batches,
                    "peak_bytes": peak,
                    "chosen_layers": trainer.fora_selection.chosen,
                    "scores_finite": all(math.isfinite(x) for x in scores.scores),
                }
            )
            del trainer
        release(ctx.device)
    key = "max_memory_allocated" if gpu else "live_peak_bytes"
    lines = [
        "| checkpointing | batches | seconds | ms / batch | scoring peak GiB | fora step peak GiB (every 2nd) | "
        "lora step fwd+bwd ms | chosen layers |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        step = step_time.find_row(ctx.rows or [], "fora", "every 2nd", run["checkpointing"])
        lora = step_time.find_row(ctx.rows or [], "lora", "all", run["checkpointing"])
        run["step_peak_bytes"] = step[key] if step else None
        lora_ms = f"{lora['ms_forward_backward']:.1f}" if lora else "—"
        lines.append(
            f"| {'on' if run['checkpointing'] else 'off'} | {run['batches']} | {run['seconds']:.2f} "
            f"| {run['ms_per_batch']:.1f} | {gib(run['peak_bytes'])} | {gib(run['step_peak_bytes'])} | {lora_ms} "
            f"| {run['chosen_layers']} |"
        )
    return {"runs": runs, "text": "\n".join(lines)}


# ---------------------------------------------------------------------------------------------- (d) host syncs
@contextlib.contextmanager
def cuda_sync_warnings(device: torch.device):
    """``set_sync_debug_mode("warn")``: each synchronizing CUDA call warns; the list holds them."""
    if device.type != "cuda":
        yield None
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def sync_warnings(caught: list[warnings.WarningMessage] | None) -> list[str] | None:
    """Where each synchronizing CUDA call that warned was made (None off CUDA)."""
    if caught is None:
        return None
    # Only the calls that synchronized: enabling the mode itself warns that it is a prototype.
    return [
        f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}"
        for w in caught
        if "called a synchronizing" in str(w.message)
    ]


# The CUDA runtime calls that block the host on the device. The sync debug mode sees only the syncs torch makes
# through its own checks; a library's (cuSOLVER's, MAGMA's) explicit synchronisation shows here. Kineto records each
# runtime call as a CPU event named after it (cudaLaunchKernel, cudaStreamSynchronize, ...). The profiler's own exit
# synchronises the device while it still records, so a trace of no step is taken as the baseline and subtracted; the
# count of all runtime events is kept beside, so that a build recording none reads as such, not as "0 syncs". Not
# yet run on a GPU: read the first run's figures with that in mind.
RUNTIME_SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def runtime_calls(step: Callable[[], Any], steps: int) -> list[str]:
    """The names of the CUDA runtime calls in a profiler trace of ``steps`` calls of ``step``."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
    return [e.name for e in profiler.events() if e.name.startswith("cuda")]


def runtime_syncs(step: Callable[[], Any], steps: int) -> dict[str, Any]:
    """The synchronising CUDA runtime calls of ``steps`` calls of ``step``, the profiler's own taken off (CUDA)."""
    baseline = runtime_calls(lambda: None, steps)
    names = runtime_calls(step, steps)
    found = {name: names.count(name) - baseline.count(name) for name in RUNTIME_SYNCS if name in names}
    return {
        "calls": found,
        "per_step": sum(found.values()) / steps,
        "runtime_events": len(names),
        "baseline": {name: baseline.count(name) for name in RUNTIME_SYNCS if name in baseline},
    }


def host_sync_case(ctx: Run, fora: dict[str, Any]) -> dict[str, Any]:
    """The counts of one FoRA optimizer (``fora``: its FoRAConfig options) built by the trainer."""
    from host_sync import HostSyncCounter
    from step_time import build_trainer, placements, release

    from fora_plugin.optim import GRAPH_WARMUP_STEPS
    from fora_plugin.wiring import FoRALogs

    s = ctx.scale.setting
    steps = ctx.scale.sync_steps
    cuda = ctx.device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        top = placements(s.model_config().num_hidden_layers)["top half"]
        trainer = build_trainer(
            s, ctx.device, tmp, mode="fora", layers=top, checkpointing=False, max_steps=1, fora_options=fora
        )
        optimizer = trainer.create_optimizer()
        fused = [g.get("fused") for g in optimizer.param_groups if not g.get("stiefel")]
        ids = torch.randint(3, s.model_config().vocab_size, (s.batch_size, s.seq_len), device=ctx.device)
        with trainer.accelerator.autocast():
            loss = trainer.model(input_ids=ids, labels=ids).loss
        loss.backward()
        with HostSyncCounter() as first:
            # The first steps make the state (and, captured, capture the step: it synchronises once): counted apart.
            for _ in range(GRAPH_WARMUP_STEPS + 1):
                optimizer.step()
        result: dict[str, Any] = {
            "options": fora,
            "steps": steps,
            "adamw_fused": fused,
            "first_steps": GRAPH_WARMUP_STEPS + 1,
            "first_step_counter": first.count,
        }
        with HostSyncCounter() as counter, cuda_sync_warnings(ctx.device) as caught:
            for _ in range(steps):
                optimizer.step()
        result["counter"] = counter.count
        result["counter_report"] = counter.report()
        result["cuda_warn"] = sync_warnings(caught)
        logs = FoRALogs(trainer.fora_selection)
        with HostSyncCounter() as log_counter, cuda_sync_warnings(ctx.device) as log_caught:
            values = logs(trainer.model, optimizer)
        result["log_counter"] = log_counter.count
        result["log_cuda_warn"] = sync_warnings(log_caught)
        result["log_values"] = values
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(steps):
                    optimizer.step()
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
                result["error_mode"] = "no error"
            except RuntimeError as error:
                result["error_mode"] = f"raised: {str(error).splitlines()[0]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            try:
                result["runtime_syncs"] = runtime_syncs(optimizer.step, steps)
            except Exception as error:  # noqa: BLE001  (a profiler that cannot trace here loses only this count)
                result["runtime_syncs"] = {"error": f"{type(error).__name__}: {error}"}
        else:
            result["error_mode"] = "skipped: needs CUDA (torch.cuda.set_sync_debug_mode)"
            result["runtime_syncs"] = None
        del trainer, optimizer
    release(ctx.device)
    return result


def section_host_syncs(ctx: Run) -> dict[str, Any]:
    """The trainer's FoRA optimizer as the step rows run it (captured on CUDA unless the capture check failed) and,
    on CUDA, eager beside it."""
    options = dict(fora_options(ctx).get("fora", ()))
    cases = {"as the rows run it": options}
    if ctx.device.type == "cuda":
        eager_case = {"cuda_graph": False}
        cases = {"captured": options, "eager": eager_case} if options.get("cuda_graph") else {"eager": eager_case}
    results, failed = {}, {}
    for label, case_options in cases.items():
        try:
            results[label] = host_sync_case(ctx, case_options)
        except Exception:  # noqa: BLE001  (the other case still runs: a captured step that fails is the finding)
            failed[label] = traceback.format_exc(limit=-6)
        if label in failed:  # released past the except block, whose traceback still holds the failed trainer
            step_time.release(ctx.device)
    if "captured" in failed and "eager" in results:  # the capture, not the trainer, failed
        reason = "the trainer's captured optimizer failed in host_syncs, its eager one ran"
        ctx.capture = {"ok": False, "reason": reason}
    if not results:
        raise RuntimeError("every case failed:\n" + "\n".join(failed.values()))
    lines = [
        "| step | what | host syncs (tests/host_sync.py counter) | CUDA sync debug mode 'warn' | sync debug mode "
        "'error' | CUDA runtime syncs / step (profiler) | goal |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for label, r in results.items():
        cuda = "skipped: needs CUDA" if r["cuda_warn"] is None else len(r["cuda_warn"])
        log_cuda = "skipped: needs CUDA" if r["log_cuda_warn"] is None else len(r["log_cuda_warn"])
        runtime = r["runtime_syncs"]
        if runtime is None:
            runtime_text = "—"
        elif "error" in runtime:
            runtime_text = f"profiler failed: {runtime['error']}"
        else:
            runtime_text = f"{runtime['per_step']:.1f} {runtime['calls']} of {runtime['runtime_events']} events"
        first = "state made, step captured" if r["options"].get("cuda_graph") else "state made"
        lines += [
            f"| {label} | first {r['first_steps']} optimizer steps ({first}) | {r['first_step_counter']} | — | — | — "
            "| — |",
            f"| {label} | {r['steps']} optimizer steps (AdamW fused={r['adamw_fused']}, Cayley-Adam) | {r['counter']} "
            f"| {cuda} | {r['error_mode']} | {runtime_text} | 0 |",
            f"| {label} | one FoRALogs log | {r['log_counter']} | {log_cuda} | — | — | ≤ 1 |",
        ]
    for label, r in results.items():
        lines += [f"- {label}, warned: {w}" for w in (r["cuda_warn"] or []) + (r["log_cuda_warn"] or [])]
    for label, error in failed.items():
        lines += ["", f"{label} failed:", "```", error, "```"]
    main = next(iter(results.values()))  # the step the rows run (or the one that ran): its counts at the top level
    return {**main, "cases": results, "failed": failed, "text": "\n".join(lines)}


# ----------------------------------------------------------------------------------------------- (e) optimizer
def section_optimizer(ctx: Run) -> dict[str, Any]:
    import optimizer as optimizer_bench  # bench/optimizer.py, called as it runs with --device

    optimizer_bench.DEVICE = ctx.device
    # First the captured step against the eager one over 20 steps of a run (tests/capture_check.py, CUDA graphs):
    # its verdict decides whether the trainer rows run fora captured.
    capture_text = check_capture(ctx) if ctx.device.type == "cuda" and ctx.capture is None else None
    buffer = io.StringIO()
    real_scale = {}
    with contextlib.redirect_stdout(buffer):
        # The stacked-views step, the previous one and the staged one before its buffer lived from phase 1 to 3
        # beside today's, where git can give them (a note where not).
        optimizer_bench.load_older(
            optimizer_bench.STACKED_REV, optimizer_bench.PREVIOUS_REV, optimizer_bench.STAGED_REV
        )
        for name, d_outs, r, experts in ctx.scale.optimizer_sets:
            captured = optimizer_bench.bench_set(name, d_outs, r, experts, ctx.scale.optimizer_rounds)
            if captured:
                real_scale[name] = captured
        if ctx.scale.dense_step:
            optimizer_bench.bench_dense(32, ctx.scale.optimizer_rounds, d=ctx.scale.dense_step)
    text = buffer.getvalue()
    profiled, d_outs, r, experts = ctx.scale.profiled_set
    profile = optimizer_bench.profile_step(d_outs, r, experts)
    try:
        phases = optimizer_bench.profile_phases(d_outs, r, experts)
        phases_text = optimizer_bench.phases_table(phases)
    except Exception as error:  # noqa: BLE001  (a profiler that cannot trace here loses only this table)
        phases, phases_text = {"error": f"{type(error).__name__}: {error}"}, f"(phases not profiled: {error})"
    sets: dict[str, dict[str, dict[str, float]]] = {}
    current, in_rows = None, False
    for line in text.splitlines():
        if line.startswith("### "):
            current, in_rows = sets.setdefault(line[4:].split(":")[0], {}), False
        elif line.startswith("| step |"):  # the header of a set's table (the d x d table has another)
            in_rows = current is not None
        elif in_rows and line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            kernels = None if cells[6] == "—" else float(cells[6])
            current[cells[0]] = {
                "host_ms": float(cells[1]),
                "wall_ms": float(cells[2]),
                "aten_ops": int(cells[5]),
                "cuda_kernels": kernels,
            }
        elif not line.startswith("|"):
            in_rows = False
    column = "wall_ms" if ctx.device.type == "cuda" else "host_ms"
    # The goals are the fast path's: on a GPU the step captured (cuda_graph=True), on the CPU the default.
    judged = "CayleyAdam now, staged, captured" if ctx.device.type == "cuda" else "CayleyAdam now"
    verdicts = {
        name: {
            "row": judged,
            "cayley_ms": t[judged][column],
            "cayley_over_foreach_adamw": t[judged][column] / t["AdamW(foreach=True)"][column],
            "cayley_over_fused_adamw": t[judged][column] / t["AdamW(fused=True)"][column],
        }
        for name, t in sets.items()
        if judged in t
    }
    lines = [
        text.rstrip(),
        "",
        f"| set | {judged}: ms ({column}) | / foreach AdamW | / fused AdamW | goal |",
        "|---|---:|---:|---:|---|",
    ]
    for name, v in verdicts.items():
        goal = OPTIMIZER_GOALS.get(name)
        verdict = "—"
        if goal is not None:
            value = v["cayley_ms"] if goal[0] == "ms" else v["cayley_over_foreach_adamw"]
            verdict = f"{goal[0]} ≤ {goal[1]}: {'met' if value <= goal[1] else 'missed'}"
        lines.append(
            f"| {name} | {v['cayley_ms']:.2f} | {v['cayley_over_foreach_adamw']:.2f} "
            f"| {v['cayley_over_fused_adamw']:.2f} | {verdict} |"
        )
    if real_scale:
        lines += [
            "",
            "Captured against eager at the sets' shapes (same start, same steps; goal ≤ 1e-6 of the largest entry):",
            "",
            "| set | implementation | steps | matrices | max abs Δ | relative | goal |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for name, captured in real_scale.items():
            for implementation, c in captured.items():
                verdict = "met" if c["relative"] <= CAPTURE_GOAL else "MISSED"
                lines.append(
                    f"| {name} | {implementation} | {c['steps']} | {c['matrices']} | {c['max_abs_diff']:.1e} "
                    f"| {c['relative']:.1e} | {verdict} |"
                )
    # The trainer rows' own shapes (the 3B top half, staged: CUDA's default): a miss there turns them eager too.
    trainer_set = real_scale.get(LLAMA_3B_TOP_HALF[0], {}).get("staged")
    if trainer_set is not None and not trainer_set["relative"] <= CAPTURE_GOAL and capture_ok(ctx):
        ctx.capture = {
            "ok": False,
            "reason": f"captured against eager at the trainer's shapes ({LLAMA_3B_TOP_HALF[0]}, staged) missed: "
            f"relative {trainer_set['relative']:.1e}, goal ≤ {CAPTURE_GOAL:.0e}",
        }
        lines += ["", f"The trainer rows run fora eager: {ctx.capture['reason']}."]
    if capture_text is not None:
        lines = [capture_text, "", *lines]
    lines += [
        "",
        f"Top ops of 3 eager Cayley-Adam steps (the ops a capture replays), {profiled}:",
        "```",
        profile,
        "```",
        "",
        f"The same step by phase, {profiled} (3 steps; the host under Python tracing):",
        "",
        phases_text,
    ]
    return {
        "sets": sets,
        "ratios": verdicts,
        "capture_checks": (ctx.capture or {}).get("checks"),
        "capture": ctx.capture,
        "captured_against_eager_real_scale": real_scale,
        "profile": profile,
        "phases": phases,
        "text": "\n".join(lines),
    }


# --------------------------------------------------------------------------------------------------- (f) QFoRA
def qfora_model(ctx: Run) -> dict[str, Any]:
    """build_trainer's arguments that load (f)'s saved bf16 base as NF4 (nested absmax, bf16 compute)."""
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return {"model": str(ctx.tmp / "qfora_base"), "quantization_config": quantization}


def section_qfora(ctx: Run) -> dict[str, Any]:
    needs_cuda(ctx.device, "bitsandbytes NF4 on the GPU")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise Skipped(f"skipped: bitsandbytes is not installed ({error})") from None
    from step_time import build_model, build_trainer, release, time_steps

    s = ctx.scale.setting
    folder = ctx.tmp / "qfora_base"
    started = time.perf_counter()
    model = build_model(s, ctx.device)
    model.save_pretrained(folder)  # random bf16 weights; quantized by transformers at load, as in a QLoRA run
    del model
    release(ctx.device)
    saved_seconds = time.perf_counter() - started
    warmup, timed = 2, 8  # 10 training steps
    with tempfile.TemporaryDirectory() as tmp:
        torch.cuda.reset_peak_memory_stats()
        trainer = build_trainer(
            s,
            ctx.device,
            tmp,
            mode="fora",
            layers=None,
            checkpointing=True,
            max_steps=warmup + timed,
            fisher_batches=ctx.scale.fisher_batches,
            **qfora_model(ctx),
        )
        scores = trainer.fora_selection.scores
        import bitsandbytes as bnb

        four_bit = sum(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
        row = time_steps(trainer, ctx.device, warmup=warmup)
        drift = (row["log"] or {}).get("fora/max_orthogonality_error")
        result = {
            "save_seconds": saved_seconds,
            "linear4bit_modules": four_bit,
            "chosen_layers": trainer.fora_selection.chosen,
            "scoring_seconds": scores.seconds,
            "scoring_peak_bytes": scores.peak_memory_bytes,
            "max_orthogonality_error": drift,
            "drift_goal_met": drift is not None and drift < GOALS["drift"],
            **{k: row[k] for k in ("ms_per_step", "ms_forward_backward", "ms_optimizer", "ms_steps", "train_loss")},
            "max_memory_allocated": row["max_memory_allocated"],
            "max_memory_reserved": row["max_memory_reserved"],
        }
        del trainer
    release(ctx.device)
    result["text"] = "\n".join(
        [
            f"LLaMA-3.2-3B config, random bf16 weights saved and loaded as NF4 (nested absmax, bf16 compute): "
            f"{four_bit} Linear4bit modules; scored on {scores.num_batches} batches, LoRA r {s.lora_r} on layers "
            f"{result['chosen_layers']}, checkpointing on, {warmup} + {timed} steps.",
            "",
            "| scoring s | scoring peak GiB | ms/step | optimizer ms | max allocated GiB | max reserved GiB | "
            "max ‖BᵀB − I‖ (goal < 1e-3) |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            f"| {scores.seconds:.2f} | {gib(scores.peak_memory_bytes)} | {row['ms_per_step']:.1f} "
            f"| {row['ms_optimizer']:.2f} | {gib(row['max_memory_allocated'])} | {gib(row['max_memory_reserved'])} "
            f"| {drift if drift is None else f'{drift:.1e}'} |",
        ]
    )
    return result


# ---------------------------------------------------------------------------------------------- (g) fora train
def section_cli_train(ctx: Run) -> dict[str, Any]:
    import yaml
    from conftest import char_tokenizer, tiny_llama_config
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fora_plugin.selection import FoRASelection
    from fora_plugin.stiefel import orthogonality_error

    gpu = ctx.device.type == "cuda"
    root = ctx.tmp / "cli"
    model_dir, out = root / "model", root / "out"
    hidden = ctx.scale.cli_hidden
    config = tiny_llama_config(4, vocab_size=99, hidden_size=hidden, intermediate_size=2 * hidden)
    config.max_position_embeddings = 1024  # one token per character: Alpaca's template alone is ~200
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    steps = ctx.scale.cli_steps
    train_config = {
        "model_name_or_path": str(model_dir),
        "dtype": "bfloat16" if ctx.scale.cli_bf16 else "float32",
        "bf16": ctx.scale.cli_bf16,
        "use_cpu": not gpu,
        "activation_checkpointing": True,
        "dataset_name": str(ALPACA),
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "lora_target_modules": list(TARGETS),
        "fora_fisher_batches": 4,
        "fora_layer_budget": 0.5,
        "fora_lr_stiefel": 1e-2,
        "output_dir": str(out),
        "per_device_train_batch_size": ctx.scale.cli_batch,
        "max_length": 512,
        "max_steps": steps,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": steps,  # one checkpoint at the end: its trainer_state.json holds the losses
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(train_config))
    env = {**os.environ, "PYTHONPATH": python_path()}
    if torch.get_num_threads() == 1:
        env["OMP_NUM_THREADS"] = "1"  # as this process (--threads)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fora_plugin.cli", "train", str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=max(60.0, ctx.remaining()),
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"fora train exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    state = json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    losses = [e["loss"] for e in state["log_history"] if "loss" in e]
    head, tail = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    selection = FoRASelection.load(out)

    # Reload: PeftModel.from_pretrained on a fresh base, against the logits the saved weights give by hand (W + s·BA).
    adapter = load_file(out / "adapter_model.safetensors")
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    scaling = adapter_config["lora_alpha"] / adapter_config["r"]
    # On the CPU in fp32 whatever the training device: exact products, no TF32.
    ids = torch.randint(4, 99, (2, 48), generator=torch.Generator().manual_seed(1))

    def base_model():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    with torch.no_grad():
        reloaded = PeftModel.from_pretrained(base_model(), out).eval()
        logits_reloaded = reloaded(input_ids=ids).logits
        merged = base_model()
        base_logits = merged(input_ids=ids).logits
        drifts, adapted = [], set()
        for key, a in adapter.items():
            if ".lora_A." not in key:
                continue
            b = adapter[key.replace(".lora_A.", ".lora_B.")].float()
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            weight = merged.get_submodule(module).weight
            weight += scaling * (b @ a.float())
            drifts.append(orthogonality_error(b).item())
            adapted.add(int(module.split(".layers.")[1].split(".")[0]))
        logits_merged = merged(input_ids=ids).logits
    result = {
        "seconds": seconds,
        "steps": steps,
        "losses": losses,
        "loss_first3": head,
        "loss_last3": tail,
        "loss_fell": tail < head,
        "chosen_layers": selection.chosen,
        "adapted_layers": sorted(adapted),
        "max_saved_b_drift": max(drifts),
        "reload_vs_saved_weights_max_abs": (logits_reloaded - logits_merged).abs().max().item(),
        "reload_vs_base_max_abs": (logits_reloaded - base_logits).abs().max().item(),
        "device": str(ctx.device),
    }
    result["reloads_to_same_logits"] = result["reload_vs_saved_weights_max_abs"] < 1e-4
    result["text"] = "\n".join(
        [
            f"`fora train` (python -m fora_plugin.cli) on a 4-layer random Llama (hidden {hidden}), the bundled "
            f"Alpaca sample, {train_config['dtype']}, checkpointing on, {steps} steps on {ctx.device}: "
            f"{seconds:.0f} s.",
            "",
            "| loss, first 3 steps | loss, last 3 steps | chosen layers | saved max ‖BᵀB − I‖ | reloaded vs "
            "saved weights, max |Δlogit| | reloaded vs base, max |Δlogit| |",
            "|---:|---:|---|---:|---:|---:|",
            f"| {head:.3f} | {tail:.3f} | {result['chosen_layers']} | {result['max_saved_b_drift']:.1e} "
            f"| {result['reload_vs_saved_weights_max_abs']:.1e} | {result['reload_vs_base_max_abs']:.3f} |",
        ]
    )
    return result


# ------------------------------------------------------------------------------------------ (h) memory at the peak
def allocation_site(frames: list[dict[str, Any]]) -> str:
    """The innermost Python frame of an allocation outside torch itself, as ``package/module.py:line function``."""
    for frame in frames:
        filename = frame.get("filename", "")
        if "/torch/" in filename or filename.startswith("<"):
            continue
        for root in ("site-packages/", "dist-packages/", f"{REPO.name}/"):
            if root in filename:
                filename = filename.rsplit(root, 1)[1]
                break
        return f"{filename}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame: the autograd engine's backward)"


def peak_sites(trace: list[dict[str, Any]], rows: int = 12) -> dict[str, Any]:
    """Replays the CUDA caching allocator's trace (``torch.cuda.memory._snapshot()["device_traces"][device]``):
    the peak of the bytes it allocated, and at that peak the bytes per :func:`allocation_site` and the largest
    blocks. Bytes allocated before the trace began are not in it."""
    live: dict[int, tuple[int, str]] = {}  # address -> (bytes, site)
    current = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    pending = False  # a new peak was reached; its live set is copied at the next free (not at every allocation)
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], allocation_site(event.get("frames") or []))
            current += event["size"]
            if current > peak:
                peak, pending = current, True
        elif action == "free_completed" and event["addr"] in live:
            if pending:
                at_peak, pending = dict(live), False
            current -= live.pop(event["addr"])[0]
    if pending:
        at_peak = dict(live)
    sites: dict[str, int] = {}
    for nbytes, site in at_peak.values():
        sites[site] = sites.get(site, 0) + nbytes
    largest = sorted(at_peak.values(), key=lambda entry: -entry[0])[:rows]
    return {
        "peak_bytes": peak,
        "sites": sorted(sites.items(), key=lambda item: -item[1])[:rows],
        "largest": [{"bytes": nbytes, "site": site} for nbytes, site in largest],
    }


def section_memory_peak(ctx: Run) -> dict[str, Any]:
    """What is allocated at the peak of two training steps, from the allocator's own history: fora on the top half
    with checkpointing on and off, and QFoRA where (f) saved its base. The evidence that a plan which disagrees with
    max_memory_allocated is checked against."""
    needs_cuda(ctx.device, "the CUDA caching allocator's history")
    from step_time import build_trainer, placements, release

    s = ctx.scale.setting
    top = placements(s.model_config().num_hidden_layers)["top half"]
    cases = [
        (f"fora, top half, checkpointing {'on' if c else 'off'}", {"layers": top, "checkpointing": c})
        for c in (True, False)
    ]
    if (ctx.tmp / "qfora_base").exists():
        cases.append(
            (
                "QFoRA (NF4), Fisher-chosen layers, checkpointing on",
                {"layers": None, "checkpointing": True, **qfora_model(ctx)},
            )
        )
    runs, text = [], []
    for name, kwargs in cases:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = build_trainer(
                s, ctx.device, tmp, mode="fora", max_steps=2, fisher_batches=ctx.scale.fisher_batches, **kwargs
            )
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
            try:
                trainer.train()
                torch.cuda.synchronize()
                snapshot = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            found = peak_sites(snapshot["device_traces"][torch.cuda.current_device()])
            run = {
                "case": name,
                "allocated_before_bytes": before,
                "max_memory_allocated": torch.cuda.max_memory_allocated(),
                **found,
            }
            runs.append(run)
            del trainer, snapshot
        release(ctx.device)
        text += [
            f"{name}, 2 steps: {gib(before)} GiB allocated before training (weights, LoRA), the trace's peak "
            f"{gib(found['peak_bytes'])} GiB above it: {gib(before + found['peak_bytes'])} GiB in all "
            f"(max_memory_allocated {gib(run['max_memory_allocated'])} GiB).",
            "",
            "| at the peak: site | GiB |",
            "|---|---:|",
            *[f"| `{site}` | {nbytes / GIB:.3f} |" for site, nbytes in found["sites"]],
            "",
            "| largest blocks at the peak: GiB | site |",
            "|---:|---|",
            *[f"| {b['bytes'] / GIB:.3f} | `{b['site']}` |" for b in found["largest"]],
            "",
        ]
    return {"runs": runs, "text": "\n".join(text).rstrip()}


# -------------------------------------------------------------------------------------------------------- engines
def section_engines(ctx: Run) -> dict[str, Any]:
    """bench/engines.py, its launches started only while the run's budget, less what the reloads and plans after the
    last launch take, lasts."""
    tail = ENGINES_MARGIN_S + engines.overrun_s(ctx.device.type)
    return engines.section(ctx, budget_s=ctx.remaining() - tail)


# ---------------------------------------------------------------------------------------------------------- run
class Run:
    """One bench run: the device, the scale, the results so far (written after every section), the clock."""

    def __init__(self, device: torch.device, scale: Scale, out: Path, budget_s: float) -> None:
        self.device, self.scale, self.out = device, scale, out
        self.started = time.perf_counter()
        self.budget_s = budget_s
        self.environment: dict[str, Any] | None = None
        self.results: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] | None = None
        self.partial: dict[str, dict[str, Any]] = {}  # what a section measured before it failed
        self.plan_process: subprocess.Popen | None = None
        self.plan_result: Path | None = None
        self.plan_log: Path | None = None
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = Path(self._tmp.name)
        self.markdown: list[str] = []
        self.measured_from: Path | None = None  # --measured: the GPU run whose peaks the plan is compared with
        self.capture: dict[str, Any] | None = None  # the capture check's verdict (:func:`check_capture`)
        self.measured: dict[tuple, dict[str, Any]] = {}  # (row without its label, live memory) -> its result
        self.current: str | None = None  # the section running now: its partial results are saved with the rest

    @property
    def gpu_measured(self) -> bool:
        """Whether the measured side of (b) is a GPU's max_memory_allocated (this run's, or --measured's)."""
        return self.device.type == "cuda" or self.measured_from is not None

    def use_measured(self, path: Path) -> None:
        """Take (a), (c) and (f)'s measurements and the environment from an earlier GPU run's gpu.json, so that
        (b) re-plans on any machine against what the GPU measured."""
        data = json.loads(path.read_text())
        sections = data["sections"]
        if data["environment"].get("device") != "cuda" or sections.get("step_time", {}).get("status") != "ok":
            raise SystemExit(
                f"--measured {path}: not a GPU run with its step_time section (device "
                f"{data['environment'].get('device')!r}); give the gpu.json of a --device cuda run"
            )
        self.measured_from = path
        self.environment = data["environment"]
        self.rows = sections["step_time"]["rows"]
        for name in ("scoring", "qfora"):
            if name in sections:
                self.results[name] = sections[name]

    def reuse(self, path: Path) -> None:
        """Take the rows an earlier call measured (its gpu.json) as measured: a second call runs only the others."""
        data = json.loads(path.read_text())
        earlier, now = data.get("environment") or {}, self.environment or {}
        differ = [key for key in REUSE_SAME if earlier.get(key) != now.get(key)]
        if differ:
            shown = "; ".join(f"{key}: {earlier.get(key)!r} there, {now.get(key)!r} here" for key in differ)
            raise SystemExit(
                f"--reuse {path}: measured on another machine or software ({shown}); its rows would be mixed with "
                "this one's. Run without --reuse (every section), or give the gpu.json of a call on this machine."
            )
        self.capture = data.get("capture") or self.capture
        self.rows = data["sections"].get("step_time", {}).get("rows") or self.rows
        for section in data["sections"].values():
            for r in section.get("rows") if isinstance(section.get("rows"), list) else []:
                if "ms_per_step" in r and "mode" in r:
                    row = dataclasses.replace(step_time.Row(**row_fields(r)), label="")
                    self.measured.setdefault((row, r.get("live_peak_bytes") is not None), r)

    def remaining(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def log(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def estimate(self, name: str) -> Estimate:
        """The section's estimate on a GPU; none (0 s) off CUDA, where the tiny mode runs everything."""
        return ESTIMATES[name] if self.device.type == "cuda" else Estimate(0, 0, "off CUDA: no estimate")

    def run(self, name: str, section: Callable[[Run], dict[str, Any]]) -> None:
        started = time.perf_counter()
        title = f"## {name}"
        estimate, left = self.estimate(name), self.remaining()
        if name != "plan" and (left <= 0 or left < estimate.start):
            reason = (
                f"skipped: {max(left, 0):.0f} s of the {self.budget_s:.0f} s budget left, below the "
                f"{estimate.start:.0f} s it needs to start ({estimate.source}); run it with --only {name}"
            )
            result = {"status": "skipped", "reason": reason}
        else:
            self.log(f"[{time.perf_counter() - self.started:.0f} s] {name} ...")
            self.current = name
            try:
                result = {"status": "ok", **section(self)}
            except Skipped as skip:
                result = {"status": "skipped", "reason": str(skip)}
            except Exception:  # noqa: BLE001  (recorded; the other sections still run)
                result = {"status": "error", "error": traceback.format_exc(limit=-12), **self.partial.get(name, {})}
            finally:
                self.current = None
        result["seconds"] = time.perf_counter() - started
        result["estimate_s"] = estimate.seconds
        self.results[name] = result
        body = result.get("text") or result.get("reason") or f"```\n{result.get('error')}\n```"
        self.markdown += [title, "", body, ""]
        print(f"{title}\n\n{body}\n", flush=True)
        self.save()

    def save(self) -> None:
        sections = dict(self.results)
        if self.current is not None:  # what the running section has measured so far: a kill loses none of it
            sections[self.current] = {"status": "running", **self.partial.get(self.current, {})}
        payload = {"environment": self.environment, "sections": sections, "capture": self.capture}
        payload["total_seconds"] = time.perf_counter() - self.started
        (self.out / "gpu.json").write_text(json.dumps(payload, indent=2, default=str))
        (self.out / "gpu.md").write_text("\n".join(self.markdown))

    def close(self) -> None:
        if self.plan_process is not None and self.plan_process.poll() is None:
            self.plan_process.kill()
        self._tmp.cleanup()


SECTION_FUNCTIONS = {
    "step_time": section_step_time,
    "step_rows": section_step_rows,
    "fast_path": section_fast_path,
    "fast_path_compile": section_fast_path_compile,
    "host_syncs": section_host_syncs,
    "scoring": section_scoring,
    "optimizer": section_optimizer,
    "cli_train": section_cli_train,
    "qfora": section_qfora,
    "memory_peak": section_memory_peak,
    "engines": section_engines,
    "plan": section_plan,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test of every section")
    parser.add_argument("--out", default="outputs/gpu_bench", help="folder for gpu.json and gpu.md")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections only")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds; a section (a row) starts only if its estimate is left, else it is skipped (default: "
        f"{DEFAULT_BUDGET_S['cuda']:.0f} on a GPU, {DEFAULT_BUDGET_S['cpu']:.0f} on the CPU)",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: 1 with --tiny, else torch's)")
    parser.add_argument(
        "--measured",
        type=Path,
        help="an earlier GPU run's gpu.json: re-plan (b) here against its measurements (with --only plan)",
    )
    parser.add_argument(
        "--reuse",
        type=Path,
        help="an earlier call's gpu.json: its measured rows are taken as they are, not measured again (a second call)",
    )
    parser.add_argument("--_plans", help=argparse.SUPPRESS)  # the child process of (b)
    parser.add_argument("--_plans-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._plans:
        return run_plans(args._plans, args._plans_out)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU: use --device cpu --tiny")
    threads = args.threads or (1 if args.tiny else None)
    if threads:
        # Tiny steps are microseconds of work: with 2 threads on a busy 2-core machine they wait on each other.
        torch.set_num_threads(threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scale = tiny_scale() if args.tiny else gpu_scale()
    budget = args.budget if args.budget is not None else DEFAULT_BUDGET_S[device.type]
    ctx = Run(device, scale, out, budget)
    sections = [s for s in SECTIONS if args.only is None or s in args.only]
    if args.measured is not None and (sections != ["plan"] or args.tiny):
        parser.error(
            f"--measured re-plans only (at the GPU's shapes): add --only plan, without --tiny (got "
            f"--only {' '.join(sections)}{' --tiny' if args.tiny else ''})"
        )
    try:
        if args.measured is not None:
            ctx.use_measured(args.measured)
        else:
            ctx.environment = environment(device)
        if args.reuse is not None:
            ctx.reuse(args.reuse)
        print(f"## environment\n\n```\n{json.dumps(ctx.environment, indent=2)}\n```\n", flush=True)
        if "plan" in sections:
            start_plans(ctx)
        for name in sections:
            ctx.run(name, SECTION_FUNCTIONS[name])
    finally:
        ctx.save()
        ctx.close()
    summary = {name: r["status"] for name, r in ctx.results.items()}
    print(f"sections: {summary}; {time.perf_counter() - ctx.started:.0f} s; {out / 'gpu.json'}")
    return 0 if all(status in ("ok", "skipped") for status in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
