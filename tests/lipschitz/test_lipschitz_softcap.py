"""Attention-logit soft-capping c tanh(s / c) (Gemma 2, THEORY F24): forward against HF, soundness, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _attack import Domain, attack_gap, attack_pairs, fuzz_spec, ref_attention, ref_stage
from _fuzzcase import Case, run_case, violations
from transcover import InputError, UnsupportedArchitectureError
from transcover.lipschitz import layer_local, lipschitz_bounds, perturbation_bound
from transcover.model import AttentionSpec, RopeSpec, attention_forward, structural_differences

F64 = torch.float64


def test_forward_matches_hf_gemma2_attention():
    """The cap sits after the scaling and before the mask, as in HF's Gemma2 eager attention (whose
    softmax runs in float32: float32's tolerance)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    d, H, Hkv, dh, T, theta, cap = 16, 4, 2, 8, 6, 100.0, 3.0
    cfg = transformers.Gemma2Config(hidden_size=d, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=dh,
                                    query_pre_attn_scalar=12, attn_logit_softcapping=cap, num_hidden_layers=1,
                                    intermediate_size=8, vocab_size=8, attn_implementation="eager",
                                    rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(0)
    hf = transformers.models.gemma2.modeling_gemma2.Gemma2Attention(cfg, 0).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, dtype=F64))  # large weights: the cap is active

    def heads(W, n):  # nn.Linear (n*dh, d) -> (n, d, dh)
        return W.detach().T.reshape(d, n, dh).permute(1, 0, 2).contiguous()

    spec = AttentionSpec(W_Q=heads(hf.q_proj.weight, H), W_K=heads(hf.k_proj.weight, Hkv),
                         W_V=heads(hf.v_proj.weight, Hkv),
                         W_O=hf.o_proj.weight.detach().T.reshape(H, dh, d).contiguous(),
                         scale=12 ** -0.5, softcap=cap, rope=RopeSpec(theta=theta))
    spec.validate()
    X = torch.randn(2, T, d, dtype=F64, generator=torch.Generator().manual_seed(1))
    inv = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=F64) / dh))
    e = torch.cat([torch.arange(T, dtype=F64)[:, None] * inv[None]] * 2, -1)[None]
    with torch.no_grad():
        ref = hf(X, position_embeddings=(e.cos(), e.sin()), attention_mask=None)[0]
    got = attention_forward(spec, X)
    tol = 100 * d * torch.finfo(torch.float32).eps * (1 + float(ref.abs().max()))
    assert float((got - ref).abs().max()) <= tol
    assert float((attention_forward(replace(spec, softcap=None), X) - ref).abs().max()) > 100 * tol


def test_constants_are_f6_and_hold_against_the_attacker():
    """F24: the cap is 1-Lipschitz, so the certified constants are F6's, and hold for capped scores."""
    spec = fuzz_spec(3, norm="none", placement="pre", softcap=0.7, qk_scale=6.0, biases=True)
    plain = replace(spec, layers=[replace(lay, attention=replace(lay.attention, softcap=None)) for lay in spec.layers])
    capped = lipschitz_bounds(spec, radius=1.5)
    assert capped.upper.value == lipschitz_bounds(plain, radius=1.5).upper.value
    st = next(s for s in capped.stages if s.name == "attention")
    w = attack_pairs(ref_stage(spec, 0, "attention"), T=3, d=6, dom=Domain(1.5), metric="2,inf", restarts=4,
                     steps=20, seed=4)
    assert w.ratio - w.slack <= st.lipschitz
    X = torch.randn(2, 4, 6, dtype=F64, generator=torch.Generator().manual_seed(2))
    a = spec.layers[0].attention
    assert float((attention_forward(a, X) - ref_attention(a, X)).abs().max()) < 1e-12


CASES = [
    Case(1, norm="rmsnorm", placement="pre", softcap=2.0, rope=True, causal=True, biases=True, qk=6.0),
    Case(2, norm="none", placement="post", softcap=0.5, biases=True, scale=2.0, radius=2.0, metric="fro"),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: f"seed{c.seed}-{c.norm}-{c.metric}")
def test_no_softcap_certificate_is_beaten_by_the_attacker(c):
    checks = run_case(c, restarts=3, steps=12)
    assert "G.3" in {k for k, *_ in checks}  # G.3 holds unchanged for one cap c
    assert not violations(checks), violations(checks)


def test_different_caps_are_structural_and_key_biases_are_refused():
    spec = fuzz_spec(5, norm="layernorm", placement="pre", softcap=1.0)
    other = replace(spec, layers=[replace(lay, attention=replace(lay.attention, softcap=2.0)) for lay in spec.layers])
    assert any("soft-capping" in line for line in structural_differences(spec, other))
    with pytest.raises(InputError, match="soft-capping"):
        perturbation_bound(spec, other)
    lay = spec.layers[0]
    keyed = replace(spec, layers=[replace(lay, attention=replace(lay.attention, b_K=torch.ones(2, 4, dtype=F64)))])
    with pytest.raises(UnsupportedArchitectureError, match="key bias"):
        lipschitz_bounds(keyed)
    with pytest.raises(InputError, match="soft-capped"):
        layer_local(lay, torch.randn(3, 6, dtype=F64), 0.1)
    with pytest.raises(ValueError, match="softcap"):
        replace(lay.attention, softcap=-1.0).validate()
    # the G.3 left-hand side of a capped pair stays below its certificate
    moved = replace(spec, layers=[replace(lay, attention=replace(lay.attention, W_Q=lay.attention.W_Q * 1.05))])
    pb = perturbation_bound(spec, moved)
    w = attack_gap(ref_stage(spec, 0, "network"), ref_stage(moved, 0, "network"), T=3, d=6, dom=Domain(1.0),
                   metric="2,inf", restarts=4, steps=15, seed=6)
    assert w.ratio - w.slack <= pb.total.value
