"""FoRASFTTrainer through HF's own DeepSpeed integration (``deepspeed=`` in the SFTConfig); run by tests/test_zero.py.

``torchrun --nproc_per_node 2 zero_trainer.py OUT_DIR`` trains 6 steps under ZeRO-2 with gradient accumulation 2,
saving a checkpoint at step 3, then a second trainer resumes from that checkpoint to step 6; then QFoRA (the same
tiny Llama loaded in 4-bit NF4) trains 6 steps under ZeRO-2. Each rank writes its lora_A/lora_B, the fp32 masters
and what the engine was given to ``OUT_DIR/<run>-rank<k>.pt``.

On a CPU-only host ``use_cpu=True`` (in ``sft_args``) makes accelerate count the torchrun ranks (without it, it sees
one process while the process group has two); bf16 is refused on a CPU, so this runs in fp32.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import char_tokenizer, tiny_llama  # noqa: E402
from test_trainer import LAYERS, VOCAB, lora_config, sft_args, sums_dataset  # noqa: E402

from fora_plugin import FoRAConfig, FoRASFTTrainer  # noqa: E402
from fora_plugin.checkpoints import STIEFEL_STATE_FILE  # noqa: E402


DEEPSPEED = {
    "zero_optimization": {"stage": 2},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
STEPS, SAVE_AT = 6, 3


def deepspeed_args(out: Path, deepspeed: dict):
    """The SFTConfig of these runs: STEPS steps of 2 x 2 micro-batches, a checkpoint at SAVE_AT, clipping at 0.5."""
    return sft_args(
        out,
        deepspeed=dict(deepspeed),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_AT,
        max_grad_norm=0.5,
    )


def make_trainer(out: Path, model: torch.nn.Module | None = None) -> FoRASFTTrainer:
    args = deepspeed_args(out, DEEPSPEED)
    return FoRASFTTrainer(
        model if model is not None else tiny_llama(LAYERS, vocab_size=VOCAB),
        args,
        train_dataset=sums_dataset(),
        processing_class=char_tokenizer(),
        peft_config=lora_config(),
        fora_config=FoRAConfig(fisher_batches=2, lr_stiefel=5e-2),
    )


def snapshot(trainer: FoRASFTTrainer) -> dict:
    engine = trainer.model_wrapped
    client = engine.optimizer.optimizer
    return {
        "lora": {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if "lora_" in n},
        "masters": [
            client.stiefel.state[p].get("master", p).detach().float().clone() for p in client.stiefel_parameters
        ],
        "chosen": trainer.fora_selection.chosen,
        "engine_gradient_clipping": engine.optimizer.clip_grad,
        "client": type(client).__name__,
        "client_max_grad_norm": client.max_grad_norm,
        "client_steps": client.steps,
        "client_last_grad_norm": client.last_grad_norm,
        "logs": [log for log in trainer.state.log_history if "loss" in log],
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "linear4bit": sum(type(m).__module__.startswith("bitsandbytes") for m in trainer.model.modules()),
    }


def load_4bit(folder: Path, **quantization_kwargs) -> torch.nn.Module:
    """The tiny Llama in NF4 with double quantisation on the CPU; ``quantization_kwargs`` go to BitsAndBytesConfig."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,  # bf16 is refused on a CPU
        **quantization_kwargs,
    )
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, device_map="cpu")


def main(out_dir: str) -> None:
    out = Path(out_dir)
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    full = make_trainer(out / "full")
    full.train()
    torch.save(snapshot(full), out / f"full-rank{rank}.pt")
    checkpoint = out / "full" / "out" / f"checkpoint-{SAVE_AT}"
    if rank == 0:
        torch.save({"has_stiefel_state": (checkpoint / STIEFEL_STATE_FILE).is_file()}, out / "checkpoint.pt")
    resumed = make_trainer(out / "full")  # same output_dir: the checkpoint's selection is reused
    resumed.train(resume_from_checkpoint=str(checkpoint))
    torch.save(snapshot(resumed), out / f"resumed-rank{rank}.pt")

    if rank == 0:
        tiny_llama(LAYERS, vocab_size=VOCAB).save_pretrained(out / "model")
    dist.barrier()
    qfora = make_trainer(out / "qfora", load_4bit(out / "model"))
    qfora.train()
    torch.save(snapshot(qfora), out / f"qfora-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
