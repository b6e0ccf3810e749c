"""THEORY F86: F85's low-rank part with the move's rest taken as the images of the upstream stages' own rests through
exact products (``image_sources``, ``pull_rows``, ``KeyImages.pulled``, ``_lowrank_sup_sources``) instead of a free ball
per token.

Independent references: the form ``||L^T Delta||^2`` with ``L`` assembled column by column (``_L`` of the F85 tests)
and a float64 projected Adam over the input move and every source's unit vectors; the exact attention rest's Adam
ascent over moves ``P delta + sum_src B_src v_src``; the pulled rows against autograd's float64 Jacobians of the
sub-stage maps chained by matrix products.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

import transcover.lipschitz._local_stack as ls
from lipschitz_testkit import chain, stack_substage_maps, stage_jacobians
from test_local_attn_psd_prefix import _L, _adam_images, _form, _prefix_sup
from test_local_attn_rest import T, _case, _clip, _rest
from test_local_move26 import CASES, _case as _stack_case
from transcover.lipschitz._local_attn_psd import KeyImages, _lowrank_sup_sources, form_rows, psd_rest_rows, velocity_rests
from transcover.lipschitz._local_attn_rest import _head_factors
from transcover.lipschitz._local_stack_move import image_sources, pull_rows, substage_products


def _maps_of(seed: int, t: int, d: int, n: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(t, t, d, d, generator=g, dtype=torch.float64) / d**0.5 * scale for _ in range(n)]


@settings(max_examples=5, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 100), i=hs.integers(0, 3), scale=hs.sampled_from([1e-3, 1.0, 1e3]))
def test_image_sup_is_never_beaten_and_near_attained(seed, i, scale):
    """The SDP over the prefix and two product sources plus an identity source stays above Adam on the same set
    (prefix and maps scaled by 1e-3 ... 1e3), reaches a third of it, and never above F85's ball of the same rest."""
    t, d, H = 4, 5, 2
    heads, cols, wts, B = _form(seed, t, d, H, scale=scale)
    M1, M2 = _maps_of(seed, t, d, 2, scale)
    g = torch.Generator().manual_seed(seed)
    Rs = [torch.rand(t, generator=g, dtype=torch.float64) * 0.05 for _ in range(3)]
    rho = 0.1
    srcs = [(KeyImages(B), torch.full((t,), rho, dtype=torch.float64)), (KeyImages(M1), Rs[0]),
            (KeyImages(M2), Rs[1]), (None, Rs[2])]
    A = _lowrank_sup_sources(i, cols, heads, wts, srcs, 30)
    got = _adam_images(_L(i, heads, cols, wts), B, rho, [M1, M2, None], Rs)
    assert got <= A * (1 + 1e-10), (got, A)
    assert got > A / 3, (got, A)
    # the same rest as a ball per token (F85): each token's radius the images' largest reach
    ball = sum(torch.linalg.matrix_norm(M, ord=2) @ R for M, R in zip((M1, M2), Rs[:2])) + Rs[2]
    assert A <= _prefix_sup(i, cols, heads, wts, B, rho, ball, 30) * (1 + 1e-9)


def test_image_sup_homogeneity():
    """A source's map x 4 with its radii / 4: the same set, the same sup (exact powers of two); every radius and
    ``rho`` x 2: the sup x 4."""
    heads, cols, wts, B = _form(5, 4, 5, 2)
    (M,) = _maps_of(5, 4, 5, 1)
    R = torch.tensor([0.01, 0.03, 0.0, 0.02], dtype=torch.float64)
    one = torch.ones(4, dtype=torch.float64)

    def sup(Bs: torch.Tensor, rho: float, Ms: torch.Tensor, Rm: torch.Tensor) -> float:
        return _lowrank_sup_sources(2, cols, heads, wts, [(KeyImages(Bs), rho * one), (KeyImages(Ms), Rm)], 30)

    a1 = sup(B, 0.1, M, R)
    assert abs(sup(B, 0.1, 4 * M, R / 4) / a1 - 1) < 1e-9
    assert abs(sup(B, 0.2, M, 2 * R) / (4 * a1) - 1) < 1e-9


@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 50), causal=hs.booleans(), rho=hs.floats(0.02, 0.1))
def test_row_with_images_is_never_beaten(seed, causal, rho):
    """The whole F84 row with F86's images inside against the exact rest's Adam ascent over moves
    ``P delta + M v + w`` (``||v_k|| <= R_k``, ``||w_k|| <= R'_k``), never above F85's row with the ball
    ``E_j = sum_k ||M_jk|| R_k + R'_j`` and strictly below it at some query."""
    attn, X, P, data, aa, _ = _case(seed, 4.0, causal)
    (M,) = _maps_of(seed, T, X.shape[1], 1)
    R, Rw = torch.full((T,), 0.6 * rho, dtype=torch.float64), torch.full((T,), 0.05 * rho, dtype=torch.float64)
    E = (torch.linalg.matrix_norm(M, ord=2) @ R + Rw) * (1 + 1e-12)
    args = (data, aa.p["heads"], aa.p["Wqa"], X, aa.Qs, aa.eQ, rho, E, 0.0, 0.0)
    old = psd_rest_rows(*args, Bp=P)
    row = psd_rest_rows(*args, Bp=P, images=[(KeyImages(M), R), (None, Rw)])
    assert torch.all(row <= old) and bool((row < old).any()), (row, old)
    for i in range(T):
        best = _adam_row(attn, X, P, M, R, Rw, rho, i)
        assert best <= float(row[i]) * (1 + 1e-10), (i, best, float(row[i]))


def _adam_row(attn, X: torch.Tensor, P: torch.Tensor, M: torch.Tensor, R: torch.Tensor, Rw: torch.Tensor,  # noqa: ANN001
              rho: float, i: int) -> float:
    """Float64 projected Adam (2 starts, 30 steps) on the exact attention rest's row ``i`` over moves
    ``P delta + M v + w`` (``||delta_j|| <= rho``, ``||v_k|| <= R_k``, ``||w_k|| <= Rw_k``): the largest value seen."""
    t, d = X.shape
    g = torch.Generator().manual_seed(i)
    best = 0.0
    for _ in range(2):
        dl = _clip(torch.randn(t, d, generator=g, dtype=torch.float64) * rho,
                   torch.full((t,), rho, dtype=torch.float64)).requires_grad_(True)
        v = _clip(torch.randn(t, d, generator=g, dtype=torch.float64), R).requires_grad_(True)
        w = _clip(torch.randn(t, d, generator=g, dtype=torch.float64), Rw).requires_grad_(True)
        opt = torch.optim.Adam([dl, v, w], lr=0.1 * rho)
        for _ in range(30):
            with torch.no_grad():
                dl.copy_(_clip(dl, torch.full((t,), rho, dtype=torch.float64)))
                v.copy_(_clip(v, R))
                w.copy_(_clip(w, Rw))
            D = torch.einsum("kjab,jb->ka", P, dl) + torch.einsum("kjab,jb->ka", M, v) + w
            val = _rest(attn, X, D)[i].norm()
            best = max(best, float(val.detach()))
            opt.zero_grad()
            (-val).backward()
            opt.step()
    return best


def test_pulled_rows_against_autograd():
    """The form's rows pulled back through ``M_{a -> s}`` (a 2-layer post-LN stack, the second attention's input) within
    their certified per-row rounding ``g`` of the same rows times autograd's float64 chain of the sub-stages' Jacobians
    (plus the reference's own rounding); the sources: every upstream stage's rest, no ball (the chain reaches
    sub-stage 1), and with a budget of two positions the window's start ball first."""
    spec, X, _, _ = _stack_case(CASES[0])
    stages, _, _ = ls._stages(spec, X.double(), {})
    T_, d = X.shape
    prods = substage_products(stages, lambda K: ls.certified_block_norms(ls._col_blocks(K), 4),
                              lambda st, K: ls._local_error(st, K, cols=True), lambda st, K: ls._chunked(st.lin.apply, K))
    maps = stack_substage_maps(spec)
    xs = chain(maps, X)
    Jj = stage_jacobians(maps, xs)
    s = 5  # layer 1's attention
    rows = torch.randn(6, T_, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pull = lambda budget: pull_rows(stages, s, rows, prods, lambda st, G: ls._chunked(st.lin.apply_t, G),  # noqa: E731
                                    ls._row_errors, budget)
    out = pull(2**30)
    assert sorted(out) == [1, 2, 3, 4]
    u = 2.0**-53
    for a, (G, g) in out.items():
        M = torch.eye(T_ * d, dtype=torch.float64)
        for m in range(a, s):
            M = Jj[m] @ M
        ref = (rows.reshape(6, -1) @ M).reshape(6, T_, d)
        diff = (G - ref).flatten(1).norm(dim=1)
        tol = 4 * (s - a) * T_ * d * u * float(torch.stack([J.abs().sum(dim=0).max() for J in Jj[a:s]]).prod()) \
            * float(rows.flatten(1).norm(dim=1).max())
        assert bool((g > 0).all()) and bool((diff <= g + tol).all()), (a, diff, g, tol)
    rests = [torch.full((T_,), 0.1 * (m + 1), dtype=torch.float64) for m in range(s)]
    srcs = image_sources(rests, None, 1, s, lambda a: a)
    assert [a for a, _ in srcs] == [1, 2, 3, 4, None] and float(srcs[0][1][0]) == 0.1
    two = pull(2 * rows.numel() * 8)
    assert sorted(two) == [3, 4]
    E3 = torch.full((T_,), 0.7, dtype=torch.float64)
    srcs = image_sources(rests, E3, 3, s, lambda a: a)
    assert [a for a, _ in srcs] == [3, 4, None] and float(srcs[0][1][0]) == 0.7 and float(srcs[1][1][0]) == 0.4


def test_pulled_forms_match_the_maps():
    """``form_rows`` pulled through a map by hand (``rows B``) gives ``KeyImages.pulled`` forms equal to the map's own
    (``KeyImages(B).forms``), the columns are F84 (b)'s velocity columns bit for bit, and the two sups agree."""
    attn, X, P, data, aa, _ = _case(3, 2.0, False)
    heads, t, d = aa.p["heads"], X.shape[0], X.shape[1]
    (M,) = _maps_of(3, t, d, 1)
    rows = form_rows(heads, aa.p["scale"])
    G = torch.einsum("nma,mkab->nkb", rows, M)
    H = len(heads)
    pk, mk = KeyImages.pulled(G, torch.zeros(G.shape[0], dtype=torch.float64), H), KeyImages(M)
    cols = [velocity_rests(data, heads, aa.p["Wqa"], X, 0.1, torch.zeros(t, dtype=torch.float64),
                           torch.zeros(t, dtype=torch.float64), torch.ones(t, dtype=torch.float64), h,
                           _head_factors(data, h, 0.1, torch.zeros(t, dtype=torch.float64),
                                         torch.zeros(t, dtype=torch.float64)))[0] for h in range(H)]
    half = t * H * t
    assert torch.equal(rows[half:].reshape(t, H, t, t, d)[torch.arange(t), :, :, torch.arange(t)],
                       torch.stack(cols, dim=1))
    for a, b in zip(pk.forms(heads, cols), mk.forms(heads, cols)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    wts = torch.rand(H, t, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.1
    R = torch.full((t,), 0.05, dtype=torch.float64)
    for i in range(t):
        a1 = _lowrank_sup_sources(i, cols, heads, wts, [(pk, R)], 30)
        a2 = _lowrank_sup_sources(i, cols, heads, wts, [(mk, R)], 30)
        assert abs(a1 / a2 - 1) < 1e-9, (i, a1, a2)


def _rows_of(src: KeyImages, heads, cols: list) -> torch.Tensor:  # noqa: ANN001
    """The pulled-rows layout (``KeyImages.pulled``'s inverse) of a map's own forms: (2 T^2 H, T_in, d)."""
    QB, CB = src.forms(heads, cols)
    t, _, tin, H, d = QB.shape
    return torch.cat([QB.permute(0, 3, 1, 2, 4).reshape(t * H * t, tin, d),
                      CB.reshape(t, tin, H, t, d).permute(0, 2, 3, 1, 4).reshape(t * H * t, tin, d)])


@settings(max_examples=2, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 100), i=hs.integers(0, 3))
def test_pulled_rows_error_is_carried(seed, i):
    """Rows known only within their error ``g`` (the computed rows a tenth of the exact ones, ``g`` the missing nine
    tenths): the sup through them stays above Adam's on the exact map, which reaches a third of the exact sup (the test's own check), while the rows alone
    give about a hundredth of it: ``eT`` (the rows' own errors, F86) is what keeps it sound."""
    t, d, H = 4, 5, 2
    heads, cols, wts, _ = _form(seed, t, d, H)
    (M,) = _maps_of(seed, t, d, 1)
    R = torch.rand(t, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.05 + 1e-3
    G = _rows_of(KeyImages(M), heads, cols)
    g = 0.9 * G.flatten(1).norm(dim=1) * (1 + 1e-12)
    A = _lowrank_sup_sources(i, cols, heads, wts, [(KeyImages.pulled(G / 10, g, H), R)], 30)
    exact = _lowrank_sup_sources(i, cols, heads, wts, [(KeyImages(M), R)], 30)
    got = _adam_images(_L(i, heads, cols, wts), torch.zeros(t, t, d, d, dtype=torch.float64), 0.0, [M], [R], restarts=2, steps=80)
    assert exact / 3 < got <= A * (1 + 1e-10), (got, A, exact)


def test_pull_rows_carries_every_step_through_the_later_products():
    """``pull_rows`` with token-local steps ``J_t = 2 Q_t`` (``Q_t`` orthogonal per token, so ``||M_{a -> t}||_2 =
    2^{t-a}`` exactly, given as ``prods``' block norms) that each add an error of exactly ``c_t`` per row along the row
    (the worst alignment) and report it as their row error: every ``||fl(G_a) - G_a||`` within ``g_a``, which here is
    attained up to the float64 chains' own rounding (each step's error grows by 2 per later step and all are aligned)."""
    T_, d, n, s = 3, 4, 5, 4
    gen = torch.Generator().manual_seed(0)
    Qs = [torch.linalg.qr(torch.randn(T_, d, d, generator=gen, dtype=torch.float64))[0] for _ in range(s)]
    c = [2.0**-10 * (u + 1) for u in range(s)]
    prods = {(a, b): (2.0 ** (b - a) * torch.eye(T_, dtype=torch.float64), 0.0) for a in range(s) for b in range(a + 1, s + 1)}
    exact = lambda u, G: 2 * torch.einsum("nkb,kab->nka", G, Qs[u])  # noqa: E731  (G J_u, J_u = 2 Q_u per token)
    unit = lambda G: G / G.flatten(1).norm(dim=1)[:, None, None]  # noqa: E731
    rows = torch.randn(n, T_, d, generator=gen, dtype=torch.float64)
    out = pull_rows(list(range(s)), s, rows, prods, lambda u, G: exact(u, G) + c[u] * unit(exact(u, G)),
                    lambda u, G: torch.full((G.shape[0],), c[u], dtype=torch.float64))
    assert sorted(out) == list(range(1, s))
    ref = rows
    for a in range(s - 1, 0, -1):
        ref = exact(a, ref)
        G, g = out[a]
        diff = (G - ref).flatten(1).norm(dim=1)
        want = sum(c[u] * 2.0 ** (u - a) for u in range(a, s))
        tol = 8 * s * d * 2.0**-53 * float(ref.flatten(1).norm(dim=1).max())  # the reference chain's own rounding
        assert bool((diff <= g + tol).all()) and bool((diff > want - tol).all()), (a, diff, g, want)


def test_images_never_loosen_a_tighter_ball():
    """A ball ``E`` tighter than the images' reach (``E`` may come from another certified route): the row with the
    images (radii 64 x the ball's) equals the row on the ball alone: F86 keeps the smaller of F85's sup and its own,
    which here is the larger (the images' sup alone gives a larger row: checked by mutation)."""
    attn, X, P, data, aa, _ = _case(3, 2.0, False)
    (M,) = _maps_of(3, T, X.shape[1], 1)
    rho = 0.05
    E = torch.full((T,), 0.01 * rho, dtype=torch.float64)
    args = (data, aa.p["heads"], aa.p["Wqa"], X, aa.Qs, aa.eQ, rho, E, 0.0, 0.0)
    old = psd_rest_rows(*args, Bp=P)
    row = psd_rest_rows(*args, Bp=P, images=[(KeyImages(M), torch.full((T,), 0.64 * rho, dtype=torch.float64))])
    assert torch.equal(row, old), (row, old)
