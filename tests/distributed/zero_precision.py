"""The LoRA parameters and optimizer states a real bf16 DeepSpeed ZeRO-2 engine keeps; run by tests/test_zero.py.

``torchrun --nproc_per_node 1 zero_precision.py OUT_DIR`` builds zero_engine's tiny Llama (LoRA r=4 on
``ADAPTED_LAYERS``, or on every layer for plain LoRA) for each mode and bf16 setting of ``VARIANTS``, takes one
optimizer step, and writes to ``OUT_DIR/precision.json``, per variant, the dtypes and bytes of the module's LoRA
parameters, of DeepSpeed's fp32 partitions, of the state its base optimizer keeps on them and of FoRA's Cayley-Adam
state (tensors of one element, the step counts, apart).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model


sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_engine  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import TARGETS, tiny_llama  # noqa: E402


# name -> (mode, bf16.enabled)
VARIANTS = {"fora": ("fora", True), "fg-lora": ("fg-lora", True), "lora": ("lora", True), "fora-fp32": ("fora", False)}
ZERO = {"stage": 2, "overlap_comm": False, "contiguous_gradients": True}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(states) -> dict[str, int]:
    """Bytes of the tensors of optimizer states: of more than one element, and of one (step counts and the like)."""
    tensors = [t for state in states for t in state.values() if isinstance(t, torch.Tensor)]
    return {
        "tensors": nbytes(t for t in tensors if t.numel() > 1),
        "scalars": nbytes(t for t in tensors if t.numel() == 1),
    }


def build(mode: str):
    from fora_plugin import build_fora_optimizer
    from fora_plugin.zero import build_zero_fora_optimizer

    if mode == "lora":  # the Trainer's AdamW over LoRA on every layer
        config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
        model = get_peft_model(tiny_llama(num_layers=4, seed=0), config).train()
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model = zero_engine.build_model()
    if mode == "fora":
        return model, build_zero_fora_optimizer(model, **zero_engine.optimizer_kwargs())
    return model, build_fora_optimizer(model, **zero_engine.optimizer_kwargs(), stiefel_params=())  # fg-lora


def capture(mode: str, bf16: bool) -> dict:
    model, optimizer = build(mode)
    engine, ids = zero_engine.probe_engine(model, optimizer, ZERO, bf16)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    lora = [p for n, p in engine.module.named_parameters() if "lora_" in n]
    zero = engine.optimizer
    stiefel = getattr(optimizer, "stiefel", None)
    return {
        "lora_dtypes": sorted({str(p.dtype) for p in lora}),
        "lora_numel": sum(p.numel() for p in lora),
        "lora_bytes": nbytes(lora),
        "base_dtypes": sorted({str(p.dtype) for n, p in engine.module.named_parameters() if "lora_" not in n}),
        "fp32_partitions": nbytes(zero.single_partition_of_fp32_groups),
        "partition_dtypes": sorted({str(t.dtype) for t in zero.single_partition_of_fp32_groups}),
        "base_optimizer": state_bytes(zero.optimizer.state.values()),
        "stiefel": state_bytes(stiefel.state.values()) if stiefel is not None else None,
        "stiefel_numel": sum(p.numel() for p in optimizer.stiefel_parameters) if stiefel is not None else 0,
    }


def main(out_dir: str) -> None:
    import torch.distributed as dist

    results = {name: capture(mode, bf16) for name, (mode, bf16) in VARIANTS.items()}
    Path(out_dir, "precision.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
