"""Red team 214: the Ray backend and the scale options.

F1 a relative model path travelled to the workers as typed and was opened in *their* working folder (a ``ray start``
cluster's): another model's numbers were certified and stored under the driver's key.  F2 an address that accepts TCP
but is no Ray hung ``ray.init`` for 7+ minutes.  F3 a local Ray joined any ``ray start`` cluster of the host and then
refused ``num_cpus``.  F5 each local Ray left its session folder in /tmp/ray.  F6 ``--resume``/``--no-resume`` without
``--store`` and ``--backend serial --workers 2`` were accepted and ignored.  F7 Monte-Carlo and analyze keys left out
the threads the outputs depend on.
"""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from transcover import InputError
from transcover.cli import main
from transcover.empirical import NormRadii, random_inputs
from transcover.model import ReferenceConfig
from transcover.scale import Item, sweep
from transcover.scale._analyze import analysis_items, analyze_item
from transcover.scale._local import local_example, local_items
from transcover.scale._montecarlo import local_class_chunk, monte_carlo_local, reference_items
from transcover.scale._synthetic import write_gpt2_checkpoint

SRC = str(Path(__file__).resolve().parents[2] / "src")
OPTIONS = {"arch": None, "allow_pickle": False, "fast": False, "rtol": 1e-3, "embeddings": True}
FOREIGN = "not the ones the driver fingerprinted"


@pytest.fixture()
def two_folders(tmp_path):
    """Two folders, each with a different model at the same relative path ``m`` (the driver's and a worker's)."""
    for name, seed in (("driver", 7), ("worker", 5)):
        write_gpt2_checkpoint(tmp_path / name / "m", d=16, layers=1, heads=2, vocab=32, positions=8, seed=seed)
    return tmp_path / "driver", tmp_path / "worker"


def test_analyze_payload_is_absolute_and_a_foreign_file_is_refused(two_folders, monkeypatch):
    """F1: the payload names the driver's file by its absolute path, so a worker in another folder computes on the
    user's model; a payload whose path reaches other files there (another node, another folder) is refused."""
    driver, worker = two_folders
    monkeypatch.chdir(driver)
    items = analysis_items(["m"], OPTIONS)
    assert items[0].payload["model"] == str(driver / "m") and items[0].label == "m"
    mine = analyze_item(items[0].payload)
    monkeypatch.chdir(worker)  # the worker's working folder: its own ./m is another model
    assert sweep(items, analyze_item).results[0].value == mine
    assert analyze_item({**items[0].payload, "model": str(worker / "m"), "files": None}) != mine
    with pytest.raises(InputError, match=FOREIGN):
        analyze_item({**items[0].payload, "model": "m"})  # the path as typed, opened in the worker's folder
    report = sweep([Item(items[0].key, "m", {**items[0].payload, "model": "m"})], analyze_item)
    assert not report.results[0].ok and FOREIGN in report.results[0].value  # one failed item, nothing stored


def test_local_payload_is_absolute_and_a_foreign_file_is_refused(two_folders, monkeypatch):
    """F1 for ``lipschitz --data``: one sequence per item, the model loaded by the worker."""
    driver, worker = two_folders
    monkeypatch.chdir(driver)
    seqs = [torch.randn(3, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)]
    item = local_items("m", seqs, [1e-2], lower=False)[0]
    assert item.payload["model"] == str(driver / "m")
    mine = local_example(item.payload)
    monkeypatch.chdir(worker)
    assert local_example(item.payload) == mine
    with pytest.raises(InputError, match=FOREIGN):
        local_example({**item.payload, "model": "m"})


def test_local_class_payload_is_absolute_and_a_foreign_file_is_refused(two_folders, monkeypatch):
    """F1 for ``cover local``: chunks of perturbed models, the model loaded by the worker."""
    driver, worker = two_folders
    monkeypatch.chdir(driver)
    seen = []
    X = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    monte_carlo_local("m", {"W_1": 0.05}, X, 4, [0.1], chunk=4, on_result=seen.append)
    payload = seen[0].item.payload
    assert payload["model"] == str(driver / "m")
    monkeypatch.chdir(worker)
    with pytest.raises(InputError, match=FOREIGN):
        local_class_chunk({**payload, "model": "m"})


def test_the_worker_check_holds_for_one_file_seen_from_another_node(two_folders, monkeypatch):
    """Note [worker check]: nodes that mount one shared file see other paths, devices and inodes, which the quick key
    hashes; the worker compares the portable fingerprint (name, size, mtime, header), so the same bytes with the same
    mtime elsewhere pass, and another model at the same path does not."""
    import shutil

    from transcover.scale._keys import fingerprint, worker_fingerprint

    driver, worker = two_folders
    monkeypatch.chdir(driver)
    item = analysis_items(["m"], OPTIONS)[0]
    mirror = worker / "mirror"
    shutil.copytree(driver / "m", mirror, copy_function=shutil.copy2)  # same bytes and mtimes, another inode
    assert fingerprint(str(mirror)) != item.payload["fingerprint"]
    assert worker_fingerprint(str(mirror)) == item.payload["files"]
    there, here = analyze_item({**item.payload, "model": str(mirror)}), analyze_item(item.payload)
    assert {k: v for k, v in there.items() if k != "model"} == {k: v for k, v in here.items() if k != "model"}
    with pytest.raises(InputError, match=FOREIGN):
        analyze_item({**item.payload, "model": str(worker / "m")})


def test_threads_are_part_of_the_keys():
    """F7: chunk outputs and analyze rows are computed with ``threads`` BLAS/torch threads, which may change the last
    bits; a store filled at one thread count must not be reused at another."""
    cfg = ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8, head_hidden=(8,))
    X = random_inputs(2, 2, 8, seed=1)
    one, two = (reference_items(cfg, NormRadii(), X, 300, threads=t) for t in (1, 2))
    assert not {it.key for it in one} & {it.key for it in two}
    assert [it.key for it in one] == [it.key for it in reference_items(cfg, NormRadii(), X, 300, threads=1)]
    assert (analysis_items(["nowhere"], OPTIONS, threads=1)[0].key
            != analysis_items(["nowhere"], OPTIONS, threads=2)[0].key)


def test_local_class_keys_follow_threads(tmp_path):
    model = write_gpt2_checkpoint(tmp_path / "m", d=16, layers=1, heads=2, vocab=32, positions=8, seed=1)
    X = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    keys = {}
    for t in (1, 2):
        seen = []
        monte_carlo_local(str(model), {"W_1": 0.05}, X, 4, [0.1], chunk=4, threads=t, on_result=seen.append)
        keys[t] = seen[0].item.key
    assert keys[1] != keys[2]


def test_resume_without_store_and_serial_with_workers_are_refused(tmp_path, capsys, monkeypatch):
    """F6: one line, exit 2, before any work, in every command with the shared options (as ``experiment staged``)."""
    monkeypatch.chdir(tmp_path)
    m = write_gpt2_checkpoint(tmp_path / "m", d=16, layers=1, heads=2, vocab=32, positions=8, seed=1)
    np.save(tmp_path / "emb.npy", np.zeros((1, 3, 16)))
    ref = ["cover", "reference", "--functions", "10", "--samples", "2", "--quiet"]
    for argv, needle in (
            ([*ref, "--no-resume"], "--no-resume applies to the results store"),
            ([*ref, "--resume"], "--resume applies to the results store"),
            (["cover", "local", str(m), "--no-resume", "--quiet"], "--no-resume applies to the results store"),
            (["lipschitz", str(m), "--data", "emb.npy", "--no-resume"], "--no-resume applies to the results store"),
            (["lipschitz", str(m), "--data", "emb.npy", "--resume"], "--resume applies to the results store"),
            (["lipschitz", str(m), "--resume"], "--resume applies to the sequences of --data"),
            (["analyze", str(m), "--resume"], "--resume applies to a sweep"),
            ([*ref, "--backend", "serial", "--workers", "2"], "--backend serial runs every item in this process"),
            (["lipschitz", str(m), "--data", "emb.npy", "--backend", "serial", "--workers", "2"],
             "--workers 2 needs --backend local or process")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["emb.npy", "m"]  # no store, no output


@pytest.fixture()
def silent_port():
    """A local port that accepts TCP connections and never says a word (no Ray behind it)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.5)
    conns, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    for c in conns:
        c.close()
    srv.close()


def test_an_address_that_is_not_ray_is_one_line_within_the_deadline(silent_port):
    """F2: ``ray.init`` retried such a port for 7+ minutes, a warning every few seconds, deaf to SIGTERM; now the join
    is tried in a child process with a deadline (30 s by default, here the variable's 6 s: what is tested is that the
    deadline holds, not its length; the default's message is the same f-string) and refused in one line (exit 2)."""
    pytest.importorskip("ray")
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "RAY_AUTH_MODE": "disabled", "HOME": os.environ.get("HOME", "/tmp"), "TRANSCOVER_RAY_CONNECT_TIMEOUT": "6"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "transcover", "cover", "reference", "--functions", "10",
                               "--samples", "2", "--quiet", "--backend", "ray", "--ray-address",
                               f"127.0.0.1:{silent_port}"], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the join did not give up within 60 s")
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert f"cannot join the Ray cluster at 127.0.0.1:{silent_port}: no Ray answered within 6 s" in proc.stderr


def test_local_ray_ignores_a_running_cluster_and_keeps_no_session_files(tmp_path, monkeypatch):
    """F3 and F5: a ``ray start`` cluster's address (in ``<ray temp>/ray_current_cluster``) made ``ray.init(num_cpus=N)``
    join it and refuse num_cpus; and every local Ray left a session folder (drwxrwxrwx inside) in the Ray temp
    folder.  Now ``address="local"`` starts a new instance whose session lives in a private folder, removed after."""
    pytest.importorskip("ray")
    from transcover.scale import _backends

    raytmp = tmp_path / "raytmp"
    (raytmp / "ray").mkdir(parents=True)
    (raytmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # what `ray start` leaves for the host
    monkeypatch.setenv("RAY_TMPDIR", str(raytmp))  # where Ray looks for it, and puts sessions by default
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    made = []
    real = getattr(_backends, "_private_temp_dir", None)
    if real is not None:
        monkeypatch.setattr(_backends, "_private_temp_dir", lambda: made.append(real()) or made[-1])
    out = list(_backends.run_backend("ray", abs, [(0, -1), (1, -2)], workers=1))
    assert sorted((i, o.ok, o.value) for i, o in out) == [(0, True, "1"), (1, True, "2")]
    assert os.listdir(raytmp / "ray") == ["ray_current_cluster"]  # no session folder where Ray keeps them
    assert len(made) == 1 and not os.path.exists(made[0])  # the private one is gone
