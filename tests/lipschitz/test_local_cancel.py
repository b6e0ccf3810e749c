"""Products that cancel (THEORY F97): a norm of a formed float64 product, padded only relative to itself, falls short
of the exact norm where the product's entries are far below ``|A| |B|``; the certified weight norm ``||sc W_Q W_K^T||``
of the drift and stack routes (``score_norm``) and the drift's score rows ``||G y_ij||`` (``score_rows``) now add
Higham's ``gamma_k`` bound on the formed product's error.

References are exact: the products in mpmath at 60 digits and the spectral norm by mpmath's SVD.  On main (before
F97) ``spectral(W_Q @ W_K.T) (1 + 1e-9)(1 + 1e-12)`` was up to 7e-8 below the exact norm on these cases, and
``stack_local`` raised a raw ``ValueError`` where ``W_Q W_K^T`` overflowed although both factors are finite.
"""

from __future__ import annotations

import dataclasses
import math

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lipschitz_testkit import random_spec
from test_local_underflow import _conjugate
from transcover import InputError
from transcover.lipschitz import stack_local
from transcover.lipschitz._local_attention import attention_query_terms, attention_weights_f64, head_norms
from transcover.lipschitz._local_jacobian import _head_data, score_norm, score_rows
from transcover.lipschitz._local_rows import _HeadMoments
from transcover.lipschitz._rounding import product_row_norms

mpmath.mp.dps = 60


def _cancelling(seed: int, n: int, m: int, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_Q = [x, x]`` and ``W_K = [y, -y (1 + delta)]`` (n, 2m) each: ``W_Q W_K^T = -delta x y^T`` exactly, while
    ``|W_Q| |W_K|^T`` is about ``2 / delta`` times larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g, dtype=torch.float64)
    y = torch.randn(n, m, generator=g, dtype=torch.float64)
    return torch.cat([x, x], 1), torch.cat([y, -y * (1 + delta)], 1)


def _mp(A: torch.Tensor) -> mpmath.matrix:
    return mpmath.matrix([[mpmath.mpf(v) for v in row] for row in A.tolist()])


def _exact_spectral(M: mpmath.matrix) -> mpmath.mpf:
    return max(mpmath.svd_r(M, compute_uv=False))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(3, 12), scale=st.sampled_from([1.0, 0.125, 0.177]))
def test_score_norm_is_at_least_the_exact_norm_where_the_product_cancels(seed, k, scale):
    Wq, Wk = _cancelling(seed, 5, 3, 10.0**-k)
    exact = mpmath.mpf(scale) * _exact_spectral(_mp(Wq) * _mp(Wk).T)
    got = score_norm(Wq, Wk, scale)
    assert got >= exact, (float(got / exact) - 1, k)


def test_score_norm_stays_tight_without_cancellation():
    """Not a pad that swamps the value: on Gaussian factors the bound is within 1e-9 of the exact norm."""
    g = torch.Generator().manual_seed(0)
    Wq, Wk = (torch.randn(12, 4, generator=g, dtype=torch.float64) for _ in range(2))
    exact = _exact_spectral(_mp(Wq) * _mp(Wk).T)
    assert exact <= score_norm(Wq, Wk, 1.0) <= exact * (1 + 1e-8)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(3, 12))
def test_score_rows_are_at_least_the_exact_rows_where_the_product_cancels(seed, k):
    """Rows ``y = [z, z]`` against ``W_K = [K, -K (1 + delta)]``: ``y W_K = -delta z K`` exactly."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2, 3, 2, generator=g, dtype=torch.float64)
    K = torch.randn(2, 3, generator=g, dtype=torch.float64)
    Wq = torch.randn(4, 3, generator=g, dtype=torch.float64)
    Y, Wk = torch.cat([z, z], -1), torch.cat([K, -K * (1 + 10.0**-k)], 0)
    got = score_rows(Y, Wk, Wq).tolist()
    mWk, mWq = _mp(Wk), _mp(Wq)
    for a in range(2):
        for b in range(3):
            row = _mp(Y[a, b][None]) * mWk * mWq.T
            exact = mpmath.sqrt(mpmath.fsum(v * v for v in row))
            assert got[a][b] >= exact, (float(got[a][b] / exact) - 1, k)


def test_stack_local_refuses_in_one_line_where_the_score_product_overflows():
    """Tokens at ``2^-520`` with ``W_Q``, ``W_K`` at ``2^520``: the formed ``W_Q W_K^T`` overflows (both factors finite)
    and main raised ``spectral_norm_interval``'s raw ValueError; now the low-rank route gives ``inf`` and the head's
    data-range check refuses with one line."""
    spec, _, X = _conjugate(-520)
    with pytest.raises(InputError) as err:
        stack_local(spec, X, [math.ldexp(1e-3, -520)])
    assert "\n" not in str(err.value) and "Note [local" in str(err.value)


# -- the heads' data at X: q_i, G y_ij, W_V^T y_ij and their moments (``_head_data``, ``_HeadMoments``) ----------------


def _cancelling_layer(seed: int, delta: float, causal: bool = False):  # noqa: ANN202
    """A one-layer post-LN spec (d = 6, two heads of d_head = 4) whose heads have ``W_Q = [x, x]``, ``W_K = [y, -y (1 +
    delta)]``: every score product ``W_Q W_K^T`` cancels to ``delta`` of ``|W_Q| |W_K|^T``; the tokens X (5, 6)."""
    spec = random_spec(seed, d=6, H=2, dh=4, L=1, norm="layernorm", placement="post", act="gelu", biases=False,
                       causal=causal, input_norm=False)
    L = spec.layers[0]
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 6, 2, generator=g, dtype=torch.float64)
    y = torch.randn(2, 6, 2, generator=g, dtype=torch.float64) / delta  # scores of order 1
    A = dataclasses.replace(L.attention, W_Q=torch.cat([x, x], -1), W_K=torch.cat([y, -y * (1 + delta)], -1))
    X = torch.randn(5, 6, generator=g, dtype=torch.float64)
    return dataclasses.replace(spec, layers=[dataclasses.replace(L, attention=A)]), A, X


def _rows_exact(A: torch.Tensor, *Ws: torch.Tensor) -> list:
    """Exact rows of ``A W_1 W_2 ...`` (A (n, k)) in mpmath."""
    M = _mp(A)
    for W in Ws:
        M = M * _mp(W)
    return [[M[i, j] for j in range(M.cols)] for i in range(M.rows)]


def _norm(row: list) -> mpmath.mpf:
    return mpmath.sqrt(mpmath.fsum(v * v for v in row))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(4, 11), causal=st.booleans())
def test_head_moments_bound_the_exact_rows_where_scores_cancel(seed, k, causal):
    """``qn``, ``gn``, ``vn``, ``lG``, ``dG`` of ``_HeadMoments`` against the exact rows of the formed ``Y`` and
    ``X~`` through the weights (mpmath): on main the formed norms fell short by up to 4e-4 relative."""
    _, A, X = _cancelling_layer(seed, 10.0**-k, causal)
    heads = _head_data(A, X)
    mom = _HeadMoments(heads, A.softmax_scale)
    sc = mpmath.mpf(A.softmax_scale)
    Xa = torch.cat([X, torch.ones(5, 1, dtype=torch.float64)], 1)
    for h, (hd, m) in enumerate(zip(heads, mom.rows)):
        P, Y, _, Wq, Wk, Wv, _ = hd
        q = _rows_exact(Xa, A.W_Q_augmented(h).double(), Wk.T)
        for i in range(5):
            assert float(m["qn"][i]) >= sc * _norm(q[i]), ("qn", h, i)
            g = [[sc * v for v in row] for row in _rows_exact(Y[i], Wk, Wq.T)]
            v = _rows_exact(Y[i], Wv)
            for j in range(5):
                assert float(m["gn"][i, j]) >= _norm(g[j]), ("gn", h, i, j)
                assert float(m["vn"][i, j]) >= _norm(v[j]), ("vn", h, i, j)
            gram = mpmath.matrix(6, 6)
            for j in range(5):
                col = mpmath.matrix(g[j])
                gram += mpmath.mpf(float(P[i, j])) * (col * col.T)
            assert float(m["lG"][i]) >= max(mpmath.eigsy(gram, eigvals_only=True)), ("lG", h, i)
            vis = [j for j in range(5) if P[i, j] > 0]
            g0 = [[sc * v for v in row] for row in _rows_exact(Y[0], Wk, Wq.T)]
            diam = max(_norm([a - b for a, b in zip(g0[j], g0[l])]) for j in vis for l in vis)
            assert float(m["dG"][i]) >= diam, ("dG", h, i)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(4, 11), rho=st.sampled_from([0.0, 1e-6, 1e-3]))
def test_attention_query_terms_at_least_the_formula_with_exact_products(seed, k, rho):
    """``attention_query_terms``' ``(sum_h L_{h,i}^2)^{1/2}`` against the same formula evaluated in mpmath with the exact
    products ``q_i``, ``G (x_j - c)``, ``G y_ij``, ``W_V^T y_ij`` of the formed ``P``, ``Y`` (and its certified
    weight norms): the formed norms alone gave up to 7.8e-7 less after every pad."""
    _, A, X = _cancelling_layer(seed, 10.0**-k)
    norms = head_norms(A)
    concat, _ = attention_query_terms(A, X, rho, norms=norms)
    Ps = attention_weights_f64(A, X)
    sc, r = mpmath.mpf(A.softmax_scale), mpmath.mpf(rho)
    Xa = torch.cat([X, torch.ones(5, 1, dtype=torch.float64)], 1)
    c = X.mean(dim=0, keepdim=True)
    total = [mpmath.mpf(0)] * 5
    for h in range(2):
        Wq, Wk, Wv, _ = (W.double() for W in A.head(h))
        nV, nG = mpmath.mpf(norms["V"][h]), mpmath.mpf(norms["G"][h])
        P = Ps[h]
        Y = X[None] - (P @ X)[:, None]
        qn = [sc * _norm(row) for row in _rows_exact(Xa, A.W_Q_augmented(h).double(), Wk.T)]
        Gc = [sc * _norm(row) for row in _rows_exact(X - c, Wk, Wq.T)]
        for i in range(5):
            dl = [r * (Gc[j] + qn[i] + nG * r) for j in range(5)]
            w = [mpmath.exp(dl[j] + max(dl)) for j in range(5)]
            Vy = [_norm(row) for row in _rows_exact(Y[i], Wv)]
            Gy = [sc * _norm(row) for row in _rows_exact(Y[i], Wk, Wq.T)]
            p = [mpmath.mpf(float(P[i, j])) for j in range(5)]
            SV = mpmath.sqrt(mpmath.fsum(p[j] * w[j] * (Vy[j] + nV * r) ** 2 for j in range(5)))
            SG = mpmath.sqrt(mpmath.fsum(p[j] * w[j] * (Gy[j] + nG * r) ** 2 for j in range(5)))
            total[i] += (nV + SV * (SG + qn[i] + nG * r)) ** 2
    for i in range(5):
        assert float(concat[i]) >= mpmath.sqrt(total[i]), (i, float(concat[i]) / float(mpmath.sqrt(total[i])) - 1)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.sampled_from([-600, -20, -1, 1, 7, 300]), which=st.integers(0, 2))
def test_score_norm_and_product_rows_are_exactly_homogeneous_in_powers_of_two(seed, k, which):
    """Each factor (and the scale) times ``2^k`` multiplies ``score_norm``, ``score_rows`` and ``product_row_norms``
    by ``2^k`` bit for bit: their pads are relative and their norms formed at powers of two (THEORY F96, F97)."""
    g = torch.Generator().manual_seed(seed)
    Wq, Wk = (torch.randn(8, 4, generator=g, dtype=torch.float64) for _ in range(2))
    A = torch.randn(5, 8, generator=g, dtype=torch.float64)
    Y = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    s = 2.0**k
    f = [s if i == which else 1.0 for i in range(3)]
    assert score_norm(Wq * f[0], Wk * f[1], 0.5 * f[2]) == score_norm(Wq, Wk, 0.5) * s
    assert torch.equal(product_row_norms(A * f[2], Wq * f[0], (Wk * f[1]).T), product_row_norms(A, Wq, Wk.T) * s)
    if which < 2:
        assert torch.equal(score_rows(Y, Wk * f[1], Wq * f[0]), score_rows(Y, Wk, Wq) * s)
    else:
        assert torch.equal(score_rows(Y * s, Wk, Wq), score_rows(Y, Wk, Wq) * s)
