"""Red team, issue 12 stop 13: F42a (branch speed13) -- skipping F31d's Grams on a Rayleigh-quotient lower bound
-- attacked at MiniLM's size (d = 384, d_ff = 1536: the rounding margin 12 (d + d_ff + 8) u sum_k c_k ||r_k||^2 is
the thinnest there), on the exact-cancellation case where both lower bounds are negative (their product is
positive: harmless only because |l| <= 12 d (d + d_ff + 8) u lambda_max), and at the skip's boundary
(the caller's bound equal to the lower bound itself).  Depends on speed13 (merge with it).
"""

from __future__ import annotations

import torch

from lipschitz_testkit import gelu_ffn_case
from transcover.lipschitz._local_jacobian import certified_lmax
from transcover.lipschitz._local_sharp import GELU_SLOPE_RANGE, ffn_unit_drift, gram_lower, unit_slope_moves


def _gram(R: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (R[None] * c[:, None, :]) @ R.T[None]


def test_gram_lower_at_minilm_size_with_cancelling_columns():
    """d = 384, d_ff = 1536: half the columns nearly parallel with alternating signs (the quotient's inner products
    cancel), weights over 12 decades with a third zero; below the certified lambda_max of the formed Gram."""
    g = torch.Generator().manual_seed(13)
    d, m = 384, 1536
    R = torch.randn(d, m, generator=g, dtype=torch.float64) * 0.05
    R[:, : m // 2] = R[:, :1] * torch.where(torch.arange(m // 2) % 2 == 0, 1.0, -1.0) + 1e-9 * R[:, : m // 2]
    c = torch.rand(2, m, generator=g, dtype=torch.float64) * 10 ** (12 * torch.rand(2, m, generator=g,
                                                                                      dtype=torch.float64) - 6)
    c[:, ::3] = 0.0
    for iters in (0, 4):
        low = gram_lower(R, c, iters=iters)
        cert = certified_lmax(_gram(R, c))
        assert bool((low <= cert).all()), (iters, low, cert)
    assert bool((gram_lower(R, c) >= 0.5 * cert).all())  # the power steps make it useful


def test_two_negative_lower_bounds_never_skip_a_smaller_bound():
    """Columns (1, -1) and (1e-10, 1e-10): from the all-ones start the iterate stays exactly on (1, 1), the
    quotient is 2e-20 and, before the clamp, each lower bound was about -3e-14 (their product's root positive).
    Now each is clamped at 0 (a formed Gram's lambda_max is >= 0), so the product is 0, and the bound stays
    below F31d's value (about 2)."""
    R = torch.tensor([[1.0, 1e-10], [-1.0, 1e-10]], dtype=torch.float64)
    c = torch.ones(1, 2, dtype=torch.float64)
    lo = gram_lower(R, c)
    assert float(lo[0]) == 0.0  # exactly 0: the quotient 2e-20 minus the error term is -3e-14, clamped
    low = float(torch.sqrt(lo * lo)[0])
    assert low <= float(torch.sqrt(certified_lmax(_gram(R, c)) ** 2)[0])


def test_skip_at_its_boundary_returns_the_same_minimum():
    """Caller's bounds exactly equal to the lower bound (the skip fires on equality) and one ulp either side: every
    min with them is the min without the skip, for uncapped and capped tokens."""
    ffn, _, z, n1, _ = gelu_ffn_case()
    W1, W2 = ffn.W_1.double(), ffn.W_2.double()
    for r in (0.01, 0.25, 3.0):
        rh = torch.full((3,), r, dtype=torch.float64)
        full, half = ffn_unit_drift(ffn, z, n1, rh)
        c = unit_slope_moves(z, n1, rh).clamp(max=GELU_SLOPE_RANGE)
        low = torch.sqrt(gram_lower(W1, c) * gram_lower(W2.T, c)) * (1 - 1e-12)
        for b in (low, torch.nextafter(low, torch.zeros_like(low)), torch.nextafter(low, full)):
            f, h = ffn_unit_drift(ffn, z, n1, rh, above=(b, b / 2))
            assert torch.equal(torch.minimum(f, b), torch.minimum(full, b)), (r, f, full, b)
            assert torch.equal(torch.minimum(h, b / 2), torch.minimum(half, b / 2)), (r, h, half, b)
