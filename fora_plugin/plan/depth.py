"""Depth extrapolation: a decoder stack that repeats every p layers is measured at p, 2p and 3p layers and its counts
extended to its L layers, when every count lies exactly on one line; else all L layers are measured.

Every byte count and FLOP count of the three runs must lie on one line (they do when the peak falls at the same point
of the run at each depth), and the three runs must run fewer layers than L itself.

May import: plan.measure, plan.setup, targets.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch import nn

from ..targets import find_decoder_layers
from .measure import Phase, measure
from .setup import PlanSetup


__all__ = ["extrapolation_depths", "measure_over_depth", "truncated_config"]

_DEPTH_MULTIPLES = (1, 2, 3)


def _layer_signatures(model: nn.Module, planned: list[int]) -> list[tuple]:
    """What makes decoder layers differ: their modules, parameter shapes and dtypes, attention kind, their entries in
    the config's per-layer lists (layer_types, no_rope_layers, ...), and whether fora adapts them."""
    _, layers = find_decoder_layers(model)
    per_layer = _per_layer_lists(model.config, len(layers))
    chosen = set(planned)
    signatures = []
    for i, layer in enumerate(layers):
        modules = tuple(
            (name, type(m).__name__, *(repr(getattr(m, a, None)) for a in ("sliding_window", "attention_type")))
            for name, m in layer.named_modules()
        )
        tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in [*layer.named_parameters(), *layer.named_buffers()])
        listed = tuple((name, repr(value[i])) for name, value in per_layer.items())
        signatures.append((modules, tensors, listed, i in chosen))
    return signatures


def extrapolation_depths(model: nn.Module, planned: list[int]) -> tuple[int, ...] | None:
    """The depths to run and extrapolate from (p, 2p, 3p for a stack repeating every p layers), or None when the
    stack does not repeat or running them would not be faster than running all its layers."""
    signatures = _layer_signatures(model, planned)
    num_layers = len(signatures)
    for period in range(1, num_layers + 1):
        if num_layers % period == 0 and all(s == signatures[i % period] for i, s in enumerate(signatures)):
            break
    depths = tuple(m * period for m in _DEPTH_MULTIPLES)
    return depths if depths[-1] <= num_layers and _saves_time(depths, num_layers) else None


def _saves_time(depths: tuple[int, ...], num_layers: int) -> bool:
    return sum(depths) < num_layers


def _per_layer_lists(config, num_layers: int) -> dict[str, list | tuple]:
    """The config's lists with one entry per decoder layer (layer_types, no_rope_layers, ...)."""
    return {n: v for n, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == num_layers}


def truncated_config(config: Any, num_layers: int) -> Any:
    """``config`` (a PretrainedConfig) with its first ``num_layers`` decoder layers: per-layer lists cut to match."""
    out = copy.deepcopy(config)
    for name, value in _per_layer_lists(config, config.num_hidden_layers).items():
        setattr(out, name, type(value)(value[:num_layers]))
    out.num_hidden_layers = num_layers
    return out


def _extrapolate(
    runs: list[dict[str, list[Phase]]], depths: tuple[int, ...], num_layers: int
) -> dict[str, list[Phase]] | str:
    """Each phase at ``num_layers`` layers from its values at ``depths``, if they lie on a line; else the first
    quantity that does not (a description) in place of the result."""
    step = depths[1] - depths[0]
    out: dict[str, list[Phase]] = {}
    for key, candidates in runs[0].items():
        out[key] = []
        for index in range(len(candidates)):
            at = [run[key][index] for run in runs]
            parts = dict.fromkeys(k for p in at for k in p.peak)  # in order of appearance: plan.json is stable
            values = {f"{part} bytes": [p.peak.get(part, 0) for p in at] for part in parts}
            values["FLOPs"] = [p.flops for p in at]
            values["trainable parameters"] = [p.trainable for p in at]
            line = {}
            for name, v in values.items():
                slopes = {b - a for a, b in zip(v, v[1:])}
                if len(slopes) != 1:
                    return f"{key}: {name} at {depths} layers is {v}, not on a line"
                line[name] = v[0] + (num_layers - depths[0]) // step * slopes.pop()
                if line[name] < 0:
                    return f"{key}: {name} at {depths} layers is {v}, which falls below 0 at {num_layers}"
            peak = {name.removesuffix(" bytes"): v for name, v in line.items() if name.endswith(" bytes") and v}
            out[key].append(Phase(peak=peak, flops=line["FLOPs"], trainable=line["trainable parameters"]))
    return out


def _measure_depths(
    setup: PlanSetup,
    modes: tuple[str, ...],
    planned: list[int],
    scoring: bool,
    depths: tuple[int, ...],
    num_layers: int,
) -> dict[str, list[Phase]] | str:
    """:func:`~fora_plugin.plan.measure.measure` at each of ``depths`` layers, extrapolated to ``num_layers`` (or
    why that did not hold)."""
    runs = [
        measure(
            dataclasses.replace(setup, model_config=truncated_config(setup.model_config, d)),
            modes,
            [layer for layer in planned if layer < d],
            scoring,
        )
        for d in depths
    ]
    return _extrapolate(runs, depths, num_layers)


def measure_over_depth(
    setup: PlanSetup,
    modes: tuple[str, ...],
    planned: list[int],
    scoring: bool,
    depths: tuple[int, ...] | None,
    num_layers: int,
) -> tuple[dict[str, list[Phase]], list[int], list[str]]:
    """The measurements of all ``num_layers`` layers: extrapolated from ``depths`` (:func:`extrapolation_depths`)
    where the counts lie on a line, else (or with ``depths`` None) measured at full depth. Returns them, the depths
    run, and notes saying which."""
    notes = []
    measured = None
    if depths is not None:
        measured = _measure_depths(setup, modes, planned, scoring, depths, num_layers)
        period = depths[1] - depths[0]
        later = tuple(d + period for d in depths)
        if isinstance(measured, str) and later[-1] <= num_layers and _saves_time(later, num_layers):
            # The lowest adapted layer forms no gradient of its input (the backward stops there): when it lies in the
            # first period, that period's transient peak can differ from the others'. One period later it does not.
            depths = later
            measured = _measure_depths(setup, modes, planned, scoring, depths, num_layers)
        if isinstance(measured, str):
            notes.append(f"depth extrapolation did not hold ({measured}): ran all {num_layers} layers")
            measured = depths = None
        else:
            notes.append(
                f"the {num_layers} decoder layers repeat every {period}: ran {', '.join(map(str, depths))} of "
                f"them and extrapolated (every count on one line; --full-depth runs all {num_layers})"
            )
    if measured is None:
        measured = measure(setup, modes, planned, scoring)
    return measured, list(depths) if depths is not None else [num_layers], notes
