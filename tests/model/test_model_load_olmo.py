"""OLMo 1 (non-parametric LayerNorm, gated SiLU FFN, GQA, optional q/k/v/o biases) against HF.

``OlmoLayerNorm`` normalises in float32 and HF's rotary table is float32, so the comparisons carry
float32's tolerance.  ``clip_qkv`` is refused with one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import causal_mask, randomize, rope_heads_enclose_svd

from transcover import UnsupportedArchitectureError
from transcover.model import NormKind, layer_forward, load, transformer_forward
from transcover.norms import analyze_spec

D, H, KV, L, T, V, DFF = 32, 4, 2, 2, 7, 64, 48
EPS = np.finfo(np.float64).eps


def _model(tm, **overrides):
    cfg = tm.OlmoConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV, num_hidden_layers=L,
                        intermediate_size=DFF, vocab_size=V, max_position_embeddings=24, attn_implementation="eager",
                        pad_token_id=0, bos_token_id=0, eos_token_id=0, **overrides)
    torch.manual_seed(0)
    return randomize(tm.OlmoForCausalLM(cfg), seed=6).double().eval()


@pytest.fixture(scope="module", params=[False, True], ids=["no_bias", "attention_bias"])
def olmo(request, tmp_path_factory, transformers_mod):
    model = _model(transformers_mod, attention_bias=request.param)
    path = tmp_path_factory.mktemp("olmo")
    model.save_pretrained(path)
    return model, path, request.param


@pytest.mark.parametrize("via", ["directory", "module"])
def test_olmo_layers_and_model_match_hf(olmo, via, assert_close):
    model, path, bias = olmo
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "olmo" and spec.n_layers == L and not spec.warnings
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None].expand(2, -1)
    with torch.no_grad():
        pe = model.model.rotary_emb(X, position_ids=pos)
        for i, layer in enumerate(spec.layers):
            n = layer.norm_attn
            assert n.kind is NormKind.LAYERNORM and n.weight is None and n.bias is None and n.eps == 1e-5
            assert (layer.attention.b_Q is not None) == bias and layer.attention.n_kv_heads == KV
            out = model.model.layers[i](X, attention_mask=causal_mask(T), position_embeddings=pe)
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, DFF, torch.float32, what=f"layer {i}")
        hidden = model.model(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), hidden, L * DFF, torch.float32, what="model")


def test_olmo_certified_intervals_enclose_float64_svd(olmo):
    """B_KQ (the RoPE supremum, brute force over every offset below the context), B_V, W_gate; layer 0."""
    model, _, _ = olmo
    spec = load(model).to_torch(torch.float64)
    got, lay = analyze_spec(spec, embeddings=False).layers[0], spec.layers[0]
    tol = 20 * DFF * EPS
    rope_heads_enclose_svd(got, lay, tol)
    g = torch.linalg.matrix_norm(torch.as_tensor(lay.ffn.W_gate).double(), 2).item()
    assert got.B_Wgate.lower <= g * (1 + tol) and g <= got.B_Wgate.upper * (1 + tol)


def test_clip_qkv_is_refused_in_one_line(olmo, tmp_path):
    _, path, _ = olmo
    cfg = json.loads((path / "config.json").read_text())
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "clip_qkv": 8.0}))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load(tmp_path)
    assert "clip_qkv" in str(e.value) and "1-Lipschitz" in str(e.value) and "\n" not in str(e.value)


def test_olmo_lipschitz_is_certified_and_g3_runs(transformers_mod):
    """Bound vs the adversarial search (CertificateViolation if a lower value exceeded it); G.3 runs
    without biases, and with q/k biases under RoPE through the split scores (F22's G.3 paragraph)."""
    import math

    from transcover.lipschitz import lipschitz_bounds, lipschitz_lower, perturbation_coefficients

    spec = load(_model(transformers_mod))
    bounds = lipschitz_bounds(spec, radius=1.0)
    low = lipschitz_lower(spec, bounds, seq_len=4, n_samples=1, n_steps=5, stages=False)
    assert 0 < low[(-2, "network")].value.value <= bounds.upper.value
    assert perturbation_coefficients(spec).entries
    biased = perturbation_coefficients(load(_model(transformers_mod, attention_bias=True))).entries
    assert {"W_Q.0", "b_K.0"} <= {e.role for e in biased} and all(math.isfinite(e.coefficient) for e in biased)
