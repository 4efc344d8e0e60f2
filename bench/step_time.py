"""Milliseconds per training step and peak memory of LoRA, FG-LoRA and FoRA, side by side, through FoRASFTTrainer.

Each row is a real ``FoRASFTTrainer.train()`` run on a model built from a config (random weights: time and memory do
not depend on the values) and a dataset of random token ids, so everything a user's step does is in the time:
TRL's loss, the activation checkpointing that ``Trainer.train`` switches on and the ``enable_input_require_grads``
that TRL adds for PEFT + checkpointing (and whatever FoRA does about them), accelerate's autocast, gradient
clipping, FoRA's optimizer (AdamW on ``lora_A``, Cayley-Adam on the Stiefel ``lora_B``), the LR scheduler and
``zero_grad``. The layers are given (``FoRAConfig.layers``), so nothing is scored.

- ``lora``: LoRA on every layer, the Trainer's AdamW (``mode="lora"``: exactly TRL's SFTTrainer);
- ``fg-lora``: LoRA on the chosen layers, AdamW on A and B;
- ``fora``: LoRA on the chosen layers, Stiefel B stepped by Cayley-Adam;

the chosen layers in two placements, the top half and every second layer from 0 (where the backward must reach
layer 0), each with activation checkpointing off and on.

A step is timed from the Trainer's ``on_step_begin`` to its ``on_step_end`` callback (CUDA events on a GPU; on the
CPU ``perf_counter``, or with ``--clock cpu`` the process's CPU time, which a busy shared machine disturbs less),
split at ``on_pre_optimizer_step`` into forward + backward + clipping and optimizer step + scheduler +
``zero_grad``; the median over the timed steps after the warm-up ones. On a GPU, peak memory is
``torch.cuda.max_memory_allocated``/``max_memory_reserved`` over the whole ``train()`` (weights included); on the
CPU, ``--live-memory`` counts the peak of live tensor bytes with the storage tracker ``fora plan`` simulates
(:class:`fora_plugin.memory.LiveTensorTracker`; it slows the step, so the times are then not worth reading).

    python bench/step_time.py                                  # CPU: issue 29's setting, a few minutes on 2 cores
    python bench/step_time.py --threads 1 --clock cpu          # the same on a busy machine
    python bench/step_time.py --device cuda --setting llama-3.2-3b --json step_time.json   # the paper's table
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # conftest's character tokenizer: SFTTrainer wants a processing class

TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")
MODES = ("lora", "fg-lora", "fora")
CLOCKS = ("wall", "cpu")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Setting:
    """A model (built from its config, random weights), the batch shape, the precision and the LoRA."""

    name: str
    model_config: Callable[[], Any]  # -> a transformers PretrainedConfig
    batch_size: int
    seq_len: int
    dtype: torch.dtype
    lora_r: int = 32
    lora_alpha: int = 64

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16


def _llama(**shape) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2, **shape)


def _bundled_llama_3b() -> Any:
    from fora_plugin.plan import find_model_config, load_model_config

    return load_model_config(find_model_config("meta-llama/Llama-3.2-3B"))


SETTINGS = {
    # Issue 29's CPU setting: 16 layers, hidden 512, vocabulary 8192, so that the decoder layers (not the head)
    # dominate the step, as in a 3B-70B model.
    "cpu": Setting(
        "Llama 16 layers, hidden 512, vocab 8192, fp32",
        lambda: _llama(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=16,
            num_attention_heads=8,
            num_key_value_heads=2,
        ),
        batch_size=4,
        seq_len=128,
        dtype=torch.float32,
    ),
    # The paper's efficiency table: LLaMA-3.2-3B (the bundled config.json), batch 16 x 256, bf16.
    "llama-3.2-3b": Setting("LLaMA-3.2-3B, bf16", _bundled_llama_3b, batch_size=16, seq_len=256, dtype=torch.bfloat16),
    # A smoke test of the script (bench/gpu.py --tiny).
    "tiny": Setting(
        "Llama 4 layers, hidden 64, vocab 256, fp32",
        lambda: _llama(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        batch_size=2,
        seq_len=32,
        dtype=torch.float32,
        lora_r=4,
        lora_alpha=8,
    ),
}


def placements(num_layers: int) -> dict[str, list[int]]:
    """The two placements of K = L/2 layers: the top half, and every second layer from 0."""
    return {
        "top half": list(range(num_layers - num_layers // 2, num_layers)),
        "every 2nd": list(range(0, num_layers, 2)),
    }


# ------------------------------------------------------------------------------------------------------ building
def lora_config(setting: Setting):
    from peft import LoraConfig

    return LoraConfig(r=setting.lora_r, lora_alpha=setting.lora_alpha, lora_dropout=0.0, target_modules=list(TARGETS))


def checkpointing_key() -> str:
    """transformers 5.23 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` (the old name warns)."""
    from trl import SFTConfig

    names = {f.name for f in dataclasses.fields(SFTConfig)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def sft_args(setting: Setting, device: torch.device, output_dir: str, *, checkpointing: bool, max_steps: int, **extra):
    """The run's SFTConfig: the paper's learning rates and weight decay, logging once at the end (after the timed
    steps), nothing saved."""
    from trl import SFTConfig

    return SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=setting.batch_size,
        max_length=setting.seq_len,
        max_steps=max_steps,
        learning_rate=2e-4,
        weight_decay=0.01,
        logging_steps=max_steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
        bf16=setting.bf16,
        dataloader_drop_last=True,
        seed=0,
        **{checkpointing_key(): checkpointing},
        **extra,
    )


def random_dataset(setting: Setting, rows: int, vocab_size: int, seed: int = 0):
    """Rows of ``seq_len`` random token ids: TRL takes a dataset with ``input_ids`` as already tokenized."""
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    # Ids from 3 up: 0-2 are pad, bos and eos.
    ids = torch.randint(3, vocab_size, (rows, setting.seq_len), generator=gen)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def build_model(setting: Setting, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The setting's model with random weights, made directly on ``device`` in the setting's dtype."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(setting.model_config(), dtype=setting.dtype)
    model.config.use_cache = False
    return model


def build_trainer(
    setting: Setting,
    device: torch.device,
    output_dir: str,
    *,
    mode: str,
    layers: list[int] | None,
    checkpointing: bool,
    max_steps: int,
    fisher_batches: int = 8,
    model: torch.nn.Module | str | None = None,
    **trainer_kwargs,
):
    """A FoRASFTTrainer as a user builds one: base model, LoraConfig, FoRAConfig; ``layers`` None scores them.

    ``model``: a built model or a model folder (SFTTrainer loads it with ``args.model_init_kwargs`` and
    ``trainer_kwargs`` such as ``quantization_config``); default: :func:`build_model`.
    """
    from conftest import char_tokenizer

    from fora_plugin import FoRAConfig, FoRASFTTrainer

    extra = {}
    if isinstance(model, str):
        extra["model_init_kwargs"] = {"dtype": setting.dtype}
    elif model is None:
        model = build_model(setting, device)
    vocab_size = setting.model_config().vocab_size
    rows = setting.batch_size * max(max_steps, fisher_batches if layers is None and mode != "lora" else 0)
    fora = FoRAConfig(mode=mode, layers=layers, fisher_batches=fisher_batches, seed=0)
    return FoRASFTTrainer(
        model,
        sft_args(setting, device, output_dir, checkpointing=checkpointing, max_steps=max_steps, **extra),
        train_dataset=random_dataset(setting, rows, vocab_size),
        processing_class=char_tokenizer(),
        peft_config=lora_config(setting),
        fora_config=fora,
        **trainer_kwargs,
    )


# ------------------------------------------------------------------------------------------------------- timing
class StepTimer(TrainerCallback):
    """Marks each optimizer step's begin, its optimizer step's begin, and its end.

    On CUDA the marks are events recorded on the stream (no host sync); read them once training is over. On the CPU
    ``clock`` is ``"wall"`` (``perf_counter``) or ``"cpu"`` (the process's CPU time, ``process_time``: on a shared
    machine, what the step costs without the time spent waiting for a core).
    """

    def __init__(self, device: torch.device, clock: str = "wall") -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock={clock!r}: use one of {CLOCKS}")
        self.cuda = device.type == "cuda"
        self.clock = time.process_time if clock == "cpu" else time.perf_counter
        self.marks: list[list[Any]] = []

    def _mark(self) -> Any:
        if not self.cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def on_step_begin(self, args, state, control, **kwargs):
        self.marks.append([self._mark()])

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.marks[-1].append(self._mark())

    def on_step_end(self, args, state, control, **kwargs):
        self.marks[-1].append(self._mark())

    def milliseconds(self) -> list[tuple[float, float, float]]:
        """Per step: (whole step, forward + backward + clipping, optimizer step + scheduler + zero_grad)."""
        if self.cuda:
            torch.cuda.synchronize()

        def elapsed(a, b) -> float:
            return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

        return [(elapsed(b, e), elapsed(b, o), elapsed(o, e)) for b, o, e in self.marks]


class StepProfiler(TrainerCallback):
    """Runs the torch profiler over steps [first, first + count) and keeps its top kernels."""

    def __init__(self, device: torch.device, first: int, count: int, rows: int = 15) -> None:
        self.device, self.first, self.count, self.rows = device, first, count, rows
        self.profiler = None
        self.table: str | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.first and self.count:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None and state.global_step == self.first + self.count:
            self.profiler.stop()
            key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            self.table = self.profiler.key_averages().table(sort_by=key, row_limit=self.rows)
            self.profiler = None


@contextlib.contextmanager
def live_memory(model: torch.nn.Module):
    """The storage tracker `fora plan` simulates, around a real run, holding the model's weights from the start."""
    from fora_plugin.memory import LiveTensorTracker

    tracker = LiveTensorTracker()
    for t in [*model.parameters(), *model.buffers()]:
        tracker.register(t)  # a storage registered twice (tied weights) counts once
    with tracker:
        yield tracker


def time_steps(
    trainer, device: torch.device, *, warmup: int, profile_steps: int = 0, live: bool = False, clock: str = "wall"
) -> dict[str, Any]:
    """``trainer.train()`` (its ``max_steps`` = warm-up + timed + profiled steps): step times and peak memory.
    ``clock``: see :class:`StepTimer` (a GPU's are always CUDA events)."""
    clock = "cuda events" if device.type == "cuda" else clock
    timer = StepTimer(device, "wall" if clock == "cuda events" else clock)
    timed = trainer.args.max_steps - warmup - profile_steps
    if timed < 1:
        raise ValueError(f"max_steps={trainer.args.max_steps} leaves no timed step after {warmup} warm-up steps.")
    profiler = StepProfiler(device, warmup + timed, profile_steps)
    trainer.add_callback(timer)
    trainer.add_callback(profiler)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with live_memory(trainer.model) if live else contextlib.nullcontext() as tracker:
        output = trainer.train()
    steps = timer.milliseconds()[warmup : warmup + timed]
    result = {
        "ms_per_step": statistics.median(s[0] for s in steps),
        "ms_forward_backward": statistics.median(s[1] for s in steps),
        "ms_optimizer": statistics.median(s[2] for s in steps),
        "ms_steps": [round(s[0], 3) for s in steps],
        "clock": clock,
        "timed_steps": timed,
        "warmup_steps": warmup,
        "train_loss": output.training_loss,
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "max_memory_allocated": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "max_memory_reserved": torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
        "live_peak_bytes": tracker.peak if tracker is not None else None,
        "log": trainer.state.log_history[-2] if len(trainer.state.log_history) > 1 else None,
    }
    if profiler.table is not None:
        result["profile"] = profiler.table
        result["profile_steps"] = profile_steps
    return result


def release(device: torch.device) -> None:
    """Free what the last run left (its model, optimizer, cached blocks) before the next one is measured on a GPU.
    (On the CPU nothing is measured by an allocator, and a full collection costs half a second.)"""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def runs(num_layers: int, modes: tuple[str, ...] = MODES) -> list[tuple[str, str, list[int] | None]]:
    """(mode, placement, layers) of every row: lora once (all layers), fg-lora and fora in each placement."""
    out = [("lora", "all", None)] if "lora" in modes else []
    for placement, layers in placements(num_layers).items():
        out += [(mode, placement, layers) for mode in modes if mode != "lora"]
    return out


def measure_all(
    setting: Setting,
    device: torch.device,
    *,
    warmup: int,
    steps: int,
    checkpointing: tuple[bool, ...] = (False, True),
    modes: tuple[str, ...] = MODES,
    profile: Callable[[str, str, bool], int] = lambda mode, placement, ckpt: 0,
    live_memory: bool = False,
    clock: str = "wall",
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every row of the table; ``profile(mode, placement, checkpointing)`` gives the steps to profile after the
    timed ones; ``on_row`` sees each row as it is done (to print or save it)."""
    num_layers = setting.model_config().num_hidden_layers
    rows = []
    for ckpt in checkpointing:
        for mode, placement, layers in runs(num_layers, modes):
            profile_steps = profile(mode, placement, ckpt)
            with tempfile.TemporaryDirectory() as tmp:
                trainer = build_trainer(
                    setting,
                    device,
                    tmp,
                    mode=mode,
                    layers=layers,
                    checkpointing=ckpt,
                    max_steps=warmup + steps + profile_steps,
                )
                row = {"mode": mode, "placement": placement, "layers": layers, "checkpointing": ckpt}
                row.update(
                    time_steps(
                        trainer, device, warmup=warmup, profile_steps=profile_steps, live=live_memory, clock=clock
                    )
                )
                del trainer
            release(device)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


# ------------------------------------------------------------------------------------------------------- output
def find_row(rows: list[dict[str, Any]], mode: str, placement: str, checkpointing: bool) -> dict[str, Any] | None:
    placement = "all" if mode == "lora" else placement
    return next(
        (r for r in rows if (r["mode"], r["placement"], r["checkpointing"]) == (mode, placement, checkpointing)), None
    )


def _gib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / GIB:.2f}"


def _ms(row: dict[str, Any] | None) -> str:
    return "—" if row is None else f"{row['ms_per_step']:.1f}"


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    return "—" if a is None or b is None else f"**{a['ms_per_step'] / b['ms_per_step']:.3f}**"


def format_ratio_table(rows: list[dict[str, Any]]) -> str:
    """Issue 29's table: ms/step of lora (all layers), fg-lora and fora per placement, and the ratios."""
    lines = [
        "| checkpointing | placement | lora, all layers | fg-lora | fora | fora / lora | fora / fg-lora |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for ckpt in dict.fromkeys(r["checkpointing"] for r in rows):
        for placement in dict.fromkeys(r["placement"] for r in rows if r["placement"] != "all"):
            lora, fg, fora = (find_row(rows, m, placement, ckpt) for m in MODES)
            lines.append(
                f"| {'on' if ckpt else 'off'} | {placement} | {_ms(lora)} | {_ms(fg)} | {_ms(fora)} "
                f"| {_ratio(fora, lora)} | {_ratio(fora, fg)} |"
            )
    return "\n".join(lines)


def format_rows(rows: list[dict[str, Any]]) -> str:
    """Every row: the step split into forward + backward and optimizer, and the peak memory."""
    lines = [
        "| mode | layers | checkpointing | ms/step | fwd+bwd+clip ms | optimizer ms | max allocated GiB | "
        "max reserved GiB | live peak GiB | trainable |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['placement']} | {'on' if r['checkpointing'] else 'off'} | {r['ms_per_step']:.1f} "
            f"| {r['ms_forward_backward']:.1f} | {r['ms_optimizer']:.2f} | {_gib(r['max_memory_allocated'])} "
            f"| {_gib(r['max_memory_reserved'])} | {_gib(r['live_peak_bytes'])} | {r['trainable_parameters']:,} |"
        )
    return "\n".join(lines)


def describe(setting: Setting, device: torch.device, warmup: int, steps: int, clock: str = "wall") -> str:
    cfg = setting.model_config()
    where = (
        f"{torch.cuda.get_device_name()}, CUDA events"
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads, {'process CPU time' if clock == 'cpu' else 'wall time'}"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{setting.name}: {cfg.num_hidden_layers} layers, batch {setting.batch_size} x {setting.seq_len}, LoRA r "
        f"{setting.lora_r} on {', '.join(TARGETS)}; {where}, torch {torch.__version__}; median of {steps} steps "
        f"after {warmup} warm-up; load average {load:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--setting", choices=SETTINGS, help="default: cpu on the CPU, llama-3.2-3b on a GPU")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default: 3 on a GPU, 1 on the CPU)")
    parser.add_argument("--steps", type=int, help="timed steps (default: 10 on a GPU, 4 on the CPU)")
    parser.add_argument("--checkpointing", nargs="+", choices=("off", "on"), default=["off", "on"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--profile", type=int, default=0, help="steps to profile after the timed ones (every row)")
    parser.add_argument("--live-memory", action="store_true", help="count live tensor bytes (slows the steps)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 on a busy machine)")
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="on the CPU: wall time, or the process's CPU time (steadier on a shared machine); a GPU: CUDA events",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    setting = SETTINGS[args.setting or ("llama-3.2-3b" if gpu else "cpu")]
    warmup = args.warmup if args.warmup is not None else 3 if gpu else 1
    steps = args.steps if args.steps is not None else 10 if gpu else 4
    started = time.perf_counter()
    print(describe(setting, device, warmup, steps, args.clock), flush=True)
    rows = measure_all(
        setting,
        device,
        warmup=warmup,
        steps=steps,
        checkpointing=tuple(c == "on" for c in args.checkpointing),
        modes=tuple(args.modes),
        profile=lambda *_: args.profile,
        live_memory=args.live_memory,
        clock=args.clock,
        on_row=lambda r: print(
            f"  {r['mode']} {r['placement']} checkpointing {'on' if r['checkpointing'] else 'off'}: "
            f"{r['ms_per_step']:.1f} ms/step",
            file=sys.stderr,
            flush=True,
        ),
    )
    print()
    print(format_ratio_table(rows))
    print()
    print(format_rows(rows))
    for r in rows:
        if "profile" in r:
            print(f"\nprofile: {r['mode']}, {r['placement']}, checkpointing {r['checkpointing']}\n{r['profile']}")
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": setting.name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
