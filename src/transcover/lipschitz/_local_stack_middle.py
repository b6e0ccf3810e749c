"""Middle products of the whole stack at the data and their certified drift over the ball
(issue 12; THEORY F36).

Note [middle products].  Cut the chain of sub-stages at the *layer-level* boundaries ``c_0 = 0 <
c_1 < ... < c_L = n`` (input norm, each layer, final norm: ``layer_cuts``) and write
``M_{a,b} = J_{c_b - 1} ... J_{c_a}`` for the product of the layer-level stages ``a .. b-1`` at the
data (``M_{0,b}`` the prefix, ``M_{a,L}`` a suffix, ``M_{a,a} = I``).  For ``y`` in the ball the
telescoping identity ``M_{a,b}(y) - M_{a,b}(x) = sum_{a<=m<b} M_{m+1,b}(y) (J_m(y_m) - J_m(x_m))
M_{a,m}(x)`` gives, row by row (``nu_i(A dJ B) <= nu_i(A) ||dJ B||``),

    dM_{a,b,i} <= sum_m (nu_i(M_{m+1,b}(x)) + dM_{m+1,b,i}) w_{a,m},
    w_{a,m} >= ||dJ_m M_{a,m}(x)||  (max_k dJ_{m,k} nu_k(M_{a,m}) for a token-local stage,
                                     max_k dJ_{m,k} ||M_{a,m}|| otherwise),

computed for the spans ending at ``b`` from the shortest up (``middle_drift_column``).  Every
first-order term carries exact middle products at the data, never a product of stage norms.  The
rows ``nu_i(M_{a,b}(x))`` come from chains started at every layer-level stage (``middle_rows``),
``O(L^2)`` layer passes over the ``T d`` columns; the chains' rounding is carried to each cut by the
exact middle products after the rounding step (``fl(M) - M = sum_m M_{m+1 -> b} E_m``) and bounded
per step by the abs evaluation on token-summed columns (``_local_stack._local_error``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["layer_cuts", "middle_rows", "middle_drift_column"]


def layer_cuts(n: int, groups: dict) -> list[int]:
    """The sub-stage indices where a layer-level stage starts (a layer's sub-stages form one stage,
    a norm its own), with ``n`` at the end."""
    cuts = {0, n}
    for a, b, _ in groups.values():
        cuts |= {a, b}
    return sorted(cuts)


def middle_rows(stages: list, cuts: list[int], rows_of, exact: int = 4) -> tuple[dict, dict]:  # noqa: ANN001
    r"""Certified rows ``mid[(a, b)] >= nu_i(M_{a,b}(x))`` (T,) for ``1 <= a < b <= L`` and ``(0, 1)``
    (layer-level stages, ``cuts`` from ``layer_cuts``) by float64 chains of the sub-stages' tangent
    maps started at every cut (from the first only its own stage: the prefix chain gives the rest), and ``first[c]``: the rows after the
    first sub-stage of the stage starting at ``c``.  ``rows_of(K)``: certified ``nu_i`` of the computed
    columns (``certified_rows`` of their blocks).  Rounding: ``fl(M_{a,b}) - M_{a,b} = sum_m
    M_{m+1 -> c_b} E_m``, each ``M_{m+1 -> c_b}`` bounded by the stage's own tail (point norms of its
    remaining sub-stages) times the exact ``mid`` of the later layer-level stages, so the starts run
    from the last.  THEORY F36 item 1."""
    from ._local_stack import _chunked, _local_error

    L = len(cuts) - 1
    n = cuts[-1]
    T, d = stages[0].x.shape
    level = {}  # sub-stage -> its layer-level stage
    for q in range(L):
        for s in range(cuts[q], cuts[q + 1]):
            level[s] = q
    pos = {c: q for q, c in enumerate(cuts)}
    mid: dict = {}
    first: dict = {}

    def norm_after(q: int, b: int) -> float:  # ||M_{q,b}(x)|| (certified), q <= b
        return 1.0 if q == b else float(mid[(q, b)].max())

    def tail(s: int) -> float:  # point norms of the sub-stages after s inside its layer-level stage
        return math.prod((stages[t].p for t in range(s + 1, cuts[level[s] + 1])), start=1.0)

    for a in range(L - 1, -1, -1):  # a = 0: its first stage only (the prefix chain gives the rest)
        K = torch.eye(T * d, dtype=torch.float64).reshape(T * d, T, d)
        errs = []
        for s in range(cuts[a], n if a > 0 else cuts[1]):
            errs.append((s, _local_error(stages[s], K, cols=True)))
            K = _chunked(stages[s].lin.apply, K)
            if s == cuts[a]:
                first[s] = rows_of(K) + errs[0][1]
            if s + 1 in pos:
                b = pos[s + 1]
                err = sum(e * tail(m) * norm_after(level[m] + 1, b) for m, e in errs) * (1 + 1e-12)
                mid[(a, b)] = rows_of(K) + err
    return mid, first


def _reach(dJ: Tensor, rows: Tensor, local: bool) -> float:
    """``>= ||dJ_m M(x)||`` from the drift rows ``dJ`` of stage m and the rows of ``M(x)``: ``max_k dJ_k
    nu_k(M)`` for a token-local stage, else ``max dJ * max nu(M)``."""
    v = float((dJ * rows).max()) if local else float(dJ.max()) * float(rows.max())
    return v if math.isfinite(v) else math.inf


def middle_drift_column(mid: dict, dJ: list[Tensor], local: list[bool], b: int) -> list[Tensor]:
    r"""Rows ``dM[a] >= sup_{y in B} nu_i(M_{a,b}(y) - M_{a,b}(x))`` for ``a = 0 .. b`` (``dM[b] = 0``):

    .. math:: \delta M_{a,b,i} \le \sum_{a \le m < b} \big(\nu_i(M_{m+1,b}(x)) + \delta M_{m+1,b,i}\big)\,
              \|\Delta J_m M_{a,m}(x)\|

    (Note [middle products]), from the shortest span up.  ``mid[(a, b)]``: certified rows of the
    middle products at the data (``(a, a)`` is the identity); ``dJ[m]`` (T,): stage ``m``'s certified
    drift rows on its input ball; ``local[m]``: stage ``m`` is token-local.  Float64 sums of a few
    non-negative products, padded by ``1e-12`` relative.  THEORY F36 item 2."""
    T = dJ[0].shape[0] if dJ else next(iter(mid.values())).shape[0]
    one = torch.ones(T, dtype=torch.float64)
    rows = lambda a, c: one if a == c else mid[(a, c)]  # noqa: E731
    out = {b: torch.zeros(T, dtype=torch.float64)}
    for a in range(b - 1, -1, -1):
        acc = torch.zeros(T, dtype=torch.float64)
        for m in range(a, b):
            w = _reach(dJ[m], rows(a, m), local[m])
            if w > 0:
                acc = acc + (rows(m + 1, b) + out[m + 1]) * w
        out[a] = torch.nan_to_num(acc * (1 + 1e-12), nan=math.inf, posinf=math.inf)
    return [out[a] for a in range(b + 1)]
