"""Issue 14, item 5: the blocked greedy (Gram-matrix filter + nearest-first exact checks).

The blocked greedy must return the same centres as the sequential greedy, whose decisions are
taken one pair at a time by ``_predicates.within`` (exact, tested against rational arithmetic in
test_empirical_exact_decisions.py), and the filter may only ever drop pairs that are truly farther
than the radius: checked here against ``Fraction`` arithmetic, on cancellation-heavy data.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover.empirical import IncrementalNet, as_outputs, greedy_net, maximal_packing
from transcover.empirical._predicates import within, within_rows

QS = (1.0, 2.0, math.inf)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def sequential_greedy(Y: torch.Tensor, r: float, q: float) -> list[int]:
    """One point at a time, each compared with every earlier centre by the exact ``within``."""
    centres: list[int] = []
    for j in range(Y.shape[0]):
        if not centres or not bool(within(Y[j:j + 1], Y[torch.as_tensor(centres)], q, r).any()):
            centres.append(j)
    return centres


def exact_dist_sq_or_d(x: torch.Tensor, y: torch.Tensor, q: float) -> Fraction:
    """``d_q`` exactly (its square for per-sample q = 2)."""
    worst = Fraction(0)
    for fi, gi in zip(x.double().tolist(), y.double().tolist()):
        d = [abs(Fraction(a) - Fraction(b)) for a, b in zip(fi, gi)]
        v = max(d) if (q == math.inf or len(d) == 1) else (sum(d) if q == 1.0 else sum(t * t for t in d))
        worst = max(worst, v)
    return worst


def exact_le(x, y, q: float, r: float) -> bool:
    R = Fraction(r)
    return exact_dist_sq_or_d(x, y, q) <= (R * R if (q == 2.0 and x.shape[-1] > 1) else R)


@st.composite
def clustered(draw):
    """Clusters with a large common offset (cancellation in |x|^2 + |y|^2 - 2xy), radius near a distance."""
    dtype = draw(st.sampled_from(DTYPES))
    q = draw(st.sampled_from(QS))
    M, n, b = draw(st.integers(2, 90)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    offset = draw(st.sampled_from([0.0, 1.0, 300.0]))
    gen = torch.Generator().manual_seed(seed)
    k = draw(st.integers(1, 6))
    centres = torch.randn(k, n, b, generator=gen, dtype=torch.float64)
    spread = draw(st.sampled_from([1e-3, 0.1, 0.5]))
    pick = torch.randint(0, k, (M,), generator=gen)
    Y = (offset + centres[pick] + spread * torch.randn(M, n, b, generator=gen, dtype=torch.float64)).to(dtype)
    if draw(st.booleans()):  # duplicates: exact ties at distance 0
        Y[M // 2:] = Y[: M - M // 2].clone()
    Yw = as_outputs(Y)
    i, j = draw(st.integers(0, M - 1)), draw(st.integers(0, M - 1))
    d = float(torch.as_tensor(exact_dist_sq_or_d(Yw[i], Yw[j], q).__float__()))
    r = math.sqrt(d) if (q == 2.0 and b > 1) else d
    r = draw(st.sampled_from([r, math.nextafter(r, 0.0), math.nextafter(r, math.inf), 3 * spread, spread]))
    return Y, q, r if r > 0 else spread


@settings(max_examples=60, deadline=None)
@given(clustered(), st.sampled_from([1, 5, 32, 2048]))
def test_blocked_greedy_equals_sequential(data, chunk):
    Y, q, r = data
    Yw = as_outputs(Y)
    assert greedy_net(Y, r, q, chunk_size=chunk).tolist() == sequential_greedy(Yw, r, q)
    if r / 2 > 0 and (r / 2) * 2 == r:  # the packing's radius 2 (r/2) is then r itself
        assert maximal_packing(Y, r / 2, q, chunk_size=chunk).tolist() == sequential_greedy(Yw, r, q)


@settings(max_examples=60, deadline=None)
@given(clustered())
def test_gram_filter_only_drops_far_pairs(data):
    """Every pair whose filter value exceeds T is exactly farther than r (rational check)."""
    Y, q, r = data
    Yw = as_outputs(Y)
    net = IncrementalNet(r, q)
    filt = net._filter(Yw)
    assert filt is not None
    F = Yw.reshape(Yw.shape[0], -1)
    s = net._scale(F, filt)
    S = net._gram(s, F, s, F)
    far = (S > filt[1]).numpy()
    for i, j in zip(*np.nonzero(far)):
        assert not exact_le(Yw[i], Yw[j], q, r)


@pytest.mark.parametrize("q", QS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_cancellation_heavy_data_is_still_exact(q, dtype):
    """A huge offset makes |x|^2 + |y|^2 - 2xy useless (the filter must then drop nothing wrongly)."""
    gen = torch.Generator().manual_seed(1)
    base = 1e4 if dtype != torch.float16 else 1e3
    Y = (base + 0.05 * torch.randint(0, 4, (150, 3, 2), generator=gen).double()).to(dtype)
    Yw = as_outputs(Y)
    for r in (0.05, 0.1, 0.0999999):
        assert greedy_net(Y, r, q, chunk_size=16).tolist() == sequential_greedy(Yw, r, q)


def test_huge_norms_are_never_pruned():
    """Squares of 1e19 overflow float32: such rows get NaN filter values and are checked exactly."""
    Y = torch.tensor([[[0.0, 0.0]], [[3e19, 3e19]], [[3e19, 3.1e19]], [[1.0, 0.0]]], dtype=torch.float32)
    for q in QS:
        for r in (0.5, 1.0, 2e18, 1e30):
            assert greedy_net(Y, r, q, chunk_size=2).tolist() == sequential_greedy(Y, r, q)
            assert greedy_net(Y, r, q).tolist() == sequential_greedy(Y, r, q)


@settings(max_examples=60, deadline=None)
@given(clustered())
def test_within_rows_is_exact(data):
    Y, q, r = data
    Yw = as_outputs(Y)
    perm = torch.randperm(Yw.shape[0], generator=torch.Generator().manual_seed(0))
    got = within_rows(Yw, Yw[perm], q, r)
    ref = [exact_le(Yw[i], Yw[perm[i]], q, r) for i in range(Yw.shape[0])]
    assert got.tolist() == ref


def test_many_centres_many_blocks():
    """More centres than one centre block (small block_elements): the per-block checks still agree."""
    gen = torch.Generator().manual_seed(4)
    Y = torch.rand(600, 4, 2, generator=gen)
    for q in QS:
        net = IncrementalNet(0.3, q, chunk_size=64, block_elements=64 * 40)
        net.add(Y)
        assert net.indices.tolist() == sequential_greedy(Y, 0.3, q)
        assert net.size > 40


def test_reduced_precision_matmul_turns_the_filter_off():
    """With bf16/tf32 float32 products allowed, the Gram filter's bound is void: it must not run."""
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        net = IncrementalNet(0.5, math.inf)
        assert net._filter(torch.zeros(3, 2, 1)) is None
        Y = torch.rand(200, 3, 2, generator=torch.Generator().manual_seed(2))
        assert greedy_net(Y, 0.3, 2.0).tolist() == sequential_greedy(Y, 0.3, 2.0)
    finally:
        torch.set_float32_matmul_precision(old)
    assert IncrementalNet(0.5, math.inf)._filter(torch.zeros(3, 2, 1)) is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_sketch_guess_path_equals_sequential(dtype, monkeypatch):
    """Blocks of >= 64 centres first try the sketch-nearest centre (checked exactly), then the filter."""
    calls = []
    original = IncrementalNet._guess

    def counting(self, *args):
        ok = original(self, *args)
        calls.append((int(ok.sum()), ok.numel()))
        return ok

    monkeypatch.setattr(IncrementalNet, "_guess", counting)
    gen = torch.Generator().manual_seed(8)
    Y = torch.rand(700, 3, 2, generator=gen).to(dtype)
    Yw = as_outputs(Y)
    for q in QS:
        for r in (0.2, 0.25):
            net = IncrementalNet(r, q, chunk_size=64, block_elements=64 * 100)
            net.add(Y)
            assert net.indices.tolist() == sequential_greedy(Yw, r, q)
    assert sum(c[0] for c in calls) > 0 and any(c[0] < c[1] for c in calls)  # settled some, not all
