"""T5's encoder (THEORY F28): relative position bias shared from layer 0, unscaled attention, RMSNorm
without shift, ReLU or gated-GELU FFN, against HF in float64; the decoder is named and left out.

HF reference points (transformers ``modeling_t5``): model <-> ``T5EncoderModel(inputs_embeds=X)`` /
``T5ForConditionalGeneration.encoder(inputs_embeds=X)``; ``T5LayerNorm`` computes its variance in
float32, so float32's tolerance.  Sequences longer than the exact buckets exercise T5's logarithmic
bucketing (8 buckets, max distance 16, T = 21).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from transcover import TranscoverWarning, UnsupportedArchitectureError
from transcover.model import load, structural_differences, transformer_forward

D, H, DH, DFF, L, T, V = 16, 2, 6, 24, 2, 21, 40


def _config(transformers_mod, gated: bool):
    return transformers_mod.T5Config(
        vocab_size=V, d_model=D, d_kv=DH, d_ff=DFF, num_layers=L, num_decoder_layers=1, num_heads=H,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu" if gated else "relu", decoder_start_token_id=0)


def _load_full(model):
    with pytest.warns(TranscoverWarning, match="decoder is not analysed"):
        return load(model)


@pytest.fixture(scope="module")
def t5_models(transformers_mod, tmp_path_factory):
    from conftest import randomize

    torch.manual_seed(0)
    enc = randomize(transformers_mod.T5EncoderModel(_config(transformers_mod, False)), seed=1).double().eval()
    full = randomize(transformers_mod.T5ForConditionalGeneration(_config(transformers_mod, True)), seed=2)
    full = full.double().eval()
    path = tmp_path_factory.mktemp("t5")
    full.save_pretrained(path)
    return enc, full, path


def _x(seed: int) -> torch.Tensor:
    return torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("which", ["encoder-relu-module", "v1.1-gated-module", "v1.1-gated-files"])
def test_t5_encoder_matches_hf(t5_models, which, assert_close):
    enc, full, path = t5_models
    if which.startswith("encoder"):
        spec = load(enc)
    else:  # T5ForConditionalGeneration: the encoder, and one line saying why the decoder is left out
        with pytest.warns(TranscoverWarning, match="decoder is not analysed.*cross-attend"):
            spec = load(full) if which.endswith("module") else load(path)
    hf = enc.encoder if which.startswith("encoder") else full.encoder
    assert spec.arch == "t5" and spec.n_layers == L
    a = spec.layers[1].attention
    assert a.softmax_scale == 1.0 and a.position_bias is not None and a.position_bias.num_buckets == 8
    assert np.array_equal(np.asarray(a.position_bias.table),  # every layer adds layer 0's table
                          hf.block[0].layer[0].SelfAttention.relative_attention_bias.weight.detach().numpy())
    assert spec.layers[0].ffn.gated == ("gated" in which)
    X = _x(3)
    with torch.no_grad():
        ref = (enc if which.startswith("encoder") else hf)(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), ref, DFF, torch.float32, what=which)
    # the relative bias matters: without it the decomposition computes another function
    plain = replace(spec, layers=[replace(lay, attention=replace(lay.attention, position_bias=None))
                                  for lay in spec.layers])
    assert float((transformer_forward(plain, X) - ref).abs().max()) > 1e-3


def test_buckets_are_t5s(t5_models):
    enc, _, _ = t5_models
    spec = load(enc)
    attn = enc.encoder.block[0].layer[0].SelfAttention
    rel = torch.arange(40)[None, :] - torch.arange(40)[:, None]
    hf = attn._relative_position_bucket(rel, bidirectional=True, num_buckets=8, max_distance=16)
    assert torch.equal(spec.layers[0].attention.position_bias.buckets(40), hf)


def test_certified_intervals_enclose_float64_svd(t5_models):
    from transcover.norms import measure_model

    _, full, _ = t5_models
    spec = _load_full(full)
    m = measure_model(spec)
    for i, lay in enumerate(spec.layers):
        a = lay.attention
        for h in range(H):
            Wq, Wk, Wv, Wo = (torch.as_tensor(x).double() for x in a.head(h))
            exact_kq = float(torch.linalg.matrix_norm(Wq @ Wk.T, 2))
            exact_ov = float(torch.linalg.matrix_norm(Wv @ Wo, 2))
            hm = m.layers[i].heads[h]
            assert hm.W_KQ(1.0).lower <= exact_kq <= hm.W_KQ(1.0).upper
            assert hm.W_OV.lower <= exact_ov <= hm.W_OV.upper
        for name in ("W_1", "W_2", "W_gate"):
            exact = float(torch.linalg.matrix_norm(torch.as_tensor(getattr(lay.ffn, name)).double(), 2))
            iv = getattr(m.layers[i], name)
            assert iv.lower <= exact <= iv.upper
    assert m.layers[0].pos_bias == pytest.approx(float(torch.as_tensor(spec.layers[0].attention.position_bias.table)
                                                      .abs().max()), rel=0)


def test_bucketing_is_structural_and_per_block_tables_are_refused(t5_models, tmp_path):
    _, full, path = t5_models
    spec = _load_full(full)
    other = replace(spec, layers=[replace(lay, attention=replace(lay.attention, position_bias=replace(
        lay.attention.position_bias, max_distance=32))) for lay in spec.layers])
    assert any("relative position bias" in d for d in structural_differences(spec, other))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors["encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"] = torch.zeros(8, H, dtype=torch.float64)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedArchitectureError, match="per-block relative position bias"):
        load(tmp_path)


def test_analyze_notes_the_score_shift(t5_models):
    from transcover.norms import analyze_spec

    enc, _, _ = t5_models
    spec = load(enc)
    res = analyze_spec(spec, embeddings=False)
    top = float(torch.as_tensor(spec.layers[0].attention.position_bias.table).abs().max())
    note = next(n for n in res.notes if "relative position bias" in n)
    assert f"{top:.4g}" in note and "F28" in note
