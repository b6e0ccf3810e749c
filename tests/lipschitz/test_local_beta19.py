"""F58: the per-unit beyond-second-order weight of F54b from the Taylor integral cut into pieces (``nested_beta``),
attacked by an exact per-unit reference (mpmath), Adam ascent over the reachable set (random starts and each heavy
unit's maximiser) on random and adversarial FFNs, homogeneity, new <= old, and the true S2 move of small post-LN layers."""

from __future__ import annotations

import dataclasses
import math

import mpmath
import pytest
import torch

from batched_redteam_ascents import ffn_remainder_ascent as _ascent  # layer17's ascent, its starts in one batch
from test_local_redteam18 import _s2_ascent  # its starts' forward passes in one batch (37b974a)
from test_local_layer17 import _bound, _case
from batched_redteam_ascents import unit_sup as _unit_sup  # redteam18's mpmath sup, the centre's terms formed once
from test_local_redteam18 import _every_token, _one_unit, _reach_bound, _stress_layer, _unit_starts
from transcover.lipschitz import _local_ffn_reach, _local_stages
from transcover.lipschitz._local_ffn_reach import nested_beta
from transcover.lipschitz._local_jacobian import GELU2_ABS_ERR, gelu_second
from transcover.lipschitz._local_rows import layer_rows

F64 = torch.float64
_SQ2 = math.sqrt(2.0)
# GELU'''s peak 0, zeros +-sqrt 2, trough +-2, GELU''''s extrema +-0.7923 and +-2.5243, saturated, crossing
_CENTRES = (0.0, _SQ2, -_SQ2, 2.0, -2.0, 0.7922876485147344, -2.524257372700608, 6.0, -9.0, -1.0, 1.9)


def _old(monkeypatch):  # noqa: ANN001, ANN202
    """F54b without F58a (``nested_beta`` never below F54b's own beta)."""
    monkeypatch.setattr(_local_ffn_reach, "nested_beta", lambda z, *a, **k: torch.full_like(z, math.inf))


def _exact_beta(z0: float, R: float, n: int = 400) -> float:
    """``sup_{0 < |s| <= R} |e(s)/s^2 - GELU''(z0)/2|`` by mpmath (40 digits) on an ``n``-point grid of each side
    (a lower bound of the sup: every grid point is attained)."""
    mpmath.mp.dps = 40
    z = mpmath.mpf(z0)
    phi = lambda x: mpmath.exp(-x * x / 2) / mpmath.sqrt(2 * mpmath.pi)  # noqa: E731
    sig = lambda x: x * mpmath.ncdf(x)  # noqa: E731
    g1 = mpmath.ncdf(z) + z * phi(z)
    g2 = phi(z) * (2 - z * z)
    s0 = sig(z)  # (formed once: the same mpf at every grid point)
    best = mpmath.mpf(0)
    for k in range(1, n + 1):
        for s in (mpmath.mpf(R) * k / n, -mpmath.mpf(R) * k / n):
            best = max(best, abs((sig(z + s) - s0 - g1 * s) / (s * s) - g2 / 2))
    return float(best)


@pytest.mark.parametrize("z0", _CENTRES)
def test_nested_beta_above_the_exact_per_unit_weight_and_near_it(z0):
    """``nested_beta`` at GELU'''s peak, zeros, trough, GELU''''s extrema, saturated and crossing centres, reaches
    1e-6 .. 20: never below the exact per-unit sup (mpmath), never above F54b's range bound where that is not negligible,
    and within 1.3x of the exact sup for unsaturated centres and reaches up to 4 (8 bins x 16 pieces: 1.07-1.26, F54b's
    own 1.6-6.7x; at R = 20 up to 1.7x)."""
    for R in (1e-6, 0.05, 0.5, 1.5, 4.0, 20.0):
        z = torch.tensor([z0], dtype=F64)
        Rt = torch.tensor([R], dtype=F64)
        got = float(nested_beta(z, Rt, 0.0, GELU2_ABS_ERR)[0])
        exact = _exact_beta(z0, R)
        lo, hi = _local_ffn_reach.gelu2_range(z - Rt, z + Rt)
        d0 = gelu_second(z)
        old = float(torch.maximum(hi - d0, d0 - lo)[0] / 2 + GELU2_ABS_ERR)
        assert exact <= got, (z0, R, exact, got)
        if exact > 1e-6:  # (below it both are the evaluation pads)
            assert got <= old, (z0, R, exact, got, old)
        if exact > 1e-6 and abs(z0) < 3 and R <= 4:
            assert got <= 1.3 * exact, (z0, R, exact, got)


def test_nested_beta_with_the_pre_activation_rounding():
    """With the exact centre anywhere within ``ez`` of ``z`` (the ends and the middle), the exact per-unit sup at that
    centre (reach ``R - ez``) is below ``nested_beta(z, R, ez, eD)``, ``eD`` the evaluation error plus ``0.7789 ez``."""
    for z0, ez in ((0.0, 0.05), (_SQ2, 0.02), (-2.0, 0.1), (6.0, 0.3)):
        R = 1.2
        eD = GELU2_ABS_ERR + 0.7789 * ez
        got = float(nested_beta(torch.tensor([z0], dtype=F64), torch.tensor([R], dtype=F64),
                                torch.tensor([ez], dtype=F64), torch.tensor([eD], dtype=F64))[0])
        for zs in (z0 - ez, z0, z0 + ez):
            assert _exact_beta(zs, R - ez, 150) <= got, (z0, ez, zs)


@pytest.mark.parametrize("z0", [0.0, _SQ2, -2.0, 0.7922876485147344, 2.524257372700608, 6.0, -9.0])
def test_single_unit_exact_supremum_and_gain(z0, monkeypatch):
    """One unit (every Cauchy-Schwarz tight; redteam18's mpmath sup over the reachable s-interval): the new bound is
    never below the exact sup, never above F54b without F58a, and at r = 3 (unsaturated) below 0.95 of it (the split
    at the centre itself stays loose there: 36.9 against 43.4 and the exact 5.23 at z = 0)."""
    mpmath.mp.dps = 40  # (redteam18's reference needs it at the tiny reaches)
    ffn, Q = _one_unit(z0, 4, 7)
    for r in (1e-9, 1e-4, 0.3, 3.0, 30.0):
        for remH in (0.0, 0.5 * r):
            exact = float(_unit_sup(ffn, Q, r, remH))
            new = _reach_bound(ffn, Q, r, remH)
            with monkeypatch.context() as m:
                _old(m)
                old = _reach_bound(ffn, Q, r, remH)
            assert exact <= new <= old * (1 + 1e-12), (z0, r, remH, exact, new, old)
            if r == 3.0 and abs(z0) < 3:  # F58a acts where the reach is wide
                assert new < 0.95 * old, (z0, remH, exact, new, old)


@pytest.mark.parametrize("seed,d,dff,scale,bias,rank,r,remH", [
    (31, 4, 32, 2.0, None, 1, 0.8, 0.0), (32, 8, 48, 3.0, 1.4, 2, 0.5, 0.3), (33, 8, 48, 6.0, -4.0, 8, 0.2, 0.1),
    (34, 6, 48, 2.0, 0.0, 6, 2.0, 1.0), (35, 3, 24, 2.0, 2.0, 3, 1.0, 0.5), (36, 8, 32, 0.5, 0.0, 8, 3.0, 0.0)])
def test_ascent_never_above_the_new_bound_and_new_below_old(seed, d, dff, scale, bias, rank, r, remH, monkeypatch):
    """Adam ascent (float64, projected; 2 random starts and each of the 3 heaviest units' maximisers, both signs) on
    the centred remainder over the reachable set never exceeds the new bound: units at GELU''s peak (``bias=None``),
    zero (1.4), trough (2), saturated (-4, scale 6), small (scale 0.5); maps of rank 1 .. full; with and without
    ``remH``; reaches up to ~10 (where F58a acts); and the new bound is at most the old one."""
    ffn, h, Ls, w = _case(seed, d, dff, scale, bias, rank)
    new, _ = _bound(ffn, h, Ls, w, r, remH)
    with monkeypatch.context() as m:
        _old(m)
        old, _ = _bound(ffn, h, Ls, w, r, remH)
    g = torch.Generator().manual_seed(seed)
    starts = _unit_starts(ffn, Ls, w, r, remH, 3) + [
        (torch.randn(Ls.shape[0], d, generator=g, dtype=F64) * r, torch.randn(d, generator=g, dtype=F64) * remH)
        for _ in range(2)]
    best = _ascent(ffn, h, Ls, r, remH, seed, starts=starts, steps=40, lr=0.05)
    assert math.isfinite(new) and best <= new <= old * (1 + 1e-12), (best, new, old)


def test_heavy_single_unit_dominates():
    """One unit with ``||w1||``, ``||w2||`` 30x the rest, at GELU''s peak: the ascent started at its maximiser stays
    below the bound (the bound's beta part is then that unit's)."""
    ffn, h, Ls, w = _case(41, 6, 24, 1.0, None, 6)
    W1, W2 = ffn.W_1.clone(), ffn.W_2.clone()
    W1[:, 0] *= 30
    W2[0] *= 30
    ffn = dataclasses.replace(ffn, W_1=W1, W_2=W2, b_1=-(h @ W1))
    for r, remH in ((0.05, 0.0), (0.05, 0.02), (0.3, 0.1)):
        bound, _ = _bound(ffn, h, Ls, w, r, remH)
        best = _ascent(ffn, h, Ls, r, remH, 0, starts=_unit_starts(ffn, Ls, w, r, remH, 2), steps=40, lr=0.05)
        assert best <= bound, (r, remH, best, bound)


def test_homogeneity():
    """``W_2 x c`` scales the bound by c (1e-9; linear in ``W_2``), ``Q x c^2`` with ``r / c`` leaves it unchanged
    (exponent 0: the same reachable set)."""
    ffn, h, Ls, w = _case(5, 10, 40, 2.0, None, 10)
    base, _ = _bound(ffn, h, Ls, w, 0.7, 0.2)
    for c in (0.25, 3.0):
        got, _ = _bound(dataclasses.replace(ffn, W_2=ffn.W_2 * c), h, Ls, w, 0.7, 0.2)
        assert got == pytest.approx(c * base, rel=1e-9)
    ffn1, Q = _one_unit(0.3, 5, 3)
    for remH in (0.0, 0.2):
        b0 = _reach_bound(ffn1, Q, 2.0, remH)
        for c in (2.0**-20, 3.0, 2.0**30):
            assert _reach_bound(ffn1, Q * c * c, 2.0 / c, remH) == pytest.approx(b0, rel=1e-9)


@pytest.mark.parametrize("d,T,eps,bias,gamma,radii", [
    (4, 2, 1e-12, 0.0, "negative", (0.03, 0.3)), (8, 2, 1.0, -4.0, "outlier", (0.3, 3.0)),
    (6, 4, 1e-12, 1.4, "plain", (0.1, 1.0))])
def test_true_s2_move_never_above_r2(d, T, eps, bias, gamma, radii, monkeypatch):
    """Small post-LN layers with F54b (with F58a) on every token: Adam ascent on the true centred S2 move over the input
    ball stays below ``r2`` (4 starts x 60 steps), and that ``r2`` is at most the one without F58a."""
    layer = _stress_layer(d, 3 + d + T, eps=eps, causal=False, qscale=1.0, bias=bias, gamma=gamma)
    X = torch.randn(T, d, generator=torch.Generator().manual_seed(d * T), dtype=F64) * 2
    monkeypatch.setattr(_local_stages, "ffn_reach", _every_token)
    new = layer_rows(layer, X, list(radii))
    _old(monkeypatch)
    old = layer_rows(layer, X, list(radii))
    for k, r in enumerate(radii):
        got = _s2_ascent(layer, X, r, seed=k)
        r2n, r2o = new[k].stage_radii["ffn"], old[k].stage_radii["ffn"]
        assert bool((got <= r2n).all()) and bool((r2n <= r2o * (1 + 1e-12)).all()), (r, got, r2n, r2o)


@pytest.mark.slow
def test_minilm_new_never_above_old_and_the_remainder_holds(monkeypatch):
    """Real MiniLM layer 0, one real sentence cut to T = 7 (the two ``layer_rows`` cost 30 s CPU, 50 s at 12 tokens;
    F58a lowers the largest reach there too, 2.73 -> 2.25), rho = 1e-2, F54b on every token: every token's bound with
    F58a at most without it and lower at the token of largest reach, ``layer_rows``' ``r2`` never above the old one, and
    Adam ascent over the layer's input ball on that token's FFN remainder (at the attained move of H) below the new
    bound."""
    from transcover.model import attention_forward, ffn_forward, load
    from transcover.model._data import load_inputs

    spec = load(None).to_torch(F64)
    X = spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=7, limit=2)[1].double())
    L = spec.layers[0]
    r = 1e-2 * float(X.norm(dim=1).median())
    seen = []
    monkeypatch.setattr(_local_stages, "ffn_reach", lambda *a: seen.append(_every_token(*a)) or seen[-1])
    new = layer_rows(L, X, [r])[0]
    _old(monkeypatch)
    old = layer_rows(L, X, [r])[0]
    reach_new, reach_old = seen[0], seen[-1]
    assert bool((reach_new <= reach_old).all()) and bool((new.stage_radii["ffn"] <= old.stage_radii["ffn"]).all())
    t = int(reach_old.argmax())
    assert float(reach_new[t]) < float(reach_old[t])
    H = lambda Z: L.norm_attn(Z + attention_forward(L.attention, Z))  # noqa: E731
    h = H(X)[t].detach()
    P = torch.eye(h.shape[0], dtype=F64) - 1.0 / h.shape[0]
    J = torch.autograd.functional.jacobian(lambda x: ffn_forward(L.ffn, x[None])[0], h)
    y0 = ffn_forward(L.ffn, h[None])[0]
    E = torch.randn(X.shape, generator=torch.Generator().manual_seed(0), dtype=F64)
    E = (E / E.norm(dim=1, keepdim=True) * r).requires_grad_(True)
    opt = torch.optim.Adam([E], lr=0.1 * r)
    best = 0.0
    for _ in range(30):
        with torch.no_grad():
            E.mul_(torch.clamp(r / E.norm(dim=1, keepdim=True), max=1.0))
        dh = H(X + E)[t] - h
        rem = (P @ (ffn_forward(L.ffn, (h + dh)[None])[0] - y0 - J @ dh)).norm()
        best = max(best, float(rem.detach()))
        opt.zero_grad()
        (-rem).backward()
        opt.step()
    assert best <= float(reach_new[t]), (best, float(reach_new[t]))
