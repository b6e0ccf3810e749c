"""Why the second norm's floor is lost on MiniLM's layers 1-4 at rho = 1e-2 (issue 12; THEORY F67, measured only).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/floor_probe.py [--layers 1,2,3,4]

``layer_rows`` on ``B(X, r)`` (``||E_j|| <= r`` per token, r = factor x median token norm), ``post_ffn`` wrapped for
F34b's parts of ``r2`` (``r g_pt``, ``remG``, the FFN remainder: least of ``dFh r_h``, F54, F46) and ``sqrt(d) sigma2``;
F54b with ``remH`` scaled.  At the worst tokens, from the float64 forward: ``nu_i = sup_u sum_j ||J_ij^T u||`` of ``X ->
P S2_i``'s exact Jacobian from below (fixed point) and above (F17b's Gram at ``w_j = ||J_ij^T u||``), and projected
Adam over the ball for the moves and remainders.  ``eigvalsh``, no pads: a measurement, not a certificate.
"""

import argparse
import math
from unittest import mock

import torch
from torch.func import jacrev, jvp

from transcover.lipschitz import _local_stages as st
from transcover.lipschitz import _local_ffn_reach as fr
from transcover.lipschitz._local_rows import layer_rows
from transcover.model import load
from transcover.model._data import load_inputs
from transcover.model._functional import attention_forward, ffn_forward, layer_forward


def record_parts(layer, X, r: float) -> dict:  # noqa: ANN001
    """F34b's parts of ``r2`` per token at the last ``post_ffn`` call on the full radius."""
    seen, orig, orig_reach = {}, st.post_ffn, st.ffn_reach

    def spy(at, pt, att, fn, lffn, rr, subs, fb, dF, dFh, fold):  # noqa: ANN001, ANN202
        out = orig(at, pt, att, fn, lffn, rr, subs, fb, dF, dFh, fold)
        if rr == r:
            rem = dFh * fn.rh if fn.reach is None else torch.minimum(dFh * fn.rh, fn.reach)
            if fold is not None:
                rem = torch.minimum(rem, fold[1] * fb.rn)
            seen.update(rg=r * pt.g_pt, remG=fn.remG, ffn=rem, r2=out[1], rh=fn.rh, hp=r * pt.h_pt, remH=fn.remH,
                        lim=math.sqrt(at.d) * at.sig2)
        return out
    st.post_ffn, st.ffn_reach = spy, lambda *x: (seen.update(reach_args=x), orig_reach(*x))[1]  # full radius (F54c)
    layer_rows(layer, X, [r])
    st.post_ffn, st.ffn_reach = orig, orig_reach
    return seen


def reach_whatif(seen: dict, r: float, i: int, scale: float, beta: bool = True) -> float:
    """F54b at token i with ``remH`` times ``scale`` (and ``r_h`` from it); without ``beta``, its beyond-second-order
    weights set to 0 (F58a's ``nested_beta`` patched): ``scale`` 0 then leaves ``N_Q r^2 / 2`` alone."""
    at, pt, gram, fn, drift, _ = seen["reach_args"]
    base = getattr(drift, "base", drift)
    k, remH = slice(i, i + 1), fn.remH[i:i + 1] * scale
    S, eS = (v[k] for v in at.n1.sandwich(gram.S, gram.err))  # token i's own D1 (a slice of S read token 0's, ffn23)
    with mock.patch.object(fr, "nested_beta", fr.nested_beta if beta else lambda z, R, *_: torch.zeros_like(R)):
        return float(fr.ffn_reach_remainder(base.taylor, base.n1, at.z[k], S, eS, gram.wsum[k], r, remH,
                                            torch.minimum(fn.rh[k], r * pt.h_pt[k] + remH), at.ez[k])[0])


def maps(layer):  # noqa: ANN001, ANN201
    """``X -> H``, ``X -> S2`` of a post-LN layer and the centring ``P``."""
    H_of = lambda X: layer.norm_attn(X + attention_forward(layer.attention, X))  # noqa: E731
    return H_of, (lambda X: (H := H_of(X)) + ffn_forward(layer.ffn, H)), (lambda v: v - v.mean(dim=-1, keepdim=True))


def first_order(J, u0, restarts: int) -> tuple[float, float, float]:  # noqa: ANN001
    """(lower, weighted-Gram upper, ``sum_j ||J_ij||``) of ``sup_u sum_j ||J_ij^T u||``; ``J`` (d, T, d)."""
    Jt = J.permute(1, 0, 2)  # (T, d_out, d_in)
    G = Jt @ Jt.transpose(1, 2)  # J_ij J_ij^T
    starts = [u0] + [torch.randn(J.shape[0], dtype=J.dtype) for _ in range(restarts)]
    best, ub = 0.0, math.inf
    for u in starts:
        u = u / u.norm()
        for _ in range(200):
            n = torch.einsum("tab,b->ta", Jt.transpose(1, 2), u).norm(dim=1).clamp(min=1e-300)
            v = torch.einsum("tab,b,t->a", G, u, 1 / n)
            u = v / v.norm()
        best = max(best, float((n := torch.einsum("tab,b->ta", Jt.transpose(1, 2), u).norm(dim=1)).sum()))
        w = n.clamp(min=1e-12 * float(n.max()))
        ub = min(ub, math.sqrt(float(torch.linalg.eigvalsh((G / w[:, None, None]).sum(0))[-1]) * float(w.sum())))
    return best, ub, float(torch.linalg.matrix_norm(Jt, ord=2).sum())


def ascend(f, X, r: float, inits, steps: int) -> float:  # noqa: ANN001
    """max over projected Adam runs (lr 0.1 r, cosine) of ``f(E)`` on ``||E_j|| <= r``."""
    best = 0.0
    for E0 in inits:
        E = E0.clone().requires_grad_(True)
        sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt := torch.optim.Adam([E], lr=0.1 * r), steps)
        for _ in range(steps):
            val = f(E)
            best = max(best, float(val.detach()))
            E.grad = torch.autograd.grad(-val, E)[0]
            opt.step()
            sch.step()
            E.data.mul_((r / E.data.norm(dim=1, keepdim=True)).clamp(max=1.0))
        best = max(best, float(f(E.detach())))
    return best


def token_report(layer, X, r: float, i: int, a) -> str:  # noqa: ANN001
    """First-order row norm and attained sups at token ``i`` (starts ``+-J_ij^T u0`` and random rows)."""
    H_of, S2_of, P = maps(layer)
    J = jacrev(lambda Z: P(S2_of(Z)[i]))(X)  # (d, T, d)
    u0 = torch.linalg.svd(J.reshape(J.shape[0], -1), full_matrices=False)[0][:, 0]  # top left singular vector
    lo, ub, crude = first_order(J, u0, a.restarts)
    H0, S20, k = H_of(X), S2_of(X), slice(i, i + 1)
    E1 = torch.einsum("a,atb->tb", u0, J)
    inits = [r * v / v.norm(dim=1, keepdim=True) for v in [E1, -E1] + [torch.randn_like(X) for _ in range(a.starts)]]
    F = lambda h: ffn_forward(layer.ffn, h)  # noqa: E731
    lin = lambda E: jvp(H_of, (X,), (E,))[1]  # noqa: E731
    rem_H = lambda E: H_of(X + E) - H0 - lin(E)  # noqa: E731
    d2F = lambda e: jvp(lambda h: jvp(F, (h,), (e,))[1], (H0[k],), (e,))[1]  # noqa: E731
    rem_F = lambda dH: F(H0[k] + dH) - F(H0[k]) - jvp(F, (H0[k],), (dH,))[1]  # noqa: E731
    forms = {"H move": lambda E: (H_of(X + E)[i] - H0[i]).norm(),
             "H remainder (remH)": lambda E: rem_H(E)[i].norm(),
             "remG's target": lambda E: P((dH := rem_H(E)[k]) + jvp(F, (H0[k],), (dH,))[1])[0].norm(),
             "FFN remainder": lambda E: P(rem_F(H_of(X + E)[k] - H0[k])[0]).norm(),
             "FFN 2nd order on D1 B E": lambda E: P(0.5 * d2F(lin(E)[k])[0]).norm(),
             "centred S2 move": lambda E: P(S2_of(X + E)[i] - S20[i]).norm()}
    return (f"nu_i first order: lower {r * lo:.4g}, Gram upper {r * ub:.4g}, sum_j ||J_ij|| {r * crude:.4g}; attained "
            + ", ".join(f"{n} {ascend(f, X, r, inits, a.steps):.4g}" for n, f in forms.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    for n, v in (("sentence", 1), ("factor", 1e-2), ("layers", "1,2,3,4"), ("tokens", 3), ("starts", 3),
                 ("restarts", 3), ("steps", 60)):
        ap.add_argument(f"--{n}", type=type(v), default=v)
    a = ap.parse_args()
    torch.manual_seed(0)
    spec = load(None).to_torch(torch.float64)
    X = spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=32, limit=a.sentence + 1)[a.sentence].double())
    layers = [int(v) for v in a.layers.split(",")]
    for li, L in enumerate(spec.layers[:max(layers) + 1]):
        if li in layers:
            r = a.factor * float(X.norm(dim=1).median())
            p = record_parts(L, X, r)
            ratio = p["r2"] / p["lim"]
            print(f"layer {li} T={X.shape[0]} r={r:.4g}: max r2/(sqrt(d) sigma2) {float(ratio.max()):.4g}", flush=True)
            for i in ratio.argsort(descending=True)[:a.tokens].tolist():
                v = {n: f"{float(p[n][i]):.4g}" for n in ("lim", "r2", "rg", "remG", "ffn", "rh", "hp", "remH")}
                print(f"  token {i}: sqrt(d) sigma2 {v['lim']}, r2 {v['r2']} | r g_pt {v['rg']}, remG {v['remG']}, "
                      f"FFN rem {v['ffn']} (r_h {v['rh']}, r h_pt {v['hp']}, remH {v['remH']})", flush=True)
                wi = [reach_whatif(p, r, i, c) for c in (1, 0.3, 0.1, 0.03, 0)] + [reach_whatif(p, r, i, 0, False)]
                print("    F54b, remH x 1, 0.3, 0.1, 0.03, 0; N_Q r^2/2: " + ", ".join(f"{x:.4g}" for x in wi))
                print("    " + token_report(L, X, r, i, a), flush=True)
        X = layer_forward(L, X).detach()


if __name__ == "__main__":
    main()
