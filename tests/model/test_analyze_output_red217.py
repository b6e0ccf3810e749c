"""What ``analyze`` prints and writes says what it is (red team 217): the embeddings' checkpoint tensors in the
JSON, the --fast caption naming the entries still certified (the gap printed is theirs), and the per-head table's
``B_KQ with b_Q`` column showing both ends, as its title says."""

from __future__ import annotations

import json
import re

import pytest

from transcover.cli import main


@pytest.fixture(scope="module")
def gpt2_dir(transformers_mod, tmp_path_factory):
    import torch

    torch.manual_seed(0)
    cfg = transformers_mod.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=8)
    model = transformers_mod.GPT2Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()  # a query bias (the B_KQ with b_Q column) and nonzero B_b1, B_b2
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return path


def test_embeddings_name_their_tensors(gpt2_dir, tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(["analyze", str(gpt2_dir), "--quiet", "--json", str(out)]) == 0
    capsys.readouterr()
    tensors = {e["name"]: e["tensor"] for e in json.loads(out.read_text())["embeddings"]}
    assert tensors == {"token_embedding": "wte.weight", "position_embedding": "wpe.weight"}


def test_fast_caption_names_the_certified_entries_its_gap_belongs_to(gpt2_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    out = tmp_path / "f.json"
    assert main(["analyze", str(gpt2_dir), "--fast", "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Lanczos ESTIMATES (--fast): not certified, except B_b1, B_b2: certified intervals; largest relative " \
           "gap" in text
    layers = json.loads(out.read_text())["layers"]
    assert all(layer[k]["kind"] == "certified interval" for layer in layers for k in ("B_b1", "B_b2"))
    assert all(layer[k]["kind"] == "estimate" for layer in layers for k in ("B_KQ", "B_V", "W_O", "B_W1", "B_W2"))
    gap = max((layer[k]["upper"] - layer[k]["lower"]) / layer[k]["upper"] for layer in layers for k in ("B_b1", "B_b2")
              if layer[k]["upper"] > 0)
    assert re.search(r"largest relative gap (\S+) \(target", text).group(1) == f"{gap:.1e}"


def test_heads_table_shows_both_ends_of_b_kq_with_b_q(gpt2_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["analyze", str(gpt2_dir), "--heads"]) == 0
    out = capsys.readouterr().out
    assert "per head (lower … upper)" in out and "B_KQ with b_Q" in out
    rows = [line for line in out.splitlines() if "…" in line and "per head" not in line]
    assert len(rows) == 2 and all(row.count("…") == 4 for row in rows), rows  # the bias column's included
