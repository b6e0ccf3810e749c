"""Dynamic NTK rope scaling (THEORY F22, "dynamic scaling"): the frequencies follow the sequence
length T once it exceeds L0 = max_position_embeddings.

A tiny random Llama with ``{"rope_type": "dynamic", "factor": 2.0}`` and L0 = 8 against HF in float64
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


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.LlamaConfig(
        hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H_KV, intermediate_size=DFF,
        vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=L0, rope_parameters=dict(DYNAMIC),
        attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = randomize(transformers_mod.LlamaForCausalLM(cfg), seed=5).double().eval()
    path = tmp_path_factory.mktemp("dynamic")
    model.save_pretrained(path)
    return model, load(path)


@pytest.mark.parametrize("T", [5, L0, 13, 2 * L0])
def test_dynamic_rope_matches_hf_below_and_above_the_original_length(dynamic_model, assert_close, T):
    model, spec = dynamic_model
    rope = spec.layers[0].attention.rope
    assert rope.dynamic == (2.0, L0) and rope.max_position == 2 * L0
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        hf = model.model(inputs_embeds=X).last_hidden_state  # a fresh length each call: HF resets below L0
    hf_inv = model.model.rotary_emb.inv_freq.double()  # the frequencies HF just used for length T
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
        Wq = Wq + 3 * np.outer(rng.standard_normal(D), np.r_[1.0, np.zeros(DH // 2 - 1), 1.0, np.zeros(DH // 2 - 1)])
        iv = rope_kq_interval(Wq, Wk, a.rope, a.softmax_scale)
        truth = [a.softmax_scale * _brute(Wq, Wk, rope_inv_freq(a.rope, DH, T), T)
                 for T in range(1, a.rope.max_position + 1)]
        assert iv.lower <= max(truth) <= iv.upper, (iv, max(truth))
        assert iv.lower > 0
