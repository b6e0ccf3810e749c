"""A layer's second-order drift term split over its sub-stages (issue 12; THEORY F69).

Note [second-order split].  F44d bounds the prefix span's second-order term ``(J_q(y) - J_q(x)) D(y)``,
``D = M_{0,q}(y) - M_{0,q}(x)``, of a layer ``q`` by the layer's drift rows times the largest row of ``D``:
the sup of the whole layer's Jacobian change in any direction, times the sup of the incoming drift over all
tokens.  Telescoping the layer over its sub-stages (``A = J(y)`` on the left, ``B = J(x)`` on the right),

    (J_q(y) - J_q(x)) D = sum_s R_s(y) dJ_s(y) L_s(x) D,

``L_s`` the sub-stages before ``s`` inside the layer at the data, ``R_s`` those after it (token-local): each
token-local sub-stage's drift acts on its own token's row of ``L_s(x) D``, whose rows mix the incoming drift
per token by the exact partial product's block norms; only the first sub-stage (the attention) sees the
largest row.  Carried across the next layer-level stage, the same rows enter F66's ``carried_first_order``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_stack_carry import carried_first_order

__all__ = ["far_second_order", "heads_second_order", "near_second_order", "second_order_rows", "tail_sup"]


def second_order_rows(dM: Tensor, drifts: list[Tensor], inner: list[tuple | None], first_local: bool) -> list[Tensor]:
    r"""Per sub-stage ``s`` of one layer, rows ``u_{s,k} >= sup_y nu_k(dJ_s(y) L_s(x) D(y))``:

    .. math:: u_{s,k} = \Delta J_{s,k} \Big(\sum_j N(L_s)_{kj}\, \delta_j + e_s \max_j \delta_j\Big)\ (s > c),\qquad
              u_{c,k} = \Delta J_{c,k} \max_j \delta_j

    (``delta_k`` for the first sub-stage ``c`` when it is token-local, ``first_local``), ``dM = delta >= sup nu_j(D)``
    the incoming span drift rows, ``drifts[s]`` the sub-stage's certified drift rows on its input ball (token-local
    after the first: ``nu_k(dJ_s C) <= ||dJ_s,kk|| nu_k(C)``), ``inner[s] = (N(L_s), e_s)`` the certified block norms
    and rounding of the computed partial product ``L_s(x)`` (``None`` for the first, ``L_c = I``;
    ``nu_k(L_s D) <= sum_j (N_kj + ||E_kj||) nu_j(D)``).  Float64 products and sums of non-negative numbers, padded
    by ``1e-12`` relative.  THEORY F69."""
    top = float(dM.max())
    rows = [drifts[0] * (dM if first_local else top)]
    for dj, (N, e) in zip(drifts[1:], inner[1:]):
        rows.append(dj * (N @ dM + e * top))
    return [torch.nan_to_num(u * (1 + 1e-12), nan=math.inf, posinf=math.inf) for u in rows]


def tail_sup(balls: list[Tensor], points: list[Tensor], dR: list[Tensor]) -> list[Tensor]:
    """Per sub-stage ``s`` of one layer, rows ``>= sup_y ||R_s(y)_kk||`` of its token-local tail ``R_s = J_last ...
    J_{s+1}``: the smaller of the ball rows' product ``prod_{t>s} B_t,k`` and ``prod_{t>s} p_t,k + dR_s,k`` (the point
    rows' product bounds ``||R_s(x)_kk||``; ``dR`` from ``tail_drift``).  Padded by ``1e-12`` relative per step.
    THEORY F69."""
    n = len(balls)
    out = [torch.ones_like(balls[0]) for _ in range(n)]
    RB, RP = torch.ones_like(balls[0]), torch.ones_like(balls[0])
    for s in range(n - 1, 0, -1):
        RB, RP = RB * balls[s] * (1 + 1e-12), RP * points[s] * (1 + 1e-12)
        out[s - 1] = torch.minimum(RB, (RP + dR[s - 1]) * (1 + 1e-12))
    return out


def near_second_order(u: list[Tensor], sup: list[Tensor], first: Tensor | None = None) -> Tensor:
    r"""(T,) rows ``>= sup_y nu_k((J_q(y) - J_q(x)) D(y))`` of one layer: ``sum_s sup||R_s(y)_kk|| u_{s,k}``
    (Note [second-order split]; ``u`` from ``second_order_rows``, ``sup`` from ``tail_sup``).  ``first`` (optional):
    other rows ``>= sup_y nu_k(R_c(y) dJ_c(y) D(y))`` of the first sub-stage's term, the smaller kept.  THEORY F69."""
    terms = [r * w for r, w in zip(sup, u)]
    if first is not None:
        terms[0] = torch.minimum(terms[0], first)
    return torch.nan_to_num(sum(terms) * (1 + 1e-12), nan=math.inf, posinf=math.inf)


def heads_second_order(through: Tensor, dR: Tensor, drift: Tensor, dM: Tensor) -> Tensor:
    r"""(T,) rows ``>= sup_y nu_k(R_c(y) dJ_c(y) D(y))`` for a post-LN attention ``x + sum_h W_O^hT z_h`` as the layer's
    first sub-stage: ``(sum_h ||R_c(x)_kk W_O^hT|| dZ_{h,k} + dR_{c,k} dJ_{c,k}) max_j delta_j``, ``through`` the first
    part at unit ``max delta`` (THEORY F44g's ``through`` of the heads' drift rows ``dZ``), ``dR`` the tail's drift
    rows, ``drift`` the sub-stage's drift rows, ``dM = delta``.  Padded by ``1e-12`` relative.  THEORY F69."""
    out = (through + dR * drift) * float(dM.max()) * (1 + 1e-12)
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


def far_second_order(G: list, u: list[Tensor], dR: list[Tensor], nxt: tuple, heads: tuple | None = None) -> Tensor:
    r"""(T,) rows ``>= sup_y nu_i(M_{q+1,q+2}(x) (J_q(y) - J_q(x)) D(y))``: F66's ``carried_first_order`` with the
    sub-stages' reach rows replaced by ``u`` (``second_order_rows``) and, for a post-LN attention, the heads' rows by
    ``dZ_{h,k} max_j delta_j`` (``heads = (SW, that)``); ``G``, ``dR``, ``nxt`` as there.  THEORY F69 (c)."""
    return carried_first_order(G, u, dR, nxt, heads)
