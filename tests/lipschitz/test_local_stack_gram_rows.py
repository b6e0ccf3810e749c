"""THEORY F93: the stack's prefix rows by the weighted row Gram at the primal ascent's weights (``gram_rows``).

A row's (2,inf) norm ``nu_i = sup_{||h_j|| <= 1} ||sum_j B_ij h_j||``.  For rank-one blocks ``a_j b_j^T`` it is
``max_s ||sum_j s_j ||b_j|| a_j||`` over signs, so brute force over the ``2^T`` sign vectors gives it exactly: the rows
are never below it and, with the block norms as the second candidate's weights, never above the triangle
``sum_j ||B_ij||``; where one direction carries each row the primal's weights make them exact.  For general blocks an
independent projected float64 Adam over unit ``h_j`` never beats them.  Homogeneity, the blocks' order, zero blocks and rows, and the float64 extremes.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from transcover.lipschitz._local_stack import certified_block_norms, rows_of_block_norms
from transcover.lipschitz._local_stack_aligned import gram_rows

U = 2.0**-53


def _rank_one(T: int, m: int, k: int, g: torch.Generator, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (T, T, m, k) ``a_ij b_ij^T`` and the exact rows by brute force over signs."""
    a = torch.randn(T, T, m, generator=g, dtype=torch.float64) * torch.exp(spread * torch.randn(T, T, 1, generator=g,
                                                                                               dtype=torch.float64))
    b = torch.randn(T, T, k, generator=g, dtype=torch.float64)
    blocks = a[..., :, None] * b[..., None, :]
    S = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=T)), dtype=torch.float64)  # (2^T, T)
    cols = a * b.norm(dim=-1, keepdim=True)  # (T, T, m): ||b_ij|| a_ij
    exact = torch.stack([(S @ cols[i]).norm(dim=1).max() for i in range(T)])
    return blocks, exact


def _tol(blocks: torch.Tensor) -> float:
    """Relative room for the float64 sums compared (``T m k`` unit roundoffs, ten times) plus certified_lmax's 1e-9."""
    return 10 * blocks.shape[1] * blocks.shape[2] * blocks.shape[3] * U + 1e-9


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(1, 7), m=hs.integers(1, 6), k=hs.integers(1, 4),
       spread=hs.sampled_from([0.0, 1.0, 3.0]), scale=hs.sampled_from([1e-60, 1.0, 1e60]))
def test_rows_bound_the_exact_rank_one_rows_and_never_pass_the_triangle(seed, T, m, k, spread, scale):
    g = torch.Generator().manual_seed(seed)
    blocks, exact = _rank_one(T, m, k, g, spread)
    blocks, exact = blocks * scale, exact * scale
    N = certified_block_norms(blocks)
    rows = gram_rows(blocks, N)
    tol = _tol(blocks)
    assert torch.all(rows >= exact * (1 - tol))
    assert torch.all(rows <= rows_of_block_norms(N) * (1 + tol))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(1, 7), m=hs.integers(2, 6), noise=hs.sampled_from([0.0, 0.01, 0.05]))
def test_rows_are_exact_where_one_direction_carries_the_row(seed, T, m, noise):
    """Rank-one blocks ``a_ij b_ij^T`` with ``a_ij = alpha_ij u_i + noise``: the row's optimum is one direction and the
    primal weights meet it (the triangle does not: it pays ``||a_ij||`` for every key)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(T, 1, m, generator=g, dtype=torch.float64)
    a = torch.randn(T, T, 1, generator=g, dtype=torch.float64) * u + noise * torch.randn(T, T, m, generator=g,
                                                                                         dtype=torch.float64)
    b = torch.randn(T, T, 3, generator=g, dtype=torch.float64)
    blocks = a[..., :, None] * b[..., None, :]
    S = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=T)), dtype=torch.float64)
    cols = a * b.norm(dim=-1, keepdim=True)
    exact = torch.stack([(S @ cols[i]).norm(dim=1).max() for i in range(T)])
    rows = gram_rows(blocks)
    tol = _tol(blocks)
    assert torch.all(rows >= exact * (1 - tol))
    assert torch.all(rows <= exact * (1 + 2e-9 + tol))


def test_float64_extremes_stay_sound():
    """Blocks near float64's range: the rows are never below the exact ones (an overflow gives inf, never less)."""
    g = torch.Generator().manual_seed(4)
    blocks, exact = _rank_one(4, 3, 2, g, 1.0)
    for scale in (1e-150, 1e150, 2.0**-600, 1e-300, 1e300):
        rows = gram_rows(blocks * scale, certified_block_norms(blocks * scale))
        assert torch.all(rows >= exact * scale * (1 - _tol(blocks)))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(2, 6), d=hs.integers(2, 6))
def test_rows_are_never_beaten_by_an_ascent(seed, T, d):
    """Projected float64 Adam over unit ``h_j`` (3 starts x 150 steps) of ``||sum_j B_ij h_j||`` per row."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(T, T, d, d, generator=g, dtype=torch.float64)
    blocks[:, 0] *= 20  # one key dominating, as the residual's own token does in a prefix
    rows = gram_rows(blocks)
    for i in range(T):
        best = 0.0
        for _ in range(3):
            H = torch.randn(T, d, generator=g, dtype=torch.float64).requires_grad_(True)
            opt = torch.optim.Adam([H], lr=0.05)
            for _ in range(150):
                val = (blocks[i] @ (H / H.norm(dim=1, keepdim=True))[:, :, None]).sum(0).norm()
                best = max(best, float(val.detach()))
                opt.zero_grad()
                (-val).backward()
                opt.step()
        assert best <= float(rows[i]) * (1 + _tol(blocks))
        assert best >= 0.5 * float(rows[i])


def test_rows_scale_with_the_blocks_and_ignore_the_order():
    """A power of two scales the rows exactly (the float32 ascent runs on the blocks scaled by one, so it takes the same
    steps); a factor 3 or the input tokens' order change its rounding, so its stop (a rise <= 1e-6 relative) may fall a
    step apart: the rows then agree within that."""
    g = torch.Generator().manual_seed(5)
    blocks = torch.randn(4, 4, 5, 3, generator=g, dtype=torch.float64)
    r0 = gram_rows(blocks)
    for k in (-600, -3, 5, 700):
        assert torch.equal(gram_rows(torch.ldexp(blocks, torch.tensor(float(k)))), torch.ldexp(r0, torch.tensor(float(k))))
    assert torch.allclose(gram_rows(3 * blocks), 3 * r0, rtol=1e-6, atol=0)
    assert torch.allclose(gram_rows(blocks.flip(1)), r0, rtol=1e-6, atol=0)


def test_zero_rows_and_blocks():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randn(3, 3, 4, 4, generator=g, dtype=torch.float64)
    blocks[1] = 0
    blocks[2, 1] = 0
    rows = gram_rows(blocks)
    assert float(rows[1]) == 0.0
    assert torch.isfinite(rows).all() and torch.all(rows[[0, 2]] > 0)


def test_one_block_per_row_is_its_spectral_norm():
    """A block-diagonal matrix (a token-local stage): the row is ``||B_ii||_2`` (float64 SVD), up to the pads."""
    g = torch.Generator().manual_seed(2)
    blocks = torch.zeros(3, 3, 6, 6, dtype=torch.float64)
    for i in range(3):
        blocks[i, i] = torch.randn(6, 6, generator=g, dtype=torch.float64)
    ref = torch.linalg.matrix_norm(blocks[torch.arange(3), torch.arange(3)], ord=2)
    rows = gram_rows(blocks)
    assert torch.all(rows >= ref) and torch.all(rows <= ref * (1 + 1e-8))
