"""What `fora plan` reports: the verdict (fits, or the setting that fixes it), the table it prints, plan.json's
content and plan.png's stacked bars.

May import: plan.engine_rules, plan.measure, plan.setup, plots.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..plots import pyplot
from .engine_rules import ENGINES
from .measure import GIB, KINDS, LORA_PARTS, kinds_of
from .setup import PlanSetup, planned_layers


__all__ = ["format_plan", "plan_json", "plot_plan", "verdict"]


def verdict(setup: PlanSetup, result: dict[str, Any], gpu_memory: float | None) -> str:
    """Whether the config's mode fits in ``gpu_memory`` GiB per GPU, and the setting that fixes it if not."""
    if gpu_memory is None:
        return "no --gpu-memory given: no verdict."
    phases = result["phases"]
    mode = setup.fora.mode if setup.fora.mode in phases else "fora" if "fora" in phases else next(iter(phases))
    entry = phases[mode]
    limit = gpu_memory * GIB
    step = kinds_of(entry["step"])
    scoring = kinds_of(entry["scoring"]) if "scoring" in entry else None
    step_total = sum(step.values())
    scoring_total = sum(scoring.values()) if scoring else 0
    worst = max(step_total, scoring_total)
    if worst <= limit:
        return f"fits: {mode} peaks at {worst / GIB:.3g} GiB of {gpu_memory:g} GiB per GPU."
    fixes = []
    if scoring_total > limit >= step_total:
        fixes.append(
            "fora_scores_path (score once with `fora score` where it fits, e.g. on more GPUs or a bigger one) "
            "or fora_layers: scoring is what overflows"
        )
    kinds = scoring if scoring_total > step_total else step
    over = max(kinds, key=kinds.get)
    if over in ("activations", "transient"):
        if not setup.checkpointing:
            fixes.append("activation_checkpointing: true")
        half = max(1, setup.batch_size // 2)
        fixes.append(
            f"per_device_train_batch_size: {half} with gradient_accumulation_steps: "
            f"{setup.training_args.gradient_accumulation_steps * max(1, setup.batch_size // half)}"
        )
    if kinds["weights"] > 0.5 * limit or over == "weights":
        if setup.four_bit is None:
            fixes.append("load_in_4bit: true (QFoRA)")
        if not ENGINES[setup.engine].shards_weights:
            fixes.append("FSDP2 or ZeRO-3 over several GPUs (example_configs/accelerate/fsdp2_8gpu.yaml)")
    if not fixes:
        fixes.append("a GPU with more memory, or FSDP2/ZeRO-3 over more GPUs")
    return (
        f"does not fit: {mode} peaks at {worst / GIB:.3g} GiB, over {gpu_memory:g} GiB per GPU. Fix: "
        + "; or ".join(fixes)
        + "."
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


def _planned_k(setup: PlanSetup) -> str:
    k = len(planned_layers(setup, setup.model_config.num_hidden_layers))
    return f"{k} (fora_layers)" if setup.fora.layers is not None else str(k)


def format_plan(setup: PlanSetup, result: dict[str, Any], gpu_memory: float | None) -> str:
    """The table `fora plan` prints: per GPU, per mode and phase, memory by kind in GiB, FLOPs, trainable params."""
    cfg = setup.model_config
    layers = getattr(cfg, "num_hidden_layers", "?")
    precision = f"{str(setup.dtype).removeprefix('torch.')} weights"
    if setup.four_bit is not None:
        precision = f"4-bit {setup.four_bit.quant_type}{' nested' if setup.four_bit.nested else ''} base"
        precision += f" ({setup.four_bit.storage} storage)"
    if setup.autocast_dtype is not None:
        precision += f", {str(setup.autocast_dtype).removeprefix('torch.')} autocast"
    lines = [
        f"fora plan: {setup.model_ref} ({cfg.model_type}, {layers} layers; {setup.model_config_path})",
        f"  batch {setup.batch_size} x seq {setup.seq_len} per GPU, {precision}, checkpointing "
        f"{'on' if setup.checkpointing else 'off'}, LoRA r {setup.lora.r}, fora/fg-lora K = "
        f"{_planned_k(setup)} of {layers} layers, {setup.engine} on {setup.gpus} GPU(s)",
        "",
        "| mode | phase | weights | LoRA+grads+opt | activations | transient | peak GiB | TFLOPs | trainable |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, entry in result["phases"].items():
        for phase_name in ("scoring", "step"):
            if phase_name not in entry:
                continue
            phase = entry[phase_name]
            kinds = kinds_of(phase)
            trainable = f"{phase.trainable:,}" if phase_name == "step" else ""
            lines.append(
                f"| {mode} | {phase_name} | {_gib(kinds['weights'])} | {_gib(kinds['lora'])} | "
                f"{_gib(kinds['activations'])} | {_gib(kinds['transient'])} | **{_gib(sum(kinds.values()))}** | "
                f"{phase.flops / 1e12:.1f} | {trainable} |"
            )
    lines.append("")
    for note in result["notes"]:
        lines.append(f"  note: {note}")
    lines.append(f"  verdict: {verdict(setup, result, gpu_memory)}")
    lines.append(f"  (planned in {result['seconds']:.1f} s on fake tensors; GiB = 2^30 bytes)")
    return "\n".join(lines)


def plan_json(setup: PlanSetup, result: dict[str, Any], gpu_memory: float | None) -> dict[str, Any]:
    """plan.json's content: the setup planned, per mode and phase its peak by kind and LoRA part, FLOPs and trainable
    parameters, the notes and the verdict."""
    phases = {}
    for mode, entry in result["phases"].items():
        phases[mode] = {
            name: {
                "peak_bytes": sum(p.peak.values()),
                "by_kind_bytes": kinds_of(p),
                "lora_parts_bytes": {k: v for k, v in p.peak.items() if k in LORA_PARTS},
                "flops": p.flops,
                **({"trainable_parameters": p.trainable} if name == "step" else {}),
            }
            for name, p in entry.items()
        }
    return {
        "config": setup.config,
        "output_dir": str(setup.output_dir),
        "model": setup.model_ref,
        "model_config": str(setup.model_config_path),
        "batch_size": setup.batch_size,
        "seq_len": setup.seq_len,
        "dtype": str(setup.dtype),
        "autocast_dtype": str(setup.autocast_dtype) if setup.autocast_dtype else None,
        "checkpointing": setup.checkpointing,
        "four_bit": dataclasses.asdict(setup.four_bit) if setup.four_bit else None,
        "engine": setup.engine,
        "gpus": setup.gpus,
        "gpu_memory_gib": gpu_memory,
        "phases": phases,
        "notes": result["notes"],
        "verdict": verdict(setup, result, gpu_memory),
        "depths_run": result["depths"],
        "seconds": result["seconds"],
    }


def plot_plan(path: Path, setup: PlanSetup, result: dict[str, Any], gpu_memory: float | None) -> None:
    """Stacked bars: one per mode and phase, memory per GPU by kind, the GPU's memory as a line."""
    plt = pyplot()

    bars = [(f"{mode}\n{name}", kinds_of(p)) for mode, entry in result["phases"].items() for name, p in entry.items()]
    fig, ax = plt.subplots(figsize=(1.4 * len(bars) + 2, 4.5))
    bottom = [0.0] * len(bars)
    colors = {"weights": "#4c72b0", "lora": "#dd8452", "activations": "#55a868", "transient": "#c44e52"}
    labels = {"lora": "LoRA params + grads + optimizer", "weights": "weights"}
    for kind in KINDS:
        values = [b[1][kind] / GIB for b in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, color=colors[kind], label=labels.get(kind, kind))
        bottom = [x + y for x, y in zip(bottom, values)]
    if gpu_memory is not None:
        ax.axhline(gpu_memory, color="black", linestyle="--", linewidth=1, label=f"GPU memory ({gpu_memory:g} GiB)")
    ax.set_xticks(range(len(bars)), [b[0] for b in bars])
    ax.set_ylabel("peak live memory per GPU (GiB)")
    ax.set_title(f"fora plan: {setup.model_ref}, batch {setup.batch_size} x {setup.seq_len}, {setup.engine}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
