"""The storage tracker's FLOP counts for ops FlopCounterMode has no formula for, against FlopCounterMode's own
count of the same product written with ops it does count."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fora_plugin.plan.memory import LiveTensorTracker, flop_formulas


def _tracked_flops(fn) -> int:
    tracker = LiveTensorTracker(count_flops=True)
    with tracker:
        fn()
    return tracker.flops


def _reference_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# Token counts per group (MoE expert), uneven on purpose: 3, 0, 5 and 4 rows.
OFFS = torch.tensor([3, 3, 8, 12], dtype=torch.int32)


def _groups() -> list[slice]:
    starts = [0, *OFFS.tolist()[:-1]]
    return [slice(a, b) for a, b in zip(starts, OFFS.tolist())]


@pytest.mark.parametrize("layout", ["2d x 3d", "2d x 2d", "3d x 3d"])
def test_grouped_mm_flops_equal_those_of_one_mm_per_group(layout):
    torch.manual_seed(0)
    g, k, n, m = 4, 8, 4, 12  # row strides a multiple of 16 bytes, as _grouped_mm requires
    if layout == "2d x 3d":  # MoE forward: tokens sorted by expert x each expert's weight
        a, b = torch.randn(12, k), torch.randn(g, k, n)

        def grouped():
            return torch._grouped_mm(a, b, offs=OFFS)

        def per_group():
            return [a[rows] @ b[i] for i, rows in enumerate(_groups())]
    elif layout == "2d x 2d":  # MoE weight gradient: the groups split the contracted tokens
        a, b = torch.randn(m, 12), torch.randn(12, n)

        def grouped():
            return torch._grouped_mm(a, b, offs=OFFS)

        def per_group():
            return [a[:, rows] @ b[rows] for rows in _groups()]
    else:
        a, b = torch.randn(g, m, k), torch.randn(g, k, n)

        def grouped():
            return torch._grouped_mm(a, b)

        def per_group():
            return torch.bmm(a, b)

    assert torch.allclose(_stacked(grouped()), _stacked(per_group()), atol=1e-5)  # the same product
    assert _reference_flops(grouped) == 0  # the gap this formula fills
    assert _tracked_flops(grouped) == _reference_flops(per_group) > 0


def _stacked(out) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in out]) if isinstance(out, list) else out.reshape(-1)


def test_cpu_attention_flops_equal_those_of_the_gpu_kernels_formula():
    """SDPA on CPU tensors (fake ones included) runs a CPU kernel; counted as FlopCounterMode counts the GPU's flash
    kernel: the explicit products, plus the scores q kᵀ recomputed in the backward."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def math_attention():  # the same products as explicit matmuls, which FlopCounterMode counts
        scores = q @ k.transpose(-1, -2) / 8**0.5
        mask = torch.ones(16, 16, dtype=torch.bool).tril()
        (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).sum().backward()

    assert _reference_flops(attention) == 0
    # FlopCounterMode's SDPA formulas count the full (non-causal) products, as the explicit matmuls do.
    recomputed_scores = 2 * 2 * 4 * 16 * 16 * 8
    assert _tracked_flops(attention) == _reference_flops(math_attention) + recomputed_scores


def test_flop_formulas_keep_every_formula_of_flop_counter_mode():
    assert set(FlopCounterMode(display=False).flop_registry) <= set(flop_formulas())
