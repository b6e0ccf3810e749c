"""Probe (issue 12, THEORY F40): how much of the whole network's first-order drift the product of
norms ``||S_s|| (dJ_s / r) ||P_s||^2`` loses against the aligned trilinear quantity

    A_s = sup_{||h||, ||v|| <= 1} ||S_s D^2 f_s(x_s)[P_s h, P_s v]||_(2,inf)

per sub-stage (attention + residual, LN1, FFN + residual, LN2) and per layer, at the data point.
Empirical (float64 Adam ascent over the per-token unit spheres, restarts): a *lower* estimate of
each sup.  Also each stage's own ``sup ||D^2 f_s(x_s)[u, w]||`` and the whole network's
``sup ||D^2 F(x)[h, v]||`` (the true first-order drift of the Jacobian per unit rho).

    PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/stack_aligned_probe.py [--sentence 14]

``--reach 1e-6,1e-5`` (THEORY F44): per layer the attention sub-stage's reach ``max_k nu_k((J_att(y) - J_att(x)) P(x))``
on ``B(x, rho)`` (rho = factor x the median token norm): certified by F35's drift rows (``dJ ||P||``), certified
with F44's projections through the prefix's ellipsoids (both from ``stack_local``), and an Adam ascent of the
true quantity (``Delta = prefix(x + rho h) - prefix(x)``, ``E = P(x) v``, every token of h, v on the unit sphere).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.func import jvp

from transcover.lipschitz._local_lower import bilinear_lower
from transcover.lipschitz._local_stack import stack_local
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


def reach_table(spec, X, st, xs, factors, steps: int, restarts: int) -> None:  # noqa: ANN001
    """Per layer and rho factor: certified reach without / with F44, and the ascent of the true reach."""
    med = float(X.norm(dim=1).median())
    rhos = [f * med for f in factors]
    t0 = time.process_time()
    res = stack_local(spec, X, rhos)
    print(f"stack_local {time.process_time() - t0:.0f}s cpu; bounds", [f"{r.upper:.4g}" for r in res])
    fs = [f for _, _, f in st]
    print("layer | rho factor | F35 dJ||P|| | F44 | ascent | radius")
    for s, (nm, idx, f) in enumerate(st):
        if not nm.endswith(".attn"):
            continue
        pre, att = chain(fs[:s]), (lambda Z, f=f: f(Z))
        for fac, rho, r in zip(factors, rhos, res):
            name = f"layer {idx} attention"
            plain, used = r.reaches[name]

            def obj(h, v, rho=rho, pre=pre, att=att, s=s):  # noqa: ANN001, ANN202
                y = pre(X + rho * h)
                E = jvp(pre, (X,), (v,))[1]
                return n2inf(jvp(att, (y,), (E,))[1] - jvp(att, (xs[s],), (E,))[1])
            lo = bilinear_lower(obj, X.shape, restarts=restarts, steps=steps)
            print(f"{idx} | {fac:g} | {plain:.4g} | {used:.4g} | {lo:.4g} | {r.radii[s]:.3g}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentence", type=int, default=14)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated stage names (default: all, and the whole network)")
    ap.add_argument("--reach", default="", help="rho factors: the attention reach table (THEORY F44) only")
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
    if a.reach:
        reach_table(spec, X, st, xs, [float(v) for v in a.reach.split(",")], a.steps, a.restarts)
        return
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
