"""FoRA under FSDP2 (``torch.distributed.fsdp.fully_shard``): row-sharded Stiefel ``lora_B``. How FoRA runs there,
and what it refuses: :func:`prepare_fsdp2`.

May import: config, errors, optim.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.training_args import ParallelMode
from transformers.utils import strtobool

from .config import FoRAConfig
from .errors import FoRAInputError
from .optim import init_cayley_adam_state
from .optim.dtensor import is_dtensor


try:
    from torch.distributed.tensor import Shard
except ImportError:  # torch without distributed tensors: nothing can be sharded (is_dtensor is always False)
    Shard = None


__all__ = [
    "FSDP2Callback",
    "check_fsdp",
    "check_one_engine",
    "check_same_selection",
    "check_sharded_training",
    "check_weights_on_every_rank",
    "fsdp_setting",
    "gathered_adapters",
    "init_sharded_stiefel_state",
    "launched",
    "prepare_fsdp2",
]

logger = logging.getLogger(__name__)


def fsdp_setting(args: Any) -> tuple[int, str] | None:
    """The FSDP version a run asks for, and how it asks, from the training arguments or an ``accelerate launch``
    FSDP config (its environment); None without FSDP."""
    if getattr(args, "fsdp", None):  # True after TrainingArguments.__post_init__ when `fsdp` or `fsdp_config` is set
        version = int((args.fsdp_config or {}).get("version", 2))
        return version, f"fsdp={args.fsdp!r} (FSDP{version}, fsdp_config={args.fsdp_config!r})"
    if strtobool(os.environ.get("ACCELERATE_USE_FSDP", "false")):
        version = int(os.environ.get("FSDP_VERSION", "1"))
        return version, f"ACCELERATE_USE_FSDP=true (FSDP{version}, from `accelerate launch` / its config file)"
    return None


def check_one_engine(fsdp: Any, deepspeed: Any) -> None:
    """Refuse FSDP and DeepSpeed set together: a run shards its model with one engine, so one of the two settings
    would be ignored (which one, the order accelerate reads them in decides)."""
    if fsdp and deepspeed:
        raise FoRAInputError(
            f"fsdp={fsdp!r} and deepspeed={deepspeed!r} are both set, and a run shards its model with one engine: "
            "one of them would be ignored. Keep one: deepspeed (ZeRO-1/2/3) or fsdp (FSDP2)."
        )


def check_fsdp(args: Any, fora: FoRAConfig) -> int | None:
    """Refuse FSDP1, FSDP2 in a single process, and loading the weights on one rank only when the layers are scored;
    the FSDP version the run uses (2, or None without FSDP).

    FSDP1 flattens the parameters of a wrapped module into one 1-D vector per rank, whose slices cut across matrices:
    no per-matrix Cayley step can run on them. FSDP2 keeps every parameter a matrix sharded by rows.
    """
    setting = fsdp_setting(args)
    if setting is None or fora.mode == "lora":
        return None if setting is None else setting[0]
    version, described = setting
    if version != 2:
        raise FoRAInputError(
            f"{described} cannot be combined with mode={fora.mode!r}: FSDP1 flattens parameters into 1-D slices "
            "that cut across lora_B matrices, and the Cayley step needs matrices. Use FSDP2 (fsdp_config "
            '{"version": 2}, or fsdp_version: 2 in the accelerate config: example_configs/accelerate/'
            "fsdp2_8gpu.yaml), DeepSpeed ZeRO-1/2, or mode='lora'."
        )
    if not launched(args):
        # HF refuses it too, but only once accelerate has been set up (which leaves ACCELERATE_USE_FSDP in the
        # environment of the process). One launched rank is a run FSDP2 shards (onto one GPU): it is taken.
        raise FoRAInputError(
            f"{described} cannot be combined with mode={fora.mode!r} in a single process: FSDP2 shards the model "
            "across processes. Launch with torchrun or accelerate launch (example_configs/accelerate/"
            "fsdp2_8gpu.yaml), or drop the FSDP setting."
        )
    if args.fsdp:
        name = "fsdp_config.cpu_ram_efficient_loading"
        loading = (args.fsdp_config or {}).get("cpu_ram_efficient_loading")
    else:
        name = "FSDP_CPU_RAM_EFFICIENT_LOADING"
        loading = os.environ.get(name)
    check_weights_on_every_rank(loading, fora, name)
    return version


def launched(args: Any) -> bool:
    """Whether the training arguments run in a launcher's process group (HF's ``ParallelMode.DISTRIBUTED``), of any
    size: ``torchrun --nproc_per_node 1`` and ``accelerate launch --num_processes 1`` do, a plain process does not."""
    return getattr(args, "parallel_mode", None) == ParallelMode.DISTRIBUTED


def _scores_here(fora: FoRAConfig) -> bool:
    """Whether the trainer Fisher-scores the layers (not given them, or their scores)."""
    return fora.selects_layers and fora.layers is None and fora.scores_path is None and fora.layer_strategy == "fisher"


def check_weights_on_every_rank(cpu_ram_efficient_loading: Any, fora: FoRAConfig, name: str) -> None:
    """Refuse, before loading, an FSDP setting that loads the weights on the first rank only when FoRA is to score
    the layers: the scoring runs on every rank before sharding."""
    if isinstance(cpu_ram_efficient_loading, str):
        cpu_ram_efficient_loading = bool(strtobool(cpu_ram_efficient_loading))
    if cpu_ram_efficient_loading and fora.mode != "lora" and _scores_here(fora):
        raise FoRAInputError(
            f"{name}={cpu_ram_efficient_loading!r} loads the weights on the first rank only, but FoRA scores the "
            "layers on every rank before FSDP2 shards the model. Set it false, or choose the layers without scoring "
            "here: fora_layers, or fora_scores_path from a `fora score` run."
        )


def prepare_fsdp2(trainer: Trainer, fora: FoRAConfig) -> None:
    """Check ``trainer``'s model for FSDP2 and set FoRA up for it; call it before scoring.

    Refuses a 4-bit base with an integer ``bnb_4bit_quant_storage`` and a model whose weights are not all loaded
    (``cpu_ram_efficient_loading`` leaves them on the meta device on every rank but the first) when the layers are to
    be scored. Puts the model on the trainer's device for scoring (FSDP2 shards it there; HF leaves it where it was
    loaded under FSDP), and adds the :class:`FSDP2Callback`.

    FSDP2 makes every parameter a DTensor sharded by rows (``Shard(0)`` on a 1-D mesh): each rank holds a contiguous
    block of the rows of every ``lora_B`` (d_out, r), split as ``torch.chunk`` splits (uneven; a rank may hold none).
    Nothing is gathered for the Cayley step: it only needs the 2r x 2r Gram matrix of [B, m] and the scalar ‖G‖², both
    sums over rows, so each rank forms them on its own rows, one all-reduce per shape bucket gives every rank the same
    coefficients, and each rank updates its own rows (:class:`fora_plugin.optim.CayleyAdam` does this for DTensor
    parameters; its moments are DTensors with the parameter's placements). So:

    - the optimizer is FoRA's ordinary one. accelerate builds it before sharding and then points its ``param_groups``
      at the DTensors; nothing in it is keyed by a parameter seen at construction. :class:`FSDP2Callback` checks, when
      training starts, that the optimizer steps the model's parameters, that they are sharded as the step expects, and
      that every rank adapts the same layers.
    - checkpoints: accelerate saves the optimizer's sharded state dict through ``torch.distributed.checkpoint`` (the
      Cayley moments are DTensors, the step counts replicated scalars) and loads it with its ``DefaultLoadPlanner``:
      the Cayley state saves and resumes with the rest. When training ends the state dict type becomes
      ``FULL_STATE_DICT``, so the adapter ``save_model`` writes is whole: plain PEFT LoRA.
    - Fisher scoring runs before sharding (the trainer's ``__init__``), on the model each rank holds, each rank on its
      own batches; the per-layer sums are all-reduced, so every rank chooses the same layers. A model already sharded
      is scored with ``fisher_scores(..., linear_grad="activations")``: linears from their inputs and output gradients,
      norms by a local re-run, so no base-weight gradient is formed and nothing is gathered but what the forward
      gathers.
    - FSDP-QLoRA: a 4-bit base whose ``bnb_4bit_quant_storage`` is a float dtype is sharded like any weight.
    - FoRA's logs read whole matrices: :func:`gathered_adapters` gathers the LoRA weights for them.

    Refused, each with the setting and the fix: FSDP1 (its flat parameters cut across matrices), a 4-bit base with the
    default integer storage, scoring weights that are not loaded on every rank (``cpu_ram_efficient_loading``), an
    optimizer left on the unsharded parameters, trainable parameters partly unsharded, a ``lora_B`` not sharded by rows
    of a 1-D mesh, and ranks that chose different layers.
    """
    if fora.mode == "lora":
        return
    model = trainer.model
    _check_quant_storage(model)
    if not _scores_here(fora):
        trainer.add_callback(FSDP2Callback(trainer))
        return
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise FoRAInputError(
            f"Parameter {meta} is on the meta device: this rank did not load the model's weights "
            "(fsdp_cpu_ram_efficient_loading: true loads them on the first rank only), so it cannot be Fisher "
            "scored before sharding. Set fsdp_cpu_ram_efficient_loading: false, or choose the layers without "
            "scoring here: fora_layers, or fora_scores_path from a `fora score` run."
        )
    if not getattr(model, "is_loaded_in_4bit", False) and not getattr(model, "is_loaded_in_8bit", False):
        # HF leaves the model where it was loaded under FSDP (accelerate shards it onto the device later); the
        # scoring batches are on the device. bitsandbytes placed a k-bit model when it loaded it.
        model.to(trainer.args.device)
    trainer.add_callback(FSDP2Callback(trainer))


def _check_quant_storage(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if type(param).__name__ == "Params4bit" and not param.is_floating_point():
            raise FoRAInputError(
                f"{name} is a 4-bit weight stored as {param.dtype} (bnb_4bit_quant_storage): FSDP2 cannot shard "
                "integer storage (accelerate leaves such weights whole on every rank; older versions train on with "
                "loss 0 or NaN gradients). Load the model with BitsAndBytesConfig(..., bnb_4bit_quant_storage="
                "torch.bfloat16) (Axolotl: bnb_4bit_quant_storage: bfloat16)."
            )


class FSDP2Callback(TrainerCallback):
    """When training starts (after accelerate has sharded the model and switched the optimizer's parameters): checks
    the sharded setup (:func:`check_sharded_training`) and that every rank adapts the same layers. When it ends:
    makes the adapter that ``save_model`` writes a whole one.

    HF Trainer's ``save_model`` writes nothing under FSDP with ``SHARDED_STATE_DICT`` (only checkpoints, which are
    for resuming): the trained adapter would silently not be saved. Checkpoints stay sharded; after training the
    state dict type becomes ``FULL_STATE_DICT``, so the final adapter is gathered whole and saved as plain PEFT LoRA.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        check_sharded_training(trainer.model, trainer.optimizer)
        init_sharded_stiefel_state(trainer.model, trainer.optimizer)
        selection = getattr(trainer, "fora_selection", None)
        if selection is not None:
            check_same_selection(selection.chosen)

    def on_train_end(self, args, state, control, **kwargs):
        plugin = getattr(self.trainer.accelerator.state, "fsdp_plugin", None)
        if plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type):
            plugin.set_state_dict_type("FULL_STATE_DICT")


def check_sharded_training(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer or a model that FoRA's sharded step cannot train correctly.

    - every parameter the optimizer steps must be one of the model's: accelerate swaps the optimizer's parameters
      for the sharded ones when model and optimizer go through the same ``prepare()`` call; an optimizer prepared on
      its own keeps stepping tensors the model no longer uses, and training silently does nothing;
    - the trainable parameters must be all DTensors or all plain tensors: gradient clipping over a mix fails with
      "got mixed torch.Tensor and DTensor";
    - a Stiefel parameter that is a DTensor must be sharded by rows on a 1-D mesh, the layout the step sums over.

    Training that runs unsharded (accelerate attaches no FSDP plugin to a multi-CPU run, which then trains with DDP)
    is correct, and gets a warning.
    """
    model_params = {id(p) for p in model.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for index, p in enumerate(group["params"]):
            if id(p) not in model_params:
                raise FoRAInputError(
                    f"The optimizer's parameter #{index} of shape {tuple(p.shape)} (group stiefel="
                    f"{bool(group.get('stiefel'))}) is not a parameter of the model: the model was sharded after the "
                    "optimizer was built and the optimizer was not switched to the sharded parameters. Prepare the "
                    "model and the optimizer in the same accelerator.prepare(model, optimizer) call."
                )
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sharded = [n for n, p in trainable if is_dtensor(p)]
    if sharded and len(sharded) < len(trainable):
        plain = next(n for n, p in trainable if not is_dtensor(p))
        raise FoRAInputError(
            f"FSDP2 sharded {sharded[0]} but left the trainable {plain} a plain tensor (is its module in the FSDP "
            "ignored modules?): gradient clipping over both fails with 'got mixed torch.Tensor and DTensor'. Let "
            "FSDP2 shard every trainable parameter."
        )
    if not sharded:
        logger.warning(
            "FoRA: FSDP2 is configured but the model is not sharded (accelerate attaches its FSDP plugin only to GPU "
            "runs): this run trains with plain data parallelism."
        )
        return
    for group in optimizer.param_groups:
        if not group.get("stiefel"):
            continue
        for p in group["params"]:
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise FoRAInputError(
                    f"Stiefel lora_B {names.get(id(p), '?')} is sharded as {p.placements} on a {p.device_mesh.ndim}-D "
                    "mesh; FoRA's Cayley step sums its Gram matrix over row shards of a 1-D mesh (FSDP2's own layout:"
                    " Shard(0)). Use fully_shard on a 1-D mesh (no tensor parallelism, no HSDP) and no "
                    "shard_placement_fn for lora_B."
                )


def init_sharded_stiefel_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Set up the Cayley-Adam state of every row-sharded Stiefel ``lora_B`` that has none yet, before training.

    The first step would do it otherwise: it projects each ``lora_B`` onto the manifold by Cholesky-QR2 on its row
    shards, and checks each Cholesky factorisation on the host (a ``lora_B`` without full column rank has no
    orthonormal basis of its span), two host syncs per parameter inside a training step. Here they run once, at
    setup, and a ``lora_B`` that cannot be projected is refused by name; every step after reads nothing back to the
    host. The state is what the first step would have made (nothing changes ``lora_B`` in between); a state loaded
    from a checkpoint is left as it is.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        if not group.get("stiefel"):
            continue
        for p in group["params"]:
            if not is_dtensor(p) or optimizer.state[p]:
                continue
            try:
                with torch.no_grad():  # as in the step: writes the projected point into the parameter
                    init_cayley_adam_state(optimizer.state[p], p, group.get("num_experts", 1))
            except ValueError as error:
                optimizer.state.pop(p, None)
                raise FoRAInputError(
                    f"Stiefel lora_B {names.get(id(p), '?')} of shape {tuple(p.shape)} cannot be projected onto the "
                    f"manifold: {error}"
                ) from error


def check_same_selection(chosen: list[int]) -> None:
    """Refuse to train when the ranks chose different layers (their adapters and shards would not match)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, list(chosen))
    if any(other != every[0] for other in every):
        raise FoRAInputError(
            f"The ranks chose different layers for LoRA: {every}. Every rank must score the same model with the "
            "all-reduced Fisher sums (fisher_scores does this under torch.distributed), or set fora_layers."
        )


@contextlib.contextmanager
def gathered_adapters(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Inside, every sharded LoRA weight of ``model`` is its whole matrix (and a sharded fp32 master in
    ``optimizer.state`` likewise): for read-only diagnostics (drift, ΔW spectra) that need whole matrices.

    Collective: every rank must enter it. No forward or step may run inside. Without DTensors it does nothing.
    """
    swapped: list[tuple[nn.Module, nn.Parameter]] = []
    added_state: list[nn.Parameter] = []
    try:
        for module in model.modules():
            if not isinstance(module, LoraLayer):
                continue
            for layer in (*module.lora_A.values(), *module.lora_B.values()):
                sharded = layer._parameters.get("weight")
                if not is_dtensor(sharded):
                    continue
                whole = nn.Parameter(sharded.full_tensor().detach(), requires_grad=False)  # (d_out, r) or (r, d_in)
                layer._parameters["weight"] = whole
                swapped.append((layer, sharded))
                master = optimizer.state.get(sharded, {}).get("master") if optimizer is not None else None
                if is_dtensor(master):
                    optimizer.state[whole] = {"master": master.full_tensor()}
                    added_state.append(whole)
        yield
    finally:
        for layer, sharded in swapped:
            layer._parameters["weight"] = sharded
        for whole in added_state:
            optimizer.state.pop(whole, None)
