"""Certified spectral and product norms at any finite scale (mend29): they enclose the exact norm (mpmath beyond
float64's range) always, never raise from an overflowed or underflowed Gram, and are exactly homogeneous under
powers of two wherever the power-of-two scaling applies (Note [scaling] in ``norms._spectral``): a matrix outside
the range is certified as the same float matrix with max|entry| in [1/2, 1).  Inside the range the float64 route
runs on the given matrix, and LAPACK's eigensolver is not bitwise scale-equivariant (ends differ by an ulp)."""

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


def _normalised(W: np.ndarray) -> tuple[np.ndarray, int]:
    """``(W 2^-e, e)`` with max|W 2^-e| in [1/2, 1) (exact for these entries)."""
    e = math.frexp(float(np.abs(W).max()))[1]
    return np.ldexp(W, -e), e


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
    Wn, e = _normalised(W)
    if not 2.0**-300 <= math.ldexp(float(np.abs(W).max()), k) <= 2.0**300:  # scaled: certified as Wn
        _homogeneous(iv, spectral_norm_interval(Wn), k + e)


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
    (An, ea), (Bn, eb) = _normalised(A), _normalised(B)
    outside = [not 2.0**-150 <= math.ldexp(float(np.abs(M).max()), k) <= 2.0**150 for M, k in ((A, k1), (B, k2))]
    if all(outside):  # both factors scaled: certified as (An, Bn)
        _homogeneous(iv, product_norm_interval(An, Bn), k1 + k2 + ea + eb)


def _attention(kq: int, kk: int, kv: int, ko: int) -> AttentionSpec:
    g = torch.Generator().manual_seed(3)
    W = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((2, 8, 4), (2, 8, 4), (2, 8, 4), (2, 4, 8))]
    return AttentionSpec(*(torch.ldexp(w, torch.tensor(float(k), dtype=torch.float64)) for w, k in zip(W, (kq, kk, kv, ko))))


@settings(max_examples=25, deadline=None)
@given(kq=st.integers(-296, 296), kk=st.integers(-296, 296), kv=st.integers(-296, 296), ko=st.integers(-296, 296))
@example(kq=-290, kk=-290, kv=0, ko=0).via("||W_Q W_K^T|| ~ 2^-580: was the loose 1e-150 of _UNDERFLOW")
@example(kq=250, kk=250, kv=0, ko=0).via("||W_Q W_K^T|| ~ 2^500: was inf (K overflowed)")
def test_head_norms_enclose_in_the_local_range(kq, kk, kv, ko):
    """head_norms' G = s ||W_Q W_K^T||, OV, V, O against float64 SVD at scale 1 times 2^k (mpmath): at least the
    norm, and within rtol 1e-6 of the product route plus the pad above it."""
    a0, a = _attention(0, 0, 0, 0), _attention(kq, kk, kv, ko)
    n = head_norms(a)
    sv = lambda M: float(np.linalg.svd(M.numpy(), compute_uv=False)[0])  # noqa: E731
    for h in range(2):
        for got, M, k, c in ((n["G"][h], a0.W_Q[h] @ a0.W_K[h].T, kq + kk, a.softmax_scale),
                             (n["OV"][h], a0.W_V[h] @ a0.W_O[h], kv + ko, 1.0), (n["V"][h], a0.W_V[h], kv, 1.0)):
            exact = mpmath.ldexp(mpmath.mpf(c * sv(M)), k)
            assert exact * (1 - 1e-13) <= got <= exact * (1 + 2e-6), (got, exact)
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
