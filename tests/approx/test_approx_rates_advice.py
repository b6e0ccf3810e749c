"""MLP rate against -β/s, design advice, failure modes."""

import math

import pytest

from transcover import InputError
from transcover.approx import (
    advise, delta_to_half_curve, fit_decay, fit_loglog, mlp_rate_sweep, shift_curve, simplicial_widths,
    simplicial_mlp, weak_dependence_curve,
)


def test_fits_recover_known_exponents():
    x = [1.0, 2.0, 4.0, 8.0]
    assert fit_loglog(x, [3 * v**-0.7 for v in x]) == pytest.approx(-0.7, abs=1e-12)
    assert fit_decay(x, [2 * math.exp(-0.3 * v) for v in x]) == pytest.approx(0.3, abs=1e-12)


def test_mlp_error_rate_matches_minus_beta_over_s():
    res = mlp_rate_sweep([(0.5, 1), (1.0, 1), (2.0, 1), (1.0, 2)],
                         grids={1: (8, 16, 32, 64), 2: (6, 8, 12, 16)}, eval_points=40_000)
    for f in res.fits:
        assert abs(f["fitted_exponent"] - f["theory_exponent"]) <= 0.15 * abs(f["theory_exponent"]) + 0.02
    for r in res.rows:
        assert r["measured"] <= r["bound"] and r["net_vs_reference"] <= 1e-12


def test_widths_formula_matches_the_network():
    for s, N in [(1, 5), (2, 3), (3, 2), (5, 1)]:
        assert simplicial_widths(s, N) == simplicial_mlp(lambda U: U[:, 0], s, N).widths


def test_advice_width_grows_with_samples():
    small, large = advise(1, 1.0, 32, 10_000), advise(1, 1.0, 32, 10**10)
    assert large.d_m > small.d_m and large.estimation_error < small.estimation_error
    assert small.heads == 1 and large.attention_layers == 1
    # the recommended R makes attention at most as bad as the MLP (seed 5.3)
    opt = min(large.curve, key=lambda c: c["total"])
    assert opt["attention"] <= opt["mlp"] * (1 + 1e-9)
    assert large.R >= math.log(32) / (1 - 2 * 0.25) * 0.5  # R grows like log n / (1 - 2Δ)


@pytest.mark.parametrize("args, match", [
    ((3, 1.0, 2, 100), "s=3 > n=2"), ((0, 1.0, 8, 100), "sparsity"), ((1, 0.0, 8, 100), "beta"),
    ((1, 1.0, 8, 0), "n_samples"), ((1, 1.0, 8, 100, 0.5), "delta"),
])
def test_bad_advice_arguments(args, match):
    kw = {"delta": args[4]} if len(args) > 4 else {}
    with pytest.raises(InputError, match=match):
        advise(*args[:4], **kw)


def test_failure_modes_degrade_as_stated():
    weak = weak_dependence_curve([0.0, 0.1, 0.5], n_random=200)
    base = weak.rows[0]["measured |F - g_eps|"]
    for r in weak.rows:  # floor grows linearly in eps: eps - base <= err <= budget + eps
        assert r["x"] - base - 1e-12 <= r["measured |F - g_eps|"] <= r["bound (budget + eps)"]
    half = delta_to_half_curve([0.0, 0.2, 0.4, 0.49], n=16, R=10.0)
    worst = [r["measured λ=Δ/2"] for r in half.rows]
    assert worst == sorted(worst) and worst[-1] > 100 * worst[0]
    for r in half.rows:
        assert r["measured λ=Δ/2"] <= r["lemma bound 2γ n e^{-R(1-2Δ)}"] * (1 + 1e-9)
        assert r["measured λ=0"] <= r["measured λ=Δ/2"] + 1e-15
    shift = shift_curve([0.0, 0.5], n_samples=300)
    assert shift.rows[0]["construction sup |F - g*|"] <= shift.rows[0]["bound on [-1,1]^n (budget)"]
    assert shift.rows[1]["construction sup |F - g*|"] > shift.rows[0]["bound on [-1,1]^n (budget)"]


@pytest.mark.parametrize("curve, what", [(weak_dependence_curve, "dependence strengths"), (shift_curve, "shifts")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1, True, "x"])
def test_failure_curves_refuse_knobs_that_are_not_finite_and_nonnegative(curve, what, bad):
    # a NaN passed the old ``v < 0`` check and the curve came back with NaN rows
    with pytest.raises(InputError, match=what):
        curve([0.1, bad])


def test_advice_says_when_the_estimation_side_is_vacuous():
    """At N = 1e5 every design's estimation term exceeds the target's range, and the advice was the smallest design
    without a word (stop 39 audit); the note says so and where the advised design's term falls below the range."""
    import re

    from transcover.approx import advise

    a = advise(2, 1.0, 64, 100_000)
    opt = next(c for c in a.curve if c["grid"] == a.grid)
    assert a.estimation_error >= opt["range"] and "vacuous at N=100000" in a.note
    need = float(re.search(r"from N=([0-9.e+]+)", a.note).group(1))
    best = lambda N: min(c["total"] for c in advise(2, 1.0, 64, int(N)).curve)  # noqa: E731
    assert best(need * 1.05) < opt["range"] <= best(need / 1.05)
    assert not advise(2, 1.0, 64, int(need * 1.05)).note
    # the approximation error alone beyond the range: no N helps, and the note says so (it blamed the estimation)
    assert "more samples do not help" in advise(2, 1.0, 64, 10**9, gamma=0.01, max_width=200).note
    with pytest.raises(InputError, match="at most 1e300"):
        advise(2, 1.0, 64, 10**400)
