"""The fast paths of the covering curve give the floats of the plain ones (Note [curve on a grid], Note [budget in
floats], ``_ScalesAt``): the grid evaluation against the scalar curve, the row-wise log-sum-exp against the scalar
one, the precomputed KKT scales against ``_log_eps_at_arrays``, and the float pre-check of the budget never says
"holds" where the exact check says it does not."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from transcover.covering import _allocation as A
from transcover.covering._model_bound import model_covering_curve
from transcover.covering._transformer import CoveringCurve, MatrixTerm, _lse_up, _lse_up_rows


def _terms(rng: np.random.Generator, n: int) -> list[MatrixTerm]:
    out = []
    for i in range(n):
        vector = bool(rng.random() < 0.2)
        shape = (1, int(rng.integers(2, 64))) if vector else (int(rng.integers(2, 64)), int(rng.integers(1, 64)))
        l21 = 0.0 if rng.random() < 0.05 else float(np.exp(rng.normal(0.0, 2.0)))
        spectral = l21 if vector else l21 / float(rng.uniform(1.0, 8.0))
        log_c = -math.inf if rng.random() < 0.05 else float(rng.normal(0.0, 4.0))
        out.append(MatrixTerm(i // 4, f"W{i}", shape, log_c, l21, spectral, vector=vector,
                              group="attention" if i % 2 else "ffn"))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("family", ["l21", "spectral", "best"])
def test_grid_evaluation_is_the_scalar_curve(seed, family):
    rng = np.random.default_rng(seed)
    terms = _terms(rng, int(rng.integers(1, 14)))
    if all(t.log_c == -math.inf for t in terms):
        terms[0] = MatrixTerm(0, "W0", terms[0].shape, 0.0, 1.0, 0.5)
    curve = CoveringCurve(terms, family=family)
    eps = np.concatenate([np.exp(rng.uniform(-12.0, 3.0, 150)), [1e-300, 1e300, 1.0, 2.0**-1074]])
    for n_points in (1, 37, 10**6):
        grid = curve.many(eps, n_points)
        plain = np.array([curve(float(e), n_points) for e in eps])
        assert np.array_equal(grid, plain), np.flatnonzero(grid != plain)


@pytest.mark.parametrize("head", [False, True])
def test_model_curves_on_a_grid_are_their_scalar_values(head):
    rng = np.random.default_rng(7)
    terms = _terms(rng, 12)
    h = ([(8, 5), (5, 1)], [2.0, 3.0], [0.5, 0.1], 1.0, 7.0) if head else None
    for family in ("auto", "best"):
        curve = model_covering_curve(terms, family=family, seq_len=16, head=h)
        eps = np.exp(rng.uniform(-12.0, 3.0, 120))
        for n in (1.0, 250.0, 3.3e7):
            assert np.array_equal(curve.many(eps, n), np.array([curve(float(e), n) for e in eps]))


@given(st.lists(st.lists(st.one_of(st.floats(-800.0, 800.0), st.just(-math.inf)), min_size=5, max_size=5),
                min_size=1, max_size=12))
def test_rowwise_log_sum_exp_is_the_scalar_one(rows):
    X = np.array(rows, dtype=np.float64)
    got = _lse_up_rows(X)
    want = np.array([_lse_up(r) for r in X])
    assert np.array_equal(got, want, equal_nan=True)


def test_precomputed_kkt_scales_are_the_formula():
    rng = np.random.default_rng(1)
    for _ in range(400):
        n = int(rng.integers(1, 30))

        def col(scale: float) -> np.ndarray:
            x = rng.normal(size=n) * scale
            x[rng.random(n) < 0.1] = -math.inf
            return x

        ar = {"log_c": col(float(rng.choice([1, 30, 300]))), "inv": rng.random(n) < 0.5,
              "log_A": col(float(rng.choice([1, 50]))), "log_p": col(5.0) + 5.0,
              "log_k": col(float(rng.choice([1, 40])))}
        scales = A._ScalesAt(ar)
        for log_lam in rng.normal(size=4) * float(rng.choice([1.0, 60.0, 1e4])):
            assert np.array_equal(scales(float(log_lam)), A._log_eps_at_arrays(ar, float(log_lam)), equal_nan=True)


def _exact_sum_below(lc, le, eps) -> bool:
    """The exact check alone (the pre-check switched off)."""
    saved = A._float_sum_below
    A._float_sum_below = lambda *a: False
    try:
        return A.budget_holds(lc, le, eps)
    finally:
        A._float_sum_below = saved


@given(st.lists(st.tuples(st.floats(-60.0, 60.0), st.floats(-60.0, 60.0)), min_size=1, max_size=20),
       st.floats(-1e-9, 1e-9), st.sampled_from([1e-300, 1e-3, 1.0, 1e200]))
def test_float_pre_check_never_claims_what_the_exact_check_refuses(pairs, rel, eps):
    """Splits placed right at the budget (``sum = eps (1 + rel)``, rel within 1e-9): the pre-check may say
    undecided, never "holds" where the exact sum exceeds eps."""
    lc = np.array([c for c, _ in pairs])
    le = np.array([e for _, e in pairs])
    # scale the split so its float sum is eps (1 + rel)
    shift = math.log(eps) + math.log1p(rel) - A._logsumexp(lc + le)
    le = le + shift
    exact = _exact_sum_below(lc, le, eps)
    if A._float_sum_below([float(v) for v in lc], [float(v) for v in le], eps):
        assert exact
    assert A.budget_holds(lc, le, eps) == exact


def test_float_pre_check_decides_a_split_with_room_and_leaves_a_tight_one():
    lc, le = [0.0, math.log(2.0)], [math.log(0.25), math.log(0.25)]  # 0.25 + 0.5 = 0.75
    assert A._float_sum_below(lc, le, 1.0)
    assert not A._float_sum_below(lc, le, 0.75)  # exactly at the budget: left to the exact check
    assert A.budget_holds(lc, le, 0.75) == _exact_sum_below(lc, le, 0.75)
    assert not A._float_sum_below([800.0], [0.0], 1e308)  # exp overflows: undecided
    assert not A._float_sum_below([math.nan], [0.0], 1.0)
    assert A._float_sum_below([-math.inf, 0.0], [math.inf, math.log(0.5)], 1.0)  # c = 0 takes no budget


def _random_costs(rng: np.random.Generator, n: int) -> list:
    out = []
    for _ in range(n):
        lc = -math.inf if rng.random() < 0.05 else float(rng.normal(0, rng.choice([1, 10, 100])))
        if rng.random() < 0.5:
            la = -math.inf if rng.random() < 0.05 else float(rng.normal(0, rng.choice([1, 20, 200])))
            out.append(A.CoverCost(lc, "inverse_square", log_A=la))
        else:
            p = 0 if rng.random() < 0.03 else int(rng.integers(1, 5000))
            lk = -math.inf if rng.random() < 0.05 else float(rng.normal(0, rng.choice([1, 30])))
            out.append(A.CoverCost(lc, "parametric", p=p, log_k=lk))
    return out


def test_replayed_bisection_is_the_plain_one(monkeypatch):
    """Note [replayed bisection]: kkt_split's split with the replay is the plain bisection's, float for float, on
    random mixes of cost forms, magnitudes up to e^600 and dead terms (the plain one patched in as the reference)."""
    rng = np.random.default_rng(3)
    plain = lambda excess, size, n: A.bisect_log_multiplier(excess)  # noqa: E731
    checked = 0
    for _ in range(600):
        costs = _random_costs(rng, int(rng.integers(1, 50)))
        if not any(c.log_c > -math.inf for c in costs):
            continue
        eps = float(np.exp(rng.normal(0, rng.choice([1, 10, 200]))))
        if not 0 < eps < math.inf:
            continue
        got = A.kkt_split(costs, eps)
        with monkeypatch.context() as mp:
            mp.setattr(A, "replayed_bisection", plain)
            want = A.kkt_split(costs, eps)
        assert np.array_equal(got, want, equal_nan=True)
        checked += 1
    assert checked > 500
