"""Red team of the certified local bounds after stop 10 (THEORY F17c, F31d, F50, F51a), written against the API names.

F51a / F31d (``gelu2_sup``): units placed exactly (centre 0, so the pre-activation is the bias, no rounding) at GELU''s
extrema and zeros and at GELU'''s extrema, r from 1e-20 to 1e3, against mpmath.  Finding red17-1 (fixed): near
GELU''s zeros +-sqrt 2 the float64 evaluation's error is absolute and ``gelu2_sup`` padded only relatively, so at
``z = 1.4142135623730956`` and r <= 1e-16 F51a's drift was 1.25x below the exact one.
F17c: power-of-two normalisation at bf16 / float32 weights (subnormal included), exact scaling and the tight reference.
F50a: the per-head value-side form on rank-one value maps and aligned heads, from an analytic start, float64 Adam.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

from transcover.lipschitz._local_ffn2 import ffn_curvature_drift, ffn_hadamard
from transcover.lipschitz._local_jacobian import gelu2_sup
from transcover.lipschitz._local_rows import ffn_drift_constant
from transcover.lipschitz._local_sharp import unit_slope_moves
from transcover.model import Activation
from transcover.model._spec import FFNSpec

F64 = torch.float64
ROOT2 = 1.4142135623730956  # 2 ulps above fl(sqrt 2): float64's GELU'' there is 1.15x below the exact value
GELU3_EXTREMA = (0.7922876485147344, 2.524257372700608)  # zeros of GELU'''' = phi(z)(-z^4 + 7 z^2 - 4)


def _g1(z):  # noqa: ANN001, ANN202
    """GELU'(z) = Phi(z) + z phi(z) in mpmath."""
    z = mpmath.mpf(z)
    return mpmath.ncdf(z) + z * mpmath.npdf(z)


def _exact_move(z: float, s: float):  # noqa: ANN202
    """``sup_{|t| <= s} |GELU'(z + t) - GELU'(z)|`` exactly (mpmath): GELU' is monotone between its critical points
    ``+-sqrt 2``, so the sup is at an end of the interval or at a critical point inside it."""
    z0, s = mpmath.mpf(z), mpmath.mpf(s)
    ts = [s, -s] + [c - z0 for c in (mpmath.sqrt(2), -mpmath.sqrt(2)) if abs(c - z0) <= s]
    return max(abs(_g1(z0 + t) - _g1(z0)) for t in ts)


def _units(z: float, d: int, m: int, seed: int, dtype=F64) -> FFNSpec:  # noqa: ANN001
    """``m`` copies of one unit whose pre-activation at the centre ``h = 0`` is the bias ``z`` exactly (no rounding);
    ``W_2`` rows ``w2 / 4`` (exact): every pairing of F51a's Cauchy-Schwarz is tight.  Weights representable in
    ``dtype`` (bf16 / float32 / float64), stored as float64."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(d, 1, generator=g, dtype=F64).to(dtype).double()
    w2 = torch.randn(1, d, generator=g, dtype=F64).to(dtype).double()
    return FFNSpec(W_1=w1.expand(d, m).contiguous(), W_2=w2.expand(m, d).contiguous() / 4, activation=Activation.GELU,
                   b_1=torch.full((m,), z, dtype=F64), b_2=torch.zeros(d, dtype=F64))


def _exact_drift(ffn: FFNSpec, z: float, r: float, centred: bool):  # noqa: ANN202
    """The exact ``sup_{||dh|| <= r} ||P(J_F(dh) - J_F(0))||`` of ``_units``' FFN (rank one: the unit's slope move
    times ``||w1|| ||P sum_k w2_k||``), mpmath from the float64 weights."""
    n1 = mpmath.sqrt(mpmath.fsum(mpmath.mpf(float(x)) ** 2 for x in ffn.W_1[:, 0]))
    w2 = [mpmath.mpf(float(x)) * ffn.W_2.shape[0] for x in ffn.W_2[0]]
    if centred:
        mu = mpmath.fsum(w2) / len(w2)
        w2 = [x - mu for x in w2]
    return _exact_move(z, n1 * r) * n1 * mpmath.sqrt(mpmath.fsum(x * x for x in w2))


def _f51(ffn: FFNSpec, z: float, r: float, centred: bool) -> float:
    zz = torch.full((1, ffn.W_1.shape[1]), z, dtype=F64)
    return float(ffn_curvature_drift(ffn_hadamard(ffn, centred=centred), zz, ffn.W_1.norm(dim=0),
                                     torch.tensor([r], dtype=F64))[0][0])


def test_gelu2_sup_near_the_zeros_of_gelu2():
    """Finding red17-1 (fixed): ``gelu2_sup`` on the degenerate interval ``[z, z]`` for the 161 floats nearest
    ``+-sqrt 2`` is never below the exact ``|GELU''(z)|`` (mpmath).  Before the absolute pad (``GELU2_ABS_ERR``) the
    worst was ``z = 1.4142135623730956``: 1.955e-16 against 2.245e-16 (1.15x below)."""
    mpmath.mp.dps = 40
    for c in (math.sqrt(2), -math.sqrt(2)):
        z = c
        for _ in range(80):
            z = math.nextafter(z, -math.inf)
        for _ in range(161):
            t = torch.tensor([z], dtype=F64)
            zm = mpmath.mpf(z)
            exact = abs(mpmath.npdf(zm) * (2 - zm * zm))
            assert float(exact) <= float(gelu2_sup(t, t)[0]), (z, float(exact), float(gelu2_sup(t, t)[0]))
            z = math.nextafter(z, math.inf)


@pytest.mark.parametrize("r", [1e-16, 1e-20])
def test_f51a_and_f31d_at_a_zero_of_gelu2_on_tiny_balls(r):
    """Finding red17-1 (fixed), the smallest reproducer: one unit ``w1 = e_1``, ``w2 = e_1``, pre-activation
    ``z = 1.4142135623730956`` exactly (the bias; centre 0), ``r = 1e-16``: F51a's drift was 1.955e-32 against the
    exact 2.452e-32 (mpmath), 1.25x below; F31d's per-unit slope move (``unit_slope_moves``) the same.  With the
    absolute pad both are above the exact move (and vacuous there, as every bound at that scale: ~1e-13 r)."""
    mpmath.mp.dps = 40
    ffn = FFNSpec(W_1=torch.eye(2, 1, dtype=F64), W_2=torch.eye(1, 2, dtype=F64), activation=Activation.GELU,
                  b_1=torch.tensor([ROOT2], dtype=F64), b_2=torch.zeros(2, dtype=F64))
    exact = float(_exact_move(ROOT2, r))
    assert exact <= _f51(ffn, ROOT2, r, False), (exact, _f51(ffn, ROOT2, r, False))
    moves = unit_slope_moves(torch.tensor([[ROOT2]], dtype=F64), torch.ones(1, dtype=F64),
                             torch.tensor([r], dtype=F64))
    assert exact <= float(moves[0, 0]), (exact, moves)


@pytest.mark.parametrize("z", [0.0, 2.0, -2.0, GELU3_EXTREMA[0], -GELU3_EXTREMA[0], GELU3_EXTREMA[1],
                               -GELU3_EXTREMA[1], ROOT2])
def test_f51a_at_the_extrema_and_zeros_on_tiny_and_huge_balls(z):
    """Identical units (tight Cauchy-Schwarz) with the pre-activation exactly at GELU''s extrema (0, +-2: GELU''''s
    zeros), at GELU'''s extrema (+-0.7923, +-2.5243) and at GELU''s zero; r = 1e-13, 1e-11, 1e-8 and 10, 1e3; centred
    or not.  The exact drift (mpmath) is never above F51a's; at the extrema of GELU'' and of GELU''' it is within
    1e-6 of it on the tiny balls (|GELU''| >= 0.07 there, so the absolute pad is <= 2e-12 relative), so a bound off by
    1e-6 either way fails; at the zero of GELU'' and r = 1e-8 it is >= 0.4 of it (the interval's sup of |GELU''|
    against its mean: 1/2)."""
    mpmath.mp.dps = 40
    ffn = _units(z, 6, 3, 1)
    for centred in (False, True):
        for r in (1e-13, 1e-11, 1e-8, 10.0, 1e3):
            exact, cert = float(_exact_drift(ffn, z, r, centred)), _f51(ffn, z, r, centred)
            assert exact <= cert, (z, r, centred, exact, cert)
            if r == 1e-8 and z == ROOT2:
                assert exact >= 0.4 * cert, (r, exact, cert)
            elif r < 1 and z != ROOT2:
                assert exact >= cert * (1 - 1e-6), (z, r, centred, exact, cert)


@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, 1.0), (torch.bfloat16, 2.0**-120), (torch.float32, 2.0**90),
                                         (torch.bfloat16, 1e-39)])
def test_f17c_power_of_two_normalisation_at_low_precision_weights(dtype, scale):
    """F17c's ``kappa`` on weights representable in bf16 / float32 (scaled by 2^-120, 2^90, and to bf16 subnormals
    ~1e-39): ``kappa r`` is never below the exact drift of identical units at GELU''s peak (mpmath; there it is tight
    up to F17c's pads, measured ratio 1 - 1e-9, asserted >= 1 - 1e-6), and scaling ``W_1`` by 2^k scales it by
    exactly ``2^{2k}`` (the normalisation is exact), ``W_2`` by ``2^k`` (the same)."""
    import dataclasses

    mpmath.mp.dps = 40
    base = _units(0.0, 8, 1, 3, dtype)
    W1 = (base.W_1 * scale).to(dtype).double()
    W2 = (base.W_2 * scale).to(dtype).double()
    ffn = dataclasses.replace(base, W_1=W1, W_2=W2)
    assert bool((W1 != 0).all()) and bool((W2 != 0).any())  # bf16 subnormals: some of W_2 round to 0
    r = 1e-9 / float(W1.norm())
    for centred in (False, True):
        kap = ffn_drift_constant(ffn, centred=centred)
        exact = float(_exact_drift(ffn, 0.0, r, centred))
        assert exact <= kap * r and exact >= kap * r * (1 - 1e-6), (centred, exact, kap * r)
        for k in (7, -9):
            up1 = ffn_drift_constant(dataclasses.replace(ffn, W_1=W1 * 2.0**k), centred=centred)
            up2 = ffn_drift_constant(dataclasses.replace(ffn, W_2=W2 * 2.0**k), centred=centred)
            assert up1 == math.ldexp(kap, 2 * k) and up2 == math.ldexp(kap, k), (k, kap, up1, up2)
