"""The ``fora_*`` keys of an Axolotl YAML: `FoRAConfig`'s fields with a ``fora_`` prefix, checked by `FoRAConfig`.

`FoRAArgs` joins Axolotl's config schema (``get_input_args``). Its validator builds a `FoRAConfig`, so the values are
checked by the same code as ``FoRASFTTrainer``'s, and, when the YAML enables the plugin, refuses the Axolotl settings
FoRA cannot be right with yet.

May import: compatibility, config, errors, files, fsdp, optim, targets, validation, zero.
"""

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from axolotl.integrations.base import normalize_plugin_name
from pydantic import BaseModel, Field, create_model, model_validator

from ..compatibility import (
    check_dora,
    check_init_lora_weights,
    check_layers_unset,
    check_learning_rate,
    check_optimizer,
)
from ..config import PREFIX, FoRAConfig
from ..errors import FoRAInputError
from ..files import check_file, check_output_folder
from ..fsdp import check_weights_on_every_rank
from ..optim import check_lr_scheduler_type
from ..targets import check_target_modules
from ..validation import LORA_KEYS, OPTIMIZER_KEYS, check_numbers
from ..zero import check_deepspeed_config, load_deepspeed_config


__all__ = ["AXOLOTL_KEYS", "LORA_KERNELS", "PLUGIN_NAME", "FoRAArgs", "fora_config_from", "fora_enabled"]


PLUGIN_NAME = "fora_plugin.axolotl.FoRAPlugin"
# Axolotl's fused LoRA kernels return no gradient for the frozen base weights, which the Fisher score is made of.
LORA_KERNELS = ("lora_qkv_kernel", "lora_o_kernel", "lora_mlp_kernel")
# The number keys of an Axolotl YAML (their rules: validation.NUMBER_RULES), checked when it enables the plugin
# (unset = None = Axolotl's default).
AXOLOTL_KEYS = LORA_KEYS + (
    "micro_batch_size",
    "gradient_accumulation_steps",
    "sequence_len",
    "num_epochs",
    "max_steps",
    *OPTIMIZER_KEYS,
    "logging_steps",
    "save_steps",
    "eval_steps",
    "seed",
)
_FIELDS = [f.name for f in dataclasses.fields(FoRAConfig)]
# FoRAConfig's messages name its fields ("layer_budget=2.0 is ..."); in a YAML they are the fora_ keys.
_FIELD_NAMES = re.compile(rf"(?<![\w.])({'|'.join(_FIELDS)})\b")


def fora_enabled(cfg: Mapping[str, Any]) -> bool:
    """Whether ``plugins`` lists FoRA, as ``fora_plugin.axolotl.FoRAPlugin`` or ``fora_plugin.axolotl:FoRAPlugin``."""
    return PLUGIN_NAME in {normalize_plugin_name(name) for name in cfg.get("plugins") or []}


def fora_config_from(cfg: Mapping[str, Any]) -> FoRAConfig:
    """The `FoRAConfig` of a config's ``fora_*`` keys (unset keys take FoRAConfig's defaults)."""
    values = {name: cfg[PREFIX + name] for name in _FIELDS if cfg.get(PREFIX + name) is not None}
    try:
        return FoRAConfig(**values)
    except ValueError as err:
        raise FoRAInputError(_FIELD_NAMES.sub(rf"{PREFIX}\1", str(err))) from None


class _FoRAChecks(BaseModel):
    @model_validator(mode="after")
    def _check_fora(self):
        cfg = dict(self)
        fora = fora_config_from(cfg)
        if fora_enabled(cfg):
            _check_user_input(cfg, fora)
        if fora_enabled(cfg) and fora.mode != "lora":
            _check_axolotl_settings(cfg, fora)
        return self


def _check_user_input(cfg: dict[str, Any], fora: FoRAConfig) -> None:
    """What Axolotl takes without a check and PEFT, transformers or torch later fail on with a traceback (or, for
    lora_alpha 0, train an adapter that does nothing): the numbers, the target modules against the model's config,
    the output folder and fora_scores_path."""
    check_numbers({k: v for k, v in cfg.items() if v is not None}, AXOLOTL_KEYS)
    base_model = cfg.get("base_model")
    if cfg.get("adapter") in ("lora", "qlora") and isinstance(base_model, str) and Path(base_model).is_dir():
        remote = bool(cfg.get("trust_remote_code"))
        check_target_modules(
            base_model, cfg.get("lora_target_modules"), trust_remote_code=remote, key="lora_target_modules"
        )
    if cfg.get("output_dir"):
        check_output_folder(str(cfg["output_dir"]), "output_dir")
    check_file(fora.scores_path, f"{PREFIX}scores_path")


def _check_axolotl_settings(cfg: dict[str, Any], fora: FoRAConfig) -> None:
    adapter = cfg.get("adapter")
    if adapter not in ("lora", "qlora"):
        raise FoRAInputError(
            f"adapter={adapter!r} cannot be combined with fora_mode={fora.mode!r}: FoRA trains LoRA adapters on the "
            "layers it chooses. Set adapter: lora, or adapter: qlora with load_in_4bit: true (QFoRA), or "
            "fora_mode: lora for Axolotl's own training."
        )
    check_learning_rate(cfg.get("learning_rate"))
    if cfg.get("lr_scheduler") is not None:
        check_lr_scheduler_type(cfg["lr_scheduler"])
    # Axolotl's LoRA config: loftq_config.loftq_bits sets init_lora_weights="loftq", else peft_init_lora_weights.
    peft = cfg.get("peft")
    loftq = getattr(peft, "loftq_config", None) if not isinstance(peft, Mapping) else peft.get("loftq_config")
    loftq_bits = getattr(loftq, "loftq_bits", None) if not isinstance(loftq, Mapping) else loftq.get("loftq_bits")
    if loftq_bits:
        name = f"peft.loftq_config (loftq_bits={loftq_bits}) sets init_lora_weights"
        check_init_lora_weights("loftq", fora, name=name, mode_name=f"{PREFIX}mode")
    elif cfg.get("peft_init_lora_weights") is not None:
        init = cfg["peft_init_lora_weights"]
        check_init_lora_weights(init, fora, name="peft_init_lora_weights", mode_name=f"{PREFIX}mode")
    kernels = [name for name in LORA_KERNELS if cfg.get(name)]
    if kernels:
        raise FoRAInputError(
            f"{', '.join(f'{name}=True' for name in kernels)} cannot be combined with FoRA: Axolotl's fused LoRA "
            "kernels compute no gradient for the base weights, which FoRA's Fisher score sums. Set them to false "
            "(the plugin turns them off when they are unset)."
        )
    if fora.adapter_dtype == "bfloat16" and cfg.get("peft_autocast_adapter_dtype"):
        raise FoRAInputError(
            f"{PREFIX}adapter_dtype='bfloat16' contradicts peft_autocast_adapter_dtype=True, which keeps the adapters "
            f"in fp32: drop peft_autocast_adapter_dtype, or set {PREFIX}adapter_dtype: auto."
        )
    check_layers_unset(
        {key: cfg.get(key) for key in ("peft_layers_to_transform", "peft_layers_pattern")},
        "remove it, and use fora_layers: [...] for a fixed set.",
    )
    check_dora(
        cfg.get("peft_use_dora"),
        fora,
        "peft_use_dora",
        "fora_mode",
        "Set peft_use_dora: false, or fora_mode: fg-lora.",
    )
    if cfg.get("lora_model_dir"):
        raise FoRAInputError(
            f"lora_model_dir={cfg['lora_model_dir']!r} loads a trained adapter, but FoRA builds its adapter on the "
            "layers it chooses. To continue a FoRA run, resume from its checkpoint (resume_from_checkpoint or "
            "auto_resume_from_checkpoints); to train on top of an adapter, merge it into the base model first."
        )
    if cfg.get("rl") or cfg.get("relora"):
        raise FoRAInputError(
            f"rl={cfg.get('rl')!r} / relora={cfg.get('relora')!r}: the FoRA plugin supports supervised fine-tuning "
            "only for now. Remove rl/relora, or use fora_mode: lora."
        )
    check_optimizer(cfg.get("optimizer"), "optimizer")
    regrouped = {k: cfg.get(k) for k in ("loraplus_lr_ratio", "lr_groups", "embedding_lr", "embedding_lr_scale")}
    regrouped = {k: v for k, v in regrouped.items() if v is not None}
    if regrouped:
        raise FoRAInputError(
            f"{', '.join(f'{k}={v!r}' for k, v in regrouped.items())}: these regroup the optimizer's parameters, "
            "and FoRA's optimizer has its own groups (lora_A at learning_rate, lora_B at fora_lr_stiefel). "
            "Remove them."
        )
    fsdp = cfg.get("fsdp_config")
    if fsdp:
        # Axolotl 0.21 runs FSDP2 only (it refuses fsdp_version 1 itself): each rank steps its rows of every lora_B.
        key = "cpu_ram_efficient_loading"
        loading = fsdp.get(key) if isinstance(fsdp, Mapping) else getattr(fsdp, key, None)
        check_weights_on_every_rank(loading, fora, "fsdp_config.cpu_ram_efficient_loading")
    if cfg.get("deepspeed"):
        _check_deepspeed(cfg["deepspeed"], fora)


def _check_deepspeed(deepspeed: str | dict[str, Any], fora: FoRAConfig) -> None:
    if isinstance(deepspeed, str) and not Path(deepspeed).is_file():
        return  # Axolotl reports a missing file itself.
    check_deepspeed_config(load_deepspeed_config(deepspeed), fora, name=f"deepspeed={deepspeed!r}")


FoRAArgs = create_model(
    "FoRAArgs",
    __base__=_FoRAChecks,
    __module__=__name__,
    __doc__="Axolotl config keys of the FoRA plugin: `FoRAConfig`'s fields, prefixed with `fora_`.",
    **{
        PREFIX + f.name: (f.type, Field(default=f.default, description=f.metadata.get("help")))
        for f in dataclasses.fields(FoRAConfig)
    },
)
