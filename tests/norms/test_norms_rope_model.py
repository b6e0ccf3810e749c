"""``measure_model`` under RoPE reads the certified supremum over relative positions (tidy12, item 1).

Before, ``HeadMeasure.W_KQ`` bounded ``sup_delta ||s W_Q R_delta W_K^T||`` by ``s ||W_Q|| ||W_K||``
while ``analyze`` showed the tighter certified sup of ``norms/_rope_sup.py`` (THEORY F22), so the
Lipschitz chain, G.3 and the covering terms read a looser number than the one printed.  Now the
sup is computed once, in ``measure_model``, and ``analyze`` shows that interval.

Reference: brute force in float64, the SVD of ``s W_Q R_delta W_K^T`` at *every* integer offset
``|delta| < P``, with the rotation built here by hand (pairs ``(k, k + r/2)``), not by the library.
The model is Llama/Qwen-shaped: grouped-query heads, pre-RMSNorm, gated SiLU FFN, Llama-3-like
frequencies (fast planes and very slow ones).  Key head 0 is built so that the slow/fast split is
tight (queries and keys use disjoint slow coordinates); key head 1 is generic.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from transcover import Interval, Kind
from transcover.lipschitz import lipschitz_bounds, perturbation_bound
from transcover.model import (Activation, AttentionSpec, FFNSpec, LayerSpec, NormKind, NormSpec, Placement, RopeSpec,
                              TransformerSpec)
from transcover.norms import analyze_spec, measure_model

EPS = np.finfo(np.float64).eps
D, DH, H, HKV, P = 12, 8, 4, 2, 64
INV = (1.0, 0.1, 1e-5, 1e-6)  # planes (0,4), (1,5) fast; (2,6), (3,7) slow: 63 * 1e-5 < 1/8


def _spec(seed: int = 0, lam_q: float = 1.0, lam_k: float = 1.0) -> TransformerSpec:
    rng = np.random.default_rng(seed)
    W_Q, W_K = rng.standard_normal((H, D, DH)), rng.standard_normal((HKV, D, DH))
    # key head 0 and the query heads reading it (0, 1): queries on slow coordinates 2 and 6 (one plane),
    # keys on 3 and 7 (another), fast coordinates small, so W_Q,S W_K,S^T = 0 and the true sup is small
    for h in (0, 1):
        W_Q[h] *= 0.05
        W_Q[h][:, [2, 6]] = 3 * rng.standard_normal((D, 2))
        W_Q[h][:, [3, 7]] = 0.0
    W_K[0] *= 0.05
    W_K[0][:, [3, 7]] = 3 * rng.standard_normal((D, 2))
    W_K[0][:, [2, 6]] = 0.0
    attn = AttentionSpec(W_Q=lam_q * W_Q, W_K=lam_k * W_K, W_V=rng.standard_normal((HKV, D, DH)),
                         W_O=rng.standard_normal((H, DH, D)), causal=True,
                         rope=RopeSpec(theta=10000.0, max_position=P, inv_freq_values=INV))
    ffn = FFNSpec(W_1=rng.standard_normal((D, 2 * D)), W_2=rng.standard_normal((2 * D, D)),
                  W_gate=rng.standard_normal((D, 2 * D)), activation=Activation.SILU)
    norm = NormSpec(NormKind.RMSNORM, weight=np.ones(D), eps=1e-5)
    layer = LayerSpec(index=0, attention=attn, ffn=ffn, norm_attn=norm, norm_ffn=norm, placement=Placement.PRE)
    return TransformerSpec(arch="llama", name="rope-llama-test", d_model=D, layers=[layer], final_norm=norm)


def _rotation(delta: int) -> np.ndarray:
    half = len(INV)
    R = np.eye(DH)
    for k, theta in enumerate(INV):
        c, s = np.cos(delta * theta), np.sin(delta * theta)
        R[k, k], R[k, k + half], R[k + half, k], R[k + half, k + half] = c, s, -s, c
    return R


def _brute(Wq: np.ndarray, Wk: np.ndarray, s: float) -> float:
    """max over every |delta| < P of the float64 SVD of s W_Q R_delta W_K^T."""
    return max(s * np.linalg.svd(Wq @ _rotation(d) @ Wk.T, compute_uv=False)[0] for d in range(-(P - 1), P))


def _old_upper(hm, s: float) -> float:
    """The old ``HeadMeasure.W_KQ`` under RoPE: s ||W_Q|| ||W_K||, each norm certified on its own."""
    return s * hm.W_Q.upper * hm.W_K.upper


def test_the_model_norms_hold_the_certified_sup_below_the_product_bound():
    spec = _spec()
    a = spec.layers[0].attention
    s = a.softmax_scale
    lm = measure_model(spec).layers[0]
    tol = 20 * D * EPS
    for h, hm in enumerate(lm.heads):
        Wq, Wk = np.asarray(a.W_Q[h]), np.asarray(a.W_K[a.kv_index(h)])
        iv, true = hm.W_KQ(s), _brute(Wq, Wk, s)
        assert iv.lower <= true * (1 + tol) and true <= iv.upper * (1 + tol)
        old = _old_upper(hm, s)
        assert old == pytest.approx(s * np.linalg.norm(Wq, 2) * np.linalg.norm(Wk, 2), rel=1e-5)
        assert iv.upper <= old * (1 + 4 * EPS)
        if a.kv_index(h) == 0:  # the split is tight here; the old bound was more than 20x too large
            assert iv.upper < old / 20


def test_analyze_shows_the_interval_the_chain_reads():
    spec = _spec(1)
    result = analyze_spec(spec, embeddings=False)
    lm = result.norms.layers[0]
    for hv, hm in zip(result.layers[0].heads, lm.heads):
        assert hv.B_KQ == hm.W_KQ(lm.scale)
    assert result.layers[0].B_KQ.upper == max(hm.W_KQ(lm.scale).upper for hm in lm.heads)


@pytest.mark.parametrize(("lam_q", "lam_k"), [(3.0, 1.0), (1e-3, 1.0), (1.0, 250.0), (0.3, 7.0)])
def test_homogeneous_in_W_Q_and_W_K(lam_q, lam_k):
    """sup_delta ||s (lam W_Q) R (mu W_K)^T|| = lam mu sup_delta ||s W_Q R W_K^T||: the interval follows."""
    base = measure_model(_spec(2)).layers[0]
    scaled = measure_model(_spec(2, lam_q, lam_k)).layers[0]
    for h0, h1 in zip(base.heads, scaled.heads):
        b, c = h0.W_KQ(base.scale), h1.W_KQ(base.scale)
        assert c.lower <= lam_q * lam_k * b.upper * (1 + 1e-12)
        assert c.upper >= lam_q * lam_k * b.lower * (1 - 1e-12)
        assert c.upper == pytest.approx(lam_q * lam_k * b.upper, rel=4e-6)


def test_lipschitz_chain_reads_the_sup_and_only_goes_down():
    """The chain's B_KQ is the sup; the old product bound, put back into the same norms, gives a larger
    certified constant for the attention stage (B_KQ enters F6) and the network."""
    spec = _spec(3)
    m = measure_model(spec)
    lm = m.layers[0]
    old_heads = tuple(dataclasses.replace(hm, W_QK=Interval(0.0, hm.W_Q.upper * hm.W_K.upper, Kind.CERTIFIED_INTERVAL,
                                                            "the old product bound")) for hm in lm.heads)
    old = dataclasses.replace(m, layers=(dataclasses.replace(lm, heads=old_heads),))
    new_L, old_L = lipschitz_bounds(m, radius=2.0), lipschitz_bounds(old, radius=2.0)
    assert new_L.upper.value < 0.9 * old_L.upper.value
    attn_new = [st.lipschitz for st in new_L.stages if st.name == "attention"]
    attn_old = [st.lipschitz for st in old_L.stages if st.name == "attention"]
    assert attn_new and all(a < b for a, b in zip(attn_new, attn_old))


def test_the_bounds_state_the_sequence_length_the_sup_covers():
    """The sup is over |delta| < max_position: the chain and G.3 say so (a pair: the smaller context)."""
    spec = _spec(4)
    assert f"RoPE: sequences of at most max_position={P} tokens" in lipschitz_bounds(spec).upper.assumptions
    a = spec.layers[0].attention
    short = dataclasses.replace(a, rope=dataclasses.replace(a.rope, max_position=40))
    other = dataclasses.replace(spec, layers=[dataclasses.replace(spec.layers[0], attention=short)])
    pb = perturbation_bound(spec, other, radius=1.0)
    assert "RoPE: sequences of at most max_position=40 tokens" in pb.total.assumptions
    plain = dataclasses.replace(spec, layers=[dataclasses.replace(spec.layers[0], attention=dataclasses.replace(
        a, rope=None))])
    assert not any("RoPE" in x for x in lipschitz_bounds(plain).upper.assumptions)


def test_a_sequence_longer_than_the_rope_context_is_refused():
    """The sup covers offsets below max_position only: a longer seq_len gets one clear InputError (a
    bound that silently covered longer sequences would be a false certificate)."""
    from transcover._errors import InputError

    spec = _spec(4)
    lipschitz_bounds(spec, seq_len=P)  # at the context length: fine
    with pytest.raises(InputError, match=f"seq_len={P + 1} is longer than the {P} tokens the model covers \\(its RoPE"):
        lipschitz_bounds(spec, seq_len=P + 1)
    with pytest.raises(InputError, match="max_position"):
        perturbation_bound(spec, spec, radius=1.0, seq_len=P + 1)
