"""The attention Jacobian drift from the second derivative (issue 12, ``lipschitz._local_drift``, THEORY
F35): the second derivative's formula against autograd, the per-head and heads-combined drift bounds
against an ascent over the ball (restarts, float64, the point ``Y`` and the unit rows ``E`` both
optimised; sharp heads, causal masks, biases), the layer bounds of the rows route that now use it
(pre- and post-LN) against the same ascent on the layer, homogeneity in ``W_V`` and ``W_O``, and a
regression number on a small model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import random_spec, weight_underflows
from batched_drift_ascents import drift_lower_batched
from transcover import InputError
from transcover.lipschitz._local_drift import (
    attention_drift_hessian, head_second_derivative, heads_joint, output_block_norms,
)
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_lower import drift_lower
from transcover.lipschitz._local_rows import (
    _head_output_norms, _heads_combined, _HeadMoments, attention_drift_f17d, attention_drift_rows, layer_rows,
)
from transcover.model import attention_forward, attention_scores
from transcover.model._functional import layer_forward


def _attn_layer(seed: int, *, qscale: float = 1.0, causal: bool = False, placement: str = "post",  # noqa: ANN202
                H: int = 2):
    """A small layer (d = 8, ``H`` heads of 8/H) with biases; ``qscale`` > 1 makes the heads sharp."""
    spec = random_spec(seed, act="gelu", norm="layernorm", placement=placement, d=8, H=H, dh=8 // H, dff=16,
                       biases=True, causal=causal)
    L = spec.layers[0]
    return _scaled(L, W_Q=L.attention.W_Q * qscale)


def _X(seed: int, T: int = 6, d: int = 8) -> torch.Tensor:
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.5


def _combined(layer, X: torch.Tensor, r: float, drift=attention_drift_hessian, joint: bool = True) -> torch.Tensor:  # noqa: ANN001
    """(T,) the drift rows of the attention sublayer (heads through ``W_O``) as the rows route forms them
    (``joint``: with F35d's joint combination of the heads)."""
    attn = layer.attention
    heads = _head_data(attn, X)
    norms = _weight_norms(layer)
    dZ = drift(_HeadMoments(heads, attn.softmax_scale), r, norms)
    Oh, _ = _head_output_norms(None, None, heads, X.shape[0])
    Oall = torch.full((X.shape[0],), float(norms["O"]), dtype=torch.float64)
    return _heads_combined(Oh, Oall, dZ, heads_joint(output_block_norms(heads), dZ) if joint else None)


def _scaled(layer, **weights):  # noqa: ANN001, ANN202
    return dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, **weights))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), causal=st.booleans(), qscale=st.sampled_from([1.0, 6.0]))
def test_second_derivative_matches_autograd(seed, causal, qscale):
    """``head_second_derivative`` (F35a) equals autograd's double JVP of the head ``P X W_V`` (to 1e-10
    of its size) at random points and tangents, every query, biases and causal masks included."""
    attn = _attn_layer(seed, qscale=qscale, causal=causal).attention
    g = torch.Generator().manual_seed(seed)
    X, D, E = (torch.randn(5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    heads = _head_data(attn, X)
    for h, (P, Y, q, Wq, Wk, Wv, _) in enumerate(heads):
        def head(Z, h=h):  # noqa: ANN001, ANN202
            return torch.softmax(attention_scores(attn, Z, h), dim=-1) @ Z @ Wv

        def tangent(Z):  # noqa: ANN001, ANN202
            return torch.autograd.functional.jvp(head, Z, E, create_graph=True)[1]

        ref = torch.autograd.functional.jvp(tangent, X, D)[1]
        G = attn.softmax_scale * Wq @ Wk.T
        for i in range(5):
            got = head_second_derivative(P[i], Y[i], q[i], G, Wv, i, D, E)
            assert float((got - ref[i]).norm()) <= 1e-10 * (1 + float(ref[i].norm())), (h, i, got, ref[i])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), causal=st.booleans(), qscale=st.sampled_from([1.0, 8.0, 30.0]),
       rho=st.sampled_from([1e-3, 3e-2, 0.3]), H=st.sampled_from([2, 4]))
@example(seed=1, causal=False, qscale=30.0, rho=1e-3, H=2)  # a weight underflows: refused (CI, stop 6)
def test_attention_drift_is_never_beaten(seed, causal, qscale, rho, H):
    """The ascent over ``Y`` in ``B(X, rho)`` and the unit rows ``E`` (restarts from random boundary
    points, every query) never finds ``nu_i(J_A(Y) - J_A(X))`` above the certified F35 rows of the
    sublayer (heads combined through ``W_O``) for random, sharp and causal heads."""
    layer = _attn_layer(seed, qscale=qscale, causal=causal, H=H)
    attn = layer.attention
    X = _X(seed)
    try:
        bound = _combined(layer, X, rho)
    except InputError:  # refused only where a visible weight really underflows (sharp heads, qscale 30)
        assert weight_underflows(attn, X)
        return
    assert not weight_underflows(attn, X)
    low, _ = drift_lower_batched(lambda Z: attention_forward(attn, Z), X, rho, tokens=range(X.shape[0]), restarts=2,
                                 steps=12, seed=seed)
    assert bool((low <= bound * (1 + 1e-9)).all()), (low, bound)


@pytest.mark.parametrize("which", ["attention", "layer"])
def test_the_batched_drift_ascent_is_the_library_loop(which):
    """The two attacks below run ``drift_lower``'s starts in one batch (``batched_drift_ascents.drift_lower_batched``): on a
    sharp causal attention and a pre-LN layer it attains ``drift_lower``'s rows (one start at a time) to rounding, and
    its witness is the loop's (the same token, point and unit rows)."""
    layer = _attn_layer(3, qscale=8.0, causal=True, placement="pre", H=4)
    X = _X(3)
    fn = (lambda Z: attention_forward(layer.attention, Z)) if which == "attention" else (lambda Z: layer_forward(layer, Z))
    kw = dict(tokens=(1, 4), restarts=2, steps=3, seed=3)
    low, best = drift_lower(fn, X, 0.05, **kw)
    got, gbest = drift_lower_batched(fn, X, 0.05, **kw)
    assert bool((low > 0).any()) and torch.allclose(got, low, rtol=1e-9, atol=0.0), (got, low)
    assert gbest[1] == best[1] and gbest[0] == pytest.approx(best[0], rel=1e-9)
    assert torch.allclose(gbest[2], best[2], rtol=0.0, atol=1e-12) and torch.allclose(gbest[3], best[3], atol=1e-9)


@pytest.mark.parametrize("placement", ["post", "pre"])
@pytest.mark.parametrize("qscale", [1.0, 8.0])
def test_layer_drift_rows_are_never_beaten(placement, qscale):
    """``layer_rows`` takes F35 inside its attention drift: its ``drift_rows`` still bound
    ``nu_i(J(Y) - J(X))`` of the whole layer and its ball rows ``nu_i(J(Y))`` against the ascent (pre-
    and post-LN, plain and sharp heads)."""
    layer = _attn_layer(5, qscale=qscale, placement=placement, H=4)
    X = _X(5)
    for r in (1e-2, 0.1):
        lj = layer_rows(layer, X, [r])[0]
        low, best = drift_lower_batched(lambda Z: layer_forward(layer, Z), X, r, tokens=(0, 3), restarts=2, steps=12)
        assert bool((low <= lj.drift_rows * (1 + 1e-9)).all()), (low, lj.drift_rows)
        Jy = torch.autograd.functional.jvp(lambda Z: layer_forward(layer, Z), best[2], best[3])[1]
        assert float(Jy[best[1]].norm()) <= float(lj.ball_rows[best[1]]) * (1 + 1e-9)


@pytest.mark.parametrize("orthogonal", [False, True])
def test_heads_joint_is_never_beaten_and_exact_for_orthogonal_heads(orthogonal):
    """F35d: Adam ascent over ``z_h`` with ``||z_h|| <= b_h`` (projected, restarts) never exceeds
    ``heads_joint``; when the heads write to orthogonal coordinate blocks the bound is attained (the
    sup is ``(sum_h b_h^2 ||W_O^h||^2)^{1/2}``) to 1e-6, far below ``||W_O|| (sum_h b_h^2)^{1/2}``'s excess."""
    g = torch.Generator().manual_seed(4)
    H, dh, d = 4, 2, 8
    Wo = torch.randn(H, dh, d, generator=g, dtype=torch.float64)
    if orthogonal:
        Wo = Wo * torch.block_diag(*[torch.ones(dh, dh, dtype=torch.float64)] * H).reshape(H, dh, d)
    heads = [(None,) * 6 + (Wo[h],) for h in range(H)]
    b = torch.rand(H, 1, generator=g, dtype=torch.float64) + 0.1
    bound = float(heads_joint(output_block_norms(heads), b)[0])
    # the 4 restarts in one batch: their draws in the loop's order, each its own Adam steps (entrywise) on its value
    z = torch.stack([torch.randn(H, dh, generator=g, dtype=torch.float64) for _ in range(4)]).requires_grad_(True)
    opt = torch.optim.Adam([z], lr=0.05)
    best = 0.0
    for _ in range(200):
        with torch.no_grad():
            z.mul_(torch.clamp(b / z.norm(dim=2, keepdim=True), max=1.0))
        val = torch.einsum("rha,had->rd", z, Wo).norm(dim=-1)
        best = max(best, float(val.detach().max()))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    assert best <= bound * (1 + 1e-12), (best, bound)
    if orthogonal:
        exact = float(torch.sqrt(sum(b[h, 0] ** 2 * torch.linalg.matrix_norm(Wo[h], 2) ** 2 for h in range(H))))
        assert bound == pytest.approx(exact, rel=1e-6)
        # attained: each z_h along its block's top left singular vector
        z = torch.stack([b[h, 0] * torch.linalg.svd(Wo[h])[0][:, 0] for h in range(H)])
        assert float(torch.einsum("ha,had->d", z, Wo).norm()) == pytest.approx(exact, rel=1e-12)
        assert bound < 0.9 * float(torch.linalg.matrix_norm(Wo.reshape(H * dh, d), 2) * b.norm())


@pytest.mark.parametrize("c", [0.25, 4.0])
def test_homogeneity_in_the_value_and_output_weights(c):
    """The drift is linear in ``W_V`` and in ``W_O`` (the softmax sees neither): scaling either by a power
    of two scales the certified rows by exactly that factor (every float64 step scales exactly)."""
    layer = _attn_layer(7, qscale=4.0)
    X = _X(7)
    base = _combined(layer, X, 0.05)
    for field in ("W_V", "W_O"):
        got = _combined(_scaled(layer, **{field: getattr(layer.attention, field) * c}), X, 0.05)
        assert torch.allclose(got, c * base, rtol=1e-12, atol=0.0), (field, got / base)


def test_regression_drift_is_tighter_than_f17d():
    """Regression (issue 12): on this small sharp layer F17d's attention drift rows were 9.3x (r = 1e-3)
    and 22.8x (r = 0.05) the ascent's best (0.171, 8.17: 4 restarts x 40 steps on every query); with
    F35 (the per-head minimum, the heads through ``W_O`` jointly) the route's rows are 3.7x and 7.7x, at most
    0.42 of F17d's here (the rows' soundness is attacked by the tests above; the values were pinned to 1e-9 until
    stop 40's test audit: a hard-coded result)."""
    layer = _attn_layer(11, qscale=4.0)
    X = _X(11)
    for r in (1e-3, 0.05):
        got = float(_combined(layer, X, r, drift=attention_drift_rows).max())
        old = float(_combined(layer, X, r, drift=attention_drift_f17d, joint=False).max())
        assert got <= 0.42 * old, (got, old)
