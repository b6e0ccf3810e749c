"""The rows route of the local exact-Jacobian bound (issue 12, ``lipschitz._local_rows``): the
weighted row Gram against the autograd blocks, the FFN and attention drift constants against
adversaries, the whole bound on the ball against the pair/Jacobian adversary, homogeneity, and the
regressions it fixes (vacuous drift on small balls, the exact route skipped above 4096 entries).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import random_spec
from test_lipschitz_local import adversary
from transcover.lipschitz._local import layer_local
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms, layer_jacobian, row_norm_lower
from transcover.lipschitz._local_rows import (
    _HeadMoments, attention_drift_rows, drift_kappa, ffn_drift_constant, layer_rows, row_weights,
)
from transcover.model._functional import layer_forward

CASES = [dict(norm=n, placement=p, biases=b, causal=c)
         for n in ("layernorm", "rmsnorm") for p in ("post", "pre") for b in (False, True) for c in (False, True)]


def _X(seed: int, T: int = 4, d: int = 6) -> torch.Tensor:
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _blocks(layer, X):  # noqa: ANN001, ANN202
    return torch.autograd.functional.jacobian(lambda Z: layer_forward(layer, Z), X).permute(0, 2, 1, 3)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6], CASES[13]])
def test_row_gram_point_bound_matches_the_blocks(case):
    """Post-LN the weighted Gram is exact: lambda_max(sum_j J_ij J_ij^T / w_j) sum_j w_j from the
    autograd blocks, with F34c's weights, bounds the certified value up to its pads (F56's optimised weights
    can only lower it; their own Gram against the blocks: test_local_wts18); pre-LN it is an upper bound
    (N_j N_j^T <= ||N_j||^2 I).  Both sit above the attained row norms."""
    spec = random_spec(11, act="gelu", **case)
    layer = spec.layers[0]
    X = _X(2)
    J = _blocks(layer, X)
    lj = layer_rows(layer, X, [1e-9])[0]
    lo = row_norm_lower(J)
    assert bool((lo <= lj.point_rows).all())
    if case["placement"] == "post":
        heads = _head_data(layer.attention, X)
        w = row_weights(heads, 4, _weight_norms(layer)["O"])
        ref = torch.stack([torch.linalg.eigvalsh(sum(J[i, j] @ J[i, j].T / w[i, j] for j in range(4)))[-1]
                           for i in range(4)])
        ref = torch.sqrt(ref * w.sum(dim=1))
        # the certified lambda_max ladder starts at 1e-3 above the power-iteration value (sqrt: 5e-4)
        assert bool((lj.point_rows <= ref * (1 + 1e-3)).all()), (lj.point_rows, ref)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), centred=st.booleans())
def test_ffn_drift_constant_is_never_beaten(seed, centred):
    """Adam ascent on ||F(h') - F(h)|| / ||h' - h|| (pairs, restarts) stays below kappa."""
    spec = random_spec(seed, act="gelu", norm="layernorm", d=6, dff=10, scale=2.0)
    ffn = spec.layers[0].ffn
    W1, W2 = ffn.W_1.double(), ffn.W_2.double()
    kappa = ffn_drift_constant(ffn, centred=centred)
    P = torch.eye(6, dtype=torch.float64) - (1.0 / 6 if centred else 0.0)

    def F(h):  # noqa: ANN001, ANN202
        z = h @ W1
        s = torch.special.ndtr(z) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # GELU'
        return P @ (W2.T * s) @ W1.T

    g = torch.Generator().manual_seed(seed)
    best = 0.0
    for _ in range(2):
        a = torch.randn(6, generator=g, dtype=torch.float64).requires_grad_(True)
        b = (a.detach() + 0.3 * torch.randn(6, generator=g, dtype=torch.float64)).requires_grad_(True)
        opt = torch.optim.Adam([a, b], lr=0.05)
        for _ in range(40):
            ratio = torch.linalg.matrix_norm(F(a) - F(b), ord=2) / (a - b).norm()
            best = max(best, float(ratio.detach()))
            opt.zero_grad()
            (-ratio).backward()
            opt.step()
    assert best <= kappa, (best, kappa)


@pytest.mark.parametrize("first", [False, True])
def test_drift_kappa_reads_the_shared_w1_factors_as_fresh_calls(first):
    """``drift_kappa`` computes each of kappa, kappaP on first use and shares the ``W_1`` factors between them
    (``norms["kappa_w1"]``): whichever comes first, both equal fresh ``ffn_drift_constant`` calls exactly, a second
    read computes nothing, and through the shared factors the constant keeps F17c's exact power-of-two degrees (2 in
    ``W_1``, 1 in ``W_2``); two layers in turn, so a factor kept from another layer would show."""
    two = lambda W, e: torch.ldexp(W.double(), torch.tensor(e))  # noqa: E731
    for seed, a, b in ((5, 0, 0), (5, 3, -5), (6, 0, 0), (5, -40, 20), (6, 7, 1)):
        ffn = random_spec(seed, act="gelu", norm="layernorm", d=6, dff=10, scale=2.0).layers[0].ffn
        f = dataclasses.replace(ffn, W_1=two(ffn.W_1, a), W_2=two(ffn.W_2, b))
        norms: dict = {}
        got = {c: drift_kappa(f, norms, c) for c in (first, not first)}
        assert set(norms) == {"kappa", "kappaP", "kappa_w1"}
        for c in (False, True):
            fresh = ffn_drift_constant(f, centred=c)
            assert got[c] == fresh == drift_kappa(f, norms, c), (seed, a, b, c, got[c], fresh)
            assert fresh == math.ldexp(ffn_drift_constant(ffn, centred=c), 2 * a + b), (seed, a, b, c)
        assert got[True] != got[False]  # the centred constant is its own (P w2_k), not the shared one


@pytest.mark.parametrize("seed", [1, 7])
def test_attention_drift_rows_bound_the_head_jacobian_change(seed):
    """At random points of B(X, r): the head's blocks Z^h = W_V^T Q^h (autograd of P X W_V) move in
    nu_i by at most the certified drift (row norms attained by alternating maximisation)."""
    spec = random_spec(seed, act="gelu", norm="layernorm", biases=True, scale=1.5)
    attn = spec.layers[0].attention
    X = _X(seed)
    norms = _weight_norms(spec.layers[0])
    from transcover.model import attention_scores

    def head(Z, h):  # noqa: ANN001, ANN202
        P = torch.softmax(attention_scores(attn, Z, h), dim=-1)
        return P @ Z @ attn.W_V[h].double()

    g = torch.Generator().manual_seed(seed)
    for r in (1e-2, 0.2):
        bound = attention_drift_rows(_HeadMoments(_head_data(attn, X), attn.softmax_scale), r, norms)
        for h in range(attn.n_heads):
            J0 = torch.autograd.functional.jacobian(lambda Z: head(Z, h), X).permute(0, 2, 1, 3)
            for _ in range(4):
                E = torch.randn(X.shape, generator=g, dtype=torch.float64)
                E = E / E.norm(dim=1, keepdim=True) * r
                J1 = torch.autograd.functional.jacobian(lambda Z: head(Z, h), X + E).permute(0, 2, 1, 3)
                assert bool((row_norm_lower(J1 - J0) <= bound[h] * (1 + 1e-9)).all())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), case=st.sampled_from(CASES), rho=st.sampled_from([1e-3, 3e-2, 0.2]))
def test_rows_route_is_never_beaten(seed, case, rho):
    spec = random_spec(seed, act="gelu", **case)
    layer = spec.layers[0]
    X = _X(seed)
    lj = layer_rows(layer, X, [rho])[0]
    lo = adversary(lambda Z: layer_forward(layer, Z), X, rho, restarts=3, steps=30, seed=seed)
    assert lo <= lj.ball * (1 + 1e-12), (lo, lj.ball, lj.parts)
    # the certified per-token output radii (for the whole-network route)
    g = torch.Generator().manual_seed(seed + 1)
    out = layer_forward(layer, X)
    for _ in range(5):
        D = torch.randn(X.shape, generator=g, dtype=torch.float64)
        D = D / D.norm(dim=1, keepdim=True) * rho
        assert bool(((layer_forward(layer, X + D) - out).norm(dim=1) <= lj.output_radii).all())


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_homogeneity_in_the_output_norm(norm):
    """Post-LN: gamma, beta of the last norm times lam scale the layer, its point and its ball
    bound by lam (the last norm's floor, and so every radius, does not depend on its gamma)."""
    spec = random_spec(21, act="gelu", norm=norm, placement="post")
    layer = spec.layers[0]
    X = _X(6)
    base = layer_rows(layer, X, [1e-2])[0]
    for lam in (0.25, 4.0):
        n = layer.norm_ffn
        bias = None if n.bias is None else n.bias * lam
        scaled = dataclasses.replace(layer, norm_ffn=dataclasses.replace(n, weight=n.weight * lam, bias=bias))
        b = layer_rows(scaled, X, [1e-2])[0]
        assert b.point == pytest.approx(lam * base.point, rel=1e-7)
        assert b.ball == pytest.approx(lam * base.ball, rel=1e-7)


def test_regression_drift_on_a_small_ball_is_not_vacuous():
    """Regression (issue 12): the blocks route's drift multiplied product constants (||I+F||, ||D1||
    and the attention's global moments) and reached 542x the attained norm at rho = 3e-2 here; the
    rows route stays within 100x."""
    spec = random_spec(1, act="gelu", norm="layernorm", placement="post", biases=True)
    layer = spec.layers[0]
    X = _X(1)
    lo = float(row_norm_lower(_blocks(layer, X)).max())
    lj = layer_rows(layer, X, [3e-2])[0]
    assert lj.ball <= 100 * lo, (lj.ball, lo)
    assert lj.ball < layer_jacobian(layer, X, 3e-2, route="blocks").ball


def test_regression_exact_route_runs_above_4096_entries():
    """Regression (issue 12): ``layer_local`` skipped the exact route when T*d > 4096 (MiniLM above
    10 tokens), leaving the product route's bound; it now runs there by default."""
    spec = random_spec(2, act="gelu", norm="layernorm", placement="post", d=64, H=2, dh=32, dff=96)
    layer = spec.layers[0]
    X = torch.randn(65, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    ll = layer_local(layer, X, 1e-6)
    assert math.isfinite(ll.exact_ball)
    assert ll.upper <= ll.exact_ball


@pytest.mark.parametrize("case", [CASES[1], CASES[5]])
def test_structured_lower_is_attained_by_autograd(case):
    """``row_lower`` works through the factors; its best V, pushed through an autograd JVP of the
    layer, attains the reported value, which no certified row exceeds and which matches the
    alternating search on the explicit blocks."""
    spec = random_spec(9, act="gelu", **case)
    layer = spec.layers[0]
    X = _X(4, T=5)
    lj = layer_rows(layer, X, [1e-3], lower=5)[0]
    i, V = lj.lower_V
    _, dy = torch.autograd.functional.jvp(lambda Z: layer_forward(layer, Z), (X,), (V,))
    assert bool((V.norm(dim=1) <= 1 + 1e-12).all())
    assert float(dy[i].norm()) == pytest.approx(float(lj.lower_rows[i]), rel=1e-10)
    assert bool((lj.lower_rows <= lj.point_rows).all())
    ref = row_norm_lower(_blocks(layer, X))
    assert float(lj.lower_rows.max()) >= 0.99 * float(ref.max())


@pytest.mark.parametrize("case", [CASES[2], CASES[4]])
def test_drift_rows_bound_the_jacobian_change(case):
    """``drift_rows`` bounds sup over the ball of nu_i(J(X') - J(X)) itself (the whole-network route
    composes it), not only the ball bound minus the point bound."""
    spec = random_spec(13, act="gelu", **case)
    layer = spec.layers[0]
    X = _X(5)
    J0 = _blocks(layer, X)
    g = torch.Generator().manual_seed(3)
    for r in (1e-2, 0.2):
        lj = layer_jacobian(layer, X, r)
        for _ in range(4):
            E = torch.randn(X.shape, generator=g, dtype=torch.float64)
            E = E / E.norm(dim=1, keepdim=True) * r
            assert bool((row_norm_lower(_blocks(layer, X + E) - J0) <= lj.drift_rows * (1 + 1e-9)).all())


def test_regression_sharp_head_ball_bound_at_a_moderate_radius():
    """Regression (issue 12): with a sharp head (W_Q x 8) the rows route's stage radii were r times a
    Jacobian sup whose softmax envelopes grew like e^{2 delta}; at r = 0.01 the ball bound was 566x the
    attained norm at X (old code); the function-based radii and per-key envelopes of F31 keep it within
    100x (38.9x)."""
    spec = random_spec(1, act="gelu", norm="layernorm", placement="post", d=8, H=2, dh=4, dff=16, biases=True)
    layer = spec.layers[0]
    layer = dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, W_Q=layer.attention.W_Q * 8))
    X = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2
    lo = float(row_norm_lower(_blocks(layer, X)).max())
    lj = layer_rows(layer, X, [0.01])[0]
    assert lj.ball <= 100 * lo, (lj.ball, lo)


@pytest.mark.parametrize("route", ["rows", "blocks"])
@pytest.mark.parametrize("case", [dict(norm="rmsnorm", placement="pre", act="relu"),
                                  dict(norm="none", placement="post", act="relu"),
                                  dict(norm="layernorm", placement="post", act="gelu", biases=True)])
def test_radius_zero_gives_the_point_bound(route, case):
    """``B(X, 0)`` is the point: every drift term, stage radius and drift row is exactly 0 and the ball
    rows are the point rows, alone or after a larger ball in the same call (F37b's scaled references);
    with ReLU the global FFN drift ``kappa r`` was ``inf * 0`` = nan, reported as an inf drift."""
    from transcover.lipschitz._local_jacobian import layer_jacobians

    spec = random_spec(13, d=8, H=2, dh=4, dff=16, L=1, **case)
    X = _X(3, T=5, d=8)
    for radii in ([0.0], [1e-2, 0.0]):
        lj = layer_jacobians(spec.layers[0], X, radii, route=route)[-1]
        assert lj.radius == 0.0
        assert torch.equal(lj.drift_rows, torch.zeros_like(lj.drift_rows)), lj.parts
        assert torch.equal(lj.total_rows, lj.point_rows)
        assert all(v == 0.0 for v in lj.parts.values()), lj.parts
        assert all(bool((v == 0).all()) for v in lj.stage_radii.values())


@pytest.mark.parametrize("seed", [0, 1])
def test_post_ln_stage_rows_at_x_bound_each_prefix_map(seed):
    """The stage functions alone (``_local_stages``): post-LN, each point row constant of ``post_point``
    bounds the attained rows of the exact Jacobian of its prefix map (autograd blocks):
    ``a_pt`` of ``X + Attn(X)``, ``aP_pt`` of its centred version, ``h_pt`` after the first LayerNorm,
    ``g_pt`` of the centred FFN sublayer's output (a LayerNorm follows) and ``point`` of the layer."""
    from transcover.lipschitz import _local_stages as stg
    from transcover.model import attention_forward, ffn_forward

    spec = random_spec(20 + seed, act="gelu", norm="layernorm", placement="post", biases=True, d=8, H=2, dh=4,
                       dff=16, scale=2.0)
    layer = spec.layers[0]
    X = _X(seed, T=5, d=8)
    at = stg.layer_at_x(layer, X, _weight_norms(layer)["O"])
    pt = stg.post_point(at, stg.attention_row_gram(at))
    centre = lambda Y: Y - Y.mean(dim=1, keepdim=True)  # noqa: E731
    s1 = lambda Z: Z + attention_forward(layer.attention, Z)  # noqa: E731
    h = lambda Z: layer.norm_attn(s1(Z))  # noqa: E731
    s2 = lambda Z: h(Z) + ffn_forward(layer.ffn, h(Z))  # noqa: E731
    maps = {"a_pt": s1, "aP_pt": lambda Z: centre(s1(Z)), "h_pt": h, "g_pt": lambda Z: centre(s2(Z)),
            "point": lambda Z: layer_forward(layer, Z)}
    for name, f in maps.items():
        J = torch.autograd.functional.jacobian(f, X).permute(0, 2, 1, 3)
        lo = row_norm_lower(J)
        assert bool((lo <= getattr(pt, name)).all()), (name, lo, getattr(pt, name))
        assert bool((getattr(pt, name) <= 2 * lo).all()), name  # a bound of this map (1.2-1.6 here), not a loose one
