"""Snapshot every command's JSON output, to check that a refactor changes no number.

    python scripts/spine_snapshot.py OUT_DIR          # run the commands, write OUT_DIR/*.json
    python scripts/spine_snapshot.py --diff A B        # compare two snapshots, exit 1 on a change

The commands run on the bundled all-MiniLM-L6-v2 and on random-weight GPT-2 models built from a
``transformers`` config (fixed seeds) and saved as safetensors under ``/tmp/transcover-spine``
(the same paths for every snapshot, so the envelopes' input lists compare too). Fields that
legitimately change between runs (the command line's output path, timings) are dropped before
comparison; every number is compared exactly, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

MODELS = Path("/tmp/transcover-spine")
_VOLATILE = ("command_line", "elapsed", "seconds", "wall", "time_s", "duration")


def _gpt2(path: Path, seed: int) -> None:
    if (path / "model.safetensors").exists():
        return
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    GPT2LMHeadModel(cfg).eval().save_pretrained(path, safe_serialization=True)


def _points(path: Path) -> None:
    if path.exists():
        return
    import numpy as np

    rng = np.random.default_rng(0)
    np.save(path, rng.standard_normal((40, 6, 2)).astype(np.float64))


def commands(out: Path) -> dict[str, list[str]]:
    g1, g2, pts = str(MODELS / "gpt2-a"), str(MODELS / "gpt2-b"), str(MODELS / "points.npy")
    return {
        "analyze_minilm": ["analyze", "--heads"],
        "analyze_gpt2": ["analyze", g1, "--heads"],
        "lipschitz_minilm": ["lipschitz", "--samples", "2", "--steps", "3", "--seed", "0"],
        "lipschitz_gpt2_fro": ["lipschitz", g1, "--metric", "fro", "--samples", "2", "--steps", "3"],
        "lipschitz_minilm_local": ["lipschitz", "--data", "sklearn-descr", "--limit", "2", "--max-len", "8",
                                   "--samples", "2", "--steps", "3"],
        "perturb_gpt2": ["perturb", g1, g2, "--samples", "2", "--steps", "3"],
        "bound_minilm": ["bound"],
        "bound_minilm_l21": ["bound", "--family", "l21", "--sigma-min", "0.04"],
        "bound_gpt2_reference": ["bound", g1, "--reference", g2],
        "cover_finite": ["cover", "finite", pts, "--eps", "0.5", "1.0"],
        "cover_reference": ["cover", "reference", "--functions", "20", "--samples", "4", "--eps", "0.1", "0.5"],
        "approx_construct": ["approx", "construct"],
        "approx_encodings": ["approx", "encodings"],
        "advise": ["advise", "--sparsity", "2", "--smoothness", "1", "--seq-len", "16", "--n-samples", "10000"],
        "train_majority": ["train", "--task", "majority", "--sparsity", "3", "--epochs", "2", "--n-train", "200", "--n-test", "100",
                         "--threads", "1", "--out", str(MODELS / "train-run")],
    }


def snapshot(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    MODELS.mkdir(parents=True, exist_ok=True)
    _gpt2(MODELS / "gpt2-a", 0)
    _gpt2(MODELS / "gpt2-b", 1)
    _points(MODELS / "points.npy")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CI": "true"}
    failed = 0
    for name, argv in commands(out).items():
        target = out / f"{name}.json"
        quiet = [] if argv[0] == "advise" else ["--quiet"]
        cmd = [sys.executable, "-m", "transcover", *argv, "--json", str(target), *quiet]
        shutil.rmtree(MODELS / "train-run", ignore_errors=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        (out / f"{name}.stdout").write_text(r.stdout + r.stderr)
        print(f"{name:28s} exit {r.returncode}")
        failed += r.returncode != 0
    return 1 if failed else 0


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if not any(s in k for s in _VOLATILE)}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _walk(a, b, path: str, diffs: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                diffs.append(f"{path}.{k}: only in {'after' if k in b else 'before'}")
            else:
                _walk(a[k], b[k], f"{path}.{k}", diffs)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{path}: length {len(a)} -> {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}[{i}]", diffs)
    elif a != b:
        diffs.append(f"{path}: {a!r} -> {b!r}")


def diff(a_dir: Path, b_dir: Path) -> int:
    bad = 0
    for fa in sorted(a_dir.glob("*.json")):
        fb = b_dir / fa.name
        if not fb.exists():
            print(f"{fa.name}: missing after")
            bad += 1
            continue
        diffs: list[str] = []
        _walk(_clean(json.loads(fa.read_text())), _clean(json.loads(fb.read_text())), "", diffs)
        # Issue 11 item 4 on purpose: every serialised interval now names its kind.
        added_kind = [d for d in diffs if d.endswith(".kind: only in after")]
        diffs = [d for d in diffs if d not in added_kind]
        note = f" (+{len(added_kind)} intervals now name their kind)" if added_kind else ""
        print(f"{fa.name:34s} {'identical' if not diffs else f'{len(diffs)} differences'}{note}")
        for d in diffs[:20]:
            print("   ", d)
        bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--diff"]:
        sys.exit(diff(Path(sys.argv[2]), Path(sys.argv[3])))
    sys.exit(snapshot(Path(sys.argv[1])))
