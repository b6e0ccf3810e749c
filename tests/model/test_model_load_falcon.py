"""Falcon (old and new decoder architecture, MQA/GQA, one or two LayerNorms, sequential) against HF.

HF computes Falcon's rotary table in float32 (``FalconRotaryEmbedding``), so the comparisons carry
float32's tolerance; everything else runs in float64.  ALiBi is refused with one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import causal_mask, randomize, rope_heads_enclose_svd

from transcover import UnsupportedArchitectureError
from transcover.model import Residual, layer_forward, load, transformer_forward
from transcover.norms import analyze_spec

D, H, L, T, V = 32, 4, 2, 7, 64
EPS = np.finfo(np.float64).eps

CASES = {  # name: (config overrides, expected kv heads, residual, one shared norm)
    "new_gqa_two_ln": (dict(new_decoder_architecture=True, num_kv_heads=2), 2, Residual.PARALLEL, False),
    "new_one_ln_bias": (dict(new_decoder_architecture=True, num_kv_heads=1, num_ln_in_parallel_attn=1, bias=True),
                        1, Residual.PARALLEL, True),
    "old_mqa_parallel_bias": (dict(multi_query=True, parallel_attn=True, bias=True), 1, Residual.PARALLEL, True),
    "old_mha_sequential": (dict(multi_query=False, parallel_attn=False, bias=True), H, Residual.SEQUENTIAL, False),
}


def _model(tm, overrides):
    cfg = tm.FalconConfig(hidden_size=D, num_attention_heads=H, num_hidden_layers=L, vocab_size=V, ffn_hidden_size=48,
                          max_position_embeddings=32, attn_implementation="eager", bos_token_id=0, eos_token_id=0,
                          **overrides)
    torch.manual_seed(0)
    return randomize(tm.FalconForCausalLM(cfg), seed=4).double().eval()


@pytest.fixture(scope="module", params=list(CASES))
def falcon(request, tmp_path_factory, transformers_mod):
    overrides, kv, residual, shared = CASES[request.param]
    model = _model(transformers_mod, overrides)
    path = tmp_path_factory.mktemp("falcon")
    model.save_pretrained(path)
    return model, path, kv, residual, shared


@pytest.mark.parametrize("via", ["directory", "module"])
def test_falcon_layers_and_model_match_hf(falcon, via, assert_close):
    model, path, kv, residual, shared = falcon
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "falcon" and spec.n_layers == L and not spec.warnings
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None].expand(2, -1)
    with torch.no_grad():
        pe = model.transformer.rotary_emb(X, position_ids=pos)
        for i, layer in enumerate(spec.layers):
            assert layer.residual is residual and (layer.norm_attn is layer.norm_ffn) == shared
            assert layer.attention.n_kv_heads == kv
            out = model.transformer.h[i](X, alibi=None, attention_mask=causal_mask(T), position_embeddings=pe)
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, 48, torch.float32, what=f"layer {i}")
        hidden = model.transformer(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), hidden, L * 48, torch.float32, what="model")


def test_falcon_certified_intervals_enclose_float64_svd(falcon):
    """B_KQ (the RoPE supremum, brute force over every offset below the context), B_V, W_1; layer 0."""
    model, _, _, _, _ = falcon
    spec = load(model).to_torch(torch.float64)
    res = analyze_spec(spec, embeddings=False)
    tol = 20 * D * EPS
    for got, lay in zip(res.layers[:1], spec.layers):
        rope_heads_enclose_svd(got, lay, tol)
        w1 = torch.linalg.matrix_norm(torch.as_tensor(lay.ffn.W_1).double(), 2).item()
        assert got.B_W1.lower <= w1 * (1 + tol) and w1 <= got.B_W1.upper * (1 + tol)


def test_alibi_and_contradicting_configs_are_refused_in_one_line(transformers_mod, tmp_path):
    model = _model(transformers_mod, dict(new_decoder_architecture=True, num_kv_heads=2))
    model.save_pretrained(tmp_path)
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    for change, word in ((dict(alibi=True), "alibi"),
                         (dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=2), "num_kv_heads")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(UnsupportedArchitectureError) as e:
            load(tmp_path)
        assert word in str(e.value) and "\n" not in str(e.value)


def test_falcon_lipschitz_is_certified_and_g3_runs(transformers_mod):
    """The bound holds against the project's adversarial search on its own domain (a
    CertificateViolation otherwise); G.3 runs without biases, and with q/k biases under RoPE through
    the split scores (F22's G.3 paragraph: W_Q, W_K, b_Q, b_K charged one by one)."""
    import math

    from transcover.lipschitz import lipschitz_bounds, lipschitz_lower, perturbation_coefficients

    spec = load(_model(transformers_mod, CASES["new_gqa_two_ln"][0]))
    bounds = lipschitz_bounds(spec, radius=1.0)
    low = lipschitz_lower(spec, bounds, seq_len=4, n_samples=1, n_steps=5, stages=False)
    assert 0 < low[(-2, "network")].value.value <= bounds.upper.value
    assert perturbation_coefficients(spec).entries
    biased = perturbation_coefficients(load(_model(transformers_mod, CASES["old_mqa_parallel_bias"][0]))).entries
    assert {"W_Q.0", "b_K.0"} <= {e.role for e in biased} and all(math.isfinite(e.coefficient) for e in biased)
