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
