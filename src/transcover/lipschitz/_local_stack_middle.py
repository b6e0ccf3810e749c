"""Middle products of the whole stack at the data and their certified drift over the ball
(issue 12; THEORY F36).

Note [middle products].  Cut the chain of sub-stages at the *layer-level* boundaries ``c_0 = 0 <
c_1 < ... < c_L = n`` (input norm, each layer, final norm: ``layer_cuts``) and write
``M_{a,b} = J_{c_b - 1} ... J_{c_a}`` for the product of the layer-level stages ``a .. b-1`` at the
data (``M_{0,b}`` the prefix, ``M_{a,L}`` a suffix, ``M_{a,a} = I``).  For ``y`` in the ball the
telescoping identity ``M_{a,b}(y) - M_{a,b}(x) = sum_{a<=m<b} M_{m+1,b}(y) (J_m(y_m) - J_m(x_m))
M_{a,m}(x)`` gives, row by row (``nu_i(A C) <= sum_k ||A_ik|| nu_k(C)`` for ``A = M_{m+1,b}(x)``,
``nu_i(A C) <= nu_i(A) max_k nu_k(C)`` for its change),

    dM_{a,b,i} <= sum_m sum_k ||M_{m+1,b}(x)_ik|| v_{a,m,k} + dM_{m+1,b,i} max_k v_{a,m,k},
    v_{a,m,k} >= nu_k(dJ_m M_{a,m}(x))  (dJ_{m,k} nu_k(M_{a,m}) for a token-local stage,
                                         dJ_{m,k} ||M_{a,m}|| otherwise),

computed for the spans ending at ``b`` from the shortest up (``middle_drift_column``).  Every
first-order term carries exact middle products at the data, never a product of stage norms.  The
rows ``nu_i(M_{a,b}(x))`` come from chains started at every layer-level stage (``middle_rows``),
``O(L^2)`` layer passes over the ``T d`` columns; the chains' rounding is carried to each cut by the
exact middle products after the rounding step (``fl(M) - M = sum_m M_{m+1 -> b} E_m``) and bounded
per step by the abs evaluation on token-summed columns (``_local_stack._local_error``).
"""

from __future__ import annotations

import bisect
import math

import torch
from torch import Tensor

from ._local_stack_move import product_norm

__all__ = ["layer_cuts", "middle_rows", "middle_of_products", "middle_drift_column", "cut_carried_error"]


def layer_cuts(n: int, groups: dict) -> list[int]:
    """The sub-stage indices where a layer-level stage starts (a layer's sub-stages form one stage,
    a norm its own), with ``n`` at the end."""
    cuts = {0, n}
    for a, b, _ in groups.values():
        cuts |= {a, b}
    return sorted(cuts)


def middle_rows(stages: list, cuts: list[int], norms_of, exact: int = 4,  # noqa: ANN001
                on_next=None) -> tuple[dict, dict, dict, dict]:  # noqa: ANN001
    r"""Certified rows ``mid[(a, b)] >= nu_i(M_{a,b}(x))`` (T,) for ``1 <= a < b <= L`` and ``(0, 1)``
    (layer-level stages, ``cuts`` from ``layer_cuts``) by float64 chains of the sub-stages' tangent
    maps started at every cut (from the first only its own stage: the prefix chain gives the rest);
    ``blk[(a, b)] = (N, e)``: the computed product's certified block norms (T, T) and its rounding
    bound ``e >= max_i sum_k ||E_ik||``, so ``||M_{a,b,ik}|| <= N_ik + ||E_ik||``; ``first[c]``: the rows
    after the first sub-stage of the stage starting at ``c``.  ``norms_of(K)``: certified block norms
    of the computed columns (``certified_block_norms`` of their blocks).  Rounding: ``fl(M_{a,b}) -
    M_{a,b} = sum_m M_{m+1 -> c_b} E_m``, each ``M_{m+1 -> c_b}`` bounded by the stage's own tail
    (point norms of its remaining sub-stages) times the exact ``mid`` of the later layer-level stages,
    so the starts run from the last (``cut_carried_error``).  ``inner[t] = (N, e)``: for a sub-stage ``t`` strictly
    inside a layer-level stage ``a >= 1``, the same for the partial product ``J_{t-1} ... J_{c_a}`` (its rounding
    carried by the point norms of the sub-stages in between; THEORY F40e).  ``on_next(a, K, e)`` (optional) is called
    with each computed ``M_{a,a+1}``'s columns ``K`` and rounding bound ``e``, ``a >= 1`` (THEORY F66's carry).
    THEORY F36 item 1."""
    from ._local_stack import _chunked, _local_error, rows_of_block_norms

    L = len(cuts) - 1
    n = cuts[-1]
    T, d = stages[0].x.shape
    pos = {c: q for q, c in enumerate(cuts)}
    mid: dict = {}
    blk: dict = {}
    first: dict = {}
    inner: dict = {}
    for a in range(L - 1, -1, -1):  # a = 0: its first stage only (the prefix chain gives the rest)
        K = torch.eye(T * d, dtype=torch.float64).reshape(T * d, T, d)
        errs = []  # the chain's step errors, from its start cuts[a]
        for s in range(cuts[a], n if a > 0 else cuts[1]):
            errs.append(_local_error(stages[s], K, cols=True))
            K = _chunked(stages[s].lin.apply, K)
            inside = a > 0 and s + 1 < cuts[a + 1]
            N = norms_of(K) if s == cuts[a] or s + 1 in pos or inside else None  # once where several ask
            if inside:
                inner[s + 1] = (N, cut_carried_error(stages, cuts, mid, inner, errs, cuts[a], s + 1))
            if s == cuts[a]:
                first[s] = rows_of_block_norms(N) + errs[0]
            if s + 1 in pos:
                b = pos[s + 1]
                err = cut_carried_error(stages, cuts, mid, inner, errs, cuts[a], s + 1)
                blk[(a, b)] = (N, err)
                mid[(a, b)] = rows_of_block_norms(N) + err
                if on_next is not None and b == a + 1 and a > 0:
                    on_next(a, K, err)
    return mid, blk, first, inner


def cut_carried_error(stages: list, cuts: list[int], mid: dict, inner: dict, errs: list[float], a: int,
                      s: int) -> float:
    r"""THEORY F88 where only the layer-level products exist (``middle_rows``): certified ``||fl(K_s) - K_s||_(2,inf)``
    of a chain of the sub-stages' maps from ``a`` to ``s`` computed step by step, ``errs[m - a] >= ||E_m||_(2,inf)``
    step ``m``'s own error (``carried_error``'s convention),

    .. math:: \|fl(K_s) - K_s\| \le \sum_{a \le m < s} e_m \|M_{m+1 \to s}\|,\qquad
              \|M_{m+1 \to s}\| \le \mathrm{tail}(m)\, \|M_{q_m + 1, q}\|\, \|M_{c_q \to s}\|

    for ``m`` before the layer-level stage ``q`` that holds ``s`` (``c_q <= s``; ``q_m`` the one holding ``m``,
    ``tail(m)`` the point norms of its sub-stages after ``m``, ``M_{q_m+1, q}`` the exact middle product, 1 when empty,
    ``M_{c_q -> s}`` the partial product ``inner[s]``'s rows plus its rounding, or the point norms from ``c_q``), and
    the point norms of the sub-stages in between for ``m >= c_q``; ``middle_rows`` carries its chains' rounding by the
    same sum (every ``mid`` it reads starts after ``a``, so the starts run from the last).  Padded ``1e-12``
    relative."""
    q = bisect.bisect_right(cuts, s) - 1
    c = cuts[q]
    pts = lambda i, j: math.prod((stages[t].p for t in range(i, j)), start=1.0)  # noqa: E731
    if s == c:
        inside = 1.0
    elif s in inner:
        inside = product_norm(inner[s])
    else:
        inside = pts(c, s)
    total = 0.0
    for m, e in zip(range(a, s), errs):
        if m >= c:
            total += e * pts(m + 1, s)
            continue
        qm = bisect.bisect_right(cuts, m) - 1
        middle = 1.0 if qm + 1 == q else float(mid[(qm + 1, q)].max())
        total += e * pts(m + 1, cuts[qm + 1]) * middle * inside
    return total * (1 + 1e-12)


def middle_of_products(prods: dict, cuts: list[int]) -> tuple[dict, dict, dict, dict]:
    """``middle_rows``' ``(mid, blk, first, inner)`` read from the chains of every sub-stage start
    (``_local_stack_move.substage_products``' ``{(a, s): (N, e)}``), which hold those from the cuts: one set of chains
    for F73c's sums and F36/F40e's products.  The rounding ``e`` of each product is the chains' own, carried by the
    exact later products (F73c) where ``middle_rows`` carries it by the stages' point norms; both bound the same
    ``sum_k ||E_ik||``.  THEORY F36 item 1, F40e, F77."""
    from ._local_stack import rows_of_block_norms

    mid: dict = {}
    blk: dict = {}
    first: dict = {}
    inner: dict = {}
    L = len(cuts) - 1
    for q in range(L):
        c = cuts[q]
        N, e = prods[(c, c + 1)]
        first[c] = rows_of_block_norms(N) + e
        for b in range(q + 1, L + 1) if q > 0 else (1,):  # from the first cut only its own stage (the prefix's)
            blk[(q, b)] = prods[(c, cuts[b])]
            mid[(q, b)] = rows_of_block_norms(blk[(q, b)][0]) + blk[(q, b)][1]
        for t in range(c + 1, cuts[q + 1]) if q > 0 else ():
            inner[t] = prods[(c, t)]
    return mid, blk, first, inner


def _reach(dJ: Tensor, rows: Tensor, local: bool) -> Tensor:
    """(T,) ``v_k >= nu_k(dJ_m M(x))`` from the drift rows ``dJ`` of stage m and the rows of ``M(x)``:
    ``dJ_k nu_k(M)`` for a token-local stage, else ``dJ_k ||M||``."""
    v = dJ * rows if local else dJ * float(rows.max())
    return torch.nan_to_num(v, nan=math.inf, posinf=math.inf)


def middle_drift_column(mid: dict, dJ: list[Tensor], local: list[bool], b: int, blk: dict | None = None,
                        reach0: list[Tensor] | None = None, earlier: dict | None = None,
                        carry0: dict | None = None, second0: dict | None = None) -> list[Tensor]:
    r"""Rows ``dM[a] >= sup_{y in B} nu_i(M_{a,b}(y) - M_{a,b}(x))`` for ``a = 0 .. b`` (``dM[b] = 0``):

    .. math:: \delta M_{a,b,i} \le \sum_{a \le m < b} \Big(\sum_k \|M_{m+1,b}(x)_{ik}\|\, v_{a,m,k}
              + \delta M_{m+1,b,i} \max_k v_{a,m,k}\Big),\quad v_{a,m,k} \ge \nu_k(\Delta J_m M_{a,m}(x))

    (Note [middle products]), from the shortest span up; the block norms ``||M_{m+1,b}(x)_ik||`` are
    ``blk``'s (``N_ik`` plus the rounding ``e``, carried as ``e max_k v``) where given, else the row
    bound ``nu_i(M_{m+1,b}) max_k v``; for ``m + 1 = b`` (the identity) the term is ``v_i``.
    ``mid[(a, b)]``: certified rows of the middle products at the data (``(a, a)`` is the identity);
    ``dJ[m]`` (T,): stage ``m``'s certified drift rows on its input ball; ``local[m]``: stage ``m`` is
    token-local; ``reach0[m]`` (optional): certified ``v_{0,m,k}`` of the prefix spans (``a = 0``) from the
    stage's own sub-stages (THEORY F40d), min'ed with the generic one.  ``earlier`` (optional): the rows
    ``dM_{a,m}`` of the spans ending before ``b`` (earlier columns); then also the other telescoping
    (THEORY F44d), ``M_{a,b}(y) - M_{a,b}(x) = sum_m M_{m+1,b}(x) (J_m(y) - J_m(x)) M_{a,m}(y)``:

    .. math:: \delta M_{a,b,i} \le \sum_{a \le m < b} \sum_k \|M_{m+1,b}(x)_{ik}\|\,
              \big(v_{a,m,k} + \Delta J_{m,k}\, \delta M_{a,m,\cdot}\big)

    (``delta M_{a,m,k}`` for a token-local stage, else its largest row), the smaller kept.  ``carry0`` (optional):
    ``{m: Q}``, rows ``Q_i >= sup_y nu_i(M_{m+1,m+2}(x) dJ_m(y) M_{0,m}(x))`` of a layer carried by exact products from
    its sub-stages (THEORY F66, ``_local_stack_carry``); for ``a = 0`` and ``b >= m + 2`` the first-order term
    ``M_{m+1,b}(x) dJ_m M_{0,m}(x)`` (in both telescopings) is also ``M_{m+2,b}(x)`` applied to ``Q``, the smaller
    kept.  ``second0`` (optional): ``{m: (near, far)}``, rows ``near_i >= sup_y nu_i((J_m(y) - J_m(x)) D(y))``,
    ``D = M_{0,m}(y) - M_{0,m}(x)``, of a layer split over its sub-stages, and ``far`` (or ``None``) the same through
    ``M_{m+1,m+2}(x)`` (THEORY F69, ``_local_stack_second``); for ``a = 0`` F44d's second-order term
    ``M_{m+1,b}(x) dJ_m dM_{0,m}`` is also ``M_{m+1,b}(x)`` applied to ``near`` and ``M_{m+2,b}(x)`` to ``far``, the
    smallest kept.  Float64 sums of a few non-negative products, padded by ``1e-12`` relative.  THEORY F36 item 2,
    F44d, F66, F69."""
    blk = {} if blk is None else blk
    T = dJ[0].shape[0] if dJ else next(iter(mid.values())).shape[0]
    one = torch.ones(T, dtype=torch.float64)
    zero = torch.zeros(T, dtype=torch.float64)
    rows = lambda a, c: one if a == c else mid[(a, c)]  # noqa: E731

    def through(w: Tensor, m: int) -> Tensor:  # rows of M_{m+1,b}(x) w, w the rows of the stage's term
        if m + 1 == b:
            return w
        wmax = float(w.max())
        if (m + 1, b) in blk:
            N, err = blk[(m + 1, b)]
            return N @ w + err * wmax
        return rows(m + 1, b) * wmax

    def carried(a: int, m: int) -> Tensor | None:  # F66: rows of M_{m+1,b}(x) dJ_m M_{0,m}(x) via Q
        if a > 0 or carry0 is None or m not in carry0 or m + 2 > b:
            return None
        return through(carry0[m], m + 1)

    def split(x: Tensor, a: int, m: int) -> Tensor:  # F69: rows of M_{m+1,b}(x) dJ_m D(y), D the span's own drift
        seen = through(x, m)
        if a > 0 or second0 is None or m not in second0:
            return seen
        near, far = second0[m]
        seen = torch.minimum(seen, through(near, m))
        return seen if far is None or m + 2 > b else torch.minimum(seen, through(far, m + 1))

    out = {b: zero}
    for a in range(b - 1, -1, -1):
        acc, alt = zero.clone(), zero.clone()
        for m in range(a, b):
            v = _reach(dJ[m], rows(a, m), local[m])
            if a == 0 and reach0 is not None:
                v = torch.minimum(v, reach0[m])
            q = carried(a, m)
            seen = through(v, m) if q is None else torch.minimum(through(v, m), q)
            if earlier is not None:  # F44d: the span's own drift on the right, M_{m+1,b} at x on the left
                dA = zero if m == a else earlier.get((a, m), torch.full_like(zero, math.inf))
                x = _reach(dJ[m], dA, local[m])
                alt = alt + torch.minimum(through(v + x, m), seen + split(x, a, m))
            vmax = float(v.max())
            if not vmax > 0:
                continue
            acc = acc + seen + (0 if m + 1 == b else out[m + 1] * vmax)
        acc = torch.minimum(acc, alt) if earlier is not None else acc
        out[a] = torch.nan_to_num(acc * (1 + 1e-12), nan=math.inf, posinf=math.inf)
    return [out[a] for a in range(b + 1)]
