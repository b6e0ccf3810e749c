"""Attack F36 (stack_local: stack = point + drift, drift, product, upper) on small random stacks: ascent of
nu_i(J(Y)) and nu_i(J(Y) - J(X)) over Y in B(X, rho) for the whole network without its head."""
from __future__ import annotations

import dataclasses
import sys
import time

import torch
from harness import ascend_nu, clip, jac, nu_all, random_starts, with_eps
from lipschitz_testkit import random_spec

from transcover.lipschitz._local_stack import stack_local
from transcover.model._functional import transformer_forward


def make(seed=1, L=2, d=6, H=2, dh=3, dff=8, T=4, q=1.0, eps=None, **kw):
    spec = random_spec(seed, act="gelu", L=L, d=d, H=H, dh=dh, dff=dff, **kw)
    layers = []
    for lay in spec.layers:
        lay = dataclasses.replace(lay, attention=dataclasses.replace(lay.attention, W_Q=lay.attention.W_Q * q))
        layers.append(with_eps(lay, eps) if eps is not None else lay)
    spec = dataclasses.replace(spec, layers=layers)
    X = torch.randn(T, d, generator=torch.Generator().manual_seed(seed + 50))
    return spec, X


def attack(case, rhos, steps=30, top=2):
    spec, X = make(**case)
    f = lambda Z: transformer_forward(spec, Z, with_head=False)  # noqa: E731
    res = stack_local(spec, X, list(rhos))
    g = torch.Generator().manual_seed(3)
    J0 = jac(f, X)
    for rho, r in zip(rhos, res):
        starts = random_starts(X, rho, 6, g)
        c = X - X.mean(dim=1, keepdim=True)
        starts.append(-rho * c / c.norm(dim=1, keepdim=True))
        out = []
        for name, J0_, bnd in (("nu", None, r.stack), ("drift", J0, r.drift)):
            scr = torch.stack([nu_all(jac(f, X + clip(E, rho)) - (0 if J0_ is None else J0_), starts=6, iters=30)
                               for E in starts])
            toks = scr.max(dim=0).values.topk(top).indices.tolist()
            worst = 0.0
            for i in toks:
                order = scr[:, i].argsort(descending=True)[:3].tolist()
                val, _ = ascend_nu(f, X, rho, i, [starts[k] for k in order], steps=steps, J0=J0_)
                worst = max(worst, val)
            out.append(f"{name}:{worst:.5g}/{bnd:.5g}={worst / bnd:.4f}")
        print(f"  rho={rho:g} point={r.point:.5g} upper={r.upper:.5g} product={r.product:.5g} " + " ".join(out), flush=True)


CASES = {
    "post_ln": dict(norm="layernorm", placement="post"),
    "pre_ln_final_bias": dict(norm="layernorm", placement="pre", final_norm=True, biases=True, seed=2),
    "post_ln_sharp_causal": dict(norm="layernorm", placement="post", causal=True, q=8.0, biases=True, seed=3),
    "post_ln_eps12_L3": dict(norm="layernorm", placement="post", L=3, eps=1e-12, q=4.0, seed=4, T=5),
    "pre_rms_causal": dict(norm="rmsnorm", placement="pre", causal=True, biases=True, seed=5),
}

if __name__ == "__main__":
    for n in sys.argv[1:] or list(CASES):
        t = time.process_time()
        print(n, flush=True)
        attack(CASES[n], (1e-5, 1e-4, 1e-3, 1e-2))
        print(f"  cpu {time.process_time() - t:.1f}s", flush=True)
