"""F38: the FFN's second-order term by one tensor norm per token (``_local_ffn2``), attacked by Adam ascent."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batched_drift_ascents import ffn_ascent
from lipschitz_testkit import random_spec
from transcover.lipschitz._local_ffn2 import ffn_hadamard, ffn_second_norms, ffn_taylor_drift, gelu3_sup


def _clip(E: torch.Tensor, r: float) -> torch.Tensor:
    return E * torch.clamp(r / E.norm(dim=-1, keepdim=True).clamp(min=1e-300), max=1.0)


def _gelu3_autograd(z: torch.Tensor) -> torch.Tensor:
    """GELU''' by three autograd passes through torch's exact GELU (independent of ``_local_ffn2``'s formula)."""
    z = z.clone().requires_grad_(True)
    y = torch.nn.functional.gelu(z)
    for _ in range(3):
        (y,) = torch.autograd.grad(y.sum(), z, create_graph=True)
    return y.detach()


def test_gelu3_sup_against_a_dense_grid():
    """On random intervals the sup is at least every grid value of |GELU'''| (autograd) and within the grid's
    resolution of the largest one; the global sup is the analytic 0.7788 at z = +-0.7923."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, generator=g, dtype=torch.float64) * 3
    b = a + torch.rand(300, generator=g, dtype=torch.float64) * 4
    t = torch.linspace(0, 1, 4001, dtype=torch.float64)
    grid = a[:, None] + (b - a)[:, None] * t[None]
    vals = _gelu3_autograd(grid.reshape(-1)).reshape(grid.shape).abs().amax(dim=1)
    sup = gelu3_sup(a, b)
    assert bool((vals <= sup).all())
    # GELU'''' is at most 2 in modulus, so the grid misses at most 2 * step / 2 at an interior maximum
    assert bool((sup <= vals + (b - a) / 4000 + 1e-12).all())
    top = gelu3_sup(torch.tensor([-10.0], dtype=torch.float64), torch.tensor([10.0], dtype=torch.float64))
    c = math.sqrt((7 - math.sqrt(33)) / 2)
    assert abs(float(top) - c * math.exp(-c * c / 2) / math.sqrt(2 * math.pi) * (4 - c * c)) < 1e-11


def _ffn(seed: int, d: int, dff: int, scale: float):  # noqa: ANN202
    return random_spec(seed, act="gelu", norm="layernorm", d=d, dff=dff, scale=scale, biases=True).layers[0].ffn


def _bounds(ffn, z: torch.Tensor, r: float, centred: bool) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    const = ffn_hadamard(ffn, centred=centred)
    return ffn_taylor_drift(const, ffn_second_norms(const, z), z, ffn.W_1.double().norm(dim=0),
                            torch.full((z.shape[0],), r, dtype=torch.float64))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), d=st.integers(8, 16), dff=st.integers(32, 64),
       scale=st.sampled_from([0.5, 2.0, 6.0]), centred=st.booleans())
def test_taylor_drift_and_remainder_are_never_beaten(seed, d, dff, scale, centred):
    """Per token on ||dh|| <= rh: Adam ascent on the drift and the remainder (``_ascent``) stays below F38's drift
    and mean drift (weights scaled to put the units near 0 (0.5) and saturated (6))."""
    ffn = _ffn(seed, d, dff, scale)
    g = torch.Generator().manual_seed(seed)
    Hs = torch.randn(2, d, generator=g, dtype=torch.float64) * 2
    z = Hs @ ffn.W_1.double() + ffn.b_1.double()
    for r in (0.05, 0.5):
        dF, half = _bounds(ffn, z, r, centred)
        for t in range(2):
            bd, bh = ffn_ascent(ffn, Hs[t], r, centred, g)
            assert bd <= float(dF[t]) and bh <= float(half[t]), (r, t, bd, dF[t], bh, half[t])


def test_first_order_norm_is_the_flattened_tensor_norm():
    """N2 is ``||W_2^T D K||_2`` with K's rows ``w1_k (x) w1_k`` (formed explicitly here, d x d^2) up to its pads; the
    first-order map dh -> W_2^T diag(GELU''(z) (W_1^T dh)) W_1^T, attacked by Adam over unit dh, stays below it (the
    rank-one sup, at most the flattened norm)."""
    ffn = _ffn(3, 10, 40, 2.0)
    h = torch.randn(1, 10, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    z = h @ ffn.W_1.double() + ffn.b_1.double()
    n2 = float(ffn_second_norms(ffn_hadamard(ffn, centred=False), z)[0])
    W1, W2 = ffn.W_1.double(), ffn.W_2.double()
    s2 = torch.exp(-0.5 * z[0] ** 2) / math.sqrt(2 * math.pi) * (2 - z[0] ** 2)
    K = torch.einsum("ak,bk->kab", W1, W1).reshape(W1.shape[1], -1)
    exact = float(torch.linalg.matrix_norm((W2.T * s2) @ K, ord=2))
    assert exact <= n2 <= exact * (1 + 1e-8), (exact, n2)
    g = torch.Generator().manual_seed(5)
    best = 0.0
    for _ in range(4):
        D = torch.randn(10, generator=g, dtype=torch.float64)
        D = (D / D.norm()).requires_grad_(True)
        opt = torch.optim.Adam([D], lr=0.05)
        for _ in range(150):
            with torch.no_grad():
                D.copy_(D / D.norm())
            val = torch.linalg.matrix_norm((W2.T * (s2 * (D @ W1))) @ W1.T, ord=2)
            best = max(best, float(val.detach()))
            opt.zero_grad()
            (-val).backward()
            opt.step()
    assert best <= n2, (best, n2)


def test_homogeneous_in_the_output_weights():
    """W_2 x c scales N2, the Hadamard Gram with W_2 and so both bounds by c (W_1 x c with h fixed is not
    homogeneous: the preactivations move)."""
    ffn = _ffn(7, 12, 48, 2.0)
    z = torch.randn(3, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64) @ ffn.W_1.double()
    n1 = ffn.W_1.double().norm(dim=0)
    rh = torch.full((3,), 0.3, dtype=torch.float64)

    def bounds(f):  # noqa: ANN001, ANN202
        const = ffn_hadamard(f, centred=True)
        return ffn_taylor_drift(const, ffn_second_norms(const, z), z, n1, rh)

    base = bounds(ffn)
    for c in (0.25, 3.0):
        got = bounds(dataclasses.replace(ffn, W_2=ffn.W_2 * c))
        assert torch.allclose(got[0], c * base[0], rtol=1e-9) and torch.allclose(got[1], c * base[1], rtol=1e-9)


@pytest.mark.parametrize("centred", [False, True])
def test_small_ffn_within_twice_the_ascent(centred):
    """A seeded FFN (d 8, d_ff 32, rh 0.2) attacked by ``_ascent``: both rows hold and are within 2x of what it
    attains (1.70x / 1.48x plain, 1.67x / 1.46x centred at stop 40; the values themselves were pinned to 1e-9 until
    stop 40's test audit: a hard-coded result)."""
    ffn = _ffn(11, 8, 32, 2.0)
    h = torch.randn(1, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    dF, half = _bounds(ffn, h @ ffn.W_1.double() + ffn.b_1.double(), 0.2, centred)
    bd, bh = ffn_ascent(ffn, h[0], 0.2, centred, torch.Generator().manual_seed(3))
    assert bd <= float(dF[0]) <= 2.0 * bd and bh <= float(half[0]) <= 2.0 * bh


def test_layer_rows_uses_f38_and_is_never_beaten(monkeypatch):
    """On a small post-LN layer (d 8, d_ff 64) at r = 0.01 F38 lowers the FFN stage radius and the ball bound (2.95
    against 4.02 and 1458 against 2811 without it; 3.50 / 4.67 and 2286 / 5145 before F41's smaller attention and
    first-norm remainders, which shrink the FFN's input radius on both sides), and Adam ascent on each stage's move and the pair/Jacobian
    adversary on the layer stay below them (a weak attack here: the stage ascent reaches 0.25 of 3.50, the slack being
    upstream; the tight attacks on F38 are the direct ones above)."""
    from test_lipschitz_local import adversary
    from test_local_sharp import assert_stage_radii_hold
    from transcover.lipschitz import _local_rows, _local_stages
    from transcover.model._functional import layer_forward

    # F54 (the FFN remainder on the first norm's reachable set) and F56 (optimised Gram weights: the ball 141.9 -> 90.8
    # without F38, the FFN's input radius smaller) also lower r2 here; F38's gain is measured without them
    from transcover.lipschitz import _local_row_weights
    monkeypatch.setattr(_local_row_weights, "reweighted", lambda at, gram, pt: (gram, pt))
    monkeypatch.setattr(_local_stages, "ffn_reach", lambda at, pt, gram, fn, ffn_drift, r: torch.full((at.T,), math.inf,
                                                                                                     dtype=torch.float64))
    layer = random_spec(1, act="gelu", norm="layernorm", placement="post", d=8, H=2, dh=4, dff=64, biases=True,
                        scale=2.0).layers[0]
    X = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    on = assert_stage_radii_hold(layer, X, [0.01])[0]
    assert adversary(lambda Z: layer_forward(layer, Z), X, 0.01, restarts=2, steps=30, seed=1) <= on.ball
    monkeypatch.setattr(_local_rows, "ffn_taylor_drift", lambda c, n2, z, n1, rh, *_: (torch.full_like(rh, math.inf),) * 2)
    no38 = _local_rows.layer_rows(layer, X, [0.01])[0]
    # F51a (each unit's own curvature) overlaps F38 here (without F38: r2 2.59 against 2.24); F38's gain is measured
    # against the route without either, as before F51a
    monkeypatch.setattr(_local_rows, "ffn_curvature_drift", lambda c, z, n1, rh, *_: (torch.full_like(rh, math.inf),) * 2)
    off = _local_rows.layer_rows(layer, X, [0.01])[0]
    assert float(on.stage_radii["ffn"].max()) < 0.8 * float(off.stage_radii["ffn"].max())
    assert on.ball < 0.6 * off.ball
    assert on.ball <= no38.ball <= off.ball
