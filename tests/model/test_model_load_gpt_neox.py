"""The GPT-NeoX adapter (Pythia: parallel residual, partial rotary, q/k/v biases) reproduces HF GPTNeoXModel.

HF reference points (transformers 5 ``modeling_gpt_neox``), per layer ``hf = model.gpt_neox.layers[i]``,
with ``attn_implementation="sdpa"`` (softmax in the input's dtype, float64 here):
  attention  <-> ``hf.attention(X, attention_mask=None, position_embeddings=(cos, sin))[0]``, cos/sin
                 from HF's default-RoPE formula over the *rotated* width, evaluated in float64 (HF's own
                 rotary module computes its frequencies in float32)
  FFN        <-> ``hf.mlp(X)``;  norms <-> ``hf.input_layernorm``, ``hf.post_attention_layernorm``
  layer      <-> ``hf(X, position_embeddings=(cos, sin))``: parallel and sequential residuals
  model      <-> ``GPTNeoXModel(inputs_embeds=X).last_hidden_state`` (HF's float32 RoPE frequencies,
                 so float32's tolerance there)
"""

from __future__ import annotations

import pytest
import torch
from conftest import randomize, tensors_equal

from transcover import InputError, UnsupportedArchitectureError
from transcover.model import (
    Activation, NormKind, Residual, attention_forward, ffn_forward, layer_forward, load, structural_differences,
    transformer_forward,
)

D, H, DFF, L, T, V, THETA = 32, 4, 48, 2, 7, 64, 500.0
DH = D // H

VARIANTS = {  # name: (use_parallel_residual, partial_rotary_factor)
    "pythia": (True, 0.25),  # Pythia's rotary_pct = 0.25: 2 of 8 coordinates rotate
    "parallel_half": (True, 0.5),
    "sequential_full": (False, 1.0),
}


def _config(transformers_mod, parallel: bool, factor: float, **extra):
    return transformers_mod.GPTNeoXConfig(
        hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DFF, vocab_size=V,
        layer_norm_eps=1e-5, max_position_embeddings=32, use_parallel_residual=parallel,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": factor},
        hidden_act="gelu", attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, **extra)


@pytest.fixture(scope="module", params=list(VARIANTS))
def neox(request, tmp_path_factory, transformers_mod):
    parallel, factor = VARIANTS[request.param]
    torch.manual_seed(0)
    model = transformers_mod.GPTNeoXForCausalLM(_config(transformers_mod, parallel, factor))
    model = randomize(model, seed=7).double().eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path, parallel, factor


def _rope_cos_sin(T: int, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``GPTNeoXRotaryEmbedding`` (default type) in float64 over the rotated width rd."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("via", ["directory", "module"])
def test_gpt_neox_layers_match_hf(neox, via, assert_close):
    model, path, parallel, factor = neox
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "gpt_neox" and spec.n_layers == L
    rd = int(DH * factor)
    cos_sin = _rope_cos_sin(T, rd)
    torch.manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(spec.layers):
            hf = model.gpt_neox.layers[i]
            a = layer.attention
            assert (a.n_heads, a.n_kv_heads, a.d_head) == (H, H, DH) and a.causal
            assert (a.rope.rotary_dim or DH) == rd and a.rope.theta == THETA
            assert a.b_Q is not None and a.b_K is not None and a.b_V is not None and a.b_O is not None
            assert layer.residual is (Residual.PARALLEL if parallel else Residual.SEQUENTIAL)
            assert layer.ffn.activation is Activation.GELU and not layer.ffn.gated
            assert layer.norm_attn.kind is NormKind.LAYERNORM
            X = torch.randn(2, T, D, dtype=torch.float64)
            assert_close(attention_forward(a, X), hf.attention(X, attention_mask=None, position_embeddings=cos_sin)[0],
                         D, what=f"attention {i}")
            assert_close(ffn_forward(layer.ffn, X), hf.mlp(X), DFF, what=f"ffn {i}")
            assert_close(layer.norm_attn(X), hf.input_layernorm(X), D, what="ln 1")
            assert_close(layer.norm_ffn(X), hf.post_attention_layernorm(X), D, what="ln 2")
            out = hf(X, attention_mask=None, position_embeddings=cos_sin)
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, DFF, what=f"layer {i}")


def test_gpt_neox_whole_model_matches_hf(neox, assert_close):
    model, path, parallel, factor = neox
    spec = load(path)
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model.gpt_neox(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), hidden, L * DFF, torch.float32, what="model")
    assert tensors_equal(spec.embeddings["unembedding"], model.get_output_embeddings().weight.detach().T)
    assert spec.config["residual"] == ("parallel" if parallel else "sequential")
    assert spec.layers[1].names["W_QKV"] == "gpt_neox.layers.1.attention.query_key_value.weight"
    assert not spec.warnings


def test_parallel_is_not_the_sequential_function(neox):
    """The residual layout changes the function: the decomposition read as sequential would be another
    model, and comparing a parallel with a sequential model is refused (Note [structural differences])."""
    from dataclasses import replace

    model, path, parallel, _ = neox
    spec = load(model).to_torch()
    flipped = replace(spec, layers=[replace(lay, residual=Residual.SEQUENTIAL if parallel else Residual.PARALLEL)
                                    for lay in spec.layers])
    X = torch.randn(1, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    gap = float((transformer_forward(spec, X) - transformer_forward(flipped, X)).abs().max())
    assert gap > 1e-3
    diffs = structural_differences(spec, flipped)
    assert any(line.startswith("residual: layer 0") for line in diffs), diffs
    from transcover.lipschitz import perturbation_bound

    with pytest.raises(InputError, match="residual"):
        perturbation_bound(spec, flipped)


def test_scaled_rope_and_odd_rotary_width_are_refused(transformers_mod):
    """LongRoPE switches factor lists by sequence length; 0.375 * 8 = 3 rotated coordinates cannot pair up."""
    torch.manual_seed(0)
    model = transformers_mod.GPTNeoXModel(_config(transformers_mod, True, 0.25))
    cfg = model.config.to_dict()
    from transcover.model._adapters._gpt_neox import build_gpt_neox
    from transcover.model._sources import StateDictSource

    src = StateDictSource(model.state_dict(), "tiny")
    for bad, what in (({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": THETA}}, "sequence"),
                      ({"rope_parameters": {"rope_type": "default", "rope_theta": THETA,
                                            "partial_rotary_factor": 0.375}}, "partial rotary")):
        with pytest.raises(UnsupportedArchitectureError, match=what):
            build_gpt_neox(src, {**cfg, **bad}, "tiny")


def test_parallel_residual_needs_pre_norm():
    from transcover.model import LayerSpec, Placement

    with pytest.raises(ValueError, match="pre-norm"):
        LayerSpec(0, None, None, None, None, Placement.POST, residual="parallel")  # type: ignore[arg-type]
