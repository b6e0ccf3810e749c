"""Attack the per-layer ball bound (layer_rows: total_rows, stage_radii, output_radii) on small adversarial
layers.  Usage: PYTHONPATH=<snap>/src:<snap>/tests/lipschitz:attacks python attacks/attack_rows.py [case...]"""
from __future__ import annotations

import dataclasses
import sys
import time

import torch
from harness import (adversarial_starts, ascend_nu, ascend_value, clip, jac, lnorm_shrink_start, nu_all,
                     random_starts, with_eps)
from lipschitz_testkit import random_spec

from transcover.lipschitz._local_rows import layer_rows
from transcover.model import attention_forward
from transcover.model._functional import layer_forward, ffn_forward


def make(case):
    kw = dict(d=8, H=2, dh=4, dff=16, T=6, placement="post", causal=False, q=8.0, eps=1e-12, tiny=False, seed=1, w1=1.0)
    kw.update(case)
    spec = random_spec(kw["seed"], act="gelu", norm="layernorm", placement=kw["placement"], d=kw["d"], H=kw["H"],
                       dh=kw["dh"], dff=kw["dff"], biases=True, causal=kw["causal"])
    L = with_eps(spec.layers[0], kw["eps"])
    L = dataclasses.replace(L, attention=dataclasses.replace(L.attention, W_Q=L.attention.W_Q * kw["q"]),
                            ffn=dataclasses.replace(L.ffn, W_1=L.ffn.W_1 * kw["w1"]))  # w1: a sharp FFN (F38)
    g = torch.Generator().manual_seed(kw["seed"] + 100)
    X = torch.randn(kw["T"], kw["d"], generator=g) * 2
    if kw["tiny"]:  # near-degenerate LayerNorm inputs: tokens almost constant across features
        X = X.mean(dim=1, keepdim=True) + 0.03 * torch.randn(kw["T"], kw["d"], generator=g)
    return L, X


def stage_fns(L):
    P = lambda Z: Z - Z.mean(dim=1, keepdim=True)  # noqa: E731
    if L.placement.value == "post":
        S1 = lambda Z: Z + attention_forward(L.attention, Z)  # noqa: E731
        H = lambda Z: L.norm_attn(S1(Z))  # noqa: E731
        return {"attention": lambda Z: P(S1(Z)), "norm_attn": H,
                "ffn": lambda Z: P(H(Z) + ffn_forward(L.ffn, H(Z)))}, lambda Z: S1(Z)
    S1 = lambda Z: Z + attention_forward(L.attention, L.norm_attn(Z))  # noqa: E731
    return {"norm_ffn": S1, "ffn": lambda Z: L.norm_ffn(S1(Z))}, lambda Z: Z


def attack(case, radii, steps=40, nrand=3, top=3):
    L, X = make(case)
    f = lambda Z: layer_forward(L, Z)  # noqa: E731
    ljs = layer_rows(L, X, list(radii))
    stages, pre_norm = stage_fns(L)
    g = torch.Generator().manual_seed(7)
    res = []
    for r, lj in zip(radii, ljs):
        bound = lj.total_rows
        starts = random_starts(X, r, nrand, g) + adversarial_starts(L, X, r, g) + [lnorm_shrink_start(pre_norm, X, r)]
        # screen: nu at every start, per token the ratio
        scr = torch.stack([nu_all(jac(f, X + clip(E, r)), starts=6, iters=30) for E in starts])  # (S, T)
        ratio0 = (scr / bound).max(dim=0).values
        toks = ratio0.topk(min(top, X.shape[0])).indices.tolist()
        worst = (0.0, None)
        for i in toks:
            order = (scr[:, i] / bound[i]).argsort(descending=True)[:4].tolist()
            val, Y = ascend_nu(f, X, r, i, [starts[k] for k in order] + random_starts(X, r, 1, g), steps=steps)
            rat = val / float(bound[i])
            if rat > worst[0]:
                worst = (rat, i)
        # stage radii and output radii
        srat = {}
        for name, fn in list(stages.items()) + [("output", f)]:
            rad = lj.output_radii if name == "output" else lj.stage_radii.get(name)
            if rad is None:
                continue
            ref = fn(X).detach()
            mv = ascend_value(lambda Z: (fn(Z) - ref).norm(dim=1), X, r, starts[:2] + starts[-2:], steps=40)
            srat[name] = float((mv / rad).max())
        res.append((r, worst, float(bound.max()), srat))
        print(f"  r={r:g} ball={float(bound.max()):.4g} nu-ratio={worst[0]:.4f}@tok{worst[1]} stage-ratios="
              + " ".join(f"{k}:{v:.3f}" for k, v in srat.items()), flush=True)
    return res


CASES = {
    "post_q8": dict(),
    "post_causal_q30": dict(causal=True, q=30.0, seed=2),
    "pre_q8": dict(placement="pre", seed=3),
    "post_tiny": dict(tiny=True, seed=4, q=4.0),
    "pre_tiny": dict(tiny=True, placement="pre", seed=5),
    "post_d16_H4": dict(d=16, H=4, dh=4, dff=32, T=8, q=15.0, seed=6),
    "post_q1": dict(q=1.0, seed=8),
    "post_ffn_sharp": dict(w1=6.0, q=4.0, seed=10),
    "pre_ffn_sharp": dict(w1=6.0, q=4.0, seed=11, placement="pre"),
    "post_T12_H4": dict(d=16, H=4, dh=4, dff=32, T=12, q=6.0, seed=12, w1=3.0),
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CASES)
    radii = (1e-3, 1e-2, 0.1, 0.5)
    for n in names:
        t = time.process_time()
        print(n, flush=True)
        attack(CASES[n], radii)
        print(f"  cpu {time.process_time() - t:.1f}s", flush=True)
