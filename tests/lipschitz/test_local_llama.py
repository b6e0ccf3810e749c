"""THEORY F107 end to end: a random Llama (RMSNorm, GQA, RoPE, causal, SwiGLU) gets certified local constants."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from _attack import Domain, attack_pairs, violates
from transcover.cli import main
from transcover.lipschitz import layer_local, network_local
from transcover.model import layer_forward, load, transformer_forward

F64 = torch.float64


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=64, max_position_embeddings=128)
    d = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    return d


def _hidden(spec, T: int = 8, seed: int = 0) -> torch.Tensor:  # noqa: ANN001
    E = torch.as_tensor(np.asarray(spec.embeddings["token_embedding"]), dtype=F64)
    ids = torch.randint(0, E.shape[0], (T,), generator=torch.Generator().manual_seed(seed))
    return E[ids]


def test_llama_cli_local_rows(llama_dir, tmp_path, capsys) -> None:  # noqa: ANN001
    """``transcover lipschitz DIR --data ids.npy --rho 1e-3 --rho-relative`` exits 0 with certified local rows for
    every layer's attention and FFN (its own ``check_certified`` enforces lower <= upper)."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([[1, 5, 9, 33, 2, 7, 7, 60], [3, 3, 3, 3, 0, 63, 12, 40]], dtype=np.int64))
    out = tmp_path / "local.json"
    assert main(["lipschitz", str(llama_dir), "--data", str(ids), "--rho", "1e-3", "--rho-relative", "--json",
                 str(out)]) == 0
    assert "Local Lipschitz constants" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    for comp in ("attention", "ffn", "layer"):
        got = [r for r in rows if r["component"] == comp]
        assert len(got) == 2, rows
        for r in got:
            assert 0 < float(r["lower"]) <= float(r["local_upper"]) < math.inf, r


@pytest.mark.parametrize("rho", [1e-4, 1e-2])
def test_llama_layers_sound(llama_dir, rho: float) -> None:  # noqa: ANN001
    """Each layer's product-route constant on B(X, rho) beats a projected pair ascent in the (2,inf) metric; the whole
    network's product bound is finite and above the ascent on the stack."""
    spec = load(llama_dir).to_torch(F64)
    X = _hidden(spec)
    rho = rho * float(X.norm(dim=-1).median())
    for layer in spec.layers:
        ll = layer_local(layer, X, rho)
        assert math.isfinite(ll.upper) and ll.upper == ll.product
        assert math.isfinite(ll.components["ffn"]) and math.isfinite(ll.components["attention"])
        w = attack_pairs(lambda Z, s, layer=layer: layer_forward(layer, X + Z), T=X.shape[0], d=X.shape[1],
                         dom=Domain(rho), metric="2,inf", restarts=4, steps=25, seed=1, n_jacobian=2)
        assert not violates(w, ll.upper), (w, ll.upper)
        X = layer_forward(layer, X).detach()
    X0 = _hidden(spec)
    net = network_local(spec, X0, rho)
    assert math.isfinite(net.upper) and net.route == "product"
    w = attack_pairs(lambda Z, s: transformer_forward(spec, X0 + Z), T=X0.shape[0], d=X0.shape[1], dom=Domain(rho),
                     metric="2,inf", restarts=4, steps=25, seed=2, n_jacobian=2)
    assert not violates(w, net.upper), (w, net.upper)


def test_a_sequence_beyond_the_rope_positions_is_refused(tmp_path, capsys) -> None:  # noqa: ANN001
    """Red team 183: a 20-token sequence of a Llama with 16 positions ran to exit 0, its global and domain columns
    built on B_KQ's supremum over offsets below 16 (0.773 for a head whose offsets up to 19 reach 0.804).  The data
    readers refuse it in one line, as they refuse a BERT sequence beyond its position table."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=64, max_position_embeddings=16)
    d = tmp_path / "m"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    capsys.readouterr()  # transformers' own progress lines
    for T, rc in ((20, 2), (16, 0)):
        ids = tmp_path / f"ids{T}.npy"
        np.save(ids, np.arange(T, dtype=np.int64)[None] % 64)
        assert main(["lipschitz", str(d), "--data", str(ids), "--rho", "1e-3", "--no-lower", "--quiet"]) == rc
    err = capsys.readouterr().err
    assert "20 tokens, more than the model allows (16 positions" in err and len(err.strip().splitlines()) == 1
