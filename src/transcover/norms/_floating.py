"""Floating-point error constants and outward rounding (float64 throughout).

Note [rounding model]: we use the standard model ``fl(a op b) = (a op b)(1 + d)``, ``|d| <= u``
with ``u = 2**-53`` (IEEE binary64, round to nearest), and Higham's
``gamma_k = k u / (1 - k u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
Lemma 3.1).  An inner product of length ``k`` computed in *any* order, with or without FMA,
satisfies ``|fl(x.y) - x.y| <= gamma_k |x|.|y|`` (Higham eq. 3.5), so a matrix product computed
by a conventional (non-Strassen) BLAS satisfies ``|fl(AB) - AB| <= gamma_k |A||B|`` entrywise.
Every bound below is built from that one fact and from Higham's Theorem 10.3 for Cholesky.
Underflow is ignored: weights are far from the subnormal range (we refuse NaN/Inf and check the
scale elsewhere).  To stay safely on the right side of every rounding in forming the bounds
themselves, each ``gamma`` is doubled.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["U64", "gamma", "up", "down", "mul_up", "mul_down", "sqrt_up", "sqrt_down"]

U64 = 2.0**-53


def gamma(k: int) -> float:
    """2 * gamma_k = 2 k u / (1 - k u): a (doubled, hence safe) Higham constant for length-k sums."""
    ku = k * U64
    if ku >= 0.5:
        raise ValueError(f"gamma(k) needs k * u < 1/2, but got k={k}")
    return 2.0 * ku / (1.0 - ku)


def up(x: float) -> float:
    """The next float64 above x (one ulp outward)."""
    return float(np.nextafter(x, math.inf))


def down(x: float) -> float:
    """The next float64 below x (one ulp outward)."""
    return float(np.nextafter(x, -math.inf))


def mul_up(a: float, b: float) -> float:
    return up(a * b)


def mul_down(a: float, b: float) -> float:
    return down(a * b)


def sqrt_up(x: float) -> float:
    """An upper bound on sqrt(x) (x >= 0)."""
    return up(math.sqrt(max(x, 0.0)))


def sqrt_down(x: float) -> float:
    """A lower bound on sqrt(x); 0 for x <= 0."""
    return max(0.0, down(math.sqrt(x))) if x > 0 else 0.0
