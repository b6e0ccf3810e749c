"""Local certified Lipschitz constants of all-MiniLM-L6-v2 at real sentences (issue 12, item 1).

    PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python benchmarks/local_lipschitz.py \
        [--n 150] [--whole-n 20] [--out docs/results]

Per layer and sentence, the exact-Jacobian route by rows (``lipschitz._local_rows``, no T^2 d^2
blocks): the certified weighted-row-Gram bound of the layer Jacobian at the data point and, for each
rho in {1e-5, ..., 1e-1} x (median token norm of the layer's input), the certified bound on the ball
(point + drift), with the drift split by term (where the gap sits).  The measured lower estimate is
the larger of the point lower, the attained (2,inf) norm of the exact Jacobian at the point
(alternating maximisation for the 4 tokens with the largest certified rows, started at the row
Gram's top eigenvector and at 2 random vectors, ``row_lower``; the best one re-evaluated through an
autograd JVP of the layer), and the ball lower (``_local_lower.ball_lower_sweep``, started at the
point witness: ascent of the Jacobian row norm over centres in the ball and of the pair ratio over
pairs in the ball), both values every Lipschitz constant on the ball is at least.  Wall and CPU
(user+sys) seconds of the certification are recorded per layer and sentence, the ball lower's wall
seconds apart (``lower_seconds``); ``--workers 2`` (default) runs the sentences in two
one-thread processes, and the JSON/log give the CPU of all processes and the load average.  Ratios
are per sentence (upper and lower at the same point), then the max over sentences.  The whole
network: the composed bound (``network_local``) against the Jacobian norm on ``--whole-n`` sentences.
Writes local_lipschitz.json, local_lipschitz_ratio.png and local_lipschitz.md under ``--out``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transcover._results import check_certified  # noqa: E402
from transcover.lipschitz._empirical import jacobian_operator_norm  # noqa: E402
from transcover.lipschitz._local import network_local  # noqa: E402
from transcover.lipschitz._local_attention import head_norms  # noqa: E402
from transcover.lipschitz._local_jacobian import _weight_norms, layer_jacobians  # noqa: E402
from transcover.lipschitz._local_lower import ball_lower_sweep  # noqa: E402
from transcover.model import load  # noqa: E402
from transcover.model._data import load_inputs  # noqa: E402
from transcover.model._functional import layer_forward, transformer_forward  # noqa: E402
from transcover.report import atomic_write_bytes, atomic_write_text  # noqa: E402

RHOS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def _attained(L, X, token: int, V) -> float:  # noqa: ANN001
    """``||sum_j J_ij v_j||`` for output token ``token`` through autograd (one JVP of the layer):
    the structured search's value re-evaluated independently of its factors."""
    _, dy = torch.autograd.functional.jvp(lambda Z: layer_forward(L, Z), (X,), (V,))
    return float(dy[token].norm())


def per_layer(spec, seqs, rhos, log, n_layers=None, lower_tokens=4, done=None, ball=None,  # noqa: ANN001
              norms=None, first=0, reuse=None) -> list[dict]:
    """``done(rows)`` is called after every sentence (partial results survive an interrupted run).
    ``ball``: keyword arguments of ``ball_lower_sweep`` (the lower estimate on each ball, timed apart
    from the certification), or None for the point lower only.  ``norms``: the layers' weight norms
    (computed here when None); ``first``: the index of ``seqs[0]`` (worker processes).  ``reuse``:
    ``_reused_lowers``' ball lowers of an earlier run, taken instead of a new search for every ball whose
    (sentence, layer, rho) and median token norm match exactly (the same input and centre: the same
    estimator would return the same value); the rest are searched."""
    rows = []
    layers = list(spec.layers)[:n_layers]
    norms = [(_weight_norms(L), head_norms(L.attention)) for L in layers] if norms is None else norms
    for k, s in enumerate(seqs, start=first):
        X = spec.input_norm(s.double())
        for li, L in enumerate(layers):
            med = float(X.norm(dim=1).median())
            t, c = time.perf_counter(), time.process_time()
            ljs = layer_jacobians(L, X, [f * med for f in rhos], norms=norms[li][0], head_norms_=norms[li][1],
                                  route="rows", lower=lower_tokens, tiers=True)  # maxima only: F45's tier
            dt, dc = time.perf_counter() - t, time.process_time() - c
            tok, V = ljs[0].lower_V
            lo = _attained(L, X, tok, V)
            bl, bt = [None] * len(rhos), 0.0
            old = [(reuse or {}).get((k, li, f)) for f in rhos]
            if ball is not None and all(o is not None and o[0] == med for o in old):
                bl = [_Reused(o[1], o[1], o[2]) for o in old]
            elif ball is not None:
                t = time.perf_counter()
                kw = dict(ball)
                pair_from = kw.pop("pair_from", 0.0) * med  # a factor of the median, like the radii
                bl = ball_lower_sweep(lambda Z, L=L: layer_forward(L, Z), X, [f * med for f in rhos],
                                      init=(lo, tok, V), pair_from=pair_from, **kw)
                bt = time.perf_counter() - t
            for f, lj, b in zip(rhos, ljs, bl):
                check_certified(f"local constant of layer {li}", lj.ball, lo)
                best = lo
                if b is not None:
                    check_certified(f"local constant of layer {li} on its ball (ball lower)", lj.ball, b.value)
                    check_certified(f"local constant of layer {li} on its ball (pair ratio)", lj.ball, b.pair)
                    best = max(lo, b.value)
                rows.append({"sentence": k, "T": X.shape[0], "layer": li, "rho": f, "median_norm": med,
                             "point": lj.point, "ball": lj.ball, "point_lower": lo, "lower": best,
                             "lower_method": "point" if b is None or b.value <= lo else b.method,
                             "ratio": lj.ball / best, "ratio_point_lower": lj.ball / lo,
                             "point_ratio": lj.point / lo, "parts": lj.parts, "seconds": dt, "cpu_seconds": dc,
                             "lower_seconds": bt})
            log(f"sentence {k} (T={X.shape[0]}) layer {li}: point {ljs[0].point:.4g} lower {lo:.4g} | "
                + " ".join(f"{f:g}:{lj.ball / lo:.3g}" + (f"->{lj.ball / max(lo, b.value):.3g}" if b else "")
                           for f, lj, b in zip(rhos, ljs, bl))
                + f" [{dt:.1f}s wall, {dc:.1f}s cpu; ball lower {bt:.1f}s]")
            X = layer_forward(L, X).detach()
        if done is not None:
            done(rows)
    return rows


class _Reused:
    """A ball lower read back from an earlier run (``--lowers-from``): its value, as ``ball_lower_sweep``'s."""

    def __init__(self, value: float, pair: float, method: str) -> None:
        self.value, self.pair, self.method = value, pair, f"{method} (reused)"


def _reused_lowers(path: str | None) -> dict:
    """``{(sentence, layer, rho): (median_norm, lower, lower_method)}`` of an earlier run's JSON (empty without
    a path).  Only attained values are read (every one was checked against that run's certificate)."""
    if not path:
        return {}
    with open(path) as f:
        rows = json.load(f)["layers"]
    return {(r["sentence"], r["layer"], r["rho"]):
            (r["median_norm"], r["lower"], r["lower_method"].replace(" (reused)", "")) for r in rows}


def _tune_malloc() -> None:
    """Keep freed memory in the process (glibc): the certification allocates and frees many (T, d, d)
    float64 temporaries, and with the default thresholds each is a fresh mmap whose pages fault in
    again (measured: ~30 % of the CPU time at T = 32).  No effect on any value."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap for large blocks
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never give the heap top back
        libc.mallopt(-2, 64 << 20)  # M_TOP_PAD
    except (OSError, AttributeError):
        pass


_W: dict = {}


def _worker_init(max_len: int, n_layers, rhos, ball, reuse) -> None:  # noqa: ANN001
    """One worker process: one BLAS thread, its own model copy and weight norms."""
    _tune_malloc()
    torch.set_num_threads(1)
    spec = load(None).to_torch(torch.float64)
    layers = list(spec.layers)[:n_layers]
    _W.update(spec=spec, n_layers=n_layers, rhos=rhos, ball=ball, reuse=reuse,
              norms=[(_weight_norms(L), head_norms(L.attention)) for L in layers])


def _worker_sentence(job) -> list[dict]:  # noqa: ANN001
    k, s = job
    return per_layer(_W["spec"], [s], _W["rhos"], lambda m: print(m, flush=True), _W["n_layers"],
                     ball=_W["ball"], norms=_W["norms"], first=k, reuse=_W["reuse"])


def _run_workers(seqs, rhos, n_layers, ball, workers: int, max_len: int, done, reuse) -> list[dict]:  # noqa: ANN001
    """The sentences over ``workers`` processes of one thread each (sentences are independent);
    rows in sentence order, ``done`` after every finished sentence."""
    import multiprocessing as mp

    rows: dict = {}
    with mp.get_context("spawn").Pool(workers, _worker_init, (max_len, n_layers, rhos, ball, reuse)) as pool:
        for part in pool.imap_unordered(_worker_sentence, list(enumerate(seqs)), chunksize=1):
            rows[part[0]["sentence"] if part else len(rows)] = part
            done([r for k in sorted(rows) for r in rows[k]])
    return [r for k in sorted(rows) for r in rows[k]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--skip", type=int, default=0, help="start at this sentence")
    ap.add_argument("--whole-n", type=int, default=20)
    ap.add_argument("--layers", type=int, default=None, help="only the first LAYERS layers (a subset run)")
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--rhos", default=",".join(f"{r:g}" for r in RHOS), help="factors of the median token norm")
    ap.add_argument("--lower-steps", type=int, default=3,
                    help="centre-ascent steps per start of the ball lower estimate (0 with --lower-pair-steps 0: "
                         "point lower only)")
    ap.add_argument("--lower-pair-steps", type=int, default=2, help="pair-ratio ascent steps per start")
    ap.add_argument("--lower-pair-from", type=float, default=0.1,
                    help="the pair-ratio ascent only on balls of at least this factor of the median (on all 150 "
                         "sentences it never set the lower below 0.1; 0: every ball)")
    ap.add_argument("--workers", type=int, default=2,
                    help="worker processes of one thread each for the per-layer part (1: this process, "
                         "OMP_NUM_THREADS threads)")
    ap.add_argument("--lowers-from", default=None,
                    help="an earlier run's local_lipschitz.json: its ball lowers are reused wherever the sentence, "
                         "layer, rho and median token norm match (the certification is rerun; the lowers are "
                         "searched only where nothing matches)")
    a = ap.parse_args()
    reuse = _reused_lowers(a.lowers_from)
    _tune_malloc()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    spec = load(None).to_torch(torch.float64)
    seqs = load_inputs(spec, "sklearn-descr", max_len=a.max_len, limit=a.skip + a.n)[a.skip:]
    rhos = [float(r) for r in a.rhos.split(",")]
    t0, c0 = time.perf_counter(), time.process_time()
    ch0, load0 = os.times(), os.getloadavg()
    os.makedirs(a.out, exist_ok=True)

    def partial(rows) -> None:  # noqa: ANN001
        n_done = len({r["sentence"] for r in rows})
        atomic_write_text(os.path.join(a.out, "local_lipschitz.json"), json.dumps(
            {"n": n_done, "n_planned": len(seqs), "skip": a.skip, "partial": n_done < len(seqs),
             "wall_seconds_so_far": time.perf_counter() - t0, "cpu_seconds_so_far": time.process_time() - c0,
             "layers": rows}, indent=1))
        atomic_write_text(os.path.join(a.out, "local_lipschitz.md"), table(rows, []))

    ball = (dict(steps=a.lower_steps, restarts=0, pair_steps=a.lower_pair_steps, pair_restarts=0,
                 pair_from=a.lower_pair_from)
            if a.lower_steps > 0 or a.lower_pair_steps > 0 else None)
    if a.workers > 1:
        rows = _run_workers(seqs, rhos, a.layers, ball, a.workers, a.max_len, partial, reuse)
    else:
        rows = per_layer(spec, seqs, rhos, lambda m: print(m, flush=True), a.layers, done=partial, ball=ball,
                         reuse=reuse)
    t_layers, c_layers = time.perf_counter() - t0, time.process_time() - c0
    ch1 = os.times()  # worker processes (joined by now): their CPU seconds
    c_layers += (ch1.children_user - ch0.children_user) + (ch1.children_system - ch0.children_system)
    load1 = os.getloadavg()
    # the ball lower estimate is timed apart: the time target is for the certification
    first = [r for r in rows if r["rho"] == rows[0]["rho"]] if rows else []
    t_lower = sum(r["lower_seconds"] for r in first)
    t_cert = sum(r["seconds"] for r in first)
    print(f"per-layer certification: {t_cert:.1f}s wall ({sum(r['cpu_seconds'] for r in first):.1f}s cpu); "
          f"ball lower estimates {t_lower:.1f}s wall; whole loop {t_layers:.1f}s wall, {c_layers:.1f}s cpu "
          f"(user+sys) for {len(seqs)} sentences; {a.workers} worker(s); load average {load0[0]:.1f} -> {load1[0]:.1f}",
          flush=True)
    whole = []
    if a.whole_n > 0:
        sub = seqs[: a.whole_n]
        t = time.perf_counter()
        for f in rhos:
            for s in sub:
                lo = jacobian_operator_norm(lambda Z: transformer_forward(spec, Z, with_head=False), s, metric="2,inf",
                                            n_iter=10)[0]
                up = network_local(spec, s, f * float(s.norm(dim=1).median())).upper
                whole.append({"rho": f, "upper": up, "lower": lo, "ratio": up / lo})
        print(f"whole network: {time.perf_counter() - t:.1f}s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    atomic_write_text(os.path.join(a.out, "local_lipschitz.json"), json.dumps(
        {"n": len(seqs), "skip": a.skip, "seconds_per_layer_total": t_layers, "cpu_seconds_per_layer_total": c_layers,
         "certification_seconds": t_cert, "ball_lower_seconds": t_lower, "workers": a.workers,
         "load_average": [load0[0], load1[0]],
         "layers": rows, "network": whole},
        indent=1))
    _figure(rows, whole, os.path.join(a.out, "local_lipschitz_ratio.png"))
    atomic_write_text(os.path.join(a.out, "local_lipschitz.md"), table(rows, whole))


def table(rows, whole) -> str:  # noqa: ANN001
    n = len({r["sentence"] for r in rows})
    first = [r for r in rows if r["rho"] == rows[0]["rho"]] if rows else []
    cpu = sum(r["cpu_seconds"] for r in first)
    low = sum(r.get("lower_seconds", 0.0) for r in first)
    out = [f"{n} sentences; per-layer certification (all rho at once) {cpu:.0f} s CPU (user+sys) in all, "
           f"{cpu / max(n, 1):.1f} s per sentence (6 layers); ball lower estimates {low:.0f} s wall apart", "",
           "Lower: the best of the point lower (attained Jacobian norm at X) and the ball lower (ascent over "
           "centres and pairs in the ball, ``_local_lower``); ratio = certified ball bound / lower.", "",
           "| rho / median | layer | max ratio (ball/lower) | median ratio | max ratio vs point lower | "
           "median lower gain | max point ratio | largest drift term |",
           "|---|---|---|---|---|---|---|---|"]
    for f in sorted({r["rho"] for r in rows}):
        for li in sorted({r["layer"] for r in rows}):
            rs = [r for r in rows if r["rho"] == f and r["layer"] == li]
            worst = max(rs, key=lambda r: r["ratio"])
            term = max(worst["parts"].items(), key=lambda kv: kv[1])
            med = sorted(r["ratio"] for r in rs)[len(rs) // 2]
            pl = max(r.get("ratio_point_lower", r["ratio"]) for r in rs)
            gain = sorted(r["lower"] / r.get("point_lower", r["lower"]) for r in rs)[len(rs) // 2]
            out.append(f"| {f:g} | {li} | {worst['ratio']:.3g} | {med:.3g} | {pl:.3g} | {gain:.3g} | "
                       f"{max(r['point_ratio'] for r in rs):.3g} | {term[0]} = {term[1]:.3g} |")
    if whole:
        out += ["", "| rho / median | whole network: max composed upper / lower |", "|---|---|"]
        for f in sorted({w["rho"] for w in whole}):
            out.append(f"| {f:g} | {max(w['ratio'] for w in whole if w['rho'] == f):.3g} |")
    return "\n".join(out) + "\n"


def _figure(rows, whole, path) -> None:  # noqa: ANN001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rhos = sorted({r["rho"] for r in rows})
    for li in sorted({r["layer"] for r in rows}):
        ax.loglog(rhos, [max(r["ratio"] for r in rows if r["layer"] == li and r["rho"] == f) for f in rhos],
                  marker="o", label=f"layer {li}")
    if whole:
        wr = sorted({w["rho"] for w in whole})
        ax.loglog(wr, [max(w["ratio"] for w in whole if w["rho"] == f) for f in wr], "k--", marker="s",
                  label="whole network (composed)")
    ax.axhline(10, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("rho / median token norm")
    ax.set_ylabel("certified local upper / measured lower")
    ax.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


if __name__ == "__main__":
    main()
