"""A plan's measurements: FoRA's own code run on the fake-tensor model, its live storages and FLOPs counted.

One Fisher scoring batch through :func:`fora_plugin.fisher.fisher_scores` on the model as scoring holds it (LoRA on
every target layer, adapters off), and one training step per mode: forward and backward with the run's
checkpointing and autocast, and the optimizer step with its states (FoRA's optimizer as
:func:`fora_plugin.training.fora_optimizer` builds it, the Trainer's AdamW for ``lora``). A
:class:`~fora_plugin.plan.memory.LiveTensorTracker` counts live storages, and breaks each peak into parts: weights,
LoRA (parameters, gradients, optimizer states, the Stiefel part), activations and transient buffers.

May import: config, fisher, optim, plan.engine_rules, plan.fake_model, plan.kernels, plan.memory, plan.setup,
training, wiring.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..config import MODE_PARTS
from ..fisher import fisher_scores
from ..optim import resolve_implementation
from ..training import fora_optimizer
from ..wiring import readapt_lora
from .engine_rules import ENGINES
from .fake_model import (
    cast_lora,
    dequantized_during_matmul,
    four_bit_linears,
    lora_optimizer,
    meta_model_of,
    plan_selection,
    planned_autocast,
    planned_batch,
    prepare_fake_model,
    sft_training_loss,
    trainer_view,
    wrap_lora,
)
from .kernels import (
    FAKE_READBACK_ERRORS,
    fused_lm_head_as_on_cuda,
    grouped_mm_in_any_dtype,
    masks_of_unpacked_batches,
)
from .memory import LiveTensorTracker
from .setup import PlanSetup


__all__ = ["GIB", "KINDS", "LORA_PARTS", "Phase", "kinds_of", "measure"]

GIB = 2**30
# The kinds a peak is broken into; "lora" is LoRA parameters + their gradients + optimizer states.
KINDS = ("weights", "lora", "activations", "transient")
# The parts of fora_plugin.plan.engine_rules.PARTS summed into "lora". "stiefel": FoRA's Stiefel lora_B gradients and
# everything Cayley-Adam keeps for them (whole on every rank under ZeRO, row-sharded under FSDP2).
LORA_PARTS = ("lora_params", "lora_grads", "optimizer_states", "stiefel")


@dataclasses.dataclass
class Phase:
    """One phase's peak per GPU (bytes by kind) and its FLOPs."""

    peak: dict[str, int]
    flops: int
    trainable: int = 0

    @property
    def total(self) -> int:
        return sum(self.peak.values())


def kinds_of(phase: Phase) -> dict[str, int]:
    """The four kinds of the output: LoRA parameters, gradients and optimizer states summed into "lora"."""
    out = {k: 0 for k in KINDS}
    for part, nbytes in phase.peak.items():
        out["lora" if part in LORA_PARTS else part] += nbytes
    return out


class _Kinds:
    """What each tracked storage is: uid -> kind."""

    def __init__(self, kind: dict[int, str] | None = None) -> None:
        self.kind: dict[int, str] = dict(kind or {})

    def mark(self, uids, kind: str) -> None:
        for uid in uids:
            self.kind.setdefault(uid, kind)

    def of(self, uid: int) -> str:
        return self.kind.get(uid, "transient")


def _register_weights(tracker, kinds: _Kinds, model: nn.Module, setup: PlanSetup) -> None:
    four_bit = {id(m.weight) for m in four_bit_linears(model)} if setup.four_bit is not None else set()
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        nbytes = setup.four_bit.packed_bytes(p.numel()) if id(p) in four_bit else None
        uid = tracker.register(p, nbytes)
        kinds.mark([uid], "lora_params" if p.requires_grad else "weights")
    for b in model.buffers():
        kinds.mark([tracker.register(b)], "weights")


def _tracked(setup: PlanSetup, model: nn.Module):
    """A tracker (FLOPs counted too) holding ``model``'s weights, and the kinds of its storages."""
    tracker = LiveTensorTracker(count_flops=True)
    kinds = _Kinds()
    _register_weights(tracker, kinds, model, setup)
    return tracker, kinds


def _peak(tracker, kinds: _Kinds, live: dict[int, int]) -> dict[str, int]:
    return {k: v for k, v in tracker.breakdown(live, kinds.of).items() if v}


# Storages that the captured Cayley-Adam step keeps and the fake step does not allocate: negative uids, no tracker's.
_STATIC_GRADS, _GRAPH_POOL = -1, -2
# DeepSpeed's gradient reduction buffers (PlanSetup.reduce_buffers): allocated by the engine, alive in the backward.
_REDUCE_BUFFERS = -3
# The engine's fp32 copies that the planned optimizer holds no master for (_engine_fp32_copies): its partitions, and
# the whole copies of the Stiefel lora_B.
_FP32_PARTITIONS, _STIEFEL_FP32_COPIES = -4, -5


def _engine_fp32_copies(setup: PlanSetup, model: nn.Module, optimizer, stiefel: set[int]) -> tuple[int, int]:
    """Bytes of the fp32 copies the engine's optimizer steps beyond what the planned optimizer holds, unsharded: its
    partitions (the rule's ``fp32_partitions``) and the whole copies of the Stiefel lora_B (``stiefel_fp32_copy``).

    A MasterAdamW master is the fp32 partition of its weight, but an fp32 weight that ZeRO-1/2 clones has none, nor
    has a Stiefel lora_B under ZeRO-3, whose Cayley-Adam master (of a bf16 lora_B) is the client's whole copy beside
    DeepSpeed's partition; an fp32 lora_B has no master to stand for that whole copy."""
    rule = ENGINES[setup.engine]
    partitions = copies = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if id(p) in stiefel and rule.stiefel_fp32_copy and "master" not in optimizer.state.get(p, {}):
            copies += 4 * p.numel()
        if rule.fp32_partitions is None or (id(p) in stiefel and rule.fp32_partitions == "euclidean"):
            continue
        if id(p) not in stiefel and "master" in optimizer.state.get(p, {}):
            continue
        if p.dtype != torch.float32 or rule.fp32_partitions_of_fp32:
            partitions += 4 * p.numel()
    return partitions, copies


def _captured_step_bytes(
    setup: PlanSetup,
    model: nn.Module,
    stiefel: set[int],
    tracker,
    step_peak: dict[int, int],
    before: dict[int, int],
    kept: dict[int, int],
) -> dict[int, int]:
    """What Cayley-Adam's captured step (``cuda_graph``) keeps alive from its capture on, beside its state: static
    gradient buffers the size of the Stiefel lora_B gradients (the Trainer frees the gradients at each zero_grad, the
    graph reads fixed addresses) and the graph's private pool, which keeps the step's own buffers (its transient peak
    above what was alive before it and what it leaves). Empty for an eager step."""
    if not (setup.captures_cayley_step and stiefel):
        return {}
    grads = tracker.uids(p.grad for p in model.parameters() if id(p) in stiefel and p.grad is not None)
    static = sum(nbytes for uid, nbytes in tracker.live().items() if uid in grads)
    pool = sum(nbytes for uid, nbytes in step_peak.items() if uid not in before and uid not in kept)
    return {_STATIC_GRADS: static, _GRAPH_POOL: pool}


def _scoring_phase(setup: PlanSetup, fake_mode, device: torch.device) -> Phase:
    """One Fisher scoring batch on the model as scoring holds it: LoRA on every target layer, adapters off."""
    model = wrap_lora(setup, meta_model_of(setup))
    with fake_mode:
        linears = prepare_fake_model(setup, model, fake_mode, device)
        tracker, kinds = _tracked(setup, model)

        def loss_fn(m, b):
            loss = sft_training_loss(m, b)
            kinds.mark(tracker.live(), "activations")  # what the forward leaves for the backward
            return loss

        targets = setup.fora.fisher_params == "targets"
        with tracker, dequantized_during_matmul(linears, setup.autocast_dtype or setup.dtype):
            try:
                fisher_scores(
                    model,
                    [planned_batch(setup, device)],
                    1,
                    loss_fn=loss_fn,
                    fisher_params=setup.fora.fisher_params,
                    target_modules=setup.lora.target_modules if targets else None,
                    target_parameters=setup.lora.target_parameters if targets else None,
                    linear_grad=ENGINES[setup.engine].scoring_linear_grad,
                    autocast=lambda: planned_autocast(setup, device),
                    quantized=linears,  # float stand-ins of 4-bit linears: scored as bitsandbytes' are
                    progress=False,
                )
            except FAKE_READBACK_ERRORS:
                pass  # the scores' one read-back to the host: fake tensors hold no values (the pass is done)
    return Phase(peak=_peak(tracker, kinds, tracker.peak_live()), flops=tracker.flops)


def _step_phases(
    setup: PlanSetup, modes: tuple[str, ...], fake_mode, device: torch.device, planned: list[int]
) -> dict[str, list[Phase]]:
    """One training step for each of ``modes``, which share their LoRA layers (fora and fg-lora: the ``planned``
    layers; lora: all): one forward and backward, then each mode's optimizer step with its states.

    Each mode gets three candidates for its steady peak (the largest is the step's): from the second step on the
    states live through the forward and backward, so the forward's peak plus the states, the backward's peak plus the
    states, and the optimizer step's own peak. They are kept apart so that each can be extrapolated over depth on its
    own: which of them is the largest can change with depth (with checkpointing, the LM head's forward and backward
    peaks differ by a few bytes), and the largest of two lines is not a line.
    """
    model = wrap_lora(setup, meta_model_of(setup))
    fora_modes = [m for m in modes if m != "lora"]
    if fora_modes:
        # make_stiefel when a mode uses Stiefel lora_B (fora); fg-lora's lora_B are the same shapes, only its
        # optimizer differs (AdamW, as fora_optimizer builds it for that mode).
        stiefel_mode = next((m for m in fora_modes if MODE_PARTS[m][1]), fora_modes[0])
        fora = dataclasses.replace(setup.fora, mode=stiefel_mode, scores_path=None)
        with torch.device("meta"):
            readapt_lora(model, plan_selection(setup, model.get_base_model(), planned), fora, seed=0)
    if setup.lora_dtype is not None:
        cast_lora(model, setup.lora_dtype)  # as the engine casts them; each mode's optimizer keeps fp32 masters
    with fake_mode:
        linears = prepare_fake_model(setup, model, fake_mode, device, stop_backward=bool(fora_modes))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tracker, kinds = _tracked(setup, model)
        with tracker:
            with dequantized_during_matmul(linears, setup.autocast_dtype or setup.dtype):
                with planned_autocast(setup, device):
                    loss = sft_training_loss(model, planned_batch(setup, device))
                kinds.mark(tracker.live(), "activations")  # what the forward leaves for the backward
                forward_peak = tracker.peak_live()
                tracker.reset_peak()
                loss.backward()
            del loss
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            kinds.mark(tracker.uids(grads), "lora_grads")
            backward_peak = tracker.peak_live()
            backward_flops = tracker.flops
            # Transient (the kind of an unmarked uid); the engine's allocations are not the fake step's.
            reduce_buffers = {_REDUCE_BUFFERS: setup.reduce_buffers.nbytes} if setup.reduce_buffers else {}
            phases = {}
            # Modes without Stiefel lora_B first, so that no Cayley-Adam state is alive through another mode's step.
            for mode in sorted(modes, key=lambda m: MODE_PARTS[m][1]):
                if mode == "lora":
                    optimizer = lora_optimizer(setup, model)
                else:
                    # The fake step runs eager (a capture needs real CUDA tensors); what a capture keeps is added
                    # below (_captured_step_bytes).
                    fora = dataclasses.replace(setup.fora, mode=mode, cuda_graph=False)
                    if setup.lora_dtype is not None:
                        # FoRA's optimizer for low-precision adapters: MasterAdamW's fp32 masters stand for
                        # DeepSpeed's fp32 partitions (the same bytes); Cayley-Adam keeps its own for lora_B.
                        fora = dataclasses.replace(fora, adapter_dtype="bfloat16")
                    optimizer = fora_optimizer(trainer_view(setup, model), model, fora)
                    # The step's buffers as on the device planned for, not as on this CPU the fake tensors name.
                    implementation = resolve_implementation(None, torch.device(setup.loss_head_device))
                    for group in optimizer.param_groups:
                        if group["stiefel"]:
                            group["implementation"] = implementation
                tracker.reset_peak()
                flops = tracker.flops
                before = tracker.live()
                optimizer.step()
                stiefel = {id(p) for g in optimizer.param_groups if g.get("stiefel") for p in g["params"]}
                states = {
                    id(p): [t for t in s.values() if isinstance(t, torch.Tensor)] for p, s in optimizer.state.items()
                }
                euclidean_uids = tracker.uids(t for i, ts in states.items() if i not in stiefel for t in ts)
                kinds.mark(euclidean_uids, "optimizer_states")
                # What the step left alive is the optimizer's to keep; beside the AdamW states, it is the Stiefel
                # part (Cayley-Adam's state), with the lora_B gradients.
                live = tracker.live()
                kept = {u: b for u, b in live.items() if u not in before or u in euclidean_uids}
                stiefel_uids = (set(kept) - euclidean_uids) | tracker.uids(
                    p.grad for p in model.parameters() if id(p) in stiefel and p.grad is not None
                )
                step_peak = tracker.peak_live()
                captured = _captured_step_bytes(setup, model, stiefel, tracker, step_peak, before, kept)
                partitions, copies = _engine_fp32_copies(setup, model, optimizer, stiefel)
                engine = {k: v for k, v in ((_FP32_PARTITIONS, partitions), (_STIEFEL_FP32_COPIES, copies)) if v}
                kept.update(engine)
                kind = _Kinds({**kinds.kind, **dict.fromkeys([*stiefel_uids, *captured], "stiefel")})
                kind.mark([_FP32_PARTITIONS], "optimizer_states")
                kind.mark([_STIEFEL_FP32_COPIES], "stiefel")
                flops = backward_flops + tracker.flops - flops
                phases[mode] = [
                    *(
                        Phase(_peak(tracker, kind, {**peak, **kept, **captured}), flops, trainable)
                        for peak in (forward_peak, {**backward_peak, **reduce_buffers})
                    ),
                    # A replayed step runs in the pool it holds: the eager step's own buffers are that pool.
                    Phase(
                        _peak(
                            tracker,
                            kind,
                            {
                                **step_peak,
                                _STATIC_GRADS: captured.get(_STATIC_GRADS, 0),
                                **engine,
                            },
                        ),
                        flops,
                        trainable,
                    ),
                ]
                del states, kept, live
                optimizer.state.clear()  # the next mode's optimizer starts from no state
                del optimizer
    return phases


def measure(setup: PlanSetup, modes: tuple[str, ...], planned: list[int], scoring: bool) -> dict[str, list[Phase]]:
    """Scoring (if ``scoring``) and one step per mode at ``setup``'s depth; per key ("scoring" or a mode), the
    candidates for its peak, unsharded."""
    device = torch.device("cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    out: dict[str, list[Phase]] = {}
    loss_head = fused_lm_head_as_on_cuda() if setup.loss_head_device == "cuda" else contextlib.nullcontext()
    # Packed sequences keep their mask, which the plan then builds as the run does.
    unpacked = contextlib.nullcontext() if setup.packs_sequences else masks_of_unpacked_batches()
    with grouped_mm_in_any_dtype(), unpacked, loss_head:
        if scoring:
            out["scoring"] = [_scoring_phase(setup, fake_mode, device)]
        fora_modes = tuple(m for m in modes if m != "lora")
        if fora_modes:
            out.update(_step_phases(setup, fora_modes, fake_mode, device, planned))
        if "lora" in modes:
            out.update(_step_phases(setup, ("lora",), fake_mode, device, planned))
    return out
