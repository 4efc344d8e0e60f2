"""Cayley-Adam on the Stiefel manifold, in the form of ``torch.optim.adam``: the functional step :func:`cayley_adam`
and the optimizer :class:`CayleyAdam`, which keeps the state beside each parameter and calls it.

May import: adapter, config, errors, stiefel, validation.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..adapter import expert_blocks
from ..config import check_cayley_adam_settings
from ..errors import FoRAInputError, FoRAInputTypeError
from ..stiefel import cayley_span_step, cholesky_qr, qr_retraction, skew_generator
from ..validation import check_choice, check_float, check_int


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed
    DTensor = None


__all__ = [
    "IMPLEMENTATIONS",
    "REPROJECT_THRESHOLD",
    "CayleyAdam",
    "all_reduce_sum",
    "bucket_key",
    "cayley_adam",
    "compute_dtype",
    "counter_total",
    "init_cayley_adam_state",
    "local_gradient",
    "is_dtensor",
    "local_rows",
    "reduce_groups",
    "resolve_implementation",
    "restore_compute_state",
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
    """The copy path of a bucket on ``device``: ``implementation`` where given, else ``"staged"`` on an accelerator
    and ``"per_matrix"`` on the CPU.

    ``torch._foreach_copy_`` takes its multi-tensor fast path only between dense tensors of equal strides, and a
    block of [B, m] is strided: elsewhere it copies tensor by tensor. On an accelerator each of those copies is a
    kernel launch (5 per matrix a step: hundreds in a step that issue 26 measured launch-bound on an H100), so the
    stage pays there. On the CPU a copy is a loop iteration and the stage's extra pass over the bucket costs more than
    it saves (10-15% of the step, bench/optimizer.py).
    """
    if implementation is not None:  # checked where it is given: CayleyAdam's groups, cayley_adam()'s argument
        return implementation
    return "per_matrix" if device.type == "cpu" else "staged"


def compute_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype Cayley-Adam computes and keeps the state of ``p`` in: fp64 for an fp64 ``p``, else fp32."""
    # fp32 at least: in bf16/fp16 the Gram matrices and the 2r x 2r solve lose orthogonality within a few steps.
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a sharded parameter of FSDP2); False where torch has no DTensor."""
    return DTensor is not None and isinstance(t, DTensor)


def local_rows(t: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def reduce_groups(p: torch.Tensor) -> tuple:
    """The process groups over which a sum over ``p``'s rows must be all-reduced (empty for a plain tensor)."""
    if not is_dtensor(p):
        return ()
    groups = []
    for dim, placement in enumerate(p.placements):
        if placement.is_shard(0):
            groups.append(p.device_mesh.get_group(dim))
        elif not placement.is_replicate():
            raise FoRAInputError(
                f"CayleyAdam got a DTensor lora_B of shape {tuple(p.shape)} with placements {p.placements}: the "
                "Cayley step needs whole rows on each rank. Shard it by rows (Shard(0), as FSDP2's fully_shard "
                "does) or replicate it."
            )
    return tuple(groups)


def all_reduce_sum(tensor: torch.Tensor, groups: tuple) -> None:
    """Sum ``tensor`` in place over each process group of ``groups`` (:func:`reduce_groups`); none: nothing."""
    for group in groups:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def local_gradient(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The rows of ``grad`` that this rank holds of ``p``: a DTensor gradient is first laid out as ``p`` is."""
    if is_dtensor(p):
        if not isinstance(grad, DTensor):
            raise FoRAInputTypeError(
                f"CayleyAdam: lora_B of shape {tuple(p.shape)} is a DTensor but its gradient is a plain tensor of "
                f"shape {tuple(grad.shape)}: pass the gradient as a DTensor with the parameter's placements."
            )
        if grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        return grad.to_local()
    return grad


def bucket_key(p: torch.Tensor) -> tuple:
    """What Stiefel parameters are stepped together by: whole-matrix shape, device, compute dtype and layout (a
    DTensor's mesh and placements). What every rank sees alike, so the all-reduces of a sharded bucket pair up across
    ranks even where the local row counts differ."""
    layout = (id(p.device_mesh), tuple(p.placements)) if is_dtensor(p) else None
    return tuple(p.shape), p.device, compute_dtype(p), layout


# ------------------------------------------------------------------------------------------------------ checks
def _check_hyperparameters(group: dict[str, Any]) -> None:
    check_float("lr", group["lr"], lambda x: x >= 0, "a finite float >= 0 (the paper uses 1e-3)")
    check_cayley_adam_settings(
        betas=group["betas"],
        eps=group["eps"],
        qr_period=group["qr_period"],
        cayley_solver=group["cayley_solver"],
        cayley_iters=group["cayley_iters"],
    )
    check_float(
        "reproject_threshold",
        group.get("reproject_threshold", REPROJECT_THRESHOLD),
        lambda x: x > 0,
        f"a finite float > 0 (default {REPROJECT_THRESHOLD}, the ‖BᵀB − I‖ above which B is re-projected onto the "
        "manifold)",
    )
    check_int(
        "num_experts",
        group.get("num_experts", 1),
        1,
        "the number of (d_out, r) expert blocks interleaved in each lora_B of the group; 1 for an ordinary LoRA layer",
    )
    if group.get("implementation") is not None:
        check_choice("implementation", group["implementation"], IMPLEMENTATIONS)


def _check_stiefel_parameter(p: torch.Tensor, index: int, num_experts: int = 1) -> None:
    if not p.is_floating_point():
        raise FoRAInputTypeError(
            f"CayleyAdam parameter #{index} has dtype {p.dtype}; a Stiefel matrix must be floating point."
        )
    if p.ndim != 2:
        raise FoRAInputError(
            f"CayleyAdam parameter #{index} has shape {tuple(p.shape)}: only 2-D (d_out, r) matrices "
            "can be kept column-orthonormal. Put 1-D parameters (biases, norms) in an AdamW group."
        )
    d, width = p.shape
    if width % num_experts:
        raise FoRAInputError(
            f"CayleyAdam parameter #{index} has shape {tuple(p.shape)} in a group with num_experts={num_experts}: "
            f"its {width} columns are not r columns for each of {num_experts} experts. Put it in the group of its "
            "own number of experts (PEFT's lora_B of E experts has r·E columns)."
        )
    r = width // num_experts
    if d < r:
        raise FoRAInputError(
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
        implementation: how the step copies each bucket of matrices, one of :data:`IMPLEMENTATIONS`; None (the
            default) picks by device (:func:`resolve_implementation`). Every path gives the same bits.
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
            stiefel=True,
            steps=0,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group)
        for index, p in enumerate(group["params"]):
            _check_stiefel_parameter(p, index, group.get("num_experts", 1))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
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
        state (a loaded master meets a parameter the step has not written, e.g. after ``load_state_dict``)."""
        _last_writes(self).clear()

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
        return counter_total(self, "skipped_steps")

    def reprojections(self) -> int:
        """Matrices re-projected onto the manifold for drifting too far so far, over all parameters (one host sync).
        Periodic ``qr_period`` re-projections are not counted."""
        return counter_total(self, "reprojections")


def counter_total(optimizer: Optimizer, key: str) -> int:
    """The state counter ``key`` (``"skipped_steps"``, ``"reprojections"``) summed over every Stiefel matrix of
    ``optimizer`` (one host sync); 0 before the first step."""
    counts = [s[key].sum() for s in optimizer.state.values() if key in s]
    return int(torch.stack(counts).sum()) if counts else 0


def restore_compute_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """After ``Optimizer.load_state_dict(state_dict)``: put the saved Cayley-Adam state of every Stiefel group (a
    group with ``"stiefel": True``) back in its compute dtype, on the parameter's device."""
    # Optimizer.load_state_dict casts floating state to the parameter's dtype; a bf16 lora_B would get its fp32
    # master and moments rounded to bf16 and stop being orthonormal. Put the saved values back as they were.
    saved_groups = state_dict["param_groups"]
    for saved_group, group in zip(saved_groups, optimizer.param_groups):
        if not group.get("stiefel"):
            continue
        for saved_id, p in zip(saved_group["params"], group["params"]):
            saved_state = state_dict["state"].get(saved_id, {})
            for key in _COMPUTE_STATE_KEYS:
                if key in saved_state:
                    # A copy: the loaded state must not share storage with the state_dict it came from (another
                    # optimizer's live state, when one loads another's state_dict).
                    optimizer.state[p][key] = saved_state[key].to(dtype=compute_dtype(p), device=p.device, copy=True)
            for key in _COUNTER_KEYS:
                if key in saved_state:
                    optimizer.state[p][key] = saved_state[key].to(device=p.device, copy=True)


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
def _last_writes(optimizer: Optimizer) -> dict[torch.Tensor, tuple]:
    """``p -> _signature(p)`` as the step last left each parameter (kept on the optimizer, out of its state_dict)."""
    return optimizer.__dict__.setdefault("_fora_written", {})


def _signature(p: torch.Tensor) -> tuple:
    """What the step last left in ``p``: its version counter (bumped by every in-place write), its storage, dtype
    and device. Host-side metadata only: reading it syncs nothing."""
    if torch.compiler.is_compiling():
        # Dynamo reads a version counter only as data (a graph break): a compiled step follows casts and moves of
        # its parameters, not in-place writes.
        return None, None, p.dtype, p.device
    local = local_rows(p)
    return local._version, local.untyped_storage()._cdata, p.dtype, p.device


def _follow_parameter(state: dict[str, Any], p: torch.Tensor, last: tuple | None) -> None:
    """Bring ``p``'s state in line with ``p`` where something outside the step changed ``p`` since the step last
    wrote it (``last``, its :func:`_signature` then; None if unknown, e.g. after ``load_state_dict``).

    - Moved (``.to(device)``): the state moves with it.
    - Cast (``.to(dtype)``): the state takes ``p``'s compute dtype; a ``p`` cast down from fp32 gets a master made
      from its values, one cast up to fp32 becomes its own point (the master's value where ``p`` still holds it).
    - Written in place (``load_state_dict``, a user's edit): the fp32 master takes ``p``'s new values. Where ``p``
      still equals the master rounded, the master's extra bits are kept, so a spurious refresh changes nothing.
    """
    if last == _signature(p):
        return
    device, dtype = p.device, compute_dtype(p)
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor):
            target = dtype if key in _COMPUTE_STATE_KEYS else value.dtype
            if value.device != device or value.dtype != target:
                state[key] = value.to(device=device, dtype=target)
    master = state.get("master")
    local = local_rows(p)
    if master is not None:
        # The master rounded as the step last stored it in p (p's dtype then), in p's dtype now.
        stored = local_rows(master).to(p.dtype if last is None else last[2]).to(p.dtype)
        point = torch.where(local == stored, local_rows(master), local.to(dtype))
        if p.dtype == dtype:  # cast up to the compute dtype: p is its own point again
            local.copy_(point)
            del state["master"]
        else:
            local_rows(master).copy_(point)
    elif p.dtype != dtype:  # cast down from the compute dtype: the master starts from the values p holds now
        state["master"] = p.detach().to(dtype)


def _group_step(
    optimizer: Optimizer,
    group: dict[str, Any],
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One step of ``group``: its state made or brought in line with each parameter, then :func:`cayley_adam`."""
    state = optimizer.state
    written = _last_writes(optimizer)
    group["steps"] += 1
    num_experts = group.get("num_experts", 1)  # a group saved before per-expert blocks existed has no key
    period = group["qr_period"]
    params, param_grads = [], []
    for p in group["params"]:
        grad = p.grad if grads is None else grads.get(p)
        if grad is None:
            continue
        if grad.is_sparse:
            raise FoRAInputTypeError("CayleyAdam does not support sparse gradients.")
        if not state[p]:
            init_cayley_adam_state(state[p], p, num_experts)
        else:
            _follow_parameter(state[p], p, written.get(p))
        if "reprojections" not in state[p]:  # a state saved before the counter existed
            state[p]["reprojections"] = torch.zeros_like(state[p]["skipped_steps"])
        params.append(p)
        param_grads.append(grad)
    states = [state[p] for p in params]
    beta1, beta2 = group["betas"]
    cayley_adam(
        params,
        param_grads,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [s["step"] for s in states],
        [s["skipped_steps"] for s in states],
        [s["reprojections"] for s in states],
        [s.get("master") for s in states],
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        cayley_solver=group["cayley_solver"],
        cayley_iters=group["cayley_iters"],
        reproject_threshold=group.get("reproject_threshold", REPROJECT_THRESHOLD),  # absent from older checkpoints
        reproject_all=period > 0 and group["steps"] % period == 0,
        num_experts=num_experts,
        implementation=group.get("implementation"),  # likewise
        constants=optimizer.__dict__.setdefault("_fora_constants", {}),
    )
    for p in params:
        written[p] = _signature(p)


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
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    cayley_solver: str = "exact",
    cayley_iters: int = 5,
    reproject_threshold: float = REPROJECT_THRESHOLD,
    reproject_all: bool = False,
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

    ``reproject_all``: re-project every matrix this step (:class:`CayleyAdam`'s ``qr_period``); ``num_experts``:
    expert blocks per parameter; ``implementation``: the copy path, one of :data:`IMPLEMENTATIONS` or None (by
    device, :func:`resolve_implementation`); ``constants``: a dict the caller keeps between steps for the step's
    small constant tensors (None: made for this call).

    Implementation paths. The step has one body (:func:`_bucket_step`); where paths differ, they are named:

    - ``implementation``, the one choice, as torch's ``foreach``/``fused``: how a bucket's B, m and G are copied into
      the step's (n, d, 2r) buffer and back. ``"per_matrix"``: one ``torch._foreach_copy_`` per list, matrix by
      matrix. ``"staged"``: through a dense (count, d, r·E) stage, one multi-tensor copy and one strided copy of the
      whole bucket. ``None`` is resolved per device by :func:`resolve_implementation`.
    - row-sharded, set by the data: a bucket of DTensor ``lora_B`` sharded by rows (``Shard(0)``, as FSDP2's
      ``fully_shard`` makes them) is stepped on its local rows; its Gram matrices and ‖G‖² are summed by one
      all-reduce over :func:`reduce_groups`, every rank solves the same small systems and updates its own rows.
    - expert blocks, set by the group's ``num_experts``: a fused-MoE ``lora_B`` (d_out, r·E) is E interleaved
      Stiefel matrices, each a matrix of the buffer with its own scalars.
    """
    if implementation is not None:
        check_choice("implementation", implementation, IMPLEMENTATIONS)
    if masters is None:
        masters = [None] * len(params)
    local_grads = [local_gradient(p, g) for p, g in zip(params, grads)]
    settings = _Settings(
        lr, beta1, beta2, eps, cayley_solver, cayley_iters, reproject_threshold, reproject_all, num_experts
    )
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for index, p in enumerate(params):
        buckets[bucket_key(p)].append(index)
    cache = {} if constants is None else constants
    # A bucket at a time: the step's scratch (4·d·r per matrix) is alive for one shape only, so a step's peak is its
    # largest bucket's, not the sum over all of them.
    lists = (params, local_grads, masters, exp_avgs, exp_avg_sqs, state_steps, skipped_steps, reprojections)
    for indices in buckets.values():
        _bucket_step(*([values[i] for i in indices] for values in lists), settings, implementation, cache)


class _Settings(NamedTuple):
    """The hyperparameters of one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    cayley_solver: str
    cayley_iters: int
    reproject_threshold: float
    reproject_all: bool
    num_experts: int


def _bucket_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    masters: list[torch.Tensor | None],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    skipped_steps: list[torch.Tensor],
    reprojections: list[torch.Tensor],
    settings: _Settings,
    implementation: str | None,
    cache: dict,
) -> None:
    """The step of every matrix of one bucket (:func:`bucket_key`); ``grads`` are the local rows. A sum over rows is
    all-reduced over :func:`reduce_groups` (none for plain tensors), once.

    [B, m] of the bucket is copied into a scratch (n, d, 2r) buffer, stepped there by two batched products, and
    copied back: parameters and moments keep their own storage (a parameter never aliases another one or the
    optimizer's state), at the price of five passes over the bucket's matrices (G, B and m in; B and m out), small
    beside the products (16·r flops per entry); staged, each pass is a few kernels whatever the number of matrices.
    A fused-MoE lora_B's E interleaved expert blocks are E matrices of the buffer.
    """
    num_experts = settings.num_experts
    points = [local_rows(p if m is None else m) for p, m in zip(params, masters)]  # (d_local, r·E), compute dtype
    moments = [local_rows(t) for t in exp_avgs]
    dtype, device = moments[0].dtype, moments[0].device
    n, d, r = len(params) * num_experts, points[0].shape[0], points[0].shape[1] // num_experts
    groups = reduce_groups(params[0])
    sharded = bool(groups)
    gather, scatter = _COPIES[resolve_implementation(implementation, device)]
    constants = _Constants.cached(cache, r, dtype, device, (settings.beta1, settings.beta2))

    P = torch.empty((n, d, 2 * r), dtype=dtype, device=device)  # [B, m]
    Q = torch.empty_like(P)  # G, then [B_{t+1}, m_{t+1}]
    # G in the first half of Q, a contiguous (n, d, r) tensor: the passes over G run several times faster on it than
    # on a strided half (8x for the norm). The product that writes Q comes after the last read of G.
    half = Q.numel() // 2
    G = Q.view(-1)[:half].view(n, d, r)
    gather(G, grads, Q.view(-1)[half:], num_experts)  # in the compute dtype
    gather(P[..., :r], points, Q.view(-1)[half:], num_experts)  # Q's second half is free until the product
    gather(P[..., r:], moments, Q.view(-1)[half:], num_experts)
    grad_sq = torch.linalg.vector_norm(G.view(n, -1), dim=-1).square()  # (n,) of the local rows: inf/nan if any is
    G.nan_to_num_(0.0, 0.0, 0.0)  # keeps the Gram matrices finite; a skipped matrix keeps m_t: m + 0·(G − m)

    def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:  # (n,)
        return torch.stack(tensors).reshape(n)

    step, v = stacked(state_steps), stacked(exp_avg_sqs)
    counts = torch.stack((stacked(skipped_steps), stacked(reprojections)))  # (2, n)
    if sharded:
        # A skip (a non-finite ‖G‖² on any rank) is only known after the all-reduce: m_{t+1} is formed for every
        # matrix, and m_t kept for the skipped ones.
        m_old = P[..., r:].clone()
        P[..., r:].lerp_(G, constants.lerp_weight)
        gram = P.mT @ P  # (n, 2r, 2r) of the local rows
        sums = torch.cat((gram.reshape(n, -1), grad_sq[:, None]), dim=1)  # (n, 4r² + 1): one all-reduce
        all_reduce_sum(sums, groups)
        gram, grad_sq = sums[:, :-1].reshape(n, 2 * r, 2 * r), sums[:, -1]
        finite = grad_sq < math.inf  # (n,) the same on every rank
    else:
        finite = grad_sq < math.inf  # False for inf and nan (one op, where isfinite takes four)
        P[..., r:].lerp_(G, torch.where(finite, constants.lerp_weight, constants.zero)[:, None, None])  # m_{t+1}
        gram = P.mT @ P  # [[BᵀB, Bᵀm], [mᵀB, mᵀm]]
    T = constants.eye.repeat(n, 1, 1)
    delta = _cayley_adam_deltas(gram, grad_sq, finite, step, v, counts, T, settings, constants)
    torch.baddbmm(P, P, delta, out=Q)  # [B_{t+1}, m_{t+1}] = [B_t, m] (I + Δ)
    B_next, m_next = Q[..., :r], Q[..., r:]
    if sharded:
        m_next = torch.where(finite[:, None, None], m_next, m_old)
    scatter(points, B_next, P.view(-1)[: P.numel() // 2], num_experts)  # P is free once the product has read it
    scatter(moments, m_next, P.view(-1)[: P.numel() // 2], num_experts)
    low_precision = [(local_rows(p), local_rows(m)) for p, m in zip(params, masters) if m is not None]
    if low_precision:
        torch._foreach_copy_([p for p, _ in low_precision], [m for _, m in low_precision])  # the master rounded
    scalar_shape = () if num_experts == 1 else (num_experts,)
    scalars = ((exp_avg_sqs, v), (state_steps, step), (skipped_steps, counts[0]), (reprojections, counts[1]))
    for tensors, value in scalars:
        torch._foreach_copy_(tensors, list(value.view(len(params), *scalar_shape).unbind(0)))


def _cayley_adam_deltas(
    gram: torch.Tensor,
    grad_sq: torch.Tensor,
    finite: torch.Tensor,
    step: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    counts: torch.Tensor,
    T: torch.Tensor,
    settings: _Settings,
    constants: _Constants,
) -> torch.Tensor:
    """Δ (N, 2r, 2r) with [B_{t+1}, m_{t+1}] = [B_t, m] (I + Δ), from the Gram matrices of [B_t, m] (N, 2r, 2r),
    m = β1 m_t + (1 − β1) G, and ‖G‖² (N,); ``step``, ``exp_avg_sq`` (N,) and ``counts`` (2, N: skipped steps,
    re-projections) are updated in place. ``T`` (N, 2r, 2r) is identity outside its B block, which the step writes.
    A skipped matrix (``finite`` False) gets Δ = 0. 2r x 2r algebra only.
    """
    eye = constants.eye  # (2r, 2r)
    step.add_(finite)
    torch.where(finite, exp_avg_sq.lerp(grad_sq, 1 - settings.beta2), exp_avg_sq, out=exp_avg_sq)

    # Re-projection by Cholesky-QR of B (B R⁻¹, RᵀR = BᵀB) before the step, folded into the coefficients: with
    # T = diag(R⁻¹, I), [B R⁻¹, m] = [B, m] T and its Gram matrix is Tᵀ gram T. No host sync, no extra reduction.
    r = gram.shape[-1] // 2
    gram_b = gram[:, :r, :r]  # (N, r, r) BᵀB
    drifting = torch.linalg.matrix_norm(gram_b - eye[:r, :r]) > settings.reproject_threshold
    factor, info = torch.linalg.cholesky_ex(gram_b)
    factored = (info == 0) & finite
    reprojected = drifting & factored  # the counter: drift, not the periodic re-projection
    counts.add_(torch.stack((~finite, reprojected)))
    project = factored if settings.reproject_all else reprojected
    r_inv = torch.linalg.solve_triangular(factor.mT, eye[:r, :r].expand_as(gram_b), upper=True)  # (N, r, r)
    # T = diag(R⁻¹, I) where projected, I elsewhere (an unfactored R⁻¹ may hold inf/nan: a select, not a product).
    T[:, :r, :r].copy_(torch.where(project[:, None, None], r_inv, eye[:r, :r]))
    gram = T.mT @ gram @ T

    # W is linear in m, so the bias-corrected W(m̂)/(√v̂ + ε) step of size lr is a step of size τ along W(m).
    bias = 1 - torch.pow(constants.betas, step)  # (2, N): 1 − β1^t, 1 − β2^t
    denominator = (exp_avg_sq / bias[1]).sqrt_().add_(settings.eps).mul_(bias[0])  # (N,)
    # τ/2 = lr/2 · (1/denominator); the denominator is 0 only if v = 0 and eps = 0: every gradient so far was 0 (so
    # m = 0), no move rather than 0/0 = NaN.
    tau_per_lr = denominator.reciprocal_().nan_to_num_(0.0, 0.0, 0.0)
    omega = skew_generator(gram, skew_basis=constants.skew_basis)  # (N, 2r, 2r)
    solver, iters = settings.cayley_solver, settings.cayley_iters
    z = cayley_span_step(omega, tau_per_lr, solver=solver, iters=iters, eye=eye, scale=settings.lr / 2)
    # In the projected basis [B R⁻¹, m]: B_{t+1} = B R⁻¹ + [B R⁻¹, m] z, and the first moment becomes W(m) B_{t+1} =
    # [B R⁻¹, m] Ω (e_B + z), its tangent part carried to the new point. So with C = [z, Ω (e_B + z)],
    # [B_{t+1}, m_{t+1}] = [B, m] (T C + [T e_B, 0]) and Δ = T C + [T e_B, 0] − I. The small step z is added to B,
    # never formed as e_B + z: that keeps the fp32 drift from the manifold ~10x lower.
    moved = torch.baddbmm(omega[..., : z.shape[-1]], omega, z)  # Ω (e_B + z)
    delta = torch.baddbmm(torch.addcmul(constants.neg_eye, T, constants.left), T, torch.cat((z, moved), dim=-1))
    return torch.where(finite[:, None, None], delta, constants.zero)  # a skipped matrix: B and m stay bit for bit


class _Constants:
    """The small constant tensors of the step for one r, dtype, device and betas, made once per optimizer."""

    def __init__(self, r: int, dtype: torch.dtype, device: torch.device, betas: tuple[float, float]) -> None:
        self.eye = torch.eye(2 * r, dtype=dtype, device=device)  # (2r, 2r)
        # Factories, not torch.tensor(data, device=): that is a host-to-device copy on an accelerator.
        self.betas = torch.full((2, 1), betas[0], dtype=dtype, device=device)  # (2, 1): β1, β2
        self.betas[1] = betas[1]
        self.neg_eye = -self.eye
        self.left = torch.zeros_like(self.eye)  # (2r, 2r): 1 in the B columns, T · left = [T e_B, 0]
        self.left[:, :r] = 1.0
        self.lerp_weight = torch.full((), 1 - betas[0], dtype=dtype, device=device)  # the first moment's 1 − β1
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.skew_basis = torch.zeros_like(self.eye)  # J = [[0, −I], [I, 0]], see skew_generator
        self.skew_basis.diagonal(offset=r).fill_(-1.0)
        self.skew_basis.diagonal(offset=-r).fill_(1.0)

    @classmethod
    def cached(
        cls, cache: dict, r: int, dtype: torch.dtype, device: torch.device, betas: tuple[float, float]
    ) -> _Constants:
        key = (r, dtype, device, tuple(betas))
        if key not in cache:
            cache[key] = cls(r, dtype, device, betas)
        return cache[key]


# ------------------------------------------------------------------------------------------------------ the copies
# Between the parameters (and their moments) and the bucket's (n, d, r) blocks, one pair of functions per
# implementation (resolve_implementation says which pays where).
def _staged(stage: torch.Tensor, tensors: list[torch.Tensor], num_experts: int) -> tuple[list, torch.Tensor]:
    """The first words of the 1-D ``stage`` as dense (d, r·E) slots, one per tensor, and as their expert blocks
    (count, E, d, r) in :func:`~fora_plugin.adapter.expert_blocks`' column order (e, e + E, ...)."""
    d, width = tensors[0].shape
    flat = stage[: len(tensors) * d * width].view(len(tensors), d, width)
    return list(flat.unbind(0)), flat.view(len(tensors), d, width // num_experts, num_experts).permute(0, 3, 1, 2)


def _per_matrix(blocks: torch.Tensor, tensors: list[torch.Tensor], num_experts: int) -> tuple[list, list]:
    """``blocks`` (n, d, r) as one entry per tensor, and each (d, r·E) tensor as its blocks: pairs to copy."""
    if num_experts == 1:
        return list(blocks.unbind(0)), tensors
    return list(blocks.split(num_experts)), [expert_blocks(t, num_experts) for t in tensors]


def _gather_per_matrix(
    blocks: torch.Tensor, tensors: list[torch.Tensor], stage: torch.Tensor, num_experts: int
) -> None:
    """``blocks`` (n, d, r), n = len(tensors)·E, takes the E expert blocks of each (d, r·E) tensor, tensor by
    tensor (``stage`` unused)."""
    torch._foreach_copy_(*_per_matrix(blocks, tensors, num_experts))


def _scatter_per_matrix(
    tensors: list[torch.Tensor], blocks: torch.Tensor, stage: torch.Tensor, num_experts: int
) -> None:
    """The inverse of :func:`_gather_per_matrix`: each (d, r·E) tensor takes its E blocks of ``blocks`` (n, d, r)."""
    sources, destinations = _per_matrix(blocks, tensors, num_experts)
    torch._foreach_copy_(destinations, sources)


def _gather_staged(blocks: torch.Tensor, tensors: list[torch.Tensor], stage: torch.Tensor, num_experts: int) -> None:
    """As :func:`_gather_per_matrix`, through ``stage`` (1-D, at least n·d·r words) where a pair would be strided."""
    if num_experts == 1 and blocks.is_contiguous():  # dense pairs of equal strides: already one multi-tensor copy
        _gather_per_matrix(blocks, tensors, stage, num_experts)
        return
    slots, staged = _staged(stage, tensors, num_experts)
    torch._foreach_copy_(slots, tensors)
    blocks.unflatten(0, staged.shape[:2]).copy_(staged)


def _scatter_staged(tensors: list[torch.Tensor], blocks: torch.Tensor, stage: torch.Tensor, num_experts: int) -> None:
    """The inverse of :func:`_gather_staged`."""
    if num_experts == 1 and blocks.is_contiguous():
        _scatter_per_matrix(tensors, blocks, stage, num_experts)
        return
    slots, staged = _staged(stage, tensors, num_experts)
    staged.copy_(blocks.unflatten(0, staged.shape[:2]))
    torch._foreach_copy_(tensors, slots)


_Copy = Callable[..., None]
# implementation -> (gather, scatter)
_COPIES: dict[str, tuple[_Copy, _Copy]] = {
    "per_matrix": (_gather_per_matrix, _scatter_per_matrix),
    "staged": (_gather_staged, _scatter_staged),
}
