"""The softmax Taylor term by the shift's range alone (issue 12, ``lipschitz._local_joint.range_taylor``, THEORY
F41a): the variance-of-a-square inequality and the Taylor term against brute force on random and adversarial
(two-point, dominant key, large spread) rows, the heads' and the attention sublayer's remainders and the stage
radii against Adam ascent on small layers with several heads (flat, peaked, large score scales), homogeneity.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import box_shifts, random_spec, softmax_box
from test_local_joint import _geometries, _remainder
from test_local_sharp import _ascent, assert_stage_radii_hold
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz import _local_joint as local_joint
from transcover.lipschitz._local_jacobian import _weight_norms
from transcover.lipschitz._local_joint import VAR_SQUARE_RANGE, attention_remainder, head_remainders, range_taylor
from transcover.model import attention_forward


def test_the_constant_is_the_maximum_of_its_polynomial():
    """C_4^2 = max_{theta <= 1/3} theta (1 - theta)^2 (1 - 2 theta): the stationary point (7 - sqrt 17)/16 of
    the derivative's factor 1 - 7 theta + 8 theta^2 beats a fine grid, and the other branch's (2/3)^4/4 is below."""
    theta = torch.linspace(0, 1 / 3, 200_001, dtype=torch.float64)
    f = theta * (1 - theta) ** 2 * (1 - 2 * theta)
    assert float(f.max()) <= VAR_SQUARE_RANGE**2
    assert float(f.max()) >= VAR_SQUARE_RANGE**2 * (1 - 1e-9)
    assert (2 / 3) ** 4 / 4 <= VAR_SQUARE_RANGE**2


def _var_square(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    y = t - (p * t).sum(-1, keepdim=True)
    return (p * y**4).sum(-1) - (p * y * y).sum(-1) ** 2


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.sampled_from([2, 3, 5, 12]), peak=st.sampled_from([0.0, 3.0, 12.0]))
def test_variance_of_the_square_is_below_the_range_bound(seed, n, peak):
    """Var_p((t - E_p t)^2) <= C_4^2 (max t - min t)^4 for random rows (flat and with a dominant key) and for
    Adam ascent of the ratio over the weights and the values; the ascent comes within 20 % of the bound
    (two-point rows reach 1/16 against C_4^2 = 0.0775), so the inequality is not vacuous."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(256, n, generator=g, dtype=torch.float64)
    logits[:, 0] += peak
    t = torch.randn(256, n, generator=g, dtype=torch.float64) * torch.rand(256, 1, generator=g, dtype=torch.float64) * 5
    L = t.max(-1).values - t.min(-1).values
    assert bool((_var_square(torch.softmax(logits, -1), t) <= VAR_SQUARE_RANGE**2 * L**4).all())
    w = torch.randn(8, n, generator=g, dtype=torch.float64).requires_grad_(True)
    x = torch.randn(8, n, generator=g, dtype=torch.float64).requires_grad_(True)
    opt = torch.optim.Adam([w, x], lr=0.05)
    for _ in range(300):
        ratio = _var_square(torch.softmax(w, -1), torch.sigmoid(4 * x))  # values in [0, 1]: range <= 1
        opt.zero_grad()
        (-ratio.sum()).backward()
        opt.step()
    best = float(ratio.detach().max())
    assert best <= VAR_SQUARE_RANGE**2
    assert math.sqrt(best) >= 0.8 * VAR_SQUARE_RANGE


def _spread(P: torch.Tensor, Z: torch.Tensor) -> torch.Tensor:
    """(T,) ``lambda_max(sum_j P_ij (z_j - zbar_i)(z_j - zbar_i)^T)^{1/2}`` (exact eigenvalues, small rows)."""
    C = Z[None] - (P @ Z)[:, None, :]
    return torch.sqrt(torch.linalg.eigvalsh(torch.einsum("ij,ijm,ijn->imn", P, C, C))[:, -1].clamp(min=0.0))


def _taylor_term(s: torch.Tensor, P: torch.Tensor, t: torch.Tensor, Z: torch.Tensor) -> torch.Tensor:
    """(m, T) ``||sum_j [p(s + t) - p(s) - J_p t]_j z_j||`` for shifts ``t`` (m, T, T)."""
    Jt = P[None] * (t - (P[None] * t).sum(-1, keepdim=True))
    return ((torch.softmax(s[None] + t, dim=-1) - P[None] - Jt) @ Z).norm(dim=-1)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), sharp=st.sampled_from([0.3, 1.0, 6.0, 30.0]), causal=st.booleans(),
       tight=st.booleans())
def test_range_taylor_is_never_beaten(seed, sharp, causal, tight):
    """Every shift with spread <= osc: the softmax Taylor term through random points z stays below
    ``range_taylor``; box vertices in random osc windows and interior points (2048), plus the adversarial
    two-point shifts t_j = +-osc/2 split along the sign of z's top principal direction (theta* of F41a)."""
    g, s, P, delta, osc = softmax_box(seed, sharp, causal, tight)
    Z = torch.randn(P.shape[-1], 3, generator=g, dtype=torch.float64) * 2
    bound = range_taylor(osc, _spread(P, Z))
    t = box_shifts(g, P, delta, osc)
    assert bool((_taylor_term(s, P, t, Z) <= bound[None]).all())
    C = Z[None] - (P @ Z)[:, None, :]
    top = torch.linalg.eigh(torch.einsum("ij,ijm,ijn->imn", P, C, C))[1][:, :, -1]  # (T, 3)
    proj = torch.einsum("ijm,im->ij", C, top)
    cuts = torch.linspace(-1, 1, 41, dtype=torch.float64)[:, None, None] * proj.abs().max(dim=1).values[None, :, None]
    for sign in (1.0, -1.0):
        two = torch.where(sign * proj[None] > cuts, 0.5, -0.5) * osc[None, :, None]
        two = torch.where((P > 0)[None], two, torch.zeros_like(two))
        assert bool((_taylor_term(s, P, two, Z) <= bound[None]).all())


def _layer(seed: int, qscale: float, causal: bool = False):  # noqa: ANN202
    """A post-LN layer with three heads (d = 12): ``qscale`` 0.3 flat, 1 moderate, 8 peaked, 30 large scores."""
    spec = random_spec(seed, act="gelu", norm="layernorm", placement="post", d=12, H=3, dh=4, dff=16,
                       biases=True, causal=causal)
    L = spec.layers[0]
    return dataclasses.replace(L, attention=dataclasses.replace(L.attention, W_Q=L.attention.W_Q * qscale))


EVAL_ROUNDING = 1e-13  # the measured remainder's own float64 rounding, with a margin (not the bound's)


def _X(seed: int) -> torch.Tensor:
    return torch.randn(6, 12, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64) * 2


@pytest.mark.parametrize("seed,qscale,causal", [(11, 0.3, False), (12, 1.0, True), (13, 8.0, False),
                                                (14, 30.0, False)])
def test_remainders_with_the_range_form_are_never_beaten(seed, qscale, causal, monkeypatch):  # noqa: ANN001
    """Adam ascent (restarts, every query) inside B(X, r) on each head's remainder through W_V W_O and on the
    attention sublayer's remainder stays below ``head_remainders`` / ``attention_remainder`` (which now take
    F41a's range form); on the flat and moderate layers (qscale <= 1) the range form is the active one for some
    head and query (peaked rows keep F34a's diameter form)."""
    layer = _layer(seed, qscale, causal)
    attn = layer.attention
    X = _X(seed)
    norms = _weight_norms(layer)
    mom, geo_v, geo_ov = _geometries(attn, X)
    nO = float(head_norms(attn)["O"])
    g = torch.Generator().manual_seed(seed)
    with_range = {r: head_remainders(mom, geo_ov, r, norms) for r in (0.1, 0.4)}  # F41a in effect
    active = False
    for r in (0.1, 0.4):
        for h in range(attn.n_heads):
            Wo = attn.W_O[h].double()
            rem = _remainder(lambda Z, h=h, Wo=Wo: _head_out_ov(attn, Z, h, Wo), X)
            best = _ascent(lambda Z, rem=rem: rem(Z).norm(dim=-1), X, r, g, starts=3, steps=40)
            # a causal first query sees one key: its remainder is exactly 0, measured as f(Z) - f(X) - J(Z - X) to
            # its float64 rounding (~1e-15 here), which EVAL_ROUNDING (100x that) covers
            assert bool((best <= with_range[r][h] + EVAL_ROUNDING).all()), (r, h)
        rem = _remainder(lambda Z: attention_forward(attn, Z), X)
        best = _ascent(lambda Z: rem(Z).norm(dim=-1), X, r, g, starts=3, steps=40)
        bound = attention_remainder(mom, geo_v, geo_ov, nO, r, norms)[0]
        assert bool((best <= bound + EVAL_ROUNDING).all()), (r, best, bound)
        with monkeypatch.context() as m:  # is the range form active? without it some head's bound is larger
            m.setattr(local_joint, "range_taylor", lambda osc, spread: torch.full_like(osc, math.inf))
            active |= bool((head_remainders(mom, geo_ov, r, norms) > with_range[r]).any())
    assert active or qscale > 1


def _head_out_ov(attn, Z: torch.Tensor, h: int, Wo: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    from test_local_sharp import _head_out

    return _head_out(attn, Z, h)[0] @ Wo


@pytest.mark.parametrize("seed,qscale", [(21, 0.3), (22, 8.0)])
def test_stage_radii_with_the_range_form_hold(seed, qscale):
    """The rows route's stage radii (attention sublayer, first norm, FFN sublayer), which take the smaller
    remainder, against per-token Adam ascent on each stage's move, flat and peaked heads."""
    assert_stage_radii_hold(_layer(seed, qscale), _X(seed), (0.05, 0.3))


def test_range_form_is_second_order_and_scales_with_the_values():
    """Homogeneity: ``range_taylor`` is osc^2 (e^{osc/2} - 1 - osc/2)/(osc/2)^2 times the spread, so it is
    1-homogeneous in the spread (W_V x c scales it by c) and 4x at twice a small osc (second order in r)."""
    osc = torch.tensor([1e-4, 2e-4, 0.5, 1.0], dtype=torch.float64)
    spread = torch.tensor([1.0, 1.0, 2.0, 2.0], dtype=torch.float64)
    b = range_taylor(osc, spread)
    assert abs(float(b[1] / b[0]) - 4) < 1e-3
    assert torch.allclose(range_taylor(osc, 3 * spread), 3 * b, rtol=1e-12)
    layer = _layer(5, 1.0)
    X = _X(5)
    norms = _weight_norms(layer)
    base = head_remainders(*_geometries(layer.attention, X)[::2], 0.2, norms)
    scaled = dataclasses.replace(layer.attention, W_V=layer.attention.W_V * 2.5)
    got = head_remainders(*_geometries(scaled, X)[::2], 0.2, norms)
    assert torch.allclose(got, 2.5 * base, rtol=1e-9)
