"""Layer 0's attention reach at the data as one trilinear form of all heads (issue 12; THEORY F65, measured only).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/attn_joint_probe.py \
        [--sentence 14] [--factor 1e-4] [--queries 4,2] [--starts 3] [--steps 100]

MiniLM's layer 0 behind its input norm: the rows of the prefix are ``Delta_m = J_m alpha_m`` (``J_m`` the input norm's
exact Jacobian at token m, ``||alpha_m|| <= 1``), rho = factor x the median embedded-token norm.  Per query i, times rho:
the attained second derivative of the attention through ``W_O`` (``attention_forward``; float64 Adam on the per-row spheres, nested
``torch.func.jvp``), the attained ``a c w`` term alone, F65b's Hadamard-Gram bound of that term at X
(``T lambda_max(Gphi^{1/2} (Gzeta o Gphi) Gphi^{1/2})^{1/2}``) and the product of its factors taken apart
(``T lambda_max(Gphi) max ||zeta_r||``).  Eigenvalues by ``eigvalsh``: a measurement, not a certificate.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch.func import jacrev, jvp

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transcover.model import load  # noqa: E402
from transcover.model._functional import attention_forward  # noqa: E402
from transcover.model._data import load_inputs  # noqa: E402


def functionals(A, x, i: int):  # noqa: ANN001, ANN201
    """``(v, zeta)``: ``v`` (H T, T, d) with ``phi_r``'s block m ``= J_m^T v[r, m]`` (``v_{hj,m} = [m = i] kappa_hj +
    ([m = j] - P_hm) q_hi``) and ``zeta`` (H T, d) ``P_hj W_O^hT W_V^hT y_hj`` (THEORY F65a)."""
    T = x.shape[0]
    vs, zs = [], []
    for h in range(A.W_Q.shape[0]):
        u = x[i] @ A.W_Q[h] + A.b_Q[h]
        k = x @ A.W_K[h] + A.b_K[h]
        p = torch.softmax(A.softmax_scale * k @ u, 0)
        y = x - p @ x
        q = A.softmax_scale * A.W_K[h] @ u
        v = (torch.eye(T, dtype=x.dtype) - p[None, :])[:, :, None] * q
        v[:, i] = v[:, i] + A.softmax_scale * (y @ A.W_K[h]) @ A.W_Q[h].T  # kappa_j = G y_j
        vs.append(v)
        zs.append(p[:, None] * (y @ A.W_V[h] @ A.W_O[h]))
    return torch.cat(vs), torch.cat(zs)


def hadamard_bound(v, zeta, Q):  # noqa: ANN001, ANN201
    """F65b at X and the product of its factors taken apart (both without rho)."""
    T = Q.shape[0]
    Gp = torch.einsum("rmd,mde,sme->rs", v, Q, v)
    ev, U = torch.linalg.eigh(0.5 * (Gp + Gp.T))
    half = U @ torch.diag(ev.clamp(min=0).sqrt()) @ U.T
    S = half @ (Gp * (zeta @ zeta.T)) @ half
    top = max(float(torch.linalg.eigvalsh(0.5 * (S + S.T))[-1]), 0.0)
    return T * math.sqrt(top), T * float(ev[-1]) * float(zeta.norm(dim=1).max())


def ascent(form, T: int, d: int, starts: int, steps: int) -> float:
    """max over Adam runs (lr 0.05) of ``||form(alpha, beta)||`` on the per-row unit spheres."""
    best = 0.0
    for _ in range(starts):
        a = torch.randn(T, d, dtype=torch.float64, requires_grad=True)
        b = torch.randn(T, d, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([a, b], lr=0.05)
        for _ in range(steps):
            val = form(a / a.norm(dim=1, keepdim=True), b / b.norm(dim=1, keepdim=True)).norm()
            opt.zero_grad()
            (-val).backward()
            opt.step()
        best = max(best, float(val.detach()))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentence", type=int, default=14)
    ap.add_argument("--factor", type=float, default=1e-4)
    ap.add_argument("--queries", default="4,2")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    torch.manual_seed(0)
    spec = load(None).to_torch(torch.float64)
    X = load_inputs(spec, "sklearn-descr", max_len=32, limit=20)[a.sentence].double()
    T, d = X.shape
    rho = a.factor * float(X.norm(dim=1).median())
    A, norm = spec.layers[0].attention, spec.input_norm
    x = norm(X)
    J = torch.stack([jacrev(norm)(X[m]) for m in range(T)])
    Q = J @ J.transpose(1, 2)
    print(f"sentence {a.sentence} T={T} rho={rho:.4g} (x rho below)")
    for i in (int(s) for s in a.queries.split(",")):
        def whole(al, be, i=i):  # noqa: ANN001, ANN202
            Da, Db = torch.einsum("tcd,td->tc", J, al), torch.einsum("tcd,td->tc", J, be)
            return jvp(lambda z: jvp(lambda w: attention_forward(A, w), (z,), (Db,))[1][i], (x,), (Da,))[1]
        v, zeta = functionals(A, x, i)
        W = torch.einsum("rmd,mde->rme", v, J)  # phi_r's blocks in alpha's coordinates

        def acw(al, be, W=W, zeta=zeta):  # noqa: ANN001, ANN202
            return (torch.einsum("rme,me->r", W, al) * torch.einsum("rme,me->r", W, be)) @ zeta
        bound, apart = hadamard_bound(v, zeta, Q)
        print(f"query {i}: attained whole >= {rho * ascent(whole, T, d, a.starts, a.steps):.4g}, a c w >= "
              f"{rho * ascent(acw, T, d, a.starts, a.steps):.4g}; F65b {rho * bound:.4g}; factors apart {rho * apart:.4g}",
              flush=True)


if __name__ == "__main__":
    main()
