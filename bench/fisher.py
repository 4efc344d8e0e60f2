"""Fisher scoring vs one LoRA training step vs keep-all-gradients scoring: time and peak memory on the same batch.

FoRA's phase 1 scores every decoder layer by F_ℓ = Σ_{θ in layer ℓ} ‖∇_θ L‖², a gradient of every base weight. The
paper's reference code gets it the obvious way: every decoder-layer weight gets requires_grad, one backward, and the
squared norms are summed once all the .grads exist. That keeps a full gradient of the decoder alive, +2 bytes per
model parameter in bf16 (+4 in float32): +14 GB for an 8B model, on top of the activations. Ours
(fora_plugin.fisher.fisher_scores) adds ‖g‖² into its layer's total the moment autograd produces g and frees it, so at
most one weight gradient exists at a time and scoring should cost about what the LoRA training step that follows
costs. For each model, on the same batch and with the same loss (model(**batch).loss, labels = input_ids):

1. scoring: fisher_scores(model, [batch] * n, n) / n, i.e. seconds per scored batch;
2. LoRA step: r = 16 adapters on q, k, v, up, down of ALL layers, forward + backward + AdamW step + zero_grad;
3. keep-all: every decoder-layer base parameter requires grad, backward, all .grads alive, ‖g‖² summed per layer.

Scoring also forms the weight gradients that a LoRA step never needs (dW of every linear, not only dX), so its
time target is 1.5x a step; its memory target is the step's peak within 5%.

Peak memory is peak minus the memory in use just before the measured call (model and batch excluded). On CUDA it is
max_memory_allocated after a warm-up call. On CPU each measurement runs in its own fresh process (a CPU allocator
keeps what it freed, so two measurements in one process would mask each other): the RSS high-water mark is reset,
the operation runs twice (lazy allocations included) and VmHWM - VmRSS(before) is the peak.

    python bench/fisher.py                                  # CPU: tiny random Llama and Gemma-3-270M
    python bench/fisher.py --device cuda                    # GPU: also an 8B-shaped random Llama in bf16
    python bench/fisher.py --device cuda --models 8b
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


MODELS = ("tiny", "gemma", "8b")
KINDS = ("scoring", "lora_step", "keep_all")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
# (batch size, sequence length) per model. Gemma-3-270M's 262144-token vocabulary makes its logits the bulk of a CPU
# forward + backward, so its batch is small.
BATCH_SHAPES = {"tiny": (4, 128), "gemma": (2, 128), "8b": (4, 512)}


def default_batches(model: str, device: torch.device) -> int:
    """n, the batches scored (and steps taken) per timing: few for Gemma on a CPU (~4 s per forward + backward)."""
    return 2 if model == "gemma" and device.type == "cpu" else 8


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(call: Callable[[], Any], device: torch.device, calls: int, repeats: int) -> float:
    """Seconds per call: the median over ``repeats`` blocks of the mean over ``calls`` back-to-back calls.

    A mean within a block, so that it compares directly with one fisher_scores call over n batches divided by n; a
    median over blocks, so that one block slowed by another process on a shared CPU does not decide the result.
    The caller has warmed up.
    """
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def build_model(name: str, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if name == "tiny":
        torch.manual_seed(0)  # the same random model in every measuring process
        config = LlamaConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    elif name == "gemma":
        from fora_plugin.models import BUNDLED_GEMMA, resolve_model_path

        path = resolve_model_path(BUNDLED_GEMMA)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    elif name == "8b":
        if device.type != "cuda":
            raise ValueError("the 8B-shaped model needs --device cuda (16 GB of bf16 weights)")
        torch.manual_seed(0)
        # LLaMA-3.1-8B's shapes (its config.json); random weights, so nothing is downloaded. Built on the GPU
        # directly: 16 GB of weights initialised on a CPU first would take minutes.
        config = LlamaConfig(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False,
        )
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        raise ValueError(f"unknown model {name!r}: use one of {MODELS}")
    return model


def make_batch(model: nn.Module, name: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Random tokens, seeded: every process and every measurement sees the same batch."""
    batch_size, seq_len = BATCH_SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=gen).to(device)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": input_ids.clone(),
    }


def prepare(kind: str, model: nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """The measured operation of ``kind`` for one batch; its setup (flags, adapters, optimizer) is done here."""
    from fora_plugin.fisher import fisher_scores
    from fora_plugin.targets import find_decoder_layers

    if kind == "scoring":
        return lambda: fisher_scores(model, [batch], 1, progress=False)

    if kind == "keep_all":
        _, layers = find_decoder_layers(model)
        model.requires_grad_(False)
        layers.requires_grad_(True)
        model.train()
        per_layer = [[p for p in layer.parameters() if p.is_floating_point()] for layer in layers]

        def keep_all_grads() -> list[float]:
            model(**batch).loss.backward()
            # Every decoder-layer .grad is alive here, as in the reference code.
            totals = torch.stack([sum(p.grad.float().square().sum() for p in params) for params in per_layer])
            scores = totals.tolist()
            for params in per_layer:
                for p in params:
                    p.grad = None  # nothing left behind for the next call's baseline
            return scores

        return keep_all_grads

    if kind == "lora_step":
        from peft import LoraConfig, get_peft_model

        peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
        peft_model.train()
        optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)

        def lora_step() -> None:
            peft_model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return lora_step

    raise ValueError(f"unknown measurement {kind!r}: use one of {KINDS}")


def timed_call(
    kind: str, model: nn.Module, batch: dict, op: Callable[[], Any], device: torch.device, n: int, repeats: int
) -> float:
    """Seconds per batch of ``kind``, after the caller's warm-up."""
    if kind == "scoring":
        from fora_plugin.fisher import fisher_scores

        # One scoring run over n batches, as phase 1 does it (one host sync at the end), divided by n.
        return time_per_call(lambda: fisher_scores(model, [batch] * n, n, progress=False), device, 1, repeats) / n
    return time_per_call(op, device, n, repeats)


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def cpu_peak_bytes(op: Callable[[], Any]) -> int:
    """Peak RSS above the RSS before ``op``, over two calls (the second sees what the first allocated lazily)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    baseline = _proc_status_kb("VmRSS")
    op()
    op()
    return (_proc_status_kb("VmHWM") - baseline) * 1024


def cuda_peak_bytes(op: Callable[[], Any], device: torch.device) -> int:
    """Peak allocated above the allocated memory before ``op``, after one warm-up call."""
    op()
    gc.collect()
    synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    op()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline


def fault_in(model: nn.Module) -> None:
    """Read every weight once: from_pretrained may leave safetensors weights memory-mapped and not yet paged in,
    and the first call to touch them would be charged their size."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.sum()


def measure_cpu_child(kind: str, name: str, n: int, repeats: int) -> None:
    """One measurement in this (fresh) process; prints a JSON line for the parent."""
    device = torch.device("cpu")
    model = build_model(name, device)
    batch = make_batch(model, name, device)
    op = prepare(kind, model, batch)
    fault_in(model)
    peak = cpu_peak_bytes(op)  # its two calls are also the timing's warm-up
    seconds = timed_call(kind, model, batch, op, device, n, repeats)
    print(json.dumps({"kind": kind, "model": name, "seconds": seconds, "peak_bytes": peak}))


def measure_cpu(name: str, n: int, repeats: int) -> dict[str, dict[str, float]]:
    results = {}
    for kind in KINDS:
        command = [sys.executable, os.path.abspath(__file__), "--_measure", kind, "--model", name, "--batches", str(n)]
        command += ["--repeats", str(repeats)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"measuring {kind} on {name} failed:\n{done.stderr}")
        results[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def measure_cuda(name: str, device: torch.device, n: int, repeats: int) -> dict[str, dict[str, float]]:
    model = build_model(name, device)
    batch = make_batch(model, name, device)
    results = {}
    for kind in ("scoring", "keep_all", "lora_step"):  # lora_step last: it wraps the model with adapters in place
        op = prepare(kind, model, batch)
        peak = cuda_peak_bytes(op, device)
        seconds = timed_call(kind, model, batch, op, device, n, repeats)
        results[kind] = {"seconds": seconds, "peak_bytes": peak}
        del op
        gc.collect()
    del model, batch
    gc.collect()
    torch.cuda.empty_cache()
    return results


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    parser.add_argument(
        "--models", default=None, help="comma-separated, of tiny, gemma, 8b (default: tiny,gemma; on cuda also 8b)"
    )
    parser.add_argument(
        "--batches", type=int, default=None, help="n, batches per timing (default: 2 for Gemma on CPU, else 8)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks of n, median taken (default: 3)")
    parser.add_argument("--_measure", choices=KINDS, help=argparse.SUPPRESS)  # the CPU child process
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)

    if args._measure:
        measure_cpu_child(args._measure, args.model, args.batches or default_batches(args.model, device), args.repeats)
        return

    default_models = "tiny,gemma,8b" if device.type == "cuda" else "tiny,gemma"
    models = [m.strip() for m in (args.models or default_models).split(",") if m.strip()]
    for name in models:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}: use {', '.join(MODELS)}")
        if name == "8b" and device.type != "cuda":
            parser.error("the 8B-shaped model runs only with --device cuda")
    if device.type not in ("cpu", "cuda"):
        parser.error("--device must be cpu or cuda")
    if "gemma" in models:
        from fora_plugin.models import BUNDLED_GEMMA, resolve_model_path

        resolve_model_path(BUNDLED_GEMMA)  # convert once here (if not cached) rather than inside a measurement

    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    memory = "max_memory_allocated" if device.type == "cuda" else "RSS high-water mark, one fresh process each"
    print(f"device: {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, peaks: {memory}")
    print()
    print(
        "| model | tokens/batch | scoring s/batch | LoRA step s | time ratio (target ≤ 1.5) | scoring peak MB "
        "| LoRA step peak MB | keep-all-grads peak MB | scoring/step (target ≤ 1.05) | scoring/keep-all "
        "| keep-all s/batch |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in models:
        n = args.batches or default_batches(model, device)
        results = (
            measure_cuda(model, device, n, args.repeats)
            if device.type == "cuda"
            else measure_cpu(model, n, args.repeats)
        )
        score, step, keep = results["scoring"], results["lora_step"], results["keep_all"]
        batch_size, seq_len = BATCH_SHAPES[model]
        mb = 2**20
        print(
            f"| {model} | {batch_size} x {seq_len} | {score['seconds']:.3f} | {step['seconds']:.3f} "
            f"| {score['seconds'] / step['seconds']:.2f} | {score['peak_bytes'] / mb:.1f} "
            f"| {step['peak_bytes'] / mb:.1f} | {keep['peak_bytes'] / mb:.1f} "
            f"| {score['peak_bytes'] / step['peak_bytes']:.2f} | {score['peak_bytes'] / keep['peak_bytes']:.2f} "
            f"| {keep['seconds']:.3f} |",
            flush=True,
        )
    print()
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
