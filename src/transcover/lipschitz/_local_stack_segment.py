"""The prefix's move averaged along the segment from the data to the input (issue 12; THEORY F71).

A sub-stage's input moves by ``x_s(X + delta) - x_s(X) = int_0^1 P_s(X + t delta) delta dt`` for a network move
``delta`` with every token within ``rho`` (``P_s`` the exact prefix Jacobian).  The point ``X + t delta`` lies in the
smaller ball ``B(X, t rho)``, so the part of the move outside the prefix's rows at X,
``e = int_0^1 (P_s(X + t delta) - P_s(X)) delta dt``, is bounded by the prefix drift certified on the smaller balls of
the same run instead of the drift on ``B(X, rho)`` itself.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["segment_moves", "with_auxiliary"]


def segment_moves(dP: list[Tensor], rhos: list[float]) -> list[Tensor]:
    r"""Per radius ``rho_k`` of a run, (T,) rows ``m_k`` with ``||e_j|| <= rho_k m_{k,j}`` for every network move within
    ``rho_k`` (THEORY F71): the right Riemann sum of the prefix drift rows ``dP[i]`` (each certified on ``B(X, rho_i)``)
    over the run's radii ``rho_i <= rho_k`` taken in increasing order, ``t_i = rho_i / rho_k``, ``t_0 = 0``:

    .. math:: m_k = \min\Big(dP_k,\ \sum_{\rho_i \le \rho_k} (t_i - t_{i-1})\, dP_i\Big)

    valid without monotonicity of ``dP`` in the radius (on ``t in (t_{i-1}, t_i]`` the point ``X + t delta`` lies in
    ``B(X, rho_i)``).  A radius reads no larger radius's rows.  Float64 weights and a sum of at most ``len(rhos)``
    non-negative products, padded ``1e-12`` relative; a zero weight ignores an inf row; nan -> inf."""
    order = sorted(range(len(rhos)), key=lambda i: rhos[i])
    out = []
    for k, rk in enumerate(rhos):
        acc, prev = torch.zeros_like(dP[k]), 0.0
        for i in order:
            if rhos[i] > rk:
                break
            w = (rhos[i] - prev) / rk
            prev = rhos[i]
            if w > 0:
                acc = acc + w * dP[i]
        acc = torch.nan_to_num(acc * (1 + 1e-12), nan=math.inf, posinf=math.inf)
        out.append(torch.minimum(dP[k], acc))
    return out


def with_auxiliary(rhos: list[float], fractions: tuple[float, ...]) -> tuple[list[float], list[int]]:
    """The run's radii with auxiliary ones ``f * max(rhos)`` (``fractions`` in (0, 1)) added below the largest (their
    results are not reported), and the positions of the user's radii in the extended list (THEORY F71c)."""
    top = max(rhos)
    extra = sorted({f * top for f in fractions if 0 < f < 1} - set(rhos))
    return list(rhos) + extra, list(range(len(rhos)))
