"""Geometry of the Stiefel manifold St(d, r) = {B in R^{d x r} : BᵀB = I_r}.

Every function takes a single matrix ``(d, r)`` or a stack ``(..., d, r)`` and works in the dtype it is given. The
optimizer calls them in fp32 (fp64 in the tests): in bf16 the Gram matrices and the 2r x 2r solve lose
orthogonality at the 1e-2 level within a few steps.

The Cayley step follows Wen & Yin (2013), "A feasible method for optimization with orthogonality constraints": the
skew-symmetric direction W = U Bᵀ − B Uᵀ has rank at most 2r, so W = L Rᵀ with L = [U, B] and R = [B, −U], and
the Sherman–Morrison–Woodbury identity turns the d x d inverse of the Cayley transform into one 2r x 2r solve
(their Lemma 4). No d x d matrix is ever built: every step costs O(d·r² + r³).
"""

from __future__ import annotations

import torch


CAYLEY_SOLVERS = ("exact", "fixed_point")


def random_stiefel(
    d: int,
    r: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A random point of St(d, r): the sign-fixed Q factor of a standard Gaussian matrix.

    Fixing the signs (diag(R) > 0) makes the result a function of the Gaussian draw alone, so a seeded
    ``generator`` gives the same B on every platform, and the distribution is the uniform (Haar) one.
    The QR runs on the CPU in fp64 so that BᵀB = I holds to ~1e-15 before the cast to ``dtype``.
    """
    if r < 1 or d < r:
        raise ValueError(
            f"random_stiefel needs 1 <= r <= d, got d={d}, r={r}: a d x r matrix has at most d orthonormal columns."
        )
    gaussian = torch.randn(d, r, generator=generator, dtype=torch.float64)  # (d, r)
    return qr_retraction(gaussian).to(dtype=dtype, device=device)


def qr_retraction(B: torch.Tensor) -> torch.Tensor:
    """Project ``B`` (..., d, r) of full column rank onto St(d, r): the thin-QR factor Q with diag(R) >= 0."""
    Q, R = torch.linalg.qr(B, mode="reduced")  # (..., d, r), (..., r, r)
    signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))  # (..., r)
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return Q * signs.unsqueeze(-2)


def cholesky_qr(B: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Project ``B`` onto the manifold from its Gram matrix: B R⁻¹ with R the Cholesky factor of ``gram`` = BᵀB.

    ``B`` (..., d_local, r) may be a block of rows of the whole matrix (a shard) and ``gram`` (..., r, r) the Gram
    matrix of the whole one, summed over the shards by the caller: every shard then gets its rows of the same Q.
    R has a positive diagonal, so Q is :func:`qr_retraction`'s sign-fixed factor. Its orthogonality error grows like
    κ(B)² · eps (Cholesky-QR is not backward stable): for a point near the manifold (κ ≈ 1) that is rounding level;
    for a far one, apply it twice (Cholesky-QR2, with the Gram of the first result).
    """
    L, info = torch.linalg.cholesky_ex(gram)  # (..., r, r) lower, gram = L Lᵀ
    if torch.any(info != 0):
        raise ValueError(
            "cholesky_qr: the Gram matrix BᵀB is not positive definite, so B has (numerically) dependent columns "
            "and no orthonormal basis of the same span: re-initialise it, e.g. with random_stiefel."
        )
    return torch.linalg.solve_triangular(L.mT, B, upper=True, left=False)  # (..., d_local, r): B R⁻¹, R = Lᵀ


def inverse_cholesky_factor(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R⁻¹ (..., r, r) with RᵀR = ``gram`` (R upper, positive diagonal), so that B R⁻¹ is :func:`cholesky_qr` of B.

    No error and no host sync: where ``gram`` is not positive definite the factor is the identity and ``ok``
    (a bool per matrix, shape (...)) is False.
    """
    L, info = torch.linalg.cholesky_ex(gram)  # (..., r, r)
    ok = info == 0
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device).expand_as(gram)
    L = torch.where(ok[..., None, None], L, eye)
    return torch.linalg.solve_triangular(L.mT, eye, upper=True), ok  # R⁻¹ = (Lᵀ)⁻¹


def orthogonality_error(B: torch.Tensor) -> torch.Tensor:
    """Drift from the manifold, ‖BᵀB − I‖_F, one value per matrix of the stack (..., d, r) -> (...)."""
    r = B.shape[-1]
    gram = B.mT @ B  # (..., r, r)
    eye = torch.eye(r, dtype=B.dtype, device=B.device)
    return torch.linalg.matrix_norm(gram - eye)


def tangent_projection(B: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Project a Euclidean gradient ``G`` onto the tangent space at ``B``: G − B sym(BᵀG), shape (..., d, r).

    For B on the manifold this equals W B, W = U Bᵀ − B Uᵀ, U = G − ½ B BᵀG (the paper's Eq. "riem_grad_skew").
    """
    BtG = B.mT @ G  # (..., r, r)
    return G - B @ (0.5 * (BtG + BtG.mT))


def _as_batched_scalar(tau: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    tau = torch.as_tensor(tau, dtype=like.dtype, device=like.device)
    return tau.reshape(*tau.shape, 1, 1)


def cayley_coefficients(
    BG: torch.Tensor,
    tau: float | torch.Tensor,
    *,
    gram: torch.Tensor | None = None,
    solver: str = "exact",
    iters: int = 5,
) -> torch.Tensor:
    """The Cayley step of B along W(G) as a 2r x 2r matrix P: [B_next, W(G) B_next] = [B, G] P.

    ``BG`` is [B, G] packed side by side, (..., d, 2r); P is (..., 2r, 2r). B_next = Q B with
    Q = (I + τ/2 W)⁻¹ (I − τ/2 W), which is orthogonal, so B_next stays on the manifold; to first order
    B_next = B − τ W B, a descent step along the Riemannian gradient W B. W(G) B_next is the direction carried to the
    new point (what the optimizer keeps as its first moment). ``tau`` is a float or one step size per matrix (shape
    ``(...)``); τ = 0 leaves B where it is.

    Every matrix involved lies in the span of [B, G]: W = L Rᵀ with L = [B, G] C_L and R = [B, G] C_R for 2r x 2r
    coefficient matrices (U = G − ½ B S, S = BᵀG, L = [U, B], R = [B, −U]). So the step needs the Gram matrix of
    [B, G] and 2r x 2r algebra: O(d·r² + r³), no d x d matrix.

    ``gram`` (..., 2r, 2r), if given, is used in place of BGᵀBG: for B and G sharded by rows, each shard passes its
    own rows as ``BG`` and the Gram matrix of the whole [B, G] (the sum of the shards' Grams); the coefficients are
    then those of the whole matrix, and ``BG @ P`` gives the shard's rows of the result.

    solver="exact": Sherman–Morrison–Woodbury, (I + τ/2 L Rᵀ)⁻¹ = I − τ/2 L (I + τ/2 RᵀL)⁻¹ Rᵀ, which gives
        B_next = B − τ L (I + τ/2 RᵀL)⁻¹ RᵀB (Wen & Yin 2013, Lemma 4): one 2r x 2r solve, exact up to rounding.
    solver="fixed_point": the paper's iteration Y ← B − τ/2 W (B + Y) from Y⁰ = B − τ W B, ``iters`` times. To keep it
        contracting (‖τ/2 W‖₂ ≤ ½), τ is capped at 1/‖W‖_F, as the paper's reference code caps its step.
    """
    if solver not in CAYLEY_SOLVERS:
        raise ValueError(f"cayley solver={solver!r} is not supported; use one of {CAYLEY_SOLVERS}.")
    if solver == "fixed_point" and iters < 1:
        raise ValueError(f"cayley_iters={iters} must be >= 1 for the fixed-point solver.")
    r = BG.shape[-1] // 2
    if gram is None:
        gram = BG.mT @ BG  # (..., 2r, 2r): [[BᵀB, BᵀG], [GᵀB, GᵀG]], the only O(d·r²) product
    S = gram[..., :r, r:]  # (..., r, r) BᵀG
    eye_r = torch.eye(r, dtype=BG.dtype, device=BG.device).expand_as(S)
    zero_r = torch.zeros_like(S)
    c_l = torch.cat((torch.cat((-0.5 * S, eye_r), -1), torch.cat((eye_r, zero_r), -1)), -2)  # L = [B, G] c_l
    c_r = torch.cat((torch.cat((eye_r, 0.5 * S), -1), torch.cat((zero_r, -eye_r), -1)), -2)  # R = [B, G] c_r
    rt_basis = c_r.mT @ gram  # (..., 2r, 2r): Rᵀ [B, G]

    def w_times(coef: torch.Tensor) -> torch.Tensor:  # W ([B, G] coef) = [B, G] (c_l Rᵀ[B, G] coef)
        return c_l @ (rt_basis @ coef)

    e_b = torch.cat((eye_r, zero_r), -2)  # (..., 2r, r): B = [B, G] e_b
    tau = _as_batched_scalar(tau, BG)
    if solver == "exact":
        core = torch.eye(2 * r, dtype=BG.dtype, device=BG.device) + (tau / 2) * (rt_basis @ c_l)  # I + τ/2 RᵀL
        # solve_ex: I + τ/2 W is invertible for skew W (eigenvalues 1 + iλ), so solve's error check, a host sync
        # on an accelerator, never fires; a non-finite input shows as a non-finite B, which the optimizer skips.
        b_next = e_b - tau * (c_l @ torch.linalg.solve_ex(core, rt_basis @ e_b)[0])  # (..., 2r, r)
    else:
        lt_l = c_l.mT @ gram @ c_l
        rt_r = c_r.mT @ gram @ c_r
        w_norm = (lt_l * rt_r).sum(dim=(-2, -1), keepdim=True).clamp_min(0).sqrt()  # ‖L Rᵀ‖_F
        tau = torch.minimum(tau, 1.0 / w_norm.clamp_min(torch.finfo(BG.dtype).tiny))
        b_next = e_b - tau * w_times(e_b)
        for _ in range(iters):
            b_next = e_b - (tau / 2) * w_times(e_b + b_next)
    return torch.cat((b_next, w_times(b_next)), dim=-1)


def cayley_step(
    B: torch.Tensor,
    G: torch.Tensor,
    tau: float | torch.Tensor,
    *,
    solver: str = "exact",
    iters: int = 5,
) -> torch.Tensor:
    """One Cayley retraction of ``B`` (..., d, r) along −W(G) B, the Riemannian gradient built from ``G``."""
    BG = torch.cat((B, G), dim=-1)  # (..., d, 2r)
    return BG @ cayley_coefficients(BG, tau, solver=solver, iters=iters)[..., : B.shape[-1]]
