"""Models read from files never import torch; the safetensors reader decodes exactly as torch does.

The CLI checks run ``transcover analyze`` in a fresh interpreter (a test process has torch loaded
already) and report ``"torch" in sys.modules`` at exit.  The reader checks compare
``transcover.model._safetensors`` with ``safetensors.torch.load_file`` on every bfloat16 and float16
bit pattern, and damage files in each way the header checks must catch.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import as_tensor, randomize, tensors_equal
from safetensors.torch import load_file, save_file

from transcover import InputError
from transcover.model import (
    ReferenceConfig, ReferenceTransformer, load, save_reference, spec_from_module, transformer_forward,
)
from transcover.model._safetensors import SafetensorsFile

_WRAPPER = """
import sys
from transcover.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}))
""".replace("import sys", "import json, sys", 1)


def _analyze_in_fresh_process(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, "analyze", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = randomize(transformers_mod.GPT2Model(cfg), seed=5).eval()
    path = tmp_path_factory.mktemp("gpt2_no_torch")
    model.save_pretrained(path)
    return model, path


def test_analyze_bundled_model_without_torch(tmp_path):
    out = tmp_path / "a.json"
    result = _analyze_in_fresh_process(["--quiet", "--json", str(out)])
    assert result == {"rc": 0, "torch": False}
    data = json.loads(out.read_text())
    assert data["n_layers"] == 6 and data["d_model"] == 384


def test_analyze_files_without_torch(gpt2_dir, tmp_path):
    model, path = gpt2_dir
    out = tmp_path / "g.json"
    assert _analyze_in_fresh_process([str(path), "--quiet", "--json", str(out)]) == {"rc": 0, "torch": False}
    assert json.loads(out.read_text())["n_layers"] == 2
    # bfloat16 shards and a bare file with its config beside it take the same torch-free path
    half = tmp_path / "bf16"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(half, max_shard_size="20KB")
    assert len(list(half.glob("model-*.safetensors"))) > 1
    assert _analyze_in_fresh_process([str(half), "--quiet", "--json", str(out)]) == {"rc": 0, "torch": False}
    cfg = ReferenceConfig(d_model=16, n_heads=2, n_layers=2, d_ff=24, norm="layernorm", head_hidden=(8,))
    ref = save_reference(ReferenceTransformer(cfg), tmp_path / "ref.safetensors")
    assert _analyze_in_fresh_process([str(ref), "--quiet", "--json", str(out)]) == {"rc": 0, "torch": False}


def test_file_spec_is_numpy_and_matches_module_spec(gpt2_dir, assert_close):
    model, path = gpt2_dir
    from_file, from_module = load(path), spec_from_module(model)
    for a, b in zip(from_file.layers, from_module.layers, strict=True):
        assert isinstance(a.attention.W_Q, np.ndarray) and isinstance(b.attention.W_Q, torch.Tensor)
        for h in range(a.attention.n_heads):
            aug = a.attention.W_Q_augmented(h)
            assert isinstance(aug, np.ndarray) and tensors_equal(aug, b.attention.W_Q_augmented(h))
        bias = a.attention.effective_output_bias()
        assert isinstance(bias, np.ndarray) and bias.dtype == np.float64
        # float64 sums of H * d_head products: numpy's and torch's summation orders differ
        assert_close(bias, b.attention.effective_output_bias(), 32, what="effective output bias")
        assert a.norm_attn.gamma_max_abs == b.norm_attn.gamma_max_abs
        # a float64 norm of d float32 entries: summation order is the only difference
        assert a.norm_attn.beta_norm == pytest.approx(b.norm_attn.beta_norm, rel=32 * 2**-52, abs=0)
    # to_torch converts every array, layer by layer, without changing a value
    converted = from_file.to_torch()
    layer = converted.layers[1]
    assert isinstance(layer.ffn.W_1, torch.Tensor) and tensors_equal(layer.ffn.W_1, from_module.layers[1].ffn.W_1)
    assert tensors_equal(converted.embeddings["token_embedding"], from_module.embeddings["token_embedding"])
    X = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_close(transformer_forward(from_file, X), transformer_forward(from_module, X), 2 * 128,
                 what="file spec vs module spec")


def _all_bit_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decoding_is_torchs_on_every_bit_pattern(dtype, tmp_path):
    path = tmp_path / "half.safetensors"
    save_file({"w": _all_bit_patterns(dtype), "v": torch.randn(3, 0).to(dtype)}, str(path))
    expected = load_file(str(path))["w"].float()
    got = SafetensorsFile(path).get("w")
    assert got.dtype == np.float32 and got.shape == (256, 256)
    got_t = torch.from_numpy(got)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got_t), nan) and int(nan.sum()) > 0
    # bitwise on every non-NaN pattern: signed zeros, subnormals, infinities included
    assert torch.equal(got_t[~nan].view(torch.int32), expected[~nan].view(torch.int32))
    assert SafetensorsFile(path).get("v").shape == (3, 0)


def test_float_storage_is_kept_and_memory_mapped(tmp_path):
    tensors = {"a": torch.randn(4, 5, dtype=torch.float64), "b": torch.randn(7), "s": torch.tensor(2.5)}
    path = tmp_path / "f.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    f = SafetensorsFile(path)
    assert f.metadata == {"k": "v"} and sorted(f.keys()) == ["a", "b", "s"]
    for k, t in tensors.items():
        got = f.get(k)
        assert got.dtype == {torch.float64: np.float64, torch.float32: np.float32}[t.dtype]
        assert tensors_equal(got, t) and f.shape(k) == tuple(t.shape)
    # a view of the mapping (no copy), writable without touching the file (copy-on-write)
    a = f.get("a")
    assert not a.flags.owndata and a.flags.writeable
    a[0, 0] = 123.0
    assert tensors_equal(SafetensorsFile(path).get("a"), tensors["a"])


def _header_file(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("damage", [
    "empty", "short", "header_too_long", "truncated_data", "bad_json", "not_object", "offsets_vs_shape",
    "gap", "unknown_dtype", "trailing_bytes", "list_dtype", "duplicate_name", "metadata_list",
])
def test_damaged_files_raise_input_error_naming_the_file(damage, tmp_path):
    path = tmp_path / f"{damage}.safetensors"
    good = {"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "y": {"dtype": "F32", "shape": [1], "data_offsets": [16, 20]}}
    data = np.arange(5, dtype="<f4").tobytes()
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "short":
        path.write_bytes(b"\x01\x02\x03")
    elif damage == "header_too_long":
        path.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    elif damage == "truncated_data":
        _header_file(path, good, data[:-3])
    elif damage == "trailing_bytes":
        _header_file(path, good, data + b"\0\0\0\0")
    elif damage == "bad_json":
        path.write_bytes((5).to_bytes(8, "little") + b"{oops")
    elif damage == "not_object":
        _header_file(path, [1, 2], b"")  # type: ignore[arg-type]
    elif damage == "offsets_vs_shape":
        _header_file(path, {**good, "x": {**good["x"], "shape": [3, 2]}}, data)
    elif damage == "gap":
        _header_file(path, {**good, "y": {**good["y"], "data_offsets": [17, 21]}}, data + b"\0")
    elif damage == "unknown_dtype":
        _header_file(path, {**good, "y": {**good["y"], "dtype": "Q7"}}, data)
    elif damage == "list_dtype":  # red team 175: "unhashable type", an internal error
        _header_file(path, {**good, "y": {**good["y"], "dtype": ["F32"]}}, data)
    elif damage == "duplicate_name":  # red team 175: refused for an offset gap instead of the name given twice
        raw = json.dumps(good).encode().replace(b'"y"', b'"x"')
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    elif damage == "metadata_list":  # a [] was taken as an empty map
        _header_file(path, {**good, "__metadata__": []}, data)
    why = {"list_dtype": "unknown dtype", "duplicate_name": "names 'x' twice", "metadata_list": "not a map"}
    message = rf"cannot read safetensors file .*{damage}\.safetensors.*{why.get(damage, '')}"
    with pytest.raises(InputError, match=message):
        SafetensorsFile(path)
    with pytest.raises(InputError, match=rf"cannot read safetensors file .*{damage}\.safetensors"):
        load(path, arch="gpt2")
    # the same layout, undamaged, reads back
    _header_file(path, good, data)
    assert tensors_equal(SafetensorsFile(path).get("x"), torch.arange(4, dtype=torch.float32).reshape(2, 2))


def test_module_specs_keep_torch_tensors(gpt2_dir):
    model, _ = gpt2_dir
    spec = load(model)
    assert isinstance(spec.layers[0].attention.W_Q, torch.Tensor)
    assert isinstance(spec.layers[0].attention.effective_output_bias(), torch.Tensor)
    assert as_tensor(spec.layers[0].ffn.W_1).dtype == torch.float32


def test_a_file_rewritten_in_place_with_its_mtime_put_back_is_refused(tmp_path):
    """Red team 175: the identity checked between tensors was (device, inode, mtime); a shard rewritten in place at the
    same size with ``os.utime`` restoring its mtime was read half old, half new. The ctime cannot be put back."""
    import os
    import time

    path = tmp_path / "w.safetensors"
    good = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    _header_file(path, good, np.arange(4, dtype="<f4").tobytes())
    f = SafetensorsFile(path)
    st = os.stat(path)
    f.get("x")
    time.sleep(0.01)
    with path.open("r+b") as fh:  # the same size, other values, in place
        fh.seek(-8, 2)
        fh.write(np.array([10.0, 20.0], dtype="<f4").tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(InputError, match="replaced or rewritten since it was opened"):
        f.get("y")


def test_a_write_landing_while_a_tensor_is_read_is_refused(tmp_path, monkeypatch):
    """Red team 219: the identity was checked before a tensor's read, not after, so a rewrite landing during the read
    of a tensor alone in its shard (as large tensors are) went unseen: half old, half new values, certified as one
    matrix.  The read is split in two here and the shard rewritten in place between the halves (deterministic: the
    writer sets a later mtime itself, whatever the clock's tick)."""
    import os

    path = tmp_path / "w.safetensors"
    old = np.arange(64, dtype="<f4")
    _header_file(path, {"x": {"dtype": "F32", "shape": [8, 8], "data_offsets": [0, 256]}}, old.tobytes())
    f = SafetensorsFile(path)
    read = SafetensorsFile._read_exact

    def split_read(fh, buf):
        half = len(buf) // 2
        read(fh, buf[:half])
        st = os.stat(path)
        with path.open("r+b") as g:  # the concurrent writer: every value doubled, in place
            g.seek(-256, 2)
            g.write((2 * old).tobytes())
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        read(fh, buf[half:])

    monkeypatch.setattr(SafetensorsFile, "_read_exact", staticmethod(split_read))
    with pytest.raises(InputError, match="cannot read tensor 'x' .*replaced or rewritten since it was opened"):
        f.get("x")


def test_one_shard_spelled_two_ways_in_an_index_is_one_shard(tmp_path):
    """Red team 175: "./s.safetensors" and "s.safetensors" in one index were two shards holding the same tensors,
    refused as "stored in two shards, s.safetensors and s.safetensors"."""
    from transcover.model._sources import open_safetensors

    _header_file(tmp_path / "s.safetensors", {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                              "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
                 np.arange(4, dtype="<f4").tobytes())
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "./s.safetensors", "y": "s.safetensors"}}))
    src = open_safetensors(index)
    assert sorted(src.keys()) == ["x", "y"]
