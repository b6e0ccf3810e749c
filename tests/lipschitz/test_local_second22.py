"""F69: a layer's second-order span-drift term split over its sub-stages (THEORY F69).

Attacks: float64 Adam over the network's input ball and per-token unit probes of ``nu_i((J_q(y) - J_q(x)) D(y))``,
``D = M_{0,q}(y) - M_{0,q}(x)``, and of the same through the next layer at x (the quantities F69's ``near`` and ``far``
rows bound), by nested forward-mode derivatives of ``layer_forward``, on random GELU stacks (post-LN 3 layers; tiny
sigma with eps = 1e-12; sharp causal heads; saturated GELU; pre-LN), never above the rows; the whole network
(``assert_network_below``); F69 off never smaller anywhere and larger somewhere; homogeneity.
"""

from __future__ import annotations

import math

import pytest
import torch

import transcover.lipschitz._local_stack as ls
import transcover.lipschitz._local_stack_second as se
from lipschitz_testkit import assert_stack_never_looser, last_norm_doubled, random_spec, token_ascents
from test_local_stack19 import _spec
from transcover.lipschitz._local_stack import stack_local
from transcover.model import layer_forward

# (spec, T, xscale, rho fraction of the median token norm)
CASES = [(dict(seed=3, L=3), 2, 1.0, 3e-3), (dict(seed=5, eps=1e-12), 5, 0.05, 5e-3),
         (dict(seed=7, qscale=8.0, causal=True), 3, 1.0, 5e-3), (dict(seed=11, w1scale=6.0), 1, 1.0, 3e-3),
         (dict(seed=13, pre=True), 3, 1.0, 5e-3)]


def _case(case: tuple) -> tuple:
    kw, T, xscale, frac = case
    kw = dict(kw)
    if kw.pop("pre", False):
        spec = random_spec(kw["seed"], act="gelu", L=2, norm="layernorm", d=8, H=2, dh=4, dff=8, biases=True,
                           placement="pre", final_norm=True)
    else:
        spec = _spec(**kw)
    X = torch.randn(T, 8, generator=torch.Generator().manual_seed(kw["seed"]), dtype=torch.float64) * xscale
    return spec, X, frac * float(X.norm(dim=1).median()), kw["seed"]


def _captured(spec, X: torch.Tensor, rho: float, monkeypatch) -> tuple:  # noqa: ANN001
    """``stack_local`` on ``B(X, rho)`` and F69's ``(near, far)`` rows per layer, in layer order."""
    got, second = [], ls._second

    def second_(*a):  # noqa: ANN002, ANN202
        got.append(second(*a))
        return got[-1]

    monkeypatch.setattr(ls, "_second", second_)
    res = stack_local(spec, X, [rho])[0]
    monkeypatch.undo()
    return res, got


def _jvp(f, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return torch.autograd.functional.jvp(f, x, v, create_graph=True)[1]


def _attained(spec, X: torch.Tensor, rho: float, layer: int, far: bool) -> torch.Tensor:  # noqa: ANN001
    """Per output token i, Adam's largest ``||((J_q(y) - J_q(x)) D(y) V)_i||`` (``far``: through the next layer's
    Jacobian at x) over network moves in the ball and per-token unit ``V`` (a lower bound on the row)."""
    ly = spec.layers

    def pre(Z):  # noqa: ANN001, ANN202
        Z = spec.input_norm(Z)
        for L in ly[:layer]:
            Z = layer_forward(L, Z)
        return Z

    mid = lambda Z: layer_forward(ly[layer], Z)  # noqa: E731
    nxt = (lambda Z: layer_forward(ly[layer + 1], Z)) if layer + 1 < len(ly) else spec.final_norm
    # the terms at the fixed points x, x1 = pre(x), mid(x1) are linear in their direction: read from Jacobians
    # computed once instead of a double-backward jvp per step
    jac = lambda f, x: torch.autograd.functional.jacobian(f, x).detach()  # noqa: E731
    lin = lambda J, V: torch.einsum("iajb,...jb->...ia", J, V)  # noqa: E731
    x1 = pre(X).detach()
    Jpre, Jmid = jac(pre, X), jac(mid, x1)
    Jnxt = jac(nxt, mid(x1).detach()) if far else None

    def out(E, V):  # noqa: ANN001, ANN202
        D = _jvp(pre, X + E, V) - lin(Jpre, V)
        w = _jvp(mid, pre(X + E), D) - lin(Jmid, D)
        return lin(Jnxt, w) if far else w

    return torch.tensor(token_ascents(out, X, rho, starts=2, steps=6), dtype=torch.float64)


@pytest.mark.parametrize("case", CASES)
def test_second_order_rows_are_never_beaten_and_bind(case, monkeypatch):
    """Per layer and output token, Adam over the input ball and unit probes of the second-order term stays below F69's
    ``near`` rows (and through the next layer below ``far``) and reaches >= 2e-4 of them somewhere; without F69
    (``_second`` giving inf rows) the bound, drift, every span drift row and radius at least as large, and some prefix
    span row strictly larger where there are two or more layers before the last cut."""
    spec, X, rho, _ = _case(case)
    new, rows = _captured(spec, X, rho, monkeypatch)
    assert len(rows) == len(spec.layers) and math.isfinite(new.upper)
    share = 0.0
    for layer, (near, far) in enumerate(rows):
        pairs = [(near, False)] + ([(far, True)] if far is not None else [])
        for bound, through in pairs:
            got = _attained(spec, X, rho, layer, through)
            assert bool((got <= bound).all()), (layer, through, got, bound)
            share = max(share, float((got / bound).max()))
    assert share >= 2e-4, share
    monkeypatch.setattr(ls, "_second", lambda *a: (torch.full((X.shape[0],), math.inf, dtype=torch.float64), None))
    old = stack_local(spec, X, [rho])[0]
    assert_stack_never_looser(new, old)


def test_homogeneity(monkeypatch):
    """The last layer's second norm x 2 (the last stage, no final norm): the last layer's ``near`` doubles (its tail's
    ball, point and drift rows are degree 1 in it), layer 0's ``near`` is unchanged and its ``far`` doubles
    (``M_{2,3}`` degree 1); ``second_order_rows`` is degree 1 in the incoming drift and in the drift rows."""
    spec, X, rho, _ = _case(CASES[2])
    (_, a), (_, b) = _captured(spec, X, rho, monkeypatch), _captured(last_norm_doubled(spec), X, rho, monkeypatch)
    assert torch.equal(a[0][0], b[0][0])
    for x, y in ((a[0][1], b[0][1]), (a[1][0], b[1][0])):
        assert torch.allclose(y, 2.0 * x, rtol=1e-9, atol=0.0), (x, y)
    g = torch.Generator().manual_seed(2)
    rnd = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    dM, dJ, inner = rnd(3), [rnd(3) for _ in range(3)], [None, (rnd(3, 3), 1e-9), (rnd(3, 3), 1e-9)]
    one = se.second_order_rows(dM, dJ, inner, False)
    twos = (se.second_order_rows(2 * dM, dJ, inner, False), se.second_order_rows(dM, [2 * v for v in dJ], inner, False))
    for two in twos:
        assert all(torch.allclose(y, 2.0 * x, rtol=1e-12, atol=0.0) for x, y in zip(one, two))
