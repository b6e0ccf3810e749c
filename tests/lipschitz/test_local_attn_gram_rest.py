"""THEORY F87: the Grams' part of the attention rest with the move's rest seen through every head's Gram factor
(``gram_factors``, ``head_block_norms``, ``move_rest_rows(..., blocks=)``, ``gram_rest_reach``; ``psd_rest_rows(heads_rest=)``).

Independent references: exact rational arithmetic (``fractions``) for the factors' residual, float64 SVD for the blocks
through the factors, a float64 projected Adam over every source's unit vectors for the seminorm of the images, and the
exact attention rest's Adam ascent over moves ``P delta + M v + w`` for the whole row.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from test_local_attn_psd_images import _adam_row, _maps_of
from test_local_attn_rest import T, _case, _clip
from transcover.lipschitz._local_attn_gram_rest import gram_factors, gram_rest_reach, head_block_norms
from transcover.lipschitz._local_attn_psd import KeyImages, psd_rest_rows
from transcover.lipschitz._local_stack_move import move_rest_rows

F64 = torch.float64


def _heads(seed: int, d: int, r: int, H: int, vscale: float = 1.0, oscale: float = 1.0, degenerate: bool = False):  # noqa: ANN202
    """``_head_data``-shaped tuples (only ``W_Q, W_K, W_V, W_O`` read); ``degenerate``: head 0's ``W_O`` zero and head 1's
    of rank one (``W_O W_O^T`` singular: the Cholesky's shift)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for h in range(H):
        Wq, Wk, Wv = (torch.randn(d, r, generator=g, dtype=F64) / d**0.5 for _ in range(3))
        Wo = torch.randn(r, d, generator=g, dtype=F64) / r**0.5 * oscale
        if degenerate and h == 0:
            Wo = torch.zeros_like(Wo)
        if degenerate and h == 1:
            Wo = Wo[:1].expand(r, d).clone()
        out.append((None, None, None, Wq, Wk, Wv * vscale, Wo))
    return out


def _exact_grams(hd) -> tuple:  # noqa: ANN001
    """The exact keys', values' and queries' Grams of one head as nested lists of Fractions."""
    Q = lambda M: [[Fraction(float(x)) for x in row] for row in M.tolist()]  # noqa: E731
    mm = lambda A, B: [[sum(a * b for a, b in zip(ra, cb)) for cb in zip(*B)] for ra in A]  # noqa: E731
    tr = lambda A: [list(c) for c in zip(*A)]  # noqa: E731
    Wq, Wk, Wv, Wo = (Q(W) for W in hd[3:7])
    return mm(Wk, tr(Wk)), mm(mm(Wv, mm(Wo, tr(Wo))), tr(Wv)), mm(Wq, tr(Wq))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 1000), vscale=hs.sampled_from([2.0**-20, 1.0, 2.0**20]),
       oscale=hs.sampled_from([2.0**-20, 1.0, 2.0**20]), degenerate=hs.booleans())
def test_factors_dominate_the_exact_grams(seed, vscale, oscale, degenerate):
    """``||G_q - F_q F_q^T||_F <= delta_q`` in exact rational arithmetic for every kind and head (the values' residual is
    non-zero: ``delta_V = 0`` would fail), weights at 2^-20 .. 2^20 and singular ``W_O W_O^T``; ``fn >= ||F_q||``."""
    heads = _heads(seed, 7, 3, 2, vscale, oscale, degenerate)
    F, delta, fn = gram_factors(heads)
    resid = []
    for h, hd in enumerate(heads):
        for q, G in enumerate(_exact_grams(hd)):
            Fq = [[Fraction(float(x)) for x in row] for row in F[q, h].tolist()]
            D2 = sum((G[a][b] - sum(x * y for x, y in zip(Fq[a], Fq[b]))) ** 2 for a in range(7) for b in range(7))
            assert D2 <= Fraction(float(delta[q, h])) ** 2, (q, h, float(D2) ** 0.5, float(delta[q, h]))
            resid.append((q, float(D2)))
    assert all(v == 0 for q, v in resid if q != 1) and any(v > 0 for q, v in resid if q == 1)
    assert bool((fn >= torch.linalg.matrix_norm(F, ord=2) * (1 + 1e-10)).all())


def _cols(M: torch.Tensor) -> torch.Tensor:
    """``substage_products``' layout of a product's blocks ``M[m, k]``: ``K[(k, c), m] = M_mk[:, c]``."""
    t, tin, d, _ = M.shape
    return M.permute(1, 3, 0, 2).reshape(tin * d, t, d)


def test_block_norms_against_svd():
    """``head_block_norms`` is above float64's SVD of every ``F_q^T M_mk`` and within 1e-6 of it, and x 4 with the
    product (exact powers of two)."""
    heads = _heads(1, 6, 2, 2)
    F, _, _ = gram_factors(heads)
    (M,) = _maps_of(1, 3, 6, 1)
    N = head_block_norms(F, _cols(M))
    ref = torch.linalg.matrix_norm(torch.einsum("qhdr,mkdc->qhmkrc", F, M), ord=2)
    assert bool((N >= ref * (1 + 1e-10)).all()) and bool((N <= ref * (1 + 1e-6) + 1e-300).all())
    assert torch.allclose(head_block_norms(F, _cols(4 * M)), 4 * N, rtol=1e-12, atol=0)


def _rest_case(seed: int, t: int = 3, d: int = 6, r: int = 2, H: int = 2, perp: bool = False, own: float = 1.0) -> tuple:
    """Heads, two products and the identity as the move's rest's sources, their rests (the identity's x ``own``),
    ``C``, ``delta`` and ``E`` (F73c's triangle); ``perp``: the products' ranges orthogonal to every factor's columns
    but for 1e-3."""
    heads = _heads(seed, d, r, H)
    F, delta, fn = gram_factors(heads)
    Ms = _maps_of(seed, t, d, 2)
    if perp:
        U, _, _ = torch.linalg.svd(F.permute(3, 0, 1, 2).reshape(r * 3 * H, d).T)
        Pp = U[:, 3 * H * r:] @ U[:, 3 * H * r:].T  # onto the factors' orthogonal complement
        Ms = [torch.einsum("ab,mkbc->mkac", Pp + 1e-3 * torch.eye(d, dtype=F64), M) for M in Ms]
    g = torch.Generator().manual_seed(seed)
    rests = [torch.rand(t, generator=g, dtype=F64) * 0.05 + 1e-3 for _ in range(3)]
    rests[2] = rests[2] * own
    hprods = {(1, 3): head_block_norms(F, _cols(Ms[0])), (2, 3): head_block_norms(F, _cols(Ms[1]))}
    prods = {(1, 3): (None, 0.0), (2, 3): (None, 0.0)}
    C = move_rest_rows(prods, rests, 3, 3, hprods, fn)
    E = sum(torch.linalg.matrix_norm(M, ord=2) @ R for M, R in zip(Ms, rests)) + rests[2]
    return heads, Ms, rests, C, delta, E * (1 + 1e-12), (hprods, fn, prods)


def _true_grams(heads) -> torch.Tensor:  # noqa: ANN001
    return torch.stack([torch.stack([hd[4] @ hd[4].T for hd in heads]),
                        torch.stack([hd[5] @ hd[6] @ hd[6].T @ hd[5].T for hd in heads]),
                        torch.stack([hd[3] @ hd[3].T for hd in heads])])  # (3, H, d, d)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 1000), m=hs.integers(0, 2), own=hs.sampled_from([1e-2, 1.0, 1e2]))
def test_reach_is_never_beaten(seed, m, own):
    """``gram_rest_reach`` of ``move_rest_rows(..., blocks=)`` stays above a float64 projected Adam on ``||e_m||_{G_m}`` over
    ``e = M_1 v_1 + M_2 v_2 + v_3`` (``||v_a,k|| <= R_a,k``; the identity's rest from a hundredth to a hundred times the
    products') with the exact Grams, and Adam reaches a fifth of it."""
    heads, Ms, rests, C, delta, E, _ = _rest_case(seed, own=own)
    t, d = 3, 6
    w = torch.rand(3, 2, t, generator=torch.Generator().manual_seed(seed + 7), dtype=F64)
    bound = float(gram_rest_reach(w, C, delta, E)[m])
    G = torch.einsum("qh,qhab->ab", w[:, :, m], _true_grams(heads))
    g = torch.Generator().manual_seed(seed)
    best = 0.0
    for _ in range(3):
        vs = [_clip(torch.randn(t, d, generator=g, dtype=F64), R).requires_grad_(True) for R in rests]
        opt = torch.optim.Adam(vs, lr=0.02)
        for _ in range(150):
            with torch.no_grad():
                for v, R in zip(vs, rests):
                    v.copy_(_clip(v, R))
            e = Ms[0][m].permute(1, 0, 2).reshape(d, -1) @ vs[0].reshape(-1) \
                + Ms[1][m].permute(1, 0, 2).reshape(d, -1) @ vs[1].reshape(-1) + vs[2][m]
            val = torch.sqrt(e @ G @ e)
            best = max(best, float(val.detach()))
            opt.zero_grad()
            (-val).backward()
            opt.step()
    assert bound / 5 < best <= bound * (1 + 1e-10), (best, bound)


def test_reach_homogeneity_and_the_misaligned_rest():
    """Every rest x 2: ``C`` x 2; ``W_V`` x 4: the values' factor x 4 and ``delta`` x 16; weights / 16 with ``C`` x 4
    and ``delta`` x 16: the same reach (exact powers of two).  A rest orthogonal to every factor's columns (but for
    1e-3) is seen far below F84's ``E_m lambda_max(G_m)^{1/2}``; the products' rounding enters as ``||F_q|| e max R``."""
    heads, Ms, rests, C, delta, E, (hprods, fn, prods) = _rest_case(4)
    assert torch.allclose(move_rest_rows(prods, [2 * R for R in rests], 3, 3, hprods, fn), 2 * C, rtol=1e-12, atol=0)
    F, dl, _ = gram_factors(heads)
    F4, dl4, _ = gram_factors([(*hd[:5], 4 * hd[5], hd[6]) for hd in heads])
    assert torch.equal(F4[1], 4 * F[1]) and torch.allclose(dl4[1], 16 * dl[1], rtol=1e-12, atol=0)
    w = torch.rand(3, 2, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    a, b = gram_rest_reach(w, C, delta, E), gram_rest_reach(w / 16, 4 * C, 16 * delta, E)
    assert torch.allclose(a, b, rtol=1e-12, atol=0)
    e1 = move_rest_rows({**prods, (1, 3): (None, 0.25)}, rests, 3, 3, hprods, fn)
    assert torch.allclose(e1 - C, 0.25 * fn[..., None] * float(rests[0].max()), rtol=1e-9, atol=0)
    heads, Ms, rests, C, delta, E, _ = _rest_case(4, d=16, perp=True)
    Gm = torch.einsum("qht,qhab->tab", w, _true_grams(heads))
    old = E * torch.linalg.eigvalsh(Gm)[:, -1].sqrt()
    assert bool((gram_rest_reach(w, C, delta, E) < 0.2 * old).all()), (gram_rest_reach(w, C, delta, E), old)


@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 50), causal=hs.booleans(), rho=hs.floats(0.02, 0.1))
def test_row_with_heads_rest_is_never_beaten(seed, causal, rho):
    """The whole F84 row with F86's images and F87's reach inside against the exact rest's Adam ascent over moves
    ``P delta + M v + w``; never above the row without F87 and strictly below it at some query."""
    attn, X, P, data, aa, _ = _case(seed, 4.0, causal)
    t, d = X.shape
    (M,) = _maps_of(seed, t, d, 1)
    R, Rw = torch.full((t,), 0.6 * rho, dtype=F64), torch.full((t,), 0.05 * rho, dtype=F64)
    E = (torch.linalg.matrix_norm(M, ord=2) @ R + Rw) * (1 + 1e-12)
    F, dl, fn = gram_factors(aa.p["heads"])
    C = move_rest_rows({(1, 2): (None, 0.0)}, [R, Rw], 2, t, {(1, 2): head_block_norms(F, _cols(M))}, fn)
    args = (data, aa.p["heads"], aa.p["Wqa"], X, aa.Qs, aa.eQ, rho, E, 0.0, 0.0)
    imgs = [(KeyImages(M), R), (None, Rw)]
    old = psd_rest_rows(*args, Bp=P, images=imgs)
    row = psd_rest_rows(*args, Bp=P, images=imgs, heads_rest=(C, dl))
    assert torch.all(row <= old) and bool((row < old).any()), (row, old)
    for i in range(T):
        best = _adam_row(attn, X, P, M, R, Rw, rho, i)
        assert best <= float(row[i]) * (1 + 1e-10), (i, best, float(row[i]))
