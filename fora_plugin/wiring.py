"""FoRA's steps on a model that need no trainer, shared by both front ends (:mod:`fora_plugin.training` runs them in
order): choose the layers, move the LoRA adapter onto them, PEFT's input cast, the selection's files and callback, and
FoRA's log entries.

May import: adapter, checkpoints, config, diagnostics, errors, fisher, fsdp, optim, plots, selection, stiefel, targets,
validation, zero.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.constants import CONFIG_NAME
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import TrainerCallback
from transformers.pytorch_utils import Conv1D

from .adapter import expert_blocks, make_stiefel, stiefel_num_experts, stiefel_parameters
from .checkpoints import checkpoint_folder
from .config import INPUT_CASTS, FoRAConfig
from .diagnostics import largest_drift, read_adapter_diagnostics
from .errors import FoRAInputError, refuse
from .fisher import FisherScores
from .fsdp import gathered_adapters
from .optim import counter_sums, find_stiefel_optimizer
from .plots import plot_fisher_scores
from .selection import (
    SCORES_FILE,
    SCORES_PLOT,
    FoRASelection,
    check_layer_indices,
    load_scores,
    resolve_layer_budget,
    select_layers,
)
from .stiefel import orthogonality_error
from .targets import find_decoder_layers, is_linear_like, layer_index, matches_target
from .validation import check_choice
from .zero import Zero3FoRAOptimizer, find_zero_client, gathered_trainable_parameters


__all__ = [
    "FoRALogs",
    "SaveSelectionCallback",
    "active_lora_config",
    "check_selection_free",
    "choose_layers",
    "format_selection_table",
    "init_fora_adapters",
    "readapt_lora",
    "restrict_lora_config",
    "set_input_cast",
    "write_selection",
]


logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------- selection
def choose_layers(
    model: nn.Module,
    fora: FoRAConfig,
    *,
    seed: int,
    checkpoint: str | None,
    score: Callable[[], FisherScores],
) -> FoRASelection:
    """The layers ``model`` gets LoRA on under ``fora``: the K decoder layers to adapt, from Fisher scores (a
    caller-given scorer), explicit indices, a control strategy, saved scores, or the selection saved with the
    checkpoint being resumed.

    ``checkpoint`` is the checkpoint the run resumes from (its saved selection is reused, nothing is scored);
    ``score`` computes the Fisher scores when they are needed: the caller's data and loss.
    """
    prefix, layers = find_decoder_layers(model)
    num_layers = len(layers)
    if not fora.selects_layers:
        return FoRASelection(list(range(num_layers)), num_layers, prefix, source="all", mode=fora.mode)
    saved = _checkpoint_selection(checkpoint, num_layers) if checkpoint is not None else None
    if fora.layers is not None:
        chosen = check_layer_indices(fora.layers, num_layers)
        if saved is not None and saved.chosen != chosen:
            raise FoRAInputError(
                f"FoRAConfig.layers={chosen} differ from the layers {saved.chosen} that checkpoint {checkpoint} was "
                f"trained on, and a resumed run keeps its layers: set layers={saved.chosen} or leave layers unset to "
                "resume, or start a new run (no resume_from_checkpoint) to train other layers."
            )
        return FoRASelection(chosen, num_layers, prefix, source="layers", mode=fora.mode)
    if saved is not None:
        k = resolve_layer_budget(fora.layer_budget, num_layers)
        if k != len(saved.chosen):
            warnings.warn(
                f"FoRAConfig.layer_budget={fora.layer_budget!r} gives K={k} layers, but checkpoint {checkpoint} was "
                f"trained with LoRA on K={len(saved.chosen)} layers {saved.chosen}: the resumed run keeps the "
                f"checkpoint's layers. Start a new run (no resume_from_checkpoint) to adapt {k} layers.",
                stacklevel=2,
            )
        logger.info("FoRA: reusing the layer selection saved with the checkpoint (no re-scoring).")
        scores = dataclasses.replace(saved.scores, layer_prefix=prefix) if saved.scores else None
        return FoRASelection(saved.chosen, num_layers, prefix, scores=scores, source="checkpoint", mode=fora.mode)
    k = resolve_layer_budget(fora.layer_budget, num_layers)
    if fora.scores_path is not None:
        scores = dataclasses.replace(load_scores(fora.scores_path, num_layers, "scores_path"), layer_prefix=prefix)
        chosen = select_layers(scores.scores, k, strategy=fora.layer_strategy, seed=seed)
        return FoRASelection(chosen, num_layers, prefix, scores=scores, source="scores_path", mode=fora.mode)
    if fora.layer_strategy != "fisher":
        chosen = select_layers(None, k, strategy=fora.layer_strategy, num_layers=num_layers, seed=seed)
        return FoRASelection(chosen, num_layers, prefix, source=fora.layer_strategy, mode=fora.mode)
    scores = score()
    chosen = select_layers(scores.scores, k, strategy="fisher")
    return FoRASelection(chosen, num_layers, prefix, scores=scores, source="fisher", mode=fora.mode)


def _checkpoint_selection(checkpoint: str, num_layers: int) -> FoRASelection:
    saved = FoRASelection.load(checkpoint)
    if saved.num_layers != num_layers:
        raise FoRAInputError(
            f"The checkpoint's selection is for {saved.num_layers} layers, this model has {num_layers}: resume with "
            "the same model."
        )
    return saved


# ---------------------------------------------------------------------------------------------------- adapters
def restrict_lora_config(config: LoraConfig, model: nn.Module, selection: FoRASelection) -> None:
    """Point ``config`` (in place) at exactly what it targets in the chosen layers of ``model``.

    ``model`` is the base model, without adapters. ``target_modules`` become the fully qualified names of the target
    linears (``nn.Linear``, GPT-2's ``Conv1D``, quantized linears) in the chosen layers, ``target_parameters``
    (fused MoE experts) the fully qualified names of the target parameters there, and ``modules_to_save`` entries
    that match modules inside decoder layers keep only those of the chosen layers. Also records the targets and the
    parameter count LoRA on every layer would have.
    """
    _, layers = find_decoder_layers(model)
    prefix = selection.layer_prefix
    per_layer = {i: _matching_modules(model, config, prefix, i) for i in range(len(layers))}
    per_layer_params = {i: _matching_parameters(model, config, prefix, i) for i in range(len(layers))}
    _check_targets_present(config, per_layer, per_layer_params, selection.chosen)
    selection.target_modules = [name for i in selection.chosen for name in per_layer[i]]
    selection.target_parameters = [name for i in selection.chosen for name in per_layer_params[i]]
    modules = [model.get_submodule(name) for names in per_layer.values() for name in names]
    parameters = [model.get_parameter(name) for names in per_layer_params.values() for name in names]
    selection.lora_all_layers_parameters = sum(_lora_parameter_count(t, config.r) for t in modules + parameters)
    # Fully qualified names adapt exactly these modules: layers_to_transform can match nothing, or also match a
    # vision tower's layers of the same index; target_parameters and modules_to_save have no layer filter at all.
    config.target_modules = list(selection.target_modules)
    if config.target_parameters:
        config.target_parameters = list(selection.target_parameters)
    if config.modules_to_save:
        config.modules_to_save = _restrict_modules_to_save(config.modules_to_save, model, prefix, selection.chosen)
    config.layers_to_transform = None
    config.layers_pattern = None


def init_fora_adapters(model: nn.Module, selection: FoRASelection, fora: FoRAConfig, seed: int) -> None:
    """After the LoRA wrap: Stiefel ``lora_B`` where the mode asks for it, and the trainable parameters per layer."""
    if fora.uses_stiefel:
        make_stiefel(model, init_a=fora.init_a, generator=torch.Generator().manual_seed(seed))
    names = {id(p): n for n, p in model.named_parameters()}
    for param in model.parameters():
        if param.requires_grad:
            index = layer_index(names[id(param)], selection.layer_prefix)
            if index is not None:
                selection.trainable_parameters[index] = selection.trainable_parameters.get(index, 0)
                selection.trainable_parameters[index] += param.numel()
    if not any(p.requires_grad for p in model.parameters()):
        raise FoRAInputError("After the FoRA wrap nothing is trainable: check target_modules and the chosen layers.")


def readapt_lora(
    model: PeftModel, selection: FoRASelection, fora: FoRAConfig, seed: int, *, autocast_adapter_dtype: bool = True
) -> None:
    """Move ``model``'s LoRA adapter onto the chosen layers only (:func:`restrict_lora_config` points the LoraConfig
    at exactly their target linears), then :func:`init_fora_adapters`: Stiefel ``lora_B`` for the modes that use it,
    and the per-layer parameter counts.

    The trainer (SFTTrainer, Axolotl's) wrapped every layer the LoraConfig targets. The adapter comes off (weights
    and wrappers) and goes back under the same name with the same LoraConfig object, restricted in place (a trainer
    may hold that object and save it), on the same PeftModel; the adapter weights get the dtype the trainer gave
    them (bf16 on a k-bit base). ``autocast_adapter_dtype`` is PEFT's (False: adapters in the base's dtype, as TRL
    asks under ZeRO-3); ``fora.adapter_dtype="bfloat16"`` asks the same of PEFT and makes every ``lora_`` weight bf16.
    """
    config = active_lora_config(model)
    adapter = model.active_adapters[0]
    dtypes = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    base = model.get_base_model()
    model.delete_adapter(adapter)
    model.unload()
    restrict_lora_config(config, base, selection)
    torch.manual_seed(seed)
    bf16 = fora.adapter_dtype == "bfloat16"
    model.add_adapter(adapter, config, autocast_adapter_dtype=autocast_adapter_dtype and not bf16)
    model.set_adapter(adapter)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if bf16 and param.is_floating_point() and _is_lora_weight(name):
            param.data = param.data.to(torch.bfloat16)
        elif name in dtypes:
            param.data = param.data.to(dtypes[name])
    init_fora_adapters(model, selection, fora, seed)


def _is_lora_weight(name: str) -> bool:
    """A PEFT LoRA weight (``lora_A``, ``lora_B``, ``lora_embedding_*``, DoRA's ``lora_magnitude_vector``)."""
    return any(part.startswith("lora_") for part in name.split("."))


# model -> the handle of its input-cast pre-hook, so that setting it again replaces it.
_INPUT_CAST_HOOKS: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()


class _InputCastUnderAutocast:
    """A forward pre-hook on the transformers model under the PeftModel: each forward, the LoRA layers skip PEFT's
    input cast exactly when it runs under autocast on its inputs' device (``cast_input_dtype_enabled``, PEFT's public
    switch per layer).

    Under autocast, ``F.linear`` casts both operands to the autocast dtype, so PEFT's fp32 copy of a bf16 input is
    cast straight back: the adapter computes the same numbers from the input itself, and its gradient is the same.
    Without autocast, a bf16 input meets fp32 adapter weights, and PEFT's cast is what makes the matmul possible. The
    model, not each LoRA layer, carries the hook: it runs once per forward (PEFT's forward calls it, and so does
    ``generate`` at every token), and a layer keeps the fast path of ``nn.Module.__call__``.
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tensor = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        cast = tensor is None or not torch.is_autocast_enabled(tensor.device.type)
        for layer in self.layers:
            layer.cast_input_dtype_enabled = cast


def set_input_cast(model: nn.Module, input_cast: str) -> int:
    """Apply ``FoRAConfig.input_cast`` to the LoRA layers ``model`` holds now; the number of layers that skip PEFT's
    input cast under autocast (0 for ``"peft"``).

    ``"auto"``: the plain LoRA linears (PEFT's ``lora.Linear`` without a variant such as DoRA) skip the cast in the
    forwards that run under autocast (:class:`_InputCastUnderAutocast`); ``"peft"``: PEFT's cast everywhere. PEFT's
    own 4-bit LoRA layers already skip it under autocast. Call it once the adapters are in place: a layer added later
    keeps PEFT's cast. Setting it again replaces the earlier setting.
    """
    check_choice("input_cast", input_cast, INPUT_CASTS)
    holder = model.get_base_model() if isinstance(model, PeftModel) else model
    previous = _INPUT_CAST_HOOKS.pop(holder, None)
    if previous is not None:
        previous.remove()
    lora_linears = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for layer in lora_linears:
        layer.cast_input_dtype_enabled = True
    plain = [layer for layer in lora_linears if not layer.lora_variant]
    if input_cast == "peft" or not plain:
        return 0
    _INPUT_CAST_HOOKS[holder] = holder.register_forward_pre_hook(_InputCastUnderAutocast(plain), with_kwargs=True)
    return len(plain)


def active_lora_config(model: PeftModel) -> LoraConfig:
    """The LoraConfig of ``model``'s one active adapter."""
    if len(model.active_adapters) != 1:
        raise FoRAInputError(f"FoRA trains one LoRA adapter; the model has active adapters {model.active_adapters}.")
    return model.peft_config[model.active_adapters[0]]


def _matching_modules(model: nn.Module, config: LoraConfig, prefix: str, index: int) -> list[str]:
    """Names of the linear-like modules in decoder layer ``index`` that the LoraConfig targets (PEFT's matching)."""
    if config.target_modules is None:
        return []
    layer_prefix = f"{prefix}.{index}."
    return [
        name
        for name, module in model.named_modules()
        if name.startswith(layer_prefix) and is_linear_like(module) and check_target_module_exists(config, name)
    ]


def _matching_parameters(model: nn.Module, config: LoraConfig, prefix: str, index: int) -> list[str]:
    """Names of the parameters in decoder layer ``index`` that ``LoraConfig.target_parameters`` targets (PEFT's rule:
    the qualified name, or a suffix of it after a dot)."""
    targets = config.target_parameters or []
    layer_prefix = f"{prefix}.{index}."
    return [
        name for name, _ in model.named_parameters() if name.startswith(layer_prefix) and matches_target(name, targets)
    ]


def _restrict_modules_to_save(entries: list[str], model: nn.Module, prefix: str, chosen: list[int]) -> list[str]:
    """``modules_to_save`` without the decoder-layer modules of unchosen layers (PEFT matches by name suffix)."""
    names = [name for name, _ in model.named_modules()]
    restricted = []
    for entry in entries:
        matched = [name for name in names if name.endswith(entry)]
        in_layers = [name for name in matched if layer_index(name, prefix) is not None]
        if not in_layers:
            restricted.append(entry)  # lm_head, embed_tokens: outside the layers, as the user wrote it
            continue
        restricted += [name for name in matched if name not in in_layers or layer_index(name, prefix) in chosen]
    return list(dict.fromkeys(restricted))


def _check_targets_present(
    config: LoraConfig, per_layer: dict[int, list[str]], per_layer_params: dict[int, list[str]], chosen: list[int]
) -> None:
    empty = [i for i in chosen if not per_layer[i] and not per_layer_params[i]]
    if empty:
        raise FoRAInputError(
            f"LoraConfig.target_modules={config.target_modules!r} / target_parameters={config.target_parameters!r} "
            f"match no linear (nn.Linear, Conv1D or a quantized linear) and no parameter in the chosen layers "
            f"{empty}: use module or parameter names of the model's decoder layers."
        )
    checks = (("target_modules", per_layer), ("target_parameters", per_layer_params))
    for field_name, found_per_layer in checks:
        targets = getattr(config, field_name)
        if not targets or isinstance(targets, str):
            continue
        found = [name for i in chosen for name in found_per_layer[i]]
        absent = [t for t in targets if not any(matches_target(name, [t]) for name in found)]
        if absent:
            example = found[:5] or [name for i in chosen for name in per_layer[i] + per_layer_params[i]][:5]
            raise FoRAInputError(
                f"{field_name.replace('_', ' ')} {absent} are absent from the chosen layers {chosen} (their "
                f"targets are named like {example}): fix LoraConfig.{field_name}."
            )


def _lora_parameter_count(target: nn.Module | torch.Tensor, r: int) -> int:
    """LoRA's r·(d_in + d_out) for a linear-like module; r·E·(d_in + d_out) for a parameter of E fused experts."""
    if isinstance(target, torch.Tensor):
        experts, *shape = target.shape if target.dim() == 3 else (1, *target.shape)
        return r * experts * sum(shape)
    if isinstance(target, Conv1D):
        return r * (target.nx + target.nf)
    return r * (target.in_features + target.out_features)


# ----------------------------------------------------------------------------------------------------- reports
def write_selection(selection: FoRASelection, output_dir: str | Path, *, table: bool = True) -> None:
    """The selection's record and its plot in ``output_dir`` (``fora_scores.json``, ``fora_scores.png``), and
    (``table``) the table on stdout. :class:`SaveSelectionCallback` puts the record in every checkpoint too, so a
    resume adapts the same layers.

    Written when the run's outputs are: at the end of training (:class:`SaveSelectionCallback`), or by ``fora
    score``, whose output they are. A run that fails or is refused before that leaves an earlier run's files as they
    were.
    """
    out = selection.save(output_dir).parent
    scores = selection.scores.scores if selection.scores else None
    plot_fisher_scores(out / SCORES_PLOT, scores, selection.chosen, selection.num_layers)
    if table:
        print(format_selection_table(selection))


def check_selection_free(output_dir: str | Path, key: str = "output_dir") -> None:
    """Refuse writing a selection on its own (``fora score``) into a folder that holds a trained adapter: the
    ``fora_scores.json`` there records the layers that adapter was trained on, and new scores with another choice
    of layers would replace that record while the adapter stays on the old layers."""
    out = Path(output_dir)
    if (out / CONFIG_NAME).is_file():
        refuse(
            key,
            str(output_dir),
            f"it holds a trained adapter ({CONFIG_NAME}) whose {SCORES_FILE} records the layers it was trained "
            f"on: the new scores and layer choice would replace that record while the adapter stays on the old layers",
            f"Give another output_dir for the scores (e.g. --output_dir {out / 'rescored'}).",
        )


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


class SaveSelectionCallback(TrainerCallback):
    """Every checkpoint carries the selection, so a resume adapts the same layers without scoring again; the output
    folder gets ``fora_scores.json``/``.png`` once training has finished (not before: a failed run must not replace
    an earlier run's selection next to that run's adapter).

    Written wherever HF writes the checkpoint (``args.should_save``): the main process, or with
    ``save_on_each_node`` each node's local main process, so a node without a shared filesystem can resume too.
    """

    def __init__(self, selection: FoRASelection) -> None:
        self.selection = selection

    def on_save(self, args, state, control, **kwargs):
        if args.should_save:
            self.selection.save(checkpoint_folder(args, state))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if args.should_save:  # where save_model writes the adapter
            write_selection(self.selection, args.output_dir, table=False)
        return control


class FoRALogs:
    """What FoRA adds to a training log: the largest ‖BᵀB − I‖, the mean effective rank of ΔW, and (in the first
    log only) the number of adapted layers, the trainable parameters and their ratio to LoRA on all layers.
    """

    def __init__(self, selection: FoRASelection) -> None:
        self.selection = selection
        self._selection_logged = False

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
        client = find_zero_client(optimizer)
        # Under ZeRO-3 the adapters are partitioned between forwards, and the fp32 lora_B live in the client; under
        # FSDP2 they are row shards. Both gathers are collectives that do nothing elsewhere.
        points = client.stiefel_points() if isinstance(client, Zero3FoRAOptimizer) else {}
        with gathered_trainable_parameters(model), gathered_adapters(model, optimizer):
            # Everything on the device, read back once: a host sync per adapter would stall a GPU's launch queue.
            drifts = _drifts(model, client.stiefel if client is not None else optimizer, points)
            # Read with them: Cayley-Adam's counters (for DivergenceMonitor, which takes them from the log) and,
            # under DeepSpeed, the norm FoRA clipped by (DeepSpeed's own is lora_A's partitions' alone).
            stiefel = find_stiefel_optimizer(optimizer) if drifts else None
            counters = {} if stiefel is None else counter_sums(stiefel)
            extra = {f"fora/{name}": t for name, t in counters.items() if t is not None}
            grad_norm = client.last_grad_norm_unread() if client is not None else None
            if isinstance(grad_norm, torch.Tensor):
                extra["grad_norm"] = grad_norm
            max_drift, mean_rank, values = read_adapter_diagnostics(model, drifts, list(extra.values()))
        read = dict(zip(extra, values))
        logs = {"fora/max_orthogonality_error": max_drift, "fora/mean_effective_rank": mean_rank}
        for name in counters:  # 0 for a counter no matrix has yet (before the first step)
            logs[f"fora/{name}"] = int(read.get(f"fora/{name}", 0))
        if grad_norm is not None:
            logs["grad_norm"] = read.get("grad_norm", grad_norm)
        if not self._selection_logged:
            trainable = sum(self.selection.trainable_parameters.values())
            logs["fora/layers_adapted"] = len(self.selection.chosen)
            logs["fora/trainable_parameters"] = trainable
            if self.selection.lora_all_layers_parameters:
                logs["fora/parameter_ratio_vs_lora_all"] = trainable / self.selection.lora_all_layers_parameters
            self._selection_logged = True
        return logs


def _drifts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, points: dict[torch.Tensor, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """‖BᵀB − I‖ of every Stiefel lora_B, as device tensors (one per matrix, (E,) for E fused experts)."""
    # A bf16 lora_B is its fp32 master rounded; the master is the point on the manifold.
    # A lora_B of E fused experts is E Stiefel matrices: each block's own drift.
    state = optimizer.state if optimizer is not None else {}
    experts = stiefel_num_experts(model)
    drifts = []
    for _, p in stiefel_parameters(model):
        b = (points or {}).get(p, state.get(p, {}).get("master", p)).detach().float()  # (d_out, r·E)
        if id(p) in experts:
            b = expert_blocks(b, experts[id(p)])  # (E, d_out, r)
        drifts.append(orthogonality_error(b))
    return drifts


def _max_drift(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, points: dict[torch.Tensor, torch.Tensor] | None = None
) -> float:
    """The largest ‖BᵀB − I‖ over the model's Stiefel lora_B (a host read: for checks, not for the logs)."""
    return largest_drift(_drifts(model, optimizer, points)).item()
