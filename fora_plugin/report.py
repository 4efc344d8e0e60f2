"""``fora report``: what a saved LoRA adapter learned, per module type, from the adapter files alone.

For each module: the singular values of ΔW = scaling · B A (via the r x r factor of B's QR, never the d x d
matrix), their entropy effective rank (Roy & Vetterli) and its ratio to r, ‖ΔW‖_F, and ‖BᵀB − I‖_F; with a base
model, KL(p_trained ‖ p_base) on held-out text. Works on any PEFT LoRA adapter, so FoRA and its baselines compare
side by side.

May import: diagnostics, errors, evaluation, plots, selection, stiefel, targets, validation.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME
from peft.utils.other import get_pattern_key
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from .diagnostics import delta_w_singular_values, effective_rank
from .errors import FoRAInputError, refuse
from .evaluation import eval_mode
from .plots import pyplot
from .selection import FoRASelection
from .stiefel import orthogonality_error
from .targets import layer_index
from .validation import is_real


__all__ = [
    "adapter_report",
    "check_adapter_folder",
    "kl_to_base",
    "load_adapter_pairs",
    "markdown_summary",
    "merged_delta_weight",
    "merged_effective_rank",
    "merged_mean_effective_rank",
    "plot_spectra",
]


def check_adapter_folder(path: str | os.PathLike, key: str) -> dict[str, Any]:
    """Refuse a LoRA adapter folder whose adapter_config.json disagrees with its weights; returns the config.

    Each module's rank (lora_A's rows) must be the config's ``r`` (or its ``rank_pattern`` entry): a config copied
    from another run reports the wrong scaling and fails in ``load_state_dict``.
    """
    folder = Path(path)
    config_file = folder / CONFIG_NAME
    weights = next((folder / n for n in (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME) if (folder / n).is_file()), None)
    if not config_file.is_file() or weights is None:
        refuse(
            key,
            str(path),
            f"it is not a PEFT adapter folder: it needs {CONFIG_NAME} and {SAFETENSORS_WEIGHTS_NAME}",
            "Give a folder that save_pretrained / fora train wrote.",
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        refuse(key, str(path), f"its {CONFIG_NAME} is not valid JSON ({error})", "Save the adapter again.")
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        found = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        refuse(key, str(path), f"it holds a {found} adapter, not LoRA", "Give a LoRA adapter folder.")
    for name in ("r", "lora_alpha"):
        if not (is_real(config.get(name)) and config[name] > 0):
            refuse(f"{key} {CONFIG_NAME} {name}", config.get(name), "use a number > 0", "Save the adapter again.")
    if weights.suffix != ".safetensors":
        return config
    pattern = config.get("rank_pattern") or {}
    wrong = []
    with safe_open(str(weights), framework="pt") as tensors:
        for tensor_key in tensors.keys():
            if ".lora_A." not in tensor_key:
                continue
            rows = tensors.get_slice(tensor_key).get_shape()[0]
            module = tensor_key.split(".lora_A.")[0].removeprefix("base_model.model.")
            expected = pattern.get(get_pattern_key(pattern.keys(), module), config["r"])
            if rows != expected:
                wrong.append((module, rows, expected))
    if wrong:
        module, rows, expected = wrong[0]
        refuse(
            f"{key} {CONFIG_NAME} r",
            config["r"],
            f"the weights of {len(wrong)} modules have another rank (e.g. {module}: rank {rows}, the config says "
            f"{expected}), so the config does not belong to these weights",
            f"Put the adapter_config.json that was saved with these weights back (r: {rows}), or save the adapter "
            "again.",
        )
    return config


def load_adapter_pairs(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's config and ``{module name: (A (r, d_in), B (d_out, r))}`` from its safetensors file."""
    adapter_dir = Path(adapter_dir)
    weights_file = adapter_dir / SAFETENSORS_WEIGHTS_NAME
    if not weights_file.is_file():
        raise FoRAInputError(
            f"{adapter_dir} is not a PEFT adapter folder: it needs adapter_config.json and "
            "adapter_model.safetensors (what save_pretrained / fora train write)."
        )
    config = check_adapter_folder(adapter_dir, "adapter")  # a LoRA config that matches the weights' ranks
    tensors = load_file(weights_file)
    broken = [key for key, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if broken:
        raise FoRAInputError(
            f"{adapter_dir} holds NaN/inf weights in {len(broken)} tensors ({', '.join(broken[:3])}"
            f"{', ...' if len(broken) > 3 else ''}): the training that wrote it diverged. Train again from an "
            "earlier checkpoint or with a lower learning_rate / fora_lr_stiefel (and max_grad_norm set)."
        )
    pairs: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in tensors.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                pairs[key.split(marker)[0]][part] = value
    return config, {name: (p["lora_A"], p["lora_B"]) for name, p in pairs.items() if len(p) == 2}


def _scaling(config: dict[str, Any], module: str, r: int) -> float:
    """PEFT's scaling of ``module`` (its name without the ``base_model.model.`` prefix) with rank ``r``."""
    alpha_pattern = config.get("alpha_pattern") or {}
    alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def adapter_report(adapter_dir: str | Path) -> dict[str, Any]:
    """Per-module and per-module-type statistics of a LoRA adapter."""
    config, pairs = load_adapter_pairs(adapter_dir)
    modules = []
    for name, (a, b) in sorted(pairs.items()):
        # Per module: rank_pattern gives A its own rank r, alpha_pattern its own alpha.
        scaling = _scaling(config, name.removeprefix("base_model.model."), a.shape[0])
        sv = scaling * delta_w_singular_values(a.float(), b.float())
        modules.append(
            {
                "module": name,
                "type": name.rsplit(".", 1)[-1],
                "layer": layer_index(name),
                "rank": a.shape[0],
                "scaling": scaling,
                "singular_values": sv.tolist(),
                "effective_rank": effective_rank(sv),
                "delta_w_norm": float(sv.square().sum().sqrt()),
                "orthogonality_error": float(orthogonality_error(b.double())),
            }
        )
    by_type: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for m in modules:
        by_type[m["type"]].append(m)
    summary = {}
    for kind, items in sorted(by_type.items()):
        # rank_pattern can give modules of one type different ranks: shorter spectra are padded with zeros.
        r = max(m["rank"] for m in items)
        spectra = torch.zeros(len(items), r, dtype=torch.float64)  # (modules, r)
        for row, m in zip(spectra, items):
            row[: m["rank"]] = torch.tensor(m["singular_values"], dtype=torch.float64)
        normalised = spectra / spectra[:, :1].clamp_min(1e-30)
        summary[kind] = {
            "modules": len(items),
            "rank": r,
            "mean_effective_rank": sum(m["effective_rank"] for m in items) / len(items),
            "effective_rank_ratio": sum(m["effective_rank"] / m["rank"] for m in items) / len(items),
            "mean_delta_w_norm": sum(m["delta_w_norm"] for m in items) / len(items),
            "max_orthogonality_error": max(m["orthogonality_error"] for m in items),
            "mean_normalised_spectrum": normalised.mean(dim=0).tolist(),
        }
    layers = sorted({m["layer"] for m in modules if m["layer"] is not None})
    selection = FoRASelection.load(adapter_dir, missing_ok=True)  # the selection files beside the adapter
    if selection is not None:
        selection.check_adapter_layers(layers, adapter_dir)
    return {
        "adapter": str(adapter_dir),
        "r": config["r"],
        "lora_alpha": config["lora_alpha"],
        "scaling": _scaling(config, "", config["r"]),
        "adapted_layers": layers,
        "modules": modules,
        "by_type": summary,
        "mean_effective_rank": sum(m["effective_rank"] for m in modules) / len(modules) if modules else 0.0,
        "fora_scores": selection.to_dict() if selection is not None else None,
    }


@torch.no_grad()
def kl_to_base(model, tokenizer, text: str, *, max_tokens: int = 1024, window: int = 512) -> float:
    """Mean per-token KL(p_trained ‖ p_base) of a PeftModel against its own base (adapter disabled) on ``text``."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0][:max_tokens]
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with eval_mode(model):  # no dropout; a model in training stays in training after this
        for start in range(0, ids.numel(), window):
            chunk = ids[start : start + window].unsqueeze(0).to(device)
            log_trained = torch.log_softmax(model(input_ids=chunk).logits.float(), dim=-1)
            with model.disable_adapter():
                log_base = torch.log_softmax(model(input_ids=chunk).logits.float(), dim=-1)
            kl = (log_trained.exp() * (log_trained - log_base)).sum(dim=-1)  # (1, T)
            total += kl.sum().item()
            count += kl.numel()
    return total / count


@torch.no_grad()
def merged_delta_weight(module: LoraLayer, adapter: str) -> torch.Tensor:
    """ΔW = merged weight − base weight (d_out, d_in) of one LoRA linear, in float64, by PEFT's own merge.

    Unlike scaling · B A this includes what the variant adds to the merge (DoRA's magnitude rescaling), so
    spectra of LoRA, DoRA and rsLoRA compare like with like. The merge runs on a float64 copy: the model is left
    as it is, and rounding does not add small singular values to the spectrum.
    """
    base = module.get_base_layer().weight
    if not base.is_floating_point():
        raise FoRAInputError(
            f"The merged ΔW of a quantized base weight ({base.dtype}) is not computed here: compare adapters "
            "trained on a float base, or use `fora report` (B A from the adapter files)."
        )
    merged = copy.deepcopy(module).double()
    merged.merge(adapter_names=[adapter])
    return merged.get_base_layer().weight - base.double()


def merged_effective_rank(module: LoraLayer, adapter: str) -> float:
    """Entropy effective rank of the merged ΔW (merged − base weight) of one LoRA linear."""
    if not module.use_dora.get(adapter, False):
        # PEFT merges exactly scaling · B A here: its spectrum from the r x r factor, without the dense matrix.
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        return effective_rank(module.scaling[adapter] * delta_w_singular_values(a, b))
    return effective_rank(torch.linalg.svdvals(merged_delta_weight(module, adapter)))


def merged_mean_effective_rank(model: nn.Module) -> float:
    """Mean entropy effective rank of the merged ΔW over every LoRA linear and adapter of a PEFT model."""
    ranks = [
        merged_effective_rank(module, adapter)
        for module in model.modules()
        if isinstance(module, LoraLayer) and isinstance(module, nn.Module)
        for adapter in module.lora_A
    ]
    return sum(ranks) / len(ranks) if ranks else 0.0


def plot_spectra(path: str | Path, reports: dict[str, dict[str, Any]]) -> Path:
    """Mean normalised singular spectrum of ΔW per module type, one line per adapter (the paper's figure)."""
    plt = pyplot()

    kinds = sorted({k for rep in reports.values() for k in rep["by_type"]})
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds) + 1, 3.4), dpi=120, squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for label, rep in reports.items():
            stats = rep["by_type"].get(kind)
            if stats:
                spectrum = stats["mean_normalised_spectrum"]
                ax.plot(
                    range(1, len(spectrum) + 1),
                    spectrum,
                    marker=".",
                    label=f"{label} (erank {stats['mean_effective_rank']:.1f}/{stats['rank']})",
                )
        ax.set_yscale("log")
        ax.set_title(kind)
        ax.set_xlabel("singular value index i")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("σᵢ(ΔW) / σ₁(ΔW), mean over layers")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Singular spectrum of ΔW = BA per module type")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def markdown_summary(reports: dict[str, dict[str, Any]], kl: dict[str, float] | None = None) -> str:
    lines = [
        "| adapter | module | modules | layers | erank | erank / r | mean ‖ΔW‖_F | max ‖BᵀB − I‖_F |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for label, rep in reports.items():
        layers = ",".join(map(str, rep["adapted_layers"]))
        for kind, s in rep["by_type"].items():
            lines.append(
                f"| {label} | {kind} | {s['modules']} | {layers} | {s['mean_effective_rank']:.2f} | "
                f"{s['effective_rank_ratio']:.2f} | {s['mean_delta_w_norm']:.4f} | "
                f"{s['max_orthogonality_error']:.1e} |"
            )
    if kl:
        lines += ["", "| adapter | KL(p_trained ‖ p_base) per token |", "|---|---:|"]
        lines += [f"| {label} | {value:.5f} |" for label, value in kl.items()]
    return "\n".join(lines)
