"""A stand-in accelerator on a CPU: tensors on device ``fakegpu:0`` that are fake (no data, FakeTensorMode), so FoRA's
code runs as on a GPU and any tensor it makes on the CPU by mistake meets a device tensor and fails.

torch's PrivateUse1 backend is renamed ``fakegpu`` (``torch.utils.backend_registration``); its module answers what
autocast and device queries ask. Each parameter becomes ``FakeTensor(mode, meta_tensor, fakegpu:0)``: the fake mode
computes shapes and devices only, and refuses an op that mixes ``fakegpu`` and ``cpu`` tensors ("found two different
devices"), except for 0-dim CPU tensors, which it treats as scalars: :func:`misplaced_states` checks those by hand.

Private, experimental torch API (pinned below, checked by :func:`check_pinned_api`). Run as a subprocess
(``python tests/fakegpu.py SCENARIO... [--inject NAME]``): an exception inside a backward hook aborts the process, so
each scenario prints one JSON line ``{"scenario", "ok", "error"}`` as it ends, and a scenario without a line did not
end. tests/test_device_placement.py runs it.
"""

from __future__ import annotations

import inspect
import json
import sys
import traceback
import types
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest's tiny models, as the tests use them

from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode  # noqa: E402
from torch.utils import backend_registration  # noqa: E402


DEVICE_NAME = "fakegpu"
# What this module relies on from torch's private API; check_pinned_api fails by name if a torch release moves it.
PINNED_API = {
    "torch.utils.backend_registration._setup_privateuseone_for_python_backend": ("rename", "backend_module"),
    "torch._subclasses.fake_tensor.FakeTensor.__new__": ("fake_mode", "elem", "device"),
}
SCENARIOS = ("optimizer_step", "optimizer_moved_after_a_step", "lora_forward_backward", "fisher", "fora_logs")
FISHER_MODES = [(params, grad) for params in ("layer", "targets") for grad in ("auto", "activations")]
INJECTIONS = ("eye_without_device", "adamw_not_fused")
FUSED = True  # FoRAOptimizer's AdamW part: fused, every state on the device


def check_pinned_api() -> None:
    found = {
        "torch.utils.backend_registration._setup_privateuseone_for_python_backend": inspect.signature(
            backend_registration._setup_privateuseone_for_python_backend
        ),
        "torch._subclasses.fake_tensor.FakeTensor.__new__": inspect.signature(FakeTensor.__new__),
    }
    for name, parameters in PINNED_API.items():
        missing = [p for p in parameters if p not in found[name].parameters]
        if missing:
            raise RuntimeError(
                f"torch {torch.__version__}: {name} has no parameter {missing}; update tests/fakegpu.py"
            )


class FakeGPUModule(types.ModuleType):
    """``torch.fakegpu``: what torch asks a backend module (autocast's dtypes, device count, RNG seeding)."""

    def __init__(self) -> None:
        super().__init__(DEVICE_NAME)

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass


def register() -> torch.device:
    check_pinned_api()
    backend_registration._setup_privateuseone_for_python_backend(rename=DEVICE_NAME, backend_module=FakeGPUModule())
    return torch.device(DEVICE_NAME, 0)


def on_device(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``tensor``'s shape, dtype and strides on ``device``."""
    return FakeTensor(mode, tensor.detach().to("meta"), device)


def to_device(model: torch.nn.Module, mode: FakeTensorMode, device: torch.device) -> torch.nn.Module:
    """Every parameter and buffer of ``model`` as a fake tensor on ``device`` (requires_grad kept), in place."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                fake = torch.nn.Parameter(on_device(mode, param, device), requires_grad=param.requires_grad)
                module._parameters[name] = fake
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = on_device(mode, buffer, device)
    return model


def token_batch(mode: FakeTensorMode, device: torch.device) -> dict[str, torch.Tensor]:
    ids = on_device(mode, torch.empty(2, 8, dtype=torch.long), device)
    return {"input_ids": ids, "labels": ids}


def misplaced_states(optimizer: torch.optim.Optimizer) -> list[str]:
    """Optimizer states not on their parameter's device, 0-dim ones included (the fake mode lets a 0-dim CPU tensor
    meet a device tensor, as a Python scalar would, so only this check sees one)."""
    misplaced = []
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != param.device:
                misplaced.append(f"{key} {tuple(value.shape)} on {value.device}, its parameter on {param.device}")
    return misplaced


def lora_model(mode: FakeTensorMode, device: torch.device) -> torch.nn.Module:
    from conftest import TARGETS, tiny_llama
    from peft import LoraConfig, get_peft_model

    from fora_plugin import make_stiefel

    model = get_peft_model(tiny_llama(num_layers=2).train(), LoraConfig(r=4, target_modules=TARGETS))
    model.config.use_cache = False  # training: no KV cache (its lazy init copies a host tensor to the device)
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    return to_device(model, mode, device)


def lora_forward_backward(mode: FakeTensorMode, device: torch.device) -> None:
    model = lora_model(mode, device)
    with mode:
        loss = model(**token_batch(mode, device)).loss
        loss.backward()
    stiefel = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert stiefel and all(p.grad is not None and p.grad.device == device for p in stiefel)


def optimizer_step(mode: FakeTensorMode, device: torch.device) -> None:
    from fora_plugin import build_fora_optimizer

    model = lora_model(mode, device)
    with mode:
        optimizer = build_fora_optimizer(model, lr=1e-3, lr_stiefel=1e-3, fused=FUSED)
        for _ in range(2):  # the first step creates the states, the second uses them
            model(**token_batch(mode, device)).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert len(optimizer.state) == sum(p.requires_grad for p in model.parameters())
    misplaced = misplaced_states(optimizer)
    assert not misplaced, f"optimizer states off their parameter's device: {misplaced}"


def optimizer_moved_after_a_step(mode: FakeTensorMode, device: torch.device) -> None:
    """Cayley-Adam steps lora_B on the CPU, then lora_B moves to the device and takes 3 more steps: it stays there,
    and so does all its state. (``model.to(device)`` keeps each Parameter object and gives it new data on the device;
    a fake CPU tensor cannot take fake device data in place, so the test hands the optimizer's groups and state to
    new Parameters on the device, which is what the optimizer then sees.)"""
    from fora_plugin import CayleyAdam

    cpu = torch.device("cpu")
    params = [torch.nn.Parameter(on_device(mode, torch.empty(32, 4), cpu)) for _ in range(2)]
    with mode:
        optimizer = CayleyAdam(params, lr=1e-2)
        for p in params:
            p.grad = torch.randn(p.shape)
        optimizer.step()
        moved = [torch.nn.Parameter(p.detach().to(device)) for p in params]
        for p, q in zip(params, moved):
            optimizer.state[q] = optimizer.state.pop(p)
        optimizer.param_groups[0]["params"] = moved
        for _ in range(3):
            for p in moved:
                p.grad = torch.randn(p.shape, device=device)
            optimizer.step()
    assert all(p.device == device for p in moved), [p.device for p in moved]
    misplaced = misplaced_states(optimizer)
    assert not misplaced, f"optimizer states off their parameter's device: {misplaced}"


def _reaches_its_one_read(function: str, run) -> None:
    """``run()`` does all its work on the device and stops at its one host read in ``function`` (a ``tolist``),
    which fake tensors cannot answer: proof that nothing before it read the device or mixed devices."""
    try:
        run()
    except DataDependentOutputException:
        frames = traceback.extract_tb(sys.exc_info()[2])
        last = [f for f in frames if "fora_plugin" in f.filename][-1]
        assert last.name == function and "tolist" in (last.line or ""), (last.name, last.line)
    else:
        raise AssertionError(f"{function} read no device value: fake tensors cannot answer a read")


def fisher(mode: FakeTensorMode, device: torch.device) -> None:
    """Scoring in each of its 4 modes, every batch's forward and backward on the device, up to its one host read."""
    from conftest import TARGETS, tiny_llama

    from fora_plugin.fisher import fisher_scores

    for fisher_params, linear_grad in FISHER_MODES:
        model = to_device(tiny_llama(num_layers=2).train(), mode, device)
        model.config.use_cache = False
        targets = TARGETS if fisher_params == "targets" else None
        batches = [token_batch(mode, device)] * 2
        kwargs = dict(fisher_params=fisher_params, target_modules=targets, linear_grad=linear_grad, progress=False)
        with mode:
            _reaches_its_one_read("fisher_scores", lambda: fisher_scores(model, batches, 2, **kwargs))  # noqa: B023


def fora_logs(mode: FakeTensorMode, device: torch.device) -> None:
    """The training log's diagnostics (drift, effective rank of ΔW) on the device, up to their one host read."""
    from fora_plugin.selection import FoRASelection
    from fora_plugin.wiring import FoRALogs

    model = lora_model(mode, device)
    with mode:
        logs = FoRALogs(FoRASelection([0, 1], 2, "model.layers"))
        _reaches_its_one_read("read_adapter_diagnostics", lambda: logs(model, None))


def inject(name: str) -> None:
    """Put a device-placement bug into this process, to show that the checks catch it."""
    if name == "eye_without_device":
        eye = torch.eye

        def eye_on_the_default_device(*args, device=None, **kwargs):  # a torch.eye(r) missing its device=
            return eye(*args, **kwargs)

        torch.eye = eye_on_the_default_device
    elif name == "adamw_not_fused":
        global FUSED  # noqa: PLW0603
        FUSED = False  # torch's for-loop AdamW keeps its step count as a 0-dim CPU tensor: fake mode lets it pass
    else:
        raise ValueError(f"inject={name!r}: use one of {INJECTIONS}")


def main(argv: list[str]) -> None:
    scenarios = [a for a in argv if not a.startswith("--")]
    injections = [a.split("=", 1)[1] for a in argv if a.startswith("--inject=")]
    device = register()
    for name in injections:
        inject(name)
    for scenario in scenarios or SCENARIOS:
        if scenario not in SCENARIOS:
            raise ValueError(f"scenario {scenario!r}: use one of {SCENARIOS}")
        mode = FakeTensorMode()
        try:
            globals()[scenario](mode, device)
            result = {"scenario": scenario, "ok": True, "error": None}
        except Exception as error:  # reported, not raised: the test reads every scenario's outcome
            result = {"scenario": scenario, "ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
