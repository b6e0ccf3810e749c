"""THEORY F88: the computed prefix's rounding carried by the exact products at the data (``carried_error``), not by
the product of the sub-stages' own constants.

Attacks: errors injected into a float64 chain of a 2-layer stack's tangent maps, each step's error a rank-one map of
(2,inf) norm exactly ``e_m`` aimed at the worst input of the product that carries it (F67a's fixed point on the
sphere), all of them aligned on one output direction so that they add; the chain's deviation against the bound at
every depth, never above, within a factor of it.  Homogeneity (errors x 2: the bound x 2), the identity for the last
step, and the stack: ``stack_local(move_rest=True)`` never looser with F88 than without and its prefix rounding at
every stage below the old recursion's.
"""

from __future__ import annotations

import math

import pytest
import torch

import transcover.lipschitz._local_stack as ls
from test_local_move26 import CASES, _case
from transcover.lipschitz._local_stack_middle import cut_carried_error, layer_cuts, middle_rows
from transcover.lipschitz._local_stack_move import carried_error

F64 = torch.float64
U = 2.0**-53


def _setup(case: tuple) -> tuple:
    spec, X, rho, _ = _case(case)
    stages = ls._stages(spec, X)[0]
    prods = ls.substage_products(stages, lambda K: ls.certified_block_norms(ls._col_blocks(K), 4),
                                 lambda st, K: ls._local_error(st, K, cols=True),
                                 lambda st, K: ls._chunked(st.lin.apply, K))
    return spec, X, rho, stages, prods


def _product(stages: list, a: int, s: int, T: int, d: int) -> torch.Tensor:
    """``M_{a -> s}`` as (T, T_in, d, d) blocks ``M_mk`` by the float64 chain of the tangent maps."""
    K = torch.eye(T * d, dtype=F64).reshape(T * d, T, d)
    for t in range(a, s):
        K = ls._chunked(stages[t].lin.apply, K)
    return K.reshape(T, d, T, d).permute(2, 0, 3, 1).contiguous()


def _aim(M: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The row ``i`` with the largest ``sum_k ||M_ik||_2`` and the top left singular vector ``u`` of ``[M_i1 ... M_iT]``."""
    i = int(torch.linalg.matrix_norm(M, ord=2).sum(dim=1).argmax())
    return i, torch.linalg.svd(M[i].permute(1, 0, 2).reshape(M.shape[2], -1))[0][:, 0]


def _worst_input(M: torch.Tensor, i: int, u: torch.Tensor) -> torch.Tensor:
    """(T_in, d) unit per token: the input that maximises ``<u, sum_k M_ik g_k>`` (``g_k = M_ik^T u / ||.||``)."""
    G = torch.einsum("kab,a->kb", M[i], u)
    return G / G.norm(dim=1, keepdim=True).clamp(min=1e-300)


def _step(st, K: torch.Tensor, e: float, cols: bool) -> tuple[torch.Tensor, float]:  # noqa: ANN001
    """One float64 step of a chain (columns: ``J K``; rows: ``K J``) and F30 item 3's recursion for the chain's own
    rounding, ``e p + e_loc`` (the steps' own constants: certified, independent of F88, loose)."""
    out = ls._chunked(st.lin.apply if cols else st.lin.apply_t, K)
    return out, e * st.p + ls._local_error(st, K, cols=cols)


def _injected(stages: list, s: int, errs: list, i: int, u: torch.Tensor, T: int, d: int) -> tuple[float, float]:
    """The chain from the network input to ``s`` with step ``m``'s error ``e_m g_m (x)_{0,0}`` added (a rank-one map of
    (2,inf) norm ``e_m``: it reads coordinate 0 of input token 0 and writes ``e_m g_m``, ``g_m`` unit per token, aimed
    through ``M_{m+1 -> s}`` at ``u`` on row ``i``), and the same chain without them: ``(<u, (K_s - P_s)_i e_{0,0}>``, a
    lower bound on the injected deviation's (2,inf) norm, ``tol``: both chains' own float64 rounding)."""
    K = torch.eye(T * d, dtype=F64).reshape(T * d, T, d)
    P, eK, eP = K.clone(), 0.0, 0.0
    for m in range(s):
        (K, eK), (P, eP) = _step(stages[m], K, eK, True), _step(stages[m], P, eP, True)
        g = _worst_input(_product(stages, m + 1, s, T, d), i, u) if m + 1 < s else u.expand(T, d)
        K[0] = K[0] + errs[m] * g
    return float(u @ (K[0, i] - P[0, i])), eK + eP


def _by_cuts(case: tuple):  # noqa: ANN202
    """``cut_carried_error`` on the case's stack with ``middle_rows``' products (the ``move_rest=False`` route)."""
    spec, X, _, _ = _case(case)
    stages, _, groups = ls._stages(spec, X)
    cuts = layer_cuts(len(stages), groups)
    mid, _, _, inner = middle_rows(stages, cuts, lambda K: ls.certified_block_norms(ls._col_blocks(K), 4))
    return lambda errs, s: cut_carried_error(stages, cuts, mid, inner, errs, 0, s)


@pytest.mark.parametrize(("case", "route", "floor"), [(CASES[0], "products", 0.5), (CASES[3], "products", 0.5),
                                                      (CASES[0], "cuts", 0.1), (CASES[3], "cuts", 0.1)])
def test_injected_errors_never_beat_the_carried_bound(case, route, floor):
    """Every depth ``s``: the aligned injected deviation at most F88's bound (``carried_error`` through the sub-stage
    products, ``cut_carried_error`` through the layer-level ones; plus the two float64 chains' own rounding by F30's
    recursion, below 1e-6 of it), and above ``floor`` of it (not loose by the product of the steps' constants); with
    one error only, the same."""
    _, X, _, stages, prods = _setup(case)
    bound_of = (lambda errs, s: carried_error(prods, errs, 0, s)) if route == "products" else _by_cuts(case)
    T, d = X.shape
    n = len(stages)
    g = torch.Generator().manual_seed(0)
    errs = [float(v) for v in 1 + torch.rand(n, generator=g, dtype=F64)]
    for s in range(2, n + 1):
        i, u = _aim(_product(stages, 1, s, T, d))
        bound, (got, tol) = bound_of(errs, s), _injected(stages, s, errs, i, u, T, d)
        one = [errs[0]] + [0.0] * (n - 1)
        (alone, tol1), bound1 = _injected(stages, s, one, i, u, T, d), bound_of(one, s)
        assert got <= bound + tol and alone <= bound1 + tol1 and tol < 1e-6 * bound, (s, got, bound, alone, bound1)
        assert got >= floor * bound and alone >= floor * bound1, (s, got, bound, alone, bound1)


def test_homogeneity_and_the_identity():
    """Errors x 2 (exact in binary): the bound x 2 exactly; the last step's error enters once (the identity), the
    earlier ones through their products' norms, each at least ``||M||_2``'s lower bound by the chain."""
    _, X, _, stages, prods = _setup(CASES[3])
    n = len(stages)
    errs = [1e-7 * (m + 1) for m in range(n)]
    for s in range(1, n + 1):
        a, b = carried_error(prods, errs, 0, s), carried_error(prods, [2 * e for e in errs], 0, s)
        assert b == pytest.approx(2 * a, rel=4 * n * U), (s, a, b)
        last = [0.0] * (s - 1) + [1.0]
        assert carried_error(prods, last, 0, s) == pytest.approx(1 + 1e-12, rel=4 * U)  # the identity, padded
    T, d = X.shape
    for m in range(n - 1):
        unit = [0.0] * n
        unit[m] = 1.0
        M = _product(stages, m + 1, n, T, d)
        row = float(torch.linalg.matrix_norm(M, ord=2).sum(dim=1).max())  # ||M||_(2,inf) <= this <= T ||M||_(2,inf)
        assert carried_error(prods, unit, 0, n) >= row / T * (1 - 1e-9), (m, row)


def test_the_stack_carries_the_prefix_by_the_products(monkeypatch):
    """``stack_local(move_rest=True)``: the prefix rounding ``eP_s`` each stage's rests read is the smaller of the old
    recursion's (``eP p + e_loc``, F30 item 3) and ``carried_error`` of the forward chain's own step errors through the
    run's products (recomputed here from what the run computed), strictly smaller somewhere; the whole result never
    looser than with F88 off."""
    spec, X, rho, _, _ = _setup(CASES[1])
    seen, prods, steps = [], [], []
    inner, run, err = ls._rest_at, ls.substage_products, ls._local_error
    monkeypatch.setattr(ls, "_rest_at", lambda st, K, al, aa, nu, eP, dPm: seen.append(eP) or inner(st, K, al, aa, nu,
                                                                                                     eP, dPm))
    monkeypatch.setattr(ls, "substage_products", lambda *a: prods.append(run(*a)) or prods[-1])
    monkeypatch.setattr(ls, "_local_error", lambda st, K, cols: steps.append((bool(prods), err(st, K, cols=cols)))
                        or steps[-1][1])
    new = ls.stack_local(spec, X, [rho], move_rest=True)[0]
    seen_new = list(seen)
    e_loc = [e for after, e in steps if after][:len(seen)]  # the forward chain's, before the suffixes' (rows)
    seen.clear()
    monkeypatch.setattr(ls, "carried_error", lambda *a: math.inf)
    old = ls.stack_local(spec, X, [rho], move_rest=True)[0]
    assert len(seen_new) == len(seen) == len(e_loc) and seen_new[0] == seen[0] == 0.0
    for s in range(1, len(seen)):
        assert seen_new[s] == min(seen[s], carried_error(prods[0], e_loc, 0, s)), (s, seen_new[s], seen[s])
    assert any(a < b for a, b in zip(seen_new, seen)), (seen_new, seen)
    assert new.upper <= old.upper and new.drift <= old.drift, (new.upper, old.upper)
    assert all(bool((a <= b).all()) for a, b in zip(new.token_radii, old.token_radii))


def test_the_default_route_carries_the_prefix_by_the_cuts(monkeypatch):
    """``stack_local(move_rest=False)`` (no sub-stage products): every prefix ``P_s``, ``s = 1 .. n``, asks
    ``cut_carried_error`` once with the ``s`` step errors that formed it; the whole result never looser than with it off."""
    spec, X, rho, stages, _ = _setup(CASES[1])
    calls, inner = [], ls.cut_carried_error
    monkeypatch.setattr(ls, "cut_carried_error", lambda st, c, m, i, errs, a, s: calls.append((a, s, len(errs))) or
                        inner(st, c, m, i, errs, a, s))
    new = ls.stack_local(spec, X, [rho])[0]
    assert calls == [(0, s, s) for s in range(1, len(stages) + 1)], calls
    monkeypatch.setattr(ls, "cut_carried_error", lambda *a: math.inf)
    old = ls.stack_local(spec, X, [rho])[0]
    assert new.upper <= old.upper and new.drift <= old.drift, (new.upper, old.upper)
    assert all(bool((a <= b).all()) for a, b in zip(new.token_radii, old.token_radii))
