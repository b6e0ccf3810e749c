"""The suite's exact references share mpmath's one global precision; conftest gives every test 320 bits and restores
what it found, so no test's setting reaches another (a 30-digit setting once broke an 80-digit reference in the next
file on the same xdist worker)."""

import mpmath


def test_a_test_may_lower_the_precision_for_itself():
    assert mpmath.mp.prec == 320
    mpmath.mp.dps = 10


def test_the_next_test_starts_from_320_bits_again():
    assert mpmath.mp.prec == 320
