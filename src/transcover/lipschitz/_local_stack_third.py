"""The FFN's third-order drift seen through the exact prefix at the data (issue 12; THEORY F62).

F40c bounds a post-LN FFN sub-stage's reach ``v_k >= nu_k((J_s(y_s) - J_s(x_s)) P_s(x))`` by the first order through
the prefix row's ellipsoid ``Q_k`` (``rho NQ_k``) plus the move's drift part and the Taylor rest through the unit
ball, ``c_3(r_k) r_k^2 nu_k`` (F38c).  On MiniLM at rho = 1e-4 the rest is 90 % of layer 0's FFN reach (5.6 of 6.6,
against a first order 0.64): it takes the move ``dh_k`` anywhere in the ball of radius ``r_k ~ rho nu_k`` and the
column ``b_k`` anywhere in the ball of radius ``nu_k``.  Both are rows of the same prefix (F40a): ``dh_k = a0 + a1``
with ``a0`` in ``rho Q_k^{1/2} B``, ``||a1|| <= rho (dP_k + e_P) + pad``, and ``b_k = b0 + b1``, ``b0`` in
``Q_k^{1/2} B``, ``||b1|| <= e_P``.  The rest is ``W_2^T (c o (W_1^T b))``, ``|c_n| <= 1/2 s3_n (w1_n . dh)^2``, so

    ||rest|| <= 1/2 ||W_2|| max_n (s3_n |w1_n . dh|) ||(W_1^T dh) o (W_1^T b)||,

``|w1_n . dh| <= m_n = min(rho sqrt(G_nn) + ||w1_n|| ||a1||, ||w1_n|| r_k)`` (``G = W_1^T Q_k W_1``) and the Hadamard
vector through ``K_Q`` (``||(W_1^T Q^{1/2} alpha) o (W_1^T Q^{1/2} beta)|| <= lambda_max(G o G)^{1/2}``, F40b) for
``(a0, b0)`` and the mixed ``G o G0`` (``G0 = W_1^T W_1``) or the unit ball for the rest.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_ffn2 import gelu3_sup
from ._local_jacobian import certified_lmax, pow2_norm

__all__ = ["third_norms", "aligned_third_rest", "aligned_reach"]

_U = 2.0**-53


def _lmax_of(H: Tensor, eH: float) -> float:
    """Certified ``lambda_max`` of the exact symmetric ``H*`` from ``H`` as formed within ``eH`` (Frobenius): the
    symmetrised ``(H + H^T)/2`` is within ``eH`` of ``H*`` too, its own rounding ``u ||H||_F``.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    S = 0.5 * (H + H.T)
    return (float(certified_lmax(S[None])[0]) + eH + _U * float(pow2_norm(H)) * (1 + H.numel() * _U)) * (1 + 1e-12)


def third_norms(G: Tensor, eG: float, gmax: float, G0: Tensor, e0: float, g0max: float) -> tuple[float, float, Tensor]:
    r"""For one prefix row ``k``, certified ``(K2_k, Km2_k, g_k)``: ``K2_k >= lambda_max(G*_k o G*_k)``, ``Km2_k >=
    lambda_max(G*_k o G0*)`` and ``g_k`` (d_ff,) ``>= G*_{k,nn}``, from ``G = W_1^T Q_k W_1`` as formed within ``eG``
    (Frobenius, so per entry) of ``G*_k`` (``Q*_k`` the exact ellipsoid of the row) and ``G0 = W_1^T W_1`` within
    ``e0``, ``gmax = max|G|``, ``g0max = max|G0|`` (``ffn_aligned_norms`` forms them once for F40b and this).  The
    Hadamard products within ``eG (2 max|G| + eG)`` and ``eG (max|G0| + e0) + e0 max|G|`` plus ``u`` of their norm
    (THEORY F62, rounding as F40b).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    H = G * G
    K2 = _lmax_of(H, eG * (2 * gmax + eG) * (1 + 1e-12) + _U * float(pow2_norm(H)))
    H = G * G0
    Km2 = _lmax_of(H, (eG * (g0max + e0) + e0 * gmax) * (1 + 1e-12) + _U * float(pow2_norm(H)))
    return K2, Km2, (G.diagonal() + eG).clamp(min=0.0)


def aligned_third_rest(nW2: float, lH: float, n1: Tensor, z: Tensor, ez: Tensor | None, K2: Tensor, Km2: Tensor,
                       g: Tensor, r: Tensor, nu: Tensor, rho: float, dP: Tensor, eP: float, pad: float, *,
                       unit: bool = False) -> Tensor:
    r"""(T,) a bound on ``||W_2^T (c o (W_1^T b))||``, the Taylor rest of ``(F'(h + dh) - F'(h)) b`` past the second
    order, for token k's move ``dh`` and column ``b`` rows of the prefix (module docstring; THEORY F62):

    .. math:: \tfrac12 \|W_2\| \max_n (s_{3,n} m_n)\,\big(\rho K_k + \min(e\,\nu_k \sqrt{l_H},\
              e_a \sqrt{Km2_k} + (e_a + \rho\nu_k) e_P \sqrt{l_H})\big)

    ``m_n = min(rho sqrt(g_n) + ||w1_n|| e_a, ||w1_n|| r_k)``, ``e_a = rho (dP_k + e_P) + pad``, ``e = e_a + rho e_P``,
    ``s3_n = sup |GELU'''|`` on ``[z_n -+ (m_n + ez_n)]`` (the exact centre within ``ez`` of ``z``), ``K_k =
    K2_k^{1/2}``, ``lH >= lambda_max(G0 o G0)``, ``nW2 >= ||W_2||``.  ``unit``: ``b`` any unit vector instead (the
    drift rows, F44f; ``nu`` unused): the last factor is ``rho Km2_k^{1/2} + e_a sqrt(lH)``.  Float64 products and
    sums of a few non-negative numbers, padded ``1e-12`` relative."""
    ea = rho * (dP + eP) + pad
    e = ea + rho * eP
    m = torch.minimum(rho * g.sqrt() * (1 + 1e-15) + n1[None, :] * ea[:, None], n1[None, :] * r[:, None]) * (1 + 1e-12)
    h = m if ez is None else m + ez
    s3m = (gelu3_sup(z - h, z + h) * m).amax(dim=1)
    sl = math.sqrt(lH)
    if unit:
        had = rho * Km2.sqrt() + ea * sl
    else:
        had = rho * K2.sqrt() + torch.minimum(e * nu * sl, ea * Km2.sqrt() + (ea + rho * nu) * eP * sl)
    return torch.nan_to_num(0.5 * nW2 * s3m * had * (1 + 1e-11), nan=math.inf)


def aligned_reach(nq: Tensor, nqm: Tensor, n2: Tensor, c3r2: Tensor, rest: Tensor, nu: Tensor, rho: float, dP: Tensor,
                  eP: float, pad: float) -> Tensor:
    r"""(T,) F40c's reach with both non-leading terms also through the prefix's rows (THEORY F62):

    .. math:: v_k = \rho NQ_k + \min(N2_k \nu_k e,\ e_a NQm_k + N2_k (e_a + \rho\nu_k) e_P)
              + \min(c_3(r_k) r_k^2 \nu_k,\ \mathrm{rest}_k)

    (``e_a``, ``e`` as ``aligned_third_rest``; ``D[a1, b0] <= e_a NQm``, the rounding parts through ``N2``); every
    branch of each ``min`` bounds the same term, so ``v_k`` is never above ``ffn_aligned_reach``."""
    ea = rho * (dP + eP) + pad
    e = ea + rho * eP
    second = torch.minimum(n2 * nu * e, ea * nqm + n2 * (ea + rho * nu) * eP)
    v = (rho * nq + second + torch.minimum(c3r2 * nu, rest)) * (1 + 1e-12)
    return torch.nan_to_num(v, nan=math.inf)
