"""THEORY F85 (measured, not wired): the attention stage's Taylor rest by F82's positive semi-definite majorant with the
segment's corrections, against F78d, F81 and the attained rest, on the stack route's own attention stages.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/attn_psd_rest.py --sentence 14 --layers 4 \
        --rhos 1e-5,1e-4

Runs ``stack_local`` (move rest on, F71c's auxiliary radii) with ``_local_stack._attention_rest`` wrapped: at every
attention stage and reported radius it evaluates F85's row (``psd_rest_rows``, prototype rounding: see its docstring),
F81 (``joint_rest_rows``), F78d (``piecewise_rest_rows``, recomputed) and the kept row, and an attained value
(projected float64 Adam over the move set ``{P-hat delta + e}``, ``--restarts`` x ``--steps`` per query, of the exact
rest ``A(x + D) - A(x) - A'(x) D``).  Prints per stage and radius the max over queries of each and the factors.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

import torch
from torch import Tensor

import transcover.lipschitz._local_stack as _ls
from transcover.lipschitz._local_attn_rest import (box_mean, joint_rest_rows, pair_mean, piecewise_rest_rows,
                                                   _head_factors)
from transcover.lipschitz._local_jacobian import certified_lmax
from transcover.lipschitz._rounding import _gamma
from transcover.model import load
from transcover.model._data import load_inputs

_U = 2.0**-53


def psd_rest_rows(data, heads, Qs: Tensor, eQ: Tensor, rho: float, E: Tensor, eP: float, pad: float,  # noqa: ANN001
                  a0: float = 1.0, b0: float = 1.0, steps: int = 20) -> Tensor:
    r"""(T,) rows ``>= ||R_i||`` of the attention stage's Taylor rest (THEORY F85), per query ``i``:

    .. math:: \|R_i\| \le \tfrac12\Big[\big(\sqrt{A_i} + \sqrt{B_i}\big)^2 + \Gamma_i\Big]

    ``A_i`` the certified sup over the move set of the low-rank form ``sum_h sum_j hi_j (Yb_j + alpha_j) (l_j . Delta)^2``
    (``l_j`` F82's centred score-velocity vector at the data weights ``P``) by the ``r x r`` SDP dual through the
    per-token ellipsoids ``Q~_j = Qs_j + eQ_j I`` and the e-balls; ``B_i = sum_h max_box sum_j p_j (Yb_j + alpha_j) eps_j^2``
    the segment's corrections per key (cross part ``X``, its ``p``-mean, the box's shift of the centre, the rounding of
    ``l``); ``Gamma_i`` the per-token Grams' sups (``sigma``'s AM-GM parts with ``beta``, the value move over
    ``alpha``).  Prototype rounding: the Grams' eigenvalues by ``eigvalsh`` padded ``1e-9`` relative plus
    ``d u`` of their Frobenius mass (not a certificate of the Grams' own rounding); the SDP's eigenvalue certified
    (``certified_lmax``) plus ``gamma_{2d+4}`` of the product's absolute mass."""
    T, d = Qs.shape[0], Qs.shape[-1]
    H, sc = len(heads), data.scale
    e = E + rho * eP
    e1 = e + pad
    Qt = Qs + (eQ * (1 + 1e-12))[:, None, None] * torch.eye(d, dtype=torch.float64)
    lQ = (torch.linalg.matrix_norm(Qs) + eQ) * (1 + 1e-12)  # >= lambda_max(Q~_j)
    Rn = (rho * torch.sqrt(lQ) + e) * (1 + 1e-12)  # >= ||Delta_j||
    Lc = torch.linalg.cholesky(Qt)
    fac = [_head_factors(data, h, rho, e, e1) for h in range(H)]
    Ybs = [pair_mean(f[2], f[3], f[5][None].expand(T, -1, -1)) for f in fac]  # F78b's Yb >= ||y_j - ybar|| on the box
    VO = [(hd[5] @ hd[6]) for hd in heads]  # d x d
    SVO = torch.stack([M @ M.T for M in VO])  # (H, d, d)
    SK = torch.stack([hd[4] @ hd[4].T for hd in heads])
    SQ = torch.stack([hd[3] @ hd[3].T for hd in heads])
    out = torch.empty(T, dtype=torch.float64)
    Gy = [sc * (hd[1] @ hd[4]) @ hd[3].T for hd in heads]  # (T, T, d): G y_ij as computed
    eGf = [_gamma(2 * d + 4) * sc * (hd[1].abs() @ hd[4].abs()) @ hd[3].abs().T for hd in heads]
    Xa = torch.cat([data_x(heads), torch.ones(T, 1, dtype=torch.float64)], dim=1)
    for i in range(T):
        cols_i, cols_q, Bi = [], [], 0.0
        gram_c = torch.zeros(H, T, dtype=torch.float64)  # coefficient of W_K Gram per (head, key)
        vo_c = torch.zeros(H, T, dtype=torch.float64)
        q_c = torch.zeros(H, dtype=torch.float64)
        wts = torch.zeros(H, T, dtype=torch.float64)
        for h, hd in enumerate(heads):
            U, sig, lo, hi, mV, gap, gapv, kpart, cross = fac[h]
            P, q = hd[0][i], hd[2][i]
            lo_i, hi_i = lo[i:i + 1], hi[i:i + 1]
            Yb = Ybs[h][i]
            qpart = rho * data.g[h][i] + e[i] * data.gn[h][i]
            Uab = (qpart + kpart[i]) * (1 + 1e-12)
            Tm = (Uab + (P * Uab).sum() * (1 + T * _U)) * (1 + 1e-12)
            wd = torch.maximum(hi[i] - P, P - lo[i]).clamp(min=0) * (1 + 1e-12)
            shift = (wd * Tm).sum() * (1 + T * _U) + (abs(1 - float(P.sum())) + 2 * T * _U) * float(Tm.max())
            # the rounding of l: G y_ij and q_i as computed
            aq = sc * (Xa[i].abs() @ hd_wqa_abs(hd)) @ hd[4].abs().T
            eq = _gamma(2 * d + 8) * float(aq.norm())
            eGi = eGf[h][i].norm(dim=-1)
            gbar = P @ Gy[h][i]
            eSum = _gamma(T + 2) * float((P[:, None] * Gy[h][i].abs()).sum(0).norm())
            N = (Rn[i] * (eGi + (P * eGi).sum() + eSum) + eq * (Rn + (P * Rn).sum())) * (1 + 1e-10)
            X = cross[i]
            eps = (N + X + box_mean(lo_i, hi_i, X[None])[0] + shift) * (1 + 1e-12)
            # AM-GM sizes from the terms' own sups
            Wj = data.nO[h] * mV
            alpha = a0 * Wj / Tm.clamp(min=1e-300)
            alpha = torch.where(Wj > 0, alpha, torch.zeros_like(alpha))
            beta = b0 * torch.where(data.mQ[h][i] > 0, _moves_k(data, h, rho, e) / _moves_q(data, h, rho, e)[i],
                                    torch.ones(T, dtype=torch.float64))
            vis = hi[i] > 0
            c = torch.where(vis, Yb + alpha, torch.zeros_like(Yb))
            Bi = Bi + float(box_mean(lo_i, hi_i, (c * eps * eps)[None])[0])
            wts[h] = torch.where(vis, hi[i] * c, torch.zeros_like(c)) * (1 + 1e-12)
            # l_j: block i: Gy_j - gbar, blocks m: q (delta_mj - P_m)
            cols_i.append(Gy[h][i] - gbar)  # (T_j, d)
            cols_q.append(q)
            q_c[h] = sc * float(box_mean(lo_i, hi_i, (Yb * beta)[None])[0])
            gram_c[h] = torch.where(vis & (beta > 0), sc * hi[i] * Yb / beta, torch.zeros_like(Yb))
            vo_c[h] = torch.where(vis & (alpha > 0), hi[i] / alpha, torch.zeros_like(Yb))
        A = _lowrank_sup(i, cols_i, cols_q, heads, wts, Qt, rho, e, steps)
        Gam = _grams_sup(i, q_c, gram_c, vo_c, SQ, SK, SVO, Lc, rho, e)
        out[i] = 0.5 * ((math.sqrt(A) + math.sqrt(Bi)) ** 2 + Gam) * (1 + 1e-10)
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


_CTX: dict = {}


def data_x(heads) -> Tensor:  # noqa: ANN001
    return _CTX["x"]


def hd_wqa_abs(hd) -> Tensor:  # noqa: ANN001
    return _CTX["wqa_abs"][id(hd[3])]


def _moves_q(data, h: int, rho: float, e: Tensor) -> Tensor:  # noqa: ANN001
    return (rho * data.mQ[h] + e * data.nQ[h]) * (1 + 1e-12)


def _moves_k(data, h: int, rho: float, e: Tensor) -> Tensor:  # noqa: ANN001
    return (rho * data.mK[h] + e * data.nK[h]) * (1 + 1e-12)


def _lowrank_sup(i: int, cols_i: list, cols_q: list, heads, wts: Tensor, Qt: Tensor, rho: float, e: Tensor,  # noqa: ANN001
                 steps: int) -> float:
    """``>= sup_Delta sum_{h,j} wts_hj (l_hj . Delta)^2`` over ``Delta_m in rho Q~_m^{1/2} B + e_m B`` by the SDP dual:
    for any ``c > 0`` over the 2T blocks, ``(sum c) lambda_max(sum_k M_k M_k^T / c_k)`` (THEORY F82 (c)/(d))."""
    H, T = wts.shape
    d = Qt.shape[-1]
    s = torch.sqrt(wts).reshape(-1)  # (r,)
    r = H * T
    eye = torch.eye(T, dtype=torch.float64)
    Pm = torch.stack([hd[0][i] for hd in heads])  # (H, T)
    # per block m: L_m (d, r); m != i: column (h, j) = s_hj q_h (delta_mj - P_hm)
    Qm = torch.stack(cols_q)  # (H, d)
    coef = eye[:, None, :].expand(T, H, T) - Pm.T[:, :, None]  # [m, h, j] = delta_mj - P_hm
    coef = coef * s.reshape(H, T)[None]
    qQq = torch.einsum("ha,mab,kb->mhk", Qm, Qt, Qm)  # (T, H, H)
    qq = Qm @ Qm.T
    Me = torch.einsum("mhj,mhk,mkl->mhjkl", coef, qQq, coef).reshape(T, r, r)
    Mo = torch.einsum("mhj,hk,mkl->mhjkl", coef, qq, coef).reshape(T, r, r)
    Li = torch.stack(cols_i)  # (H, T, d)
    Lfull = (Li * s.reshape(H, T)[..., None]).reshape(r, d).T + Qm.T[:, :, None].expand(d, H, T).reshape(d, r) * coef[i].reshape(1, r)
    Me[i] = Lfull.T @ Qt[i] @ Lfull
    Mo[i] = Lfull.T @ Lfull
    blocks = torch.cat([Me * rho * rho, Mo * (e * e)[:, None, None]])  # (2T, r, r)
    absm = torch.cat([Me.abs(), Mo.abs()])  # rounding mass (prototype: gamma_{2d+4} of |M|)
    err_b = _gamma(2 * d + 4) * torch.linalg.matrix_norm(absm)  # per block, Frobenius
    err_b = torch.cat([err_b[:T] * rho * rho, err_b[T:] * (e * e)])
    keep = torch.linalg.matrix_norm(blocks) > 0
    blocks, err_b = blocks[keep], err_b[keep]
    if blocks.shape[0] == 0:
        return 0.0
    blocks = 0.5 * (blocks + blocks.transpose(1, 2))
    c = torch.sqrt(torch.linalg.matrix_norm(blocks, ord=2).clamp(min=1e-300))
    best, bestc = math.inf, c
    for _ in range(steps):
        M = (blocks / c[:, None, None]).sum(0)
        lam, vec = torch.linalg.eigh(M)
        val = float(c.sum()) * float(lam[-1])
        if val < best:
            best, bestc = val, c.clone()
        z = vec[:, -1]
        cn = torch.sqrt(torch.einsum("a,kab,b->k", z, blocks, z).clamp(min=0))  # ||M_k^T z||: the optimal c's shape
        cn = cn.clamp(min=float(cn.max()) * 1e-8)
        c = torch.sqrt(c * cn / float(cn.sum()) * float(c.sum()))  # damped (geometric mean); every c > 0 is valid
    M = (blocks / bestc[:, None, None]).sum(0)
    lam = float(certified_lmax(0.5 * (M + M.T)[None])[0])
    err = float((err_b / bestc).sum())
    return float(bestc.sum()) * (1 + 2 * len(bestc) * _U) * (lam + err) * (1 + 1e-10)


def _grams_sup(i: int, q_c: Tensor, gram_c: Tensor, vo_c: Tensor, SQ: Tensor, SK: Tensor, SVO: Tensor, Lc: Tensor,
               rho: float, e: Tensor) -> float:
    """``>= sum_m sup_{Delta_m} Delta_m^T G_m Delta_m`` (``G_m`` the per-token Grams): ``(rho lambda(Lc^T G Lc)^{1/2} +
    e_m lambda(G)^{1/2})^2`` per token (prototype: ``eigvalsh`` padded)."""
    T = Lc.shape[0]
    tot = 0.0
    for m in range(T):
        G = torch.einsum("h,hab->ab", gram_c[:, m], SK) + torch.einsum("h,hab->ab", vo_c[:, m], SVO)
        if m == i:
            G = G + torch.einsum("h,hab->ab", q_c, SQ)
        G = 0.5 * (G + G.T)
        pad = G.shape[0] * _U * float(torch.linalg.matrix_norm(G))
        lg = float(torch.linalg.eigvalsh(G)[-1]) * (1 + 1e-9) + pad
        GQ = Lc[m].T @ G @ Lc[m]
        lq = float(torch.linalg.eigvalsh(0.5 * (GQ + GQ.T))[-1]) * (1 + 1e-9) + 4 * G.shape[0] * _U * float(
            torch.linalg.matrix_norm(Lc[m]) ** 2 * torch.linalg.matrix_norm(G))
        tot += (rho * math.sqrt(max(lq, 0.0)) + float(e[m]) * math.sqrt(max(lg, 0.0))) ** 2
    return tot * (1 + 1e-10)


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
    spec = load(None).to_torch(torch.float64)
    X = load_inputs(spec, "sklearn-descr", max_len=32, limit=20)[a.sentence].double()
    if a.layers < len(spec.layers):
        spec = replace(spec, layers=spec.layers[: a.layers], final_norm=None)
    med = float(X.norm(dim=1).median())
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
    inner, rows, cpu = _ls._attention_rest, [], {"psd": 0.0, "adam": 0.0}

    def wrapped(st, at, k, rho, E, r, pad):  # noqa: ANN001, ANN202
        R = inner(st, at, k, rho, E, r, pad)
        f = next((v for key, v in targets.items() if abs(key - rho) <= 1e-12 * key), None)
        if f is None or at.aa is None:
            return R
        aa = at.aa
        heads, wqa = aa.p["heads"], aa.p["Wqa"]
        _CTX.update(x=st.x, scale=aa.p["scale"], wqa_abs={id(hd[3]): w.abs() for hd, w in zip(heads, wqa)})
        c0 = time.process_time()
        new = torch.stack([psd_rest_rows(at.forms, heads, aa.Qs, aa.eQ, rho, E, at.eP, pad, a0, b0)
                           for a0, b0 in grid]).min(dim=0).values
        cpu["psd"] += time.process_time() - c0
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
        rows.append((st.group, f, float(E.max()), new, f78d, f81, R, att))
        return R

    _ls._attention_rest = wrapped
    c = time.process_time()
    _ls.stack_local(spec, X, [f * med for f in factors], segment=True, aux=_ls.SEGMENT_AUX, move_rest=True)
    print(f"sentence {a.sentence}, {a.layers} layers: {time.process_time() - c:.1f} s CPU "
          f"(F85 rows {cpu['psd']:.1f} s, Adam {cpu['adam']:.1f} s); grid {grid}")
    print("layer radius maxE | F85 F78d F81 kept attained | kept/F85 (max over queries) | min-per-query gain | F85>=att")
    for lay, f, Em, new, f78d, f81, R, att in rows:
        both = torch.minimum(new, R)
        print(f"{lay} {f:g} {Em:.3g} | {new.max():.3g} {f78d.max():.3g} {f81.max():.3g} {R.max():.3g} {att.max():.3g} | "
              f"{float(R.max() / new.max()):.3f} | {float(R.max() / both.max()):.3f} | {bool((new >= att).all())}")
        bind = ["F78d" if float(a) <= float(b) else "F81" for a, b in zip(f78d, f81)]
        print("    per query F85/kept:", " ".join(f"{float(n / k):.2f}" for n, k in zip(new, R)), "binding:",
              ",".join(sorted(set(bind))))


if __name__ == "__main__":
    main()
