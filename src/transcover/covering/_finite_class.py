"""Finite-class (Occam, compression) generalisation bounds for a model described in L bits (THEORY F18).

A prefix-free code assigns every model ``h`` it can describe a length ``L(h)`` with Kraft's
inequality ``sum_h 2^{-L(h)} <= 1``, so ``P(h) = 2^{-L(h)}`` is a prior fixed before the data.
For a loss in ``{0, 1}`` the one-sided Chernoff bound ``Pr[e_hat <= q] <= exp(-n kl(q || e))``
(q <= e) and a union bound weighted by ``P(h) delta`` give, with probability at least ``1 - delta``
over ``n`` i.i.d. samples, simultaneously for every describable ``h``:

.. math::

    \\mathrm{kl}(\\hat e(h) \\,\\|\\, e(h)) \\le \\frac{L(h)\\ln 2 + \\ln(1/\\delta)}{n}
    \\quad\\text{on } \\{\\hat e \\le e\\},

hence ``e(h) <= kl^{-1}(e_hat, c)`` with ``c`` the right-hand side (Langford & Seeger 2001;
Langford 2005, "Tutorial on practical prediction theory", Thm 4.1 the Occam's razor bound;
McAllester 1999).  Catoni (2007, "PAC-Bayesian supervised classification", Thm 1.2.6) relaxes the
kl to ``e <= (1 - exp(-C e_hat - c)) / (1 - exp(-C))`` for a fixed ``C > 0``; Hoeffding gives the
square-root form ``e <= e_hat + sqrt(c / 2)``.  Non-vacuous deep-network bounds of this kind:
Lotfi et al., NeurIPS 2022 (quantisation + arithmetic coding).

Every function here returns a number that is *at least* the exact real-number value of its
formula: floating-point rounding is accounted for and always goes up (Note [upward rounding]).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from fractions import Fraction

from .._errors import InputError, check_number
from .._results import Kind

__all__ = [
    "binary_kl",
    "kl_inverse_upper",
    "occam_complexity",
    "kl_occam_bound",
    "catoni_occam_bound",
    "sqrt_occam_bound",
    "error_rate_upper",
    "OccamBound",
    "occam_bounds",
]

_EPS = 2.0**-52

# Note [upward rounding]: a float64 operation (+, -, *, /, sqrt, exp, log, log1p, expm1) returns
# the exact result times (1 + d) with |d| <= 2^-52 (correctly rounded ops: 2^-53; libm's
# exp/log/log1p/expm1 are within 1 ulp on glibc).  A chain of k such operations on positive
# quantities is therefore within a factor (1 + 2^-52)^k of the exact value, and multiplying the
# computed result by (1 + 4k 2^-52) and stepping one float up puts it above the exact value.


def _up(x: float, n_ops: int) -> float:
    """``x`` enlarged past the error of ``n_ops`` float64 operations on non-negative terms."""
    if x <= 0.0:  # a negative result moves towards zero, i.e. up
        return math.nextafter(x * (1.0 - 4 * n_ops * _EPS), math.inf) if x < 0 else 0.0
    return math.nextafter(x * (1.0 + 4 * n_ops * _EPS), math.inf)


def _check_prob(name: str, q: float) -> float:
    if not (_number(q) and _finite(q) and 0.0 <= q <= 1.0):
        raise InputError(f"{name} must be a number in [0, 1], but got {name}={q!r}")
    return float(q) + 0.0  # -0.0 -> 0.0: the bisection reads bit patterns, and -0.0's is negative


def _number(x: object) -> bool:
    """An int or float that is not a bool (``True`` was counted as 1 bit, 1 mistake; red team of stop 35)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x: float) -> bool:
    """``math.isfinite`` that answers False, not OverflowError, for an int beyond float64 (``10**400``)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def binary_kl(q: float, p: float) -> float:
    """The binary relative entropy, in nats (float64, no rounding guarantee; see ``_kl_with_error``).

    .. math::

        \\mathrm{kl}(q \\| p) = q \\ln\\frac{q}{p} + (1 - q) \\ln\\frac{1 - q}{1 - p},
        \\qquad 0 \\ln 0 = 0.

    Example:
        >>> round(binary_kl(0.1, 0.5), 6)
        0.368064
    """
    q, p = _check_prob("q", q), _check_prob("p", p)
    return _kl_with_error(q, p)[0]


def _kl_with_error(q: float, p: float) -> tuple[float, float]:
    """``kl(q || p)`` in float64 and a bound on its absolute rounding error.

    The value is ``a + b`` with ``a = q log1p((q - p)/p)`` (or ``q log(q/p)`` when ``q < p/2``,
    where ``|log(q/p)| > 0.69`` absorbs the rounding of the ratio) and
    ``b = (1 - q) log1p((p - q)/(1 - p))``.  Written with ``log1p`` of the relative change, each
    term is computed to a few ulp *of itself* (``q - p`` is exact when p and q are within a factor
    2 and otherwise within 1 ulp, as is ``1 - p``; the divisions, products and ``log``/``log1p``
    (within 2 ulp on glibc) add at most 2 ulp each).  So each term carries at most ``8 * 2^-52`` of
    its magnitude and the sum one more ulp: ``16 * 2^-52 * (|a| + |b|)`` bounds the error even when
    ``a`` and ``b`` cancel (p close to q), which is what keeps the inversion tight.  The ``1e-300``
    absorbs subnormal ``q`` (relative precision lost, absolute error below 1e-305).
    """
    if p == 0.0:
        return (0.0, 0.0) if q == 0.0 else (math.inf, 0.0)
    if p == 1.0:
        return (0.0, 0.0) if q == 1.0 else (math.inf, 0.0)
    r = 1.0 - q
    if q == 0.0:
        a = 0.0
    elif q < 0.5 * p:
        a = q * math.log(q / p)
    else:  # where (q - p)/p overflows (p subnormal, far below q), log q - log p: both logs within 1 ulp of <= 745,
        # their difference >= 709, so the error stays within 4 ulps of the term (red team of stop 35: inf before)
        ratio = (q - p) / p
        a = q * (math.log1p(ratio) if ratio < math.inf else math.log(q) - math.log(p))
    b = r * math.log1p((p - q) / (1.0 - p)) if r > 0.0 else 0.0
    return a + b, 16.0 * _EPS * (abs(a) + abs(b)) + 1e-300


def _bits(x: float) -> int:
    """The IEEE-754 bit pattern of a float >= 0 as an integer: order-preserving on [0, inf]."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0]


def kl_inverse_upper(q: float, c: float) -> float:
    """A certified upper bound on ``sup{p in [q, 1] : kl(q || p) <= c}`` (the upper kl inverse).

    .. math::

        \\mathrm{kl}^{-1}(q, c) = \\sup\\{p \\in [q, 1] : \\mathrm{kl}(q \\| p) \\le c\\}.

    Bisection on ``[q, 1]`` over the float64 numbers themselves (their bit patterns are ordered
    integers, so at most 64 steps reach adjacent floats, even near 1e-300) keeps ``hi``
    *certified infeasible*: a point moves to ``hi``
    only when its computed ``kl`` minus the rounding-error bound of ``_kl_with_error`` still
    exceeds ``c``.  ``kl(q || .)`` is continuous and increasing on ``[q, 1]``, so the exact
    supremum is below every certified-infeasible point, and the returned ``hi`` is at least the
    exact value (or 1).  Used by the Occam bound of THEORY F18 (Langford & Seeger 2001).

    Args:
        q: the empirical error in [0, 1] (already rounded up by the caller if it is a ratio).
        c: the complexity ``(L ln 2 + ln(1/delta)) / n >= 0``.

    Returns:
        A float ``>= q``, ``<= 1``, ``>=`` the exact inverse; typically within 1e-12 of it.

    Raises:
        InputError: q outside [0, 1] or c negative, NaN, or an int beyond float64 (red team 204).

    Example:
        >>> round(kl_inverse_upper(0.0, math.log(2)), 9)  # 1 - exp(-c) = 0.5
        0.5
    """
    q = _check_prob("q", q)
    # _finite, not math.isnan: an int beyond float64 (c = 10**400) raised OverflowError there (red team 204)
    if not (_number(c) and (c == math.inf or _finite(c)) and c >= 0.0):
        raise InputError(f"c must be a number >= 0 (within float64, or inf), but got c={c!r}")
    if q >= 1.0 or c == math.inf:
        return 1.0
    lo, hi = _bits(q), _bits(1.0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        value, err = _kl_with_error(q, _from_bits(mid))
        if value - err > c:
            hi = mid
        else:
            lo = mid
    return _from_bits(hi)


def occam_complexity(description_bits: float, n: int, delta: float) -> float:
    """``(L ln 2 + ln(1/delta)) / n``, rounded up (THEORY F18).

    Args:
        description_bits: L, the length of the model's prefix-free code in bits (>= 0).
        n: number of i.i.d. samples the empirical error is measured on (>= 1).
        delta: failure probability in (0, 1).
    """
    if not (_number(description_bits) and _finite(description_bits) and description_bits >= 0):
        raise InputError(f"description_bits must be a finite number >= 0, but got {description_bits!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or not _finite(n):
        raise InputError(f"n must be a positive integer (within float64), but got n={n!r}")
    check_number(delta, "delta", low=0.0, strict=True, below=1.0)
    numerator = _up(_up(description_bits * math.log(2.0), 2) + _up(-math.log(delta), 1), 1)
    return _up(numerator / n, 1)


def error_rate_upper(mistakes: int, n: int) -> float:
    """``mistakes / n`` as a float64 that is not below the exact ratio (``kl^{-1}`` grows with q)."""
    if not (_number(mistakes) and _number(n) and isinstance(mistakes, int) and isinstance(n, int)
            and n > 0 and 0 <= mistakes <= n):
        raise InputError(f"need integers 0 <= mistakes <= n, n > 0, but got mistakes={mistakes!r}, n={n!r}")
    q = mistakes / n
    return math.nextafter(q, math.inf) if Fraction(q) < Fraction(mistakes, n) else q


def kl_occam_bound(train_error: float, description_bits: float, n: int, delta: float) -> float:
    """The kl Occam bound: certified ``e <= kl^{-1}(e_hat, (L ln 2 + ln(1/delta)) / n)`` (THEORY F18).

    Assumptions: 0-1 loss; the ``n`` samples are i.i.d. and independent of the code (the code,
    including every grid and hyperparameter menu, is fixed before seeing them); ``L`` is the length
    of the model's codeword in a prefix-free code.  Holds with probability ``>= 1 - delta``
    simultaneously for every describable model (Langford 2005, Thm 4.1; Lotfi et al. 2022, Eq. 2).
    """
    return kl_inverse_upper(_check_prob("train_error", train_error), occam_complexity(description_bits, n, delta))


def catoni_occam_bound(train_error: float, description_bits: float, n: int, delta: float,
                       C: float | tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)) -> float:
    """Catoni's bound for a finite class, optimised over a finite grid of ``C`` (union bound paid).

    .. math::

        e \\le \\min_{C \\in \\mathcal C} \\frac{1 - \\exp(-C \\hat e - c_{|\\mathcal C|})}{1 - e^{-C}},
        \\qquad c_k = \\frac{L \\ln 2 + \\ln(k/\\delta)}{n}.

    Catoni (2007), Thm 1.2.6 with a Dirac posterior on the described model; each ``C`` gets
    ``delta / |grid|``.  It is never below :func:`kl_occam_bound` at the same ``delta / |grid|``
    (it is a linearisation of the kl), which the tests check.  Assumptions as for the kl bound.
    """
    grid = (C,) if isinstance(C, (int, float)) else tuple(C)
    if not grid or any(not (_number(x) and _finite(x) and x > 0) for x in grid):
        raise InputError(f"C must be positive finite numbers, but got C={C!r}")
    q = _check_prob("train_error", train_error)
    check_number(delta, "delta", low=0.0, strict=True, below=1.0)
    share = delta / len(grid)
    if Fraction(share) * len(grid) > Fraction(delta):  # each C's delta rounded down (it rounded up by up to half an
        share = math.nextafter(share, 0.0)             # ulp: far more than the log's margin where it is subnormal)
    if share == 0.0:
        raise InputError(f"delta / |C grid| = {delta!r} / {len(grid)} underflows float64; use a larger delta")
    c = occam_complexity(description_bits, n, share)
    best = 1.0
    for x in grid:
        # numerator -expm1(-t) grows with t, so t rounded up; denominator rounded down.
        t = _up(_up(x * q, 1) + c, 1)
        num = _up(-math.expm1(-t), 2)
        den = -math.expm1(-x) * (1.0 - 8 * _EPS)
        best = min(best, _up(num / den, 1))
    return min(best, 1.0)


def sqrt_occam_bound(train_error: float, description_bits: float, n: int, delta: float) -> float:
    """The square-root (Hoeffding) Occam bound ``e <= e_hat + sqrt((L ln 2 + ln(1/delta)) / (2n))``.

    McAllester (1999) / Hoeffding with the prior ``2^{-L}`` (THEORY F18); looser than the kl form
    when ``e_hat`` is small (it pays ``sqrt(c)`` instead of ``c``).  Rounded up; capped at 1.
    """
    q = _check_prob("train_error", train_error)
    c = occam_complexity(description_bits, n, delta)
    return min(1.0, _up(q + _up(math.sqrt(_up(c / 2.0, 1)), 1), 1))


@dataclass(frozen=True)
class OccamBound:
    """The three finite-class bounds for one described model, each a certified upper bound on the test error."""

    train_error: float  # exact ratio of the model actually described (measured, exact)
    mistakes: int
    n: int
    description_bits: int
    delta: float
    kl: float
    catoni: float
    sqrt: float
    kind: Kind = Kind.CERTIFIED_UPPER

    def to_dict(self) -> dict:
        return {
            "train_error": {"value": self.train_error, "kind": Kind.EXACT.value},
            "mistakes": self.mistakes, "n": self.n, "description_bits": self.description_bits,
            "delta": self.delta,
            "kl_bound": {"value": self.kl, "kind": self.kind.value, "source": "THEORY F18, Langford 2005 Thm 4.1"},
            "catoni_bound": {"value": self.catoni, "kind": self.kind.value, "source": "THEORY F18, Catoni 2007 Thm 1.2.6"},
            "sqrt_bound": {"value": self.sqrt, "kind": self.kind.value, "source": "THEORY F18, Hoeffding/McAllester"},
        }


def occam_bounds(mistakes: int, n: int, description_bits: int, delta: float = 0.05) -> OccamBound:
    """All three bounds (kl, Catoni, square root) for a model with ``mistakes`` errors on ``n`` samples."""
    q = error_rate_upper(mistakes, n)
    occam_complexity(description_bits, n, delta)  # the checks first: ceil below would take inf or NaN
    # the bits shown round up (int() truncated a fractional code length; the bounds always used the exact one)
    return OccamBound(train_error=mistakes / n, mistakes=mistakes, n=n, description_bits=math.ceil(description_bits),
                      delta=delta, kl=kl_occam_bound(q, description_bits, n, delta),
                      catoni=catoni_occam_bound(q, description_bits, n, delta),
                      sqrt=sqrt_occam_bound(q, description_bits, n, delta))
