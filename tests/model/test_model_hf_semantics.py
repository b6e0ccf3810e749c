"""Checkpoints transcover read as another function than transformers computes (red team 168).

Each case either reproduces HF's own forward in float64 (tiny random models saved with ``save_pretrained``)
or is refused in one line where the checkpoint means different functions under transformers 4 and 5:

* ``partial_rotary_factor`` on a Llama-style family (transformers 5 rotates the whole head): refused;
* Qwen3-MoE's ``norm_topk_prob=False`` saved beside ``num_local_experts`` (test_model_load_moe);
* Gemma 1's legacy ``hidden_act="gelu"``: the tanh GELU, as transformers 5.25 rewrites it;
* ``nn.TransformerEncoder`` norms: eps 0 kept, ``nn.RMSNorm`` and ``nn.Identity`` read as such, other
  submodules refused by name;
* keys missing from config.json: transformers' class defaults (GPT-NeoX's quarter rotation, Gemma 2's
  query_pre_attn_scalar / soft-cap / window), checked against the installed config classes;
* a null number in config.json (test_model_config_values).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import randomize
from torch import nn

from transcover import InputError, UnsupportedArchitectureError
from transcover._errors import TranscoverWarning
from transcover.cli import main
from transcover.model import layer_forward, load, transformer_forward

V, T = 32, 7


def _save(model, path):
    model.save_pretrained(path)
    return path


def _edit(src, dst, drop=(), **changes):
    """A copy of checkpoint folder ``src`` whose config.json has ``drop`` removed and ``changes`` set."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
        if isinstance(cfg.get("rope_parameters"), dict):
            cfg["rope_parameters"].pop(k, None)
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _layer_io(model, layers, run):
    """``[(input, output)]`` of every module in ``layers`` during ``run()`` (HF's own forward)."""
    caps, hooks = [], []
    for i, layer in enumerate(layers):
        caps.append({})

        def pre(mod, args, kwargs, c=caps[i]):
            c["x"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        def post(mod, args, out, c=caps[i]):
            c["y"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

        hooks += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post)]
    with torch.no_grad():
        run()
    for h in hooks:
        h.remove()
    return [(c["x"], c["y"]) for c in caps]


def _check_layers(spec, model, layers, tol):
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    for i, (x, y) in enumerate(_layer_io(model, layers, lambda: model(input_ids=ids))):
        with torch.no_grad():
            err = float((layer_forward(spec.layers[i], x) - y).abs().max() / y.abs().max())
        assert err <= tol, f"layer {i}: relative error {err:.3e}"


# -- 1. partial_rotary_factor on families that rotate the whole head ------------------------------------


@pytest.fixture(scope="module")
def llama_partial(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       partial_rotary_factor=0.5)
    torch.manual_seed(0)
    return _save(randomize(transformers_mod.LlamaForCausalLM(cfg), seed=3), tmp_path_factory.mktemp("partial"))


def test_llama_family_refuses_partial_rotary_factor(llama_partial, tmp_path, transformers_mod, capsys):
    # transformers 5 ignores the factor: the folder with it and the folder without it are one function
    plain = _edit(llama_partial, tmp_path / "plain", drop=("partial_rotary_factor",))
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = (transformers_mod.LlamaForCausalLM.from_pretrained(p).double().eval()(ids).logits
                for p in (llama_partial, plain))
    assert torch.equal(a, b)
    assert load(plain).layers[0].attention.rope.rotary_dim is None
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        d = _edit(llama_partial, tmp_path / model_type, model_type=model_type)
        with pytest.raises(InputError, match=f"partial_rotary_factor is refused for {model_type}.*but got "
                                             "partial_rotary_factor=0.5"):
            load(d)
    capsys.readouterr()  # HF's loading progress
    assert main(["analyze", str(llama_partial), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "partial_rotary_factor" in err[0] and "transformers version" in err[0]
    # the transformers 4 spelling (top level) and 5's (inside rope_parameters) alike; 1.0 is no partial rotation
    nested = _edit(llama_partial, tmp_path / "nested", drop=("partial_rotary_factor",),
                   rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25})
    with pytest.raises(InputError, match="partial_rotary_factor=0.25"):
        load(nested)
    one = _edit(llama_partial, tmp_path / "one", drop=("partial_rotary_factor",), partial_rotary_factor=1.0)
    assert load(one).layers[0].attention.rope.rotary_dim is None


# -- 3. Gemma 1's legacy hidden_act="gelu" --------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma1(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.GemmaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return _save(randomize(transformers_mod.GemmaModel(cfg), seed=5, std=1.0), tmp_path_factory.mktemp("gemma1"))


def test_gemma1_legacy_gelu_is_the_tanh_gelu_as_in_transformers(gemma1, tmp_path, transformers_mod):
    d = _edit(gemma1, tmp_path / "legacy", drop=("hidden_activation",), hidden_act="gelu")
    hf = transformers_mod.GemmaModel.from_pretrained(d).double().eval()
    assert hf.config.hidden_act == "gelu_pytorch_tanh"
    spec = load(d)
    assert spec.layers[0].ffn.activation.value == "gelu_tanh"
    _check_layers(spec, hf, hf.layers, 1e-6)  # HF's RMSNorm computes in float32
    # both keys, one function: accepted; two functions (transformers 4 read hidden_activation): refused
    same = _edit(gemma1, tmp_path / "same", hidden_act="gelu", hidden_activation="gelu_pytorch_tanh")
    assert load(same).layers[0].ffn.activation.value == "gelu_tanh"
    both = _edit(gemma1, tmp_path / "both", hidden_act="gelu", hidden_activation="gelu")
    with pytest.raises(InputError, match="hidden_activation='gelu'.*depends on the transformers version"):
        load(both)


# -- 4. nn.TransformerEncoder norms and submodules ------------------------------------------------------


def _encoder(norm=None, norm_first=True) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(32, 4, 48, dropout=0.0, batch_first=True, norm_first=norm_first)
    return randomize(nn.TransformerEncoder(layer, 2, norm=norm, enable_nested_tensor=False), seed=2).double()


def _same_function(enc, X, assert_close):
    spec = load(enc)
    with torch.no_grad():  # gradients off is fine: the module is in training mode (no fast path), dropout 0
        assert_close(transformer_forward(spec, X, with_head=False), enc.train()(X), 2 * 48)
    return spec


def test_torch_encoder_final_layernorm_with_eps_zero_keeps_it(assert_close):
    enc = _encoder(nn.LayerNorm(32, eps=0.0))
    spec = load(enc)
    assert spec.final_norm.eps == 0.0
    h = 1e-4 * torch.randn(2, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # tokens of variance 1e-8: a floor of 1e-5 would shrink them ~30-fold
        assert_close(spec.final_norm(h), enc.norm(h), 32)


@pytest.mark.parametrize("where", ["layers", "final", "final_eps_none", "identity"])
def test_torch_encoder_rmsnorm_and_identity_norms_are_read_as_such(where, assert_close):
    enc = _encoder(nn.RMSNorm(32, eps=None if where == "final_eps_none" else 1e-3)
                   if where.startswith("final") else None)
    for layer in enc.layers:
        if where == "layers":
            layer.norm1, layer.norm2 = nn.RMSNorm(32, eps=1e-3).double(), nn.RMSNorm(32, eps=1e-2).double()
            randomize(layer, seed=6)
        elif where == "identity":
            layer.norm1 = nn.Identity()
    X = torch.randn(2, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    spec = _same_function(enc, X, assert_close)
    kinds = {n.kind.value for la in spec.layers for n in (la.norm_attn, la.norm_ffn)}
    assert kinds == {"layers": {"rmsnorm"}, "identity": {"none", "layernorm"}}.get(where, {"layernorm"})
    if where == "final_eps_none":  # RMSNorm(eps=None): the machine epsilon of the dtype it runs in
        assert spec.final_norm.eps == torch.finfo(torch.float64).eps


@pytest.mark.parametrize("sub, replacement, message", [
    ("linear1", lambda: nn.Sequential(nn.Linear(32, 48)), "layers.0.linear1 is Sequential"),
    ("norm2", lambda: nn.BatchNorm1d(32), "layers.0.norm2 is BatchNorm1d"),
    ("self_attn", lambda: nn.Identity(), "layers.0.self_attn is Identity"),
])
def test_torch_encoder_unsupported_submodules_are_refused_by_name(sub, replacement, message):
    enc = _encoder()
    setattr(enc.layers[0], sub, replacement())
    with pytest.raises(UnsupportedArchitectureError, match=message):
        load(enc)
    enc = _encoder(nn.GroupNorm(1, 32))
    with pytest.raises(UnsupportedArchitectureError, match="norm is GroupNorm"):
        load(enc)


# -- 5. keys missing from config.json: transformers' class defaults ------------------------------------


def test_hf_defaults_table_matches_the_installed_config_classes(transformers_mod):
    from transcover.model._adapters._common import HF_DEFAULTS

    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
               "olmo": "OlmoConfig", "olmo2": "Olmo2Config", "falcon": "FalconConfig", "gpt_neox": "GPTNeoXConfig",
               "gptj": "GPTJConfig", "phi": "PhiConfig", "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
               "gemma3_text": "Gemma3TextConfig"}
    assert set(HF_DEFAULTS) == set(classes)
    for model_type, defaults in HF_DEFAULTS.items():
        cls = getattr(transformers_mod, classes[model_type])
        hf = cls().to_dict()
        if "use_sliding_window" in defaults:  # the window a config turning it on gets (None while it is off)
            hf["sliding_window"] = cls(use_sliding_window=True).sliding_window
        rope = hf.get("rope_parameters") or {}
        for key, value in defaults.items():
            got = rope.get(key) if key == "rope_theta" else hf.get(key)
            assert got == value, f"{model_type}.{key}: transformers {got!r}, transcover {value!r}"


@pytest.mark.parametrize("family", ["gpt_neox", "gemma2", "gemma3"])
def test_a_minimal_config_json_is_read_with_transformers_defaults(family, tmp_path, transformers_mod):
    tm = transformers_mod
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    if family == "gpt_neox":
        model = tm.GPTNeoXModel(tm.GPTNeoXConfig(**common))
        keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    else:
        cls, ccls = (tm.Gemma2Model, tm.Gemma2Config) if family == "gemma2" else (tm.Gemma3TextModel,
                                                                                 tm.Gemma3TextConfig)
        model = cls(ccls(**common, head_dim=8, num_key_value_heads=2, max_position_embeddings=64))
        keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                "head_dim", "num_key_value_heads", "max_position_embeddings")
    torch.manual_seed(0)
    d = _save(randomize(model, seed=7, std=1.0), tmp_path / "full")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k in keep or k == "model_type"}))
    hf = type(model).from_pretrained(d).double().eval()
    spec = load(d)
    if family == "gpt_neox":  # rotary_pct 0.25: 2 of the 8 coordinates of a head rotate
        assert spec.layers[0].attention.rope.rotary_dim == 2
    else:  # query_pre_attn_scalar 256 (not head_dim 8), sliding window 4096
        assert spec.layers[0].attention.scale == pytest.approx(256 ** -0.5)
        assert spec.layers[0].attention.window == 4096
        assert (spec.layers[0].attention.softcap == 50.0) == (family == "gemma2")
    _check_layers(spec, hf, hf.layers, 1e-6)


def test_qwen_sliding_windows_without_their_keys_read_as_transformers_does(tmp_path, transformers_mod):
    """Red team 173: a Qwen2 config with use_sliding_window on and no sliding_window key is windowed at 4096 by
    transformers (its class default); transcover read no window at all. Qwen2-MoE without layer_types is windowed
    on other layers by transformers 5 than by 4: refused."""
    tf = transformers_mod
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True, max_window_layers=1,
                         sliding_window=4096)
    src = _save(tf.Qwen2ForCausalLM(cfg), tmp_path / "qwen")
    bare = _edit(src, tmp_path / "bare", drop=("sliding_window", "layer_types"))
    hf = tf.Qwen2Config.from_pretrained(bare)
    want = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert want == [None, 4096]
    assert [layer.attention.window for layer in load(str(bare)).layers] == want
    off = _edit(src, tmp_path / "off", drop=("sliding_window", "layer_types", "use_sliding_window"))
    assert [layer.attention.window for layer in load(str(off)).layers] == [None, None]  # off by default
    from transcover.model._adapters._windows import sliding_windows

    for model_type in ("qwen2_moe", "qwen3_moe"):
        with pytest.raises(InputError, match="transformers versions window different layers"):
            sliding_windows({"model_type": model_type, "use_sliding_window": True, "sliding_window": 16,
                             "max_window_layers": 1}, 2, family=model_type, arch="moe", name="m")


def test_roberta_tokens_are_embedded_at_robertas_positions(tmp_path, transformers_mod):
    """Red team 172: RoBERTa's positions start after its padding index (2, 3, ... for pad 1; a pad itself at 1), but
    token ids were embedded at BERT's rows 0, 1, ...: the local bounds were centred 1.8-3.3 away from the hidden
    states the model computes. The whole forward from ids now matches HF's."""
    import numpy as np

    from transcover.model._data import load_inputs

    tf = transformers_mod
    torch.manual_seed(0)
    cfg = tf.RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           vocab_size=100, max_position_embeddings=12, pad_token_id=1, initializer_range=0.3)
    path = _save(tf.RobertaModel(cfg).eval(), tmp_path / "roberta")
    ids = np.array([[0, 5, 6, 7, 8, 2], [0, 9, 1, 4, 2, -1]], dtype=np.int64)  # a pad id inside, a -1 pad after
    np.save(tmp_path / "ids.npy", ids)
    model = tf.RobertaModel.from_pretrained(path, attn_implementation="eager").double().eval()
    spec = load(str(path))
    for row, X in zip(ids, load_inputs(spec, str(tmp_path / "ids.npy"))):
        r = row[row >= 0]
        with torch.no_grad():
            want = model(input_ids=torch.as_tensor(r)[None]).last_hidden_state[0]
        Z = spec.input_norm(X.double())
        for layer in spec.layers:
            Z = layer_forward(layer, Z)
        assert float((Z - want).abs().max()) <= 1e-12 * float(want.abs().max())
    # 12 position rows, the first two taken by the padding offset: 10 tokens fit, 11 do not
    np.save(tmp_path / "long.npy", np.full((1, 11), 5, dtype=np.int64))
    with pytest.raises(InputError, match="more than the model allows"):
        load_inputs(spec, str(tmp_path / "long.npy"))


# -- 6. bias tensors the configuration says do not exist (red team 195, A) -----------------------------


def _families_without_biases(tm):
    """family -> (model, the module list of its layers, its forward's inputs): each gives some projection no bias
    (by a configuration flag or by its architecture)."""
    dec = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    ids = {"input_ids": torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))}
    pixels = {"pixel_values": torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))}
    return {
        "llama": (lambda: tm.LlamaModel(tm.LlamaConfig(**dec)), "layers", ids),  # attention_bias, mlp_bias false
        "mistral": (lambda: tm.MistralModel(tm.MistralConfig(**dec, attention_bias=True)), "layers", ids),
        "qwen2": (lambda: tm.Qwen2Model(tm.Qwen2Config(**dec)), "layers", ids),  # q/k/v biases, none on o_proj
        "qwen3": (lambda: tm.Qwen3Model(tm.Qwen3Config(**dec, head_dim=8)), "layers", ids),
        "gemma": (lambda: tm.GemmaModel(tm.GemmaConfig(**dec, head_dim=8)), "layers", ids),
        "olmo2": (lambda: tm.Olmo2Model(tm.Olmo2Config(**dec)), "layers", ids),
        "gpt_neox": (lambda: tm.GPTNeoXModel(tm.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                                                num_hidden_layers=2, num_attention_heads=4,
                                                                attention_bias=False)), "layers", ids),
        "falcon": (lambda: tm.FalconModel(tm.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                            num_attention_heads=4, bias=False)), "h", ids),
        "vit": (lambda: tm.ViTModel(tm.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_size=48, image_size=8, patch_size=4, qkv_bias=False),
                                    add_pooling_layer=False), "layers", pixels),
    }


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "olmo2", "gpt_neox", "falcon",
                                    "vit"])
def test_bias_tensors_the_model_does_not_have_are_ignored_with_a_warning(family, tmp_path, transformers_mod):
    """Red team 195 (A): transformers builds these projections without a bias and reports a bias tensor in the file
    as UNEXPECTED; transcover read it as the projection's bias (outputs 0.26-1.48 apart). It is now ignored with an
    "unexpected tensor" warning (refused under strict), as GPT-J's and T5's were."""
    from safetensors.torch import load_file, save_file

    make, container, inputs = _families_without_biases(transformers_mod)[family]
    torch.manual_seed(0)
    d = _save(randomize(make(), seed=8), tmp_path / family)
    f = d / "model.safetensors"
    tensors = load_file(f)
    g = torch.Generator().manual_seed(9)
    inside = re.compile(r"(^|\.)(layers|layer|h)\.\d+\.")  # the layers' own projections
    added = [k[: -len("weight")] + "bias" for k, t in tensors.items()
             if t.dim() == 2 and inside.search(k) and k[: -len("weight")] + "bias" not in tensors]
    assert added
    for key in added:
        tensors[key] = 0.5 * torch.randn(tensors[key[: -len("bias")] + "weight"].shape[0], generator=g)
    save_file(tensors, f, metadata={"format": "pt"})
    hf = type(make()).from_pretrained(d).double().eval()
    with pytest.warns(TranscoverWarning, match="unexpected tensor"):
        spec = load(d)
    for key in added:  # one warning per ignored tensor
        assert sum(f"unexpected tensor {key!r}" in w for w in spec.warnings) == 1, (key, spec.warnings)
    for i, (x, y) in enumerate(_layer_io(hf, getattr(hf, container), lambda: hf(**inputs))):
        with torch.no_grad():
            err = float((layer_forward(spec.layers[i], x) - y).abs().max() / y.abs().max())
        assert err <= 1e-6, f"layer {i}: relative error {err:.3e}"  # HF's RoPE and RMSNorm compute in float32
    with pytest.raises(InputError, match=r"refused \(strict\).*unexpected tensor"):
        load(d, strict=True)


# -- 7. which layers are windowed, per model type (red team 195, B) -------------------------------------


@pytest.mark.parametrize("family, edit, want", [
    # LlamaModel and GemmaModel build only the causal mask: a sliding_window key is an attribute nothing reads
    ("llama", {"sliding_window": 3}, [None, None]),
    ("llama", {"sliding_window": 3, "use_sliding_window": True, "max_window_layers": 1,
               "layer_types": ["sliding_attention", "sliding_attention"]}, [None, None]),
    ("gemma", {"sliding_window": 3}, [None, None]),
    # MistralModel windows every layer when sliding_window is set, whatever the Qwen-style keys say
    ("mistral", {"sliding_window": 3, "use_sliding_window": False}, [3, 3]),
    ("mistral", {"sliding_window": 3, "use_sliding_window": True, "max_window_layers": 1}, [3, 3]),
    ("mistral", {"sliding_window": 3, "layer_types": ["full_attention", "sliding_attention"]}, [3, 3]),
    ("mistral", {"sliding_window": None}, [None, None]),
    ("qwen3", {"sliding_window": 3, "use_sliding_window": True, "layer_types": ["sliding_attention",
                                                                                "full_attention"]}, [3, None]),
])
def test_sliding_windows_follow_each_model_type(family, edit, want, tmp_path, transformers_mod):
    """Red team 195 (B): the Qwen2/Mistral window rules were applied to every model type the Llama and Gemma
    adapters read; a Llama config.json with a sliding_window key was read as a windowed model (0.1-0.5 apart)."""
    tm = transformers_mod
    classes = {"llama": ("LlamaConfig", "LlamaModel"), "gemma": ("GemmaConfig", "GemmaModel"),
               "mistral": ("MistralConfig", "MistralModel"), "qwen3": ("Qwen3Config", "Qwen3Model")}
    cfg_cls, model_cls = (getattr(tm, c) for c in classes[family])
    extra = {"head_dim": 8} if family in ("gemma", "qwen3") else {}
    cfg = cfg_cls(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    src = _save(randomize(model_cls(cfg), seed=10), tmp_path / "src")
    d = _edit(src, tmp_path / "edited", **edit)
    hf = model_cls.from_pretrained(d).double().eval()
    spec = load(d)
    assert [layer.attention.window for layer in spec.layers] == want
    _check_layers(spec, hf, hf.layers, 1e-6)  # T = 7 tokens: a window of 3 changes every output row past the third


def test_qwen3_moe_windows_every_layer_or_is_refused():
    """transformers 5.25 windows every Qwen3-MoE layer when use_sliding_window is on (its config has no
    layer_types; 4.x windowed the layers >= max_window_layers): all-sliding layer_types agree, others are refused."""
    from transcover.model._adapters._windows import sliding_windows

    cfg = {"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}
    assert sliding_windows({**cfg, "layer_types": ["sliding_attention"] * 2}, 2, family="qwen3_moe", arch="moe",
                           name="m") == [16, 16]
    with pytest.raises(InputError, match="5.25: every layer"):
        sliding_windows({**cfg, "layer_types": ["full_attention", "sliding_attention"]}, 2, family="qwen3_moe",
                        arch="moe", name="m")
    assert sliding_windows({**cfg, "use_sliding_window": False}, 2, family="qwen3_moe", arch="moe",
                           name="m") == [None, None]
    with pytest.raises(InputError, match="sets a sliding window for model_type 'yi'"):
        sliding_windows({"sliding_window": 4}, 2, family="yi", arch="llama", name="m")


# -- 8. rope_scaling beside rope_parameters, and a top-level original length (red team 195, C and D) ----------


def _drop_nested_theta(cfg):
    for entry in cfg["rope_parameters"].values():
        entry.pop("rope_theta")
    cfg.update(rope_theta=5.0, rope_local_base_freq=7.0)


def _neox_top_level_only(cfg):
    del cfg["rope_parameters"]
    cfg.update(rope_theta=50.0, partial_rotary_factor=0.5)


_LLAMA3 = dict(rope_type="llama3", rope_theta=100.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8)
_YARN = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=64)


@pytest.mark.parametrize("family, rope, edit", [
    # transformers 5.25: ``rope_scaling or rope_parameters`` -- a legacy rope_scaling replaces the whole dict, its
    # theta then the top-level rope_theta or the default (C)
    ("llama", {"rope_type": "default", "rope_theta": 100.0}, {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}),
    ("gpt_neox", {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
     {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}),
    ("phi", {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
     {"rope_scaling": {"type": "linear", "factor": 3.0}, "rope_theta": 50.0}),
    # GPTNeoXConfig fills them from rotary_emb_base / rotary_pct, else 10000 / 0.25: never from the top level
    # (red team 197: read there, 0.41 and 0.62 apart)
    ("gpt_neox", {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
     {"rope_scaling": {"rope_type": "linear", "factor": 3.0}, "rope_theta": 50.0, "partial_rotary_factor": 0.5}),
    ("gpt_neox", None, _neox_top_level_only),
    # Gemma 3 merges it into the full_attention entry, and takes an absent theta from the top level (C)
    ("gemma3", None, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("gemma3", None, _drop_nested_theta),
    # a top-level original_max_position_embeddings overrides the dict's for llama3 and yarn (D)
    ("llama", _LLAMA3, {"original_max_position_embeddings": 2}),
    ("llama", _YARN, {"original_max_position_embeddings": 2}),
    ("gemma3", {"full_attention": _YARN, "sliding_attention": {"rope_type": "default", "rope_theta": 7.0}},
     {"original_max_position_embeddings": 2}),  # not for a nested entry: HF keeps the entry's own
])
def test_rope_parameters_are_formed_as_transformers_does(family, rope, edit, tmp_path, transformers_mod):
    tm = transformers_mod
    dec = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=16)
    if rope is not None:
        dec["rope_parameters"] = rope
    if family == "llama":
        model = tm.LlamaModel(tm.LlamaConfig(**dec, num_key_value_heads=2))
    elif family == "gpt_neox":
        model = tm.GPTNeoXModel(tm.GPTNeoXConfig(**dec))
    elif family == "phi":
        model = tm.PhiModel(tm.PhiConfig(**dec))
    else:
        model = tm.Gemma3TextModel(tm.Gemma3TextConfig(**dec, num_key_value_heads=2, head_dim=8, sliding_window=3,
                                                       layer_types=["sliding_attention", "full_attention"]))
    torch.manual_seed(0)
    src = _save(randomize(model, seed=11), tmp_path / "src")
    if callable(edit):
        d = _edit(src, tmp_path / "edited")
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    else:
        d = _edit(src, tmp_path / "edited", **edit)
    hf = type(model).from_pretrained(d).double().eval()
    _check_layers(load(d), hf, hf.layers, 1e-6)  # HF computes the frequencies and RMSNorm in float32


# -- 9. a model_type spelled otherwise than transformers' key (red team 197) ---------------------------------


@pytest.mark.parametrize("family, spelling, edit", [
    ("qwen2", "Qwen2", {}),  # q/k/v biases: Qwen2's rule, not Llama's (read as unexpected: 0.39 apart)
    ("mistral", "Mistral", {"sliding_window": 3}),  # every layer windowed: Mistral's rule (was refused)
    ("gemma2", "GEMMA2", "minimal"),  # Gemma 2's defaults: query_pre_attn_scalar 256, soft-cap 50, window 4096
])
def test_model_type_selects_its_rules_in_any_spelling(family, spelling, edit, tmp_path, transformers_mod):
    """transcover's registry reads ``model_type`` in lower case with ``-`` as ``_`` (``"Qwen2"`` chooses the Qwen2
    adapter) and the model class ignores its spelling; the rules chosen by model type (biases, windows, the config
    class's defaults) followed the raw string and missed (red team 197)."""
    tm = transformers_mod
    classes = {"qwen2": ("Qwen2Config", "Qwen2Model"), "mistral": ("MistralConfig", "MistralModel"),
               "gemma2": ("Gemma2Config", "Gemma2Model")}
    cfg_cls, model_cls = (getattr(tm, c) for c in classes[family])
    extra = {"head_dim": 8} if family == "gemma2" else {}
    cfg = cfg_cls(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    src = _save(randomize(model_cls(cfg), seed=5), tmp_path / "src")
    if edit == "minimal":
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "head_dim")
        d = _edit(src, tmp_path / "edited")
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**{k: cfg[k] for k in keep}, "model_type": spelling}))
    else:
        d = _edit(src, tmp_path / "edited", model_type=spelling, **edit)
    hf = model_cls.from_pretrained(d).double().eval()
    spec = load(d)
    attn = spec.layers[0].attention
    if family == "qwen2":
        assert attn.b_Q is not None and attn.b_O is None
    elif family == "mistral":
        assert [layer.attention.window for layer in spec.layers] == [3, 3]
    else:
        assert attn.scale == pytest.approx(256 ** -0.5) and attn.softcap == 50.0 and attn.window == 4096
    _check_layers(spec, hf, hf.layers, 1e-6)


# -- 10. Gemma 2/3 without a window: transformers still fills in sliding layers (red team 197) -------------------


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_gemma_sliding_layers_without_a_window_are_refused(family, layer_types, tmp_path, transformers_mod):
    """Gemma2Config / Gemma3TextConfig fill layer_types in (sliding, full, ...) whether or not sliding_window is set,
    and their model then fails on a null window (TypeError in the mask): with layer_types given this was refused,
    without them it loaded unwindowed (Gemma 3's sliding layers with the global base). Both are refused alike."""
    tm = transformers_mod
    cfg_cls, model_cls = ((tm.Gemma2Config, tm.Gemma2Model) if family == "gemma2" else
                          (tm.Gemma3TextConfig, tm.Gemma3TextModel))
    cfg = cfg_cls(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=16, sliding_window=3,
                  layer_types=["sliding_attention", "full_attention"])
    src = _save(model_cls(cfg), tmp_path / "src")
    changes = {"sliding_window": None, "sliding_window_pattern": 2}
    d = _edit(src, tmp_path / "edited", **changes) if layer_types else _edit(src, tmp_path / "edited",
                                                                             drop=("layer_types",), **changes)
    hf = model_cls.from_pretrained(d).eval()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    with pytest.raises(TypeError):
        hf(input_ids=torch.zeros(1, T, dtype=torch.long))
    with pytest.raises(InputError, match="'sliding_attention' layers .* but no sliding_window"):
        load(d)
    if family == "gemma3":  # transformers fails on a pattern that is no positive integer, at the config already
        bad = _edit(src, tmp_path / "bad", drop=("layer_types",), sliding_window_pattern=None)
        with pytest.raises(TypeError):
            model_cls.from_pretrained(bad)
        with pytest.raises(InputError, match="sliding_window_pattern must be a positive integer"):
            load(bad)
