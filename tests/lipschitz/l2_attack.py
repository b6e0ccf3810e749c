"""An adversary for Lipschitz certificates of maps on N x d token matrices (test helper).

Independent of ``transcover.lipschitz._empirical``: float64 throughout, and three searches whose
best value is an attained lower bound on the true constant in the chosen metric:

* Jacobian ascent: Adam on ``sigma_max(J(X))`` (Frobenius) over X, the full Jacobian formed by
  ``torch.autograd.functional.jacobian``, its norm an exact SVD;
* Jacobian power iteration: for ``(2,inf)``, the alternating row-block iteration (maximise
  ``||(J V)_i||`` over unit-row V, monotone) at the best X;
* pair ascent: Adam on ``||F(X) - F(Y)|| / ||X - Y||`` from restarts, some seeded at the best X
  with Y = X + a small step along the top singular direction, some far apart.

Every start is drawn at several input scales, since a map like L2 attention is steepest where the
scores are of order one, whatever the weights' scale.
"""

from __future__ import annotations

import torch
from torch.autograd.functional import jacobian


def metric_norm(Z: torch.Tensor, metric: str) -> torch.Tensor:
    """``||Z||_F`` or ``max_t ||z_t||_2`` of an ``(N, d)`` matrix."""
    return Z.norm() if metric == "fro" else Z.norm(dim=-1).max()


def full_jacobian(fn, X: torch.Tensor, create_graph: bool = False) -> torch.Tensor:
    """``(N d, N d)`` Jacobian of the flattened map at X."""
    N, d = X.shape
    return jacobian(lambda x: fn(x.reshape(N, d)).reshape(-1), X.reshape(-1), create_graph=create_graph,
                    vectorize=True)


def jacobian_2inf(J: torch.Tensor, N: int, d: int, g: torch.Generator, iters: int = 30) -> float:
    """Attained lower bound on the ``(2,inf) -> (2,inf)`` operator norm of J: for each output row
    i, alternate ``y = J_i V / ||J_i V||`` and ``v_j = J_ij^T y / ||J_ij^T y||`` (monotone)."""
    blocks = J.reshape(N, d, N, d)
    best = 0.0
    for i in range(N):
        V = torch.randn(N, d, generator=g, dtype=J.dtype)
        V = V / V.norm(dim=-1, keepdim=True)
        for _ in range(iters):
            y = torch.einsum("ajb,jb->a", blocks[i], V)
            val = float(y.norm())
            best = max(best, val)
            if val == 0:
                break
            W = torch.einsum("ajb,a->jb", blocks[i], y / y.norm())
            n = W.norm(dim=-1, keepdim=True)
            V = torch.where(n > 0, W / n.clamp_min(1e-300), V)
    return best


def jacobian_norm(fn, X: torch.Tensor, metric: str, g: torch.Generator) -> float:
    J = full_jacobian(fn, X)
    if metric == "fro":
        return float(torch.linalg.matrix_norm(J, 2))
    return jacobian_2inf(J, *X.shape, g)


def attack(fn, N: int, d: int, metric: str, scales: list[float], *, seed: int = 0, restarts: int = 3,
           steps: int = 40) -> float:
    """Largest attained ratio (Jacobian norm or pair quotient) found by the three searches."""
    g = torch.Generator().manual_seed(seed)
    best, best_X = 0.0, None
    for scale in scales:
        for _ in range(restarts):
            X = (scale * torch.randn(N, d, generator=g, dtype=torch.float64)).requires_grad_(True)
            opt = torch.optim.Adam([X], lr=0.05 * scale)
            for _ in range(steps):
                J = full_jacobian(fn, X, create_graph=True)
                loss = -torch.linalg.matrix_norm(J, 2)
                opt.zero_grad()
                loss.backward()
                opt.step()
            Xd = X.detach()
            val = jacobian_norm(fn, Xd, metric, g)
            if val > best:
                best, best_X = val, Xd.clone()
    best = max(best, _pair_ascent(fn, best_X, metric, g, scales, steps))
    return best


def _pair_ascent(fn, X0: torch.Tensor, metric: str, g: torch.Generator, scales: list[float], steps: int) -> float:
    N, d = X0.shape
    J = full_jacobian(fn, X0)
    _, _, Vh = torch.linalg.svd(J)
    starts = [(X0, X0 + 1e-3 * scales[0] * Vh[0].reshape(N, d))]
    for scale in scales:
        X = scale * torch.randn(N, d, generator=g, dtype=torch.float64)
        starts.append((X, X + scale * torch.randn(N, d, generator=g, dtype=torch.float64)))
    best = 0.0
    for X, Y in starts:
        X, Y = X.clone().requires_grad_(True), Y.clone().requires_grad_(True)
        lr = 0.02 * float(metric_norm(X.detach(), "fro")) / (N * d) ** 0.5 + 1e-6
        opt = torch.optim.Adam([X, Y], lr=lr)
        for _ in range(steps):
            ratio = metric_norm(fn(X) - fn(Y), metric) / metric_norm(X - Y, metric)
            best = max(best, float(ratio.detach()))
            opt.zero_grad()
            (-ratio).backward()
            opt.step()
    return best
