"""QFoRA: memory of Fisher scoring and of one FoRA training step on a 4-bit NF4 base vs a float base.

QLoRA's point is the frozen base: NF4 with double-quantised absmax constants stores ~0.5 byte per decoder weight
instead of 2 (bf16) or 4 (fp32). FoRA adds two phases on top of that base, and both must keep the saving:

1. Fisher scoring (fora_plugin.fisher.fisher_scores, fisher_params="layer"): a 4-bit weight can hold no gradient, so
   each Linear4bit is scored from its input x and output gradient g (‖Σ g xᵀ‖²), the float norms by autograd;
2. one FoRA training step: LoRA (r 32, alpha 64 on q, k, v, up, down) on K = L/2 layers, lora_B made Stiefel,
   forward + backward + FoRA's optimizer step (AdamW on lora_A, Cayley-Adam on lora_B) + zero_grad. On a 4-bit base
   the adapters are bf16, as SFTTrainer (and so FoRASFTTrainer) makes them for QLoRA.

Each is measured on a float base (fp32, bf16) and on an NF4 base whose compute dtype (bnb_4bit_compute_dtype, also
the dtype of the embeddings, norms and lm_head, as TRL's `dtype` key sets both) is the same fp32 or bf16, so every
NF4 / float ratio compares like with like. Weights are the bytes of every parameter, buffer and quantisation
constant; the embeddings and lm_head stay in the compute dtype (transformers' bitsandbytes quantiser skips them).

Peaks are bench/fisher.py's: the memory above what is in use just before the measured call (weights, adapters and
batch excluded). On CPU each measurement runs in a fresh process (glibc serving tensor-sized blocks by mmap, so RSS
follows the live tensors), with the RSS high-water mark reset and the call made twice (lazy allocations such as the
optimizer state included); on CUDA torch.cuda.max_memory_allocated after a warm-up call. Seconds are the faster of
the second and a third call. The model is a random Llama built from a config (no download), saved once and loaded by
every measurement, quantised at load time by transformers as in a real QLoRA run.

    python bench/qfora.py                  # CPU: a ~200M-parameter Llama, ~3 minutes on 2 cores
    python bench/qfora.py --size tiny      # about a minute
    python bench/qfora.py --device cuda    # GPU: batch 16 x 256 as in the paper
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

# bench/fisher.py, importable because a script's own folder is first on sys.path: the same peak measurement.
from fisher import cpu_name, cpu_peak_bytes, cuda_peak_bytes, fault_in, synchronize


SIZES = ("tiny", "small")
BASES = ("fp32", "nf4-fp32", "bf16", "nf4-bf16")  # float base, then the NF4 base with the same compute dtype
KINDS = ("scoring", "fora_step")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def llama_config(size: str):
    from transformers import LlamaConfig

    shapes = {
        # ~3M parameters: a smoke test of the script.
        "tiny": dict(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        # ~200M: LLaMA-3 proportions scaled down (MLP 3.5x hidden, 4 query heads per KV head). The embeddings and
        # lm_head, never quantised, are 17% of the parameters here (13% in LLaMA-3.1-8B): a comparable weight ratio.
        "small": dict(
            vocab_size=16384,
            hidden_size=1024,
            intermediate_size=3584,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
        ),
    }[size]
    return LlamaConfig(
        **shapes,
        max_position_embeddings=2048,
        tie_word_embeddings=False,  # as LLaMA-3.1-8B
    )


def save_base(size: str, path: str) -> int:
    """A random fp32 Llama of ``size`` saved to ``path``; returns its parameter count."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(size), dtype=torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def load_base(path: str, base: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = DTYPES[base.split("-")[-1]]
    if not base.startswith("nf4"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, dtype=dtype, device_map=device.type
    )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, plus the NF4 constants (absmax, their own absmax, codebooks)."""
    seen: set[int] = set()

    def size(t: Any) -> int:
        if not isinstance(t, torch.Tensor) or t.data_ptr() in seen:
            return 0
        seen.add(t.data_ptr())
        return t.numel() * t.element_size()

    total = 0
    for p in model.parameters():
        total += size(p)
        state = getattr(p, "quant_state", None)
        if state is not None:
            total += size(state.absmax) + size(state.code) + size(getattr(state, "offset", None))
            if state.nested:
                total += size(state.state2.absmax) + size(state.state2.code)
    return total + sum(size(b) for b in model.buffers())


def make_batch(vocab_size: int, batch_size: int, seq_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)  # the same batch in every measuring process
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen).to(device)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}


def prepare(kind: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """The measured operation; its setup (adapters, optimizer) is done here, outside the measurement."""
    from fora_plugin.fisher import fisher_scores
    from fora_plugin.targets import find_decoder_layers

    if kind == "scoring":
        return lambda: fisher_scores(model, [batch], 1, progress=False)
    if kind != "fora_step":
        raise ValueError(f"unknown measurement {kind!r}: use one of {KINDS}")

    from peft import LoraConfig, get_peft_model

    from fora_plugin import build_fora_optimizer, make_stiefel

    _, layers = find_decoder_layers(model)
    # Every other layer, layer 0 included: backward then runs through the whole decoder, as it does whenever the
    # Fisher choice includes an early layer (the worst case for activation memory).
    chosen = list(range(0, len(layers), 2))
    config = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=LORA_TARGETS, layers_to_transform=chosen)
    peft_model = get_peft_model(model, config)
    if getattr(model, "is_loaded_in_4bit", False):
        for param in peft_model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)  # SFTTrainer's QLoRA adapter dtype
    make_stiefel(peft_model, generator=torch.Generator().manual_seed(0))
    peft_model.train()
    optimizer = build_fora_optimizer(peft_model, lr=2e-4, lr_stiefel=1e-3, weight_decay=0.01)

    def fora_step() -> None:
        peft_model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return fora_step


def timed(op: Callable[[], Any], device: torch.device, seconds: list[float]) -> Callable[[], Any]:
    def call() -> Any:
        synchronize(device)
        start = time.perf_counter()
        result = op()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        return result

    return call


def measure_child(path: str, base: str, kind: str, batch_size: int, seq_len: int, device: torch.device) -> None:
    """One measurement in this (fresh) process; prints a JSON line for the parent."""
    model = load_base(path, base, device)
    weights = weight_bytes(model)
    batch = make_batch(model.config.vocab_size, batch_size, seq_len, device)
    seconds: list[float] = []
    op = timed(prepare(kind, model, batch), device, seconds)
    if device.type == "cuda":
        peak = cuda_peak_bytes(op, device)
    else:
        fault_in(model)
        peak = cpu_peak_bytes(op)
    op()  # a third call: seconds are the faster of the last two, the first one's lazy setup left out
    print(json.dumps({"base": base, "kind": kind, "weights": weights, "peak": peak, "seconds": min(seconds[-2:])}))


def measure(path: str, base: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--device",
        args.device,
        "--batch-size",
        str(args.batch_size),
    ]
    command += ["--seq-len", str(args.seq_len), "--_measure", kind, "--_base", base, "--_path", path]
    # A fixed mmap threshold: glibc then serves every tensor-sized block by mmap and unmaps it when freed, so the RSS
    # high-water mark follows the live tensors. With glibc's default (a threshold that rises as blocks are freed),
    # freed dequantised NF4 weights stay in the heap in a thread-dependent pattern: repeated runs differed by 2x.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {kind} on the {base} base failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


MB = 2**20
# (label, value of one base's results {kind: result}, format) of each table row.
QUANTITIES: list[tuple[str, Callable[[dict[str, dict[str, Any]]], float], str]] = [
    ("weights MB", lambda r: r["scoring"]["weights"] / MB, ".1f"),
    ("Fisher scoring peak MB (above weights)", lambda r: r["scoring"]["peak"] / MB, ".1f"),
    ("FoRA step peak MB (above weights)", lambda r: r["fora_step"]["peak"] / MB, ".1f"),
    ("weights + Fisher scoring peak MB", lambda r: (r["scoring"]["weights"] + r["scoring"]["peak"]) / MB, ".1f"),
    ("weights + FoRA step peak MB", lambda r: (r["fora_step"]["weights"] + r["fora_step"]["peak"]) / MB, ".1f"),
    ("Fisher scoring s/batch", lambda r: r["scoring"]["seconds"], ".3f"),
    ("FoRA step s", lambda r: r["fora_step"]["seconds"], ".3f"),
]


def print_table(results: dict[tuple[str, str], dict[str, Any]]) -> None:
    print("| compute dtype | quantity | float base | NF4 base | NF4 / float |")
    print("|---|---|---:|---:|---:|")
    for compute in DTYPES:
        float_base = {kind: results[compute, kind] for kind in KINDS}
        nf4_base = {kind: results[f"nf4-{compute}", kind] for kind in KINDS}
        for label, value, fmt in QUANTITIES:
            a, b = value(float_base), value(nf4_base)
            print(f"| {compute} | {label} | {a:{fmt}} | {b:{fmt}} | {b / a:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    parser.add_argument("--size", choices=SIZES, default="small", help="model size (default: small, ~200M)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 16 on cuda, 2 on cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 256 on cuda, 128 on cpu")
    parser.add_argument("--_measure", choices=KINDS, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--_base", choices=BASES, help=argparse.SUPPRESS)
    parser.add_argument("--_path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda"):
        parser.error("--device must be cpu or cuda")
    args.batch_size = args.batch_size or (16 if device.type == "cuda" else 2)
    args.seq_len = args.seq_len or (256 if device.type == "cuda" else 128)

    if args._measure:
        measure_child(args._path, args._base, args._measure, args.batch_size, args.seq_len, device)
        return

    try:
        import bitsandbytes
    except ImportError:
        parser.error("the NF4 base needs bitsandbytes: pip install -e '.[qlora]'")
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    memory = "max_memory_allocated" if device.type == "cuda" else "RSS high-water mark, one fresh process each"
    print(
        f"device: {device} ({name}), torch {torch.__version__}, bitsandbytes {bitsandbytes.__version__}, "
        f"threads {torch.get_num_threads()}, peaks: {memory}"
    )
    with tempfile.TemporaryDirectory() as path:
        params = save_base(args.size, path)
        print(
            f"model: random Llama '{args.size}', {params / 1e6:.1f}M parameters; batch {args.batch_size} x "
            f"{args.seq_len} tokens; FoRA: LoRA r 32 on q, k, v, up, down of every other layer, Stiefel lora_B"
        )
        print()
        results = {(base, kind): measure(path, base, kind, args) for base in BASES for kind in KINDS}
    print_table(results)
    print()
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
