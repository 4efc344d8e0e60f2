"""Count the host syncs a piece of code would make on an accelerator, on any device (the CPU included).

A host sync is a point where the CPU waits for the device: reading a tensor's value into Python (``.item()``,
``float(t)``, ``if t:``, ``.tolist()``), an op whose output size depends on the data (``nonzero``, boolean-mask
indexing, ``masked_select``), an error check that reads a device flag (``torch.linalg.solve``'s
``_linalg_check_errors``), or host data copied to the device (``torch.tensor(values, device=...)``,
``t.new_tensor(values)``, a host-made tensor's ``.to(device)``: a copy from pageable host memory, which CUDA makes
synchronous). On a GPU each one stalls the launch queue; in an optimizer step that runs once per training step, a
handful of them cost more than the step's own kernels. On the CPU they cost nothing, so they go unnoticed unless
counted: :class:`HostSyncCounter` counts them with a dispatch mode (the aten ops) and a torch function mode (the
Python-level reads that do not go through an aten op), so a CPU test can hold a GPU budget.

On the CPU every tensor is a host tensor, so a copy to "the device" is told by intent: a factory given Python data
and a device other than ``"cpu"`` (a ``torch.device`` taken from a tensor counts, since on a GPU it is the GPU), and
``.to`` of a tensor that a factory made from Python data inside the counter on the host. Missed: a host tensor made
outside the counter (or by another function, ``torch.from_numpy``) moved inside it, and ``device_tensor.copy_(host)``
(on the CPU both are host tensors).

    with HostSyncCounter() as syncs:
        optimizer.step()
    assert syncs.count == 0, syncs.report()
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


__all__ = ["HostSync", "HostSyncCounter"]

_aten = torch.ops.aten

# aten ops that read a device value on the host, or whose output shape depends on device data.
SYNCING_OPS = {
    _aten._local_scalar_dense.default: "item",  # .item(), float(t), int(t)
    _aten.is_nonzero.default: "bool",  # if t:, bool(t)
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._linalg_check_errors.default: "linalg error check",  # torch.linalg.solve / cholesky / inv
    _aten.equal.default: "equal",
    _aten.repeat_interleave.Tensor: "repeat_interleave",  # output size read from the repeats tensor
    _aten.unique_dim.default: "unique",
    _aten._unique2.default: "unique",
}
# aten ops that sync when one of their index tensors is boolean (a mask needs its nonzero count).
_MASK_INDEXED_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
# Tensor methods that copy device data to the host without going through an aten op above.
_HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu"}
# Factories that copy Python data to the device named by their ``device`` argument (a device-side fill, such as
# ``torch.full``, makes no copy). On the CPU the device is the CPU, so a named device is what tells the intent.
_HOST_DATA_FACTORIES = (torch.tensor, torch.as_tensor)


def _names_a_device(device) -> bool:
    """Whether a ``device`` argument names where the computation runs: a ``torch.device`` (as taken from a tensor,
    the GPU on a GPU) or a string other than "cpu"; the string "cpu" asks for the host on any machine."""
    if isinstance(device, torch.device):
        return True
    return isinstance(device, str) and torch.device(device).type != "cpu"


@dataclass
class HostSync:
    """One host sync: what caused it and the innermost frames of the code that made it."""

    kind: str
    where: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.kind} at " + " <- ".join(self.where)


def _callers(limit: int = 4) -> list[str]:
    # The frames of the code under test: torch's own frames and this module's are left out.
    frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__]
    return [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames[-limit:]][::-1]


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, record) -> None:
        super().__init__()
        self._record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = SYNCING_OPS.get(func)
        if kind is None and func in _MASK_INDEXED_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                kind = f"boolean-mask {func.__name__}"
        if kind is not None:
            self._record(kind)
        return func(*args, **kwargs)


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, record) -> None:
        super().__init__()
        self._record = record
        self._host_made: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _HOST_READS.get(func)
        host_made = False
        if func in _HOST_DATA_FACTORIES:
            data = args[0] if args else kwargs.get("data")
            if not isinstance(data, torch.Tensor):
                device = kwargs.get("device")
                if device is None or torch.device(device).type == "cpu":
                    # Made on the host (by default or asked for): moving it to a device later is a copy.
                    host_made = True
                if _names_a_device(device):
                    kind = "host data to device"
        elif func is torch.Tensor.new_tensor:
            # The new tensor is on the device of the one it is called on unless told otherwise.
            data = args[1] if len(args) > 1 else kwargs.get("data")
            device = kwargs.get("device", args[0].device)
            if not isinstance(data, torch.Tensor) and _names_a_device(device):
                kind = "host data to device"
        elif func is torch.Tensor.to:
            source = args[0]
            targets = [a for a in (*args[1:], kwargs.get("device"), kwargs.get("other")) if a is not None]
            devices = [a.device if isinstance(a, torch.Tensor) else a for a in targets]
            devices = [d for d in devices if isinstance(d, (str, torch.device))]
            if any(torch.device(d).type == "cpu" for d in devices) and source.device.type != "cpu":
                kind = "to(cpu)"
            elif self._host_made.get(id(source)) is source and any(_names_a_device(d) for d in devices):
                kind = "host tensor to device"
        if kind is not None:
            self._record(kind)
        result = func(*args, **kwargs)
        if host_made and isinstance(result, torch.Tensor):
            self._host_made[id(result)] = result
        return result


class HostSyncCounter:
    """Context manager that records every host sync made inside it (see the module docstring).

    ``count`` is the number of syncs, ``syncs`` the list with where each was made, ``report()`` a readable summary
    for an assertion message. Reads of a CPU tensor count as well: the budget is the one the code would have on an
    accelerator.
    """

    def __init__(self) -> None:
        self.syncs: list[HostSync] = []
        self._modes: list = []

    def _record(self, kind: str) -> None:
        self.syncs.append(HostSync(kind, _callers()))

    @property
    def count(self) -> int:
        return len(self.syncs)

    def report(self) -> str:
        if not self.syncs:
            return "no host sync"
        return f"{self.count} host sync(s):\n" + "\n".join(f"  {s}" for s in self.syncs)

    def __enter__(self) -> HostSyncCounter:
        self._modes = [_FunctionCounter(self._record), _DispatchCounter(self._record)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
