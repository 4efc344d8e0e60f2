"""FoRA under FSDP2, driving ``fully_shard`` directly on a PEFT tiny Llama; run by tests/test_fsdp.py.

``torchrun --nproc_per_node W fsdp_engine.py OUT_DIR`` (W = 2 or 3) writes ``OUT_DIR/rank<k>.pt`` with:

- ``train``: STEPS optimizer steps of FoRA's optimizer on the sharded model, with gradient accumulation, one clipping
  norm, an LR warmup, and at NAN_STEP a NaN planted in the local rows of one ``lora_B`` gradient of rank 0 only (its
  step must be skipped on every rank). The optimizer is built before sharding and its ``param_groups`` are then
  pointed at the sharded parameters, as accelerate does (``fsdp2_switch_optimizer_parameters``).
- ``resumed``: the same run stopped after SAVE_AT steps, saved with ``torch.distributed.checkpoint`` (sharded model
  and optimizer state dicts), loaded into a freshly built and sharded model and optimizer, and finished.
- ``differing_selection``: what :func:`fora_plugin.fsdp.check_same_selection` says when the ranks chose differently.
- ``fisher``: Fisher scores of the sharded base model, each rank scoring its own batches with
  ``linear_grad="activations"``, and the peak of live tensor bytes during scoring against that of a backward that
  keeps every base-weight gradient.

Each rank takes its own micro-batches of every global batch, so the results can be compared with
:func:`train_single_process` and :func:`fisher_single_process` on the same global batches. With W = 2 the ``lora_B``
rows split unevenly (65 -> 33/32); with W = 3 the (4, 4) ``k_proj``/``v_proj`` ``lora_B`` split 2/2/0: rank 2 holds
no row of them.
"""

from __future__ import annotations

import os
import sys
import weakref
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, LlamaForCausalLM


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import TARGETS  # noqa: E402

from fora_plugin import build_fora_optimizer, make_stiefel  # noqa: E402
from fora_plugin.fisher import fisher_scores  # noqa: E402
from fora_plugin.fsdp import check_same_selection  # noqa: E402


MICRO, GAS, STEPS, SAVE_AT, NAN_STEP = 2, 2, 6, 3, 4
# MAX_GRAD_NORM is below the gradient norms this run sees, so every step but NAN_STEP is clipped.
LR, LR_STIEFEL, MAX_GRAD_NORM, WEIGHT_DECAY, QR_PERIOD = 5e-2, 1e-1, 0.2, 0.01, 4
ADAPTED_LAYERS = [1, 3]
SEQ_LEN = 12
NAN_PARAM = "base_model.model.model.layers.1.mlp.up_proj.lora_B.default.weight"
FISHER_BATCHES_PER_RANK = 2


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def base_model() -> LlamaForCausalLM:
    # One key/value head of size 4: k_proj and v_proj have 4 output rows, so under 3 ranks their lora_B (4, 4) split
    # 2/2/0. intermediate_size 65 gives odd up_proj rows (33/32 under 2 ranks).
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=65,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def build_model() -> torch.nn.Module:
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, layers_to_transform=ADAPTED_LAYERS, lora_dropout=0.0
    )
    model = get_peft_model(base_model(), config)
    make_stiefel(model, init_a="gaussian", generator=torch.Generator().manual_seed(0))
    return model.train()


def global_batches(world: int, steps: int = STEPS, seed: int = 1) -> torch.Tensor:
    """(steps, world * GAS * MICRO, SEQ_LEN) token ids: sequences that count up from a random start, learnable."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 80, (steps, world * GAS * MICRO, 1), generator=gen)
    return (starts + torch.arange(SEQ_LEN)) % 96


def micro_batch(batch: torch.Tensor, world: int, rank: int, micro: int) -> torch.Tensor:
    start = (micro * world + rank) * MICRO
    return batch[start : start + MICRO]


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 3)  # warmup: the Stiefel lr must follow it too


def optimizer_kwargs() -> dict:
    return dict(lr=LR, lr_stiefel=LR_STIEFEL, weight_decay=WEIGHT_DECAY, qr_period=QR_PERIOD)


def lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every lora_A / lora_B as a whole tensor (gathered from the shards under FSDP2)."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().float().clone()
    return out


def plant_nan(model: torch.nn.Module) -> None:
    grad = model.get_parameter(NAN_PARAM).grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    if local.shape[0] > 0:
        local[0, 0] = float("nan")


# ---------------------------------------------------------------------------------------------- single process
def train_single_process(world: int, steps: int = STEPS) -> dict:
    """The reference: one process, the whole global batch per step, FoRA's ordinary optimizer and torch's clipping."""
    model = build_model()
    optimizer = build_fora_optimizer(model, **optimizer_kwargs())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses = []
    for step, batch in enumerate(global_batches(world)[:steps]):
        total = 0.0
        for micro in range(GAS):
            for rank in range(world):
                ids = micro_batch(batch, world, rank, micro)
                loss = model(input_ids=ids, labels=ids).loss / (GAS * world)
                loss.backward()
                total += loss.item()
        _clip_or_plant(model, step)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"lora": lora_tensors(model), "losses": losses, "skipped": optimizer.skipped_steps()}


def _clip_or_plant(model: torch.nn.Module, step: int) -> None:
    if step == NAN_STEP:
        # No clipping at this step: one NaN in a gradient makes the clipping norm NaN, and every gradient with it.
        plant_nan(model)
    else:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM)


def fisher_batches(world: int) -> list[dict[str, torch.Tensor]]:
    ids = global_batches(world, steps=FISHER_BATCHES_PER_RANK, seed=2).reshape(-1, MICRO, SEQ_LEN)
    return [{"input_ids": b, "labels": b} for b in ids]  # world * FISHER_BATCHES_PER_RANK batches of MICRO rows


def fisher_single_process(world: int, fisher_params: str) -> list[float]:
    """The reference: autograd weight gradients (``linear_grad="auto"``) on every batch in one process."""
    batches = fisher_batches(world)
    targets = TARGETS if fisher_params == "targets" else None
    result = fisher_scores(
        base_model(), batches, len(batches), fisher_params=fisher_params, target_modules=targets, progress=False
    )
    return result.scores


# --------------------------------------------------------------------------------------------------- FSDP2
def shard(model: torch.nn.Module, mesh) -> None:
    """fully_shard each decoder layer, then the root: what accelerate's FSDP2 auto-wrap does for a Llama."""
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_sharded(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model()
    optimizer = build_fora_optimizer(model, **optimizer_kwargs())  # before sharding, as accelerate builds it
    names = {id(p): n for n, p in model.named_parameters()}
    group_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    shard(model, mesh)
    sharded = dict(model.named_parameters())
    for group, param_names in zip(optimizer.param_groups, group_names):
        group["params"] = [sharded[n] for n in param_names]
    return model, optimizer


def train_fsdp(model, optimizer, scheduler, steps: range) -> list[float]:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in steps:
        batch = global_batches(world)[step]
        total = torch.zeros(())
        for micro in range(GAS):
            ids = micro_batch(batch, world, rank, micro)
            loss = model(input_ids=ids, labels=ids).loss / GAS  # FSDP2 averages the gradients over the ranks
            loss.backward()
            total += loss.detach() / world
        if step == NAN_STEP:
            if rank == 0:
                plant_nan(model)
        else:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def run_training(mesh, out: Path) -> tuple[dict, dict]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer = build_sharded(mesh)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses = train_fsdp(model, optimizer, scheduler, range(STEPS))
    nan_param = model.get_parameter(NAN_PARAM)
    state = optimizer.state[nan_param]
    train = {
        "lora": lora_tensors(model),
        "losses": losses,
        "skipped": optimizer.skipped_steps(),
        "nan_param_skipped": int(state["skipped_steps"]),
        "exp_avg_type": type(state["exp_avg"]).__name__,
        "local_rows": {
            n: p.to_local().shape[0] for n, p in model.named_parameters() if "lora_B" in n and hasattr(p, "to_local")
        },
        "stiefel_lrs": [g["lr"] for g in optimizer.param_groups if g.get("stiefel")],
    }

    # Stop at SAVE_AT, save the sharded state dicts, load them into a new sharded model and optimizer, finish.
    model, optimizer = build_sharded(mesh)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    first = train_fsdp(model, optimizer, scheduler, range(SAVE_AT))
    folder = out / "dcp"
    saved = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(saved, checkpoint_id=folder)
    scheduler_state = scheduler.state_dict()
    dist.barrier()
    model, optimizer = build_sharded(mesh)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    loaded = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(loaded, checkpoint_id=folder)
    set_model_state_dict(model, loaded["model"])
    set_optimizer_state_dict(model, optimizer, loaded["optim"])
    scheduler.load_state_dict(scheduler_state)
    rest = train_fsdp(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    resumed = {"lora": lora_tensors(model), "losses": first + rest, "skipped": optimizer.skipped_steps()}
    return train, resumed


class PeakLiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensor storages that ops create while it is active (CPU included).

    Storages alive before it starts (parameters, the sharded weights) are not counted: the peak is what the work
    inside adds. A storage is counted once, from its first op output until it is freed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                local = t.to_local() if hasattr(t, "to_local") else t
                self._count(local.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        size = storage.nbytes()
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.current -= size


def load_4bit(folder: Path) -> torch.nn.Module:
    """``folder``'s model in 4-bit NF4, packed into a bf16 storage (what FSDP2 shards), in train mode (an eval-mode
    forward would repack the weights for CPU inference)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")
    return model.train()


def fisher_4bit_single_process(folder: Path, world: int) -> list[float]:
    """The reference: the unsharded 4-bit model, scored through its Linear4bit inputs and output gradients."""
    batches = fisher_batches(world)
    return fisher_scores(load_4bit(folder), batches, len(batches), progress=False).scores


def run_fisher_4bit(mesh, out: Path) -> list[float] | str:
    """FSDP-QLoRA scoring: the 4-bit model sharded (its packed bf16 storage split by rows like any weight), each
    rank scoring its own batches by x/g."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        base_model().save_pretrained(out / "model")
    dist.barrier()
    model = load_4bit(out / "model")
    shard(model, mesh)
    batches = fisher_batches(world)[rank::world]
    try:
        return fisher_scores(model, batches, len(batches), linear_grad="activations", progress=False).scores
    except Exception as error:  # recorded, so that the test names what failed
        return f"{type(error).__name__}: {error}"


def run_fisher(mesh) -> dict:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    model = base_model()
    shard(model, mesh)
    batches = fisher_batches(world)[rank::world]  # this rank's share
    scores = {}
    for fisher_params in ("targets", "layer"):
        targets = TARGETS if fisher_params == "targets" else None
        try:
            result = fisher_scores(
                model,
                batches,
                len(batches),
                fisher_params=fisher_params,
                target_modules=targets,
                linear_grad="activations",
                progress=False,
            )
            scores[fisher_params] = result.scores
        except Exception as error:  # recorded, so that the test names what failed
            scores[fisher_params] = f"{type(error).__name__}: {error}"
    grads_left = [n for n, p in model.named_parameters() if p.grad is not None]

    memory = scoring_memory(mesh, rank) if world == 2 else {}  # checked once
    return {"scores": scores, "grads_left": grads_left, **memory}


def memory_model() -> LlamaForCausalLM:
    # Weights large next to the activations of one short sequence, so that weight gradients dominate a peak.
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def scoring_memory(mesh, rank: int) -> dict:
    """Peak bytes of x/g scoring on the sharded model against a backward that keeps every base-weight gradient."""
    model = memory_model()
    shard(model, mesh)
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids, "labels": ids}
    tracker = PeakLiveBytes()
    with tracker:
        fisher_scores(model, [batch], 1, linear_grad="activations", progress=False)
    scoring_peak = tracker.peak
    grads_after_scoring = [n for n, p in model.named_parameters() if p.grad is not None]
    model.requires_grad_(True)
    tracker = PeakLiveBytes()
    with tracker:
        model(**batch).loss.backward()
    keep_all_peak = tracker.peak
    layer_params = [p for n, p in model.named_parameters() if ".layers." in n]
    return {
        "scoring_peak": scoring_peak,
        "keep_all_peak": keep_all_peak,
        "grads_after_scoring": grads_after_scoring,
        # What the keep-all backward holds at its end on this rank: the local rows of every layer weight's gradient.
        "local_layer_grad_bytes": sum(p.to_local().numel() * p.element_size() for p in layer_params),
        "full_layer_weight_bytes": sum(p.numel() * p.element_size() for p in layer_params),
    }


def main(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    out = Path(out_dir)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    train, resumed = run_training(mesh, out)
    fisher = run_fisher(mesh)
    fisher["scores_4bit"] = run_fisher_4bit(mesh, out)
    check_same_selection([0, 2])  # the same on every rank: passes
    try:
        check_same_selection([0, 1 + dist.get_rank()])
        differing = None
    except ValueError as error:
        differing = str(error)
    result = {"train": train, "resumed": resumed, "fisher": fisher, "differing_selection": differing}
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
