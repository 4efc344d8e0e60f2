"""Warn when a FoRA run diverges, instead of finishing it silently with a NaN or drifted adapter.

A diverging run shows in what the trainer logs anyway: the loss or the gradient norm turns non-finite or jumps by
orders of magnitude, and FoRA's ``fora/max_orthogonality_error`` grows. Cayley-Adam meanwhile skips steps with a
non-finite gradient and re-projects a lora_B that drifted from the manifold (its ``skipped_steps`` and
``reprojections`` counters). :class:`DivergenceMonitor` reads both at every log and warns once per kind, naming the
step, the value and the usual fixes.

May import: optim, validation.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

from transformers import TrainerCallback

from .optim import COUNTERS, REPROJECT_THRESHOLD, counter_totals, find_stiefel_optimizer
from .validation import check_float


__all__ = ["FIXES", "DivergenceMonitor", "stiefel_counters"]


logger = logging.getLogger(__name__)

FIXES = (
    "lower learning_rate and/or fora_lr_stiefel (e.g. by 10x), clip gradients (max_grad_norm: 1.0), or train in "
    "bf16 rather than fp16"
)


def stiefel_counters(optimizer: Any) -> dict[str, int] | None:
    """FoRA's Cayley-Adam ``skipped_steps`` and ``reprojections`` totals, through the wrappers a trainer puts around
    its optimizer (accelerate's ``AcceleratedOptimizer``, DeepSpeed's ZeRO optimizer and FoRA's ZeRO client); None
    when no Cayley-Adam is found. One host sync for both."""
    stiefel = find_stiefel_optimizer(optimizer)
    return None if stiefel is None else counter_totals(stiefel)


class DivergenceMonitor(TrainerCallback):
    """Warn once per kind when a run diverges: add it to any HF ``Trainer`` (FoRASFTTrainer and the Axolotl plugin
    do).

    Kinds: a non-finite ``loss``; a non-finite ``grad_norm``; a ``grad_norm`` more than ``grad_norm_jump`` times the
    median of the earlier ones; ``fora/max_orthogonality_error`` above ``orthogonality_threshold`` (or non-finite);
    Cayley-Adam steps skipped for a non-finite gradient; lora_B re-projected onto the manifold for drifting.

    Args:
        orthogonality_threshold: the ‖BᵀB − I‖_F above which to warn (Cayley-Adam re-projects above the same value
            by default, so a logged error above it means the re-projection could not keep up).
        grad_norm_jump: the factor over the median of the earlier gradient norms that counts as a blow-up.
    """

    def __init__(self, orthogonality_threshold: float = REPROJECT_THRESHOLD, grad_norm_jump: float = 1e3) -> None:
        for name, value in (("orthogonality_threshold", orthogonality_threshold), ("grad_norm_jump", grad_norm_jump)):
            check_float(f"DivergenceMonitor {name}", value, lambda x: x > 0, "a finite float > 0")
        self.orthogonality_threshold = orthogonality_threshold
        self.grad_norm_jump = grad_norm_jump
        self.warned: set[str] = set()
        self._grad_norms: list[float] = []

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            logger.warning(message)

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        logs = logs or {}
        step = state.global_step
        loss = logs.get("loss")
        if isinstance(loss, (int, float)) and not math.isfinite(loss):
            self._warn("loss", f"FoRA: the training loss is {loss} at step {step}: the run has diverged; {FIXES}.")
        self._check_grad_norm(logs.get("grad_norm"), step)
        drift = logs.get("fora/max_orthogonality_error")
        if isinstance(drift, (int, float)) and not drift <= self.orthogonality_threshold:
            self._warn(
                "orthogonality",
                f"FoRA: fora/max_orthogonality_error = {drift:.3g} at step {step} (threshold "
                f"{self.orthogonality_threshold:g}): lora_B has left the Stiefel manifold (BᵀB != I), so ΔW = BA no "
                f"longer has A's spectrum. Cayley-Adam's steps are too large or the gradients non-finite; {FIXES}.",
            )
        # FoRA's trainers log the counters (``fora/skipped_steps``, ``fora/reprojections``), read with the log's other
        # values; any other trainer's log costs a read of its own.
        logged = {name: logs.get(f"fora/{name}") for name in COUNTERS}
        if all(isinstance(value, (int, float)) for value in logged.values()):
            counters = {name: int(value) for name, value in logged.items()}
        else:
            counters = stiefel_counters(kwargs.get("optimizer"))
        if counters and counters["skipped_steps"]:
            self._warn(
                "skipped_steps",
                f"FoRA: by step {step}, Cayley-Adam skipped {counters['skipped_steps']} lora_B step(s) for a "
                f"non-finite gradient (B and its moments were left unchanged); {FIXES}.",
            )
        if counters and counters["reprojections"]:
            self._warn(
                "reprojections",
                f"FoRA: by step {step}, Cayley-Adam re-projected a lora_B onto the manifold "
                f"{counters['reprojections']} time(s) because ‖BᵀB − I‖ passed its reproject_threshold: the "
                f"steps are too large for fp32 rounding to stay small; {FIXES}.",
            )
        return control

    def _check_grad_norm(self, grad_norm: Any, step: int) -> None:
        if not isinstance(grad_norm, (int, float)):
            return
        if not math.isfinite(grad_norm):
            self._warn(
                "grad_norm",
                f"FoRA: grad_norm is {grad_norm} at step {step}: non-finite gradients (AdamW's lora_A turns NaN "
                f"with them, Cayley-Adam skips lora_B's step); {FIXES}.",
            )
            return
        if self._grad_norms:
            typical = statistics.median(self._grad_norms)
            if typical > 0 and grad_norm > self.grad_norm_jump * typical:
                self._warn(
                    "grad_norm_jump",
                    f"FoRA: grad_norm jumped to {grad_norm:.3g} at step {step}, {grad_norm / typical:.2g}x the "
                    f"median {typical:.3g} of the earlier logs: the run is diverging; {FIXES}.",
                )
        self._grad_norms.append(grad_norm)
