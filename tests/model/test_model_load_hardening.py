"""Issue 10, defect 12: what ``load`` must refuse or report instead of silently following or ignoring.

* a shard index naming a file outside the model folder (``..``, absolute, symlink out) is refused;
* a tensor inside a layer that no adapter role reads is a warning naming it (``strict``: refused),
  while each architecture's known harmless extras stay silent;
* a deeply nested JSON (config, index, metadata, safetensors header) is one clear InputError;
* a pickle that ``weights_only`` refuses gives one clean line naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import numpy as np
import pytest
import torch
from conftest import randomize
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

import transcover
from transcover import InputError, TranscoverWarning
from transcover.cli import main
from transcover.model import load, spec_from_module

D, H, DFF, L = 16, 2, 24, 2
EXTRA = "encoder.layer.1.attention.self.extra_gate.weight"


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.BertConfig(hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
                                      intermediate_size=DFF, vocab_size=32, max_position_embeddings=8)
    torch.manual_seed(0)
    model = randomize(transformers_mod.BertModel(cfg), seed=3).eval()
    path = tmp_path_factory.mktemp("bert")
    model.save_pretrained(path)
    return model, path


def _with_tensors(src, dst, extra: dict[str, torch.Tensor]):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.update(extra)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _no_warnings(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TranscoverWarning)
        return fn(*args, **kwargs)


# -- shard paths ---------------------------------------------------------------------------------

def _split(bert_dir, tmp_path, outside_name: str, place_outside):
    """Half of the tensors in the folder, half in a file the index names as ``outside_name``."""
    _, path = bert_dir
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(path / "config.json", folder / "config.json")
    tensors = load_file(str(path / "model.safetensors"))
    keys = sorted(tensors)
    inside = keys[: len(keys) // 2]
    save_file({k: tensors[k] for k in inside}, str(folder / "a.safetensors"))
    place_outside({k: tensors[k] for k in keys if k not in inside}, folder)
    index = {"weight_map": {**{k: "a.safetensors" for k in inside},
                            **{k: outside_name for k in keys if k not in inside}}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_shard_with_dotdot_is_refused(bert_dir, tmp_path, capsys):
    folder = _split(bert_dir, tmp_path, "../x.safetensors",
                    lambda t, f: save_file(t, str(f.parent / "x.safetensors")))
    with pytest.raises(InputError, match=r"'\.\./x\.safetensors'.*outside the model folder"):
        load(folder)
    rc = main(["analyze", str(folder), "--fast", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "outside the model folder" in err


def test_absolute_shard_path_is_refused(bert_dir, tmp_path):
    target = tmp_path / "elsewhere.safetensors"
    folder = _split(bert_dir, tmp_path, str(target), lambda t, f: save_file(t, str(target)))
    with pytest.raises(InputError, match="outside the model folder"):
        load(folder / "model.safetensors.index.json")


def test_symlink_leaving_the_folder_is_refused(bert_dir, tmp_path):
    target = tmp_path / "secret" / "x.safetensors"
    target.parent.mkdir()

    def place(t, f):
        save_file(t, str(target))
        os.symlink(target, f / "b.safetensors")

    folder = _split(bert_dir, tmp_path, "b.safetensors", place)
    with pytest.raises(InputError, match=r"resolves to .*secret.*outside the model folder"):
        load(folder)


def test_a_shard_that_is_a_symlink_loop_is_one_line_naming_it(bert_dir, tmp_path, capsys):
    """Red team 219: ``resolve()`` raises RuntimeError on a symlink loop (Python < 3.13), which ended in "internal
    error: RuntimeError", exit 1; now one InputError line naming the shard, exit 2."""
    folder = _split(bert_dir, tmp_path, "b.safetensors", lambda t, f: os.symlink("b.safetensors", f / "b.safetensors"))
    with pytest.raises(InputError, match=r"cannot follow shard 'b\.safetensors' .*b\.safetensors: it is a symlink "
                                         "loop"):
        load(folder)
    rc = main(["analyze", str(folder), "--fast", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "symlink loop" in err and "internal error" not in err


def test_symlinks_inside_and_the_hf_cache_layout_are_followed(bert_dir, tmp_path):
    _, path = bert_dir
    reference = load(path)
    # huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--x--y"
    snap = repo / "snapshots" / "rev0"

    def place(t, f):
        (repo / "blobs").mkdir(parents=True)
        save_file(t, str(repo / "blobs" / "abc123"))
        os.symlink(os.path.relpath(repo / "blobs" / "abc123", snap), f / "b.safetensors")  # valid once moved

    snap.parent.mkdir(parents=True)
    folder = _split(bert_dir, tmp_path, "b.safetensors", place)
    folder.rename(snap)
    spec = _no_warnings(load, snap)
    assert np.array_equal(spec.layers[1].ffn.W_2, reference.layers[1].ffn.W_2)


def test_pickle_index_outside_is_refused(bert_dir, tmp_path):
    model, _ = bert_dir
    folder = tmp_path / "m"
    folder.mkdir()
    torch.save(model.state_dict(), tmp_path / "x.bin")
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {k: "../x.bin" for k in model.state_dict()}}))
    with pytest.raises(InputError, match="outside the model folder"):
        load(folder, allow_pickle=True)


# -- unexpected tensors --------------------------------------------------------------------------

def test_extra_tensor_in_a_layer_warns_and_strict_refuses(bert_dir, tmp_path, capsys):
    _, path = bert_dir
    folder = _with_tensors(path, tmp_path / "extra", {EXTRA: torch.ones(D, D)})
    with pytest.warns(TranscoverWarning, match=EXTRA.replace(".", r"\.")) as rec:
        spec = load(folder)
    assert len(rec) == 1 and len(spec.warnings) == 1 and EXTRA in spec.warnings[0]
    with pytest.raises(InputError, match="strict"):
        load(folder, strict=True)
    with pytest.raises(InputError, match=EXTRA.replace(".", r"\.")):
        transcover.analyze(folder, strict=True, fast=True)
    with pytest.warns(TranscoverWarning):
        assert any(EXTRA in w for w in transcover.analyze(folder, fast=True).to_dict()["warnings"])
    # CLI: one warning line on stderr and the warning in the JSON; --strict: exit 2, one line
    js = tmp_path / "a.json"
    assert main(["analyze", str(folder), "--fast", "--quiet", "--json", str(js)]) == 0
    err = capsys.readouterr().err
    warn_lines = [ln for ln in err.splitlines() if ln.startswith("transcover: warning:")]
    assert len(warn_lines) == 1 and EXTRA in warn_lines[0]
    assert any(EXTRA in w for w in json.loads(js.read_text())["warnings"])
    js.unlink()
    assert main(["analyze", str(folder), "--fast", "--quiet", "--strict", "--json", str(js)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("transcover: error:") and EXTRA in err and not js.exists()


def test_layer_beyond_the_configured_count_warns(bert_dir, tmp_path):
    _, path = bert_dir
    extra = f"encoder.layer.{L}.output.dense.weight"
    folder = _with_tensors(path, tmp_path / "more", {extra: torch.ones(D, DFF)})
    with pytest.warns(TranscoverWarning, match=rf"layer {L} is beyond the {L} layers"):
        load(folder)


def test_live_module_with_an_extra_parameter_warns(transformers_mod):
    cfg = transformers_mod.BertConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                      intermediate_size=DFF, vocab_size=32, max_position_embeddings=8)
    model = transformers_mod.BertModel(cfg).eval()  # dropout in training mode is warned about (red team 210)
    _no_warnings(spec_from_module, model)
    model.encoder.layer[0].attention.self.extra_gate = torch.nn.Linear(D, D)
    with pytest.warns(TranscoverWarning, match="extra_gate"):
        spec_from_module(model)
    with pytest.raises(InputError, match="extra_gate"):
        transcover.load(model, strict=True)


def test_known_harmless_extras_stay_silent(bert_dir, tmp_path, transformers_mod):
    _, path = bert_dir
    # BERT: pooler and position_ids (MiniLM has both) plus an MLM head outside the base model
    folder = _with_tensors(path, tmp_path / "bert_extras", {
        "embeddings.position_ids": torch.arange(8)[None], "cls.predictions.bias": torch.zeros(32)})
    _no_warnings(load, folder, strict=True)
    _no_warnings(load, None, strict=True)  # the bundled MiniLM
    # GPT-2: the causal-mask buffers of older checkpoints; Llama: RoPE's inv_freq buffer
    g = transformers_mod.GPT2Model(transformers_mod.GPT2Config(n_embd=D, n_layer=1, n_head=H, vocab_size=32,
                                                               n_positions=8))
    gpath = tmp_path / "gpt2"
    g.save_pretrained(gpath)
    tensors = load_file(str(gpath / "model.safetensors"))
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))
    tensors["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, str(gpath / "model.safetensors"), metadata={"format": "pt"})
    _no_warnings(load, gpath, strict=True)
    lcfg = transformers_mod.LlamaConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                        num_key_value_heads=H, intermediate_size=DFF, vocab_size=32)
    lpath = tmp_path / "llama"
    transformers_mod.LlamaModel(lcfg).save_pretrained(lpath)
    tensors = load_file(str(lpath / "model.safetensors"))
    tensors["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(D // H // 2)
    save_file(tensors, str(lpath / "model.safetensors"), metadata={"format": "pt"})
    _no_warnings(load, lpath, strict=True)
    tensors["layers.0.mlp.extra_proj.weight"] = torch.ones(D, D)
    save_file(tensors, str(lpath / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match="extra_proj"):
        load(lpath, strict=True)


# -- deep JSON -----------------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def test_deep_config_is_one_clear_line(bert_dir, tmp_path, capsys):
    _, path = bert_dir
    folder = tmp_path / "deep"
    shutil.copytree(path, folder)
    (folder / "config.json").write_text('{"model_type": "bert", "x": ' + DEEP + "}")
    with pytest.raises(InputError, match="nested deeper"):
        load(folder)
    rc = main(["analyze", str(folder), "--fast", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("transcover: error:") and "config.json" in err
    # deep but within the parser's recursion limit: refused before any later recursive walk
    (folder / "config.json").write_text('{"model_type": "bert", "x": ' + "[" * 500 + "]" * 500 + "}")
    with pytest.raises(InputError, match="nested deeper than 64"):
        load(folder)


def test_deep_index_metadata_and_header(bert_dir, tmp_path):
    _, path = bert_dir
    folder = tmp_path / "idx"
    shutil.copytree(path, folder)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    with pytest.raises(InputError, match="nested deeper"):
        load(folder / "model.safetensors.index.json")
    bare = tmp_path / "bare.safetensors"
    save_numpy({"w": np.zeros(2, np.float32)}, str(bare),
               metadata={"transcover_arch": "reference", "transcover_config": DEEP})
    with pytest.raises(InputError, match="nested deeper"):
        load(bare)
    header = ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": ' + DEEP + "}").encode()
    raw = tmp_path / "raw.safetensors"
    raw.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(InputError, match="nested too deeply"):
        load(raw, arch="bert")


# -- refused pickles -----------------------------------------------------------------------------

def test_refused_pickle_is_one_clean_line(tmp_path, capsys):
    import fractions

    bad = tmp_path / "bad.pt"
    torch.save({"w": torch.zeros(2), "f": fractions.Fraction(1, 3)}, bad)
    with pytest.raises(InputError) as info:
        load(bad, arch="bert", allow_pickle=True)
    msg = str(info.value)
    assert "\n" not in msg and "\x1b" not in msg and str(bad) in msg and "safetensors" in msg
    assert "fractions.Fraction" in msg and "weights_only` set to `False`" not in msg
    rc = main(["analyze", str(bad), "--arch", "bert", "--allow-pickle"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and not any(ord(c) < 32 for c in err[:-1])


# -- tensors without values in a pickle (red team 201) -------------------------------------------

@pytest.mark.parametrize("how, said", [
    ("sparse", r"is sparse \(sparse_coo\)"),
    ("meta", "is on the meta device"),
    ("complex", "has dtype complex64"),
])
def test_pickled_sparse_meta_or_complex_weights_are_refused_in_one_line(how, said, tmp_path, capsys):
    """A sparse or meta tensor in a pickle ended in "internal error" (reshape / .item() not implemented), exit 1."""
    from transcover.scale._synthetic import write_gpt2_checkpoint

    d = write_gpt2_checkpoint(tmp_path / "gpt2", d=16, layers=2, heads=2, vocab=32, positions=16)
    tensors = load_file(str(d / "model.safetensors"))
    key = "h.1.mlp.c_fc.weight"
    t = tensors[key]
    tensors[key] = {"sparse": lambda: t.to_sparse(), "meta": lambda: t.to("meta"),
                    "complex": lambda: t.to(torch.complex64)}[how]()
    (d / "model.safetensors").unlink()
    torch.save(tensors, d / "pytorch_model.bin")
    code = main(["analyze", str(d), "--allow-pickle", "--fast"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and re.search(rf"tensor '{re.escape(key)}' in .*pytorch_model\.bin {said}", err)


# -- a tensor too large for this machine (red team 201) -------------------------------------------

def test_a_tensor_larger_than_half_the_memory_is_refused_before_it_is_read(tmp_path, capsys, monkeypatch):
    """A 119 GiB wte.weight ended in "internal error: MemoryError", exit 1. Its size is known from the header:
    refused in one line naming it and its size, with --no-embeddings as the way round for an embedding."""
    import transcover.model._sources as sources
    from transcover.scale._synthetic import write_gpt2_checkpoint

    d = write_gpt2_checkpoint(tmp_path / "gpt2", d=16, layers=1, heads=2, vocab=1024, positions=16)
    monkeypatch.setattr(sources, "physical_memory", lambda: 64_000)  # wte: 1024 x 16 float32 = 65.5 kB
    code = main(["analyze", str(d), "--fast"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.search(r"tensor 'wte\.weight' in .*model\.safetensors \(shape \[1024, 16\], float32\) needs 6\.55e-05 GB",
                     err), err
    assert "over half of this machine's memory" in err and "--no-embeddings" in err
    assert main(["analyze", str(d), "--fast", "--no-embeddings"]) == 0, capsys.readouterr().err
    monkeypatch.setattr(sources, "physical_memory", lambda: 4_000)  # c_fc.weight 16 x 64 float32: 4.1 kB
    with pytest.raises(transcover.WeightError, match=r"tensor 'h\.0\.attn\.c_attn\.weight' .* needs .* over half"):
        load(d).layers[0]


def test_a_boolean_size_in_a_safetensors_header_is_refused(tmp_path):
    """Red team 201: shape [true, 32] was accepted and printed as [True, 32]."""
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}}).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(InputError, match=r"tensor 'w' has invalid shape \[True, 4\]"):
        load(path, arch="gpt2")


def test_a_truncated_pickle_says_so(tmp_path):
    """Red team 201: a truncated zip pickle was reported as "[Errno 22] Invalid argument" alone."""
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.ones(2000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"cannot read pickled checkpoint .*: the file is truncated or corrupted"):
        load(path, arch="gpt2", allow_pickle=True)
