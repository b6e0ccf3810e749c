"""Certificates for symmetric eigenvalue bounds: Gram matrices with error bars, and a Cholesky test.

Note [Cholesky certificate]: to prove ``lambda_max(K) <= mu`` for a symmetric ``K`` that we only
know as a float64 matrix ``K_hat`` with ``||K - K_hat||_2 <= err``, it suffices that
``S = s I - K_hat`` is positive semidefinite with ``s = mu - err``.  We factor
``A = t I - K_hat`` with ``t = s - alpha`` in floating point.  If the factorisation completes,
Higham's Theorem 10.3 gives ``L L^T = A_fl + dA`` with ``|dA| <= gamma_{n+1} |L||L^T|``, hence
``||dA||_2 <= gamma_{n+1} ||L||_F^2``; forming the diagonal of ``A_fl`` adds at most
``u (|t| + |K_ii|)`` per entry.  So ``S = A_fl + alpha I - D = L L^T - dA + alpha I - D`` is PSD
as soon as ``alpha >= gamma_{n+1} ||L||_F^2 + max_i u (|t| + |K_ii|)``, which we check *after*
the factorisation (a posteriori).  This is the idea of Rump's verification of positive
definiteness (BIT 46, 2006), re-derived here in the simple form we need.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import blas, lapack

from ._floating import U64, gamma, up

__all__ = ["gram_with_error", "batched_gram_with_error", "certify_lambda_max_at_most", "psd_cholesky_upper"]


def gram_with_error(W: np.ndarray) -> tuple[np.ndarray, float]:
    """``G = W^T W`` in float64 and ``err >= ||fl(G) - G||_2``.

    ``W`` is (m, n) float64.  Uses BLAS ``dsyrk`` (half the flops of a general product).
    Error: ``|fl(G) - G| <= gamma_m |W|^T |W|``, and ``|| |W|^T|W| ||_2 <= ||W||_F^2``.
    """
    m = W.shape[0]
    if W.flags.c_contiguous:  # W^T is then Fortran-ordered: G = (W^T)(W^T)^T without a copy
        G = blas.dsyrk(1.0, W.T, trans=0, lower=0)
    else:
        G = blas.dsyrk(1.0, np.asfortranarray(W), trans=1, lower=0)
    G = np.triu(G)  # dsyrk fills the upper triangle; mirror it
    G += np.triu(G, 1).T
    fro2 = float(np.einsum("ij,ij->", W, W))
    fro2 = up(fro2 * (1.0 + gamma(W.size)))
    return G, up(gamma(m) * fro2)


def batched_gram_with_error(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``G[h] = W[h]^T W[h]`` for a stack ``W`` (H, m, n) and ``err[h] >= ||fl(G[h]) - G[h]||_2``.

    The same bound as :func:`gram_with_error` (any summation order of a conventional product),
    for all heads of a layer in one batched product instead of H BLAS calls.
    """
    m = W.shape[1]
    G = np.matmul(W.transpose(0, 2, 1), W)
    G = 0.5 * (G + G.transpose(0, 2, 1))  # exact: both triangles hold the same inner products
    fro2 = np.einsum("hij,hij->h", W, W) * (1.0 + gamma(W.shape[1] * W.shape[2]))
    return G, np.nextafter(gamma(m) * fro2, np.inf)


def _cholesky_ok(A: np.ndarray) -> tuple[bool, np.ndarray]:
    L, info = lapack.dpotrf(A, lower=1, clean=1, overwrite_a=0)
    return info == 0, L


def certify_lambda_max_at_most(K_hat: np.ndarray, err: float, mu: float) -> bool:
    """True only if ``lambda_max(K) <= mu`` for every symmetric K with ``||K - K_hat||_2 <= err``.

    See Note [Cholesky certificate].  A False answer proves nothing (mu may be too tight).
    """
    n = K_hat.shape[0]
    diag = np.diag(K_hat)
    s = mu - err
    scale = max(abs(s), float(np.abs(diag).max(initial=0.0)), 1e-300)
    # a first guess of alpha from ||L||_F^2 ~ trace(A) <= n|s| + sum|K_ii|
    alpha = 4.0 * (gamma(n + 1) * (n * abs(s) + float(np.abs(diag).sum())) + U64 * 2 * scale)
    for _ in range(3):
        t = s - alpha
        A = -K_hat.copy()
        A[np.diag_indices(n)] += t
        ok, L = _cholesky_ok(A)
        if not ok:
            return False
        fro2 = up(float(np.einsum("ij,ij->", L, L)) * (1.0 + gamma(n * n)))
        needed = up(gamma(n + 1) * fro2 + U64 * (abs(t) + float(np.abs(diag).max(initial=0.0))) * 2)
        if alpha >= needed:
            return True
        alpha = 2.0 * needed
    return False


def psd_cholesky_upper(G_hat: np.ndarray, err: float) -> np.ndarray:
    """A lower-triangular ``L`` with ``L L^T >= G`` (Loewner order) for every PSD ``G`` with
    ``||G - G_hat||_2 <= err``.

    We factor ``G_hat + tau I``; with ``L L^T = G_hat + tau I + D + dA`` (diagonal rounding D,
    Cholesky error dA as in Note [Cholesky certificate]) we have ``L L^T - G >= (tau - err -
    ||D|| - ||dA||) I``, and we accept ``tau`` once that is >= 0, checked a posteriori.
    """
    n = G_hat.shape[0]
    diag = np.diag(G_hat)
    trace = float(np.abs(diag).sum())
    if trace == 0.0 and err == 0.0:  # G_hat = 0 exactly (PSD with zero trace) and G = G_hat
        return np.zeros_like(G_hat)
    tau = 2.0 * err + 4.0 * gamma(n + 1) * trace + 1e-300
    for _ in range(60):
        A = G_hat.copy()
        A[np.diag_indices(n)] += tau
        ok, L = _cholesky_ok(A)
        if ok:
            fro2 = up(float(np.einsum("ij,ij->", L, L)) * (1.0 + gamma(n * n)))
            needed = up(err + gamma(n + 1) * fro2 + 2 * U64 * (float(diag.max(initial=0.0)) + tau))
            if tau >= needed:
                return L
            tau = 2.0 * needed
        else:
            tau = 4.0 * tau + 1e-300
    raise FloatingPointError("could not certify a Cholesky factor of a Gram matrix (scale out of range)")
