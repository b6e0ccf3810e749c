"""torch.nn.TransformerEncoder(Layer) and transcover's ReferenceTransformer, through ``load``.

torch reference points (``torch/nn/modules/transformer.py``), per layer ``m = encoder.layers[i]``:
  attention  <-> ``m.self_attn(X, X, X, need_weights=False)[0]`` (fused in_proj, out_proj)
  FFN        <-> ``m.linear2(m.activation(m.linear1(X)))``
  layer      <-> ``m(X)``
  encoder    <-> ``encoder(X)`` (with its final ``norm``)
ReferenceTransformer: ``model.features(X)`` (no head) and ``model(X)`` (with the MLP head).
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
from conftest import as_tensor, randomize, tensors_equal
from safetensors.torch import save_file
from torch import nn

from transcover import TranscoverWarning
from transcover.model import (
    Activation, Placement, ReferenceConfig, ReferenceTransformer, attention_forward, ffn_forward,
    layer_forward, load, reference_spec, save_reference, transformer_forward,
)
from transcover.model._adapters._torch_encoder import torch_encoder_config

D, H, DFF, L, T = 32, 4, 48, 2, 6

ENCODERS = {
    "post_relu": (False, "relu", Activation.RELU),
    "pre_gelu": (True, "gelu", Activation.GELU),
    "pre_relu_function": (True, nn.functional.relu, Activation.RELU),
    "post_gelu_tanh_module": (False, nn.GELU(approximate="tanh"), Activation.GELU_TANH),
}


def _encoder(norm_first: bool, activation) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(
        d_model=D, nhead=H, dim_feedforward=DFF, dropout=0.0, activation=activation,
        batch_first=True, norm_first=norm_first, layer_norm_eps=1e-6,
    )
    enc = nn.TransformerEncoder(layer, num_layers=L, norm=nn.LayerNorm(D, eps=1e-4), enable_nested_tensor=False)
    return randomize(enc, seed=11).double().eval()


@pytest.mark.parametrize("case", list(ENCODERS))
def test_torch_encoder_matches_module(case, tmp_path, assert_close):
    norm_first, activation, expected_act = ENCODERS[case]
    enc = _encoder(norm_first, activation)
    # the same decomposition from the module and from a safetensors file with transcover metadata
    state, config = torch_encoder_config(enc)
    path = tmp_path / "enc.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"transcover_arch": "torch_encoder", "transcover_config": json.dumps(config)})
    X = torch.randn(3, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # Gradients stay on so torch takes its reference ("slow") path: the eval fast path
    # (torch._transformer_encoder_layer_fwd) computes nn.GELU(approximate="tanh") as exact GELU.
    fast = case == "post_gelu_tanh_module"  # the fast path's exact GELU is said when loaded (red team 216)
    with pytest.warns(TranscoverWarning, match="fast path") if fast else contextlib.nullcontext():
        from_module = load(enc)
    for spec in (from_module, load(path)):
        assert spec.arch == "torch_encoder" and spec.n_layers == L
        for i, layer in enumerate(spec.layers):
            m = enc.layers[i]
            assert layer.placement is (Placement.PRE if norm_first else Placement.POST)
            assert layer.ffn.activation is expected_act
            assert_close(attention_forward(layer.attention, X),
                         m.self_attn(X, X, X, need_weights=False)[0].detach(), D, what=f"attention {i}")
            assert_close(ffn_forward(layer.ffn, X), m.linear2(m.activation(m.linear1(X))).detach(), DFF,
                         what="ffn")
            assert_close(layer_forward(layer, X), m(X).detach(), DFF, what=f"layer {i}")
        assert_close(transformer_forward(spec, X), enc(X).detach(), L * DFF, what="encoder")
        assert spec.layers[1].names["W_K"] == f"layers.1.self_attn.in_proj_weight[{D}:{2 * D}, :]"


def test_single_encoder_layer(assert_close):
    enc = _encoder(True, "gelu")
    layer = enc.layers[0]
    spec = load(layer)
    assert spec.n_layers == 1 and spec.final_norm is None
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(transformer_forward(spec, X), layer(X), DFF, what="single layer")


@pytest.mark.parametrize("norm, causal", [("ball", False), ("layernorm", True), ("none", False)])
def test_reference_model_from_file_and_module(norm, causal, tmp_path, assert_close):
    torch.manual_seed(0)
    cfg = ReferenceConfig(d_model=16, n_heads=2, n_layers=2, d_ff=24, norm=norm, causal=causal,
                          head_hidden=(8,), n_outputs=3, activation="gelu")
    model = randomize(ReferenceTransformer(cfg), seed=13).double().eval()
    path = save_reference(model, tmp_path / "ref.safetensors")
    X = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = reference_spec(model)
    for spec in (load(path), load(model)):
        assert spec.arch == "reference" and spec.n_layers == 2
        for got, ref in zip(spec.layers, expected.layers):
            assert tensors_equal(got.attention.W_Q, ref.attention.W_Q) and as_tensor(got.attention.W_Q).dtype == torch.float64
            assert tensors_equal(got.ffn.W_2, ref.ffn.W_2)
        with torch.no_grad():
            assert_close(transformer_forward(spec, X), model(X), 24 * 2, what="reference with head")
            assert_close(transformer_forward(spec, X, with_head=False), model.features(X), 24 * 2,
                         what="reference features")


def _safetensors_in_order(tensors: dict[str, torch.Tensor], order: list[str], metadata: dict[str, str]) -> bytes:
    """A safetensors file whose header lists ``order`` in that order (safetensors' own writer sorts them)."""
    import struct

    header, data, offset = {"__metadata__": metadata}, b"", 0
    for k in order:
        raw = tensors[k].contiguous().numpy().tobytes()
        header[k] = {"dtype": {torch.float32: "F32", torch.float64: "F64"}[tensors[k].dtype],
                     "shape": list(tensors[k].shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("f32_first", [True, False])
def test_reference_file_is_read_exactly_whatever_the_header_order(f32_first, tmp_path, monkeypatch):
    """Red team 201: the adapter took the first floating tensor's dtype for all; a float64 model with one float32
    tensor listed first was cast to float32 (2.7e-8 off, the certified B_W2 excluding the true value)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    import transcover.model._adapters._reference as adapter

    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=12)).double()
    save_reference(model, tmp_path / "ref.safetensors")
    with safe_open(str(tmp_path / "ref.safetensors"), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(tmp_path / "ref.safetensors"))
    small = sorted(tensors)[0]
    tensors[small] = tensors[small].float()
    order = sorted(tensors, key=lambda k: (k != small) if f32_first else (k == small))
    path = tmp_path / "mixed.safetensors"
    path.write_bytes(_safetensors_in_order(tensors, order, meta))
    read = {}

    def spy(cfg, get, name, *args):
        read.update({k: get(k) for k in tensors})
        return build(cfg, get, name, *args)

    build = adapter.build_reference_spec
    monkeypatch.setattr(adapter, "build_reference_spec", spy)
    load(path)
    assert set(read) == set(tensors)
    for k, t in load_file(str(path)).items():  # every value as stored, upcast to float64, bit for bit
        assert read[k].dtype == np.float64 and read[k].tobytes() == t.double().numpy().tobytes(), k
