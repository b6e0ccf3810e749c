"""The move's rest as a tangent side of F44b's Hessian sup, seen through every head's factors (issue 12; THEORY F89).

The attention's drift rows on the whole stack's ball (F44e) and its reach (F44c) integrate the head's second derivative
``H(Z)[Delta, E]`` along the move ``Delta = rho Phat h + e``.  The part ``e`` outside the prefix's ellipsoids (the move's
rest, its rounding and the centre pad) entered as a ball of radius ``e_max`` in every direction, so the head paid F35's
unit-ball sup ``S`` times ``e_max``.  F44b's bound reads a tangent family only through per-token projections (a *side*:
``||W_Q^T Delta_j||``, ``||W_K^T Delta_j||``, ``||W_V^T Delta_j||``, ``|q_i . Delta_j|``, ``|Delta_i . G y_ij|`` and
``sup sum_j P_ij (Delta_i . G y_ij)^2``), and F87 already certifies how large the move's rest is through each head's
``W_Q`` and ``W_K`` (the images of the upstream rests through the exact products at the data, ``C_qm``).  Every
projection above factors through ``W_Q^T e_i`` or ``W_K^T e_j`` (``q_i = W_K u_i``, ``G y_ij = scale W_Q k_ij`` with
``k_ij = W_K^T y_ij``), so the side of the move's rest is F87's ``C`` times radius-free data of the head.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_jacobian import pow2_norm
from ._local_rows import _lmax_gram
from ._rounding import _U, _gamma

__all__ = ["head_key_data", "image_side"]


def head_key_data(heads, X: Tensor, Wqa: list[Tensor], scale: float) -> list[dict]:  # noqa: ANN001
    r"""Per head (``_head_data``'s ``(P, Y, q, Wq, Wk, Wv, Wo)`` at ``X`` (T, d), ``Wqa`` the augmented query weights) the
    radius-free data of ``image_side``, each a certified upper bound of its exact counterpart (THEORY F89 (b)):

    * ``un`` (T,) ``>= ||u_i||``, ``u_i = scale Wqa^T xa_i`` the query's vector in the key factor's space (the score's
      key gradient is ``q_i = W_K u_i``): ``||fl(Xa Wqa)_i|| + gamma_{d+1} || |xa_i| |Wqa| ||``, times ``scale`` with
      its own rounding;
    * ``kn`` (T, T) ``>= ||k_ij||``, ``k_ij = W_K^T y_ij`` (``y_ij`` the head's centred keys as ``_HeadMoments``
      reads them): ``||fl(k_ij)|| + gamma_d ||y_ij|| ||W_K||_F``;
    * ``lk`` (T,) ``>= lambda_max(sum_j P_ij k_ij k_ij^T)``: ``(lambda_max(fl)^{1/2} + (sum_j P_ij delta_ij^2)^{1/2})^2``
      (Minkowski in ``L^2(P_i)``, ``delta_ij`` the row's error above; ``_lmax_gram`` pads the eigenvalue).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = X.shape
    Xa = torch.cat([X, torch.ones(T, 1, dtype=torch.float64)], dim=1)
    out = []
    for (P, Y, _, _, Wk, _, _), Wq in zip(heads, Wqa):
        U = Xa @ Wq
        eU = _gamma(d + 1) * pow2_norm(Xa.abs() @ Wq.abs(), 1)
        un = (pow2_norm(U, 1) * (1 + (U.shape[1] + 2) * _U) + eU) * scale * (1 + 4 * _U)
        K = Y @ Wk  # (T, T, dh)
        dk = _gamma(d) * pow2_norm(Y, -1) * float(pow2_norm(Wk)) * (1 + 2 * d * _U)
        kn = pow2_norm(K, -1) * (1 + (K.shape[-1] + 2) * _U) + dk
        lam = _lmax_gram(K @ K.transpose(1, 2), P)
        lk = (torch.sqrt(lam) + torch.sqrt((P * dk * dk).sum(dim=1))) ** 2
        out.append({"un": un * (1 + 1e-12), "kn": kn * (1 + 1e-12), "lk": lk * (1 + 1e-12)})
    return out


def image_side(C: Tensor, data: dict, m: dict, nQ: float, nK: float, nV: float, scale: float, E: Tensor,
               b: float) -> dict:
    r"""The side (``aligned_hessian_sup``'s ``s1``/``s2`` keys) of one head for the move's part outside the prefix's
    ellipsoids, ``e_j = e'_j + w_j`` with ``||e'_j|| <= E_j`` and ``||w_j|| <= b`` (the prefix's rounding ``rho e_P`` and
    the centre pad), THEORY F89 (a):

    .. math:: \|W_Q^T e_j\| \le \min(C_{Q,j}, n_Q E_j) + n_Q b,\quad \|W_K^T e_j\| \le \min(C_{K,j}, n_K E_j) + n_K b,
              \quad \|W_V^T e_j\| \le \min(C_{V,j}, n_V E_j) + n_V b,

    .. math:: |q_i \cdot e_j| \le \min(\|u_i\| C_{K,j}, \|q_i\| E_j) + \|q_i\| b,\quad
              |e_i \cdot G y_{ij}| \le \min(\mathrm{scale}\,\|k_{ij}\| C_{Q,i}, \|G y_{ij}\| E_i) + \|G y_{ij}\| b,

    .. math:: \Big(\sup \sum_j P_{ij} (e_i \cdot G y_{ij})^2\Big)^{1/2} \le
              \min(\mathrm{scale}\, C_{Q,i}\, \lambda_k^{1/2}, \lambda_G^{1/2} E_i) + \lambda_G^{1/2} b

    (Minkowski for the sum ``e' + w``; ``q_i = W_K u_i`` and ``G y_ij = scale W_Q k_ij``, so the first of each ``min``
    is Cauchy-Schwarz through the factor F87 bounds, the second the ball's).  ``C`` (4, T): rows ``>= ||F_q^T e'_j||``
    for ``F = W_K, W_V W_O`` (unused here), ``W_Q, W_V`` of this head (``move_rest_rows(..., blocks=)``); ``data``
    ``head_key_data``'s row, ``m`` the head's ``_HeadMoments`` row; ``nQ``, ``nK``, ``nV`` certified spectral norms.
    Float64 products of non-negative numbers, padded by ``1e-12`` relative; nan -> inf."""
    pad = 1 + 1e-12
    qn, gn, sl = m["qn"] * pad, m["gn"] * pad, torch.sqrt(m["lG"])
    sQ = torch.minimum(C[2], nQ * E) + nQ * b
    sK = torch.minimum(C[0], nK * E) + nK * b
    sV = torch.minimum(C[3], nV * E) + nV * b
    om = torch.minimum(data["un"][:, None] * C[0][None, :], qn[:, None] * E[None, :]) + qn[:, None] * b
    g = torch.minimum(scale * data["kn"] * C[2][:, None], gn * E[:, None]) + gn * b
    lg = torch.minimum(scale * C[2] * torch.sqrt(data["lk"]), sl * E) + sl * b
    side = {"mQ2": sQ * sQ, "mK2": sK * sK, "mV2": sV * sV, "om2": om * om, "g2": g * g, "lG": lg * lg}
    return {k: torch.nan_to_num(v * (pad + 8 * _U), nan=math.inf) for k, v in side.items()}
