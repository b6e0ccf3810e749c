"""Certified spectral norms against float64 SVD: lower <= exact <= upper, always."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transcover import Kind
from transcover.norms import (
    product_norm_estimate,
    product_norm_interval,
    spectral_norm_estimate,
    spectral_norm_interval,
)

EPS64 = np.finfo(np.float64).eps


def _svd_norm(M: np.ndarray) -> tuple[float, float]:
    """Reference sigma_max by LAPACK SVD, with its own error bar ~ 10 max(m,n) eps sigma (backward stable)."""
    s = float(np.linalg.svd(M, compute_uv=False)[0]) if M.size else 0.0
    return s, 10 * max(M.shape) * EPS64 * s


def _assert_encloses(iv, exact: float, ref_err: float) -> None:
    assert iv.lower <= exact + ref_err, (iv, exact)
    assert iv.upper >= exact - ref_err, (iv, exact)


def _with_singular_values(m: int, n: int, sv: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    U, _ = np.linalg.qr(rng.standard_normal((m, m)))
    V, _ = np.linalg.qr(rng.standard_normal((n, n)))
    S = np.zeros((m, n))
    k = min(m, n, sv.size)
    S[np.arange(k), np.arange(k)] = sv[:k]
    return U @ S @ V.T


SHAPES = {"square": (48, 48), "tall": (96, 24), "wide": (20, 70), "vector-col": (30, 1), "vector-row": (1, 30)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_random_matrices_enclosed_with_small_gap(shape, dtype):
    torch.manual_seed(0)
    W = torch.randn(*shape).to(dtype)
    exact, err = _svd_norm(W.double().numpy())
    iv = spectral_norm_interval(W)
    _assert_encloses(iv, exact, err)
    assert iv.kind is Kind.CERTIFIED_INTERVAL
    assert iv.relative_gap <= 1e-3


@pytest.mark.parametrize("case", ["rank1", "rank-deficient", "near-degenerate", "exactly-degenerate",
                                  "huge-range", "tiny-scale", "huge-scale", "zero"])
def test_structured_matrices(case):
    rng = np.random.default_rng(1)
    m, n = 40, 30
    if case == "rank1":
        W = np.outer(rng.standard_normal(m), rng.standard_normal(n))
    elif case == "rank-deficient":
        W = _with_singular_values(m, n, np.r_[np.linspace(3, 1, 5), np.zeros(25)], rng)
    elif case == "near-degenerate":  # sigma_1 ~ sigma_2: power iteration's worst case
        W = _with_singular_values(m, n, np.r_[2.0, 2.0 - 1e-9, 2.0 - 2e-9, np.linspace(1.9, 0.1, 27)], rng)
    elif case == "exactly-degenerate":
        W = _with_singular_values(m, n, np.r_[np.full(10, 1.5), np.linspace(1, 0.1, 20)], rng)
    elif case == "huge-range":
        W = _with_singular_values(m, n, np.logspace(4, -8, 30), rng)
    elif case == "tiny-scale":
        W = rng.standard_normal((m, n)) * 1e-30
    elif case == "huge-scale":
        W = rng.standard_normal((m, n)) * 1e30
    else:
        W = np.zeros((m, n))
    exact, err = _svd_norm(W)
    iv = spectral_norm_interval(W)
    _assert_encloses(iv, exact, err)
    assert iv.relative_gap <= 1e-3


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(1, 24),
    n=st.integers(1, 24),
    seed=st.integers(0, 2**32 - 1),
    log_scale=st.floats(-12, 12),
    rank=st.integers(0, 24),
    structure=st.sampled_from(["gauss", "lowrank", "degenerate", "integer", "sparse"]),
)
def test_property_lower_le_exact_le_upper(m, n, seed, log_scale, rank, structure):
    rng = np.random.default_rng(seed)
    if structure == "gauss":
        W = rng.standard_normal((m, n))
    elif structure == "lowrank":
        W = rng.standard_normal((m, rank)) @ rng.standard_normal((rank, n)) if rank else np.zeros((m, n))
    elif structure == "degenerate":
        W = _with_singular_values(m, n, np.r_[np.ones(max(rank, 1)), np.linspace(0.9, 0.0, 24)], rng)
    elif structure == "integer":
        W = rng.integers(-3, 4, size=(m, n)).astype(float)
    else:
        W = rng.standard_normal((m, n)) * (rng.random((m, n)) < 0.1)
    W = W * 10.0**log_scale
    exact, err = _svd_norm(W)
    iv = spectral_norm_interval(W)
    _assert_encloses(iv, exact, err)
    assert iv.relative_gap <= 1e-3


@settings(max_examples=600, deadline=None)
@given(p=st.integers(1, 40), r=st.integers(1, 8), q=st.integers(1, 40), seed=st.integers(0, 2**32 - 1),
       log_scale=st.floats(-8, 8), kill=st.integers(0, 8))
def test_property_product_norm(p, r, q, seed, log_scale, kill):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((p, r)) * 10.0**log_scale
    B = rng.standard_normal((r, q))
    A[:, :min(kill, r - 1)] = 0.0  # rank-deficient heads
    exact, err = _svd_norm(A @ B)
    err += 10 * (p + q + r) * EPS64 * np.linalg.norm(A, 2) * np.linalg.norm(B, 2)  # forming A @ B for the reference
    iv = product_norm_interval(A, B)
    _assert_encloses(iv, exact, err)
    assert iv.upper - iv.lower <= 1e-3 * iv.upper + 1e-12 * np.linalg.norm(A) * np.linalg.norm(B)


def test_product_matches_head_structure_of_attention():
    """W_KQ^h = W_Q^h W_K^hT / sqrt(d_head): the low-rank route vs forming the d x d matrix."""
    torch.manual_seed(2)
    d, dh = 96, 16
    Wq, Wk = torch.randn(d, dh, dtype=torch.float64), torch.randn(d, dh, dtype=torch.float64)
    full = float(torch.linalg.matrix_norm(Wq @ Wk.T, 2))
    iv = product_norm_interval(Wq, Wk.T)
    assert iv.lower <= full * (1 + 1e3 * EPS64) and iv.upper >= full * (1 - 1e3 * EPS64)
    assert iv.relative_gap < 1e-6


def test_fast_estimates_are_labelled_and_accurate():
    torch.manual_seed(3)
    W = torch.randn(300, 200)
    exact = float(torch.linalg.matrix_norm(W.double(), 2))
    est = spectral_norm_estimate(W)
    assert est.kind is Kind.ESTIMATE
    assert abs(est.upper - exact) <= 1e-3 * exact
    A, B = torch.randn(50, 8), torch.randn(8, 60)
    pe = product_norm_estimate(A, B)
    assert pe.kind is Kind.ESTIMATE
    assert math.isclose(pe.upper, float(torch.linalg.matrix_norm(A.double() @ B.double(), 2)), rel_tol=1e-6)


def test_rejects_non_finite():
    W = torch.ones(3, 3)
    W[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        spectral_norm_interval(W)


@pytest.mark.parametrize("scale", [1e-30, 1e20, 1e37, 1e150, 1e300])
def test_estimates_survive_every_finite_scale(scale):
    # W^T W overflowed float32 above ~1e19 (and float64 Grams above ~1e154): ValueError from eigh (red team 37f)
    from transcover.norms import product_norm_estimate

    rng = np.random.default_rng(0)
    for shape in ((4, 6), (150, 140)):
        W = rng.standard_normal(shape)
        want = np.linalg.norm(W, 2)
        got = spectral_norm_estimate(W * scale)
        assert got.kind is Kind.ESTIMATE and got.upper / scale == pytest.approx(want, rel=1e-3)
    A, B = rng.standard_normal((5, 2)), rng.standard_normal((2, 7))
    got = product_norm_estimate(A * scale, B * scale)
    if scale < 1e200:
        assert got.upper / scale / scale == pytest.approx(np.linalg.norm(A @ B, 2), rel=1e-6)
    else:  # ||AB|| ~ 1e300 x 1e300: inf, not an exception
        assert got.upper == math.inf
