"""A stand-in for a CUDA graph on any device: :func:`capture` records the aten ops a function runs and returns a
function that replays them on the same tensors, with the semantics of a captured graph.

A CUDA graph records kernels without running them and replays them later on the same memory. What the captured code
decided in Python (a branch, a float read from a dict, a list of tensors) is frozen at the capture; a value read back
to the host is an error; tensors made during the capture keep their memory and are filled again at each replay. The
recording here does the same on the CPU: ops that write into existing tensors (in-place and ``out=`` ops) and ops
that make new tensors are recorded, not run (new tensors get uninitialised memory of the right shape, from the op's
meta kernel); views are made at once, since they only alias memory; a host read raises. :func:`capture` is the
``capture(run, device) -> replay`` function that ``fora_plugin.optim.cayley_adam.GRAPH_BACKENDS`` takes (``run``
runs once, then is recorded), so a test can run Cayley-Adam's captured path on the CPU and compare it with the eager
step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


__all__ = ["RecordingGraph", "capture"]

_aten = torch.ops.aten
_HOST_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default, _aten.nonzero.default}


def _as_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


def _aliased_output(func, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """Whether ``func`` writes into tensors it is given (in place or ``out=``), and what it would return: those
    tensors."""
    schema = func._schema
    writes = [r for r in schema.returns if r.alias_info is not None and r.alias_info.is_write]
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if not mutates:
        return False, None
    values = {}
    for index, argument in enumerate(schema.arguments):
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if argument.alias_info is not None:
            values[frozenset(argument.alias_info.before_set)] = value
    outputs = [values.get(frozenset(r.alias_info.before_set)) for r in writes]
    if not outputs:
        return True, None
    return True, outputs[0] if len(outputs) == 1 else tuple(outputs)


class RecordingGraph(TorchDispatchMode):
    """Records what runs inside it as a captured graph would (see the module docstring); :meth:`replay` runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise RuntimeError(f"{func} reads a device value on the host: not allowed while a graph is captured")
        if func.is_view:
            return func(*args, **kwargs)
        mutates, aliased = _aliased_output(func, args, kwargs)
        if mutates:
            self.ops.append((func, args, kwargs, None))
            return aliased
        meta = func(*tree_map(_as_meta, args), **tree_map(_as_meta, kwargs))
        device = next(
            (t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)),
            kwargs.get("device") or torch.device("cpu"),
        )

        def allocate(m: Any) -> Any:
            if isinstance(m, torch.Tensor):
                return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
            return m

        outputs = tree_map(allocate, meta)
        self.ops.append((func, args, kwargs, outputs))
        return outputs

    def replay(self) -> None:
        for func, args, kwargs, outputs in self.ops:
            result = func(*args, **kwargs)
            if outputs is None:
                continue
            results = result if isinstance(result, (tuple, list)) else (result,)
            targets = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
            for target, value in zip(targets, results):
                if isinstance(target, torch.Tensor):
                    target.copy_(value)


def capture(run: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """As Cayley-Adam's CUDA backend does: run ``run`` once, then record it (nothing runs) and return the function
    that replays it."""
    with torch.no_grad():
        run()
    graph = RecordingGraph()
    with torch.no_grad(), graph:
        run()
    return graph.replay
