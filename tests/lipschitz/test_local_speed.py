"""The faster rows route (issue 12, THEORY F37): lazy refinement of the FFN's per-unit drift (F37a) reports
exactly the maxima of refining every token, on layers where the per-unit term decides them; the scaled
reference of a larger ball (F37b) is above the direct per-unit bound and above Adam ascent on the FFN
Jacobian's change; ``refine_lazily`` on synthetic monotone rows (hypothesis) equals the full refinement.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import gelu_ffn_case, random_spec, refine_every_token
from transcover.lipschitz import _local_rows
from transcover.lipschitz._local_rows import layer_rows, refine_lazily
from transcover.lipschitz._local_sharp import GELU_SLOPE_RANGE, ffn_unit_drift, unit_slope_moves

RADII = [1e-4, 1e-3, 1e-2, 3e-2, 0.1]


def _counting(calls: list):  # noqa: ANN202
    def lazy(evaluate, reported, refine, T, lowest=None):  # noqa: ANN001, ANN202
        def counted(idx: torch.Tensor) -> torch.Tensor | None:
            calls.extend(idx.tolist())
            return refine(idx)

        return refine_lazily(evaluate, reported, counted, T, lowest=lowest)

    return lazy


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_lazy_maxima_equal_the_full_refinement(placement, monkeypatch):
    """Every reported maximum (point, ball, drift row, each drift term) of the lazy route equals the one
    with every token refined at every radius; every lazy row is at least the full one (still certified);
    the lazy route refines fewer token-radii; and the per-unit term decides the ball here (F17c's global
    drift alone, no token refined, gives a ball bound at least 5 % larger at some radius)."""
    spec = random_spec(11, act="gelu", norm="layernorm", placement=placement, d=12, H=2, dh=6, dff=48,
                       scale=1.5, biases=True)
    L = spec.layers[0]
    X = torch.randn(10, 12, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 2
    calls: list = []
    monkeypatch.setattr(_local_rows, "refine_lazily", _counting(calls))
    lazy = layer_rows(L, X, RADII)
    monkeypatch.setattr(_local_rows, "refine_lazily", refine_every_token)
    full = layer_rows(L, X, RADII)
    monkeypatch.setattr(_local_rows, "refine_lazily", lambda evaluate, *args, **kw: evaluate())
    cheap = layer_rows(L, X, RADII)
    assert 0 < len(calls) < len(RADII) * X.shape[0], len(calls)
    assert min(a.ball / c.ball for a, c in zip(lazy, cheap)) < 0.95
    for a, b in zip(lazy, full):
        assert a.point == b.point and a.ball == b.ball, (a.radius, a.ball, b.ball)
        assert float(a.drift_rows.max()) == float(b.drift_rows.max())
        assert a.parts == b.parts, (a.parts, b.parts)
        assert bool((a.total_rows >= b.total_rows).all()) and bool((a.drift_rows >= b.drift_rows).all())
        for name, rad in a.stage_radii.items():
            assert bool((rad >= b.stage_radii[name]).all()), name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), T=st.integers(1, 12), floors=st.booleans())
def test_refine_lazily_equals_the_full_refinement_on_monotone_rows(seed, T, floors):
    """Synthetic rows non-decreasing in each token's own term (sums, products, a min and a floor like the
    layer's, and one row that does not see the term): the lazy maxima equal the full ones, with and without
    the rows' floors (every term at 0), and no token is refined twice."""
    g = torch.Generator().manual_seed(seed)
    base, slope, cap = (torch.rand(T, generator=g, dtype=torch.float64) * s for s in (10.0, 5.0, 40.0))
    full = torch.rand(T, generator=g, dtype=torch.float64)
    theta = full + torch.rand(T, generator=g, dtype=torch.float64) * 3  # the cheap term, above the full one

    def rows(th: torch.Tensor) -> dict:
        floor = (2.0 - th / 2).clamp(min=0.0)
        total = torch.minimum(base + slope * th + th * th, cap / torch.where(floor > 0, floor, 0.0))
        return {"total": total, "drift": slope * th, "terms": {"a": th * th, "b": base * th, "c": base * slope}}

    reported = lambda r: [r["total"], r["drift"], *r["terms"].values()]  # noqa: E731
    cur = theta.clone()
    done: list = []

    def refine(idx: torch.Tensor) -> None:
        done.extend(idx.tolist())
        cur[idx] = torch.minimum(cur[idx], full[idx])

    out = refine_lazily(lambda: rows(cur), reported, refine, T, lowest=rows(torch.zeros(T, dtype=torch.float64))
                        if floors else None)
    for a, b in zip(reported(out), reported(rows(full))):
        assert float(a.max()) == float(b.max())
    assert len(set(done)) == len(done) <= T


def test_scaled_reference_is_never_beaten():
    """F37b: for rh_a <= rh_b with no capped unit at rh_b, (rh_a/rh_b) F31d(rh_b) is at least F31d(rh_a) and
    at least Adam ascent on ||F(h') - F(h)||_2 over ||h' - h|| <= rh_a; homogeneity: W_2 -> 2 W_2 doubles it."""
    ffn, H, z, n1, F = gelu_ffn_case()

    rb = torch.full((3,), 0.25, dtype=torch.float64)
    assert bool((unit_slope_moves(z, n1, rb) <= GELU_SLOPE_RANGE).all())
    ub = ffn_unit_drift(ffn, z, n1, rb)[0]
    g = torch.Generator().manual_seed(1)
    for ra in (0.25, 0.1, 0.01):
        scaled = ra / 0.25 * ub * (1 + 1e-12)
        direct = ffn_unit_drift(ffn, z, n1, torch.full((3,), ra, dtype=torch.float64))[0]
        assert bool((direct <= scaled * (1 + 1e-9)).all()), (ra, direct, scaled)
        for t in range(3):
            best = 0.0
            for _ in range(2):
                D = (torch.randn(6, generator=g, dtype=torch.float64) * ra).requires_grad_(True)
                opt = torch.optim.Adam([D], lr=0.1 * ra)
                for _ in range(30):
                    with torch.no_grad():
                        D.mul_(torch.clamp(ra / D.norm(), max=1.0))
                    drift = torch.linalg.matrix_norm(F(H[t] + D) - F(H[t]), ord=2)
                    best = max(best, float(drift.detach()))
                    opt.zero_grad()
                    (-drift).backward()
                    opt.step()
            assert best <= float(scaled[t]), (ra, t, best, scaled[t])
    u2 = ffn_unit_drift(dataclasses.replace(ffn, W_2=ffn.W_2 * 2), z, n1, rb)[0]
    assert torch.allclose(u2, 2 * ub, rtol=1e-9), (u2, ub)


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_an_infinite_ball_does_not_poison_the_smaller_ones(placement):
    """F37b scales a larger ball's per-unit bound into the smaller balls; a ball so large that its bounds are
    inf once made that scaling 0 * inf = nan, and torch.minimum carried the nan into every smaller ball (the
    whole-network route then lost its per-layer drifts at every radius). The small ball's rows must be finite
    and no larger than when it is certified alone."""
    torch.manual_seed(3)
    spec = random_spec(1, act="gelu", norm="layernorm", placement=placement, d=16, H=2, dh=8, dff=32)
    X = torch.randn(6, 16, dtype=torch.float64)
    alone = layer_rows(spec.layers[0], X, [1e-4])[0]
    small, huge = layer_rows(spec.layers[0], X, [1e-4, 1e8])
    assert not math.isfinite(huge.ball)  # the case: the large ball's bounds really are inf
    assert math.isfinite(small.ball) and float(small.drift_rows.max()) < math.inf
    assert small.ball <= alone.ball * (1 + 1e-12)
    assert float(small.drift_rows.max()) <= float(alone.drift_rows.max()) * (1 + 1e-12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), d=st.integers(1, 24), m=st.integers(1, 80), spread=st.floats(0.0, 12.0),
       zeros=st.floats(0.0, 0.9), iters=st.integers(0, 20))
def test_gram_lower_never_exceeds_the_certified_gram(seed, d, m, spread, zeros, iters):
    """F42a: ``gram_lower`` is at most the certified ``lambda_max`` F31d computes for the same ``R diag(c) R^T``
    as formed, for columns and weights spread over up to 24 decades, weights partly zero, nearly parallel columns
    (large cancellations in the quotient's inner products), and any number of power steps (even none)."""
    from transcover.lipschitz._local_jacobian import certified_lmax
    from transcover.lipschitz._local_sharp import gram_lower

    g = torch.Generator().manual_seed(seed)
    R = torch.randn(d, m, generator=g, dtype=torch.float64)
    if seed % 3 == 0:  # nearly parallel columns with alternating signs: v . r_k cancels
        R = R[:, :1] * torch.where(torch.arange(m) % 2 == 0, 1.0, -1.0) + 1e-9 * R
    R = R * 10 ** (spread * (torch.rand(m, generator=g, dtype=torch.float64) - 0.5))
    c = torch.rand(4, m, generator=g, dtype=torch.float64) * 10 ** (spread * (torch.rand(4, 1, generator=g,
                                                                                         dtype=torch.float64) - 0.5))
    c = torch.where(torch.rand(4, m, generator=g, dtype=torch.float64) < zeros, 0.0, c)
    low = gram_lower(R, c, iters=iters)
    cert = certified_lmax((R[None] * c[:, None, :]) @ R.T[None])
    assert bool((~(low > cert)).all()), (low, cert)
    exact = torch.linalg.eigvalsh((R[None] * c[:, None, :]) @ R.T[None])[:, -1]
    assert bool((~(low > exact * (1 + 1e-12) + 1e-300)).all()), (low, exact)


def test_gram_lower_is_close_on_the_ffn_grams():
    """The power iterate makes F42a's bound useful: within 2 % of the certified values on the small GELU FFN's
    F31d Grams (both sides), and 2-homogeneous in R (R -> 3 R multiplies it by 9, up to rounding)."""
    from transcover.lipschitz._local_jacobian import certified_lmax
    from transcover.lipschitz._local_sharp import gram_lower

    ffn, _, z, n1, _ = gelu_ffn_case()
    c = unit_slope_moves(z, n1, torch.full((3,), 0.2, dtype=torch.float64)).clamp(max=GELU_SLOPE_RANGE)
    for R in (ffn.W_1.double(), ffn.W_2.double().T):
        cert = certified_lmax((R[None] * c[:, None, :]) @ R.T[None])
        low = gram_lower(R, c)
        assert bool((low <= cert).all()) and bool((low >= 0.98 * cert).all()), (low, cert)
        assert torch.allclose(gram_lower(3 * R, c), 9 * low, rtol=1e-9)


def test_skipped_unit_drift_loses_to_the_callers_bound():
    """``ffn_unit_drift(above=(b, b_half))`` returns the plain bounds bit for bit where it forms the Grams and
    ``(inf, inf)`` only where the plain bounds are at least ``b`` and ``b_half`` with no unit capped: every
    ``min`` with the caller's bounds is the same float (F42a)."""
    ffn, _, z, n1, _ = gelu_ffn_case()
    g = torch.Generator().manual_seed(3)
    skipped = 0
    for r in (0.01, 0.25, 3.0):
        rh = torch.full((3,), r, dtype=torch.float64)
        full, half = ffn_unit_drift(ffn, z, n1, rh)
        capped = (unit_slope_moves(z, n1, rh) > GELU_SLOPE_RANGE).any(dim=1)
        for _ in range(6):
            b = full * (0.5 + torch.rand(3, generator=g, dtype=torch.float64))
            bh = half * (0.5 + torch.rand(3, generator=g, dtype=torch.float64))
            f, h = ffn_unit_drift(ffn, z, n1, rh, above=(b, bh))
            assert torch.equal(torch.minimum(f, b), torch.minimum(full, b))
            assert torch.equal(torch.minimum(h, bh), torch.minimum(half, bh))
            skip = torch.isinf(f)
            assert not bool((skip & capped).any())
            assert bool((full[skip] >= b[skip]).all()) and bool((half[skip] >= bh[skip]).all())
            assert torch.equal(f[~skip], full[~skip]) and torch.equal(h[~skip], half[~skip])
            skipped += int(skip.sum())
    assert skipped > 0  # the case exercises the skip


def test_memoised_ball_quantities_equal_fresh_ones():
    """F42b: the softmax box and F35b's ball sup kept in the head moments are the floats a fresh evaluation
    gives, for the sub-ball's segment points that coincide with the ball's and after the weight norms change
    (a stale entry would be returned for the old norms)."""
    from transcover.lipschitz._local_drift import attention_drift_hessian, hessian_ball_sup
    from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
    from transcover.lipschitz._local_rows import _HeadMoments, attention_drift_f17d
    from transcover.lipschitz._local_sharp import head_moves

    spec = random_spec(4, act="gelu", norm="layernorm", d=8, H=2, dh=4, dff=16, biases=True)
    attn = spec.layers[0].attention
    X = torch.randn(6, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    heads = _head_data(attn, X)
    norms = _weight_norms(spec.layers[0])
    fresh = lambda: _HeadMoments(heads, attn.softmax_scale)  # noqa: E731
    mom = fresh()
    r = 0.3
    for f in (attention_drift_hessian, attention_drift_f17d, head_moves):
        for rr in (r / 2, r):
            assert torch.equal(f(mom, rr, norms), f(fresh(), rr, norms)), (f.__name__, rr)
    assert all(len(m["box"]) == 6 and len(m["hess"]) == 6 for m in mom.rows)  # r/8 ... r: 6 distinct radii
    doubled = dict(norms, G=[2 * g for g in norms["G"]], V=[3 * v for v in norms["V"]])
    for f in (hessian_ball_sup, head_moves):
        assert torch.equal(f(mom, r, doubled), f(fresh(), r, doubled)), f.__name__
        assert not torch.equal(f(mom, r, doubled), f(mom, r, norms)), f.__name__


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_skipping_f31d_keeps_every_reported_maximum(placement, monkeypatch):
    """F42a end to end: ``layer_rows`` with F31d's Grams skipped where ``gram_lower`` proves they lose to F38
    reports the same point, ball, drift row and drift terms, bit for bit, as with F31d formed at every refined
    token (``gram_lower`` replaced by NaN, which no comparison passes), and the case does skip."""
    from transcover.lipschitz import _local_sharp

    spec = random_spec(11, act="gelu", norm="layernorm", placement=placement, d=12, H=2, dh=6, dff=48,
                       scale=1.5, biases=True)
    X = torch.randn(10, 12, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 2
    skipped = []

    def counted(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        full, half = ffn_unit_drift(*args, **kw)
        skipped.append(int(torch.isinf(full).sum()))
        return full, half

    monkeypatch.setattr(_local_rows, "ffn_unit_drift", counted)
    fast = layer_rows(spec.layers[0], X, RADII)
    n_fast, skipped[:] = sum(skipped), []
    monkeypatch.setattr(_local_sharp, "gram_lower", lambda R, c, **kw: torch.full((len(c),), math.nan))
    formed = layer_rows(spec.layers[0], X, RADII)
    assert n_fast > sum(skipped) == 0, (n_fast, skipped)  # infinite F31d only where skipped
    for a, b in zip(fast, formed):
        assert a.point == b.point and a.ball == b.ball, (a.radius, a.ball, b.ball)
        assert float(a.drift_rows.max()) == float(b.drift_rows.max())
        assert a.parts == b.parts, (a.parts, b.parts)
