"""Probe: visible keys whose softmax weight underflows to exactly 0.0 at X (score gap > 745) are treated as
masked (P > 0 is the visibility test in score_moves / softmax_envelope).  On a ball large enough to close the
gap such a key can take the mass; the certified head moves / remainders / stage radii may miss it."""
import sys
import torch
from attack_rows import CASES, make
from harness import ascend_value, random_starts
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_rows import _HeadMoments, layer_rows
from transcover.lipschitz._local_sharp import head_moves
from transcover.model import attention_forward, attention_scores

torch.set_default_dtype(torch.float64)
q = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0
L, X = make(dict(q=q, seed=1))
attn = L.attention
P0 = [torch.softmax(attention_scores(attn, X, h), -1) for h in range(attn.n_heads)]
print("exact zeros in P at X per head:", [int((p == 0).sum()) for p in P0])
norms = _weight_norms(L)
mom = _HeadMoments(_head_data(attn, X), attn.softmax_scale)
g = torch.Generator().manual_seed(0)
for r in [float(a) for a in sys.argv[2:]] or [0.3, 1.0, 2.0]:
    hm = head_moves(mom, r, norms)
    for h in range(attn.n_heads):
        Wv = attn.W_V[h].double()
        o0 = (P0[h] @ X @ Wv).detach()
        f = lambda Z, h=h, Wv=Wv: (torch.softmax(attention_scores(attn, Z, h), -1) @ Z @ Wv - o0).norm(dim=1)  # noqa: E731
        mv = ascend_value(f, X, r, random_starts(X, r, 3, g), steps=60, lr=0.3)
        print(f"q={q} r={r} head{h} head_moves bound {[round(v, 4) for v in hm[h].tolist()]}\n    found {[round(v, 4) for v in mv.tolist()]}"
              f" ratio max {float((mv / hm[h]).max()):.4f}", flush=True)
    lj = layer_rows(L, X, [r])[0]
    S1 = lambda Z: (Z + attention_forward(attn, Z))  # noqa: E731
    ref = S1(X) - S1(X).mean(1, keepdim=True)
    mv = ascend_value(lambda Z: ((S1(Z) - S1(Z).mean(1, keepdim=True)) - ref).norm(dim=1), X, r, random_starts(X, r, 2, g), steps=60, lr=0.3)
    print(f"  stage 'attention' radius {[round(v, 4) for v in lj.stage_radii['attention'].tolist()]}\n  found {[round(v, 4) for v in mv.tolist()]} ratio {float((mv / lj.stage_radii['attention']).max()):.4f}; ball {lj.ball:.4g}", flush=True)
