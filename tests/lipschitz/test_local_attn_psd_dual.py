"""THEORY F92: the SDP dual of F82 (c) / F84 (c) (``_sdp_dual``) with the primal ascent's weights.

For rank-one blocks ``m_k m_k^T`` the sup of ``||sum_k m_k v_k||^2`` over unit ``v_k`` is over signs, so brute force
over all ``2^K`` sign vectors gives it exactly: the dual is never below it, and never above ``pi/2`` times it (Nesterov's
bound on the SDP relaxation of a PSD form over signs; the computed dual is at least the relaxation's value, so a larger
ratio would be the optimiser's, not the relaxation's).  Where one direction carries the optimum the relaxation is exact and
so must the dual be, to rounding.  With vector variables a projected float64 Adam over the unit ``v_k`` (an ascent of its
own, not the library's) gives lower estimates the dual never beats.
"""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from transcover.lipschitz._local_attn_psd import _primal_weights, _sdp_dual

U = 2.0**-53


def _blocks(M: torch.Tensor) -> torch.Tensor:
    """(K, r, r) ``M_k M_k^T`` for M (K, r, dk)."""
    return M @ M.transpose(1, 2)


def _brute(m: torch.Tensor) -> float:
    """``max_s ||sum_k s_k m_k||^2`` over all sign vectors (m: (K, r))."""
    S = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=m.shape[0])), dtype=torch.float64)
    return float(((S @ m) ** 2).sum(1).max())


def _dual(blocks: torch.Tensor) -> float:
    return _sdp_dual(blocks, torch.zeros(blocks.shape[0], dtype=torch.float64), 20)


def _tol(blocks: torch.Tensor) -> float:
    """Relative rounding room of the float64 sums compared: ``r K`` unit roundoffs, padded ten times."""
    return 10 * blocks.shape[1] * blocks.shape[0] * U


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), K=hs.integers(2, 10), r=hs.integers(1, 8), spread=hs.sampled_from([0.0, 1.0, 3.0]),
       scale=hs.sampled_from([1e-12, 1.0, 1e12]))
def test_dual_is_never_below_the_signs_and_within_nesterov(seed, K, r, spread, scale):
    """Rank-one blocks with norms spread over ``e^{+-3 spread}``: brute force <= dual <= (pi/2) brute force."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(K, r, generator=g, dtype=torch.float64) * torch.exp(spread * torch.randn(K, 1, generator=g,
                                                                                               dtype=torch.float64))
    m = m * scale
    blocks = _blocks(m[:, :, None])
    exact, dual = _brute(m), _dual(blocks)
    assert dual >= exact * (1 - _tol(blocks))
    assert dual <= math.pi / 2 * exact * (1 + _tol(blocks))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), K=hs.integers(2, 10), r=hs.integers(2, 8), noise=hs.sampled_from([0.0, 0.01, 0.05]))
def test_dual_is_exact_where_one_direction_carries_the_optimum(seed, K, r, noise):
    """``m_k = a_k u + noise``: the optimum's signs follow ``a_k`` and the relaxation is exact; so is the dual with the
    primal's weights (the damped steps alone stalled up to 1.45x above it on MiniLM's first attention, THEORY F92), up to
    ``certified_lmax``'s own pad (``1e-9`` relative plus the residual) and the sums' rounding."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(r, generator=g, dtype=torch.float64)
    a = torch.randn(K, generator=g, dtype=torch.float64) * 3
    m = a[:, None] * u[None] + noise * torch.randn(K, r, generator=g, dtype=torch.float64)
    blocks = _blocks(m[:, :, None])
    exact, dual = _brute(m), _dual(blocks)
    assert exact * (1 - _tol(blocks)) <= dual <= exact * (1 + 2e-9 + _tol(blocks))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), K=hs.integers(2, 8), dk=hs.integers(2, 5), r=hs.integers(2, 10))
def test_dual_is_never_beaten_with_vector_variables(seed, K, dk, r):
    """Projected float64 Adam over unit ``v_k`` (4 starts x 200 steps) of ``||sum_k M_k v_k||^2`` never exceeds the dual,
    and reaches at least ``2/pi`` of it."""
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(K, r, dk, generator=g, dtype=torch.float64) * torch.exp(torch.randn(K, 1, 1, generator=g,
                                                                                       dtype=torch.float64))
    blocks = _blocks(M)
    dual = _dual(blocks)
    best = 0.0
    for _ in range(4):
        V = torch.randn(K, dk, generator=g, dtype=torch.float64).requires_grad_(True)
        opt = torch.optim.Adam([V], lr=0.05)
        for _ in range(200):
            val = (M @ (V / V.norm(dim=1, keepdim=True))[:, :, None]).sum(0).pow(2).sum()
            best = max(best, float(val.detach()))
            opt.zero_grad()
            (-val).backward()
            opt.step()
    assert best <= dual * (1 + _tol(blocks))
    assert best >= 2 / math.pi * dual


def test_dual_scales_with_the_blocks_and_ignores_their_order():
    """Blocks x 4 -> dual x 4; the blocks reversed -> the same dual (up to the sums' rounding)."""
    g = torch.Generator().manual_seed(3)
    blocks = _blocks(torch.randn(9, 6, 3, generator=g, dtype=torch.float64))
    d0 = _dual(blocks)
    assert math.isclose(_dual(4 * blocks), 4 * d0, rel_tol=1e-9)
    assert math.isclose(_dual(blocks.flip(0)), d0, rel_tol=1e-9)


def test_primal_weights_are_the_block_norms_at_a_top_direction():
    """On blocks with a common top direction ``u`` the weights are ``||M_k^T u||`` (up to scale) and positive where a
    block is zero there (the floor)."""
    u = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    m = torch.tensor([[2.0, 0.1, 0.0], [-1.0, 0.0, 0.1], [0.0, 0.0, 1e-3]], dtype=torch.float64)
    c = _primal_weights(_blocks(m[:, :, None]), None, 50)
    assert torch.all(c > 0)
    ref = (m @ u).abs()
    assert torch.allclose(c[:2] / c[0], ref[:2] / ref[0], rtol=1e-2)


def test_dual_is_exact_where_the_damped_steps_stalled():
    """The Gram of the seven largest rank-one parts of one query's blocks at MiniLM's first attention (sentence 14,
    rho = 1e-4, rounded to 3 digits; the blocks are ``m_k m_k^T`` with ``m_k`` the rows of its Cholesky factor): the damped
    steps alone stop 1.25x above the brute-force sup; with the primal's weights the dual meets it (THEORY F92)."""
    G = torch.tensor([[0.686, -0.018, 0.008, 0.011, -0.007, -0.004, 0.208],
                      [-0.018, 0.423, -0.006, -0.013, 0.006, 0.002, -0.080],
                      [0.008, -0.006, 0.139, -0.004, 0.003, -0.001, -0.030],
                      [0.011, -0.013, -0.004, 0.187, 0.003, 0.0, -0.041],
                      [-0.007, 0.006, 0.003, 0.003, 0.100, 0.0, 0.022],
                      [-0.004, 0.002, -0.001, 0.0, 0.0, 1.000, 0.017],
                      [0.208, -0.080, -0.030, -0.041, 0.022, 0.017, 0.748]], dtype=torch.float64)
    m = torch.linalg.cholesky(G)
    blocks = _blocks(m[:, :, None])
    exact, dual = _brute(m), _dual(blocks)
    assert exact * (1 - _tol(blocks)) <= dual <= exact * (1 + 2e-9 + _tol(blocks))
