"""The backward stop under DeepSpeed ZeRO-3 through FoRASFTTrainer; run by tests/test_backward.py.

``torchrun --nproc_per_node 2 backward_zero3.py OUT_DIR``: the tiny Llama saved in ``OUT_DIR/model``, partitioned by
``zero.Init``, gets LoRA on layers 2 and 3 and trains one step with activation checkpointing (reentrant, which TRL
means to force for PEFT + ZeRO-3, and transformers' default). Twice each: with FoRA's backward stop, and without it
(the stop removed before ``train()``, so ``Trainer.train``'s embeddings hook stays: the behaviour before). Each rank
records the gradient its backward computed for every LoRA parameter (a tensor hook: the whole gradient of its own
micro-batch, before DeepSpeed reduces and partitions it) and the backward and forward calls of the modules below layer
2, in ``OUT_DIR/rank<k>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import char_tokenizer  # noqa: E402
from test_backward import ADAPTED, BelowCounter  # noqa: E402
from test_trainer import lora_config, sft_args, sums_dataset  # noqa: E402
from zero3_trainer import DEEPSPEED  # noqa: E402

from fora_plugin import FoRAConfig, FoRASFTTrainer  # noqa: E402
from fora_plugin.backward import BackwardStopCallback, checkpointing_settings, is_reentrant  # noqa: E402


# TRL 1.16 forces use_reentrant=True for PEFT + ZeRO-3 into gradient_checkpointing_kwargs, but when no kwargs were
# given it sets a new dict on that deprecated alias only, and transformers 5.23's Trainer.train reads
# activation_checkpointing_kwargs (None: non-reentrant). Both are run: reentrant given explicitly, and the default.
VARIANTS = {"reentrant": {"use_reentrant": True}, "default": None}


def make_trainer(out: Path, model_dir: Path, checkpointing_kwargs: dict | None) -> FoRASFTTrainer:
    from transformers import AutoModelForCausalLM

    args = sft_args(
        out,
        deepspeed=dict(DEEPSPEED),
        per_device_train_batch_size=2,
        max_steps=1,
        train_sampling_strategy="sequential",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs=checkpointing_kwargs,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # after the SFTConfig: zero.Init partitions it
    return FoRASFTTrainer(
        model,
        args,
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=lora_config(),
        fora_config=FoRAConfig(layers=ADAPTED, init_a="gaussian"),
    )


def one_step(trainer: FoRASFTTrainer) -> dict:
    grads: dict[str, torch.Tensor] = {}
    for name, param in trainer.model.named_parameters():
        if "lora_" in name:
            param.register_hook(lambda g, name=name: grads.setdefault(name, g.detach().float().clone()))
    counter = BelowCounter(trainer.model, ADAPTED[0])
    trainer.train()
    return {"grads": grads, "backward_below": counter.backward, "mlp_forwards": counter.mlp_forwards}


def main(out_dir: str) -> None:
    import deepspeed

    out = Path(out_dir)
    model_dir = out / "model"  # the tiny Llama, saved by the test before the launch
    deepspeed.init_distributed()
    results = {}
    for variant, checkpointing_kwargs in VARIANTS.items():
        with_stop = make_trainer(out / variant / "with", model_dir, checkpointing_kwargs)
        _, kwargs = checkpointing_settings(with_stop.args, with_stop.model)
        result = {"reentrant": is_reentrant(kwargs), "stop_index": with_stop.fora_backward_stop.index}
        result["with"] = one_step(with_stop)
        without = make_trainer(out / variant / "without", model_dir, checkpointing_kwargs)
        without.fora_backward_stop.remove()
        without.remove_callback(BackwardStopCallback)
        result["without"] = one_step(without)
        results[variant] = result
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
