"""A sweep of >= 20 checkpoints: 1 worker vs 2 workers, and SIGKILL half-way then resume (issue 14).

The checkpoints are random-weight GPT-2 models built from ``transformers`` configurations and saved
as safetensors (``save_pretrained``), laid out as a training run: ``RUN/checkpoint-<step>``.  Each
measurement is a whole ``transcover analyze RUN --workers N`` command with a fresh results store.
Then the 2-worker sweep is SIGKILLed (its whole process group) once a third of the items are
committed, and re-run: the report counts the items lost (committed before the kill, missing after)
and repeated (recomputed although committed).  The load average is printed with the timings: on a
shared machine the speed-up understates what idle cores give.

    PYTHONPATH=src python benchmarks/bench_sweep.py [--n 24] [--d 256] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def make_run(root: Path, n: int, d: int, layers: int, vocab: int) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=d, n_layer=layers, n_head=max(1, d // 64), vocab_size=vocab, n_positions=256,
                        bos_token_id=0, eos_token_id=0)
    for k in range(n):
        torch.manual_seed(k)
        GPT2LMHeadModel(config).save_pretrained(root / f"checkpoint-{(k + 1) * 100}", safe_serialization=True)


def committed(store: Path) -> set[str]:
    try:
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
        try:
            return {r[0] for r in db.execute("SELECT key FROM results")}
        finally:
            db.close()
    except sqlite3.OperationalError:
        return set()


def analyze_cmd(run: Path, store: Path, workers: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "transcover.cli", "analyze", str(run), "--store", str(store),
            "--workers", str(workers), "--quiet", *extra]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20, help="checkpoints (default 20)")
    # about 1.3 s of work per checkpoint on one core: with tiny checkpoints (d=256, 6 layers: 0.3 s each)
    # the workers' start-up (spawn, imports) is a visible share and 2 workers measured 1.58x, not ~2x
    p.add_argument("--d", type=int, default=512, help="width (default 512)")
    p.add_argument("--layers", type=int, default=8, help="layers (default 8)")
    p.add_argument("--vocab", type=int, default=8000)
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=SRC, OMP_NUM_THREADS="1")
    tmp = Path(tempfile.mkdtemp(prefix="tc_sweep_", dir="/tmp"))
    try:
        run = tmp / "run"
        t0 = time.perf_counter()
        make_run(run, args.n, args.d, args.layers, args.vocab)
        print(f"{args.n} GPT-2 checkpoints (d={args.d}, {args.layers} layers, vocab {args.vocab}) "
              f"written in {time.perf_counter() - t0:.0f} s")
        times, outputs = {}, {}
        for workers in (1, 2):
            load = os.getloadavg()[0]
            out = tmp / f"w{workers}.json"
            t0 = time.perf_counter()
            subprocess.run(analyze_cmd(run, tmp / f"w{workers}.sqlite", workers, "--json", str(out)), env=env,
                           check=True, stderr=subprocess.DEVNULL)
            times[workers] = time.perf_counter() - t0
            outputs[workers] = json.loads(out.read_text())["rows"]
            print(f"workers={workers}: {times[workers]:.1f} s ({times[workers] / args.n:.2f} s per checkpoint), "
                  f"load average before {load:.1f} on {os.cpu_count()} CPUs")
        print(f"speed-up 2 workers vs 1: {times[1] / times[2]:.2f}x (target >= 1.8x on 2 idle cores); "
              f"rows identical: {outputs[1] == outputs[2]}")

        store = tmp / "kill.sqlite"
        proc = subprocess.Popen(analyze_cmd(run, store, 2), env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while len(committed(store)) < args.n // 3 and proc.poll() is None:
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        before = committed(store)
        res = subprocess.run(analyze_cmd(run, store, 2), env=env, capture_output=True, text=True)
        after = committed(store)
        summary = [line for line in res.stderr.splitlines() if line.startswith("sweep:")]
        lost = len(before - after)
        reused = sum(1 for line in res.stderr.splitlines() if "] reused " in line)
        repeated = len(before) - reused
        print(f"SIGKILL after {len(before)}/{args.n} committed; resume: {summary[0] if summary else res.stderr[-300:]}")
        print(f"kill/resume: {lost} lost, {repeated} repeated, {len(after)}/{args.n} in the store, exit {res.returncode}")
        return 0 if (lost == 0 and repeated == 0 and len(after) == args.n and res.returncode == 0) else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
