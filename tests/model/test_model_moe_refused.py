"""Mixture-of-experts models (Mixtral) are recognised and refused for every bound with the reason
(THEORY F25: top-k routing is discontinuous); ``analyze`` still reports their matrices one by one."""

from __future__ import annotations

import json

import pytest
import torch

from transcover import UnsupportedArchitectureError
from transcover.cli import main
from transcover.model import load


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, transformers_mod):
    cfg = transformers_mod.MixtralConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=3,
                                         num_experts_per_tok=2, vocab_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers_mod.MixtralModel(cfg).eval()
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    return model, path


def test_moe_is_refused_with_the_reason(mixtral):
    model, path = mixtral
    for source in (path, model):
        with pytest.raises(UnsupportedArchitectureError, match="top-k experts.*discontinuous.*F25"):
            load(source)


def test_moe_bounds_refuse_in_one_line_and_analyze_goes_per_matrix(mixtral, tmp_path, capsys):
    _, path = mixtral
    assert main(["lipschitz", str(path), "--no-lower", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "discontinuous" in err[0], err
    out = tmp_path / "pm.json"
    assert main(["analyze", str(path), "--quiet", "--fast", "--json", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["schema"] == "transcover.analyze.per_matrix"
    assert any("experts" in m["name"] for m in doc["matrices"])
