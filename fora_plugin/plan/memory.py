"""Live tensor memory, counted by storage: what a run holds at each moment and at its peak, whatever device it is on.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode


__all__ = ["LiveTensorTracker", "flop_formulas", "storage_bytes"]

_DEVICE_QUERY = torch.ops.prim.device.default


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage under ``tensor`` (a view counts its whole base)."""
    return tensor.untyped_storage().nbytes()


def _grouped_mm_flops(mat_a: torch.Tensor, mat_b: torch.Tensor, *args, out_val: torch.Tensor, **kwargs) -> int:
    """One multiply-add per output element and contracted index. The groups (MoE experts) split one dimension,
    so the total does not depend on how the tokens are routed."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # (M, K_total) x (K_total, N): the groups split K
        return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    return 2 * out_val.numel() * mat_a.shape[-1]  # K = mat_a's last dimension; the groups split M or N


def flop_formulas() -> dict:
    """``FlopCounterMode``'s formulas, plus the ops it has none for that FoRA's runs make: the grouped matmul of
    MoE experts (``torch._grouped_mm``), SDPA's CPU kernels (fake tensors on the CPU take them; on a GPU the
    same attention is a flash/efficient kernel that ``FlopCounterMode`` counts, with the same formula), and the
    in-place ``addmm_`` (TRL's fused LM head accumulates its gradient products with it off CUDA)."""
    aten = torch.ops.aten
    formulas = dict(FlopCounterMode(display=False).flop_registry)
    formulas[aten._grouped_mm] = _grouped_mm_flops
    formulas[aten._scaled_dot_product_flash_attention_for_cpu] = formulas[aten._scaled_dot_product_flash_attention]
    formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = formulas[
        aten._scaled_dot_product_flash_attention_backward
    ]
    formulas[aten.addmm_] = formulas[aten.addmm]
    return formulas


class LiveTensorTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages; ``peak`` and the storages live at the peak.

    :class:`LiveTensorTracker` is a dispatch mode that sees every tensor an operator returns. Each storage it has not
    seen yet is counted once (views share their base's storage) and uncounted when its Python storage object dies (a
    ``weakref.finalize``): this is the memory a caching allocator holds for live tensors, without its fragmentation
    and rounding. It works the same on real CPU tensors (calibration), meta tensors and fake tensors (``fora plan``).

    The peak is kept as the set of storages live at that moment, so that it can be broken down afterwards by what
    each storage turned out to be (a weight, a gradient, an optimizer state, a saved activation).
    :func:`flop_formulas` gives FLOP formulas for the ops ``FlopCounterMode`` lacks. In the package only
    ``fora plan`` uses them (bench/ does too).

    Storages created before the mode is entered (weights) are counted only if :meth:`register`-ed. Each storage gets
    a unique id (``uid``), so that a storage address reused after a free is not mistaken for the old one.
    """

    def __init__(self, count_flops: bool = False) -> None:
        super().__init__()
        # FLOPs by FlopCounterMode's own formulas, counted here: FlopCounterMode itself wraps module outputs in
        # autograd functions for its backward bookkeeping, which keeps checkpointed activations alive.
        self.flops = 0
        self._flop_formulas = None
        if count_flops:
            self._flop_formulas = flop_formulas()
        self._live: dict[int, tuple[int, int]] = {}  # storage _cdata -> (uid, bytes)
        self._uids = itertools.count()
        self.current = 0
        self.peak = 0
        self._peak_live: dict[int, int] = {}  # uid -> bytes, at the peak
        self._peak_pending = False  # a new peak was reached; its live set is copied at the next free

    # -- counting ----------------------------------------------------------------------------------------------
    def _count(self, storage: torch.UntypedStorage, nbytes: int | None = None) -> int:
        key = storage._cdata
        entry = self._live.get(key)
        if entry is not None:
            return entry[0]
        uid = next(self._uids)
        nbytes = storage.nbytes() if nbytes is None else nbytes
        self._live[key] = (uid, nbytes)
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            self._peak_pending = True
        weakref.finalize(storage, self._free, key, uid)
        return uid

    def _free(self, key: int, uid: int) -> None:
        entry = self._live.get(key)
        if entry is None or entry[0] != uid:
            return
        if self._peak_pending:
            self._peak_live = dict(self._live.values())
            self._peak_pending = False
        del self._live[key]
        self.current -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:  # most calls on fake tensors (autograd asks each input's device): kept cheap
            return func(*args)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._flop_formulas is not None:
            formula = self._flop_formulas.get(func._overloadpacket)
            if formula is not None:
                if func._overloadname in ("dtype", "dtype_out"):
                    # mm/addmm/bmm with an out_dtype: the FLOPs of the product without one, whose formula takes no
                    # dtype (positional in these overloads' schemas).
                    args = tuple(a for a in args if not isinstance(a, torch.dtype))
                    kwargs = {k: v for k, v in kwargs.items() if k != "out_dtype"}
                self.flops += formula(*args, **kwargs, out_val=out)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        return out

    # -- queries -------------------------------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, nbytes: int | None = None) -> int:
        """Count an existing tensor's storage (weights made before tracking); ``nbytes`` overrides its size."""
        return self._count(tensor.untyped_storage(), nbytes)

    def uid(self, tensor: torch.Tensor) -> int | None:
        """The id of ``tensor``'s storage if it is live and counted."""
        entry = self._live.get(tensor.untyped_storage()._cdata)
        return None if entry is None else entry[0]

    def uids(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The ids of those of ``tensors`` whose storages are live and counted."""
        return {u for u in (self.uid(t) for t in tensors) if u is not None}

    def live(self) -> dict[int, int]:
        """uid -> bytes of every storage live now."""
        return dict(self._live.values())

    def peak_live(self) -> dict[int, int]:
        """uid -> bytes of the storages live at the peak since the last :meth:`reset_peak`."""
        if self._peak_pending:
            self._peak_live = dict(self._live.values())
            self._peak_pending = False
        return dict(self._peak_live)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.current
        self._peak_live = dict(self._live.values())
        self._peak_pending = False

    @staticmethod
    def breakdown(live: dict[int, int], kind_of: Callable[[int], str]) -> dict[str, int]:
        """Bytes per kind of a live set (``live()`` or ``peak_live()``), ``kind_of(uid)`` naming each storage."""
        out: dict[str, int] = {}
        for uid, nbytes in live.items():
            kind = kind_of(uid)
            out[kind] = out.get(kind, 0) + nbytes
        return out
