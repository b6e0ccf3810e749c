"""Per-example local certification on the backends (issue 14): one sequence per item, resumable."""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from test_kill_resume import _committed, _kill_when  # the kill/resume harness of the analyze sweep

from transcover.cli import main
from transcover.lipschitz._local_report import local_table
from transcover.model import load
from transcover.scale import ResultStore
from transcover.scale._local import local_items, local_rows
from transcover.scale._synthetic import write_gpt2_checkpoint

SRC = str(Path(__file__).resolve().parents[2] / "src")
RHOS = [1e-3, 3e-2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A pre-norm GPT-2 and a post-norm BERT (input LayerNorm), both tiny, random, on disk."""
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("models")
    gpt2 = write_gpt2_checkpoint(root / "gpt2", d=32, layers=2, heads=2, vocab=64, positions=16, seed=1)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=16)).save_pretrained(root / "bert")
    return {"gpt2": str(gpt2), "bert": str(root / "bert")}


def _seqs(n, T=5, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T + k % 3, d, generator=g, dtype=torch.float64) for k in range(n)]


def _text(rows):
    return json.dumps([r.to_dict() for r in rows])  # NaN and repr-exact floats: a bit-for-bit comparison


@pytest.mark.parametrize("arch,relative", [("gpt2", True), ("bert", False)])  # each architecture, each radius kind
def test_items_merged_equal_local_table_bit_for_bit(models, arch, relative):
    spec = load(models[arch]).to_torch(torch.float64)
    seqs = _seqs(3, seed=len(arch))
    table = local_table(spec, seqs, RHOS, relative=relative, lower_iter=5)
    rows = local_rows(models[arch], seqs, RHOS, relative=relative, lower_iter=5)
    assert _text(rows) == _text(table)
    assert len(rows) == len(RHOS) * len({(r.layer, r.component) for r in table})


def test_process_pool_and_ray_equal_serial(models):
    seqs = _seqs(3)  # more items than workers: each backend merges out-of-order results
    serial = local_rows(models["bert"], seqs, RHOS, lower_iter=5)
    pool = local_rows(models["bert"], seqs, RHOS, lower_iter=5, backend="process", workers=2)
    ray = local_rows(models["bert"], seqs, RHOS, lower_iter=5, backend="ray", workers=2)
    assert _text(serial) == _text(pool) == _text(ray)


def test_resume_reuses_sequences_and_keys_follow_options(models, tmp_path):
    seqs = _seqs(3)
    with ResultStore(tmp_path / "s.sqlite") as store:
        seen = []
        first = local_rows(models["gpt2"], seqs[:2], RHOS, lower_iter=5, store=store)
        again = local_rows(models["gpt2"], seqs, RHOS, lower_iter=5, store=store, on_result=seen.append)
        assert [r.reused for r in seen] == [True, True, False]
        assert _text(again) == _text(local_table(load(models["gpt2"]).to_torch(torch.float64), seqs, RHOS,
                                                  lower_iter=5))
        assert _text(first) != _text(again)
    base = {it.key for it in local_items(models["gpt2"], seqs, RHOS, lower_iter=5)}
    assert len(base) == 3
    for other in (local_items(models["gpt2"], seqs, [1e-3], lower_iter=5),
                  local_items(models["gpt2"], seqs, RHOS, lower_iter=6),
                  local_items(models["bert"], seqs, RHOS, lower_iter=5),
                  local_items(models["gpt2"], [s + 1e-9 for s in seqs], RHOS, lower_iter=5)):
        assert not base & {it.key for it in other}


def test_cli_killed_half_way_and_resumed_equals_the_serial_table(models, tmp_path, capsys):
    n = 8  # killed after 3 committed: the rest (and the resume) still outnumber the 2 workers
    np.save(tmp_path / "emb.npy", np.random.default_rng(5).standard_normal((n, 6, 32)))
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    store = tmp_path / "loc.sqlite"
    base = [sys.executable, "-m", "transcover.cli", "lipschitz", models["gpt2"], "--data", str(tmp_path / "emb.npy"),
            "--rho", "1e-3,1e-2", "--rho-relative", "--steps", "10"]
    scaled = [*base, "--store", str(store), "--workers", "2"]
    proc = subprocess.Popen(scaled, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    finished = _kill_when(proc, store, at_least=3)
    assert len(finished) < n
    db = sqlite3.connect(store)
    before = dict(db.execute("SELECT key, run FROM results"))
    db.close()
    out = subprocess.run([*scaled, "--json", str(tmp_path / "a.json")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"sequences: {n - len(finished)} computed, {len(finished)} reused" in out.stderr
    db = sqlite3.connect(store)
    after = dict(db.execute("SELECT key, run FROM results"))
    db.close()
    assert len(after) == n and set(after) == _committed(store)  # 0 lost
    assert {k: after[k] for k in before} == before  # 0 repeated
    capsys.readouterr()
    # the serial run: local_table in one process (this one: no interpreter and torch import of its own), no store
    assert main([*base[3:], "--json", str(tmp_path / "b.json")]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == out.stdout  # the same table

    def body(path):
        d = json.loads(path.read_text())
        d.pop("command_line")
        return d

    assert body(tmp_path / "a.json") == body(tmp_path / "b.json")


def test_cli_ray_missing_is_one_line(models, tmp_path):
    np.save(tmp_path / "emb.npy", np.zeros((1, 3, 32)))
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    hide_ray = "import sys; sys.modules['ray'] = None; from transcover.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", hide_ray, "lipschitz", models["gpt2"], "--data",
                           str(tmp_path / "emb.npy"), "--backend", "ray"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "pip install 'transcover[ray]'" in proc.stderr


@pytest.mark.parametrize("how", ["option", "env"])
def test_unreachable_ray_cluster_is_one_line_not_a_hang(monkeypatch, how):
    """Stop 38 red team: ``--ray-address 127.0.0.1:1`` hung in ray.init's retries (killed after 120 s), and a
    RAY_ADDRESS in the environment made ray.init refuse the num_cpus passed beside it (an internal ValueError)."""
    import time

    pytest.importorskip("ray")
    from transcover import InputError
    from transcover.scale._backends import run_backend

    options = {"address": "127.0.0.1:1"} if how == "option" else {}
    if how == "env":
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    t0 = time.monotonic()
    with pytest.raises(InputError, match="cannot reach the Ray cluster at 127.0.0.1:1"):
        list(run_backend("ray", abs, [(0, -1)], workers=1, options=options))
    assert time.monotonic() - t0 < 30
