"""FoRA's steps around a trainer, shared by `FoRASFTTrainer` (TRL) and the Axolotl plugin.

1. :func:`choose_layers`: the K decoder layers to adapt (Fisher scores from a caller-given scorer, explicit indices,
   a control strategy, saved scores, or the selection saved with the checkpoint being resumed).
2. :func:`readapt_lora`: the trainer's LoRA adapter moved onto those layers (:func:`restrict_lora_config` points
   the LoraConfig at exactly their target linears), then :func:`init_fora_adapters`: Stiefel ``lora_B`` for the
   modes that use it, and the per-layer parameter counts.
4. :func:`write_selection`: ``fora_scores.json``, ``fora_scores.png`` and the printed table;
   :class:`SaveSelectionCallback` puts the json in every checkpoint, so a resume adapts the same layers.
5. :class:`FoRALogs`: what FoRA adds to every training log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .adapter import make_stiefel, stiefel_parameters
from .config import FoRAConfig
from .diagnostics import mean_effective_rank
from .fisher import FisherScores, find_decoder_layers
from .plots import plot_fisher_scores
from .selection import check_layer_indices, resolve_layer_budget, select_layers
from .stiefel import orthogonality_error
from .zero import find_zero_client


logger = logging.getLogger(__name__)

SCORES_FILE = "fora_scores.json"
SCORES_PLOT = "fora_scores.png"


class FoRASelection:
    """The chosen layers and how they were chosen; saved as ``fora_scores.json``."""

    def __init__(
        self,
        chosen: list[int],
        num_layers: int,
        layer_prefix: str,
        *,
        scores: FisherScores | None = None,
        source: str = "fisher",
        mode: str = "fora",
    ) -> None:
        self.chosen = sorted(chosen)
        self.num_layers = num_layers
        self.layer_prefix = layer_prefix
        self.scores = scores
        self.source = source
        self.mode = mode
        self.target_modules: list[str] = []
        self.trainable_parameters: dict[int, int] = {}
        self.lora_all_layers_parameters = 0

    def to_dict(self) -> dict[str, Any]:
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
            "trainable_parameters_per_layer": {str(k): v for k, v in self.trainable_parameters.items()},
            "lora_all_layers_parameters": self.lora_all_layers_parameters,
        }

    @staticmethod
    def read(path: str | Path) -> dict[str, Any]:
        path = Path(path)
        if path.is_dir():
            path = path / SCORES_FILE
        if not path.is_file():
            raise ValueError(f"No FoRA selection at {path}: expected the {SCORES_FILE} an earlier run wrote.")
        return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------------- selection
def choose_layers(
    model: nn.Module,
    fora: FoRAConfig,
    *,
    seed: int,
    checkpoint: str | None,
    score: Callable[[], FisherScores],
) -> FoRASelection:
    """The layers ``model`` gets LoRA on under ``fora``.

    ``checkpoint`` is the checkpoint the run resumes from (its saved selection is reused, nothing is scored);
    ``score`` computes the Fisher scores when they are needed: the caller's data and loss.
    """
    prefix, layers = find_decoder_layers(model)
    num_layers = len(layers)
    if not fora.selects_layers:
        return FoRASelection(list(range(num_layers)), num_layers, prefix, source="all", mode=fora.mode)
    if fora.layers is not None:
        chosen = check_layer_indices(fora.layers, num_layers)
        return FoRASelection(chosen, num_layers, prefix, source="layers", mode=fora.mode)
    if checkpoint is not None:
        saved = FoRASelection.read(checkpoint)
        if saved["num_layers"] != num_layers:
            raise ValueError(
                f"The checkpoint's selection is for {saved['num_layers']} layers, this model has "
                f"{num_layers}: resume with the same model."
            )
        logger.info("FoRA: reusing the layer selection saved with the checkpoint (no re-scoring).")
        scores = _saved_scores(saved, prefix)
        return FoRASelection(
            saved["chosen_layers"], num_layers, prefix, scores=scores, source="checkpoint", mode=fora.mode
        )
    k = resolve_layer_budget(fora.layer_budget, num_layers)
    if fora.scores_path is not None:
        saved = FoRASelection.read(fora.scores_path)
        if saved.get("scores") is None or len(saved["scores"]) != num_layers:
            raise ValueError(f"scores_path={fora.scores_path!r} holds no scores for {num_layers} layers.")
        scores = _saved_scores(saved, prefix)
        chosen = select_layers(scores.scores, k, strategy=fora.layer_strategy, seed=seed)
        return FoRASelection(chosen, num_layers, prefix, scores=scores, source="scores_path", mode=fora.mode)
    if fora.layer_strategy != "fisher":
        chosen = select_layers(None, k, strategy=fora.layer_strategy, num_layers=num_layers, seed=seed)
        return FoRASelection(chosen, num_layers, prefix, source=fora.layer_strategy, mode=fora.mode)
    scores = score()
    chosen = select_layers(scores.scores, k, strategy="fisher")
    return FoRASelection(chosen, num_layers, prefix, scores=scores, source="fisher", mode=fora.mode)


def _saved_scores(saved: dict[str, Any], prefix: str) -> FisherScores | None:
    if saved.get("scores") is None:
        return None
    return FisherScores(
        saved["scores"],
        saved["num_batches"],
        saved["fisher_params"],
        saved["seconds"] or 0.0,
        saved.get("peak_memory_bytes"),
        prefix,
    )


# ---------------------------------------------------------------------------------------------------- adapters
def restrict_lora_config(config: LoraConfig, model: nn.Module, selection: FoRASelection) -> None:
    """Point ``config`` (in place) at exactly the linears it targets in the chosen layers of ``model``.

    ``model`` is the base model, without adapters. Also records the target names and the parameter count LoRA on
    every layer would have in ``selection``.
    """
    _, layers = find_decoder_layers(model)
    per_layer = {i: _matching_modules(model, config, selection.layer_prefix, i) for i in range(len(layers))}
    _check_targets_present(config, per_layer, selection.chosen)
    selection.target_modules = [name for i in selection.chosen for name in per_layer[i]]
    selection.lora_all_layers_parameters = sum(
        _lora_parameter_count(model.get_submodule(name), config.r) for names in per_layer.values() for name in names
    )
    # Fully qualified names adapt exactly these modules: layers_to_transform can match nothing, or also match a
    # vision tower's layers of the same index.
    config.target_modules = list(selection.target_modules)
    config.layers_to_transform = None
    config.layers_pattern = None


def init_fora_adapters(model: nn.Module, selection: FoRASelection, fora: FoRAConfig, seed: int) -> None:
    """After the LoRA wrap: Stiefel ``lora_B`` where the mode asks for it, and the trainable parameters per layer."""
    if fora.uses_stiefel:
        make_stiefel(model, init_a=fora.init_a, generator=torch.Generator().manual_seed(seed))
    names = {id(p): n for n, p in model.named_parameters()}
    for param in model.parameters():
        if param.requires_grad:
            index = _layer_index(names[id(param)], selection.layer_prefix)
            if index is not None:
                selection.trainable_parameters[index] = selection.trainable_parameters.get(index, 0)
                selection.trainable_parameters[index] += param.numel()
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("After the FoRA wrap nothing is trainable: check target_modules and the chosen layers.")


def readapt_lora(
    model: PeftModel, selection: FoRASelection, fora: FoRAConfig, seed: int, *, autocast_adapter_dtype: bool = True
) -> None:
    """Move ``model``'s LoRA adapter onto the chosen layers only, then :func:`init_fora_adapters`.

    The trainer (SFTTrainer, Axolotl's) wrapped every layer the LoraConfig targets. The adapter comes off (weights
    and wrappers) and goes back under the same name with the same LoraConfig object, restricted in place (a trainer
    may hold that object and save it), on the same PeftModel; the adapter weights get the dtype the trainer gave
    them (bf16 on a k-bit base).
    """
    config = active_lora_config(model)
    adapter = model.active_adapters[0]
    dtypes = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    base = model.get_base_model()
    model.delete_adapter(adapter)
    model.unload()
    restrict_lora_config(config, base, selection)
    torch.manual_seed(seed)
    model.add_adapter(adapter, config, autocast_adapter_dtype=autocast_adapter_dtype)
    model.set_adapter(adapter)
    for name, param in model.named_parameters():
        if param.requires_grad and name in dtypes:
            param.data = param.data.to(dtypes[name])
    init_fora_adapters(model, selection, fora, seed)


def active_lora_config(model: PeftModel) -> LoraConfig:
    """The LoraConfig of ``model``'s one active adapter."""
    if len(model.active_adapters) != 1:
        raise ValueError(f"FoRA trains one LoRA adapter; the model has active adapters {model.active_adapters}.")
    return model.peft_config[model.active_adapters[0]]


def _layer_index(name: str, prefix: str) -> int | None:
    marker = f"{prefix}."
    at = name.find(marker)
    if at < 0:
        return None
    head = name[at + len(marker) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _matching_modules(model: nn.Module, config: LoraConfig, prefix: str, index: int) -> list[str]:
    """Names of the modules in decoder layer ``index`` that the LoraConfig targets (PEFT's own matching)."""
    layer_prefix = f"{prefix}.{index}."
    return [
        name
        for name, module in model.named_modules()
        if name.startswith(layer_prefix) and isinstance(module, nn.Linear) and check_target_module_exists(config, name)
    ]


def _check_targets_present(config: LoraConfig, per_layer: dict[int, list[str]], chosen: list[int]) -> None:
    empty = [i for i in chosen if not per_layer[i]]
    if empty:
        raise ValueError(
            f"LoraConfig.target_modules={config.target_modules!r} match no linear in the chosen "
            f"layers {empty}: use module names of the model's decoder layers."
        )
    if isinstance(config.target_modules, str):
        return
    found = {name.rsplit(".", 1)[-1] for i in chosen for name in per_layer[i]}
    absent = [t for t in config.target_modules if t.rsplit(".", 1)[-1] not in found]
    if absent:
        example = per_layer[chosen[0]][:5]
        raise ValueError(
            f"target modules {absent} are absent from the chosen layers {chosen} (their linears are "
            f"named like {example}): fix LoraConfig.target_modules."
        )


def _lora_parameter_count(module: nn.Module, r: int) -> int:
    return r * (module.in_features + module.out_features)


# ----------------------------------------------------------------------------------------------------- reports
def write_selection(selection: FoRASelection, output_dir: str | Path) -> None:
    """``fora_scores.json`` and ``fora_scores.png`` in ``output_dir``, and the table on stdout."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / SCORES_FILE).write_text(json.dumps(selection.to_dict(), indent=2))
    scores = selection.scores.scores if selection.scores else None
    plot_fisher_scores(out / SCORES_PLOT, scores, selection.chosen, selection.num_layers)
    print(format_selection_table(selection))


def format_selection_table(selection: FoRASelection) -> str:
    """The chosen layers as a table: index, score, trainable parameters."""
    scores = selection.scores.scores if selection.scores else None
    lines = [
        f"FoRA ({selection.mode}): LoRA on {len(selection.chosen)} of {selection.num_layers} decoder layers "
        f"(chosen by: {selection.source})",
        "| layer | Fisher score | trainable params |",
        "|---:|---:|---:|",
    ]
    for i in selection.chosen:
        score = f"{scores[i]:.4e}" if scores else "-"
        lines.append(f"| {i} | {score} | {selection.trainable_parameters.get(i, 0):,} |")
    trainable = sum(selection.trainable_parameters.values())
    lines.append(f"trainable: {trainable:,} parameters")
    if selection.lora_all_layers_parameters:
        ratio = trainable / selection.lora_all_layers_parameters
        lines[-1] += f" = {ratio:.1%} of LoRA on all layers ({selection.lora_all_layers_parameters:,})"
    return "\n".join(lines)


def checkpoint_folder(args, state) -> Path:
    """The checkpoint folder HF Trainer has just saved, in a callback's ``on_save``."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


class SaveSelectionCallback(TrainerCallback):
    """Every checkpoint carries the selection, so a resume adapts the same layers without scoring again."""

    def __init__(self, selection: FoRASelection) -> None:
        self.selection = selection

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = checkpoint_folder(args, state)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / SCORES_FILE).write_text(json.dumps(self.selection.to_dict(), indent=2))
        return control


class FoRALogs:
    """What FoRA adds to a training log: the largest ‖BᵀB − I‖, the mean effective rank of ΔW, and (in the first
    log only) the number of adapted layers, the trainable parameters and their ratio to LoRA on all layers."""

    def __init__(self, selection: FoRASelection) -> None:
        self.selection = selection
        self._selection_logged = False

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
        client = find_zero_client(optimizer)
        logs = {
            "fora/max_orthogonality_error": _max_drift(model, client.stiefel if client is not None else optimizer),
            "fora/mean_effective_rank": mean_effective_rank(model),
        }
        if client is not None and client.last_grad_norm is not None:
            # DeepSpeed reports the norm of the partitioned lora_A gradients only; FoRA clipped by this one.
            logs["grad_norm"] = client.last_grad_norm
        if not self._selection_logged:
            trainable = sum(self.selection.trainable_parameters.values())
            logs["fora/layers_adapted"] = len(self.selection.chosen)
            logs["fora/trainable_parameters"] = trainable
            if self.selection.lora_all_layers_parameters:
                logs["fora/parameter_ratio_vs_lora_all"] = trainable / self.selection.lora_all_layers_parameters
            self._selection_logged = True
        return logs


def _max_drift(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> float:
    # A bf16 lora_B is its fp32 master rounded; the master is the point on the manifold.
    state = optimizer.state if optimizer is not None else {}
    drifts = [
        orthogonality_error(state.get(p, {}).get("master", p).detach().float()).item()
        for _, p in stiefel_parameters(model)
    ]
    return max(drifts, default=0.0)
