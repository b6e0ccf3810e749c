"""Certified spectral and product norms at any finite scale (mend29): they enclose the exact norm (mpmath beyond
float64's range) always, never raise from an overflowed or underflowed Gram, and are exactly homogeneous under powers
of two wherever their ends stay normal floats (Note [scaling] in ``norms._spectral``: the certificate runs on the
Gram of the matrix scaled to max|entry| in [1/2, 1), since LAPACK's eigensolver is not bitwise scale-equivariant)."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from transcover.lipschitz._local_attention import head_norms
from transcover.model import AttentionSpec
from transcover.norms import product_norm_interval, spectral_norm_interval

EPS64 = np.finfo(np.float64).eps
TINY, MAX = np.finfo(np.float64).tiny, np.finfo(np.float64).max


def _matrix(seed: int, m: int, n: int, zeros: float = 0.0) -> np.ndarray:
    """Entries of magnitude in [2^-20, 2^20] (or 0): every scaling by 2^k, |k| <= 1000, is exact."""
    rng = np.random.default_rng(seed)
    W = np.ldexp(rng.uniform(1.0, 2.0, (m, n)) * rng.choice([-1.0, 1.0], (m, n)), rng.integers(-20, 20, (m, n)))
    return np.where(rng.random((m, n)) < zeros, 0.0, W)


def _encloses(iv, sigma: float, k: int, rel: float) -> None:
    """lower <= sigma 2^k <= upper with sigma's float64-SVD error ``rel`` (compared in mpmath: 2^k sigma may be
    outside float64's range); an upper end of inf only where the exact value exceeds the largest float."""
    exact = mpmath.ldexp(mpmath.mpf(sigma), k)
    assert mpmath.mpf(iv.lower) <= exact * (1 + rel), (iv, exact)
    if iv.upper == math.inf:
        assert exact * (1 + rel) > MAX, (iv, exact)
    else:
        assert mpmath.mpf(iv.upper) >= exact * (1 - rel), (iv, exact)


def _homogeneous(iv, iv0, k: int) -> None:
    """``iv`` is ``iv0`` times 2^k, exactly, where both ends stay normal floats."""
    for a, b in ((iv.lower, iv0.lower), (iv.upper, iv0.upper)):
        if b != 0.0 and TINY <= abs(mpmath.ldexp(b, k)) <= MAX:
            assert a == math.ldexp(b, k), (iv, iv0, k)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 12), n=st.integers(1, 12), k=st.integers(-500, 500))
@example(seed=0, m=8, n=4, k=-1000).via("the norm 2^-1000 ||W||: subnormal ends, rounded outward")
def test_spectral_interval_homogeneous_at_any_scale(seed, m, n, k):
    W = _matrix(seed, m, n, zeros=0.2)
    sigma = float(np.linalg.svd(W, compute_uv=False)[0])
    iv = spectral_norm_interval(np.ldexp(W, k))
    _encloses(iv, sigma, k, 10 * max(m, n) * EPS64)
    _homogeneous(iv, spectral_norm_interval(W), k)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), p=st.integers(1, 12), r=st.integers(1, 5), q=st.integers(1, 12),
       k1=st.integers(-500, 500), k2=st.integers(-500, 500))
@example(seed=0, p=8, r=4, q=8, k1=223, k2=292).via("both factors in [2^-300, 2^300], K = L^T U L overflowed: LinAlgError")
@example(seed=0, p=8, r=4, q=8, k1=140, k2=140).via("the witness A B z overflowed: a finite lower end 1e138 too large")
@example(seed=0, p=8, r=4, q=8, k1=-500, k2=-560).via("2^-1060 ||AB||: subnormal, rounded to nearest below it")
def test_product_interval_homogeneous_at_any_scale(seed, p, r, q, k1, k2):
    A, B = _matrix(seed, p, r), _matrix(seed + 1, r, q, zeros=0.2)
    AB = A @ B
    sigma = float(np.linalg.svd(AB, compute_uv=False)[0])
    # forming A @ B for the reference: |fl(AB) - AB| <= r u |A||B|, at most r u ||A||_F ||B||_F in norm
    rel = 10 * (p + q) * EPS64 + (r * EPS64 * np.linalg.norm(A) * np.linalg.norm(B) / sigma if sigma else 0.0)
    iv = product_norm_interval(np.ldexp(A, k1), np.ldexp(B, k2))
    if sigma == 0.0:
        assert iv.lower == 0.0
        return
    _encloses(iv, sigma, k1 + k2, rel)
    _homogeneous(iv, product_norm_interval(A, B), k1 + k2)


def _attention(kq: int, kk: int, kv: int, ko: int) -> AttentionSpec:
    g = torch.Generator().manual_seed(3)
    W = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((2, 8, 4), (2, 8, 4), (2, 8, 4), (2, 4, 8))]
    return AttentionSpec(*(torch.ldexp(w, torch.tensor(float(k), dtype=torch.float64)) for w, k in zip(W, (kq, kk, kv, ko))))


@settings(max_examples=25, deadline=None)
@given(kq=st.integers(-296, 296), kk=st.integers(-296, 296), kv=st.integers(-190, 190), ko=st.integers(-190, 190))
@example(kq=-290, kk=-290, kv=0, ko=0).via("||W_Q W_K^T|| ~ 2^-580: was the loose 1e-150 of _UNDERFLOW")
@example(kq=250, kk=250, kv=0, ko=0).via("||W_Q W_K^T|| ~ 2^500: was inf (K overflowed)")
@example(kq=150, kk=150, kv=0, ko=0).via("2^300: the witness overflowed, G's lower end and so its upper 1e126 too large")
def test_head_norms_homogeneous_and_enclosing(kq, kk, kv, ko):
    """head_norms' G = s ||W_Q W_K^T||, OV, V, O (the value side inside Note [local norm range]): exactly 2^k times
    their values at scale 1, and against float64 SVD at scale 1 times 2^k (mpmath) at least the norm, within rtol 1e-6
    of the product route plus the pad above it."""
    a0, a = _attention(0, 0, 0, 0), _attention(kq, kk, kv, ko)
    n0, n = head_norms(a0), head_norms(a)
    sv = lambda M: float(np.linalg.svd(M.numpy(), compute_uv=False)[0])  # noqa: E731
    for h in range(2):
        for key, M, k, c in (("G", a0.W_Q[h] @ a0.W_K[h].T, kq + kk, a.softmax_scale),
                             ("OV", a0.W_V[h] @ a0.W_O[h], kv + ko, 1.0), ("V", a0.W_V[h], kv, 1.0)):
            assert n[key][h] == math.ldexp(n0[key][h], k), (key, n[key][h], n0[key][h], k)
            exact = mpmath.ldexp(mpmath.mpf(c * sv(M)), k)
            assert exact * (1 - 1e-13) <= n[key][h] <= exact * (1 + 2e-6), (key, n[key][h], exact)
    assert n["O"] == math.ldexp(n0["O"], ko)
    exact = mpmath.ldexp(mpmath.mpf(sv(a0.W_O.reshape(-1, 8))), ko)
    assert exact * (1 - 1e-13) <= n["O"] <= exact * (1 + 2e-6)


@pytest.mark.parametrize("k", [-1065, -1060, -1030, 1000, 1023])
def test_ends_outside_the_normal_range_are_rounded_outward(k):
    """sqrt(2) 2^-1065 is 724.08 subnormal ulps: scaling the certified ends back rounded the upper end to 724 (below
    the norm); past the largest float the upper end is inf and the lower end stays finite."""
    for iv, exact in ((spectral_norm_interval(np.ldexp(np.ones((1, 2)), k)), mpmath.ldexp(mpmath.sqrt(2), k)),
                      (spectral_norm_interval(np.ldexp(np.ones((3, 2)), k)), mpmath.ldexp(mpmath.sqrt(6), k)),
                      (product_norm_interval(np.ldexp(np.ones((2, 1)), k), np.array([[1.0, 2.0]])),
                       mpmath.ldexp(mpmath.sqrt(10), k))):
        assert mpmath.mpf(iv.lower) <= exact and iv.lower < math.inf
        assert iv.upper == math.inf if exact > MAX else mpmath.mpf(iv.upper) >= exact, (iv, exact)


def _exact_fro_l21(W):  # noqa: ANN001, ANN202
    """Exact Frobenius and (2,1) norms (column sums) of a float64 matrix: rational squares, mpmath roots."""
    from fractions import Fraction

    import mpmath

    W = np.atleast_2d(np.asarray(W, dtype=np.float64))
    cols = [sum(Fraction(float(v)) ** 2 for v in W[:, j]) for j in range(W.shape[1])]
    with mpmath.workdps(60):
        root = lambda f: mpmath.sqrt(mpmath.mpf(f.numerator) / f.denominator)  # noqa: E731
        return root(sum(cols)), mpmath.fsum(root(c) for c in cols)


@pytest.mark.parametrize("W", [[[float.fromhex("0x1.23456789abcdfp-520")], [float.fromhex("0x1.23456789abcdfp-520")]],
                               [[2.0**-540, 0.0]], [[2.0**600], [0.0]],
                               [[float.fromhex("0x1.23456789abcdfp-520"), -float.fromhex("0x1.fedcba9876543p-521")]],
                               [[2.0**-1074, 3 * 2.0**-1074]], [[2.0**1000, -(2.0**1000)]]])
def test_entrywise_norms_contain_the_exact_value_at_every_scale(W):
    """Stop 35's red team (Note [entrywise scale]): the squares under- or overflowed: ``(2^-540, 0)`` was enclosed in
    [0, 0], ``2^600`` in [1.8e308, inf], and squares near ``2^-520`` lost bits outside the pads."""
    import mpmath

    from transcover.norms._entrywise import frobenius_l21_intervals, product_frobenius_l21, vector_norm_interval

    W = np.asarray(W, dtype=np.float64)
    fro, l21 = frobenius_l21_intervals(W)
    efro, el21 = _exact_fro_l21(W)
    assert mpmath.mpf(fro.lower) <= efro <= mpmath.mpf(fro.upper)
    assert mpmath.mpf(l21.lower) <= el21 <= mpmath.mpf(l21.upper)
    v = vector_norm_interval(W.ravel())
    assert mpmath.mpf(v.lower) <= efro <= mpmath.mpf(v.upper)
    eye = np.eye(W.shape[0])  # the product route on (I, W): the same norms
    pf, pl = product_frobenius_l21(eye * 2.0**-300, W)
    with mpmath.workdps(60):
        s = mpmath.mpf(2) ** -300
        assert mpmath.mpf(pf.lower) <= efro * s <= mpmath.mpf(pf.upper)
        assert mpmath.mpf(pl.lower) <= el21 * s <= mpmath.mpf(pl.upper)


def test_entrywise_norms_refuse_non_finite_weights():
    from transcover.norms._entrywise import frobenius_l21_intervals, vector_norm_interval

    for bad in (np.array([math.nan, 0.0]), np.array([math.inf, 1.0])):
        with pytest.raises(ValueError, match="NaN or infinite"):
            vector_norm_interval(bad)
        with pytest.raises(ValueError, match="NaN or infinite"):
            frobenius_l21_intervals(bad[None])


def test_scaled_kq_interval_is_outward_where_it_is_subnormal():
    """``HeadMeasure.W_KQ`` multiplied a power-of-two scale in without rounding: exact only while normal (scale
    ``2^-1070`` certified 9.4e-323 for an exact 9.49e-323)."""
    from fractions import Fraction

    from transcover._results import Interval
    from transcover.norms._model import HeadMeasure

    w = float.fromhex("0x1.3333333333333p+0")
    hm = HeadMeasure.__new__(HeadMeasure)
    object.__setattr__(hm, "W_QK", Interval(w, w))
    iv = hm.W_KQ(2.0**-1070)
    exact = Fraction(w) * Fraction(2) ** -1070
    assert Fraction(iv.lower) <= exact <= Fraction(iv.upper)
