"""The attention stage's own Taylor rest for moves along the prefix's rows (issue 12; THEORY F78).

The whole stack's move rest (F73c, F76) needs, for the post-LN attention sub-stage ``x -> x + A(x)`` at the data,
rows ``>= ||R_i||`` of ``R = A(x + Delta) - A(x) - A'(x) Delta = int_0^1 (1 - t) D^2 A(x + t Delta)[Delta, Delta] dt``
for the stage input's moves ``Delta = P(X) delta + e`` (every ``||delta_j|| <= rho``, ``||e_j|| <= E_j``).  Per head the
second derivative along the segment is the softmax's (``p''``, ``p'``) against centred values, and every factor is a
per query ``i`` and key ``j`` quantity: the score change ``u_ij`` (F44a's exact projections through the prefix's
ellipsoids, plus the e-part), the cross term ``2 q'_i . k'_j``, certified weight intervals on the segment, value gaps
at the data plus their move, the value velocity.  The Taylor integral's weight ``int (1 - t) dt = 1/2`` is kept.
Two further rows of the same rest: F44b/F35's ball sups weighted by ``1 - t`` on the segment's pieces
(``segment_rest_heads``, F78c) and F73c's own drift rows at the scaled moves of the pieces (``piecewise_rest_rows``, F78d).
F81 (``joint_rest_rows``): F78 with the score changes' variance joint over the keys — the query part of every key's
score change comes from one move of query i's row, so its ``p``-weighted second moment is F44a's ``lambda_max`` of the
weighted Gram, not the sum of every key's own maximum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ._local_jacobian import certified_spectral, pow2_exponent, pow2_norm
from ._rounding import _gamma

__all__ = ["AttnRestData", "attn_rest_data", "box_mean", "weight_box", "pair_mean", "head_rest_sup", "head_rest_sups",
           "attention_rest_rows", "segment_rest_heads", "piecewise_rest_rows", "joint_rest_rows", "JointSpread"]


@dataclass(frozen=True)
class AttnRestData:
    """Radius-free per-head data of F78 at the stage input ``X`` (T, d), each a certified upper bound unless said:
    ``S`` (H, T, T) the scores as computed (masked keys ``-inf``) and ``eS`` their rounding; ``g``, ``gn`` (H, T, T):
    ``||Q*_i^{1/2} G y_ij||`` and ``||G y_ij||`` (the query part of a score change); ``om``, ``qn``: ``||Q*_j^{1/2} q_i||``
    (H, T, T) and ``||q_i||`` (H, T) (the key part); ``mQ``, ``mK``, ``mV`` (H, T): ``||Q*_j^{1/2} W||``; ``nQ``, ``nK``,
    ``nV``, ``nO`` (H,): ``||W_Q||``, ``||W_K||``, ``||W_V||``, ``||W_O^h||``; ``Y`` (H, T, T): ``||W_O^hT W_V^hT (x_j -
    x_k)||`` and ``Yv`` the same before ``W_O`` (``||W_V^hT (x_j - x_k)||``), ``nOall`` ``>= ||W_O||`` (all heads); ``scale``
    the softmax scale (in ``G``, ``q``, ``S``, not in ``mQ``, ``nQ``); ``P`` (H, T, T) the weights as computed and ``lG``
    (H, T) ``>= lambda_max(sum_j P_ij g_ij g_ij^T)`` with exactly these ``P`` (F44a; F81's joint query part); ``lGb``
    (H, T) the same for the rows ``G y_ij`` as computed (F35's moment, F81's outside part) and ``eG`` (H, T)
    ``>= max_j ||G* y_ij - G y_ij||`` their rounding."""

    S: Tensor
    eS: Tensor
    g: Tensor
    gn: Tensor
    om: Tensor
    qn: Tensor
    mQ: Tensor
    mK: Tensor
    mV: Tensor
    nQ: Tensor
    nK: Tensor
    nV: Tensor
    nO: Tensor
    Y: Tensor
    Yv: Tensor
    nOall: float
    scale: float
    P: Tensor
    lG: Tensor
    lGb: Tensor
    eG: Tensor


def attn_rest_data(X: Tensor, heads, Wqa: list[Tensor], scale: float, proj: list[dict], nQ: Tensor, nK: Tensor,  # noqa: ANN001
                   nV, mom) -> AttnRestData:  # noqa: ANN001
    """F78's data for one attention sub-stage: ``heads`` ``_head_data``'s tuples at ``X``, ``Wqa`` the heads' augmented
    query maps ``[W_Q; b_Q]`` (float64), ``proj`` F44a's ``head_projections`` (the prefix's ellipsoids), ``nQ``, ``nK``,
    ``nV`` certified weight norms, ``mom`` the heads' ``_HeadMoments`` (F35; same ``heads``).  THEORY F78, F81.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = X.shape
    Xa = torch.cat([X, torch.ones(T, 1, dtype=torch.float64)], dim=1)
    sc = scale  # the softmax scale
    S, eS, g, gn, om, qn, Y, Yv, nO, eGm = [], [], [], [], [], [], [], [], [], []
    D = X[:, None, :] - X[None, :, :]
    for h, (P, Yc, q, Wq, Wk, Wv, Wo) in enumerate(heads):
        s = q @ X.T
        # q = fl(sc (Xa Wqa) Wk^T), s = fl(q X^T): the chain's rounding against the exact scores at X
        aq = sc * (Xa.abs() @ Wqa[h].abs()) @ Wk.abs().T
        es = _gamma(3 * d + 10) * (aq + q.abs()) @ X.abs().T * (1 + 1e-12)
        S.append(torch.where(P > 0, s, torch.full_like(s, -math.inf)))
        eS.append(es)
        G = sc * (Yc @ Wk) @ Wq.T  # (T, T, d): G y_ij
        eG = _gamma(2 * d + 4) * sc * (Yc.abs() @ Wk.abs()) @ Wq.abs().T
        gn.append((pow2_norm(G, -1) * (1 + 1e-12) + pow2_norm(eG, -1)) * (1 + 1e-12))
        eGm.append(torch.where(P > 0, pow2_norm(eG, -1), torch.zeros_like(P)).max(dim=1).values * (1 + 1e-12))
        qn.append((pow2_norm(q, -1) * (1 + 1e-12) + _gamma(2 * d + 8) * pow2_norm(aq, -1)) * (1 + 1e-12))
        g.append(torch.sqrt(proj[h]["g2"]))
        om.append(torch.sqrt(proj[h]["om2"]))
        Y.append(_gaps(D, Wv @ Wo, Wv.abs() @ Wo.abs(), d + Wv.shape[1] + 4))
        Yv.append(_gaps(D, Wv, Wv.abs(), d + 2))
        nO.append(float(certified_spectral(Wo[None])[0]))
    st = lambda k: torch.stack([torch.sqrt(p[k]) for p in proj])  # noqa: E731
    return AttnRestData(torch.stack(S), torch.stack(eS), torch.stack(g), torch.stack(gn), torch.stack(om),
                        torch.stack(qn), st("mQ2"), st("mK2"), st("mV2"), nQ.to(torch.float64).reshape(-1),
                        nK.to(torch.float64).reshape(-1), torch.tensor([float(v) for v in nV], dtype=torch.float64),
                        torch.tensor(nO, dtype=torch.float64) * (1 + 1e-12), torch.stack(Y), torch.stack(Yv),
                        float(certified_spectral(torch.cat([hd[6] for hd in heads])[None])[0]) * (1 + 1e-12), sc,
                        torch.stack([hd[0] for hd in heads]), torch.stack([p["lG"] for p in proj]),
                        torch.stack([m["lG"] for m in mom.rows]), torch.stack(eGm))


def _gaps(D: Tensor, M: Tensor, Mabs: Tensor, k: int) -> Tensor:
    """(T, T) ``>= ||(x_j - x_k) M*||`` for ``M*`` the exact product that ``M`` computes (``|M* - M| <= gamma_k |Mabs|``
    covers it, ``Mabs`` the product of the factors' absolute values) and ``D`` the computed differences (their own
    rounding, at most ``u |D|``, inside ``gamma_k`` too).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    return (pow2_norm(D @ M, -1) * (1 + 1e-12) + 2 * _gamma(k) * pow2_norm(D.abs() @ Mabs, -1)) * (1 + 1e-12)


def box_mean(lo: Tensor, hi: Tensor, c: Tensor) -> Tensor:
    r"""(T,) per row ``>= max { sum_j p_j c_j : lo_j <= p_j <= hi_j, sum_j p_j = 1 }`` for ``c >= 0`` (T, T), keys with
    ``hi = 0`` left out: the linear programme's greedy optimum (``lo`` first, then the rest of the unit mass to the
    largest ``c`` up to ``hi``), plus any mass the rounded box cannot place times ``max c``.  THEORY F78b."""
    order = torch.argsort(c, dim=1, descending=True)
    cs, room = c.gather(1, order), (hi - lo).clamp(min=0).gather(1, order)
    mass = (1 - lo.sum(dim=1, keepdim=True)).clamp(min=0)
    before = torch.cumsum(room, dim=1) - room
    take = torch.minimum(room, (mass - before).clamp(min=0))
    left = (mass[:, 0] - take.sum(dim=1)).clamp(min=0)
    top = torch.where(hi > 0, c, torch.zeros_like(c)).max(dim=1).values
    out = (lo * c).sum(dim=1) + (take * cs).sum(dim=1) + left * top
    return torch.nan_to_num(out * (1 + 1e-12), nan=math.inf, posinf=math.inf)


def weight_box(S: Tensor, D: Tensor) -> tuple[Tensor, Tensor]:
    r"""``(lo, hi)`` (T, T): certified bounds of the softmax weights ``p_ij`` for every score row with ``|s'_ij - s_ij -
    c_i| <= D_ij`` (any ``c_i``; ``S`` with ``-inf`` at masked keys, whose weights stay 0):
    ``p_j <= 1 / (1 + sum_{k != j} exp(s_k - D_k - s_j - D_j))``, ``p_j >= 1 / (1 + sum_{k != j} exp(s_k + D_k - s_j + D_j))``.
    ``exp``, the sums and the division within ``1e-12`` relative.  THEORY F78b."""
    vis = torch.isfinite(S)
    Sz = torch.where(vis, S, torch.zeros_like(S))
    off = ~torch.eye(S.shape[1], dtype=torch.bool)[None] & vis[:, None, :]  # [i, j, k]: k != j, k visible

    def odds(a: Tensor, b: Tensor) -> Tensor:  # [i, j] sum_{k != j} exp(a_ik - b_ij)
        e = torch.exp(a[:, None, :] - b[:, :, None])
        return torch.where(off, e, torch.zeros_like(e)).sum(dim=2)

    hi = 1 / (1 + odds(Sz - D, Sz + D) * (1 - 1e-12)) * (1 + 1e-12)
    lo = 1 / (1 + odds(Sz + D, Sz - D) * (1 + 1e-12)) * (1 - 1e-12)
    zero = torch.zeros_like(S)
    return torch.where(vis, lo, zero).nan_to_num(nan=0.0), torch.where(vis, hi.clamp(max=1.0), zero).nan_to_num(nan=1.0)


def pair_mean(lo: Tensor, hi: Tensor, f: Tensor) -> Tensor:
    """(T, T) ``[i, j] >= sum_{k != j} p_ik f_ijk`` over query i's weight box (``box_mean`` per pair, ``f >= 0``)."""
    T = lo.shape[0]
    f = f * (~torch.eye(T, dtype=torch.bool))[None]
    L, Hh = (w[:, None, :].expand(T, T, T).reshape(T * T, T) for w in (lo, hi))
    return box_mean(L, Hh, f.reshape(T * T, T)).reshape(T, T)


class JointSpread(NamedTuple):
    r"""F81a's bound of one head's score-velocity spread, linear in the move: for every weight row ``p`` of the box
    ``[lo, hi]``, ``var_p(u_i)^{1/2} <= lin_i + sum_m (max_p sum_j p_j keys[m]_ij^2)^{1/2}`` (``lin`` (T,) the query's
    own parts, ``keys`` (T, T) the per-key parts).  Kept unsquared so that ``head_rest_sup`` squares it at its own
    power of two (THEORY F81d)."""

    lin: Tensor
    keys: tuple

    def scaled(self, a: Tensor) -> JointSpread:
        """The same spread times the powers of two ``a`` (T, 1), one per query row (exact)."""
        return JointSpread(self.lin * a[:, 0], tuple(k * a for k in self.keys))

    def var(self, lo: Tensor, hi: Tensor) -> Tensor:
        """(T,) ``V^J_i >= var_p(u_i)`` over the box (``box_mean`` of the squares; padded; nan -> inf)."""
        root = (self.lin + sum(torch.sqrt(box_mean(lo, hi, k * k)) for k in self.keys)) * (1 + 1e-12)
        return torch.nan_to_num(root * root * (1 + 1e-12), nan=math.inf, posinf=math.inf)


def head_rest_sup(lo: Tensor, hi: Tensor, U: Tensor, sig: Tensor, gap: Tensor, W: Tensor,
                  spread: JointSpread | None = None) -> Tensor:
    r"""(T,) per query ``>= sup_t ||d^2/dt^2 W_O^T o_i(x + t Delta)||`` of one head (THEORY F78a) from, on the segment,
    weights in ``[lo, hi]``, ``|u_ij| <= U_ij`` (the score velocity less a constant per query), ``|s''_ij| <= sig_ij``,
    ``||y_j - y_k|| <= gap_jk`` (output-space values) and ``||W_O^T W_V^T Delta_j|| <= W_j``: with
    ``C_ij = sum_{k != j} p_k (U_ij + U_ik) >= |u_j - ubar|``, ``Yb_ij = sum_{k != j} p_k gap_jk >= ||y_j - ybar||`` and
    ``V_i = min(sum_j p_j U_j^2, sum_j p_j C_j^2) >= var_p(u)``,

    .. math:: \min\big(\textstyle\sum_j p_j C_j^2 \bar Y_j,\ V \max_j \bar Y_j\big) + \sum_j p_j \sigma_j \bar Y_j
              + 2 \min\big(\sum_j p_j C_j W_j,\ (V \sum_j p_j W_j^2)^{1/2}\big),

    every ``sum_j p_j f_j`` the box's largest (``box_mean``).  With F81's ``spread`` (``V^J = spread.var``), ``V`` is
    the smaller and the velocity term also ``<= max {sum_j m_j Yb_j : 0 <= m_j <= hi_j C_j^2, sum_j m_j <= V}`` (the
    masses ``m_j = p_j (u_j - ubar)^2``; the greedy optimum, ``box_mean`` of the caps over ``V``; THEORY F81c).
    The bound is homogeneous (``U -> a U``, ``sig -> a^2 sig``, ``gap -> b gap``, ``W -> a b W``, ``spread -> a spread``
    scale it by ``a^2 b``), and query ``i``'s row reads row ``i`` alone, so it is formed at powers of two ``a_i`` (per
    query row) and ``b`` that bring ``max_j U_ij`` and ``max gap`` to order one (exact), then scaled back in one step:
    no product of three or four factors under- or overflows, and ``V^J`` is squared at that scale (every part of the
    spread is at most ``2 max_j U_ij``; THEORY F80, F81d)."""
    return head_rest_sups(lo, hi, U, sig, ((gap, W),), spread)[0]


def head_rest_sups(lo: Tensor, hi: Tensor, U: Tensor, sig: Tensor, pairs: tuple,
                   spread: JointSpread | None = None) -> list[Tensor]:
    """:func:`head_rest_sup` of one head for each ``(gap, W)`` of ``pairs`` (``_rest_rows``: the model-space and the
    value-space gaps): the parts that read the score velocity alone (``C``, ``V``, F81's ``spread.var``) formed once,
    at the power of two ``a`` of ``U``; each pair at its own ``b`` (the same floats as one call per pair)."""
    a, ea = _pow2_rows(U)
    Ua = U * a
    C = pair_mean(lo, hi, Ua[:, :, None] + Ua[:, None, :])
    V = torch.minimum(box_mean(lo, hi, Ua * Ua), box_mean(lo, hi, C * C))
    V = V if spread is None else torch.minimum(V, spread.scaled(a).var(lo, hi))
    out = []
    for gap, W in pairs:
        b, eb = _pow2_rows(gap.reshape(1, -1))
        unit = _head_rest_unit(lo, hi, C, V, sig * a * a, gap * b, W[None, :] * a * b, spread is not None)
        out.append(times_pow2(unit, 2 * ea[:, 0] + eb[0, 0]))
    return out


def _pow2_rows(v: Tensor) -> tuple[Tensor, Tensor]:
    """``(s, e)`` (T, 1) per row of ``v``: the power of two ``s = 2^-e`` with ``s max_j |v_ij|`` in ``[1/2, 1)`` (1 where
    that max is 0 or not finite; ``2^+-1000`` at most).  THEORY F80: per query row, so that one query's small score
    velocity is not measured against another's large one (its squares flushed to 0 below ``2^-537`` of the largest)."""
    m = v.abs().amax(dim=1, keepdim=True)
    e = pow2_exponent(m).clamp(-1000, 1000)
    return torch.ldexp(torch.ones_like(m), -e), e


def times_pow2(x: Tensor, e: Tensor) -> Tensor:
    """``x 2^e`` (``e`` integer-valued, broadcast) in steps of at most ``2^+-1000`` of one sign, so that for ``x`` in
    ``[2^-1000, 2^1000]`` no step but the last can leave the normal range (dividing by ``a``, ``a``, ``b`` one at a
    time flushed ``2^-600`` velocities with ``2^600`` gaps to 0); a positive result below the smallest normal float,
    rounded to nearest, moved one ulp up.  THEORY F80."""
    out, rest = x, e
    while bool((rest != 0).any()):
        step = rest.clamp(-1000, 1000)
        out, rest = out * torch.ldexp(torch.ones_like(step), step), rest - step
    return torch.where((out < _TINY) & (x > 0), torch.nextafter(out, torch.full_like(out, math.inf)), out)


_TINY = torch.finfo(torch.float64).tiny


def _head_rest_unit(lo: Tensor, hi: Tensor, C: Tensor, V: Tensor, sig: Tensor, gap: Tensor, Wr: Tensor,
                    joint: bool) -> Tensor:
    """``head_rest_sup``'s bound at the given (rescaled) factors, from ``head_rest_sups``' ``C`` and ``V`` (``Wr`` (T, T)
    the keys' ``W`` at each query's scale; ``joint``: ``V`` holds F81's spread, and F81c's fill applies)."""
    Yb = pair_mean(lo, hi, gap[None].expand(C.shape[0], -1, -1))
    top = torch.where(hi > 0, Yb, torch.zeros_like(Yb)).max(dim=1).values
    t1 = torch.minimum(box_mean(lo, hi, C * C * Yb), top * V * (1 + 1e-12))
    if joint:  # THEORY F81c: the variance's mass into the largest value gaps, each key up to hi C^2
        fill = torch.nan_to_num(V * box_mean(torch.zeros_like(C), hi * C * C / V[:, None], Yb) * (1 + 1e-12),
                                nan=math.inf, posinf=math.inf)
        t1 = torch.minimum(t1, torch.where(V > 0, fill, torch.zeros_like(fill)))
    t2 = box_mean(lo, hi, sig * Yb)
    t3 = torch.minimum(box_mean(lo, hi, C * Wr), torch.sqrt(V * box_mean(lo, hi, Wr * Wr)) * (1 + 1e-12))
    return (t1 + t2 + 2 * t3) * (1 + 1e-12)


def attention_rest_rows(data: AttnRestData, rho: float, E: Tensor, eP: float, pad: float) -> Tensor:
    r"""(T,) rows ``>= ||R_i||`` of the attention stage's Taylor rest at the data for every move ``Delta = P(X) delta + e``
    (``||delta_j|| <= rho``, ``||e_j|| <= E_j``; ``P(X)`` the prefix as computed within ``eP`` in the (2,inf) norm, the
    true centre within ``pad`` of ``X``), THEORY F78:

    .. math:: \|R_i\| \le \tfrac12 \min\Big(\sum_h \sup_t \|W_O^{hT} \ddot o^h_i\|,\
              \|W_O\| \big(\textstyle\sum_h \sup_t \|\ddot o^h_i\|^2\big)^{1/2}\Big)

    (the heads through ``W_O`` one by one, or all at once) by ``head_rest_sup`` with, per head (``e_j = E_j + rho eP``
    the move outside the ellipsoids, ``e'_j = e_j + pad`` the offset of the segment's points from ``X`` outside them,
    ``m_W,j = rho ||Q*_j^{1/2} W|| + e_j ||W||``, ``m'`` with ``e'``): ``U_ij = (rho g_ij + e_i gn_ij) + (rho om_ij + e_j qn_i) + scale (m_Q,i m'_K,j + m'_Q,i m_K,j)``,
    ``sig_ij = 2 scale m_Q,i m_K,j``, the weights' score box ``D_ij = rho g_ij + e'_i gn_ij + rho om_ij + e'_j qn_i +
    scale m'_Q,i m'_K,j + eS_ij``, ``gap_jk = Y_jk + ||W_O^h|| (m'_V,j + m'_V,k)``, ``W_j = ||W_O^h|| m_V,j`` (before
    ``W_O``: ``Yv`` and no ``||W_O^h||``).
    Assumptions: post-LN dot attention without RoPE, soft-cap or q/k norm.  Padded; nan -> inf."""
    return _rest_rows(data, rho, E, eP, pad, keys_joint=False)


def joint_rest_rows(data: AttnRestData, rho: float, E: Tensor, eP: float, pad: float) -> Tensor:
    r"""(T,) rows ``>= ||R_i||`` as ``attention_rest_rows`` (same moves, same assumptions) with the score changes'
    variance also bounded jointly over the keys (THEORY F81a): Minkowski in ``L^2(p)`` over the parts of ``u_ij``,

    .. math:: \mathrm{var}_p(u)^{1/2} \le \rho \min\big(r_i \lambda_i, \max_p \textstyle\sum_j p_j g_{ij}^2\big)^{1/2}
              + e_i \min\big((r_i \lambda^b_i)^{1/2} + eG_i, (\max_p \sum_j p_j gn_{ij}^2)^{1/2}\big)
              + \big(\max_p \sum_j p_j (\rho\, om_{ij} + e_j qn_i)^2\big)^{1/2}
              + \big(\max_p \sum_j p_j X_{ij}^2\big)^{1/2}

    (``lambda_i`` F44a's ``lambda_max(sum_j P_ij g_ij g_ij^T)``, ``lambda^b_i`` F35's for the rows ``G y_ij`` as
    computed, ``eG_i`` their rounding, ``r_i = max_j hi_ij / P_ij`` so that every box weight row's Gram is below
    ``r_i`` times it; ``X_ij = scale (m_Q,i m'_K,j + m'_Q,i m_K,j)`` the cross part; every ``max_p`` over the weight
    box, ``box_mean``), fed to ``head_rest_sup`` as its ``spread`` (F81c's fill with it).  So it is ``min(F78, F81)``
    by construction: never above ``attention_rest_rows``.  Padded; nan -> inf."""
    return _rest_rows(data, rho, E, eP, pad, keys_joint=True)


def _rest_rows(data: AttnRestData, rho: float, E: Tensor, eP: float, pad: float, keys_joint: bool) -> Tensor:
    """F78's rows (``keys_joint``: with F81's joint spread): the heads one by one through ``W_O`` or all at once."""
    e = E + rho * eP
    e1 = e + pad
    per, sups = torch.zeros_like(E), []
    for h in range(data.S.shape[0]):
        U, sig, lo, hi, mV, gap, gapv, key, cross = _head_factors(data, h, rho, e, e1)
        sp = _joint_spread(data, h, rho, e, lo, hi, key, cross) if keys_joint else None
        per_h, sup_h = head_rest_sups(lo, hi, U, sig, ((gap, data.nO[h] * mV * (1 + 1e-12)), (gapv, mV)), sp)
        per = per + per_h
        sups.append(sup_h)
    joint = data.nOall * _heads_norm(torch.stack(sups)) * (1 + 1e-12)
    return torch.nan_to_num(torch.minimum(per, joint) / 2 * (1 + 1e-12), nan=math.inf, posinf=math.inf)


def _joint_spread(data: AttnRestData, h: int, rho: float, e: Tensor, lo: Tensor, hi: Tensor, key: Tensor,
                  cross: Tensor) -> JointSpread:
    """Head ``h``'s F81a spread over the weight box (``joint_rest_rows``): the query's parts through the weighted Grams
    (``lin``), the key and cross parts per key (``key``, ``cross``: ``_head_factors``' parts of ``U``)."""
    ratio = torch.where(hi > 0, hi / data.P[h], torch.zeros_like(hi)).nan_to_num(nan=math.inf).max(dim=1).values
    ratio = ratio * (1 + 1e-12)
    query = torch.sqrt(torch.minimum((ratio * data.lG[h]).nan_to_num(nan=math.inf), box_mean(lo, hi, data.g[h] ** 2)))
    outq = torch.minimum((torch.sqrt(ratio * data.lGb[h]) * (1 + 1e-12) + data.eG[h]).nan_to_num(nan=math.inf),
                         torch.sqrt(box_mean(lo, hi, data.gn[h] ** 2)))
    return JointSpread((rho * query + e * outq) * (1 + 1e-12), (key * (1 + 1e-12), cross * (1 + 1e-12)))


def _heads_norm(v: Tensor) -> Tensor:
    """(T,) ``(sum_h v_h^2)^{1/2}`` over the heads of ``v`` (H, T), formed at the power of two that brings the largest
    to order one (no square under- or overflows; THEORY F80); within ``1e-15`` relative (padded by the caller)."""
    s, e = _pow2_rows(v.T)
    return times_pow2(torch.sqrt(((v * s[:, 0]) ** 2).sum(dim=0)) * (1 + 1e-15), e[:, 0])


def _head_factors(data: AttnRestData, h: int, rho: float, e: Tensor, e1: Tensor) -> tuple:
    """Head ``h``'s ``(U, sig, lo, hi, m_V, gap, gap_v, key, cross)`` of ``attention_rest_rows`` (THEORY F78b items 1-3,
    5; the value gaps ``[j, k]`` in the model space and before ``W_O``; ``key`` and ``cross`` the key and cross parts of
    ``U``, unpadded, which F81a's spread reads)."""
    mQ, mK, mV = _moves(data, h, rho, e)
    mQ1, mK1, mV1 = _moves(data, h, rho, e1)
    sc = data.scale
    qpart, kpart = rho * data.g[h] + e[:, None] * data.gn[h], rho * data.om[h] + e[None, :] * data.qn[h][:, None]
    cross = sc * (mQ[:, None] * mK1[None, :] + mQ1[:, None] * mK[None, :])
    U = (qpart + kpart + cross) * (1 + 1e-12)
    sig = 2 * sc * mQ[:, None] * mK[None, :] * (1 + 1e-12)
    D = (rho * data.g[h] + e1[:, None] * data.gn[h] + rho * data.om[h] + e1[None, :] * data.qn[h][:, None]
         + sc * mQ1[:, None] * mK1[None, :] + data.eS[h]) * (1 + 1e-12)
    lo, hi = weight_box(data.S[h], D)
    gap = (data.Y[h] + data.nO[h] * (mV1[:, None] + mV1[None, :])) * (1 + 1e-12)
    gapv = (data.Yv[h] + mV1[:, None] + mV1[None, :]) * (1 + 1e-12)
    return U, sig, lo, hi, mV, gap, gapv, kpart, cross


def _moves(data: AttnRestData, h: int, rho: float, e: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Head ``h``'s ``m_W,j = rho ||Q*_j^{1/2} W|| + e_j ||W||`` for ``W = W_Q, W_K, W_V`` (THEORY F78b)."""
    def m(w: Tensor, n: Tensor) -> Tensor:
        return (rho * w + e * n) * (1 + 1e-12)
    return m(data.mQ[h], data.nQ[h]), m(data.mK[h], data.nK[h]), m(data.mV[h], data.nV[h])


def segment_rest_heads(sup, rho: float, emax: float, rD: float, pad: float, steps: int = 4) -> Tensor:  # noqa: ANN001
    r"""(H, T) per head and query ``>= ||R^h_i||`` (before ``W_O``) from ball sups of the head's second derivative (THEORY
    F78c): ``sup(s)`` returns ``(F, F^m, S)`` (H, T) on ``B(X, s)`` — both tangents in the prefix's ellipsoids, one in the
    unit ball, both (F44b, F35) — and every point ``x + t Delta`` of the segment lies in ``B(X, t rD + pad)``, so with
    ``||H[Delta, Delta]|| <= rho^2 F + 2 rho e_max F^m + e_max^2 S`` (``Delta = rho Phat h + e``, ``||e_j|| <= emax``):

    .. math:: \|R^h_i\| \le \int_0^1 (1 - t) \sup_{B(X, t r_\Delta + pad)} \|H^h_i\| dt
              \le \sum_{k=1}^{n} \frac{2n - 2k + 1}{2n^2} \sup_{B(X, k r_\Delta / n + pad)} \|H^h_i\|

    (the Taylor integral's weight on each piece; the sups grow with the ball).  Padded; nan -> inf."""
    total = None
    for k in range(1, steps + 1):
        F, Fm, S = sup(k * rD / steps + pad)
        H = rho * (rho * F) + (2 * rho * (emax * Fm) + emax * (emax * S) if emax > 0 else 0.0)  # no inf * 0 at e = 0
        part = H * ((2 * steps - 2 * k + 1) / (2 * steps**2))
        total = part if total is None else total + part
    return torch.nan_to_num(total * (1 + 1e-12), nan=math.inf, posinf=math.inf)


def piecewise_rest_rows(rows_at, rho: float, emax: float, steps: int = 4) -> Tensor:  # noqa: ANN001
    r"""(T,) rows ``>= ||R_i||`` from a stage's drift rows on the segment's pieces (THEORY F78d):
    ``R = int_0^1 (J(x + t Delta) - J(x)) Delta dt``, ``Delta = P delta + e``, and on ``t in [(k-1)/n, k/n]`` the point
    ``x + t Delta`` is a move of the same kind with ``t delta``, ``t e`` (plus the centre's pad), so the rows
    ``(reach_k, dj_k) = rows_at(k / n)`` of the ball of the move scaled by ``k / n`` bound the integrand there:

    .. math:: \|R_i\| \le \frac1n \sum_{k=1}^n \big(\rho\, \mathrm{reach}_{k,i} + dj_{k,i}\, e_{\max}\big)

    (``reach_k >= nu_i((J(y) - J(x)) P)``, ``dj_k >= ||J(y) - J(x)||_i`` on that ball; ``emax >= max_j ||e_j||``).  With
    rows linear in the scale this is ``(n + 1) / (2n)`` of F73c's ``rho reach + dj emax`` at the top.  Padded; nan -> inf."""
    total = None
    for k in range(1, steps + 1):
        reach, dj = rows_at(k / steps)
        part = rho * reach + torch.where(dj == 0, 0.0, dj * emax) if emax > 0 else rho * reach
        total = part if total is None else total + part
    return torch.nan_to_num(total / steps * (1 + 1e-12), nan=math.inf, posinf=math.inf)
