"""Device placement on a stand-in accelerator (tests/fakegpu.py): FoRA's optimizer step, Fisher scoring in its 4
modes, a LoRA forward/backward with make_stiefel and the log diagnostics run with every tensor on ``fakegpu:0``; a
tensor made on the CPU by mistake (a ``torch.eye(r)`` without ``device=``, a host-to-device copy) fails there, as it
would on a GPU. Each run is a subprocess: an exception inside a backward hook aborts the process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import fakegpu
import pytest


HERE = Path(__file__).resolve().parent


def run_fakegpu(*args: str) -> dict[str, dict]:
    """Run tests/fakegpu.py; its report, one entry per scenario (a scenario that aborted the process has none)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent), "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, str(HERE / "fakegpu.py"), *args], env=env, capture_output=True, text=True, timeout=600
    )
    report = {}
    for line in result.stdout.splitlines():
        if line.startswith('{"scenario"'):
            entry = json.loads(line)
            report[entry["scenario"]] = entry
    assert result.returncode == 0, f"rc={result.returncode}, report={report}\n{result.stderr[-4000:]}"
    return report


@pytest.fixture(scope="module")
def report():
    return run_fakegpu(*fakegpu.SCENARIOS)


def test_the_private_torch_api_the_stand_in_relies_on_is_there():
    fakegpu.check_pinned_api()  # raises, naming what moved, on a torch release that changed it


@pytest.mark.parametrize("scenario", fakegpu.SCENARIOS)
def test_fora_runs_on_the_stand_in_accelerator(report, scenario):
    # optimizer_step: FoRAOptimizer (Cayley-Adam + fused AdamW), two steps, every state on its parameter's device,
    # 0-dim ones included. fisher: the 4 modes up to their one host read (on main, the batch count was copied to the
    # device from the host: a blocking copy on a GPU, and an error here). fora_logs: the diagnostics up to theirs.
    assert report[scenario]["ok"], report[scenario]["error"]


def test_an_injected_eye_without_device_is_caught():
    report = run_fakegpu("optimizer_step", "--inject=eye_without_device")
    assert not report["optimizer_step"]["ok"]
    assert "fakegpu:0" in report["optimizer_step"]["error"] and "cpu" in report["optimizer_step"]["error"]


def test_a_0_dim_cpu_state_that_fake_mode_lets_pass_is_caught_by_the_plain_check():
    # torch's for-loop AdamW keeps `step` as a 0-dim CPU tensor; fake mode treats it as a scalar and runs the step.
    # misplaced_states sees it. With fused AdamW (HF's optim adamw_torch_fused) every state is on the device.
    report = run_fakegpu("optimizer_step", "--inject=adamw_not_fused")
    assert not report["optimizer_step"]["ok"]
    assert "step () on cpu, its parameter on fakegpu:0" in report["optimizer_step"]["error"]
