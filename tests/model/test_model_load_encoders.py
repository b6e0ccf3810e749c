"""DistilBERT, RoBERTa / XLM-R, CLIP (text and vision towers) and the Whisper encoder reproduce HF.

Each family: a random-weight model built from a small HF config (no download), saved with
``save_pretrained`` and read back through the file loader (and read from the live module), then
the decomposition recomputes HF's hidden states in float64 (``attn_implementation="sdpa"``: float64
softmax).  Layer by layer against HF's ``output_hidden_states`` and, for the whole model, against
``last_hidden_state``; tolerances from ``conftest._assert_close`` (size and dtype).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import randomize

from transcover import InputError, UnsupportedArchitectureError
from transcover.model import Activation, Placement, layer_forward, load, transformer_forward
from transcover.norms import frobenius_interval, l21_interval, spectral_norm_interval

D, H, DFF, L, V = 16, 2, 24, 2, 40


def _build(tf, cfg_cls: str, model_cls: str, seed: int, attn: str = "sdpa", **kw):
    cfg = getattr(tf, cfg_cls)(**kw, attn_implementation=attn)
    torch.manual_seed(seed)
    return randomize(getattr(tf, model_cls)(cfg), seed=seed).double().eval()


def _saved(model, tmp_path):
    model.save_pretrained(tmp_path)
    return tmp_path


def _check_layers(spec, hidden_states, assert_close, what, last_is_normed: bool = False):
    """layer_forward(layer i, h_i) == h_{i+1} for every layer (HF's hidden states in float64).

    ``last_is_normed``: HF's last hidden state already went through the final norm (Whisper).
    """
    assert spec.n_layers == len(hidden_states) - 1
    for i, layer in enumerate(spec.layers[: spec.n_layers - int(last_is_normed)]):
        assert_close(layer_forward(layer, hidden_states[i]), hidden_states[i + 1], DFF, what=f"{what} layer {i}")


def _enclose_svd(spec):
    """``analyze``'s certified intervals enclose float64 SVD / exact norms (the checks of tests/analyze)."""
    from transcover.norms import analyze_spec

    eps = np.finfo(np.float64).eps

    def encloses(iv, exact: float, n: int) -> bool:
        tol = 10 * n * eps * max(exact, 1e-300)  # the float64 reference's own error
        return iv.lower <= exact + tol and iv.upper >= exact - tol

    def norm2(M) -> float:
        return float(np.linalg.svd(np.asarray(torch.as_tensor(M).double()), compute_uv=False)[0])

    res = analyze_spec(spec, embeddings=False)
    for got, L in zip(res.layers, spec.layers):
        a, f = L.attention, L.ffn
        t = [torch.as_tensor(x).double() for x in (a.W_Q, a.W_K, a.W_V, a.W_O)]
        kq = [norm2(t[0][h] @ t[1][a.kv_index(h)].T * a.softmax_scale) for h in range(a.n_heads)]
        ov = [norm2(t[2][a.kv_index(h)] @ t[3][h]) for h in range(a.n_heads)]
        for h, hn in enumerate(got.heads):
            assert encloses(hn.B_KQ, kq[h], D) and encloses(hn.B_V, ov[h], D)
        assert encloses(got.B_KQ, max(kq), D) and encloses(got.B_V, max(ov), D)
        assert encloses(got.B_W1, norm2(f.W_1), DFF) and encloses(got.B_W2, norm2(f.W_2), DFF)
        W1 = np.asarray(torch.as_tensor(f.W_1).double())
        assert encloses(got.matrices["W_1"].frobenius, float(np.sqrt((W1 * W1).sum())), W1.size)
        assert encloses(got.matrices["W_1"].l21, float(np.sqrt((W1 * W1).sum(axis=0)).sum()), W1.size)
        for W in (f.W_1, a.W_Q[0]):  # and the public certifiers on the spec's own matrices
            W = np.asarray(torch.as_tensor(W).double())
            assert encloses(spectral_norm_interval(W), norm2(W), W.shape[0])
            assert encloses(frobenius_interval(W), float(np.sqrt((W * W).sum())), W.size)
            assert encloses(l21_interval(W), float(np.sqrt((W * W).sum(axis=0)).sum()), W.size)


@pytest.mark.parametrize("via", ["directory", "module"])
def test_distilbert_matches_hf(transformers_mod, tmp_path, via, assert_close):
    model = _build(transformers_mod, "DistilBertConfig", "DistilBertModel", 3, dim=D, n_heads=H, hidden_dim=DFF,
                   n_layers=L, vocab_size=V, max_position_embeddings=20)
    spec = load(_saved(model, tmp_path)) if via == "directory" else load(model)
    assert spec.arch == "distilbert" and spec.layers[0].placement is Placement.POST
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        raw = model.embeddings.word_embeddings(ids) + model.embeddings.position_embeddings(torch.arange(7))
    _check_layers(spec, hs, assert_close, "distilbert")
    assert_close(transformer_forward(spec, raw), hs[-1], L * DFF, what="distilbert model (with the embedding LN)")
    _enclose_svd(spec)


@pytest.mark.parametrize("cls", ["RobertaModel", "XLMRobertaModel"])
def test_roberta_and_xlmr_read_by_the_bert_adapter(transformers_mod, tmp_path, cls, assert_close):
    cfg_cls = cls.replace("Model", "Config")
    model = _build(transformers_mod, cfg_cls, cls, 4, hidden_size=D, num_attention_heads=H, intermediate_size=DFF,
                   num_hidden_layers=L, vocab_size=V, max_position_embeddings=20, pad_token_id=1)
    spec = load(_saved(model, tmp_path))
    assert spec.arch == "bert"
    ids = torch.randint(2, V, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    _check_layers(spec, out.hidden_states, assert_close, cls)
    no_input_norm = dataclasses.replace(spec, input_norm=None)  # hidden_states[0] is after the embedding LN
    assert_close(transformer_forward(no_input_norm, out.hidden_states[0]), out.last_hidden_state, L * DFF, what=cls)
    _enclose_svd(spec)


@pytest.mark.parametrize("via", ["directory", "module"])
def test_clip_text_tower_matches_hf(transformers_mod, tmp_path, via, assert_close):
    model = _build(transformers_mod, "CLIPTextConfig", "CLIPTextModel", 5, hidden_size=D, num_attention_heads=H,
                   intermediate_size=DFF, num_hidden_layers=L, vocab_size=V, max_position_embeddings=20,
                   bos_token_id=0, eos_token_id=1, pad_token_id=1)
    spec = load(_saved(model, tmp_path)) if via == "directory" else load(model)
    a = spec.layers[0].attention
    assert spec.arch == "clip_text" and a.causal and spec.layers[0].ffn.activation is Activation.QUICK_GELU
    ids = torch.randint(2, V, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    _check_layers(spec, out.hidden_states, assert_close, "clip text")
    assert_close(transformer_forward(spec, out.hidden_states[0]), out.last_hidden_state, L * DFF, what="clip text")
    _enclose_svd(spec)


def test_clip_vision_tower_matches_hf(transformers_mod, tmp_path, assert_close):
    model = _build(transformers_mod, "CLIPVisionConfig", "CLIPVisionModel", 6, hidden_size=D, num_attention_heads=H,
                   intermediate_size=DFF, num_hidden_layers=L, image_size=8, patch_size=4)
    spec = load(_saved(model, tmp_path))
    assert spec.arch == "clip_vision" and not spec.layers[0].attention.causal and spec.final_norm is None
    px = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(pixel_values=px, output_hidden_states=True)
        emb = model.embeddings(px)  # before pre_layrnorm, the spec's input_norm
    _check_layers(spec, out.hidden_states, assert_close, "clip vision")
    assert_close(transformer_forward(spec, emb), out.last_hidden_state, L * DFF, what="clip vision")
    assert spec.embeddings["patch_projection"].shape == (3 * 4 * 4, D)
    _enclose_svd(spec)


def test_clip_model_needs_a_tower_and_reads_each(transformers_mod, tmp_path, assert_close):
    tf = transformers_mod
    cfg = tf.CLIPConfig(
        text_config=dict(hidden_size=D, num_attention_heads=H, intermediate_size=DFF, num_hidden_layers=L,
                         vocab_size=V, max_position_embeddings=20, bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=D, num_attention_heads=H, intermediate_size=DFF, num_hidden_layers=1,
                           image_size=8, patch_size=4), projection_dim=8, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = randomize(tf.CLIPModel(cfg), seed=7).double().eval()
    path = _saved(model, tmp_path)
    with pytest.raises(InputError, match="two towers: pass arch='clip_text' or arch='clip_vision'"):
        load(path)
    text, vision = load(path, arch="clip_text"), load(path, arch="clip_vision")
    assert (text.n_layers, vision.n_layers) == (L, 1)
    ids = torch.randint(2, V, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model.text_model(input_ids=ids, output_hidden_states=True)
    assert_close(transformer_forward(text, out.hidden_states[0]), out.last_hidden_state, L * DFF, what="clip model text")
    assert text.embeddings["text_projection"].shape == (D, 8)


def test_whisper_encoder_matches_hf(transformers_mod, tmp_path, assert_close):
    model = _build(transformers_mod, "WhisperConfig", "WhisperModel", 8, d_model=D, encoder_attention_heads=H,
                   encoder_ffn_dim=DFF, encoder_layers=L, decoder_layers=1, decoder_attention_heads=H,
                   decoder_ffn_dim=DFF, vocab_size=V, num_mel_bins=4, max_source_positions=6, max_target_positions=6,
                   pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    spec = load(_saved(model, tmp_path))
    assert spec.arch == "whisper" and spec.layers[0].attention.b_K is None and spec.final_norm is not None
    assert "conv front-end" in spec.config["covered"]
    feats = torch.randn(2, 4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model.encoder(feats, output_hidden_states=True)
    _check_layers(spec, out.hidden_states, assert_close, "whisper", last_is_normed=True)
    assert_close(transformer_forward(spec, out.hidden_states[0]), out.last_hidden_state, L * DFF, what="whisper")
    assert spec.embeddings["conv1"].shape == (4 * 3, D)  # Conv1d (d, mel, 3) as (mel * 3, d)
    _enclose_svd(spec)


def test_deberta_v2_refused_naming_disentangled_attention(transformers_mod, tmp_path):
    model = _build(transformers_mod, "DebertaV2Config", "DebertaV2Model", 9, attn="eager", hidden_size=D, num_attention_heads=H,
                   intermediate_size=DFF, num_hidden_layers=1, vocab_size=V, max_position_embeddings=20,
                   relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=4, max_relative_positions=8)
    path = _saved(model, tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="disentangled attention .* would need"):
        load(path)
    with pytest.raises(UnsupportedArchitectureError, match="disentangled attention"):
        load(model)


def test_config_contradicting_the_tensors_is_refused(transformers_mod, tmp_path):
    import json

    from transcover import InputError

    model = _build(transformers_mod, "DistilBertConfig", "DistilBertModel", 3, dim=D, n_heads=H, hidden_dim=DFF,
                   n_layers=L, vocab_size=V, max_position_embeddings=20)
    path = _saved(model, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "n_layers": L + 1}))
    with pytest.raises(InputError, match=r"declares 3 layers, but the checkpoint stores 2"):
        load(path)
    (path / "config.json").write_text(json.dumps({**cfg, "dim": 2 * D, "n_heads": H}))
    with pytest.raises(InputError, match=r"says hidden size 32, but .* has input width 16"):
        load(path)


@pytest.mark.parametrize("family", ["clip_text", "distilbert"])
def test_certified_lipschitz_bound_survives_the_adversarial_search(transformers_mod, family):
    """The network bound of a new family (QuickGELU + causal pre-norm; post-norm) against float64 ascent.

    ``lipschitz_lower`` raises CertificateViolation when a searched ratio exceeds the certified
    stage or network bound (each searched inside its own certified domain).
    """
    from transcover.lipschitz import lipschitz_bounds, lipschitz_lower

    if family == "clip_text":
        model = _build(transformers_mod, "CLIPTextConfig", "CLIPTextModel", 5, hidden_size=D, num_attention_heads=H,
                       intermediate_size=DFF, num_hidden_layers=1, vocab_size=V, max_position_embeddings=20,
                       bos_token_id=0, eos_token_id=1, pad_token_id=1)
    else:
        model = _build(transformers_mod, "DistilBertConfig", "DistilBertModel", 3, dim=D, n_heads=H, hidden_dim=DFF,
                       n_layers=1, vocab_size=V, max_position_embeddings=20)
    spec = load(model).to_torch(torch.float64)
    bounds = lipschitz_bounds(spec, radius=1.0)
    lower = lipschitz_lower(spec, bounds, seq_len=5, n_samples=2, n_steps=8, seed=2)
    assert 0 < lower[(-2, "network")].value.value <= bounds.upper.value
