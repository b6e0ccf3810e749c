"""Closed-form covering logs evaluated with directed rounding (issue 10, defect 6).

A covering bound such as ``p ln(1 + 2B/eps)`` or ``ceil(36 a^2 b^2/eps^2) ln(L)`` is a real number;
the float64 that reports it must lie on the side of the claim (above it for an upper bound, below
for a lower bound) or be its correct rounding when it is labelled exact.  Plain float arithmetic
gets neither: ``math.ceil(1.0 / (1/3))`` is 3 although the float ``1/3`` is below one third, so
the true quotient ``3.0000000000000002...`` needs 4 centres.

Note [directed decimals]: every computation here runs on an :class:`Enclosure` ``[lo, hi]`` of
decimals.  Inputs are exact (a float is a dyadic rational, and ``Fraction`` holds it exactly);
``+``, ``*`` and ``/`` run in ``ROUND_FLOOR`` contexts for ``lo`` and ``ROUND_CEILING`` for ``hi``;
``ln`` and ``exp`` of :mod:`decimal` are correctly rounded (Python reference, ``Decimal.ln``), so
one ``next_minus`` / ``next_plus`` step of their result encloses the true value.  The decimal
exponent range (``MAX_EMAX``) makes ``p = 10^9`` or ``x = e^(10^5)`` harmless.  The enclosure is
then rounded to float64 in the claimed direction, checked exactly with ``Fraction``; for "nearest"
the precision doubles until both ends round to the same float64, which terminates because
``ln x`` of a rational ``x != 1`` is transcendental (Lindemann-Weierstrass), never a midpoint.
"""

from __future__ import annotations

import decimal
import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

__all__ = ["Enclosure", "exact", "to_float", "round_log", "log_count", "ROUNDINGS"]

ROUNDINGS = ("nearest", "up", "down")
_PREC = 40  # decimal digits: ample for a float64 result, whose own precision is ~17 digits


@functools.lru_cache(maxsize=64)
def _ctx(prec: int, rounding: str) -> decimal.Context:
    """A decimal context (cached: building one costs more than an ln; callers never modify it)."""
    return decimal.Context(prec=prec, rounding=rounding, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN,
                           traps=[decimal.InvalidOperation, decimal.DivisionByZero, decimal.Overflow])


@dataclass(frozen=True)
class Enclosure:
    """Decimals ``lo <= x <= hi`` enclosing a real ``x``, at ``prec`` significant digits."""

    lo: Decimal
    hi: Decimal
    prec: int = _PREC

    def _down(self) -> decimal.Context:
        return _ctx(self.prec, decimal.ROUND_FLOOR)

    def _up(self) -> decimal.Context:
        return _ctx(self.prec, decimal.ROUND_CEILING)

    def __add__(self, other: "Enclosure") -> "Enclosure":
        return Enclosure(self._down().add(self.lo, other.lo), self._up().add(self.hi, other.hi), self.prec)

    def __sub__(self, other: "Enclosure") -> "Enclosure":
        return Enclosure(self._down().subtract(self.lo, other.hi), self._up().subtract(self.hi, other.lo), self.prec)

    def __mul__(self, other: "Enclosure") -> "Enclosure":
        """Product of two enclosures of non-negative numbers (all the closed forms need)."""
        if self.lo < 0 or other.lo < 0:
            raise ValueError("Enclosure.__mul__ is only defined for non-negative enclosures")
        return Enclosure(self._down().multiply(self.lo, other.lo), self._up().multiply(self.hi, other.hi), self.prec)

    def ln(self) -> "Enclosure":
        """``ln`` of a positive enclosure (monotone; one step outward covers the half-ulp error)."""
        if self.lo <= 0:
            raise ValueError("Enclosure.ln needs a positive enclosure")
        near = _ctx(self.prec, decimal.ROUND_HALF_EVEN)
        lo = near.ln(self.lo)
        hi = near.ln(self.hi)
        return Enclosure(lo if self.lo == 1 else self._down().next_minus(lo),
                         hi if self.hi == 1 else self._up().next_plus(hi), self.prec)

    def exp(self) -> "Enclosure":
        """``exp`` of an enclosure (monotone; exp(0) = 1 is kept exact)."""
        near = _ctx(self.prec, decimal.ROUND_HALF_EVEN)
        lo = near.exp(self.lo)
        hi = near.exp(self.hi)
        return Enclosure(lo if self.lo == 0 else self._down().next_minus(lo),
                         hi if self.hi == 0 else self._up().next_plus(hi), self.prec)

    def sqrt(self) -> "Enclosure":
        """``sqrt`` of a non-negative enclosure (monotone, correctly rounded, one step outward)."""
        if self.lo < 0:
            raise ValueError("Enclosure.sqrt needs a non-negative enclosure")
        near = _ctx(self.prec, decimal.ROUND_HALF_EVEN)
        lo, hi = near.sqrt(self.lo), near.sqrt(self.hi)
        return Enclosure(max(Decimal(0), self._down().next_minus(lo)), self._up().next_plus(hi), self.prec)

    def ceil(self) -> "Enclosure":
        """An enclosure of ``ceil(x)``: ``[ceil(lo), ceil(hi)]`` (ceil is monotone)."""
        return Enclosure(self.lo.to_integral_value(decimal.ROUND_CEILING),
                         self.hi.to_integral_value(decimal.ROUND_CEILING), self.prec)


def exact(x: Fraction | int | float, prec: int = _PREC) -> Enclosure:
    """The tightest decimal enclosure of a rational (a float is taken at its exact binary value)."""
    fx = Fraction(x)
    num, den = Decimal(fx.numerator), Decimal(fx.denominator)
    return Enclosure(_ctx(prec, decimal.ROUND_FLOOR).divide(num, den),
                     _ctx(prec, decimal.ROUND_CEILING).divide(num, den), prec)


def _float_dir(d: Decimal, up: bool) -> float:
    """``d`` rounded to float64 towards +inf (``up``) or -inf, compared exactly."""
    f = float(d)  # correctly rounded to nearest (CPython parses the decimal string)
    if math.isinf(f):
        return f if (f > 0) == up else math.copysign(1.7976931348623157e308, f)
    exact_f = Fraction(f)
    exact_d = Fraction(d)
    if up and exact_f < exact_d:
        return math.nextafter(f, math.inf)
    if not up and exact_f > exact_d:
        return math.nextafter(f, -math.inf)
    return f


def to_float(e: Enclosure, rounding: str) -> float | None:
    """A float64 for the enclosed real: above ``hi`` ("up"), below ``lo`` ("down"), or, for
    "nearest", the common rounding of both ends, None when they differ (refine the enclosure)."""
    if rounding == "up":
        return _float_dir(e.hi, True)
    if rounding == "down":
        return _float_dir(e.lo, False)
    a, b = float(e.lo), float(e.hi)
    return a if a == b else None


def round_log(evaluate: Callable[[int], Enclosure], rounding: str) -> float:
    """Run ``evaluate(prec)`` (an enclosure of a real at ``prec`` digits) and round it as asked.

    "up" and "down" need one pass; "nearest" doubles the precision until the enclosure's ends
    round to the same float64 (Note [directed decimals]).

    Raises:
        ValueError: an unknown rounding, or no convergence by 5 000 digits (a value that is not a
            transcendental log, e.g. exactly a float64 midpoint).
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, but got rounding={rounding!r}")
    prec = _PREC
    while prec <= 5000:
        f = to_float(evaluate(prec), rounding)
        if f is not None:
            return f
        prec *= 2
    raise ValueError("the enclosure did not separate from a float64 rounding boundary")


def log_count(n: int, rounding: str) -> float:
    """``ln n`` of a count ``n >= 1`` (a net's or a packing's size) as a float64 rounded as asked: "up" for an upper
    bound on a log covering number, "down" for a lower bound, "nearest" for an estimate (THEORY F112, logs of
    counts).  ``math.log`` rounds to nearest, so about half the counts come out below ``ln n`` (``math.log(4)`` is
    1 ulp under ``ln 4``): a certified upper bound under its own claim.  ``ln 1 = 0`` is exact.  ``n``: any integer
    type (numpy's too)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"log_count needs an integer n >= 1, but got n={n!r}")
    k = int(n)
    return round_log(lambda prec: exact(k, prec).ln(), rounding)
