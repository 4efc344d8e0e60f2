"""A diverging run is reported: DivergenceMonitor's warnings, and FoRA's diagnostics on non-finite weights."""

import logging
import math

import pytest
import torch
from conftest import tiny_llama
from host_sync import HostSyncCounter
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerControl, TrainerState, TrainingArguments

from fora_plugin import CayleyAdam, build_fora_optimizer, make_stiefel, stiefel_parameters
from fora_plugin.diagnostics import (
    delta_w_singular_values,
    effective_rank,
    lora_pairs,
    mean_effective_rank,
)
from fora_plugin.monitor import DivergenceMonitor, stiefel_counters
from fora_plugin.selection import FoRASelection
from fora_plugin.stiefel import orthogonality_error, random_stiefel
from fora_plugin.wiring import FoRALogs


def stiefel_lora_model():
    model = get_peft_model(tiny_llama(num_layers=2), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    return model


# ---- diagnostics never raise on non-finite weights ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_spectrum_and_effective_rank_of_a_non_finite_adapter_are_nan(bad):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 10, generator=gen), random_stiefel(16, 4, generator=gen)
    finite = delta_w_singular_values(a, b)
    dense = torch.linalg.svdvals((b @ a).double())[:4]  # the d_out x d_in reference (rank 4)
    assert torch.allclose(finite, dense, atol=1e-10)
    b[3, 1] = bad
    values = delta_w_singular_values(a, b)
    assert values.shape == (4,) and torch.all(torch.isnan(values))
    assert math.isnan(effective_rank(values))
    assert math.isnan(effective_rank(torch.tensor([1.0, float("inf")])))


def test_fora_logs_of_a_model_with_nan_weights_report_nan_instead_of_raising():
    model = stiefel_lora_model()
    logs = FoRALogs(FoRASelection([0, 1], 2, "model.layers"))
    healthy = logs(model, None)
    assert healthy["fora/max_orthogonality_error"] < 1e-5 and healthy["fora/mean_effective_rank"] == 0.0
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(float("nan"))
    diverged = logs(model, None)
    assert math.isnan(diverged["fora/max_orthogonality_error"])
    assert math.isnan(diverged["fora/mean_effective_rank"]) and math.isnan(mean_effective_rank(model))


# ---- DivergenceMonitor ----------------------------------------------------------------------------------------------


def feed(monitor, entries, optimizer=None, tmp_path="."):
    """Call on_log as HF Trainer does, once per log entry, with global_step = 1, 2, ..."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    state, control = TrainerState(), TrainerControl()
    for step, logs in enumerate(entries, start=1):
        state.global_step = step
        monitor.on_log(args, state, control, logs=dict(logs), optimizer=optimizer)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "fora_plugin.monitor" and r.levelno == logging.WARNING]


def healthy_logs(n):
    return [
        {"loss": 2.0 - 0.1 * i, "grad_norm": 3.0 + 0.5 * (-1) ** i, "fora/max_orthogonality_error": 1e-6}
        for i in range(n)
    ]


def test_a_healthy_run_gets_no_warning(caplog, tmp_path):
    feed(DivergenceMonitor(), healthy_logs(20), tmp_path=tmp_path)
    assert warnings_of(caplog) == []


def test_grad_norm_blow_up_warns_once_with_step_value_and_fix(caplog, tmp_path):
    entries = healthy_logs(5) + [{"loss": 9.0, "grad_norm": 1e16}, {"loss": 9.0, "grad_norm": 1e17}]
    feed(DivergenceMonitor(), entries, tmp_path=tmp_path)
    (message,) = warnings_of(caplog)
    assert "grad_norm jumped to 1e+16 at step 6" in message
    assert "learning_rate" in message and "fora_lr_stiefel" in message and "max_grad_norm" in message


def test_non_finite_loss_and_grad_norm_warn_once_each(caplog, tmp_path):
    entries = healthy_logs(3) + [{"loss": float("nan"), "grad_norm": float("inf")}] * 3
    feed(DivergenceMonitor(), entries, tmp_path=tmp_path)
    messages = warnings_of(caplog)
    assert len(messages) == 2
    assert "training loss is nan at step 4" in messages[0]
    assert "grad_norm is inf at step 4" in messages[1]


@pytest.mark.parametrize(("error", "warns"), [(2e-2, True), (float("nan"), True), (5e-4, False)])
def test_orthogonality_error_above_the_threshold_warns(caplog, tmp_path, error, warns):
    entries = healthy_logs(2) + [{"fora/max_orthogonality_error": error}]
    feed(DivergenceMonitor(), entries, tmp_path=tmp_path)
    messages = warnings_of(caplog)
    assert len(messages) == int(warns)
    if warns:
        assert f"fora/max_orthogonality_error = {error:.3g} at step 3 (threshold 0.001)" in messages[0]


class AcceleratedLike:
    """Stands for accelerate's AcceleratedOptimizer: the real optimizer is its `.optimizer`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def stepped_optimizer(seed: int, nan_in_first: bool = False):
    """A Stiefel LoRA model and its FoRA optimizer after one step on random gradients (with a NaN in the first
    lora_B's, whose step is then skipped)."""
    model = stiefel_lora_model()
    optimizer = build_fora_optimizer(model)
    stiefel = optimizer.stiefel_groups[0]["params"]
    gen = torch.Generator().manual_seed(seed)
    for p in stiefel:
        p.grad = torch.randn(p.shape, generator=gen)
    if nan_in_first:
        stiefel[0].grad[0, 0] = float("nan")
    optimizer.step()
    return model, optimizer


def test_skipped_steps_and_reprojections_of_the_optimizer_are_reported(caplog, tmp_path):
    model, optimizer = stepped_optimizer(1)
    stiefel = optimizer.stiefel_groups[0]["params"]
    assert stiefel_counters(AcceleratedLike(optimizer)) == {"skipped_steps": 0, "reprojections": 0}
    feed(DivergenceMonitor(), healthy_logs(2), AcceleratedLike(optimizer), tmp_path)
    assert warnings_of(caplog) == []

    stiefel[0].grad[0, 0] = float("nan")  # skipped by Cayley-Adam
    with torch.no_grad():
        stiefel[1].add_(0.05)  # knocked off the manifold: re-projected within the step
    optimizer.step()
    feed(DivergenceMonitor(), healthy_logs(2), AcceleratedLike(optimizer), tmp_path)
    messages = warnings_of(caplog)
    assert len(messages) == 2
    assert "skipped 1 lora_B step(s) for a non-finite gradient" in messages[0]
    assert "re-projected a lora_B onto the manifold 1 time(s)" in messages[1]


def test_counters_are_found_inside_a_zero_client_like_wrapper():
    (b,) = [torch.nn.Parameter(random_stiefel(8, 2, generator=torch.Generator().manual_seed(2)))]
    inner = CayleyAdam([b])
    b.grad = torch.full_like(b, float("nan"))
    inner.step()

    class ZeroLike:  # FoRA's ZeRO client keeps Cayley-Adam in `.stiefel`, DeepSpeed wraps it in `.optimizer`
        stiefel = inner

    assert stiefel_counters(AcceleratedLike(ZeroLike())) == {"skipped_steps": 1, "reprojections": 0}
    assert stiefel_counters(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)) is None


def test_both_counters_are_read_back_in_one_host_sync():
    # A log must cost at most one read of the device: the two counters come back together.
    model = stiefel_lora_model()
    optimizer = build_fora_optimizer(model)
    gen = torch.Generator().manual_seed(3)
    for p in optimizer.stiefel_groups[0]["params"]:
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()
    with HostSyncCounter() as syncs:
        counters = stiefel_counters(AcceleratedLike(optimizer))
    assert counters == {"skipped_steps": 0, "reprojections": 0} and syncs.count == 1, syncs.report()


def test_bad_monitor_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"orthogonality_threshold=nan is invalid"):
        DivergenceMonitor(orthogonality_threshold=float("nan"))
    with pytest.raises(ValueError, match=r"grad_norm_jump=0 is invalid"):
        DivergenceMonitor(grad_norm_jump=0)


# ---- the log's diagnostics: one host sync ---------------------------------------------------------------------------


class LinalgCalls(TorchDispatchMode):
    """Records the matrix decompositions torch runs (each a host sync on an accelerator: LAPACK's info check)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(word in func.__name__ for word in ("svd", "eigh", "qr", "eig")):
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_fora_logs_read_the_device_once_and_equal_a_dense_reference():
    # The log's diagnostics made 7 host syncs per adapter and a device SVD each (28 here: 4 adapters): on a GPU each
    # one stalls the launch queue at every log (~640 at LLaMA-8B, r 32, K 16). They are computed on the device and
    # read back once; the values are those of a dense reference: ‖BᵀB − I‖ and the SVD of the d_out x d_in BA.
    model = stiefel_lora_model()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * torch.logspace(0, -3, p.shape[0])[:, None])
            if "lora_B" in name and "layers.1" in name:
                p.add_(1e-3 * torch.randn(p.shape, generator=gen))  # off the manifold: a drift to report
    pairs = [(a.detach().double(), b.detach().double()) for _, _, a, b in lora_pairs(model)]
    assert len(pairs) == 4
    identity = torch.eye(4, dtype=torch.float64)
    drift = max(torch.linalg.matrix_norm(b.T @ b - identity).item() for _, b in pairs)
    ranks = [effective_rank(torch.linalg.svdvals(b @ a)[:4]) for a, b in pairs]  # the dense (d_out, d_in) ΔW
    logs = FoRALogs(FoRASelection([0, 1], 2, "model.layers"))
    with HostSyncCounter() as syncs, LinalgCalls() as linalg:
        values = logs(model, None)
    assert syncs.count == 1, syncs.report()
    assert linalg.calls == []  # no device SVD/QR per adapter: the r x r spectra are finished on the host
    assert values["fora/max_orthogonality_error"] == pytest.approx(drift, rel=1e-5)
    assert drift > 1e-3
    assert values["fora/mean_effective_rank"] == pytest.approx(sum(ranks) / len(ranks), rel=1e-9)
    assert 1.0 < values["fora/mean_effective_rank"] < 4.0


def test_fora_logs_of_the_optimizer_masters_and_of_no_adapter_read_once():
    # Under FoRAOptimizer a bf16 lora_B's drift is its fp32 master's; a model without adapters logs zeros. One read.
    model = stiefel_lora_model().to(torch.bfloat16)
    optimizer = build_fora_optimizer(model, lr=1e-3, lr_stiefel=1e-3)
    model(torch.randint(0, 96, (2, 8))).logits.float().square().mean().backward()
    optimizer.step()
    masters = [optimizer.state[p]["master"] for _, p in stiefel_parameters(model)]
    assert all(m.dtype == torch.float32 for m in masters)
    with HostSyncCounter() as syncs:
        logs = FoRALogs(FoRASelection([0, 1], 2, "model.layers"))(model, optimizer)
    assert syncs.count == 1, syncs.report()
    assert logs["fora/max_orthogonality_error"] == pytest.approx(max(orthogonality_error(m).item() for m in masters))
    with HostSyncCounter() as syncs:
        assert mean_effective_rank(tiny_llama(num_layers=2)) == 0.0
    assert syncs.count <= 1


def test_a_fora_log_and_the_monitor_read_the_device_once_together(caplog):
    """FoRA's log reads Cayley-Adam's counters with its own values and logs them; DivergenceMonitor takes them from
    the log, so the log and its checks cost one host read (two before: the monitor read the counters again)."""
    model, optimizer = stepped_optimizer(5, nan_in_first=True)
    expected = stiefel_counters(optimizer)  # the independent read
    assert expected["skipped_steps"] == 1
    with HostSyncCounter() as syncs, caplog.at_level(logging.WARNING, logger="fora_plugin.monitor"):
        logs = FoRALogs(FoRASelection([0, 1], 2, "model.layers"))(model, optimizer)
        feed(DivergenceMonitor(), [{"loss": 1.0, **logs}], optimizer=AcceleratedLike(optimizer))
    assert syncs.count == 1, syncs.report()
    assert {k: logs[f"fora/{k}"] for k in expected} == expected
    assert isinstance(logs["fora/skipped_steps"], int)
    assert any("skipped 1 lora_B step(s)" in w for w in warnings_of(caplog))
    # Before the first step no matrix has a counter yet: 0, and still one read.
    fresh = stiefel_lora_model()
    with HostSyncCounter() as syncs:
        logs = FoRALogs(FoRASelection([0, 1], 2, "model.layers"))(fresh, build_fora_optimizer(fresh))
    assert syncs.count == 1 and logs["fora/skipped_steps"] == logs["fora/reprojections"] == 0
