"""Geometry of the Stiefel manifold St(d, r) = {B in R^{d x r} : BᵀB = I_r}.

May import: nothing of fora_plugin.
"""

from __future__ import annotations

import torch


__all__ = [
    "CAYLEY_SOLVERS",
    "cayley_coefficients",
    "cayley_span_step",
    "cayley_step",
    "cholesky_qr",
    "inverse_cholesky_factor",
    "orthogonality_error",
    "qr_retraction",
    "random_stiefel",
    "skew_generator",
    "tangent_projection",
]


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
    # Row-major like the lora_B weight it initialises (LAPACK's Q is column-major): a parameter made from it is laid
    # out as nn.Linear's, which the optimizer's multi-tensor copies need to run as one kernel.
    return qr_retraction(gaussian).to(dtype=dtype, device=device, memory_format=torch.contiguous_format)


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


def skew_generator(gram: torch.Tensor) -> torch.Tensor:
    """Ω (..., 2r, 2r) with W(G) [B, G] = [B, G] Ω, from ``gram`` = [B, G]ᵀ[B, G] (..., 2r, 2r) alone.

    W = U Bᵀ − B Uᵀ with U = G − ½ B S, S = BᵀG, is [B, G] K [B, G]ᵀ for the skew-symmetric
    K = [[A, −I], [I, 0]], A = ½(Sᵀ − S), so W [B, G] = [B, G] (K · gram). The span of [B, G] is invariant under W, and
    Ω is W acting on coordinates in it: every Cayley quantity is 2r x 2r algebra on Ω. With gram's block rows
    [top; bottom] (r x 2r each), K · gram = [A · top − bottom; top]: one r x r product.
    """
    r = gram.shape[-1] // 2
    top, bottom = gram[..., :r, :], gram[..., r:, :]  # (..., r, 2r)
    half_skew = 0.5 * (gram[..., r:, :r] - gram[..., :r, r:])  # A = ½(Sᵀ − S), (..., r, r)
    return torch.cat((half_skew @ top - bottom, top), dim=-2)


def cayley_span_step(
    omega: torch.Tensor,
    half_tau: torch.Tensor,
    *,
    solver: str = "exact",
    iters: int = 5,
    eye: torch.Tensor | None = None,
) -> torch.Tensor:
    """z (..., 2r, r) with (I + τ/2 W)⁻¹ (I − τ/2 W) B = B + [B, G] z, for Ω of :func:`skew_generator` and
    τ/2 = ``half_tau`` (...).

    The step itself, not the new point: z is small, and computing it directly keeps its relative precision (B + [B,
    G] z then drifts from the manifold several times less in fp32 than [B, G] (e_B + z) would).

    solver="exact": W maps the span of [B, G] into itself and I + τ/2 W is invertible (W is skew), so
        (I + τ/2 Ω) z = −τ Ω e_B: one 2r x 2r solve (the Sherman–Morrison–Woodbury reduction of Wen & Yin 2013,
        Lemma 4, written on the span). ``solve_ex``: no error check, which is a host sync on an accelerator; I + τ/2 Ω
        is similar to I + τ/2 (skew), so the check could never fire, and a non-finite input shows as a non-finite z.
    solver="fixed_point": the paper's iteration Y ← B − τ/2 W (B + Y) from Y⁰ = B − τ W B, ``iters`` times, with τ
        capped at 1/‖W‖_F so that it contracts (‖τ/2 W‖₂ ≤ ½), as the paper's reference code caps its step;
        ‖W‖_F² = tr(WᵀW) = −tr(Ω²). In z = Y − B: z ← −τ/2 W (2B + z) from z⁰ = −τ W B.

    ``eye``: the (2r, 2r) identity in Ω's dtype and device, if the caller keeps one.
    """
    if solver not in CAYLEY_SOLVERS:
        raise ValueError(f"cayley solver={solver!r} is not supported; use one of {CAYLEY_SOLVERS}.")
    if solver == "fixed_point" and iters < 1:
        raise ValueError(f"cayley_iters={iters} must be >= 1 for the fixed-point solver.")
    r = omega.shape[-1] // 2
    omega_b = omega[..., :r]  # (..., 2r, r): W B = [B, G] Ω e_B
    h = half_tau[..., None, None]
    if solver == "exact":
        if eye is None:
            eye = torch.eye(2 * r, dtype=omega.dtype, device=omega.device)
        core = torch.addcmul(eye, omega, h)  # I + τ/2 Ω
        # Solved as zᵀ (I + τ/2 Ω)ᵀ = rhsᵀ: the transposed row-major core is the column-major matrix LAPACK takes
        # (20% faster on a CPU, no copy).
        return torch.linalg.solve_ex(core.mT, (omega_b * h).mul_(-2).mT, left=False)[0].mT
    # ‖W‖_F². abs, not clamp_min(0): W = 0 sums to −0.0, which clamp keeps, and rsqrt(−0.0) = −inf would turn
    # τ into −inf and z into NaN; rounding's tiny negatives become tiny positives, whose cap is no cap either.
    w_norm_sq = (omega * omega.mT).sum(dim=(-2, -1)).abs_()
    h = torch.minimum(h, 0.5 * w_norm_sq.rsqrt()[..., None, None])  # τ <= 1/‖W‖_F (rsqrt(+0) = inf: no cap)
    z = omega_b * (-2 * h)  # −τ W B
    for _ in range(iters):
        z = (omega @ z).add_(omega_b, alpha=2.0).mul_(-h)  # −τ/2 W (2B + z)
    return z


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

    Every matrix involved lies in the span of [B, G] (:func:`skew_generator`), so the step needs the Gram matrix of
    [B, G] and 2r x 2r algebra: O(d·r² + r³), no d x d matrix. ``gram`` (..., 2r, 2r), if given, is used in place of
    BGᵀBG: for B and G sharded by rows, each shard passes its own rows as ``BG`` and the Gram matrix of the whole
    [B, G] (the sum of the shards' Grams); the coefficients are then those of the whole matrix, and ``BG @ P``
    gives the shard's rows of the result. ``solver`` as in :func:`cayley_span_step`.
    """
    if gram is None:
        gram = BG.mT @ BG  # (..., 2r, 2r): [[BᵀB, BᵀG], [GᵀB, GᵀG]], the only O(d·r²) product
    omega = skew_generator(gram)
    tau = torch.as_tensor(tau, dtype=BG.dtype, device=BG.device).expand(gram.shape[:-2])
    z = cayley_span_step(omega, tau / 2, solver=solver, iters=iters)  # (..., 2r, r)
    y = z + torch.eye(*z.shape[-2:], dtype=z.dtype, device=z.device)  # B_next = [B, G] y
    return torch.cat((y, omega @ y), dim=-1)


def cayley_step(
    B: torch.Tensor,
    G: torch.Tensor,
    tau: float | torch.Tensor,
    *,
    solver: str = "exact",
    iters: int = 5,
) -> torch.Tensor:
    """One Cayley retraction of ``B`` (..., d, r) along −W(G) B, the Riemannian gradient built from ``G``.

    The Cayley step follows Wen & Yin (2013), "A feasible method for optimization with orthogonality constraints":
    the skew-symmetric direction W = U Bᵀ − B Uᵀ has rank at most 2r, so W = L Rᵀ with L = [U, B] and R = [B, −U],
    and the Sherman–Morrison–Woodbury identity turns the d x d inverse of the Cayley transform into one 2r x 2r solve
    (their Lemma 4). No d x d matrix is ever built: every step costs O(d·r² + r³).

    Every function of this module takes a single matrix ``(d, r)`` or a stack ``(..., d, r)`` and works in the dtype
    it is given. The optimizer calls them in fp32 (fp64 in the tests): in bf16 the Gram matrices and the 2r x 2r
    solve lose orthogonality at the 1e-2 level within a few steps.
    """
    BG = torch.cat((B, G), dim=-1)  # (..., d, 2r)
    return BG @ cayley_coefficients(BG, tau, solver=solver, iters=iters)[..., : B.shape[-1]]
