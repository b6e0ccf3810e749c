"""A bias or LayerNorm shift the model has but the checkpoint lacks is a broken checkpoint (red team 201).

transformers builds these projections and norms with a bias (by architecture or because the configuration says
so); a checkpoint without one was read as a zero bias, exit 0, B_b = 0 "exact" even under --strict.  Each such
tensor is now refused in one line naming it and its file (Note [missing biases] in ``_adapters/_common``), while a
bias the configuration says the model does not have stays absent (tests/model/test_model_hf_semantics.py, 6).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import randomize
from safetensors.torch import load_file, save_file
from torch import nn

from transcover import WeightError
from transcover.cli import main
from transcover.model import load
from transcover.model._adapters._torch_encoder import torch_encoder_config
from transcover.scale._synthetic import write_gpt2_checkpoint

V, D = 32, 32


def _families(tm):
    """family -> a model whose every projection and norm has its bias (by architecture or configuration)."""
    dec = dict(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)
    return {
        "bert": lambda: tm.BertModel(tm.BertConfig(**dec), add_pooling_layer=False),
        "distilbert": lambda: tm.DistilBertModel(tm.DistilBertConfig(vocab_size=V, dim=D, hidden_dim=48, n_layers=2,
                                                                     n_heads=4, max_position_embeddings=64)),
        "vit": lambda: tm.ViTModel(tm.ViTConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                                                intermediate_size=48, image_size=8, patch_size=4),
                                   add_pooling_layer=False),
        "gpt_neox": lambda: tm.GPTNeoXModel(tm.GPTNeoXConfig(**dec)),
        "falcon": lambda: tm.FalconModel(tm.FalconConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2,
                                                         num_attention_heads=4, bias=True)),
        "phi": lambda: tm.PhiModel(tm.PhiConfig(**dec)),
        "gptj": lambda: tm.GPTJModel(tm.GPTJConfig(vocab_size=V, n_embd=D, n_layer=2, n_head=4, rotary_dim=4,
                                                   n_positions=64)),
        "llama": lambda: tm.LlamaModel(tm.LlamaConfig(**dec, attention_bias=True, mlp_bias=True)),
        "qwen2": lambda: tm.Qwen2Model(tm.Qwen2Config(**dec, num_key_value_heads=2)),
        "whisper": lambda: tm.WhisperModel(tm.WhisperConfig(vocab_size=V, d_model=D, encoder_layers=2,
                                                            encoder_attention_heads=4, decoder_layers=1,
                                                            decoder_attention_heads=4, encoder_ffn_dim=48,
                                                            decoder_ffn_dim=48, num_mel_bins=8,
                                                            max_source_positions=16, max_target_positions=16,
                                                            pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                            decoder_start_token_id=1)),
    }


# tensors outside the analysed function: deleting them changes nothing the adapters read
_OUTSIDE = re.compile(r"(^|\.)(decoder|pooler|lm_head|conv\d|embed_positions|patch_embeddings)\.")


def _read_all(path):
    spec = load(path)
    for layer in spec.layers:
        assert layer.ffn is not None
    return spec


def _biases(path) -> list[str]:
    return [k for k in load_file(str(path / "model.safetensors")) if k.endswith("bias") and not _OUTSIDE.search(k)]


def _without(src, dst, key):
    tensors = load_file(str(src / "model.safetensors"))
    del tensors[key]
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", ["bert", "distilbert", "vit", "gpt_neox", "falcon", "phi", "gptj", "llama",
                                    "qwen2", "whisper"])
def test_each_missing_bias_or_layernorm_shift_is_refused_by_name(family, tmp_path, transformers_mod):
    torch.manual_seed(0)
    full = tmp_path / "full"
    randomize(_families(transformers_mod)[family](), seed=4).save_pretrained(full)
    _read_all(full)  # complete: loads
    keys = _biases(full)
    assert len(keys) >= 4, keys
    for j, key in enumerate(keys):
        broken = _without(full, tmp_path / f"b{j}", key)
        with pytest.raises(WeightError, match=rf"tensor {re.escape(repr(key))} is missing from .*model\.safetensors"):
            _read_all(broken)


def test_gpt2_missing_bias_is_refused_by_the_cli_in_one_line(tmp_path, capsys):
    """The red team's case: h.1.mlp.c_fc.bias deleted gave B_b1 = 0 "exact", exit 0, under --strict."""
    full = write_gpt2_checkpoint(tmp_path / "full", d=16, layers=2, heads=2, vocab=32, positions=16)
    for j, key in enumerate(_biases(full)):  # every c_attn/c_proj/c_fc bias and ln_1/ln_2/ln_f shift
        broken = _without(full, tmp_path / f"b{j}", key)
        out = tmp_path / f"b{j}.json"
        code = main(["analyze", str(broken), "--strict", "--json", str(out)])
        err = capsys.readouterr().err.strip()
        assert code == 2, (key, err)
        assert len(err.splitlines()) == 1 and f"tensor {key!r} is missing from {broken / 'model.safetensors'}" in err
        assert not out.exists()


def test_a_shard_index_that_leaves_out_the_biases_shard_is_refused(tmp_path):
    full = write_gpt2_checkpoint(tmp_path / "full", d=16, layers=2, heads=2, vocab=32, positions=16)
    tensors = load_file(str(full / "model.safetensors"))
    biases = {k: v for k, v in tensors.items() if k.endswith("bias")}
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text((full / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k not in biases}, str(d / "w.safetensors"))
    save_file(biases, str(d / "b.safetensors"))  # on disk, but the index leaves it out
    index = {"weight_map": {k: "w.safetensors" for k in tensors if k not in biases}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match=r"tensor '[^']*bias' is missing from .*index\.json"):
        _read_all(d)


def _torch_file(enc, path):
    state, config = torch_encoder_config(enc)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"transcover_arch": "torch_encoder", "transcover_config": json.dumps(config)})
    return state, config


@pytest.mark.parametrize("bias", [True, False])
def test_torch_encoder_biases_follow_the_recorded_parameters(bias, tmp_path):
    """nn.TransformerEncoderLayer(bias=False) (torch >= 2.1) has no biases: absent is right, and loads; with biases,
    each one missing from the file is refused, even all of them at once (a bias-free layer in its tensors)."""
    layer = nn.TransformerEncoderLayer(D, 4, 48, dropout=0.0, batch_first=True, bias=bias)
    enc = randomize(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D, bias=bias), enable_nested_tensor=False), 5)
    state, _ = _torch_file(enc, tmp_path / "full.safetensors")
    spec = _read_all(tmp_path / "full.safetensors")
    assert (spec.layers[1].ffn.b_1 is not None) == bias and (spec.final_norm.bias is not None) == bias
    if not bias:
        return
    for key in [k for k in state if k.endswith("bias")]:
        path = tmp_path / "broken.safetensors"
        _, config = torch_encoder_config(enc)
        save_file({k: v.contiguous() for k, v in state.items() if k != key}, str(path),
                  metadata={"transcover_arch": "torch_encoder", "transcover_config": json.dumps(config)})
        with pytest.raises(WeightError, match=rf"tensor {re.escape(repr(key))} is missing"):
            _read_all(path)
    path = tmp_path / "no_biases.safetensors"
    save_file({k: v.contiguous() for k, v in state.items() if not k.endswith("bias")}, str(path),
              metadata={"transcover_arch": "torch_encoder", "transcover_config": json.dumps(config)})
    with pytest.raises(WeightError, match="is missing"):
        _read_all(path)
