"""Nets, packings, exact covering numbers and the q-metrics, against closed forms and naive code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover import InputError
from transcover.empirical import (
    IncrementalNet,
    distance_matrix,
    estimate_covering_number,
    exact_covering_number,
    greedy_net,
    maximal_packing,
    sample_distance,
)

QS = (1.0, 2.0, math.inf)


def naive_distance(f: np.ndarray, g: np.ndarray, q: float) -> float:
    """max_i ||f_i - g_i||_q with plain Python loops (float64)."""
    worst = 0.0
    for i in range(f.shape[0]):
        diffs = [abs(float(f[i, j]) - float(g[i, j])) for j in range(f.shape[1])]
        if q == math.inf:
            v = max(diffs)
        elif q == 1.0:
            v = sum(diffs)
        else:
            v = math.sqrt(sum(d * d for d in diffs))
        worst = max(worst, v)
    return worst


def naive_greedy(Y: np.ndarray, r: float, q: float) -> list[int]:
    """All pairwise distances first, then the sequential greedy: the straightforward algorithm."""
    M = Y.shape[0]
    D = np.array([[naive_distance(Y[i], Y[j], q) for j in range(M)] for i in range(M)])
    covered = np.zeros(M, dtype=bool)
    centres = []
    for i in range(M):
        if not covered[i]:
            centres.append(i)
            covered |= D[i] <= r
    return centres


@pytest.mark.parametrize("q", QS)
@pytest.mark.parametrize("n,b", [(1, 1), (5, 1), (4, 3), (7, 2)])
def test_metric_matches_naive(q, n, b):
    gen = torch.Generator().manual_seed(17)
    A = torch.randn(6, n, b, generator=gen, dtype=torch.float64)
    B = torch.randn(5, n, b, generator=gen, dtype=torch.float64)
    D = distance_matrix(A, B, q)
    ref = np.array([[naive_distance(A[i].numpy(), B[j].numpy(), q) for j in range(5)] for i in range(6)])
    tol = 10 * n * b * torch.finfo(torch.float64).eps * float(ref.max())
    np.testing.assert_allclose(D.numpy(), ref, rtol=0, atol=tol)
    assert sample_distance(A[0], B[0], q) == pytest.approx(ref[0, 0], rel=0, abs=tol)


@pytest.mark.parametrize("q", QS)
def test_metric_blocks_agree(q):
    """Tiny block budgets (many blocks) give the same matrix as one block."""
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(9, 6, 3, generator=gen)
    B = torch.randn(11, 6, 3, generator=gen)
    assert torch.equal(distance_matrix(A, B, q), distance_matrix(A, B, q, block_elements=7))


def grid_internal(k: int, h: float, eps: float) -> int:
    """Centres on grid points cover floor(eps/h) neighbours on each side."""
    return math.ceil(k / (2 * math.floor(eps / h) + 1))


def grid_external(k: int, h: float, eps: float) -> int:
    """A free interval of length 2 eps holds floor(2 eps / h) + 1 grid points."""
    return math.ceil(k / (math.floor(2 * eps / h) + 1))


@pytest.mark.parametrize("k", [1, 7, 12])
@pytest.mark.parametrize("eps", [0.25, 0.5, 0.75, 1.0, 1.25, 2.0, 3.5])
def test_1d_grid_closed_forms(k, eps):
    h = 0.5  # exact in binary: every distance and comparison below is exact
    Y = (torch.arange(k, dtype=torch.float64) * h)[:, None]
    n_int = exact_covering_number(Y, eps, centres="internal")
    n_ext = exact_covering_number(Y, eps, centres="external")
    assert n_int == grid_internal(k, h, eps)
    assert n_ext == grid_external(k, h, eps)
    est = estimate_covering_number(Y, eps, n_orders=3, seed=1)
    assert est.packing_size <= n_ext <= n_int <= est.net_size
    # factor 2: centres from the set at eps need no more than free centres at eps / 2
    assert n_int <= exact_covering_number(Y, eps / 2, centres="external")


@pytest.mark.parametrize("layout", ["one_sample_two_outputs", "two_samples_scalar"])
@pytest.mark.parametrize("eps", [0.5, 1.0, 1.5])
def test_2d_grid_linf_product_formula(layout, eps):
    """Under l_inf a k1 x k2 grid needs prod ceil(k_j / m) balls (product packing attains it)."""
    k1, k2, h = 4, 3, 1.0
    pts = torch.tensor([[i * h, j * h] for i in range(k1) for j in range(k2)], dtype=torch.float64)
    Y = pts[:, None, :] if layout == "one_sample_two_outputs" else pts[:, :, None]
    m_ext = math.floor(2 * eps / h) + 1
    m_int = 2 * math.floor(eps / h) + 1
    n_ext = exact_covering_number(Y, eps, math.inf, centres="external")
    n_int = exact_covering_number(Y, eps, math.inf, centres="internal")
    assert n_ext == math.ceil(k1 / m_ext) * math.ceil(k2 / m_ext)
    assert n_int == math.ceil(k1 / m_int) * math.ceil(k2 / m_int)
    est = estimate_covering_number(Y, eps, math.inf, n_orders=4)
    assert est.packing_size <= n_ext <= n_int <= est.net_size


small_sets = st.integers(min_value=1, max_value=10).flatmap(
    lambda M: st.tuples(
        st.lists(st.lists(st.lists(st.integers(-4, 4), min_size=2, max_size=2), min_size=2, max_size=2),
                 min_size=M, max_size=M),
        st.sampled_from(QS),
        st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),
    ))


@settings(max_examples=60, deadline=None)
@given(small_sets)
def test_exact_between_estimates(data):
    """packing <= N_ext <= N_int <= net on random small integer sets (exact arithmetic)."""
    pts, q, eps = data
    Y = torch.tensor(pts, dtype=torch.float64)  # (M, n=2, b=2)
    est = estimate_covering_number(Y, eps, q)
    n_int = exact_covering_number(Y, eps, q)
    assert est.packing_size <= n_int <= est.net_size
    if q == math.inf:
        n_ext = exact_covering_number(Y, eps, q, centres="external")
        assert est.packing_size <= n_ext <= n_int
        assert n_int <= exact_covering_number(Y, eps / 2, q, centres="external")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 120), st.integers(1, 4), st.integers(1, 3), st.sampled_from(QS),
       st.floats(0.05, 3.0), st.integers(0, 10_000), st.integers(1, 50))
def test_packing_never_exceeds_net(M, n, b, q, eps, seed, chunk):
    gen = torch.Generator().manual_seed(seed)
    Y = torch.randn(M, n, b, generator=gen)
    order = torch.randperm(M, generator=gen)
    net = greedy_net(Y, eps, q, chunk_size=chunk)
    pack = maximal_packing(Y, eps, q, order=order, chunk_size=chunk)
    assert len(pack) <= len(net)
    # the net covers, its centres are eps-separated; the packing is strictly 2eps-separated
    # (checked in float64: a float32 comparison would cast eps to float32; exact checks live in
    # test_empirical_exact_decisions.py)
    Y = Y.double()
    D_cover = distance_matrix(Y, Y[torch.as_tensor(net)], q)
    assert bool((D_cover.min(dim=1).values <= eps).all())
    D_net = distance_matrix(Y[torch.as_tensor(net)], Y[torch.as_tensor(net)], q)
    assert bool((D_net + torch.eye(len(net)) * 1e9 > eps).all())
    D_pack = distance_matrix(Y[torch.as_tensor(pack)], Y[torch.as_tensor(pack)], q)
    assert bool((D_pack + torch.eye(len(pack)) * 1e9 > 2 * eps).all())


@pytest.mark.parametrize("q", QS)
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_greedy_equals_naive(q, chunk):
    gen = torch.Generator().manual_seed(5)
    Y = torch.randn(60, 3, 2, generator=gen, dtype=torch.float64)
    for eps in (0.8, 2.0):
        assert greedy_net(Y, eps, q, chunk_size=chunk).tolist() == naive_greedy(Y.numpy(), eps, q)


def test_incremental_net_streams_and_prefixes():
    gen = torch.Generator().manual_seed(9)
    Y = torch.randn(300, 4, 1, generator=gen)
    whole = IncrementalNet(1.0, 2.0, chunk_size=32)
    whole.add(Y)
    parts = IncrementalNet(1.0, 2.0, chunk_size=7)
    for s in range(0, 300, 41):
        parts.add(Y[s:s + 41])
    assert whole.indices.tolist() == parts.indices.tolist()
    assert whole.size_after([10, 100, 300]) == [len(greedy_net(Y[:m], 1.0, 2.0)) for m in (10, 100, 300)]
    assert torch.equal(whole.centres, Y[torch.as_tensor(whole.indices)])


def test_packing_strictness_on_boundary():
    """Points exactly 2 eps apart are *not* a packing: one free ball (centre eps) covers both."""
    Y = torch.tensor([[0.0], [2.0]], dtype=torch.float64)
    assert len(maximal_packing(Y, 1.0)) == 1
    assert exact_covering_number(Y, 1.0, centres="external") == 1
    assert exact_covering_number(Y, 1.0, centres="internal") == 2  # centres from the set: 0 and 2
    assert len(maximal_packing(Y, 0.999)) == 2


@pytest.mark.parametrize("bad,match", [
    (dict(eps=0.0), "eps must be"), (dict(eps=-1.0), "eps must be"), (dict(eps=float("nan")), "eps must be"),
    (dict(q=3), "q must be 1, 2 or inf"), (dict(n_orders=0), "n_orders"),
])
def test_bad_arguments(bad, match):
    kwargs = dict(eps=1.0, q=math.inf)
    kwargs.update(bad)
    with pytest.raises(InputError, match=match):
        estimate_covering_number(torch.zeros(3, 2), **kwargs)


@pytest.mark.parametrize("Y,match", [
    (torch.zeros(3), "must have shape"), (torch.zeros(2, 2, 2, 2), "must have shape"),
    (torch.zeros(0, 2, 1), "empty axis"), (torch.tensor([[float("nan")]]), "NaN"),
])
def test_bad_outputs(Y, match):
    with pytest.raises(InputError, match=match):
        estimate_covering_number(Y, 1.0)


def test_exact_refuses_what_it_cannot_do():
    with pytest.raises(InputError, match="q=inf or scalar"):
        exact_covering_number(torch.zeros(3, 2, 2), 1.0, 2.0, centres="external")
    with pytest.raises(InputError, match="limited to"):
        exact_covering_number(torch.zeros(17, 1), 1.0, centres="external")
    with pytest.raises(InputError, match="centres must be"):
        exact_covering_number(torch.zeros(3, 1), 1.0, centres="free")


@pytest.mark.parametrize("order", [[0, 0, 0], [2, 2, 1], [0.5, 1, 2], [0, 1, 5], [-1, 0, 1], [True, False, True]])
def test_an_order_that_is_not_a_permutation_is_refused(order):
    """Red team 162: only the length was checked, so ``order=[0, 0, 0]`` gave a "net" covering one point of three,
    ``[0.5, 1, 2]`` was truncated and ``[0, 1, 5]`` was an IndexError."""
    Y = torch.tensor([[0.0], [10.0], [20.0]])
    for f in (greedy_net, maximal_packing):
        with pytest.raises(InputError, match="must be a permutation of the 3 indices") as e:
            f(Y, 1.0, order=order)
        assert "\n" not in str(e.value)
    assert sorted(greedy_net(Y, 1.0, order=[2, 0, 1]).tolist()) == [0, 1, 2]
