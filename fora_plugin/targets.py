"""What a causal LM is made of, as FoRA and PEFT name it: its decoder layers, its linear-like modules, PEFT's
matching of target names, and the up-front check of a config's target names against the model.

One home for the rules that scoring (:mod:`fora_plugin.fisher`), the up-front checks (:mod:`fora_plugin.validation`),
the adapter wiring (:mod:`fora_plugin.wiring`) and ``fora report`` share: a target given in a list matches a module
or parameter whose qualified name equals it or ends with ``"." + target`` (PEFT's rule); PEFT's ``base_layer`` hops
are not part of a name; a decoder layer's index is the number after the decoder-layer list's name.

May import: errors, models, validation.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn
from transformers.pytorch_utils import Conv1D

from .errors import FoRAInputError, refuse
from .models import meta_model
from .validation import suggestion


__all__ = [
    "LAYER_PATHS",
    "base_name",
    "check_target_modules",
    "check_target_parameters",
    "find_decoder_layers",
    "fused_target_names",
    "is_linear_like",
    "layer_index",
    "matches_target",
    "module_names",
    "target_names",
]

# Attribute paths tried, in order, when a model has no get_decoder().layers.
LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "model.decoder.layers",
    "transformer.h",
    "gpt_neox.layers",
    "layers",
)
# The names decoder-layer lists have in the paths above, for adapter files read without their model.
_LAYER_LIST_NAMES = ("layers", "h")


def matches_target(name: str, targets: Iterable[str]) -> bool:
    """Whether ``name`` is one of ``targets`` or ends with ``"." + target`` (PEFT's rule for a list of names)."""
    return any(name == t or name.endswith("." + t) for t in targets)


def base_name(name: str) -> str:
    """``name`` without PEFT's ``base_layer`` hops, as the unwrapped model names it (target matching)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def layer_index(name: str, prefix: str | None = None) -> int | None:
    """The decoder-layer index in a qualified ``name``; None outside the decoder layers.

    With the model's decoder-layer prefix (``find_decoder_layers(model)[0]``) the index is the number after it. Without
    one (an adapter file read without its model) it is the number after the first ``layers`` or ``h`` part.
    """
    if prefix is not None:
        marker = f"{prefix}."
        at = name.find(marker)
        if at < 0:
            return None
        head = name[at + len(marker) :].split(".", 1)[0]
        return int(head) if head.isdigit() else None
    parts = name.split(".")
    for before, after in zip(parts, parts[1:]):
        if before in _LAYER_LIST_NAMES and after.isdigit():
            return int(after)
    return None


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layer list of a causal LM (never a vision tower or an encoder) and its qualified name.

    Uses ``get_decoder().layers`` (Llama, Qwen, Gemma 3, and the language model of multimodal models), then a few
    common attribute paths. A ``PeftModel`` is looked through to its base model.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = {id(m): n for n, m in model.named_modules()}
    candidates = []
    get_decoder = getattr(base, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(Exception):
            candidates.append(getattr(get_decoder(), "layers", None))
    for path in LAYER_PATHS:
        module = base
        for part in path.split("."):
            module = getattr(module, part, None)
        candidates.append(module)
    for layers in candidates:
        if isinstance(layers, nn.ModuleList) and len(layers) > 0 and id(layers) in names:
            return names[id(layers)], layers
    raise FoRAInputError(
        f"Cannot find the decoder layers of {type(base).__name__}: looked for get_decoder().layers and the "
        f"attributes {list(LAYER_PATHS)}. FoRA scores and adapts the decoder layers of causal language models."
    )


def is_linear_like(module: nn.Module) -> bool:
    """A module that computes y = x Wᵀ (+ b): ``nn.Linear`` and its quantized forms (bitsandbytes, GPTQ, AWQ, HQQ,
    torchao, fp8), which all expose ``in_features``/``out_features``, and transformers' ``Conv1D`` (GPT-2)."""
    if isinstance(module, (nn.Linear, Conv1D)):
        return True
    return isinstance(getattr(module, "in_features", None), int) and isinstance(
        getattr(module, "out_features", None), int
    )


def module_names(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """(every module name, the linear-like module names, those inside the decoder layers) of ``model``."""
    modules = dict(model.named_modules())
    linear = [n for n, m in modules.items() if n and is_linear_like(m)]
    prefix, _ = find_decoder_layers(model)
    return list(modules), linear, [n for n in linear if n.startswith(prefix + ".")]


# ----------------------------------------------------------------------------------- target names of a config
# A target name PEFT matches as a name (by suffix) when it is given in a list; as a lone string it is a regex.
_PLAIN_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def target_names(value: Any) -> Any:
    """LoRA target names in the form PEFT reads as names: one plain name given alone (``--lora_target_modules
    q_proj`` on the command line, or TRL's ModelConfig, which turns a one-item list into its item) becomes a list.

    As a string PEFT would take it for a regex that must match a module's whole qualified name, which a leaf name
    never does, so the adapter would match nothing. ``all-linear``, a regex and a list are returned as they are.
    """
    if isinstance(value, str) and value != "all-linear" and _PLAIN_NAME.fullmatch(value):
        return [value]
    return value


def check_target_modules(
    model: Any, targets: Any, *, trust_remote_code: bool = False, key: str, model_key: str = "model_name_or_path"
) -> None:
    """Refuse LoRA target module names that ``model`` (a local model folder, or a transformers config) lacks;
    ``model_key`` names the model's setting when its config.json cannot be read.

    The model is built on the meta device from its config (no weights are read), before PEFT wraps it. A name
    matches as PEFT matches it: the module's full name, or its last components after a dot; on a model whose MoE
    experts are fused, the names PEFT converts to the fused parameters (``gate_proj`` + ``up_proj`` ->
    ``gate_up_proj``) count, in complete groups. The message names the model's linear module names and suggests a
    list.
    """
    if isinstance(targets, str) and "," in targets:
        targets = [targets]  # one YAML string "q_proj,v_proj": PEFT would read it as a regex matching nothing
    targets = target_names(targets)
    if targets is None or isinstance(targets, str) or not _has_config(model):
        return  # None / "all-linear" / a regex: PEFT's own rules; a hub name: not checkable offline
    joined = [t for t in targets if isinstance(t, str) and ("," in t or " " in t.strip())]
    if joined:
        parts = [p for t in targets for p in t.replace(",", " ").split()]
        refuse(
            key,
            targets if len(targets) > 1 else targets[0],
            f"{joined[0]!r} is one name holding several (separated by commas or spaces), and no module is called that",
            f"Give a list: `{key}: [{', '.join(parts)}]` in the YAML, or `--{key} {' '.join(parts)}` on the command "
            "line.",
        )
    meta = meta_model(model, trust_remote_code, model_key)
    names, linear, in_layers = module_names(meta)
    absent = [t for t in targets if not any(matches_target(n, [t]) for n in names)]
    fused = _fused_expert_names(meta)
    _check_fused_groups(targets, fused, key, meta)
    _check_converted_without_experts(targets, key, meta)
    absent = [t for t in absent if t not in fused]
    if absent:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
        # Suggested: the decoder layers' linears (FoRA adapts decoder layers; lm_head is rarely a LoRA target).
        suggested = sorted({n.rsplit(".", 1)[-1] for n in in_layers}) or leaves
        hints = "".join(suggestion(t, leaves).replace("Did you mean", f"For {t!r}, did you mean") for t in absent)
        refuse(
            key,
            list(targets),
            f"the model has no module named {absent} (its linear modules are {leaves})",
            f"Use some of those, e.g. {key}: [{', '.join(suggested)}].{hints}",
        )


def fused_target_names(model_type: str | None) -> dict[str, tuple[str, list[str]]]:
    """PEFT's renaming of LoRA target names for a model type whose MoE experts transformers 5 fused: each name ->
    (the fused parameter's name, every name fused into it), as get_peft_model applies it to every model of that type.
    Empty for other types (and PEFT releases without the conversion)."""
    try:  # PEFT's own tables of the conversion it makes in get_peft_model (absent from older releases)
        from peft.utils.transformers_weight_conversion import (
            _MODEL_TO_CONVERSION_PATTERN,
            _MOE_FUSED_TARGETS,
            _MOE_TARGET_MODULE_MAPPING,
        )
    except ImportError:
        return {}
    kind = _MODEL_TO_CONVERSION_PATTERN.get(model_type)
    fused = _MOE_FUSED_TARGETS.get(kind) or {}
    return {
        old: (new, list(fused.get(new, [old]))) for old, new in (_MOE_TARGET_MODULE_MAPPING.get(kind) or {}).items()
    }


def _expert_parameter_names(model: Any) -> set[str]:
    """The last name part of the model's fused expert parameters (3-D: one matrix per expert)."""
    return {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.dim() >= 3}


def _fused_expert_names(model: Any) -> dict[str, tuple[str, list[str]]]:
    """For a model whose MoE experts PEFT converts (transformers 5 fused them): each pre-fusion target name ->
    (the fused parameter it is part of, every name fused into that parameter). Empty for other models."""
    leaves = _expert_parameter_names(model)
    return {
        old: converted
        for old, converted in fused_target_names(getattr(model.config, "model_type", None)).items()
        if converted[0] in leaves  # a name the router keeps (gate -> gate.weight) is a module, not a fused expert
    }


def _check_converted_without_experts(targets: list[str], key: str, model: Any) -> None:
    """Refuse targets that PEFT renames to fused expert parameters (by the model's type) on a model that has none of
    them (a ``qwen3_moe`` config with ``num_experts: 0``: every MLP is dense): PEFT would stop on a partial group
    or, with the whole group, adapt nothing there."""
    model_type = getattr(model.config, "model_type", None)
    converted = fused_target_names(model_type)
    experts = _expert_parameter_names(model)
    # A name PEFT turns into a module's parameter (the router: gate -> gate.weight) is not an expert's.
    expert_names = {old for old, (new, _) in converted.items() if "." not in new}
    renamed = [
        t
        for t in targets
        if t.rsplit(".", 1)[-1] in expert_names and converted[t.rsplit(".", 1)[-1]][0] not in experts
    ]
    if renamed:
        fused = sorted({converted[t.rsplit(".", 1)[-1]][0] for t in renamed})
        kept = [t for t in targets if t not in renamed]
        refuse(
            key,
            list(targets),
            f"PEFT renames {renamed} for every {model_type!r} model to its fused MoE expert parameters ({fused}), but "
            "this model has no such parameter (no MoE experts: every MLP is dense, e.g. with num_experts 0), so "
            "those targets would adapt nothing",
            "Check the model's config.json (its num_experts), or target "
            + (f"only {kept}" if kept else "attention modules such as [q_proj, v_proj]")
            + ".",
        )


def _check_fused_groups(targets: list[str], fused: dict[str, tuple[str, list[str]]], key: str, model: Any) -> None:
    """Refuse a part of a fused expert parameter without the rest (``up_proj`` without ``gate_proj``): one fused
    matrix cannot be adapted in part. PEFT would stop with "fused into gate_up_proj"; say how to target it."""
    leaves = {t.rsplit(".", 1)[-1] for t in targets}
    for name in sorted(leaves & set(fused)):
        parameter, group = fused[name]
        missing = [g for g in group if g not in leaves]
        if not missing:
            continue
        within = sorted(
            {n.split(".layers.")[-1].split(".", 1)[-1] for n, p in model.named_parameters() if p.dim() >= 3}
        )
        others = [t for t in targets if t.rsplit(".", 1)[-1] not in fused]
        refuse(
            key,
            list(targets),
            f"this model's MoE experts are fused: {' and '.join(group)} are one parameter, {parameter}, so {name} "
            f"cannot be adapted without {', '.join(missing)}",
            f"Target the fused experts with lora_target_parameters: [{', '.join(within)}]"
            + (f" and {key}: [{', '.join(others)}]" if others else "")
            + f", or add {', '.join(missing)} to {key} (PEFT then adapts {parameter} whole).",
        )


def check_target_parameters(
    model: Any, targets: Any, *, trust_remote_code: bool = False, key: str, model_key: str = "model_name_or_path"
) -> None:
    """Refuse LoRA target parameter names (fused MoE experts) that ``model`` (a local model folder, or a transformers
    config) does not have."""
    targets = target_names(targets)
    if not targets or isinstance(targets, str) or not _has_config(model):
        return
    parameters = dict(meta_model(model, trust_remote_code, model_key).named_parameters())
    absent = [t for t in targets if not any(matches_target(n, [t]) for n in parameters)]
    if absent:
        # The 3-D parameters are the fused experts that target_parameters is for, named here within their layer.
        fused = sorted({n.split(".layers.")[-1].split(".", 1)[-1] for n, p in parameters.items() if p.dim() >= 3})
        refuse(
            key,
            list(targets),
            f"the model has no parameter named {absent} (its fused expert parameters are {fused or 'none'})",
            "Use names like those, or target_modules for linear layers.",
        )


def _has_config(model: Any) -> bool:
    """Whether ``model`` can be built here: a config object, or a local folder holding config.json."""
    return not isinstance(model, (str, os.PathLike)) or Path(model, "config.json").is_file()
