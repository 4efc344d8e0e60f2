"""FoRA under DeepSpeed ZeRO-3, driving the engine directly on a tiny Llama; run by tests/test_zero.py.

``torchrun --nproc_per_node 2 zero3_engine.py OUT_DIR`` writes to ``OUT_DIR/<run>-rank<k>.pt``:

- ``zero3`` / ``zero3_bf16``: training with :class:`~fora_plugin.zero.Zero3FoRAOptimizer` on the global batches
  of ``zero_engine`` (each rank its own micro-batches, gradient accumulation 2, every step clipped), rank 1's loss
  made NaN in one micro-batch of step ``NAN_STEP``; the full lora_A/lora_B, the Cayley state and what the
  partition looked like. fp32 is compared with ``zero_engine.train_single_process`` skipping that step.
- ``zero3_moe``: the same on a tiny Qwen3-MoE whose fused experts carry LoRA (``target_parameters``, 4 experts,
  r·E > d_out), AdamW fused; with each Cayley group's step count and number of expert blocks, and the host syncs
  of every client step (DeepSpeed calls the client once per sub-group).
- ``scores``: Fisher scores of a base model partitioned by ``zero.Init``, each rank scoring its own batches inside
  :func:`~fora_plugin.zero.zero3_scoring_engine`, compared with a single-process run on all the batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_engine  # noqa: E402
from conftest import EXPERT_PARAMETERS, TARGETS, tiny_llama, tiny_moe  # noqa: E402
from zero_engine import GAS, MAX_GRAD_NORM, MICRO, WORLD, global_batches, micro_batch  # noqa: E402

from fora_plugin import make_stiefel  # noqa: E402


# up_proj's lora_B is (45, 3): 135 elements, split 68 / 67 (+1 padding) over two ranks, not on a row boundary.
INTERMEDIATE, RANK = 45, 3
UNEVEN = "up_proj"
NAN_STEP = 4
VARIANTS = ("zero3", "zero3_bf16", "zero3_moe")
# The MoE's expert lora_B are (32, r·E) = (32, 48): more columns than rows, each expert's (32, 12) block a Stiefel
# matrix of its own. Its AdamW is fused: the non-fused one reads its step counts (CPU tensors even on a GPU) to
# the host, which the sync count would take for syncs.
MOE_RANK, MOE_LAYERS, MOE_EXPERTS = 12, [1, 3], 4
MOE_OPTIMIZER = {"fused": True}
SCORE_BATCHES, SCORE_SEQ = 6, 10
# Whole decoder layers (the paper's definition): linears from their inputs and output gradients, norm weights by a
# local replay of the module with its own parameters gathered.
SCORE_SCOPE: dict = {}


def build_model() -> torch.nn.Module:
    config = LoraConfig(
        r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, layers_to_transform=zero_engine.ADAPTED_LAYERS
    )
    config.lora_dropout = 0.0
    model = get_peft_model(tiny_llama(num_layers=4, seed=0, intermediate_size=INTERMEDIATE), config)
    make_stiefel(model, init_a="gaussian", generator=torch.Generator().manual_seed(0))
    return model.train()


def build_moe_model() -> torch.nn.Module:
    """FoRA's adapter on layers MOE_LAYERS of a tiny Qwen3-MoE, as FoRASFTTrainer builds it."""
    from fora_plugin import FoRAConfig
    from fora_plugin.selection import FoRASelection
    from fora_plugin.wiring import init_fora_adapters, restrict_lora_config

    base = tiny_moe(num_experts=MOE_EXPERTS)
    config = LoraConfig(
        r=MOE_RANK,
        lora_alpha=2 * MOE_RANK,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        target_parameters=list(EXPERT_PARAMETERS),
    )
    selection = FoRASelection(MOE_LAYERS, base.config.num_hidden_layers, "model.layers")
    restrict_lora_config(config, base, selection)
    model = get_peft_model(base, config)
    init_fora_adapters(model, selection, FoRAConfig(layers=MOE_LAYERS, init_a="gaussian"), 0)
    return model.train()


def deepspeed_config(bf16: bool = False) -> dict:
    return {
        "train_batch_size": WORLD * GAS * MICRO,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        # Under ZeRO-3 DeepSpeed's clipping is the one: a norm over every group it holds, lora_B included.
        "gradient_clipping": MAX_GRAD_NORM,
        # Persistence threshold 0: every weight, lora_B included, is released after its forward and backward.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
    }


def full_lora(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole fp32 lora_A/lora_B from DeepSpeed's fp32 partitions (the same on every rank)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def counting_host_syncs(optimizer: torch.optim.Optimizer) -> list[int]:
    """Count the host syncs of every call of ``optimizer.step`` (DeepSpeed calls it once per sub-group)."""
    from host_sync import HostSyncCounter

    counts = []
    step = optimizer.step

    def counted(*args, **kwargs):
        with HostSyncCounter() as syncs:
            result = step(*args, **kwargs)
        counts.append(syncs.count)
        return result

    optimizer.step = counted
    return counts


def train_deepspeed(bf16: bool, moe: bool = False) -> dict:
    import deepspeed
    import torch.distributed as dist

    from fora_plugin.zero import build_zero3_fora_optimizer

    model = build_moe_model() if moe else build_model()
    extra = MOE_OPTIMIZER if moe else {}
    optimizer = build_zero3_fora_optimizer(
        model, **zero_engine.optimizer_kwargs(), **extra, max_grad_norm=MAX_GRAD_NORM
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, zero_engine.schedule)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(bf16)
    )
    optimizer.bind(engine.optimizer)
    host_syncs = counting_host_syncs(optimizer) if moe else []
    rank = dist.get_rank()
    losses, grad_norms, applied = [], [], []
    for step, batch in enumerate(global_batches()):
        total = torch.zeros(())
        for micro in range(GAS):
            ids = micro_batch(batch, rank, micro)
            loss = engine(input_ids=ids, labels=ids).loss
            if step == NAN_STEP and micro == 0 and rank == 1:
                loss = loss * float("nan")  # one rank's gradients become NaN: both ranks must skip the step
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / (GAS * WORLD)
        dist.all_reduce(total)
        losses.append(total.item())
        grad_norms.append(optimizer.last_grad_norm)  # DeepSpeed's, over every group
        applied.append(engine.was_step_applied())
    uneven = next((p for n, p in engine.module.named_parameters() if f"{UNEVEN}.lora_B" in n), None)
    if uneven is None:  # the MoE: its expert lora_B instead
        uneven = next(p for n, p in engine.module.named_parameters() if "experts.lora_B" in n)
    return {
        "lora": full_lora(engine.module),
        "full_b": [b.clone() for b in optimizer.stiefel_parameters],
        "exp_avg": [optimizer.stiefel.state[b]["exp_avg"].clone() for b in optimizer.stiefel_parameters],
        "module_dtype": str(uneven.dtype),
        "uneven": {"numel": uneven.ds_numel, "partition": uneven.ds_tensor.numel(), "shape": tuple(uneven.ds_shape)},
        "losses": losses,
        "grad_norms": grad_norms,
        "applied": applied,
        "client_steps": optimizer.steps,
        "bytes_gathered": optimizer.bytes_gathered,
        "stiefel_numel": sum(b.numel() for b in optimizer.stiefel_parameters),
        "cayley_steps": [group["steps"] for group in optimizer.stiefel.param_groups],
        "num_experts": [group["num_experts"] for group in optimizer.stiefel.param_groups],
        "qr_period": [group["qr_period"] for group in optimizer.stiefel.param_groups],
        "host_syncs": host_syncs,
    }


def score_batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 96, (SCORE_BATCHES, 2, SCORE_SEQ), generator=gen)
    return [{"input_ids": x, "labels": x} for x in ids]


def score_single_process() -> list[float]:
    """The reference: every batch in one process, weight gradients by autograd (the default path)."""
    from fora_plugin import fisher_scores

    model = tiny_llama(num_layers=4, seed=0)
    return fisher_scores(model, score_batches(), SCORE_BATCHES, **SCORE_SCOPE, progress=False).scores


def score_zero3() -> dict:
    import deepspeed
    import torch.distributed as dist

    from fora_plugin import fisher_scores
    from fora_plugin.zero import gathered_parameters, zero3_scoring_engine

    deepspeed.init_distributed()
    config = deepspeed_config()
    model = tiny_llama(num_layers=4, seed=0)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)  # partitions the weights in place, as HF does
    # The decoder layers' linear weights: partitioned, and never to require a gradient while scored.
    weights = {n: p for n, p in model.named_parameters() if ".layers." in n and len(p.ds_shape) == 2}
    partitioned = all(p.numel() == 0 for p in weights.values())
    rank, world = dist.get_rank(), dist.get_world_size()
    grad_enabled = []

    def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        grad_enabled.extend(n for n, p in weights.items() if p.requires_grad)
        return model(**batch).loss

    with zero3_scoring_engine(model, config):
        scores = fisher_scores(
            model,
            score_batches()[rank::world],
            SCORE_BATCHES // world,
            loss_fn=loss_fn,
            **SCORE_SCOPE,
            linear_grad="activations",
            gather=gathered_parameters,
            progress=False,
        )
    return {
        "scores": scores.scores,
        "num_batches": scores.num_batches,
        "partitioned": partitioned,
        "weights_requiring_grad": grad_enabled,
        "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
    }


def main(out_dir: str) -> None:
    import torch.distributed as dist

    out = Path(out_dir)
    rank = None
    for name in VARIANTS:
        result = train_deepspeed(bf16=name.endswith("bf16"), moe=name.endswith("moe"))
        rank = dist.get_rank()
        torch.save(result, out / f"{name}-rank{rank}.pt")
        dist.barrier()
    torch.save(score_zero3(), out / f"scores-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
