"""The logs of net and packing sizes lie on the side of their claim (red team 220, THEORY F112, logs of counts).

``math.log`` rounds to nearest: for 1026 of the counts 2..2000 it is below ``ln k`` (``math.log(4)`` is 1 ulp under
``ln 4``), so a certified upper bound ``log_N_upper`` came out under the value it certifies, and for the others a lower
bound came out above it.  Every count is compared with mpmath's ``ln k`` at 320 bits (conftest), far beyond the ulp.
"""

from __future__ import annotations

import math

import mpmath
import torch

from transcover.empirical import CoveringEstimate, MonteCarloCovering, UniformSearchResult

COUNTS = list(range(1, 2001)) + [2**31 - 1, 10**12 + 39, 2**62]


def _estimate(k: int) -> CoveringEstimate:
    return CoveringEstimate(eps=1.0, q=math.inf, n_functions=k, n_samples=1, n_outputs=1, net_size=k, packing_size=k)


def _monte_carlo(k: int) -> MonteCarloCovering:
    return MonteCarloCovering(eps=(1.0,), q=math.inf, checkpoints=(k,), net_sizes=((k,),), packing_sizes=((k,),),
                              n_samples=1, n_outputs=1)


def _uniform(k: int) -> UniformSearchResult:
    return UniformSearchResult(eps=1.0, q=math.inf, n=1, n_functions=k, best_packing=k, random_packings=(k,),
                               greedy_packings=(k,), best_inputs=torch.zeros(1, 1, 1))


def test_the_counts_include_logs_that_nearest_rounding_puts_on_either_side():
    """The test can fail: among these counts math.log lands below ln k for some and above for others."""
    below = [k for k in COUNTS if mpmath.mpf(math.log(k)) < mpmath.log(k)]
    above = [k for k in COUNTS if mpmath.mpf(math.log(k)) > mpmath.log(k)]
    assert 4 in below and 11 in above and len(below) > 500 and len(above) > 500


def test_upper_bounds_are_at_least_and_lower_bounds_at_most_the_exact_log():
    for k in COUNTS:
        exact = mpmath.log(k)
        up = [_estimate(k).upper]
        low = [_estimate(k).lower, _monte_carlo(k).log_packing_lower(0), _monte_carlo(k).log_covering_lower(0),
               _uniform(k).lower]
        for q in up:
            assert mpmath.mpf(q.value) >= exact, (k, q.source, q.value)
            assert q.value <= math.nextafter(math.log(k), math.inf)  # within one ulp: no looser than needed
        for q in low:
            assert mpmath.mpf(q.value) <= exact, (k, q.source, q.value)
            assert q.value >= math.nextafter(math.log(k), -math.inf)
        # the estimate claims no side: the float nearest ln k
        est = _monte_carlo(k).log_N_estimate(0).value
        assert abs(mpmath.mpf(est) - exact) <= abs(mpmath.mpf(math.nextafter(est, math.inf)) - exact)
        assert abs(mpmath.mpf(est) - exact) <= abs(mpmath.mpf(math.nextafter(est, -math.inf)) - exact)


def test_the_red_team_values():
    assert _estimate(4).upper.value == math.nextafter(1.3862943611198906, math.inf)  # was 1.3862943611198906 < ln 4
    assert mpmath.mpf(_monte_carlo(11).log_covering_lower(0).value) < mpmath.log(11)  # was 1.25e-16 above
    assert _estimate(1).upper.value == 0.0 == _estimate(1).lower.value  # ln 1 = 0 exactly, not -1 ulp
