"""Frobenius and (2,1) norms, of matrices and of low-rank products, as certified intervals.

THEORY.md section 4 (item 5): spectral norms alone give only dimension-dependent covers; the
1/eps^2 covering bounds (F2, F3, F9, F12) need ``||W||_F`` or the (2,1) norm
``||W||_{2,1} = sum_j ||W[:, j]||_2`` (row-vector convention ``x @ W``: the sum over output units
of the l2 norms of their incoming weights; THEORY section 2).
"""

from __future__ import annotations

import math

import numpy as np

from .._results import Interval, Kind
from ._floating import down, gamma, sqrt_down, sqrt_up, up
from ._spectral import _amax, _pow2_scale, _unscale

__all__ = ["frobenius_interval", "l21_interval", "frobenius_l21_intervals", "product_frobenius_interval", "product_l21_interval",
           "product_frobenius_l21", "vector_norm_interval"]


# Note [entrywise scale]: the norms below sum squares in float64, which under- or overflow for entries outside about
# 2^+-511 (stop 35's red team: b_1 = (2^-540, 0) enclosed in [0, 0], 2^600 in [1.8e308, inf], 2^-520 squares that lost
# bits outside the pads).  Every norm here is homogeneous of degree one in each factor, so a factor whose largest
# |entry| lies outside [2^-250, 2^250] is first brought to [1/2, 1) by a power of two and the interval scaled back,
# outwards.  Scaling up is exact; scaling down can take an entry far below the largest one under the normal range,
# which moves the norm by at most n^{1/2} 2^-1075 of the scaled units, inside the gamma pads of a norm >= 1/2.  Inside
# [2^-250, 2^250] nothing is scaled: the same floats as before.
_SAFE = 250


def _pow2(W: np.ndarray) -> tuple[np.ndarray, int]:
    """``(W 2^-e, e)`` per Note [entrywise scale] (``_spectral._pow2_scale`` with ``lim = 250``); refuses NaN/inf."""
    W = np.asarray(W, dtype=np.float64)
    amax = _amax(W)  # max and min carry a NaN through: one pass checks the range and finiteness
    if not math.isfinite(amax):
        raise ValueError("a norm of weights with NaN or infinite entries is not defined; the weights are refused")
    return _pow2_scale(W, amax, lim=_SAFE)


def _scaled(iv: Interval, e: int) -> Interval:
    """``iv`` times ``2^e``, outwards (``_spectral._unscale``)."""
    return iv if e == 0 else Interval(*_unscale(iv.lower, iv.upper, e), iv.kind, iv.method)


def _enclose(value: float, rel: float, method: str) -> Interval:
    if value == 0.0:  # a sum of squares that is exactly zero: every term is zero
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, method)
    return Interval(max(0.0, down(value * (1 - rel))), up(value * (1 + rel)), Kind.CERTIFIED_INTERVAL, method)


def vector_norm_interval(x: np.ndarray) -> Interval:
    """``||x||_2`` enclosed: a sum of k squares has relative error <= gamma_k, sqrt one ulp (Note [entrywise
    scale])."""
    x, e = _pow2(x)
    return _scaled(_enclose(float(np.sqrt(np.dot(x.ravel(), x.ravel()))), gamma(x.size + 2), "float64 sum of squares"), e)


def enclosed_vector_norm(x: np.ndarray, err: np.ndarray | float) -> Interval:
    """``||x*||_2`` enclosed for every ``x*`` with ``|x*_j - x_j| <= err_j``: x is a computed vector and ``err``
    its entrywise error bound (a bias summed in float64, a difference of two vectors).

    The norm of ``|x| + err`` (formed one ulp up) bounds it above and that of ``max(|x| - err, 0)`` (one ulp
    down) below, each enclosed by :func:`vector_norm_interval`.
    """
    a = np.abs(np.asarray(x, dtype=np.float64)).ravel()
    e = np.broadcast_to(np.asarray(err, dtype=np.float64), a.shape) if np.ndim(err) == 0 else \
        np.asarray(err, dtype=np.float64).ravel()
    hi = a + e
    hi = np.where(hi > 0, np.nextafter(hi, np.inf), 0.0)  # a zero entry with a zero error stays exactly zero
    lo = np.maximum(np.nextafter(a - e, -np.inf), 0.0)
    return Interval(vector_norm_interval(lo).lower, vector_norm_interval(hi).upper, Kind.CERTIFIED_INTERVAL,
                    "float64 sum of squares around a vector with an entrywise error bound")


def frobenius_interval(W: np.ndarray) -> Interval:
    """``||W||_F = sqrt(sum_ij W_ij^2)``, enclosed (all terms non-negative: relative error gamma_mn)."""
    return vector_norm_interval(W)


def l21_interval(W: np.ndarray) -> Interval:
    """``||W||_{2,1} = sum_j ||W[:, j]||_2`` for ``x @ W`` (sum over output units), enclosed."""
    W, e = _pow2(W)  # float64 (the error bound below is for float64 sums), Note [entrywise scale]
    col = np.sqrt(np.einsum("ij,ij->j", W, W))
    return _scaled(_enclose(float(col.sum()), gamma(W.shape[0] + W.shape[1] + 2), "float64 column norms"), e)


def frobenius_l21_intervals(W: np.ndarray) -> tuple[Interval, Interval]:
    """(``||W||_F``, ``||W||_{2,1}``) from one pass of column sums of squares (float64).

    Column j's sum of m squares has relative error <= gamma_m; the Frobenius norm sums the n
    column sums (gamma_(m+n) in all), the (2,1) norm their square roots (gamma_(m+n+2)).
    """
    W, e = _pow2(W)  # Note [entrywise scale]
    col_sq = np.einsum("ij,ij->j", W, W)
    fro = _enclose(float(np.sqrt(col_sq.sum())), gamma(W.shape[0] + W.shape[1] + 2), "float64 sum of squares")
    l21 = _enclose(float(np.sqrt(col_sq).sum()), gamma(W.shape[0] + W.shape[1] + 2), "float64 column norms")
    return _scaled(fro, e), _scaled(l21, e)


def _col_sq_norms_of_product(A: np.ndarray, B: np.ndarray, G_A: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Squared column norms of ``A B`` via ``diag(B^T (A^T A) B)`` and an absolute error bound.

    Each entry is a sum of products of non-negative-in-magnitude terms bounded by
    ``||A||_F^2 ||B[:, j]||^2``; with gamma over the three nested sums the absolute error of
    entry j is at most ``gamma_(p + 2r) ||A||_F^2 ||B[:, j]||^2``.  ``G_A`` may be a float64
    ``A^T A`` computed elsewhere by a conventional product (the same gamma_p bound holds).
    """
    A = np.asarray(A, dtype=np.float64)
    B = np.ascontiguousarray(B, dtype=np.float64)
    G = A.T @ A if G_A is None else G_A  # callers scale first (Note [entrywise scale]); a given G_A is A's own
    sq = np.einsum("ij,ij->j", G @ B, B)
    a2 = float(np.einsum("ij,ij->", A, A))
    bj2 = np.einsum("ij,ij->j", B, B)
    err = gamma(A.shape[0] + 2 * A.shape[1] + 2) * a2 * bj2
    return sq, err


def _product_parts(A: np.ndarray, B: np.ndarray, G_A: np.ndarray | None = None) -> tuple[np.ndarray, float, int]:
    """``_col_sq_norms_of_product`` with each factor scaled per Note [entrywise scale] (a given ``G_A`` is used only
    where ``A`` is not scaled) and the product's power of two."""
    (A, ea), (B, eb) = _pow2(A), _pow2(B)
    sq, err = _col_sq_norms_of_product(A, B, G_A if ea == 0 else None)
    return sq, err, ea + eb


def product_frobenius_l21(A: np.ndarray, B: np.ndarray, G_A: np.ndarray | None = None) -> tuple[Interval, Interval]:
    """(``||A B||_F``, ``||A B||_{2,1}``) sharing one Gram computation (``G_A = A^T A`` if given)."""
    sq, err, e = _product_parts(A, B, G_A)
    return _scaled(_fro_from(sq, err), e), _scaled(_l21_from(sq, err), e)


def product_frobenius_interval(A: np.ndarray, B: np.ndarray) -> Interval:
    """``||A B||_F`` from the r x r Grams, enclosed (absolute rounding error bounded)."""
    sq, err, e = _product_parts(A, B)
    return _scaled(_fro_from(sq, err), e)


def _fro_from(sq: np.ndarray, err: np.ndarray) -> Interval:
    total = float(sq.sum())
    e = float(err.sum()) * (1 + gamma(sq.size)) + gamma(sq.size) * total
    return Interval(sqrt_down(total - e), sqrt_up(total + e), Kind.CERTIFIED_INTERVAL, "low-rank gram")


def product_l21_interval(A: np.ndarray, B: np.ndarray) -> Interval:
    """``||A B||_{2,1} = sum_j ||A B[:, j]||_2`` without forming ``A B``, enclosed."""
    sq, err, e = _product_parts(A, B)
    return _scaled(_l21_from(sq, err), e)


def _l21_from(sq: np.ndarray, err: np.ndarray) -> Interval:
    lo = np.sqrt(np.clip(sq - err, 0.0, None)).sum()
    hi = np.sqrt(sq + err).sum()
    rel = gamma(sq.size + 2)
    return Interval(max(0.0, down(float(lo) * (1 - rel))), up(float(hi) * (1 + rel)),
                    Kind.CERTIFIED_INTERVAL, "low-rank gram")
