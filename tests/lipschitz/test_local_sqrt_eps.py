"""``s = sqrt(sigma^2 + eps)`` where the squares leave float64's normal range (THEORY F96's open item, closed): with
``eps = 0`` (or a subnormal ``eps``) and tokens near ``2^-530`` the plain form rounded ``sigma^2`` as a subnormal, up to
``2^-15`` relative, and ``norm_local`` certified a norm's local constant 0.2 % below the exact one (the first test
fails on the previous main).  ``root_sq_plus`` forms it at a power of two there and is the plain form elsewhere."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

from transcover.lipschitz._local import norm_local
from transcover.lipschitz._local_centre import norm_forward_error
from transcover.lipschitz._rounding import _gamma, root_sq_plus
from transcover import InputError
from transcover.model import NormKind, NormSpec

mpmath.mp.dps = 60
TINY = torch.finfo(torch.float64).tiny


def _rms(d: int, eps: float, gamma: torch.Tensor | None = None) -> NormSpec:
    return NormSpec(kind=NormKind.RMSNORM, weight=torch.ones(d, dtype=torch.float64) if gamma is None else gamma,
                    eps=eps)


@pytest.mark.parametrize("e", [-532, -530, -529, -520])
@pytest.mark.parametrize("eps", [0.0, 2.0**-1074, 2.0**-1062])
def test_norm_local_never_below_the_exact_constant_at_tiny_scales(e, eps):
    """RMSNorm (gain 1) on ``B(x, rho)``: its local constant is ``sup ||D(y)|| = 1/sqrt(min_y rms(y)^2 + eps)``, attained
    at the point of the ball nearest 0, ``rms = (||x|| - rho)/sqrt d``; computed in mpmath from the same floats."""
    d = 4
    worst = mpmath.mpf(0)
    for seed in range(60):
        x = torch.randn(1, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        X = torch.ldexp(x, torch.tensor(e))
        rho = math.ldexp(float(x.norm()) * (seed % 6) / 7, e) or 1e-300
        lip = float(norm_local(_rms(d, eps), X, rho)[0][0])
        xs = [mpmath.mpf(float(v)) for v in X[0]]
        floor = mpmath.sqrt(sum(v * v for v in xs)) / mpmath.sqrt(d) - mpmath.mpf(rho) / mpmath.sqrt(d)
        exact = 1 / mpmath.sqrt(floor * floor + mpmath.mpf(eps))
        worst = max(worst, exact / lip)
    assert worst <= 1, worst


@pytest.mark.parametrize("e", [-530, -300, 300])
def test_norm_local_scales_exactly_with_eps_zero(e):
    """With ``eps = 0`` the norm is degree 0 in its input, so its local constant on ``B(2^e x, 2^e rho)`` is ``2^-e`` times
    the one on ``B(x, rho)``: exactly, every operation being the same on numbers scaled by powers of two."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(5, 8, generator=g, dtype=torch.float64)
    gam = torch.rand(8, generator=g, dtype=torch.float64) + 0.5
    base, _ = norm_local(_rms(8, 0.0, gam), X, 0.05)
    got, _ = norm_local(_rms(8, 0.0, gam), torch.ldexp(X, torch.tensor(e)), math.ldexp(0.05, e))
    assert torch.equal(got, torch.ldexp(base, torch.tensor(-e)))


def test_root_sq_plus_is_the_plain_form_in_range_and_relative_below_it():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4000, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-480, 480, (4000,), generator=g).double())
    for c in (0.0, 1e-12, 1e-5, 3.0):
        assert torch.equal(root_sq_plus(x, c), torch.sqrt(x * x + c))
    worst = mpmath.mpf(0)
    for e in range(-1070, -480, 11):
        for c in (0.0, 2.0**-1074, 3 * 2.0**-1074, 2.0**-1050, 2.0 ** max(2 * e, -1074)):
            xv = torch.ldexp(torch.rand(20, generator=g, dtype=torch.float64) + 0.5, torch.tensor(e))
            for a, b in zip(xv.tolist(), root_sq_plus(xv, c).tolist()):
                exact = mpmath.sqrt(mpmath.mpf(a) ** 2 + mpmath.mpf(c))
                if exact >= TINY:  # a subnormal root carries that range's absolute rounding (documented)
                    worst = max(worst, abs(mpmath.mpf(b) - exact) / exact)
    assert worst <= _gamma(3), worst  # the square, the sum, the root: what the norms' error bounds charge
    # above 2^512 the square overflowed and s came out inf (a constant max|gamma|/s of 0): the same relative error
    worst = mpmath.mpf(0)
    for e in range(500, 1022, 7):
        for c in (0.0, 1e-12, 3.0, 2.0 ** min(2 * e, 1023)):
            xv = torch.ldexp(torch.rand(20, generator=g, dtype=torch.float64) + 0.5, torch.tensor(e))
            for a, b in zip(xv.tolist(), root_sq_plus(xv, c).tolist()):
                exact = mpmath.sqrt(mpmath.mpf(a) ** 2 + mpmath.mpf(c))
                assert math.isfinite(b) or exact > mpmath.mpf(2) ** 1024
                if math.isfinite(b):
                    worst = max(worst, abs(mpmath.mpf(b) - exact) / exact)
    assert worst <= _gamma(3), worst


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_forward_error_covers_the_forward_at_subnormal_squares(kind):
    """The model's own one-pass forward squares the centred entries unscaled: at ``2^-530`` with ``eps = 0`` those round as
    subnormals; ``norm_forward_error`` (F64) covers that absolute rounding, against the exact norm in mpmath."""
    d = 6
    g = torch.Generator().manual_seed(7)
    for e in (-534, -530, -526):
        norm = NormSpec(kind=NormKind(kind), weight=torch.rand(d, generator=g, dtype=torch.float64) + 0.5, eps=0.0)
        X = torch.ldexp(torch.randn(4, d, generator=g, dtype=torch.float64), torch.tensor(e))
        Y = norm(X)
        bound = norm_forward_error(norm, X)
        for x, y in zip(X.tolist(), Y.tolist()):
            xs = [mpmath.mpf(v) for v in x]
            mu = sum(xs) / d if kind == "layernorm" else 0
            c = [v - mu for v in xs]
            s = mpmath.sqrt(sum(v * v for v in c) / d)
            err = mpmath.sqrt(sum((mpmath.mpf(yy) - float(gg) * cc / s) ** 2 for yy, gg, cc in zip(y, norm.weight, c)))
            assert err <= bound, (kind, e, float(err), bound)


@pytest.mark.parametrize("kind", [NormKind.LAYERNORM, NormKind.RMSNORM])
def test_norm_local_never_certifies_zero_for_a_nonzero_gain(kind):
    # max|gamma| / s = 1e-300 / 2.2e150 underflowed to a certified 0.0 (exact 9.2e-451; red team 37c)
    n = NormSpec(kind, weight=torch.full((4,), 1e-300, dtype=torch.float64), eps=0.0)
    X = torch.tensor([[1e150, -1e150, 3e150, -3e150]], dtype=torch.float64)
    lip, s = norm_local(n, X, 1e140)
    assert bool((lip > 0).all()) and mpmath.mpf(float(lip[0])) >= mpmath.mpf(1e-300) / mpmath.mpf(float(s[0]))


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_norm_local_refuses_a_matrix_gain(name):
    # a (d, d) gain passed the width check on its last axis and gave a constant (red team 37c)
    n = NormSpec(NormKind.LAYERNORM, eps=1e-5, **{name: torch.ones(4, 4, dtype=torch.float64)})
    with pytest.raises(InputError, match=f"{'gain' if name == 'weight' else 'bias'} must be one vector"):
        norm_local(n, torch.randn(3, 4, dtype=torch.float64), 0.1)


def test_large_radii_give_inf_not_nan_or_a_refusal_of_rho():
    # causal (masked) weights are 0 while exp(max Delta) overflows at a large radius: 0 * inf = NaN came back
    # from layer_local as "rho must be a finite number >= 0, but got rho=nan" for the user's valid rho (37e)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from lipschitz_testkit import random_spec
    from transcover.lipschitz import layer_local, network_local
    from transcover.lipschitz._local_attention import attention_local_bound

    spec = random_spec(3, norm="layernorm", placement="pre", L=2, d=6, H=2, dh=3, eps=1e-5, causal=True)
    X = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    Y = spec.layers[0].norm_attn(X)
    last = 0.0
    for r in (0.1, 1.0, 10.0, 100.0, 1e3):
        a = attention_local_bound(spec.layers[0].attention, Y, r).upper
        ll = layer_local(spec.layers[0], X, r).upper
        assert not math.isnan(a) and not math.isnan(ll) and a >= last  # grows with the radius, inf at the end
        last = a
    assert last == math.inf
    # the layer's local attention bound is inf there; the layer may still be finite through the global constants of
    # the sublayers behind the pre-norms (bounded outputs: they hold on every point, F112), never NaN
    big = layer_local(spec.layers[0], X, 1e3)
    assert not math.isnan(big.upper) and (big.upper == math.inf or "attention" in big.global_parts), big
    net = network_local(spec, X, 5.0)
    assert not math.isnan(net.upper) and (net.upper == math.inf or "layer 0 attention" in net.global_parts), net
