"""Red-team sweep of the local routes at power-of-two scales of a layer's FFN weights, norm gains and input (mend30,
Note [local weight range] in ``_local_attention``): ``layer_local`` and ``stack_local`` (and ``attention_local_bound``,
``norm_local`` where they apply) either return a bound at least the attained float64 Jacobian norm at the data, or
refuse with one ``InputError`` line -- never a raw LinAlgError/ValueError, a NaN or a false bound.  On main
``W_1 x 2^600, W_2 x 2^-600`` raised a raw ValueError, ``W_1 x 2^-600, W_2 x 2^600`` gave a NaN stack bound, both
gains of a post-LN layer at ``2^-600`` were certified 2.4e-194 against an attained 7.6e-180, and ``X x 2^600`` gave
NaN (attention) and 0 (LayerNorm).  Inside the range the routes are exactly invariant under ``W_1, b_1 x 2^k``,
``W_2 x 2^-k`` for a positively homogeneous activation (identity, ReLU: the same map; GELU is not homogeneous)."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from _attack import ref_layer
from l2_attack import full_jacobian, jacobian_2inf
from lipschitz_testkit import random_spec
from transcover import InputError
from transcover.lipschitz import attention_local_bound, layer_local, norm_local, stack_local

RHO = 1e-3


def _two(W, k: int):  # noqa: ANN001, ANN202
    return None if W is None else torch.ldexp(torch.as_tensor(W, dtype=torch.float64), torch.tensor(float(k), dtype=torch.float64))


def _case(place: str, act: str, *, k1: int = 0, k2: int = 0, kg1: int = 0, kg2: int = 0, kx: int = 0, kq: int = 0,  # noqa: ANN202
          seed: int = 1):
    """A one-layer LayerNorm spec (no input norm) with ``W_1, b_1 x 2^k1``, ``W_2 x 2^k2`` (``b_2 x 2^(k1+k2)``), the
    gain and bias of norm_attn / norm_ffn ``x 2^kg1`` / ``2^kg2``, ``W_Q, b_Q x 2^kq`` with ``W_K, b_K x 2^-kq`` (the
    same scores; all exact in float64), and its input ``x 2^kx``."""
    spec = random_spec(seed, L=1, norm="layernorm", placement=place, act=act, biases=True, input_norm=False)
    L = spec.layers[0]
    A = L.attention
    L = dataclasses.replace(L, attention=dataclasses.replace(A, W_Q=_two(A.W_Q, kq), b_Q=_two(A.b_Q, kq),
                                                             W_K=_two(A.W_K, -kq), b_K=_two(A.b_K, -kq)))
    f = L.ffn
    ffn = dataclasses.replace(f, W_1=_two(f.W_1, k1), b_1=_two(f.b_1, k1), W_2=_two(f.W_2, k2), b_2=_two(f.b_2, k1 + k2))
    norms = {n: dataclasses.replace(getattr(L, n), weight=_two(getattr(L, n).weight, k), bias=_two(getattr(L, n).bias, k))
             for n, k in (("norm_attn", kg1), ("norm_ffn", kg2))}
    L = dataclasses.replace(L, ffn=ffn, **norms)
    X = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return dataclasses.replace(spec, layers=[L]), L, _two(X, kx)


def _lower(layer, X: torch.Tensor) -> float:  # noqa: ANN001
    """The attained (2,inf) norm of the layer's Jacobian at X (``ref_layer``, the test's own forward; autograd in
    float64), its alternating maximisation run on ``J`` scaled by a power of two to max|entry| in [1/2, 1) and scaled
    back: at 2^-600 the squares inside ``jacobian_2inf`` would flush.  NaN where the forward itself overflowed."""
    J = full_jacobian(lambda Z: ref_layer(layer, Z), X)
    m = float(J.abs().max())
    if not (math.isfinite(m) and m > 0):
        return m
    e = math.frexp(m)[1]
    val = jacobian_2inf(torch.ldexp(J, torch.tensor(float(-e), dtype=torch.float64)), *X.shape, torch.Generator().manual_seed(0))
    return math.ldexp(val * (1 - 64 * torch.finfo(torch.float64).eps), e)  # the 2x30-ulp rounding of J V's norms


def _routes(spec, layer, X: torch.Tensor) -> dict:  # noqa: ANN001
    """name -> bound or the InputError's text, for the two layer routes."""
    out = {}
    for name, route in (("layer_local", lambda: layer_local(layer, X, RHO).upper),
                        ("stack_local", lambda: stack_local(spec, X, [RHO])[0].upper)):
        try:
            out[name] = route()
        except InputError as e:
            assert "\n" not in str(e) and str(e), (name, str(e))
            out[name] = str(e)
    return out


@functools.lru_cache(maxsize=None)
def _base(place: str, act: str) -> dict:
    return _routes(*_case(place, act))


def _valid_or_refused(spec, layer, X: torch.Tensor) -> dict:  # noqa: ANN001
    got = _routes(spec, layer, X)
    if any(isinstance(v, float) for v in got.values()):
        lo = _lower(layer, X)
        for name, v in got.items():
            assert not isinstance(v, float) or (v >= lo and not math.isnan(v)), (name, v, lo)
    return got


_RANGE, _SUM = "Note [local weight range]", "gains and ||W_O|| at most 400"
# (placement, scales, what both routes must give): "bound" (floats at least the attained Jacobian norm) or the text
# of the refusal. Each case names its outcome: a route that refused every case had passed the sweep unchecked (11 of
# the 18 cases are refusals; stop 40's test audit)
SWEEP = [
    ("post", dict(k1=1000, k2=-1000), _RANGE), ("post", dict(k1=190, k2=190), "bound"),
    ("post", dict(k1=-1000), _RANGE), ("post", dict(k2=600), _RANGE), ("post", dict(kg1=-190, kg2=-190), "bound"),
    ("post", dict(kg1=600), _SUM), ("post", dict(kg2=130, k1=130, k2=130), "bound"),
    ("post", dict(kx=-540), "Note [local head data range]"), ("post", dict(kx=250), "underflows float64"),
    ("pre", dict(k1=1000, k2=-1000), _RANGE), ("pre", dict(k1=190, k2=190), "bound"), ("pre", dict(k1=-1000), _RANGE),
    ("pre", dict(k2=600), _RANGE), ("pre", dict(kg1=-190, kg2=-190), "bound"), ("pre", dict(kg1=600), _SUM),
    ("pre", dict(kg2=130, k1=130, k2=130), "bound"), ("pre", dict(kx=-540), "bound"), ("pre", dict(kx=250), "bound"),
]


@pytest.mark.parametrize("place,scale,expect", SWEEP)
def test_sweep_bound_is_valid_or_refused(place, scale, expect):
    """Every route returns a bound above the attained Jacobian norm at the data, or one InputError line naming why
    (the scales main failed at are in the two tests below); which of the two each case gives is part of the test."""
    got = _valid_or_refused(*_case(place, "gelu", **scale))
    if expect == "bound":
        assert all(isinstance(v, float) for v in got.values()), got
    else:
        assert all(isinstance(v, str) and expect in v for v in got.values()), got


@pytest.mark.parametrize("scale,main_gave", [(dict(k1=600, k2=-600), "raw ValueError (an overflowed column norm)"),
                                             (dict(k1=-600, k2=600), "a NaN stack bound"),
                                             (dict(k1=400, k2=400), "a raw LinAlgError from eigh"),
                                             (dict(kg1=-600), "2.4e-194 against an attained 7.6e-180"),
                                             (dict(kg2=-600), "1.65e-181 against an attained 5.8e-180")])
def test_layers_outside_the_weight_range_are_refused(scale, main_gave):
    """Note [local weight range]: both layer routes refuse (on main: ``main_gave``)."""
    spec, layer, X = _case("post", "gelu", **scale)
    got = _routes(spec, layer, X)
    assert all(isinstance(v, str) and "Note [local weight range]" in v for v in got.values()), (got, main_gave)


def test_an_overflowed_input_is_refused_by_every_local_route():
    """``X x 2^600``: the scores and the LayerNorm spread overflow; on main attention_local_bound gave NaN and
    norm_local 0 (a false bound: the norm's constant there is about 2^-600, positive)."""
    spec, layer, X = _case("post", "gelu", kx=600)
    for route in (lambda: attention_local_bound(layer.attention, X, RHO), lambda: norm_local(layer.norm_attn, X, RHO)):
        with pytest.raises(InputError, match="overflows float64"):
            route()
    assert all(isinstance(v, str) for v in _routes(spec, layer, X).values())


@pytest.mark.parametrize("act,place,k", [("identity", "post", 150), ("identity", "pre", -150), ("relu", "post", -150),
                                         ("relu", "pre", 150)])
def test_same_map_same_bound_inside_the_range(act, place, k):
    """``W_1, b_1 x 2^k`` with ``W_2 x 2^-k`` is the same map for a positively homogeneous activation; inside the
    range both routes give the very same floats as at ``k = 0``."""
    base = _base(place, act)
    assert all(isinstance(v, float) for v in base.values()), base
    assert _routes(*_case(place, act, k1=k, k2=-k)) == base


@pytest.mark.parametrize("k", [-150, 150])
def test_last_gain_scales_the_post_ln_bound(k):
    """Post-LN, the layer ends in norm_ffn: its gain and bias ``x 2^k`` scale the map, and both routes' bounds, by
    exactly ``2^k``."""
    base = _base("post", "identity")
    got = _routes(*_case("post", "identity", kg2=k))
    assert got == {n: math.ldexp(v, k) for n, v in base.items()}, (got, base)


def test_a_power_moved_from_w_k_to_w_q_is_not_a_crash():
    """``W_Q x 2^600`` with ``W_K x 2^-600`` (the same scores), post-LN: on main ``stack_local`` raised a raw
    OverflowError (Python's ``float ** 2`` of ``||W_Q||_F`` in F53a's ``joint_query_lmax``); now that term is inf
    and both routes return bounds that hold."""
    got = _valid_or_refused(*_case("post", "gelu", kq=600))
    assert all(isinstance(v, float) for v in got.values()), got
