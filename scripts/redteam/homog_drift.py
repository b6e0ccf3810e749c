"""Homogeneity of the attention drift rows (F35, F17d): X -> cX, r -> cr, W_Q, W_K, W_V -> W/c leaves every
head's output as a function of Z/c, so nu_i(J'(Y) - J'(cX)) = nu_i(J(Y/c) - J(X))/c: the bound should follow 1/c."""
import dataclasses
import torch
from attack_drift import CASES
from attack_rows import make
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_rows import _HeadMoments, attention_drift_rows
import transcover.lipschitz._local_rows as lr

for name in ("q8", "causal_q30", "q1"):
    L, X = make(CASES[name])
    for r in (1e-3, 1e-1):
        def drift(L, X, r, fn=attention_drift_rows):
            return fn(_HeadMoments(_head_data(L.attention, X), L.attention.softmax_scale), r, _weight_norms(L))
        base = drift(L, X, r)
        for c in (0.25, 4.0):
            a = L.attention
            kw = dict(W_Q=a.W_Q / c, W_K=a.W_K / c, W_V=a.W_V / c)
            Lc = dataclasses.replace(L, attention=dataclasses.replace(a, **kw))
            got = drift(Lc, c * X, c * r)
            rel = float(((got * c) / base - 1).abs().max())
            parts = ""
            for fn in ("attention_drift_f17d", "attention_drift_hessian"):
                if hasattr(lr, fn):
                    b0, b1 = drift(L, X, r, getattr(lr, fn)), drift(Lc, c * X, c * r, getattr(lr, fn))
                    parts += f" {fn[16:]}:{float(((b1 * c) / b0 - 1).abs().max()):.2e}"
            print(f"{name} r={r:g} c={c}: max |c*bound_c/bound - 1| = {rel:.3e}{parts}")
