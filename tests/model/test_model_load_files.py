"""File formats (shards, fp16/bf16, pickles, bare files) and every bad input ``load`` must refuse."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from conftest import as_tensor, randomize, tensors_equal
from safetensors.torch import load_file, save_file

from transcover import InputError, UnsupportedArchitectureError, WeightError
from transcover.model import SUPPORTED_ARCHITECTURES, layer_forward, load, transformer_forward

D, H, DFF, L = 32, 4, 48, 2
Q0 = "encoder.layer.0.attention.self.query.weight"


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, transformers_mod):
    """A float64 BertModel saved as one file (keys without prefix)."""
    cfg = transformers_mod.BertConfig(
        hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=DFF, vocab_size=64,
        max_position_embeddings=16, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = randomize(transformers_mod.BertModel(cfg), seed=17).double().eval()
    path = tmp_path_factory.mktemp("bert_single")
    model.save_pretrained(path)
    return model, path


def _copy(src, dst, tensors=None, config=None):
    """A copy of a model directory, optionally with edited tensors or config."""
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _layers_equal(a, b):
    for la, lb in zip(a.layers, b.layers, strict=True):
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_O"):
            assert tensors_equal(getattr(la.attention, name), getattr(lb.attention, name)), name
        assert tensors_equal(la.ffn.W_1, lb.ffn.W_1) and tensors_equal(la.norm_ffn.weight, lb.norm_ffn.weight)


def test_sharded_checkpoint_round_trip(bert_dir, tmp_path):
    model, path = bert_dir
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    spec = load(sharded)
    _layers_equal(spec, load(path))
    assert spec.name == str(sharded)
    # the index file itself is accepted too
    _layers_equal(load(sharded / "model.safetensors.index.json"), spec)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_upcast_exactly(bert_dir, dtype, tmp_path, assert_close):
    half = tmp_path / "half"
    model = copy.deepcopy(bert_dir[0]).to(dtype)
    model.save_pretrained(half)
    model.double()  # the rounded weights, compared in float64
    spec = load(half)
    assert spec.config["storage_dtype"] == str(dtype).removeprefix("torch.")
    layer = spec.layers[1]
    assert as_tensor(layer.attention.W_Q).dtype == torch.float32
    stored = model.encoder.layer[1].attention.self.query.weight.detach()
    # the upcast is exact: the float32 spec holds the half-precision values themselves
    assert tensors_equal(as_tensor(layer.attention.W_Q).double(), stored.T.reshape(D, H, D // H).permute(1, 0, 2))
    X = torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.encoder(model.embeddings.LayerNorm(X)).last_hidden_state
    assert_close(transformer_forward(spec, X), hidden, L * DFF, what=f"{dtype} model")


def test_pickle_refused_then_loaded(bert_dir, tmp_path):
    model, path = bert_dir
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(path / "config.json", d / "config.json")
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    with pytest.raises(InputError, match=r"pickled checkpoint refused: .*pytorch_model\.bin.*allow_pickle=True"):
        load(d)
    with pytest.raises(InputError, match="pickled checkpoint refused"):
        load(d / "pytorch_model.bin")
    _layers_equal(load(d, allow_pickle=True), load(path))
    _layers_equal(load(d / "pytorch_model.bin", allow_pickle=True), load(path))


def test_bare_safetensors_needs_arch_and_config(bert_dir, tmp_path):
    _, path = bert_dir
    bare = tmp_path / "weights.safetensors"
    shutil.copy(path / "model.safetensors", bare)
    with pytest.raises(InputError, match="pass arch=.*" + ".*".join(SUPPORTED_ARCHITECTURES)):
        load(bare)
    with pytest.raises(InputError, match="number of attention heads.*config.json"):
        load(bare, arch="bert")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    _layers_equal(load(bare, arch="bert"), load(path))
    _layers_equal(load(bare), load(path))  # config.json beside it names the architecture
    with pytest.raises(InputError, match="arch='gpt2' contradicts"):
        load(bare, arch="gpt2")


def test_missing_path_and_unknown_file(tmp_path):
    with pytest.raises(InputError, match="model path not found: .*nowhere"):
        load(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InputError, match="unrecognised model file"):
        load(tmp_path / "notes.txt")
    with pytest.raises(InputError, match="no model weights in"):
        load(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "random_bytes", "empty"])
def test_corrupted_safetensors_refused_at_load(bert_dir, damage, tmp_path):
    _, path = bert_dir
    d = _copy(path, tmp_path / damage)
    data = (d / "model.safetensors").read_bytes()
    broken = {"truncated": data[: len(data) // 2], "random_bytes": torch.randint(
        0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy().tobytes(),
        "empty": b""}[damage]
    (d / "model.safetensors").write_bytes(broken)
    with pytest.raises(InputError, match=r"cannot read safetensors file .*model\.safetensors"):
        load(d)


def test_missing_tensor_names_tensor_and_file(bert_dir, tmp_path):
    _, path = bert_dir
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["encoder.layer.1.attention.self.key.weight"]
    d = _copy(path, tmp_path / "missing", tensors=tensors)
    spec = load(d)  # lazy: layer 0 is intact
    spec.layers[0]
    with pytest.raises(WeightError, match=r"'encoder\.layer\.1\.attention\.self\.key\.weight' is missing from .*model\.safetensors"):
        spec.layers[1]


def test_wrong_shapes_name_tensor_and_both_shapes(bert_dir, tmp_path):
    _, path = bert_dir
    tensors = load_file(str(path / "model.safetensors"))
    tensors[Q0] = tensors[Q0][:, :16].contiguous()
    spec = load(_copy(path, tmp_path / "narrow", tensors=tensors))
    with pytest.raises(WeightError, match=rf"'{Q0}' .* has shape \[32, 16\], but .* implies \[32, 32\]"):
        spec.layers[0]
    # config says hidden 64 while every tensor has 32
    config = json.loads((path / "config.json").read_text()) | {"hidden_size": 64}
    with pytest.raises(WeightError, match=r"has shape \[32\], but .* implies \[64\]"):
        load(_copy(path, tmp_path / "wide", config=config)).layers[0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_names_tensor_and_count(bert_dir, bad, tmp_path):
    _, path = bert_dir
    tensors = load_file(str(path / "model.safetensors"))
    value = "encoder.layer.1.attention.self.value.weight"
    tensors[value][3, :2] = bad
    spec = load(_copy(path, tmp_path / "nan", tensors=tensors))
    with pytest.raises(WeightError, match=rf"'{value}' .* holds 2 non-finite value"):
        spec.layers[1]


def test_integer_weight_refused(bert_dir, tmp_path):
    _, path = bert_dir
    tensors = load_file(str(path / "model.safetensors"))
    tensors[Q0] = tensors[Q0].round().to(torch.int32)
    with pytest.raises(WeightError, match=rf"'{Q0}' .* dtype int32, but a floating-point weight"):
        load(_copy(path, tmp_path / "int", tensors=tensors)).layers[0]


def test_unknown_architecture_lists_supported(bert_dir, tmp_path):
    _, path = bert_dir
    config = json.loads((path / "config.json").read_text()) | {"model_type": "bart"}
    with pytest.raises(UnsupportedArchitectureError, match="'bart'.*" + ", ".join(SUPPORTED_ARCHITECTURES)):
        load(_copy(path, tmp_path / "bart", config=config))
    with pytest.raises(UnsupportedArchitectureError, match="unsupported module Linear"):
        load(torch.nn.Linear(3, 3))
    with pytest.raises(UnsupportedArchitectureError, match="'mamba'"):
        load(path / "model.safetensors", arch="mamba")


def test_model_without_layers(transformers_mod, tmp_path):
    cfg = transformers_mod.BertConfig(hidden_size=D, num_hidden_layers=0, num_attention_heads=H,
                                      intermediate_size=DFF, vocab_size=64, max_position_embeddings=16)
    model = transformers_mod.BertModel(cfg)
    model.save_pretrained(tmp_path)
    with pytest.raises(InputError, match="model has no Transformer layers"):
        load(tmp_path)
    with pytest.raises(InputError, match="model has no Transformer layers"):
        load(model)
    with pytest.raises(InputError, match="model has no Transformer layers"):
        load(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, batch_first=True),
                                         num_layers=0, enable_nested_tensor=False))


def test_layers_are_read_lazily_and_validated_on_access(bert_dir, tmp_path, assert_close):
    """Only the accessed layer's tensors are read: a NaN in layer 1 does not stop layer 0."""
    model, path = bert_dir
    tensors = load_file(str(path / "model.safetensors"))
    tensors["encoder.layer.1.output.dense.bias"][0] = float("nan")
    spec = load(_copy(path, tmp_path / "lazy", tensors=tensors))
    X = torch.randn(1, 4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model.encoder.layer[0](X)
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert_close(layer_forward(spec.layers[0], X), expected, DFF, what="layer 0")
    with pytest.raises(WeightError, match="output.dense.bias"):
        list(spec.layers)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16,
      "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "'llama3' lacks 'low_freq_factor'"),
    ({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16,
      "rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type='longrope'"),
    ({"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16,
      "position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
    ({"model_type": "gpt2", "n_embd": 8, "n_head": 2, "add_cross_attention": True}, "cross-attention"),
    ({"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16,
      "hidden_act": "mish"}, "activation 'mish'"),
])
def test_variants_the_spec_cannot_represent_are_refused(config, message, tmp_path):
    """Refused by name rather than loaded with different semantics."""
    save_file({"unused": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=message):
        load(tmp_path)


def test_public_names_resolve():
    import transcover.model as model

    for name in model.__all__:
        assert getattr(model, name) is not None, name
    assert SUPPORTED_ARCHITECTURES[:6] == ("bert", "gpt2", "llama", "vit", "torch_encoder", "reference")
    assert {"distilbert", "clip_text", "clip_vision", "whisper", "deberta_v2", "gpt_neox"} <= set(SUPPORTED_ARCHITECTURES)


def _sharded(bert_dir, tmp_path):
    model, _ = bert_dir
    d = tmp_path / "sharded"
    model.save_pretrained(d, max_shard_size="20KB")
    return d, json.loads((d / "model.safetensors.index.json").read_text())


def test_a_tensor_in_two_shards_or_an_index_that_disagrees_is_refused(bert_dir, tmp_path):
    """The first shard listed in the index silently won, so a 10x copy of W_1 in another shard was read with exit 0
    (red team 37g); an index entry for a tensor its shard lacks was ignored."""
    d, index = _sharded(bert_dir, tmp_path)
    W1 = "encoder.layer.0.intermediate.dense.weight"
    home = index["weight_map"][W1]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != home)
    shard = load_file(str(d / other))
    shard[W1] = torch.zeros(DFF, D, dtype=torch.float64)
    save_file(shard, str(d / other), metadata={"format": "pt"})
    with pytest.raises(InputError, match=rf"tensor {W1} is stored in two shards"):
        load(d)
    d2, index2 = _sharded(bert_dir, tmp_path / "b")
    index2["weight_map"][W1] = other
    (d2 / "model.safetensors.index.json").write_text(json.dumps(index2))
    with pytest.raises(InputError, match=rf"puts tensor {W1} in {other}, but it is stored in {home}"):
        load(d2)
    index2["weight_map"][W1] = home
    index2["weight_map"]["encoder.layer.0.nothing.weight"] = home
    (d2 / "model.safetensors.index.json").write_text(json.dumps(index2))
    with pytest.raises(InputError, match="lists tensor encoder.layer.0.nothing.weight in .*which does not hold it"):
        load(d2)


def test_an_index_naming_the_wrong_subfolder_is_refused(bert_dir, tmp_path):
    """Red team 184: the index and the shards were compared by base name, so a tensor the index puts in a/x but that
    is stored in b/x (one name, two folders) passed; they are compared by resolved path."""
    d, index = _sharded(bert_dir, tmp_path)
    W1 = "encoder.layer.0.intermediate.dense.weight"
    home = index["weight_map"][W1]
    for sub in ("a", "b"):
        (d / sub).mkdir()
    shard = load_file(str(d / home))
    rest = {k: v for k, v in shard.items() if k != W1}
    save_file({W1: shard[W1]}, str(d / "b" / home), metadata={"format": "pt"})
    save_file(rest, str(d / "a" / home), metadata={"format": "pt"})
    (d / home).unlink()
    wm = {k: (f"a/{home}" if v == home else v) for k, v in index["weight_map"].items()}
    wm["__other__"] = f"b/{home}"  # b/x is a shard of the index too, listed for a tensor it does not hold
    (d / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": wm}))
    with pytest.raises(InputError, match=rf"puts tensor {W1} in a/{home}, but it is stored in"):
        load(d)


def test_a_tensor_in_two_pickled_shards_is_refused(bert_dir, tmp_path):
    model, path = bert_dir
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(path / "config.json", d / "config.json")
    state = model.state_dict()
    keys = list(state)
    torch.save({k: state[k] for k in keys[: len(keys) // 2]}, d / "pytorch_model-00001.bin")
    W1 = "encoder.layer.0.intermediate.dense.weight"
    torch.save({**{k: state[k] for k in keys[len(keys) // 2:]}, W1: state[W1] * 10}, d / "pytorch_model-00002.bin")
    wm = {k: "pytorch_model-00001.bin" if i < len(keys) // 2 else "pytorch_model-00002.bin" for i, k in enumerate(keys)}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(InputError, match=rf"tensor {W1} is stored in two shards, pytorch_model-00001\.bin and "):
        load(d, allow_pickle=True)


def test_header_architecture_must_agree_with_config(bert_dir, tmp_path):
    """transcover_arch in the safetensors header overrode config.json unchecked: a Llama folder whose header
    said "gemma" was read with Gemma's (1 + gamma) gains, exit 0 (red team 37g)."""
    _, path = bert_dir
    d = _copy(path, tmp_path / "meta")
    tensors = load_file(str(d / "model.safetensors"))
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt", "transcover_arch": "gpt2"})
    with pytest.raises(InputError, match="transcover_arch='gpt2' contradicts config.json's model_type='bert'"):
        load(d)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt", "transcover_arch": "bert"})
    _layers_equal(load(d), load(path))


def test_a_refused_pickle_names_the_cause_in_one_line(tmp_path, capsys):
    import os

    from transcover.cli import main

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'PWNED'}",))

    d = tmp_path / "evil"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2,
                                               "num_hidden_layers": 1, "intermediate_size": 8}))
    torch.save({"w": Evil()}, d / "pytorch_model.bin")
    assert main(["analyze", str(d), "--allow-pickle"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # torch 2.13's text starts with advice to disable weights_only; the cause is a later line (red team 37g)
    assert len(err) == 1 and "weights_only unpickling refused it (" in err[0] and "will likely succeed" not in err[0]
    assert "GLOBAL" in err[0] and not (tmp_path / "PWNED").exists()


def test_shards_without_their_index_are_said_so(bert_dir, tmp_path):
    """Red team 219: ten .safetensors shards without model.safetensors.index.json were "no model weights ... expected
    model.safetensors, ..."; the message now says what is there and what is missing."""
    d, _ = _sharded(bert_dir, tmp_path)
    (d / "model.safetensors.index.json").unlink()
    n = len(list(d.glob("*.safetensors")))
    with pytest.raises(InputError, match=rf"{n} \.safetensors files \(model-0.*\) but no "
                                         r"model\.safetensors\.index\.json naming them"):
        load(d)


def test_model_safetensors_beside_an_index_is_read_with_a_warning(bert_dir, tmp_path):
    """Red team 219: with both model.safetensors and model.safetensors.index.json, model.safetensors is read (as
    transformers does) without a word; now a warning says which and that the shards are not read."""
    from transcover import TranscoverWarning
    from transcover.model import files_read

    model, path = bert_dir
    d, _ = _sharded(bert_dir, tmp_path)
    shutil.copy(path / "model.safetensors", d / "model.safetensors")
    with pytest.warns(TranscoverWarning, match=r"both model\.safetensors and model\.safetensors\.index\.json: "
                                              r"model\.safetensors is read .*the index and its shards are not"):
        spec = load(d)
    _layers_equal(spec, load(path))
    assert files_read(d) == [d / "config.json", d / "model.safetensors"]


def test_a_mixed_checkpoint_says_so_the_same_as_one_file_and_as_shards(bert_dir, tmp_path):
    """Red team 219: "stored dtype" was the first floating tensor's dtype in header order, so one checkpoint of
    float16, bfloat16 and float64 tensors was "float64" as one file and something else as shards.  Now every dtype
    is counted, the same for both."""
    model, path = bert_dir
    tensors = load_file(str(path / "model.safetensors"))
    dtypes = {k: torch.float16 if "layer.0.attention" in k else torch.bfloat16 if "layer." in k else torch.float64
              for k in tensors}
    mixed = {k: t.to(dtypes[k]) for k, t in tensors.items()}
    single = _copy(path, tmp_path / "single", tensors=mixed)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(path / "config.json", sharded / "config.json")
    keys = sorted(mixed, reverse=True)
    half = {k: ("a.safetensors" if i % 2 else "b.safetensors") for i, k in enumerate(keys)}
    for shard in ("a.safetensors", "b.safetensors"):
        save_file({k: mixed[k] for k in keys if half[k] == shard}, str(sharded / shard), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": half}))
    n = {dt: sum(1 for v in dtypes.values() if v == dt) for dt in (torch.float16, torch.bfloat16, torch.float64)}
    said = ", ".join(f"{c} {str(dt).removeprefix('torch.')}" for dt, c in sorted(n.items(), key=lambda kv: -kv[1]))
    assert len(set(n.values())) == 3  # the order by count is well defined
    for folder in (single, sharded):
        assert load(folder).config["storage_dtype"] == f"mixed: {said}", folder.name
