"""CayleyAdam and FoRAOptimizer on bare tensors: trajectories, manifold, resume, robustness, errors."""

import contextlib
import copy
import io
import warnings

import pytest
import torch
from dense_reference import dense_cayley_adam

from fora_plugin import CayleyAdam, FoRAOptimizer
from fora_plugin.optim import resolve_implementation
from fora_plugin.stiefel import orthogonality_error, qr_retraction, random_stiefel


def stiefel_params(shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(random_stiefel(d, r, generator=gen).to(dtype)) for d, r in shapes]


def set_random_grads(params, gen, scale=1.0):
    for p in params:
        p.grad = (scale * torch.randn(p.shape, generator=gen)).to(p.dtype)


def test_trajectory_matches_the_dense_appendix_c_reference():
    gen = torch.Generator().manual_seed(0)
    B0 = random_stiefel(24, 4, generator=gen, dtype=torch.float64)
    grads = [torch.randn(24, 4, generator=gen, dtype=torch.float64) for _ in range(12)]
    expected = dense_cayley_adam(B0, grads, lr=0.05)

    p = torch.nn.Parameter(B0.clone())
    opt = CayleyAdam([p], lr=0.05, qr_period=0)
    for G, B_ref in zip(grads, expected):
        p.grad = G.clone()
        opt.step()
        assert torch.max(torch.abs(p.detach() - B_ref)) < 1e-10


def test_stacked_update_equals_one_optimizer_per_matrix():
    shapes = [(48, 4), (48, 4), (48, 4), (20, 2)]
    together = stiefel_params(shapes, seed=1)
    alone = [torch.nn.Parameter(p.detach().clone()) for p in together]
    opt_together = CayleyAdam(together, lr=0.01)
    opts_alone = [CayleyAdam([p], lr=0.01) for p in alone]
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in together]
        for p, q, g in zip(together, alone, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_together.step()
        for opt in opts_alone:
            opt.step()
    for p, q in zip(together, alone):
        assert torch.allclose(p, q, atol=1e-6)


def test_orthonormality_drift_stays_below_1e_4_after_2000_fp32_steps_without_qr():
    params = stiefel_params([(256, 16), (256, 16), (64, 8)], seed=3)
    opt = CayleyAdam(params, lr=5e-2, qr_period=0)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2000):
        set_random_grads(params, gen)
        opt.step()
    drift = max(orthogonality_error(p.detach()).item() for p in params)
    print(f"drift after 2000 fp32 steps: {drift:.2e}")
    assert drift < 1e-4
    # The points did move: a stationary optimizer would pass the drift check trivially.
    start = stiefel_params([(256, 16)], seed=3)[0]
    assert torch.linalg.norm(params[0].detach() - start) > 1.0


def test_qr_period_reprojects_onto_the_manifold():
    (p,) = stiefel_params([(32, 4)], seed=5)
    opt = CayleyAdam([p], lr=1e-2, qr_period=3)
    gen = torch.Generator().manual_seed(6)
    for step in range(1, 4):
        set_random_grads([p], gen)
        if step == 3:
            with torch.no_grad():
                p.add_(1e-3 * torch.randn(p.shape, generator=gen))  # knock the point off the manifold
        opt.step()
    # Cayley preserves BᵀB, so only the QR at step 3 brings the drift back to rounding level.
    assert orthogonality_error(p.detach()) < 1e-5


@pytest.mark.parametrize(("knock", "reprojected"), [(1e-2, True), (1e-5, False)])
def test_drift_above_the_threshold_is_reprojected_within_the_step(knock, reprojected):
    gen = torch.Generator().manual_seed(21)
    params = stiefel_params([(24, 4), (24, 4)], seed=22, dtype=torch.float64)
    opt = CayleyAdam(params, lr=0.05, qr_period=0)  # reproject_threshold = 1e-3
    for _ in range(3):
        set_random_grads(params, gen)
        opt.step()
    with torch.no_grad():
        params[0].add_(knock * torch.randn(params[0].shape, generator=gen, dtype=torch.float64))
    # Reference: the same optimizer, its B set by hand to the sign-fixed Householder QR of the knocked B (or left).
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = CayleyAdam(twin, lr=0.05, qr_period=0, reproject_threshold=1.0)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    if reprojected:
        with torch.no_grad():
            twin[0].copy_(qr_retraction(twin[0]))
    set_random_grads(params, gen)
    for p, q in zip(params, twin):
        q.grad = p.grad.clone()
    opt.step()
    twin_opt.step()
    for p, q in zip(params, twin):
        assert torch.max(torch.abs(p.detach() - q.detach())) < 1e-10
    assert [int(opt.state[p]["reprojections"]) for p in params] == [int(reprojected), 0]
    assert opt.reprojections() == int(reprojected)
    assert orthogonality_error(params[0].detach()) < (1e-12 if reprojected else 1e-3)


def test_maximising_a_trace_finds_the_top_eigenspace():
    # max tr(BᵀSB) over St(d, r) is attained at the top-r eigenvectors of S.
    gen = torch.Generator().manual_seed(7)
    d, r = 60, 4
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    eigenvalues = torch.cat([torch.tensor([10.0, 9.0, 8.0, 7.0]), torch.linspace(3.0, 0.0, d - r)]).double()
    S = (Q * eigenvalues) @ Q.T
    (p,) = stiefel_params([(d, r)], seed=8, dtype=torch.float64)
    opt = CayleyAdam([p], lr=0.05)
    for _ in range(600):
        opt.zero_grad()
        loss = -torch.trace(p.T @ S @ p)
        loss.backward()
        opt.step()
    top = torch.linalg.eigh(S).eigenvectors[:, -r:]  # (d, r)
    cosines = torch.linalg.svdvals(top.T @ p.detach())
    largest_principal_angle = torch.arccos(cosines.min().clamp(max=1.0))
    assert largest_principal_angle < 1e-2
    assert orthogonality_error(p.detach()) < 1e-10


@pytest.mark.parametrize("solver", ["exact", "fixed_point"])
def test_state_dict_round_trip_continues_bit_identically(solver):
    shapes = [(40, 4), (40, 4), (16, 2)]
    params = stiefel_params(shapes, seed=9)
    opt = CayleyAdam(params, lr=0.02, qr_period=4, cayley_solver=solver)
    gen = torch.Generator().manual_seed(10)
    for _ in range(5):
        set_random_grads(params, gen)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = CayleyAdam(resumed_params, lr=0.02, qr_period=4, cayley_solver=solver)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for _ in range(6):  # crosses a QR step: the step counter came back too
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, q, g in zip(params, resumed_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        resumed.step()
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("solver", ["exact", "fixed_point"])
def test_a_zero_gradient_on_a_fresh_matrix_leaves_it_in_place(solver):
    # A layer whose loss does not reach it yet (zero gradient, zero moment): W = 0. The fixed-point solver once
    # returned NaN there (rsqrt of −0.0).
    params = stiefel_params([(30, 3), (12, 2)], seed=13)
    before = [p.detach().clone() for p in params]
    opt = CayleyAdam(params, lr=0.05, cayley_solver=solver)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, start in zip(params, before):
        torch.testing.assert_close(p.detach(), start, rtol=0, atol=1e-6)  # fp32 rounding; NaN fails it


def test_non_finite_gradient_skips_only_that_matrix_and_is_counted():
    params = stiefel_params([(30, 3), (30, 3), (30, 3)], seed=11)
    opt = CayleyAdam(params, lr=0.05)
    gen = torch.Generator().manual_seed(12)
    for _ in range(3):
        set_random_grads(params, gen)
        opt.step()
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    set_random_grads(params, gen)
    params[1].grad[0, 0] = float("nan")
    params[2].grad[5, 1] = float("inf")
    opt.step()
    assert not torch.equal(params[0], before[0])
    for i in (1, 2):
        assert torch.equal(params[i], before[i])
        assert torch.equal(opt.state[params[i]]["exp_avg"], moments[i])
        assert orthogonality_error(params[i].detach()) < 1e-5
    assert torch.all(torch.isfinite(torch.stack([p.detach() for p in params])))
    assert opt.skipped_steps() == 2
    assert [int(opt.state[p]["skipped_steps"]) for p in params] == [0, 1, 1]
    assert [int(opt.state[p]["step"]) for p in params] == [4, 3, 3]


def test_bf16_parameter_keeps_an_orthonormal_fp32_master_for_1000_steps():
    (p,) = stiefel_params([(128, 8)], seed=13, dtype=torch.bfloat16)
    opt = CayleyAdam([p], lr=1e-2)
    gen = torch.Generator().manual_seed(14)
    for _ in range(1000):
        set_random_grads([p], gen)
        opt.step()
    master = opt.state[p]["master"]
    assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
    assert orthogonality_error(master) < 1e-5
    assert torch.equal(p.detach(), master.to(torch.bfloat16))  # the stored copy is the master, rounded
    # A resume keeps the master in fp32 (Optimizer.load_state_dict alone would cast it to bf16).
    resumed = CayleyAdam([torch.nn.Parameter(p.detach().clone())], lr=1e-2)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    (q,) = resumed.param_groups[0]["params"]
    assert resumed.state[q]["master"].dtype == torch.float32
    assert torch.equal(resumed.state[q]["master"], master)


def test_a_point_off_the_manifold_is_projected_at_its_first_step():
    p = torch.nn.Parameter(torch.randn(20, 3, generator=torch.Generator().manual_seed(15)))
    opt = CayleyAdam([p], lr=1e-3)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert orthogonality_error(p.detach()) < 1e-6


def test_construction_refuses_what_cannot_be_stiefel():
    with pytest.raises(ValueError, match=r"shape \(16,\).*only 2-D"):
        CayleyAdam([torch.nn.Parameter(torch.zeros(16))])
    with pytest.raises(ValueError, match=r"d_out=3 < r=8.*r <= 3"):
        CayleyAdam([torch.nn.Parameter(torch.zeros(3, 8))])
    with pytest.raises(TypeError, match=r"dtype torch.int64"):
        CayleyAdam([torch.zeros(4, 2, dtype=torch.long)])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, r"lr=-1.0"),
        ({"betas": (0.9, 1.0)}, r"betas=\(0.9, 1.0\)"),
        ({"eps": -1e-8}, r"eps=-1e-08"),
        ({"lr": float("nan")}, r"lr=nan is invalid: use a finite float >= 0"),
        ({"lr": float("inf")}, r"lr=inf is invalid"),
        ({"eps": float("nan")}, r"eps=nan is invalid: use a finite float >= 0"),
        ({"betas": (float("nan"), 0.99)}, r"betas=\(nan, 0.99\) is invalid"),
        ({"reproject_threshold": 0.0}, r"reproject_threshold=0.0 is invalid: use a finite float > 0"),
        ({"reproject_threshold": float("nan")}, r"reproject_threshold=nan is invalid"),
        ({"qr_period": -5}, r"qr_period=-5.*0 = never"),
        ({"qr_period": 2.5}, r"qr_period=2.5"),
        ({"cayley_solver": "newton"}, r"cayley_solver='newton'.*'exact', 'fixed_point'"),
        ({"cayley_iters": 0}, r"cayley_iters=0"),
        ({"implementation": "fused"}, r"implementation='fused' is invalid: use one of \('per_matrix', 'staged'\)"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CayleyAdam(stiefel_params([(8, 2)]), **kwargs)


def test_eps_zero_with_zero_gradients_does_not_move_and_then_follows_the_dense_reference():
    # With lora_A = 0 the first lora_B gradients are exactly 0: v = 0, and with eps = 0 the step was 0/0 = NaN.
    gen = torch.Generator().manual_seed(20)
    B0 = random_stiefel(12, 3, generator=gen, dtype=torch.float64)
    grads = [torch.zeros(12, 3, dtype=torch.float64)] * 2 + [torch.randn(12, 3, generator=gen, dtype=torch.float64)]
    # The dense reference with a vanishing eps: 0/(0 + 1e-300) = 0, then the same steps as eps = 0.
    expected = dense_cayley_adam(B0, grads, lr=0.05, eps=1e-300)
    p = torch.nn.Parameter(B0.clone())
    opt = CayleyAdam([p], lr=0.05, eps=0.0, qr_period=0)
    for t, G in enumerate(grads):
        p.grad = G.clone()
        opt.step()
        assert torch.all(torch.isfinite(p))
        assert torch.max(torch.abs(p.detach() - expected[t])) < 1e-10
    assert torch.equal(expected[1], B0) and not torch.allclose(expected[2], B0)


def test_fora_optimizer_steps_adamw_groups_like_torch_adamw():
    gen = torch.Generator().manual_seed(16)
    a = torch.nn.Parameter(torch.randn(6, 10, generator=gen))
    a_ref = torch.nn.Parameter(a.detach().clone())
    (b,) = stiefel_params([(12, 6)], seed=17)
    opt = FoRAOptimizer(
        [{"params": [a], "weight_decay": 0.1}, {"params": [b], "stiefel": True}],
        adamw_defaults={"lr": 1e-2},
        stiefel_defaults={"lr": 5e-2},
    )
    ref = torch.optim.AdamW([a_ref], lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        g = torch.randn(a.shape, generator=gen)
        a.grad, a_ref.grad = g.clone(), g.clone()
        b.grad = torch.randn(b.shape, generator=gen)
        opt.step()
        ref.step()
    assert torch.equal(a, a_ref)
    assert [g["stiefel"] for g in opt.param_groups] == [False, True]
    assert opt.param_groups[1]["lr"] == 5e-2 and opt.param_groups[0]["lr"] == 1e-2
    assert orthogonality_error(b.detach()) < 1e-5


def test_fora_optimizer_resumes_both_groups_bit_identically():
    gen = torch.Generator().manual_seed(18)

    def build(a, b):
        return FoRAOptimizer(
            [{"params": [a]}, {"params": [b], "stiefel": True}],
            adamw_defaults={"lr": 1e-2, "fused": True},  # torch.optim.AdamW reads its step count otherwise
            stiefel_defaults={"lr": 5e-2, "qr_period": 3},
        )

    a = torch.nn.Parameter(torch.randn(4, 9, generator=gen))
    (b,) = stiefel_params([(9, 4)], seed=19, dtype=torch.bfloat16)
    opt = build(a, b)
    for _ in range(4):
        a.grad, b.grad = torch.randn(a.shape, generator=gen), torch.randn(b.shape, generator=gen).bfloat16()
        opt.step()
    a2, b2 = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    resumed = build(a2, b2)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed.state[b2]["master"].dtype == torch.float32
    for _ in range(4):
        ga, gb = torch.randn(a.shape, generator=gen), torch.randn(b.shape, generator=gen).bfloat16()
        a.grad, b.grad, a2.grad, b2.grad = ga.clone(), gb.clone(), ga.clone(), gb.clone()
        opt.step()
        resumed.step()
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert torch.equal(opt.state[b]["master"], resumed.state[b2]["master"])


def test_fora_optimizer_refuses_a_bad_stiefel_group_by_name():
    with pytest.raises(ValueError, match=r"only 2-D"):
        FoRAOptimizer([{"params": [torch.nn.Parameter(torch.zeros(5))], "stiefel": True}])


# ---- per-expert Stiefel blocks (PEFT's fused-MoE lora_B (d_out, r·E), experts' columns interleaved) -------------


def interleave(blocks):
    """E (d, r) blocks -> PEFT's (d, r·E) lora_B, expert e in columns e, e + E, ..."""
    d, r = blocks[0].shape
    return torch.stack(blocks, dim=-1).reshape(d, r * len(blocks))


def test_expert_blocks_follow_independent_dense_cayley_adam_runs():
    gen = torch.Generator().manual_seed(30)
    d, r, experts = 20, 3, 4
    blocks = [random_stiefel(d, r, generator=gen, dtype=torch.float64) for _ in range(experts)]
    # Each expert sees gradients of its own scale: one shared second moment would mix them.
    grads = [
        [(10.0**e) * torch.randn(d, r, generator=gen, dtype=torch.float64) for e in range(experts)] for _ in range(8)
    ]
    expected = [dense_cayley_adam(blocks[e], [g[e] for g in grads], lr=0.05) for e in range(experts)]
    p = torch.nn.Parameter(interleave(blocks))
    opt = CayleyAdam([{"params": [p], "num_experts": experts}], lr=0.05, qr_period=0)
    for t, g in enumerate(grads):
        p.grad = interleave(g)
        opt.step()
        got = p.detach().view(d, r, experts).permute(2, 0, 1)
        for e in range(experts):
            assert torch.max(torch.abs(got[e] - expected[e][t])) < 1e-10
    assert opt.state[p]["exp_avg_sq"].shape == (experts,)


def test_expert_blocks_batch_with_plain_matrices_and_skip_on_their_own():
    gen = torch.Generator().manual_seed(31)
    d, r, experts = 16, 2, 3
    blocks = [random_stiefel(d, r, generator=gen) for _ in range(experts)]
    fused = torch.nn.Parameter(interleave(blocks))
    plain = stiefel_params([(d, r)], seed=32)[0]  # same (d, r): stacked with the expert blocks
    alone = [torch.nn.Parameter(b.clone()) for b in blocks]
    opt = CayleyAdam([{"params": [fused], "num_experts": experts}, {"params": [plain]}], lr=0.02)
    ref = CayleyAdam(alone, lr=0.02)
    for step in range(4):
        block_grads = [torch.randn(d, r, generator=gen) for _ in range(experts)]
        if step == 2:
            block_grads[1][3, 0] = float("inf")  # only expert 1 skips this step
        fused.grad = interleave(block_grads)
        plain.grad = torch.randn(d, r, generator=gen)
        for q, g in zip(alone, block_grads):
            q.grad = g.clone()
        opt.step()
        ref.step()
    got = fused.detach().view(d, r, experts).permute(2, 0, 1)
    for e in range(experts):
        assert torch.allclose(got[e], alone[e].detach(), atol=1e-6)
    assert opt.state[fused]["skipped_steps"].tolist() == [0, 1, 0]
    assert opt.state[fused]["step"].tolist() == [4, 3, 4]
    assert opt.skipped_steps() == 1
    assert orthogonality_error(plain.detach()) < 1e-5


@pytest.mark.parametrize(
    ("shape", "experts", "message"),
    [
        ((16, 6), 4, r"shape \(16, 6\) in a group with num_experts=4.*not r columns for each of 4 experts"),
        ((2, 12), 4, r"d_out=2 < r=3"),
        ((16, 8), 0, r"num_experts=0 is invalid: use an int >= 1"),
    ],
)
def test_bad_expert_layouts_are_refused_by_name(shape, experts, message):
    with pytest.raises(ValueError, match=message):
        CayleyAdam([{"params": [torch.nn.Parameter(torch.zeros(shape))], "num_experts": experts}])


def test_fora_optimizer_parts_puts_fused_expert_lora_b_in_their_own_group():
    from test_moe import EXPERTS, fora_moe

    from fora_plugin import stiefel_num_experts
    from fora_plugin.optim import build_fora_optimizer

    model, _ = fora_moe()
    experts = stiefel_num_experts(model)
    assert experts and set(experts.values()) == {EXPERTS}
    opt = build_fora_optimizer(model)
    stiefel = opt.stiefel_groups
    assert [g["num_experts"] for g in stiefel] == [1, EXPERTS]
    assert {id(p) for p in stiefel[1]["params"]} == set(experts)
    assert not {id(p) for p in stiefel[0]["params"]} & set(experts)
    gen = torch.Generator().manual_seed(33)
    for _ in range(3):
        for p in stiefel[1]["params"]:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    for p in stiefel[1]["params"]:
        d, width = p.shape
        blocks = p.detach().view(d, width // EXPERTS, EXPERTS).permute(2, 0, 1)
        assert torch.all(orthogonality_error(blocks) < 1e-5)
        assert orthogonality_error(p.detach()) > 0.5  # the whole (d, r·E) matrix is not orthonormal


# ---- LR schedulers: every transformers scheduler keeps the lr_stiefel / lr ratio, or is refused by name ---------

SCHEDULER_KWARGS = {
    "cosine_with_min_lr": {"min_lr": 1e-5},
    "cosine_warmup_with_min_lr": {"min_lr": 1e-5},
    "warmup_stable_decay": {"num_decay_steps": 4},
    "greedy": {"patience": 0, "factor": 0.5, "min_lr": 1e-4},  # lr hits its floor two halvings before lr_stiefel
    "reduce_lr_on_plateau": {"patience": 0, "factor": 0.5},
}


def two_group_fora_optimizer():
    a = torch.nn.Parameter(torch.zeros(3, 5))
    (b,) = stiefel_params([(5, 3)], seed=40)
    return FoRAOptimizer(
        [{"params": [a]}, {"params": [b], "stiefel": True}],
        adamw_defaults={"lr": 2e-4},
        stiefel_defaults={"lr": 1e-3},
    )


@pytest.mark.parametrize("name", [s.value for s in __import__("transformers").SchedulerType])
def test_every_transformers_scheduler_keeps_the_lr_ratio_or_is_refused(name):
    from transformers import get_scheduler

    from fora_plugin.optim import UNSUPPORTED_LR_SCHEDULERS, check_lr_scheduler_type

    opt = two_group_fora_optimizer()
    assert opt.defaults["lr"] == 2e-4  # what polynomial and the min-lr schedules divide by
    scheduler = get_scheduler(
        name, opt, num_warmup_steps=2, num_training_steps=12, scheduler_specific_kwargs=SCHEDULER_KWARGS.get(name)
    )
    ratios, lrs = [], []
    for step in range(12):
        opt.step()  # no gradients: a no-op, but the scheduler expects it first
        if name in ("reduce_lr_on_plateau", "greedy"):
            scheduler.step(float(step))  # a loss that never improves
        else:
            scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
        ratios.append(opt.param_groups[1]["lr"] / opt.param_groups[0]["lr"] if opt.param_groups[0]["lr"] else 5.0)
    keeps_ratio = all(abs(ratio - 5.0) < 1e-9 for ratio in ratios)
    if name in UNSUPPORTED_LR_SCHEDULERS:
        assert not keeps_ratio  # the reason it is refused
        with pytest.raises(ValueError, match=rf"lr_scheduler_type='{name}' cannot be used with FoRA"):
            check_lr_scheduler_type(name)
    else:
        assert keeps_ratio, ratios
        check_lr_scheduler_type(name)
    if name != "constant":
        assert len(set(lrs)) > 1  # the schedule did act


# ---- the step against the old one, host syncs, graph breaks, optimizer state saved by the old step ----------------


def reference_optimizer_class():
    """The old step (before the stacked storage), kept in bench/ as the reference path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "reference_cayley_adam.py"
    spec = importlib.util.spec_from_file_location("reference_cayley_adam", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ReferenceCayleyAdam


class AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every aten op that runs, and the largest tensor it is given."""

    def __init__(self):
        super().__init__()
        self.names, self.sizes = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        tensors = [
            t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)
        ]
        self.sizes.append(max((t.numel() for t in tensors), default=0))
        return func(*args, **(kwargs or {}))


def test_every_lora_b_and_moment_owns_its_storage_and_keeps_its_address_through_steps():
    # bf16 and expert lora_B too: their fp32 masters and interleaved blocks are copied in and out as well.
    gen = torch.Generator().manual_seed(51)
    params = stiefel_params([(48, 4), (48, 4), (48, 4), (20, 4)], seed=50)
    params += stiefel_params([(48, 4)], seed=49, dtype=torch.bfloat16)
    experts = torch.nn.Parameter(interleave([random_stiefel(16, 2, generator=gen) for _ in range(3)]))
    opt = CayleyAdam([{"params": params}, {"params": [experts], "num_experts": 3}], lr=0.02)
    everything = params + [experts]
    addresses = [p.data_ptr() for p in everything]
    for _ in range(5):
        set_random_grads(everything, gen)
        opt.step()
    assert [p.data_ptr() for p in everything] == addresses
    tensors = everything + [t for p in everything for t in opt.state[p].values()]
    storages = [t.untyped_storage() for t in tensors]
    assert len({s.data_ptr() for s in storages}) == len(tensors)  # no tensor shares another one's storage
    assert all(s.nbytes() == t.numel() * t.element_size() for s, t in zip(storages, tensors))  # nor holds more


class ForeachCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op's name, and for each torch._foreach_copy_ whether each (destination, source) pair is dense with equal
    sizes and strides: the pairs CUDA copies in one multi-tensor kernel (any other pair gets a kernel of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.slow_pairs: list[tuple] = []
        self.matrix_copies = 0  # multi-tensor copies of matrices (not of per-matrix scalars)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view:
            self.ops.append(name)
        if name == "_foreach_copy_":
            self.matrix_copies += args[0][0].dim() == 2
            for dst, src in zip(args[0], args[1]):
                fast = (
                    dst.shape == src.shape
                    and dst.stride() == src.stride()
                    and all(torch._prims_common.is_non_overlapping_and_dense_or_false(t) for t in (dst, src))
                )
                if not fast:
                    self.slow_pairs.append((tuple(dst.shape), dst.stride(), tuple(src.shape), src.stride()))
        return func(*args, **(kwargs or {}))


def test_the_step_stages_its_copies_on_an_accelerator_and_not_on_the_cpu():
    assert resolve_implementation(None, torch.device("cuda")) == "staged"
    assert resolve_implementation(None, torch.device("meta")) == "staged"
    assert resolve_implementation(None, torch.device("cpu")) == "per_matrix"
    # A named implementation is taken as given, on any device.
    assert resolve_implementation("staged", torch.device("cpu")) == "staged"
    assert resolve_implementation("per_matrix", torch.device("cuda")) == "per_matrix"


@pytest.mark.parametrize("implementation", ["per_matrix", "staged"])
def test_the_functional_step_is_the_optimizers_step(implementation):
    """cayley_adam() on the state's own tensors, as torch's adam() on Adam's: the same bits as CayleyAdam.step."""
    from fora_plugin.optim.cayley_adam import cayley_adam

    gen = torch.Generator().manual_seed(62)
    params = stiefel_params([(24, 4), (24, 4), (12, 2)], seed=63) + stiefel_params([(24, 4)], dtype=torch.bfloat16)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = CayleyAdam(params, lr=0.02, qr_period=2, implementation=implementation)
    holder = CayleyAdam(twins, lr=0.02, implementation=implementation)  # makes the state the functional step moves
    constants = {}
    for step in range(4):
        set_random_grads(params, gen)
        for p, q in zip(params, twins):
            q.grad = p.grad.clone()
        opt.step()
        if step == 0:
            holder.step()  # the state made, and a first step taken as the class takes it
            continue
        states = [holder.state[q] for q in twins]
        lists = [
            [s[key] for s in states] for key in ("exp_avg", "exp_avg_sq", "step", "skipped_steps", "reprojections")
        ]
        with torch.no_grad():  # as the class steps: in place on leaf parameters
            cayley_adam(
                twins,
                [q.grad for q in twins],
                *lists,
                [s.get("master") for s in states],
                lr=0.02,
                beta1=0.9,
                beta2=0.99,
                eps=1e-8,
                reproject_all=(step + 1) % 2 == 0,
                implementation=implementation,
                constants=constants,
            )
        for p, q in zip(params, twins):
            assert torch.equal(p, q)
            for key, value in opt.state[p].items():
                assert torch.equal(value, holder.state[q][key]), key


def copies_forced(opt, staged):
    """``opt`` set to copy through the dense stage (``staged``) or matrix by matrix, whatever the device."""
    for group in opt.param_groups:
        group["implementation"] = "staged" if staged else "per_matrix"
    return opt


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "experts"])
def test_the_copies_in_and_out_are_a_few_multi_tensor_kernels_whatever_the_number_of_matrices(kind, staged):
    """On a GPU the step is bound by the host issuing kernels (docs/gpu.md): a strided copy per matrix would take
    hundreds of launches a step. Staged (as on an accelerator), each list copy must be one that CUDA runs as one
    multi-tensor kernel, and the ops of a step must not grow with the number of matrices in a bucket; both ways (the
    CPU steps matrix by matrix), the step must give the same parameters and state, to fp32 rounding. 192 rows: the
    staged step sums its Gram matrices from 3 blocks of 64 rows (gram_by_row_blocks)."""
    gen = torch.Generator().manual_seed(60)

    def one_step(count: int) -> ForeachCopies:
        if kind == "experts":
            params = [
                torch.nn.Parameter(interleave([random_stiefel(192, 2, generator=gen) for _ in range(3)]))
                for _ in range(count)
            ]
            opt = CayleyAdam([{"params": params, "num_experts": 3}], lr=0.02)
        else:
            dtype = torch.bfloat16 if kind == "bf16" else torch.float32
            params = stiefel_params([(192, 4)] * count, seed=61, dtype=dtype)
            opt = CayleyAdam(params, lr=0.02)
        set_random_grads(params, gen)
        opt.step()  # the state is made
        set_random_grads(params, gen)
        copies_forced(opt, staged)
        with ForeachCopies() as copies, BatchedProducts() as products:
            opt.step()
        copies.products = products.shapes
        return copies, params, opt

    (few, *_), (many, params, opt) = one_step(2), one_step(9)
    if staged:
        assert many.slow_pairs == []
        assert sorted(many.ops) == sorted(few.ops)
        # The bucket crosses between the matrices' own storage and the step's buffers once each way: the gradients, B
        # and m in, B and m out (and a bf16 lora_B its master's value). Whole-bucket copies beside them: B and m into
        # the halves of [B, m], each half into its update's output, and the experts' blocks out of the stage (they are
        # strided in their lora_B).
        assert many.matrix_copies == 5 + (kind == "bf16")
        assert many.ops.count("copy_") == (6 if kind == "experts" else 4)
        r, n = (2, 27) if kind == "experts" else (4, 9)  # 9 lora_B of 3 experts: 27 matrices
        assert ((3 * n, 2 * r, 64), (3 * n, 64, 2 * r)) in many.products  # each Gram matrix from 3 blocks of rows
    # The same step the other way, from the same point, state and gradients: the same result.
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = CayleyAdam(twins, lr=0.02) if kind != "experts" else CayleyAdam([{"params": twins, "num_experts": 3}])
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(params, twins):
        q.grad = p.grad.clone()
    copies_forced(other, not staged).step()
    copies_forced(opt, staged).step()
    for p, q in zip(params, twins):
        for key in ("master", "exp_avg"):  # a bf16 lora_B's point is its fp32 master
            if key in opt.state[p]:
                torch.testing.assert_close(other.state[q][key], opt.state[p][key], rtol=0, atol=1e-6)
        ulp = torch.finfo(p.dtype).eps  # a bf16 master within 1e-6 rounds to the same value or to a neighbour
        torch.testing.assert_close(q, p, rtol=ulp, atol=1e-6)


class BatchedProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """The operand shapes of each batched matrix product run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.baddbmm):
            self.shapes.append(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "d, c, rows",
    [
        (24, 8, 24),
        (100, 8, 100),
        (512, 8, 512),
        (192, 8, 64),
        (1024, 8, 512),
        (3072, 8, 512),
        (14336, 8, 512),
        (11008, 8, 256),
        (1366, 8, 1366),  # an FSDP2 shard of 4096 rows over 3 ranks: no block of 64 rows divides it
        (4096, 256, 1024),  # r = 128: blocks of 4·2r rows, so the partial sums stay a quarter of P
        (768, 256, 768),
    ],
)
def test_the_staged_gram_matrices_are_summed_from_blocks_of_rows(d, c, rows):
    """The staged step's PᵀP is the sum of the products of P's blocks of rows (the largest power of two dividing d,
    up to 512 or 4c; all d rows where that is under 64 or 4c, or is d): the blocks are those, and the sum is the
    product of the whole matrices (fp64, against an einsum over all rows)."""
    from fora_plugin.optim.cayley_adam import gram_by_row_blocks

    P = torch.randn(3, d, c, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with BatchedProducts() as products:
        gram = gram_by_row_blocks(P)
    assert products.shapes == [((3 * (d // rows), c, rows), (3 * (d // rows), rows, c))]
    torch.testing.assert_close(gram, torch.einsum("ndi,ndj->nij", P, P), rtol=1e-12, atol=1e-12)


def test_the_step_follows_the_old_step():
    # fp64: both steps are exact, so they agree to rounding, through a periodic re-projection and a skipped step.
    Reference = reference_optimizer_class()
    shapes = [(40, 4), (40, 4), (16, 2)]
    params = stiefel_params(shapes, seed=52, dtype=torch.float64)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    old = Reference(params, lr=0.05, qr_period=4)
    new = CayleyAdam(twins, lr=0.05, qr_period=4)
    gen = torch.Generator().manual_seed(53)
    for step in range(11):  # crosses two periodic re-projections, and skips a non-finite gradient
        set_random_grads(params, gen)
        if step == 7:
            params[1].grad[3, 1] = float("nan")
        for p, q in zip(params, twins):
            q.grad = p.grad.clone()
        old.step()
        new.step()
        for p, q in zip(params, twins):
            assert torch.max(torch.abs(p.detach() - q.detach())) < 1e-12
            assert torch.max(torch.abs(old.state[p]["exp_avg"] - new.state[q]["exp_avg"])) < 1e-12
    for key in ("step", "skipped_steps", "exp_avg_sq"):
        assert [float(old.state[p][key]) for p in params] == pytest.approx([float(new.state[q][key]) for q in twins])
    # The step saves plain tensors of each parameter's own size.
    saved = new.state_dict()["state"]
    for index, q in enumerate(twins):
        exp_avg = saved[index]["exp_avg"]
        assert exp_avg.is_contiguous() and exp_avg.untyped_storage().nbytes() == q.numel() * 8


def test_a_parameter_without_a_gradient_or_replaced_storage_keeps_its_point_and_state():
    params = stiefel_params([(24, 3), (24, 3), (24, 3)], seed=54, dtype=torch.float64)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = CayleyAdam(params, lr=0.05)
    ref = reference_optimizer_class()(twins, lr=0.05)
    gen = torch.Generator().manual_seed(55)
    for step in range(6):
        set_random_grads(params, gen)
        if step == 2:
            params[0].grad = None  # not stepped: its point and state stay as they are
        if step == 4:
            with torch.no_grad():
                params[2].data = params[2].detach().clone()  # storage replaced from outside (e.g. .to())
        for p, q in zip(params, twins):
            q.grad = None if p.grad is None else p.grad.clone()
        opt.step()
        ref.step()
        for p, q in zip(params, twins):
            assert torch.max(torch.abs(p.detach() - q.detach())) < 1e-12
    assert [int(opt.state[p]["step"]) for p in params] == [5, 6, 6]


def new_stepped(kind):
    """A CayleyAdam (or FoRAOptimizer) after one step, and a function setting the next gradients."""
    gen = torch.Generator().manual_seed(56)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    params = stiefel_params([(32, 4), (32, 4), (12, 4)], seed=57, dtype=dtype)
    if kind == "experts":
        params.append(torch.nn.Parameter(interleave([random_stiefel(16, 2, generator=gen) for _ in range(3)])))
        groups = [{"params": params[:3]}, {"params": params[3:], "num_experts": 3}]
    else:
        groups = [{"params": params}]
    if kind == "fora":
        a = torch.nn.Parameter(torch.randn(4, 8, generator=gen))
        opt = FoRAOptimizer(
            [{"params": [a]}, {**groups[0], "stiefel": True}],
            adamw_defaults={"lr": 1e-2, "fused": True},
            stiefel_defaults={"lr": 0.05, "qr_period": 3},
        )
        params = params + [a]
    else:
        opt = CayleyAdam(groups, lr=0.05, qr_period=3)

    def set_grads():
        set_random_grads(params, gen)

    return opt, params, set_grads


@pytest.mark.parametrize("kind", ["cayley", "fora", "bf16", "experts"])
def test_steps_make_no_host_sync_first_later_skipped_or_reprojected(kind):
    from host_sync import HostSyncCounter

    opt, params, set_grads = new_stepped(kind)
    set_grads()
    with HostSyncCounter() as syncs:
        opt.step()  # the first: state made, points projected
    assert syncs.count == 0, syncs.report()
    for case in ("later", "skip", "drift", "periodic"):
        set_grads()
        if case == "skip":
            params[1].grad[0, 0] = float("inf")
        if case == "drift":
            point = opt.state[params[0]].get("master", params[0])  # a bf16 lora_B is its fp32 master, rounded
            with torch.no_grad():
                point.add_(0.05 * torch.randn_like(point))
        with HostSyncCounter() as syncs:
            opt.step()
        assert syncs.count == 0, f"{case}: {syncs.report()}"
    assert opt.skipped_steps() == 1 and opt.reprojections() >= 1  # the paths were taken
    assert opt.param_groups[-1]["steps"] % 3 == 2  # the periodic re-projection ran at step 3


def test_the_step_has_no_graph_break_under_dynamo():
    params = stiefel_params([(32, 4), (32, 4), (12, 4)], seed=58)
    opt = CayleyAdam(params, lr=0.05)
    gen = torch.Generator().manual_seed(59)
    set_random_grads(params, gen)
    opt.step()
    set_random_grads(params, gen)
    explanation = torch._dynamo.explain(opt.step)()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_state_tensors_are_contiguous_and_carry_the_whole_state():
    # What ZeRO-1/2's periodic broadcast sends: writing one optimizer's state tensors into another's makes them equal.
    gen = torch.Generator().manual_seed(60)
    shapes = [(24, 3), (24, 3), (10, 3)]
    runs = []
    for seed in (61, 62):
        low = [torch.nn.Parameter(p.detach().contiguous()) for p in stiefel_params([(24, 3)], seed, torch.bfloat16)]
        # Row-major, as PEFT's lora_B weights are; a bf16 lora_B sends its fp32 master too.
        params = [torch.nn.Parameter(p.detach().contiguous()) for p in stiefel_params(shapes, seed=seed)] + low
        opt = CayleyAdam(params, lr=0.05)
        for _ in range(2):
            set_random_grads(params, gen)
            opt.step()
        runs.append((params, opt))
    (src_params, src), (dst_params, dst) = runs
    sent, received = src.state_tensors(), dst.state_tensors()
    assert all(t.is_contiguous() for t in sent) and [t.shape for t in sent] == [t.shape for t in received]
    for s, r in zip(sent, received):
        r.copy_(s)
    for p, q in zip(src_params, dst_params):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if key in src.state[p]:
                assert torch.equal(src.state[p][key], dst.state[q][key])


def test_the_step_runs_on_fake_and_meta_tensors():
    # fora plan and the device-placement tests run the optimizer on tensors without data.
    from torch._subclasses.fake_tensor import FakeTensorMode

    for mode, device in ((FakeTensorMode(), "cpu"), (contextlib.nullcontext(), "meta")):
        with mode:
            params = [torch.nn.Parameter(torch.randn(64, 4, device=device)) for _ in range(3)]
            opt = CayleyAdam(params)
            for _ in range(2):
                for p in params:
                    p.grad = torch.randn(64, 4, device=device)
                opt.step()
            assert opt.state[params[0]]["exp_avg"].shape == (64, 4)


# ---- every lora_B owns its storage: what PyTorch, PEFT, Accelerate and safetensors assume --------------------------


def peft_llama(r=4, layers=(1, 3), dtype=torch.float32, **sizes):
    from conftest import TARGETS, tiny_llama
    from peft import LoraConfig, get_peft_model

    from fora_plugin import make_stiefel

    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, layers_to_transform=list(layers))
    model = get_peft_model(tiny_llama(num_layers=4, **sizes).train(), config).to(dtype)
    make_stiefel(model, generator=torch.Generator().manual_seed(0))
    return model


def token_batch(step, vocab=96):
    ids = torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(200 + step))
    return {"input_ids": ids, "labels": ids}


def lora_b(model):
    return [p for n, p in model.named_parameters() if "lora_B" in n]


def train(model, optimizer, steps, first=0):
    for step in range(first, first + steps):
        model(**token_batch(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_accelerate_save_state_keeps_every_lora_b_and_resumes_in_a_fresh_process(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors import safe_open

    script = Path(__file__).resolve().parent / "accelerate_resume.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parents[1])}
    logs = ""
    for mode in ("run", "resume"):
        result = subprocess.run(
            [sys.executable, str(script), mode, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-4000:]
        logs += result.stdout + result.stderr
    assert "Removed shared tensor" not in logs
    with safe_open(tmp_path / "checkpoint" / "model.safetensors", "pt") as saved:
        saved_lora_b = [key for key in saved.keys() if "lora_B" in key]
    assert len(saved_lora_b) == 10  # q, k, v, up, down on layers 1 and 3
    uninterrupted, resumed = torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "resume.pt")
    assert uninterrupted.keys() == resumed.keys()
    assert max((uninterrupted[k] - resumed[k]).abs().max().item() for k in uninterrupted) <= 1e-6


def test_safetensors_and_torch_save_write_the_adapter_and_nothing_else(tmp_path):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file, save_model

    model = peft_llama(r=8, hidden_size=64, intermediate_size=128)
    model.save_pretrained(tmp_path / "before", safe_serialization=False)  # plain parameters, no optimizer yet
    train(model, build_optimizer(model), steps=2)
    save_model(model, str(tmp_path / "model.safetensors"))
    whole = load_file(str(tmp_path / "model.safetensors"))
    named = dict(model.named_parameters())
    assert all(torch.equal(whole[name], p) for name, p in named.items() if "lora_B" in name)
    adapter = get_peft_model_state_dict(model)
    save_file(adapter, str(tmp_path / "adapter.safetensors"))
    loaded = load_file(str(tmp_path / "adapter.safetensors"))
    assert loaded.keys() == adapter.keys() and all(torch.equal(loaded[k], v) for k, v in adapter.items())
    # The size torch.save writes for standalone copies of the same tensors is the adapter's own size. (Same file
    # names: torch.save's archive names its records after the file.)
    for folder, tensors in (("live", adapter), ("standalone", {k: v.clone() for k, v in adapter.items()})):
        (tmp_path / folder).mkdir()
        torch.save(tensors, tmp_path / folder / "adapter.pt")
    size, standalone = ((tmp_path / folder / "adapter.pt").stat().st_size for folder in ("live", "standalone"))
    assert abs(size / standalone - 1) <= 0.01, (size, standalone)
    model.save_pretrained(tmp_path / "after", safe_serialization=False)
    before, after = ((tmp_path / name / "adapter_model.bin").stat().st_size for name in ("before", "after"))
    assert abs(after / before - 1) <= 0.01, (after, before)


def build_optimizer(model):
    from fora_plugin import build_fora_optimizer

    return build_fora_optimizer(model, lr=1e-2, lr_stiefel=5e-2)


@pytest.mark.parametrize("to", [torch.bfloat16, torch.float32])
def test_a_cast_after_a_step_is_kept_and_the_next_steps_stay_on_the_manifold(to):
    # bf16 after fp32 steps: lora_B stays bf16 with an fp32 master; fp32 after bf16 steps: lora_B is its own point.
    start = torch.float32 if to == torch.bfloat16 else torch.bfloat16
    model = peft_llama(dtype=start)
    optimizer = CayleyAdam(lora_b(model), lr=5e-2)
    train(model, optimizer, steps=1)
    model.to(to)
    train(model, optimizer, steps=3, first=1)  # the forward runs: every lora_B has the model's dtype
    for p in lora_b(model):
        assert p.dtype == to
        state = optimizer.state[p]
        assert ("master" in state) == (to == torch.bfloat16)
        assert orthogonality_error(state.get("master", p).float()) < 1e-3
        assert state["exp_avg"].dtype == torch.float32 and int(state["step"]) == 4
    if to == torch.float32:  # the master's precision came back with the cast, not bf16's
        assert max(orthogonality_error(p) for p in lora_b(model)) < 1e-5


def test_a_move_to_another_device_after_a_step_is_followed_by_the_state():
    # tests/fakegpu.py: after a step on the CPU, lora_B moves to the stand-in accelerator; 3 more steps there.
    from test_device_placement import run_fakegpu

    report = run_fakegpu("optimizer_moved_after_a_step")
    assert report["optimizer_moved_after_a_step"]["ok"], report["optimizer_moved_after_a_step"]["error"]


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_a_lora_b_loaded_in_place_mid_run_is_where_the_next_step_starts(kind):
    # lr 0 and no re-projection: the step leaves B where it starts, so B after it is the point it started from.
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    holder = torch.nn.ParameterList(stiefel_params([(32, 4), (32, 4), (12, 4)], seed=70, dtype=dtype))
    optimizer = CayleyAdam(list(holder), lr=5e-2)
    gen = torch.Generator().manual_seed(71)
    for _ in range(3):
        set_random_grads(list(holder), gen)
        optimizer.step()
    loaded = [p.to(dtype) for p in stiefel_params([(32, 4), (32, 4), (12, 4)], seed=72)]
    holder.load_state_dict({str(i): value for i, value in enumerate(loaded)})  # copies in place
    for group in optimizer.param_groups:
        group.update(lr=0.0, reproject_threshold=1e9)
    set_random_grads(list(holder), gen)
    optimizer.step()
    for p, value in zip(holder, loaded):
        point = optimizer.state[p].get("master", p).float()
        ulp = torch.finfo(dtype).eps * value.float().abs()  # one ulp of each loaded value (its spacing at 1: eps)
        assert torch.all((point - value.float()).abs() <= ulp), (point - value.float()).abs().max()
        assert torch.equal(p, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loaded_state_owns_its_storage_apart_from_the_state_dict_it_came_from(dtype):
    # b.load_state_dict(a.state_dict()): were b's moments or masters a's own tensors, each step of one would move the
    # other's state.
    gen = torch.Generator().manual_seed(71)
    source = stiefel_params([(16, 4), (16, 4)], seed=72, dtype=dtype)
    a = CayleyAdam(source, lr=0.01)
    set_random_grads(source, gen)
    a.step()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in source]
    b = CayleyAdam(twins, lr=0.01)
    b.load_state_dict(a.state_dict())
    for p, q in zip(source, twins):
        assert a.state[p].keys() == b.state[q].keys()
        for key, value in a.state[p].items():
            assert torch.equal(value, b.state[q][key]), key
            assert value.untyped_storage().data_ptr() != b.state[q][key].untyped_storage().data_ptr(), key


# ---- the step captured as a CUDA graph, replayed on the CPU by tests/graph_replay.py -------------------------------


@pytest.fixture
def captures(monkeypatch):
    """Lets the CPU capture a step as a CUDA graph does (tests/graph_replay.py); yields the list of captures made."""
    from graph_replay import capture

    from fora_plugin.optim import cayley_adam as module

    made = []

    def counted(run, device):
        made.append(device)
        return capture(run, device)

    monkeypatch.setitem(module.GRAPH_BACKENDS, "cpu", counted)
    return made


@pytest.mark.parametrize("implementation", ["per_matrix", "staged"])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "experts", "fora"])
def test_a_captured_step_is_the_eager_step(kind, implementation, captures):
    """20 steps, eager against captured and replayed (tests/capture_check.py, which bench/optimizer.py runs on a GPU):
    an lr that changes every step, a non-finite gradient on one matrix, periodic re-projection, a resume from a saved
    state and a cast of a lora_B after a step."""
    from capture_check import captured_against_eager
    from host_sync import HostSyncCounter

    result = captured_against_eager(
        kind, torch.device("cpu"), sync_counter=HostSyncCounter, implementation=implementation
    )
    assert result["dtypes_match"]
    assert result["max_param_diff"] <= 1e-6 and result["max_state_diff"] <= 1e-6, result
    assert result["skipped"] == (1, 1)
    assert result["syncs"] == 0
    # Each group captured after the warm-up and after the resume; the group of the cast lora_B after the cast too.
    assert len(captures) == (5 if kind == "experts" else 3), captures


@pytest.fixture(scope="module")
def previous_package():
    """fora_plugin before this step (a buffer per bucket), from git; skipped where git cannot give it."""
    from capture_check import package_at

    from fora_plugin import __version__  # noqa: F401  (the installed package first: the old one imports beside it)

    package = package_at("c19dc8c")
    if package is None:
        pytest.skip("git cannot give revision c19dc8c here (no git, or a shallow clone)")
    return package


@pytest.mark.parametrize("implementation", ["per_matrix", "staged"])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "experts", "fora"])
def test_each_implementation_equals_the_previous_step(kind, implementation, previous_package):
    """Every new path equals the step it replaces to 1e-6 (fp32) over the same 20 steps."""
    from capture_check import differences, run

    before = run(kind, torch.device("cpu"), package=previous_package)
    now = run(kind, torch.device("cpu"), options={"implementation": implementation})
    result = differences(before, now)
    assert result["dtypes_match"] and result["skipped"] == (1, 1)
    assert result["max_param_diff"] <= 1e-6 and result["max_state_diff"] <= 1e-6, result


def test_a_change_of_the_parameters_that_step_is_stepped_eagerly_then_captured(captures):
    """A parameter without a gradient at some steps: each change of the set is an eager step, then a new capture; a
    group whose set keeps changing steps eagerly, with a warning, after MAX_CAPTURES captures."""
    from capture_check import differences

    from fora_plugin.optim.cayley_adam import MAX_CAPTURES

    runs = []
    for cuda_graph in (False, True):
        params = stiefel_params([(24, 4), (24, 4), (12, 2)], seed=97)
        opt = CayleyAdam(params, lr=0.05, cuda_graph=cuda_graph)
        gen = torch.Generator().manual_seed(98)
        with pytest.warns(UserWarning, match="captured 8 times") if cuda_graph else contextlib.nullcontext():
            for step in range(30):
                set_random_grads(params, gen)
                if step >= 6 and step % 3 == 0:
                    params[2].grad = None
                opt.step()
        runs.append({"params": params, "optimizer": opt, "skipped": opt.skipped_steps()})
    result = differences(*runs)
    assert result["max_param_diff"] <= 1e-6 and result["max_state_diff"] <= 1e-6, result
    assert len(captures) == MAX_CAPTURES


def test_a_capture_is_refused_where_no_graph_can_be_made():
    # At construction, before any state is made: a step on the CPU cannot be captured.
    params = stiefel_params([(16, 2)], seed=95)
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match=r"cuda_graph=True is invalid for a group of 1 parameter\(s\) on \['cpu'\]"):
        CayleyAdam(params, cuda_graph=True)
    assert torch.equal(params[0], before)


def test_captured_by_default_where_possible_eager_elsewhere_and_true_refused_there(monkeypatch):
    from fora_plugin.optim import cayley_adam as module
    from fora_plugin.optim import resolve_cuda_graph

    cpu, meta = [torch.zeros(4, 2)], [torch.zeros(4, 2, device="meta")]
    assert resolve_cuda_graph(None, cpu) is False and resolve_cuda_graph(False, cpu) is False
    with pytest.raises(ValueError, match=r"cuda_graph=True is invalid for a group of 1 parameter\(s\) on \['cpu'\]"):
        resolve_cuda_graph(True, cpu)
    monkeypatch.setitem(module.GRAPH_BACKENDS, "meta", lambda run, device: run)
    assert resolve_cuda_graph(True, meta) is True and resolve_cuda_graph(None, meta) is True  # the default: captured
    assert resolve_cuda_graph(False, meta) is False
    assert resolve_cuda_graph(None, cpu + meta) is False  # unset: eager where it cannot be captured, not refused
    with pytest.raises(ValueError, match=r"on \['cpu', 'meta'\].*on one \['cuda', 'meta'\] device"):
        resolve_cuda_graph(True, cpu + meta)  # a group over two devices: its step cannot be one graph


def test_a_training_run_leaves_an_unset_cuda_graph_eager_under_a_data_parallel_engine(monkeypatch):
    from fora_plugin.optim import cayley_adam as module
    from fora_plugin.optim import default_cuda_graph, resolve_cuda_graph

    monkeypatch.setitem(module.GRAPH_BACKENDS, "meta", lambda run, device: run)
    meta = [torch.zeros(4, 2, device="meta")]
    table = {
        (asked, data_parallel): resolve_cuda_graph(default_cuda_graph(asked, data_parallel=data_parallel), meta)
        for asked in (None, True, False)
        for data_parallel in (False, True)
    }
    assert table == {
        (None, False): True,  # a single process: captured where it can be
        (None, True): False,  # DDP, DeepSpeed, FSDP2: eager until measured there
        (True, False): True,
        (True, True): True,  # asked for: captured
        (False, False): False,
        (False, True): False,
    }
    assert resolve_cuda_graph(None, []) is False and resolve_cuda_graph(True, []) is False  # an empty group


def test_an_unset_cuda_graph_captures_the_step_on_a_graph_backend(captures):
    """The default (None) takes the captured path where the device has a graph backend (here the CPU's stand-in),
    with the eager step's result; False stays eager."""
    from capture_check import differences

    runs = []
    for cuda_graph in (False, None):
        params = stiefel_params([(24, 4), (12, 2)], seed=91)
        opt = CayleyAdam(params, lr=0.05, cuda_graph=cuda_graph)
        gen = torch.Generator().manual_seed(92)
        for _ in range(6):
            set_random_grads(params, gen)
            opt.step()
        runs.append({"params": params, "optimizer": opt, "skipped": opt.skipped_steps()})
        assert len(captures) == (0 if cuda_graph is False else 1)
    result = differences(*runs)
    assert result["max_param_diff"] <= 1e-6 and result["max_state_diff"] <= 1e-6, result


def test_a_resume_keeps_how_this_run_steps(captures):
    """cuda_graph and implementation are this run's choice, not the checkpoint's: a state saved by a run that
    captured (None) resumed with False stays eager, one saved eager (False) resumed unset captures again, and the
    saved moments and counters come back either way."""
    gen = torch.Generator().manual_seed(81)
    for saved_graph, run_graph, captures_after in ((None, False, 0), (False, None, 1)):
        shapes = [(24, 4), (12, 2)]
        params = stiefel_params(shapes, seed=80)
        saved_by = CayleyAdam(params, lr=0.05, cuda_graph=saved_graph, implementation="per_matrix")
        for _ in range(4):
            set_random_grads(params, gen)
            saved_by.step()
        resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        resumed = CayleyAdam(resumed_params, lr=0.05, cuda_graph=run_graph, implementation="staged")
        resumed.load_state_dict(copy.deepcopy(saved_by.state_dict()))
        (group,) = resumed.param_groups
        assert (group["cuda_graph"], group["implementation"]) == (run_graph, "staged")
        assert group["steps"] == 4  # what the step computes does come from the checkpoint
        for p, q in zip(params, resumed_params):
            assert torch.equal(saved_by.state[p]["exp_avg"], resumed.state[q]["exp_avg"])
        captures.clear()
        for _ in range(4):
            set_random_grads(resumed_params, gen)
            resumed.step()
        assert len(captures) == captures_after, (saved_graph, run_graph)

    # The same for FoRA's optimizer, whose loader is torch's over all its groups.
    fora = two_group_fora_optimizer()
    saved = copy.deepcopy(fora.state_dict())
    (saved_stiefel,) = (group for group in saved["param_groups"] if group["stiefel"])
    saved_stiefel.update(cuda_graph=None, implementation="per_matrix")
    resumed = two_group_fora_optimizer()
    resumed.stiefel_groups[0].update(cuda_graph=False, implementation="staged")
    resumed.load_state_dict(saved)
    assert [(g["cuda_graph"], g["implementation"]) for g in resumed.stiefel_groups] == [(False, "staged")]


@pytest.mark.parametrize("value", [0, 1, 1.0, "true"])
def test_a_cuda_graph_setting_that_is_not_a_bool_is_refused(value):
    from fora_plugin import FoRAConfig

    with pytest.raises(TypeError, match=rf"cuda_graph={value!r} is invalid"):
        CayleyAdam(stiefel_params([(8, 2)]), cuda_graph=value)
    with pytest.raises(ValueError, match=rf"cuda_graph={value!r} is invalid"):
        FoRAConfig(cuda_graph=value)


class _LinalgCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """The linalg ops a step dispatches, each with whether the device's linear-algebra context was open then."""

    def __init__(self, inside: list[bool]) -> None:
        super().__init__()
        self.inside, self.calls = inside, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "linalg" in func.__name__ and "norm" not in func.__name__:
            self.calls.append((func.__name__, self.inside[-1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("implementation", ["per_matrix", "staged"])
@pytest.mark.parametrize("qr_period", [0, 1])  # the re-projection's Cholesky and triangular solve too
def test_the_steps_linear_algebra_runs_in_the_devices_context(monkeypatch, implementation, qr_period):
    # On CUDA that context puts torch's linear algebra on cuSOLVER: left to its heuristic torch factors a batch of more
    # than 16 small matrices with MAGMA, which syncs the host at each call. A CPU stand-in context records where the
    # step's Cholesky, LU and triangular solves run.
    from fora_plugin.optim import cayley_adam as module

    inside = [False]

    @contextlib.contextmanager
    def recording():
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setitem(module.LINEAR_ALGEBRA_CONTEXTS, "cpu", recording)
    params = stiefel_params([(24, 3)] * 20 + [(16, 3)], seed=70)
    opt = CayleyAdam(params, lr=0.05, qr_period=qr_period, implementation=implementation)
    gen = torch.Generator().manual_seed(71)
    for _ in range(2):  # the first step makes the state (a QR of each matrix, outside any step's algebra)
        set_random_grads(params, gen)
        with _LinalgCalls(inside) as mode:
            opt.step()
    names = {name for name, _ in mode.calls}
    assert {"linalg_cholesky_ex.default", "linalg_solve_triangular.default"} <= names, names
    assert any(name.startswith("linalg_lu_factor_ex") or name.startswith("_linalg_solve_ex") for name in names)
    assert all(opened for _, opened in mode.calls), mode.calls
    assert inside == [False]  # closed after the step


def test_the_cuda_linear_algebra_context_sets_cusolver_and_restores_the_choice(monkeypatch):
    from fora_plugin.optim import cayley_adam as module

    chosen, warned = ["default"], []
    module._first_cusolver_choice.cache_clear()  # a fresh process's first choice

    def preferred(backend=None):
        if backend is not None:
            chosen.append(backend)
            if backend != "default" and not warned:  # as torch's setter warns: once a process
                warned.append(backend)
                warnings.warn(
                    "torch.backends.cuda.preferred_linalg_library is an experimental feature. If you see any error "
                    "or unexpected behavior when this flag is set please file an issue on GitHub.",
                    UserWarning,
                    stacklevel=2,
                )
        return chosen[-1]

    monkeypatch.setattr(torch.backends.cuda, "preferred_linalg_library", preferred)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with module.LINEAR_ALGEBRA_CONTEXTS["cuda"]():
            assert chosen[-1] == "cusolver"
    assert chosen[-1] == "default"
    assert not caught, [str(w.message) for w in caught]  # FoRA's own choice is not the user's to be warned of
    chosen.append("magma")  # a user's own choice, kept also when the body raises
    with pytest.raises(RuntimeError, match="inside"), module.LINEAR_ALGEBRA_CONTEXTS["cuda"]():
        raise RuntimeError("inside")
    assert chosen[-1] == "magma"
    module._first_cusolver_choice.cache_clear()  # the stand-in setter made that choice, not torch's
