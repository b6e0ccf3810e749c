"""The ViT adapter reproduces HF ViTModel in float64, from files (legacy tensor names) and modules
(transformers 5 names: ``layers.N.attention.q_proj``, ``mlp.fc1``...).

HF reference points (transformers 5 ``modeling_vit``), per layer ``hf = vit.layers[i]``, with
``attn_implementation="sdpa"`` (float64 softmax; eager's softmax is float32):
  attention  <-> ``hf.attention(X)[0]``   (q/k/v projections, heads, o_proj)
  FFN        <-> ``hf.mlp(X)``            (fc1, GELU, fc2)
  layer      <-> ``hf(X)``
  model      <-> ``ViTModel(pixel_values).last_hidden_state`` (after the final layernorm) from the
                 input of ``layers[0]``; the spec's patch projection, CLS token and positions
                 rebuild that input from the pixels.
"""

from __future__ import annotations

import pytest
import torch
from conftest import randomize

from transcover.model import (
    Placement, attention_forward, ffn_forward, layer_forward, load, transformer_forward,
)

D, H, DFF, L, IMG, P, C = 32, 4, 48, 2, 8, 4, 3
N = (IMG // P) ** 2 + 1  # patches + CLS


@pytest.fixture(scope="module")
def vit(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.ViTConfig(
        hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DFF,
        image_size=IMG, patch_size=P, num_channels=C, layer_norm_eps=1e-6, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = randomize(transformers_mod.ViTForImageClassification(cfg), seed=7).double().eval()
    path = tmp_path_factory.mktemp("vit")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("via", ["directory", "module"])
def test_vit_layers_match_hf(vit, via, assert_close):
    model, path = vit
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "vit" and spec.n_layers == L
    torch.manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(spec.layers):
            hf = model.vit.layers[i]
            assert layer.placement is Placement.PRE and not layer.attention.causal
            X = torch.randn(2, N, D, dtype=torch.float64)
            assert_close(attention_forward(layer.attention, X), hf.attention(X)[0], D, what=f"attention {i}")
            assert_close(ffn_forward(layer.ffn, X), hf.mlp(X), DFF, what=f"ffn {i}")
            out = hf(X)
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, DFF, what=f"layer {i}")


@pytest.mark.parametrize("via", ["directory", "module"])
def test_vit_whole_model_and_patch_embedding_match_hf(vit, via, assert_close):
    model, path = vit
    spec = load(path) if via == "directory" else load(model)
    captured = {}
    hook = model.vit.layers[0].register_forward_pre_hook(lambda m, args: captured.update(x=args[0]))
    pixels = torch.randn(2, C, IMG, IMG, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            hidden = model.vit(pixel_values=pixels).last_hidden_state
    finally:
        hook.remove()
    g = IMG // P  # (B, C, g, P, g, P) -> (B, g*g, C*P*P): the Conv2d's patch flattening
    patches = pixels.reshape(2, C, g, P, g, P).permute(0, 2, 4, 1, 3, 5).reshape(2, g * g, C * P * P)
    emb = spec.to_torch().embeddings  # numpy arrays when read from files
    bias = model.vit.embeddings.patch_embeddings.projection.bias.detach()
    tokens = patches @ emb["patch_projection"] + bias
    assert all(emb[k].ndim == 2 for k in emb)
    X = torch.cat([emb["cls_token"].expand(2, 1, D), tokens], dim=1) + emb["position_embedding"]
    assert_close(X, captured["x"], C * P * P, what="patch embedding")
    assert_close(transformer_forward(spec, captured["x"]), hidden, L * DFF, what="model")
    expected_prefix = "vit.encoder.layer.0.attention.attention." if via == "directory" else "vit.layers.0.attention."
    assert spec.layers[0].names["W_K"].startswith(expected_prefix)
