"""The move's part outside the prefix's rows by its own linear recursion at the data (issue 12; THEORY F73).

A network move ``delta`` (every token within ``rho``) moves sub-stage ``s``'s input by
``Delta_s = P_s(X) delta + e_s``.  From ``f_s(x_s + Delta_s) = f_s(x_s) + J_s(x_s) Delta_s + R_s`` with the stage's own
Taylor rest ``R_s = int_0^1 (J_s(x_s + tau Delta_s) - J_s(x_s)) Delta_s dtau``,

    e_{s+1} = J_s(x_s) e_s + R_s,   so   e_s = sum_{m < s} M_{m+1 -> s}(x) R_m,

``M_{a -> s} = J_{s-1} ... J_a`` the exact product of the sub-stages at the data: no Jacobian at a moved point
multiplies ``e`` and every span is one exact product (F40e's inner prefix drift reads ``N(M_{c -> s}) N(M_{m+1 -> c})``,
about 12 times the exact ``N(M_{m+1 -> s})`` on MiniLM).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["substage_products", "move_rest_rows", "stage_rest_rows", "norm_rest_rows", "layer_rest_rows"]


def substage_products(stages: list, norms_of, local_error, apply) -> dict:  # noqa: ANN001
    """``{(a, s): (N, e)}`` for ``0 <= a < s <= n``: ``N`` the certified block norms (``norms_of`` of the computed
    columns) of ``M_{a -> s} = J_{s-1} ... J_a`` at the data, by a float64 chain of the sub-stages' tangent maps from
    every start ``a`` (``apply(stage, K)``), and ``e >= max_i sum_k ||E_ik||`` the computed product's rounding:
    ``fl(M_{a -> s}) - M_{a -> s} = sum_{a <= m < s} M_{m+1 -> s} E_m`` exactly (``E_m`` the step's own error,
    ``local_error(stage, K)`` in the (2,inf) norm), each ``||M_{m+1 -> s}||`` the certified rows of the later start's
    product plus its own rounding (the starts run from the last), the identity for ``m + 1 = s``.  THEORY F73, F36
    item 1."""
    n = len(stages)
    T, d = stages[0].x.shape
    out: dict = {}
    for a in range(n - 1, -1, -1):
        K = torch.eye(T * d, dtype=torch.float64).reshape(T * d, T, d)
        errs = []
        for s in range(a, n):
            errs.append(local_error(stages[s], K))
            K = apply(stages[s], K)
            err = sum(e * _norm(out, m + 1, s + 1) for m, e in zip(range(a, s + 1), errs))
            out[(a, s + 1)] = (norms_of(K), err * (1 + 1e-12))
    return out


def _norm(prods: dict, a: int, s: int) -> float:
    """Certified ``||M_{a -> s}||_(2,inf)`` of the exact product (1 for the identity, ``a = s``)."""
    from ._local_stack import rows_of_block_norms

    if a == s:
        return 1.0
    N, e = prods[(a, s)]
    return float(rows_of_block_norms(N).max()) + e


def move_rest_rows(prods: dict, rests: list[Tensor], s: int, like: Tensor) -> Tensor:
    r"""(T,) rows ``E_{s,i} >= ||e_{s,i}||`` for sub-stage ``s``'s input, from the rows ``rests[m] >= ||R_{m,k}||`` of
    the stages before it (THEORY F73a):

    .. math:: E_{s,i} = \sum_{m < s} \Big(\sum_k N(M_{m+1 \to s})_{ik} R_{m,k} + e_{m+1 \to s} \max_k R_{m,k}\Big)

    (the identity for ``m + 1 = s``; the exact blocks are within ``||E_ik||`` of the computed, ``sum_k ||E_ik|| <= e``).
    ``E_0 = 0`` (the network input moves by ``delta`` itself); ``like`` a (T,) float64 template.  Float64 sums of non-negative products, padded by
    ``1e-12`` relative; nan -> inf."""
    acc = torch.zeros_like(like)
    for m in range(s):
        R = rests[m]
        if m + 1 == s:
            acc = acc + R
        else:
            N, e = prods[(m + 1, s)]
            acc = acc + N @ R + e * float(R.max())
    return torch.nan_to_num(acc * (1 + 1e-12), nan=math.inf, posinf=math.inf)


def stage_rest_rows(rho: float, reach: Tensor, dj: Tensor, E: Tensor, local: bool) -> Tensor:
    r"""(T,) rows ``>= ||R_{s,i}||`` of the stage's Taylor rest ``R_s = int_0^1 (J_s(x_s + tau Delta) - J_s(x_s)) Delta
    dtau``, ``Delta = P_s(X) delta + e``, every ``x_s + tau Delta`` in the stage's certified ball (the ball is star-shaped
    about ``x_s``, and ``tau Delta = P_s(X)(tau delta) + tau e`` is a move of the same kind, so the rows of moves along
    the prefix's rows hold there too):

    .. math:: \|R_{s,i}\| \le \rho\, \mathrm{reach}_{s,i} + \Delta J_{s,i} \|e_i\|\ \text{(token-local)},\quad
              \rho\, \mathrm{reach}_{s,i} + \Delta J_{s,i} \max_k \|e_k\|\ \text{(attention)},

    ``reach_{s,i} >= sup nu_i((J_s(y) - J_s(x_s)) P_s(X))`` and ``dj`` the drift rows on the ball (``||delta_j|| <=
    rho``, ``E >= ||e||``).  Float64, padded by ``1e-12`` relative; nan -> inf.  THEORY F73a."""
    Em = E if local else torch.full_like(E, float(E.max()))
    out = rho * reach + torch.where(Em == 0, 0.0, dj * Em)
    return torch.nan_to_num(out * (1 + 1e-12), nan=math.inf, posinf=math.inf)


def norm_rest_rows(dj: Tensor, r: Tensor) -> Tensor:
    r"""(T,) rows ``>= ||R_{s,i}||`` of a LayerNorm/RMSNorm stage's Taylor rest for every move of its input whose
    centred part is within ``r_i`` (all a norm reads, F59a):

    .. math:: \|R_{s,i}\| \le \int_0^1 \|D_i(x + \tau\Delta) - D_i(x)\|\, r_i\, d\tau \le \tfrac12\, dj_i(r_i)\, r_i,

    ``dj_i(r)`` the stage's drift rows on the ball of radius ``r`` (F17's or F43a's sphere curvature, the smaller: both
    at most ``tau dj_i(r)`` on the ball of radius ``tau r``, F43a, F34b).  Padded ``1e-12`` relative; nan -> inf.
    THEORY F76."""
    out = torch.where(r == 0, 0.0, dj * r / 2)
    return torch.nan_to_num(out * (1 + 1e-12), nan=math.inf, posinf=math.inf)


def layer_rest_rows(N: Tensor, e: float, Ec: Tensor, rem: Tensor) -> Tensor:
    r"""(T,) rows ``>= ||e_{s,i}||`` at a post-LN layer's inner point ``s`` from the layer input's ``E_c`` in one step:
    ``e_s = M_{c -> s}(x) e_c + R_{c -> s}(Delta_c)``, the partial layer's own Taylor rest at ``x_c`` for the layer
    input's whole move ``Delta_c`` (within the per-layer route's ball), ``||R_{c -> s, i}|| <= rem_i`` (F59b's ``remA``,
    ``remH``, ``remG`` plus the FFN's own rest; centred for ``S1``, ``S2``, which only a LayerNorm reads):

    .. math:: E_{s,i} = \sum_k N(M_{c \to s})_{ik} E_{c,k} + e \max_k E_{c,k} + rem_i.

    Padded ``1e-12`` relative; nan -> inf.  THEORY F76."""
    out = N @ Ec + e * float(Ec.max()) + rem
    return torch.nan_to_num(out * (1 + 1e-12), nan=math.inf, posinf=math.inf)
