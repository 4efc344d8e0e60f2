"""Which layers to adapt: top-K by Fisher score, or the paper's controls (random, first, last, explicit); and the
record of the choice, :class:`FoRASelection`, saved as ``fora_scores.json`` (its file name and keys live here only).

The one home of the layer-budget and explicit-layer rules: :class:`fora_plugin.config.FoRAConfig` checks its values
here without the model, and the wiring again against the model's layer count.

May import: errors, files, fisher, validation.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from .errors import FoRAInputError, FoRAInputTypeError
from .files import read_json
from .fisher import FisherScores
from .validation import is_integer, is_real


__all__ = [
    "LAYER_STRATEGIES",
    "SCORES_FILE",
    "SCORES_PLOT",
    "FoRASelection",
    "check_layer_indices",
    "check_layer_list",
    "check_scores_finite",
    "load_scores",
    "parse_layer_budget",
    "resolve_layer_budget",
    "select_layers",
]

LAYER_STRATEGIES = ("fisher", "random", "first", "last")
# The selection's files, in the output folder (and the JSON in every checkpoint): the record and its plot.
SCORES_FILE = "fora_scores.json"
SCORES_PLOT = "fora_scores.png"


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


# ---------------------------------------------------------------------------------------------------- the record
@dataclass
class FoRASelection:
    """The chosen layers and how they were chosen: the record saved as ``fora_scores.json`` (:meth:`save`) in the
    output folder and in every checkpoint, and read back (:meth:`load`) to resume on the same layers or to report.

    ``trainable_parameters`` (layer -> count), the targets and ``lora_all_layers_parameters`` (the count LoRA on every
    layer would have) are filled in once the adapter is in place.
    """

    chosen: list[int]
    num_layers: int
    layer_prefix: str
    _: KW_ONLY
    scores: FisherScores | None = None
    source: str = "fisher"
    mode: str = "fora"
    target_modules: list[str] = field(default_factory=list)
    target_parameters: list[str] = field(default_factory=list)
    trainable_parameters: dict[int, int] = field(default_factory=dict)
    lora_all_layers_parameters: int = 0

    def __post_init__(self) -> None:
        self.chosen = sorted(self.chosen)

    def to_dict(self) -> dict[str, Any]:
        """The record as its JSON file holds it."""
        s = self.scores
        return {
            "mode": self.mode,
            "source": self.source,
            "num_layers": self.num_layers,
            "k": len(self.chosen),
            "chosen_layers": self.chosen,
            "scores": s.scores if s else None,
            "num_batches": s.num_batches if s else None,
            "fisher_params": s.fisher_params if s else None,
            "seconds": s.seconds if s else None,
            "peak_memory_bytes": s.peak_memory_bytes if s else None,
            "layer_prefix": self.layer_prefix,
            "target_modules": self.target_modules,
            "target_parameters": self.target_parameters,
            "trainable_parameters_per_layer": {str(k): v for k, v in self.trainable_parameters.items()},
            "lora_all_layers_parameters": self.lora_all_layers_parameters,
        }

    @classmethod
    def from_dict(cls, saved: Any, where: str) -> FoRASelection:
        """The record a JSON document holds (``where``: the file, for the message); refused when it is not one."""
        try:
            if not isinstance(saved, Mapping):
                raise TypeError(f"a {type(saved).__name__}, not a mapping")
            chosen, num_layers = saved["chosen_layers"], saved["num_layers"]
            if not (isinstance(chosen, list) and all(map(is_integer, chosen)) and is_integer(num_layers)):
                raise TypeError(f"chosen_layers={chosen!r}, num_layers={num_layers!r}")
            scores = _scores_of(saved)
            per_layer = {int(k): v for k, v in (saved.get("trainable_parameters_per_layer") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise FoRAInputError(
                f"{where} is not a FoRA selection ({type(error).__name__}: {error}): remove it, or run `fora score` "
                "to write it again."
            ) from None
        return cls(
            chosen,
            num_layers,
            saved.get("layer_prefix") or "",
            scores=scores,
            source=saved.get("source", "fisher"),
            mode=saved.get("mode", "fora"),
            target_modules=list(saved.get("target_modules") or []),
            target_parameters=list(saved.get("target_parameters") or []),
            trainable_parameters=per_layer,
            lora_all_layers_parameters=saved.get("lora_all_layers_parameters") or 0,
        )

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the record into ``folder`` (created if need be); returns the file."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        file = folder / SCORES_FILE
        file.write_text(json.dumps(self.to_dict(), indent=2))
        return file

    @classmethod
    def load(
        cls, path: str | os.PathLike, key: str | None = None, *, missing_ok: bool = False
    ) -> FoRASelection | None:
        """The record in ``path`` (the file, or a folder holding it); a malformed file is refused naming the file
        (as ``key``'s value when given), the line and the column. A missing one is refused, or None with
        ``missing_ok``."""
        file = _record_file(path)
        if not file.is_file():
            if missing_ok:
                return None
            raise FoRAInputError(f"No FoRA selection at {file}: expected the {SCORES_FILE} an earlier run wrote.")
        return cls.from_dict(read_json(file, key=key), str(file))

    def check_adapter_layers(self, adapted_layers: list[int], folder: str | os.PathLike) -> None:
        """Refuse a record whose chosen layers are not the layers the adapter in ``folder`` (next to it) is on.

        The selection files of one run next to the adapter of another (a failed later run's, a copied folder) would
        plot and report the wrong chosen layers.
        """
        if adapted_layers and self.chosen != sorted(adapted_layers):
            raise FoRAInputError(
                f"{Path(folder) / SCORES_FILE} says layers {self.chosen} were chosen, but the adapter in {folder} is "
                f"on layers {sorted(adapted_layers)}: the selection files belong to another run. Remove "
                f"{SCORES_FILE} and {SCORES_PLOT} there (or run `fora score` with this run's config to write them "
                "again)."
            )


def load_scores(path: str | os.PathLike, num_layers: int, key: str) -> FisherScores:
    """The Fisher scores of an earlier run's record (``path``: the file or its folder), to choose layers again from;
    refused unless it holds one score per decoder layer of this model (``num_layers``). Only its scores are read: a
    file holding ``{"scores": [...]}`` alone is accepted."""
    file = _record_file(path)
    if not file.is_file():
        raise FoRAInputError(f"No FoRA selection at {file}: expected the {SCORES_FILE} an earlier run wrote.")
    saved = read_json(file, key=key)
    try:
        scores = _scores_of(saved) if isinstance(saved, Mapping) else None
    except TypeError as error:
        raise FoRAInputError(f"{key}={os.fspath(path)!r} is invalid: {error}.") from None
    if scores is None or len(scores.scores) != num_layers:
        held = "no scores" if scores is None else f"scores for {len(scores.scores)} layers"
        raise FoRAInputError(
            f"{key}={os.fspath(path)!r} holds {held}, but this model has {num_layers} decoder layers: give the "
            f"{SCORES_FILE} of a run on this model, or leave {key} unset to score again."
        )
    return scores


def _record_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path / SCORES_FILE if path.is_dir() else path


def _scores_of(saved: Mapping[str, Any]) -> FisherScores | None:
    """The FisherScores a record holds; None when it holds no scores (layers given, or a control strategy)."""
    scores = saved.get("scores")
    if scores is None:
        return None
    if not (isinstance(scores, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in scores)):
        raise TypeError(f"its scores {scores!r} are not one number per decoder layer")
    return FisherScores(
        scores,
        saved.get("num_batches"),
        saved.get("fisher_params"),
        saved.get("seconds") or 0.0,
        saved.get("peak_memory_bytes"),
        saved.get("layer_prefix") or "",
    )
