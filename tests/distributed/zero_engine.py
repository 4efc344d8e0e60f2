"""FoRA under DeepSpeed ZeRO-1/2, driving the engine directly on a tiny Llama; run by tests/test_zero.py.

``torchrun --nproc_per_node 2 zero_engine.py OUT_DIR`` trains the same model under each DeepSpeed setting of
``VARIANTS`` and writes every rank's final lora_A/lora_B and per-step losses to ``OUT_DIR/<variant>-rank<k>.pt``.
Each rank takes its own micro-batches of every global batch (the data split DeepSpeed's data parallelism is for),
so the result can be compared with :func:`train_single_process` on the same global batches.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Container
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import TARGETS, tiny_llama  # noqa: E402

from fora_plugin import make_stiefel  # noqa: E402


WORLD, MICRO, GAS, STEPS = 2, 2, 2, 10
# MAX_GRAD_NORM is below the gradient norms this run sees, so every step is clipped.
LR, LR_STIEFEL, MAX_GRAD_NORM, WEIGHT_DECAY = 5e-2, 1e-1, 0.2, 0.01
ADAPTED_LAYERS = [1, 3]
SEQ_LEN = 12
# sync_period > STEPS: replicas must agree without the periodic broadcast hiding a difference.
SYNC_PERIOD = 100

VARIANTS = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "zero2_bf16": {"stage": 2},
}


def build_model() -> torch.nn.Module:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, layers_to_transform=ADAPTED_LAYERS)
    config.lora_dropout = 0.0
    model = get_peft_model(tiny_llama(num_layers=4, seed=0), config)
    make_stiefel(model, init_a="gaussian", generator=torch.Generator().manual_seed(0))
    return model.train()


def global_batches() -> torch.Tensor:
    """(STEPS, WORLD * GAS * MICRO, SEQ_LEN) token ids: sequences that count up from a random start, learnable."""
    gen = torch.Generator().manual_seed(1)
    starts = torch.randint(0, 80, (STEPS, WORLD * GAS * MICRO, 1), generator=gen)
    return (starts + torch.arange(SEQ_LEN)) % 96


def micro_batch(batch: torch.Tensor, rank: int, micro: int) -> torch.Tensor:
    start = (micro * WORLD + rank) * MICRO
    return batch[start : start + MICRO]


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 3)  # warmup: the Stiefel lr must follow it too


def optimizer_kwargs() -> dict:
    return dict(lr=LR, lr_stiefel=LR_STIEFEL, weight_decay=WEIGHT_DECAY, qr_period=4)


def lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if "lora_" in n}


def train_single_process(
    build: Callable[[], torch.nn.Module] | None = None, skip_steps: Container[int] = (), **extra_kwargs
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference: one process, the whole global batch per step, FoRA's ordinary optimizer and HF's clipping.

    ``build`` makes the model (default :func:`build_model`); the steps in ``skip_steps`` are computed and dropped
    (no optimizer or LR-schedule step), as DeepSpeed does with a step whose gradient norm is not finite.
    ``extra_kwargs`` go to the optimizer with :func:`optimizer_kwargs` (e.g. ``fused=True`` for AdamW).
    """
    from fora_plugin import build_fora_optimizer

    model = (build or build_model)()
    optimizer = build_fora_optimizer(model, **optimizer_kwargs(), **extra_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses = []
    for step, batch in enumerate(global_batches()):
        total = 0.0
        for micro in range(GAS):
            for rank in range(WORLD):
                ids = micro_batch(batch, rank, micro)
                loss = model(input_ids=ids, labels=ids).loss / (GAS * WORLD)
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        if step not in skip_steps:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad()
        losses.append(total)
    return lora_tensors(model), losses


def probe_engine(model: torch.nn.Module, optimizer, zero: dict, bf16: bool):
    """A DeepSpeed engine over ``model`` and ``optimizer`` (a FoRA ZeRO client is bound to it) taking one micro-batch
    a step, for reading what the engine allocates; returns it and the first micro-batch."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if hasattr(optimizer, "bind"):
        optimizer.bind(engine.optimizer)
    return engine, global_batches()[0, :MICRO]


def train_deepspeed(zero: dict, bf16: bool = False) -> dict:
    import deepspeed
    import torch.distributed as dist

    from fora_plugin.zero import build_zero_fora_optimizer

    model = build_model()
    optimizer = build_zero_fora_optimizer(
        model, **optimizer_kwargs(), max_grad_norm=MAX_GRAD_NORM, sync_period=SYNC_PERIOD
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    config = {
        "train_batch_size": WORLD * GAS * MICRO,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        # As HF fills it from max_grad_norm: bind() must turn this (lora_A by its own norm) off, since
        # ZeroFoRAOptimizer clips lora_A and lora_B by one norm; a match with the single process shows it did.
        "gradient_clipping": MAX_GRAD_NORM,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": bf16},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    optimizer.bind(engine.optimizer)
    rank = dist.get_rank()
    losses, grad_norms = [], []
    for batch in global_batches():
        total = torch.zeros(())
        for micro in range(GAS):
            ids = micro_batch(batch, rank, micro)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / (GAS * WORLD)
        dist.all_reduce(total)
        losses.append(total.item())
        grad_norms.append(optimizer.last_grad_norm)
    module = engine.module
    return {
        "lora": lora_tensors(module),
        # The point on the manifold: the fp32 master of a bf16 lora_B, else lora_B itself.
        "masters": [
            optimizer.stiefel.state[p].get("master", p).detach().float().clone() for p in optimizer.stiefel_parameters
        ],
        "dtype": str(optimizer.stiefel_parameters[0].dtype),
        "losses": losses,
        "grad_norms": grad_norms,
        "stiefel_lrs": [g["lr"] for g in optimizer.stiefel.param_groups],
        "partitioned": sum(p.numel() for g in engine.optimizer.bit16_groups for p in g),
        "stiefel_numel": sum(p.numel() for p in optimizer.stiefel_parameters),
    }


def main(out_dir: str) -> None:
    import torch.distributed as dist

    out = Path(out_dir)
    for name, zero in VARIANTS.items():
        result = train_deepspeed(zero, bf16=name.endswith("bf16"))
        torch.save(result, out / f"{name}-rank{dist.get_rank()}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
