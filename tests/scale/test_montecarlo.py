"""Monte-Carlo covering classes on the backends (issue 14, item 4): chunks of members as sweep items."""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from test_kill_resume import _committed, _kill_when  # the kill/resume harness of the analyze sweep

from transcover.cli import main
from transcover.empirical import NormRadii, covering_of_outputs, random_inputs
from transcover.empirical._montecarlo import block_seed, reference_block_outputs
from transcover.model import ReferenceConfig
from transcover.scale import ResultStore
from transcover.scale._montecarlo import decode_array, encode_array, monte_carlo_reference, reference_items

SRC = str(Path(__file__).resolve().parents[2] / "src")
CFG = ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8, head_hidden=(8,))
RADII = NormRadii(B_KQ=2.0, B_V=1.5)
X = random_inputs(4, 2, 8, seed=1)
EPS = [0.02, 0.05, 0.1]


def test_a_member_depends_only_on_seed_and_index():
    whole = reference_block_outputs(CFG, RADII, X, 0, 70, seed=3, block_size=16)
    pieces = torch.cat([reference_block_outputs(CFG, RADII, X, a, b, seed=3, block_size=16)
                        for a, b in ((0, 5), (5, 16), (16, 41), (41, 70))])
    assert torch.equal(whole, pieces)  # any chunking, bit for bit
    longer = reference_block_outputs(CFG, RADII, X, 0, 100, seed=3, block_size=16)
    assert torch.equal(longer[:70], whole)  # a draw of 70 is the prefix of a draw of 100
    other = reference_block_outputs(CFG, RADII, X, 0, 70, seed=4, block_size=16)
    assert not torch.equal(other, whole)
    assert len({block_seed(s, k) for s in range(4) for k in range(50)}) == 200


def test_stored_outputs_read_back_bit_for_bit():
    a = np.array([[0.1, -0.0, 5e-324], [np.finfo(float).max, 1 / 3, -2.5]])
    b = decode_array(json.loads(json.dumps(encode_array(a))))
    assert b.tobytes() == a.tobytes()


def _brute_sizes(Y, r, counts):
    flat = Y.reshape(Y.shape[0], -1).numpy()
    centres = []
    for j, y in enumerate(flat):
        if all(np.abs(y - flat[c]).max() > r for c in centres):
            centres.append(j)
    return tuple(sum(c < m for c in centres) for m in counts)


def test_serial_process_and_ray_give_the_same_class_bit_for_bit():
    kw = dict(seed=2, checkpoints=[10, 50, 90], block=16)
    serial = monte_carlo_reference(CFG, RADII, X, 90, EPS, **kw)
    coarse = monte_carlo_reference(CFG, RADII, X, 90, EPS, chunk_blocks=3, **kw)
    pool = monte_carlo_reference(CFG, RADII, X, 90, EPS, backend="process", workers=2, **kw)
    ray = monte_carlo_reference(CFG, RADII, X, 90, EPS, backend="ray", workers=2, **kw)
    assert serial.to_dict() == coarse.to_dict() == pool.to_dict() == ray.to_dict()
    # an independent route: every member's outputs in one array, a one-point-at-a-time float64 greedy
    Y = reference_block_outputs(CFG, RADII, X, 0, 90, seed=2, block_size=16)
    for e, eps in enumerate(EPS):
        assert serial.net_sizes[e] == _brute_sizes(Y, eps, [10, 50, 90])
        assert serial.packing_sizes[e] == _brute_sizes(Y, 2 * eps, [10, 50, 90])
    assert serial.to_dict() == {**covering_of_outputs(Y, EPS, checkpoints=[10, 50, 90]).to_dict(),
                                "description": serial.description, **serial.extra}


def test_resume_reuses_chunks_and_a_changed_option_recomputes(tmp_path):
    kw = dict(seed=0, block=16)
    with ResultStore(tmp_path / "s.sqlite") as store:
        seen = []
        first = monte_carlo_reference(CFG, RADII, X, 40, EPS, store=store, on_result=seen.append, **kw)
        assert [r.reused for r in seen] == [False] * 3
        seen.clear()
        again = monte_carlo_reference(CFG, RADII, X, 64, EPS, store=store, on_result=seen.append, **kw)
        # members 0..31 are the same two chunks; 32..39 was a shorter last chunk, so 32..47 is new
        assert [r.reused for r in seen] == [True, True, False, False]
        assert first.to_dict() != again.to_dict()
        assert again.to_dict() == monte_carlo_reference(CFG, RADII, X, 64, EPS, **kw).to_dict()
        seen.clear()
        monte_carlo_reference(CFG, NormRadii(B_KQ=2.0, B_V=1.25), X, 40, EPS, store=store, on_result=seen.append, **kw)
        assert not any(r.reused for r in seen)
        assert len(store) == 3 + 2 + 3


def test_items_are_keyed_by_class_samples_seed_and_range():
    base = [it.key for it in reference_items(CFG, RADII, X, 64, block=16)]
    assert len(set(base)) == 4
    for changed in (reference_items(CFG, RADII, X, 64, block=16, seed=1),
                    reference_items(CFG, RADII, X + 1e-12, 64, block=16),
                    reference_items(CFG, RADII, X, 64, block=16, radial="uniform"),
                    reference_items(CFG, RADII, X, 64, block=8)):
        assert not set(base) & {it.key for it in changed}


def _cli(*extra):
    return [sys.executable, "-m", "transcover.cli", "cover", "reference", "--functions", "3072", "--eps", "0.1",
            "0.2", "--quiet", *extra]


def test_cli_killed_half_way_and_resumed_loses_and_repeats_no_chunk(tmp_path, capsys):
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    store = tmp_path / "mc.sqlite"
    proc = subprocess.Popen(_cli("--store", str(store), "--workers", "2"), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finished = _kill_when(proc, store, at_least=3)
    assert 3 <= len(finished) < 12
    db = sqlite3.connect(store)
    before = dict(db.execute("SELECT key, run FROM results"))
    db.close()
    # the resumed run: the same command (its 2 worker processes too) from this process, where a fresh interpreter only
    # re-imported torch; what it reads of the killed run is the store
    capsys.readouterr()
    code = main(_cli("--store", str(store), "--workers", "2", "--json", str(tmp_path / "a.json"))[3:])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"chunks: {12 - len(finished)} computed, {len(finished)} reused" in err
    db = sqlite3.connect(store)
    after = dict(db.execute("SELECT key, run FROM results"))
    db.close()
    assert len(after) == 12 and set(after) == _committed(store)  # 0 lost
    assert {k: after[k] for k in before} == before  # 0 repeated: the first run's rows are untouched
    assert main(_cli("--json", str(tmp_path / "b.json"))[3:]) == 0  # one serial run, in this process

    def body(path):
        d = json.loads(path.read_text())
        d.pop("command_line")
        return d

    assert body(tmp_path / "a.json") == body(tmp_path / "b.json")  # the same as one serial run


def test_cli_ray_missing_is_one_line_and_old_workers_flag_still_means_threads(tmp_path, capsys, monkeypatch):
    # ray hidden in this process (an import of it fails, whether or not an earlier test imported it): what the fresh
    # interpreter this ran in did, without re-importing torch
    monkeypatch.setitem(sys.modules, "ray", None)
    capsys.readouterr()
    code = main(["cover", "reference", "--backend", "ray"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "pip install 'transcover[ray]'" in err
    monkeypatch.undo()
    np.save(tmp_path / "grid.npy", np.arange(4.0)[:, None])
    capsys.readouterr()  # in this process: the flag is read by the parser, no fresh interpreter (and torch) needed
    assert main(["cover", "finite", str(tmp_path / "grid.npy"), "--eps", "1", "--workers", "1", "--quiet"]) == 0
    assert "--workers is deprecated; use --threads" in capsys.readouterr().err


def test_local_class_in_chunks_equals_the_one_process_class(tmp_path):
    from transcover.empirical import monte_carlo_covering, sample_local_class
    from transcover.model import load
    from transcover.scale._montecarlo import monte_carlo_local
    from transcover.scale._synthetic import write_gpt2_checkpoint

    model = str(write_gpt2_checkpoint(tmp_path / "m", d=16, layers=1, heads=2, vocab=32, positions=8, seed=2))
    radii, eps = {"W_1": 0.05, "W_O": 0.02}, [0.003, 0.01, 0.02]
    Xs = random_inputs(3, 2, 16, seed=5)
    ref = monte_carlo_covering(sample_local_class(load(model).to_torch(), radii, 40, seed=1), Xs, eps, workers=1)
    serial, _ = monte_carlo_local(model, radii, Xs, 40, eps, seed=1, chunk=16)
    pool, _ = monte_carlo_local(model, radii, Xs, 40, eps, seed=1, chunk=7, backend="process", workers=2)
    assert ref.to_dict() == serial.to_dict() == pool.to_dict()
    # the CLI: chunks through a store (serial backend) give the JSON of the one-process path
    args = ["cover", "local", model, "--perturb", "W_1=0.05", "W_O=0.02", "--functions", "40", "--samples", "3",
            "--seq-len", "2", "--seed", "1", "--eps", *map(str, eps), "--threads", "1", "--quiet"]
    assert main([*args, "--json", str(tmp_path / "a.json")]) == 0
    assert main([*args, "--store", str(tmp_path / "s.sqlite"), "--chunk", "9", "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["rows"] == b["rows"] and a["max_abs_output"] == b["max_abs_output"]
    assert len({r["net_sizes"][-1] for r in a["rows"]}) > 1  # a class the eps tell apart, not a degenerate one
