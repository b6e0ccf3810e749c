"""The approximation lab at its edges (red team of stop 36).

Found: the off-target mass overflowed for gaps beyond ln(n-1) + 709.8 (``R = 1000`` crashed the
bound and the CLI); ``advise`` divided 0 by 0 for a Hölder constant 0 and printed NaN for inf; the
trained decomposition's ratio was NaN on float32 models; the advice took ``B_KQ = R`` where the
construction's score matrix has norm ``(3 + s) R``; the designed encoding kept two rows equal up to
sign (Δ = 1); an empty ridge and a one-grid rate fit raised bare errors.  References: mpmath, the
construction's own weights by float64 SVD.
"""

import math

import mpmath
import pytest
import torch

from transcover import InputError
from transcover.approx import (advise, build_construction, construction_capacity, decompose_trained,
                               designed_encoding, equiangular_encoding, holder_ridge, mlp_rate_sweep,
                               off_target_mass_bound)
from transcover.approx._encodings import coherence, random_sign_encoding


@pytest.mark.parametrize("n", [2, 16, 10**6])
@pytest.mark.parametrize("gap", [-800.0, -30.0, 0.0, 3.5, 700.0, 712.0, 713.0, 750.0, 1e4, 1e300])
def test_off_target_mass_matches_mpmath_at_every_gap(n, gap):
    with mpmath.workdps(60):
        t = (n - 1) * mpmath.exp(-mpmath.mpf(gap))
        exact = t / (1 + t)
    got = off_target_mass_bound(n, gap)
    assert 0.0 <= got <= 1.0
    if exact > mpmath.mpf(2) ** -1000:
        # log t = ln(n-1) - g is formed in floats: its absolute error (|log t| + 2) u becomes exp's relative one
        log_t = math.log(n - 1) - gap
        assert abs(got - exact) <= (abs(log_t) + 8) * 2.0**-52 * exact
    else:
        assert got <= 2.0**-1000  # deep in the underflow: 0 or a subnormal, never a crash


def test_off_target_mass_refuses_non_integers_and_nan():
    for n, gap in ((2.5, 1.0), (True, 1.0), (4, math.nan)):
        with pytest.raises(InputError):
            off_target_mass_bound(n, gap)


def test_a_huge_temperature_gives_a_bound_not_a_crash():
    c = build_construction(holder_ridge((1, 3), 1.0), equiangular_encoding(8, 0.2), R=1000.0, grid=4)
    b = c.bound()
    # the exact value (about e^-800, below float64's range) is above 0: the bound is the smallest float above it, not
    # 0, since stop 38 rounds it up
    assert 0.0 < b.attention.value <= 1e-300 and math.isfinite(b.total.value)


@pytest.mark.parametrize("L", [0.0, math.inf, math.nan, -1.0])
def test_advise_refuses_a_degenerate_holder_constant(L):
    with pytest.raises(InputError, match="Hölder constant"):
        advise(2, 1.0, 16, 1000, holder_constant=L)


@pytest.mark.parametrize("s, lam", [(1, 0.0), (2, 0.0), (4, 0.2)])
def test_the_constructions_score_norm_is_3_plus_s_times_R(s, lam):
    """What the advice now charges: B_KQ = (3 + s) R sqrt(1 + λ²) under the ball norm (B_X = 1)."""
    c = build_construction(holder_ridge(tuple(range(s)), 1.0), equiangular_encoding(8, 0.2), R=10.0, grid=2,
                           key_leak=lam)
    assert construction_capacity(c).B_KQ == pytest.approx((3 + s) * 10.0 * math.sqrt(1 + lam * lam), rel=1e-9)


def test_float32_decomposition_has_a_number_not_nan():
    tgt = holder_ridge((1, 3), 1.0, seed=0)
    c = build_construction(tgt, equiangular_encoding(8, 0.2), R=60.0, grid=4)
    X = torch.rand(300, 8, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2 - 1
    r64 = decompose_trained(c.model, tgt, X).attention_bound_ratio
    r32 = decompose_trained(c.model.float(), tgt, X.float()).attention_bound_ratio
    assert math.isfinite(r32) and math.isfinite(r64)


@pytest.mark.parametrize("n, d", [(8, 3), (12, 5)])
def test_designed_encoding_separates_rows_the_random_start_repeats(n, d):
    start = random_sign_encoding(n, d, seed=0)
    assert start.delta == pytest.approx(1.0)  # two rows equal up to sign: the hard start
    e = designed_encoding(n, d, seed=0)
    assert e.delta < 0.7 and e.delta == pytest.approx(coherence(e.P))


def test_empty_ridge_and_one_grid_fit_are_refused():
    with pytest.raises(InputError, match="relevant position"):
        holder_ridge((), 1.0)
    for grids in ({1: (4,)}, {1: (1,)}, {1: (4, 4)}):
        with pytest.raises(InputError, match="two distinct grids"):
            mlp_rate_sweep([(1.0, 1)], grids, n_targets=1)
