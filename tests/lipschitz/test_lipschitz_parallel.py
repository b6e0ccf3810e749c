"""The parallel residual x + attn(N_1 x) + ffn(N_2 x) (THEORY F21) and RoPE with query/key biases (F22).

Soundness: the independent attacker (``_attack``: float64 reference forward, projected ascent over
pairs, Jacobian power iteration) against every certified stage, layer, network and G.3 value on
random parallel-residual models; an exact case where the F21 constant is attained; homogeneity of
the bound in the weights whose exponent is known; the refusals where a bound is not derived.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from _attack import Domain, attack_pairs, fuzz_spec, ref_layer, ref_stage
from _fuzzcase import Case, run_case, violations
from transcover import InputError, UnsupportedArchitectureError
from transcover.lipschitz import layer_local, lipschitz_bounds, lipschitz_lower, perturbation_coefficients
from transcover.lipschitz._parallel import parallel_residual_lipschitz
from transcover.model import (
    Activation, AttentionSpec, FFNSpec, LayerSpec, NormKind, NormSpec, Placement, Residual, TransformerSpec,
    layer_forward,
)

F64 = torch.float64


def _as_sequential(spec):
    return replace(spec, layers=[replace(lay, residual=Residual.SEQUENTIAL) for lay in spec.layers])


def test_forward_is_the_independent_reference():
    spec = fuzz_spec(3, norm="layernorm", placement="pre", biases=True, rope=True, rope_biases=True, rotary_dim=2,
                     causal=True, residual="parallel", L=1)
    X = torch.randn(2, 5, 6, dtype=F64, generator=torch.Generator().manual_seed(0))
    lay = spec.layers[0]
    err = float((layer_forward(lay, X) - ref_layer(lay, X)).abs().max())
    assert err <= 1e3 * torch.finfo(F64).eps * (1 + float(ref_layer(lay, X).abs().max()))
    # and it is not the sequential layer on the same weights
    seq = float((layer_forward(replace(lay, residual=Residual.SEQUENTIAL), X) - ref_layer(lay, X)).abs().max())
    assert seq > 1e-3


def test_parallel_stage_is_the_f19_sum_and_beats_the_sequential_product():
    # Pi_norm keeps every branch radius at <= 1 in both layouts and a plain FFN's constant does not
    # depend on the radius, so the parallel constant is exactly the F21 sum of the sequential pieces.
    spec = fuzz_spec(5, norm="ball", placement="pre", biases=True, residual="parallel", L=1)
    par = lipschitz_bounds(spec, radius=1.5)
    seq = lipschitz_bounds(_as_sequential(spec), radius=1.5)
    st = next(s for s in par.stages if s.name == "parallel")
    sa = next(s for s in seq.stages if s.name == "attention")
    sf = next(s for s in seq.stages if s.name == "ffn")
    assert [s.name for s in par.stages] == ["input_norm", "parallel", "final_norm"]
    assert st.lipschitz == parallel_residual_lipschitz(sa.components["attention"], sa.components["norm_attn"],
                                                       sf.components["ffn"], sf.components["norm_ffn"])
    assert st.lipschitz == pytest.approx(sa.lipschitz + sf.lipschitz - 1.0, rel=1e-14)
    assert st.lipschitz < sa.lipschitz * sf.lipschitz
    assert par.upper.value < seq.upper.value


def _aligned(a: float, b: float, T: int) -> tuple[TransformerSpec, float]:
    """W_Q = 0 (uniform attention), W_OV = a u u^T, W_1 W_2 = b u u^T, identity activation, no norms:
    f(X)_i = x_i + mean_j(x_j) W_OV + x_i W_1 W_2, whose (2,inf) constant is exactly 1 + a + b
    (move every token by the same t u)."""
    d, dh = 4, 2
    u = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=F64)
    u = u / u.norm()
    e = torch.zeros(dh, dtype=F64)
    e[0] = 1.0
    attn = AttentionSpec(W_Q=torch.zeros(1, d, dh, dtype=F64), W_K=torch.randn(1, d, dh, dtype=F64),
                         W_V=(math.sqrt(a) * torch.outer(u, e))[None], W_O=(math.sqrt(a) * torch.outer(e, u))[None])
    f = torch.zeros(3, dtype=F64)
    f[1] = 1.0
    ffn = FFNSpec(W_1=math.sqrt(b) * torch.outer(u, f), W_2=math.sqrt(b) * torch.outer(f, u),
                  activation=Activation.IDENTITY)
    none = NormSpec(NormKind.NONE)
    layer = LayerSpec(0, attn, ffn, none, none, Placement.PRE, residual=Residual.PARALLEL)
    return TransformerSpec(arch="t", name="aligned", d_model=d, layers=[layer]), 1.0 + a + b


@pytest.mark.parametrize("a,b", [(0.5, 2.0), (3.0, 0.25)])
def test_the_f19_constant_is_attained(a, b):
    spec, exact = _aligned(a, b, 3)
    bounds = lipschitz_bounds(spec, radius=1.0)
    st = next(s for s in bounds.stages if s.name == "parallel")
    # certified >= exact, and within the spectral certificates' rtol (1e-6) of it: no slack in F21 here
    assert exact <= st.lipschitz <= exact * (1 + 1e-5)
    # the sequential composition of the same weights would claim (1 + a)(1 + b): F21 is strictly tighter
    seq = next(s for s in lipschitz_bounds(_as_sequential(spec), radius=1.0).stages if s.name == "ffn")
    assert seq.lipschitz * (1 + a) > st.lipschitz * (1 + 0.5 * min(a, b))
    w = attack_pairs(ref_stage(spec, 0, "parallel"), T=3, d=4, dom=Domain(1.0), metric="2,inf",
                     restarts=3, steps=15, seed=1, n_jacobian=2)
    assert w.ratio - w.slack <= st.lipschitz
    assert w.ratio >= exact * (1 - 1e-3), (w.ratio, exact)  # the attacker reaches the exact constant


@pytest.mark.parametrize("which", ["W_2", "W_V"])
def test_bound_is_homogeneous_of_degree_one_in_each_branch(which):
    """Scaling W_2 by lam scales L_F by lam (F7), scaling W_V scales L_A by lam (F6 is linear in
    B_OV, B_V): the F21 constant minus the other branch and the 1 is exactly linear in lam, and the
    attacker's measured constant grows at least linearly too (within the bound)."""
    base = fuzz_spec(11, norm="none", placement="pre", biases=True, residual="parallel", L=1, act="relu")

    def scaled(lam):
        lay = base.layers[0]
        if which == "W_2":
            lay = replace(lay, ffn=replace(lay.ffn, W_2=lay.ffn.W_2 * lam))
        else:
            lay = replace(lay, attention=replace(lay.attention, W_V=lay.attention.W_V * lam))
        return replace(base, layers=[lay])

    def stage(lam):
        return next(s for s in lipschitz_bounds(scaled(lam), radius=1.0).stages if s.name == "parallel")

    s1, s4, s16 = stage(1.0), stage(4.0), stage(16.0)
    other = "attention" if which == "W_2" else "ffn"
    branch = "ffn" if which == "W_2" else "attention"
    for s, lam in ((s4, 4.0), (s16, 16.0)):
        assert s.components[other] == pytest.approx(s1.components[other], rel=1e-12)
        assert s.components[branch] == pytest.approx(lam * s1.components[branch], rel=1e-5)
    lows = []
    for lam, s in ((1.0, s1), (16.0, s16)):
        w = attack_pairs(ref_stage(scaled(lam), 0, "parallel"), T=3, d=6, dom=Domain(1.0), metric="2,inf",
                         restarts=4, steps=20, seed=2)
        assert w.ratio - w.slack <= s.lipschitz
        lows.append(w.ratio)
    assert lows[1] - 1.0 >= 4.0 * (lows[0] - 1.0) * 0.5  # grows with lam (exponent 1, loose lower check)


PARALLEL_CASES = [
    Case(1, norm="layernorm", placement="pre", residual="parallel", biases=True, L=2, final_norm=True),
    Case(2, norm="rmsnorm", placement="pre", residual="parallel", rope=True, rope_biases=True, biases=True,
         rotary_dim=2, causal=True),
    Case(3, norm="layernorm", placement="pre", residual="parallel", metric="fro", gated=True, act="silu",
         biases=True, sigma_min=0.2),
]  # and the hypothesis fuzz of test_lipschitz_fuzz draws parallel layers and RoPE with biases too


@pytest.mark.parametrize("c", PARALLEL_CASES, ids=lambda c: f"seed{c.seed}-{c.norm}-{c.metric}")
def test_no_parallel_certificate_is_beaten_by_the_attacker(c):
    checks = run_case(c, restarts=3, steps=12)
    kinds = {k for k, *_ in checks}
    assert {"stage", "layer", "network", "radius"} <= kinds
    assert "G.3" in kinds  # RoPE with q/k biases included (THEORY F22, split scores)
    assert not violations(checks), violations(checks)


def test_rope_with_query_key_biases_is_certified_for_inputs_and_g3():
    spec = fuzz_spec(7, norm="layernorm", placement="pre", biases=True, rope=True, rope_biases=True, rotary_dim=2,
                     residual="parallel", causal=True)
    assert spec.layers[0].attention.b_K is not None  # the case GPT-NeoX has (they do not cancel under RoPE)
    bounds = lipschitz_bounds(spec, radius=1.0)
    assert math.isfinite(bounds.upper.value)
    roles = {e.role for e in perturbation_coefficients(spec).entries if e.layer == 0}
    assert {"W_Q.0", "W_K.1", "b_Q.0", "b_K.1", "W_OV.0"} <= roles and not any(r.startswith("W_KQ") for r in roles)
    from transcover.covering._model_bound import model_terms

    terms, radius, _ = model_terms(spec)
    assert {"W_Q.0", "b_K.1"} <= {t.role for t in terms} and all(math.isfinite(t.log_c) for t in terms)


def test_rope_bias_term_is_needed():
    """Without the F22 bias term the score bound misses b_K's effect.  With W_K = 0 and a large key
    bias the scores are s (x_i W_Q) R_{j-i} b_K^T: B_KQ = 0, yet under RoPE they still move with x_i
    differently for each key, so the attacker beats the bias-free constant, never the certified one."""
    spec = fuzz_spec(9, norm="none", placement="pre", biases=True, rope=True, rope_biases=True,
                     residual="sequential", causal=False)
    lay = spec.layers[0]
    a = lay.attention
    b_K = a.b_K / a.b_K.norm(dim=-1, keepdim=True) * 40.0
    spec = replace(spec, layers=[replace(lay, attention=replace(a, W_K=a.W_K * 0, b_K=b_K, b_Q=None))])
    st = next(s for s in lipschitz_bounds(spec, radius=1.0).stages if s.name == "attention")
    from transcover.lipschitz._attention import attention_lipschitz
    from transcover.lipschitz._weights import spec_norms

    L = spec_norms(spec).layers[0]
    without = 1.0 + attention_lipschitz(L.B_OV, L.B_KQ, 1.0, B_V=L.B_V, B_O=L.B_O)  # B_bKQ dropped
    w = attack_pairs(ref_stage(spec, 0, "attention"), T=3, d=6, dom=Domain(1.0), metric="2,inf",
                     restarts=6, steps=40, seed=3)
    assert w.ratio - w.slack <= st.lipschitz
    assert w.ratio > 2 * without, (w.ratio, without)  # measured 20.1 against 4.41 (certified 122)


def test_lower_estimators_search_the_parallel_stage():
    spec = fuzz_spec(13, norm="layernorm", placement="pre", biases=True, residual="parallel", L=1)
    bounds = lipschitz_bounds(spec, radius=1.0)
    low = lipschitz_lower(spec, bounds, seq_len=3, n_samples=2, n_steps=5)
    assert (0, "parallel") in low and (0, "attention") not in low
    assert 0 < low[(0, "parallel")].value.value <= next(s.lipschitz for s in bounds.stages if s.name == "parallel")


def test_local_bounds_refuse_the_parallel_residual():
    spec = fuzz_spec(13, norm="layernorm", placement="pre", residual="parallel", L=1)
    with pytest.raises(InputError, match="parallel residual"):
        layer_local(spec.layers[0], torch.randn(3, 6, dtype=F64), 0.1)


def test_g3_coefficients_of_a_parallel_layer_skip_the_ffn_factor():
    """In the parallel block the attention's terms are not multiplied by the FFN stage's constant."""
    spec = fuzz_spec(17, norm="layernorm", placement="pre", biases=True, residual="parallel", L=1)
    par = perturbation_coefficients(spec)
    seq = perturbation_coefficients(_as_sequential(spec))
    assert par.coefficient(0, "W_OV.0") < seq.coefficient(0, "W_OV.0")
    assert {e.stage for e in par.entries if e.layer == 0} == {"parallel"}
    assert {e.role for e in par.entries} == {e.role for e in seq.entries}
