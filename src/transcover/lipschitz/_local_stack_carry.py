"""A layer's first-order drift carried across the next layer-level stage by exact products from each of
its sub-stages (issue 12; THEORY F66).

Note [sub-stage carry].  F36 item 2 carries the prefix span's drift term ``M_{q+1,b}(y) dJ_q(y) M_{0,q}(x)``
of a layer ``q`` by the block norms of the next middle product times the layer's reach rows
``v_{0,q,k} >= nu_k(dJ_q M_{0,q}(x))``.  The next product (about 14 per MiniLM layer, (2,inf)) and the
layer's own token-local tail (about 2.3 after its attention) do not align with each other, while their
exact product at the data does (about 6): telescoping the layer over its sub-stages,
``dJ_q(y) = sum_s R_s(y) dJ_s(y) L_s(x)`` (``R_s`` the sub-stages after ``s`` inside the layer, ``L_s``
those before), so

    M_{q+1,q+2}(x) dJ_q(y) M_{0,q}(x) = sum_s [G_s(x) + M_{q+1,q+2}(x) (R_s(y) - R_s(x))] dJ_s(y) P_s(x),

``G_s = M_{q+1,q+2} R_s`` the exact product from sub-stage ``s + 1`` to the cut after the next
layer-level stage (the computed ``M_{q+1,q+2}`` of ``middle_rows`` carried back through the layer's transposed maps
gives every ``G_s``).  ``R_s`` is token-local (every
sub-stage after a layer's first is), so its drift is a per-token row.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["carry_blocks", "tail_drift", "carried_first_order"]


def carry_blocks(stages: list, cuts: list[int], starts: set, norms_of, a: int, K: Tensor,  # noqa: ANN001
                 err: float) -> tuple[dict, dict]:
    """``({s: (N, e)}, {c: SW})`` for the layer-level stage ``q = a - 1`` before stage ``a``, when it is a layer
    (``cuts[q]`` in ``starts``) of two or more sub-stages: for each sub-stage ``s`` of it but the last, ``N`` the
    certified block norms (``norms_of`` of the computed rows) of ``G_s = M_{a,a+1} J_last ... J_{s+1}`` and
    ``e >= max_i sum_k ||E_ik||`` its rounding, from the computed columns ``K`` of ``M_{a,a+1}`` (``middle_rows``'
    chain from ``a``, rounding ``err``) turned into rows and carried back through the layer's transposed maps
    (``fl(C J_t) = C J_t + F_t``; ``E J_t`` has row sums ``<= e p_t``, ``p_t`` the point (2,inf) norm; ``F_t`` by
    ``_local_error``).  ``SW`` (T, T, H) at the layer's first sub-stage ``c`` when it is a plain attention (no norm
    inside): the certified ``||Ghat_c,ik W_O^hT||`` (``_suffix_heads``, F33 item 4).  THEORY F66."""
    from ._local_stack import _chunked, _local_error, _suffix_heads

    c, e1 = cuts[a - 1], cuts[a]
    if c not in starts or e1 - c < 2:
        return {}, {}
    n, T, d = K.shape
    C = K.reshape(n, n).T.contiguous().reshape(n, T, d)  # the rows of M_{a,a+1}
    out: dict = {}
    for t in range(e1 - 1, c, -1):  # after stage t, C holds the rows of G_{t-1}
        f = _local_error(stages[t], C, cols=False)
        C = _chunked(stages[t].lin.apply_t, C)
        err = err * stages[t].p + f
        out[t - 1] = (norms_of(C), err * (1 + 1e-12))
    lin = stages[c].lin
    if getattr(lin, "att", None) is not None and getattr(lin, "n1", None) is None:
        return out, {c: _suffix_heads(C, lin.att)}
    return out, {}


def tail_drift(balls: list[Tensor], drifts: list[Tensor], points: list[Tensor]) -> list[Tensor]:
    """Per sub-stage ``s`` of one layer (token-local after the first), the rows ``dR_{s,k} >= sup nu_k(R_s(y) -
    R_s(x))`` of its tail ``R_s = J_last ... J_{s+1}``: from ``R_{s-1} = R_s J_s``,
    ``dR_{s-1} <= RB_s dJ_s + dR_s p_s`` and ``RB_{s-1} = RB_s B_s`` (``RB_s >= sup nu_k(R_s(y))``, ``B`` the
    ball rows, ``dJ`` the drift rows, ``p`` the point rows, all per token; ``dR_last = 0``, ``RB_last = 1``).
    Float64 products and sums of non-negative numbers, padded by ``1e-12`` relative per step.  THEORY F66."""
    n = len(balls)
    dR = [torch.zeros_like(balls[0]) for _ in range(n)]
    RB = torch.ones_like(balls[0])
    for s in range(n - 1, 0, -1):
        dR[s - 1] = (RB * drifts[s] + dR[s] * points[s]) * (1 + 1e-12)
        RB = RB * balls[s] * (1 + 1e-12)
    return dR


def carried_first_order(G: list, reach: list[Tensor], dR: list[Tensor], nxt: tuple,
                        heads: tuple | None = None) -> Tensor:
    r"""(T,) rows ``Q_i >= sup_y nu_i(M_{q+1,q+2}(x) dJ_q(y) M_{0,q}(x))`` of a layer ``q`` (Note [sub-stage carry]):

    .. math:: Q_i = \sum_{s < last} \Big(\sum_k N(G_s)_{ik} w_{s,k} + e_s \max_k w_{s,k}\Big)
              + \sum_k N_{ik} z_k + e \max_k z_k,\quad z_k = w_{last,k} + \sum_s dR_{s,k}\, w_{s,k},

    ``w_{s,k} >= nu_k(dJ_s(y) P_s(x))`` the sub-stages' reach rows, ``G = [(N(G_s), e_s)]`` (``carry_blocks``) for
    all but the last sub-stage, whose ``G`` is ``M_{q+1,q+2}`` itself, ``nxt = (N, e)`` its certified blocks and
    rounding; ``dR`` from ``tail_drift``.  ``heads = (SW, b)`` (optional): the first sub-stage is an attention
    ``x + sum_h W_O^hT z_h`` with heads' reach rows ``b_{h,k} >= nu_k(dZ_h P_s(x))`` (H, T) and ``SW_ikh >=
    ||Ghat_ik W_O^hT||``; then its ``sum_k N(G)_ik w_k`` is also ``sum_k sum_h SW_ikh b_{h,k}``, the smaller kept
    (the rounding part ``e max w`` stays: ``||E_ik W_O^T z_k|| <= ||E_ik|| w_k``).  Row inequalities of F33 item 1;
    ``R_s(y) - R_s(x)`` is block diagonal.  Float64 sums of non-negative products, padded by ``1e-12`` relative.
    THEORY F66."""
    N, e = nxt
    z = reach[-1] + sum(r * w for r, w in zip(dR, reach))
    Q = N @ z + e * float(z.max())
    for j, ((Ns, es), w) in enumerate(zip(G, reach)):
        seen = Ns @ w
        if j == 0 and heads is not None:
            seen = torch.minimum(seen, torch.einsum("ikh,hk->i", *heads))
        Q = Q + seen + es * float(w.max())
    return torch.nan_to_num(Q * (1 + 1e-12), nan=float("inf"), posinf=float("inf"))
