"""Whole-network local certified constant of all-MiniLM-L6-v2 at real sentences (issue 12, item 1).

    PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python benchmarks/local_stack.py \
        [--n 20] [--order shortest] [--rhos 1e-5,1e-4,1e-3] [--out docs/results] [--workers 2]

Per sentence (sklearn descriptions, <= 32 tokens), rho = factor x the median embedded-token norm:
the certified whole-stack constant on B(X, rho) by the exact Jacobian at X plus the telescoped drift
(``lipschitz._local_stack.stack_local``, THEORY F30) beside the product of the per-stage ball
constants, and the measured constant at the same point (``stack_lower``: the attained (2,inf) norm
of the exact Jacobian, alternating maximisation with restarts, and Adam ascent on the pair ratio in
the ball).  Ratios are per sentence (certified / measured).  Wall and CPU seconds per sentence.
``--order shortest`` takes the ``--n`` shortest of the first ``--pool`` sentences (the stack route
costs T^2 d^3 per stage).  ``--workers 2`` (default) runs the sentences in two processes of one
thread each (sentences are independent; ``local_lipschitz``'s pool and malloc tuning), and the total
wall and CPU seconds (workers included) are printed at the end.  Writes local_stack.json under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transcover._results import check_certified  # noqa: E402
from transcover.lipschitz._local_stack import MOVE_REST, SEGMENT_AUX, stack_local, stack_lower  # noqa: E402
from transcover.model import load  # noqa: E402
from transcover.model._data import load_inputs  # noqa: E402
from transcover.report import atomic_write_text  # noqa: E402

from local_lipschitz import _tune_malloc  # noqa: E402  (this script's folder is on sys.path)

_W: dict = {}


def _worker_init(lower_steps: int) -> None:
    """One worker process: one BLAS thread, its own model copy and data-free cache."""
    _tune_malloc()
    torch.set_num_threads(1)
    _W.update(spec=load(None).to_torch(torch.float64), cache={}, lower_steps=lower_steps)


def _worker_sentence(job) -> list[dict]:  # noqa: ANN001
    k, X, factors, aux, move_rest = job
    return sentence(_W["spec"], k, X, factors, _W["cache"], _W["lower_steps"], aux, move_rest)


def _prefix_drift(r) -> list[float]:  # noqa: ANN001
    """``max_i dM_{0,b,i}`` at every layer-level cut b >= 1 (THEORY F36: the prefix drift that sets the radii)."""
    return [float(r.spans[(0, b)].max()) if (0, b) in r.spans else math.inf for b in range(1, len(r.cuts))]


def sentence(spec, k: int, X, factors: list[float], cache: dict, lower_steps: int,  # noqa: ANN001
             aux: tuple = SEGMENT_AUX, move_rest: bool = MOVE_REST) -> list[dict]:
    """The certified and measured whole-network constants of one sentence at every ``rho`` factor (``aux``: THEORY
    F71c's auxiliary radii, fractions of the largest, not reported; ``move_rest``: THEORY F77's recursion of the
    move's rest, ``stack_local``'s keyword)."""
    rows = []
    X = X.double()
    med = float(X.norm(dim=1).median())
    res = stack_local(spec, X, [f * med for f in factors], keep_jacobian=True, norms=cache, aux=aux, move_rest=move_rest)
    t, c = time.perf_counter(), time.process_time()
    for f, r in zip(factors, res):
        lo = stack_lower(spec, X, r.rho, steps=lower_steps, blocks=res[0].jacobian, blocks_err=res[0].rounding)
        check_certified(f"whole-network local constant (sentence {k}, rho {f:g})", r.upper, lo)
        rows.append({"sentence": k, "T": X.shape[0], "rho_factor": f, "rho": r.rho, "median_norm": med,
                     "point": r.point, "drift": r.drift, "stack": r.stack, "product": r.product,
                     "upper": r.upper, "route": r.route, "lower": lo, "ratio": r.upper / lo,
                     "point_ratio": r.point / lo, "rounding": r.rounding, "radii": r.radii,
                     "stage_names": r.stage_names, "stage_drift": r.stage_drift, "stage_ball": r.stage_ball,
                     "drift_parts": r.parts, "drift_sub_stage": r.parts.get("(sub-stage route)"),
                     "drift_layer": r.parts.get("(layer route)"),
                     "prefix_norms": r.prefix_norms, "suffix_norms": r.suffix_norms,
                     "prefix_drift": _prefix_drift(r),
                     "seconds": r.seconds, "cpu_seconds": r.cpu_seconds, "refusals": r.refusals})
        print(f"sentence {k} T={X.shape[0]} rho {f:g}: point {r.point:.4g} (rounding {r.rounding:.2g}) "
              f"drift {r.drift:.4g} [sub-stages {r.parts.get('(sub-stage route)', float('nan')):.4g}, "
              f"layers {r.parts.get('(layer route)', float('nan')):.4g}] "
              f"stack {r.stack:.4g} product {r.product:.4g} -> {r.route}; lower {lo:.4g}; "
              f"ratio {r.upper / lo:.4g} [{r.seconds:.0f}s wall, {r.cpu_seconds:.0f}s cpu]; upper {r.upper!r}",
              flush=True)
        print("  prefix drift at the layer-level cuts: " + " ".join(f"{v:.3g}" for v in _prefix_drift(r)), flush=True)
        for line in r.refusals:  # Note [per-layer refusals]: the per-layer route gave no bound there
            print(f"  per-layer route refused: {line}", flush=True)
    lt, lc = time.perf_counter() - t, time.process_time() - c
    for row in rows:
        row["lower_seconds"], row["lower_cpu_seconds"] = lt, lc
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--pool", type=int, default=20, help="choose among the first POOL sentences")
    ap.add_argument("--order", choices=("data", "shortest"), default="data")
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--rhos", default="1e-7,1e-6,1e-5,1e-4", help="factors of the median embedded-token norm")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--lower-steps", type=int, default=20)
    ap.add_argument("--aux", default=",".join(f"{f:g}" for f in SEGMENT_AUX),
                    help="THEORY F71c: auxiliary radii, fractions of the largest (not reported; '' for none)")
    ap.add_argument("--move-rest", choices=("on", "off"), default="on" if MOVE_REST else "off",
                    help="THEORY F77: the move's rest by its own recursion at the data (exact products from every "
                         "sub-stage start, each stage's rest by F78/F79; tighter at factors 1e-5 and above, about "
                         "2x the CPU)")
    ap.add_argument("--workers", type=int, default=2,
                    help="worker processes of one thread each (1: this process, OMP_NUM_THREADS threads)")
    a = ap.parse_args()
    _tune_malloc()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    spec = load(None).to_torch(torch.float64)
    seqs = load_inputs(spec, "sklearn-descr", max_len=a.max_len, limit=max(a.pool, a.n))
    idx = list(range(len(seqs)))
    if a.order == "shortest":
        idx = sorted(idx, key=lambda k: (seqs[k].shape[0], k))
    idx = idx[: a.n]
    factors = [float(f) for f in a.rhos.split(",")]
    aux = tuple(float(f) for f in a.aux.split(",") if f)
    os.makedirs(a.out, exist_ok=True)
    t0, c0, ch0 = time.perf_counter(), time.process_time(), os.times()
    done: dict = {}

    def write(part: list[dict]) -> None:
        done[part[0]["sentence"]] = part
        rows = [r for k in idx if k in done for r in done[k]]
        atomic_write_text(os.path.join(a.out, "local_stack.json"), json.dumps({"rows": rows}, indent=1))

    if a.workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(a.workers, _worker_init, (a.lower_steps,)) as pool:
            for part in pool.imap_unordered(_worker_sentence, [(k, seqs[k], factors, aux, a.move_rest == "on") for k in idx], chunksize=1):
                write(part)
    else:
        cache: dict = {}  # the data-free constants per layer (kappa, weight norms), shared by every sentence
        for k in idx:
            write(sentence(spec, k, seqs[k], factors, cache, a.lower_steps, aux, a.move_rest == "on"))
    ch1 = os.times()  # worker processes (joined by now): their CPU seconds
    cpu = time.process_time() - c0 + (ch1.children_user - ch0.children_user) + (ch1.children_system - ch0.children_system)
    cert = sum(done[k][0]["cpu_seconds"] for k in done)
    print(f"{len(idx)} sentences, {a.workers} worker(s): {time.perf_counter() - t0:.1f}s wall, {cpu:.1f}s cpu "
          f"(stack_local {cert:.1f}s cpu)", flush=True)


if __name__ == "__main__":
    main()
