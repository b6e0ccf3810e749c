"""The BERT adapter reproduces HF BertModel, piece by piece, in float64.

HF reference points (transformers 5 ``modeling_bert``), per layer ``hf = encoder.layer[i]``:
  attention  <-> ``hf.attention.output.dense(hf.attention.self(X)[0])`` (before dropout/residual/LN)
  FFN        <-> ``hf.output.dense(hf.intermediate(X))``               (before dropout/residual/LN)
  layer      <-> ``hf(X)``
  encoder    <-> ``BertModel(input_ids).last_hidden_state`` from the input of ``embeddings.LayerNorm``
"""

from __future__ import annotations

import pytest
import torch
from conftest import randomize
from safetensors import safe_open

from transcover.model import (
    attention_forward, ffn_forward, layer_forward, load, transformer_forward,
)

D, H, DFF, L, T = 32, 4, 48, 2, 6


@pytest.fixture(scope="module")
def bert(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.BertConfig(
        hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DFF,
        vocab_size=64, max_position_embeddings=16, layer_norm_eps=1e-7,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = randomize(transformers_mod.BertForSequenceClassification(cfg)).double().eval()
    path = tmp_path_factory.mktemp("bert")
    model.save_pretrained(path)
    return model, path


def _hf_layer(layer, X):
    out = layer(X)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("via", ["directory", "module"])
def test_bert_layers_match_hf(bert, via, assert_close):
    model, path = bert
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "bert" and spec.n_layers == L and spec.d_model == D
    torch.manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(spec.layers):
            hf = model.bert.encoder.layer[i]
            X = torch.randn(2, T, D, dtype=torch.float64)
            assert_close(attention_forward(layer.attention, X),
                         hf.attention.output.dense(hf.attention.self(X)[0]), D, what=f"attention {i}")
            assert_close(ffn_forward(layer.ffn, X), hf.output.dense(hf.intermediate(X)), DFF, what=f"ffn {i}")
            assert_close(layer_forward(layer, X), _hf_layer(hf, X), DFF, what=f"layer {i}")


def test_bert_whole_encoder_and_embeddings_match_hf(bert, assert_close):
    model, path = bert
    spec = load(path)
    captured = {}
    hook = model.bert.embeddings.LayerNorm.register_forward_pre_hook(
        lambda m, args: captured.update(x=args[0]))  # returns None: the input is left as it is
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            hidden = model.bert(input_ids=ids).last_hidden_state
    finally:
        hook.remove()
    emb = spec.embeddings
    X = emb["token_embedding"][ids] + emb["position_embedding"][:T] + emb["token_type_embedding"][0]
    assert_close(X, captured["x"], 1, what="embedding sum")
    assert_close(transformer_forward(spec, captured["x"]), hidden, L * DFF, what="encoder")


def test_bert_names_prefix_and_config(bert):
    _, path = bert
    spec = load(path)
    names = spec.layers[1].names
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert len(names) == 16 and set(names.values()) <= keys  # every role names a stored tensor
    assert names["W_Q"] == "bert.encoder.layer.1.attention.self.query.weight"
    assert names["norm_ffn.bias"] == "bert.encoder.layer.1.output.LayerNorm.bias"
    assert spec.config["prefix"] == "bert." and spec.config["n_heads"] == H
    assert spec.embeddings.names["pooler"] == "bert.pooler.dense.weight"
    assert spec.input_norm is not None and spec.input_norm.eps == 1e-7
    assert spec.layers[0].attention.W_Q.shape == (H, D, D // H)
