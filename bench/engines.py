"""The distributed engines on one GPU: ``fora train`` under DeepSpeed ZeRO-2, ZeRO-3, QFoRA with ZeRO-2 and
FSDP2, each launched by the docs' own line (docs/distributed.md) with world size 1, and DeepSpeed ZeRO-2 with two ranks
on the one device over gloo, against the same ``fora train`` in a single process (same seed, same data order).

Every run goes through bench/engine_probe.py (``-m engine_probe`` in place of ``-m fora_plugin.cli``; the rest of the
line is the user's). Per run: the loss of each of the 10 steps and the saved ``lora_B`` against the single process's,
max ‖BᵀB − I‖, ms per step, ``max_memory_allocated`` beside ``fora plan``'s figure for the same config, host syncs per
optimizer step and per log, and the saved adapter reloaded by ``PeftModel.from_pretrained``.

On a GPU: LLaMA-3.2-3B's config (bundled) with 4 of its 28 layers, random bf16 weights, batch 8 x 256, 10 steps
(the launches, not the steps, take the time: see docs/gpu.md). On the CPU (``--tiny``): a 4-layer Llama of hidden 64,
fp32, CPU ranks over gloo with ``DS_ACCELERATOR=cpu``, as the tests run DeepSpeed and FSDP2.

    python bench/engines.py --device cuda --out "$OUT"     # also a section of bench/gpu.py
    python bench/engines.py --device cpu --tiny            # CI runs it (tests/test_bench_gpu.py)
    python bench/engines.py --measured RUN.json            # on any host: plan RUN's engine runs, beside its memory
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch


BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TESTS = REPO / "tests"
EXAMPLES = REPO / "example_configs"
COMMONSENSE = "example_configs/commonsense_llama3_8b.yaml"  # the paper's config, the docs' multi-GPU example
QFORA = "example_configs/qfora_llama3_8b.yaml"  # the shipped QFoRA config
ALPACA = EXAMPLES / "data" / "alpaca_en_demo.json"
GIB = 2**30

STEPS = 10
# The loss and lora_B of an engine against the single process: relative, per step / per matrix (‖ΔB‖_F / ‖B‖_F).
# fp32: the engines only reorder sums (DeepSpeed's flat buffers, the all-reduce, the clipping norm over buckets), so
# float32's rounding (6e-8 per operation, compounded over 10 steps) stays far below 1e-5. bf16: the engines hold the
# LoRA weights (ZeRO-3 from their creation) and their gradients in bf16 where the single process keeps them in fp32
# under autocast, so each step differs by bf16's rounding (unit roundoff 2^-8): two of them, 2^-7.
TOLERANCE = {"fp32": 1e-5, "bf16": 2.0**-7}
GOALS = {"drift": 1e-3, "reload_logits": 1e-3, "plan": 0.10, "plan_single": 0.05, "syncs_per_step": 0, "per_log": 1}
# Seconds after which no further run starts (the rest are recorded as skipped): this section's share of the one
# 10-minute GPU call. On the H100 (2026-11-28) the single-process runs (37 s) and the four one-rank engines (147 s)
# ended about 190 s into the section, past the 170 s then, so the gloo row, the last, was skipped: now 240 s.
BUDGET_S = {"cuda": 240.0, "cpu": 1200.0}
# Seconds one launch may take before it is stopped (a hung collective must not eat the call): several times what one
# takes (about 20 s on a GPU machine, 30 s on a 2-core CPU).
LAUNCH_TIMEOUT_S = {"cuda": 120.0, "cpu": 600.0}
# Past the budget, what a launch started before it may still take (then it is stopped): a launch takes 15-30 s.
GRACE_S = {"cuda": 30.0, "cpu": 600.0}
# How long a stopped launch is given to end after each of SIGTERM and SIGKILL.
KILL_WAIT_S = 15.0


def overrun_s(device_type: str) -> float:
    """The most a launch started just before the budget ends can add past it: its grace, then SIGTERM and SIGKILL."""
    return GRACE_S[device_type] + 2 * KILL_WAIT_S


# Learning rates above the shipped configs' (2e-4, 1e-3): 10 steps then move lora_B by several times the bf16
# tolerance (by about 0.4 x fora_lr_stiefel of its norm in the tiny CPU mode), so that a wrong or missing lora_B step
# cannot pass as bf16 rounding.
LEARNING_RATES = ("--learning_rate", "1e-3", "--fora_lr_stiefel", "0.1")


@dataclasses.dataclass(frozen=True)
class Scale:
    """The model, batch and data of the runs: the GPU's or the tiny CPU mode's."""

    name: str
    batch: int
    max_length: int
    rows: int
    tiny: bool


GPU = Scale("LLaMA-3.2-3B config, 4 of 28 layers, random bf16 weights", batch=8, max_length=256, rows=192, tiny=False)
TINY = Scale("Llama 4 layers, hidden 64, fp32 (tiny CPU mode)", batch=2, max_length=256, rows=64, tiny=True)


@dataclasses.dataclass(frozen=True)
class Reference:
    """A single-process ``fora train`` (no launcher) that engine runs are compared with."""

    config: str
    fp32: bool = False  # fp32 on the GPU too (the CPU runs are all fp32)
    micro_batches: int = 1  # gradient accumulation: the micro-batches of several ranks, in one process


@dataclasses.dataclass(frozen=True)
class Engine:
    """One engine run: its launcher, the config it trains, its engine config, its reference."""

    name: str
    launcher: str  # "accelerate" (--config_file engine_config) or "torchrun" (--deepspeed engine_config)
    engine_config: str
    config: str
    reference: str  # a key of REFERENCES
    ranks: int = 1  # >1: that many ranks on the one device, over gloo (one torchrun "node" each)
    fp32: bool = False

    def plan_flags(self) -> list[str]:
        """The engine as `fora plan` takes it: the DeepSpeed JSON, or FSDP2 for the accelerate FSDP config."""
        if self.engine_config.endswith(".json"):
            return ["--deepspeed", self.engine_config]
        if "fsdp" in self.engine_config:
            return ["--fsdp", "full_shard", "--fsdp_config", json.dumps({"version": 2})]
        return ["--deepspeed", "example_configs/deepspeed/zero2.json"]  # accelerate/zero2_8gpu.yaml points at it


REFERENCES = {
    "single": Reference(COMMONSENSE),
    "qfora": Reference(QFORA),
    "single, 2 micro-batches": Reference(COMMONSENSE, fp32=True, micro_batches=2),
}
ENGINES = (
    Engine("ZeRO-2", "accelerate", "example_configs/accelerate/zero2_8gpu.yaml", COMMONSENSE, "single"),
    Engine("ZeRO-3", "torchrun", "example_configs/deepspeed/zero3.json", COMMONSENSE, "single"),
    Engine("QFoRA, ZeRO-2", "torchrun", "example_configs/deepspeed/zero2_qfora.json", QFORA, "qfora"),
    Engine("FSDP2", "accelerate", "example_configs/accelerate/fsdp2_8gpu.yaml", COMMONSENSE, "single"),
    Engine(
        "ZeRO-2, 2 ranks on one device, gloo",
        "torchrun",
        "example_configs/deepspeed/zero2.json",
        COMMONSENSE,
        "single, 2 micro-batches",
        ranks=2,
        fp32=True,
    ),
)


# ------------------------------------------------------------------------------------------------------ setup
def build_model(scale: Scale, device: torch.device, folder: Path, weights: bool = True) -> None:
    """The base model (random weights, seed 0) and the tests' character tokenizer, saved to ``folder``; without
    ``weights``, its config.json alone (what `fora plan` reads)."""
    sys.path.insert(0, str(TESTS))
    from conftest import char_tokenizer, tiny_llama_config
    from transformers import AutoModelForCausalLM

    from fora_plugin.models import load_model_config
    from fora_plugin.plan import find_model_config

    if scale.tiny:
        config = tiny_llama_config(4, vocab_size=99, hidden_size=64, intermediate_size=128)
        config.max_position_embeddings = 1024
        dtype = torch.float32
    else:
        config = load_model_config(find_model_config("meta-llama/Llama-3.2-3B"))
        config.num_hidden_layers = 4
        dtype = torch.bfloat16
    char_tokenizer().save_pretrained(folder)
    if not weights:
        config.dtype = dtype
        config.save_pretrained(folder)
        return
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    del model


def write_data(scale: Scale, path: Path) -> None:
    """Alpaca rows of the bundled sample that fill ``max_length`` tokens of the character tokenizer (one per
    character) with a prompt of at most 200: every batch is ``batch x max_length``, as `fora plan` plans it."""
    from fora_plugin.data import alpaca_to_prompt_completion

    rows = []
    for row in json.loads(ALPACA.read_text()):
        pair = alpaca_to_prompt_completion(row)
        if len(pair["prompt"]) <= 200 and len(pair["prompt"]) + len(pair["completion"]) >= scale.max_length + 50:
            rows.append(row)
    if len(rows) < scale.rows:
        raise RuntimeError(f"{ALPACA} has {len(rows)} rows long enough, {scale.rows} wanted")
    path.write_text(json.dumps(rows[: scale.rows]))


def overrides(scale: Scale, cpu: bool, fp32: bool, model: Path, data: Path, out: Path, micro_batches: int = 1):
    """The command-line keys every run adds to the shipped config: the model, data, output, 10 steps, a log each."""
    keys = [
        "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
        "--max_steps", str(STEPS), "--per_device_train_batch_size", str(scale.batch),
        "--gradient_accumulation_steps", str(micro_batches), "--fora_fisher_batches", str(2 * micro_batches),
        "--max_length", str(scale.max_length), "--logging_steps", "1", "--save_strategy", "no",
        "--disable_tqdm", "true", "--report_to", "none", *LEARNING_RATES,
    ]  # fmt: skip
    if cpu:
        keys += ["--use_cpu", "true", "--bf16", "false", "--dtype", "float32"]
    elif fp32:
        keys += ["--bf16", "false", "--dtype", "float32"]
    return keys


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def child_env(device: torch.device, out: Path, **extra: str) -> dict[str, str]:
    paths = [str(REPO), str(BENCH), str(TESTS), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "ENGINE_PROBE_OUT": str(out), **extra}
    if device.type == "cpu":
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def engine_commands(engine: Engine, train: list[str], device: torch.device) -> list[list[str]]:
    """The launch line(s): the docs' own, with ``-m engine_probe`` for ``-m fora_plugin.cli`` (one per torchrun
    "node" when several ranks share the device: each is LOCAL_RANK 0, so each takes the one GPU)."""
    probe = ["-m", "engine_probe", "train", *train]
    port = free_port()
    if engine.launcher == "accelerate":
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", engine.engine_config]
        return [[*launch, "--num_processes", "1", "--main_process_port", port, *probe]]
    deepspeed = ["--deepspeed", engine.engine_config]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if engine.ranks == 1:
        return [[*torchrun, "--nproc_per_node", "1", "--master_port", port, *probe, *deepspeed]]
    nodes = ["--nnodes", str(engine.ranks), "--nproc_per_node", "1", "--master_addr", "127.0.0.1"]
    nodes += ["--master_port", port]
    return [[*torchrun, *nodes, "--node_rank", str(rank), *probe, *deepspeed] for rank in range(engine.ranks)]


def shown(command: list[str]) -> str:
    """A launch line as a user types it."""
    text = " ".join(command).replace(f"{sys.executable} -m accelerate.commands.launch", "accelerate launch")
    return text.replace(f"{sys.executable} -m torch.distributed.run", "torchrun").replace(sys.executable, "python")


def launch(commands: list[list[str]], env: dict[str, str], log: Path, timeout: float) -> tuple[int, float, str]:
    """Run the processes of one launch together; (worst exit code, seconds, the end of their output)."""
    started = time.perf_counter()
    logs = [log.with_suffix(f".{i}.log") for i in range(len(commands))]
    processes = []
    for command, path in zip(commands, logs):
        with open(path, "w") as file:
            # Its own session, stopped as a whole at the timeout: SIGTERM first, on which torchrun and accelerate stop
            # their workers (each in a session of its own), then SIGKILL.
            process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=file, stderr=subprocess.STDOUT, start_new_session=True
            )
            processes.append(process)
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(1.0, timeout - (time.perf_counter() - started))))
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for other in processes:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(other.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=KILL_WAIT_S)
            process.wait()
            codes.append(124)
    tail = "\n".join(path.read_text(errors="replace")[-3000:] for path in logs)
    return max(codes), time.perf_counter() - started, tail


# --------------------------------------------------------------------------------------------------- results
def read_run(out: Path) -> dict[str, Any]:
    """What a probed run left: probe.json, the in-process LoRA weights, the saved adapter, the selection."""
    from safetensors.torch import load_file

    run = json.loads((out / "probe.json").read_text())
    run["in_process"] = torch.load(out / "lora.pt", weights_only=True)
    run["in_process_begin"] = torch.load(out / "lora_begin.pt", weights_only=True)
    run["saved"] = load_file(out / "adapter_model.safetensors")
    run["adapter_config"] = json.loads((out / "adapter_config.json").read_text())
    return run


def lora_b(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in weights.items() if ".lora_B." in k}


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest ‖a − b‖_F / ‖b‖_F over the matrices both hold (inf when they hold different ones)."""
    if set(a) != set(b):
        return math.inf
    return max((a[k].float() - b[k].float()).norm().item() / b[k].float().norm().item() for k in b)


def step_losses(run: dict[str, Any]) -> list[float]:
    return [float(x) for x in run["losses"]]


def precision(*runs: dict[str, Any]) -> str:
    """ "fp32" where every run computed and kept lora_B in float32, else "bf16" (QFoRA's adapters are bf16 on a CPU
    too)."""
    fp32 = all(not run["bf16"] and run["lora_b_dtype"] == "torch.float32" for run in runs)
    return "fp32" if fp32 else "bf16"


def compare(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """An engine run against its single-process reference."""
    kind = precision(run, reference)
    tolerance = TOLERANCE[kind]
    losses, ref_losses = step_losses(run), step_losses(reference)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    b_end, ref_end = lora_b(run["saved"]), lora_b(reference["saved"])
    b_error = relative(b_end, ref_end)
    start_error = relative(lora_b(run["in_process_begin"]), lora_b(reference["in_process_begin"]))
    moved = relative(ref_end, lora_b(reference["in_process_begin"]))
    return {
        "precision": kind,
        "tolerance": tolerance,
        "same_layers": run["chosen_layers"] == reference["chosen_layers"],
        "loss_error": loss_error,
        "lora_b_error": b_error,
        "lora_b_start_error": start_error,
        "lora_b_moved": moved,
        "ok": run["chosen_layers"] == reference["chosen_layers"] and loss_error <= tolerance and b_error <= tolerance,
    }


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """ms per step, syncs, drift: the run's own figures (the steps that set the optimizer up counted apart)."""
    from fora_plugin.stiefel import orthogonality_error

    setup = run["setup_steps"]
    timed = run["ms_steps"][setup:] or run["ms_steps"]
    steps = run["step_syncs"]
    drifts = [log["fora/max_orthogonality_error"] for log in run["logs"] if "fora/max_orthogonality_error" in log]
    return {
        "ms_per_step": statistics.median(timed),
        "syncs_first_steps": [s["total"] for s in steps[:setup]],
        "syncs_per_step": max((s["total"] for s in steps[setup:]), default=None),
        "fora_syncs_per_step": max((s["inner"] for s in steps[setup:]), default=None),
        "optimizer_steps_counted": len(steps),
        "syncs_per_log": max((s["total"] for s in run["log_syncs"]), default=None),
        "sync_sites": sorted({w for s in steps[setup:] + run["log_syncs"] for w in s["where"]}),
        "max_drift_logged": max(drifts) if drifts else None,
        "max_drift_saved": max(orthogonality_error(b).item() for b in lora_b(run["saved"]).values()),
    }


def reload_check(runs: dict[str, dict[str, Any]], model_dir: Path, device: torch.device, dtype: torch.dtype):
    """Each saved adapter through ``PeftModel.from_pretrained`` against the base with the run's in-process LoRA
    weights merged by hand (W + scaling · B A), in fp32 on the weights as saved: Δlogit, and the saved tensors
    against the in-process ones."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    vocab = base.config.vocab_size
    ids = torch.randint(3, min(vocab, 99), (2, 48), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    checks = {}
    for name, run in runs.items():
        out = Path(run["output_dir"])
        config = run["adapter_config"]
        scaling = config["lora_alpha"] / config["r"]
        saved_vs_in_process = max(
            (run["saved"][k].float() - v.float()).abs().max().item() if k in run["saved"] else math.inf
            for k, v in run["in_process"].items()
        )
        with torch.no_grad():
            model = PeftModel.from_pretrained(base, out).eval()
            reloaded = model(input_ids=ids).logits
            base = model.unload()
            kept = {}
            for key, a in run["in_process"].items():
                if ".lora_A." not in key:
                    continue
                b = run["in_process"][key.replace(".lora_A.", ".lora_B.")]
                module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
                weight = base.get_submodule(module).weight
                kept[module] = weight.detach().clone()
                weight += scaling * (b.to(device, torch.float32) @ a.to(device, torch.float32))
            merged = base(input_ids=ids).logits
            for module, weight in kept.items():
                base.get_submodule(module).weight.copy_(weight)
        checks[name] = {
            "saved_vs_in_process": saved_vs_in_process,
            "saved_dtype": str(next(iter(run["saved"].values())).dtype),
            "reload_vs_merged": (reloaded - merged).abs().max().item(),
            "reload_vs_base": (reloaded - base_logits).abs().max().item(),
        }
    del base
    return checks


def start_plan(
    engine: Engine | None, config: str, train: list[str], out: Path, ranks: int, layers: list[int] | None = None
) -> subprocess.Popen:
    """`fora plan` of the run's config and keys (the layers it chose: from its selection record, or ``layers``), in
    the background on the CPU, as the user runs it."""
    from fora_plugin.selection import SCORES_FILE

    keys = [k for k in train]
    if layers is None:
        keys += ["--fora_scores_path", str(out / SCORES_FILE)]
    else:
        keys += ["--fora_layers", *map(str, layers)]
    keys += engine.plan_flags() if engine is not None else []
    command = [sys.executable, "-m", "fora_plugin.cli", "plan", config, *keys, "--gpus", str(ranks)]
    command += ["--output", str(out / "plan")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    log = open(out / "plan.log", "w")  # noqa: SIM115  (closed when the process is collected)
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    process.log = log
    return process


def collect_plan(process: subprocess.Popen, out: Path, timeout: float) -> dict[str, Any]:
    try:
        process.wait(timeout=max(1.0, timeout))  # past the budget a plan not done is not waited for
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    process.log.close()
    path = out / "plan" / "plan.json"
    if not path.exists():
        return {"error": (out / "plan.log").read_text(errors="replace")[-1500:]}
    plan = json.loads(path.read_text())
    phases = plan["phases"]["fora"]
    return {"step_bytes": phases["step"]["peak_bytes"], "engine": plan["engine"], "gpus": plan["gpus"]}


# ---------------------------------------------------------------------------------------------------------- run
def run_all(device: torch.device, scale: Scale, root: Path, log=print, budget_s: float | None = None) -> dict:
    """Every reference and engine run, their comparisons and the tables."""
    cpu = device.type == "cpu"
    budget_s = BUDGET_S[device.type] if budget_s is None else budget_s
    started = time.perf_counter()
    model_dir, data = root / "model", root / "data.json"
    build_model(scale, device, model_dir)
    write_data(scale, data)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    runs: dict[str, dict[str, Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    plans: dict[str, tuple[subprocess.Popen, Path]] = {}

    # The single-process runs, in one process one after the other (one import instead of three).
    spec, trains = [], {}
    for name, ref in REFERENCES.items():
        out = root / f"ref-{len(trains)}"
        trains[name] = overrides(scale, cpu, ref.fp32, model_dir, data, out, ref.micro_batches)
        spec.append({"out": str(out), "argv": ["train", ref.config, *trains[name]], "name": name})
    (root / "references.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "engine_probe", "--runs", str(root / "references.json")]
    log(f"  single-process runs: {shown(command)}")
    grace = GRACE_S[device.type]

    def timeout(scale: float = 1.0) -> float:
        # A launch's limit: its own, but never far past the budget (bench/gpu.py's call has a hard end).
        left = budget_s + grace - (time.perf_counter() - started)
        return max(10.0, min(scale * LAUNCH_TIMEOUT_S[device.type], left))

    code, seconds, tail = launch([command], child_env(device, root), root / "references", timeout(1.5))
    for entry in spec:
        name, out = entry["name"], Path(entry["out"])
        rows[name] = {"kind": "single process", "line": shown([sys.executable, "-m", "engine_probe", *entry["argv"]])}
        if (out / "probe.json").exists():
            runs[name] = {**read_run(out), "output_dir": str(out)}
            rows[name].update(status="ok", **summarize(runs[name]))
            plans[name] = (start_plan(None, REFERENCES[name].config, trains[name], out, 1), out)
        else:
            rows[name].update(status="error", error=tail[-4000:])
    log(f"  single-process runs: {seconds:.0f} s, exit {code}")

    for engine in ENGINES:
        row = rows[engine.name] = {"kind": engine.launcher, "ranks": engine.ranks}
        spent = time.perf_counter() - started
        if spent > budget_s:
            row.update(status="skipped", reason=f"skipped: the section's {budget_s:.0f} s budget is spent")
            continue
        out = root / engine.name.replace(",", "").replace(" ", "-")
        train = overrides(scale, cpu, engine.fp32, model_dir, data, out)
        commands = engine_commands(engine, [engine.config, *train], device)
        extra = {}
        if engine.ranks > 1:
            extra["ENGINE_PROBE_BACKEND"] = "gloo"
        if cpu and "fsdp" in engine.engine_config:
            extra["ENGINE_PROBE_FORCE_FSDP2"] = "1"
        row["line"] = shown(commands[0])
        code, seconds, tail = launch(commands, child_env(device, out, **extra), out.with_suffix(""), timeout())
        row["launch_seconds"] = seconds
        if code != 0 or not (out / "probe.json").exists():
            row.update(status="error", exit_code=code, error=tail[-4000:])
            log(f"  {engine.name}: exit {code} after {seconds:.0f} s")
            continue
        runs[engine.name] = {**read_run(out), "output_dir": str(out)}
        row.update(status="ok", **summarize(runs[engine.name]))
        if engine.reference in runs:
            row["against_reference"] = compare(runs[engine.name], runs[engine.reference])
        plans[engine.name] = (start_plan(engine, engine.config, train, out, engine.ranks), out)
        log(f"  {engine.name}: {seconds:.0f} s, {row['ms_per_step']:.1f} ms/step")

    reloads = reload_check(runs, model_dir, device, torch.float32)
    for name, check in reloads.items():
        rows[name]["reload"] = check
    for name, (process, out) in plans.items():
        rows[name]["plan"] = collect_plan(process, out, budget_s + grace - (time.perf_counter() - started))
    for name, run in runs.items():
        rows[name].update(
            {k: run.get(k) for k in ("world_size", "backend", "device", "deepspeed_stage", "fsdp_version")},
            bf16=run["bf16"],
            lora_b_dtype=run["lora_b_dtype"],
            lora_b_type=run["lora_b_type"],
            chosen_layers=run["chosen_layers"],
            losses=run["losses"],
            max_memory_allocated=run["max_memory_allocated"],
            max_memory_reserved=run["max_memory_reserved"],
            scoring_peak_bytes=run["scoring_peak_bytes"],
            fora_train_seconds=run["fora_train_seconds"],
        )
        plan = rows[name].get("plan", {})
        if plan.get("step_bytes") and run["max_memory_allocated"]:
            plan["error"] = plan["step_bytes"] / run["max_memory_allocated"] - 1
    result = {"scale": dataclasses.asdict(scale), "rows": rows, "seconds": time.perf_counter() - started}
    result["text"] = tables(result, device)
    return result


# -------------------------------------------------------------------------------------------------------- output
def fmt(value: float | None, spec: str = ".1e") -> str:
    return "—" if value is None else format(value, spec)


def gib(nbytes: int | None) -> str:
    return "—" if not nbytes else f"{nbytes / GIB:.2f}"


def tables(result: dict[str, Any], device: torch.device) -> str:
    rows = result["rows"]
    lines = [
        f"{result['scale']['name']}; batch {result['scale']['batch']} x {result['scale']['max_length']}, {STEPS} "
        f"steps, LoRA r 32 on q/k/v/up/down, K = 2 of 4 layers by Fisher scores; {result['seconds']:.0f} s.",
        "",
        "| run | ranks, backend, device | precision (lora_B) | layers | ms/step | max allocated GiB | plan GiB "
        "| plan / measured − 1 | syncs per optimizer step (FoRA's) | syncs per log | max ‖BᵀB − I‖ |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        if row.get("status") != "ok":
            continue
        plan = row.get("plan", {})
        error = plan.get("error") if isinstance(plan.get("error"), float) else None
        where = f"{row['world_size']}, {row['backend'] or '—'}, {row['device']}"
        if row["deepspeed_stage"]:
            where += f", ZeRO-{row['deepspeed_stage']}"
        if row["fsdp_version"]:
            where += f", FSDP{row['fsdp_version']}"
        syncs = f"{fmt(row['syncs_per_step'], 'd')} ({fmt(row['fora_syncs_per_step'], 'd')})"
        lines.append(
            f"| {name} | {where} | {'bf16' if row['bf16'] else 'fp32'} ({row['lora_b_dtype'].removeprefix('torch.')}) "
            f"| {row['chosen_layers']} | {row['ms_per_step']:.1f} | {gib(row['max_memory_allocated'])} "
            f"| {gib(plan.get('step_bytes'))} | {fmt(error and 100 * error, '+.1f')}{'%' if error else ''} "
            f"| {syncs} | {fmt(row['syncs_per_log'], 'd')} | {fmt(row['max_drift_logged'])} |"
        )
    lines += [
        "",
        "| engine | against | tolerance | max \\|Δloss\\| / loss | max ‖ΔB‖ / ‖B‖ | lora_B moved (reference) "
        "| same start | saved = in-process | reload vs merged, max \\|Δlogit\\| | reload vs base | verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for engine in ENGINES:
        row = rows.get(engine.name, {})
        if row.get("status") != "ok":
            reason = row.get("reason") or (row.get("error") or "").strip().splitlines()[-1:]
            lines.append(f"| {engine.name} | {engine.reference} | | | | | | | | | {row.get('status')}: {reason} |")
            continue
        c, reload = row.get("against_reference"), row.get("reload", {})
        if c is None:
            lines.append(f"| {engine.name} | {engine.reference} (did not run) | | | | | | | | | — |")
            continue
        verdict = "equal" if c["ok"] else "DIFFERENT" if c["same_layers"] else "other layers chosen"
        lines.append(
            f"| {engine.name} | {engine.reference} | {c['tolerance']:.1e} ({c['precision']}) | {c['loss_error']:.1e} "
            f"| {c['lora_b_error']:.1e} | {c['lora_b_moved']:.1e} | {c['lora_b_start_error']:.1e} "
            f"| {fmt(reload.get('saved_vs_in_process'))} | {fmt(reload.get('reload_vs_merged'))} "
            f"| {fmt(reload.get('reload_vs_base'), '.3f')} | {verdict} |"
        )
    lines += ["", "Launch lines (`-m engine_probe` in place of `-m fora_plugin.cli`):", ""]
    lines += [f"- {name}: `{row.get('line')}`" for name, row in rows.items()]
    for name, row in rows.items():
        if row.get("status") == "error":
            lines += ["", f"{name} failed:", "```", row["error"][-2500:], "```"]
        sites = row.get("sync_sites")
        if sites:
            lines += ["", f"{name}, where the syncs were made:", *[f"- {s}" for s in sites]]
    return "\n".join(lines)


def replan(measured: Path, root: Path, log=print, scale: Scale = GPU) -> dict[str, Any]:
    """`fora plan`, on this host, of every run of an earlier GPU run of this section (bench/gpu.py's JSON or
    engines.json) that measured its memory, beside its ``max_memory_allocated``: the check a GPU call's own plans
    did not finish, or a change of the plan checked against the GPU's figures without a GPU. Same configs and keys as
    the runs, the layers they chose given as ``fora_layers``."""
    data = json.loads(measured.read_text())
    section = data.get("sections", {}).get("engines", data)
    if "rows" not in section:
        raise SystemExit(f"--measured {measured}: no engines rows (status {section.get('status')!r})")
    root.mkdir(parents=True, exist_ok=True)
    model_dir, data_path = root / "model", root / "data.json"
    build_model(scale, torch.device("cpu"), model_dir, weights=False)
    write_data(scale, data_path)
    engines = {engine.name: engine for engine in ENGINES}
    plans, rows = {}, {}
    for name, row in section["rows"].items():
        if row.get("status") != "ok" or not row.get("max_memory_allocated"):
            continue
        engine = engines.get(name)
        reference = REFERENCES.get(name)
        if engine is None and reference is None:
            raise SystemExit(
                f"--measured {measured}: its run {name!r} is none of this bench's ({[*REFERENCES, *engines]}); plan "
                "it with `fora plan` and its own keys, or take a JSON of this version of bench/engines.py"
            )
        fp32, micro, config = (
            (engine.fp32, 1, engine.config) if engine else (reference.fp32, reference.micro_batches, reference.config)
        )
        out = root / name.replace(",", "").replace(" ", "-")
        out.mkdir()
        train = overrides(scale, False, fp32, model_dir, data_path, out, micro)
        ranks = engine.ranks if engine else 1
        plans[name] = (start_plan(engine, config, train, out, ranks, layers=row["chosen_layers"]), out)
        rows[name] = row
        plans[name][0].wait()  # one at a time: each plan takes the host's cores
        log(f"  planned {name}")
    comparisons = {}
    for name, (process, out) in plans.items():
        plan = collect_plan(process, out, 1.0)
        measured_bytes = rows[name]["max_memory_allocated"]
        goal = GOALS["plan_single"] if name in REFERENCES else GOALS["plan"]
        comparisons[name] = {
            "step_bytes": plan.get("step_bytes"),
            "measured_bytes": measured_bytes,
            "deviation": plan["step_bytes"] / measured_bytes - 1 if "step_bytes" in plan else None,
            "goal": goal,
            "failed": plan.get("error"),
        }
    env = data.get("environment", {})
    lines = [
        f"`fora plan` on this host of the engine runs measured on the {env.get('gpu', 'GPU')} "
        f"({env.get('date_utc', '?')}, {measured.name}):",
        "",
        "| run | planned GiB | max allocated GiB | plan / measured − 1 | goal |",
        "|---|---:|---:|---:|---|",
    ]
    for name, c in comparisons.items():
        if c["deviation"] is None:
            lines.append(f"| {name} | failed | {gib(c['measured_bytes'])} | — | — |")
            continue
        verdict = "met" if abs(c["deviation"]) <= c["goal"] else "missed"
        lines.append(
            f"| {name} | {gib(c['step_bytes'])} | {gib(c['measured_bytes'])} | {100 * c['deviation']:+.1f}% "
            f"| within {100 * c['goal']:.0f}%: {verdict} |"
        )
    for name, c in comparisons.items():
        if c["failed"]:
            lines += ["", f"plan of {name} failed:", "```", c["failed"], "```"]
    return {"comparisons": comparisons, "text": "\n".join(lines)}


def section(ctx, budget_s: float) -> dict[str, Any]:
    """bench/gpu.py's ``engines`` section: the tiny scale with --tiny, else the GPU's; no launch starts after
    ``budget_s`` (what the whole run can give it) or this section's own budget, whichever comes first."""
    import step_time

    tiny = ctx.scale.setting is step_time.SETTINGS["tiny"]
    root = ctx.tmp / "engines"
    root.mkdir()
    budget_s = min(BUDGET_S[ctx.device.type], budget_s)
    return run_all(ctx.device, TINY if tiny else GPU, root, log=ctx.log, budget_s=budget_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny CPU mode's model (any device)")
    parser.add_argument("--out", default="outputs/engines", help="folder for engines.json and engines.md")
    parser.add_argument(
        "--measured",
        type=Path,
        help="an earlier GPU run's JSON (bench/gpu.py's or engines.json): plan its engine runs on this host and "
        "compare with the memory they measured; nothing else runs",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help=f"seconds after which no run starts (default: {BUDGET_S['cuda']:.0f} on a GPU)",
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.measured is not None:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            result = replan(args.measured, Path(tmp))
        (out / "engines-plan.json").write_text(json.dumps(result, indent=2, default=str))
        (out / "engines-plan.md").write_text(result["text"])
        print(result["text"])
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU: use --device cpu --tiny")
    if device.type == "cpu" and not args.tiny:
        parser.error("--device cpu runs the tiny mode only: add --tiny")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = run_all(device, TINY if args.tiny else GPU, Path(tmp), budget_s=args.budget)
        except Exception:  # noqa: BLE001  (the traceback goes to the JSON as well)
            result = {"error": traceback.format_exc(), "text": traceback.format_exc()}
    (out / "engines.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "engines.md").write_text(result["text"])
    print(result["text"])
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
