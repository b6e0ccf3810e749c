"""min(norm-based, parametric) covers inside Lemma G.1 (issue 12 item 3) and the certified split.

References are independent: scipy's SLSQP for the allocation, an exhaustive enumeration of the
cover forms (each a convex problem) for the non-convex minimum, mpmath at 60 digits for the
budget, greedy packings for the parametric cover, the closed-form lower bound (B/eps)^p.
"""

from __future__ import annotations

import itertools
import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from transcover.covering import (CoverCost, MatrixTerm, allocate_mixed, model_bound, model_terms,
                                 spectral_ball_matrix_log_covering, transformer_log_covering)
from transcover.covering._allocation import budget_holds, fit_to_budget
from transcover.covering._transformer import _exact_loglog, _term_arrays


def _mp_budget(log_c, log_e) -> mpmath.mpf:
    """sum_i exp(log_c_i + log_e_i) at 60 digits, floats taken at their exact binary values."""
    with mpmath.workdps(60):
        return mpmath.fsum(mpmath.exp(mpmath.mpf(c) + mpmath.mpf(e))
                           for c, e in zip(log_c, log_e) if c != -math.inf and e != -math.inf)


def _slsqp_min(fs, c, eps):
    """min sum_i f_i(e_i) s.t. sum_i c_i e_i = eps, by SLSQP over softmax weights, three starts."""
    def split(z):
        w = np.exp(z - z.max())
        return eps * (w / w.sum()) / c

    def obj(z):
        return sum(f(x) for f, x in zip(fs, split(z)))

    best = (math.inf, None)
    for z0 in (np.zeros(len(c)), np.log(c), -np.log(c)):
        s = obj(z0)
        r = minimize(lambda z: obj(z) / s, z0, method="SLSQP", bounds=[(-40, 40)] * len(c),
                     options={"ftol": 1e-14, "maxiter": 1000})
        v = obj(r.x)
        if v < best[0]:
            best = (v, split(r.x))
    return best


# ---------------------------------------------------------------- the certified split (Lemma G.1)

@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 30), st.floats(-5, 5), st.integers(1, 10**6), st.booleans()),
                min_size=1, max_size=8), st.floats(1e-6, 10.0))
def test_mixed_split_meets_the_budget_exactly(rows, eps):
    costs = [CoverCost(lc, "inverse_square", log_A=la) if inv else CoverCost(lc, "parametric", p=p, log_k=la)
             for lc, la, p, inv in rows]
    r = allocate_mixed(costs, eps)
    log_c = [t.log_c for t in costs]
    assert budget_holds(log_c, r.log_eps_i, eps)
    assert _mp_budget(log_c, r.log_eps_i) <= mpmath.mpf(eps)  # independent of the decimal enclosures
    # and it is not wasteful: the budget is used up to 1e-9 (the optimum sits on the constraint)
    assert _mp_budget(log_c, r.log_eps_i) >= mpmath.mpf(eps) * (1 - 1e-9)


def test_fit_to_budget_repairs_an_overspent_split():
    log_c = [math.log(3.0), math.log(1 / 3), 700.0]
    le = [math.log(0.1), math.log(0.1), -700.0 + math.log(0.1)]  # sums to 0.3 + 0.0333 + 0.1 > 0.4
    assert not budget_holds(log_c, le, 0.4)
    fixed = fit_to_budget(log_c, le, 0.4)
    assert budget_holds(log_c, fixed, 0.4) and _mp_budget(log_c, fixed) <= mpmath.mpf(0.4)
    # a split at the budget up to float rounding: the exact check decides, not the float sum
    c = [1 / 3] * 3
    e = [math.log(1.0)] * 3
    assert budget_holds([math.log(x) for x in c], e, 1.0) == (_mp_budget([math.log(x) for x in c], e) <= 1)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 10), st.floats(0.1, 10), st.integers(1, 50), st.booleans()),
                min_size=2, max_size=4), st.floats(0.02, 1.0))
def test_mixed_allocation_is_the_slsqp_optimum_and_never_below_it(rows, eps):
    costs, fs = [], []
    for a, c, p, inv in rows:
        if inv:
            costs.append(CoverCost(math.log(c), "inverse_square", log_A=math.log(a)))
            fs.append(lambda e, a=a: a / e**2)
        else:
            costs.append(CoverCost(math.log(c), "parametric", p=p, log_k=math.log(a)))
            fs.append(lambda e, a=a, p=p: p * np.log1p(a / e))
    c = np.array([r[1] for r in rows])
    r = allocate_mixed(costs, eps)
    ref, _ = _slsqp_min(fs, c, eps)
    # SLSQP's point is feasible, so nothing feasible is below the optimum; a value below SLSQP's by
    # more than its tolerance would mean a split that overspends the budget
    assert r.total >= ref * (1 - 1e-6)
    assert r.total <= ref * (1 + 1e-6)


# ------------------------------------------------------- min(F1, F2) per matrix against enumeration

def _terms_strategy():
    term = st.tuples(st.booleans(), st.integers(2, 40), st.integers(2, 40), st.floats(-2, 4),
                     st.floats(-2, 1), st.floats(0, 2))
    return st.lists(term, min_size=2, max_size=3)


def _make_terms(rows):
    out = []
    for i, (vec, r, k, lc, lsp, lratio) in enumerate(rows):
        sp = math.exp(lsp)
        vec = vec and i == 0
        out.append(MatrixTerm(0, f"W{i}", (1 if vec else r, k), lc, sp if vec else sp * math.exp(lratio), sp,
                              vector=vec))
    return out


def _smooth(t: MatrixTerm, n_points: int, parametric: bool):
    """Lower bounds of the exact per-matrix costs (ceilings dropped): F1 and F2 at e/2."""
    p, k = t.shape[0] * t.shape[1], t.shape[1]
    if parametric:
        r = t.l21 if t.vector else t.spectral
        return lambda e: p * np.log1p(2 * r / e)
    a = t.l21
    return lambda e: (144 * a * a / e**2 + k) * np.log(2 * (8 * a / e + 2) * n_points + 1)


@settings(max_examples=6, deadline=None)
@given(_terms_strategy(), st.floats(-4, 0), st.integers(1, 10**5))
# hypothesis's two counterexamples at stop 35: the alternation from all-F1 and all-F2 stopped at
# all-F1 (1074.4 and 239.5) where F1 + F2 reaches 1061.3 and 236.6; the second also needs the
# split to follow the log factor's slope (Note [slope of the log factor]: 236.63 with it, 1.2 %
# above without)
@example([(False, 2, 24, 0.0, 0.0, 0.0), (False, 28, 35, -1.375, -0.3125, 0.046875)], -1.25, 129)
@example([(False, 2, 17, 0.0, 0.0, 0.0), (False, 16, 14, -1.0, -1.3125, 0.03125)], -1.09375, 3)
def test_min_cover_search_matches_exhaustive_enumeration(rows, log_eps, n_points):
    terms = _make_terms(rows)
    eps = math.exp(log_eps)
    ours = transformer_log_covering(terms, eps, n_points, family="best")
    c = np.array([math.exp(t.log_c) for t in terms])
    lower, feasible = math.inf, math.inf
    for forms in itertools.product(*[[True] if t.vector else [True, False] for t in terms]):
        v, e = _slsqp_min([_smooth(t, n_points, f) for t, f in zip(terms, forms)], c, eps)
        lower = min(lower, v)
        le = np.log(e * (1 - 1e-9))
        exact = float(np.logaddexp.reduce(_exact_loglog(_term_arrays(terms, list(forms)), le, n_points)))
        feasible = min(feasible, math.exp(exact))
    assert ours.log_N >= lower * (1 - 1e-6)  # sound: nothing beats the global optimum of the lower costs
    assert ours.log_N <= feasible * (1 + 1e-6)  # as good as the best assignment found by brute force
    for fam in ("l21", "spectral"):
        assert ours.log_log_N <= transformer_log_covering(terms, eps, n_points, family=fam).log_log_N + 1e-12


# ----------------------------------------------------------------- the parametric cover (F1) itself

def _greedy_packing(points: np.ndarray, eps: float, dist_many) -> int:
    """Size of a greedy eps-separated subset (a maximal one of the sample: also an eps-net of it);
    ``dist_many(x, C)`` gives the distances from ``x`` to every row of ``C``."""
    centres = np.empty((len(points), *points.shape[1:]))
    n = 0
    for x in points:
        if n == 0 or dist_many(x, centres[:n]).min() > eps:
            centres[n] = x
            n += 1
    return n


@pytest.mark.parametrize("shape, B, eps", [((2, 2), 1.0, 0.6), ((1, 3), 1.0, 0.5), ((2, 1), 2.0, 0.7)])
def test_spectral_ball_cover_bounds_a_greedy_packing(shape, B, eps):
    """Every eps-separated set in the B-ball has at most (1 + 2B/eps)^p points (F1's volume argument)."""
    rng = np.random.default_rng(3)
    p = shape[0] * shape[1]
    W = rng.standard_normal((4000, *shape))
    s = np.linalg.norm(W, ord=2, axis=(1, 2))
    W = W / s[:, None, None] * B * rng.random(4000)[:, None, None] ** (1 / p)  # inside the spectral ball
    n = _greedy_packing(W, eps, lambda x, C: np.linalg.norm(C - x, ord=2, axis=(1, 2)))
    bound = spectral_ball_matrix_log_covering(*shape, B, eps).value
    assert math.log(n) <= bound
    # the same number through the route the Transformer bound uses (ln ln N of F1)
    t = MatrixTerm(0, "W", shape, 0.0, 10 * B, B)
    f1 = _exact_loglog(_term_arrays([t], [True]), np.array([math.log(eps)]), 1)[0]
    assert math.exp(f1) >= bound * (1 - 1e-12)


@pytest.mark.parametrize("B, eps", [(1.0, 0.3), (1.0, 0.11), (2.0, 0.45)])
def test_parametric_cover_between_volume_bounds_on_a_grid(B, eps):
    """p = 2 (a 1x2 matrix: spectral = l2): (B/(eps+h))^2 <= greedy net of a fine grid <= (1+2B/eps)^2."""
    h = eps / 10
    g = np.arange(-B, B + h / 2, h)
    P = np.array([(x, y) for x in g for y in g if x * x + y * y <= B * B])
    n = _greedy_packing(P, eps, lambda x, C: np.hypot(*(C - x).T))
    # the grid is within h of every point of the ball, so the net covers the ball at eps + h
    assert (B / (eps + h)) ** 2 <= n
    assert math.log(n) <= spectral_ball_matrix_log_covering(1, 2, B, eps).value


@pytest.mark.parametrize("lam", [2.0**-7, 0.37, 3.0, 2.0**10])
def test_parametric_cost_is_scale_free(lam):
    """F1 depends on B/eps only: scaling both leaves log N unchanged (exactly for powers of two)."""
    for shape, B, eps in [((4, 5), 1.3, 0.01), ((30, 30), 0.2, 1e-5)]:
        a = spectral_ball_matrix_log_covering(*shape, B, eps).value
        b = spectral_ball_matrix_log_covering(*shape, lam * B, lam * eps).value
        assert b == pytest.approx(a, rel=0 if math.log2(lam).is_integer() else 1e-12)
    # the whole Transformer bound: scale every norm and eps by lam, coefficients fixed
    terms = [MatrixTerm(0, "W_KQ.0", (8, 8), 1.0, 3.0, 1.0), MatrixTerm(1, "W_1", (16, 8), 2.0, 2.0, 0.7),
             MatrixTerm(1, "b_1", (1, 16), 0.5, 0.4, 0.4, vector=True)]
    scaled = [MatrixTerm(t.layer, t.role, t.shape, t.log_c, lam * t.l21, lam * t.spectral, vector=t.vector)
              for t in terms]
    for fam in ("spectral", "l21", "best"):
        a = transformer_log_covering(terms, 0.05, 1000, family=fam).log_log_N
        b = transformer_log_covering(scaled, lam * 0.05, 1000, family=fam).log_log_N
        assert b == pytest.approx(a, abs=1e-8)


# ------------------------------------------------------------- a digits-sized model, default route

def _digits_sized_spec():
    """The shape `transcover train --task digits` builds (d 32, 2 heads, 2 layers, d_ff 64, head 64),
    with every capped matrix projected to spectral norm <= 1.5 as `--radius all=1.5` does."""
    from transcover.constrain import project_spectral_
    from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec

    torch.manual_seed(0)
    m = ReferenceTransformer(ReferenceConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64, d_input=8, max_len=8,
                                             n_outputs=10, head_hidden=(64,)))
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 2 and min(p.shape) > 1:
                project_spectral_(p, 1.5)
    return reference_spec(m)


@pytest.fixture(scope="module")
def digits_terms():
    spec = _digits_sized_spec()
    return spec, model_terms(spec)


def test_default_route_is_the_smallest_and_below_1e6_on_a_digits_sized_model(digits_terms):
    """Issue 12 items 3 and 6: the default reports min over routes; the old default (l21) is 10^15+."""
    spec, terms = digits_terms
    kw = dict(eps=0.1, n_samples=(1200.0,), seq_len=8, terms=terms)
    default = model_bound(spec, **kw)
    old = model_bound(spec, family="l21", **kw)  # the old default route, still reachable
    assert default.family == "auto" and default.route in ("l21", "spectral", "best")
    assert default.log_log_N == min(default.routes.values())
    assert default.routes["l21"] == old.log_log_N
    assert default.log_log_N <= old.log_log_N
    assert default.log_log_N / math.log(10) <= 6.0 < old.log_log_N / math.log(10)
    # the Dudley curve of "auto" is the pointwise minimum: its gap is no worse than any route's
    for fam in ("l21", "spectral", "best"):
        other = model_bound(spec, family=fam, **kw)
        assert default.generalisation[0].raw_log_gap <= other.generalisation[0].raw_log_gap + 1e-12


def test_min_covers_are_never_below_the_monte_carlo_estimate():
    """The project's Monte-Carlo lower estimate of log N stays below the min-cover bound."""
    from _mc_case import monte_carlo_case

    from transcover.empirical import monte_carlo_covering

    terms, X, sample = monte_carlo_case()
    for eps in (0.05, 0.2):
        est = monte_carlo_covering(sample, X, eps, q=2).log_packing_lower(0).value
        assert est > 0
        # a class with only spectral caps: ||W||_(2,1) <= sqrt(cols) ||W||_F <= sqrt(cols rank) ||W||_2
        wide = [MatrixTerm(t.layer, t.role, t.shape, t.log_c,
                           max(t.l21, math.sqrt(t.shape[1] * min(t.shape)) * t.spectral),
                           t.spectral, vector=t.vector) for t in terms]
        assert est <= transformer_log_covering(wide, eps, 6, family="best").log_N


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 400), st.floats(-3, 3), st.sampled_from(["l21", "spectral", "best"]))
def test_total_is_rounded_up_over_many_terms(k, log_c, fam):
    """ln(sum_i ln N_i) as reported is >= the exact log-sum of the reported per-matrix terms."""
    terms = [MatrixTerm(i // 4, f"W{i}", (16, 16), log_c + 0.01 * (i % 7), 2.0 + 0.1 * (i % 3), 1.0)
             for i in range(k)]
    cov = transformer_log_covering(terms, 0.1, 1000, family=fam)
    with mpmath.workdps(60):
        exact = mpmath.log(mpmath.fsum(mpmath.exp(mpmath.mpf(c.log_cost)) for c in cov.contributions))
    assert mpmath.mpf(cov.log_log_N) >= exact
