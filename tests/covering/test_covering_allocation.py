"""Lemma G.1 (THEORY F4) against scipy's SLSQP, and the mixed allocation against the same."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from transcover import InputError
from transcover.covering import CoverCost, allocate_mixed, budget_allocation, budget_allocation_log


def _slsqp(objective, c, eps, x0):
    """Independent optimum: SLSQP over softmax weights z, eps_i = eps * softmax(z)_i / c_i.

    The parametrisation satisfies sum_i c_i eps_i = eps exactly, so the solver runs unconstrained
    (bounded z) and cannot report an infeasible split; the objective is rescaled to O(1).
    """
    def split(z):
        w = np.exp(z - z.max())
        return eps * (w / w.sum()) / c

    z0 = np.log(np.asarray(x0) * c / eps)
    scale = float(objective(split(z0)))
    res = minimize(lambda z: objective(split(z)) / scale, z0, method="SLSQP", bounds=[(-40, 40)] * len(c),
                   options={"ftol": 1e-15, "maxiter": 2000})
    assert res.success, res.message
    res.fun = float(objective(split(res.x)))
    return res


def test_theory_example():
    a, c = np.array([3, 1, 7, .5]), np.array([2, 5, 1, .3])
    r = budget_allocation(a, c, 0.1)
    assert r.total == pytest.approx(41885.599, abs=1e-3)
    assert r.eps_i == pytest.approx((.015299, .007816, .025567, .015846), abs=1e-6)
    res = _slsqp(lambda x: np.sum(a / x**2), c, 0.1, np.full(4, 0.1 / c.sum()))
    assert r.total <= res.fun * (1 + 1e-9)  # the closed form is the minimum
    assert r.total == pytest.approx(res.fun, rel=1e-6)
    assert math.fsum(ci * e for ci, e in zip(c, r.eps_i)) == pytest.approx(0.1, rel=1e-12)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 20), st.floats(0.05, 20)), min_size=2, max_size=6),
       st.floats(0.01, 2.0))
def test_closed_form_matches_slsqp(ac, eps):
    a = np.array([x for x, _ in ac])
    c = np.array([y for _, y in ac])
    r = budget_allocation(a, c, eps)
    x0 = np.array(r.eps_i) * np.exp(np.linspace(-0.3, 0.3, len(a)))  # start off the optimum
    x0 *= eps / np.dot(c, x0)
    res = _slsqp(lambda x: np.sum(a / x**2), c, eps, x0)
    assert r.total <= res.fun * (1 + 1e-9)
    assert r.total == pytest.approx(res.fun, rel=1e-5)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 10), st.floats(0.1, 10), st.integers(1, 50), st.booleans()),
                min_size=2, max_size=4), st.floats(0.02, 1.0))
def test_mixed_allocation_matches_slsqp(rows, eps):
    costs, fns = [], []
    for a, c, p, inv in rows:
        if inv:
            costs.append(CoverCost(math.log(c), "inverse_square", log_A=math.log(a)))
            fns.append(lambda e, a=a: a / e**2)
        else:
            costs.append(CoverCost(math.log(c), "parametric", p=p, log_k=math.log(a)))
            fns.append(lambda e, a=a, p=p: p * np.log1p(a / e))
    c = np.array([r[1] for r in rows])
    r = allocate_mixed(costs, eps)
    assert math.fsum(ci * e for ci, e in zip(c, r.eps_i)) <= eps  # the split is sound
    x0 = np.full(len(c), eps / c.sum())
    res = _slsqp(lambda x: sum(f(xi) for f, xi in zip(fns, x)), c, eps, x0)
    assert r.total <= res.fun * (1 + 1e-6)
    assert r.total == pytest.approx(res.fun, rel=1e-4)


def test_log_space_survives_huge_coefficients():
    # c_i ~ e^800 would overflow float64; the log form stays finite
    r = budget_allocation_log([0.0, 1.0], [800.0, 2.0], 0.1)
    assert math.isfinite(r.log_total) and r.total == math.inf
    assert r.log_total == pytest.approx(3 * r.log_gamma - 2 * math.log(0.1), rel=1e-14)


def test_zero_cost_and_zero_coefficient_terms():
    r = budget_allocation([0.0, 2.0, 1.0], [1.0, 1.0, 0.0], 0.5)
    assert r.eps_i[0] == 0.0 and r.eps_i[2] == math.inf
    assert r.total == pytest.approx(2.0 / 0.5**2, rel=1e-12)


@pytest.mark.parametrize("bad", [dict(a=[1, -1], c=[1, 1], eps=0.1), dict(a=[1], c=[1, 2], eps=0.1),
                                 dict(a=[1], c=[1], eps=0.0), dict(a=[1], c=[float("inf")], eps=0.1)])
def test_bad_inputs(bad):
    with pytest.raises(InputError):
        budget_allocation(**bad)


@pytest.mark.parametrize("log_c", [-700.0, -800.0, -1500.0])
@pytest.mark.parametrize("family", ["l21", "spectral"])
def test_a_term_that_barely_moves_the_output_costs_almost_nothing_not_nan(log_c, family):
    """Stop 35's red team: a bias with a coefficient ``e^-1500`` gets a scale whose ``2r/e`` underflows, and the
    parametric cover's ``ln softplus`` became ``log(0)``: a raw ValueError (``CoverCost``) or a NaN ``log log N``
    (the certified route).  ``ln log1p(x) <= ln x`` bounds it above there: the total is the weight matrix's own."""
    from transcover.covering._transformer import MatrixTerm, transformer_log_covering

    W = MatrixTerm(0, "W_1", (4, 4), 0.0, 2.0, 1.0, group="ffn")
    alone = transformer_log_covering([W], 1.0, 100, family=family)
    both = transformer_log_covering([W, MatrixTerm(0, "b_1", (1, 4), log_c, 1.0, 1.0, vector=True, group="ffn")],
                                    1.0, 100, family=family)
    assert math.isfinite(both.log_log_N) and both.log_log_N >= alone.log_log_N - 1e-9
    assert CoverCost(log_c=0.0, form="parametric", p=4, log_k=0.0).log_cost(800.0) == math.log(4) - 800.0


def test_mixed_allocation_refuses_infinite_logs():
    for bad in (CoverCost(log_c=math.inf, form="inverse_square", log_A=0.0),
                CoverCost(log_c=0.0, form="inverse_square", log_A=math.inf),
                CoverCost(log_c=math.nan, form="parametric", p=3, log_k=0.0)):
        with pytest.raises(InputError, match="finite or -inf"):
            allocate_mixed([bad], 0.1)
