"""Scaled RoPE (linear, Llama 3 "llama3", YaRN; dynamic NTK in test_model_rope_dynamic) and its
refusals (longrope): THEORY F22.

Frequencies against transformers' own ``ROPE_INIT_FUNCTIONS`` (computed there in float32, here in
float64: float32's relative tolerance), then a Llama-3.2-1B-shaped model (llama3 scaling with
Llama 3.2's parameters, theta 500000, GQA 4:1, tied embeddings; tiny widths) and a YaRN model
(attention factor folded into the softmax scale) against HF layer by layer and whole, with HF's own
rotary module supplying cos/sin (float32, hence float32's tolerance).
"""

from __future__ import annotations

import pytest
import torch
from conftest import randomize

from transcover import UnsupportedArchitectureError
from transcover.model import attention_forward, layer_forward, load, structural_differences, transformer_forward
from transcover.model._rope_scaling import rope_from_config

D, H, H_KV, DFF, L, T, V = 64, 8, 2, 96, 2, 9, 64
DH = D // H
LLAMA32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
        "beta_fast": 32.0, "beta_slow": 1.0}
LINEAR = {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0}


def _config(transformers_mod, rope: dict, **kw):
    return transformers_mod.LlamaConfig(
        hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H_KV, intermediate_size=DFF,
        vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=131072 if rope is LLAMA32 else 256,
        rope_parameters=dict(rope), attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, **kw)


@pytest.mark.parametrize("rope", [LINEAR, LLAMA32, YARN], ids=["linear", "llama3", "yarn"])
def test_frequencies_match_transformers(transformers_mod, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _config(transformers_mod, rope)
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    spec_rope, score = rope_from_config(cfg.to_dict(), "llama", DH)
    ours = spec_rope.inv_freq(DH)
    assert ours.shape == hf_inv.shape
    rel = float(((ours - hf_inv.double()).abs() / hf_inv.double()).max())
    assert rel <= 8 * torch.finfo(torch.float32).eps, rel
    assert score == pytest.approx(float(hf_factor) ** 2, rel=1e-6)
    default = rope_from_config({**cfg.to_dict(), "rope_parameters": {"rope_theta": rope["rope_theta"]}}, "llama", DH)[0]
    assert float((ours - default.inv_freq(DH)).abs().max()) > 0  # the scaling changed the frequencies


@pytest.fixture(scope="module", params=["llama32", "yarn"])
def scaled(request, tmp_path_factory, transformers_mod):
    rope = LLAMA32 if request.param == "llama32" else YARN
    extra = {"tie_word_embeddings": True} if request.param == "llama32" else {}
    torch.manual_seed(0)
    model = randomize(transformers_mod.LlamaForCausalLM(_config(transformers_mod, rope, **extra)), seed=4)
    model = model.double().eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path, request.param


def test_scaled_rope_layers_and_model_match_hf(scaled, assert_close):
    model, path, name = scaled
    spec = load(path)
    a0 = spec.layers[0].attention
    assert a0.rope.inv_freq_values is not None
    if name == "yarn":  # m^2 in the scale: every score is multiplied by YaRN's attention factor squared
        assert a0.scale is not None and a0.scale > DH ** -0.5
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None]
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(X, pos)  # HF's float32 frequencies
        for i, layer in enumerate(spec.layers):
            hf = model.model.layers[i]
            ref = hf.self_attn(X, position_embeddings=(cos.double(), sin.double()), attention_mask=None)[0]
            assert_close(attention_forward(layer.attention, X), ref, D, torch.float32, what=f"attention {i}")
            out = hf(X, attention_mask=None, position_embeddings=(cos.double(), sin.double()))
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, DFF, torch.float32, what=f"layer {i}")
        hidden = model.model(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), hidden, L * DFF, torch.float32, what="model")


def test_scaled_and_default_rope_are_structurally_different(scaled):
    from dataclasses import replace

    model, path, _ = scaled
    spec = load(path)
    plain = replace(spec, layers=[replace(la, attention=replace(la.attention, rope=replace(
        la.attention.rope, inv_freq_values=None))) for la in spec.layers])
    assert any("rotary position embedding" in line for line in structural_differences(spec, plain))


@pytest.mark.parametrize("rope_type", ["longrope", "su_rope_unknown"])
def test_length_dependent_or_unknown_rope_is_refused(rope_type):
    cfg = {"hidden_size": D, "num_attention_heads": H, "max_position_embeddings": 256,
           "rope_parameters": {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}}
    with pytest.raises(UnsupportedArchitectureError, match=rope_type):
        rope_from_config(cfg, "llama", DH)


def test_dynamic_without_factor_or_below_one_is_refused():
    for params in ({"rope_type": "dynamic"}, {"rope_type": "dynamic", "factor": 0.5}):
        cfg = {"max_position_embeddings": 16, "rope_parameters": {**params, "rope_theta": 10000.0}}
        with pytest.raises(UnsupportedArchitectureError, match="dynamic"):
            rope_from_config(cfg, "llama", DH)


def test_yarn_factor_with_partial_rotation_is_refused():
    # a family that rotates part of each head (GPT-NeoX, Phi); Llama's refuses the factor itself
    cfg = {"max_position_embeddings": 256, "rope_parameters": {**YARN, "partial_rotary_factor": 0.5}}
    with pytest.raises(UnsupportedArchitectureError, match="partial rotation"):
        rope_from_config(cfg, "gpt_neox", DH, partial=True)
