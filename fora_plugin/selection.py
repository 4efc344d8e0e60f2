"""Which layers to adapt: top-K by Fisher score, or the paper's controls (random, first, last, explicit)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


LAYER_STRATEGIES = ("fisher", "random", "first", "last")


def resolve_layer_budget(layer_budget: float | int, num_layers: int) -> int:
    """K from a budget: a float in (0, 1] is a fraction of the ``num_layers`` layers (rounded), an int is K itself."""
    if isinstance(layer_budget, bool) or not isinstance(layer_budget, (int, float)):
        raise TypeError(f"layer_budget={layer_budget!r} must be a fraction in (0, 1] or an int number of layers.")
    if isinstance(layer_budget, float):
        if not 0.0 < layer_budget <= 1.0:
            raise ValueError(
                f"layer_budget={layer_budget} is a fraction outside (0, 1]: use e.g. 0.5 for half of "
                f"the {num_layers} layers, or an int K."
            )
        k = math.floor(layer_budget * num_layers + 0.5)
        if k < 1:
            raise ValueError(
                f"layer_budget={layer_budget} of {num_layers} layers gives K=0: use at least "
                f"{1 / num_layers:.3g} or an int K >= 1."
            )
        return k
    if not 1 <= layer_budget <= num_layers:
        raise ValueError(f"layer_budget={layer_budget} layers is outside 1..{num_layers} (the model's layer count).")
    return layer_budget


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
        raise ValueError(f"layer_strategy={strategy!r} is invalid: use one of {LAYER_STRATEGIES}.")
    if scores is None:
        if strategy == "fisher":
            raise ValueError("layer_strategy='fisher' needs Fisher scores.")
        if num_layers is None:
            raise ValueError(f"layer_strategy={strategy!r} without scores needs num_layers.")
        n = num_layers
    else:
        n = len(scores)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"K={k!r} layers is invalid for a model with {n} layers: use 1 <= K <= {n}.")
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
        raise ValueError(
            f"Fisher scores of layers {sorted(bad)} are not finite ({values}), "
            "so no top-K can be chosen. The loss or its gradients overflowed on the scoring batches: check the base "
            "model for NaN/inf weights and the data for empty completions, score in float32 (dtype: float32), or "
            "pick the layers yourself (fora_layers)."
        )


def check_layer_indices(layers: Sequence[int], num_layers: int) -> list[int]:
    """Validate an explicit layer list against the model: ints in 0..num_layers-1, no repeats."""
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"layers={list(layers)} has indices {bad} outside 0..{num_layers - 1} (the model has "
            f"{num_layers} decoder layers)."
        )
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers={list(layers)} repeats an index.")
    return sorted(layers)
