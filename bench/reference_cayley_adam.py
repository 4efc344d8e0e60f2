"""Cayley-Adam's step as it was before the stacked storage (fora-plugin main at 294dfd8), kept as the bench's
reference: each step copies B, m and G of a shape bucket into scratch buffers, runs the Woodbury solve of Wen & Yin
(2013) on [B, G] with eye/cat/where chains, and copies B and m back. Not part of the package: `bench/optimizer.py`
times it beside today's step, and `tests/test_optim.py` checks that optimizer state saved by it still loads.

The code below is the old `fora_plugin/optim.py` step and `fora_plugin/stiefel.py` coefficients, verbatim except for
the names; the helpers it shares with today's optimizer (state initialisation, bucket keys, DTensor locals, the
inverse Cholesky factor) are imported from `fora_plugin.optim.cayley_adam` and `fora_plugin.stiefel`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from fora_plugin.adapter import expert_blocks
from fora_plugin.optim.cayley_adam import REPROJECT_THRESHOLD, CayleyAdam, bucket_key, init_cayley_adam_state
from fora_plugin.optim.dtensor import all_reduce_sum, local_gradient, local_rows, reduce_groups
from fora_plugin.stiefel import CAYLEY_SOLVERS, inverse_cholesky_factor


class ReferenceCayleyAdam(CayleyAdam):
    """CayleyAdam with the old step: same hyperparameters, state layout and checks."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            reference_group_step(self.state, group)
        return loss

    def state_dict(self) -> dict[str, Any]:
        return torch.optim.Optimizer.state_dict(self)


def _as_batched_scalar(tau: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    tau = torch.as_tensor(tau, dtype=like.dtype, device=like.device)
    return tau.reshape(*tau.shape, 1, 1)


def reference_cayley_coefficients(
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


def reference_group_step(
    state: dict[torch.Tensor, dict[str, Any]],
    group: dict[str, Any],
    grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    group["steps"] += 1
    num_experts = group.get("num_experts", 1)  # a group saved before per-expert blocks existed has no key
    period = group["qr_period"]
    periodic = period > 0 and group["steps"] % period == 0
    # Buckets by the whole matrix's shape and layout, which every rank sees alike: the all-reduces of a sharded
    # bucket then pair up across ranks even where the local row counts differ.
    buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for p in group["params"]:
        grad = p.grad if grads is None else grads.get(p)
        if grad is None:
            continue
        if grad.is_sparse:
            raise TypeError("CayleyAdam does not support sparse gradients.")
        if not state[p]:
            init_cayley_adam_state(state[p], p, num_experts)
        if "reprojections" not in state[p]:  # a state saved before the counter existed
            state[p]["reprojections"] = torch.zeros_like(state[p]["skipped_steps"])
        buckets[bucket_key(p)].append((p, local_gradient(p, grad)))
    for members in buckets.values():
        params = [p for p, _ in members]
        reference_bucket_step(state, params, [g for _, g in members], group, periodic, reduce_groups(params[0]))


def reference_bucket_step(
    state: dict[torch.Tensor, dict[str, Any]],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    group: dict[str, Any],
    periodic: bool,
    reduce_groups: tuple,
) -> None:
    """One Cayley-Adam step for n matrices of one shape, stacked: a fixed number of kernels whatever n is.

    Works on the local rows of each matrix; a sum over rows is all-reduced over ``reduce_groups`` (none for
    plain tensors), once per bucket.
    """
    beta1, beta2 = group["betas"]
    num_experts = group.get("num_experts", 1)
    states = [state[p] for p in params]
    masters = [local_rows(s.get("master", p)) for p, s in zip(params, states)]  # (d_local, r·E) each
    exp_avgs = [local_rows(s["exp_avg"]) for s in states]
    d, r = masters[0].shape[0], masters[0].shape[1] // num_experts
    n = len(params) * num_experts
    dtype, device = exp_avgs[0].dtype, exp_avgs[0].device
    sharded = bool(reduce_groups)
    # B and m side by side in one scratch buffer: the step reads [B, m_{t+1}] as a whole, with no extra copy. The
    # second buffer holds G, or under sharding m_t: there a skip (a non-finite ‖G‖² on any rank) is only known
    # after the all-reduce, so m_{t+1} is formed for every matrix and m_t kept for the skipped ones.
    BM = torch.empty((n, d, 2 * r), dtype=dtype, device=device)  # (n, d, 2r)
    B, m = BM[..., :r], BM[..., r:]  # (n, d, r) views
    other = torch.empty((n, d, r), dtype=dtype, device=device)
    G, m_old = (m, other) if sharded else (other, m)

    # One (E, d, r) view of the stack per parameter and the matching (E, d, r) view of each parameter's tensor.
    # With E = 1, plain (d, r) matrices: torch._foreach_copy_ then takes its fast path (2x faster on CPU).
    def blocks(stack: torch.Tensor) -> list[torch.Tensor]:
        return list(stack.unbind(0) if num_experts == 1 else stack.split(num_experts))

    def expert_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return tensors if num_experts == 1 else [expert_blocks(t, num_experts) for t in tensors]

    torch._foreach_copy_(blocks(B), expert_views(masters))
    torch._foreach_copy_(blocks(m_old), expert_views(exp_avgs))
    torch._foreach_copy_(blocks(G), expert_views(grads))  # in the compute dtype
    scalar_shape = () if num_experts == 1 else (num_experts,)

    def stacked(key: str) -> torch.Tensor:  # (n,)
        return torch.stack([s[key] for s in states]).reshape(n)

    v, step, skipped, reprojected = (stacked(k) for k in ("exp_avg_sq", "step", "skipped_steps", "reprojections"))

    grad_sq = G.square().sum(dim=(-2, -1))  # (n,) ‖G‖² of the local rows: inf/nan iff some entry is (or overflow)
    finite = torch.isfinite(grad_sq)
    G.masked_fill_(~finite[:, None, None], 0.0)  # keeps the Gram matrices finite
    if sharded:
        m.lerp_(m_old, beta1)  # m_{t+1} = β1 m_t + (1 − β1) G
    else:
        m.lerp_(G, (1 - beta1) * finite.to(dtype)[:, None, None])  # a skipped matrix keeps m_t bit for bit
    gram = BM.mT @ BM  # (n, 2r, 2r), the only O(d·r²) product: [[BᵀB, Bᵀm], [mᵀB, mᵀm]] of the local rows
    if sharded:
        sums = torch.cat((gram.reshape(n, -1), grad_sq[:, None]), dim=1)  # (n, 4r² + 1): one all-reduce
        all_reduce_sum(sums, reduce_groups)
        gram, grad_sq = sums[:, :-1].reshape(n, 2 * r, 2 * r), sums[:, -1]
        finite = torch.isfinite(grad_sq)  # (n,) the same on every rank

    live = finite.to(dtype)  # (n,) 1 = step, 0 = skip
    step += live
    skipped += (~finite).long()
    v.lerp_(torch.where(finite, grad_sq, 0.0), (1 - beta2) * live)

    # Re-projection by Cholesky-QR of B (B R⁻¹, RᵀR = BᵀB) before the step, folded into the coefficients: with
    # T = diag(R⁻¹, I), [B R⁻¹, m] = [B, m] T and its Gram matrix is Tᵀ gram T. No host sync, no extra reduction.
    eye_r = torch.eye(r, dtype=dtype, device=device)
    drift = torch.linalg.matrix_norm(gram[:, :r, :r] - eye_r)  # (n,) ‖BᵀB − I‖_F
    drifting = drift > group.get("reproject_threshold", REPROJECT_THRESHOLD)  # absent from older checkpoints
    r_inv, factored = inverse_cholesky_factor(gram[:, :r, :r])  # (n, r, r)
    project = (drifting | periodic) & factored & finite
    reprojected += (drifting & factored & finite).long()
    T = torch.eye(2 * r, dtype=dtype, device=device).repeat(n, 1, 1)  # (n, 2r, 2r)
    T[:, :r, :r] = torch.where(project[:, None, None], r_inv, eye_r)
    gram = T.mT @ gram @ T

    # W is linear in m, so the bias-corrected W(m̂)/(√v̂ + ε) step of size lr is a step of size tau along W(m).
    t = step.to(dtype).clamp_min(1.0)
    bias1, bias2 = 1 - beta1**t, 1 - beta2**t
    denominator = bias1 * ((v / bias2).sqrt() + group["eps"])  # (n,) 0 only if v = 0 and eps = 0
    # v = 0 means every gradient so far was 0 (so m = 0): no move, rather than 0/0 = NaN when eps = 0.
    tau = torch.where(denominator > 0, live * group["lr"] / denominator.clamp_min(torch.finfo(dtype).tiny), 0.0)
    solver, iters = group["cayley_solver"], group["cayley_iters"]
    coef = T @ reference_cayley_coefficients(BM, tau, gram=gram, solver=solver, iters=iters)
    # Applied as B + [B, m] (P_B − e_B): adding a small step to B keeps ~10x less drift than forming [B, m] P_B.
    e_b = torch.eye(2 * r, r, dtype=dtype, device=device)  # (2r, r): B = [B, m] e_b
    # A skipped matrix gets a zero step and keeps m: products with exact 0 and 1 reproduce both bit for bit.
    e_m = torch.eye(2 * r, dtype=dtype, device=device)[:, r:]  # (2r, r): m = [B, m] e_m
    coef = torch.where(finite[:, None, None], coef - torch.cat((e_b, 0 * e_b), -1), torch.cat((0 * e_b, e_m), -1))
    out = BM @ coef  # (n, d, 2r): [B_{t+1} − B_t, W(m) B_{t+1}]
    # The first moment becomes W(m) B_{t+1}: its tangent part, carried to the new point.
    B_next = B + out[..., :r]
    m_next = torch.where(finite[:, None, None], out[..., r:], m_old) if sharded else out[..., r:]

    torch._foreach_copy_(expert_views(masters), blocks(B_next))
    low_precision = [(local_rows(p), b) for p, s, b in zip(params, states, masters) if "master" in s]
    if low_precision:
        torch._foreach_copy_([p for p, _ in low_precision], [b for _, b in low_precision])
    torch._foreach_copy_(expert_views(exp_avgs), blocks(m_next))
    for key, values in (("exp_avg_sq", v), ("step", step), ("skipped_steps", skipped), ("reprojections", reprojected)):
        torch._foreach_copy_([s[key] for s in states], list(values.view(len(params), *scalar_shape).unbind(0)))
