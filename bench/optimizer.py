"""Time per optimizer step over the lora_B set of real model shapes: Cayley-Adam vs AdamW vs a dense Cayley step.

Every lora_B of a FoRA run on LLaMA-3.1-8B and Qwen3-8B shapes (r = 32, targets q, k, v, up, down, K = L/2 layers)
is stepped by our CayleyAdam and by torch.optim.AdamW(foreach=True) on the same tensors, side by side in one run.
The dense line is the paper's reference approach: the d x d skew matrix W is formed and the Cayley system is solved
by 5 fixed-point iterations with d x d products, on one 4096 x 32 matrix.

    python bench/optimizer.py                 # CPU
    python bench/optimizer.py --device cuda   # GPU
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from fora_plugin import CayleyAdam
from fora_plugin.stiefel import orthogonality_error, random_stiefel


# d_out of q, k, v, up, down and the number of decoder layers, from the models' config.json.
MODEL_SHAPES = {
    "LLaMA-3.1-8B": {"d_out": {"q": 4096, "k": 1024, "v": 1024, "up": 14336, "down": 4096}, "layers": 32},
    "Qwen3-8B": {"d_out": {"q": 4096, "k": 1024, "v": 1024, "up": 12288, "down": 4096}, "layers": 36},
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds per call of ``step``."""
    for _ in range(warmup):
        step()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def lora_b_set(shape: dict, rank: int, device: torch.device, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    k = shape["layers"] // 2
    params = []
    for _ in range(k):
        for d_out in shape["d_out"].values():
            p = torch.nn.Parameter(random_stiefel(d_out, rank, generator=gen).to(device))
            p.grad = torch.randn(d_out, rank, generator=gen).to(device) * 1e-3
            params.append(p)
    return params


def dense_reference_step(B: torch.Tensor, G: torch.Tensor, lr: float, iters: int = 5) -> torch.Tensor:
    """The reference implementation's shape of work: a d x d W and d x d products in the fixed-point solve."""
    W_hat = G @ B.T - 0.5 * B @ (B.T @ G @ B.T)  # (d, d)
    W = W_hat - W_hat.T  # (d, d)
    Y = B - lr * (W @ B)
    for _ in range(iters):
        Y = B - (lr / 2) * (W @ (B + Y))
    return Y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank r (default: 32)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per measurement (default: 10)")
    parser.add_argument("--drift-steps", type=int, default=200, help="steps before reading the drift (default: 200)")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device: {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, r={args.rank}")
    print()
    print(
        "| model shapes | lora_B matrices | lora_B params | AdamW ms/step | CayleyAdam ms/step | ratio "
        f"| drift after {args.drift_steps} steps |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for model, shape in MODEL_SHAPES.items():
        params = lora_b_set(shape, args.rank, device)
        n_params = sum(p.numel() for p in params)
        adamw = torch.optim.AdamW(params, lr=1e-3, foreach=True)
        adamw_s = time_steps(adamw.step, device, warmup=3, repeats=args.repeats)
        params = lora_b_set(shape, args.rank, device)  # fresh points for the Stiefel run
        cayley = CayleyAdam(params, lr=1e-3)
        cayley_s = time_steps(cayley.step, device, warmup=3, repeats=args.repeats)
        for _ in range(max(0, args.drift_steps - 3 - args.repeats)):
            cayley.step()
        drift = max(orthogonality_error(p.detach()).item() for p in params)
        print(
            f"| {model} | {len(params)} | {n_params / 1e6:.1f}M | {adamw_s * 1e3:.1f} | {cayley_s * 1e3:.1f} "
            f"| {cayley_s / adamw_s:.2f}x | {drift:.1e} |"
        )
        del params, adamw, cayley

    gen = torch.Generator().manual_seed(1)
    B = random_stiefel(4096, args.rank, generator=gen).to(device)
    G = torch.randn(4096, args.rank, generator=gen).to(device)
    dense_s = time_steps(lambda: dense_reference_step(B, G, 1e-3), device, warmup=1, repeats=max(3, args.repeats // 3))
    single = torch.nn.Parameter(B.clone())
    single.grad = G.clone()
    one = CayleyAdam([single], lr=1e-3)
    ours_s = time_steps(one.step, device, warmup=3, repeats=args.repeats)
    print()
    print("| one 4096 x r matrix | ms/step | vs ours |")
    print("|---|---:|---:|")
    print(
        f"| dense d x d Cayley (reference approach: W formed, 5 fixed-point iterations) | {dense_s * 1e3:.1f} "
        f"| {dense_s / ours_s:.0f}x slower |"
    )
    print(f"| ours: CayleyAdam, exact Woodbury step | {ours_s * 1e3:.2f} | 1x |")


if __name__ == "__main__":
    main()
