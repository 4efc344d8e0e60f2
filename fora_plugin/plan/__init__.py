"""``fora plan``: memory and FLOPs of a FoRA run at its real shapes, computed on the CPU without any weight. How it is
computed: :func:`run_plan`.

Modules, in import order: ``setup`` (the config read as `fora train` reads it, the planned layers), ``fake_model``
(the model on fake tensors), ``kernels`` (GPU kernels' stand-ins), ``measure`` (the tracked phases), ``depth`` (depth
extrapolation), ``shard`` (per-GPU bytes under an engine), ``output`` (verdict, table, plan.json, plot).

May import: errors, plan, targets.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import FoRAInputError
from ..targets import find_decoder_layers
from .depth import extrapolation_depths, measure_over_depth, truncated_config
from .engine_rules import ENGINES
from .fake_model import (
    add_sft_loss_head,
    lora_optimizer,
    meta_model_of,
    plan_selection,
    planned_autocast,
    planned_batch,
    prepare_fake_model,
    sft_training_loss,
    trainer_view,
    wrap_lora,
)
from .kernels import fused_lm_head_as_on_cuda
from .measure import GIB, KINDS, LORA_PARTS, Phase, kinds_of
from .output import format_plan, plan_json, plot_plan, verdict
from .setup import (
    BUNDLED_MODEL_CONFIGS,
    LOSS_HEAD_DEVICES,
    MODEL_CONFIGS,
    MODES,
    FourBit,
    PlanSetup,
    find_model_config,
    plan_setup,
    planned_layers,
    planned_placement,
)
from .shard import gathered_bytes, shard_phase


__all__ = [
    "BUNDLED_MODEL_CONFIGS",
    "GIB",
    "KINDS",
    "LORA_PARTS",
    "LOSS_HEAD_DEVICES",
    "MODEL_CONFIGS",
    "MODES",
    "FourBit",
    "Phase",
    "PlanSetup",
    "add_sft_loss_head",
    "extrapolation_depths",
    "find_model_config",
    "format_plan",
    "fused_lm_head_as_on_cuda",
    "kinds_of",
    "lora_optimizer",
    "meta_model_of",
    "plan",
    "plan_json",
    "plan_selection",
    "plan_setup",
    "planned_autocast",
    "planned_batch",
    "planned_layers",
    "planned_placement",
    "plot_plan",
    "prepare_fake_model",
    "run_plan",
    "sft_training_loss",
    "trainer_view",
    "truncated_config",
    "verdict",
    "wrap_lora",
]


def run_plan(setup: PlanSetup, modes: tuple[str, ...] = MODES, *, full_depth: bool = False) -> dict[str, Any]:
    """Scoring and one step per mode on fake tensors; per-GPU peaks by kind, FLOPs, trainable parameters.

    A stack that repeats is run at three small depths and extrapolated (see :func:`extrapolation_depths`), unless
    ``full_depth``; the output says which.

    The model is built from its config.json on the ``meta`` device and wrapped with PEFT LoRA there (PEFT cannot move
    modules under FakeTensorMode), then every parameter and buffer becomes a fake tensor (shape, dtype and device, no
    data), which, unlike meta tensors, answers the ``.item()`` calls of checkpointing and masking. FoRA's own code then
    runs on it: one Fisher scoring batch through :func:`fora_plugin.fisher.fisher_scores` on the model as scoring holds
    it (LoRA on every target layer, adapters off), and one training step per mode (``fora``, ``fg-lora``, ``lora``):
    forward and backward with the run's checkpointing and autocast, and the optimizer step with its states (FoRA's
    optimizer as :func:`fora_plugin.training.fora_optimizer` builds it, the Trainer's AdamW for ``lora``).

    A decoder stack that repeats every p layers is run at p, 2p and 3p layers and extrapolated to its L layers when
    every count lies exactly on one line (:func:`extrapolation_depths`); else, or with ``full_depth``, all L layers
    run.

    A :class:`~fora_plugin.plan.memory.LiveTensorTracker` counts live storages; its peak is broken down into weights,
    LoRA (parameters, gradients, optimizer states), activations (what the forward left alive for the backward) and
    transient buffers. ``torch.utils.flop_counter.FlopCounterMode`` counts FLOPs.

    What is modelled rather than run: a 4-bit bitsandbytes base is a bf16 linear scored and trained the way
    bitsandbytes' are (no weight gradient; fisher.py scores it from x and g), counted at its packed size (NF4 plus
    absmax constants) with one dequantized weight alive during its matmul; sharded engines (ZeRO-1/2/3, FSDP2) divide
    what they shard by the number of GPUs, by their rules in :mod:`fora_plugin.plan.engine_rules` (the output says so;
    bench/plan_fsdp2_simulation.py checks FSDP2's against ``fully_shard`` on a fake process group).
    """
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise FoRAInputError(f"modes={modes!r}: plan one or more of {MODES}, each once.")
    started = time.perf_counter()
    result: dict[str, Any] = {"phases": {}, "notes": list(setup.notes)}
    scoring = (
        any(m != "lora" for m in modes)
        and setup.fora.selects_layers
        and setup.fora.layers is None
        and setup.fora.scores_path is None
        and setup.fora.layer_strategy == "fisher"
    )
    base = meta_model_of(setup)
    num_layers = len(find_decoder_layers(base)[1])
    planned, placement = planned_placement(setup, num_layers)
    if any(m != "lora" for m in modes) and setup.fora.selects_layers:
        result["notes"].append(placement)
    depths = None
    # A config whose layer count is not num_hidden_layers (a nested text config) cannot be cut: all layers run.
    if not full_depth and getattr(setup.model_config, "num_hidden_layers", None) == num_layers:
        # With LoRA on: target names may reach some layers only (a full module name, target_parameters).
        depths = extrapolation_depths(wrap_lora(setup, base).get_base_model(), planned)
    del base
    measured, result["depths"], notes = measure_over_depth(setup, modes, planned, scoring, depths, num_layers)
    result["notes"] += notes
    buffers = setup.reduce_buffers
    if buffers is not None:
        result["notes"].append(
            f"{setup.engine}: DeepSpeed's gradient reduction buffers counted in each step's backward (transient, "
            f"every GPU): {buffers.count} x {buffers.elements:,} {str(buffers.dtype).removeprefix('torch.')} "
            f"elements = {buffers.nbytes / GIB:.2f} GiB ({buffers.settings}), whatever the trainable count"
        )
    # Built once: it sizes a meta model of every layer, and shard_phase runs per mode, phase and candidate.
    rule = ENGINES[setup.engine]
    gathers = rule.gathered_layers if setup.gpus > 1 else rule.gathered_layers_one_rank
    gathered = gathered_bytes(setup) if gathers else None
    for mode in modes:
        entry: dict[str, Any] = {}
        phases = {"scoring": measured["scoring"]} if "scoring" in measured and mode != "lora" else {}
        for name, candidates in {**phases, "step": measured[mode]}.items():
            # The per-GPU peak is the larger candidate once each is sharded.
            sharded = [shard_phase(setup, phase, name == "scoring", gathered) for phase in candidates]
            entry[name] = max((phase for phase, _ in sharded), key=lambda phase: phase.total)
            notes = [note for _, notes in sharded for note in notes]
            result["notes"] += [note for note in dict.fromkeys(notes) if note not in result["notes"]]
        result["phases"][mode] = entry
    result["seconds"] = time.perf_counter() - started
    return result


def plan(
    config: str,
    overrides: list[str],
    *,
    gpus: int = 1,
    gpu_memory: float | None = None,
    model_config: str | None = None,
    output: str | None = None,
    full_depth: bool = False,
) -> tuple[str, dict[str, Any]]:
    """`fora plan`: the printed table and plan.json's content; writes plan.json and plan.png into the output dir."""
    setup = plan_setup(config, overrides, gpus=gpus, model_config=model_config, output=output)
    result = run_plan(setup, full_depth=full_depth)
    text = format_plan(setup, result, gpu_memory)
    payload = plan_json(setup, result, gpu_memory)
    setup.output_dir.mkdir(parents=True, exist_ok=True)
    (setup.output_dir / "plan.json").write_text(json.dumps(payload, indent=2))
    plot_plan(setup.output_dir / "plan.png", setup, result, gpu_memory)
    return text, payload
