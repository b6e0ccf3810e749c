"""The embedding's max row norm and the row-block route at extreme scales (stop 36).

``analyze``'s ``max_row_norm`` (the radius of the input tokens) was a float64 evaluation rounded to
nearest, labelled nowhere and able to sit an ulp under the value; the row-block route (matrices
above ``BLOCK_BYTES``) scaled its enclosures back by ``value * 2^e`` rounded to nearest, which in the
subnormal range lost the enclosure (a max row of 4.4e-323 for an exact 4.58e-323).  References:
sums of squares of the stored floats in rationals, square roots in mpmath at 50 digits.
"""

from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover.norms._analyze import _max_row_norm
from transcover.norms._blocked import blocked_matrix_norms


def _exact_norms(E: np.ndarray) -> tuple[mpmath.mpf, mpmath.mpf, mpmath.mpf]:
    """(max row norm, Frobenius, (2,1) over columns) of the stored values, exactly up to mpmath's sqrt."""
    def root(q: Fraction) -> mpmath.mpf:
        return mpmath.sqrt(mpmath.mpf(q.numerator) / q.denominator)

    with mpmath.workdps(50):
        rows = [sum(Fraction(float(x)) ** 2 for x in r) for r in E]
        cols = [sum(Fraction(float(x)) ** 2 for x in E[:, j]) for j in range(E.shape[1])]
        return root(max(rows)), root(sum(rows)), mpmath.fsum(root(c) for c in cols)


def test_subnormal_rows_keep_their_enclosure_in_the_row_block_route():
    E = np.array([[4e-323, 1e-323, 2e-323]])  # 8, 2 and 4 times 2^-1074: the exact max row is 9.17 x 2^-1074
    mr, fro, l21 = _exact_norms(E)
    _, fr, l2, mx = blocked_matrix_norms(E, rtol=1e-3)
    assert mx >= mr and _max_row_norm(E) >= mr
    assert fr.lower <= fro <= fr.upper and l2.lower <= l21 <= l2.upper


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 5), n=st.integers(1, 24), log2_scale=st.integers(-1074, 1000),
       f32=st.booleans(), seed=st.integers(0, 2**16))
def test_max_row_norm_is_an_upper_bound_at_every_scale(m, n, log2_scale, f32, seed):
    dtype = np.float32 if f32 else np.float64
    if f32:
        log2_scale = max(-149, min(log2_scale, 120))  # float32's range
    with np.errstate(over="ignore"):
        E = (np.random.default_rng(seed).standard_normal((m, n)) * 2.0**log2_scale).astype(dtype)
    if not np.isfinite(E).all():
        return  # a Gaussian draw times 2^1000 can pass float64's maximum: nothing stored to measure
    mr, fro, l21 = _exact_norms(E)
    assert _max_row_norm(E) >= mr
    _, fr, l2, mx = blocked_matrix_norms(E, rtol=1e-3)
    assert mx >= mr
    assert fr.lower <= fro <= fr.upper and l2.lower <= l21 <= l2.upper
    # and it is still the norm, not a loose pad: within a few ulps at normal scales
    if 2.0**-900 < float(mr) < 2.0**900:
        assert _max_row_norm(E) <= float(mr) * (1 + 1e-13)


def test_max_row_norm_refuses_non_finite_rows():
    with pytest.raises(ValueError, match="NaN or infinite"):
        _max_row_norm(np.array([[1.0, np.nan]]))
