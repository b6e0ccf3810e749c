"""Dynamic NTK rope scaling (THEORY F22, "dynamic scaling"): the frequencies follow the sequence
length T once it exceeds L0 = max_position_embeddings.

A tiny random Llama (and a partial-rotary GPT-NeoX) with ``{"rope_type": "dynamic", "factor": 2.0}`` and L0 = 8 against HF in float64
at T below and above L0 (HF's frequencies are float32, hence float32's tolerance), and the certified
B_KQ against brute-force float64 SVD over every offset of both lengths, with each length's own
frequencies.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import randomize

from transcover.model import load, structural_differences, transformer_forward
from transcover.norms._rope_sup import rope_inv_freq, rope_kq_interval, rotate_columns

D, H, H_KV, DFF, L, V, L0 = 32, 4, 2, 48, 2, 64, 8
DH = D // H
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


@pytest.fixture(scope="module", params=["llama", "gpt_neox"])
def dynamic_model(request, tmp_path_factory, transformers_mod):
    common = dict(hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DFF, vocab_size=V,
                  max_position_embeddings=L0, attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    if request.param == "llama":
        cfg = transformers_mod.LlamaConfig(num_key_value_heads=H_KV, rms_norm_eps=1e-5,
                                           rope_parameters=dict(DYNAMIC), **common)
        model = transformers_mod.LlamaForCausalLM(cfg)
    else:  # partial rotary: the base's exponent uses the rotated width r = DH / 2
        cfg = transformers_mod.GPTNeoXConfig(layer_norm_eps=1e-5, hidden_act="gelu",
                                             rope_parameters={**DYNAMIC, "partial_rotary_factor": 0.5}, **common)
        model = transformers_mod.GPTNeoXForCausalLM(cfg)
    torch.manual_seed(0)
    model = randomize(model, seed=5).double().eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, load(path)


@pytest.mark.parametrize("T", [5, L0, 13, 2 * L0])
def test_dynamic_rope_matches_hf_below_and_above_the_original_length(dynamic_model, assert_close, T):
    model, spec = dynamic_model
    rope = spec.layers[0].attention.rope
    assert rope.dynamic == (2.0, L0) and rope.max_position == 2 * L0
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        hf = model.base_model(inputs_embeds=X).last_hidden_state  # HF resets to unscaled below L0
    hf_inv = model.base_model.rotary_emb.inv_freq.double()  # the frequencies HF just used for length T
    ours = rope.inv_freq(DH, T)
    assert float(((ours - hf_inv).abs() / hf_inv).max()) <= 8 * torch.finfo(torch.float32).eps
    assert_close(transformer_forward(spec, X), hf, L * DFF, torch.float32, what=f"model at T={T}")
    if T > L0:  # above L0 the frequencies really changed (the test would not see a missing rescale otherwise)
        assert float((ours - rope.inv_freq(DH)).abs().max()) > 1e-3


def test_dynamic_and_default_rope_are_structurally_different(dynamic_model):
    from dataclasses import replace

    _, spec = dynamic_model
    plain = replace(spec, layers=[replace(la, attention=replace(la.attention, rope=replace(
        la.attention.rope, dynamic=None))) for la in spec.layers])
    assert any("rotary position embedding" in line for line in structural_differences(spec, plain))


def _brute(Wq, Wk, inv, T):
    """max over |delta| < T of ||W_Q R_delta W_K^T||_2, float64 SVD at every offset."""
    out = 0.0
    for delta in range(-(T - 1), T):
        ang = delta * inv
        out = max(out, float(np.linalg.norm(rotate_columns(Wq, inv, np.cos(ang), np.sin(ang)) @ Wk.T, 2)))
    return out


def test_certified_kq_encloses_brute_force_for_every_length(dynamic_model):
    _, spec = dynamic_model
    a = spec.layers[0].attention
    rng = np.random.default_rng(3)
    for h in range(a.n_heads):
        Wq = np.asarray(a.head(h)[0], dtype=np.float64)
        Wk = np.asarray(a.head(h)[1], dtype=np.float64)
        # a low-rank rotated part makes the offsets (and so the lengths) matter
        half = (a.rope.rotary_dim or DH) // 2
        pair = np.zeros(DH)
        pair[[0, half]] = 1.0
        Wq = Wq + 3 * np.outer(rng.standard_normal(D), pair)
        iv = rope_kq_interval(Wq, Wk, a.rope, a.softmax_scale)
        truth = [a.softmax_scale * _brute(Wq, Wk, rope_inv_freq(a.rope, DH, T), T)
                 for T in range(1, a.rope.max_position + 1)]
        assert iv.lower <= max(truth) <= iv.upper, (iv, max(truth))
        assert iv.lower > 0
