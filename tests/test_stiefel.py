"""The Stiefel math against dense d x d references in float64."""

import pytest
import torch
from dense_reference import dense_cayley, dense_skew

from fora_plugin.stiefel import (
    CAYLEY_SOLVERS,
    cayley_coefficients,
    cayley_step,
    orthogonality_error,
    qr_retraction,
    random_stiefel,
    tangent_projection,
)


F64 = torch.float64


def point_and_gradient(d: int, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return random_stiefel(d, r, generator=gen, dtype=F64), torch.randn(d, r, generator=gen, dtype=F64)


def test_random_stiefel_is_orthonormal_seeded_and_sign_fixed():
    B = random_stiefel(64, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    assert orthogonality_error(B) < 1e-13
    again = random_stiefel(64, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    assert torch.equal(B, again)
    assert torch.allclose(qr_retraction(B), B, atol=1e-14)  # the sign-fixed projection is idempotent


def test_qr_retraction_is_the_unique_factor_with_positive_r_diagonal():
    X = torch.randn(40, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    Q = qr_retraction(X)
    R = Q.T @ X  # X = Q R
    assert torch.allclose(Q @ R, X, atol=1e-12)
    assert torch.allclose(R, torch.triu(R), atol=1e-12)
    assert torch.all(torch.diagonal(R) > 0)


def test_random_stiefel_refuses_more_columns_than_rows():
    with pytest.raises(ValueError, match=r"d=3, r=5"):
        random_stiefel(3, 5)


def test_qr_retraction_projects_onto_the_manifold_and_keeps_the_span():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(3, 50, 6, generator=gen, dtype=F64)  # a stack of 3 matrices
    Q = qr_retraction(X)
    assert torch.all(orthogonality_error(Q) < 1e-13)
    # Same column span: projecting X onto span(Q) gives X back.
    assert torch.allclose(Q @ (Q.mT @ X), X, atol=1e-12)


def test_orthogonality_error_matches_dense_definition():
    X = torch.randn(30, 4, dtype=F64)
    expected = torch.linalg.norm(X.T @ X - torch.eye(4, dtype=F64), "fro")
    assert torch.isclose(orthogonality_error(X), expected, rtol=1e-12)


@pytest.mark.parametrize(("d", "r", "tau"), [(12, 3, 0.1), (40, 5, 0.7), (33, 33, 0.05), (64, 8, 3.0)])
def test_exact_cayley_step_equals_dense_formula(d, r, tau):
    B, G = point_and_gradient(d, r, seed=d + r)
    ours = cayley_step(B, G, tau)
    assert torch.max(torch.abs(ours - dense_cayley(B, G, tau))) < 1e-10
    assert orthogonality_error(ours) < 1e-12


def test_cayley_transform_accepts_one_step_size_per_matrix_of_a_stack():
    pairs = [point_and_gradient(20, 4, seed=s) for s in range(3)]
    B = torch.stack([b for b, _ in pairs])
    G = torch.stack([g for _, g in pairs])
    taus = torch.tensor([0.0, 0.2, 1.5], dtype=F64)
    out = cayley_step(B, G, taus)
    assert torch.equal(out[0], B[0])  # tau = 0 leaves the point exactly where it is
    for i in (1, 2):
        assert torch.max(torch.abs(out[i] - dense_cayley(B[i], G[i], taus[i].item()))) < 1e-10


def test_fixed_point_solver_converges_to_the_exact_step():
    B, G = point_and_gradient(40, 5, seed=1)
    tau = 0.02  # ‖τ/2 W‖ ≈ 0.2 < 1: the iteration contracts
    exact = dense_cayley(B, G, tau)
    errors = [
        torch.max(torch.abs(cayley_step(B, G, tau, solver="fixed_point", iters=k) - exact)).item()
        for k in (1, 3, 10, 30)
    ]
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < 1e-12


def test_unknown_solver_and_bad_iteration_count_are_refused():
    B, G = point_and_gradient(10, 2, seed=0)
    with pytest.raises(ValueError, match=r"solver='newton'.*\('exact', 'fixed_point'\)"):
        cayley_step(B, G, 0.1, solver="newton")
    with pytest.raises(ValueError, match=r"cayley_iters=0"):
        cayley_step(B, G, 0.1, solver="fixed_point", iters=0)


def test_tangent_projection_equals_skew_times_point_and_is_tangent():
    B, G = point_and_gradient(30, 4, seed=2)
    xi = tangent_projection(B, G)
    assert torch.allclose(xi, dense_skew(B, G) @ B, atol=1e-12)
    BtXi = B.T @ xi
    assert torch.allclose(BtXi, -BtXi.T, atol=1e-12)  # tangent: Bᵀξ is skew
    assert torch.allclose(tangent_projection(B, xi), xi, atol=1e-12)  # a projection


def test_coefficients_give_the_new_point_and_the_direction_carried_to_it():
    B, G = point_and_gradient(25, 3, seed=4)
    BG = torch.cat((B, G), dim=-1)
    out = BG @ cayley_coefficients(BG, 0.3)
    B_next = dense_cayley(B, G, 0.3)
    assert torch.allclose(out[:, :3], B_next, atol=1e-12)
    assert torch.allclose(out[:, 3:], dense_skew(B, G) @ B_next, atol=1e-12)


def test_fixed_point_caps_its_step_so_that_it_contracts():
    B, G = point_and_gradient(40, 5, seed=1)
    tau = 0.3  # ‖τ/2 W‖ ≈ 3: uncapped, the iteration diverges
    B_next = cayley_step(B, G, tau, solver="fixed_point", iters=50)
    capped_tau = 1 / torch.linalg.norm(dense_skew(B, G), "fro").item()
    assert torch.allclose(B_next, dense_cayley(B, G, capped_tau), atol=1e-10)


@pytest.mark.parametrize("solver", CAYLEY_SOLVERS)
def test_a_zero_gradient_leaves_the_point_where_it_is(solver):
    # W = 0 sums ‖W‖_F² to −0.0; the fixed-point cap once took rsqrt of it (−inf) and returned NaN.
    B, _ = point_and_gradient(20, 4, seed=6)
    for dtype in (F64, torch.float32):
        point = B.to(dtype)
        assert torch.equal(cayley_step(point, torch.zeros_like(point), 0.1, solver=solver), point)


def test_small_cayley_step_descends_a_smooth_loss():
    gen = torch.Generator().manual_seed(5)
    d, r = 30, 4
    S = torch.randn(d, d, generator=gen, dtype=F64)
    S = S + S.T
    B = random_stiefel(d, r, generator=gen, dtype=F64)

    def loss(X):  # f(B) = tr(Bᵀ S B), gradient 2 S B
        return torch.trace(X.T @ S @ X)

    for tau in (1e-2, 1e-3, 1e-4):
        B_next = cayley_step(B, 2 * S @ B, tau)
        decrease = loss(B) - loss(B_next)
        # First-order prediction: τ ‖grad_R‖², with the Riemannian gradient grad_R = W B.
        predicted = tau * torch.sum(tangent_projection(B, 2 * S @ B) ** 2)
        assert decrease > 0
        assert torch.isclose(decrease, predicted, rtol=10 * tau)


def test_cayley_step_never_builds_a_d_by_d_matrix():
    # A d x d fp32 matrix for d = 200 000 needs 160 GB; the step on a (d, 4) point needs a few MB.
    d, r = 200_000, 4
    gen = torch.Generator().manual_seed(0)
    B = qr_retraction(torch.randn(d, r, generator=gen))
    G = torch.randn(d, r, generator=gen)
    for solver in ("exact", "fixed_point"):
        out = cayley_step(B, G, 1e-3, solver=solver)
        assert out.shape == (d, r)
    assert orthogonality_error(cayley_step(B, G, 1e-3)) < 1e-4
