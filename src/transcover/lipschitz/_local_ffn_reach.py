"""The FFN's remainder on the first norm's reachable set, post-LN (issue 12; THEORY F54).

F34b bounds the second norm's input radius by ``r2 <= r g_pt + remG + R``, ``R`` a bound on the FFN's remainder
``P(F(h + dh) - F(h) - J_F dh)`` over every ``||dh|| <= r_h`` (the mean FFN drift times ``r_h``, F17c-F51a).  On the
ball the move is ``dh = a + rho`` with ``a`` the exact linear map at X (``a a^T <= r^2 Q``, ``Q`` the first norm's
weighted row Gram times ``sum_j w_j``, F40a) and ``||rho|| <= remH`` (F34b's remainder of H): the second-order part
is taken through that set (F40b's tensor norms), the rest per unit with its own reach (its weight through the
Taylor integral cut into pieces, F58).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_ffn2 import _GELU2_ABS_ERR, _weighted_lmax, _weighted_norm, centre_gelu2_err, ffn_second_norms, gelu3_sup
from ._local_jacobian import gelu_second
from ._local_stack_aligned import _gamma, _hadamard_norm

__all__ = ["gelu2_range", "nested_beta", "ffn_reach_remainder"]

_PHI0 = 1 / math.sqrt(2 * math.pi)
_U = 2.0**-53
# F58a: pieces of the Taylor integral's t in [0, 1] and bins of |s| in [0, R] (powers of two: the cuts exact)
NESTED_PIECES, NESTED_BINS = 16, 8


def gelu2_range(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(inf, sup) of ``GELU'' = phi(z)(2 - z^2)`` on each interval ``[a, b]`` (THEORY F54a): its extrema are ``2 phi(0)``
    at 0 and ``-2 phi(2)`` at ``+-2``, monotone in between, so the endpoint values and the extrema inside; each padded
    outward by ``_GELU2_ABS_ERR`` and a relative ``1e-12`` (the float64 evaluation)."""
    fa, fb = gelu_second(a), gelu_second(b)
    lo, hi = torch.minimum(fa, fb), torch.maximum(fa, fb)
    hi = torch.where((a <= 0) & (b >= 0), torch.full_like(hi, 2 * _PHI0), hi)
    two = ((a <= 2) & (b >= 2)) | ((a <= -2) & (b >= -2))
    lo = torch.where(two, torch.minimum(lo, torch.full_like(lo, -2 * math.exp(-2) * _PHI0)), lo)
    pad = lambda v: v.abs() * 1e-12 + _GELU2_ABS_ERR  # noqa: E731
    return lo - pad(lo), hi + pad(hi)


def nested_beta(z: Tensor, R: Tensor, ez: Tensor | float, eD: Tensor | float, pieces: int = NESTED_PIECES,
                bins: int = NESTED_BINS) -> Tensor:
    r"""Per unit, ``beta_k >= sup_{0 < |s| <= R0_k} |e_k(s)/s^2 - GELU''(z*_k)/2|`` (THEORY F58a), ``e_k(s) = GELU(z*_k + s) -
    GELU(z*_k) - GELU'(z*_k) s = s^2 int_0^1 (1 - t) GELU''(z*_k + t s) dt``, for the exact pre-activation ``z*`` within
    ``ez`` of ``z`` and ``R = R0 + ez``.  So ``e_k/s^2 - GELU''(z*)/2 = int_0^1 (1 - t)(GELU''(z* + t s) - GELU''(z*)) dt``;
    ``|s|`` cut into ``bins`` equal bins ``[S_m, S_{m+1}]``, ``t`` into ``pieces`` equal pieces ``[t_j, t_{j+1}]``: for s
    in bin m and t in piece j the argument lies in ``I_mj = [z - ez + t_j S_m, z + ez + t_{j+1} S_{m+1}]`` (s > 0, the
    mirror for s < 0), where ``GELU'' - GELU''(z*)`` lies in ``[L_mj, U_mj]``, ``U = min(hi - D + eD, s3 t_{j+1}
    S_{m+1})``, ``L = max(lo - D - eD, -s3 t_{j+1} S_{m+1})`` (``lo, hi`` the range of GELU'' on ``I_mj``,
    ``gelu2_range``; ``D`` the evaluated ``GELU''(z)``, within ``eD`` of ``GELU''(z*)``; ``s3`` the sup of ``|GELU'''|``
    between ``z*`` and the argument, on ``[z - ez, z + ez + t_{j+1} S_{m+1}]``, ``gelu3_sup``), so, piece by piece,

    .. math:: \beta_k = \max_{\pm, m} \max\Big(\sum_j w_j U_{mj}^\pm,\; -\sum_j w_j L_{mj}^\pm\Big),
              \quad w_j = \int_{t_j}^{t_{j+1}} (1 - t)\,dt

    (``sum_j w_j = 1/2``: one bin and one piece is F54b's range bound).  Rounding: ``t_j``, ``w_j`` and ``S_m / R``
    exact (dyadic), each interval's ends widened by ``4u(|z| + R + ez)`` and ``t S`` by ``4u``, each sum padded by ``1e-12``
    of the sum of its absolute terms plus ``1e-12 (|D| + eD)``.  ``z``, ``R`` (and tensor ``ez``, ``eD``) of one shape."""
    t = torch.arange(pieces + 1, dtype=torch.float64) / pieces
    w = (t[1:] - t[:-1]) - (t[1:] * t[1:] - t[:-1] * t[:-1]) / 2
    sm = torch.arange(bins + 1, dtype=torch.float64) / bins
    lead = (bins, pieces) + (1,) * z.dim()
    lo_reach = ((sm[:-1, None] * t[None, :-1]).reshape(lead) * R) * (1 - 4 * _U)  # t_j S_m
    hi_reach = ((sm[1:, None] * t[None, 1:]).reshape(lead) * R) * (1 + 4 * _U)  # t_{j+1} S_{m+1}
    w = w.reshape((1, pieces) + (1,) * z.dim())
    D = gelu_second(z)
    wid = 4 * _U * (z.abs() + R + ez)
    out = torch.zeros_like(z)
    zl, zh = z - ez - wid, z + ez + wid
    for a, b, a3, b3 in ((zl + lo_reach, zh + hi_reach, zl, zh + hi_reach), (zl - hi_reach, zh - lo_reach, zl - hi_reach, zh)):
        lo, hi = gelu2_range(a, b)
        s3 = gelu3_sup(a3, b3) * hi_reach * (1 + 4 * _U)  # |GELU'''| between z* and the argument
        for side in (torch.minimum(hi - D + eD, s3), -torch.maximum(lo - D - eD, -s3)):
            pad = 1e-12 * ((w * side.abs()).sum(1) + D.abs() + eD)
            out = torch.maximum(out, ((w * side).sum(1) + pad).amax(0))
    return out


def ffn_reach_remainder(const: dict, n1: Tensor, z: Tensor, S: Tensor, eS: Tensor, wsum: Tensor, r: float,
                        remH: Tensor, rh: Tensor, ez: Tensor | None = None) -> Tensor:
    r"""(n,) certified ``sup ||P(F(h + dh) - F(h) - J_F dh)||`` per token over ``dh = a + rho``, ``a a^T <= r^2 Q*``,
    ``Q* = wsum S*`` (``S*`` the exact first-norm row Gram, the formed ``S`` within ``eS`` spectral), ``||rho|| <= remH``,
    ``||dh|| <= rh`` (THEORY F54b).  With ``s_k = w1_k . dh``, ``e_k = GELU''(z_k) s_k^2/2 + eps_k``, ``|eps_k| <= beta_k
    s_k^2``, and ``G = W_1^T Q W_1``, ``G_1 = W_1^T W_1``:

    .. math:: R \le \tfrac12\big(N_Q r^2 + 2N_{Qm} r\,rem_H + N_2\,rem_H^2\big)
              + \|\mathrm{diag}(\beta)^{1/2}PW_2\|\,\big(k_Q r^2 + 2k_{Qm} r\,rem_H + k_1 rem_H^2\big)

    ``N_Q, N_{Qm}, N_2 = lambda_max(W_2^T D H D W_2)^{1/2}`` for ``H = G o G, G o G_1, G_1 o G_1`` (``D = diag(GELU''(z))``
    signed; F40b, F44f, F38b), ``k_* = lambda_max(diag(beta)^{1/2} H diag(beta)^{1/2})^{1/2}`` for the same ``H``;
    ``beta_k = min(max(hi_k - GELU''(z_k), GELU''(z_k) - lo_k)/2, s3_k R_k/6)`` on unit k's reach ``[z_k - R_k, z_k + R_k]``,
    ``R_k = min(||w1_k|| rh, r G_kk^{1/2} + ||w1_k|| remH)`` (``lo, hi`` from ``gelu2_range``, ``s3_k`` ``gelu3_sup``),
    each min'ed with F58a's ``nested_beta`` (the Taylor integral's weight piece by piece, THEORY F58).
    ``Q = wsum (sym(S) + eS I) >= Q*`` (so ``G o G`` and ``G o G_1`` dominate the exact ones, Schur), formed within
    ``gamma_4 ||Q||_F``; ``G`` within ``eG = ||W_1||_F^2 (gamma_{2d} ||Q||_F + eQ)`` (F40b), ``G o G`` within ``eG (2 max|G| +
    eG) + u ||G o G||_F``, ``G o G_1`` within ``eG (max|G_1| + e_1) + e_1 max|G|`` (``e_1 = gamma_{d+2} ||W_1||_F^2``); the
    centred ``W_2`` as formed within ``eW2`` adds ``eW2 max|D| ||K_*||`` to each ``N``.  ``const``: ``ffn_hadamard``
    (centred when a LayerNorm follows), ``n1`` the ``||w1_k||``.  ``z`` within ``ez`` of the exact pre-activations
    (``pre_activations``; None: exact, red17-2): each ``R_k`` widened by ``ez_k`` (the reach around the exact centre),
    ``GELU''``'s error at the centre ``e_k = centre_gelu2_err`` in each ``N`` (its max) and in ``beta_k`` (``+ e_k``:
    ``D`` taken at ``z``, the remainder's ``hi - D*, D* - lo`` against the exact ``D*``).  Exact (erf) GELU only; cost
    ~``8 d d_ff^2`` flops and three certified ``d_ff x d_ff`` ``lambda_max`` a token."""
    W1, W2 = const["W1"], const["W2"]
    d = W1.shape[0]
    fW1 = float(W1.norm()) * (1 + W1.numel() * _gamma(1))
    w1max = float(n1.max())
    G1 = W1.T @ W1
    e1 = _gamma(d + 2) * fW1 * fW1
    g1max = float(G1.abs().max())
    n2 = ffn_second_norms(const, z, ez)
    out = torch.empty(len(z), dtype=torch.float64)
    for i in range(len(z)):
        Si = 0.5 * (S[i] + S[i].T)
        Si.diagonal().add_(float(eS[i]))
        Q = float(wsum[i]) * Si
        fQ = float(Q.norm()) * (1 + Q.numel() * _gamma(1))
        eQ = _gamma(4) * fQ
        G = (W1.T @ Q) @ W1
        eG = fW1 * fW1 * (_gamma(2 * d) * fQ + eQ) * (1 + 1e-12)
        gmax = float(G.abs().max())
        HQ, HQm = G * G, G * G1
        eHQ = (eG * (2 * gmax + eG) + _gamma(1) * float(HQ.norm())) * (1 + 1e-12)
        eHQm = (eG * (g1max + e1) + e1 * gmax + _gamma(1) * float(HQm.norm())) * (1 + 1e-12)
        Dk = gelu_second(z[i])
        eD = torch.as_tensor(centre_gelu2_err(None if ez is None else ez[i]), dtype=torch.float64)
        dmax = float(Dk.abs().max()) + float(eD.max())
        nKQ, nKQm = (fQ + eQ) * w1max * fW1, math.sqrt(fQ + eQ) * w1max * fW1  # ||K_Q||, ||K_{Q,I}|| (F40b)
        nq = _hadamard_norm(const, HQ, eHQ, Dk, nKQ, float(eD.max())) + const["eW2"] * dmax * nKQ
        nqm = _hadamard_norm(const, HQm, eHQm, Dk, nKQm, float(eD.max())) + const["eW2"] * dmax * nKQm
        Rk = torch.minimum(n1 * float(rh[i]),
                           r * torch.sqrt(G.diagonal().clamp(min=0.0) + eG) + n1 * float(remH[i])) * (1 + 1e-12)
        if ez is not None:
            Rk = Rk + ez[i]
        lo, hi = gelu2_range(z[i] - Rk, z[i] + Rk)
        beta = (torch.minimum((torch.maximum(hi - Dk, Dk - lo) + _GELU2_ABS_ERR) / 2,
                              gelu3_sup(z[i] - Rk, z[i] + Rk) * Rk / 6) + (eD - _GELU2_ABS_ERR)) * (1 + 1e-12)
        beta = torch.minimum(beta, nested_beta(z[i], Rk, 0.0 if ez is None else ez[i], eD))  # F58a
        sb = torch.sqrt(beta)[None] * (1 + 1e-12)
        k = [torch.sqrt(_weighted_lmax(Hm, eHm, sb))[0] for Hm, eHm in
             ((HQ, eHQ), (HQm, eHQm), (const["H"], const["eH"]))]
        nb = _weighted_norm(W2.T, sb)[0] + float(sb.max()) * const["eW2"]
        # products, not ``** 2``: a Python float's power raises OverflowError past 1e154 (red18-1), a product is inf
        rr, rm, hh = r * r, r * float(remH[i]), float(remH[i]) * float(remH[i])
        first = 0.5 * (nq * rr + 2 * nqm * rm + float(n2[i]) * hh)
        second = nb * (k[0] * rr + 2 * k[1] * rm + k[2] * hh)
        out[i] = (first + float(second)) * (1 + 1e-12)
    return torch.nan_to_num(out, nan=math.inf)
