"""``norms.measure_model``: one measurement, every interval true, distances as the lemma charges them.

References are independent: float64 SVDs of the explicitly formed matrices (``torch.linalg``),
explicit (2,1) column sums, explicit bias products.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover import Interval, Kind
from transcover._results import as_dict, rounding_pad
from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec
from transcover.norms import measure_model

_U = 2.0**-53


def _svd(M: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(M.double(), 2))


def _l21(M: torch.Tensor) -> float:
    return float(M.double().norm(dim=0).sum())


def _slack(n: int) -> float:
    """Relative error of a float64 SVD / column sum of an n-sized problem (the reference's own rounding)."""
    return 8 * n * _U


def _pair(seed: int, rel: float, **cfg):
    torch.manual_seed(seed)
    a = ReferenceTransformer(ReferenceConfig(**cfg))
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(rel * torch.randn_like(p))
    return reference_spec(a), reference_spec(b)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), rel=st.floats(1e-3, 1.0), scale=st.floats(0.2, 4.0),
       norm=st.sampled_from(["ball", "layernorm"]))
def test_every_interval_contains_the_svd_and_distances_dominate_the_explicit_ones(seed, rel, scale, norm):
    sa, sb = _pair(seed, rel, d_model=8, n_heads=2, n_layers=2, d_ff=12, init_scale=scale, norm=norm)
    m = measure_model(sa, reference=sb, entrywise=True)
    for layer, lm, lb in zip(sa.layers, m.layers, sb.layers):
        a, ar = layer.attention, lb.attention
        s = a.softmax_scale
        for h, hm in enumerate(lm.heads):
            Wq, Wk, Wv, Wo = (torch.as_tensor(x).double() for x in a.head(h))
            checks = [(hm.W_QK, Wq @ Wk.T), (hm.W_OV, Wv @ Wo), (hm.W_Q, Wq), (hm.W_V, Wv), (hm.W_KQ(s), s * Wq @ Wk.T)]
            for iv, M in checks:
                true = _svd(M)
                assert iv.lower <= true * (1 + _slack(M.numel())) and true <= iv.upper * (1 + _slack(M.numel()))
            assert _l21(s * Wq @ Wk.T) <= hm.l21_KQ.upper * (1 + _slack(64))
            rq, rk, rv, ro = (torch.as_tensor(x).double() for x in ar.head(h))
            dkq = s * Wq @ Wk.T - ar.softmax_scale * rq @ rk.T
            dov = Wv @ Wo - rv @ ro
            for role, D in ((f"W_KQ.{h}", dkq), (f"W_OV.{h}", dov)):
                d = m.distances[(layer.index, role)]
                assert _svd(D) <= d.value * (1 + _slack(D.numel())) and _l21(D) <= d.l21 * (1 + _slack(D.numel()))
        for name in ("W_1", "W_2"):
            W = torch.as_tensor(getattr(layer.ffn, name)).double()
            D = W - torch.as_tensor(getattr(lb.ffn, name)).double()
            assert _svd(W) <= getattr(lm, name).upper * (1 + _slack(W.numel()))
            assert _l21(W) <= lm.l21[name].upper * (1 + _slack(W.numel()))
            d = m.distances[(layer.index, name)]
            assert _svd(D) <= d.value * (1 + _slack(D.numel())) and _l21(D) <= d.l21 * (1 + _slack(D.numel()))


def test_norms_are_homogeneous_in_each_weight():
    """Scaling W_V by lam scales ||W_V||, ||W_V W_O|| by lam and leaves ||W_Q W_K^T|| alone (exponent 1, 0)."""
    torch.manual_seed(1)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=12))
    base = measure_model(reference_spec(model))
    lam = 3.0  # not a power of two: every route rounds again
    with torch.no_grad():
        model.blocks[0].W_V.mul_(lam)
    scaled = measure_model(reference_spec(model))
    for h0, h1 in zip(base.layers[0].heads, scaled.layers[0].heads):
        assert h1.W_V.upper == pytest.approx(lam * h0.W_V.upper, rel=1e-6)
        assert h1.W_OV.upper == pytest.approx(lam * h0.W_OV.upper, rel=1e-6)
        assert h1.W_QK.upper == pytest.approx(h0.W_QK.upper, rel=1e-6)


def test_identical_models_are_at_distance_zero():
    sa, _ = _pair(0, 0.1, d_model=8, n_heads=2, n_layers=1, d_ff=12, norm="layernorm")
    m = measure_model(sa, reference=sa, entrywise=True)
    assert m.distances and all(d.value == 0.0 for d in m.distances.values())


def test_biases_are_measured_as_the_lemma_charges_them():
    """``||b_Q^h W_K^hT||`` (the query bias's only effect) and ``||b_O + sum_h b_V^h W_O^h||``."""
    torch.manual_seed(2)
    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=12)))
    layer = spec.layers[0]
    a = layer.attention
    bq, bv, bo = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    a2 = dataclasses.replace(a, b_Q=bq, b_V=bv, b_O=bo)
    spec2 = dataclasses.replace(spec, layers=(dataclasses.replace(layer, attention=a2),))
    lm = measure_model(spec2).layers[0]
    for h, hm in enumerate(lm.heads):
        want = float((bq[h] @ torch.as_tensor(a.W_K[h]).double().T).norm())
        assert hm.b_QK == pytest.approx(want, rel=1e-14)
    want = bo + sum(bv[h] @ torch.as_tensor(a.W_O[h]).double() for h in range(2))
    assert lm.b_out == pytest.approx(float(want.norm()), rel=1e-14)
    assert lm.has_query_bias


def test_interval_dicts_keep_their_kind():
    """Regression (issue 11): ``Interval.to_dict`` dropped ``kind``, so a JSON reader could not tell a
    certified interval from an estimate."""
    for kind in (Kind.CERTIFIED_INTERVAL, Kind.ESTIMATE):
        d = Interval(1.0, 2.0, kind, "m").to_dict()
        assert d == {"lower": 1.0, "upper": 2.0, "kind": kind.value}
    m = measure_model(_pair(0, 0.1, d_model=8, n_heads=2, n_layers=1, d_ff=12)[0])
    text = json.dumps(m.to_dict())
    assert '"kind": "certified interval"' in text


def test_the_serialiser_keeps_kind_properties_and_drops_nothing_else():
    @dataclasses.dataclass(frozen=True)
    class R:
        value: float
        parts: tuple[Interval, ...]

        @property
        def kind(self) -> Kind:
            return Kind.CERTIFIED_UPPER

    d = as_dict(R(1.5, (Interval(0.0, 1.0),)))
    assert d == {"value": 1.5, "parts": [{"lower": 0.0, "upper": 1.0, "kind": "certified interval"}],
                 "kind": "certified upper bound"}


@pytest.mark.parametrize("n", [1, 10**3, 10**6, 4 * 10**6, 10**8])
def test_rounding_pad_dominates_the_sum_of_squares_error(n):
    """Regression (issue 11): covering padded float64 norms by 1e-10 "for sums of <= 1e6 squares", but
    gamma_{1e6} = 1.11e-10 > 1e-10.  The one pad covers gamma_n (doubled) for every n it is asked for,
    and is never below the pads it replaced (1e-9, 1e-10)."""
    from transcover.covering import _model_bound
    from transcover.lipschitz import _weights

    gamma = n * _U / (1 - n * _U)
    assert rounding_pad(terms=n) >= 2 * gamma
    assert rounding_pad() >= 1e-9
    assert _weights.ROUNDING_PAD >= 1e-9 and _model_bound._PAD >= 1e-9
    if n <= 10**6:  # the vectors the covering pad was stated for
        assert _model_bound._PAD >= 2 * gamma
    assert math.isfinite(rounding_pad(np.float32)) and rounding_pad(np.float32) > rounding_pad()


def _exact_product_difference(sa: float, Aa, Ba, sb: float, Ab, Bb):  # noqa: ANN001, ANN202
    """``||sa Aa Ba - sb Ab Bb||_2`` in mpmath (320 bits, conftest) of the stored floats, and the balanced scale
    ``||dA||_F ||B_a||_F + ||A_b||_F ||dB||_F`` of the scaled factors (Note [product differences])."""
    import mpmath

    def mat(x):  # noqa: ANN001, ANN202
        return mpmath.matrix(torch.as_tensor(x).double().tolist())

    A1, B1, A2, B2 = (mat(x) for x in (Aa, Ba, Ab, Bb))
    A1, A2 = A1 * mpmath.mpf(sa), A2 * mpmath.mpf(sb)
    exact = max(mpmath.svd_r(A1 * B1 - A2 * B2, compute_uv=False))
    scale = mpmath.mnorm(A1 - A2, "f") * mpmath.mnorm(B1, "f") + mpmath.mnorm(A2, "f") * mpmath.mnorm(B1 - B2, "f")
    return exact, scale


@pytest.mark.parametrize("other_scale", [None, 0.4375])
def test_product_distances_of_float32_models_an_ulp_apart_are_tight(other_scale):
    """Red team 220: two float32 checkpoints 1e-7 apart got ||dW_KQ|| = 3.37e-6 against an exact 1.35e-8 (250x) and
    ||dW_OV|| 6.79e-6 against 3.07e-9 (2200x): the certificate of the concatenated product [A_a, -A_b][B_a; B_b] errs
    by about sqrt(r u) times the weights' size, not the change's.  The distance must lie above the exact one (320-bit
    mpmath) and within the certificate's own terms of it: its rtol (1e-6 on the square) and the Gram floor
    sqrt(64 r u) times the balanced factors' scale (err_K <= 4 gamma_r ||P||_F^2 ||Q||_F^2, charged a few times over,
    with the power-of-two balance within 1.25 of the best), r = 2 d_head.  A scale that differs (0.4375 against
    0.5) takes the route that forms the scaled factors."""
    torch.manual_seed(3)
    a = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=12))
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():  # float32: about half the entries move by an ulp or two, the rest stay
            p.add_(1e-7 * p.abs() * torch.randn_like(p))
    sa, sb = reference_spec(a), reference_spec(b)
    assert sa.layers[0].attention.W_Q.dtype == torch.float32
    if other_scale is not None:
        sb = dataclasses.replace(sb, layers=tuple(dataclasses.replace(
            layer, attention=dataclasses.replace(layer.attention, scale=other_scale)) for layer in sb.layers))
    m = measure_model(sa, reference=sb)
    aa, ab = sa.layers[0].attention, sb.layers[0].attention
    r = 2 * aa.d_head
    tight = 0
    for h in range(aa.n_heads):
        qa, ka, va, oa = aa.head(h)
        qb, kb, vb, ob = ab.head(h)
        for role, args in ((f"W_KQ.{h}", (aa.softmax_scale, qa, ka.T, ab.softmax_scale, qb, kb.T)),
                           (f"W_OV.{h}", (1.0, va, oa, 1.0, vb, ob))):
            exact, scale = _exact_product_difference(*args)
            got = m.distances[(0, role)].value
            assert exact <= got, (role, got, exact)
            assert got <= exact * (1 + 1e-6) + math.sqrt(64 * r * _U) * 1.25 * scale, (role, got, exact, scale)
            tight += exact > 0 and got <= exact * (1 + 1e-6)
    assert tight == 2 * aa.n_heads  # the changes are far above the certificate's floor: the distances are exact


@pytest.mark.parametrize("k", [-40, -3, 5, 60])
def test_product_difference_is_homogeneous_and_above_the_exact_distance(k):
    """``product_difference_upper`` (Note [product differences]) scales with either pair of factors: scaling both
    models' ``A`` (or both ``B``) by ``2^k`` scales the exact ``||A_a B_a - A_b B_b||_2`` by ``2^k`` and, every step
    being exact at powers of two, the bound by exactly ``2^k``; and it stays above the exact distance (mpmath, 60
    digits, from the float32 weights taken exactly), on pairs 1e-6 apart, where the old concatenated certificate
    was loosest."""
    import mpmath

    from transcover.norms._model import product_difference_upper as pdu

    g = torch.Generator().manual_seed(k + 100)

    def f32(*shape, base=None):  # noqa: ANN001, ANN202
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        return (x if base is None else base + 1e-6 * x).float().double()

    Aa, Ba = f32(8, 3), f32(3, 8)
    Ab, Bb = f32(8, 3, base=Aa), f32(3, 8, base=Ba)
    u = pdu(Aa, Ba, Ab, Bb)
    s = torch.tensor(k)
    assert pdu(torch.ldexp(Aa, s), Ba, torch.ldexp(Ab, s), Bb) == u * 2.0**k
    assert pdu(Aa, torch.ldexp(Ba, s), Ab, torch.ldexp(Bb, s)) == u * 2.0**k
    with mpmath.workdps(60):
        m = lambda t: mpmath.matrix(t.tolist())  # noqa: E731  (float64 entries, exact)
        exact = max(mpmath.svd_r(m(Aa) * m(Ba) - m(Ab) * m(Bb), compute_uv=False))
    assert u >= exact and u <= exact * (1 + 1e-6), (u, exact)
