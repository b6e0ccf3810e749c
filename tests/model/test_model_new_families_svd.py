"""``analyze``'s certified intervals on the families of issue 15 item 1 (GPT-NeoX with partial rotary
and biases, GPT-J, Qwen3 with q/k norms, Llama with llama3 rope scaling) enclose float64 SVD.

With RoPE, B_KQ is the supremum over relative positions of ||s W_Q R_delta W_K^T||: every float64
value at a relative position must lie below the certified upper end, and the lower end below the
largest of them over the positions analyze samples (its certified lower ends are taken there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import randomize

from transcover.model import load
from transcover.model._functional import apply_rope
from transcover.norms import analyze_spec, spectral_norm_interval

D, H, DFF = 32, 4, 48
EPS = np.finfo(np.float64).eps


def _build(tm, name):
    common = dict(vocab_size=32, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    if name == "gpt_neox":
        cfg = tm.GPTNeoXConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=H, intermediate_size=DFF,
                               rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
                               **common)
        return tm.GPTNeoXModel(cfg)
    if name == "gptj":
        return tm.GPTJModel(tm.GPTJConfig(n_embd=D, n_head=H, n_layer=1, n_inner=DFF, rotary_dim=4, n_positions=64,
                                          vocab_size=32))
    if name == "qwen3":
        return tm.Qwen3Model(tm.Qwen3Config(hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                            num_key_value_heads=2, head_dim=8, intermediate_size=DFF, **common))
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 100.0}
    return tm.LlamaModel(tm.LlamaConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=2,
                                        intermediate_size=DFF, rope_parameters=rope, **common))


def _norm2(M) -> float:
    return float(np.linalg.svd(np.asarray(torch.as_tensor(M).double()), compute_uv=False)[0])


@pytest.mark.parametrize("name", ["gpt_neox", "gptj", "qwen3", "llama3_scaled"])
def test_certified_intervals_enclose_float64_svd(transformers_mod, name):
    from transcover.norms._rope_sup import rope_offsets

    torch.manual_seed(0)
    spec = load(randomize(_build(transformers_mod, name), seed=1).double().eval()).to_torch(torch.float64)
    res = analyze_spec(spec, embeddings=False)
    for got, L in zip(res.layers, spec.layers):
        a, f = L.attention, L.ffn
        for h, hn in enumerate(got.heads):
            Wq, Wk, Wv, Wo = (t.double() for t in a.head(h))
            offsets = rope_offsets(a.rope.max_position).tolist()
            vals = []
            for delta in offsets + list(range(0, 40, 3)):
                Wq_rot = apply_rope(Wq, a.rope, torch.full((Wq.shape[0],), float(delta), dtype=torch.float64))
                vals.append((delta, _norm2(a.softmax_scale * Wq_rot @ Wk.T)))
            tol = 10 * D * EPS
            assert all(v <= hn.B_KQ.upper * (1 + tol) for _, v in vals), (name, h)
            sampled = max(v for dl, v in vals if dl in offsets)
            assert hn.B_KQ.lower <= sampled * (1 + tol)
            ov = _norm2(Wv @ Wo)
            assert hn.B_V.lower <= ov * (1 + tol) and hn.B_V.upper >= ov * (1 - tol)
        for key, W in (("B_W1", f.W_1), ("B_W2", f.W_2)):
            iv, exact = getattr(got, key), _norm2(W)
            assert iv.lower <= exact * (1 + 10 * DFF * EPS) and iv.upper >= exact * (1 - 10 * DFF * EPS)
        exact = _norm2(a.W_Q[0])
        iv = spectral_norm_interval(np.asarray(a.W_Q[0]))
        assert iv.lower <= exact * (1 + 1e-12) and iv.upper >= exact * (1 - 1e-12)


@pytest.mark.parametrize("name", ["gpt_neox", "gptj", "qwen3", "llama3_scaled"])
def test_bounds_on_the_new_families(transformers_mod, name):
    """lipschitz_bounds and G.3 are certified on each family (RoPE with q/k biases and q/k norm:
    the split scores of THEORY F22/F23)."""
    import math

    from transcover.lipschitz import lipschitz_bounds, perturbation_coefficients

    torch.manual_seed(0)
    spec = load(randomize(_build(transformers_mod, name), seed=1).double().eval())
    assert math.isfinite(lipschitz_bounds(spec, radius=1.0).upper.value)
    coeffs = perturbation_coefficients(spec).entries
    assert coeffs and all(math.isfinite(e.coefficient) for e in coeffs)
    assert any(e.role.startswith("W_Q.") for e in coeffs) == (name in ("gpt_neox", "qwen3"))
