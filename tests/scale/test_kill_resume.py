"""SIGKILL a sweep half-way, re-run it: no finished item lost, none repeated (issue 14, item 3)."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from transcover.scale._synthetic import write_gpt2_checkpoint

SRC = str(Path(__file__).resolve().parents[2] / "src")
N = 16

SCRIPT = textwrap.dedent('''
    import os, sys, time
    from transcover.scale import Item, ResultStore, sweep

    def slow(payload):
        # computation log: one fsync'd line per item whose computation *finished* in this process
        time.sleep(0.15)
        with open(payload["log"], "a") as f:
            f.write(payload["key"] + "\\n")
            f.flush()
            os.fsync(f.fileno())
        return {"square": payload["i"] ** 2}

    if __name__ == "__main__":
        store, log, backend = sys.argv[1], sys.argv[2], sys.argv[3]
        items = [Item(f"k{i:02d}", f"item {i}", {"i": i, "key": f"k{i:02d}", "log": log}) for i in range(%d)]
        with ResultStore(store) as s:
            report = sweep(items, slow, store=s, backend=backend, workers=2)
        print(report.computed, report.reused, len(report.failed))
''' % N)


def _committed(store: Path) -> set[str]:
    if not store.exists():
        return set()
    try:
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
        try:
            return {r[0] for r in db.execute("SELECT key FROM results")}
        finally:
            db.close()
    except sqlite3.OperationalError:  # not created yet
        return set()


def _kill_when(proc: subprocess.Popen, store: Path, at_least: int, timeout: float = 300) -> set[str]:
    """SIGKILL the sweep's whole process group once ``at_least`` items are committed."""
    t0 = time.time()
    while len(_committed(store)) < at_least:
        assert proc.poll() is None, "the sweep ended before it could be killed"
        assert time.time() - t0 < timeout
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return _committed(store)


@pytest.mark.parametrize("backend", ["serial", "process"])
def test_sigkill_then_resume_loses_nothing_and_repeats_nothing(tmp_path, backend):
    script, store = tmp_path / "sweep_script.py", tmp_path / "s.sqlite"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(script), str(store)]
    proc = subprocess.Popen([*cmd, str(tmp_path / "log1"), backend], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finished = _kill_when(proc, store, at_least=N // 3)
    proc.stdout.close()
    proc.stderr.close()
    assert N // 3 <= len(finished) < N  # really killed half-way
    out = subprocess.run([*cmd, str(tmp_path / "log2"), backend], env=env, capture_output=True, text=True, check=True)
    computed, reused, failed = map(int, out.stdout.split())
    recomputed = set((tmp_path / "log2").read_text().split())
    assert not recomputed & finished  # 0 repeated
    assert (computed, reused, failed) == (N - len(finished), len(finished), 0)
    final = _committed(store)
    assert final == {f"k{i:02d}" for i in range(N)}  # 0 lost
    db = sqlite3.connect(store)
    runs = dict(db.execute("SELECT key, run FROM results"))
    db.close()
    assert len({runs[k] for k in finished}) == 1 and not {runs[k] for k in finished} & {runs[k] for k in recomputed}


def test_cli_sweep_killed_and_resumed(tmp_path):
    run = tmp_path / "run"
    for step in range(1, N + 1):
        write_gpt2_checkpoint(run / f"checkpoint-{step * 10}", d=32, layers=2, heads=2, vocab=64, positions=16, seed=step)
    store = tmp_path / "s.sqlite"
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "transcover.cli", "analyze", str(run), "--store", str(store), "--workers", "2",
           "--quiet"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finished = _kill_when(proc, store, at_least=3)
    assert len(finished) < N
    out = subprocess.run([*cmd, "--json", str(tmp_path / "o.json")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"{N - len(finished)} computed, {len(finished)} reused from the store, 0 failed" in out.stderr
    assert len(_committed(store)) == N
