"""THEORY F95: the move's rest carried through a product by its unit rows as well as its blocks (``carried_rows``).

``nu_i(R) = sup_{||h_k|| <= R_k} ||sum_k B_ik h_k||`` is monotone, subadditive and positively homogeneous in the
per-token radii ``R``, so ``nu_i(R) <= t nu_i(1) + sum_k N_ik (R_k - t)_+`` for every ``t >= 0``.  Checked against
independent values of ``nu_i(R)``: exact for scalar blocks (``sum_k |B_ik| R_k``) and rank-one blocks (brute force over
signs), a dense grid over the circle for two-row blocks, and a projected float64 Adam over the balls for general
blocks, which never beats the bound; the bound never passes the triangle ``N @ R`` and meets ``max R nu_i(1)`` at
equal radii; exact power-of-two homogeneity; the rounding of ``(R - t)_+`` checked in exact rationals; an infinite
``nu`` gives the triangle, not nan.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

import transcover.lipschitz._local_stack as ls
from test_local_move26 import CASES, _case
from test_local_stack15 import assert_network_below
from transcover.lipschitz._local_stack import certified_block_norms
from transcover.lipschitz._local_stack_aligned import block_norms_and_rows, gram_rows
from transcover.lipschitz._local_stack_move import carried_rows, layer_rest_rows, radii_over

U = 2.0**-53


def _radii(T: int, g: torch.Generator, spread: float) -> torch.Tensor:
    return torch.exp(spread * torch.randn(T, generator=g, dtype=torch.float64))


def _bound(blocks: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    return carried_rows(certified_block_norms(blocks), gram_rows(blocks), R)


def _tol(blocks: torch.Tensor) -> float:
    """Relative room for the reference's own float64 sums (``T m k`` unit roundoffs, ten times)."""
    return 10 * blocks.shape[1] * blocks.shape[2] * blocks.shape[3] * U


def _adam(B: torch.Tensor, R: torch.Tensor, g: torch.Generator, steps: int = 200, starts: int = 3) -> list:
    """Per row i, a lower estimate of ``nu_i(R)`` for its blocks ``B[i]`` (B: rows, T, m, k): projected float64 Adam on
    ``||sum_k B_ik h_k||`` over ``||h_k|| <= R_k``, from the top singular directions and random starts (independent of
    ``gram_rows``).  Every (row, start) ascent in one batch: the same starts as one row after another (row i's random
    starts drawn from ``g`` after row i - 1's), the same steps and learning rate; Adam is entrywise and each ascent's
    loss depends on its own ``h`` alone, so the summed loss gives each the gradient and update it has alone."""
    n, T, m, k = B.shape
    h0 = []
    for i in range(n):
        h0.append(torch.linalg.svd(B[i], full_matrices=False).Vh[:, 0, :])
        h0 += [torch.randn(T, k, generator=g, dtype=torch.float64) for _ in range(starts - 1)]
    h0 = torch.stack(h0).reshape(n, starts, T, k)
    h = (h0 / h0.norm(dim=-1, keepdim=True).clamp(min=1e-300) * R[:, None]).clone().requires_grad_(True)
    opt = torch.optim.Adam([h], lr=0.05 * float(R.max()))
    for _ in range(steps):
        opt.zero_grad()
        loss = -torch.einsum("ntmk,nstk->nsm", B, h).norm(dim=-1).sum()
        loss.backward()
        opt.step()
        with torch.no_grad():
            h.mul_((R / h.norm(dim=-1).clamp(min=1e-300)).clamp(max=1.0)[..., None])
    with torch.no_grad():
        return torch.einsum("ntmk,nstk->nsm", B, h).norm(dim=-1).amax(dim=1).clamp(min=0.0).tolist()


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(1, 7), spread=hs.sampled_from([0.0, 0.5, 2.0]))
def test_scalar_blocks_meet_the_exact_value(seed, T, spread):
    """1 x 1 blocks: ``nu_i(R) = sum_k |B_ik| R_k`` exactly, and so is the triangle; the bound is within rounding of it."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(T, T, 1, 1, generator=g, dtype=torch.float64)
    R = _radii(T, g, spread)
    exact = blocks[..., 0, 0].abs() @ R
    got = _bound(blocks, R)
    tol = _tol(blocks) + 1e-9
    assert torch.all(got >= exact * (1 - tol))
    assert torch.all(got <= exact * (1 + tol))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(1, 7), m=hs.integers(1, 5), k=hs.integers(1, 4),
       spread=hs.sampled_from([0.0, 1.0, 3.0]))
def test_rank_one_blocks_never_exceed_the_bound(seed, T, m, k, spread):
    """Rank-one blocks ``a_ik b_ik^T``: ``nu_i(R) = max_s ||sum_k s_k R_k ||b_ik|| a_ik||`` over signs (brute force)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(T, T, m, generator=g, dtype=torch.float64)
    b = torch.randn(T, T, k, generator=g, dtype=torch.float64)
    blocks = a[..., :, None] * b[..., None, :]
    R = _radii(T, g, spread)
    S = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=T)), dtype=torch.float64)
    cols = a * (b.norm(dim=-1) * R)[..., None]
    exact = torch.stack([(S @ cols[i]).norm(dim=1).max() for i in range(T)])
    got = _bound(blocks, R)
    assert torch.all(got >= exact * (1 - _tol(blocks)))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(1, 6), k=hs.integers(1, 4), spread=hs.sampled_from([0.0, 1.0]))
def test_two_row_blocks_against_a_dense_circle(seed, T, k, spread):
    """``m = 2``: ``nu_i(R) = max_{|u| = 1} sum_k R_k ||B_ik^T u||`` (the sups swapped), read on 20 001 angles of the
    half circle (``phi(u) = phi(-u)``): a lower value of the exact that the bound may never undercut."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(T, T, 2, k, generator=g, dtype=torch.float64)
    R = _radii(T, g, spread)
    th = torch.linspace(0, math.pi, 20_001, dtype=torch.float64)
    u = torch.stack([th.cos(), th.sin()], dim=1)  # phi(u) = phi(-u): half the circle
    vals = torch.einsum("nm,itmk->nitk", u, blocks).norm(dim=-1) @ R  # (angles, T)
    grid = vals.max(dim=0).values
    got = _bound(blocks, R)
    assert torch.all(got >= grid * (1 - _tol(blocks)))


@settings(max_examples=5, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(2, 5), m=hs.integers(2, 6), k=hs.integers(2, 6),
       spread=hs.sampled_from([0.0, 1.0, 2.0]))
def test_adam_over_the_balls_never_beats_the_bound(seed, T, m, k, spread):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(T, T, m, k, generator=g, dtype=torch.float64)
    R = _radii(T, g, spread)
    got = _bound(blocks, R)
    for i, lo in enumerate(_adam(blocks, R, g)):
        assert lo <= float(got[i]) * (1 + _tol(blocks))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(1, 7), m=hs.integers(1, 6), spread=hs.sampled_from([0.0, 1.0, 3.0]))
def test_never_above_the_triangle_and_at_equal_radii_the_unit_rows(seed, T, m, spread):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(T, T, m, m, generator=g, dtype=torch.float64)
    N, nu = certified_block_norms(blocks), gram_rows(blocks)
    R = _radii(T, g, spread)
    tri = N @ (R * (1 + 2.0**-51))
    assert torch.all(carried_rows(N, nu, R) <= tri * (1 + 4 * T * U))
    r = float(R[0])
    flat = torch.full((T,), r, dtype=torch.float64)
    assert torch.all(carried_rows(N, nu, flat) <= torch.minimum(nu * r, N @ flat) * (1 + 4 * T * U))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(1, 7), e=hs.integers(-40, 40))
def test_power_of_two_homogeneity(seed, T, e):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(T, T, 3, 3, generator=g, dtype=torch.float64)
    N, nu = certified_block_norms(blocks), gram_rows(blocks)
    R = _radii(T, g, 1.5)
    c = 2.0**e
    assert torch.equal(carried_rows(N, nu, R * c), carried_rows(N, nu, R) * c)
    assert torch.equal(carried_rows(N * c, nu * c, R), carried_rows(N, nu, R) * c)


def test_the_split_of_the_radii_is_rounded_up():
    """``radii_over``: ``R_k <= t + (R_k - t)_+`` in exact rationals for every breakpoint ``t``, on radii whose
    differences round in float64 (the plain difference fails on some of these, counted)."""
    g = torch.Generator().manual_seed(3)
    R = torch.cat([torch.exp((20 * torch.randn(40, generator=g, dtype=torch.float64)).clamp(-700, 700)),
                   torch.tensor([1.0, 1.0 + 2**-52, 3.0, 1e-300, 5e-324, 1e300], dtype=torch.float64)])
    ts = torch.cat([R.new_zeros(1), R])
    over = radii_over(R, ts)
    # read through the identity (N = I, nu = 1) every row is at least R_i
    T = R.shape[0]
    got = carried_rows(torch.eye(T, dtype=torch.float64), torch.ones(T, dtype=torch.float64), R)
    assert torch.all(got >= R)
    bad = 0
    for a in range(ts.shape[0]):
        t = Fraction(float(ts[a]))
        for k in range(T):
            assert Fraction(float(R[k])) <= t + Fraction(float(over[a, k]))
            raw = max(float(R[k]) - float(ts[a]), 0.0)
            bad += Fraction(float(R[k])) > t + Fraction(raw)
    assert bad > 0  # the test's radii do exercise the rounding


def test_an_infinite_unit_row_gives_the_triangle():
    g = torch.Generator().manual_seed(0)
    N = torch.rand(4, 4, generator=g, dtype=torch.float64)
    R = torch.rand(4, generator=g, dtype=torch.float64)
    got = carried_rows(N, torch.tensor([math.inf, 1.0, math.inf, 0.5], dtype=torch.float64), R)
    assert torch.isfinite(got).all()
    tri = N @ (R * (1 + 2.0**-51))
    for i in (0, 2):  # the triangle's sum in another order: within its rounding
        assert abs(float(got[i]) - float(tri[i])) <= 8 * U * float(tri[i])


# -- block_norms_and_rows: the block norms and the unit rows from one left Gram per block -----------------------------

@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(1, 6), m=hs.integers(1, 5), k=hs.integers(1, 4),
       spread=hs.sampled_from([0.0, 1.0, 3.0]))
def test_shared_grams_bound_the_rank_one_rows_and_blocks(seed, T, m, k, spread):
    """Rank-one blocks: the rows by brute force over signs, the blocks' norms by the float64 SVD; never below them,
    the rows never above the triangle of the blocks' norms (beyond rounding)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(T, T, m, generator=g, dtype=torch.float64) * torch.exp(spread * torch.randn(T, T, 1, generator=g,
                                                                                               dtype=torch.float64))
    b = torch.randn(T, T, k, generator=g, dtype=torch.float64)
    blocks = a[..., :, None] * b[..., None, :]
    S = torch.tensor(list(itertools.product([-1.0, 1.0], repeat=T)), dtype=torch.float64)
    cols = a * b.norm(dim=-1, keepdim=True)
    exact = torch.stack([(S @ cols[i]).norm(dim=1).max() for i in range(T)])
    N, nu = block_norms_and_rows(blocks)
    tol = _tol(blocks) + 1e-9
    assert torch.all(N >= torch.linalg.matrix_norm(blocks, ord=2) * (1 - tol))
    assert torch.all(nu >= exact * (1 - tol))
    assert torch.all(nu <= N.sum(dim=1) * (1 + 4 * T * U))  # never above the triangle of the block norms


@settings(max_examples=4, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(2, 5), m=hs.integers(2, 6), k=hs.integers(2, 6))
def test_shared_grams_rows_against_adam(seed, T, m, k):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(T, T, m, k, generator=g, dtype=torch.float64)
    N, nu = block_norms_and_rows(blocks)
    one = torch.ones(T, dtype=torch.float64)
    for i, lo in enumerate(_adam(blocks, one, g)):
        assert lo <= float(nu[i]) * (1 + _tol(blocks))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(1, 5), e=hs.sampled_from([-700, -300, 0, 300, 600]),
       gap=hs.sampled_from([0, 40, 560, 1200]))
def test_shared_grams_at_every_scale_and_with_blocks_far_below_their_row(seed, T, e, gap):
    """Blocks scaled by ``2^e``, one key's blocks a further ``2^-gap`` below (past 537 their scale underflows out of the
    row's Gram and they enter by their norms): never below a float64 SVD's block norms nor below an ascent's row."""
    g = torch.Generator().manual_seed(seed)
    gap = min(gap, e + 1000)  # the far blocks stay in float64's normal range
    blocks = torch.randn(T, T, 3, 3, generator=g, dtype=torch.float64)
    blocks[:, 0] = torch.ldexp(blocks[:, 0], torch.tensor(-gap, dtype=torch.float64))
    blocks = torch.ldexp(blocks, torch.tensor(e, dtype=torch.float64))
    N, nu = block_norms_and_rows(blocks)
    ref = torch.linalg.matrix_norm(blocks, ord=2)
    assert torch.all(N >= ref) and torch.all(N > 0)
    one = torch.ones(T, dtype=torch.float64)
    # the ascent in each row's own scale (its largest entry near 1), read back at 2^e
    exs = [math.frexp(float(blocks[i].abs().max()))[1] for i in range(T)]
    scaled = torch.stack([torch.ldexp(blocks[i], torch.tensor(-ex, dtype=torch.float64)) for i, ex in enumerate(exs)])
    for i, (low, ex) in enumerate(zip(_adam(scaled, one, g, steps=100, starts=2), exs)):
        assert math.ldexp(low, ex) <= float(nu[i]) * (1 + _tol(blocks))
        assert float(nu[i]) >= float(ref[i].max())


def test_shared_grams_zero_blocks_and_rows():
    blocks = torch.zeros(3, 3, 4, 4, dtype=torch.float64)
    blocks[1, 2] = torch.eye(4, dtype=torch.float64) * 3
    N, nu = block_norms_and_rows(blocks)
    assert float(N[1, 2]) >= 3 and float(N[1, 2]) <= 3 * (1 + 1e-8)
    assert float(N.sum()) == float(N[1, 2])
    assert nu[0] == 0 and nu[2] == 0
    assert 3 <= float(nu[1]) <= 3 * (1 + 1e-8)


# -- the stack: F95 on against off -------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", range(len(CASES)))
def test_stack_with_carried_rows_is_never_looser_and_stays_above_the_adversary(case, monkeypatch):
    """``stack_local(move_rest=True)`` with ``CARRY_ROWS`` on and off on F77's attack cases (2-layer post-LN GELU stacks,
    T = 3): the bound and every move-rest row at most the old ones (the products' block norms come from the other side's
    Gram, each within certified_lmax's candidate pad, ``1e-6`` relative, of the old), and the whole bound above the
    network's float64 adversary (``test_local_stack15``'s); it binds on each.  The one-step layer rest (F76a item 4,
    ``layer_rest_rows``) is handed the product's unit rows whenever ``CARRY_ROWS`` is on, never off, and they bind."""
    spec, X, rho, seed = _case(CASES[case])
    rows, layer = {}, {}
    real = ls.layer_rest_rows
    for flag in (True, False):
        monkeypatch.setattr(ls, "CARRY_ROWS", flag)
        E, move, L = [], ls._move_rest, layer.setdefault(flag, [])
        monkeypatch.setattr(ls, "_move_rest", lambda *a: E.append(move(*a)) or E[-1])
        monkeypatch.setattr(ls, "layer_rest_rows", lambda *a: L.append(a) or real(*a))
        rows[flag] = (ls.stack_local(spec, X, [rho], move_rest=True)[0], torch.stack(E))
        monkeypatch.setattr(ls, "_move_rest", move)
    assert layer[False] and all(len(a) == 4 or a[4] is None for a in layer[False])
    assert layer[True] and all(len(a) == 5 and a[4] is not None for a in layer[True])
    assert any(torch.any(real(*a) < real(*a[:4]) * (1 - 1e-6)) for a in layer[True])
    (new, En), (old, Eo) = rows[True], rows[False]
    assert new.upper <= old.upper * (1 + 1e-5)
    assert torch.all(En <= Eo * (1 + 1e-5))
    assert new.upper < old.upper * (1 - 1e-4)  # it binds: 0.02-0.9 % lower on these five
    assert_network_below(spec, X, rho, new, seed=seed)


# -- F76a item 4 with F95: the partial layer's rest in one step ------------------------------------------------------

@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 10_000), T=hs.integers(2, 5), m=hs.integers(2, 6), spread=hs.sampled_from([0.0, 1.0, 2.0]))
def test_layer_rest_rows_with_unit_rows_never_above_the_triangle_nor_below_adam(seed, T, m, spread):
    """``layer_rest_rows(..., nu)`` against the triangle form (``nu`` None) and a projected Adam over the balls
    ``||h_k|| <= E_c,k`` for ``||sum_k B_ik h_k|| + e max E_c + rem_i``: between the two."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(T, T, m, m, generator=g, dtype=torch.float64)
    N, nu = certified_block_norms(blocks), gram_rows(blocks)
    Ec, rem, e = _radii(T, g, spread), torch.rand(T, generator=g, dtype=torch.float64), 1e-3
    with_nu = layer_rest_rows(N, e, Ec, rem, nu)
    assert torch.all(with_nu <= layer_rest_rows(N, e, Ec, rem) * (1 + 4 * T * U))
    assert torch.equal(layer_rest_rows(N, e, Ec, rem), layer_rest_rows(N, e, Ec, rem, None))
    for i, lo in enumerate(_adam(blocks, Ec, g)):
        assert lo + e * float(Ec.max()) + float(rem[i]) <= float(with_nu[i]) * (1 + _tol(blocks))

