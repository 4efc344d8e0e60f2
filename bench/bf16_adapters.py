"""bf16 adapters with fp32 masters against fp32 adapters: the loss curve, against the run-to-run noise, and ‖BᵀB − I‖.

Each run is a real ``FoRASFTTrainer.train()`` of a tiny Llama with bf16 weights (random, seeded) under bf16 autocast,
on the bundled Alpaca sample (example_configs/data/alpaca_en_demo.json, prompt/completion in the Alpaca template)
with a character tokenizer, FoRA on fixed layers (no scoring), 200 steps by default. Per seed, two runs that differ
only in ``fora_adapter_dtype``: ``auto`` (PEFT's fp32 adapters) and ``bfloat16`` (bf16 ``lora_A``/``lora_B``, fp32
masters and moments in FoRA's optimizer). The seed sets the trainer's seed (data order, lora_A init) and FoRA's
(the Stiefel init of lora_B).

What is compared, on the losses smoothed over a window of steps (the raw per-batch loss is mostly the batch):

- the difference: bf16 − fp32 adapters of the same seed;
- the run-to-run noise: fp32 adapters of one seed against fp32 adapters of another (other data order and init), and
  against fp32 adapters of the same data order with only FoRA's Stiefel init seed changed (``--init-noise``).

‖BᵀB − I‖_F: the largest over the Stiefel lora_B, from the fp32 masters (the points Cayley-Adam steps) and from the
bf16 weights the forward uses (the masters rounded), at the end of each run, and the largest the run logged
(``fora/max_orthogonality_error``, read from the masters).

    python bench/bf16_adapters.py                       # CPU: 3 seeds x 2 dtypes x 200 steps, ~10 min on 2 cores
    python bench/bf16_adapters.py --steps 20 --seeds 0  # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # conftest's character tokenizer and tiny Llama config

TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
DATA = REPO / "example_configs" / "data" / "alpaca_en_demo.json"


def train(adapter_dtype: str, seed: int, args: argparse.Namespace, fora_seed: int | None = None) -> dict:
    """One run: its per-step losses and the ‖BᵀB − I‖ of its lora_B."""
    from conftest import char_tokenizer, tiny_llama_config
    from peft import LoraConfig
    from transformers import LlamaForCausalLM
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig

    from fora_plugin import FoRAConfig, FoRASFTTrainer, stiefel_parameters
    from fora_plugin.data import load_train_dataset
    from fora_plugin.stiefel import orthogonality_error

    torch.manual_seed(1000)  # the same random base for every run
    config = tiny_llama_config(args.layers, vocab_size=99, hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    config.max_position_embeddings = args.max_length
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        trainer = FoRASFTTrainer(
            model,
            SFTConfig(
                output_dir=out,
                per_device_train_batch_size=args.batch,
                max_length=args.max_length,
                max_steps=args.steps,
                learning_rate=args.lr,
                lr_scheduler_type="constant",
                logging_steps=1,
                save_strategy="no",
                report_to=[],
                bf16=True,
                use_cpu=args.device == "cpu",
                disable_tqdm=True,
                seed=seed,
            ),
            train_dataset=load_train_dataset(str(DATA)),
            processing_class=char_tokenizer(),
            peft_config=LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS),
            fora_config=FoRAConfig(
                layers=list(range(args.layers // 2, args.layers)),
                lr_stiefel=args.lr_stiefel,
                adapter_dtype=adapter_dtype,
                seed=seed if fora_seed is None else fora_seed,
            ),
        )
        trainer.remove_callback(PrinterCallback)  # a log line per step: the table below is the output
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        logs = [e for e in trainer.state.log_history if "loss" in e]
        optimizer = trainer.optimizer
        masters, weights = [], []
        for _, p in stiefel_parameters(trainer.model):
            masters.append(orthogonality_error(optimizer.state[p].get("master", p).detach().float()).item())
            weights.append(orthogonality_error(p.detach().float()).item())
    return {
        "adapter_dtype": adapter_dtype,
        "seed": seed,
        "fora_seed": seed if fora_seed is None else fora_seed,
        "losses": [e["loss"] for e in logs],
        "max_logged_orthogonality_error": max(e["fora/max_orthogonality_error"] for e in logs),
        "final_master_orthogonality_error": max(masters),
        "final_weight_orthogonality_error": max(weights),
        "seconds": seconds,
    }


def smoothed(losses: list[float], window: int) -> list[float]:
    """The mean of each run of ``window`` steps (non-overlapping)."""
    return [statistics.fmean(losses[i : i + window]) for i in range(0, len(losses) - window + 1, window)]


def gap(a: list[float], b: list[float], window: int) -> float:
    """The largest difference of two smoothed loss curves."""
    return max(abs(x - y) for x, y in zip(smoothed(a, window), smoothed(b, window)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--window", type=int, default=20, help="steps per point of the smoothed loss curve")
    parser.add_argument("--init-noise", action="store_true", help="also: fp32 runs changing FoRA's init seed only")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lr-stiefel", type=float, default=1e-2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", help="write every run (per-step losses included) to this file")
    args = parser.parse_args()
    from fora_plugin.cli import quiet_third_party_noise

    quiet_third_party_noise()
    runs = {}
    for seed in args.seeds:
        for dtype in ("auto", "bfloat16"):
            runs[(dtype, seed)] = train(dtype, seed, args)
            print(f"seed {seed}, adapter_dtype {dtype}: {runs[(dtype, seed)]['seconds']:.0f} s", flush=True)
    init_noise = {}
    if args.init_noise:
        for seed in args.seeds:
            init_noise[seed] = train("auto", seed, args, fora_seed=seed + 100)
    w = args.window
    print(
        f"\nTiny Llama ({args.layers} layers, hidden {args.hidden}, bf16 weights, bf16 autocast), FoRA on the top "
        f"{args.layers // 2} layers, r {args.rank}, batch {args.batch}, {args.steps} steps, Alpaca sample; loss "
        f"smoothed over {w} steps\n"
    )
    print("| seed | fp32 adapters: last-window loss | bf16 adapters: last-window loss | largest gap bf16 − fp32 |")
    print("|---:|---:|---:|---:|")
    for seed in args.seeds:
        a, b = runs[("auto", seed)]["losses"], runs[("bfloat16", seed)]["losses"]
        print(f"| {seed} | {smoothed(a, w)[-1]:.4f} | {smoothed(b, w)[-1]:.4f} | {gap(a, b, w):.4f} |")
    seeds = args.seeds
    noise = [gap(runs[("auto", s)]["losses"], runs[("auto", t)]["losses"], w) for s in seeds for t in seeds if s < t]
    differences = [gap(runs[("auto", s)]["losses"], runs[("bfloat16", s)]["losses"], w) for s in seeds]
    print()
    print("| measure | largest gap of smoothed losses |")
    print("|---|---:|")
    print(f"| bf16 − fp32 adapters, same seed (max over {len(seeds)} seeds) | {max(differences):.4f} |")
    if noise:
        print(
            f"| fp32 − fp32, another seed (data order and init; min / max over {len(noise)} pairs) | "
            f"{min(noise):.4f} / {max(noise):.4f} |"
        )
    if init_noise:
        only_init = [gap(runs[("auto", s)]["losses"], init_noise[s]["losses"], w) for s in seeds]
        print(
            f"| fp32 − fp32, another Stiefel init only (min / max over {len(only_init)} seeds) | "
            f"{min(only_init):.4f} / {max(only_init):.4f} |"
        )
    print()
    print("| adapters | ‖BᵀB − I‖ of the masters, end | of the weights the forward uses, end | largest logged |")
    print("|---|---:|---:|---:|")
    for dtype, label in (("auto", "fp32"), ("bfloat16", "bf16 + fp32 masters")):
        chosen = [runs[(dtype, s)] for s in seeds]
        master = max(r["final_master_orthogonality_error"] for r in chosen)
        weight = max(r["final_weight_orthogonality_error"] for r in chosen)
        logged = max(r["max_logged_orthogonality_error"] for r in chosen)
        print(f"| {label} | {master:.2e} | {weight:.2e} | {logged:.2e} |")
    if args.json:
        payload = {"args": vars(args), "runs": [*runs.values(), *init_noise.values()]}
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
