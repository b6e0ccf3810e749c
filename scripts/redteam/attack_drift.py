"""Attack F35 (attention_drift_rows per head, and heads combined through W_O with F35d): sup over Y in
B(X, r) of nu_i(J_h(Y) - J_h(X)) against the certified rows.  PYTHONPATH=<snap-drift12>/src:...:attacks"""
from __future__ import annotations

import sys
import time

import torch
from attack_rows import make
from harness import adversarial_starts, ascend_nu, clip, jac, nu_all, random_starts

from transcover.lipschitz._local_drift import heads_joint, output_block_norms
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_rows import _head_output_norms, _heads_combined, _HeadMoments, attention_drift_rows
from transcover.model import attention_forward, attention_scores


def head_fn(attn, h):
    Wv = attn.W_V[h].double()
    return lambda Z: torch.softmax(attention_scores(attn, Z, h), dim=-1) @ Z @ Wv


def bounds(L, X, r):
    attn = L.attention
    heads = _head_data(attn, X)
    dZ = attention_drift_rows(_HeadMoments(heads, attn.softmax_scale), r, _weight_norms(L))
    Oh, _ = _head_output_norms(None, None, heads, X.shape[0])
    Oall = torch.full((X.shape[0],), float(_weight_norms(L)["O"]))
    return dZ, _heads_combined(Oh, Oall, dZ, heads_joint(output_block_norms(heads), dZ))


def attack(case, radii, steps=40, top=2):
    L, X = make(case)
    attn = L.attention
    g = torch.Generator().manual_seed(11)
    fns = [(f"head{h}", h, head_fn(attn, h)) for h in range(attn.n_heads)]
    fns.append(("combined", None, lambda Z: attention_forward(attn, Z)))
    for r in radii:
        dZ, comb = bounds(L, X, r)
        starts = random_starts(X, r, 3, g) + adversarial_starts(L, X, r, g)
        line = []
        for name, h, f in fns:
            b = comb if h is None else dZ[h]
            J0 = jac(f, X)
            scr = torch.stack([nu_all(jac(f, X + clip(E, r)) - J0, starts=6, iters=30) for E in starts])
            toks = (scr / b).max(dim=0).values.topk(top).indices.tolist()
            worst = 0.0
            for i in toks:
                order = (scr[:, i] / b[i]).argsort(descending=True)[:3].tolist()
                val, _ = ascend_nu(f, X, r, i, [starts[k] for k in order], steps=steps, J0=J0)
                worst = max(worst, val / float(b[i]))
            line.append(f"{name}:{worst:.4f}")
        print(f"  r={r:g} max-bound={float(comb.max()):.4g} " + " ".join(line), flush=True)


CASES = {
    "q8": dict(),
    "causal_q30": dict(causal=True, q=30.0, seed=2),
    "H4_q15": dict(d=16, H=4, dh=4, dff=32, T=8, q=15.0, seed=6),
    "q1": dict(q=1.0, seed=8),
    "q3_T10": dict(q=3.0, T=10, seed=9),
}

if __name__ == "__main__":
    for n in sys.argv[1:] or list(CASES):
        t = time.process_time()
        print(n, flush=True)
        attack(CASES[n], (1e-3, 1e-2, 0.1, 0.3))
        print(f"  cpu {time.process_time() - t:.1f}s", flush=True)
