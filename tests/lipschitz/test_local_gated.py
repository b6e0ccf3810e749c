"""THEORY F107: the gated FFN's local constant (SwiGLU, GeGLU) on a ball around real data."""

from __future__ import annotations

import math

import mpmath as mp
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _attack import Domain, attack_pairs, violates
from lipschitz_testkit import jvp_ascent, jvp_row_norm
from transcover.lipschitz import _local_gated as lg
from transcover.model import Activation, FFNSpec, ffn_forward

F64 = torch.float64
ACTS = [Activation.SILU, Activation.GELU_TANH, Activation.GELU, Activation.QUICK_GELU]


def _mp_act(act: Activation):  # noqa: ANN202
    sig = lambda x: 1 / (1 + mp.exp(-x))  # noqa: E731
    if act is Activation.SILU:
        return lambda x: x * sig(x)
    if act is Activation.QUICK_GELU:
        return lambda x: x * sig(mp.mpf(1.702) * x)
    if act is Activation.GELU:
        return lambda x: x * mp.ncdf(x)
    return lambda x: x * sig(2 * mp.sqrt(2 / mp.pi) * (x + mp.mpf("0.044715") * x**3))


@pytest.mark.parametrize("act", [Activation.SILU, Activation.GELU, Activation.GELU_TANH, Activation.QUICK_GELU])
def test_critical_points_rederived(act: Activation) -> None:
    """Every bracket holds a sign change of the right derivative and every stated extreme covers the mpmath value;
    sigma' and sigma have no other critical point on [-12, 12] (a grid of sign changes)."""
    mp.mp.dps = 30
    f = _mp_act(act)
    xm, m, x1, d1, x2, d2 = lg._crit(act)
    b = lg._BRACKET
    d1f, d2f = (lambda x: mp.diff(f, x)), (lambda x: mp.diff(f, x, 2))
    assert d1f(xm - b) < 0 < d1f(xm + b)
    assert d2f(x1 - b) < 0 < d2f(x1 + b) and d2f(x2 - b) > 0 > d2f(x2 + b)
    assert m - lg._EXT_PAD <= f(mp.findroot(d1f, (xm - b, xm + b), solver="anderson"))
    assert d1 - lg._EXT_PAD <= d1f(mp.findroot(d2f, (x1 - b, x1 + b), solver="anderson"))
    assert d2 + lg._EXT_PAD >= d1f(mp.findroot(d2f, (x2 - b, x2 + b), solver="anderson"))
    grid = [mp.mpf(k) / 8 for k in range(-96, 97)]
    s1 = sum(1 for a, c in zip(grid, grid[1:]) if d1f(a) * d1f(c) < 0)
    s2 = sum(1 for a, c in zip(grid, grid[1:]) if d2f(a) * d2f(c) < 0)
    assert (s1, s2) == (1, 2)


@settings(max_examples=30, deadline=None)
@given(act=st.sampled_from(ACTS), c=st.floats(-40, 40), w=st.floats(0, 8), seed=st.integers(0, 99))
def test_act_ranges_cover(act: Activation, c: float, w: float, seed: int) -> None:
    """The certified ranges of sigma and sigma' contain their values on a fine grid of the interval and at mpmath's
    evaluation of a few points (ends and random ones)."""
    lo, hi = torch.tensor([c - w], dtype=F64), torch.tensor([c + w], dtype=F64)
    s_lo, s_hi, d_lo, d_hi = (float(t) for t in lg.act_ranges(act, lo, hi))
    xs = torch.linspace(c - w, c + w, 4001, dtype=F64)
    s, dv = lg._values(act, xs)
    assert s_lo <= float(s.min()) and float(s.max()) <= s_hi
    assert d_lo <= float(dv.min()) and float(dv.max()) <= d_hi
    mp.mp.dps = 30
    f = _mp_act(act)
    g = torch.Generator().manual_seed(seed)
    for x in [c - w, c + w] + (c - w + 2 * w * torch.rand(3, generator=g, dtype=F64)).tolist():
        assert s_lo <= f(x) <= s_hi
        assert d_lo <= mp.diff(f, x) <= d_hi


def _ffn(seed: int, act: Activation, scale: float, *, d: int = 6, dff: int = 12, bias: bool = True) -> FFNSpec:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    return FFNSpec(W_1=r(d, dff) * scale / math.sqrt(d), W_2=r(dff, d) / math.sqrt(dff), activation=act,
                   W_gate=r(d, dff) * scale, b_1=r(dff) * 0.3 if bias else None, b_gate=r(dff) * 0.3 if bias else None)


def _jac_norm(ffn: FFNSpec, H: torch.Tensor) -> float:
    """max over tokens of the float64 autograd Jacobian's spectral norm at H."""
    f = lambda h: ffn_forward(ffn, h[None])[0]  # noqa: E731
    return max(float(torch.linalg.matrix_norm(torch.autograd.functional.jacobian(f, h), 2)) for h in H)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), act=st.sampled_from(ACTS), scale=st.sampled_from([0.3, 3.0, 30.0]),
       r=st.sampled_from([1e-6, 0.05, 0.5, 4.0]), big=st.booleans())
def test_gated_sound(seed: int, act: Activation, scale: float, r: float, big: bool) -> None:
    """No pair in the ball, and no Jacobian on it, beats the certified constant: projected ascent on the pair ratio
    in the (2,inf) metric and on ``||J(h) v||`` (every token within r of H); large weights and tokens whose
    pre-activations sit at the critical points of sigma' (``big``) included."""
    ffn = _ffn(seed, act, scale)
    T, d = 3, 6
    H = torch.randn(T, d, generator=torch.Generator().manual_seed(seed + 1), dtype=F64) * (4.0 if big else 1.0)
    if big:  # first token's gate pre-activations near sigma''s maximiser
        x2 = lg._crit(act)[4]
        Wg = ffn.W_gate
        H[0] = torch.linalg.lstsq(Wg.T, torch.full((Wg.shape[1],), x2, dtype=F64) - ffn.b_gate).solution
    cert = lg.gated_ffn_local(ffn, H, r).upper
    w = attack_pairs(lambda Z, s: ffn_forward(ffn, H + Z), T=T, d=d, dom=Domain(r), metric="2,inf", restarts=6,
                     steps=30, seed=seed, n_jacobian=2)
    assert not violates(w, cert), (w, cert)
    jv = jvp_ascent(jvp_row_norm(lambda Z: ffn_forward(ffn, Z), H), H, r, seed=seed, starts=2, steps=40)
    assert jv <= cert * (1 + 1e-9), (jv, cert)


@pytest.mark.parametrize("act", [Activation.SILU, Activation.GELU_TANH])
def test_gated_homogeneity_monotone_limit(act: Activation) -> None:
    """W_2 scaled by c scales the constant by c; the constant never drops as r grows; at r -> 0 it is above the
    float64 Jacobian norm at H and within 1e-6 of it (the centred form)."""
    ffn = _ffn(3, act, 2.0)
    H = torch.randn(4, 6, generator=torch.Generator().manual_seed(5), dtype=F64)
    base = lg.gated_ffn_local(ffn, H, 0.1).upper
    for c in (0.37, 8.0, 1e3):
        scaled = FFNSpec(W_1=ffn.W_1, W_2=ffn.W_2 * c, activation=act, W_gate=ffn.W_gate, b_1=ffn.b_1,
                         b_gate=ffn.b_gate)
        assert lg.gated_ffn_local(scaled, H, 0.1).upper == pytest.approx(c * base, rel=1e-9)
    ups = [lg.gated_ffn_local(ffn, H, r).upper for r in (0.0, 1e-9, 1e-5, 1e-3, 0.1, 1.0, 10.0)]
    assert all(a <= b for a, b in zip(ups, ups[1:])), ups
    J = _jac_norm(ffn, H)
    assert J <= ups[1] <= J * (1 + 1e-6)


def test_gated_attained_ratio() -> None:
    """Certified / attained on a random SwiGLU at a moderate ball stays below 2 (tightness, not soundness)."""
    ffn = _ffn(11, Activation.SILU, 1.0)
    H = torch.randn(3, 6, generator=torch.Generator().manual_seed(2), dtype=F64)
    cert = lg.gated_ffn_local(ffn, H, 0.05).upper
    jv = jvp_ascent(jvp_row_norm(lambda Z: ffn_forward(ffn, Z), H), H, 0.05, seed=0, starts=2, steps=60)
    assert jv <= cert <= 2 * jv


def test_gated_refusals() -> None:
    from transcover._errors import InputError

    with pytest.raises(InputError, match="relu"):
        lg.gated_ffn_local(_ffn(0, Activation.RELU, 1.0), torch.zeros(2, 6, dtype=F64), 0.1)


@pytest.mark.parametrize("act", ACTS)
def test_act_ranges_at_the_slope_zero(act: Activation) -> None:
    """At sigma''s zero (the minimum of sigma, where ``sigma'`` is a difference of terms of order one that cancel) a
    degenerate interval's certified ``sigma'`` range still contains mpmath's value: the float64 error there is
    absolute, not relative to ``sigma'``."""
    mp.mp.dps = 40
    f = _mp_act(act)
    xm = lg._crit(act)[0]
    root = mp.findroot(lambda x: mp.diff(f, x), (xm - 1e-3, xm + 1e-3), solver="anderson")
    for k in range(-40, 41):
        x = float(root) + k * 2.0**-52
        t = torch.tensor([x], dtype=F64)
        _, _, d_lo, d_hi = (float(v) for v in lg.act_ranges(act, t, t))
        assert d_lo <= mp.diff(f, mp.mpf(x)) <= d_hi, (x, d_lo, d_hi)
