"""FoRASFTTrainer through HF's own FSDP2 integration (accelerate's ``fully_shard``); run by tests/test_fsdp.py.

``torchrun --nproc_per_node 2 fsdp_trainer.py OUT_DIR`` trains 6 steps under FSDP2 with gradient accumulation 2,
saving a (sharded) checkpoint at step 3, then a second trainer resumes from that checkpoint to step 6 and saves the
adapter; then FSDP-QLoRA: the same tiny Llama loaded in 4-bit NF4 with ``bnb_4bit_quant_storage=bfloat16`` trains 6
steps. Each rank writes the whole lora_A/lora_B (gathered), what the optimizer held and the logs to
``OUT_DIR/<run>-rank<k>.pt``.

accelerate attaches its FSDP plugin only for GPU-like distributed types, never on a multi-CPU run (it then trains
with DDP, silently): :func:`force_fsdp2` sets the plugin by hand after the trainer is built, as accelerate would have
from ``fsdp="full_shard"`` and ``fsdp_config={"version": 2, ...}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import char_tokenizer, tiny_llama  # noqa: E402
from test_trainer import LAYERS, VOCAB, lora_config, sft_args, sums_dataset  # noqa: E402
from zero_trainer import load_4bit  # noqa: E402

from fora_plugin import FoRAConfig, FoRASFTTrainer  # noqa: E402


FSDP_CONFIG = {
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    "reshard_after_forward": True,
    "state_dict_type": "SHARDED_STATE_DICT",
}
STEPS, SAVE_AT = 6, 3


def force_fsdp2(trainer: FoRASFTTrainer) -> None:
    """What accelerate does for ``fsdp_config`` version 2 on GPUs; on a multi-CPU run it must be set by hand."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    if getattr(state, "fsdp_plugin", None) is None:
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def make_trainer(out: Path, model: torch.nn.Module | None = None, **overrides) -> FoRASFTTrainer:
    settings = dict(
        fsdp="full_shard",
        fsdp_config=dict(FSDP_CONFIG),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_AT,
        max_grad_norm=0.5,
    )
    args = sft_args(out, **{**settings, **overrides})
    trainer = FoRASFTTrainer(
        model if model is not None else tiny_llama(LAYERS, vocab_size=VOCAB),
        args,
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=lora_config(),
        fora_config=FoRAConfig(fisher_batches=2, lr_stiefel=5e-2),
    )
    force_fsdp2(trainer)
    return trainer


def snapshot(trainer: FoRASFTTrainer) -> dict:
    from torch.distributed.tensor import DTensor

    stiefel = [p for g in trainer.optimizer.param_groups if g.get("stiefel") for p in g["params"]]
    return {
        "lora": {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in trainer.model.named_parameters()
            if "lora_" in n
        },
        # The point on the manifold: the fp32 master of a bf16 lora_B (a DTensor like lora_B), else lora_B itself.
        "masters": [trainer.optimizer.state[p].get("master", p).full_tensor().float().clone() for p in stiefel],
        "stiefel_placements": sorted({str(getattr(p, "placements", None)) for p in stiefel}),
        "stiefel_count": len(stiefel),
        "exp_avg_types": sorted({type(trainer.optimizer.state[p]["exp_avg"]).__name__ for p in stiefel}),
        "chosen": trainer.fora_selection.chosen,
        "scores": trainer.fora_selection.scores.scores if trainer.fora_selection.scores else None,
        "logs": [log for log in trainer.state.log_history if "loss" in log],
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "global_step": trainer.state.global_step,
        "linear4bit": sum(type(m).__module__.startswith("bitsandbytes") for m in trainer.model.modules()),
        "base_placements": sorted(
            {str(getattr(p, "placements", None)) for n, p in trainer.model.named_parameters() if "lora_" not in n}
        ),
    }


def main(out_dir: str) -> None:
    out = Path(out_dir)
    full = make_trainer(out / "full")
    full.train()
    rank = dist.get_rank()
    torch.save(snapshot(full), out / f"full-rank{rank}.pt")
    checkpoint = out / "full" / "out" / f"checkpoint-{SAVE_AT}"
    resumed = make_trainer(out / "full")  # same output_dir: the checkpoint's selection is reused
    resumed.train(resume_from_checkpoint=str(checkpoint))
    # The adapter (FoRA's FSDP2Callback made the state dict type FULL at the end of training: plain PEFT LoRA). On a
    # multi-CPU run accelerate has set its distributed type back to MULTI_CPU by now: force FSDP2 again.
    force_fsdp2(resumed)
    resumed.save_model(str(out / "adapter"))
    torch.save(snapshot(resumed), out / f"resumed-rank{rank}.pt")

    if rank == 0:
        tiny_llama(LAYERS, vocab_size=VOCAB).save_pretrained(out / "model")
    dist.barrier()
    # A float storage: FSDP2 shards the 4-bit weights like any other.
    four_bit = load_4bit(out / "model", bnb_4bit_quant_storage=torch.bfloat16)
    qfora = make_trainer(out / "qfora", four_bit, save_strategy="no")
    qfora.train()
    torch.save(snapshot(qfora), out / f"qfora-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
