"""What a trained adapter looks like: singular spectrum and effective rank of ΔW = BA, drift of lora_B.

The training-log diagnostics (:func:`read_adapter_diagnostics`) make one host sync per log: on the device, each
adapter is reduced to two r x r Gram matrices (BᵀB and AAᵀ) and every ``lora_B``'s drift to one number; all of them
are read back in one transfer, and the r x r spectra are finished on the host (NumPy), where a LAPACK call costs no
device sync. On an accelerator, a per-adapter SVD or ``.item()`` would each stall the launch queue.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from peft.tuners.lora import LoraLayer
from torch import nn


__all__ = [
    "adapter_grams",
    "delta_w_singular_values",
    "effective_rank",
    "largest_drift",
    "lora_pairs",
    "mean_effective_rank",
    "read_adapter_diagnostics",
    "singular_values_from_grams",
]


def _entropy_effective_rank(s: np.ndarray) -> float:
    """exp(−Σ pᵢ log pᵢ), pᵢ = σᵢ / Σσ, of host singular values; 0 for a zero matrix, NaN if one is not finite."""
    s = np.asarray(s, dtype=np.float64)
    if not np.all(np.isfinite(s)):
        return math.nan
    s = np.clip(s, 0.0, None)
    total = s.sum()
    if total <= 0:
        return 0.0
    p = s[s > 0] / total
    return float(np.exp(-(p * np.log(p)).sum()))


def effective_rank(singular_values: torch.Tensor) -> float:
    """Entropy effective rank (Roy & Vetterli 2007): exp(−Σ pᵢ log pᵢ), pᵢ = σᵢ / Σσ. 0 for a zero matrix.

    NaN if a singular value is NaN or inf (an adapter with non-finite weights): a diagnostic never raises on a
    diverged run, it reports it; :class:`fora_plugin.monitor.DivergenceMonitor` names the cause.
    """
    return _entropy_effective_rank(np.array(singular_values.detach().double().tolist()))


def delta_w_singular_values(lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """Singular values of ΔW = B A (B (d_out, r), A (r, d_in)) without forming the d_out x d_in matrix.

    With B = Q R (thin QR), σ(B A) = σ(R A), an r x d_in problem. For a Stiefel B, R = I and σ(ΔW) = σ(A): the
    paper's Lemma. All NaN if A or B holds a NaN or inf, where LAPACK's SVD would raise.
    """
    lora_a, lora_b = lora_a.detach().double(), lora_b.detach().double()
    if not (torch.all(torch.isfinite(lora_a)) and torch.all(torch.isfinite(lora_b))):
        return torch.full((min(lora_b.shape[1], lora_a.shape[1]),), math.nan, dtype=torch.float64)
    _, R = torch.linalg.qr(lora_b)  # (r, r)
    return torch.linalg.svdvals(R @ lora_a)  # (r,)


def adapter_grams(lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
    """(BᵀB, AAᵀ) stacked, (2, r, r) in float64, on the adapter's device: all the spectrum of ΔW = BA needs.

    float64 because the spectrum comes from Gram matrices, whose eigenvalues are σ²: in float32 a singular value
    below ~3e-4 σ_max would be lost to rounding. A non-finite A or B gives a non-finite Gram matrix.
    """
    lora_a, lora_b = lora_a.detach().double(), lora_b.detach().double()
    return torch.stack((lora_b.mT @ lora_b, lora_a @ lora_a.mT))  # (2, r, r)


def singular_values_from_grams(grams: np.ndarray) -> np.ndarray:
    """σ(BA) from host (BᵀB, AAᵀ) (2, r, r): σ² are the eigenvalues of S AAᵀ S, S = (BᵀB)^½ (the same nonzero
    eigenvalues as (BA)ᵀ(BA) = Aᵀ S² A). All NaN if either Gram matrix is not finite."""
    btb, aat = grams
    if not (np.all(np.isfinite(btb)) and np.all(np.isfinite(aat))):
        return np.full(btb.shape[0], math.nan)
    w, v = np.linalg.eigh(btb)  # (r,), (r, r)
    root = (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T  # (r, r)
    squared = np.linalg.eigvalsh(root @ aat @ root)  # (r,)
    return np.sqrt(np.clip(squared, 0.0, None))[::-1]  # descending, as svdvals


def lora_pairs(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """``(module name, adapter name, A weight, B weight)`` of every linear LoRA adapter of a PEFT model."""
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, lora_b in module.lora_B.items():
            if isinstance(lora_b, nn.Linear) and adapter in module.lora_A:
                yield name, adapter, module.lora_A[adapter].weight, lora_b.weight


def largest_drift(drifts: list[torch.Tensor]) -> torch.Tensor:
    """The largest of the ``drifts`` (device tensors of ‖BᵀB − I‖ values) as a 0-dim float64 device tensor; NaN if
    one is NaN (``max`` propagates it), 0 if there are none."""
    if not drifts:
        return torch.zeros((), dtype=torch.float64)
    device = drifts[0].device  # a model spread over devices (device_map="auto") reduces on the first one
    return torch.stack([d.detach().double().max().to(device) for d in drifts]).max()


def read_adapter_diagnostics(
    model: nn.Module, drifts: list[torch.Tensor] | None = None, extra: Sequence[torch.Tensor] = ()
) -> tuple[float, float, list[float]]:
    """``(largest drift, mean effective rank of ΔW, the values of extra)`` with one host sync.

    The largest of ``drifts`` (:func:`largest_drift`), the mean entropy effective rank over the model's LoRA
    adapters (0.0 if there are none; NaN if one adapter has non-finite weights), and the value of each one-element
    device tensor of ``extra`` (what else a log reads: Cayley-Adam's counters, a gradient norm), in float64.
    """
    grams = [adapter_grams(a, b) for _, _, a, b in lora_pairs(model)]  # each (2, r, r)
    drift = largest_drift(drifts or [])
    device = drifts[0].device if drifts else grams[0].device if grams else drift.device
    parts = [drift.reshape(1), *(t.detach().reshape(1) for t in extra), *(g.reshape(-1) for g in grams)]
    flat = torch.cat([t.to(device=device, dtype=torch.float64) for t in parts])
    values = np.array(flat.tolist())  # the one host sync
    effective_ranks = []
    offset = 1 + len(extra)
    for g in grams:
        host = values[offset : offset + g.numel()].reshape(g.shape)
        effective_ranks.append(_entropy_effective_rank(singular_values_from_grams(host)))
        offset += g.numel()
    mean_rank = sum(effective_ranks) / len(effective_ranks) if effective_ranks else 0.0
    return float(values[0]), mean_rank, [float(v) for v in values[1 : 1 + len(extra)]]


def mean_effective_rank(model: nn.Module) -> float:
    """Mean entropy effective rank of ΔW over the model's LoRA adapters (0 if there are none; NaN if one adapter
    has non-finite weights), with one host sync."""
    return read_adapter_diagnostics(model)[1]
