"""Configuration values no model has, refused in one line (red team of stop 36).

A zero or negative head or layer count, a width the heads do not divide, a textual size ended in
ZeroDivisionError, "math domain error" or a failed reshape ("internal error", exit 1); a NaN
``layer_norm_epsilon`` passed every ``eps < 0`` test and ``lipschitz`` printed a *certified* NaN
with exit 0.  Also: a 0-byte ``--data`` array (EOFError) and a damaged ``train --resume`` checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from conftest import randomize
from safetensors.torch import load_file, save_file

from transcover import InputError
from transcover.cli import main
from transcover.lipschitz import layernorm_lipschitz
from transcover.model import NormKind, NormSpec, load

D, H, L = 16, 2, 2


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.GPT2Config(n_embd=D, n_layer=L, n_head=H, vocab_size=32, n_positions=8)
    torch.manual_seed(0)
    model = randomize(transformers_mod.GPT2Model(cfg), seed=5).eval()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return path


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))  # json writes NaN as NaN, as Python's json reads it
    return dst


@pytest.mark.parametrize("changes, field", [
    (dict(n_head=0), "n_head"), (dict(n_head=3), "n_embd"), (dict(n_layer=-1), "n_layer"),
    (dict(n_embd=-16), "n_embd"), (dict(n_layer="two"), "n_layer"), (dict(n_layer=True), "n_layer"),
    (dict(n_layer=1.5), "n_layer"), (dict(layer_norm_epsilon=math.nan), "layer_norm_epsilon"),
    (dict(layer_norm_epsilon=-1e-5), "layer_norm_epsilon"), (dict(n_positions=0), "n_positions"),
    (dict(layer_norm_epsilon=None), "layer_norm_epsilon"),  # float(None): "internal error", exit 1 (red team 168)
], ids=lambda v: str(v))
def test_impossible_configuration_values_are_refused_in_one_line(gpt2_dir, tmp_path, capsys, changes, field):
    bad = _edited(gpt2_dir, tmp_path / "bad", **changes)
    with pytest.raises(InputError, match=field):
        load(bad)
    assert main(["lipschitz", str(bad), "--no-lower"]) == 2  # before: 1 ("internal error") or 0 with a NaN
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "internal error" not in err[0]


def test_an_integer_valued_float_size_is_still_a_size(gpt2_dir, tmp_path):
    ok = _edited(gpt2_dir, tmp_path / "ok", n_layer=2.0, n_embd=16.0)
    assert len(load(ok).layers) == 2


def test_grouped_heads_must_divide(tmp_path):
    from transcover.model._adapters._common import check_config

    with pytest.raises(InputError, match="multiple of num_key_value_heads"):
        check_config({"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 3}, "x")
    with pytest.raises(InputError, match="rope_theta"):
        check_config({"text_config": {"rope_theta": -1.0}}, "x")
    check_config({"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}, "x")


def test_norm_spec_and_layernorm_bound_refuse_a_nan_eps():
    with pytest.raises(InputError, match="eps"):
        NormSpec(NormKind.LAYERNORM, eps=math.nan)
    for args in ((1.0, math.nan), (math.nan, 1e-5), (math.inf, 1e-5), (1.0, 1e-5, math.nan)):
        with pytest.raises(InputError):
            layernorm_lipschitz(*args)


def test_an_empty_npy_is_one_line(gpt2_dir, tmp_path, capsys):
    z = tmp_path / "z.npy"
    z.write_bytes(b"")
    assert main(["lipschitz", str(gpt2_dir), "--data", str(z), "--no-lower"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_resume_refuses_a_damaged_optimizer_state_and_nan_weights(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--task", "parity", "--epochs", "1", "--out", str(out)]
    assert main(args) == 0
    ck = out / "checkpoint"
    good = ck.with_name("good")
    shutil.copytree(ck, good)
    (ck / "optimizer.pt").write_bytes(np.random.default_rng(0).bytes(100))
    capsys.readouterr()
    assert main(args + ["--resume"]) == 2
    assert "optimizer.pt" in capsys.readouterr().err
    shutil.rmtree(ck)
    shutil.copytree(good, ck)
    w = load_file(str(ck / "model.safetensors"))
    name = next(k for k, t in w.items() if t.is_floating_point() and t.numel() > 1)
    w[name].view(-1)[0] = math.nan
    save_file(w, str(ck / "model.safetensors"))
    assert main(args + ["--resume"]) == 2  # a file that is not the one the state was written with (stop 38)
    assert "is torn" in capsys.readouterr().err
    # a run that itself saved NaN weights: its state.json holds their digest, and the NaN check names them
    import hashlib
    import json

    state = json.loads((ck / "state.json").read_text())
    state["files"]["model.safetensors"] = hashlib.sha256((ck / "model.safetensors").read_bytes()).hexdigest()
    (ck / "state.json").write_text(json.dumps(state))
    assert main(args + ["--resume"]) == 2
    assert "NaN or infinite" in capsys.readouterr().err


def test_norm_spec_takes_numpy_eps_at_its_value():
    import torch

    # np.float32(1e-5) was refused with "must be a finite number >= 0, but got eps=1e-05"
    n = NormSpec(NormKind.LAYERNORM, eps=np.float32(1e-5))
    assert type(n.eps) is float and n.eps == float(np.float32(1e-5))
    with pytest.raises(InputError, match="Tensor"):
        NormSpec(NormKind.LAYERNORM, eps=torch.tensor(1e-5))
