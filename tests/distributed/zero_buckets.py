"""DeepSpeed ZeRO-1/2's gradient reduction buffers as a real engine allocates them; run by tests/test_zero.py.

``torchrun --nproc_per_node 1 zero_buckets.py OUT_DIR`` builds zero_engine's tiny Llama under each DeepSpeed setting
of ``VARIANTS``, runs one forward and backward, and writes to ``OUT_DIR/buckets.json``, per variant, the bytes of
every buffer in ``engine.optimizer.ipg_buckets`` read in the middle of the backward (a gradient hook on the output of
the lowest adapted layer, after the layers above it were back-propagated) and after it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_engine  # noqa: E402


# name -> (zero_optimization block, bf16): bucket sizes well above the tiny model's LoRA elements, as at full scale.
VARIANTS = {
    "zero2-overlap": ({"stage": 2, "overlap_comm": True, "reduce_bucket_size": 30000}, False),
    "zero2-no-overlap-bf16": ({"stage": 2, "overlap_comm": False, "reduce_bucket_size": 20000}, True),
    "zero1-defaults": ({"stage": 1, "reduce_bucket_size": 50000}, False),
}


def buffer_bytes(engine) -> dict[str, list[int]]:
    return {
        str(dtype): [b.numel() * b.element_size() for b in bucket.buffer]
        for dtype, bucket in engine.optimizer.ipg_buckets.items()
    }


def capture(zero: dict, bf16: bool) -> dict:
    import torch

    from fora_plugin.zero import build_zero_fora_optimizer

    model = zero_engine.build_model()
    optimizer = build_zero_fora_optimizer(model, **zero_engine.optimizer_kwargs())
    engine, ids = zero_engine.probe_engine(model, optimizer, zero, bf16)
    during = []

    def on_output(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(lambda grad: during.append(buffer_bytes(engine)))

    layer = engine.module.get_base_model().model.layers[zero_engine.ADAPTED_LAYERS[0]]
    handle = layer.register_forward_hook(on_output)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    handle.remove()
    assert len(during) == 1, during
    return {
        "during": during[0],
        "after": buffer_bytes(engine),
        "dtype": str(torch.bfloat16 if bf16 else torch.float32),
    }


def main(out_dir: str) -> None:
    import torch.distributed as dist

    results = {name: capture(zero, bf16) for name, (zero, bf16) in VARIANTS.items()}
    Path(out_dir, "buckets.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
