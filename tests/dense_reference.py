"""Dense d x d reference implementations, for tests only: slow, obvious, independent of fora_plugin's code."""

import torch


def dense_skew(B: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """The paper's Eq. "skew": W = Ŵ − Ŵᵀ, Ŵ = G Bᵀ − ½ B Bᵀ G Bᵀ, as a d x d matrix."""
    W_hat = G @ B.T - 0.5 * B @ B.T @ G @ B.T
    return W_hat - W_hat.T


def dense_cayley(B: torch.Tensor, G: torch.Tensor, tau: float) -> torch.Tensor:
    """(I + τ/2 W)⁻¹ (I − τ/2 W) B with a dense solve."""
    W = dense_skew(B, G)
    eye = torch.eye(B.shape[0], dtype=B.dtype)
    return torch.linalg.solve(eye + tau / 2 * W, (eye - tau / 2 * W) @ B)


def dense_cayley_adam(B: torch.Tensor, grads: list[torch.Tensor], lr: float, betas=(0.9, 0.99), eps=1e-8):
    """The paper's Appendix C Cayley-Adam, one matrix, dense: returns the trajectory of B."""
    beta1, beta2 = betas
    m = torch.zeros_like(B)
    v = torch.zeros((), dtype=B.dtype)
    trajectory = []
    for t, G in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * G
        v = beta2 * v + (1 - beta2) * torch.sum(G * G)
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        W = dense_skew(B, m_hat) / (v_hat.sqrt() + eps)
        eye = torch.eye(B.shape[0], dtype=B.dtype)
        B_next = torch.linalg.solve(eye + lr / 2 * W, (eye - lr / 2 * W) @ B)
        m = dense_skew(B, m) @ B_next  # the first moment, moved to the new point
        B = B_next
        trajectory.append(B)
    return trajectory
