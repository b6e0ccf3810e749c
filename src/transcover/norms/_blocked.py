"""Certified norms of one large matrix, read in row blocks: no float64 copy of the whole matrix.

``analyze`` measures the matrices outside the decomposition (token embeddings, un-embeddings) with
the same certificates as :func:`~transcover.norms._spectral.spectral_norm_interval` and
:func:`~transcover.norms._entrywise.frobenius_l21_intervals`, but those work on a float64 copy:
8 bytes per entry, four times a bf16 checkpoint's own size, for the largest tensor of most models
(issue 14, item 1).  Here the float32 (or float64) matrix is visited in blocks of rows, each block
widened to float64 on its own, and every sum the certificates need is accumulated across blocks.

Rounding (the bounds of the unblocked routes, with the summation tree made explicit): an entry of
the Gram ``G = W^T W`` is a sum of ``m`` products computed as ``nb`` block sums (BLAS, any order,
``b <= m`` terms each) added one after another; every term then passes through at most
``b + nb <= m + nb`` roundings, so ``|fl(G) - G| <= gamma_{m+nb} |W|^T |W|`` elementwise and
``||fl(G) - G||_2 <= gamma_{m+nb} ||W||_F^2`` (Higham 2002, section 3.1, for any summation order).
Column sums of squares get the same ``gamma_{m+nb}``.  Each row's products ``(W v)_i`` and sums of
squares are computed within one block, exactly as in the unblocked routes.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import blas

from .._results import Interval, Kind
from ._entrywise import _enclose, _scaled
from ._floating import down, gamma, sqrt_up, up
from ._spectral import _UNDERFLOW, _norm_upper, _top_eigpair, _upper_from_certificate

__all__ = ["blocked_matrix_norms", "BLOCK_BYTES"]

BLOCK_BYTES = 1 << 23  # float64 bytes of one block (8 MiB)


def _blocks(W: np.ndarray, rows: int):
    for lo in range(0, W.shape[0], rows):
        yield np.ascontiguousarray(W[lo: lo + rows], dtype=np.float64)


def blocked_matrix_norms(E: np.ndarray, *, rtol: float = 1e-3, block_bytes: int = BLOCK_BYTES,
                         ) -> tuple[Interval, Interval, Interval, float]:
    """(``||E||_2``, ``||E||_F``, ``||E||_{2,1}``, max row norm) of a 2-D float array, in row blocks.

    The spectral enclosure is the certificate of ``spectral_norm_interval`` (witness lower end,
    Cholesky-certified upper end of the Gram's top eigenvalue, seed 2.1 quantities); the
    Frobenius and (2,1) enclosures are those of ``frobenius_l21_intervals`` (the (2,1) norm sums the
    column norms of ``x @ E``); the max row norm a certified upper bound (like ``_max_row_norm``).

    Assumptions: ``E`` is exactly its float values (float32 or float64; bf16/fp16 were widened
    exactly); no overflow.  Memory: the ``n x n`` Gram (``n`` the smaller side) and one block.

    Raises:
        ValueError: ``E`` is not 2-D or holds NaN/Inf.
    """
    if E.ndim != 2:
        raise ValueError(f"blocked_matrix_norms needs a matrix, but got shape {E.shape}")
    flipped = E.shape[0] < E.shape[1]
    W = E.T if flipped else E  # tall: the Gram is the small side; rows of W are contiguous blocks
    m, n = W.shape
    if W.size == 0:
        zero = Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, "empty")
        return zero, zero, zero, 0.0
    rows = max(1, block_bytes // (8 * n))
    nb = -(-m // rows)
    wmax, wmin = float(W.max()), float(W.min())  # exact in any dtype; NaN/Inf show up here
    if not (math.isfinite(wmax) and math.isfinite(wmin)):
        raise ValueError("blocked_matrix_norms: matrix has NaN or Inf entries")
    amax = max(wmax, -wmin)
    e = 0 if amax == 0.0 or 2.0**-300 <= amax <= 2.0**300 else math.frexp(amax)[1]
    G = np.zeros((n, n))
    col_sq = np.zeros(n)
    row_sq = np.empty(m)
    fro2 = 0.0
    for i, B in enumerate(_blocks(W, rows)):
        if e:
            B = np.ldexp(B, -e)  # exact (Note [scaling] in _spectral)
        Gb = blas.dsyrk(1.0, B.T, trans=0, lower=0)  # B^T is Fortran-ordered: no copy
        G += np.triu(Gb)
        col_sq += np.einsum("ij,ij->j", B, B)  # no squared copy of the block
        rs = np.einsum("ij,ij->i", B, B)
        row_sq[i * rows: i * rows + B.shape[0]] = rs
        fro2 += float(rs.sum())
    G += np.triu(G, 1).T
    steps = m + nb
    fro2 = up(fro2 * (1.0 + gamma(W.size + nb)))
    err = up(gamma(steps) * fro2) + _UNDERFLOW
    # Entrywise norms of E (columns of E are rows of W when flipped), at the working scale 2^-e.
    e_cols, e_rows = (row_sq, col_sq) if flipped else (col_sq, row_sq)
    rel = gamma(steps + n + 2)
    # enclosed at the working scale, then scaled back outwards: ``value * 2^e`` rounded to nearest where it
    # is subnormal (a max row of 4.4e-323 for an exact 4.58e-323 before stop 36)
    fro = _scaled(_enclose(float(np.sqrt(e_cols.sum())), rel, "float64 sum of squares, row blocks"), e)
    l21 = _scaled(_enclose(float(np.sqrt(e_cols).sum()), rel, "float64 column norms, row blocks"), e)
    max_row = _scaled(_enclose(float(np.sqrt(e_rows.max(initial=0.0))), rel, ""), e).upper  # like _max_row_norm
    if amax == 0.0:
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, "zero matrix"), fro, l21, max_row
    if n == 1:  # a vector: its spectral norm is its Frobenius norm
        return Interval(fro.lower, fro.upper, Kind.CERTIFIED_INTERVAL, "vector norm"), fro, l21, max_row
    theta, v = _top_eigpair(G)
    yy = 0.0
    for B in _blocks(W, rows):
        if e:
            B = np.ldexp(B, -e)
        y = B @ v  # each entry within one block, as in the unblocked route
        yy += float(y @ y)
    # ||y||: a sum of m squares over blocks (relative error gamma_{m+nb}), one sqrt
    y_lower = max(0.0, down(math.sqrt(yy) * (1.0 - gamma(steps + 2))))
    fro_W = sqrt_up(float(np.trace(G)) * (1.0 + 2.0 * gamma(steps)) + n * err)
    slack_abs = gamma(n) * fro_W * _norm_upper(v)
    lower = max(0.0, down((y_lower - slack_abs) / _norm_upper(v)))
    mu, _ = _upper_from_certificate(G, err, theta, rtol)
    upper = max(sqrt_up(mu), lower)
    return (_scaled(Interval(lower, upper, Kind.CERTIFIED_INTERVAL, "gram+cholesky certificate, row blocks"), e),
            fro, l21, max_row)
