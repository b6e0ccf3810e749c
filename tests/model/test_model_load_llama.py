"""The Llama adapter (GQA, RoPE, gated SiLU MLP, RMSNorm) reproduces HF LlamaModel / Qwen2Model.

HF reference points (transformers 5 ``modeling_llama``), per layer ``hf = model.layers[i]``, with
``attn_implementation="sdpa"`` (float64 softmax; the eager path computes its softmax in float32):
  attention  <-> ``hf.self_attn(X, position_embeddings=(cos, sin))[0]`` with cos/sin from HF's
                 default-RoPE formula evaluated in float64 (HF's own rotary module works in float32)
  FFN        <-> ``hf.mlp(X)``
  norms      <-> ``hf.input_layernorm(X)``, ``hf.post_attention_layernorm(X)``   (float32 inside HF)
  layer      <-> ``hf(X, position_embeddings=(cos, sin))``                      (float32 RMSNorm)
  model      <-> ``LlamaModel(inputs_embeds=X).last_hidden_state`` (HF's float32 RoPE and RMSNorm)
Where HF computes in float32 the tolerance is float32's, as the reference's precision dictates.
"""

from __future__ import annotations

import pytest
import torch
from conftest import randomize, tensors_equal

from transcover.model import (
    Activation, NormKind, attention_forward, ffn_forward, layer_forward, load, transformer_forward,
)

D, H, H_KV, DFF, L, T, V, THETA = 32, 4, 2, 48, 2, 9, 64, 500.0

VARIANTS = {
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_biases": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases, no o bias: read by presence
    # Mistral's sliding window (here 4 < T): the spec's window mask, compared on sequences longer
    # than the window
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    # Qwen2 windows only the layers >= max_window_layers (here layer 1)
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 3,
                                                         "max_window_layers": 1}),
}
WINDOWS = {"mistral": (4, 4), "qwen2_window": (None, 3)}


def _mask(T: int, window: int | None) -> torch.Tensor:
    """HF's additive (1, 1, T, T) mask: causal, and key j hidden from query i when j <= i - window."""
    hide = torch.ones(T, T, dtype=torch.bool).triu(1)
    if window is not None:
        hide |= torch.ones(T, T, dtype=torch.bool).tril(-window)
    return torch.zeros(T, T, dtype=torch.float64).masked_fill(hide, float("-inf"))[None, None]


@pytest.fixture(scope="module", params=list(VARIANTS))
def llama(request, tmp_path_factory, transformers_mod):
    cfg_cls, model_cls, extra = VARIANTS[request.param]
    cfg = getattr(transformers_mod, cfg_cls)(
        hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H_KV,
        intermediate_size=DFF, vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": THETA}, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa", **extra,
    )
    torch.manual_seed(0)
    model = randomize(getattr(transformers_mod, model_cls)(cfg), seed=5).double().eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path, request.param


def _rope_cos_sin(T: int, dh: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``LlamaRotaryEmbedding`` (default type) in float64: inv_freq = theta^(-2i/dh), emb = [f, f]."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh))
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[None]  # (1, T, dh)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("via", ["directory", "module"])
def test_llama_layers_match_hf(llama, via, assert_close):
    model, path, variant = llama
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "llama" and spec.n_layers == L
    cos_sin = _rope_cos_sin(T, D // H)
    torch.manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(spec.layers):
            hf = model.model.layers[i]
            a = layer.attention
            assert (a.n_heads, a.n_kv_heads, a.d_head) == (H, H_KV, D // H)
            assert a.causal and a.rope is not None and a.rope.theta == THETA
            assert (a.b_Q is not None) == (variant in ("llama_biases", "qwen2", "qwen2_window"))
            assert (a.b_O is not None) == (variant == "llama_biases")
            assert layer.ffn.gated and layer.ffn.activation is Activation.SILU
            X = torch.randn(2, T, D, dtype=torch.float64)
            window = WINDOWS.get(variant, (None,) * L)[i]
            assert a.window == window
            mask = _mask(T, window)
            assert_close(attention_forward(a, X), hf.self_attn(X, position_embeddings=cos_sin, attention_mask=mask)[0], D,
                         what=f"attention {i}")
            assert_close(ffn_forward(layer.ffn, X), hf.mlp(X), DFF, what=f"ffn {i}")
            assert layer.norm_attn.kind is NormKind.RMSNORM
            assert_close(layer.norm_attn(X), hf.input_layernorm(X), D, torch.float32, what="rms 1")
            assert_close(layer.norm_ffn(X), hf.post_attention_layernorm(X), D, torch.float32, what="rms 2")
            out = hf(X, attention_mask=mask, position_embeddings=cos_sin)
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, DFF, torch.float32, what=f"layer {i}")


def test_llama_whole_model_matches_hf(llama, assert_close):
    model, path, variant = llama
    spec = load(path)
    n = T  # longer than every window: the window mask is exercised
    if variant in WINDOWS:
        assert spec.config["sliding_window"] == max(w for w in WINDOWS[variant] if w is not None)
    X = torch.randn(2, n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model.model(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), hidden, L * DFF, torch.float32, what="model")
    # the untied LM head is kept, un-embedding as x @ W
    assert tensors_equal(spec.embeddings["unembedding"], model.lm_head.weight.detach().T)
    assert spec.layers[1].names["W_gate"] == "model.layers.1.mlp.gate_proj.weight"
