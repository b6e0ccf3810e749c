"""Red team, issue 12 stop 14: F43a (``_local_joint.sphere_drift`` / ``norm_drift``, a LayerNorm/RMSNorm Jacobian's
drift by the sphere's curvature) as main wires it -- the first norm (post_first_norm, pre_attention) AND the second
norm (post_tail's ``e2`` on the FFN sublayer's output radius ``r2``, pre_second_norm's on ``r1``).

* the constant: ``cos^2 a cos^2 b + sin^2(a + b) <= 4/3`` on a fine angle grid (the planar reduction of F43a), and
  the integral-and-arctan step against mpmath quadrature (eps from 0 to large, b up to sigma);
* the wiring: every ``norm_drift`` call ``layer_rows`` makes on its largest ball is recorded, and an Adam ascent
  over the layer's input ball and unit directions on ``||(D(n_in(X')) - D(n_in(X))) v||`` (``n_in`` the norm's
  input as the layer computes it: the attention's residual sum, the FFN's residual sum, X) must stay below
  ``max|gamma| e`` per token -- a radius that did not bound the norm's input move would show here, not in the
  function-level tests;
* finding red14-1 (fixed on main by 44ee16c / eadbce2, THEORY F17e): ``sigma`` was taken only ``(1 - 1e-12)`` low
  while the one-pass float64 centring errs by ``~ d u max|x|`` absolutely: a token whose mean dwarfs its spread got a
  finite F43a drift (and a positive F17 floor) on a ball that holds a zero-variance point.  The reproducers stay as
  regression tests, with ``centre_tokens``' certified low sigma against the exact sigma on tokens a few ulps wide.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import mpmath
import pytest
import torch
from torch.autograd.functional import jvp

from lipschitz_testkit import random_spec
from test_local_sharp import _clip
from transcover.lipschitz import _local_stages
from transcover.lipschitz._local_jacobian import _norm_parts
from transcover.lipschitz._local_joint import SPHERE_CURVATURE, norm_drift, sphere_drift
from transcover.lipschitz._local_rows import layer_rows
from transcover.model import NormKind, NormSpec, attention_forward, ffn_forward


def test_planar_curvature_form_is_at_most_four_thirds():
    """F43a's reduction: ``||D^2 n[e, v]||^2 = cos^2 a cos^2 b + sin^2(a + b)`` (unit e, v at angles a, b off the
    sphere's tangent plane, ``e_perp || v_perp``) is at most 4/3 everywhere on a 2001^2 grid and reaches it
    (``a = b``, ``cos^2 a = 2/3``), so ``SPHERE_CURVATURE = 2/sqrt 3`` is its square root, rounded up."""
    t = torch.linspace(-math.pi / 2, math.pi / 2, 2001, dtype=torch.float64)
    a, b = t[:, None], t[None, :]
    f = torch.cos(a) ** 2 * torch.cos(b) ** 2 + torch.sin(a + b) ** 2
    assert float(f.max()) <= 4 / 3 * (1 + 1e-15)
    assert float(f.max()) >= 4 / 3 * (1 - 1e-5)
    assert SPHERE_CURVATURE >= math.sqrt(4 / 3)


@pytest.mark.parametrize("sigma,frac,eps", [(1.0, 0.5, 0.0), (1.0, 0.999, 1e-12), (0.01, 0.99, 1e-3), (2.0, 0.999999, 0.3),
                                            (1e-3, 0.9, 1.0), (5.0, 1e-6, 1e-12)])
def test_integral_and_arctan_step_against_quadrature(sigma, frac, eps):
    """``(2/sqrt 3) b int_0^1 dtau/((sigma - tau b)^2 + eps)`` by mpmath quadrature (50 digits) is at most
    ``sphere_drift`` (d = 1, so ``b = r``), from the Taylor regime to ``b -> sigma`` with eps > 0, and above it by no
    more than ``z/arctan z`` (the one step F43a gives away)."""
    mpmath.mp.dps = 50
    b = sigma * frac
    exact = mpmath.quad(lambda tau: b / ((sigma - tau * b) ** 2 + eps), [0, 1]) * 2 / mpmath.sqrt(3)
    bound = float(sphere_drift(torch.tensor([sigma], dtype=torch.float64), eps,
                               torch.tensor([b], dtype=torch.float64), 1)[0])
    assert float(exact) <= bound, (float(exact), bound)
    z = b * math.sqrt(eps) / (eps + sigma * (sigma - b))
    assert bound <= float(exact) * (z / math.atan(z) if z > 0 else 1.0) * (1 + 1e-8)  # only arctan z <= z is lost


def _case(seed: int, placement: str, kind: str, eps: float, qscale: float, xscale: float, T: int = 5, d: int = 8):  # noqa: ANN202
    spec = random_spec(seed, act="gelu", norm=kind, placement=placement, d=d, H=2, dh=4, dff=16, biases=True, eps=eps)
    L = spec.layers[0]
    L = dataclasses.replace(L, attention=dataclasses.replace(L.attention, W_Q=L.attention.W_Q * qscale))
    X = torch.randn(T, d, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64) * xscale
    return L, X


def _norm_inputs(L, Z: torch.Tensor) -> dict:  # noqa: ANN001
    """site -> (the norm, its input as the layer computes it from Z)."""
    if L.placement.value == "post":
        S1 = Z + attention_forward(L.attention, Z)
        H = L.norm_attn(S1)
        return {"first": (L.norm_attn, S1), "second": (L.norm_ffn, H + ffn_forward(L.ffn, H))}
    return {"first": (L.norm_attn, Z), "second": (L.norm_ffn, Z + attention_forward(L.attention, L.norm_attn(Z)))}


def _recorded_drifts(L, X: torch.Tensor, r: float, monkeypatch) -> dict:  # noqa: ANN001
    """site -> the smallest ``e`` (per token) of every ``norm_drift`` call ``layer_rows`` makes on the ball of radius
    ``r`` itself (the sub-balls of F31e's sums are left out; post_tail's lazy refinement calls it several times, each
    with a radius it claims)."""
    seen, cur = {}, [None]
    radius_rows, plain = _local_stages.radius_rows, _local_stages.norm_drift

    def rows(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        cur[0] = args[6]
        return radius_rows(*args, **kw)

    def drift(norm, sigma, rr, d):  # noqa: ANN001, ANN202
        e, sf = plain(norm, sigma, rr, d)
        if cur[0] == r:
            site = "first" if norm is L.norm_attn else "second"
            seen[site] = e.clone() if site not in seen else torch.minimum(seen[site], e)
        return e, sf

    monkeypatch.setattr(_local_stages, "radius_rows", rows)
    monkeypatch.setattr(_local_stages, "norm_drift", drift)
    layer_rows(L, X, [r])
    monkeypatch.undo()
    return seen


def _drift_ascent(value, X: torch.Tensor, r: float, *, starts: int = 3, steps: int = 100) -> torch.Tensor:  # noqa: ANN001
    """Per token, the largest ``value(X + E, V)`` seen by Adam ascent over moves ``E`` (every token within r,
    projected) and per-token unit ``V``; the first start on the sphere."""
    T, d = X.shape
    g = torch.Generator().manual_seed(0)
    # the starts as one batch (starts, T, d), each start's E then V drawn in turn: Adam acts entrywise and each start's
    # gradient of the summed values is its own, so every start takes the steps it took alone
    E0, V0 = [], []
    for s in range(starts):
        E0.append(_clip(torch.randn(T, d, generator=g, dtype=torch.float64) * (r * (1e6 if s == 0 else 1.0)), r))
        V0.append(torch.randn(T, d, generator=g, dtype=torch.float64))
    E, V = torch.stack(E0).requires_grad_(True), torch.stack(V0).requires_grad_(True)
    opt = torch.optim.Adam([{"params": [E], "lr": 0.08 * r}, {"params": [V], "lr": 0.05}])
    best = torch.zeros(T, dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            E.copy_(_clip(E, r))
        val = value(X + E, V / V.norm(dim=-1, keepdim=True))
        best = torch.maximum(best, torch.nan_to_num(val.detach(), nan=0.0).amax(dim=0))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return best


# (seed, placement, kind, eps, W_Q scale, X scale, radius / median token norm, the attained fraction the ascent
# must reach at the site named: measured 0.84 pre-LN first norm, 0.51 post-LN second norm (red14 probes))
CASES = [(0, "pre", "rmsnorm", 1e-3, 8.0, 2.0, 0.1, "first", 0.6),
         (0, "post", "layernorm", 1e-3, 1.0, 0.05, 0.01, "second", 0.3),
         (1, "post", "layernorm", 1e-12, 8.0, 2.0, 0.1, None, 0.0),
         (2, "pre", "layernorm", 0.3, 1.0, 0.05, 0.1, None, 0.0),
         (3, "post", "rmsnorm", 1e-12, 1.0, 1.0, 0.01, None, 0.0)]


@pytest.mark.parametrize("seed,placement,kind,eps,qscale,xscale,frac,site,attained", CASES)
def test_norm_drift_at_every_call_site_is_never_beaten(seed, placement, kind, eps, qscale, xscale, frac, site,
                                                       attained, monkeypatch):
    """Both norms of a post- and a pre-LN layer (LayerNorm and RMSNorm, eps 1e-12 to 0.3, sharp heads, tiny sigma):
    per token, Adam ascent on the norm's Jacobian drift over the LAYER's input ball stays below ``max|gamma| e`` of
    every ``norm_drift`` call ``layer_rows`` makes on that ball (first norm on ``r1`` / r, second on ``r2`` / ``r1``),
    and reaches ``attained`` of it where named (a radius or sigma mixed up would not)."""
    L, X = _case(seed, placement, kind, eps, qscale, xscale)
    r = frac * float(X.norm(dim=1).median())
    drifts = _recorded_drifts(L, X, r, monkeypatch)
    assert set(drifts) == {"first", "second"}
    base = _norm_inputs(L, X)
    for name, e in drifts.items():
        norm, S0 = base[name]

        def value(Z, V, name=name, norm=norm, S0=S0):  # noqa: ANN001, ANN202
            S = _norm_inputs(L, Z)[name][1]
            S0b = S0.detach().expand_as(V).contiguous()  # the centre's, once per start of the batch
            return (jvp(norm, S, V, create_graph=True)[1] - jvp(norm, S0b, V, create_graph=True)[1]).norm(dim=-1)

        best = _drift_ascent(value, X, r)
        bound = float(norm.weight.abs().max()) * e
        assert bool((best <= bound).all()), (name, best, bound)
        if name == site:
            assert float((best / bound).max()) >= attained, (name, best / bound)


def _far_tokens(n: int, d: int = 8) -> list:
    """``n`` LayerNorm input tokens ``1e12 + 1e-3 N(0, 1)`` with the exact sigma of the same floats (mpmath)."""
    g = torch.Generator().manual_seed(0)
    mpmath.mp.dps = 50
    out = []
    for _ in range(n):
        x = 1e12 + 1e-3 * torch.randn(1, d, generator=g, dtype=torch.float64)
        xs = [Fraction(float(v)) for v in x[0]]
        m = sum(xs) / d
        var = sum((v - m) ** 2 for v in xs) / d
        out.append((x, mpmath.sqrt(mpmath.mpf(var.numerator) / var.denominator)))
    return out


def test_finding_sigma_rounding_when_the_mean_dwarfs_the_spread():
    """Finding red14-1 (fixed: F17e).  x = 1e12 + 1e-3 N(0, 1) (d = 8, eps = 1e-12): the float64 sigma is ~0.1-0.7 % ABOVE the exact
    sigma of the same floats.  With r = sqrt(d) sigma_exact (1 + 1e-9) the ball holds ``x' = mean(x) 1`` (``P E = -P x``,
    ``||P E|| = sqrt(d) sigma_exact <= r``), where ``D(x') v = v/sqrt(eps)`` for ``v`` centred and orthogonal to
    ``P x`` while ``D(x) v = v/s``: the true drift is at least ``1/sqrt(eps) - 1/s ~ 1e6``, but ``norm_drift`` (F43a)
    returned 2.6e5-7.4e5 before the fix (sigma seen above b)."""
    d, eps = 8, 1e-12
    norm = NormSpec(NormKind.LAYERNORM, torch.ones(d, dtype=torch.float64), None, eps)
    for seed, (x, sig_exact) in enumerate(_far_tokens(6, d)):
        sigma = _norm_parts(norm, x)[2]
        r = torch.tensor([float(math.sqrt(d) * sig_exact * (1 + mpmath.mpf("1e-9")))], dtype=torch.float64)
        true_low = float(1 / mpmath.sqrt(eps) - 1 / mpmath.sqrt(sig_exact**2 + eps))
        assert float(norm_drift(norm, sigma, r, d)[0][0]) >= true_low, (seed, float(sigma[0]) / float(sig_exact) - 1)


def test_finding_sigma_rounding_gives_a_positive_floor_on_a_ball_through_zero_variance():
    """Finding red14-1 (fixed: F17e), F17 and F41c.  The same tokens, eps = 0: the ball of radius ``sqrt(d) sigma_exact (1 + 1e-9)``
    holds the zero-variance point ``mean(x) 1`` (the norm's ``s`` is 0 there), yet ``_floor`` returns a positive
    ``s`` floor (so F17's drift and ``||D'|| <= g/s_f`` are finite) and ``sphere_remainder`` a finite remainder."""
    from transcover.lipschitz._local_jacobian import _floor
    from transcover.lipschitz._local_joint import sphere_remainder

    d = 8
    norm = NormSpec(NormKind.LAYERNORM, torch.ones(d, dtype=torch.float64), None, 0.0)
    for x, sig_exact in _far_tokens(2, d):
        _, s, sigma, _ = _norm_parts(norm, x)
        r = torch.tensor([float(math.sqrt(d) * sig_exact * (1 + mpmath.mpf("1e-9")))], dtype=torch.float64)
        assert float(_floor(norm, sigma, r, d)[0]) == 0.0
        assert math.isinf(float(sphere_remainder(1.0, s, r, d)[0]))


@pytest.mark.parametrize("d", [8, 384, 1024])
def test_certified_low_sigma_on_tokens_a_few_ulps_wide(d):
    """F17e's ``centre_tokens``: on tokens ``+-2^e + ulp n`` (n in -2..2, e in 20..60, some scaled by 1 + 2^-30 U) --
    the spread a few ulps of a mean up to 1e18 -- the certified low sigma is never above the exact sigma of the floats
    (Fractions), and the computed one within 1e-14 of it (red14 probe: 9e-16)."""
    from transcover.lipschitz._local_jacobian import centre_tokens

    g = torch.Generator().manual_seed(d)
    for e in (20, 40, 52, 60):
        ulp = math.ulp(2.0**e)
        for t in range(6):
            x = (1 if t % 2 == 0 else -1) * 2.0**e + ulp * torch.randint(-2, 3, (1, d), generator=g).double()
            if t % 3 == 0:
                x = x * (1 + 2.0**-30 * torch.rand(1, d, generator=g, dtype=torch.float64))
            _, sigma, low = centre_tokens(x, True)
            xs = [Fraction(float(v)) for v in x[0]]
            m = sum(xs) / d
            var = sum((v - m) ** 2 for v in xs) / d
            if var == 0:
                continue
            assert Fraction(float(low[0])) ** 2 <= var, (e, t)
            assert abs(float(sigma[0]) / math.sqrt(var) - 1) <= 1e-14, (e, t)
