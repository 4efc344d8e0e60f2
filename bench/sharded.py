"""Per-step cost of FoRA's Stiefel step with lora_B sharded by rows (FSDP2) vs replicated (DDP, ZeRO-1/2).

Replicated: every rank holds every whole lora_B (d_out, r), all-reduces its gradient, and steps all of it.
Sharded (FSDP2): every rank holds d_out / W rows of each lora_B; FSDP2 reduce-scatters the gradient (as it does for
every parameter), and the Cayley step all-reduces one (4r² + 1)-value Gram row per matrix (one call per shape
bucket), then updates the local rows.

Three tables, on the lora_B set of a FoRA run (r = 32; q, k, v, up, down; K = L/2 layers):
1. bytes each rank sends per step (ring all-reduce: 2(W-1)/W x size; reduce-scatter: (W-1)/W x size), fp32;
2. local compute of one step, timed here on the shard sizes of W ranks against the whole matrices (W = 1). The
   70B set (200 matrices, 241 MB of fp32 lora_B) is timed on a subset of layers and scaled by K / subset;
3. with ``--gloo``: 2 CPU processes over gloo stepping the same subset for real, DTensor lora_B (Shard(0)) against
   replicated lora_B with a gradient all-reduce; bytes counted at ``torch.distributed.all_reduce``.

    python bench/sharded.py                 # tables 1 and 2
    python bench/sharded.py --gloo          # and table 3
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fora_plugin import CayleyAdam
from fora_plugin.stiefel import random_stiefel


RANK = 32
# d_out of q, k, v, up, down and the number of decoder layers, from the models' config.json.
MODEL_SHAPES = {
    "LLaMA-3.1-8B": {"d_out": {"q": 4096, "k": 1024, "v": 1024, "up": 14336, "down": 4096}, "layers": 32},
    "LLaMA-3.1-70B": {"d_out": {"q": 8192, "k": 1024, "v": 1024, "up": 28672, "down": 8192}, "layers": 80},
}
FP32 = 4


def lora_b_rows(model: str) -> list[int]:
    """d_out of every lora_B of a FoRA run on ``model`` (K = L/2 layers)."""
    shape = MODEL_SHAPES[model]
    return [d for _ in range(shape["layers"] // 2) for d in shape["d_out"].values()]


def bytes_per_rank(model: str, world: int) -> dict[str, float]:
    rows = lora_b_rows(model)
    grads = sum(rows) * RANK * FP32  # every lora_B gradient, fp32
    gram = len(rows) * (4 * RANK * RANK + 1) * FP32  # one Gram row [BᵀB, Bᵀm; mᵀB, mᵀm] + ‖G‖² per matrix
    ring = 2 * (world - 1) / world
    return {
        "replicated: gradient all-reduce": ring * grads,
        "sharded: gradient reduce-scatter (FSDP2's own)": (world - 1) / world * grads,
        "sharded: Gram all-reduce (FoRA's step)": ring * gram,
    }


def make_set(rows: list[int], world: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """The local part of each lora_B on one of ``world`` ranks (torch.chunk's first, largest, block)."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for d in rows:
        local = math.ceil(d / world)
        p = torch.nn.Parameter(random_stiefel(d, RANK, generator=gen)[:local].clone())
        p.grad = torch.randn(local, RANK, generator=gen) * 1e-3
        params.append(p)
    return params


def time_step(optimizer: torch.optim.Optimizer, repeats: int, before=None, clock=time.perf_counter) -> float:
    """Median seconds per step, the first (state initialisation) step left out."""
    optimizer.step()
    times = []
    for _ in range(repeats):
        start = clock()
        if before is not None:
            before()
        optimizer.step()
        times.append(clock() - start)
    return statistics.median(times)


def local_compute(model: str, world: int, layers: int | None, repeats: int) -> tuple[float, str]:
    rows = lora_b_rows(model)
    per_layer = len(MODEL_SHAPES[model]["d_out"])
    k = len(rows) // per_layer
    subset = min(layers or k, k)
    params = make_set(rows[: subset * per_layer], world)
    # The sharded step on local rows is this step plus one all-reduce; a plain tensor of the local rows has the same
    # work (Gram, 2r x 2r algebra, update of the rows), so it times the local compute of a shard.
    # CPU time of this process (one thread): what the step costs, whatever else runs on the machine.
    seconds = time_step(CayleyAdam(params, qr_period=0), repeats, clock=time.process_time) * k / subset
    note = f"{subset} of {k} layers x {k / subset:g}" if subset < k else f"all {k} layers"
    return seconds, note


# ------------------------------------------------------------------------------------------------ 2 gloo ranks
def _count_all_reduce(counter: list[int]):
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        counter[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    return counting


def _gloo_worker(rank: int, world: int, store: str, rows: list[int], repeats: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    whole = [(random_stiefel(d, RANK, generator=gen), torch.randn(d, RANK, generator=gen) * 1e-3) for d in rows]
    counter = [0]
    dist.all_reduce = _count_all_reduce(counter)
    try:
        sharded = []
        for b, g in whole:
            p = torch.nn.Parameter(distribute_tensor(b, mesh, [Shard(0)]))
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
            sharded.append(p)
        counter[0] = 0
        sharded_time = time_step(CayleyAdam(sharded, qr_period=0), repeats)
        sharded_bytes = counter[0] / (repeats + 1)

        replicated = [torch.nn.Parameter(b.clone()) for b, _ in whole]
        grads = [g.clone() for _, g in whole]

        def all_reduce_grads() -> None:  # one flat all-reduce, as the ZeRO-1/2 path averages replicated lora_B
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for p, g in zip(replicated, flat.div_(world).split([g.numel() for g in grads])):
                p.grad = g.view_as(p)

        all_reduce_grads()
        counter[0] = 0
        replicated_time = time_step(CayleyAdam(replicated, qr_period=0), repeats, before=all_reduce_grads)
        replicated_bytes = counter[0] / repeats
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        out.update(
            sharded_time=sharded_time,
            sharded_bytes=sharded_bytes,
            replicated_time=replicated_time,
            replicated_bytes=replicated_bytes,
        )


def gloo_measure(rows: list[int], repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gloo_worker, args=(2, os.path.join(folder, "store"), rows, repeats, out), nprocs=2)
        return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8, help="ranks whose shard sizes are timed (table 2)")
    parser.add_argument("--layers-70b", type=int, default=4, help="70B layers timed (scaled to K = 40)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gloo", action="store_true", help="also measure 2 gloo ranks (table 3)")
    parser.add_argument("--gloo-layers", type=int, default=2, help="8B layers stepped by the 2 gloo ranks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")

    print(f"\n1. Bytes each rank sends per step (lora_B gradients, FoRA's reductions), r = {RANK}, W = {args.world}")
    columns = ["replicated: grad all-reduce", "sharded: FSDP2 grad reduce-scatter", "sharded: Gram all-reduce"]
    print(f"| model | lora_B | {' | '.join(columns)} |")
    print("|---|---:|---:|---:|---:|")
    for model in MODEL_SHAPES:
        sizes = [f"{v / 1e6:.2f} MB" for v in bytes_per_rank(model, args.world).values()]
        print(f"| {model} | {len(lora_b_rows(model))} | {' | '.join(sizes)} |")

    print(f"\n2. CPU time of one Cayley-Adam step (1 thread), whole lora_B vs the rows of 1 of {args.world} ranks")
    print(f"| model | timed | replicated (W = 1) | sharded (W = {args.world}) | ratio |")
    print("|---|---|---:|---:|---:|")
    for model in MODEL_SHAPES:
        layers = args.layers_70b if "70B" in model else None
        whole, note = local_compute(model, 1, layers, args.repeats)
        shard, _ = local_compute(model, args.world, layers, args.repeats)
        print(f"| {model} | {note} | {whole * 1e3:.1f} ms | {shard * 1e3:.1f} ms | {whole / shard:.1f}x |")

    if args.gloo:
        rows = lora_b_rows("LLaMA-3.1-8B")[: args.gloo_layers * 5]
        result = gloo_measure(rows, args.repeats)
        print(f"\n3. 2 gloo ranks, {len(rows)} LLaMA-3.1-8B lora_B ({args.gloo_layers} layers), measured per step")
        print("| step | all-reduce payload per rank | wall time per step |")
        print("|---|---:|---:|")
        print(
            f"| replicated: grad all-reduce + whole step | {result['replicated_bytes'] / 1e6:.2f} MB | "
            f"{result['replicated_time'] * 1e3:.1f} ms |"
        )
        print(
            f"| sharded (DTensor Shard(0)): Gram all-reduce + local step | {result['sharded_bytes'] / 1e6:.3f} MB | "
            f"{result['sharded_time'] * 1e3:.1f} ms |"
        )


if __name__ == "__main__":
    main()
