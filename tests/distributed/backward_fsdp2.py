"""The backward stop under FSDP2 (accelerate's ``fully_shard``) through FoRASFTTrainer; run by tests/test_backward.py.

``torchrun --nproc_per_node 2 backward_fsdp2.py OUT_DIR``: the tiny Llama with LoRA on layers 2 and 3 trains one step
with activation checkpointing (non-reentrant, transformers' default) under FSDP2, with FoRA's backward stop and
without it (the stop removed before ``train()``: the behaviour before). Each rank records the LoRA gradients the step
reduced (the data-parallel mean, gathered whole) and the backward and forward calls of the modules below layer 2, in
``OUT_DIR/rank<k>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import char_tokenizer, tiny_llama  # noqa: E402
from fsdp_trainer import FSDP_CONFIG, force_fsdp2  # noqa: E402
from test_backward import ADAPTED, BelowCounter  # noqa: E402
from test_trainer import LAYERS, VOCAB, lora_config, sft_args, sums_dataset  # noqa: E402

from fora_plugin import FoRAConfig, FoRASFTTrainer  # noqa: E402
from fora_plugin.backward import BackwardStopCallback  # noqa: E402


class ReducedGrads(TrainerCallback):
    """The first step's reduced LoRA gradients, gathered whole (a collective: every rank takes part)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        if self.grads:
            return
        for name, param in model.named_parameters():
            if "lora_" in name and param.grad is not None:
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                self.grads[name] = grad.detach().float().clone()


def one_step(out: Path, stop: bool) -> dict:
    args = sft_args(
        out,
        fsdp="full_shard",
        fsdp_config=dict(FSDP_CONFIG),
        per_device_train_batch_size=2,
        max_steps=1,
        train_sampling_strategy="sequential",
        max_grad_norm=0.0,  # the gradients as the backward left them
        gradient_checkpointing=True,
    )
    trainer = FoRASFTTrainer(
        tiny_llama(LAYERS, vocab_size=VOCAB),
        args,
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=lora_config(),
        fora_config=FoRAConfig(layers=ADAPTED, init_a="gaussian"),
    )
    force_fsdp2(trainer)
    if not stop:
        trainer.fora_backward_stop.remove()
        trainer.remove_callback(BackwardStopCallback)
    counter = BelowCounter(trainer.model, ADAPTED[0])
    grads = ReducedGrads()
    trainer.add_callback(grads)
    trainer.train()
    return {
        "grads": grads.grads,
        "backward_below": counter.backward,
        "mlp_forwards": counter.mlp_forwards,
        "sharded": all(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),  # fully_shard sharded it
    }


def main(out_dir: str) -> None:
    out = Path(out_dir)
    results = {"with": one_step(out / "with", stop=True), "without": one_step(out / "without", stop=False)}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
