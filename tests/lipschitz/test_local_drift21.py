"""F66: a layer's first-order drift carried across the next layer-level stage by exact products from its sub-stages
(THEORY F66).

Attacks: float64 Adam over the network's input ball and per-token unit probes of ``nu_i(M_{q+1,q+2}(x) (J_q(y) -
J_q(x)) M_{0,q}(x))`` (the quantity F66's rows ``Q`` bound) on random post-LN GELU stacks (2-3 layers, T = 1, 3, 5;
plain, tiny sigma with eps = 1e-12, sharp causal heads, saturated GELU), never above ``Q``; the whole network
(``assert_network_below``); F66 off never smaller anywhere and larger somewhere; homogeneity in the next stage's scale.
"""

from __future__ import annotations

import math

import pytest
import torch

import transcover.lipschitz._local_stack as ls
import transcover.lipschitz._local_stack_carry as ca
from lipschitz_testkit import assert_stack_never_looser, last_norm_doubled, token_ascents
from test_local_stack15 import assert_network_below
from test_local_stack19 import _spec
from transcover.lipschitz._local_stack import stack_local
from transcover.model import layer_forward

# (spec arguments, T, xscale, rho fraction of the median token norm)
CASES = [(dict(seed=3, L=3), 3, 1.0, 1e-3), (dict(seed=5, eps=1e-12), 5, 0.05, 5e-3),
         (dict(seed=7, qscale=8.0, causal=True), 3, 1.0, 5e-3), (dict(seed=11, w1scale=6.0), 1, 1.0, 3e-3)]


def _case(case: tuple) -> tuple:
    kw, T, xscale, frac = case
    spec = _spec(**kw)
    X = torch.randn(T, 8, generator=torch.Generator().manual_seed(kw["seed"]), dtype=torch.float64) * xscale
    return spec, X, frac * float(X.norm(dim=1).median()), kw["seed"]


def _captured(spec, X: torch.Tensor, rho: float, monkeypatch) -> tuple:  # noqa: ANN001
    """``stack_local`` on ``B(X, rho)`` and F66's rows ``Q`` per layer with a next layer-level stage, in layer order,
    with the same rows without the per-head branch."""
    got, plain, carried = [], [], ca.carried_first_order

    def carried_(*a):  # noqa: ANN002, ANN202
        got.append(carried(*a))
        plain.append(carried(*a[:4]))
        return got[-1]

    monkeypatch.setattr(ls, "carried_first_order", carried_)
    res = stack_local(spec, X, [rho])[0]
    monkeypatch.undo()
    return res, got, plain


def _jvp(f, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return torch.autograd.functional.jvp(f, x, v, create_graph=True)[1]


def _attained(spec, X: torch.Tensor, rho: float, layer: int) -> list:  # noqa: ANN001
    """Per output token i, Adam's largest ``||(M_{q+1,q+2}(x) (J_q(y) - J_q(x)) M_{0,q}(x) V)_i||`` over network moves
    in the ball and per-token unit ``V`` (a lower bound on the row), ``q`` the layer-level stage of ``layer``."""
    ly = spec.layers

    def pre(Z):  # noqa: ANN001, ANN202
        Z = spec.input_norm(Z)
        for L in ly[:layer]:
            Z = layer_forward(L, Z)
        return Z

    mid = lambda Z: layer_forward(ly[layer], Z)  # noqa: E731
    nxt = lambda Z: layer_forward(ly[layer + 1], Z)  # noqa: E731

    def out(E, V):  # noqa: ANN001, ANN202
        x0 = X.expand_as(E).contiguous()
        u = _jvp(pre, x0, V)
        x1 = pre(x0)
        w = _jvp(mid, pre(X + E), u) - _jvp(mid, x1, u)
        return _jvp(nxt, mid(x1), w)

    return token_ascents(out, X, rho, starts=2, steps=25)


@pytest.mark.parametrize("case", CASES)
def test_carried_rows_are_never_beaten_and_bind(case, monkeypatch):
    """Per layer with a next one and output token, Adam over the input ball and unit probes of the carried first order
    stays below F66's ``Q`` and reaches at least 1 % of it; without F66 (``carry_blocks`` empty) every prefix drift
    row, radius and the bound are at least as large, and some prefix drift row strictly larger (it binds); the per-head
    branch of the attention's term never above the block-norm one and below it somewhere when T > 1."""
    spec, X, rho, _ = _case(case)
    new, Q, plain = _captured(spec, X, rho, monkeypatch)
    assert all(bool((q <= p).all()) for q, p in zip(Q, plain))
    assert X.shape[0] == 1 or any(bool((q < p).any()) for q, p in zip(Q, plain))  # the per-head branch binds
    assert len(Q) == len(spec.layers) - 1 and math.isfinite(new.upper)
    share = 0.0
    for layer, q in enumerate(Q):
        got = torch.tensor(_attained(spec, X, rho, layer), dtype=torch.float64)
        assert bool((got <= q).all()), (layer, got, q)
        share = max(share, float((got / q).max()))
    assert share >= 1e-2, share
    monkeypatch.setattr(ls, "carry_blocks", lambda *a: ({}, {}))
    old = stack_local(spec, X, [rho])[0]
    assert_stack_never_looser(new, old)


def test_whole_network_is_never_beaten():
    """The whole network with F66 and F69 (both on by default; tiny sigma, eps = 1e-12) against pair-ratio and
    Jacobian-row ascent (``assert_network_below``).  test_local_second22 had the same test on the same case: one copy."""
    spec, X, rho, seed = _case(CASES[1])
    assert_network_below(spec, X, rho, stack_local(spec, X, [rho])[0], seed=seed)


def test_homogeneity_in_the_next_stage(monkeypatch):
    """Layer 1's second norm x 2 (weight and bias; the last stage, no final norm): layer 0's ``Q`` doubles (``M_{2,3}``
    is degree 1 in it, the reaches and radii before it degree 0); ``carried_first_order`` is degree 1 in the reach rows
    and ``tail_drift`` degree 1 in the drift rows."""
    spec, X, rho, _ = _case(CASES[2])
    scaled = last_norm_doubled(spec)
    (_, (a,), _), (_, (b,), _) = _captured(spec, X, rho, monkeypatch), _captured(scaled, X, rho, monkeypatch)
    assert torch.allclose(b, 2.0 * a, rtol=1e-9, atol=0.0), (a, b)
    g = torch.Generator().manual_seed(1)
    T = 3
    rnd = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    G, w, dR, nxt = [(rnd(T, T), 1e-9)] * 2, [rnd(T) for _ in range(3)], [rnd(T) for _ in range(3)], (rnd(T, T), 1e-9)
    one, three = ca.carried_first_order(G, w, dR, nxt), ca.carried_first_order(G, [3.0 * v for v in w], dR, nxt)
    assert torch.allclose(three, 3.0 * one, rtol=1e-12, atol=0.0)
    B, D, P = [rnd(T) + 1 for _ in range(3)], [rnd(T) for _ in range(3)], [rnd(T) for _ in range(3)]
    for x, y in zip(ca.tail_drift(B, D, P), ca.tail_drift(B, [2.0 * v for v in D], P)):
        assert torch.allclose(y, 2.0 * x, rtol=1e-12, atol=0.0)
