"""GPT-J (parallel residual with one ln_1, interleaved partial rotary) against HF GPTJModel.

HF computes GPT-J's attention scores in float32 (``query.to(torch.float32)``) and its rotary table in
float32, so the comparisons carry float32's tolerance.  The adapter's column permutation (Note
[interleaved rotary] in ``_adapters/_gptj``) is exact: the scores it recomputes are GPT-J's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import causal_mask, randomize

from transcover.model import Residual, layer_forward, load, transformer_forward

D, H, L, T, V, RD = 32, 4, 2, 7, 64, 4  # rotary on 4 of 8 coordinates per head


@pytest.fixture(scope="module")
def gptj(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.GPTJConfig(n_embd=D, n_head=H, n_layer=L, n_inner=48, vocab_size=V, n_positions=32,
                                      rotary_dim=RD, attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = randomize(transformers_mod.GPTJForCausalLM(cfg), seed=2).double().eval()
    path = tmp_path_factory.mktemp("gptj")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("via", ["directory", "module"])
def test_gptj_layers_and_model_match_hf(gptj, via, assert_close):
    model, path = gptj
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "gptj" and spec.n_layers == L and not spec.warnings
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None].expand(2, -1)
    with torch.no_grad():
        pe = model.transformer.rotary_emb(X, position_ids=pos)  # HF's float32 sinusoid table
        for i, layer in enumerate(spec.layers):
            assert layer.residual is Residual.PARALLEL and layer.norm_attn is layer.norm_ffn
            assert layer.attention.rope.rotary_dim == RD
            out = model.transformer.h[i](X, position_embeddings=pe, attention_mask=causal_mask(T))
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, 48, torch.float32, what=f"layer {i}")
        hidden = model.transformer(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), hidden, L * 48, torch.float32, what="model")


def test_without_the_permutation_the_function_differs(gptj):
    """The interleaved pairs matter: reading W_Q, W_K unpermuted computes another function."""
    from dataclasses import replace

    model, _ = gptj
    spec = load(model).to_torch()
    lay = spec.layers[0]
    a = lay.attention
    inv = torch.tensor([0, 2, 1, 3] + list(range(RD, D // H)))  # undo the permutation on the rotary part
    raw = replace(lay, attention=replace(a, W_Q=a.W_Q[..., inv], W_K=a.W_K[..., inv]))
    X = torch.randn(1, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert float((layer_forward(raw, X) - layer_forward(lay, X)).abs().max()) > 1e-3
