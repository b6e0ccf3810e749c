"""F61a: F51a's d_ff x d_ff certificates only where they can beat the FFN drift bounds so far; the lower bounds that
decide it never exceed what the certificates return, and the per-layer route reports the same floats (THEORY F61)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from batched_drift_ascents import ffn_ascent as _ascent
from lipschitz_testkit import hetero_gamma, random_spec, refine_every_token
from test_local_ffn2 import _ffn
from transcover.lipschitz import _local_rows
from transcover.lipschitz import _local_stages as st
from transcover.lipschitz._local_ffn2 import (
    _kappa_a, _lmax_lower, ffn_curvature_drift, ffn_hadamard, ffn_second_norms, ffn_taylor_drift,
)
from transcover.lipschitz._local_jacobian import certified_lmax, gelu2_sup
from transcover.lipschitz._local_rows import layer_rows
from transcover.model import NormKind

pytestmark = pytest.mark.usefixtures("without_reach_drift")  # F70c off: these test F37a's exact maxima

RADII = [1e-3, 1e-2, 0.1, 0.3, 1.0]


def _weights(ffn, z: torch.Tensor, r: float) -> torch.Tensor:  # noqa: ANN001
    """F51a's per-unit weights ``a`` on the ball of radius ``r`` (``ffn_curvature_drift``'s, ``ez`` = 0)."""
    h = ffn.W_1.double().norm(dim=0)[None, :] * r * (1 + 1e-12)
    return torch.sqrt(gelu2_sup(z - h, z + h)) * (1 + 1e-12)


def _formed(G: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    M = a[:, :, None] * G[None] * a[:, None, :]
    return certified_lmax((M + M.transpose(1, 2)) / 2)


def test_lower_bounds_never_exceed_the_certificates():
    """``_lmax_lower`` <= ``certified_lmax`` of the formed weighted matrix and ``_kappa_a(lower)`` <= ``_kappa_a``, per
    token: units near 0, saturated (bias -4, scale 6), half-open (+3), centred and not, radii 0.05-2; adversarial
    weights (one unit only: rank one, where the certificate is the trace; a zero row; 1e-8 against 1; a NaN, which
    must not pass a comparison); and not vacuous (within 5 % on the random cases: the skip can happen)."""
    worst = 1.0
    for seed, scale, bias in ((1, 0.5, 0.0), (2, 6.0, -4.0), (3, 2.0, 3.0)):
        ffn = _ffn(seed, 12, 40, scale)
        ffn = dataclasses.replace(ffn, b_1=ffn.b_1 + bias)
        Hs = torch.randn(3, 12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
        z = Hs @ ffn.W_1.double() + ffn.b_1.double()
        for centred in (False, True):
            const = ffn_hadamard(ffn, centred=centred)
            for r in (0.05, 0.5, 2.0):
                a = _weights(ffn, z, r)
                for G in (const["H"], const["H12"]):
                    low, cert = _lmax_lower(G, a), _formed(G, a)
                    assert bool((low <= cert).all()), (low, cert)
                    worst = min(worst, float((low / cert).min()))
                low, full = _kappa_a(const, a, lower=True), _kappa_a(const, a)
                assert bool((low <= full).all()), (low, full)
                worst = min(worst, float((low / full).min()))
    assert worst > 0.95, worst
    G = const["H"]
    m = G.shape[0]
    one = torch.zeros(4, m, dtype=torch.float64)
    one[0, 3] = 1.0  # rank one: lambda_max = the trace = G_33
    one[2] = 1.0
    one[2, ::2] = 1e-8
    one[3] = torch.rand(m, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # row 1: all zero
    low, cert = _lmax_lower(G, one), _formed(G, one)
    assert bool((low <= cert).all()) and float(low[1]) == 0.0 and float(low[0]) > 0.99 * float(G[3, 3]), (low, cert)
    one[3, 5] = math.nan
    assert not bool(_lmax_lower(G, one)[3] >= 0.0)


def _centres(seed: int):  # noqa: ANN202
    ffn = _ffn(seed, 10, 32, 2.0)
    Hs = torch.randn(4, 10, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64) * 2
    return ffn, Hs, Hs @ ffn.W_1.double() + ffn.b_1.double()


def test_skip_keeps_every_minimum_and_the_attack():
    """With ``above`` the tokens whose certificate can win get F51a's floats, the others ``inf`` only where F51a's
    values are at least ``above`` (both halves), so ``min(above, .)`` is the same float; some tokens of each kind.
    With ``above`` F38's bounds (as in the route), ``min(above, .)`` stays above float64 Adam's ascent on the drift
    and on the remainder (``batched_drift_ascents.ffn_ascent``) inside the ball."""
    ffn, Hs, z = _centres(11)
    const = ffn_hadamard(ffn, centred=True)
    n1 = ffn.W_1.double().norm(dim=0)
    rh = torch.full((4,), 0.4, dtype=torch.float64)
    c, ch = ffn_curvature_drift(const, z, n1, rh)
    above = (c * torch.tensor([0.5, 2.0, 0.5, 0.9], dtype=torch.float64),
             ch * torch.tensor([0.5, 0.5, 2.0, 0.9], dtype=torch.float64))
    s, sh = ffn_curvature_drift(const, z, n1, rh, None, above)
    skipped = torch.isinf(s)
    assert skipped.tolist() == [True, False, False, True], (s, c)
    assert torch.equal(s[~skipped], c[~skipped]) and torch.equal(sh[~skipped], ch[~skipped])
    assert torch.equal(torch.minimum(above[0], s), torch.minimum(above[0], c))
    assert torch.equal(torch.minimum(above[1], sh), torch.minimum(above[1], ch))
    # the route's case: ``above`` F38's certified bounds, then every token's min against the attack
    t2 = ffn_taylor_drift(const, ffn_second_norms(const, z), z, n1, rh)
    s, sh = ffn_curvature_drift(const, z, n1, rh, None, t2)
    g = torch.Generator().manual_seed(3)
    for t in range(4):
        bd, bh = _ascent(ffn, Hs[t], 0.4, True, g)
        assert bd <= float(torch.minimum(t2[0], s)[t]) and bh <= float(torch.minimum(t2[1], sh)[t]), (t, bd, bh)


def _layer(seed: int, d: int = 16, T: int = 8):  # noqa: ANN202
    spec = random_spec(seed, act="gelu", norm="layernorm", placement="post", d=d, H=2, dh=8, dff=64, scale=1.5,
                       biases=True)
    L = spec.layers[0]
    g = torch.Generator().manual_seed(seed)
    for norm in (L.norm_attn, L.norm_ffn):
        if norm.kind is NormKind.LAYERNORM:
            norm.weight.copy_(hetero_gamma("outlier", d, g))
    return L, torch.randn(T, d, generator=g, dtype=torch.float64) * 2


def test_layer_rows_report_the_same_floats(monkeypatch):
    """``layer_rows`` (with F45's tier and without) on a post-LN GELU layer (d = 16, heterogeneous gamma, five radii,
    the largest beyond the second norm's floor at some token): every point, ball, drift and total row, stage radius,
    stage remainder and part is the float it was with F51a certified at every refined token, and the skip happened."""
    L, X = _layer(4)
    calls = {"skip": 0, "form": 0}
    orig = ffn_curvature_drift

    def counted(*args):  # noqa: ANN002, ANN202
        c, ch = orig(*args)
        calls["skip"] += int(torch.isinf(c).sum())
        calls["form"] += int(torch.isfinite(c).sum())
        return c, ch

    monkeypatch.setattr(_local_rows, "ffn_curvature_drift", counted)
    new = [layer_rows(L, X, RADII, tiers=t) for t in (True, False)]
    monkeypatch.setattr(_local_rows, "ffn_curvature_drift",
                        lambda c, z, n1, rh, ez=None, above=None: orig(c, z, n1, rh, ez))  # F51a at every token
    old = [layer_rows(L, X, RADII, tiers=t) for t in (True, False)]
    assert calls["skip"] > 0 and calls["form"] > 0, calls
    at = st.layer_at_x(L, X.double(), 1.0)
    lim = math.sqrt(L.norm_ffn.weight.numel()) * at.sig2
    assert bool((new[0][-1].stage_radii["ffn"] > lim).any()), "the largest ball keeps every floor"
    for a, b in zip(sum(new, []), sum(old, [])):
        assert a.point == b.point and a.ball == b.ball and a.parts == b.parts, (a.radius, a.ball, b.ball)
        for k in ("point_rows", "drift_rows", "total_rows", "ball_rows"):
            assert torch.equal(getattr(a, k), getattr(b, k)), k
        assert a.stage_radii.keys() == b.stage_radii.keys()
        assert all(torch.equal(a.stage_radii[k], b.stage_radii[k]) for k in a.stage_radii)
        for k, v in a.stage_remainders.items():
            w = b.stage_remainders[k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, k


def _counting_refinements(monkeypatch) -> list:  # noqa: ANN001
    """Count the tokens ``FfnDrift.refine`` is asked to refine."""
    seen, orig = [0], _local_rows.FfnDrift.refine

    def counted(self, rh, dF, dFh, ref, base, level, idx):  # noqa: ANN001, ANN202, PLR0913
        seen[0] += len(idx)
        return orig(self, rh, dF, dFh, ref, base, level, idx)

    monkeypatch.setattr(_local_rows.FfnDrift, "refine", counted)
    return seen


def test_f61b_bound_part_is_an_upper_bound_and_the_maxima_stay(monkeypatch):
    """F61b (``tiers``): without ``ffn (dF)`` among the rows that ask, the ball, the largest drift row and every other
    part are the floats of the old rule (every reported row asking) and of the refinement at every token; ``ffn (dF)``
    is at least the fully refined maximum (a certified upper bound) and above it somewhere; fewer refinements; every
    per-token row and stage radius at least the fully refined one.  Post-LN GELU layers with outlier gamma whose FFN
    dominates (W_1 x 3), five radii up to beyond the second norm's floor."""
    seen = _counting_refinements(monkeypatch)
    looser = fewer = 0
    for seed in (4, 5):
        L, X = _layer(seed, T=10)
        L = dataclasses.replace(L, ffn=dataclasses.replace(L.ffn, W_1=3 * L.ffn.W_1))
        seen[0] = 0
        new = layer_rows(L, X, RADII, tiers=True)
        n_new = seen[0]
        monkeypatch.setattr(_local_rows, "_reported_maxima", _local_rows._reported)
        seen[0] = 0
        old = layer_rows(L, X, RADII, tiers=True)
        n_old = seen[0]

        monkeypatch.setattr(_local_rows, "refine_lazily", refine_every_token)
        full = layer_rows(L, X, RADII, tiers=True)
        monkeypatch.undo()
        seen = _counting_refinements(monkeypatch)
        fewer += n_new < n_old
        assert n_new <= n_old, (seed, n_new, n_old)
        for a, b, c in zip(new, old, full):
            assert a.point == b.point == c.point and a.ball == b.ball == c.ball, (seed, a.radius, a.ball, b.ball, c.ball)
            assert float(a.drift_rows.max()) == float(b.drift_rows.max()) == float(c.drift_rows.max())
            for k in a.parts:
                if k in _local_rows.BOUND_PARTS:
                    assert a.parts[k] >= b.parts[k] == c.parts[k], (seed, k, a.parts[k], b.parts[k])
                    looser += a.parts[k] > c.parts[k]
                else:
                    assert a.parts[k] == b.parts[k] == c.parts[k], (seed, k)
            assert bool((a.total_rows >= c.total_rows).all()) and bool((a.drift_rows >= c.drift_rows).all())
            assert all(bool((a.stage_radii[k] >= c.stage_radii[k]).all()) for k in a.stage_radii)
    assert looser > 0 and fewer > 0, ("F61b not seen", looser, fewer)


def test_f61c_unbounded_ball_exits_without_changing_the_others(monkeypatch):
    """F61c: a ball so large that the FFN's input radius is inf at every token (radius 1e200 with four finite ones,
    post-LN, with F46's fold) is not refined; the four other radii's rows, stage radii, remainders and parts are the
    floats of the run without the exit (``unbounded`` always False), and so are the large ball's (all non-finite)
    but ``ffn_coef``, the cheap coefficient there, at least the refined one; the exit refines fewer tokens."""
    L, X = _layer(7)
    radii = [1e-3, 1e-2, 0.1, 1.0, 1e200]
    seen = _counting_refinements(monkeypatch)
    exits = []
    orig = _local_rows.unbounded
    monkeypatch.setattr(_local_rows, "unbounded", lambda *a: exits.append(orig(*a)) or exits[-1])
    new = layer_rows(L, X, radii)
    n_new = seen[0]
    assert sum(exits) == 1, exits
    monkeypatch.setattr(_local_rows, "unbounded", lambda *a: False)
    seen[0] = 0
    old = layer_rows(L, X, radii)
    assert n_new < seen[0], (n_new, seen[0])
    big = old[-1]
    assert not bool(torch.isfinite(big.total_rows).any()) and not bool(torch.isfinite(big.drift_rows).any())
    assert not any(bool(torch.isfinite(v).any()) for v in big.stage_radii.values())

    def same(v: torch.Tensor, w: torch.Tensor) -> bool:
        return torch.equal(torch.nan_to_num(v, nan=-1.0), torch.nan_to_num(w, nan=-1.0))

    for a, b in zip(new, old):
        assert a.point == b.point and a.ball == b.ball and a.parts == b.parts, (a.radius, a.parts, b.parts)
        for k in ("point_rows", "drift_rows", "total_rows", "ball_rows"):
            assert same(getattr(a, k), getattr(b, k)), (a.radius, k)
        assert all(same(a.stage_radii[k], b.stage_radii[k]) for k in a.stage_radii)
        for k, v in a.stage_remainders.items():
            w = b.stage_remainders[k]
            if k == "ffn_coef" and a is new[-1]:
                assert bool((v >= w).all()), (v, w)
            else:
                assert same(v, w) if isinstance(v, torch.Tensor) else v == w, (a.radius, k)
