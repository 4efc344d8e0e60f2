"""Per-GPU bytes under a sharded engine: a phase measured on one unsharded GPU, read through the engine's rule in
:mod:`fora_plugin.plan.engine_rules` (what it shards, what it gathers while computing). Computed, not simulated ranks
(bench/plan_fsdp2_simulation.py checks FSDP2's against ``fully_shard`` on a fake process group).

May import: plan.engine_rules, plan.fake_model, plan.measure, plan.setup, targets.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..targets import find_decoder_layers
from .engine_rules import ENGINES, GATHERED, PARTS, EngineSharding
from .fake_model import four_bit_linears, meta_model_of
from .measure import GIB, Phase
from .setup import PlanSetup


__all__ = ["gathered_bytes", "shard_phase"]

# What is not alive yet at a forward's first all-gather: no activation, no transient buffer, no gradient (zero_grad
# left none).
_ABSENT_AT_FORWARD_START = ("activations", "transient", "lora_grads")


def shard_phase(
    setup: PlanSetup, phase: Phase, scoring: bool, gathered: tuple[int, int, int] | None
) -> tuple[Phase, list[str]]:
    """Per-GPU bytes of ``phase`` under ``setup``'s engine: what it shards divided by the number of GPUs, what it
    gathers added as transient (said in the notes returned). ``gathered`` is :func:`gathered_bytes`, for the engines
    that gather weights."""
    w = setup.gpus
    rule = ENGINES[setup.engine]
    # Scoring before the engine wraps the model (shards_scoring empty: FSDP2) gathers nothing.
    if w == 1 and rule.gathered_layers_one_rank and (rule.shards_scoring or not scoring):
        layer, outside = _gathered(rule, gathered)
        extra = rule.gathered_layers_one_rank * layer + outside
        peak = {**phase.peak, "transient": phase.peak.get("transient", 0) + extra}
        note = (
            f"{setup.engine} on 1 GPU: nothing divided; + {extra / GIB:.2f} GiB transient: "
            f"{_count(rule.gathered_layers_one_rank)} gathered decoder layer(s) and {GATHERED[rule.gathered_outside]} "
            "(all-gathered into buffers of its own with one rank too)"
        )
        return dataclasses.replace(phase, peak=peak), [note]
    if not rule.shards or w == 1:
        return phase, []
    sharded = rule.shards_scoring if scoring else rule.shards
    if not sharded:
        return phase, [f"{setup.engine}: scoring holds the whole model on every GPU (before sharding)"]
    peak = {k: (math.ceil(v / w) if k in sharded else v) for k, v in phase.peak.items()}
    note = f"{setup.engine} over {w} GPUs: {', '.join(sharded)} divided by {w} (computed, not simulated ranks)"
    if rule.gathered_layers:
        # Gathered while computing: the current and the prefetched decoder layer, and the head or the FSDP2 root.
        layer, outside = _gathered(rule, gathered)
        layers = rule.gathered_layers * layer
        peak["transient"] = peak.get("transient", 0) + layers + outside
        note += (
            f"; + {(layers + outside) / GIB:.2f} GiB transient: {_count(rule.gathered_layers)} gathered decoder "
            f"layers and {GATHERED[rule.gathered_outside]}"
        )
        if rule.forward_start_copies:
            # The moment of a forward's first all-gather, before any activation or gradient. FSDPMemTracker puts the
            # step's peak there once the rest of the step holds less (bench/plan_fsdp2_simulation.py, checkpointing
            # on).
            start = {k: v for k, v in peak.items() if k not in _ABSENT_AT_FORWARD_START}
            start["transient"] = rule.forward_start_copies * (outside + layer)
            if sum(start.values()) > sum(peak.values()):
                peak = start
                note += (
                    f"; the peak is the forward's first all-gather: {start['transient'] / GIB:.2f} GiB, the root and "
                    "a decoder layer twice (all-gather buffers and unsharded parameters)"
                )
    notes = [note]
    notes += [f"{setup.engine}: {PARTS[part]} are whole on every GPU" for part in rule.whole if phase.peak.get(part)]
    return dataclasses.replace(phase, peak=peak), notes


def _gathered(rule: EngineSharding, gathered: tuple[int, int, int]) -> tuple[int, int]:
    """(bytes of a gathered decoder layer, bytes of what the rule keeps gathered outside the layers)."""
    layer, head, root = gathered
    return layer, {"head": head, "root": root}[rule.gathered_outside]


def _count(n: int) -> str:
    return {1: "one", 2: "two", 3: "three"}.get(n, str(n))


def gathered_bytes(setup: PlanSetup) -> tuple[int, int, int]:
    """Bytes of the largest decoder layer's weights (4-bit packed where the run quantizes), of the output head, and
    of every weight outside the decoder layers (embeddings, final norm, head; tied ones once)."""
    model = meta_model_of(setup)
    four_bit = {id(m.weight) for m in four_bit_linears(model)} if setup.four_bit is not None else set()

    def size(p: torch.Tensor) -> int:
        return setup.four_bit.packed_bytes(p.numel()) if id(p) in four_bit else p.numel() * p.element_size()

    _, layers = find_decoder_layers(model)
    layer = max(sum(size(p) for p in block.parameters()) for block in layers)
    head = model.get_output_embeddings()
    in_layers = {id(p) for block in layers for p in block.parameters()}
    root = sum(size(p) for p in model.parameters() if id(p) not in in_layers)  # parameters() yields tied ones once
    return layer, sum(size(p) for p in head.parameters()) if head is not None else 0, root
