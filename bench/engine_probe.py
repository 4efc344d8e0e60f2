"""``fora train`` with measurements, for bench/engines.py: the user's launch line with ``-m engine_probe`` in place of
``-m fora_plugin.cli`` (``bench/`` and ``tests/`` on PYTHONPATH). It runs ``fora_plugin.cli.main`` unchanged; around
the trainer that ``fora train`` builds it adds one callback, which measures (every rank takes part in the gathers;
rank 0 writes):

- the losses, ``grad_norm`` and ‖BᵀB − I‖ of every log (``logging_steps: 1``), the layers chosen and their scores;
- ms per step (CUDA events on a GPU), and ``max_memory_allocated`` / reserved from train start to train end;
- host syncs of every optimizer step (DeepSpeed's ``engine.step``, within it FoRA's client step; elsewhere the
  trainer's optimizer step) and of every log, by ``torch.cuda.set_sync_debug_mode("warn")`` on a GPU and by
  tests/host_sync.py's counter on the CPU;
- the LoRA weights as they are in the process when training ends (gathered under ZeRO-3 and FSDP2), to check the
  adapter ``fora train`` saves against them.

Environment: ``ENGINE_PROBE_OUT`` (folder for probe.json and lora.pt), ``ENGINE_PROBE_BACKEND=gloo`` (the process group
over gloo, set up before ``fora train`` runs: two ranks on one GPU, which NCCL refuses; no launch option chooses
DeepSpeed's backend), ``ENGINE_PROBE_FORCE_FSDP2=1`` (CPU ranks: accelerate attaches its FSDP plugin only to GPU runs,
so it is attached as tests/distributed/fsdp_trainer.py does). ``python -m engine_probe --runs SPEC.json`` runs several
single-process ``fora train`` commands in turn (SPEC: a list of ``{"out": folder, "argv": [...]}``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from host_sync import HostSyncCounter
from step_time import StepTimer
from transformers import TrainerCallback

from fora_plugin import cli
from fora_plugin.fsdp import gathered_adapters
from fora_plugin.optim import GRAPH_WARMUP_STEPS
from fora_plugin.zero import deepspeed_zero_stage, find_zero_client, gathered_trainable_parameters


OUT, BACKEND, FORCE_FSDP2 = "ENGINE_PROBE_OUT", "ENGINE_PROBE_BACKEND", "ENGINE_PROBE_FORCE_FSDP2"
# The steps that make the optimizer's state and capture its step (a capture synchronises): counted apart.
SETUP_STEPS = GRAPH_WARMUP_STEPS + 1


class SyncRegions:
    """Host syncs inside an outer call (an optimizer step, a log), and among them those inside inner calls (FoRA's
    client step within DeepSpeed's). One record per outer call: {"total", "inner", "where"}."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.records: list[dict[str, Any]] = []
        self._events: list | None = None
        self._inner = 0

    def _syncs(self, events: list) -> list[str]:
        if not self.cuda:
            return [str(s) for s in events]
        # Only the calls that synchronized: enabling the mode itself warns that it is a prototype.
        return [
            f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}"
            for w in events
            if "called a synchronizing" in str(w.message)
        ]

    @contextlib.contextmanager
    def outer(self):
        if self._events is not None:  # re-entered (a step calling a step): counted once, by the outermost
            yield
            return
        self._inner = 0
        if self.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                self._events = caught
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        else:
            with HostSyncCounter() as counter:
                self._events = counter.syncs
                yield
        syncs = self._syncs(self._events)
        self._events = None
        self.records.append({"total": len(syncs), "inner": self._inner, "where": syncs[:4]})

    @contextlib.contextmanager
    def inner(self):
        if self._events is None:
            yield
            return
        start = len(self._events)
        yield
        self._inner += len(self._syncs(self._events[start:]))


def counted(method, region):
    """``method`` with every call inside ``region()`` (an instance attribute in place of the bound method)."""

    def call(*args, **kwargs):
        with region():
            return method(*args, **kwargs)

    return call


def force_fsdp2(trainer) -> None:
    """What accelerate does for an FSDP2 config on GPUs; a multi-CPU run must have it set by hand."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    if getattr(state, "fsdp_plugin", None) is None:
        state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables accelerate launch set
    trainer.is_fsdp_enabled = True


class Probe(TrainerCallback):
    """The measurements of one ``fora train`` run (see the module docstring)."""

    def __init__(self, trainer, out: Path) -> None:
        self.trainer, self.out = trainer, out
        self.cuda = trainer.args.device.type == "cuda"
        self.timer = StepTimer(trainer.args.device)  # bench/step_time.py's, a callback of the trainer beside this one
        self.step_syncs = SyncRegions(self.cuda)
        self.log_syncs = SyncRegions(self.cuda)
        self.result: dict[str, Any] = {}
        self.lora: dict[str, torch.Tensor] = {}
        self.lora_begin: dict[str, torch.Tensor] = {}
        self.micro_losses: list[torch.Tensor] = []  # each micro-batch's loss as training_step returns it

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.result["allocated_at_train_begin"] = torch.cuda.memory_allocated() if self.cuda else None
        if trainer.is_deepspeed_enabled:
            # accelerate runs DeepSpeed's step inside backward(); the trainer's optimizer.step() does nothing.
            engine = trainer.model_wrapped
            engine.step = counted(engine.step, self.step_syncs.outer)
            client = find_zero_client(engine.optimizer)
            if client is not None:
                client.step = counted(client.step, self.step_syncs.inner)
        else:
            optimizer = trainer.optimizer
            optimizer.step = counted(optimizer.step, self.step_syncs.outer)
            inner = getattr(optimizer, "optimizer", None)
            if inner is not None:
                inner.step = counted(inner.step, self.step_syncs.inner)
        trainer.log = counted(trainer.log, self.log_syncs.outer)
        training_step = trainer.training_step

        def recorded_step(*args, **kwargs):
            loss = training_step(*args, **kwargs)
            self.micro_losses.append(loss.detach().float().reshape(()))  # read when training ends: no sync here
            return loss

        trainer.training_step = recorded_step
        self.lora_begin = gathered_lora(trainer.model)

    def on_train_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        model = trainer.model
        if self.cuda:
            torch.cuda.synchronize()
        steps = self.timer.milliseconds()
        # The loss of each optimizer step, unrounded (the logs round it to 4 decimals): its micro-batches' summed, the
        # mean over the ranks (HF scales each rank's by the world size when it averages tokens across devices).
        per_step = torch.stack(self.micro_losses).reshape(-1, args.gradient_accumulation_steps).sum(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(per_step)
            per_step /= dist.get_world_size()
        lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
        self.result.update(
            max_memory_allocated=torch.cuda.max_memory_allocated() if self.cuda else None,
            max_memory_reserved=torch.cuda.max_memory_reserved() if self.cuda else None,
            ms_steps=[round(s[0], 3) for s in steps],
            losses=per_step.tolist(),
            logs=[log for log in state.log_history if "loss" in log],
            step_syncs=self.step_syncs.records,
            log_syncs=self.log_syncs.records,
            lora_b_dtype=str(lora_b[0].dtype) if lora_b else None,
            lora_b_type=type(lora_b[0]).__name__ if lora_b else None,
        )
        self.lora = gathered_lora(model)
        if os.environ.get(FORCE_FSDP2) == "1":
            force_fsdp2(trainer)  # accelerate set its distributed type back to MULTI_CPU: save_model needs FSDP

    def describe(self) -> dict[str, Any]:
        trainer = self.trainer
        selection = trainer.fora_selection
        scores = selection.scores
        fsdp_plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
        return {
            **self.result,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "device": str(trainer.args.device),
            "deepspeed_stage": deepspeed_zero_stage(trainer),
            "fsdp_version": getattr(fsdp_plugin, "fsdp_version", None) if trainer.is_fsdp_enabled else None,
            "bf16": bool(trainer.args.bf16),
            "chosen_layers": selection.chosen,
            "scores": scores.scores if scores is not None else None,
            "scoring_seconds": scores.seconds if scores is not None else None,
            "scoring_peak_bytes": scores.peak_memory_bytes if scores is not None else None,
            "setup_steps": SETUP_STEPS,
        }


def gathered_lora(model) -> dict[str, torch.Tensor]:
    """The adapter's weights as PEFT saves them (its keys), whole under ZeRO-3 and FSDP2 (collectives: every rank
    calls it), copied to the CPU."""
    from peft import get_peft_model_state_dict

    with gathered_trainable_parameters(model), gathered_adapters(model):
        return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


def probed(build_trainer, out: Path, probes: list[Probe]):
    """``fora_plugin.cli.build_trainer`` that adds a :class:`Probe` to the trainer it builds."""

    def build(*args, **kwargs):
        trainer = build_trainer(*args, **kwargs)
        if os.environ.get(FORCE_FSDP2) == "1":
            force_fsdp2(trainer)
        probe = Probe(trainer, out)
        trainer.add_callback(probe)
        trainer.add_callback(probe.timer)
        probes.append(probe)
        return trainer

    return build


def run(argv: list[str], out: Path) -> int:
    """``fora train`` (``fora_plugin.cli.main(argv)``) with a probe; rank 0 writes ``out``/probe.json and lora.pt."""
    out.mkdir(parents=True, exist_ok=True)
    probes: list[Probe] = []
    original = cli.build_trainer
    cli.build_trainer = probed(original, out, probes)
    started = time.perf_counter()
    try:
        code = cli.main(argv)
    finally:
        cli.build_trainer = original
    seconds = time.perf_counter() - started
    if not probes or (dist.is_initialized() and dist.get_rank() != 0):
        return code
    probe = probes[-1]
    (out / "probe.json").write_text(
        json.dumps({"exit_code": code, "fora_train_seconds": seconds, **probe.describe()}, default=str)
    )
    torch.save(probe.lora, out / "lora.pt")
    torch.save(probe.lora_begin, out / "lora_begin.pt")
    return code


def main() -> int:
    if sys.argv[1:2] == ["--runs"]:
        spec = json.loads(Path(sys.argv[2]).read_text())
        return max(run(entry["argv"], Path(entry["out"])) for entry in spec)
    if os.environ.get(BACKEND) == "gloo":
        dist.init_process_group("gloo")
    code = run(sys.argv[1:], Path(os.environ[OUT]))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
