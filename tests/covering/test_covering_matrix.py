"""Matrix covers (THEORY F2, F3) and BFT's spectral complexity (F12) against direct computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from transcover import InputError, Kind
from transcover.covering import (
    bft_matrix_log_covering,
    bft_spectral_complexity,
    linear_linf_log_covering,
    matrix_linf_log_covering,
    spectral_ball_matrix_log_covering,
)


def test_zhang_by_hand():
    # a = b = eps = 1: ceil(36) * ln(2 * ceil(6) * n + 1)
    assert linear_linf_log_covering(1.0, 1.0, 1.0, 10).value == pytest.approx(36 * math.log(121), rel=1e-14)
    v = [linear_linf_log_covering(2.0, 1.0, 0.1, n).value for n in (10, 10**4, 10**8)]
    assert v[0] < v[1] < v[2] and v[2] / v[1] < 2  # logarithmic in n


def test_matrix_cover_dominates_each_column_cover():
    # a one-column matrix is the scalar class, up to F2's +k term
    one = matrix_linf_log_covering(2.0, 1.5, 0.1, 1000, 1).value
    scalar = linear_linf_log_covering(2.0, 1.5, 0.1, 1000).value
    assert scalar <= one <= scalar + 2 * math.log(2 * math.ceil(4 * 3 / 0.1 + 2) * 1000 + 1)


def test_bft_maurey_decomposition_and_rate():
    """The re-derivation of BFT Lemma 3.2: XA is a convex combination of atoms of norm ab, and the
    average of k sampled atoms is within ab/sqrt(k) in mean square (Maurey)."""
    rng = np.random.default_rng(0)
    n, d, m = 7, 5, 4
    X = rng.standard_normal((n, d))
    A = rng.standard_normal((d, m))
    a, b = float(np.linalg.norm(A, axis=0).sum()), float(np.linalg.norm(X))
    c = np.linalg.norm(X, axis=0)  # column norms of X
    alpha = (c[:, None] * np.abs(A)) / (a * b)  # weights of the atoms V_ij = a b (X e_i / c_i) e_j^T
    assert alpha.sum() <= 1 + 1e-12
    atoms = np.zeros((d, m, n, m))
    for i in range(d):
        for j in range(m):
            atoms[i, j, :, j] = a * b * X[:, i] / c[i]
    signs = np.sign(A)
    recon = np.einsum("ij,ij,ijnk->nk", alpha, signs, atoms)
    assert np.allclose(recon, X @ A, rtol=0, atol=1e-12 * a * b)
    assert np.allclose(np.linalg.norm(atoms.reshape(d, m, -1), axis=-1), a * b)
    # leftover weight split between +V_00 and -V_00 keeps the mean; sample k atoms
    p = np.concatenate([alpha.ravel(), [(1 - alpha.sum()) / 2] * 2])
    flat = np.concatenate([(signs[..., None, None] * atoms).reshape(d * m, n, m), atoms[0, :1], -atoms[0, :1]])
    k, trials = 9, 3000
    idx = rng.choice(len(p), size=(trials, k), p=p / p.sum())
    err2 = np.mean([np.sum((flat[row].mean(axis=0) - X @ A) ** 2) for row in idx])
    assert err2 <= (a * b) ** 2 / k
    # and the lemma's count for eps = ab/sqrt(k)
    # eps a hair above ab/sqrt(k): the exact ratio (ab/eps)^2 is then below k whatever the last bits of a, b
    # (np.linalg.norm's summation order varies by build), so the lemma's k is exactly 9
    q = bft_matrix_log_covering(a, b, a * b / math.sqrt(k) * (1 + 1e-12), d, m)
    assert q.value == pytest.approx(k * math.log(2 * d * m), rel=1e-9)


def test_bft_spectral_complexity_direct():
    rng = np.random.default_rng(1)
    mats = [rng.standard_normal((6, 5)), rng.standard_normal((5, 4)), rng.standard_normal((4, 3))]
    s = [float(np.linalg.norm(M, 2)) for M in mats]
    l21 = [float(np.linalg.norm(M, axis=0).sum()) for M in mats]
    rho = [1.0, 0.5, 2.0]
    R = np.prod([r * x for r, x in zip(rho, s)]) * sum((b / x) ** (2 / 3) for b, x in zip(l21, s)) ** 1.5
    sc = bft_spectral_complexity(s, l21, rho=rho, width=6, input_radius=2.0, feedforward=True)
    assert sc.R == pytest.approx(R, rel=1e-12) and sc.kind is Kind.CERTIFIED_UPPER
    assert math.exp(sc.log_A) == pytest.approx(4.0 * math.log(2 * 36) * R**2, rel=1e-12)
    assert bft_spectral_complexity(s, l21, width=6).kind is Kind.ESTIMATE


def test_spectral_ball_and_bad_inputs():
    assert spectral_ball_matrix_log_covering(3, 4, 1.0, 0.5).value == pytest.approx(12 * math.log(5), rel=1e-14)
    with pytest.raises(InputError):
        matrix_linf_log_covering(1.0, 1.0, 0.1, 0, 3)
    with pytest.raises(InputError):
        bft_spectral_complexity([1.0, 0.0], [1.0, 1.0], width=3)


def test_bft_certified_complexity_is_rounded_up_against_mpmath():
    # feedforward=True labels R_A and A certified upper bounds; in plain float64 they were below the exact
    # value of the formula at the given floats in 1 904 of 3 000 random chains (red team 37b)
    import random
    from fractions import Fraction

    import mpmath

    mpmath.mp.prec = 300
    exact = lambda x: mpmath.mpf(Fraction(x).numerator) / Fraction(x).denominator  # noqa: E731
    rng = random.Random(7)
    for _ in range(600):
        m = rng.randint(1, 8)
        s = [10 ** rng.uniform(-30, 30) for _ in range(m)]
        b = [rng.choice([0.0, 10 ** rng.uniform(-30, 30)]) for _ in range(m)]
        b[0] = b[0] or 1.0
        r = [rng.choice([1.0, 0.5, 1.1283791670955126, 10 ** rng.uniform(-3, 3)]) for _ in range(m)]
        width, radius = rng.randint(1, 10**6), 10 ** rng.uniform(-5, 5)
        sc = bft_spectral_complexity(s, b, rho=r, width=width, input_radius=radius, feedforward=True)
        log_R = (mpmath.fsum(mpmath.log(exact(ri) * exact(si)) for ri, si in zip(r, s))
                 + mpmath.mpf(1.5) * mpmath.log(mpmath.fsum((exact(bi) / exact(si)) ** (mpmath.mpf(2) / 3)
                                                             for bi, si in zip(b, s))))
        log_A = 2 * mpmath.log(exact(radius)) + mpmath.log(mpmath.log(2 * width * width)) + 2 * log_R
        for got, want in ((sc.log_R, log_R), (sc.log_A, log_A)):
            assert exact(got) >= want and exact(got) - want <= 1e-9 * (1 + abs(want)), (got, want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=40), st.integers(0, 12), st.floats(1e-3, 1e3))
def test_f2_profile_union_covers_every_column_norm_profile(weights, log2c, a):
    """THEORY F2, matrix version (red team 205: the cover was derived for the model's own column-norm profile, a
    smaller class than the (2,1) ball it was used for).  Every profile of the ball rounds up to a grid profile
    ``ñ_j = a m_j/K`` (``K = c k``) with ``ñ_j >= n_j``, ``sum ñ_j <= a(1 + 1/c)``, and the grid profiles number
    ``C(K + 2k, k) <= (e(c + 2))^k``; the per-profile scales ``delta_j = eps sqrt(ñ_j/A')`` meet ``eps`` in l2."""
    from fractions import Fraction

    k, c = len(weights), 2**log2c
    K = c * k
    total = sum(weights)
    assume(total > 0)
    n = [Fraction(w) * Fraction(a) / Fraction(total) for w in weights]  # exact column norms, sum exactly a
    n = [x * Fraction(1 - 1e-9) for x in n]  # strictly inside the ball
    m = [math.ceil(K * x / Fraction(a)) for x in n]
    tilde = [Fraction(a) * mj / K for mj in m]
    assert all(t >= x for t, x in zip(tilde, n)) and sum(m) <= K + k
    A = sum(tilde)
    assert A <= Fraction(a) * (1 + Fraction(1, c))
    assert math.log(math.comb(K + 2 * k, k)) <= k * (1 + math.log(c + 2))
    assert sum(Fraction(1) * t / A for t in tilde) == 1  # sum_j delta_j^2 / eps^2
    # each column's Zhang cost 36 ñ_j^2 b^2/delta_j^2 = 36 ñ_j A b^2/eps^2: summed, 36 A^2 b^2/eps^2
    assert sum(36 * t * A for t in tilde) == 36 * A * A


def test_f2_matrix_cover_pays_for_the_profiles():
    """k columns cost more than the scalar cover of the same radius by at least the profiles' count (red team 205)."""
    ab, n, k = 10.0, 1000, 16
    L = 2 * math.ceil(4 * ab + 2) * n + 1
    v = matrix_linf_log_covering(ab, 1.0, 1.0, n, k).value
    assert v > (36 * ab * ab + k) * math.log(L) + math.log(k + 2)  # the union over profiles is paid
    assert v <= (36 * (2 * ab) ** 2 + k) * math.log(2 * math.ceil(8 * ab + 2) * n + 1) + k * (1 + math.log(3))


@pytest.mark.parametrize("family", ["l21", "spectral", "best"])
@pytest.mark.parametrize("k", [-40, 9, 60])
def test_model_cover_is_homogeneous_in_the_norms_and_eps(family, k):
    """Every cover reads only ``norm / eps_i`` (F1, and F2 with its profile union at ``A_c = a(1 + 1/c)``), and Lemma
    G.1's split scales with eps: norms and eps times ``2^k`` leave ``ln ln N`` unchanged, to the rounding pads."""
    from transcover.covering import MatrixTerm, transformer_log_covering

    terms = [MatrixTerm(0, "W_KQ.0", (8, 8), 0.5, 3.0, 1.0, group="attention"),
             MatrixTerm(0, "W_1", (8, 32), 1.2, 7.5, 2.0, group="ffn"),
             MatrixTerm(1, "W_2", (32, 8), -0.3, 4.0, 1.5, group="ffn")]
    scaled = [MatrixTerm(t.layer, t.role, t.shape, t.log_c, math.ldexp(t.l21, k), math.ldexp(t.spectral, k),
                         group=t.group) for t in terms]
    a = transformer_log_covering(terms, 0.05, 4096, family=family).log_log_N
    b = transformer_log_covering(scaled, math.ldexp(0.05, k), 4096, family=family).log_log_N
    # the split's budget check shrinks by 1e-12 (doubling) and each cost carries a 1e-12 relative pad: 4e-12 covers a
    # shrink or pad landing differently on the two scales (measured: 8.5e-13 at most)
    assert b == pytest.approx(a, rel=4e-12, abs=0.0)
