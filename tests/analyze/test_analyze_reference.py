"""analyze_spec against independent float64 references on the reference model and hand-built specs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover import Kind
from transcover.model import (
    Activation,
    AttentionSpec,
    FFNSpec,
    LayerSpec,
    NormKind,
    NormSpec,
    Placement,
    ReferenceConfig,
    ReferenceTransformer,
    TransformerSpec,
    reference_spec,
)
from transcover.norms import analyze_spec

EPS64 = np.finfo(np.float64).eps


def _norm2(M: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(M.double(), 2))


def _encloses(iv, exact: float, n: int) -> bool:
    tol = 10 * n * EPS64 * max(exact, 1e-300)  # the float64 SVD reference's own error
    return iv.lower <= exact + tol and iv.upper >= exact - tol


def _random_spec(seed: int, d: int, H: int, dh: int, H_kv: int, dff: int, biases: bool, gated: bool) -> TransformerSpec:
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    attn = AttentionSpec(
        W_Q=r(H, d, dh), W_K=r(H_kv, d, dh), W_V=r(H_kv, d, dh), W_O=r(H, dh, d),
        b_Q=r(H, dh) if biases else None, b_K=r(H_kv, dh) if biases else None,
        b_V=r(H_kv, dh) if biases else None, b_O=r(d) if biases else None,
    )
    ffn = FFNSpec(W_1=r(d, dff), W_2=r(dff, d), activation=Activation.SILU if gated else Activation.GELU,
                  b_1=r(dff) if biases else None, b_2=r(d) if biases else None,
                  W_gate=r(d, dff) if gated else None)
    ln = NormSpec(NormKind.LAYERNORM, r(d), r(d), 1e-5)
    layer = LayerSpec(0, attn, ffn, ln, ln, Placement.PRE)
    return TransformerSpec("handmade", "random", d, [layer])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), d=st.integers(4, 24), H=st.sampled_from([1, 2, 4]), dh=st.integers(1, 6),
       group=st.sampled_from([1, 2]), dff=st.integers(2, 30), biases=st.booleans(), gated=st.booleans())
def test_every_quantity_encloses_float64_svd(seed, d, H, dh, group, dff, biases, gated):
    H_kv = max(1, H // group)
    spec = _random_spec(seed, d, H, dh, H_kv, dff, biases, gated)
    res = analyze_spec(spec)
    layer, L = res.layers[0], spec.layers[0]
    a, f = L.attention, L.ffn
    scale = 1 / math.sqrt(dh)
    kq = [_norm2(a.head(h)[0] @ a.head(h)[1].T * scale) for h in range(H)]
    ov = [_norm2(a.head(h)[2] @ a.head(h)[3]) for h in range(H)]
    for h, hn in enumerate(layer.heads):
        assert _encloses(hn.B_KQ, kq[h], d) and _encloses(hn.B_V, ov[h], d)
        assert _encloses(hn.W_V, _norm2(a.head(h)[2]), d)
        if biases:  # [W_Q; b_Q] W_K^T / sqrt(dh): the exact bilinear form on [x, 1]
            aug = torch.cat([a.W_Q[h], a.b_Q[h][None]], 0) @ a.head(h)[1].T * scale
            assert _encloses(hn.B_KQ_bias, _norm2(aug), d)
        # Frobenius and (2,1) norms of the products against the formed matrices
        KQ = a.head(h)[0] @ a.head(h)[1].T * scale
        m = layer.matrices[f"W_KQ.h{h}"]
        assert _encloses(m.frobenius, float(KQ.norm()), d * d)
        assert _encloses(m.l21, float(KQ.norm(dim=0).sum()), d * d)
    assert _encloses(layer.B_KQ, max(kq), d) and _encloses(layer.B_V, max(ov), d)
    assert _encloses(layer.B_W1, _norm2(f.W_1), dff) and _encloses(layer.B_W2, _norm2(f.W_2), dff)
    assert _encloses(layer.W_O, _norm2(a.W_O.reshape(-1, d)), d)
    if gated:
        assert _encloses(layer.B_Wgate, _norm2(f.W_gate), dff)
    if biases:
        assert _encloses(layer.B_b1, float(f.b_1.norm()), dff) and _encloses(layer.B_b2, float(f.b_2.norm()), d)
        eff = a.b_O + sum(a.b_V[a.kv_index(h)] @ a.W_O[h] for h in range(H))
        assert _encloses(layer.B_b_attn, float(eff.norm()), d * H)
    else:
        assert layer.B_b1.upper == 0.0 and layer.B_b2.upper == 0.0
    for key in ("W_1", "W_2", "W_O"):
        M = layer.matrices[key]
        W = {"W_1": f.W_1, "W_2": f.W_2, "W_O": a.W_O.reshape(-1, d)}[key]
        assert _encloses(M.frobenius, float(W.norm()), W.numel())
        assert _encloses(M.l21, float(W.norm(dim=0).sum()), W.numel())
    assert all(layer_.B_KQ.relative_gap <= 1e-3 for layer_ in res.layers)


def test_reference_model_summary_and_dataframe():
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=16, n_heads=4, n_layers=3, d_ff=32, d_input=5, max_len=7))
    res = analyze_spec(reference_spec(model))
    assert len(res.layers) == 3 and res.kind is Kind.CERTIFIED_INTERVAL
    df = res.layers_dataframe()
    assert list(df.index) == [0, 1, 2]
    assert (df["B_KQ_lower"] <= df["B_KQ_upper"]).all()
    assert {"B_b_attn_lower", "B_b_attn_upper"} <= set(df.columns)
    heads = res.heads_dataframe()
    assert heads.shape[0] == 12 and set(heads["kind"]) == {"certified interval"}  # the kind column (stop 38)
    assert set(analyze_spec(reference_spec(model), fast=True).heads_dataframe()["kind"]) == {"estimate"}
    summary = res.summary()
    assert summary["B_W1"].upper == max(layer.B_W1.upper for layer in res.layers)
    names = {e.name for e in res.embeddings}
    assert {"input_embedding", "position_embedding", "mlp_head.0", "mlp_head.1"} <= names


def test_fast_mode_is_labelled_and_close():
    torch.manual_seed(1)
    model = ReferenceTransformer(ReferenceConfig(d_model=96, n_heads=4, n_layers=2, d_ff=300))
    spec = reference_spec(model)
    cert, fast = analyze_spec(spec), analyze_spec(spec, fast=True)
    assert fast.kind is Kind.ESTIMATE and fast.layers[0].B_W1.kind is Kind.ESTIMATE
    for lc, lf in zip(cert.layers, fast.layers):
        for key in ("B_KQ", "B_V", "B_W1", "B_W2", "W_O"):
            exact = getattr(lc, key).mid
            assert abs(getattr(lf, key).mid - exact) <= 1e-3 * exact


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("case", ["float32 2^120", "float32 2^-120", "one entry 3e38", "float64 2^200",
                                  "float64 2^-200"])
def test_fast_estimates_at_the_ends_of_the_float32_range(case, rope):
    """``--fast`` formed float32 Grams of the raw matrices: one W_Q entry 3e38 (a finite bfloat16 weight) made them
    inf and ``analyze --fast`` a LinAlgError, W_Q, W_K entries ~1e-38 printed B_KQ 0 for 2.345e-76, and the
    Frobenius and (2,1) norms of a matrix with entries 2^100 were inf; float64 weights past float32's range were
    cast to inf or 0 first (red team 221).  Every estimate must be within the Lanczos target ``rtol`` = 1e-3 of the
    certified value (which scales exactly; test_fast_mode_is_labelled_and_close), or inside its interval."""
    from transcover.model import RopeSpec

    spec = _random_spec(7, 12, 2, 4, 2, 10, True, False)
    L = spec.layers[0]
    dt = torch.float64 if case.startswith("float64") else torch.float32
    f32 = {k: getattr(L.attention, k).to(dt) for k in ("W_Q", "W_K", "W_V", "b_Q")}
    if case == "one entry 3e38":
        f32["W_Q"][1, 3, 2] = 3e38
    else:  # exact: a power of two, float32 normal or not
        f32 = {k: v * 2.0 ** int(case.split("^")[1]) for k, v in f32.items()}
    attn = AttentionSpec(f32["W_Q"], f32["W_K"], f32["W_V"], L.attention.W_O.to(dt), b_Q=None if rope else f32["b_Q"],
                         rope=RopeSpec(theta=10000.0, max_position=16) if rope else None)
    ffn = FFNSpec(W_1=L.ffn.W_1.to(dt) * (f32["W_V"].abs().max() / L.ffn.W_1.abs().max()), W_2=L.ffn.W_2.to(dt),
                  activation=L.ffn.activation)
    spec = TransformerSpec("handmade", case, 12, [LayerSpec(0, attn, ffn, L.norm_attn, L.norm_ffn, L.placement)])
    cert, fast = analyze_spec(spec).layers[0], analyze_spec(spec, fast=True).layers[0]
    pairs = [(getattr(cert.matrices[k], q), getattr(fast.matrices[k], q))
             for k in cert.matrices for q in ("spectral", "frobenius", "l21")]
    pairs += [(getattr(hc, q), getattr(hf, q)) for hc, hf in zip(cert.heads, fast.heads) for q in ("B_KQ", "B_V", "W_V")]
    if not rope:
        pairs += [(hc.B_KQ_bias, hf.B_KQ_bias) for hc, hf in zip(cert.heads, fast.heads)]
    assert len(pairs) > 30 and all(f.kind is Kind.ESTIMATE for _, f in pairs)
    for c, f in pairs:
        assert 0.0 < c.lower and c.upper < math.inf  # the certified route holds every scale
        assert abs(f.mid - c.mid) <= 1e-3 * c.mid + (c.upper - c.lower), (c, f)


def test_rope_heads_are_a_supremum_over_relative_positions():
    from transcover.model import RopeSpec
    from transcover.model._functional import apply_rope

    spec = _random_spec(3, 16, 2, 8, 2, 8, False, False)
    L = spec.layers[0]
    rope = RopeSpec(theta=10000.0, max_position=64)
    attn = AttentionSpec(L.attention.W_Q, L.attention.W_K, L.attention.W_V, L.attention.W_O, rope=rope)
    spec = TransformerSpec("handmade", "rope", 16, [LayerSpec(0, attn, L.ffn, L.norm_attn, L.norm_ffn, L.placement)])
    hn = analyze_spec(spec).layers[0].heads[0]
    Wq, Wk = attn.W_Q[0], attn.W_K[0]
    scale = 1 / math.sqrt(8)
    sup = max(_norm2(apply_rope(Wq, rope, torch.full((16,), float(k))) @ Wk.T * scale) for k in range(64))
    assert hn.B_KQ.lower <= sup * (1 + 1e-12)
    assert hn.B_KQ.upper >= sup
    assert hn.B_KQ.upper <= _norm2(Wq) * _norm2(Wk) * scale * (1 + 2e-3)  # each factor certified to rtol


def test_invalid_rtol_is_a_clear_error():
    from transcover import InputError

    spec = _random_spec(0, 4, 1, 2, 1, 3, False, False)
    with pytest.raises(InputError, match="rtol"):
        analyze_spec(spec, rtol=0.0)


def test_float32_arrays_from_files_are_enclosed_in_float64():
    """Specs read from files hold float32 numpy arrays: every certified sum must still be float64."""
    from transcover.norms import frobenius_interval, l21_interval

    rng = np.random.default_rng(5)
    W = rng.standard_normal((384, 1536)).astype(np.float32)
    W64 = W.astype(np.float64)
    exact_l21 = float(np.sqrt((W64 * W64).sum(axis=0)).sum())
    exact_fro = float(np.sqrt((W64 * W64).sum()))
    l21, fro = l21_interval(W), frobenius_interval(W)
    assert l21.lower <= exact_l21 <= l21.upper and fro.lower <= exact_fro <= fro.upper
