"""Stage radii by the exact linearisation plus a second-order remainder (issue 12, ``lipschitz._local_joint``,
THEORY F34): the softmax Taylor remainder against feasible shifts, each head's and the whole attention
sublayer's remainder and the normalisation's remainder against Adam ascent inside the ball (sharp heads,
causal masks, biases), homogeneity in ``W_V`` and ``W_O``, and a regression number for the stage radii.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import box_shifts, softmax_box
from test_local_sharp import _X, _ascent, _head_out, _sharp_layer, assert_stage_radii_hold
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_joint import (
    attention_remainder, head_geometry, head_remainders, norm_remainder, softmax_taylor_l1,
)
from transcover.lipschitz._local_rows import _HeadMoments, _ln_drift
from transcover.lipschitz._local_sharp import softmax_envelope
from transcover.model import attention_forward, attention_scores


def _linearised(f, X: torch.Tensor):  # noqa: ANN001, ANN202
    """(``J``, ``Z -> f(Z) - f(X) - J_f(X)(Z - X)``): the exact Jacobian (T, m, T, d) formed once (small layers)."""
    J = torch.autograd.functional.jacobian(f, X)
    f0 = f(X).detach()
    return J, lambda Z: f(Z) - f0 - torch.einsum("imjd,...jd->...im", J, Z - X)


def _remainder(f, X: torch.Tensor):  # noqa: ANN001, ANN202
    """``Z -> f(Z) - f(X) - J_f(X)(Z - X)`` (T, m)."""
    return _linearised(f, X)[1]


def _remainder_lowered(f, absf, X: torch.Tensor):  # noqa: ANN001, ANN202
    """``Z -> ||f(Z) - f(X) - J_f(X)(Z - X)||`` per token lowered by its float64 evaluation error, ``gamma_k`` times
    the abs evaluations ``|f|(Z) + |f|(X) + |J||Z - X|`` (``absf``: f's products and sums on absolute values;
    ``k = 2(T + m + d) + 8`` covers the softmax, both products and the Jacobian's contraction): a head whose
    remainder is 0 to 1e-15 (a one-hot row) otherwise measures its own rounding."""
    J, rem = _linearised(f, X)
    a0 = absf(X).detach()
    T, m, _, d = J.shape
    k = 2 * (T + m + d) + 8
    gk = k * 2.0**-53 / (1 - k * 2.0**-53)

    def lowered(Z: torch.Tensor) -> torch.Tensor:
        scale = absf(Z) + a0 + torch.einsum("imjd,...jd->...im", J.abs(), (Z - X).abs())
        return rem(Z).norm(dim=-1) - gk * scale.norm(dim=-1)

    return lowered


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), sharp=st.sampled_from([1.0, 6.0, 30.0]), causal=st.booleans(),
       tight=st.booleans())
@example(seed=8068, sharp=30.0, causal=False, tight=False)  # a one-hot row: the float64 pad decides
def test_softmax_taylor_remainder_is_never_beaten(seed, sharp, causal, tight):
    """Every shift in the box (|t_j| <= delta_j, spread <= osc): ||p(s + t) - p(s) - J_p t||_1 stays below
    ``softmax_taylor_l1``; box vertices clamped into random osc windows and interior points, 2048 each."""
    g, s, P, delta, osc = softmax_box(seed, sharp, causal, tight)
    a, _, tv = softmax_envelope(P, delta, osc)
    bound = softmax_taylor_l1(P, delta, osc, a, tv)
    t = box_shifts(g, P, delta, osc)
    Jt = P[None] * (t - (P[None] * t).sum(-1, keepdim=True))  # J_p t = diag(p) t - p p^T t
    rem = (torch.softmax(s[None] + t, dim=-1) - P[None] - Jt).abs().sum(-1)
    assert bool((rem <= bound[None]).all()), float((rem - bound[None]).max())


def _geometries(attn, X: torch.Tensor):  # noqa: ANN001, ANN202
    heads = _head_data(attn, X)
    geo = (head_geometry(heads, attn.softmax_scale, output=o) for o in (False, True))
    return _HeadMoments(heads, attn.softmax_scale), *geo


@pytest.mark.parametrize("seed,causal,qscale", [(1, False, 8.0), (4, True, 8.0), (7, False, 1.0)])
def test_head_and_sublayer_remainders_are_never_beaten(seed, causal, qscale):
    """Adam ascent (restarts, every query) inside B(X, r) on each head's remainder through W_V and W_V W_O
    and on the whole attention sublayer's remainder ``A(X') - A(X) - J_A (X' - X)`` stays below
    ``head_remainders`` and ``attention_remainder``; sharp heads (W_Q x 8), causal masks, biases."""
    layer = _sharp_layer(seed, causal=causal, qscale=qscale)
    attn = layer.attention
    X = _X(seed)
    norms = _weight_norms(layer)
    mom, geo_v, geo_ov = _geometries(attn, X)
    nO = float(head_norms(attn)["O"])
    g = torch.Generator().manual_seed(seed)
    for r in (0.03, 0.3):
        for h in range(attn.n_heads):
            Wo = attn.W_O[h].double()
            Wv = attn.W_V[h].double()
            absv = (lambda Z, h=h, Wv=Wv: torch.softmax(attention_scores(attn, Z, h), dim=-1) @ Z.abs() @ Wv.abs())
            for geo, out, absf in ((geo_v, lambda Z, h=h: _head_out(attn, Z, h)[0], absv),
                                   (geo_ov, lambda Z, h=h, Wo=Wo: _head_out(attn, Z, h)[0] @ Wo,
                                    lambda Z, absv=absv, Wo=Wo: absv(Z) @ Wo.abs())):
                best = _ascent(_remainder_lowered(out, absf, X), X, r, g)
                bound = head_remainders(mom, geo, r, norms)[h]
                assert bool((best <= bound).all()), (r, h, best, bound)
        rem = _remainder(lambda Z: attention_forward(attn, Z), X)
        best = _ascent(lambda Z: rem(Z).norm(dim=-1), X, r, g)
        bound = attention_remainder(mom, geo_v, geo_ov, nO, r, norms)[0]
        assert bool((best <= bound).all()), (r, best, bound)


def test_norm_remainder_is_never_beaten():
    """LayerNorm: Adam ascent on ||N(x + e) - N(x) - D(x) e|| over centred moves ||P e|| <= r (the raw move
    ascended, its centred part measured) stays below ``norm_remainder`` with ``_ln_drift``'s e and floor."""
    layer = _sharp_layer(2)
    norm = layer.norm_attn
    X = _X(2) * 0.3  # small sigma: the floor matters
    d = X.shape[1]
    sigma = (X - X.mean(dim=1, keepdim=True)).norm(dim=1) / d**0.5
    g1 = float(norm.weight.abs().max())
    rem = _remainder(norm, X)
    g = torch.Generator().manual_seed(2)
    for r in (0.05, 0.5):
        rr = torch.full((X.shape[0],), r, dtype=torch.float64)
        e, _ = _ln_drift(norm, sigma, rr, d)
        bound = norm_remainder(g1, e, rr)
        best = _ascent(lambda Z: rem(Z).norm(dim=-1), X, r, g)  # ||P e|| <= ||e|| <= r
        assert bool((best <= bound).all()), (r, best, bound)


def test_remainders_scale_with_the_value_and_output_weights():
    """Homogeneity: the softmax does not see W_V or W_O, so the remainder through W_V scales by c with
    W_V and the one through W_V W_O by c with W_O (to the float64 rounding pads)."""
    layer = _sharp_layer(5)
    attn = layer.attention
    X = _X(5)
    norms = _weight_norms(layer)
    mom, geo_v, geo_ov = _geometries(attn, X)
    base_v, base_ov = head_remainders(mom, geo_v, 0.1, norms), head_remainders(mom, geo_ov, 0.1, norms)
    for c in (0.25, 3.0):
        scaled_v = dataclasses.replace(attn, W_V=attn.W_V * c)
        scaled_o = dataclasses.replace(attn, W_O=attn.W_O * c)
        mom_v, geo_vv, _ = _geometries(scaled_v, X)
        mom_o, _, geo_oo = _geometries(scaled_o, X)
        assert torch.allclose(head_remainders(mom_v, geo_vv, 0.1, norms), c * base_v, rtol=1e-9)
        assert torch.allclose(head_remainders(mom_o, geo_oo, 0.1, norms), c * base_ov, rtol=1e-9)


def test_regression_stage_radii_by_the_linearisation():
    """Regression (issue 12): a small post-LN layer at r = 0.1; the certified stage radii were 2.458
    (attention sublayer), 6.225 (first norm), 31.90 (FFN sublayer) with F31b (each head at its own worst
    query move and softmax shift, or r times the Jacobian sup); the exact linear maps at X plus the
    second-order remainders (F34) give 1.314, 2.488, 12.41.  Soundness first (Adam ascent on each stage's
    move), then the numbers."""
    lj = assert_stage_radii_hold(_sharp_layer(3, qscale=1.0), _X(3), (0.1,))[0]
    got = {k: float(v.max()) for k, v in lj.stage_radii.items()}
    for name, value in (("attention", 1.3137), ("norm_attn", 2.4883), ("ffn", 12.4127)):
        assert got[name] <= value * (1 + 1e-4), (name, got[name])
