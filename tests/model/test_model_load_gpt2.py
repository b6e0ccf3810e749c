"""The GPT-2 adapter reproduces HF GPT2Model, piece by piece, in float64.

HF reference points (transformers 5 ``modeling_gpt2``), per block ``hf = transformer.h[i]``, with the
causal mask passed explicitly (HF builds it in ``GPT2Model.forward``, not in the block):
  attention  <-> ``hf.attn(X, attention_mask=causal)[0]``  (c_attn split, heads, c_proj)
  FFN        <-> ``hf.mlp(X)``
  layer      <-> ``hf(X, attention_mask=causal)``
  model      <-> ``GPT2Model(input_ids).last_hidden_state`` (after ln_f; HF's own mask) from the
                 input of ``h[0]``
"""

from __future__ import annotations

import pytest
import torch
from conftest import causal_mask, randomize
from safetensors import safe_open

from transcover.model import (
    Activation, attention_forward, ffn_forward, layer_forward, load, transformer_forward,
)

D, H, L, T, V = 32, 4, 3, 7, 64

VARIANTS = {
    "default": {},
    # scale 1/(sqrt(d_head) (layer + 1)), and a ReLU MLP with an explicit inner width
    "layer_scaled_relu": {"scale_attn_by_inverse_layer_idx": True, "activation_function": "relu", "n_inner": 40},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def gpt2(request, tmp_path_factory, transformers_mod):
    cfg = transformers_mod.GPT2Config(
        n_embd=D, n_layer=L, n_head=H, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager", **VARIANTS[request.param],
    )
    torch.manual_seed(0)
    model = randomize(transformers_mod.GPT2LMHeadModel(cfg), seed=3).double().eval()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return model, path, request.param


@pytest.mark.parametrize("via", ["directory", "module"])
def test_gpt2_blocks_match_hf(gpt2, via, assert_close):
    model, path, variant = gpt2
    spec = load(path) if via == "directory" else load(model)
    assert spec.arch == "gpt2" and spec.n_layers == L
    d_ff = spec.config["d_ff"]
    assert d_ff == (40 if variant != "default" else 4 * D)
    torch.manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(spec.layers):
            hf = model.transformer.h[i]
            X = torch.randn(2, T, D, dtype=torch.float64)
            mask = causal_mask(T)
            assert layer.attention.causal
            assert_close(attention_forward(layer.attention, X), hf.attn(X, attention_mask=mask)[0], D,
                         what=f"attention {i}")
            assert_close(ffn_forward(layer.ffn, X), hf.mlp(X), d_ff, what=f"ffn {i}")
            out = hf(X, attention_mask=mask)
            out = out[0] if isinstance(out, tuple) else out
            assert_close(layer_forward(layer, X), out, d_ff, what=f"block {i}")


def test_gpt2_whole_model_matches_hf(gpt2, assert_close):
    model, path, _ = gpt2
    spec = load(path)
    captured = {}
    hook = model.transformer.h[0].register_forward_pre_hook(lambda m, args: captured.update(x=args[0]))
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            hidden = model.transformer(input_ids=ids).last_hidden_state
    finally:
        hook.remove()
    X = spec.embeddings["token_embedding"][ids] + spec.embeddings["position_embedding"][:T]
    assert_close(X, captured["x"], 1, what="embedding sum")
    assert_close(transformer_forward(spec, captured["x"]), hidden, L * 4 * D, what="model")


def test_gpt2_fused_names_and_activation(gpt2):
    _, path, variant = gpt2
    spec = load(path)
    names = spec.layers[2].names
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert len(names) == 16 and {n.split("[")[0] for n in names.values()} <= keys
    assert names["W_Q"] == f"transformer.h.2.attn.c_attn.weight[:, 0:{D}]"
    assert names["W_V"] == f"transformer.h.2.attn.c_attn.weight[:, {2 * D}:{3 * D}]"
    assert names["b_K"] == f"transformer.h.2.attn.c_attn.bias[{D}:{2 * D}]"
    expected = Activation.GELU_TANH if variant == "default" else Activation.RELU
    assert spec.layers[0].ffn.activation is expected
    scale = (D // H) ** -0.5 / (3 if variant != "default" else 1)
    assert spec.layers[2].attention.softmax_scale == pytest.approx(scale, rel=1e-15)


def test_gpt2_per_head_value_label_names_the_head_slice(gpt2):
    """Stop 38's list: ``analyze`` labelled every ``W_V.h`` of GPT-2 with the whole V block
    (``c_attn.weight[:, 64:96]``); each now names its head's own columns, which hold exactly that matrix."""
    import numpy as np

    from transcover import analyze

    _, path, _ = gpt2
    res = analyze(path)
    dh = D // H
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for h in range(H):
            m = res.layers[1].matrices[f"W_V.h{h}"]
            lo, hi = 2 * D + h * dh, 2 * D + (h + 1) * dh
            assert m.tensor == f"transformer.h.1.attn.c_attn.weight[:, {lo}:{hi}]"
            W = f.get_tensor("transformer.h.1.attn.c_attn.weight")[:, lo:hi].double().numpy()
            top = float(np.linalg.svd(W, compute_uv=False)[0])
            assert m.spectral.lower <= top <= m.spectral.upper


def test_gelu_fast_is_a_structural_difference(gpt2):
    """Red team 165: ``gelu_fast`` (HF's FastGELU, constant 0.7978845608) was read as tanh GELU, so a gelu_new model
    and the same weights with gelu_fast were certified 0 apart by G.3 while float64 attains 3.2e-14. Both load as tanh
    GELU, and the pair is now refused as structurally different; gelu_pytorch_tanh (exactly gelu_new) still is not."""
    import dataclasses

    from transcover.model import structural_differences

    _, path, _ = gpt2
    a = load(path)
    src = dict(a.config["source_config"])
    fast = dataclasses.replace(a, config={**a.config, "source_config": {**src, "activation_function": "gelu_fast"}})
    same = dataclasses.replace(a, config={**a.config,
                                          "source_config": {**src, "activation_function": "gelu_pytorch_tanh"}})
    diffs = structural_differences(a, fast)
    assert len(diffs) == 1 and "gelu_fast" in diffs[0] and "0.7978845608" in diffs[0]
    assert structural_differences(a, same) == [] and structural_differences(fast, fast) == []
    import transcover

    with pytest.raises(transcover.InputError, match="gelu_fast"):
        transcover.perturb(a, fast)
