"""Row-blocked certified norms of large matrices (issue 14, item 1): enclosures against float64 references."""

import math

import numpy as np
from hypothesis import given, settings, strategies as st

from transcover.norms._blocked import blocked_matrix_norms
from transcover.norms._spectral import spectral_norm_interval


@settings(max_examples=15)
@given(m=st.integers(1, 300), n=st.integers(1, 40), block_rows=st.integers(1, 64), seed=st.integers(0, 10_000),
       flip=st.booleans(), exp=st.sampled_from([-1030, -20, 0, 20, 900]), f32=st.booleans())
def test_blocked_norms_enclose_the_float64_references(m, n, block_rows, seed, flip, exp, f32):
    rng = np.random.default_rng(seed)
    E = rng.standard_normal((m, n))
    if f32:
        E = E.astype(np.float32).astype(np.float64)  # float32 values, exactly
    E = E.T if flip else E
    if f32 and abs(exp) > 100:
        exp = 0  # float32 has no such exponents: the widened input would not be the matrix
    E_small = E.astype(np.float32) if f32 else E
    spec, fro, l21, max_row = blocked_matrix_norms(np.ldexp(E_small, exp), block_bytes=8 * min(E.shape) * block_rows)
    # references on the unscaled matrix (float64 SVD, exact power-of-two scaling afterwards)
    sv = np.linalg.svd(E, compute_uv=False)[0]
    true_fro = math.sqrt(math.fsum((E * E).ravel()))
    true_l21 = math.fsum(math.sqrt(math.fsum(c * c for c in col)) for col in E.T)
    true_row = max(math.sqrt(math.fsum(r * r for r in row)) for row in E)
    s = math.ldexp(1.0, exp)
    if s == 0.0 or not math.isfinite(s * sv * 2):
        return  # outside float64 entirely; the input itself underflowed or cannot be represented
    slack = 1e-12  # the float64 SVD reference's own error, relative
    assert spec.lower / s <= sv * (1 + slack) and sv * (1 - slack) <= spec.upper / s
    assert fro.lower / s <= true_fro * (1 + 1e-15) and true_fro * (1 - 1e-15) <= fro.upper / s
    assert l21.lower / s <= true_l21 * (1 + 1e-15) and true_l21 * (1 - 1e-15) <= l21.upper / s
    assert math.isclose(max_row / s, true_row, rel_tol=1e-12)


def test_blocked_matches_the_unblocked_certificate_and_is_tight():
    rng = np.random.default_rng(1)
    E = rng.standard_normal((5000, 48)).astype(np.float32)
    spec, *_ = blocked_matrix_norms(E, block_bytes=8 * 48 * 333)
    ref = spectral_norm_interval(E)
    assert spec.lower <= ref.upper and ref.lower <= spec.upper
    assert spec.relative_gap < 1e-3


def test_homogeneity_under_a_power_of_two_and_a_general_scale():
    rng = np.random.default_rng(2)
    E = rng.standard_normal((400, 30))
    base, *_ = blocked_matrix_norms(E, block_bytes=8 * 30 * 50)
    twice, *_ = blocked_matrix_norms(E * 4.0, block_bytes=8 * 30 * 50)
    assert twice.lower == 4.0 * base.lower and twice.upper == 4.0 * base.upper  # exact
    lam = 3.7
    sv = np.linalg.svd(E * lam, compute_uv=False)[0]
    scaled, *_ = blocked_matrix_norms(E * lam, block_bytes=8 * 30 * 50)
    assert scaled.lower <= sv * (1 + 1e-12) and sv * (1 - 1e-12) <= scaled.upper


def test_nan_is_refused():
    E = np.ones((10, 3))
    E[4, 1] = np.nan
    try:
        blocked_matrix_norms(E)
    except ValueError as err:
        assert "NaN" in str(err)
    else:
        raise AssertionError("a NaN entry was accepted")
