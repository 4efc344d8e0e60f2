"""What each engine shards of a FoRA run, across which ranks, and what it gathers while computing, as data.

The rules of the engines FoRA runs under (plain DDP, DeepSpeed ZeRO-1/2/3 in :mod:`fora_plugin.zero`, torch FSDP2
in :mod:`fora_plugin.fsdp`), stated as data for the planner, their one reader: it turns one unsharded GPU's memory
into each rank's. Each rule describes what that engine's code does, so a change to an engine changes its rule here.
Nothing here computes beyond reading an engine config's keys.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any


__all__ = ["ENGINES", "GATHERED", "PARTS", "EngineSharding", "ReduceBuckets"]

# The parts of a run's memory that the rules name (``fora plan`` breaks each peak into these).
PARTS = MappingProxyType(
    {
        "weights": "the base model's weights and buffers",
        "lora_params": "the LoRA parameters",
        "lora_grads": "the LoRA gradients",
        "optimizer_states": "the AdamW states",
        "stiefel": "fora's Stiefel lora_B gradients and Cayley-Adam states",
        "activations": "what the forward leaves for the backward",
        "transient": "buffers that live during one operation",
    }
)
# What an engine that shards the weights keeps gathered beside its decoder layers while computing.
GATHERED = MappingProxyType(
    {
        "head": "the head",  # ZeRO-3 gathers the output head for the loss
        "root": "the root (embeddings, norm, head)",  # FSDP2's root module: not resharded after its forward
    }
)


@dataclasses.dataclass(frozen=True)
class ReduceBuckets:
    """Gradient reduction buffers that a DeepSpeed ZeRO optimizer allocates whole, whatever the number of trainable
    elements: ``reduce_bucket_size`` elements each (in the dtype the engine reduces gradients in), one per
    communication dtype, a second one with ``overlap_comm``. Read from a ``zero_optimization`` block as DeepSpeed's
    ``DeepSpeedZeroConfig`` reads it (its defaults filled).

    ZeRO-1/2 (``stage_1_and_2.py``): ``setup_buckets`` allocates them at each backward's first gradient hook when
    ``contiguous_gradients`` is on (which optimizer offload forces), and ``_release_ipg_buffers`` frees them at the
    backward's end: they live in the backward only.
    """

    size: str = "reduce_bucket_size"
    needs: str = "contiguous_gradients"  # no buffer without it ...
    forced_by: str = "offload_optimizer"  # ... unless the optimizer is offloaded (device other than "none")
    doubled_by: str | None = "overlap_comm"

    def count(self, zero: Any) -> int:
        """How many buffers of ``size`` elements per communication dtype; ``zero`` is a ``DeepSpeedZeroConfig``."""
        offload = getattr(zero, self.forced_by)
        if not (getattr(zero, self.needs) or (offload is not None and offload.device != "none")):
            return 0
        return 2 if self.doubled_by is not None and getattr(zero, self.doubled_by) else 1

    def elements(self, zero: Any) -> int:
        return int(getattr(zero, self.size))


@dataclasses.dataclass(frozen=True)
class EngineSharding:
    """One engine's rule: which :data:`PARTS` each rank holds a 1/world-size shard of, and what it gathers whole.

    Every engine here shards across all ranks of the one data-parallel group (FoRA runs no hybrid sharding), so a
    shard is 1/world size of its part.
    """

    # Parts divided among the ranks during a training step (a tuple: the output names them in this order).
    shards: tuple[str, ...] = ()
    # Parts divided during Fisher scoring, which runs before the engine wraps the model (FSDP2) or inside it (ZeRO).
    shards_scoring: tuple[str, ...] = ()
    # Parts the engine keeps whole on every rank although it shards the rest of their kind (the Stiefel part: ZeRO
    # steps each whole lora_B beside its partition).
    whole: tuple[str, ...] = ()
    gathered_layers: int = 0  # decoder layers gathered at once while computing: the current one and the prefetched
    gathered_outside: str | None = None  # a key of GATHERED: what else stays gathered while computing
    # Copies of (gathered_outside + one decoder layer) alive at each forward's start: FSDP2 all-gathers the root and
    # prefetches the first layer, and copies both out of the all-gather buffers into the unsharded parameters while
    # the buffers still live. 0: no such moment.
    forward_start_copies: int = 0
    # Decoder layers gathered at a time, beside gathered_outside, when the engine runs on one rank: FSDP2 all-gathers
    # into buffers of its own with one rank too (FSDPMemTracker on a fake process group of one rank: the root and one
    # decoder layer beyond the unsharded model, at LLaMA-3.2-3B's shapes with checkpointing on and off; an H100
    # measured 2.82 GiB where the unsharded plan was 1.83). 0: a rank alone gathers nothing (ZeRO-3: the H100
    # measured 1.96 GiB against 1.84 planned unsharded).
    gathered_layers_one_rank: int = 0
    # fisher_scores' linear_grad during scoring: a weight's gradient is a shard under ZeRO-3, so linears are scored
    # from their inputs and output gradients.
    scoring_linear_grad: str = "auto"
    # Gradient reduction buffers alive during each step's backward (not sharded: each rank allocates them whole).
    reduce_buckets: ReduceBuckets | None = None
    # The trainable parameters whose fp32 copy the engine's optimizer steps (DeepSpeed ZeRO's fp32 partitions, counted
    # with the optimizer states): "euclidean" (ZeRO-1/2, stage_1_and_2.py: FoRA's client keeps the Stiefel lora_B
    # outside) or "trainable" (ZeRO-3, stage3.py: every one); None: the optimizer steps the parameters themselves.
    fp32_partitions: str | None = None
    # Whether an fp32 parameter gets that copy too (ZeRO-1/2 clone it; ZeRO-3 steps an fp32 partition in place).
    fp32_partitions_of_fp32: bool = False
    # Whether FoRA's client steps each Stiefel lora_B on its own whole fp32 copy, also of an fp32 lora_B
    # (Zero3FoRAOptimizer gathers the partition into it).
    stiefel_fp32_copy: bool = False

    def __post_init__(self) -> None:
        unknown = {*self.shards, *self.shards_scoring, *self.whole} - set(PARTS)
        if unknown or (self.gathered_outside is not None and self.gathered_outside not in GATHERED):
            raise ValueError(f"an engine rule names what PARTS and GATHERED do not: {self}")
        if self.fp32_partitions not in (None, "euclidean", "trainable"):
            raise ValueError(f"an engine rule's fp32_partitions is not None, 'euclidean' or 'trainable': {self}")

    @property
    def shards_weights(self) -> bool:
        """Whether a rank holds a shard of the base weights (ZeRO-3, FSDP2) rather than all of them."""
        return "weights" in self.shards


_ZERO_WHOLE = ("stiefel",)
_ZERO12_BUCKETS = ReduceBuckets()
# Engine name (as ``fora plan`` names the run's engine) -> its rule.
ENGINES: MappingProxyType[str, EngineSharding] = MappingProxyType(
    {
        "single": EngineSharding(),
        "ddp": EngineSharding(),  # every rank holds everything
        "zero1": EngineSharding(
            shards=("optimizer_states",),
            shards_scoring=("optimizer_states",),
            whole=_ZERO_WHOLE,
            reduce_buckets=_ZERO12_BUCKETS,
            fp32_partitions="euclidean",
            fp32_partitions_of_fp32=True,
        ),
        "zero2": EngineSharding(
            shards=("optimizer_states", "lora_grads"),
            shards_scoring=("optimizer_states", "lora_grads"),
            whole=_ZERO_WHOLE,
            reduce_buckets=_ZERO12_BUCKETS,
            fp32_partitions="euclidean",
            fp32_partitions_of_fp32=True,
        ),
        # Zero3FoRAOptimizer: every rank holds each whole fp32 lora_B and its Cayley state.
        "zero3": EngineSharding(
            shards=("weights", "lora_params", "optimizer_states", "lora_grads"),
            shards_scoring=("weights", "lora_params", "optimizer_states", "lora_grads"),
            whole=_ZERO_WHOLE,
            gathered_layers=2,
            gathered_outside="head",
            scoring_linear_grad="activations",
            fp32_partitions="trainable",
            stiefel_fp32_copy=True,
        ),
        # fully_shard: lora_B and its Cayley state are row-sharded; scoring holds the whole model (before sharding).
        "fsdp2": EngineSharding(
            shards=("weights", "lora_params", "optimizer_states", "lora_grads", "stiefel"),
            gathered_layers=2,
            gathered_outside="root",
            forward_start_copies=2,
            gathered_layers_one_rank=1,
        ),
    }
)
