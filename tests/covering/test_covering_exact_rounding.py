"""Issue 10, defect 6: closed-form covering logs from the floats' exact values, rounded as labelled.

References: exact rational arithmetic (``Fraction``) for every ceiling, ``mpmath`` at 300 bits for
every logarithm, and, for the l_inf box, an explicit cover and an explicit packing checked exactly.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import mpmath
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover import Kind
from transcover.covering import (
    ball_log_covering,
    ball_log_covering_simple,
    ball_log_packing_lower,
    bft_matrix_log_covering,
    box_log_covering,
    box_log_covering_linf,
    linear_linf_log_covering,
    matrix_linf_log_covering,
)

mpmath.mp.prec = 300


def mp_exact(x: float) -> mpmath.mpf:
    """A float's exact value as an mpf (300 bits hold every float64 exactly)."""
    return mpmath.mpf(x)


def nearest(v: mpmath.mpf) -> float:
    """Round a 300-bit mpf to the nearest float64 (mpmath rounds to nearest on conversion)."""
    return float(v)


# ---- the reproductions of the issue ---------------------------------------------------------------

@pytest.mark.parametrize("p,B,eps,k", [(1, 1.0, 1 / 3, 4), (1, 3.6, 0.3, 13), (100, 1.0, 1 / 3, 4),
                                       (100, 3.6, 0.3, 13)])
def test_box_linf_float_boundaries(p, B, eps, k):
    assert math.ceil(Fraction(B) / Fraction(eps)) == k  # the true ratio is just above an integer
    q = box_log_covering_linf(p, B, eps)
    assert q.kind is Kind.EXACT
    assert q.value == nearest(p * mpmath.log(k))


def test_box_linf_p100_loses_no_nats():
    old = 100 * math.log(math.ceil(1.0 / (1 / 3)))  # what the float quotient gave: 100 log 3
    assert box_log_covering_linf(100, 1.0, 1 / 3).value - old > 28.7  # 100 log(4/3) = 28.77 nats


def test_maurey_and_zhang_ceilings_see_the_true_ratio():
    """ab/eps = 6.0000000000000003 for eps = float(1/6): k = ceil(36.000...) = 37, not 36."""
    assert bft_matrix_log_covering(1.0, 1.0, 1 / 6, 4, 5).value >= 37 * math.log(40)
    k = math.ceil(36 * (Fraction(1) / Fraction(1 / 3)) ** 2)  # 325
    L = 2 * math.ceil(4 * (Fraction(1) / Fraction(1 / 3)) + 2) * 10 + 1  # 2 * 15 * 10 + 1
    assert (k, L) == (325, 301)
    assert linear_linf_log_covering(1.0, 1.0, 1 / 3, 10).value >= nearest(k * mpmath.log(L))


# ---- the l_inf box against an explicit cover and packing -----------------------------------------


decimals = st.integers(1, 99).map(lambda k: k / 10)  # 0.1 .. 9.9: floats just off the decimal
dyadics = st.tuples(st.integers(1, 64), st.integers(0, 5)).map(lambda t: t[0] / 2 ** t[1])
thirds = st.integers(1, 30).map(lambda k: k / 3)


def one_axis_cover(B: Fraction, eps: Fraction) -> list[Fraction]:
    """Greedy left-to-right interval cover of [-B, B] (optimal on a line), centres clipped to it."""
    centres, reach = [], -B
    while not centres or reach < B:
        c = min(reach + eps, B)
        centres.append(c)
        reach = c + eps
    return centres


def covers_box(centres: list[tuple[Fraction, ...]], B: Fraction, eps: Fraction) -> bool:
    """Closed cubes cover [-B, B]^p iff every cell of their boundary arrangement is covered."""
    p = len(centres[0])
    cuts = sorted({-B, B} | {c[i] + s * eps for c in centres for i in range(p) for s in (-1, 1)
                             if -B <= c[i] + s * eps <= B})
    probes = cuts + [(x + y) / 2 for x, y in zip(cuts, cuts[1:])]
    return all(any(all(abs(pt[i] - c[i]) <= eps for i in range(p)) for c in centres)
               for pt in itertools.product(probes, repeat=p))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2]), st.one_of(decimals, dyadics, thirds), st.one_of(decimals, dyadics, thirds))
def test_box_linf_is_the_exact_covering_number(p, B, eps):
    Bf, ef = Fraction(B), Fraction(eps)
    axis = one_axis_cover(Bf, ef)
    k = len(axis)
    if k ** p > 200:  # keep the exact cover check small
        return
    # an explicit cover with k^p cubes ...
    grid = list(itertools.product(axis, repeat=p))
    assert covers_box(grid, Bf, ef)
    # ... and k^p points pairwise > 2 eps apart (each needs its own closed eps-cube)
    pts_axis = [-Bf + i * (2 * Bf / (k - 1)) for i in range(k)] if k > 1 else [Fraction(0)]
    pts = list(itertools.product(pts_axis, repeat=p))
    assert all(max(abs(x - y) for x, y in zip(a, b)) > 2 * ef for a, b in itertools.combinations(pts, 2))
    q = box_log_covering_linf(p, B, eps)
    assert q.value == nearest(p * mpmath.log(k))
    up = box_log_covering_linf(p, B, eps, rounding="up")
    down = box_log_covering_linf(p, B, eps, rounding="down")
    assert up.kind is Kind.CERTIFIED_UPPER and down.kind is Kind.CERTIFIED_LOWER and q.kind is Kind.EXACT
    assert mp_exact(down.value) <= p * mpmath.log(k) <= mp_exact(up.value)
    assert math.nextafter(down.value, math.inf) >= up.value or down.value == up.value  # adjacent floats


# ---- every other closed form rounds to the side of its claim --------------------------------------

radii = st.one_of(decimals, dyadics, thirds, st.floats(1e-6, 1e6))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10**9), radii, radii)
def test_ball_bounds_round_outward(p, B, eps):
    Bm, em = mp_exact(B), mp_exact(eps)
    assert mp_exact(ball_log_covering(p, B, eps).value) >= p * mpmath.log(1 + 2 * Bm / em)
    low_q = ball_log_packing_lower(p, B, eps)
    assert low_q.kind is Kind.CERTIFIED_LOWER  # a proven lower bound, not the value of log N (red team 162)
    low = low_q.value
    assert mp_exact(low) <= max(0, p * mpmath.log(Bm / em))
    assert mp_exact(box_log_covering(p, B, eps).value) >= p * mpmath.log(1 + 2 * Bm * mpmath.sqrt(p) / em)
    if eps <= B:
        assert mp_exact(ball_log_covering_simple(p, B, eps).value) >= p * mpmath.log(3 * Bm / em)


def f2_reference(ab, n: int, k: int):
    """THEORY F2's matrix bound computed independently (mpmath, the exact binomial): one column ``(36 ab^2 + 1) ln L``;
    k columns ``ln C(K + 2k, k) + (36 A^2 + k) ln L(A)``, ``K = c k``, ``A = ab (1 + 1/c)``, ``L(A) = 2 ceil(4A + 2) n
    + 1``, at the library's grid multiplier c (any c is valid; its float choice may differ by one here, so the least
    over c - 1, c, c + 1).  The library bounds ``ln C`` by ``k(1 + ln(c + 2))``, so it is never below this; the bound
    without the union over column-norm profiles (red team 205) always is."""
    from transcover.covering._matrix_covers import profile_multiplier

    def main(A):
        return (36 * A**2 + k) * mpmath.log(2 * int(mpmath.ceil(4 * A + 2)) * n + 1)

    if k == 1:
        return main(ab)
    c = int(profile_multiplier(float(mpmath.log(ab)), n, math.log(k)))
    return min(mpmath.log(math.comb(c * k + 2 * k, k)) + main(ab * (1 + mpmath.mpf(1) / c))
               for c in (c - 1, c, c + 1) if c >= 1)


@settings(max_examples=40, deadline=None)
@given(radii, radii, radii, st.integers(1, 10**6), st.integers(1, 64))
def test_matrix_covers_round_outward(a, b, eps, n, k):
    ab = Fraction(a) * Fraction(b) / Fraction(eps)
    L = 2 * math.ceil(4 * ab + 2) * n + 1
    mab = mpmath.mpf(ab.numerator) / ab.denominator
    assert mp_exact(linear_linf_log_covering(a, b, eps, n).value) >= math.ceil(36 * ab * ab) * mpmath.log(L)
    assert mp_exact(matrix_linf_log_covering(a, b, eps, n, k).value) >= f2_reference(mab, n, k)
    assert mp_exact(bft_matrix_log_covering(a, b, eps, 3, k).value) >= math.ceil(ab * ab) * mpmath.log(6 * k)


def test_rounding_argument_is_checked():
    from transcover import InputError

    with pytest.raises(InputError, match="rounding must be"):
        box_log_covering_linf(2, 1.0, 0.5, rounding="sideways")


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.floats(-20.0, 60.0), st.floats(690.0, 2000.0), st.integers(-5, 40).map(float),
                 st.sampled_from([math.log(k) for k in (3, 6, 10, 1 / 3, 0.1)])),
       st.integers(1, 10**9))
def test_zhang_log_factor_from_logs_rounds_up(log_x, n):
    from transcover.covering._matrix_covers import _zhang_log_factor, matrix_linf_loglog

    x = mpmath.exp(mp_exact(log_x))  # the float log taken at its exact value
    L = 2 * int(mpmath.ceil(4 * x + 2)) * n + 1
    assert mp_exact(_zhang_log_factor(log_x, n)) >= mpmath.log(L)
    ll = matrix_linf_loglog(log_x, 0.0, 0.0, n, 3)
    assert mp_exact(ll) >= mpmath.log(f2_reference(x, n, 3))


@settings(max_examples=60, deadline=None)
@given(st.one_of(decimals, thirds, dyadics),
       st.one_of(st.floats(-8.0, 3.0), st.sampled_from([0.0, -math.log(3.0), -math.log(6.0)])),
       st.integers(1, 10**6), st.integers(1, 8), st.integers(1, 8), st.booleans())
def test_vectorised_matrix_costs_round_up(norm, log_e, n, rows, cols, parametric):
    """``_transformer._exact_loglog`` (the per-matrix costs of the model bound) against mpmath."""
    import numpy as np

    from transcover.covering._transformer import MatrixTerm, _exact_loglog, _term_arrays

    term = MatrixTerm(0, "W", (rows, cols), 0.0, norm, norm)
    got = float(_exact_loglog(_term_arrays([term], [parametric]), np.array([log_e]), n)[0])
    e = mpmath.exp(mp_exact(log_e))
    if parametric:  # F1: p ln(1 + 2r/e)
        ref = mpmath.log(rows * cols * mpmath.log(1 + 2 * mp_exact(norm) / e))
    else:  # F2 at e/2, ab = 2a/e, with the union over column-norm profiles
        ref = mpmath.log(f2_reference(2 * mp_exact(norm) / e, n, cols))
    assert mp_exact(got) >= ref
