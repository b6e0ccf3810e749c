"""VIOLATION reproducer (F34, joint12, merged in main 217af59): a visible key whose float64 softmax weight
underflows to exactly 0.0 at X is treated as masked (``P > 0`` is the visibility test of score_moves /
softmax_envelope / visible_diameter); on a ball that can close its score gap it takes the mass, and F34's
``attention_remainder`` and hence layer_rows' ``stage_radii["attention"]`` miss it.

One head d = dh = 4, G = c I (W_Q = W_K = (c sqrt(dh))^(1/2) I, W_V = W_O = I, no biases), c = 8000, T = 2:
x_0 = u, x_1 = 0.9 u + w (u, w orthonormal): scores of query 0 are 8000 and 7200 (gap 800 > 745: P_01 = 0.0).
Y = X + (-r u, +r u), r = 0.052 (every token moved by exactly r) gives P'(query 0) = (7e-14, 1).
Run: PYTHONPATH=src:tests/lipschitz python scripts/redteam/repro_underflow_f34.py  (exit 1 on violation).
Since the fix (Note [underflowed attention weights] in lipschitz/_local_attention.py) such an input is refused:
_head_data raises InputError; tests/lipschitz/test_local_redteam.py pins both the refusal and a gap-700 case."""
import dataclasses
import sys

import torch
from lipschitz_testkit import random_spec
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_joint import attention_remainder, head_geometry
from transcover.lipschitz._local_rows import _HeadMoments, layer_rows
from transcover.model import attention_forward


def case(c: float = 8000.0, eps: float = 0.1, r: float = 0.052):
    d = 4
    L = random_spec(1, act="gelu", norm="layernorm", placement="post", d=d, H=1, dh=d, dff=8).layers[0]
    eye = torch.eye(d, dtype=torch.float64)[None]
    s = (c * d**0.5) ** 0.5
    attn = dataclasses.replace(L.attention, W_Q=eye * s, W_K=eye * s, W_V=eye.clone(), W_O=eye.clone(), b_Q=None,
                               b_K=None, b_V=None, b_O=None)
    L = dataclasses.replace(L, attention=attn)
    u, w = eye[0, 0], eye[0, 1]
    X = torch.stack([u, (1 - eps) * u + w])
    Y = X + torch.stack([-r * u, r * u])
    return L, X, Y, r


def main() -> int:
    L, X, Y, r = case()
    attn = L.attention
    A = lambda Z: attention_forward(attn, Z)  # noqa: E731
    J = torch.autograd.functional.jacobian(A, X)
    R = (A(Y) - A(X) - torch.einsum("imjd,jd->im", J, Y - X)).norm(dim=1)
    heads = _head_data(attn, X)
    mom = _HeadMoments(heads, attn.softmax_scale)
    gv, gov = (head_geometry(heads, attn.softmax_scale, output=o) for o in (False, True))
    remA, _ = attention_remainder(mom, gv, gov, float(head_norms(attn)["O"]), r, _weight_norms(L))
    lj = layer_rows(L, X, [r])[0]
    cen = lambda Z: Z - Z.mean(dim=1, keepdim=True)  # noqa: E731
    moved = (cen(Y + A(Y)) - cen(X + A(X))).norm(dim=1)
    rad = lj.stage_radii["attention"]
    print(f"max token move |Y - X| = {float((Y - X).norm(dim=1).max()):.6g} (r = {r})")
    print(f"F34 attention_remainder {remA.tolist()}  actual remainder {R.tolist()}")
    print(f"stage_radii['attention'] {rad.tolist()}  actual centred move {moved.tolist()}  (ball {lj.ball:.6g})")
    bad = bool((R > remA).any() or (moved > rad).any())
    print("VIOLATION" if bad else "holds")
    return int(bad)


if __name__ == "__main__":
    sys.exit(main())
