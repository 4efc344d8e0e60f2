"""What a trained adapter looks like: singular spectrum and effective rank of ΔW = BA, drift of lora_B."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from peft.tuners.lora import LoraLayer
from torch import nn


def effective_rank(singular_values: torch.Tensor) -> float:
    """Entropy effective rank (Roy & Vetterli 2007): exp(−Σ pᵢ log pᵢ), pᵢ = σᵢ / Σσ. 0 for a zero matrix.

    NaN if a singular value is NaN or inf (an adapter with non-finite weights): a diagnostic never raises on a
    diverged run, it reports it; :class:`fora_plugin.monitor.DivergenceMonitor` names the cause.
    """
    s = singular_values.detach().double()
    if not torch.all(torch.isfinite(s)):
        return math.nan
    s = s.clamp_min(0)
    total = s.sum()
    if total <= 0:
        return 0.0
    p = s / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


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


def lora_pairs(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """``(module name, adapter name, A weight, B weight)`` of every linear LoRA adapter of a PEFT model."""
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, lora_b in module.lora_B.items():
            if isinstance(lora_b, nn.Linear) and adapter in module.lora_A:
                yield name, adapter, module.lora_A[adapter].weight, lora_b.weight


def mean_effective_rank(model: nn.Module) -> float:
    """Mean entropy effective rank of ΔW over the model's LoRA adapters (0 if there are none; NaN if one adapter
    has non-finite weights)."""
    ranks = [effective_rank(delta_w_singular_values(a, b)) for _, _, a, b in lora_pairs(model)]
    return sum(ranks) / len(ranks) if ranks else 0.0
