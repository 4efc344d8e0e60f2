"""Which layers to adapt: top-K by Fisher score, or the paper's controls (random, first, last, explicit).

The one home of the layer-budget and explicit-layer rules: :class:`fora_plugin.config.FoRAConfig` checks its values
here without the model, and the wiring again against the model's layer count.

May import: errors, validation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from .errors import FoRAInputError, FoRAInputTypeError
from .validation import is_integer, is_real


__all__ = [
    "LAYER_STRATEGIES",
    "check_layer_indices",
    "check_layer_list",
    "check_scores_finite",
    "parse_layer_budget",
    "resolve_layer_budget",
    "select_layers",
]

LAYER_STRATEGIES = ("fisher", "random", "first", "last")


def parse_layer_budget(value: float | int | str) -> float | int:
    """A layer budget as a number, checked without the model: a fraction in (0, 1] or an int K >= 1. From the command
    line every value is a string: "8" is K = 8, "0.5" is a fraction."""
    if isinstance(value, str):
        try:
            value = int(value) if value.strip().lstrip("+").isdigit() else float(value)
        except ValueError:
            raise FoRAInputError(f"layer_budget={value!r} is invalid: use a fraction in (0, 1] or an int K.") from None
    if not is_real(value):
        raise FoRAInputError(f"layer_budget={value!r} is invalid: use a fraction in (0, 1] or an int K.")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise FoRAInputError(f"layer_budget={value} is a fraction outside (0, 1]: use e.g. 0.5 (K = L/2) or an int K.")
    if isinstance(value, int) and value < 1:
        raise FoRAInputError(f"layer_budget={value} gives K < 1: adapt at least one layer.")
    return value


def resolve_layer_budget(layer_budget: float | int, num_layers: int) -> int:
    """K from a budget: a float in (0, 1] is a fraction of the ``num_layers`` layers (rounded), an int is K itself."""
    if not is_real(layer_budget):
        raise FoRAInputTypeError(
            f"layer_budget={layer_budget!r} must be a fraction in (0, 1] or an int number of layers."
        )
    if isinstance(layer_budget, float):
        parse_layer_budget(layer_budget)
        k = math.floor(layer_budget * num_layers + 0.5)
        if k < 1:
            raise FoRAInputError(
                f"layer_budget={layer_budget} of {num_layers} layers gives K=0: use at least "
                f"{1 / num_layers:.3g} or an int K >= 1."
            )
        return k
    if not 1 <= layer_budget <= num_layers:
        raise FoRAInputError(
            f"layer_budget={layer_budget} layers is outside 1..{num_layers} (the model's layer count)."
        )
    return layer_budget


def check_layer_list(layers: Sequence[int]) -> list[int]:
    """An explicit layer list checked without the model: distinct 0-based indices, at least one."""
    layers = list(layers)
    bad = [i for i in layers if not is_integer(i) or i < 0]
    if bad or not layers or len(set(layers)) != len(layers):
        raise FoRAInputError(f"layers={layers!r} is invalid: use distinct 0-based layer indices, e.g. [0, 3, 7].")
    return layers


def select_layers(
    scores: Sequence[float] | None,
    k: int,
    *,
    strategy: str = "fisher",
    num_layers: int | None = None,
    seed: int = 0,
) -> list[int]:
    """The K layer indices to adapt, sorted.

    ``"fisher"``: the K highest ``scores`` (ties go to the lower index). The paper's controls ignore the scores:
    ``"random"`` (seeded), ``"first"``, ``"last"``; they need ``num_layers`` when no scores are given.
    """
    if strategy not in LAYER_STRATEGIES:
        raise FoRAInputError(f"layer_strategy={strategy!r} is invalid: use one of {LAYER_STRATEGIES}.")
    if scores is None:
        if strategy == "fisher":
            raise FoRAInputError("layer_strategy='fisher' needs Fisher scores.")
        if num_layers is None:
            raise FoRAInputError(f"layer_strategy={strategy!r} without scores needs num_layers.")
        n = num_layers
    else:
        n = len(scores)
    if not is_integer(k) or not 1 <= k <= n:
        raise FoRAInputError(f"K={k!r} layers is invalid for a model with {n} layers: use 1 <= K <= {n}.")
    if strategy == "fisher":
        check_scores_finite(scores)
        ranked = sorted(range(n), key=lambda i: (-scores[i], i))
        return sorted(ranked[:k])
    if strategy == "random":
        return sorted(random.Random(seed).sample(range(n), k))
    if strategy == "first":
        return list(range(k))
    return list(range(n - k, n))


def check_scores_finite(scores: Sequence[float]) -> None:
    """Refuse NaN/inf Fisher scores: ``sorted`` would order them arbitrarily and pick a meaningless top-K."""
    bad = {i: s for i, s in enumerate(scores) if not math.isfinite(s)}
    if bad:
        values = ", ".join(f"{i}: {s}" for i, s in bad.items())
        raise FoRAInputError(
            f"Fisher scores of layers {sorted(bad)} are not finite ({values}), "
            "so no top-K can be chosen. The loss or its gradients overflowed on the scoring batches: check the base "
            "model for NaN/inf weights and the data for empty completions, score in float32 (dtype: float32), or "
            "pick the layers yourself (fora_layers)."
        )


def check_layer_indices(layers: Sequence[int], num_layers: int) -> list[int]:
    """Validate an explicit layer list against the model: ints in 0..num_layers-1, no repeats."""
    bad = [i for i in layers if not is_integer(i) or not 0 <= i < num_layers]
    if bad:
        raise FoRAInputError(
            f"layers={list(layers)} has indices {bad} outside 0..{num_layers - 1} (the model has "
            f"{num_layers} decoder layers)."
        )
    if len(set(layers)) != len(layers):
        raise FoRAInputError(f"layers={list(layers)} repeats an index.")
    return sorted(layers)
