"""`fora plan`'s FSDP2 arithmetic beside FSDP2 itself, run on a fake process group.

    python bench/plan_fsdp2_simulation.py [--config CONFIG.yaml] [--gpus 8] [--layers 4] [--modes lora fora]

`fora plan` plans an FSDP2 step on one unsharded model and divides what FSDP2 shards by the number of GPUs, adding
two gathered decoder layers and the root module (embeddings, final norm, head) as transient. Here the same model
(built from config.json on fake tensors, LoRA as the trainer wraps it, the first ``--layers`` decoder layers of the
config: real shapes, fewer layers) is sharded by ``fully_shard`` (each decoder layer, then the root, as
accelerate's TRANSFORMER_BASED_WRAP does) over a fake process group of ``--gpus`` ranks, and trained for two steps
(forward, backward, optimizer step) under torch's ``FSDPMemTracker``, which counts rank 0's sharded and unsharded
parameters, gradients, optimizer states, activations, all-gather buffers and temporaries. Its peak of the second
step is printed beside the plan's, with and without activation checkpointing.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from unittest import mock

import torch
import torch.distributed as dist

from fora_plugin import plan
from fora_plugin.fsdp import init_sharded_stiefel_state
from fora_plugin.optim import cayley_adam
from fora_plugin.targets import find_decoder_layers
from fora_plugin.training import fora_optimizer
from fora_plugin.wiring import readapt_lora


warnings.filterwarnings("ignore")
GIB = 2**30


def _unchecked_cholesky_qr(B: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """stiefel.cholesky_qr without its host-side rank check (fake tensors hold no status to read)."""
    L, _ = torch.linalg.cholesky_ex(gram)  # (..., r, r)
    return torch.linalg.solve_triangular(L.mT, B, upper=True, left=False)  # (..., d_local, r)


def simulated_peak(setup, mode: str, mesh) -> int:
    """Rank 0's peak bytes of the second training step under fully_shard, per FSDPMemTracker."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    device = torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = plan.wrap_lora(setup, plan.meta_model_of(setup))
    if mode != "lora":
        fora = dataclasses.replace(setup.fora, mode=mode, scores_path=None)
        planned = plan.planned_layers(setup, setup.model_config.num_hidden_layers)
        with torch.device("meta"):
            readapt_lora(model, plan.plan_selection(setup, model.get_base_model(), planned), fora, seed=0)
    with fake_mode:
        plan.prepare_fake_model(setup, model, fake_mode, device)
        for layer in find_decoder_layers(model)[1]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if mode == "lora":
            optimizer = plan.lora_optimizer(setup, model)
        else:
            optimizer = fora_optimizer(plan.trainer_view(setup, model), model, fora)
            # What FSDP2Callback does when training starts: the Cayley state of each row-sharded lora_B. Its
            # rank check reads the Cholesky status on the host, a value fake tensors do not have: skipped here.
            with mock.patch.object(cayley_adam, "cholesky_qr", _unchecked_cholesky_qr):
                init_sharded_stiefel_state(model, optimizer)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((plan.planned_batch(setup, device),))
        with tracker, plan.fused_lm_head_as_on_cuda():  # the loss as the plan forms it (SFTTrainer's, on a GPU)
            for step in range(2):
                with plan.planned_autocast(setup, device):
                    loss = plan.sft_training_loss(model, plan.planned_batch(setup, device))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()  # the second step is the steady one: states live through it
        snapshot = tracker.get_tracker_snapshot("peak")
    return snapshot[device]["Total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="example_configs/commonsense_llama3_8b.yaml")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["lora", "fora"])
    args = parser.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.gpus)
    mesh = init_device_mesh("cpu", (args.gpus,))
    rows = []
    for checkpointing in ("true", "false"):
        fsdp = ["--fsdp", "full_shard", "--fsdp_config", '{"version": 2}', "--activation_checkpointing", checkpointing]
        setup = plan.plan_setup(args.config, fsdp, gpus=args.gpus)
        setup = dataclasses.replace(setup, model_config=plan.truncated_config(setup.model_config, args.layers))
        planned = plan.run_plan(setup, modes=tuple(args.modes), full_depth=True)
        for mode in args.modes:
            arithmetic = planned["phases"][mode]["step"].total
            simulated = simulated_peak(setup, mode, mesh)
            rows.append((checkpointing, mode, arithmetic, simulated))
            print(f"checkpointing {checkpointing}, {mode}: plan {arithmetic / GIB:.3f}, FSDP2 {simulated / GIB:.3f}")
    dist.destroy_process_group()
    print(
        f"\n{setup.model_ref}, first {args.layers} decoder layers, batch {setup.batch_size} x {setup.seq_len}, "
        f"LoRA r {setup.lora.r}, FSDP2 over {args.gpus} GPUs; per-GPU peak of a steady step (GiB = 2^30 bytes)\n"
    )
    print("| checkpointing | mode | `fora plan` (divided) | FSDP2 on a fake process group | plan / FSDP2 - 1 |")
    print("|---|---|---:|---:|---:|")
    for checkpointing, mode, arithmetic, simulated in rows:
        print(
            f"| {'on' if checkpointing == 'true' else 'off'} | {mode} | {arithmetic / GIB:.3f} | "
            f"{simulated / GIB:.3f} | {arithmetic / simulated - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
