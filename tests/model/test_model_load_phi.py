"""Phi-1/1.5/2 (parallel residual with one LayerNorm, partial rotary, q/k/v/o biases) against HF PhiModel.

HF reference points (transformers 5 ``modeling_phi``), per layer ``hf = model.model.layers[i]``, sdpa attention
(causal, softmax in float64; the eager path takes its softmax in float32):
  layer  <-> ``hf(X, attention_mask=None, position_embeddings=(cos, sin))`` with cos/sin from HF's
             default-RoPE formula over the rotated width in float64 (HF's own rotary module computes
             its frequencies in float32), so float64's tolerance;
  model  <-> ``PhiModel(inputs_embeds=X).last_hidden_state`` (HF's float32 frequencies: float32's tolerance).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import randomize, rope_heads_enclose_svd, tensors_equal

from transcover import UnsupportedArchitectureError, WeightError
from transcover.model import Residual, layer_forward, load, transformer_forward
from transcover.norms import analyze_spec

D, H, DFF, L, T, V, THETA = 32, 4, 48, 2, 7, 64, 500.0
DH = D // H
EPS = np.finfo(np.float64).eps
VARIANTS = {"phi2_half": (H, 0.5), "gqa_quarter": (2, 0.25)}  # (num_key_value_heads, partial_rotary_factor)


def _model(tm, kv: int, factor: float, **extra):
    cfg = tm.PhiConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=kv, num_hidden_layers=L,
                       intermediate_size=DFF, vocab_size=V, max_position_embeddings=32, layer_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": factor},
                       attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0, **extra)
    torch.manual_seed(0)
    return randomize(tm.PhiForCausalLM(cfg), seed=5).double().eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi(request, tmp_path_factory, transformers_mod):
    kv, factor = VARIANTS[request.param]
    model = _model(transformers_mod, kv, factor)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path, kv, factor


def _cos_sin(rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (THETA ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    emb = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([emb, emb], dim=-1)[None]
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("via", ["directory", "module"])
def test_phi_layers_and_model_match_hf(phi, via, assert_close):
    model, path, kv, factor = phi
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "phi" and spec.n_layers == L and not spec.warnings
    rd = int(DH * factor)
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i, layer in enumerate(spec.layers):
            a = layer.attention
            assert layer.residual is Residual.PARALLEL and layer.norm_attn is layer.norm_ffn
            assert (a.n_heads, a.n_kv_heads, a.rope.rotary_dim or DH) == (H, kv, rd) and a.causal
            assert all(b is not None for b in (a.b_Q, a.b_K, a.b_V, a.b_O, layer.ffn.b_1, layer.ffn.b_2))
            out = model.model.layers[i](X, attention_mask=None, position_embeddings=_cos_sin(rd))
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, DFF, what=f"layer {i}")
        hidden = model.model(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), hidden, L * DFF, torch.float32, what="model")
    assert tensors_equal(spec.embeddings["unembedding"], model.lm_head.weight.detach().T)
    assert spec.layers[1].names["W_O"] == "model.layers.1.self_attn.dense.weight"


def test_phi_certified_intervals_enclose_float64_svd(phi):
    """B_KQ (the RoPE supremum: every relative offset below the context, float64), B_V, W_1, W_2."""
    model, _, _, _ = phi
    spec = load(model).to_torch(torch.float64)
    res = analyze_spec(spec, embeddings=False)
    tol = 20 * DFF * EPS
    for got, lay in zip(res.layers, spec.layers):
        rope_heads_enclose_svd(got, lay, tol)
        for key, W in (("B_W1", lay.ffn.W_1), ("B_W2", lay.ffn.W_2)):
            exact = torch.linalg.matrix_norm(torch.as_tensor(W).double(), 2).item()
            iv = getattr(got, key)
            assert iv.lower <= exact * (1 + tol) and exact <= iv.upper * (1 + tol), key


def test_phi_lipschitz_is_certified_and_g3_runs(transformers_mod):
    """The bound holds against the project's adversarial search on its domain (lipschitz_lower raises a
    CertificateViolation otherwise); G.3 charges W_Q, W_K and b_K one by one (q/k biases under RoPE, F22)."""
    from transcover.lipschitz import lipschitz_bounds, lipschitz_lower, perturbation_coefficients

    spec = load(_model(transformers_mod, 2, 0.25))
    bounds = lipschitz_bounds(spec, radius=1.0)
    low = lipschitz_lower(spec, bounds, seq_len=4, n_samples=1, n_steps=5, stages=False)
    assert 0 < low[(-2, "network")].value.value <= bounds.upper.value
    coeffs = perturbation_coefficients(spec).entries
    assert {"W_Q.0", "b_K.0"} <= {e.role for e in coeffs} and all(math.isfinite(e.coefficient) for e in coeffs)


def test_qk_layernorm_and_phi3_are_refused_in_one_line(transformers_mod, tmp_path):
    with pytest.raises(UnsupportedArchitectureError) as e:
        load(_model(transformers_mod, H, 0.5, qk_layernorm=True))
    assert "qk_layernorm" in str(e.value) and "\n" not in str(e.value)
    model = _model(transformers_mod, H, 0.5)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))
    from transcover.model._adapters._refused import OutsideDecompositionError

    with pytest.raises(OutsideDecompositionError) as e:
        load(tmp_path)
    assert "Phi-3" in str(e.value) and "qkv_proj" in str(e.value) and "\n" not in str(e.value)


def test_phi_is_in_the_support_table_and_found_by_class_name():
    from transcover.model._adapters._registry import arch_from_config
    from transcover.model._adapters._support import support_table

    rows = {line.split(" | ")[0] for line in support_table().splitlines()}
    assert {"| `phi`", "| `phi3`"} <= rows
    assert arch_from_config({"architectures": ["PhiForCausalLM"]}, "x") == "phi"
    assert arch_from_config({"architectures": ["Phi3ForCausalLM"]}, "x") == "phi3"


def test_transformers4_config_and_contradicting_heads(transformers_mod, tmp_path):
    """A 4.x config.json (top-level partial_rotary_factor and rope_theta, rope_scaling null) rotates the
    same width; a num_key_value_heads that contradicts the k_proj tensor is refused, not reshaped."""
    model = _model(transformers_mod, 2, 0.25)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    old.update(partial_rotary_factor=0.25, rope_theta=THETA, rope_scaling=None)
    (tmp_path / "config.json").write_text(json.dumps(old))
    rope = load(tmp_path).layers[0].attention.rope
    assert (rope.rotary_dim, rope.theta) == (2, THETA)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": H}))
    with pytest.raises(WeightError) as e:
        _ = load(tmp_path).layers[0]
    assert "k_proj" in str(e.value) and "\n" not in str(e.value)


def test_phi_layer_bounds_beat_an_independent_attacker(transformers_mod):
    """Per parallel layer (one LayerNorm, RoPE with q/k biases, GQA): float64 projected ascent on
    ||f(X) - f(Y)|| / ||X - Y|| through the attacker's own forward (tests/lipschitz/_attack, checked
    equal to the decomposition's forward here) over pairs with rows of norm <= the layer's input
    radius and LayerNorm spread >= sigma_min stays below the certified layer constant."""
    import sys
    from pathlib import Path

    helpers = str(Path(__file__).resolve().parents[1] / "lipschitz")
    if helpers not in sys.path:  # the lipschitz tests' attacker, imported as they import it
        sys.path.insert(0, helpers)
    from _attack import Domain, attack_pairs, ref_network, ref_stage

    from transcover.lipschitz import lipschitz_bounds

    spec = load(_model(transformers_mod, 2, 0.25)).to_torch(torch.float64)
    X = torch.randn(4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert float((ref_network(spec, X) - transformer_forward(spec, X)).abs().max()) <= 1e3 * DFF * EPS
    sigma = 0.5
    bounds = lipschitz_bounds(spec, radius=8.0, sigma_min=sigma)
    for i in range(L):
        r0 = next(s.radius_in for s in bounds.stages if s.layer == i)
        w = attack_pairs(ref_stage(spec, i, "layer"), T=4, d=D, dom=Domain(r0, sigma), metric="2,inf",
                         restarts=4, steps=20, seed=i)
        assert 0 < w.ratio - w.slack <= bounds.layer_upper(i).value, i


def test_dynamic_ntk_phi_matches_hf_beyond_the_original_length(transformers_mod, assert_close):
    """rope_from_config's dynamic NTK (THEORY F22): the spec recomputes the frequencies per length as
    PhiRotaryEmbedding does, so T = 12 > max_position_embeddings = 8 still matches (float32: HF's table)."""
    cfg = transformers_mod.PhiConfig(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=2, num_hidden_layers=L, intermediate_size=DFF,
        vocab_size=V, max_position_embeddings=8, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
        pad_token_id=0, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA,
                                         "partial_rotary_factor": 0.5})
    torch.manual_seed(0)
    model = randomize(transformers_mod.PhiForCausalLM(cfg), seed=5).double().eval()
    spec = load(model)
    for t in (6, 12):
        X = torch.randn(1, t, D, dtype=torch.float64, generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            hidden = model.model(inputs_embeds=X).last_hidden_state
        assert_close(transformer_forward(spec, X), hidden, L * DFF, torch.float32, what=f"T={t}")
