"""Rounding for the local routes (issue 12): Higham's ``gamma_k``, the relative error of ``k`` float64 roundings; norms
formed at powers of two (THEORY F96); and formed products with their rounding (THEORY F97).

One place for the unit roundoff these bounds read: a test that evaluates a stage in float32 sets ``_U`` here to
``2^-24`` and every ``gamma_k`` follows (``tests/lipschitz/test_local_stack.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_U = 2.0**-53
_TINY = torch.finfo(torch.float64).tiny


def _gamma(k: int) -> float:
    """``gamma_k = k u / (1 - k u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*, Lemma 3.1): a product of
    ``k`` factors ``(1 + delta_i)^{+-1}``, ``|delta_i| <= u``, lies within ``gamma_k`` of 1 when ``k u < 1``."""
    return k * _U / (1 - k * _U)


def pow2_exponent(top: Tensor, lim: int = 0) -> Tensor:
    """The exponent ``e`` with ``top 2^-e`` in ``[1/2, 1)`` (``frexp``) where ``top`` (a largest ``|entry|``, >= 0) is
    positive and finite and, for ``lim > 0``, outside ``[2^-lim, 2^lim]``; else 0 (left as it is).  In ``top``'s
    dtype.  The one form of the power-of-two scalings of THEORY F96 (exact: ``ldexp`` by ``-e``, undone at the end)."""
    ok = (top > 0) & torch.isfinite(top)
    if lim:
        ok = ok & ((top < 2.0**-lim) | (top > 2.0**lim))
    return torch.where(ok, torch.frexp(top).exponent, 0).to(top.dtype)


def pow2_norm(A: Tensor, dims: tuple | int | None = None) -> Tensor:
    """Frobenius norms of ``A`` over ``dims`` (default: all) as float64 computes them, each formed at the power of two
    that brings its largest entry to ``[1/2, 1)`` (exact scalings), so no square under- or overflows: ``torch``'s norm
    squares as it goes, and a matrix of entries ``2^-600`` had norm 0 (THEORY F81d).  In the normal range the very
    floats of ``torch``'s norm; a positive result below the smallest normal float (rounded to nearest when scaled
    back) is moved one ulp up.  Where every plain norm lies in ``[2^-400, 2^400]`` that is the result (one pass): no
    square overflowed, and the squares that flushed lose at most ``n 2^-1075`` of a sum above ``2^-800`` (``n`` entries),
    far inside any caller's relative pad.  Unpadded: the caller adds its sum's rounding."""
    dims = tuple(range(A.dim())) if dims is None else (dims,) if isinstance(dims, int) else tuple(dims)
    plain = torch.linalg.vector_norm(A, dim=dims)
    if A.numel() == 0 or bool(((plain >= 2.0**-400) & (plain <= 2.0**400)).all()):
        return plain
    m = A.abs().amax(dim=dims, keepdim=True)
    s = torch.ldexp(torch.ones_like(m), -pow2_exponent(m).clamp(-1000, 1000))
    r = torch.linalg.vector_norm(A * s, dim=dims)
    r = r / s.reshape(r.shape)
    return torch.where((r > 0) & (r < _TINY), torch.nextafter(r, torch.full_like(r, math.inf)), r)


def product_row_error(A: Tensor, *Ws: Tensor) -> Tensor:
    """Per row of ``A`` (..., k), a bound on ``||fl((A W_1) W_2 ...) - A W_1 W_2 ...||``, the formed product's
    rounding: ``gamma_K || |A| |W_1| |W_2| ... ||`` with ``K`` the sum of the inner dimensions (Higham Lemma 3.5 once
    per product, ``gamma_a + gamma_b + gamma_a gamma_b <= gamma_{a+b}``; THEORY F97), padded for its own evaluation
    (non-negative terms: relative ``gamma_K``).  A norm of the formed product padded only relative to itself falls
    short of the exact one where the product cancels.  Norms at powers of two (``pow2_norm``, THEORY F96)."""
    R = A.abs()
    for W in Ws:
        R = R @ W.abs()
    return _gamma(sum(W.shape[0] for W in Ws)) * pow2_norm(R, -1) * (1 + 1e-12)


def product_row_norms(A: Tensor, *Ws: Tensor) -> Tensor:
    """Per row of ``A``, a certified upper bound on the exact product's row norm ``||(A W_1 W_2 ...)_i||``: the formed
    row's norm plus ``product_row_error`` (THEORY F97)."""
    R = A
    for W in Ws:
        R = R @ W
    return (pow2_norm(R, -1) * (1 + 1e-12) + product_row_error(A, *Ws)) * (1 + 1e-12)
