"""The attention's first-order drift seen through the exact prefix at the data (issue 12; THEORY F44).

F36/F40 need, for the attention sub-stage ``x -> x + A(x)`` of a post-LN layer, ``v_k >= nu_k((J(y) -
J(x)) P(x))``: the Jacobian's drift applied to the rows the prefix ``P`` can produce.  F35 bounds it by
``dJ_k ||P||`` (every direction of the input ball, every row of unit length).  The attention reads its
input only through ``W_Q``, ``W_K``, ``W_V``, and both the move of the point and the Jacobian's argument
are rows of the same prefix, which lie in the ellipsoids ``E(Q_j)`` of F40a.  So the second derivative of
a head (F35a) needs only the projections ``Q_j^{1/2} W`` of d_head columns:

* the query part of a score change ``e_i . G y_j`` as the vector ``Q_i^{1/2} G y_j`` (a T x T Gram per
  query, ``(Y_i W_K) W_Q^T Q_i W_Q (Y_i W_K)^T``),
* the key part ``q_i . e_j`` as ``||Q_j^{1/2} q_i||``,
* the value part ``W_V^T e_j`` as ``||Q_j^{1/2} W_V||``, the cross part ``e_i^T G e_j`` as
  ``||Q_i^{1/2} W_Q|| ||Q_j^{1/2} W_K||``,

each an exact projection at the data (d_head x d_head Grams per token and head).  The sup over the ball
of the projected second derivative (F35b's envelopes) integrated along the segment (F35c) bounds the first
order and the softmax's higher orders together; the part of the move outside the ellipsoids (the prefix's
own drift and rounding) is second order and takes the same sup with that tangent in the unit ball.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._local_drift import SEGMENT_STEPS, _ball_moment, attention_drift_hessian, heads_joint
from ._local_jacobian import certified_lmax, certified_spectral, pow2_norm, root_sum_squares
from ._local_rows import _heads_combined, _lmax_gram
from ._local_sharp import ball_box
from ._local_stack_aligned import ellipsoid_gram
from ._rounding import _gamma, product_row_error

__all__ = ["head_projections", "ball_side", "centred_max", "aligned_hessian_sup", "attention_aligned_reach", "attention_aligned_drift",
           "AttentionAligned"]

_U = 2.0**-53


def _fro(A: Tensor, dims: tuple) -> Tensor:
    """Frobenius norms over ``dims`` (``pow2_norm``: no square under- or overflows, THEORY F81d), padded up for their
    own float64 sum."""
    n = math.prod(A.shape[d] for d in dims)
    return pow2_norm(A, dims) * (1 + (n + 2) * _U)


def _projected_lmax(W: Tensor, Qs: Tensor, fQ: Tensor, eQ: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(H, T) certified ``lambda_max(W_h^T Q*_j W_h)`` for ``W`` (H, d, dh) and the ellipsoids ``Q*_j`` known
    as ``Qs`` (T, d, d) to within ``eQ`` (T,) (Frobenius), ``fQ`` (T,) ``>= ||Qs_j||_F``: the eigenvalue of
    the float64 product, certified (F32), plus the product's rounding ``gamma_{2d} ||W_h||_F^2 ||Q_j||_F``
    and ``||W_h||_F^2 eQ_j`` (``W^T (Q* - Q) W``); with the formed products (H, T, dh, dh) and that error bound
    (H, T) (Frobenius), which F50's cores read.  THEORY F44a."""
    H, d, dh = W.shape
    T = Qs.shape[0]
    M = torch.einsum("had,tab,hbe->thde", W, Qs, W)
    M = 0.5 * (M + M.transpose(2, 3))
    lam = certified_lmax(M.reshape(T * H, dh, dh)).reshape(T, H).T
    fW2 = (_fro(W, (1, 2)) ** 2)[:, None]
    err = (fW2 * (_gamma(2 * d + 2) * fQ[None, :] + eQ[None, :]) + _U * _fro(M, (2, 3)).T) * (1 + 1e-12)
    return torch.nan_to_num((lam + err) * (1 + 1e-12), nan=math.inf), M.transpose(0, 1), err


def head_projections(heads, moments, Qs: Tensor, eQ: Tensor, scale: float) -> list[dict]:  # noqa: ANN001
    r"""Per head (``heads``: ``_head_data``'s ``(P, Y, q, Wq, Wk, Wv, Wo)``, ``moments`` their ``_HeadMoments``) the
    radius-free projections of F44a through the reachable ellipsoids ``Q*_j`` (``Qs`` (T, d, d) as formed, ``eQ`` (T,)
    their Frobenius errors, ``ellipsoid_gram``), all certified upper bounds (a *side* of ``aligned_hessian_sup``):

    * ``mQ2``, ``mK2``, ``mV2`` (T,): ``lambda_max(W^T Q*_j W)`` for ``W = W_Q, W_K, W_V`` of the head,
    * ``om2`` (T, T): ``[i, j] >= q_i^T Q*_j q_i`` (``q_i = scale W_K u_i`` the score's key gradient),
    * ``g2`` (T, T), ``lG`` (T,): ``||g_ij||^2`` and ``lambda_max(sum_j P_ij g_ij g_ij^T)`` for ``g_ij = Q*_i^{1/2} G y_ij``,
      from the Gram ``KG[i] = Kc_i M_i Kc_i^T`` (``Kc_i = scale Y_i W_K`` the centred keys of query i, ``M_i = W_Q^T Q_i
      W_Q`` as formed): the exact Gram is below ``KG[i] + eM_i Kc_i Kc_i^T + E_i`` (``eM_i`` bounds ``M_i``'s error:
      ``W^T (Q* - Q) W``, its float64 product and symmetrisation; ``||E_i||_F <= gamma_{2dh+2} ||Kc_i||_F^2 ||M_i||_F``
      the Gram's product), so both take ``eM_i ||Kc_ij||^2`` (weighted) plus ``||E_i||_F``;
    * ``MV`` (T, dh, dh), ``eMV`` (T,): the formed ``W_V^T Q_j W_V`` and their Frobenius error bounds (F50's cores).
    THEORY F44a."""
    d = Qs.shape[1]
    fQ = _fro(Qs, (1, 2))
    W = {k: torch.stack([hd[n] for hd in heads]) for k, n in (("Q", 3), ("K", 4), ("V", 5))}
    proj = {k: _projected_lmax(w, Qs, fQ, eQ) for k, w in W.items()}
    lam = {k: v[0] for k, v in proj.items()}
    out = []
    for h, (hd, m) in enumerate(zip(heads, moments.rows)):
        P, Y, q, Wq, Wk, _, _ = hd
        qQ = torch.einsum("ia,jab,ib->ij", q, Qs, q)
        qn2 = (_fro(q, (1,)) ** 2)[:, None]
        om2 = qQ + qn2 * (_gamma(2 * d + 2) * fQ[None, :] + eQ[None, :])
        # THEORY F97: the exact q_i is within q_err of the formed one, so ||Q*_j^{1/2} q_i|| moves by at most
        # ||Q*_j||^{1/2} q_err_i, ||Q*_j|| <= ||Q_j||_F + eQ_j
        om2 = (torch.sqrt(om2.clamp(min=0.0) * (1 + 1e-12))
               + torch.sqrt((fQ + eQ) * (1 + 1e-12))[None, :] * hd.q_err[:, None] * (1 + 1e-12)) ** 2
        M = Wq.T @ Qs @ Wq  # (T, dh, dh): M_i = W_Q^T Q_i W_Q
        M = 0.5 * (M + M.transpose(1, 2))
        eM = (_fro(Wq, (0, 1)) ** 2 * (_gamma(2 * d + 2) * fQ + eQ) + _U * _fro(M, (1, 2))) * (1 + 1e-12)
        Kc = scale * (Y @ Wk)  # (T, T, dh): Kc[i, j] = scale (x_j - xbar_i) W_K
        KG = Kc @ M @ Kc.transpose(1, 2)
        kc2 = _fro(Kc, (2,)) ** 2
        eKG = _gamma(2 * Wq.shape[1] + 2) * kc2.sum(dim=1) * _fro(M, (1, 2)) * (1 + 1e-12)
        g2 = KG.diagonal(dim1=1, dim2=2).clamp(min=0.0) + eM[:, None] * kc2 + eKG[:, None]
        lG = _lmax_gram(KG, P) + eM * (P * kc2).sum(dim=1) + eKG
        # THEORY F97: the exact keys scale y_ij W_K are within ek of the formed Kc (twice Higham's bound: the scaling
        # rounds once more), so ||M_i^{1/2} k|| moves by at most ||M_i||^{1/2} ek (and the weighted Gram's root by
        # ||M_i||^{1/2} (sum_j P_ij ek^2)^{1/2}, Minkowski)
        ek = 2 * scale * product_row_error(Y, Wk)
        sM = torch.sqrt((_fro(M, (1, 2)) + eM) * (1 + 1e-12))
        g2 = (torch.sqrt(g2 * (1 + 1e-12)) + sM[:, None] * ek * (1 + 1e-12)) ** 2
        lG = (torch.sqrt(lG * (1 + 1e-12)) + sM * torch.sqrt((P * ek * ek).sum(dim=1) * (1 + 1e-12))) ** 2
        out.append({"mQ2": lam["Q"][h], "mK2": lam["K"][h], "mV2": lam["V"][h], "om2": om2 * (1 + 1e-12),
                    "g2": g2 * (1 + 1e-12), "lG": lG * (1 + 1e-12), "MV": proj["V"][1][h], "eMV": proj["V"][2][h]})
    return out


def ball_side(m: dict, nQ: float, nK: float, nV: float) -> dict:
    """The side of ``aligned_hessian_sup`` for tangents in the unit ball (``Q = I``): the weight norms, ``||q_i||``
    and F35's moments ``||G y_ij||``, ``lambda_max(sum_j P_j G y_ij (G y_ij)^T)`` (THEORY F44b)."""
    T = m["P"].shape[0]
    one = torch.ones(T, dtype=torch.float64)
    qn = m["qn"] * (1 + 1e-12)
    return {"mQ2": nQ * nQ * one, "mK2": nK * nK * one, "mV2": nV * nV * one, "om2": (qn * qn)[:, None].expand(T, T),
            "g2": m["gn"] * m["gn"] * (1 + 1e-12), "lG": m["lG"]}


def _pmean(P: Tensor, a: Tensor, f: Tensor) -> Tensor:
    """(T,) ``>= sum_j P'_ij f_ij`` for every weight row with ``P' <= P + a``, ``sum_j P'_ij = 1``, ``P'_ij = 0`` where
    ``P_ij = 0`` (``f >= 0``, (T, T) or broadcast): ``min(sum_j (P + a)_ij f_ij, max_{visible j} f_ij)``."""
    f = f.expand_as(P)
    vis = torch.where(P > 0, f, torch.zeros_like(f)).max(dim=1).values
    return torch.minimum(((P + a) * f).sum(dim=1) * (1 + 1e-12), vis)


def _pvar(P: Tensor, a: Tensor, f: Tensor) -> Tensor:
    """(T,) ``>= sum_j P'_ij (b_j - sum_k P'_ik b_k)^2`` for every ``|b_j| <= f_ij`` and weights as in ``_pmean``: a
    variance is at most the second moment about any constant, about 0 (``_pmean`` of ``f^2``) or about ``b_*`` of a
    visible key ``*``: ``sum_{j != *} (P + a)_ij (f_ij + f_i*)^2``, the smallest over ``*``."""
    Pa = P + a
    off = 1 - torch.eye(P.shape[1], dtype=P.dtype)  # [j, *]: the key * itself left out
    anchored = (Pa[:, :, None] * (f[:, :, None] + f[:, None, :]) ** 2 * off[None]).sum(dim=1)  # [i, *]
    anchored = torch.where(P > 0, anchored, torch.full_like(anchored, math.inf)).min(dim=1).values
    return torch.minimum(_pmean(P, a, f * f), anchored * (1 + 1e-12))


def centred_max(P: Tensor, a: Tensor, gn: Tensor, qmove: Tensor, om: Tensor) -> Tensor:
    r"""(T,) per query ``>= max_{visible j} |c_j|`` at every Z of the ball, ``c_j = f_j - sum_k P'_k f_k`` the centred
    score change along one tangent, ``f_j = alpha . Q^{1/2} G (x'_j - xbar) + q'_i . e_j`` (THEORY F44b, F53a):
    ``|f_j| <= F_j = ||g_ij|| + qmove_i + om_ij`` (``gn`` (T, T) ``>= ||g_ij||``, ``om`` ``>= |q'_i . e_j|``), so
    ``|c_j| <= max_j F_j + |sum_k P'_k f_k|`` with the mean at most ``_pmean(F)`` or, the query part centred exactly
    (``sum_k P'_k (x'_k - xbar) = sum_k P'_k (x'_k - x_k) + sum_k (P'_k - P_k) y_k``, ``|P'_k - P_k| <= a_k``),
    ``qmove_i + sum_k a_k ||g_ik|| + _pmean(om)``; never above F44b's ``2 max_j F_j``."""
    cj = gn + qmove[:, None] + om
    top = torch.where(P > 0, cj, torch.zeros_like(cj)).max(dim=1).values
    shift = qmove + torch.where(P > 0, a * gn, torch.zeros_like(gn)).sum(dim=1) * (1 + 1e-12) + _pmean(P, a, om)
    return torch.minimum(2 * top, (top + torch.minimum(_pmean(P, a, cj), shift)) * (1 + 1e-12))


def _side_at(sd: dict, P: Tensor, a: Tensor, ratio: Tensor, rho: float, nQ: float, nK: float,
             scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One side's per-query bounds at every Z of ``B(X, rho)`` (THEORY F44b): ``A`` (the ``L^2(P')`` norm of a centred
    score change), ``c`` (its largest entry), ``sigma_V``, ``||Q_i^{1/2} W_Q||``, ``(sum_j P'_j ||Q_j^{1/2} W_K||^2)^{1/2}``
    and ``A`` without its query part ``lambda_max(sum_j P'_j g_ij g_ij^T)^{1/2}`` (the part F53 joins over the heads)."""
    mQ = torch.sqrt(sd["mQ2"])
    qmove = scale * mQ * nK * rho  # ||Q_i^{1/2} scale W_Q W_K^T (z_j - x_j)||
    om = torch.sqrt(sd["om2"]) + (scale * nQ * rho) * torch.sqrt(sd["mK2"])[None, :]  # >= |u'_i . W_K^T e_j| at Z
    rest = qmove + torch.sqrt(_pvar(P, a, om))
    A = _ball_moment(sd["lG"], a, sd["g2"], ratio) + rest
    chat = centred_max(P, a, torch.sqrt(sd["g2"]), qmove, om)
    sigV = torch.sqrt(_pvar(P, a, torch.sqrt(sd["mV2"]).expand_as(P)))
    return A, chat, sigV, mQ, torch.sqrt(_pmean(P, a, sd["mK2"][None, :])), rest


@dataclass(frozen=True)
class HeadSides:
    """One head's F44b factors on ``B(X, rho)``: the envelope's excess weights ``a`` and ``ratio = max a/P``, per side
    ``(A, c, sigma_V, mu_Q, kappa_K)`` (``_side_at``), the value moment ``sV``, the largest centred value ``what`` and
    per side ``A`` without its query part (``rest``, THEORY F53)."""

    a: Tensor
    ratio: Tensor
    one: tuple
    two: tuple
    sV: Tensor
    what: Tensor
    rest: tuple


def head_sides(s1: dict, s2: dict, m: dict, rho: float, nG: float, nV: float, nQ: float, nK: float,
               scale: float) -> HeadSides:
    """``HeadSides`` of one head (arguments as ``aligned_hessian_sup``'s; THEORY F44b)."""
    P = m["P"]
    _, _, a, _, _ = ball_box(m, rho, nG)
    ratio = torch.where(P > 0, a / P, torch.zeros_like(P)).max(dim=1).values * (1 + 1e-12)
    *one, rest1 = _side_at(s1, P, a, ratio, rho, nQ, nK, scale)
    *two, rest2 = _side_at(s2, P, a, ratio, rho, nQ, nK, scale)
    sV = _ball_moment(m["lV"], a, m["vn"] * m["vn"], ratio) + nV * rho
    # the largest centred value at Z: ||W_V^T (x'_j - xbar')|| <= ||W_V^T y_j|| + 2 ||W_V|| rho + sum_k a_k ||W_V^T y_k||
    vis = torch.where(P > 0, m["vn"], torch.zeros_like(P)).max(dim=1).values
    return HeadSides(a, ratio, tuple(one), tuple(two), sV, vis + 2 * nV * rho + (a * m["vn"]).sum(dim=1), (rest1, rest2))


def aligned_hessian_sup(s1: dict, s2: dict, m: dict, rho: float, nG: float, nV: float, nQ: float, nK: float,
                        scale: float, hs: HeadSides | None = None) -> Tensor:
    r"""(T,) per query ``i`` a certified ``sup_{Z in B(X, rho)} ||H_i(Z)[Delta, E]||`` of one head (before ``W_O``,
    F35a) over the tangents with rows ``Delta_j`` in side ``s1``'s ellipsoid ``E(Q1_j)`` and ``E_j`` in ``s2``'s (THEORY F44b):

    .. math:: A_1\sigma_{V,2} + A_2\sigma_{V,1} + \min\big(\min(A_1 \hat c_2, A_2 \hat c_1)\, s_V,\ A_1 A_2 \hat w\big)
              + \mathrm{scale}\,(\mu_{Q2,i} \kappa_{K1} + \mu_{Q1,i} \kappa_{K2})\, s_V

    with, at every Z of the ball (weights ``P' <= P + a``, F31a's envelope, each sum over ``P'`` by ``_pmean``/``_pvar``):
    ``A = lambda_max(sum_j P'_j g_ij g_ij^T)^{1/2} + scale mu_Q,i ||W_K|| rho + (var_{P'} om'_ij)^{1/2}`` the ``L^2(P')``
    bound of a centred score change (``g_ij = scale Q_i^{1/2} W_Q W_K^T y_j``, second moment about X's mean;
    ``om'_ij = ||Q_j^{1/2} q_i|| + scale ||W_Q|| rho mu_K,j``), ``c = 2 max_j (||g_ij|| + scale mu_Q,i ||W_K|| rho + om'_ij)``
    its largest entry, ``sigma_V = (var_{P'} mu_V,j)^{1/2}``, ``kappa_K = (sum_j P'_j mu_K,j^2)^{1/2}``
    (``mu_W,j = ||Q_j^{1/2} W||``), ``s_V`` F35b's value moment on the ball, ``w^ = max_j ||W_V^T y_j|| + 2 ||W_V|| rho
    + sum_j a_j ||W_V^T y_j||`` the largest centred value on it.  ``s1``, ``s2``: ``head_projections``
    rows or ``ball_side``; ``m`` the head's ``_HeadMoments`` row, ``nG``, ``nV``, ``nQ``, ``nK`` certified
    ``||scale W_Q W_K^T||``, ``||W_V||``, ``||W_Q||``, ``||W_K||``.  Assumptions: every token of the attention's input
    within ``rho`` of X; dot attention without RoPE, soft-cap or q/k norm.  ``hs``: ``head_sides`` of these arguments
    when the caller holds it (the same floats, THEORY F83b)."""
    hs = head_sides(s1, s2, m, rho, nG, nV, nQ, nK, scale) if hs is None else hs
    (A1, c1, v1, q1, k1), (A2, c2, v2, q2, k2), sV, what = hs.one, hs.two, hs.sV, hs.what
    t3 = torch.minimum(torch.minimum(A1 * c2, A2 * c1) * sV, A1 * A2 * what)
    out = (A1 * v2 + A2 * v1 + t3 + scale * (q2 * k1 + q1 * k2) * sV) * (1 + 1e-10)
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


def attention_aligned_reach(first: Tensor, mixed: Tensor, second: Tensor, rho: float, emax: float, r: float,
                            eP: float) -> Tensor:
    r"""(H, T) per head and query ``>= nu_k((Z^h(y) - Z^h(x)) P(x))`` (the head's Jacobian drift before ``W_O`` on the
    exact prefix's rows, THEORY F44c), from ``(J(y) - J(x)) E = int_0^1 H(x + t Delta)[Delta, E] dt`` with
    ``Delta = rho Phat h + e`` and ``E = Phat v + eps``:

    .. math:: \rho\,F_{h,k} + e_{\max} F^{m}_{h,k} + r\, e_P\, S_{h,k}

    ``first`` ``F``, ``mixed`` ``F^m``: the segment integrals of ``aligned_hessian_sup`` with both tangents in the
    prefix's ellipsoids, and with ``Delta`` in the unit ball and ``E`` in the ellipsoids; ``second`` ``S`` the segment
    integral of F35's unit-ball sup; ``emax >= max_j ||e_j||`` (the move outside the ellipsoids: the prefix's drift,
    rounding and centre pad), ``r >= max_j ||Delta_j||``, ``eP >= max_j ||eps_j||`` the computed prefix's rounding."""
    out = (rho * first + emax * mixed + r * eP * second) * (1 + 1e-12)
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


def attention_aligned_drift(mixed: Tensor, second: Tensor, rho: float, emax: float) -> Tensor:
    r"""(H, T) per head and query ``>= nu_k(Z^h(y_s) - Z^h(x_s))`` for ``y`` in the network's ball ``B(x, rho)`` (THEORY
    F44e): the move ``Delta = rho Phat h + e`` is a prefix row plus ``||e_j|| <= emax``, the argument any unit row:

    .. math:: \rho\,F^{m}_{h,k} + e_{\max} S_{h,k}

    (``mixed`` ``F^m`` and ``second`` ``S`` as in ``attention_aligned_reach``)."""
    out = (rho * mixed + emax * second) * (1 + 1e-12)
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


def _segment(sup, r: float) -> Tensor:  # noqa: ANN001
    """``(1/n) sum_{k=1}^n sup(k r / n)`` (F35c's right Riemann sum of ball sups along the segment)."""
    n = SEGMENT_STEPS
    return sum(sup(k * r / n) for k in range(1, n + 1)) / n * (1 + 1e-12)


def _seg_sum(parts: list[dict]) -> dict:
    """Per key the mean of ``parts`` (F35c's right Riemann sum over the segment's points), padded."""
    return {k: sum(p[k] for p in parts) / len(parts) * (1 + 1e-12) for k in parts[0]}


class AttentionAligned:
    """F44 for one post-LN attention sub-stage: the projections through the prefix's ellipsoids at the data,
    then per radius the heads' reach combined through ``W_O`` (``reach``)."""

    def __init__(self, parts: dict, blocks: Tensor) -> None:
        self.p, self.memo, self.blocks = parts, {}, blocks  # the prefix's computed blocks (F84 (e) reads them)
        T = blocks.shape[0]
        grams = [ellipsoid_gram(blocks[j]) for j in range(T)]
        Qs = torch.stack([g[0] for g in grams])
        eQ = torch.tensor([g[1] for g in grams], dtype=torch.float64)
        self.Qs, self.eQ = Qs, eQ
        self.proj = head_projections(parts["heads"], parts["mom"], Qs, eQ, parts["scale"])
        self.nQ = certified_spectral(torch.stack([hd[3] for hd in parts["heads"]])) * (1 + 1e-12)
        self.nK = certified_spectral(torch.stack([hd[4] for hd in parts["heads"]])) * (1 + 1e-12)
        w = parts["norms"]
        self.ball = [ball_side(m, float(self.nQ[h]), float(self.nK[h]), w["V"][h]) for h, m in enumerate(parts["mom"].rows)]

    def sup(self, rho: float, mixed: bool = False) -> Tensor:
        """(H, T) ``aligned_hessian_sup`` of every head on ``B(X, rho)``, both tangents in the ellipsoids or (``mixed``)
        the first in the unit ball."""
        w = self.p["norms"]
        return torch.stack([
            aligned_hessian_sup(self.ball[h] if mixed else pj, pj, m, rho, w["G"][h], w["V"][h], float(self.nQ[h]),
                                float(self.nK[h]), self.p["scale"], self.sides(h, mixed, rho))
            for h, (pj, m) in enumerate(zip(self.proj, self.p["mom"].rows))])

    def sides(self, h: int, ball: bool, rho: float) -> HeadSides:
        """Head ``h``'s ``head_sides`` on ``B(X, rho)`` with the first tangent in the unit ball (``ball``) or the
        ellipsoids and the second in the ellipsoids, formed once per radius: ``sup``, ``terms`` and ``acw_reach`` read
        the same segment points (THEORY F44b, F50a, F68b; F83b)."""
        key = ("sides", h, ball, rho)
        if key not in self.memo:
            w, pj = self.p["norms"], self.proj[h]
            self.memo[key] = head_sides(self.ball[h] if ball else pj, pj, self.p["mom"].rows[h], rho, w["G"][h],
                                        w["V"][h], float(self.nQ[h]), float(self.nK[h]), self.p["scale"])
        return self.memo[key]

    def integrals(self, r: float) -> tuple[Tensor, Tensor, Tensor]:
        """(H, T) each: the segment sums on ``B(X, r)`` of ``aligned_hessian_sup`` with both tangents in the
        ellipsoids (``F``), with one in the unit ball (``F^m``; the bound is symmetric in its two families), and
        F35's unit-ball sup (``S``), kept per radius."""
        memo = self.memo  # the ellipsoids are this prefix's: the memo lives on the instance
        if r not in memo:
            memo[r] = (_segment(self.sup, r), _segment(lambda t: self.sup(t, True), r),
                       attention_drift_hessian(self.p["mom"], r, self.p["norms"]) / r)
        return memo[r]

    def combined(self, b: Tensor) -> Tensor:
        """(T,) heads' rows ``b`` (H, T) through ``W_O`` (``_heads_combined``, F35d)."""
        return _heads_combined(self.p["Oh"], self.p["Oall"], b, heads_joint(self.p["Cw"], b))

    def reach_heads(self, r: Tensor, rho: float, dP: Tensor, eP: float, pad: float,
                    img: Tensor | None = None) -> Tensor:
        """(H, T) the heads' reach before ``W_O`` (``attention_aligned_reach``, F44c) at token radii ``r`` (every token
        of the stage's input within ``r_j`` of x) and prefix drift rows ``dP``; with ``img`` (F87's ``C``, (4, H, T))
        also the move's rest through the heads' factors (``image_drift``, THEORY F89), the smaller kept."""
        rm = float(r.max())
        H = len(self.proj)
        if not math.isfinite(rm):
            return torch.full((H, r.shape[0]), math.inf, dtype=torch.float64)
        if rm == 0:
            return torch.zeros(H, r.shape[0], dtype=torch.float64)
        F, Fm, S = self.integrals(rm)
        emax = float((rho * (dP + eP) + pad).max())
        out = attention_aligned_reach(F, Fm, S, rho, emax, rm, eP)
        if img is None:
            return out
        alt = (rho * F + self.image_drift(img, rho, dP, eP, pad, rm, False) + rm * eP * S) * (1 + 1e-12)
        return torch.minimum(out, torch.nan_to_num(alt, nan=math.inf))

    def image_drift(self, C: Tensor, rho: float, dP: Tensor, eP: float, pad: float, rm: float, ball: bool) -> Tensor:
        r"""(H, T) per head the segment sum on ``B(X, rm)`` of ``aligned_hessian_sup`` with the move's part outside the
        prefix's ellipsoids as the first tangent family (``image_side``: F87's ``C`` (4, H, T) through the head's
        factors, capped by the rows ``rho dP`` and the ball ``rho e_P + pad`` beside them) and the argument in the unit
        ball (``ball``: the drift rows, F44e) or in the prefix's ellipsoids (the reach, F44c): what ``e_max S`` and
        ``e_max F^m`` bound with the move's rest in a ball (THEORY F89)."""
        from ._local_attn_img_side import head_key_data, image_side

        if "F89 keys" not in self.memo:
            self.memo["F89 keys"] = head_key_data(self.p["heads"], self.p["X"], self.p["Wqa"], self.p["scale"])
        keys, w, rows = self.memo["F89 keys"], self.p["norms"], self.p["mom"].rows
        E, b = rho * dP * (1 + 1e-12), (rho * eP + pad) * (1 + 1e-12)
        sides = [image_side(C[:, h], keys[h], m, float(self.nQ[h]), float(self.nK[h]), w["V"][h], self.p["scale"], E,
                            b) for h, m in enumerate(rows)]
        other = self.ball if ball else self.proj
        return _segment(lambda t: torch.stack([
            aligned_hessian_sup(sd, other[h], m, t, w["G"][h], w["V"][h], float(self.nQ[h]), float(self.nK[h]),
                                self.p["scale"]) for h, (sd, m) in enumerate(zip(sides, rows))]), rm)

    def reach(self, r: Tensor, nu: Tensor, rho: float, dP: Tensor, eP: float, pad: float) -> Tensor:  # noqa: ARG002
        """(T,) ``v_k`` of F44c through ``W_O`` (``_heads_combined``, F35d; ``nu``: the prefix rows, unused: the
        ellipsoids carry them)."""
        return self.combined(self.reach_heads(r, rho, dP, eP, pad))

    def joint(self, r: Tensor, rho: float, dP: Tensor, eP: float, pad: float,
              through: bool = True) -> tuple[Tensor, Tensor | None]:
        """``(v, v_M)``: the reach of ``reach`` and ``through`` with one output direction for all heads (THEORY F50):
        the coefficients of ``aligned_hessian_terms`` along the segment as ``attention_aligned_reach`` combines
        ``F``, ``F^m`` and ``S`` (the last in norm only), then ``joint_reach`` through ``W_O`` and through the layer's
        token-local product at x (None without one, or when ``through`` is False: a caller that reads ``v`` only, whose
        floats are the same either way, THEORY F83a); each the smaller of F50's branch, F53b's (``branch``) and F68's
        (``hadamard_branch``)."""
        rm = float(r.max())
        T = r.shape[0]
        kept = through and "M" in self.p
        if not math.isfinite(rm):
            inf = torch.full((T,), math.inf, dtype=torch.float64)
            return inf, (inf if kept else None)
        if rm == 0:
            zero = torch.zeros(T, dtype=torch.float64)
            return zero, (zero if kept else None)
        emax = float((rho * (dP + eP) + pad).max())
        out = [self.branch(rm, rho, emax, eP, True, through), self.branch(rm, rho, emax, eP, False, through),
               self.hadamard_branch(rm, rho, emax, eP, through)]
        v = torch.minimum(torch.minimum(out[0][0], out[1][0]), out[2][0])
        return v, (None if out[0][1] is None else torch.minimum(torch.minimum(out[0][1], out[1][1]), out[2][1]))

    def branch(self, rm: float, rho: float, emax: float, eP: float, query: bool,
               through: bool = True) -> tuple[Tensor, Tensor | None]:
        """``joint``'s pair for one branch on ``B(X, rm)``: F50's (``query``) or F53b's, F50 without the query parts of
        ``A`` plus ``query_joint`` (one query move and one output direction for all heads)."""
        return self._branch(rm, rho, emax, eP, query, True, through)

    def hadamard_branch(self, rm: float, rho: float, emax: float, eP: float,
                        through: bool = True) -> tuple[Tensor, Tensor | None]:
        """``joint``'s pair for F68's branch on ``B(X, rm)``: F53b's without the ``a c w`` term of the ellipsoid pair
        (``rho F``'s) plus ``rho`` times that term for all heads at once (``acw_reach``)."""
        return self._branch(rm, rho, emax, eP, False, False, through)

    def _branch(self, rm: float, rho: float, emax: float, eP: float, query: bool, acw: bool,
                through: bool) -> tuple[Tensor, Tensor | None]:
        """``branch`` (``acw``) and ``hadamard_branch``: the coefficients along the segment through ``joint_reach``, then
        (``query`` False) ``query_joint`` and (``acw`` False) ``acw_reach``; the pair's second (through the layer's
        token-local product) only with ``through``."""
        _, _, S = self.integrals(rm)
        F, Fm = self.terms(rm, query, acw)
        coef = {k: (rho * F[k] + emax * Fm[k]) * (1 + 1e-12) for k in F}
        coef["1"] = coef["1"] + rm * eP * S * (1 + 1e-12)
        v, vM = self._joint(coef, through)
        if query:
            return v, vM
        aw, aM = (0.0, 0.0) if acw else self.acw_reach(rm, rho, emax, through)
        v = (v + self.query_joint(rm, rho, emax, False) + aw) * (1 + 1e-12)
        return v, (None if vM is None else (vM + self.query_joint(rm, rho, emax, True) + aM) * (1 + 1e-12))

    def acw_reach(self, r: float, rho: float, emax: float, through: bool = True) -> tuple[Tensor, Tensor | None]:
        r"""(T,) each: ``rho`` times the ``a c w`` term of all heads in ``rho F``'s pair along the segment (THEORY F68c),
        through ``W_O`` and (None without one) through ``M_k(x) W_O^T``: F65b's Hadamard Gram at X (``hadamard_acw``)
        plus the rest ``(1/2) sup_Z ||D_Delta acw||`` per head (``acw_drift``, the move ``rho`` times a prefix row plus
        ``e_max`` in the unit ball) combined as F35d/F44g (the second None unless ``through``)."""
        from ._local_stack_hadamard import acw_drift

        key = ("acw", r)
        if key not in self.memo:
            def drift(ball: bool) -> Tensor:
                return torch.stack([acw_drift(self.sides(h, ball, r), self.ball[h] if ball else pj, pj, self.p["scale"])
                                    for h, pj in enumerate(self.proj)])
            self.memo[key] = (drift(False), drift(True))
        De, Db = self.memo[key]
        rest = 0.5 * (rho * De + emax * Db) * (1 + 1e-12)
        at = self.acw_data(False) + self.combined(rest)
        if not through or "M" not in self.p:
            return rho * at * (1 + 1e-12), None
        return rho * at * (1 + 1e-12), rho * (self.acw_data(True) + self.through(rest)) * (1 + 1e-12)

    def acw_data(self, through: bool) -> Tensor:
        """(T,) F65b's certified bound at X per query (``hadamard_acw``, THEORY F68a) through ``W_O`` or (``through``)
        ``M_k(x) W_O^T``, formed once."""
        from ._local_stack_hadamard import acw_bound

        key = ("acw_data", through)
        if key not in self.memo:
            MO, eMO = self._maps(through)
            heads, sc = self.p["heads"], self.p["scale"]
            self.memo[key] = torch.tensor([acw_bound(heads, i, sc, MO[i], float(eMO[i]), self.Qs, self.eQ)
                                           for i in range(MO.shape[0])], dtype=torch.float64)
        return self.memo[key]

    def query_joint(self, r: float, rho: float, emax: float, through: bool) -> Tensor:
        r"""(T,) the query parts of F44b's ``A_1 sigma_2 + A_2 sigma_1`` in the reach ``rho F + e_max F^m`` with one query
        move and one output direction for all heads (THEORY F53b): ``rho`` times twice the (ellipsoid query, ellipsoid
        values) pair, ``e_max`` times the (ball query, ellipsoid values) and (ellipsoid query, ``W_V^T W_V``) pairs, each
        ``query_value_reach`` along the segment on ``B(X, r)``, through ``W_O`` or (``through``) ``M_k(x) W_O^T``."""
        from ._local_stack_query import joint_query_lmax, query_excess, query_value_reach, value_lmax, value_weights

        done = ("query_joint", r, rho, emax, through)
        if done in self.memo:
            return self.memo[done]
        MO, eMO = self._maps(through)
        cores, w = self.cores(), self.p["norms"]
        n = SEGMENT_STEPS
        out = torch.zeros(MO.shape[0], dtype=torch.float64)
        for coeff, ball, K in ((2 * rho, False, "E"), (emax, True, "E"), (emax, False, "N")):
            key = ("query", ball, K, through)
            sides = self.ball if ball else self.proj
            if key not in self.memo:
                lam = torch.stack([sd["lG"] for sd in sides])
                wt = value_weights(cores[K], MO, lam)
                lamw = joint_query_lmax(self.p["heads"], None if ball else self.Qs, self.eQ, self.p["scale"], wt)
                self.memo[key] = (wt, lamw, *value_lmax(wt, cores[K], cores["err"][K], MO, eMO))
            wt, lamw, lamB, fMO = self.memo[key]
            exc = [torch.stack([query_excess(m, sd, k * r / n, w["G"][h]) for h, (sd, m)
                                in enumerate(zip(sides, self.p["mom"].rows))]) for k in range(1, n + 1)]
            out = out + coeff * query_value_reach(lamw, exc, wt, lamB, fMO)
        self.memo[done] = out * (1 + 1e-12)
        return self.memo[done]

    def _maps(self, through: bool) -> tuple[Tensor, Tensor]:
        """``(MO, eMO)``: ``W_O^T`` per token (exact as stored) or the layer's ``M_k(x) W_O^T`` with its error (F44g),
        formed once.
        Norms at powers of two (``pow2_norm``, THEORY F96)."""
        key = ("maps", through)
        if key in self.memo:
            return self.memo[key]
        Wo = torch.cat([hd[6] for hd in self.p["heads"]], dim=0)  # (H dh, d)
        T = self.p["heads"][0][0].shape[0]
        if not through:
            self.memo[key] = (Wo.T.expand(T, *Wo.T.shape), torch.zeros(T, dtype=torch.float64))
        else:
            M, eM = self.p["M"]
            nW = float(pow2_norm(Wo))
            self.memo[key] = (M @ Wo.T[None], (4 * (M.shape[1] + 2) * _U * pow2_norm(M, (1, 2)) * nW + eM * nW)
                              * (1 + 1e-12))
        return self.memo[key]

    def _joint(self, coef: dict, through: bool) -> tuple[Tensor, Tensor | None]:
        """``joint_reach`` of the heads' coefficients ``coef`` through ``W_O`` and (``through``, when the layer has
        one) through its token-local product at x."""
        from ._local_stack_joint import joint_reach

        cores, dh = self.cores(), self.p["heads"][0][6].shape[0]
        ident = joint_reach(coef, cores, *self._maps(False), dh, self.p["Oh"], self.p["Oall"], self.p["Cw"],
                            self._basis(False))
        if not through or "M" not in self.p:
            return ident, None
        per, full = self.p["MO"]
        return ident, joint_reach(coef, cores, *self._maps(True), dh, per, full, basis=self._basis(True))

    def _basis(self, through: bool) -> dict:
        """``joint_basis`` of the heads' cores through ``_maps(through)`` (THEORY F50c's coefficient-free parts), formed
        once (F83b)."""
        from ._local_stack_joint import joint_basis

        key = ("basis", through)
        if key not in self.memo:
            self.memo[key] = joint_basis(self.cores(), self._maps(through)[0], self.p["heads"][0][6].shape[0])
        return self.memo[key]

    def cores(self) -> dict:
        """``value_cores`` of the heads (THEORY F50b), formed once."""
        from ._local_stack_joint import value_cores

        if "cores" not in self.memo:
            MV = torch.stack([pj["MV"] for pj in self.proj])
            eMV = torch.stack([pj["eMV"] for pj in self.proj])
            self.memo["cores"] = value_cores(self.p["heads"], MV, eMV)
        return self.memo["cores"]

    def terms(self, r: float, query: bool = True, acw: bool = True) -> tuple[dict, dict]:
        """Per kind (H, T): the segment sums on ``B(X, r)`` of ``aligned_hessian_terms`` with both tangents in the
        ellipsoids and with the move in the unit ball (THEORY F50a; ``query=False``: without the query parts, F53;
        ``acw=False``: the first without its ``a c w`` term, F68), kept per radius."""
        from ._local_stack_joint import aligned_hessian_terms

        w = self.p["norms"]

        def at(t: float, mixed: bool) -> dict:
            rows = [aligned_hessian_terms(self.ball[h] if mixed else pj, pj, m, t, w["G"][h], w["V"][h],
                                          float(self.nQ[h]), float(self.nK[h]), self.p["scale"], mixed, False, query,
                                          acw or mixed, self.sides(h, mixed, t))
                    for h, (pj, m) in enumerate(zip(self.proj, self.p["mom"].rows))]
            return {k: torch.stack([row[k] for row in rows]) for k in rows[0]}

        key = ("terms", r, query, acw)
        if key not in self.memo:
            n = SEGMENT_STEPS
            self.memo[key] = tuple(_seg_sum([at(k * r / n, mixed) for k in range(1, n + 1)]) for mixed in (False, True))
        return self.memo[key]

    def through(self, b: Tensor) -> Tensor | None:
        """(T,) ``>= nu_k(M_k(x) W_O^T z_k)`` for heads' rows ``||z_h,k|| <= b_h,k`` (THEORY F44g): ``M_k`` the layer's
        token-local product at x (``MO``: its certified ``||M_k W_O^hT||``, ``||M_k W_O^T||``), the smaller of the
        per-head sum and the concatenation; None when the layer has no such product.  The root of the squares at a power
        of two where ``b`` is outside ``[2^-400, 2^400]`` (``root_sum_squares``: at ``2^-600`` it flushed to 0)."""
        if "MO" not in self.p:
            return None
        per, full = self.p["MO"]
        return torch.minimum((per * b).sum(dim=0), full * root_sum_squares(b, 0)) * (1 + 1e-12)

    def drift(self, r: Tensor, rho: float, dP: Tensor, eP: float, pad: float, heads: tuple | None,
              img: Tensor | None = None) -> tuple:
        """``(dj, heads)``: the sub-stage's drift rows ``sup nu_k(J(y_s) - J(x_s))`` on the network's ball (THEORY
        F44e), per head ``min(dZ_h, rho F^m + e_max S)`` (the move along the prefix's ellipsoids, the argument free)
        and with ``img`` (F87's ``C``, (4, H, T)) ``rho F^m`` plus the move's rest through the heads' factors
        (``image_drift``, THEORY F89; the smaller of it and ``e_max S`` also in F50d's joint), combined through ``W_O``;
        ``heads`` the stage's ``(dZ, a, c)`` (post-LN: ``a = 1``, ``c = 0``), returned with the smaller ``dZ``."""
        rm = float(r.max())
        if heads is None or not math.isfinite(rm) or rm == 0:
            return None, heads
        _, Fm, S = self.integrals(rm)
        emax = float((rho * (dP + eP) + pad).max())
        dZ = torch.minimum(heads[0], attention_aligned_drift(Fm, S, rho, emax))
        rest = emax * S  # the move's part outside the ellipsoids, per head and query
        if img is not None:
            rest = torch.minimum(rest, torch.nan_to_num(self.image_drift(img, rho, dP, eP, pad, rm, True), nan=math.inf))
            dZ = torch.minimum(dZ, (rho * Fm + rest) * (1 + 1e-12))
        # THEORY F50d: the same move with one output direction for all heads (F^m's terms, that part in norm only)
        coef = {k: rho * v * (1 + 1e-12) for k, v in self.terms(rm)[1].items()}
        coef["1"] = coef["1"] + rest * (1 + 1e-12)
        return torch.minimum(self.combined(dZ), self._joint(coef, False)[0]), (dZ, *heads[1:])
