"""Cayley-Adam on the Stiefel manifold, in the form of ``torch.optim.adam``: the functional step :func:`cayley_adam`
and the optimizer :class:`CayleyAdam`, which keeps the state beside each parameter and calls it. It needs torch and
Stiefel geometry only (PEFT's ``optimizers`` could take it as is); its checks raise ``ValueError``/``TypeError``, as
torch's optimizers do.

May import: adapter, optim.dtensor, optim.masters, stiefel.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.optim import Optimizer

from ..adapter import expert_blocks
from ..stiefel import (
    CAYLEY_SOLVERS,
    cayley_span_step,
    cholesky_qr,
    inverse_cholesky_factor,
    qr_retraction,
    skew_generator,
)
from .dtensor import all_reduce_sum, is_dtensor, local_gradient, local_rows, reduce_groups
from .masters import compute_dtype, follow_parameter, signature
from .masters import restore_compute_state as restore_state


__all__ = [
    "GRAPH_BACKENDS",
    "GRAPH_WARMUP_STEPS",
    "IMPLEMENTATIONS",
    "LINEAR_ALGEBRA_CONTEXTS",
    "REPROJECT_THRESHOLD",
    "RUN_SETTINGS",
    "CayleyAdam",
    "bucket_key",
    "cayley_adam",
    "check_cayley_adam_settings",
    "COUNTERS",
    "counter_sums",
    "counter_totals",
    "default_cuda_graph",
    "GRAM_ROW_BLOCK",
    "gram_by_row_blocks",
    "init_cayley_adam_state",
    "resolve_cuda_graph",
    "resolve_implementation",
    "restore_compute_state",
    "run_settings_kept",
    "stiefel_step_with_gradients",
]


# How a bucket's matrices are copied into the step's buffer and back: see the module docstring.
IMPLEMENTATIONS = ("per_matrix", "staged")

# ‖BᵀB − I‖_F above which a matrix is re-projected onto the manifold within the step. An fp32 Cayley-Adam run
# stays below 1e-4 for thousands of steps; more means the step size or the gradients have gone wrong.
REPROJECT_THRESHOLD = 1e-3

# State entries kept in the compute dtype (fp32, or fp64 for fp64 parameters), whatever the parameter's dtype.
_COMPUTE_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")
# Counters, one per matrix (per expert block): steps taken, steps skipped, re-projections onto the manifold.
_COUNTER_KEYS = ("step", "skipped_steps", "reprojections")
# The per-matrix scalars of the state (tensors of shape () or (E,)).
_STATE_SCALAR_KEYS = ("exp_avg_sq", *_COUNTER_KEYS)


def resolve_implementation(implementation: str | None, device: torch.device) -> str:
    """How the step reaches the matrices on ``device`` (:func:`cayley_adam`): ``implementation`` where given, else
    ``"per_matrix"`` on the CPU and ``"staged"`` elsewhere.

    Matrix by matrix, each matrix is read where it lies and its reads stay in the cache, with no pass that copies it:
    on a CPU, where an op costs microseconds of host time, that is the fastest. On an accelerator each op is a kernel
    launch, and a few batched kernels per shape bucket (through a dense buffer) beat a dozen per matrix.
    """
    if implementation is not None:  # checked where it is given: CayleyAdam's groups, cayley_adam()'s argument
        return implementation
    return "per_matrix" if device.type == "cpu" else "staged"


def bucket_key(p: torch.Tensor) -> tuple:
    """What Stiefel parameters are stepped together by: whole-matrix shape, device, compute dtype and layout (a
    DTensor's mesh and placements). What every rank sees alike, so the all-reduces of a sharded bucket pair up across
    ranks even where the local row counts differ."""
    layout = (id(p.device_mesh), tuple(p.placements)) if is_dtensor(p) else None
    return tuple(p.shape), p.device, compute_dtype(p), layout


# ------------------------------------------------------------------------------------------------------ checks
def _refuse(key: str, value: Any, accepted: str, error: type[Exception] = ValueError) -> None:
    raise error(f"{key}={value!r} is invalid: {accepted}.")


# The module checks its own numbers, as torch's optimizers do: it imports nothing beyond torch and Stiefel geometry,
# so validation's equivalents (the rules of what a user types) are not at hand here.
def _real(value: Any) -> bool:
    """A finite int or float (not a bool: YAML's `true` is not 1)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def check_cayley_adam_settings(
    *,
    betas: Any,
    eps: Any,
    qr_period: Any,
    cayley_solver: Any,
    cayley_iters: Any,
    keys: Mapping[str, Any] | None = None,
    error: type[ValueError] = ValueError,
) -> None:
    """The one rule of each Cayley-Adam setting, which ``CayleyAdam``'s param groups and ``FoRAConfig`` both check:
    ``error`` naming the key, the value and what is accepted. ``keys``: the caller's name of each setting where it
    differs (FoRAConfig's ``stiefel_eps``); ``betas`` named by a pair of keys is checked as two settings."""
    keys = keys or {}
    beta_keys = keys.get("betas", "betas")
    if isinstance(beta_keys, str):
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_real(b) and 0 <= b < 1 for b in betas)):
            _refuse(beta_keys, betas, "use two floats in [0, 1), e.g. (0.9, 0.99)", error)
    else:
        for key, beta in zip(beta_keys, betas):
            if not (_real(beta) and 0 <= beta < 1):
                _refuse(key, beta, "use a float in [0, 1), e.g. 0.9 and 0.99", error)
    if not (_real(eps) and eps >= 0):
        _refuse(keys.get("eps", "eps"), eps, "use a finite float >= 0, e.g. 1e-8", error)
    if not (_integer(qr_period) and qr_period >= 0):
        _refuse(keys.get("qr_period", "qr_period"), qr_period, "use an int >= 0 (0 = never re-project)", error)
    if cayley_solver not in CAYLEY_SOLVERS:
        _refuse(keys.get("cayley_solver", "cayley_solver"), cayley_solver, f"use one of {CAYLEY_SOLVERS}", error)
    if not (_integer(cayley_iters) and cayley_iters >= 1):
        _refuse(keys.get("cayley_iters", "cayley_iters"), cayley_iters, "use an int >= 1 (the paper uses 5)", error)


def _check_hyperparameters(group: dict[str, Any]) -> None:
    if not (_real(group["lr"]) and group["lr"] >= 0):
        _refuse("lr", group["lr"], "use a finite float >= 0 (the paper uses 1e-3)")
    check_cayley_adam_settings(
        betas=group["betas"],
        eps=group["eps"],
        qr_period=group["qr_period"],
        cayley_solver=group["cayley_solver"],
        cayley_iters=group["cayley_iters"],
    )
    threshold = group["reproject_threshold"]
    if not (_real(threshold) and threshold > 0):
        _refuse(
            "reproject_threshold",
            threshold,
            f"use a finite float > 0 (default {REPROJECT_THRESHOLD}, the ‖BᵀB − I‖ above which B is re-projected onto "
            "the manifold)",
        )
    if not (_integer(group["num_experts"]) and group["num_experts"] >= 1):
        _refuse(
            "num_experts",
            group["num_experts"],
            "use an int >= 1 (the number of (d_out, r) expert blocks interleaved in each lora_B of the group; 1 for "
            "an ordinary LoRA layer)",
        )
    if group["implementation"] not in (None, *IMPLEMENTATIONS):
        _refuse("implementation", group["implementation"], f"use one of {IMPLEMENTATIONS}, or None (by device)")
    if not (group["cuda_graph"] is None or isinstance(group["cuda_graph"], bool)):  # 0 would pass `in (None, ...)`
        _refuse(
            "cuda_graph",
            group["cuda_graph"],
            "use True (captured), False (eager) or None (captured where it can be)",
            TypeError,
        )


def _check_stiefel_parameter(p: torch.Tensor, index: int, num_experts: int = 1) -> None:
    if not p.is_floating_point():
        raise TypeError(f"CayleyAdam parameter #{index} has dtype {p.dtype}; a Stiefel matrix must be floating point.")
    if p.ndim != 2:
        raise ValueError(
            f"CayleyAdam parameter #{index} has shape {tuple(p.shape)}: only 2-D (d_out, r) matrices "
            "can be kept column-orthonormal. Put 1-D parameters (biases, norms) in an AdamW group."
        )
    d, width = p.shape
    if width % num_experts:
        raise ValueError(
            f"CayleyAdam parameter #{index} has shape {tuple(p.shape)} in a group with num_experts={num_experts}: "
            f"its {width} columns are not r columns for each of {num_experts} experts. Put it in the group of its "
            "own number of experts (PEFT's lora_B of E experts has r·E columns)."
        )
    r = width // num_experts
    if d < r:
        raise ValueError(
            f"CayleyAdam parameter #{index} has shape {tuple(p.shape)} with d_out={d} < r={r}: it "
            f"cannot have {r} orthonormal columns. Use a LoRA rank r <= {d} for this module."
        )
    reduce_groups(p)  # refuses a layout the row-sharded step cannot handle


# ------------------------------------------------------------------------------------------------------ the class
class CayleyAdam(Optimizer):
    """Adam on the Stiefel manifold St(d, r) with an exact O(d·r²) Cayley retraction.

    The algorithm is the paper's Appendix C ("Adam moments on the manifold"): a first moment m of the Euclidean
    gradient, a scalar second moment v of its squared Frobenius norm, Adam's bias correction, the skew direction
    W(m̂) / (√v̂ + ε) and a Cayley step of size lr. After the step the first moment is replaced by W(m) B_{t+1}, its
    tangent part carried to the new point (Q commutes with W, so this is Q·W(m)B_t: the momentum moves with the
    point). Matrices of one shape are stepped together in one buffer, so the kernel launches per step do not grow
    with the number of adapters. The step reads the matrices only through the 2r x 2r Gram matrix of [B, m] (a sum
    over rows) and ‖G‖².

    Every parameter is a ``(d_out, r)`` matrix (a LoRA ``lora_B`` weight) kept column-orthonormal, BᵀB = I_r. A
    parameter off the manifold at its first step is projected onto it (QR). All math runs in fp32 (fp64 for an fp64
    parameter): a bf16/fp16 parameter gets an fp32 master copy in the optimizer state, and its stored value is the
    master rounded.

    A group with ``"num_experts": E`` holds PEFT ``lora_B`` of E experts, (d_out, r·E) with the experts' columns
    interleaved: each expert's (d_out, r) block is its own Stiefel matrix, with its own second moment, step count
    and re-projection; state counters then have shape (E,).

    A parameter may be a DTensor sharded by rows (``Shard(0)``, e.g. under FSDP2): the step runs on the local rows
    and sums the Gram matrices over the mesh, so every rank computes the step of the whole matrix. Its ``exp_avg``
    (and ``master``) are DTensors with the parameter's placements; the scalars are replicated plain tensors.

    A matrix whose gradient holds inf/NaN skips its step (B, m and v unchanged) and its ``skipped_steps`` state
    counter grows; the other matrices of the batch step as usual. A matrix that has drifted from the manifold by
    more than ``reproject_threshold`` (‖BᵀB − I‖_F, read from the Gram matrix the step forms anyway) is re-projected
    in the same step and its ``reprojections`` counter grows: no host sync.

    Args:
        params: iterable of parameters or of param-group dicts.
        lr: Cayley step size (the paper's lr_B, 1e-3).
        betas: decay of the first moment and of the scalar second moment.
        eps: added to √v̂. 0 is allowed: a matrix that has only seen zero gradients does not move.
        qr_period: re-project every matrix onto the manifold every ``qr_period`` steps; 0 = never.
        reproject_threshold: re-project a matrix whose ‖BᵀB − I‖_F exceeds this.
        cayley_solver: ``"exact"`` (Woodbury, one 2r x 2r solve) or ``"fixed_point"`` (the paper's iteration; its
            step is capped at 1/‖W‖_F so that the iteration contracts).
        cayley_iters: iterations of the fixed-point solver.
        num_experts: expert blocks per parameter (a group key; 1 for ordinary LoRA).
        implementation: how the step reaches the matrices, one of :data:`IMPLEMENTATIONS`; None (the default)
            picks by device (:func:`resolve_implementation`). The paths agree to rounding.
        cuda_graph: whether each group's step is captured in a CUDA graph after :data:`GRAPH_WARMUP_STEPS` eager
            steps and replayed at every later step: one launch from the host instead of one per kernel. None (the
            default): captured where the group can be (its parameters on one CUDA device, none row-sharded:
            :func:`resolve_cuda_graph`), eager elsewhere (the CPU, FSDP2). True: captured, and refused where it
            cannot be. False: eager (for debugging). A cast, move or load of a parameter or its state is followed by
            an eager step, then a new capture.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        qr_period: int = 200,
        cayley_solver: str = "exact",
        cayley_iters: int = 5,
        reproject_threshold: float = REPROJECT_THRESHOLD,
        num_experts: int = 1,
        *,
        implementation: str | None = None,
        cuda_graph: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            qr_period=qr_period,
            cayley_solver=cayley_solver,
            cayley_iters=cayley_iters,
            reproject_threshold=reproject_threshold,
            num_experts=num_experts,
            implementation=implementation,
            cuda_graph=cuda_graph,
            stiefel=True,
            steps=0,
        )
        # Kept on the optimizer, out of its state_dict: p -> what the step last left in p (signature), the step's
        # small constant tensors, and each group's captured step.
        self._written: dict[torch.Tensor, tuple] = {}
        self._constants: dict[tuple, Any] = {}
        self._captures: dict[int, Any] = {}
        self._capture_counts: dict[int, int] = {}
        self._eager_groups: set[int] = set()  # groups captured MAX_CAPTURES times
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group)
        for index, p in enumerate(group["params"]):
            _check_stiefel_parameter(p, index, group["num_experts"])
        resolve_cuda_graph(group["cuda_graph"], group["params"])  # refuses a capture the parameters cannot have

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with run_settings_kept(self):
            super().load_state_dict(state_dict)
        restore_compute_state(self, state_dict)
        self.forget_writes()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _group_step(self, group)
        return loss

    def forget_writes(self) -> None:
        """Forget what the step last wrote into each parameter: the next step reconciles every parameter with its
        state (a loaded master meets a parameter the step has not written, e.g. after ``load_state_dict``), and
        steps eagerly before it captures again."""
        self._written.clear()
        self._captures.clear()

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds a Stiefel point or Cayley-Adam state, in a fixed order: what a broadcast of the
        whole state sends (ZeRO-1/2's periodic sync). Each is its own storage, so a collective can write into it."""
        tensors = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                tensors.append(p.data)
                tensors.extend(state[key] for key in ("master", "exp_avg", *_STATE_SCALAR_KEYS) if key in state)
        return tensors

    def skipped_steps(self) -> int:
        """Matrix steps skipped for a non-finite gradient so far, over all parameters (one host sync)."""
        return counter_totals(self, ("skipped_steps",))["skipped_steps"]

    def reprojections(self) -> int:
        """Matrices re-projected onto the manifold for drifting too far so far, over all parameters (one host sync).
        Periodic ``qr_period`` re-projections are not counted."""
        return counter_totals(self, ("reprojections",))["reprojections"]


COUNTERS = ("skipped_steps", "reprojections")


def counter_sums(optimizer: Optimizer, keys: Iterable[str] = COUNTERS) -> dict[str, torch.Tensor | None]:
    """Each state counter of ``keys`` summed over every Stiefel matrix of ``optimizer``, on the device (no host
    sync: a log reads them with its other values); None for a counter no matrix has yet (before the first step)."""
    sums = {}
    for key in keys:
        counts = [s[key].sum() for s in optimizer.state.values() if key in s]
        sums[key] = torch.stack(counts).sum() if counts else None
    return sums


def counter_totals(optimizer: Optimizer, keys: Iterable[str] = COUNTERS) -> dict[str, int]:
    """:func:`counter_sums` read back in one host sync; 0 before the first step."""
    sums = counter_sums(optimizer, keys)
    present = [t for t in sums.values() if t is not None]
    values = iter(torch.stack(present).tolist() if present else [])
    return {key: 0 if t is None else int(next(values)) for key, t in sums.items()}


# The group keys that say how a step runs, not what it computes. They are this run's choice: a checkpoint saved under
# DeepSpeed (where an unset cuda_graph steps eagerly), on another device or with another flag must not set them.
RUN_SETTINGS = ("implementation", "cuda_graph")


@contextlib.contextmanager
def run_settings_kept(optimizer: Optimizer) -> Iterator[None]:
    """Around ``Optimizer.load_state_dict``, which puts every saved group key back: keep each group's
    :data:`RUN_SETTINGS` as this run set them."""
    kept = [{key: group[key] for key in RUN_SETTINGS if key in group} for group in optimizer.param_groups]
    yield
    # The loader has checked that the saved groups match these one for one.
    for group, settings in zip(optimizer.param_groups, kept, strict=True):
        group.update(settings)


def restore_compute_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """After ``Optimizer.load_state_dict(state_dict)``: put the saved Cayley-Adam state of every Stiefel group (a
    group with ``"stiefel": True``) back in its compute dtype, on the parameter's device: torch's loader would round
    a bf16 lora_B's fp32 master and moments to bf16, and it would stop being orthonormal."""
    restore_state(optimizer, state_dict, lambda g: g.get("stiefel"), _COMPUTE_STATE_KEYS, device_keys=_COUNTER_KEYS)


def init_cayley_adam_state(state: dict[str, Any], p: torch.Tensor, num_experts: int = 1) -> None:
    """Fill ``state`` (empty) for the Stiefel parameter ``p``: project ``p`` onto the manifold, in place, and make
    its moments, counters and, for a bf16/fp16 ``p``, its fp32 master. The first step does this; FSDP2's setup calls
    it before training so that the host-side checks of a row-sharded projection run once, outside the steps."""
    device, dtype = p.device, compute_dtype(p)
    groups = reduce_groups(p)
    # An fp32 p is projected in place; a bf16 p gets an fp32 copy (a DTensor with p's placements for a DTensor p).
    master = p.detach() if p.dtype == dtype else p.detach().to(dtype)
    blocks = expert_blocks(local_rows(master), num_experts)  # (E, d_local, r) view into master
    if groups:
        # Cholesky-QR2 on the local rows with the Gram matrix of the whole matrix: one all-reduce per pass.
        for _ in range(2):
            gram = blocks.mT @ blocks  # (E, r, r)
            all_reduce_sum(gram, groups)
            blocks.copy_(cholesky_qr(blocks, gram))
    else:
        blocks.copy_(qr_retraction(blocks))
    if p.dtype != dtype:
        state["master"] = master
        local_rows(p).copy_(local_rows(master))
    counter_shape = () if num_experts == 1 else (num_experts,)
    state["step"] = torch.zeros(counter_shape, dtype=torch.float32, device=device)
    # (d, r·E) row-major, whatever p's strides (a QR factor is column-major): the step writes it from a row-major
    # buffer, and a transposing copy is 5x slower. A DTensor keeps p's placements.
    state["exp_avg"] = torch.zeros_like(master, memory_format=torch.contiguous_format)
    state["exp_avg_sq"] = torch.zeros(counter_shape, dtype=dtype, device=device)
    state["skipped_steps"] = torch.zeros(counter_shape, dtype=torch.int64, device=device)
    state["reprojections"] = torch.zeros(counter_shape, dtype=torch.int64, device=device)


def stiefel_step_with_gradients(
    optimizer: CayleyAdam,
    grads: Mapping[torch.Tensor, torch.Tensor],
    groups: Iterable[dict[str, Any]] | None = None,
) -> None:
    """One :class:`CayleyAdam` step with ``grads[p]`` as the gradient of ``p`` in place of ``p.grad``.

    For gradients kept outside ``.grad``: an fp32 gradient of a bf16 parameter (``.grad`` must have the
    parameter's dtype), such as the all-reduced gradient of a replicated ``lora_B`` under DeepSpeed. ``groups``
    (default: all of ``optimizer.param_groups``) are the groups that step: a group left out keeps its step count.
    """
    with torch.no_grad():
        for group in optimizer.param_groups if groups is None else groups:
            _group_step(optimizer, group, grads)


# ------------------------------------------------------------------------------------------------------ the state
def _group_step(
    optimizer: CayleyAdam,
    group: dict[str, Any],
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One step of ``group``: its state made or brought in line with each parameter, then :func:`cayley_adam`,
    eagerly or by replaying the group's captured graph (:class:`_CapturedStep`)."""
    state, written = optimizer.state, optimizer._written
    group["steps"] += 1
    num_experts = group["num_experts"]
    period = group["qr_period"]
    params, param_grads = [], []
    replaced = False  # a tensor a captured step reads is another one now
    for p in group["params"]:
        grad = p.grad if grads is None else grads.get(p)
        if grad is None:
            continue
        if grad.is_sparse:
            raise TypeError("CayleyAdam does not support sparse gradients.")
        if not state[p]:
            init_cayley_adam_state(state[p], p, num_experts)
            replaced = True
        else:
            replaced |= follow_parameter(state[p], p, written.get(p), _COMPUTE_STATE_KEYS)
        params.append(p)
        param_grads.append(grad)
    if not params:
        return
    reproject_all = period > 0 and group["steps"] % period == 0
    if not _captured_step(optimizer, group, params, param_grads, replaced, reproject_all):
        _step_eagerly(optimizer, group, params, param_grads, reproject_all)
    for p in params:
        written[p] = signature(p)


def _step_arguments(optimizer: CayleyAdam, group: dict[str, Any], params: list[torch.Tensor]) -> tuple:
    """The state lists of ``params`` in :func:`cayley_adam`'s order, and its keyword arguments but lr and
    reproject_all."""
    states = [optimizer.state[p] for p in params]
    lists = tuple([s[key] for s in states] for key in ("exp_avg", "exp_avg_sq", *_COUNTER_KEYS))
    beta1, beta2 = group["betas"]
    settings = dict(
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        cayley_solver=group["cayley_solver"],
        cayley_iters=group["cayley_iters"],
        reproject_threshold=group["reproject_threshold"],
        num_experts=group["num_experts"],
        implementation=group["implementation"],
        constants=optimizer._constants,
    )
    return (*lists, [s.get("master") for s in states]), settings


def _step_eagerly(
    optimizer: CayleyAdam,
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    reproject_all: bool,
) -> None:
    lists, settings = _step_arguments(optimizer, group, params)
    cayley_adam(params, grads, *lists, lr=group["lr"], reproject_all=reproject_all, **settings)


# ------------------------------------------------------------------------------------------------------ captured
def _capture_cuda(run: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """Run ``run`` once on the device's capture stream, then capture it there in a CUDA graph; return the function
    that replays it.

    The run is the step of this iteration and the warm-up the CUDA-graph docs ask for: cuBLAS and cuSOLVER set up
    their handles and workspaces for the stream outside the capture. The step's linear algebra runs on cuSOLVER
    (:data:`LINEAR_ALGEBRA_CONTEXTS`), which a capture can hold.
    """
    with torch.cuda.device(device):
        stream = _CAPTURE_STREAMS.get(device)
        if stream is None:
            stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


# CUDA device -> the side stream every capture there warms up and captures on. One per device, as torch's own
# torch.cuda.graph keeps one: cuBLAS keeps a workspace for each stream it has run on (32 MiB on an H100) until the
# process ends, so a new stream per capture would leave one more behind at each capture.
_CAPTURE_STREAMS: dict[torch.device, Any] = {}


# device type -> how a step is captured there, ``capture(run, device) -> replay``: ``run`` runs once (the step of
# that iteration), then its kernels are captured without running. The tests add a stand-in for the CPU that records
# the aten ops and replays them on the same tensors, as a CUDA graph does.
GRAPH_BACKENDS: dict[str, Callable[[Callable[[], None], torch.device], Callable[[], None]]] = {"cuda": _capture_cuda}


@contextlib.contextmanager
def _cusolver() -> Iterator[None]:
    """torch's CUDA linear algebra on cuSOLVER and cuBLAS for the duration, the previous choice restored after.

    Left to its heuristic, torch 2.11 factors a batch of more than 16 matrices of order 17 to 128 (the step's 2r x 2r
    systems, one per matrix) with MAGMA, which synchronises the device with the host at each call and stages
    pointers in host memory that a CUDA graph cannot hold: host syncs that torch's sync debug mode does not see, and
    no capture.
    """
    if torch.compiler.is_compiling():  # a global setting, not something a compiled graph can hold
        yield
        return
    previous = torch.backends.cuda.preferred_linalg_library()
    _first_cusolver_choice()
    torch.backends.cuda.preferred_linalg_library("cusolver")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_linalg_library(previous)


@functools.cache
def _first_cusolver_choice() -> None:
    """The process's first choice of cuSOLVER, without the warning torch gives once a process that the setting is
    experimental, as if the user had asked for it (later choices do not warn: no filter on every step)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"torch\.backends\.cuda\.preferred_linalg_library is an experimental feature"
        )
        torch.backends.cuda.preferred_linalg_library("cusolver")


# device type -> the context the step's small linear algebra (Cholesky factors, triangular and LU solves of 2r x 2r
# matrices) runs in there; none on other devices.
LINEAR_ALGEBRA_CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {"cuda": _cusolver}

# Eager steps of a group before its step is captured: the first makes the state, the second steps it as every later
# step will (the capture's own run, the third, is then the warm-up on the capture stream).
GRAPH_WARMUP_STEPS = 2
# Captures of one group after which its step stays eager (with a warning): a group whose parameters get gradients on
# some steps only, or whose state something replaces at every step, would otherwise be captured at every step.
MAX_CAPTURES = 8


def resolve_cuda_graph(cuda_graph: bool | None, params: list[torch.Tensor]) -> bool:
    """Whether a group's step is captured. A group can be captured where all of its parameters are on one device with
    a graph backend (:data:`GRAPH_BACKENDS`: CUDA) and none is row-sharded (FSDP2's DTensor step all-reduces, which a
    graph would have to replay in lockstep with every rank). None (the default) captures where the group can be, the
    faster path measured on an H100 (docs/gpu.md) with the same result; True captures and refuses a group that cannot
    be, not stepping it eagerly behind the user's back; False never captures."""
    if cuda_graph is False or not params:  # an empty group has no step to capture
        return False
    devices = {p.device for p in params}
    device = next(iter(devices))
    sharded = any(is_dtensor(p) for p in params)
    capturable = len(devices) == 1 and device.type in GRAPH_BACKENDS and not sharded
    if cuda_graph is None or capturable:
        return capturable
    raise ValueError(
        f"cuda_graph=True is invalid for a group of {len(params)} parameter(s) on {sorted(map(str, devices))}"
        f"{' (row-sharded DTensors)' if sharded else ''}: a step is captured where every parameter of the group is "
        f"on one {sorted(GRAPH_BACKENDS)} device and none is sharded. Set cuda_graph to False (or leave it unset) "
        "there."
    )


def default_cuda_graph(cuda_graph: bool | None, *, data_parallel: bool) -> bool | None:
    """The ``cuda_graph`` a training run gives Cayley-Adam: as the user set it; unset, None (captured where a group
    can be, :func:`resolve_cuda_graph`) in a process started without a launcher, where the captured step was measured
    equal to the eager one and faster (docs/gpu.md), and False (eager) under a data-parallel launcher or engine (DDP,
    even of one process, DeepSpeed ZeRO, FSDP2), where it has not been measured yet. True is kept everywhere: the user
    asked for the capture."""
    if cuda_graph is None and data_parallel:
        return False
    return cuda_graph


class _CapturedStep:
    """One group's :func:`cayley_adam` captured once and replayed at each step.

    A graph replays the same kernels on the same memory, so everything the step reads must stay where it was at the
    capture: the parameters and their state (a tensor replaced drops the capture, :func:`_captured_step`; a write in
    place is read in place), the gradients (copied into buffers of the capture's own, one multi-tensor copy: a
    trainer's ``zero_grad`` frees them each step), and the learning rate and the periodic re-projection, which are
    device tensors written before each replay, so a schedule changes them without a new capture. Made at the step it
    is captured at, which it takes eagerly (the backend's run).
    """

    def __init__(
        self,
        optimizer: CayleyAdam,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        key: tuple,
        lr: float,
        reproject_all: bool,
    ) -> None:
        self.key = key
        device = params[0].device
        self.grads = [torch.empty_like(g, memory_format=torch.contiguous_format) for g in grads]
        # fp64, so an fp64 group's algebra gets the rate exactly; an fp32 one rounds it as it rounds a Python float.
        self.lr = torch.zeros((), dtype=torch.float64, device=device)
        self.reproject_all = torch.zeros((), dtype=torch.bool, device=device)
        self.fill(grads, lr, reproject_all)
        lists, settings = _step_arguments(optimizer, group, params)
        # The constants are made before the capture: made inside it, they would hold nothing until its first replay.
        betas = (settings["beta1"], settings["beta2"])
        for p in params:
            _Constants.cached(settings["constants"], [p], betas, settings["num_experts"])

        def run() -> None:
            cayley_adam(params, self.grads, *lists, lr=self.lr, reproject_all=self.reproject_all, **settings)

        self._replay = GRAPH_BACKENDS[device.type](run, device)

    def fill(self, grads: list[torch.Tensor], lr: float | torch.Tensor, reproject_all: bool) -> None:
        torch._foreach_copy_(self.grads, grads)
        self.lr.fill_(lr)
        self.reproject_all.fill_(reproject_all)

    def replay(self, grads: list[torch.Tensor], lr: float | torch.Tensor, reproject_all: bool) -> None:
        self.fill(grads, lr, reproject_all)
        self._replay()


def _captured_step(
    optimizer: CayleyAdam,
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    replaced: bool,
    reproject_all: bool,
) -> bool:
    """Take the group's step through its capture: replayed, or captured now (a capture runs the step once). False:
    step eagerly this time (before the capture, or after a tensor it read was replaced: the next step captures)."""
    if not resolve_cuda_graph(group["cuda_graph"], params) or id(group) in optimizer._eager_groups:
        return False
    captures = optimizer._captures
    # What the capture depends on besides the tensors it reads in place: which parameters step, their gradients'
    # layout, and the group's settings other than lr.
    key = (
        tuple(map(id, params)),
        tuple((g.dtype, g.shape) for g in grads),
        tuple(group[k] for k in _CAPTURED_GROUP_KEYS),
    )
    captured = captures.get(id(group))
    if replaced or group["steps"] <= GRAPH_WARMUP_STEPS or (captured is not None and captured.key != key):
        captures.pop(id(group), None)
        return False
    if captured is not None:
        captured.replay(grads, group["lr"], reproject_all)
        return True
    count = optimizer._capture_counts[id(group)] = optimizer._capture_counts.get(id(group), 0) + 1
    if count > MAX_CAPTURES:
        optimizer._eager_groups.add(id(group))
        warnings.warn(
            f"CayleyAdam: a group of {len(params)} lora_B was captured {MAX_CAPTURES} times (its parameters' "
            "gradients or state keep changing) and steps eagerly from now on.",
            stacklevel=4,
        )
        return False
    captures[id(group)] = _CapturedStep(optimizer, group, params, grads, key, group["lr"], reproject_all)
    return True


# Group settings a captured step holds as they were at its capture (lr and the re-projection flag are tensors).
_CAPTURED_GROUP_KEYS = (
    "betas",
    "eps",
    "cayley_solver",
    "cayley_iters",
    "reproject_threshold",
    "num_experts",
    "implementation",
)


# ------------------------------------------------------------------------------------------------------ the step
def cayley_adam(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    skipped_steps: list[torch.Tensor],
    reprojections: list[torch.Tensor],
    masters: list[torch.Tensor | None] | None = None,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    cayley_solver: str = "exact",
    cayley_iters: int = 5,
    reproject_threshold: float = REPROJECT_THRESHOLD,
    reproject_all: bool | torch.Tensor = False,
    num_experts: int = 1,
    implementation: str | None = None,
    constants: dict | None = None,
) -> None:
    """Functional API that performs one Cayley-Adam step, in place: see :class:`CayleyAdam` for the algorithm.

    One entry per Stiefel parameter in each list, with the state :func:`init_cayley_adam_state` makes:

    - ``params``: the (d_out, r·E) matrices, plain tensors or DTensors sharded by rows; ``grads``: their gradients,
      of the parameter's kind, in any float dtype;
    - ``exp_avgs``: the first moments (the parameter's layout, compute dtype); ``exp_avg_sqs``, ``state_steps``,
      ``skipped_steps``, ``reprojections``: the per-matrix scalars, shape () or (E,);
    - ``masters``: the compute-dtype copy of a low-precision parameter, which the step moves and then stores rounded
      in the parameter; None where the parameter is its own point (default: everywhere).

    ``lr``: a float, or a 0-dim tensor on the parameters' device (a captured step reads its rate from one);
    ``reproject_all``: re-project every matrix this step (:class:`CayleyAdam`'s ``qr_period``), a bool or a 0-dim bool
    tensor; ``num_experts``: expert blocks per parameter; ``implementation``: one of :data:`IMPLEMENTATIONS` or None
    (by device, :func:`resolve_implementation`); ``constants``: a dict the caller keeps between steps for the step's
    small constant tensors (None: made for this call). The step reads nothing back to the host.

    The step runs in three phases, so that the small algebra runs once for all matrices of one rank r, whatever their
    shapes: (1) each matrix's first moment m is moved to β1 m + (1 − β1) G and the Gram matrix of [B, m] and ‖G‖² are
    formed; (2) from those alone, one batched 2r x 2r computation gives each matrix's Δ; (3) [B, m] ← [B, m] (I + Δ).
    ``implementation`` says how phases 1 and 3 reach the matrices: ``"per_matrix"`` (the CPU's default) works on each
    matrix in its own storage, one after the other (each matrix's reads stay in the cache, and no pass copies it);
    ``"staged"`` (an accelerator's) copies a shape bucket (:func:`bucket_key`) into a dense buffer and works on it in
    batched products: a few kernels per bucket, whatever the number of matrices. A bucket of DTensor ``lora_B``
    sharded by rows (``Shard(0)``, FSDP2's ``fully_shard``) works on its local rows, and the Gram matrices and ‖G‖²
    are summed over the mesh (one all-reduce per mesh) before phase 2. A fused-MoE ``lora_B`` (d_out, r·E) is E
    matrices (its interleaved expert blocks), each with its own scalars.
    """
    if implementation not in (None, *IMPLEMENTATIONS):
        _refuse("implementation", implementation, f"use one of {IMPLEMENTATIONS}, or None (by device)")
    if masters is None:
        masters = [None] * len(params)
    local_grads = [local_gradient(p, g) for p, g in zip(params, grads)]
    settings = _Settings(
        lr, beta1, beta2, eps, cayley_solver, cayley_iters, reproject_threshold, reproject_all, num_experts
    )
    cache = {} if constants is None else constants
    # Buckets of one shape, then the buckets of one rank r (and compute dtype and device): the 2r x 2r algebra of
    # each such set of buckets runs once.
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for index, p in enumerate(params):
        buckets[bucket_key(p)].append(index)
    by_rank: dict[tuple, list[list[int]]] = defaultdict(list)
    # Smallest bucket first (by whole-matrix size, which every rank sees alike): the staged step keeps each bucket's
    # buffer from its phase 1 to its phase 3, which frees it, so beside a bucket's phase-3 scratch only its own and
    # the larger buckets' buffers are alive. The step's peak is then at most what it was with a buffer for one bucket
    # at a time wherever the largest bucket holds half of the entries or more (the LLaMA and Qwen3-MoE sets of
    # bench/optimizer.py); buckets of about one size keep more (three of one size: about 1.6x).
    for key, indices in sorted(buckets.items(), key=lambda item: math.prod(item[0][0]) * len(item[1])):
        by_rank[(key[0][1] // num_experts, *key[1:3])].append(indices)
    lists = (params, local_grads, masters, exp_avgs, exp_avg_sqs, state_steps, skipped_steps, reprojections)
    for rank_buckets in by_rank.values():
        _rank_step(
            [[[values[i] for i in indices] for values in lists] for indices in rank_buckets],
            settings,
            cache,
            implementation,
        )


class _Settings(NamedTuple):
    """The hyperparameters of one step."""

    lr: float | torch.Tensor
    beta1: float
    beta2: float
    eps: float
    cayley_solver: str
    cayley_iters: int
    reproject_threshold: float
    reproject_all: bool | torch.Tensor
    num_experts: int


def _rank_step(buckets: list[list[list]], settings: _Settings, cache: dict, implementation: str | None) -> None:
    """The step of the buckets of one rank r: each bucket is the lists of :func:`cayley_adam` for its matrices."""
    first = buckets[0]
    moment = local_rows(first[3][0])
    dtype, device = moment.dtype, moment.device  # the compute dtype
    E = settings.num_experts
    constants = _Constants.cached(cache, first[0], (settings.beta1, settings.beta2), E)
    implementation = resolve_implementation(implementation, device)
    measure, update = _PHASES[implementation]
    # Phase 1, a bucket at a time: only one bucket's scratch is alive at once, beside what each hands to phase 3.
    measured = [measure(*bucket[:4], settings, constants) for bucket in buckets]
    grams = [m[0] for m in measured]
    grad_sqs = [m[1] for m in measured]
    layouts = [reduce_groups(bucket[0][0]) for bucket in buckets]
    for groups in dict.fromkeys(layouts):  # one all-reduce per mesh: every rank holds the same buckets
        if not groups:
            continue
        members = [i for i, layout in enumerate(layouts) if layout == groups]
        sums = torch.cat([torch.cat((grams[i].flatten(1), grad_sqs[i][:, None]), dim=1) for i in members])
        all_reduce_sum(sums, groups)
        for i, part in zip(members, sums.split([len(grad_sqs[i]) for i in members])):
            grams[i], grad_sqs[i] = part[:, :-1].view_as(grams[i]), part[:, -1]
    # Phase 2: the algebra of every matrix of the buckets at once.
    gram, grad_sq = torch.cat(grams), torch.cat(grad_sqs)
    n = grad_sq.shape[0]
    scalar_lists = [[t for bucket in buckets for t in bucket[k]] for k in range(4, 8)]  # v, step, skipped, reproj
    v, step, skipped, reprojected = (torch.stack(ts).reshape(n) for ts in scalar_lists)
    counts = torch.stack((skipped, reprojected))  # (2, n)
    finite = grad_sq < math.inf  # False for inf and nan (one op, where isfinite takes four)
    with LINEAR_ALGEBRA_CONTEXTS.get(device.type, contextlib.nullcontext)():
        delta = _cayley_adam_deltas(gram, grad_sq, finite, step, v, counts, settings, constants)
    # Phase 3, a bucket at a time.
    offsets = [0]
    for g in grad_sqs:
        offsets.append(offsets[-1] + len(g))
    for bucket, (_, _, carried), start, stop in zip(buckets, measured, offsets, offsets[1:]):
        update(bucket[0], bucket[2], bucket[3], delta[start:stop], finite[start:stop], carried, E, dtype)
    scalar_shape = () if E == 1 else (E,)
    for tensors, value in zip(scalar_lists, (v, step, counts[0], counts[1])):
        torch._foreach_copy_(tensors, list(value.view(len(tensors), *scalar_shape).unbind(0)))


def _points(params: list[torch.Tensor], masters: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The local rows of each matrix's point on the manifold: its master, or the parameter itself."""
    return [local_rows(p if m is None else m) for p, m in zip(params, masters)]


def _store_masters(params: list[torch.Tensor], masters: list[torch.Tensor | None]) -> None:
    """Each low-precision parameter takes its master's new value, rounded."""
    pairs = [(local_rows(p), local_rows(m)) for p, m in zip(params, masters) if m is not None]
    if pairs:
        torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])


def _finite_gradient(G: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``G`` with every inf and NaN replaced by ± the dtype's largest value. A skipped matrix's first moment m + 0·(G −
    m) is then m exactly, and the squared norm of the result still overflows to inf wherever ``G`` was not finite, so
    one pass over ``G`` serves both (a finite ``G`` whose squared norm overflows is skipped as well)."""
    big = torch.finfo(G.dtype).max
    return torch.nan_to_num(G, big, big, -big, out=out) if out is not None else G.nan_to_num_(big, big, -big)


def _lerp_weights(norm: torch.Tensor, constants: _Constants) -> torch.Tensor:
    """``norm``'s shape: 1 − β1 for a matrix whose gradient norm (of this rank's rows) has a finite square, 0 for one
    that skips: the one skip rule of both implementations (its square, ‖G‖², is what phase 2 reads)."""
    return torch.where(norm <= _NORM_LIMITS[norm.dtype], constants.lerp_weight, constants.zero)


# ---- phases 1 and 3 matrix by matrix, each in its own storage (the CPU's)
# A plain lora_B is worked on as the (d, r) matrix it is, with 2-D products; a fused-MoE one as its (E, d, r) blocks,
# with batched products. Each matrix's outputs are views made in one op per kind before the loop: an op costs
# microseconds of host time on a CPU.
def _blocks(t: torch.Tensor, E: int, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (d, r·E) as the matrices the step works on, in ``dtype``: ``t`` itself where it is a plain matrix of that
    dtype, else a copy ((E, d, r) interleaved expert blocks, which products would copy anyway; a bf16 gradient)."""
    if E == 1:
        return t if t.dtype == dtype else t.to(dtype)
    return expert_blocks(t, E).to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def _slots(t: torch.Tensor, E: int) -> tuple[torch.Tensor, ...]:
    """``t``'s leading dimension (one entry per matrix) as one view per lora_B: an entry, or E of them."""
    return t.unbind(0) if E == 1 else t.split(E)


def _norm_limit(dtype: torch.dtype) -> float:
    """The largest ``x`` of ``dtype`` whose square is finite in ``dtype``: ``‖G‖ <= limit`` holds exactly where
    ``‖G‖²`` is finite, so one comparison of the norm decides a skip."""
    limit = torch.tensor(math.sqrt(torch.finfo(dtype).max), dtype=dtype)
    inf = torch.tensor(math.inf, dtype=dtype)
    while not torch.isfinite(limit * limit):
        limit = torch.nextafter(limit, -inf)
    while torch.isfinite(torch.nextafter(limit, inf) ** 2):
        limit = torch.nextafter(limit, inf)
    return limit.item()


_NORM_LIMITS = {dtype: _norm_limit(dtype) for dtype in (torch.float32, torch.float64)}


def _measure_per_matrix(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    masters: list[torch.Tensor | None],
    exp_avgs: list[torch.Tensor],
    settings: _Settings,
    constants: _Constants,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, list]]:
    """Phase 1 for one bucket, matrix by matrix: the first moments moved in place, the Gram matrices of [B, m] (n, 2r,
    2r) and ‖G‖² (n,) of this rank's rows, and what phase 3 takes over: the expert blocks of B and m copied out here
    (copied out again, they would cost as many transposing copies as the rest of the step) and, under sharding, the
    moments before the move (a matrix another rank skips keeps them)."""
    E = settings.num_experts
    points, moments = _points(params, masters), [local_rows(t) for t in exp_avgs]
    dtype, device = moments[0].dtype, moments[0].device
    n, d, r = len(params) * E, points[0].shape[0], points[0].shape[1] // E
    sharded = bool(reduce_groups(params[0]))
    product = torch.mm if E == 1 else torch.bmm
    # ‖G‖ of each matrix, and the blocks BᵀB, Bᵀm, mᵀm of its Gram matrix, each written whole (a product into a
    # strided block of one (n, 2r, 2r) tensor would go through a copy, and break a compiled graph).
    norms = torch.empty((n, 1, 1), dtype=dtype, device=device)
    blocks = torch.empty((3, n, r, r), dtype=dtype, device=device)
    outputs = zip(_slots(norms if E > 1 else norms.view(n), E), *(_slots(b, E) for b in blocks))
    scratch = torch.empty((d, r), dtype=dtype, device=device)  # a gradient made finite, where not a copy
    carried = {"old_moments": [] if sharded else None, "blocks": [] if E > 1 else None}
    for B, m, G, (norm, btb, btm, mtm) in zip(points, moments, grads, outputs):
        view = E == 1 and G.dtype == dtype  # else _blocks copies
        G = _finite_gradient(_blocks(G, E, dtype), out=scratch if view else None)
        torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=E > 1, out=norm)  # its square is inf if G was not finite
        M = _blocks(m, E, dtype)
        if sharded:
            carried["old_moments"].append(M.clone())
        # m_{t+1}; a skipped matrix keeps m_t: m + 0·G
        M.lerp_(G, _lerp_weights(norm, constants))
        B = _blocks(B, E, dtype)
        if E > 1:
            carried["blocks"].append((B, M))
        Bt = B.mT
        product(Bt, B, out=btb)
        product(Bt, M, out=btm)
        product(M.mT, M, out=mtm)
    gram = torch.empty((n, 2 * r, 2 * r), dtype=dtype, device=device)
    gram[:, :r, :r], gram[:, :r, r:], gram[:, r:, :r], gram[:, r:, r:] = blocks[0], blocks[1], blocks[1].mT, blocks[2]
    return gram, norms.view(n).square_(), carried


def _update_per_matrix(
    params: list[torch.Tensor],
    masters: list[torch.Tensor | None],
    exp_avgs: list[torch.Tensor],
    delta: torch.Tensor,
    finite: torch.Tensor,
    carried: dict[str, list],
    E: int,
    dtype: torch.dtype,
) -> None:
    """Phase 3 for one bucket, matrix by matrix: [B, m] ← [B, m] + [B, m] Δ, Δ (n, 2r, 2r); ``carried``: what
    :func:`_measure_per_matrix` hands over."""
    points, moments = _points(params, masters), [local_rows(t) for t in exp_avgs]
    d, r = points[0].shape[0], points[0].shape[1] // E
    product, accumulate = (torch.mm, torch.Tensor.addmm_) if E == 1 else (torch.bmm, torch.Tensor.baddbmm_)
    # [B, m] Δ of one matrix, its two halves apart: each is then added to a dense tensor (5% faster than halves of
    # one (E, d, 2r) product on a CPU, where the adds read their operands from memory).
    step_b, step_m = torch.empty((2, *((E,) if E > 1 else ()), d, r), dtype=dtype, device=delta.device)
    quarters = [_slots(q, E) for q in (delta[:, :r, :r], delta[:, r:, :r], delta[:, :r, r:], delta[:, r:, r:])]
    old_moments = carried["old_moments"]
    keep = _slots(finite.view(-1, 1, 1), E) if old_moments is not None else [None] * len(points)
    for i, (point, moment, (bb, mb, bm, mm), kept) in enumerate(zip(points, moments, zip(*quarters), keep)):
        B, M = (point, moment) if E == 1 else carried["blocks"][i]
        accumulate(product(B, bb, out=step_b), M, mb)
        accumulate(product(B, bm, out=step_m), M, mm)
        # The step is added to [B, m], never formed as [B, m] (I + Δ): B_{t+1} − B_t is small, and adding it keeps
        # the fp32 drift from the manifold ~10x lower.
        B.add_(step_b)
        M.add_(step_m)
        if kept is not None:  # a matrix skipped on another rank's rows keeps m_t
            torch.where(kept, M, old_moments[i], out=M)
        if E > 1:
            expert_blocks(point, E).copy_(B)
            expert_blocks(moment, E).copy_(M)
    _store_masters(params, masters)


# ---- phases 1 and 3 through a dense buffer per bucket (an accelerator's)
def _measure_staged(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    masters: list[torch.Tensor | None],
    exp_avgs: list[torch.Tensor],
    settings: _Settings,
    constants: _Constants,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """Phase 1 for one bucket through a dense (n, d, 2r) buffer [B, m]: as :func:`_measure_per_matrix`.

    One (n, d, r) stage beside the buffer: the gradients are copied into it and moved into the first moments from
    there, in the stage's own layout (a fused-MoE one's expert blocks are a strided view of it), then it stages B. The
    buffer, its first moments moved, is handed to phase 3 as it is: gathered again there and the moments scattered
    here, it would cost three more passes over the bucket, for a buffer that lives from phase 1 to phase 3 (every
    bucket's: phase 2 needs every Gram matrix first; :func:`_rank_step` takes the buckets smallest first)."""
    E = settings.num_experts
    points, moments = _points(params, masters), [local_rows(t) for t in exp_avgs]
    dtype, device = moments[0].dtype, moments[0].device
    n, d, r = len(params) * E, points[0].shape[0], points[0].shape[1] // E
    P = torch.empty((n, d, 2 * r), dtype=dtype, device=device)  # [B, m]
    stage = torch.empty(n * d * r, dtype=dtype, device=device)
    _gather(P[..., r:], moments, stage, E)  # m_t
    slots, G = _staged(stage, grads, E)  # G (count, E, d, r): the stage in the order of P's expert blocks
    torch._foreach_copy_(slots, grads)  # in the compute dtype
    _finite_gradient(stage)
    norm = torch.linalg.vector_norm(G, dim=(-2, -1)).view(n)  # its square is inf if any entry of G was not finite
    moved = P[..., r:].unflatten(0, G.shape[:2])  # (count, E, d, r)
    old_moments = moved.clone().flatten(0, 1) if reduce_groups(params[0]) else None
    moved.lerp_(G, _lerp_weights(norm.view(*G.shape[:2], 1, 1), constants))  # m_{t+1}
    _gather(P[..., :r], points, stage, E)  # B_t
    return gram_by_row_blocks(P), norm.square(), {"old_moments": old_moments, "points_and_moments": P}


def _update_staged(
    params: list[torch.Tensor],
    masters: list[torch.Tensor | None],
    exp_avgs: list[torch.Tensor],
    delta: torch.Tensor,
    finite: torch.Tensor,
    carried: dict[str, torch.Tensor | None],
    E: int,
    dtype: torch.dtype,
) -> None:
    """Phase 3 for one bucket through phase 1's dense (n, d, 2r) buffer, which it frees: as
    :func:`_update_per_matrix`. B_{t+1} and then m_{t+1} are formed in one dense (n, d, r) buffer, each copied out
    from there: a plain lora_B's in one multi-tensor copy, a fused-MoE one's through a stage of that size (its expert
    blocks are strided in the lora_B)."""
    P, old_moments = carried.pop("points_and_moments"), carried["old_moments"]  # P (n, d, 2r)
    points, moments = _points(params, masters), [local_rows(t) for t in exp_avgs]
    n, d, r = P.shape[0], P.shape[1], delta.shape[-1] // 2
    half = torch.empty((n, d, r), dtype=dtype, device=delta.device)
    stage = torch.empty(n * d * r, dtype=dtype, device=delta.device) if E > 1 else None
    torch.baddbmm(P[..., :r], P, delta[..., :r], out=half)  # B_{t+1} = B + [B, m] Δ[:, :r]
    _scatter(points, half, stage, E)
    torch.baddbmm(P[..., r:], P, delta[..., r:], out=half)  # m_{t+1} = m + [B, m] Δ[:, r:]
    if old_moments is not None:  # a matrix skipped on another rank's rows keeps m_t
        torch.where(finite[:, None, None], half, old_moments, out=half)
    _scatter(moments, half, stage, E)
    _store_masters(params, masters)


# Rows of each partial product of the staged step's Gram matrices (:func:`gram_by_row_blocks`), at most (or 4·2r,
# where that is more: the partial sums then hold at most a quarter of the buffer's words). One (2r x d)·(d x 2r)
# product per matrix gives a GPU a few thread blocks per matrix, each running down all d rows: on the H100 of
# bench/results/h100-2026-11-28 the 3B set's eager step ran 4 fp32 GEMMs a step of that kind, 3 of them its Gram
# products, at 100 µs a call on average, where one read of its largest bucket takes about 9 µs. Blocks of rows give
# every multiprocessor work, for one more small sum.
GRAM_ROW_BLOCK = 512


def gram_by_row_blocks(P: torch.Tensor) -> torch.Tensor:
    """PᵀP (n, c, c) of a dense P (n, d, c), summed from the Gram matrices of P's blocks of rows: gcd(d, L) rows, L
    the larger of :data:`GRAM_ROW_BLOCK` and 4c (with L = 512, the largest power of two dividing d, up to 512). All d
    rows at once where that block is under 64 or 4c rows: such blocks cost more in partial sums than they give. A row
    count with no such divisor (an FSDP2 shard of 4096 rows over 3 ranks has 1366) gets one product per matrix."""
    n, d, c = P.shape
    rows = math.gcd(d, max(GRAM_ROW_BLOCK, 4 * c))
    if rows == d or rows < max(64, 4 * c):
        return P.mT @ P
    blocks = P.view(n * (d // rows), rows, c)  # (n·k, rows, c)
    return (blocks.mT @ blocks).view(n, d // rows, c, c).sum(1)


# implementation -> (phase 1, phase 3)
_PHASES: dict[str, tuple[Callable, Callable]] = {
    "per_matrix": (_measure_per_matrix, _update_per_matrix),
    "staged": (_measure_staged, _update_staged),
}


def _cayley_adam_deltas(
    gram: torch.Tensor,
    grad_sq: torch.Tensor,
    finite: torch.Tensor,
    step: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    counts: torch.Tensor,
    settings: _Settings,
    constants: _Constants,
) -> torch.Tensor:
    """Δ (N, 2r, 2r) with [B_{t+1}, m_{t+1}] = [B_t, m] (I + Δ), from the Gram matrices of [B_t, m] (N, 2r, 2r),
    m = β1 m_t + (1 − β1) G, and ‖G‖² (N,); ``step``, ``exp_avg_sq`` (N,) and ``counts`` (2, N: skipped steps,
    re-projections) are updated in place. A skipped matrix (``finite`` False) gets Δ = 0. 2r x 2r algebra only.
    """
    eye = constants.eye  # (2r, 2r)
    step.add_(finite)
    torch.where(finite, exp_avg_sq.lerp(grad_sq, 1 - settings.beta2), exp_avg_sq, out=exp_avg_sq)

    # Re-projection by Cholesky-QR of B (B R⁻¹, RᵀR = BᵀB) before the step, folded into the coefficients: with
    # T = diag(R⁻¹, I), [B R⁻¹, m] = [B, m] T and its Gram matrix is Tᵀ gram T. No host sync, no extra reduction.
    r = gram.shape[-1] // 2
    gram_b = gram[:, :r, :r]  # (N, r, r) BᵀB
    drifting = torch.linalg.matrix_norm(gram_b - eye[:r, :r]) > settings.reproject_threshold
    r_inv, factored = inverse_cholesky_factor(gram_b)  # (N, r, r), (N,)
    factored &= finite
    reprojected = drifting & factored  # the counter: drift, not the periodic re-projection
    counts.add_(torch.stack((~finite, reprojected)))
    if isinstance(settings.reproject_all, torch.Tensor):
        project = torch.where(settings.reproject_all, factored, reprojected)
    else:
        project = factored if settings.reproject_all else reprojected
    # T = diag(R⁻¹, I) where projected, I elsewhere (an unfactored R⁻¹ may hold inf/nan: a select, not a product).
    r_inv = torch.where(project[:, None, None], r_inv, eye[:r, :r])  # (N, r, r)
    # Tᵀ gram T, block by block: [[R⁻ᵀ BᵀB R⁻¹, R⁻ᵀ Bᵀm], [mᵀB R⁻¹, mᵀm]].
    top = r_inv.mT @ gram[:, :r]  # (N, r, 2r)
    top[:, :, :r] = top[:, :, :r] @ r_inv
    gram = torch.cat((top, torch.cat((top[:, :, r:].mT, gram[:, r:, r:]), dim=-1)), dim=-2)

    # W is linear in m, so the bias-corrected W(m̂)/(√v̂ + ε) step of size lr is a step of size τ along W(m).
    bias = 1 - torch.pow(constants.betas, step)  # (2, N): 1 − β1^t, 1 − β2^t
    denominator = (exp_avg_sq / bias[1]).sqrt_().add_(settings.eps).mul_(bias[0])  # (N,)
    # τ/2 = lr/2 · (1/denominator); the denominator is 0 only if v = 0 and eps = 0: every gradient so far was 0 (so
    # m = 0), no move rather than 0/0 = NaN.
    half_tau = denominator.reciprocal_().nan_to_num_(0.0, 0.0, 0.0).mul_(settings.lr * 0.5)
    omega = skew_generator(gram)  # (N, 2r, 2r)
    z = cayley_span_step(omega, half_tau, solver=settings.cayley_solver, iters=settings.cayley_iters, eye=eye)
    # In the projected basis [B R⁻¹, m]: B_{t+1} = B R⁻¹ + [B R⁻¹, m] z, and the first moment becomes W(m) B_{t+1} =
    # [B R⁻¹, m] Ω (e_B + z), its tangent part carried to the new point. So with C = [z, Ω (e_B + z)],
    # [B_{t+1}, m_{t+1}] = [B, m] (T C + [T e_B, 0]) and Δ = T C + [T e_B, 0] − I: in blocks, Δ's top rows are
    # R⁻¹ C_top + [R⁻¹ − I, 0] and its bottom rows C_bottom − [0, I]. The small step z is added to B, never formed as
    # e_B + z: that keeps the fp32 drift from the manifold ~10x lower.
    moved = torch.baddbmm(omega[..., :r], omega, z)  # Ω (e_B + z)
    C = torch.cat((z, moved), dim=-1)  # (N, 2r, 2r)
    top = r_inv @ C[:, :r]  # (N, r, 2r)
    top[:, :, :r] += r_inv - eye[:r, :r]
    delta = torch.cat((top, C[:, r:] - eye[r:]), dim=-2)
    return torch.where(finite[:, None, None], delta, constants.zero)  # a skipped matrix: B and m stay bit for bit


class _Constants:
    """The small constant tensors of the step for one r, dtype, device and betas, made once per optimizer."""

    def __init__(self, r: int, dtype: torch.dtype, device: torch.device, betas: tuple[float, float]) -> None:
        self.eye = torch.eye(2 * r, dtype=dtype, device=device)  # (2r, 2r)
        # Factories, not torch.tensor(data, device=): that is a host-to-device copy on an accelerator.
        self.betas = torch.full((2, 1), betas[0], dtype=dtype, device=device)  # (2, 1): β1, β2
        self.betas[1] = betas[1]
        self.lerp_weight = torch.full((), 1 - betas[0], dtype=dtype, device=device)  # the first moment's 1 − β1
        self.zero = torch.zeros((), dtype=dtype, device=device)

    @classmethod
    def cached(
        cls, cache: dict, params: list[torch.Tensor], betas: tuple[float, float], num_experts: int
    ) -> _Constants:
        """The constants of ``params[0]``'s rank, compute dtype and device, from ``cache`` or made into it."""
        p = params[0]
        key = (p.shape[1] // num_experts, compute_dtype(p), p.device, tuple(betas))
        if key not in cache:
            cache[key] = cls(key[0], key[1], key[2], betas)
        return cache[key]


# ------------------------------------------------------------------------------------------------------ the copies
# Between the parameters (and their moments) and a bucket's dense (n, d, r) blocks: through a dense (count, d, r·E)
# stage, one multi-tensor copy and one strided copy of the whole bucket, where a pair of tensors would not be dense
# with equal strides (torch._foreach_copy_ runs as one kernel only on such pairs; each other pair is a kernel).
def _staged(stage: torch.Tensor, tensors: list[torch.Tensor], num_experts: int) -> tuple[list, torch.Tensor]:
    """The first words of the 1-D ``stage`` as dense (d, r·E) slots, one per tensor, and as their expert blocks
    (count, E, d, r) in :func:`~fora_plugin.adapter.expert_blocks`' column order (e, e + E, ...)."""
    d, width = tensors[0].shape
    flat = stage[: len(tensors) * d * width].view(len(tensors), d, width)
    return list(flat.unbind(0)), flat.view(len(tensors), d, width // num_experts, num_experts).permute(0, 3, 1, 2)


def _gather(blocks: torch.Tensor, tensors: list[torch.Tensor], stage: torch.Tensor, num_experts: int) -> None:
    """``blocks`` (n, d, r), n = len(tensors)·E, takes the E expert blocks of each (d, r·E) tensor."""
    if num_experts == 1 and blocks.is_contiguous():  # dense pairs of equal strides: one multi-tensor copy
        torch._foreach_copy_(list(blocks.unbind(0)), tensors)
        return
    slots, staged = _staged(stage, tensors, num_experts)
    torch._foreach_copy_(slots, tensors)
    blocks.unflatten(0, staged.shape[:2]).copy_(staged)


def _scatter(tensors: list[torch.Tensor], blocks: torch.Tensor, stage: torch.Tensor | None, num_experts: int) -> None:
    """The inverse of :func:`_gather`: each (d, r·E) tensor takes its E blocks of ``blocks`` (n, d, r); ``stage`` may
    be None where ``blocks`` is dense and E is 1 (no stage is used)."""
    if num_experts == 1 and blocks.is_contiguous():
        torch._foreach_copy_(tensors, list(blocks.unbind(0)))
        return
    slots, staged = _staged(stage, tensors, num_experts)
    staged.copy_(blocks.unflatten(0, staged.shape[:2]))
    torch._foreach_copy_(tensors, slots)
