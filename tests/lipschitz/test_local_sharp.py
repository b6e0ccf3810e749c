"""The sharper pieces of the rows route (issue 12, ``lipschitz._local_sharp``, THEORY F31): the softmax
envelope and total variation under a bounded logit shift, the attention heads' output move and chi
distance on the ball, the FFN slope drift per hidden unit, and the stage radii they give ``layer_rows``,
each against an adversary (float64 sampling of the box's vertices, Adam ascent with restarts inside
the ball), homogeneity in ``W_V`` and ``W_2``, and the stage radii end to end (the regression test sits in test_local_rows.py, which the old code can import).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import box_shifts, clip_rows, gelu_ffn_case, random_spec, softmax_box, sphere_ascent
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_rows import _HeadMoments, layer_rows
from transcover.lipschitz._local_sharp import chi_bound, ffn_unit_drift, head_moves, score_moves, softmax_envelope
from transcover.model import attention_forward, attention_scores, ffn_forward


_clip = clip_rows  # other test files import it from here


def _sharp_layer(seed: int, placement: str = "post", qscale: float = 8.0, causal: bool = False):  # noqa: ANN202
    """A small layer whose heads are made sharp (``W_Q`` scaled: ``P_max -> 1`` on most rows)."""
    spec = random_spec(seed, act="gelu", norm="layernorm", placement=placement, d=8, H=2, dh=4, dff=16,
                       biases=True, causal=causal)
    L = spec.layers[0]
    return dataclasses.replace(L, attention=dataclasses.replace(L.attention, W_Q=L.attention.W_Q * qscale))


def _ascent(value, X: torch.Tensor, r: float, g: torch.Generator, *, starts: int = 2, steps: int = 30,  # noqa: ANN001
            shown=lambda v: v) -> torch.Tensor:  # noqa: ANN001
    """Per token, the largest ``shown(value(X + E))`` seen by Adam ascent of ``value`` (..., T) over moves ``E``
    with every token within ``r`` (projected each step), from ``starts`` random starts.  The starts run as one
    batch (E of shape (starts, T, d); each start's own draw from ``g``, in turn, and its own Adam steps: Adam acts
    entrywise); ``value`` must act on a leading batch axis, checked at the first step on the last start alone.  Then
    the sphere ascent (``sphere_ascent``, THEORY F57: every row on the sphere of radius r, Adam on its direction;
    1.1-20x more than the projected one on these tests, sphere19) with as many starts and steps, drawn from its own
    generator (seeded by ``g``'s, so the projected starts and later calls' draws are unchanged); the max of both
    (``shown`` increasing)."""
    E = torch.stack([_clip(torch.randn(X.shape, generator=g, dtype=torch.float64) * r, r) for _ in range(starts)])
    E.requires_grad_(True)
    opt = torch.optim.Adam([E], lr=0.1 * r)
    best = torch.zeros(X.shape[0], dtype=torch.float64)
    for step in range(steps):
        with torch.no_grad():
            E.copy_(_clip(E, r))
        val = value(X + E)
        if step == 0:  # a value that mixed the batch axis in would attack something else
            alone = value(X + E[-1].detach())
            assert torch.allclose(val[-1], alone, rtol=1e-6, atol=1e-9 * float(alone.abs().max())), "not batched"
        best = torch.maximum(best, shown(val.detach()).amax(dim=0))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    sph = sphere_ascent(value, X, r, torch.Generator().manual_seed(g.initial_seed() + 1), starts=starts, steps=steps)
    return torch.maximum(best, shown(sph))


def _X(seed: int, T: int = 6, d: int = 8) -> torch.Tensor:
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), sharp=st.sampled_from([1.0, 6.0, 30.0]), causal=st.booleans(),
       tight=st.booleans())
def test_softmax_envelope_is_never_beaten(seed, sharp, causal, tight):
    """Every shift in the box (|d_j| <= delta_j, spread <= osc): P' >= lo, |P' - P| <= a, TV <= tv; the
    shifts are the box's vertices clamped into random osc windows (the extremes of the linear-fractional
    P'_j) and random interior points, 2048 per example."""
    g, s, P, delta, osc = softmax_box(seed, sharp, causal, tight)
    a, lo, tv = softmax_envelope(P, delta, osc)
    Pn = torch.softmax(s[None] + box_shifts(g, P, delta, osc), dim=-1)
    assert bool((Pn >= lo[None] - 1e-15).all())
    assert bool(((Pn - P[None]).abs() <= a[None]).all())
    assert bool((0.5 * (Pn - P[None]).abs().sum(-1) <= tv[None] + 1e-15).all())


def _head_out(attn, Z: torch.Tensor, h: int) -> torch.Tensor:  # noqa: ANN001
    P = torch.softmax(attention_scores(attn, Z, h), dim=-1)
    return P @ Z @ attn.W_V[h].double(), P


@pytest.mark.parametrize("seed,causal", [(1, False), (4, True)])
def test_head_moves_and_chi_are_never_beaten(seed, causal):
    """Adam ascent inside B(X, r) (restarts, every query) on each head's output move ||o'_i - o_i|| and
    on sqrt(sum_j (P'_ij - P_ij)^2 / P_ij) stays below ``head_moves`` and ``chi_bound``; sharp heads."""
    layer = _sharp_layer(seed, causal=causal)
    attn = layer.attention
    X = _X(seed)
    norms = _weight_norms(layer)
    mom = _HeadMoments(_head_data(attn, X), attn.softmax_scale)
    g = torch.Generator().manual_seed(seed)
    for r in (0.02, 0.2):
        bound = head_moves(mom, r, norms)
        for h in range(attn.n_heads):
            o0, P0 = _head_out(attn, X, h)
            chi = chi_bound(mom.rows[h], r, norms["G"][h], score_moves(mom.rows[h], r, norms["G"][h])[0])
            for target in ("move", "chi"):
                if target == "move":
                    best = _ascent(lambda Z: (_head_out(attn, Z, h)[0] - o0).norm(dim=-1), X, r, g)
                else:  # ascend chi^2 (sqrt has no gradient at 0: a query with one visible key)
                    best = _ascent(lambda Z: torch.where(P0 > 0, (_head_out(attn, Z, h)[1] - P0) ** 2
                                                         / P0.clamp(min=1e-300), 0.0).sum(dim=-1),
                                   X, r, g, shown=torch.sqrt)
                ref = bound[h] if target == "move" else chi
                assert bool((best <= ref).all()), (target, r, h, best, ref)


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_stage_radii_are_never_beaten(placement):
    """``stage_radii`` of ``layer_rows`` bound how far each stage's output moves on B(X, r) (Adam ascent
    per token, restarts): post-LN the attention sublayer's centred output, the first norm's output and the
    FFN sublayer's centred output; pre-LN the normalised input and the attention sublayer's output."""
    layer = _sharp_layer(3, placement=placement, qscale=4.0)
    assert_stage_radii_hold(layer, _X(3), (3e-3, 3e-2))


def _stage_outputs(layer, Z: torch.Tensor) -> dict:  # noqa: ANN001
    """The stage outputs ``stage_radii`` speaks of (post-LN: centred sublayer outputs, the first norm's)."""
    P = torch.eye(Z.shape[-1], dtype=torch.float64) - 1.0 / Z.shape[-1]
    if layer.placement.value == "post":
        S1 = Z + attention_forward(layer.attention, Z)
        H = layer.norm_attn(S1)
        return {"attention": S1 @ P, "norm_attn": H, "ffn": (H + ffn_forward(layer.ffn, H)) @ P}
    Y = layer.norm_attn(Z)
    return {"attention": Y, "norm_ffn": Z + attention_forward(layer.attention, Y)}


def assert_stage_radii_hold(layer, X: torch.Tensor, radii) -> list:  # noqa: ANN001
    """Per radius and stage, Adam ascent per token on the stage output's move stays below ``stage_radii``;
    returns the ``LayerJacobian`` objects."""
    ref = _stage_outputs(layer, X)
    g = torch.Generator().manual_seed(0)
    ljs = layer_rows(layer, X, list(radii))
    for r, lj in zip(radii, ljs):
        for name, rad in lj.stage_radii.items():
            if name not in ref:
                continue
            best = _ascent(lambda Z: (_stage_outputs(layer, Z)[name] - ref[name]).norm(dim=-1), X, r, g)
            assert bool((best <= rad).all()), (name, r, best, rad)
    return ljs


def test_ffn_unit_drift_is_never_beaten():
    """Per token on ||h' - h|| <= rh: Adam ascent on ||F(h') - F(h)||_2 (F the FFN Jacobian) and on the
    second-order remainder ||FFN(h + dh) - FFN(h) - F(h) dh|| / ||dh|| stays below the two bounds."""
    ffn, H, z, n1, F = gelu_ffn_case()

    g = torch.Generator().manual_seed(1)
    for r in (0.05, 0.5, 3.0):
        rh = torch.full((3,), r, dtype=torch.float64)
        dF, half = ffn_unit_drift(ffn, z, n1, rh)
        for t in range(3):
            bd, bh = 0.0, 0.0
            for _ in range(2):
                D = _clip(torch.randn(6, generator=g, dtype=torch.float64) * r, r).requires_grad_(True)
                opt = torch.optim.Adam([D], lr=0.1 * r)
                for _ in range(30):
                    with torch.no_grad():
                        D.copy_(_clip(D, r))
                    h1 = H[t] + D
                    drift = torch.linalg.matrix_norm(F(h1) - F(H[t]), ord=2)
                    rem = (ffn_forward(ffn, h1[None])[0] - ffn_forward(ffn, H[t][None])[0] - F(H[t]) @ D).norm() / D.norm()
                    bd, bh = max(bd, float(drift.detach())), max(bh, float(rem.detach()))
                    opt.zero_grad()
                    (-(drift + rem)).backward()
                    opt.step()
            assert bd <= float(dF[t]) and bh <= float(half[t]), (r, t, bd, dF[t], bh, half[t])


def test_homogeneity_in_the_value_and_output_weights():
    """``head_moves`` is linear in ``W_V`` (the softmax does not see it) and ``ffn_unit_drift`` in ``W_2``."""
    layer = _sharp_layer(2)
    X = _X(2)
    base = head_moves(_HeadMoments(_head_data(layer.attention, X), layer.attention.softmax_scale), 0.05,
                      _weight_norms(layer))
    z = X @ layer.ffn.W_1.double() + layer.ffn.b_1.double()
    rh = torch.full((X.shape[0],), 0.3, dtype=torch.float64)
    f0 = ffn_unit_drift(layer.ffn, z, layer.ffn.W_1.double().norm(dim=0), rh)
    for lam in (0.25, 3.0):
        L = dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, W_V=layer.attention.W_V * lam),
                                ffn=dataclasses.replace(layer.ffn, W_2=layer.ffn.W_2 * lam))
        got = head_moves(_HeadMoments(_head_data(L.attention, X), L.attention.softmax_scale), 0.05, _weight_norms(L))
        assert torch.allclose(got, lam * base, rtol=1e-9)
        f1 = ffn_unit_drift(L.ffn, z, L.ffn.W_1.double().norm(dim=0), rh)
        assert torch.allclose(f1[0], lam * f0[0], rtol=1e-9) and torch.allclose(f1[1], lam * f0[1], rtol=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_sharp_heads_drift_and_ball_are_never_beaten(causal):
    """Sharp heads (W_Q x 8): at points of B(X, r) (sign vertices and ascent) the head blocks move in nu_i
    by at most ``attention_drift_rows`` (with F31's envelopes and per-key dy), and the pair/Jacobian
    adversary on the layer stays below the ball bound."""
    from test_lipschitz_local import adversary
    from transcover.lipschitz._local_jacobian import row_norm_lower
    from transcover.lipschitz._local_rows import attention_drift_rows
    from transcover.model._functional import layer_forward

    layer = _sharp_layer(6, causal=causal)
    attn = layer.attention
    X = _X(6)
    norms = _weight_norms(layer)
    g = torch.Generator().manual_seed(6)
    for r in (0.01, 0.1):
        bound = attention_drift_rows(_HeadMoments(_head_data(attn, X), attn.softmax_scale), r, norms)
        for h in range(attn.n_heads):
            def head(Z):  # noqa: ANN001, ANN202
                return _head_out(attn, Z, h)[0]

            J0 = torch.autograd.functional.jacobian(head, X).permute(0, 2, 1, 3)
            for _ in range(2):
                E = torch.randn(X.shape, generator=g, dtype=torch.float64)
                E = E / E.norm(dim=1, keepdim=True) * r
                J1 = torch.autograd.functional.jacobian(head, X + E).permute(0, 2, 1, 3)
                assert bool((row_norm_lower(J1 - J0, iters=10, restarts=1) <= bound[h] * (1 + 1e-9)).all())
    lj = layer_rows(layer, X, [0.05])[0]
    lo = adversary(lambda Z: layer_forward(layer, Z), X, 0.05, restarts=1, steps=15, seed=6)
    assert lo <= lj.ball * (1 + 1e-12), (lo, lj.ball)
