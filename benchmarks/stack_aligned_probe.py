"""Probe (issue 12, THEORY F40): how much of the whole network's first-order drift the product of
norms ``||S_s|| (dJ_s / r) ||P_s||^2`` loses against the aligned trilinear quantity

    A_s = sup_{||h||, ||v|| <= 1} ||S_s D^2 f_s(x_s)[P_s h, P_s v]||_(2,inf)

per sub-stage (attention + residual, LN1, FFN + residual, LN2) and per layer, at the data point.
Empirical (float64 Adam ascent over the per-token unit spheres, restarts): a *lower* estimate of
each sup.  Also each stage's own ``sup ||D^2 f_s(x_s)[u, w]||`` and the whole network's
``sup ||D^2 F(x)[h, v]||`` (the true first-order drift of the Jacobian per unit rho).

    PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/stack_aligned_probe.py [--sentence 14]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.func import jvp

from transcover.lipschitz._local_lower import bilinear_lower
from transcover.model import attention_forward, ffn_forward, load
from transcover.model._data import load_inputs


def sub_stages(spec):  # noqa: ANN001, ANN201
    """(name, layer index or None, function) for every sub-stage of a post-LN stack, in order."""
    out = []
    if spec.input_norm is not None:
        out.append(("input_norm", None, lambda Z, n=spec.input_norm: n(Z)))
    for ly in spec.layers:
        out.append((f"L{ly.index}.attn", ly.index, lambda Z, ly=ly: Z + attention_forward(ly.attention, Z)))
        out.append((f"L{ly.index}.ln1", ly.index, lambda Z, ly=ly: ly.norm_attn(Z)))
        out.append((f"L{ly.index}.ffn", ly.index, lambda Z, ly=ly: Z + ffn_forward(ly.ffn, Z)))
        out.append((f"L{ly.index}.ln2", ly.index, lambda Z, ly=ly: ly.norm_ffn(Z)))
    if spec.final_norm is not None:
        out.append(("final_norm", None, lambda Z, n=spec.final_norm: n(Z)))
    return out


def chain(fs):  # noqa: ANN001, ANN201
    def f(Z):  # noqa: ANN001, ANN202
        for g in fs:
            Z = g(Z)
        return Z
    return f


def n2inf(Y):  # noqa: ANN001, ANN201
    return Y.norm(dim=-1).max()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentence", type=int, default=14)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated stage names (default: all, and the whole network)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = load(None).to_torch(torch.float64)
    X = load_inputs(spec, "sklearn-descr", max_len=32, limit=20)[a.sentence].double()
    st = sub_stages(spec)
    fs = [f for _, _, f in st]
    xs = [X]
    with torch.no_grad():
        for f in fs:
            xs.append(f(xs[-1]))
    groups = [("input_norm", 0, 1)] + [(f"layer{ly.index}", 1 + 4 * k, 5 + 4 * k) for k, ly in enumerate(spec.layers)]
    items = [(nm, s, s + 1) for s, (nm, _, _) in enumerate(st)] + groups[1:]
    shape = X.shape
    t0 = time.process_time()
    whole = chain(fs)
    d2 = lambda f, x, u, w: jvp(lambda z: jvp(f, (z,), (w,))[1], (x,), (u,))[1]  # noqa: E731
    only = set(filter(None, a.only.split(",")))
    if not only:
        full = bilinear_lower(lambda h, v: n2inf(d2(whole, X, h, v)), shape, restarts=a.restarts, steps=a.steps)
        print(f"sentence {a.sentence} T={X.shape[0]}: whole network sup||D2F(x)[h,v]|| >= {full:.4g}", flush=True)
    print("stage | aligned A = sup||S D2f[Ph,Pv]|| | local sup||D2f[u,w]|| | cpu")
    for nm, s, e in items:
        if only and nm not in only:
            continue
        f, pre, suf = chain(fs[s:e]), chain(fs[:s]), chain(fs[e:])
        P = lambda h: jvp(pre, (X,), (h,))[1]  # noqa: E731
        S = lambda q: jvp(suf, (xs[e],), (q,))[1]  # noqa: E731
        A = bilinear_lower(lambda h, v: n2inf(S(d2(f, xs[s], P(h), P(v)))), shape, restarts=a.restarts, steps=a.steps)
        loc = bilinear_lower(lambda h, v: n2inf(d2(f, xs[s], h, v)), shape, restarts=a.restarts, steps=a.steps)
        print(f"{nm} | {A:.4g} | {loc:.4g} | cpu {time.process_time() - t0:.0f}s", flush=True)

if __name__ == "__main__":
    main()
