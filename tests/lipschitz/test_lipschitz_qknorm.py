"""Attention with per-head query/key RMSNorm (Qwen3, THEORY F23): forward, soundness, homogeneity, refusals."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from _attack import Domain, attack_pairs, fuzz_spec, ref_attention, ref_stage
from _fuzzcase import Case, run_case, violations
from transcover import InputError, UnsupportedArchitectureError
from transcover.lipschitz import layer_local, lipschitz_bounds, perturbation_coefficients
from transcover.lipschitz._qknorm import score_magnitude_bound, side_bounds
from transcover.model import attention_forward

F64 = torch.float64


def _attn_stage(spec, radius=1.0):
    return next(s for s in lipschitz_bounds(spec, radius=radius).stages if s.name == "attention")


def test_forward_is_the_independent_reference():
    spec = fuzz_spec(1, norm="rmsnorm", placement="pre", biases=True, rope=True, rope_biases=True, rotary_dim=2,
                     qk_norm=True, Hkv=1, H=2, causal=True)
    a = spec.layers[0].attention
    X = torch.randn(2, 5, 6, dtype=F64, generator=torch.Generator().manual_seed(0))
    ref = ref_attention(a, X)
    assert float((attention_forward(a, X) - ref).abs().max()) <= 1e3 * torch.finfo(F64).eps * (1 + float(ref.abs().max()))


def test_scores_are_bounded_by_the_normalisation_whatever_the_weights():
    """|s_ij| <= s max|gamma_q| max|gamma_k| d_head (F23) while ||W_Q W_K^T|| grows like lam^2."""
    spec = fuzz_spec(2, norm="none", placement="pre", qk_norm=True, rope=True)
    a = spec.layers[0].attention
    dh = a.d_head
    gq, gk = a.q_norm.gamma_max_abs, a.k_norm.gamma_max_abs
    bound = score_magnitude_bound(a.softmax_scale, gq * math.sqrt(dh), gk * math.sqrt(dh))
    assert bound == pytest.approx(a.softmax_scale * gq * gk * dh, rel=1e-14)
    from transcover.model._functional import attention_scores

    X = 50.0 * torch.randn(4, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    for lam in (1.0, 100.0):
        big = replace(a, W_Q=a.W_Q * lam, W_K=a.W_K * lam)
        top = max(float(attention_scores(big, X, h).abs().max()) for h in range(a.n_heads))
        assert top <= bound


FIXED = [
    Case(1, norm="rmsnorm", placement="pre", qk_norm=True, rope=True, causal=True),
    Case(2, norm="none", placement="pre", qk_norm=True, biases=True, scale=3.0, radius=3.0),
    Case(3, norm="layernorm", placement="pre", qk_norm=True, metric="fro", residual="parallel", biases=True, rope=True,
         rope_biases=True, qk=8.0),
]


@pytest.mark.parametrize("c", FIXED, ids=lambda c: f"seed{c.seed}-{c.norm}-{c.metric}")
def test_no_qknorm_certificate_is_beaten_by_the_attacker(c):
    checks = run_case(c, restarts=3, steps=12)
    kinds = {k for k, *_ in checks}
    assert {"stage", "layer", "network", "G.3"} <= kinds  # G.3 with split scores (F23)
    assert not violations(checks), violations(checks)


def test_the_norms_amplification_is_charged():
    """W_K = 0 and a unit key bias: without the norms F6/F22 allow 7.36 on this head, yet the RMSNorm's
    slope max|gamma|/sqrt(eps) near 0 lets the attacker reach 40.3; the F23 bound (4227) holds."""
    spec = fuzz_spec(9, norm="none", placement="pre", biases=True, rope=True, rope_biases=True, qk_norm=True,
                     qk_eps=1e-4)
    lay = spec.layers[0]
    a = lay.attention
    a = replace(a, W_K=a.W_K * 0, b_K=a.b_K / a.b_K.norm(dim=-1, keepdim=True), b_Q=None)
    spec = replace(spec, layers=[replace(lay, attention=a)])
    naive = _attn_stage(replace(spec, layers=[replace(lay, attention=replace(a, q_norm=None, k_norm=None))]))
    st = _attn_stage(spec)
    w = attack_pairs(ref_stage(spec, 0, "attention"), T=3, d=6, dom=Domain(1.0), metric="2,inf", restarts=6,
                     steps=40, seed=3)
    assert w.ratio - w.slack <= st.lipschitz
    assert w.ratio > 2 * naive.lipschitz, (w.ratio, naive.lipschitz)


def test_radius_exponent_is_one_with_both_norms():
    """Normalised scores make the head's constant affine in the radius (values only), where F6 on
    the raw weights grows like r^2."""
    spec = fuzz_spec(4, norm="none", placement="pre", qk_norm=True)
    raw = replace(spec, layers=[replace(lay, attention=replace(lay.attention, q_norm=None, k_norm=None))
                                for lay in spec.layers])

    def comp(s, r):
        return _attn_stage(s, r).components["attention"]

    assert comp(spec, 100.0) / comp(spec, 10.0) <= 10.0 * (1 + 1e-9)
    assert comp(raw, 100.0) / comp(raw, 10.0) >= 50.0  # quadratic regime without the norms
    # and scaling W_Q by lam multiplies the score-difference term a by lam, leaves c unchanged (exponent 1, 0)
    L0 = spec.layers[0].attention
    for lam in (4.0, 16.0):
        q1 = side_bounds(1.0, 0.0, 1.0, 2.0, 3.0)
        ql = side_bounds(lam, 0.0, 1.0, 2.0, 3.0)
        assert ql == (q1[0], lam * q1[1])
        big = replace(spec, layers=[replace(spec.layers[0], attention=replace(L0, W_Q=L0.W_Q * lam))])
        w = attack_pairs(ref_stage(big, 0, "attention"), T=3, d=6, dom=Domain(1.0), metric="2,inf", restarts=3,
                         steps=12, seed=5, n_jacobian=2)
        assert w.ratio - w.slack <= _attn_stage(big).lipschitz


def test_paths_without_a_derivation_refuse_query_key_normalisation():
    spec = fuzz_spec(5, norm="rmsnorm", placement="pre", qk_norm=True)
    assert "q_norm.gamma" in {e.role for e in perturbation_coefficients(spec).entries}  # G.3 derived (F23)
    with pytest.raises(InputError, match="query/key normalisation"):
        layer_local(spec.layers[0], torch.randn(3, 6, dtype=F64), 0.1)
    zero_eps = replace(spec, layers=[replace(lay, attention=replace(lay.attention, q_norm=replace(
        lay.attention.q_norm, eps=0.0))) for lay in spec.layers])
    with pytest.raises(InputError):
        lipschitz_bounds(zero_eps)
