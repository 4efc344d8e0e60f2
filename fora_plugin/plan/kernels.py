"""Kernels as the GPU a plan is for runs them, not as fake tensors on this host would: stand-ins for TRL's fused LM
head's CPU fallback and for the meta kernel of MoE experts' grouped matmul, and the errors of a fake read-back.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import torch
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import DataDependentOutputException, is_fake
from transformers import masking_utils


__all__ = ["FAKE_READBACK_ERRORS", "fused_lm_head_as_on_cuda", "grouped_mm_in_any_dtype", "masks_of_unpacked_batches"]


def _fake_readback_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [DataDependentOutputException]
    with contextlib.suppress(ImportError):  # torch versions that have it raise it for .item() under a ShapeEnv
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        errors.append(GuardOnDataDependentSymNode)
    return tuple(errors)


# What reading a fake tensor's value back to the host raises (fake tensors hold no values).
FAKE_READBACK_ERRORS = _fake_readback_errors()


@contextlib.contextmanager
def fused_lm_head_as_on_cuda():
    """TRL's fused LM head (SFTTrainer's loss) as it runs on the GPU the plan is for, not on the host it runs on.

    On CUDA it folds each (tokens, vocabulary chunk) tile of logits into the loss's running statistics, forward and
    backward, by a Triton kernel, which allocates nothing, and accumulates the gradient products in fp32 by
    ``addmm(out_dtype=float32)``. Without Triton and CUDA (this host) it folds with torch ops that make several fp32
    copies of the tile, and casts both factors of each product to fp32: 3.5 and 0.9 GiB at 4,080 tokens, a 32,768-word
    chunk and a 3,072 hidden size, absent on the GPU (its allocator's trace at the peak, docs/gpu.md). So the plan runs
    the GPU's case: a fold that allocates nothing (fake tensors hold no values to fold) and an fp32 product that
    allocates nothing and counts its FLOPs; the tile, the statistics and the accumulators are TRL's own tensors and
    counted. The product dispatches no ``out_dtype`` overload: torch 2.11's fake mode runs addmm's decomposition for
    them, which takes ``out_dtype`` for ``beta`` (TypeError). A plan needs the product's allocation, not its value.
    """
    try:
        from trl.kernels import chunked_logprob
    except ImportError:  # a TRL without the fused head: the loss builds the logits, counted as they are
        yield
        return

    def fake_only(name: str, values: tuple) -> None:
        # The stand-ins compute no value: on real tensors (a loss run while the plan's patch is on) they would give a
        # wrong loss and gradients, silently.
        real = [tuple(v.shape) for v in values if isinstance(v, torch.Tensor) and not (is_fake(v) or v.is_meta)]
        if real:
            raise RuntimeError(
                f"fora plan's stand-in for TRL's {name} was called on real tensors of shapes {real}: it computes no "
                "value and runs only on the plan's fake tensors, inside fused_lm_head_as_on_cuda()"
            )

    def fold_in_place(*args: Any, **kwargs: Any) -> None:
        fake_only("tile fold", (*args, *kwargs.values()))

    def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        fake_only("_addmm_fp32", (acc, a, b))
        if a.dtype not in (torch.float16, torch.bfloat16):
            acc.addmm_(a, b)
            return
        agree = a.dim() == b.dim() == 2 and acc.shape == (a.shape[0], b.shape[1]) and a.shape[1] == b.shape[0]
        if not agree or acc.dtype != torch.float32 or b.dtype != a.dtype:
            raise RuntimeError(
                f"fp32 product: acc {tuple(acc.shape)} {acc.dtype} += a {tuple(a.shape)} {a.dtype} @ b "
                f"{tuple(b.shape)} {b.dtype} do not agree (acc (m, n) float32, a (m, k), b (k, n) in a's dtype)"
            )
        if acc.numel():  # the same in-place product in fp32, on zero-stride views of acc for the factors: its FLOPs
            acc.addmm_(acc.as_strided(a.shape, (0, 0)), acc.as_strided(b.shape, (0, 0)))

    stand_ins = {"_forward_tile": fold_in_place, "_backward_tile": fold_in_place, "_addmm_fp32": addmm_fp32}
    with contextlib.ExitStack() as stack:
        for name, stand_in in stand_ins.items():
            if hasattr(chunked_logprob, name):
                stack.enter_context(mock.patch.object(chunked_logprob, name, stand_in))
        yield


@contextlib.contextmanager
def masks_of_unpacked_batches():
    """transformers' attention masks as it makes them for the plan's batch: one sequence a row, every token kept.

    Given no 2-D mask, transformers reads the position ids to detect packed sequences (``find_packed_sequence_indices``
    in ``masking_utils``); it cannot read fake ones, takes them for packed and builds a 4-D mask, which a run on this
    batch, whose ids it reads, does not build. With that mask SDPA repeats k and v to every query head of a
    grouped-query model and keeps them for the backward: 3-5% of LLaMA-3.2-3B's step with checkpointing off, planned
    against an H100's ``max_memory_allocated``. Here the ids read as one sequence a row, as they are.
    """
    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


@contextlib.contextmanager
def grouped_mm_in_any_dtype():
    """Fake tensors run MoE experts' ``torch._grouped_mm`` in float32 and float16 as in bfloat16.

    Its meta kernel (what fake tensors run) has only the CUDA fast path's bfloat16 check, while the kernels that the
    run itself calls (on the CPU, and CUDA's fallback) take every float dtype: a float32 MoE plan would stop on
    "Expected inputs of BF16 type". The shapes are checked by the meta kernel on bfloat16 stand-ins, and the output
    is made in the inputs' dtype; both happen inside the fake mode's dispatch, below the tracker, which sees the one
    output alone.
    """
    grouped_mm = torch.ops.aten._grouped_mm.default

    def impl(fake_mode, func, mat_a, mat_b, *args, out_dtype=None, **kwargs):
        if mat_a.dtype == mat_b.dtype == torch.bfloat16:
            return NotImplemented  # the meta kernel's own case
        checked = func(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), *args, **kwargs)
        return torch.empty_like(checked, dtype=out_dtype or mat_a.dtype)

    entry = (lambda func: func is grouped_mm, impl)
    fake_impls.op_implementations_checks.append(entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)
