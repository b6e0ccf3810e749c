"""A bound stated for T tokens covers only the sequences the model's bounds are certified for (red team 189).

A RoPE model's B_KQ is the supremum of ``||W_Q R_delta W_K^T||`` over the offsets below ``max_position``; ``bound
--seq-len 1000`` of a Llama with 64 positions printed a certified covering number built on it while the score matrix
at offset 999 was 3.7x larger.  Every command and API function that states a bound for T tokens refuses T beyond the
model's limit in one line, and the defaults (128 tokens) shrink to it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from transcover.cli import main
from transcover.covering import model_bound
from transcover.lipschitz import lipschitz_bounds, lipschitz_lower, perturbation_lower
from transcover.model import check_sequence_length, load, max_sequence_length
from transcover.norms._rope_sup import rope_inv_freq

P = 16


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=64, max_position_embeddings=P)
    d = tmp_path_factory.mktemp("llama16")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    return d


def _score_norm(layer, h: int, delta: int) -> float:  # noqa: ANN001
    """``||W_Q^h R_delta W_K^hT|| / sqrt(d_h)`` in float64 (exact rotation of the query's planes), RoPE's pairing of
    coordinates i and i + d_h/2 (the Llama layout)."""
    a = layer.attention
    Wq = np.asarray(a.W_Q, dtype=np.float64)[h]
    Wk = np.asarray(a.W_K, dtype=np.float64)[h // (a.n_heads // a.n_kv_heads)]
    dh = Wq.shape[1]
    inv = rope_inv_freq(a.rope, dh, int(a.rope.max_position))
    c, s = np.cos(delta * inv), np.sin(delta * inv)
    half = dh // 2
    R = np.zeros((dh, dh))
    R[:half, :half], R[half:, half:] = np.diag(c), np.diag(c)
    R[:half, half:], R[half:, :half] = np.diag(s), -np.diag(s)
    return float(np.linalg.norm(Wq @ R @ Wk.T, 2)) / np.sqrt(dh)


def test_the_limit_is_the_rope_positions(llama_dir) -> None:  # noqa: ANN001
    """The limit is ``max_position``; T = P passes and T = P + 1 is refused, naming the setting and the limit."""
    spec = load(llama_dir)
    assert max_sequence_length(spec) == P
    check_sequence_length(spec, P)
    with pytest.raises(Exception, match=rf"--seq-len={P + 1} is longer than the {P} tokens .*use --seq-len <= {P}"):
        check_sequence_length(spec, P + 1, "--seq-len")


def test_the_bound_needs_the_limit(llama_dir) -> None:  # noqa: ANN001
    """Why: some offset beyond the limit has a larger score matrix than every offset below it, so a B_KQ read off the
    offsets below P is no bound on longer sequences (if this fails, the model below is no witness and the test should
    pick another seed, not be dropped)."""
    layer = load(llama_dir).layers[0]
    below = max(_score_norm(layer, h, dl) for h in range(4) for dl in range(P))
    beyond = max(_score_norm(layer, h, dl) for h in range(4) for dl in range(P, 400))
    assert beyond > below


@pytest.mark.parametrize("command", [
    ["bound", "--json", "{out}"],
    ["lipschitz", "--steps", "1", "--samples", "1", "--json", "{out}"],
    ["perturb", "{model}", "--steps", "1", "--samples", "1", "--json", "{out}"],
    ["report", "-o", "{out}", "--lower-steps", "0"],
])
def test_cli_refuses_longer_sequences(llama_dir, tmp_path, capsys, command) -> None:  # noqa: ANN001
    """``--seq-len P + 1``: one line, exit 2, nothing written; ``--seq-len P``: exit 0."""
    out = tmp_path / ("r.html" if command[0] == "report" else "r.json")
    args = [command[0], str(llama_dir)] + [a.format(out=out, model=llama_dir) for a in command[1:]] + ["--quiet"]
    assert main(args + ["--seq-len", str(P + 1)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"longer than the {P} tokens" in err, err
    assert not out.exists()
    assert main(args + ["--seq-len", str(P)]) == 0
    assert out.exists()


def test_defaults_shrink_to_the_limit(llama_dir, tmp_path) -> None:  # noqa: ANN001
    """``bound`` and ``report`` default to 128 tokens; a model covering fewer gets its own limit, said in the output."""
    out = tmp_path / "b.json"
    assert main(["bound", str(llama_dir), "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["seq_len"] == P
    html = tmp_path / "r.html"
    assert main(["report", str(llama_dir), "-o", str(html), "--lower-steps", "0", "--quiet"]) == 0
    assert f"T = {P})" in html.read_text()


def test_perturb_checks_both_models(llama_dir, tmp_path, capsys) -> None:  # noqa: ANN001
    """Red team 197: ``perturb A B`` checked T against A only, so a B covering fewer tokens passed in one order."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=64, max_position_embeddings=4 * P)
    longer = tmp_path / "llama64"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(longer, safe_serialization=True)
    capsys.readouterr()
    for a, b in ((longer, llama_dir), (llama_dir, longer)):
        assert main(["perturb", str(a), str(b), "--seq-len", str(2 * P), "--steps", "1", "--samples", "1",
                     "--quiet"]) == 2
        assert f"longer than the {P} tokens" in capsys.readouterr().err
    with pytest.raises(Exception, match=f"longer than the {P} tokens"):
        perturbation_lower(load(longer).to_torch(), load(llama_dir).to_torch(), seq_len=P + 1, n_samples=1,
                           n_steps=0)


def test_every_default_shrinks_to_a_short_model(tmp_path, capsys) -> None:  # noqa: ANN001
    """Red team 197: with 3 positions, ``lipschitz`` (default 8 tokens) and ``report`` (its lower search's 4) were
    refused for a T the user never gave, and ``transcover.bound()`` kept 128 where the CLI shrank it."""
    import transcover

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    d = tmp_path / "gpt2_3"
    transformers.GPT2Model(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=3,
                                                   vocab_size=20)).save_pretrained(d, safe_serialization=True)
    capsys.readouterr()
    assert main(["lipschitz", str(d), "--steps", "1", "--samples", "1", "--quiet"]) == 0
    assert main(["perturb", str(d), str(d), "--steps", "1", "--samples", "1", "--quiet"]) == 0
    assert main(["report", str(d), "-o", str(tmp_path / "r.html"), "--quiet", "--lower-steps", "1"]) == 0
    assert transcover.bound(d).seq_len == 3
    assert transcover.lipschitz(d, samples=1, steps=1) is not None
    with pytest.raises(Exception, match="longer than the 3 tokens"):
        transcover.bound(d, seq_len=4)


def test_api_refuses_longer_sequences(llama_dir) -> None:  # noqa: ANN001
    """The library functions that state a number for T tokens refuse T beyond the limit themselves."""
    spec = load(llama_dir).to_torch()
    with pytest.raises(Exception, match="longer than the 16 tokens"):
        model_bound(spec, seq_len=P + 1)
    bounds = lipschitz_bounds(spec)
    with pytest.raises(Exception, match="longer than the 16 tokens"):
        lipschitz_lower(spec, bounds, seq_len=P + 1, n_samples=1, n_steps=0)
    with pytest.raises(Exception, match="longer than the 16 tokens"):
        perturbation_lower(spec, spec, seq_len=P + 1, n_samples=1, n_steps=0)
    assert model_bound(spec, seq_len=P).seq_len == P
