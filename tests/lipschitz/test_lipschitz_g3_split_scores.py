"""Lemma G.3 where the scores are not a function of W_Q W_K^T (THEORY F22/F23 G.3 paragraphs,
Note [split G.3] in ``lipschitz._qknorm``): query/key normalisation and RoPE with query/key biases.

The attacker is float64 projected gradient ascent on ``||g_A(X) - g_B(X)||`` over the certified
domain (``_attack.attack_gap``), for pairs that differ in one piece only (so the bound is that
piece's own term and nothing else can pay for it), and for pairs where every weight moves.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from _attack import Domain, attack_gap, fuzz_spec, ref_attention, ref_stage
from _fuzzcase import perturbed
from transcover import InputError
from transcover.lipschitz import perturbation_bound
from transcover.lipschitz._qknorm import split_perturbation_coefficients
from transcover.lipschitz._weights import spec_norms

F64 = torch.float64


def _with(spec, **attn):
    lay = spec.layers[0]
    return replace(spec, layers=[replace(lay, attention=replace(lay.attention, **attn))])


def _qk_spec(seed=3):
    return fuzz_spec(seed, norm="none", placement="pre", qk_norm=True, biases=True, rope=True, rope_biases=True,
                     qk_eps=1e-2, H=4, Hkv=2)


def _rope_bias_spec(seed=4):
    return fuzz_spec(seed, norm="none", placement="pre", biases=True, rope=True, rope_biases=True, rotary_dim=2,
                     causal=True)


def _moves():
    """(name, spec builder, change applied to the attention of model B): one piece each."""
    g = torch.Generator().manual_seed(11)

    def noise(t, s=0.5):
        return t + s * torch.randn(t.shape, generator=g, dtype=F64)

    return [
        ("q_norm.gamma", _qk_spec, lambda a: dict(q_norm=replace(a.q_norm, weight=noise(a.q_norm.weight)))),
        ("k_norm.gamma", _qk_spec, lambda a: dict(k_norm=replace(a.k_norm, weight=noise(a.k_norm.weight)))),
        ("W_Q", _qk_spec, lambda a: dict(W_Q=noise(a.W_Q))),
        ("b_K", _qk_spec, lambda a: dict(b_K=noise(a.b_K))),
        ("W_K", _rope_bias_spec, lambda a: dict(W_K=noise(a.W_K))),
        ("b_Q", _rope_bias_spec, lambda a: dict(b_Q=noise(a.b_Q, 2.0))),
        ("b_K", _rope_bias_spec, lambda a: dict(b_K=noise(a.b_K, 2.0))),
    ]


@pytest.mark.parametrize("k", range(7), ids=lambda k: _moves()[k][0] + ("-qknorm" if k < 4 else "-rope-bias"))
def test_one_piece_moved_is_charged_by_its_own_term(k):
    name, build, move = _moves()[k]
    a_spec = build()
    b_spec = _with(a_spec, **move(a_spec.layers[0].attention))
    pb = perturbation_bound(a_spec, b_spec, radius=2.0)
    charged = {e.role.split(".")[0] for e, d, c in pb.terms() if c > 0}
    assert charged == {name.split(".")[0]}, charged  # the moved piece, and only it, is charged
    w = attack_gap(ref_stage(a_spec, 0, "network"), ref_stage(b_spec, 0, "network"), T=3, d=6, dom=Domain(2.0),
                   metric="2,inf", restarts=4, steps=25, seed=k)
    assert w.ratio - w.slack <= pb.total.value, (name, w.ratio, pb.total.value)
    assert w.ratio > 1e-3 * pb.total.value  # the change is real: a bound without this term would be beaten


@pytest.mark.parametrize("metric", ["2,inf", "fro"])
def test_every_weight_moved_is_certified(metric):
    for build in (_qk_spec, _rope_bias_spec):
        a_spec = build(seed=21)
        b_spec = perturbed(a_spec, 5, 0.05)
        T = 4
        pb = perturbation_bound(a_spec, b_spec, radius=1.5, metric=metric, seq_len=T if metric == "fro" else None)
        w = attack_gap(ref_stage(a_spec, 0, "network"), ref_stage(b_spec, 0, "network"), T=T, d=6,
                       dom=Domain(1.5), metric=metric, restarts=4, steps=20, seed=2)
        assert w.ratio - w.slack <= pb.total.value


def test_coefficient_exponents_follow_the_function():
    """Scaling W_V by lam multiplies the attention's change under dW_Q by lam (P X W_OV is linear in W_V):
    the W_Q/W_K/gamma coefficients follow with exponent 1.  Scaling W_K by lam leaves the normalised keys
    (hence the W_Q coefficient) unchanged with a key norm (exponent 0), and multiplies K_max = ||W_K|| r
    without one (exponent 1, RoPE with a query bias only)."""
    def coeffs(spec):
        return {role: c for role, c, _ in split_perturbation_coefficients(spec_norms(spec).layers[0], 1.0, 1.0)}

    for base in (_qk_spec(), _rope_bias_spec()):
        a = base.layers[0].attention
        c1, c4 = coeffs(base), coeffs(_with(base, W_V=a.W_V * 4.0))
        for role in c1:
            if role.startswith(("W_Q", "W_K", "b_Q", "b_K", "q_norm", "k_norm")):
                assert c4[role] == pytest.approx(4.0 * c1[role], rel=1e-5), role
            elif role.startswith("W_OV"):
                assert c4[role] == c1[role]
    qk = _qk_spec()
    a = qk.layers[0].attention
    assert coeffs(_with(qk, W_K=a.W_K * 8.0))["W_Q.0"] == pytest.approx(coeffs(qk)["W_Q.0"], rel=1e-12)
    rb = _with(_rope_bias_spec(), b_K=None)
    a = rb.layers[0].attention
    assert coeffs(_with(rb, W_K=a.W_K * 8.0))["W_Q.0"] == pytest.approx(8.0 * coeffs(rb)["W_Q.0"], rel=1e-5)


def test_measured_gap_scales_with_the_values_and_stays_certified():
    a_spec = _qk_spec(seed=8)
    a = a_spec.layers[0].attention
    g = torch.Generator().manual_seed(1)
    moved = dict(W_Q=a.W_Q + 0.3 * torch.randn(a.W_Q.shape, generator=g, dtype=F64))
    X = torch.randn(16, 3, 6, generator=g, dtype=F64)
    X = X / torch.linalg.vector_norm(X, dim=-1, keepdim=True).clamp_min(1.0)  # every token in Domain(1.0)
    gaps, bounds = [], []
    for lam in (1.0, 5.0):
        A = _with(a_spec, W_V=a.W_V * lam)
        B = _with(A, **moved)
        bound = perturbation_bound(A, B, radius=1.0).total.value
        fa = (lambda X, s, at=A.layers[0].attention: ref_attention(at, X))
        fb = (lambda X, s, at=B.layers[0].attention: ref_attention(at, X))
        w = attack_gap(fa, fb, T=3, d=6, dom=Domain(1.0), metric="2,inf", restarts=3, steps=20, seed=3)
        assert w.ratio - w.slack <= bound
        gaps.append(torch.linalg.vector_norm(fa(X, []) - fb(X, []), dim=-1).amax(-1))
        bounds.append(bound)
    # the true gap is exactly linear in lam at every fixed input (compared point by point, not through two
    # searches whose trajectories rounding may split), and so is the certified bound's value part
    assert torch.allclose(gaps[1], 5.0 * gaps[0], rtol=1e-12, atol=0)
    assert bounds[1] == pytest.approx(5.0 * bounds[0], rel=1e-9)


def test_pairs_the_split_lemma_does_not_cover_are_refused():
    spec = _qk_spec()
    a = spec.layers[0].attention
    with pytest.raises(InputError, match="softmax scales differ"):
        perturbation_bound(spec, _with(spec, scale=0.3))
    with pytest.raises(InputError, match="variance floors differ"):
        perturbation_bound(spec, _with(spec, q_norm=replace(a.q_norm, eps=0.5)))
