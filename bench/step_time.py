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
layer 0), each with activation checkpointing off and on. Beside that grid (:func:`measure_all`), :func:`measure_rows`
runs any :class:`Row`: with gradient accumulation (the paper trains with 4), on the paper's kind of data (the bundled
commonsense mix, a word-level tokenizer built from it, padded per batch up to ``seq_len``), and the frozen base alone
(:func:`frozen_base_ms`: no adapters, the inputs requiring grad, so the backward runs through every layer: the floor
a LoRA step adds to).

A step is timed from the Trainer's ``on_step_begin`` to its ``on_step_end`` callback (CUDA events on a GPU; on the
CPU ``perf_counter``, or with ``--clock cpu`` the process's CPU time, which a busy shared machine disturbs less),
split at ``on_pre_optimizer_step`` into forward + backward + clipping and the optimizer phase, and that at
``on_optimizer_step`` into the optimizer's own step and the rest (scheduler, ``zero_grad``, callbacks); the host's
share of the optimizer phase (the thread's CPU time: what issuing its work costs) beside it; the median over the
timed steps after the warm-up ones, each at a padded batch shape the process has run before (:func:`warm_shapes`,
for the data padded per batch). On a GPU, peak memory is
``torch.cuda.max_memory_allocated``/``max_memory_reserved`` over the whole ``train()`` (weights included); on the
CPU, ``--live-memory`` counts the peak of live tensor bytes with the storage tracker ``fora plan`` simulates
(:class:`fora_plugin.plan.memory.LiveTensorTracker`; it slows the step, so the times are then not worth reading).

    python bench/step_time.py                                  # CPU: the CPU setting, a few minutes on 2 cores
    python bench/step_time.py --threads 1 --clock cpu          # the same on a busy machine
    python bench/step_time.py --device cuda --setting llama-3.2-3b --json step_time.json   # the paper's table
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
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
DATA = ("random", "commonsense")  # fixed-length random token ids; the bundled commonsense mix, padded per batch
GIB = 2**30
COMMONSENSE = REPO / "example_configs" / "data" / "commonsense_mix_train.json"


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
    from fora_plugin.models import load_model_config
    from fora_plugin.plan import find_model_config

    return load_model_config(find_model_config("meta-llama/Llama-3.2-3B"))


SETTINGS = {
    # The CPU setting: 16 layers, hidden 512, vocabulary 8192, so that the decoder layers (not the head)
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


def commonsense_dataset(rows: int):
    """``rows`` prompt/completion rows of the bundled commonsense mix (repeated as needed), as the paper trains: the
    instruction (and input) as the prompt, the answer sentence as the completion."""
    from datasets import Dataset

    examples = json.loads(COMMONSENSE.read_text())
    picked = [examples[i % len(examples)] for i in range(rows)]
    return Dataset.from_dict(
        {
            "prompt": [e["instruction"] + (f"\n\n{e['input']}" if e["input"] else "") + "\n\n" for e in picked],
            "completion": [e["output"] for e in picked],
        }
    )


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of the commonsense mix's words (the most frequent ``vocab_size`` − 4; the rest are
    ``<unk>``), so that its rows have a real instruction's length in tokens (a character tokenizer would make every
    row ``seq_len`` long)."""
    from collections import Counter

    from conftest import SPECIAL_TOKENS
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    splitter = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    counts: Counter[str] = Counter()
    for e in json.loads(COMMONSENSE.read_text()):
        for field in ("instruction", "input", "output"):
            counts.update(word for word, _ in splitter.pre_tokenize_str(e[field]))
    words = [w for w, _ in counts.most_common(vocab_size - len(SPECIAL_TOKENS))]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = splitter
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
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
    accumulation: int = 1,
    data: str = "random",
    fora_options: dict[str, Any] | None = None,
    sft_options: dict[str, Any] | None = None,
    **trainer_kwargs,
):
    """A FoRASFTTrainer as a user builds one: base model, LoraConfig, FoRAConfig; ``layers`` None scores them.

    ``model``: a built model or a model folder (SFTTrainer loads it with ``args.model_init_kwargs`` and
    ``trainer_kwargs`` such as ``quantization_config``); default: :func:`build_model`. ``accumulation``: gradient
    accumulation steps; ``data``: one of :data:`DATA`; ``fora_options``: more FoRAConfig fields (in mode lora, which
    is SFTTrainer's own, ``adapter_dtype="bfloat16"`` casts the LoRA weights to bf16 after the wrap, plain AdamW
    stepping them); ``sft_options``: more SFTConfig fields (``use_liger_kernel``, ``torch_compile``).
    """
    from conftest import char_tokenizer

    from fora_plugin import FoRAConfig, FoRASFTTrainer

    if data not in DATA:
        raise ValueError(f"data={data!r}: use one of {DATA}")
    extra = {"gradient_accumulation_steps": accumulation, **(sft_options or {})}
    fora_options = dict(fora_options or {})
    bf16_lora = mode == "lora" and fora_options.pop("adapter_dtype", "auto") == "bfloat16"
    if isinstance(model, str):
        extra["model_init_kwargs"] = {"dtype": setting.dtype}
    elif model is None:
        model = build_model(setting, device)
    vocab_size = setting.model_config().vocab_size
    batches = max(max_steps * accumulation, fisher_batches if layers is None and mode != "lora" else 0)
    rows = setting.batch_size * batches
    fora = FoRAConfig(mode=mode, layers=layers, fisher_batches=fisher_batches, seed=0, **fora_options)
    if data == "commonsense":
        # At least 64 rows: where seq_len is short (the tiny setting), most rows lose their completion to truncation.
        dataset, tokenizer = commonsense_dataset(max(rows, 64)), word_tokenizer(vocab_size)
    else:
        dataset, tokenizer = random_dataset(setting, rows, vocab_size), char_tokenizer()
    trainer = FoRASFTTrainer(
        model,
        sft_args(setting, device, output_dir, checkpointing=checkpointing, max_steps=max_steps, **extra),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(setting),
        fora_config=fora,
        **trainer_kwargs,
    )
    if bf16_lora:
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.to(torch.bfloat16)
    return trainer


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
        self.host: list[list[float]] = []  # the thread's CPU time at the optimizer phase's begin and end

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
        self.host.append([time.thread_time()])

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.marks[-1].append(self._mark())

    def on_step_end(self, args, state, control, **kwargs):
        self.marks[-1].append(self._mark())
        self.host[-1].append(time.thread_time())

    def elapsed(self, a: Any, b: Any) -> float:
        """Milliseconds from mark ``a`` to mark ``b`` (after a synchronisation on CUDA)."""
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def milliseconds(self) -> list[tuple[float, ...]]:
        """Per step: (whole step, forward + backward + clipping, the optimizer phase (optimizer step + scheduler +
        zero_grad + callbacks), the optimizer's own step, the host's CPU time in the optimizer phase)."""
        if self.cuda:
            torch.cuda.synchronize()
        ms = self.elapsed
        return [
            (ms(b, e), ms(b, o), ms(o, e), ms(o, s), (h1 - h0) * 1e3)
            for (b, o, s, e), (h0, h1) in zip(self.marks, self.host)
        ]


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
    from fora_plugin.plan.memory import LiveTensorTracker

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
        "ms_optimizer_step": statistics.median(s[3] for s in steps),
        "host_ms_optimizer": statistics.median(s[4] for s in steps),
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
        # cuBLAS keeps a workspace per stream and handle until told: freed, each row's peak starts from one baseline
        # (before empty_cache, which then returns their blocks too).
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------- batch shapes
# The padded batch shapes a kind of pass has run in this process: (device, setting, pass, shape). cuDNN builds its
# attention's execution plan, and cuBLAS chooses its kernels, once per shape and keep them for the process: a step at
# a shape no earlier pass ran pays for that, a later step at the same shape does not.
_WARM_SHAPES: set[tuple] = set()

# What TRL's compute_loss changes besides returning the loss: its training metrics and token count.
_TRL_LOSS_STATE = ("_metrics", "_total_train_tokens")


def train_batches(trainer) -> Iterator[dict[str, Any]]:
    """The trainer's batches in the order ``Trainer.train`` takes them: its dataloader's epochs one after another.
    A fresh dataloader repeats them: accelerate's seedable sampler shuffles epoch ``e`` from the seed plus ``e``."""
    loader = trainer.get_train_dataloader()
    if len(loader) == 0:
        raise ValueError(f"no batch of the training data survives truncation to {trainer.args.max_length} tokens")
    # As many epochs as the steps take (rows whose completion the truncation dropped are gone).
    return itertools.chain.from_iterable(itertools.repeat(loader))


def batch_shape(batch: dict[str, Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What sets a batch's kernels apart: each tensor's name and shape."""
    return tuple(sorted((key, tuple(value.shape)) for key, value in batch.items() if isinstance(value, torch.Tensor)))


def forward_backward(trainer, model: torch.nn.Module, batch: dict[str, Any], accumulation: int = 1) -> None:
    """One micro-batch as a training step runs it: readied as ``training_step`` does, TRL's loss under accelerate's
    autocast, the backward."""
    inputs = trainer._prepare_inputs(batch)
    with trainer.accelerator.autocast():
        loss = trainer.compute_loss(model, inputs) / accumulation
    loss.backward()


# FoRAConfig fields that set only how the optimizer steps: the forward and backward run the same kernels whatever they
# are.
OPTIMIZER_OPTIONS = ("cuda_graph", "cayley_solver", "cayley_iters", "qr_period")


def _kernel_options(options: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    return tuple(option for option in options if option[0] not in OPTIMIZER_OPTIONS)


def warm_shapes(
    trainer, model: torch.nn.Module, device: torch.device, key: tuple, *, batches: int, warmup: int
) -> int:
    """One untimed forward + backward of ``model`` on a batch of each padded shape among the first ``batches`` of
    :func:`train_batches` that no pass of ``key`` (device, setting, pass, and what else sets the kernels apart) has run
    in this process; returns how many. A compiled model's graphs are not warmed: ``torch.compile`` wraps the model in
    ``train()``, after this pass.

    Data padded per batch (the commonsense mix) has a new length at almost every step, and the first step at a length
    builds cuDNN's attention plans and cuBLAS's kernel choices for it: the warm-up steps, at other lengths, cannot
    absorb that, so the first such row in a process would pay it in its timed steps and the rows after it would not.
    With this pass first, every timed step runs at a shape the process has run before. Fixed-length data (one shape)
    is left to the first ``warmup`` batches, which run it. The random state, the model's gradients and TRL's metrics
    are left as they were: ``train()`` then runs as it would have.
    """
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        picked: dict[tuple, dict[str, Any]] = {}
        for batch in itertools.islice(train_batches(trainer), batches):
            picked.setdefault(batch_shape(batch), batch)
        if len(picked) == 1 and warmup > 0:
            return 0
        new = [shape for shape in picked if (*key, shape) not in _WARM_SHAPES]
        if not new:
            return 0
        saved = {name: copy.deepcopy(getattr(trainer, name)) for name in _TRL_LOSS_STATE if hasattr(trainer, name)}
        training = model.training
        model.train()
        try:
            for shape in new:
                forward_backward(trainer, model, picked[shape])
                model.zero_grad(set_to_none=True)
        finally:
            model.train(training)
            for name, value in saved.items():
                setattr(trainer, name, value)
    _WARM_SHAPES.update((*key, shape) for shape in new)
    release(device)
    return len(new)


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured run: ``mode`` one of :data:`MODES` or ``"frozen"`` (the base alone, :func:`frozen_base`);
    ``placement`` "all" (lora, frozen) or a key of :func:`placements`; ``options`` and ``sft_options``: FoRAConfig and
    SFTConfig fields as (key, value) pairs; ``label``: what sets the row apart, for its table."""

    mode: str
    placement: str
    checkpointing: bool
    accumulation: int = 1
    data: str = "random"
    options: tuple[tuple[str, Any], ...] = ()
    sft_options: tuple[tuple[str, Any], ...] = ()
    label: str = ""


# The fields that set a Row apart besides mode, placement and checkpointing, with their defaults.
ROW_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Row)[3:]}


def runs(num_layers: int, modes: tuple[str, ...] = MODES) -> list[tuple[str, str, list[int] | None]]:
    """(mode, placement, layers) of every row: lora once (all layers), fg-lora and fora in each placement."""
    out = [("lora", "all", None)] if "lora" in modes else []
    for placement, layers in placements(num_layers).items():
        out += [(mode, placement, layers) for mode in modes if mode != "lora"]
    return out


def grid(
    setting: Setting,
    checkpointing: tuple[bool, ...] = (False, True),
    modes: tuple[str, ...] = MODES,
    options: dict[str, tuple] | None = None,
) -> list[Row]:
    """The rows of the table (:func:`runs` per checkpointing); ``options``: mode -> its rows' FoRAConfig options."""
    options = options or {}
    num_layers = setting.model_config().num_hidden_layers
    return [
        Row(mode, placement, ckpt, options=options.get(mode, ()))
        for ckpt in checkpointing
        for mode, placement, _ in runs(num_layers, modes)
    ]


def measure_all(
    setting: Setting,
    device: torch.device,
    *,
    warmup: int,
    steps: int,
    checkpointing: tuple[bool, ...] = (False, True),
    modes: tuple[str, ...] = MODES,
    options: dict[str, tuple] | None = None,
    profile: Callable[[str, str, bool], int] = lambda mode, placement, ckpt: 0,
    live_memory: bool = False,
    clock: str = "wall",
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every row of the table; ``options``: mode -> its rows' FoRAConfig options; ``profile(mode, placement,
    checkpointing)`` gives the steps to profile after the timed ones; ``on_row`` sees each row as it is done (to print
    or save it)."""
    return measure_rows(
        setting,
        device,
        grid(setting, checkpointing, modes, options),
        warmup=warmup,
        steps=steps,
        profile=lambda row: profile(row.mode, row.placement, row.checkpointing),
        live_memory=live_memory,
        clock=clock,
        on_row=on_row,
    )


def measure_rows(
    setting: Setting,
    device: torch.device,
    rows: list[Row],
    *,
    warmup: int,
    steps: int,
    profile: Callable[[Row], int] = lambda row: 0,
    live_memory: bool = False,
    clock: str = "wall",
    on_row: Callable[[dict[str, Any]], None] | None = None,
    errors: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Each of ``rows`` measured in turn (see :func:`measure_all` for ``profile`` and ``on_row``). With ``errors`` (a
    list), a row that raises is appended there (its fields and its traceback's last lines) and the others still run;
    without, the error propagates."""
    results = []
    for row in rows:
        try:
            result = _measure_row(setting, device, row, warmup, steps, profile(row), live_memory, clock)
        except Exception as error:
            if errors is None:
                raise
            tail = traceback.format_exc(limit=-6)[-3000:]
            errors.append(
                {**dataclasses.asdict(row), "exception": type(error).__name__, "message": str(error), "error": tail}
            )
            result = None
        # Released here after every row, not inside the row or the except block: while its error unwinds, the
        # traceback's frames still hold a failed row's trainer and model, and the next row's peak would count them.
        release(device)
        if result is None:
            continue
        results.append(result)
        if on_row is not None:
            on_row(result)
    return results


def _measure_row(
    setting: Setting,
    device: torch.device,
    row: Row,
    warmup: int,
    steps: int,
    profile_steps: int,
    live_memory: bool,
    clock: str,
) -> dict[str, Any]:
    from fora_plugin.training import checkpoint_as_in_training

    num_layers = setting.model_config().num_hidden_layers
    layers = placements(num_layers)[row.placement] if row.placement in placements(num_layers) else None
    result = {**dataclasses.asdict(row), "layers": layers}
    with tempfile.TemporaryDirectory() as tmp:
        common = dict(checkpointing=row.checkpointing, accumulation=row.accumulation, data=row.data)
        if row.mode == "frozen":
            result.update(frozen_base(setting, device, tmp, warmup=warmup, steps=steps, clock=clock, **common))
        else:
            trainer = build_trainer(
                setting,
                device,
                tmp,
                mode=row.mode,
                layers=layers,
                max_steps=warmup + steps + profile_steps,
                fora_options=dict(row.options),
                sft_options=dict(row.sft_options),
                **common,
            )
            # Checkpointed as train() will be: the warm pass must not hold every layer's activations where the
            # timed steps do not (the memory a checkpointed row is run for).
            checkpoint_as_in_training(trainer)
            shapes = warm_shapes(
                trainer,
                trainer.model,
                device,
                # A row's options change its kernels (Liger's Triton kernels, bf16 adapters' products): a shape warm
                # for one set of options is cold for another. The optimizer's options change none.
                (str(device), setting.name, "adapters", _kernel_options(row.options), row.sft_options),
                batches=(warmup + steps + profile_steps) * row.accumulation,
                warmup=warmup * row.accumulation,
            )
            timed = time_steps(
                trainer, device, warmup=warmup, profile_steps=profile_steps, live=live_memory, clock=clock
            )
            result.update(timed, shape_warmup=shapes)
            del trainer
    return result


def frozen_base(
    setting: Setting,
    device: torch.device,
    output_dir: str,
    *,
    checkpointing: bool,
    accumulation: int,
    data: str,
    warmup: int,
    steps: int,
    clock: str = "wall",
) -> dict[str, Any]:
    """The floor a LoRA step adds to: the base model's forward and backward with no adapter, its inputs requiring
    grad so that the backward runs through every layer, through the trainer's own batches, loss (TRL's) and autocast,
    as many micro-batches a step as ``accumulation``. No optimizer: ms per step is forward + backward."""
    from fora_plugin.training import checkpoint_as_in_training

    trainer = build_trainer(
        setting,
        device,
        output_dir,
        mode="lora",
        layers=None,
        checkpointing=checkpointing,
        max_steps=warmup + steps,
        accumulation=accumulation,
        data=data,
    )
    model = trainer.model
    model.requires_grad_(False)
    model.get_base_model().enable_input_require_grads()
    checkpoint_as_in_training(trainer)
    model.train()
    timer = StepTimer(device, "wall" if device.type == "cuda" else clock)
    batches = train_batches(trainer)
    marks = []
    with model.disable_adapter():
        shapes = warm_shapes(
            trainer,
            model,
            device,
            (str(device), setting.name, "frozen base"),
            batches=(warmup + steps) * accumulation,
            warmup=warmup * accumulation,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup + steps):
            begin = timer._mark()
            for _ in range(accumulation):
                forward_backward(trainer, model, next(batches), accumulation)
            marks.append((begin, timer._mark()))
    if device.type == "cuda":
        torch.cuda.synchronize()
    timed = [timer.elapsed(begin, end) for begin, end in marks[warmup:]]
    result = {
        "ms_per_step": statistics.median(timed),
        "ms_forward_backward": statistics.median(timed),
        "ms_optimizer": 0.0,
        "ms_optimizer_step": 0.0,
        "host_ms_optimizer": 0.0,
        "clock": "cuda events" if device.type == "cuda" else clock,
        "timed_steps": steps,
        "warmup_steps": warmup,
        "trainable_parameters": 0,
        "max_memory_allocated": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "max_memory_reserved": torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
        "live_peak_bytes": None,
        "shape_warmup": shapes,
    }
    del trainer, model
    return result


# ------------------------------------------------------------------------------------------------------- output
def find_row(
    rows: list[dict[str, Any]], mode: str, placement: str, checkpointing: bool, **fields: Any
) -> dict[str, Any] | None:
    """The first row of ``mode`` (lora and frozen: all layers), ``placement`` and ``checkpointing`` whose other
    :class:`Row` fields given in ``fields`` have those values."""
    placement = "all" if mode in ("lora", "frozen") else placement
    for r in rows:
        if (r["mode"], r["placement"], r["checkpointing"]) != (mode, placement, checkpointing):
            continue
        # A row read back from JSON holds lists where it had tuples.
        if all(_plain(r.get(key, ROW_DEFAULTS[key])) == _plain(value) for key, value in fields.items()):
            return r
    return None


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _gib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / GIB:.2f}"


def _ms(row: dict[str, Any] | None) -> str:
    return "—" if row is None else f"{row['ms_per_step']:.1f}"


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    return "—" if a is None or b is None else f"**{a['ms_per_step'] / b['ms_per_step']:.3f}**"


def format_ratio_table(rows: list[dict[str, Any]]) -> str:
    """The step-time table: ms/step of lora (all layers), fg-lora and fora per placement, and the ratios; a line per
    kind of row (data, accumulation, options) besides checkpointing and placement, and the frozen base's where
    measured."""
    lines = [
        "| checkpointing | placement | row | frozen base | lora, all layers | fg-lora | fora | fora / lora "
        "| fora / fg-lora |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    kinds = {json.dumps(_plain(_kind(r))): r for r in rows}
    for ckpt in dict.fromkeys(r["checkpointing"] for r in rows):
        for example in kinds.values():
            fields = _kind(example)
            frozen = find_row(rows, "frozen", "all", ckpt, **fields)
            for placement in dict.fromkeys(r["placement"] for r in rows if r["placement"] != "all"):
                lora, fg, fora = (find_row(rows, m, placement, ckpt, **fields) for m in MODES)
                if lora is None and fg is None and fora is None:
                    continue
                lines.append(
                    f"| {'on' if ckpt else 'off'} | {placement} | {_what(example)} | {_ms(frozen)} | {_ms(lora)} "
                    f"| {_ms(fg)} | {_ms(fora)} | {_ratio(fora, lora)} | {_ratio(fora, fg)} |"
                )
    return "\n".join(lines)


def _kind(r: dict[str, Any]) -> dict[str, Any]:
    """What a row is besides mode, placement and checkpointing, for the lines of a table: its Row fields but the
    FoRAConfig options (which differ by mode within a line: fora's captured step on a GPU)."""
    return {key: r.get(key, default) for key, default in ROW_DEFAULTS.items() if key != "options"}


def _what(r: dict[str, Any]) -> str:
    """The row's data, accumulation and label, where they differ from the default rows'."""
    parts = [r.get("label") or ""]
    if r.get("data", "random") != "random":
        parts.append(f"{r['data']} data")
    if r.get("accumulation", 1) != 1:
        parts.append(f"accumulation {r['accumulation']}")
    return ", ".join(p for p in parts if p) or "—"


def format_rows(rows: list[dict[str, Any]]) -> str:
    """Every row: the step split into forward + backward and the optimizer phase (its optimizer step apart, and the
    host's share), and the peak memory."""
    lines = [
        "| mode | layers | checkpointing | row | ms/step | fwd+bwd+clip ms | optimizer phase ms | its optimizer.step "
        "ms | its host ms | max allocated GiB | max reserved GiB | live peak GiB | trainable |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['placement']} | {'on' if r['checkpointing'] else 'off'} | {_what(r)} "
            f"| {r['ms_per_step']:.1f} | {r['ms_forward_backward']:.1f} | {r['ms_optimizer']:.2f} "
            f"| {r.get('ms_optimizer_step', 0.0):.2f} | {r.get('host_ms_optimizer', 0.0):.2f} "
            f"| {_gib(r['max_memory_allocated'])} | {_gib(r['max_memory_reserved'])} | {_gib(r['live_peak_bytes'])} "
            f"| {r['trainable_parameters']:,} |"
        )
    return "\n".join(lines)


def format_optimizer_phase(rows: list[dict[str, Any]]) -> str:
    """The optimizer phase of fora against fg-lora's on the same layers (bench/gpu.py's GOALS hold the goal)."""
    lines = [
        "| checkpointing | placement | row | fg-lora phase ms | fora phase ms | fora − fg-lora ms "
        "| fora optimizer.step ms | fora host ms |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for fora in rows:
        if fora["mode"] != "fora":
            continue
        fg = find_row(rows, "fg-lora", fora["placement"], fora["checkpointing"], **_kind(fora))
        if fg is None:
            continue
        extra = fora["ms_optimizer"] - fg["ms_optimizer"]
        lines.append(
            f"| {'on' if fora['checkpointing'] else 'off'} | {fora['placement']} | {_what(fora)} "
            f"| {fg['ms_optimizer']:.2f} | {fora['ms_optimizer']:.2f} | {extra:+.2f} "
            f"| {fora['ms_optimizer_step']:.2f} | {fora['host_ms_optimizer']:.2f} |"
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
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps (default: 1)")
    parser.add_argument("--data", choices=DATA, default="random", help="random token ids, or the commonsense mix")
    parser.add_argument("--frozen-base", action="store_true", help="also time the frozen base alone (the floor)")
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
    checkpointing = tuple(c == "on" for c in args.checkpointing)
    grid = [
        Row(mode, placement, ckpt, accumulation=args.accumulation, data=args.data)
        for ckpt in checkpointing
        for mode, placement, _ in runs(setting.model_config().num_hidden_layers, tuple(args.modes))
    ]
    if args.frozen_base:
        grid += [Row("frozen", "all", c, accumulation=args.accumulation, data=args.data) for c in checkpointing]
    rows = measure_rows(
        setting,
        device,
        grid,
        warmup=warmup,
        steps=steps,
        profile=lambda row: args.profile if row.mode != "frozen" else 0,
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
    print()
    print(format_optimizer_phase(rows))
    for r in rows:
        if "profile" in r:
            print(f"\nprofile: {r['mode']}, {r['placement']}, checkpointing {r['checkpointing']}\n{r['profile']}")
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": setting.name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
