"""Positional encodings: Δ computed exactly, the F16b dimension, the Welch floor."""

import itertools
import math
from fractions import Fraction

import pytest
import torch

from transcover import InputError, Kind
from transcover.approx import (
    coherence, designed_encoding, equiangular_encoding, random_sign_dimension, random_sign_encoding,
    sinusoidal_encoding, welch_bound, welch_dimension,
)


@pytest.mark.parametrize("n, d, seed", [(5, 3, 0), (12, 16, 1), (20, 7, 2)])
def test_random_sign_delta_is_exact(n, d, seed):
    enc = random_sign_encoding(n, d, seed=seed)
    signs = [[int(round(float(x) * math.sqrt(d))) for x in row] for row in enc.P]
    brute = max(abs(Fraction(sum(a * b for a, b in zip(signs[i], signs[j])), d))
                for i, j in itertools.combinations(range(n), 2))
    assert enc.delta_fraction == brute and enc.kind is Kind.EXACT


@pytest.mark.parametrize("enc", [sinusoidal_encoding(9, 6), equiangular_encoding(7, 0.3), designed_encoding(24, 8, steps=40)])
def test_coherence_matches_brute_force(enc):
    P = enc.P.double()
    brute = max(abs(float(P[i] @ P[j])) for i, j in itertools.combinations(range(enc.n), 2))
    assert abs(enc.delta - brute) <= 8 * enc.dim * torch.finfo(torch.float64).eps
    assert coherence(P) == enc.delta


def test_equiangular_has_the_prescribed_delta():
    for delta in (0.0, 0.1, 0.49):
        assert abs(equiangular_encoding(11, delta).delta - delta) <= 16 * torch.finfo(torch.float64).eps


def test_designed_beats_random_and_respects_welch():
    n, d = 40, 12
    des = designed_encoding(n, d, seed=0, steps=60)
    rnd = random_sign_encoding(n, d, seed=0)
    assert welch_bound(n, d) <= des.delta <= rnd.delta
    assert welch_bound(n, d) <= rnd.delta


def test_random_sign_dimension_delivers():
    n, delta, fail = 32, 0.5, 0.1
    d = random_sign_dimension(n, delta, fail)
    assert d == math.ceil(2 * math.log(n * n / fail) / delta**2)
    misses = sum(random_sign_encoding(n, d, seed=s).delta >= delta for s in range(20))
    assert misses <= 6  # P(miss) <= 0.1 per seed; far fewer in practice
    # and the Welch floor: no design of that n can have Delta below it in fewer dims
    k = welch_dimension(n, delta)
    assert welch_bound(n, k) <= delta + 1e-12 and (k == 1 or welch_bound(n, k - 1) > delta)


@pytest.mark.parametrize("call, match", [
    (lambda: random_sign_dimension(10, 0.0), "delta"),
    (lambda: random_sign_dimension(1, 0.2), "n must"),
    (lambda: random_sign_dimension(10, 0.2, 1.5), "failure_prob"),
    (lambda: equiangular_encoding(4, 1.0), "delta"),
    (lambda: random_sign_encoding(0, 4), "n must"),
    (lambda: sinusoidal_encoding(4, 5), "even"),
    (lambda: coherence(torch.ones(3, 2)), "unit rows"),
])
def test_bad_encoding_arguments(call, match):
    with pytest.raises(InputError, match=match):
        call()


def test_a_hand_built_encoding_cannot_claim_a_smaller_delta():
    """Stop 36 left open, closed at stop 38: an Encoding built by hand was trusted for its delta, which Lemma H.1's
    gap R(1 - 2Δ) and every error bound read."""
    import pytest
    import torch

    from transcover import InputError
    from transcover._results import Kind
    from transcover.approx._encodings import Encoding, coherence, random_sign_encoding

    e = random_sign_encoding(40, 16, seed=3)
    Encoding(e.P, e.delta, Kind.EXACT, "mine")  # the true delta is accepted
    Encoding(e.P, 0.49, Kind.EXACT, "mine") if e.delta <= 0.49 else None  # a larger (weaker) claim too
    with pytest.raises(InputError, match="below the encodings' coherence"):
        Encoding(e.P, e.delta / 2, Kind.EXACT, "mine")
    P = torch.eye(3, dtype=torch.float64)
    P[1] = torch.tensor([0.6, 0.8, 0.0], dtype=torch.float64)
    assert coherence(P) == pytest.approx(0.6)
    with pytest.raises(InputError):
        Encoding(P, 0.0, Kind.EXACT, "mine")
