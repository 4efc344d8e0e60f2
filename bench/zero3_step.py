"""Per-step cost of FoRA's Stiefel step under DeepSpeed ZeRO-3 (gathered) and ZeRO-2 (replicated), side by side.

The same PEFT Llama (LoRA on every layer, Stiefel lora_B) trains under ZeRO-2 with
:class:`~fora_plugin.zero.ZeroFoRAOptimizer` (lora_B replicated beside the partition, its gradient all-reduced) and
under ZeRO-3 with :class:`~fora_plugin.zero.Zero3FoRAOptimizer` (lora_B in DeepSpeed's partition, gathered whole
with its gradient, stepped, its slice written back). Printed per optimizer step: the time of the Stiefel part
(communication + Cayley-Adam step), of the whole DeepSpeed optimizer step and of a whole training step, and the
bytes each rank receives for lora_B in FoRA's own collective.

    torchrun --nproc_per_node 2 bench/zero3_step.py                    # DS_ACCELERATOR=cpu on a CPU host
    torchrun --nproc_per_node 8 bench/zero3_step.py --hidden 4096 --intermediate 14336 --layers 4 --rank 32
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time

import deepspeed
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from fora_plugin import make_stiefel
from fora_plugin.zero import (
    Zero3FoRAOptimizer,
    ZeroFoRAOptimizer,
    build_zero3_fora_optimizer,
    build_zero_fora_optimizer,
)


TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
    )
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=args.rank, target_modules=TARGETS))
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    return model


def timed(method, record: list[float]):
    @functools.wraps(method)
    def wrapper(*a, **kw):
        started = time.perf_counter()
        result = method(*a, **kw)
        record.append(time.perf_counter() - started)
        return result

    return wrapper


def run(stage: int, args: argparse.Namespace) -> dict[str, float]:
    model = build_model(args)
    kwargs = dict(lr=1e-4, lr_stiefel=1e-3, max_grad_norm=1.0)
    if stage == 3:
        optimizer = build_zero3_fora_optimizer(model, **kwargs)
    else:
        optimizer = build_zero_fora_optimizer(model, **kwargs)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": args.bf16},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    optimizer.bind(engine.optimizer)
    stiefel, engine_step, total = [], [], []
    optimizer.step_stiefel = timed(optimizer.step_stiefel, stiefel)
    engine.optimizer.step = timed(engine.optimizer.step, engine_step)
    gen = torch.Generator().manual_seed(dist.get_rank())
    bytes_before = 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            stiefel.clear(), engine_step.clear(), total.clear()
            bytes_before = getattr(optimizer, "bytes_gathered", 0)
        ids = torch.randint(0, 512, (args.batch, args.seq), generator=gen)
        started = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total.append(time.perf_counter() - started)
    numel = sum(p.numel() for p in optimizer.stiefel_parameters)
    world = dist.get_world_size()
    if isinstance(optimizer, Zero3FoRAOptimizer):
        received = (optimizer.bytes_gathered - bytes_before) / args.steps  # all-gather of fp32 B and its gradient
    else:
        assert isinstance(optimizer, ZeroFoRAOptimizer)
        received = 2 * (world - 1) / world * (numel + len(optimizer.stiefel_parameters)) * 4  # ring all-reduce
    # Per call of the client: ZeRO-2 steps lora_B once per optimizer step; ZeRO-3 once per sub-group (one here).
    return {
        "stiefel_ms": 1e3 * sum(stiefel) / args.steps,
        "optimizer_ms": 1e3 * statistics.median(engine_step),
        "step_ms": 1e3 * statistics.median(total),
        "received_kb": received / 1024,
        "lora_b_kb": numel * 4 / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    deepspeed.init_distributed()
    results = {stage: run(stage, args) for stage in (2, 3)}
    if dist.get_rank() == 0:
        print(
            f"\n{dist.get_world_size()} ranks, {platform.machine()}, torch {torch.__version__}, "
            f"deepspeed {deepspeed.__version__}; Llama hidden {args.hidden}, intermediate {args.intermediate}, "
            f"{args.layers} layers, r={args.rank}, LoRA on {TARGETS}, batch {args.batch}x{args.seq}, "
            f"{'bf16' if args.bf16 else 'fp32'}; medians over {args.steps} steps"
        )
        print("| | Stiefel part ms | DeepSpeed optimizer step ms | training step ms | lora_B fp32 KB | received KB |")
        print("|---|---:|---:|---:|---:|---:|")
        names = {2: "ZeRO-2 (replicated, all-reduce)", 3: "ZeRO-3 (gathered, all-gather)"}
        for stage, r in results.items():
            print(
                f"| {names[stage]} | {r['stiefel_ms']:.2f} | {r['optimizer_ms']:.2f} | {r['step_ms']:.1f} "
                f"| {r['lora_b_kb']:.0f} | {r['received_kb']:.0f} |"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
