"""Stiefel-constrained LoRA on a PEFT model: plain PEFT LoRA layers, with lora_B kept column-orthonormal.

Nothing of PEFT is patched: the forward is LoRA's own, ΔW = scaling · B A. `make_stiefel` only re-initialises
the chosen adapters (B random orthonormal, A zero so that ΔW = 0 at step 0) and marks the layers, so that
`build_fora_optimizer` gives their lora_B to Cayley-Adam. The saved adapter is an ordinary LoRA adapter.

Fused MoE experts (``LoraConfig.target_parameters``, PEFT's ``ParamWrapper``) hold the LoRA of E experts in one
``lora_B`` of shape (d_out, r·E), the experts' columns interleaved (:func:`expert_blocks`). The paper constrains each
adapter's B on its own: each expert's (d_out, r) block is its own Stiefel matrix, never orthogonal to the others'.

May import: errors, stiefel, validation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from .errors import FoRAInputError, FoRAInputTypeError
from .stiefel import random_stiefel
from .validation import check_choice


__all__ = [
    "INIT_A",
    "STIEFEL_ADAPTERS_ATTR",
    "expert_blocks",
    "make_stiefel",
    "stiefel_num_experts",
    "stiefel_parameters",
]


INIT_A = ("zeros", "gaussian")
# Attribute on a LoraLayer: the adapter names whose lora_B is Stiefel-constrained.
STIEFEL_ADAPTERS_ATTR = "fora_stiefel_adapters"


def _resolve_adapter_name(model: nn.Module, lora_layers: dict[str, LoraLayer], adapter_name: str | None) -> str:
    if adapter_name is not None:
        return adapter_name
    active = getattr(model, "active_adapters", None)
    if active is None:
        active = sorted({name for layer in lora_layers.values() for name in layer.lora_B})
    active = list(active)
    if len(active) != 1:
        raise FoRAInputError(
            f"make_stiefel cannot tell which adapter to constrain: the model has adapters {active}. "
            "Pass adapter_name=... explicitly."
        )
    return active[0]


def make_stiefel(
    model: nn.Module,
    module_names: Iterable[str] | None = None,
    *,
    adapter_name: str | None = None,
    init_a: str = "zeros",
    generator: torch.Generator | None = None,
) -> list[str]:
    """Make the ``lora_B`` of LoRA modules of a PEFT model Stiefel-constrained (BᵀB = I) and re-initialise them.

    Each chosen module gets B = a random orthonormal (d_out, r) matrix and A = 0, so ΔW = B A = 0 exactly at step
    0 and the adapted model starts as the base model; Cayley-Adam (see :func:`fora_plugin.build_fora_optimizer`)
    then keeps B on the manifold. No gate and no patched forward: save, load and merge stay PEFT's own. A lora_B of
    E fused experts gets E independent random orthonormal (d_out, r) blocks (see :func:`stiefel_num_experts`).

    Args:
        model: a ``PeftModel`` (or a model holding PEFT LoRA layers).
        module_names: qualified names (as in ``model.named_modules()``) of the LoRA modules to constrain; ``None``
            constrains every LoRA module that holds the adapter.
        adapter_name: the adapter to constrain; defaults to the model's single active adapter.
        init_a: ``"zeros"`` (ΔW = 0 at step 0, default) or ``"gaussian"`` (the paper's A ~ N(0, 1/r): ΔW ≠ 0 at
            step 0, so the adapted model differs from the base before any training).
        generator: a CPU ``torch.Generator`` for a reproducible initialisation.

    Returns:
        The names of the modules made Stiefel, in model order.
    """
    check_choice("init_a", init_a, INIT_A)
    lora_layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not lora_layers:
        raise FoRAInputError(
            "make_stiefel found no LoRA layer in the model: wrap it with peft.get_peft_model(model, "
            "LoraConfig(...)) first."
        )
    adapter_name = _resolve_adapter_name(model, lora_layers, adapter_name)
    if module_names is None:
        chosen = {name: layer for name, layer in lora_layers.items() if adapter_name in layer.lora_B}
        if not chosen:
            raise FoRAInputError(
                f"No LoRA module holds adapter {adapter_name!r}; the model's LoRA modules hold "
                f"{sorted({a for layer in lora_layers.values() for a in layer.lora_B})}."
            )
    else:
        wanted = list(module_names)
        missing = [n for n in wanted if n not in lora_layers]
        if missing:
            examples = list(lora_layers)[:3]
            raise FoRAInputError(
                f"make_stiefel: {missing[:5]} are not LoRA modules of the model (LoRA modules are "
                f"named like {examples}). Pass names from model.named_modules()."
            )
        chosen = {name: lora_layers[name] for name in lora_layers if name in set(wanted)}

    for name, layer in chosen.items():
        _check_stiefel_capable(name, layer, adapter_name)
    for layer in chosen.values():
        _init_stiefel_adapter(layer, adapter_name, init_a, generator)
    return list(chosen)


def _check_stiefel_capable(name: str, layer: LoraLayer, adapter_name: str) -> None:
    if adapter_name not in layer.lora_B:
        raise FoRAInputError(f"LoRA module {name!r} has no adapter {adapter_name!r} (it has {list(layer.lora_B)}).")
    lora_b = layer.lora_B[adapter_name]
    if not isinstance(lora_b, nn.Linear):
        raise FoRAInputTypeError(
            f"LoRA module {name!r}: lora_B is a {type(lora_b).__name__}; only linear LoRA (lora_B an "
            "nn.Linear, weight (d_out, r)) can be Stiefel-constrained. Leave this module out."
        )
    if layer.use_dora.get(adapter_name, False):
        raise FoRAInputError(
            f"LoRA module {name!r} uses DoRA (use_dora=True): its magnitude vector rescales B's "
            "columns, which defeats BᵀB = I. Use use_dora=False with FoRA."
        )
    d_out, width = lora_b.weight.shape
    r = width // _num_experts(layer)
    if d_out < r:
        raise FoRAInputError(
            f"LoRA module {name!r} has d_out={d_out} < r={r}: lora_B cannot have {r} orthonormal "
            f"columns. Use r <= {d_out} for it (rank_pattern) or leave it out."
        )


@torch.no_grad()
def _init_stiefel_adapter(layer: LoraLayer, adapter_name: str, init_a: str, generator: torch.Generator | None) -> None:
    b_weight = layer.lora_B[adapter_name].weight  # (d_out, r·E)
    a_weight = layer.lora_A[adapter_name].weight  # (r·E, d_in)
    experts = _num_experts(layer)
    d_out, r = b_weight.shape[0], b_weight.shape[1] // experts
    for block in expert_blocks(b_weight, experts):  # (d_out, r) each, a view into b_weight
        block.copy_(random_stiefel(d_out, r, generator=generator))
    if init_a == "zeros":
        a_weight.zero_()
    else:
        gaussian = torch.randn(a_weight.shape, generator=generator) / math.sqrt(r)
        a_weight.copy_(gaussian)
    marked = set(getattr(layer, STIEFEL_ADAPTERS_ATTR, ()))
    setattr(layer, STIEFEL_ADAPTERS_ATTR, frozenset(marked | {adapter_name}))


def _num_experts(layer: LoraLayer) -> int:
    # PEFT's ParamWrapper on a 3-D (E, ., .) expert Parameter; 1 for every other LoRA layer.
    return int(getattr(layer, "num_experts", 1) or 1)


def expert_blocks(weight: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The (E, d_out, r) view of a ``lora_B`` weight (d_out, r·E) whose E experts' columns PEFT interleaves.

    PEFT's ``ParamWrapper`` reads expert e's B as ``weight.view(d_out, r, E).permute(2, 0, 1)[e]``: its columns are
    e, e + E, e + 2E, ... The view shares ``weight``'s storage, so writing a block writes the weight.
    """
    d_out, width = weight.shape
    return weight.view(d_out, width // num_experts, num_experts).permute(2, 0, 1)


def stiefel_num_experts(model: nn.Module) -> dict[int, int]:
    """``id(lora_B weight) -> E`` for the Stiefel ``lora_B`` that hold E > 1 experts (fused MoE expert Parameters).

    Each of their E (d_out, r) blocks (:func:`expert_blocks`) is its own Stiefel matrix; a lora_B absent from the
    dict is one (d_out, r) matrix.
    """
    found = {}
    for module in model.modules():
        experts = _num_experts(module) if isinstance(module, LoraLayer) else 1
        if experts > 1:
            for adapter_name in getattr(module, STIEFEL_ADAPTERS_ATTR, ()):
                if adapter_name in module.lora_B:
                    found[id(module.lora_B[adapter_name].weight)] = experts
    return found


def stiefel_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, lora_B weight)`` of every adapter made Stiefel by :func:`make_stiefel`, in model order."""
    found = []
    for module_name, module in model.named_modules():
        for adapter_name in sorted(getattr(module, STIEFEL_ADAPTERS_ATTR, ())):
            if adapter_name in module.lora_B:
                found.append((f"{module_name}.lora_B.{adapter_name}.weight", module.lora_B[adapter_name].weight))
    return found
