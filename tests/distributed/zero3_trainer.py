"""FoRASFTTrainer through HF's own DeepSpeed integration under ZeRO-3; run by tests/test_zero.py.

``torchrun --nproc_per_node 2 zero3_trainer.py OUT_DIR``: the tiny Llama is loaded with ``from_pretrained`` after the
SFTConfig exists, so ``zero.Init`` partitions its weights as it would a real model's; FoRA scores it inside
:func:`~fora_plugin.zero.zero3_scoring_engine`, chooses the layers, trains 6 steps (gradient accumulation 2) with
:class:`~fora_plugin.zero.Zero3FoRAOptimizer` and saves a checkpoint at step 3 and the adapter at the end; a second
trainer resumes from the checkpoint to step 6. Each rank writes its results to ``OUT_DIR/<run>-rank<k>.pt``.

On a CPU-only host ``use_cpu=True`` makes accelerate count the torchrun ranks; bf16 is refused on a CPU, so this
runs in fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import char_tokenizer, tiny_llama  # noqa: E402
from test_trainer import LAYERS, VOCAB, lora_config, sums_dataset  # noqa: E402
from zero_trainer import SAVE_AT, deepspeed_args  # noqa: E402

from fora_plugin import FoRAConfig, FoRASFTTrainer  # noqa: E402


DEEPSPEED = {
    # Persistence threshold 0: no weight of the tiny model stays gathered between forwards (scoring included).
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
# Whole decoder layers: linears from their inputs and output gradients, norms by a local replay of the module.
FORA = dict(fisher_batches=2, lr_stiefel=5e-2)


def make_trainer(out: Path, model_dir: Path) -> FoRASFTTrainer:
    from transformers import AutoModelForCausalLM

    args = deepspeed_args(out, DEEPSPEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # after the SFTConfig: zero.Init partitions it
    layers = [p for n, p in model.named_parameters() if ".layers." in n]
    assert layers and all(p.numel() == 0 for p in layers), "from_pretrained did not partition the model"
    return FoRASFTTrainer(
        model,
        args,
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=lora_config(),
        fora_config=FoRAConfig(**FORA),
    )


def snapshot(trainer: FoRASFTTrainer, partitioned: bool) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    engine = trainer.model_wrapped
    client = engine.optimizer.optimizer
    return {
        "partitioned_at_load": partitioned,
        "lora": {
            n: safe_get_full_fp32_param(p).detach().clone()
            for n, p in trainer.model.named_parameters()
            if "lora_" in n
        },
        "full_b": [b.clone() for b in client.stiefel_parameters],
        "chosen": trainer.fora_selection.chosen,
        "scores": trainer.fora_selection.scores.scores if trainer.fora_selection.scores else None,
        "engine_gradient_clipping": engine.optimizer.clip_grad,
        "client": type(client).__name__,
        "client_steps": client.steps,
        "logs": [log for log in trainer.state.log_history if "loss" in log],
    }


def main(out_dir: str) -> None:
    out = Path(out_dir)
    model_dir = out / "model"
    import deepspeed

    deepspeed.init_distributed()
    rank = dist.get_rank()
    if rank == 0:
        tiny_llama(LAYERS, vocab_size=VOCAB).save_pretrained(model_dir)
    dist.barrier()
    full = make_trainer(out / "full", model_dir)
    # The base stays partitioned through scoring (the scoring engine released what it gathered).
    partitioned = all(p.numel() == 0 for n, p in full.model.named_parameters() if "base_layer" in n)
    full.train()
    full.save_model()  # the adapter: under ZeRO-3 HF gathers the 16-bit weights for it
    torch.save(snapshot(full, partitioned), out / f"full-rank{rank}.pt")
    checkpoint = out / "full" / "out" / f"checkpoint-{SAVE_AT}"
    resumed = make_trainer(out / "full", model_dir)  # same output_dir: the checkpoint's selection is reused
    resumed.train(resume_from_checkpoint=str(checkpoint))
    torch.save(snapshot(resumed, True), out / f"resumed-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
