"""Qwen3 (Llama's block + per-head query/key RMSNorm before RoPE) through the Llama adapter, against HF.

HF reference points (transformers 5 ``modeling_qwen3``), ``hf = model.model.layers[i]``, sdpa attention:
  attention  <-> ``hf.self_attn(X, position_embeddings=(cos, sin), attention_mask=None)[0]``; HF's
                 ``Qwen3RMSNorm`` (q_norm, k_norm) computes in float32, so float32's tolerance
  layer      <-> ``hf(X, position_embeddings=(cos, sin))``; model <-> ``Qwen3Model(inputs_embeds=X)``
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from transcover import UnsupportedArchitectureError
from transcover.model import NormKind, attention_forward, layer_forward, load, structural_differences, transformer_forward

D, H, H_KV, DH, DFF, L, T, V, THETA = 32, 4, 2, 12, 48, 2, 7, 64, 500.0


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, transformers_mod):
    from conftest import randomize

    cfg = transformers_mod.Qwen3Config(
        hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H_KV, head_dim=DH,
        intermediate_size=DFF, vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": THETA}, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = randomize(transformers_mod.Qwen3ForCausalLM(cfg), seed=3).double().eval()
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return model, path


def _cos_sin(T: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (THETA ** (torch.arange(0, DH, 2, dtype=torch.float64) / DH))
    f = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    e = torch.cat([f, f], -1)[None]
    return e.cos(), e.sin()


@pytest.mark.parametrize("via", ["directory", "module"])
def test_qwen3_layers_match_hf(qwen3, via, assert_close):
    model, path = qwen3
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "llama" and spec.n_layers == L
    cs = _cos_sin(T)
    with torch.no_grad():
        for i, layer in enumerate(spec.layers):
            hf = model.model.layers[i]
            a = layer.attention
            assert a.q_norm is not None and a.k_norm is not None and a.q_norm.kind is NormKind.RMSNORM
            assert tuple(torch.as_tensor(a.q_norm.weight).shape) == (DH,) and a.d_head == DH
            X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
            ref = hf.self_attn(X, position_embeddings=cs, attention_mask=None)[0]
            assert_close(attention_forward(a, X), ref, D, torch.float32, what=f"attention {i}")
            # the q/k norms matter: without them the attention is another function
            bare = replace(a, q_norm=None, k_norm=None)
            assert float((attention_forward(bare, X) - ref).abs().max()) > 1e-3
            out = hf(X, attention_mask=None, position_embeddings=cs)
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, DFF, torch.float32, what=f"layer {i}")
    assert "q_norm.weight" in spec.layers[0].names and not spec.warnings
    assert structural_differences(spec, replace(spec, layers=[replace(la, attention=replace(la.attention, q_norm=None))
                                                              for la in spec.layers]))


def test_qwen3_whole_model_matches_hf(qwen3, assert_close):
    model, path = qwen3
    spec = load(path)
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        hidden = model.model(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), hidden, L * DFF, torch.float32, what="model")


def test_whole_projection_qk_norm_is_refused(transformers_mod):
    """OLMo 2 normalises all heads' queries together (q_norm of width H * d_head): not per head."""
    from transcover.model._adapters._llama import build_llama
    from transcover.model._sources import StateDictSource

    cfg = transformers_mod.Qwen3Config(hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                       num_key_value_heads=H_KV, head_dim=DH, intermediate_size=DFF, vocab_size=V)
    sd = dict(transformers_mod.Qwen3Model(cfg).state_dict())
    sd["layers.0.self_attn.q_norm.weight"] = torch.ones(H * DH)
    with pytest.raises(UnsupportedArchitectureError, match="more than one head"):
        build_llama(StateDictSource(sd, "olmo-like"), cfg.to_dict(), "olmo-like")
