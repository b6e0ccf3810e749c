"""Constructed case: one head, G = c I (W_Q = W_K = sqrt(c sqrt(dh)) I, no biases), T = 2, x_0 = u,
x_1 = (1 - eps) u + M w (w orthogonal to u): the score gap of key 1 for query 0 is c eps (P_01 = 0.0 exactly
when c eps > 745) while x_1's value is far from x_0's; on B(X, r) with r > eps / 2 key 1 takes the mass."""
import dataclasses
import sys
import torch
from lipschitz_testkit import random_spec
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_rows import _HeadMoments, attention_drift_rows, layer_rows
from transcover.lipschitz._local_sharp import head_moves
from transcover.model import attention_forward, attention_scores

torch.set_default_dtype(torch.float64)
c, eps, M = (float(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (1000.0, 0.9, 3.0)
d = 4
spec = random_spec(1, act="gelu", norm="layernorm", placement="post", d=d, H=1, dh=d, dff=8)
L = spec.layers[0]
I = torch.eye(d)[None]
s = (c * d**0.5) ** 0.5
attn = dataclasses.replace(L.attention, W_Q=I * s, W_K=I * s, W_V=I.clone(), W_O=I.clone(), b_Q=None, b_K=None,
                           b_V=None, b_O=None)
L = dataclasses.replace(L, attention=attn)
u, w = torch.eye(d)[0], torch.eye(d)[1]
X = torch.stack([u, (1 - eps) * u + M * w]) + 0.0
S = attention_scores(attn, X, 0)
P = torch.softmax(S, -1)
print("scores", S.tolist(), "P", P.tolist())
norms = _weight_norms(L)
mom = _HeadMoments(_head_data(attn, X), attn.softmax_scale)
for r in [float(a) for a in sys.argv[4:]] or [0.55 * eps, 0.6 * eps, 0.7 * eps]:
    hm = head_moves(mom, r, norms)
    dz = attention_drift_rows(mom, r, norms)
    # the explicit move: x_0 -> x_0 - r u, x_1 -> x_1 + r u
    Y = X + torch.stack([-r * u, r * u])
    Py = torch.softmax(attention_scores(attn, Y, 0), -1)
    o0, oy = P @ X, Py @ Y
    move = (oy - o0).norm(dim=1)
    print(f"r={r:g}: P'(query 0)={Py[0].tolist()}  head move found {move.tolist()}  head_moves bound {hm[0].tolist()}"
          f"  drift bound {dz[0].tolist()}", flush=True)
    try:
        lj = layer_rows(L, X, [r])[0]
        S1 = lambda Z: Z + attention_forward(attn, Z)  # noqa: E731
        cen = lambda Z: Z - Z.mean(1, keepdim=True)  # noqa: E731
        print("   stage attention radius", lj.stage_radii["attention"].tolist(), "found", (cen(S1(Y)) - cen(S1(X))).norm(dim=1).tolist(),
              "ball", lj.ball, "output radii", lj.output_radii.tolist(), flush=True)
    except Exception as e:  # noqa: BLE001
        print("   layer_rows:", type(e).__name__, e)

# the F34 remainder itself (when the snapshot has it) against the actual remainder at the explicit point
try:
    from transcover.lipschitz._local_joint import attention_remainder, head_geometry
    from transcover.lipschitz._local_attention import head_norms
    heads = _head_data(attn, X)
    gv, gov = (head_geometry(heads, attn.softmax_scale, output=o) for o in (False, True))
    J = torch.autograd.functional.jacobian(lambda Z: attention_forward(attn, Z), X)
    for r in [float(a) for a in sys.argv[4:]] or [0.55 * eps]:
        Y = X + torch.stack([-r * u, r * u])
        R = attention_forward(attn, Y) - attention_forward(attn, X) - torch.einsum("imjd,jd->im", J, Y - X)
        remA, _ = attention_remainder(mom, gv, gov, float(head_norms(attn)["O"]), r, norms)
        print(f"F34 r={r:g}: attention_remainder {remA.tolist()} actual ||R_i|| {R.norm(dim=1).tolist()}")
except ImportError:
    print("no F34 in this source tree")
