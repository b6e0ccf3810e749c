"""THEORY F84 (measured, not wired): the attention stage's Taylor rest by F82's positive semi-definite majorant with the
segment's corrections, against F78d, F81 and the attained rest, on the stack route's own attention stages.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/attn_psd_rest.py --sentence 14 --layers 4 \
        --rhos 1e-5,1e-4

Runs ``stack_local`` (move rest on, F71c's auxiliary radii) with ``_local_stack._attention_rest`` wrapped: at every
attention stage and reported radius it evaluates F84's row (``_local_attn_psd.psd_rest_rows``; before it was wired the measured table of docs/theory.md F84 came from
this script with a prototype of it; since then "kept" includes F84, so kept/F84 is 1 where F84 binds), the same row
with its low-rank part through the prefix's blocks (F85, ``Bp=``; the "F84" column is the ellipsoid route without them),
F81 (``joint_rest_rows``), F78d (``piecewise_rest_rows``, recomputed) and the kept row, and an attained value
(projected float64 Adam over the move set ``{P-hat delta + e}``, ``--restarts`` x ``--steps`` per query, of the exact
rest ``A(x + D) - A(x) - A'(x) D``).  Prints per stage and radius the max over queries of each and the factors.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import Tensor

import transcover.lipschitz._local_stack as _ls
from transcover.lipschitz._local_attn_psd import psd_rest_rows
from transcover.lipschitz._local_attn_rest import joint_rest_rows, piecewise_rest_rows
from stack_prefix import sentence_spec  # benchmarks/ is the script's directory



_CTX: dict = {}


def attention_forward64(heads, wqa: list) -> callable:  # noqa: ANN001
    """``A(X)`` up to constants (biases of values and output drop in the rest), float64."""
    def A(X: Tensor) -> Tensor:
        T = X.shape[0]
        Xa = torch.cat([X, torch.ones(T, 1, dtype=torch.float64)], dim=1)
        out = 0
        for (P0, Y, q, Wq, Wk, Wv, Wo), Wqa in zip(heads, wqa):
            s = _CTX["scale"] * (Xa @ Wqa) @ (X @ Wk).T
            out = out + torch.softmax(s, dim=-1) @ (X @ Wv) @ Wo
        return out
    return A


def attained(A, x: Tensor, blocks: Tensor, rho: float, Ef: Tensor, restarts: int, steps: int, seed: int = 0) -> Tensor:  # noqa: ANN001
    """(T,) per query the largest ``||R_i||`` found by projected Adam over ``Delta = P-hat delta + e``."""
    T, d = x.shape
    Tin = blocks.shape[1]
    g = torch.Generator().manual_seed(seed)
    best = torch.zeros(T, dtype=torch.float64)

    def rest(v: Tensor, w: Tensor) -> Tensor:
        D = torch.einsum("jmab,mb->ja", blocks, rho * v) + Ef[:, None] * w
        _, jv = torch.func.jvp(A, (x,), (D,))
        return A(x + D) - A(x) - jv

    for i in range(T):
        for _ in range(restarts):
            v = torch.randn(Tin, blocks.shape[3], generator=g, dtype=torch.float64)
            w = torch.randn(T, d, generator=g, dtype=torch.float64)
            v = (v / v.norm(dim=1, keepdim=True)).requires_grad_()
            w = (w / w.norm(dim=1, keepdim=True)).requires_grad_()
            opt = torch.optim.Adam([v, w], lr=0.1)
            for _ in range(steps):
                opt.zero_grad()
                val = rest(v, w)[i].norm()
                best[i] = max(float(best[i]), float(val.detach()))
                (-val).backward()
                opt.step()
                with torch.no_grad():
                    v /= v.norm(dim=1, keepdim=True).clamp(min=1.0)
                    w /= w.norm(dim=1, keepdim=True).clamp(min=1.0)
            with torch.no_grad():
                best[i] = max(float(best[i]), float(rest(v, w)[i].norm()))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentence", type=int, default=14)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rhos", default="1e-5,1e-4")
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--grid", default="1,1", help="a0,b0 pairs separated by ';' (every pair valid, min kept)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec, X, med = sentence_spec(a.sentence, a.layers)
    factors = [float(f) for f in a.rhos.split(",")]
    targets = {f * med: f for f in factors}
    grid = [tuple(float(v) for v in p.split(",")) for p in a.grid.split(";")]
    blocks_of: dict = {}
    Inner = _ls.AttentionAligned

    class Keep(Inner):
        def __init__(self, parts: dict, blocks: Tensor) -> None:
            super().__init__(parts, blocks)
            blocks_of[id(self)] = blocks

    _ls.AttentionAligned = Keep
    inner, rows, cpu = _ls._attention_rest, [], {"psd": 0.0, "psde": 0.0, "adam": 0.0}

    def wrapped(st, at, k, rho, E, r, pad):  # noqa: ANN001, ANN202
        R = inner(st, at, k, rho, E, r, pad)
        f = next((v for key, v in targets.items() if abs(key - rho) <= 1e-12 * key), None)
        if f is None or at.aa is None:
            return R
        aa = at.aa
        heads, wqa = aa.p["heads"], aa.p["Wqa"]
        _CTX.update(scale=aa.p["scale"])
        c0 = time.process_time()
        new = torch.stack([psd_rest_rows(at.forms, heads, wqa, st.x, aa.Qs, aa.eQ, rho, E, at.eP, pad, ((a0, b0),))
                           for a0, b0 in grid]).min(dim=0).values
        cpu["psd"] += time.process_time() - c0
        c0 = time.process_time()
        newe = torch.stack([psd_rest_rows(at.forms, heads, wqa, st.x, aa.Qs, aa.eQ, rho, E, at.eP, pad, ((a0, b0),),
                                          Bp=blocks_of[id(aa)]) for a0, b0 in grid]).min(dim=0).values
        cpu["psde"] += time.process_time() - c0
        f81 = joint_rest_rows(at.forms, rho, E, at.eP, pad)

        def rows_at(t: float) -> tuple[Tensor, Tensor]:
            rt = t * r + 2 * pad
            djt, _, _, hdt = st.bounds(rt)
            alt, _ = aa.drift(rt, t * rho, at.dPm[k], at.eP, pad, hdt)
            djt = _ls._nan_inf(djt if alt is None else torch.minimum(djt, alt))
            reach = aa.combined(aa.reach_heads(rt, t * rho, at.dPm[k], at.eP, pad))
            return torch.minimum(reach, aa.joint(rt, t * rho, at.dPm[k], at.eP, pad, through=False)[0]), djt

        f78d = piecewise_rest_rows(rows_at, rho, float(E.max()))
        c0 = time.process_time()
        att = attained(attention_forward64(heads, wqa), st.x, blocks_of[id(aa)], rho, E + rho * at.eP,
                       a.restarts, a.steps)
        cpu["adam"] += time.process_time() - c0
        rows.append((st.group, f, float(E.max()), new, f78d, f81, R, att, newe))
        return R

    _ls._attention_rest = wrapped
    c = time.process_time()
    _ls.stack_local(spec, X, [f * med for f in factors], segment=True, aux=_ls.SEGMENT_AUX, move_rest=True)
    print(f"sentence {a.sentence}, {a.layers} layers: {time.process_time() - c:.1f} s CPU "
          f"(F84 rows {cpu['psd']:.1f} s, F85 rows {cpu['psde']:.1f} s, Adam {cpu['adam']:.1f} s); grid {grid}")
    print("layer radius maxE | F84 F78d F81 kept attained | kept/F84 (max over queries) | min-per-query gain | F84>=att")
    for lay, f, Em, new, f78d, f81, R, att, newe in rows:
        print(f"{lay} {f:g} F85 (through P-hat): {newe.max():.3g} (F84/F85 {float(new.max() / newe.max()):.3f}, "
              f"kept/F85 {float(R.max() / newe.max()):.3f}, F85>=att {bool((newe >= att).all())}, "
              f"F85<=F84 {bool((newe <= new).all())})")
        both = torch.minimum(new, R)
        print(f"{lay} {f:g} {Em:.3g} | {new.max():.3g} {f78d.max():.3g} {f81.max():.3g} {R.max():.3g} {att.max():.3g} | "
              f"{float(R.max() / new.max()):.3f} | {float(R.max() / both.max()):.3f} | {bool((new >= att).all())}")
        bind = ["F78d" if float(a) <= float(b) else "F81" for a, b in zip(f78d, f81)]
        print("    per query F84/kept:", " ".join(f"{float(n / k):.2f}" for n, k in zip(new, R)), "binding:",
              ",".join(sorted(set(bind))))


if __name__ == "__main__":
    main()
