"""Finite-class (Occam) bounds of THEORY F18: the certified kl inversion against 60-digit references."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover._errors import InputError
from transcover.covering import (
    binary_kl,
    catoni_occam_bound,
    error_rate_upper,
    kl_inverse_upper,
    kl_occam_bound,
    occam_bounds,
    occam_complexity,
    sqrt_occam_bound,
)

mpmath.mp.dps = 50

probs = st.one_of(st.sampled_from([0.0, 1e-300, 1e-9, 0.5, 1 - 1e-12]), st.floats(0.0, 1.0))
complexities = st.one_of(st.sampled_from([0.0, 1e-300, 1e-12, 50.0]), st.floats(0.0, 10.0))


def _kl_mp(q, p):
    q, p = mpmath.mpf(q), mpmath.mpf(p)
    if p >= 1:
        return mpmath.mpf(0) if q >= 1 else mpmath.inf
    a = q * (mpmath.log(q) - mpmath.log(p)) if q > 0 else mpmath.mpf(0)
    b = (1 - q) * (mpmath.log1p(-q) - mpmath.log1p(-p)) if q < 1 else mpmath.mpf(0)
    return a + b


def _kl_inverse_mp(q, c):
    """sup{p in [q, 1]: kl(q||p) <= c} to within 2^-160, by bisection at 50 digits (independent of the code)."""
    q, c = mpmath.mpf(q), mpmath.mpf(c)
    if q >= 1:
        return mpmath.mpf(1)
    lo, hi = q, mpmath.mpf(1)
    for _ in range(160):
        mid = (lo + hi) / 2
        if _kl_mp(q, mid) > c:
            hi = mid
        else:
            lo = mid
    return lo


@settings(max_examples=60, deadline=None)
@given(q=probs, c=complexities)
def test_kl_inverse_is_certified_and_tight_against_a_50_digit_reference(q, c):
    got = kl_inverse_upper(q, c)
    ref = _kl_inverse_mp(q, c)
    assert q <= got <= 1.0
    # certified: kl(q || got) >= c exactly (50 digits), so got is at or above the supremum
    assert got == 1.0 or _kl_mp(q, got) >= c
    # tight: rounding slack of a few hundred ulp at most (bisection to adjacent floats)
    assert mpmath.mpf(got) - ref <= 1e-12 + 1e-9 * ref


@settings(max_examples=80, deadline=None)
@given(q=probs, c=complexities, dq=st.floats(0.0, 0.5), dc=st.floats(0.0, 2.0))
def test_kl_inverse_is_monotone(q, c, dq, dc):
    q2 = min(1.0, q + dq)
    assert kl_inverse_upper(q, c) <= kl_inverse_upper(q2, c) + 1e-12
    assert kl_inverse_upper(q, c) <= kl_inverse_upper(q, c + dc)


@pytest.mark.parametrize("c", [1e-8, 1e-3, 0.1, math.log(2), 3.0])
def test_kl_inverse_at_zero_error_is_one_minus_exp(c):
    exact = -math.expm1(-c)
    got = kl_inverse_upper(0.0, c)
    assert got >= exact and got - exact <= 64 * math.ulp(exact)


def test_binary_kl_matches_reference():
    for q, p in [(0.1, 0.5), (0.0, 0.3), (0.9, 0.95), (1e-6, 1e-3)]:
        assert math.isclose(binary_kl(q, p), float(_kl_mp(q, p)), rel_tol=1e-13, abs_tol=1e-300)
    assert binary_kl(0.5, 0.0) == math.inf and binary_kl(0.5, 1.0) == math.inf and binary_kl(0.0, 0.0) == 0.0


@settings(max_examples=60, deadline=None)
@given(bits=st.floats(0.0, 1e6), n=st.integers(1, 10**7), delta=st.floats(1e-12, 0.999))
def test_complexity_is_rounded_up(bits, n, delta):
    exact = (mpmath.mpf(bits) * mpmath.log(2) + mpmath.log(1 / mpmath.mpf(delta))) / n
    got = occam_complexity(bits, n, delta)
    assert mpmath.mpf(got) >= exact and mpmath.mpf(got) <= exact * (1 + 1e-13) + 1e-300


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10**9), data=st.data())
def test_error_rate_is_rounded_up(n, data):
    k = data.draw(st.integers(0, n))
    q = error_rate_upper(k, n)
    assert Fraction(q) >= Fraction(k, n) and q - k / n <= math.ulp(k / n)


@settings(max_examples=60, deadline=None)
@given(q=st.floats(0.0, 1.0), bits=st.integers(0, 100_000), n=st.integers(1, 10**6))
def test_kl_is_tightest_catoni_and_sqrt_are_above_it(q, bits, n):
    grid = (0.5, 1.0, 2.0, 4.0)
    kl_same_delta = kl_occam_bound(q, bits, n, 0.05 / len(grid))  # Catoni spends delta/|grid| per C
    assert catoni_occam_bound(q, bits, n, 0.05, C=grid) >= kl_same_delta - 1e-12
    # Pinsker: kl(q||p) >= 2 (p - q)^2, so the kl inverse is at most q + sqrt(c / 2)
    assert sqrt_occam_bound(q, bits, n, 0.05) >= kl_occam_bound(q, bits, n, 0.05) - 1e-12
    for b in (catoni_occam_bound(q, bits, n, 0.05), sqrt_occam_bound(q, bits, n, 0.05), kl_occam_bound(q, bits, n, 0.05)):
        assert q <= b <= 1.0


def test_catoni_matches_its_formula_at_one_c():
    q, bits, n, delta, C = 0.02, 500, 10_000, 0.05, 3.0
    c = (mpmath.mpf(bits) * mpmath.log(2) + mpmath.log(1 / mpmath.mpf(delta))) / n
    exact = (1 - mpmath.exp(-C * mpmath.mpf(q) - c)) / (1 - mpmath.exp(-C))
    got = catoni_occam_bound(q, bits, n, delta, C=C)
    assert mpmath.mpf(got) >= exact and mpmath.mpf(got) - exact <= 1e-13


def test_numbers_of_the_issue_scale():
    # THEORY F18's rough scale: ~6 kbit, 1% training error, n = 1e5 -> about 0.04-0.07
    b = kl_occam_bound(0.01, 6000, 100_000, 0.05)
    assert 0.04 <= b <= 0.07
    r = occam_bounds(0, 1000, 300, 0.05)
    assert r.kl < r.sqrt and r.kl == kl_inverse_upper(0.0, occam_complexity(300, 1000, 0.05))


def test_occam_bound_holds_over_a_finite_class_by_simulation():
    """A finite class of 64 threshold rules on U[0,1] with label noise; true errors are exact.

    Over 300 seeded draws of n = 200 samples, the fraction of draws in which *some* rule's kl bound
    is below its true error must be at most delta = 0.05 (uniform convergence over the class, each
    rule coded in 6 bits).  Binomial(300, 0.05) exceeds 27 with probability < 1e-3.
    """
    g = torch.Generator().manual_seed(0)
    thresholds = torch.linspace(0.0, 1.0, 64, dtype=torch.float64)
    noise = 0.2
    # rule t: predict 1 iff x > t; data y = 1{x > 0.5} flipped w.p. noise.  True error is exact:
    true_err = noise + (1 - 2 * noise) * (thresholds - 0.5).abs()
    failures = 0
    for _ in range(300):
        x = torch.rand(200, generator=g, dtype=torch.float64)
        y = (x > 0.5) ^ (torch.rand(200, generator=g, dtype=torch.float64) < noise)
        wrong = ((x[None, :] > thresholds[:, None]) != y[None, :]).sum(dim=1)
        bounds = [kl_occam_bound(error_rate_upper(int(k), 200), 6, 200, 0.05) for k in wrong]
        failures += any(b < float(e) for b, e in zip(bounds, true_err))
    assert failures <= 27


@pytest.mark.parametrize("call", [
    lambda: kl_inverse_upper(1.5, 0.1), lambda: kl_inverse_upper(0.1, -1.0), lambda: kl_inverse_upper(math.nan, 0.1),
    lambda: occam_complexity(-1, 10, 0.05), lambda: occam_complexity(10, 0, 0.05), lambda: occam_complexity(10, 5, 1.0),
    lambda: error_rate_upper(6, 5), lambda: catoni_occam_bound(0.1, 10, 10, 0.05, C=()),
])
def test_bad_input_raises(call):
    with pytest.raises(InputError):
        call()


@pytest.mark.parametrize("units", [9, 16, 23, 53, 601])
def test_catoni_with_a_subnormal_delta_is_never_below_its_formula(units):
    """Stop 35's red team: ``delta / |grid|`` rounded *up* where it is subnormal (by up to half its spacing, far
    beyond the log's relative margin): at ``delta = 5 * 2^-1074`` the bound was 0.5249999 against the exact
    0.5250865.  Each C's share is now rounded down (or refused where no positive float is below it)."""
    from transcover.covering._finite_class import catoni_occam_bound

    delta = units * 2.0**-1074
    grid = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
    got = catoni_occam_bound(0.0, 0, 1000, delta, C=grid)
    with mpmath.workdps(60):
        c = mpmath.log(mpmath.mpf(len(grid)) / (units * mpmath.mpf(2) ** -1074)) / 1000
        exact = min((1 - mpmath.exp(-c)) / (1 - mpmath.exp(-x)) for x in grid)
        assert mpmath.mpf(got) >= min(exact, 1)


def test_catoni_refuses_a_delta_whose_share_underflows():
    from transcover.covering._finite_class import catoni_occam_bound

    with pytest.raises(InputError, match="underflows float64"):
        catoni_occam_bound(0.0, 0, 1000, 5 * 2.0**-1074)


def test_a_negative_zero_error_is_zero():
    """``-0.0`` passed the input check, and the kl bisection read its (negative) bit pattern: a math domain error."""
    assert kl_occam_bound(-0.0, 10, 100, 0.05) == kl_occam_bound(0.0, 10, 100, 0.05)
    assert kl_inverse_upper(-0.0, 0.1) == kl_inverse_upper(0.0, 0.1)


def test_kl_at_a_subnormal_p_far_below_q_is_finite_and_exact():
    """``(q - p)/p`` overflowed for a subnormal ``p`` below ``q``: ``binary_kl(0.5, 1e-310)`` was inf (exact 356.2)."""
    from transcover.covering._finite_class import _kl_with_error, binary_kl

    for q, p in ((0.5, 1e-310), (1.0 - 2.0**-53, 5e-324), (2.0**-20, 2.0**-1070)):
        value, err = _kl_with_error(q, p)
        assert math.isfinite(value) and err < 1e-12 * value
        with mpmath.workdps(60):
            Q, Pm = mpmath.mpf(q), mpmath.mpf(p)
            exact = Q * mpmath.log(Q / Pm) + (1 - Q) * (mpmath.log1p(-Q) - mpmath.log1p(-Pm))
            assert abs(mpmath.mpf(value) - exact) <= mpmath.mpf(err)
        assert binary_kl(q, p) == value


@pytest.mark.parametrize("call", ["q", "bits", "n", "C"])
def test_integers_beyond_float64_are_refused_in_one_line(call):
    """``10**400`` raised OverflowError from ``math.isfinite``."""
    from transcover.covering._finite_class import catoni_occam_bound

    big = 10**400
    with pytest.raises(InputError):
        {"q": lambda: kl_occam_bound(big, 10, 100, 0.05), "bits": lambda: kl_occam_bound(0.1, big, 100, 0.05),
         "n": lambda: kl_occam_bound(0.1, 10, big, 0.05),
         "C": lambda: catoni_occam_bound(0.1, 10, 100, 0.05, C=(1.0, big))}[call]()


@pytest.mark.parametrize("call", [
    lambda: occam_complexity(True, 10, 0.05), lambda: error_rate_upper(True, 5), lambda: error_rate_upper(1, True),
    lambda: kl_inverse_upper(0.1, True), lambda: catoni_occam_bound(0.1, 10, 10, 0.05, C=(True,)),
    lambda: occam_complexity(10, 10, True),
], ids=["bits", "mistakes", "n", "c", "C", "delta"])
def test_booleans_are_not_counts(call):
    """``True`` passed as 1 bit, 1 mistake, ``c = 1`` (left open at stop 35)."""
    with pytest.raises(InputError):
        call()


def test_occam_bounds_show_the_bits_rounded_up():
    from transcover.covering._finite_class import occam_bounds

    r = occam_bounds(3, 1000, 1234.25)
    assert r.description_bits == 1235  # int() showed 1234, a shorter code than the one the bounds used
    assert r.kl == kl_occam_bound(error_rate_upper(3, 1000), 1234.25, 1000, 0.05)
    with pytest.raises(InputError):
        occam_bounds(3, 1000, math.inf)


def test_kl_inverse_refuses_a_complexity_beyond_float64_with_one_line():
    # red team 204: c = 10**400 (an int) raised OverflowError in math.isnan instead of the InputError of a bad c
    for c in (10**400, -(10**400), math.nan, -1e-300):
        with pytest.raises(InputError) as info:
            kl_inverse_upper(0.1, c)
        message = str(info.value)
        assert message.startswith("c must be a number >= 0 (within float64, or inf), but got c="), message
        assert "\n" not in message
    assert kl_inverse_upper(0.1, math.inf) == 1.0 and kl_inverse_upper(0.1, 10**300) == 1.0  # within float64: fine


@pytest.mark.parametrize("delta", [0.0, 1.0, 1.5, -0.1, math.nan, math.inf, True, "0.05"])
def test_every_delta_check_says_the_same_line(delta):
    """The Occam, Catoni, concentration, Dudley and encoding-size functions refuse a delta outside (0, 1) (a bool or a
    string too: ``"0.05"`` was a TypeError in ``random_sign_dimension``) with the one shared message."""
    from transcover.approx._encodings import random_sign_dimension
    from transcover.covering._generalisation import concentration_term

    calls = [lambda: occam_complexity(10.0, 100, delta),
             lambda: catoni_occam_bound(0.1, 10.0, 100, delta),
             lambda: concentration_term(100.0, delta=delta),
             lambda: random_sign_dimension(10, 0.5, failure_prob=delta),
             lambda: random_sign_dimension(10, delta)]
    for call in calls:
        with pytest.raises(InputError, match=r"must be a finite number in \(0, 1\), but got"):
            call()
