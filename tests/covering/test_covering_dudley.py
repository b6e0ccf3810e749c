"""Dudley's integral (THEORY F11) against THEORY section 5 and scipy quadrature; the gap pieces."""

from __future__ import annotations

import math

import pytest
from scipy.integrate import quad

from transcover import InputError
from transcover.covering import (
    concentration_term,
    dudley_entropy_integral,
    dudley_inverse_square,
    generalisation_bound,
    sample_size_for_gap,
)


def test_theory_section5_values():
    A, m, D = 50.0, 1e4, 1.0
    assert dudley_inverse_square(A, m, D, alpha=1 / math.sqrt(m)).value == pytest.approx(3.948, abs=5e-4)
    opt = dudley_inverse_square(A, m, D)
    assert opt.value == pytest.approx(2.164, abs=5e-4)
    assert opt.alpha == pytest.approx(3 * math.sqrt(A / m), rel=1e-15)


@pytest.mark.parametrize("alpha", [1e-3, 0.05, 0.3])
@pytest.mark.parametrize("curve", ["inverse_square", "parametric"])
def test_numerical_integral_upper_bounds_quad(alpha, curve):
    m, D = 1e4, 1.0
    if curve == "inverse_square":
        logN = lambda e: 50.0 / e**2  # noqa: E731
    else:
        logN = lambda e: 300.0 * math.log1p(2.0 / e)  # noqa: E731
    ref_int, err = quad(lambda e: math.sqrt(logN(e)), alpha, D, limit=200, epsabs=0, epsrel=1e-12)
    ref = 4 * alpha + 12 / math.sqrt(m) * ref_int
    got = dudley_entropy_integral(lambda e: math.log(logN(e)), m, D, alpha=alpha, n_grid=4000)
    # the left Riemann sum of a decreasing integrand is an upper bound, within ln(D/alpha)/n_grid
    assert got.value >= ref * (1 - 1e-12)
    assert got.value <= ref * (1 + 2 * math.log(D / alpha) / 4000)


def test_optimised_alpha_matches_closed_form():
    A, m, D = 50.0, 1e4, 1.0
    got = dudley_entropy_integral(lambda e: math.log(A / e**2), m, D, n_grid=4000)
    closed = dudley_inverse_square(A, m, D)
    assert closed.value <= got.value <= closed.value * 1.01


def test_trivial_class_and_rich_class():
    # a one-function class (log N = 0): only the 4 alpha term remains, minimised at the grid's bottom
    got = dudley_entropy_integral(lambda e: -math.inf, 100.0, 1.0)
    assert got.value == pytest.approx(4e-10, rel=1e-6)
    # an astronomically rich class: the bound is the trivial 4D, from logs without overflow
    got = dudley_entropy_integral(lambda e: 2000.0 - 2 * math.log(e), 1e6, 1.0)
    assert got.value == pytest.approx(4.0) and got.alpha == 1.0


def test_generalisation_bound_and_sample_size():
    curve = lambda e, n: math.log(50.0 / e**2)  # noqa: E731
    g = generalisation_bound(curve, 1e6, loss_bound=1.0, delta=0.05)
    assert not g.vacuous
    assert g.gap == pytest.approx(2 * g.rademacher.value + concentration_term(1e6), rel=1e-12)
    n = sample_size_for_gap(curve, 0.05)
    assert generalisation_bound(curve, n).gap <= 0.05
    assert generalisation_bound(curve, n / 1.1).gap > 0.05
    # a Lipschitz loss of constant 2 costs like a class covered at eps/2
    g2 = generalisation_bound(curve, 1e6, loss_lipschitz=2.0)
    assert g2.gap > g.gap


@pytest.mark.parametrize("bad", [dict(m=0.0, D=1.0), dict(m=10.0, D=-1.0), dict(m=10.0, D=1.0, alpha=2.0)])
def test_bad_inputs(bad):
    with pytest.raises(InputError):
        dudley_entropy_integral(lambda e: 0.0, **bad)
