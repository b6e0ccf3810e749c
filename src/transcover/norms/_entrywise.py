"""Frobenius and (2,1) norms, of matrices and of low-rank products, as certified intervals.

THEORY.md section 4 (item 5): spectral norms alone give only dimension-dependent covers; the
1/eps^2 covering bounds (F2, F3, F9, F12) need ``||W||_F`` or the (2,1) norm
``||W||_{2,1} = sum_j ||W[:, j]||_2`` (row-vector convention ``x @ W``: the sum over output units
of the l2 norms of their incoming weights; THEORY section 2).
"""

from __future__ import annotations

import numpy as np

from .._results import Interval, Kind
from ._floating import down, gamma, sqrt_down, sqrt_up, up

__all__ = ["frobenius_interval", "l21_interval", "frobenius_l21_intervals", "product_frobenius_interval", "product_l21_interval",
           "product_frobenius_l21", "vector_norm_interval"]


def _enclose(value: float, rel: float, method: str) -> Interval:
    if value == 0.0:  # a sum of squares that is exactly zero: every term is zero
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, method)
    return Interval(max(0.0, down(value * (1 - rel))), up(value * (1 + rel)), Kind.CERTIFIED_INTERVAL, method)


def vector_norm_interval(x: np.ndarray) -> Interval:
    """``||x||_2`` enclosed: a sum of k squares has relative error <= gamma_k, sqrt one ulp."""
    x = np.asarray(x, dtype=np.float64).ravel()
    return _enclose(float(np.sqrt(np.dot(x, x))), gamma(x.size + 2), "float64 sum of squares")


def frobenius_interval(W: np.ndarray) -> Interval:
    """``||W||_F = sqrt(sum_ij W_ij^2)``, enclosed (all terms non-negative: relative error gamma_mn)."""
    return vector_norm_interval(W)


def l21_interval(W: np.ndarray) -> Interval:
    """``||W||_{2,1} = sum_j ||W[:, j]||_2`` for ``x @ W`` (sum over output units), enclosed."""
    W = np.asarray(W, dtype=np.float64)  # the error bound below is for float64 sums
    col = np.sqrt(np.einsum("ij,ij->j", W, W))
    return _enclose(float(col.sum()), gamma(W.shape[0] + W.shape[1] + 2), "float64 column norms")


def frobenius_l21_intervals(W: np.ndarray) -> tuple[Interval, Interval]:
    """(``||W||_F``, ``||W||_{2,1}``) from one pass of column sums of squares (float64).

    Column j's sum of m squares has relative error <= gamma_m; the Frobenius norm sums the n
    column sums (gamma_(m+n) in all), the (2,1) norm their square roots (gamma_(m+n+2)).
    """
    W = np.asarray(W, dtype=np.float64)
    col_sq = np.einsum("ij,ij->j", W, W)
    fro = _enclose(float(np.sqrt(col_sq.sum())), gamma(W.shape[0] + W.shape[1] + 2), "float64 sum of squares")
    l21 = _enclose(float(np.sqrt(col_sq).sum()), gamma(W.shape[0] + W.shape[1] + 2), "float64 column norms")
    return fro, l21


def _col_sq_norms_of_product(A: np.ndarray, B: np.ndarray, G_A: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Squared column norms of ``A B`` via ``diag(B^T (A^T A) B)`` and an absolute error bound.

    Each entry is a sum of products of non-negative-in-magnitude terms bounded by
    ``||A||_F^2 ||B[:, j]||^2``; with gamma over the three nested sums the absolute error of
    entry j is at most ``gamma_(p + 2r) ||A||_F^2 ||B[:, j]||^2``.  ``G_A`` may be a float64
    ``A^T A`` computed elsewhere by a conventional product (the same gamma_p bound holds).
    """
    A = np.asarray(A, dtype=np.float64)
    B = np.ascontiguousarray(B, dtype=np.float64)
    G = A.T @ A if G_A is None else G_A
    sq = np.einsum("ij,ij->j", G @ B, B)
    a2 = float(np.einsum("ij,ij->", A, A))
    bj2 = np.einsum("ij,ij->j", B, B)
    err = gamma(A.shape[0] + 2 * A.shape[1] + 2) * a2 * bj2
    return sq, err


def product_frobenius_l21(A: np.ndarray, B: np.ndarray, G_A: np.ndarray | None = None) -> tuple[Interval, Interval]:
    """(``||A B||_F``, ``||A B||_{2,1}``) sharing one Gram computation (``G_A = A^T A`` if given)."""
    sq, err = _col_sq_norms_of_product(A, B, G_A)
    return _fro_from(sq, err), _l21_from(sq, err)


def product_frobenius_interval(A: np.ndarray, B: np.ndarray) -> Interval:
    """``||A B||_F`` from the r x r Grams, enclosed (absolute rounding error bounded)."""
    return _fro_from(*_col_sq_norms_of_product(A, B))


def _fro_from(sq: np.ndarray, err: np.ndarray) -> Interval:
    total = float(sq.sum())
    e = float(err.sum()) * (1 + gamma(sq.size)) + gamma(sq.size) * total
    return Interval(sqrt_down(total - e), sqrt_up(total + e), Kind.CERTIFIED_INTERVAL, "low-rank gram")


def product_l21_interval(A: np.ndarray, B: np.ndarray) -> Interval:
    """``||A B||_{2,1} = sum_j ||A B[:, j]||_2`` without forming ``A B``, enclosed."""
    return _l21_from(*_col_sq_norms_of_product(A, B))


def _l21_from(sq: np.ndarray, err: np.ndarray) -> Interval:
    lo = np.sqrt(np.clip(sq - err, 0.0, None)).sum()
    hi = np.sqrt(sq + err).sum()
    rel = gamma(sq.size + 2)
    return Interval(max(0.0, down(float(lo) * (1 - rel))), up(float(hi) * (1 + rel)),
                    Kind.CERTIFIED_INTERVAL, "low-rank gram")
