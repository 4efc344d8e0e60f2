"""FoRASFTTrainer: TRL's SFTTrainer with Fisher-selected layers, Stiefel lora_B and the one FoRA optimizer.

The trainer first lets SFTTrainer do all of its work without PEFT (dataset processing, completion/assistant masks,
packing, collator, loss), then scores the layers on batches of its own train dataloader through its own
``compute_loss``, then wraps the model with PEFT on the chosen layers only, doing what SFTTrainer does at its PEFT
step. Overridden, and why:

- ``__init__``: the selection and the PEFT wrap described above.
- ``create_optimizer``: the single AdamW + Cayley-Adam optimizer (``build_fora_optimizer``).
- ``log``: adds the largest ‖BᵀB − I‖ and the mean effective rank of ΔW to every log, and the selection once.
- ``train``: refuses to resume a checkpoint trained on other layers.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from trl import SFTTrainer

from .adapter import make_stiefel, stiefel_parameters
from .config import FoRAConfig
from .diagnostics import mean_effective_rank
from .fisher import FisherScores, find_decoder_layers, fisher_scores
from .optim import build_fora_optimizer
from .plots import plot_fisher_scores
from .selection import check_layer_indices, resolve_layer_budget, select_layers
from .stiefel import orthogonality_error


logger = logging.getLogger(__name__)

SCORES_FILE = "fora_scores.json"
SCORES_PLOT = "fora_scores.png"
# transformers.Trainer's default optimizers, which FoRA's optimizer replaces with the same AdamW maths.
_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


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


class _SaveSelectionCallback(TrainerCallback):
    """Every checkpoint carries the selection, so a resume adapts the same layers without scoring again."""

    def __init__(self, selection: FoRASelection) -> None:
        self.selection = selection

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / SCORES_FILE).write_text(json.dumps(self.selection.to_dict(), indent=2))
        return control


class FoRASFTTrainer(SFTTrainer):
    """``trl.SFTTrainer`` that trains FoRA: LoRA on the Fisher-selected layers, Stiefel ``lora_B`` by Cayley-Adam.

    Args are SFTTrainer's, plus:
        peft_config: a ``peft.LoraConfig`` (rank, alpha, dropout, target modules). Required: FoRA is a LoRA method.
            Its ``layers_to_transform`` must be unset: FoRA chooses the layers.
        fora_config: a :class:`FoRAConfig` (mode, layer budget, Fisher batches, Stiefel settings). Default:
            ``FoRAConfig()``, the paper's FoRA with K = L/2.

    With ``mode="lora"`` the trainer is exactly SFTTrainer with the LoraConfig (the ablation's baseline).
    """

    def __init__(
        self,
        model,
        args=None,
        *pos,
        peft_config: LoraConfig | None = None,
        fora_config: FoRAConfig | None = None,
        **kwargs,
    ) -> None:
        self.fora_config = fora_config = fora_config or FoRAConfig()
        if not isinstance(fora_config, FoRAConfig):
            raise TypeError(f"fora_config must be a FoRAConfig, got {type(fora_config).__name__}.")
        if isinstance(model, PeftModel):
            raise ValueError(
                "FoRASFTTrainer got a PeftModel: FoRA decides which layers carry LoRA, so it needs the base model. "
                "Pass the base model with peft_config=LoraConfig(...); if the PeftModel holds trained weights to "
                "keep, merge_and_unload() it first."
            )
        if not isinstance(peft_config, LoraConfig):
            raise TypeError(
                f"FoRASFTTrainer needs peft_config=LoraConfig(...), got {type(peft_config).__name__}: FoRA is a LoRA "
                "method (its rank, alpha, dropout and target modules come from the LoraConfig)."
            )
        self.fora_selection: FoRASelection | None = None
        self._fora_logged_once = False
        if fora_config.mode == "lora":
            super().__init__(model, args, *pos, peft_config=peft_config, **kwargs)
            return
        _check_lora_config(peft_config, fora_config)
        if kwargs.get("optimizers", (None, None))[0] is not None:
            raise ValueError(
                "FoRASFTTrainer builds its own optimizer (AdamW for lora_A, Cayley-Adam for lora_B): "
                "leave optimizers=(None, None) and set learning_rate / fora lr_stiefel instead."
            )
        super().__init__(model, args, *pos, peft_config=None, **kwargs)
        optim = getattr(self.args.optim, "value", self.args.optim)  # an OptimizerNames enum after __post_init__
        if optim not in _ADAMW_OPTIMS:
            raise ValueError(
                f"optim={optim!r} cannot be combined with FoRA, whose optimizer is AdamW on "
                f"lora_A plus Cayley-Adam on lora_B: use optim in {_ADAMW_OPTIMS}."
            )
        plugin = self.args.deepspeed_plugin
        if plugin is not None and plugin.zero_stage == 3:
            raise ValueError(
                "FoRA does not support DeepSpeed ZeRO-3 yet (a Cayley step needs whole lora_B "
                "matrices): use ZeRO-2, or mode='lora'."
            )
        self._fora_seed = fora_config.seed if fora_config.seed is not None else self.args.seed
        selection = self._fora_select_layers(peft_config)
        self._fora_wrap(peft_config, selection)
        self.fora_selection = selection
        self.add_callback(_SaveSelectionCallback(selection))
        self._fora_report_selection()

    # ----------------------------------------------------------------------------------------------- selection
    def _fora_select_layers(self, peft_config: LoraConfig) -> FoRASelection:
        fora = self.fora_config
        prefix, layers = find_decoder_layers(self.model)
        num_layers = len(layers)
        if not fora.selects_layers:
            return FoRASelection(list(range(num_layers)), num_layers, prefix, source="all", mode=fora.mode)
        if fora.layers is not None:
            chosen = check_layer_indices(fora.layers, num_layers)
            return FoRASelection(chosen, num_layers, prefix, source="layers", mode=fora.mode)
        resumed = self._fora_checkpoint_selection()
        if resumed is not None:
            if resumed["num_layers"] != num_layers:
                raise ValueError(
                    f"The checkpoint's selection is for {resumed['num_layers']} layers, this model has "
                    f"{num_layers}: resume with the same model."
                )
            logger.info("FoRA: reusing the layer selection saved with the checkpoint (no re-scoring).")
            return self._selection_from_saved(resumed, prefix, source="checkpoint")
        k = resolve_layer_budget(fora.layer_budget, num_layers)
        if fora.scores_path is not None:
            saved = FoRASelection.read(fora.scores_path)
            if saved.get("scores") is None or len(saved["scores"]) != num_layers:
                raise ValueError(f"scores_path={fora.scores_path!r} holds no scores for {num_layers} layers.")
            scores = FisherScores(
                saved["scores"],
                saved["num_batches"],
                saved["fisher_params"],
                saved["seconds"] or 0.0,
                saved.get("peak_memory_bytes"),
                prefix,
            )
            chosen = select_layers(scores.scores, k, strategy=fora.layer_strategy, seed=self._fora_seed)
            return FoRASelection(chosen, num_layers, prefix, scores=scores, source="scores_path", mode=fora.mode)
        if fora.layer_strategy != "fisher":
            chosen = select_layers(None, k, strategy=fora.layer_strategy, num_layers=num_layers, seed=self._fora_seed)
            return FoRASelection(chosen, num_layers, prefix, source=fora.layer_strategy, mode=fora.mode)
        scores = self.fora_score(peft_config)
        chosen = select_layers(scores.scores, k, strategy="fisher")
        return FoRASelection(chosen, num_layers, prefix, scores=scores, source="fisher", mode=fora.mode)

    def fora_score(self, peft_config: LoraConfig | None = None) -> FisherScores:
        """Fisher scores of the (still unwrapped) model on the trainer's own batches and loss."""
        targets = _target_names(peft_config) if self.fora_config.fisher_params == "targets" else None
        saved_metrics, saved_tokens = copy.deepcopy(self._metrics), self._total_train_tokens

        def loss_fn(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
            return self.compute_loss(model, self._prepare_inputs(batch))

        try:
            return fisher_scores(
                self.model,
                self.get_train_dataloader(),
                self.fora_config.fisher_batches,
                loss_fn=loss_fn,
                fisher_params=self.fora_config.fisher_params,
                target_modules=targets,
                autocast=self.compute_loss_context_manager,
                progress=self.is_local_process_zero() and not self.args.disable_tqdm,
            )
        finally:
            # compute_loss feeds the training metrics; scoring batches are not training.
            self._metrics, self._total_train_tokens = saved_metrics, saved_tokens

    def _fora_checkpoint_selection(self) -> dict[str, Any] | None:
        checkpoint = _resolve_checkpoint(self.args.resume_from_checkpoint, self.args.output_dir)
        if checkpoint is None:
            return None
        return FoRASelection.read(checkpoint)

    def _selection_from_saved(self, saved: dict[str, Any], prefix: str, source: str) -> FoRASelection:
        scores = None
        if saved.get("scores") is not None:
            scores = FisherScores(
                saved["scores"],
                saved["num_batches"],
                saved["fisher_params"],
                saved["seconds"] or 0,
                saved.get("peak_memory_bytes"),
                prefix,
            )
        return FoRASelection(
            saved["chosen_layers"],
            saved["num_layers"],
            prefix,
            scores=scores,
            source=source,
            mode=self.fora_config.mode,
        )

    # --------------------------------------------------------------------------------------------------- wrap
    def _fora_wrap(self, peft_config: LoraConfig, selection: FoRASelection) -> None:
        base = self.model
        _, layers = find_decoder_layers(base)
        per_layer = {i: _matching_modules(base, peft_config, selection.layer_prefix, i) for i in range(len(layers))}
        _check_targets_present(peft_config, per_layer, selection.chosen)
        selection.target_modules = [name for i in selection.chosen for name in per_layer[i]]
        selection.lora_all_layers_parameters = sum(
            _lora_parameter_count(base.get_submodule(name), peft_config.r)
            for names in per_layer.values()
            for name in names
        )
        config = copy.deepcopy(peft_config)
        # Fully qualified names adapt exactly these modules: layers_to_transform can match nothing, or also match a
        # vision tower's layers of the same index.
        config.target_modules = list(selection.target_modules)
        config.layers_to_transform = None
        config.layers_pattern = None

        torch.manual_seed(self._fora_seed)
        model = get_peft_model(base, config)
        if self.args.gradient_checkpointing:
            model.enable_input_require_grads()  # as SFTTrainer does for PEFT + checkpointing
        if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
            for name, param in model.named_parameters():  # SFTTrainer's QLoRA adapter dtype
                if param.requires_grad and "lora_magnitude_vector" not in name:
                    param.data = param.data.to(torch.bfloat16)
        if self.fora_config.uses_stiefel:
            make_stiefel(
                model, init_a=self.fora_config.init_a, generator=torch.Generator().manual_seed(self._fora_seed)
            )
        names = {id(p): n for n, p in model.named_parameters()}
        for param in model.parameters():
            if param.requires_grad:
                index = _layer_index(names[id(param)], selection.layer_prefix)
                if index is not None:
                    selection.trainable_parameters[index] = selection.trainable_parameters.get(index, 0)
                    selection.trainable_parameters[index] += param.numel()
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("After the FoRA wrap nothing is trainable: check target_modules and the chosen layers.")
        self.model = self.model_wrapped = model
        self.callback_handler.model = model

    def _fora_report_selection(self) -> None:
        selection = self.fora_selection
        if self.is_world_process_zero():
            out = Path(self.args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / SCORES_FILE).write_text(json.dumps(selection.to_dict(), indent=2))
            scores = selection.scores.scores if selection.scores else None
            plot_fisher_scores(out / SCORES_PLOT, scores, selection.chosen, selection.num_layers)
            print(format_selection_table(selection))

    # ------------------------------------------------------------------------------------------- optimizer
    def create_optimizer(self, model=None):
        if self.fora_config.mode == "lora":
            return super().create_optimizer(model)
        if self.optimizer is None:
            opt_model = self.model
            self.optimizer = build_fora_optimizer(
                opt_model,
                lr=self.args.learning_rate,
                lr_stiefel=self.fora_config.lr_stiefel,
                weight_decay=self.args.weight_decay,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
                qr_period=self.fora_config.qr_period,
                cayley_solver=self.fora_config.cayley_solver,
                cayley_iters=self.fora_config.cayley_iters,
                decay_parameter_names=self.get_decay_parameter_names(opt_model),
                fused=True if self.args.optim == "adamw_torch_fused" else None,
            )
        return self.optimizer

    # ------------------------------------------------------------------------------------------------ logs
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.fora_selection is not None:
            logs["fora/max_orthogonality_error"] = self._fora_max_drift()
            logs["fora/mean_effective_rank"] = mean_effective_rank(self.model)
            if not self._fora_logged_once:
                selection = self.fora_selection
                trainable = sum(selection.trainable_parameters.values())
                logs["fora/layers_adapted"] = len(selection.chosen)
                logs["fora/trainable_parameters"] = trainable
                if selection.lora_all_layers_parameters:
                    logs["fora/parameter_ratio_vs_lora_all"] = trainable / selection.lora_all_layers_parameters
                self._fora_logged_once = True
        super().log(logs, start_time)

    def _fora_max_drift(self) -> float:
        # A bf16 lora_B is its fp32 master rounded; the master is the point on the manifold.
        state = self.optimizer.state if self.optimizer is not None else {}
        drifts = [
            orthogonality_error(state.get(p, {}).get("master", p).detach().float()).item()
            for _, p in stiefel_parameters(self.model)
        ]
        return max(drifts, default=0.0)

    # ------------------------------------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        checkpoint = _resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if checkpoint is not None and self.fora_selection is not None and self.fora_config.selects_layers:
            saved = FoRASelection.read(checkpoint)
            if saved["chosen_layers"] != self.fora_selection.chosen:
                raise ValueError(
                    f"Checkpoint {checkpoint} was trained with LoRA on layers {saved['chosen_layers']}, but this "
                    f"trainer adapts layers {self.fora_selection.chosen}. Build the trainer with "
                    f"args.resume_from_checkpoint={str(checkpoint)!r} so it reuses the checkpoint's selection."
                )
        return super().train(resume_from_checkpoint, *args, **kwargs)


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


def _check_lora_config(config: LoraConfig, fora: FoRAConfig) -> None:
    if config.layers_to_transform is not None or config.layers_pattern is not None:
        raise ValueError(
            f"LoraConfig.layers_to_transform={config.layers_to_transform!r} / layers_pattern="
            f"{config.layers_pattern!r} are set, but FoRA chooses the layers: unset them and use FoRAConfig("
            "layers=[...]) for a fixed set."
        )
    if config.target_modules is None or config.target_modules == "all-linear":
        raise ValueError(
            f"LoraConfig.target_modules={config.target_modules!r}: name the target linears explicitly, e.g. "
            "['q_proj', 'k_proj', 'v_proj', 'up_proj', 'down_proj'] (the paper's five)."
        )
    if fora.uses_stiefel and config.use_dora:
        raise ValueError(
            f"LoraConfig.use_dora=True cannot be combined with mode={fora.mode!r}: DoRA's magnitude "
            "rescales lora_B's columns. Use use_dora=False, or mode='fg-lora'."
        )


def _target_names(config: LoraConfig | None) -> list[str] | None:
    if config is None or isinstance(config.target_modules, str):
        return None
    return list(config.target_modules)


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


def _resolve_checkpoint(value: str | bool | None, output_dir: str) -> str | None:
    if value in (None, False, "", "false", "False"):
        return None
    if value in (True, "true", "True"):
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(f"resume_from_checkpoint=True but {output_dir} holds no checkpoint.")
        return last
    return str(value)
