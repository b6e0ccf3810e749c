"""The whole stack's remainders by exact middle products (issue 12, ``lipschitz._local_stack_middle``,
THEORY F36): the middle products' certified rows against autograd, the span drifts against the
sampled change of the middle products in the ball, the whole-network bound against an adversary
(float64 Adam ascent on pair ratios and Jacobian norms in the ball), homogeneity, and a regression
on a 6-layer stack where the middle products tighten the drift.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import random_spec
from test_lipschitz_local import _clip, adversary
from transcover.lipschitz._local_jacobian import row_norm_lower
from transcover.lipschitz._local_stack import _col_blocks, _stages, certified_block_norms, stack_local
from transcover.lipschitz._local_stack_middle import layer_cuts, middle_drift_column, middle_rows
from transcover.model import NormKind
from transcover.model._functional import layer_forward, transformer_forward

CASES = [dict(norm="layernorm", placement="post"), dict(norm="layernorm", placement="pre", final_norm=True, biases=True),
         dict(norm="rmsnorm", placement="pre", causal=True, biases=True)]


def _X(seed: int, T: int = 4, d: int = 6) -> torch.Tensor:
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _level_maps(spec) -> list:  # noqa: ANN001
    """The layer-level stages as functions (input norm, layers, final norm), ``layer_cuts``' order."""
    active = lambda n: n is not None and n.kind is not NormKind.NONE  # noqa: E731
    fs = [spec.input_norm] if active(spec.input_norm) else []
    fs += [lambda Z, ly=ly: layer_forward(ly, Z) for ly in spec.layers]
    return fs + ([spec.final_norm] if active(spec.final_norm) else [])


def _middle(spec, Y: torch.Tensor, a: int, b: int) -> torch.Tensor:  # noqa: ANN001
    """Blocks (i, j, d, d) of M_{a,b} at the point reached from the network input Y, by autograd."""
    fs = _level_maps(spec)
    Z = Y
    for f in fs[:a]:
        Z = f(Z)

    def chain(W: torch.Tensor) -> torch.Tensor:
        for f in fs[a:b]:
            W = f(W)
        return W

    # vectorize: the T d backward passes as one batched (vmap) pass, the same Jacobian to rounding
    return torch.autograd.functional.jacobian(chain, Z.detach(), vectorize=True).permute(0, 2, 1, 3)


@pytest.mark.parametrize("case", CASES)
def test_middle_rows_bound_the_autograd_middle_products(case):
    spec = random_spec(3, act="gelu", L=3, **case)
    X = _X(5)
    stages, _, groups = _stages(spec, X, {})
    cuts = layer_cuts(len(stages), groups)
    mid, blk, _, _ = middle_rows(stages, cuts, lambda K: certified_block_norms(_col_blocks(K), 4))
    assert len(cuts) - 1 == len(_level_maps(spec))
    L = len(cuts) - 1
    assert set(mid) == {(a, b) for a in range(1, L) for b in range(a + 1, L + 1)} | {(0, 1)}
    for (a, b), rows in mid.items():
        M = _middle(spec, X, a, b)
        exact = torch.linalg.matrix_norm(M, ord=2).sum(dim=1)  # sum_j ||M_ij||_2 >= nu_i
        assert bool((exact <= rows).all()), (a, b)
        assert bool((rows <= exact * 1.3 + 1e-12).all()), (a, b)
        N, err = blk[(a, b)]
        assert bool((torch.linalg.matrix_norm(M, ord=2) <= N + err).all()) and 0 <= err <= 1e-10 * float(rows.max())


def test_middle_drift_column_is_the_recursion_by_hand():
    """Two stages, one token: dM_{1,2} = dJ_1, dM_{0,2} = (mu_{1,2} + dJ_1) dJ_0 + dJ_1 mu_{0,1}; with
    the block norms N of M_{1,2} and its rounding e, (N + e + dJ_1) dJ_0 + dJ_1 mu_{0,1}.  Two tokens:
    the identity's term keeps the rows of dJ (no max over tokens)."""
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    mid = {(0, 1): t(3.0), (1, 2): t(5.0), (0, 2): t(7.0)}
    col = middle_drift_column(mid, [t(0.5), t(0.25)], [False, True], 2)
    assert float(col[2]) == 0.0 and float(col[1]) == pytest.approx(0.25)
    assert float(col[0]) == pytest.approx((5.0 + 0.25) * 0.5 + 0.25 * 3.0)
    col = middle_drift_column(mid, [t(0.5), t(0.25)], [False, True], 2, {(1, 2): (t(4.0)[None], 0.5)})
    assert float(col[0]) == pytest.approx((4.0 + 0.5 + 0.25) * 0.5 + 0.25 * 3.0)
    mid2, dJ2 = {(0, 1): t(1.0, 2.0), (1, 2): t(5.0, 5.0)}, [t(0.0, 0.0), t(0.5, 0.25)]
    assert torch.allclose(middle_drift_column(mid2, dJ2, [True, True], 2)[0], t(0.5, 0.5))
    assert torch.allclose(middle_drift_column(mid2, dJ2, [True, False], 2)[0], t(1.0, 0.5))


@pytest.mark.parametrize("case", CASES[:2])
def test_span_drifts_bound_the_sampled_change_of_the_middle_products(case):
    """sup over sampled points y of the ball of nu_i(M_{a,b}(y) - M_{a,b}(x)) (attained values,
    random corners and the Jacobian's own top direction) never exceeds the certified span drift."""
    from transcover.lipschitz._empirical import jacobian_operator_norm

    spec = random_spec(13, act="gelu", L=2, **case)
    X = _X(9)
    rho = 1e-3
    r = stack_local(spec, X, [rho])[0]
    g = torch.Generator().manual_seed(2)
    dirs = [torch.randn(X.shape, generator=g, dtype=torch.float64) for _ in range(3)]
    dirs.append(jacobian_operator_norm(lambda Z: transformer_forward(spec, Z, with_head=False), X,
                                       metric="2,inf", n_iter=10)[1])
    L = len(r.cuts) - 1
    assert set(r.spans) == {(a, b) for b in range(1, L + 1) for a in range(b)}
    base = {ab: _middle(spec, X, *ab) for ab in r.spans}
    seen = 0.0
    for D in dirs:
        for sg in (1.0, -1.0):
            Y = X + _clip(sg * D / D.norm(dim=-1, keepdim=True) * rho, rho)
            for ab, bound in r.spans.items():
                change = row_norm_lower(_middle(spec, Y, *ab) - base[ab])
                assert bool((change <= bound).all()), (ab, change, bound)
                seen = max(seen, float(change.max()))
    assert seen > 0


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), case=st.sampled_from(CASES), rho=st.sampled_from([1e-5, 1e-4, 1e-3]))
def test_middle_product_route_alone_is_never_beaten(seed, case, rho):
    """The point bound plus the middle-product drift of J (THEORY F36 item 3 iii) on its own against
    the adversary (Adam ascent on pair ratios, Jacobian norms at points of the ball)."""
    spec = random_spec(seed, act="gelu", L=3, **case)
    X = _X(seed)
    r = stack_local(spec, X, [rho])[0]
    lo = adversary(lambda Z: transformer_forward(spec, Z, with_head=False), X, rho, restarts=2, steps=15, seed=seed)
    assert lo <= (r.point + r.parts["(middle products)"]) * (1 + 1e-12), (lo, r.point, r.parts)
    assert lo <= r.upper * (1 + 1e-12)


def test_span_drifts_are_homogeneous_in_the_last_norm():
    """Scaling the last layer's output LayerNorm by lam scales every span ending at the last stage,
    and the middle-product drift, by lam; the other spans do not move."""
    spec = random_spec(21, act="gelu", L=2, norm="layernorm", placement="post")
    X = _X(6)
    base = stack_local(spec, X, [1e-4], layer_route=False)[0]
    L = len(base.cuts) - 1
    for lam in (0.25, 4.0):
        last = spec.layers[-1]
        n = last.norm_ffn
        new = dataclasses.replace(last, norm_ffn=dataclasses.replace(n, weight=n.weight * lam, bias=n.bias * lam))
        b = stack_local(dataclasses.replace(spec, layers=[*spec.layers[:-1], new]), X, [1e-4], layer_route=False)[0]
        assert b.parts["(middle products)"] == pytest.approx(lam * base.parts["(middle products)"], rel=1e-7)
        for ab, v in base.spans.items():
            want = lam * v if ab[1] == L else v
            assert torch.allclose(b.spans[ab], want, rtol=1e-7, atol=0.0), ab


def test_middle_products_tighten_a_deep_stack():
    """Regression (issue 12, THEORY F36): a 6-layer post-LN stack at rho = 1e-5; the remainders by
    products of ball norms gave a drift of 25.1 (sub-stage route 103, layer route 25.1); with the
    exact middle products (their block norms against the drift rows) and each layer's drift the
    smaller of its sub-stages' and the per-layer route's, 3.11 (sub-stage route; layer route 4.53,
    middle products alone 4.08)."""
    spec = random_spec(1, act="gelu", L=6, norm="layernorm", placement="post", d=6, dff=8, eps=1e-5, biases=True)
    X = _X(1)
    r = stack_local(spec, X, [1e-5])[0]
    assert r.drift <= 3.2 and r.parts["(layer route)"] <= 4.6 and r.parts["(middle products)"] <= 4.1
    lo = adversary(lambda Z: transformer_forward(spec, Z, with_head=False), X, 1e-5, restarts=1, steps=10, seed=1)
    assert lo <= r.upper
