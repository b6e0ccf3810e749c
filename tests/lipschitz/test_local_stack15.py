"""The whole stack's own norm stages with the sphere's curvature (issue 12, ``lipschitz._local_stack_stages``, THEORY
F48): a norm sub-stage's drift and ball rows never beaten by random, worst-angle and Adam moves (LayerNorm and RMSNorm,
tiny sigma and radii up to the variance floor, heterogeneous per-token radii), never above F17's; their homogeneity in
``gamma`` and in the input's scale; the whole network (post- and pre-LN, near-floor inputs) against pair-ratio and
Jacobian ascent and never above the bound with F17's drift alone; new <= old on MiniLM's norm stages.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import transcover.lipschitz._local_stack_stages as stages_mod
from lipschitz_testkit import jvp_ascents, random_spec
from test_lipschitz_local import adversary
from batched_stage_ascents import centred_ascents, norm_jacobians
from test_local_sphere import _norm_case, _worst_angle_moves
from transcover.lipschitz._local_jacobian import _norm_parts
from transcover.lipschitz._local_rows import _ln_drift
from transcover.lipschitz._local_stack import stack_local
from transcover.lipschitz._local_stack_stages import norm_stage
from transcover.model._functional import transformer_forward


def _radii(sigma: torch.Tensor, d: int, frac: float) -> torch.Tensor:
    """Heterogeneous per-token radii: ``frac`` of each token's floor distance ``sqrt(d) sigma_i``, scaled 0.5-1."""
    return frac * math.sqrt(d) * sigma * torch.linspace(0.5, 1.0, sigma.shape[0], dtype=torch.float64)


@pytest.mark.parametrize("seed,kind,eps,small", [(1, "layernorm", 1e-12, False), (2, "layernorm", 0.05, True),
                                                 (3, "rmsnorm", 1e-6, False), (4, "rmsnorm", 0.3, True),
                                                 (5, "layernorm", 1e-5, True)])
def test_norm_stage_rows_are_never_beaten(seed, kind, eps, small):
    """Per token i of a norm sub-stage with radii ``r_i`` (every move ``||E_i|| <= r_i``, so ``||P E_i|| <= r_i``):
    ``||(D(x + E) - D(x)) v||`` (unit v) stays below the drift row ``dJ_i`` and ``||D(x + E) v||`` below the ball row,
    for random moves, the curvature's worst-angle moves at full length (v = E/r, and v = the centred token), and Adam
    ascent over (E, v); radii 2 %, 30 % and 90 % of the floor distance ``sqrt(d) sigma_i`` (tiny sigma: ``small``)."""
    norm, X = _norm_case(seed, kind, eps, small)
    T, d = X.shape
    D0, _, sigma, _ = _norm_parts(norm, X)
    st = norm_stage("n", 0, norm, X)
    gen = torch.Generator().manual_seed(seed)

    def jac(E: torch.Tensor) -> torch.Tensor:  # (m, T, d, d) for moves (m, T, d): each point's _norm_parts, one call
        return norm_jacobians(norm, X, E)

    def drift(E: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.einsum("mtij,mtj->mti", jac(E) - D0[None], v).norm(dim=-1)

    def ball(E: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.einsum("mtij,mtj->mti", jac(E), v).norm(dim=-1)

    for frac in (0.02, 0.3, 0.9):
        r = _radii(sigma, d, frac)
        dj, djc, b, _ = st.bounds(r)
        assert torch.equal(dj, djc) and bool(torch.isfinite(dj).all()) and bool((dj > 0).all())
        E = torch.randn(32, T, d, generator=gen, dtype=torch.float64)
        E = E / E.norm(dim=-1, keepdim=True) * r[None, :, None]
        v = torch.randn(32, T, d, generator=gen, dtype=torch.float64)
        v = v / v.norm(dim=-1, keepdim=True)
        assert bool((drift(E, v) <= dj[None]).all()) and bool((ball(E, v) <= b[None]).all()), (frac, "random")
        c = X - X.mean(dim=-1, keepdim=True) if kind == "layernorm" else X
        c = (c / c.norm(dim=-1, keepdim=True))[None].expand(8, T, d)
        for U in _worst_angle_moves(kind, X, 8, gen):
            for w in (U, c):
                assert bool((drift(r[None, :, None] * U, w) <= dj[None]).all()), (frac, "adversarial")
                assert bool((ball(r[None, :, None] * U, w) <= b[None]).all()), (frac, "adversarial ball")
        # Adam at the smallest token radius (a move within it is within every token's): _centred_ascent(value, ...,
        # starts=2, steps=40, lr=0.05 rm, unit_v=True) of the drift, then of the ball, both in one batch (the same draws
        # from gen in the same order, the same starts, steps and Adam: batched_stage_ascents.centred_ascents)
        rm = float(r.min())
        bests = centred_ascents([drift, ball], kind, (T, d), rm, gen, starts=2, steps=40, lr=0.05 * rm)
        for best, bound in zip(bests, (dj, b)):
            assert bool((best <= bound).all()), (frac, best, bound)


@pytest.mark.parametrize("seed,kind,eps,small", [(1, "layernorm", 1e-12, False), (4, "rmsnorm", 0.3, True),
                                                 (5, "layernorm", 1e-5, True)])
def test_norm_stage_rows_are_not_above_f17_and_sqrt3_below_it_off_the_floor(seed, kind, eps, small):
    """The drift rows are the smaller of F17's and F43a's: never above F17's (``_ln_drift`` times ``max|gamma|``), and
    at small radii about ``1/sqrt 3`` of it (within 1 %: F17's floor and F43a's denominator differ by O(r)); the ball
    rows never above F17's ``min(max|gamma|/s_floor, point + drift)``."""
    norm, X = _norm_case(seed, kind, eps, small)
    T, d = X.shape
    _, _, sigma, _ = _norm_parts(norm, X)
    st = norm_stage("n", 0, norm, X)
    g = stages_mod._gmax(norm)
    for frac in (1e-4, 0.3, 0.9, 1.2):
        r = _radii(sigma, d, frac)
        dj, _, b, _ = st.bounds(r)
        e17, sf = _ln_drift(norm, sigma, r, d)
        old = g * e17 * (1 + 1e-12)
        assert bool((dj <= old * (1 + 1e-9)).all()), (frac, dj, old)
        assert bool((b <= torch.minimum(g / sf * (1 + 1e-12), st.pt + old) * (1 + 1e-9)).all())
        if frac == 1e-4:
            assert bool((dj <= old / math.sqrt(3) * 1.01).all()), (dj / old)


def test_norm_stage_homogeneity():
    """``gamma -> c gamma``: drift rows x c (degree 1); eps = 0 and ``X -> c X`` with radii ``c r``: drift rows / c
    (the Jacobian is degree -1 in the input's scale), both to rounding."""
    norm, X = _norm_case(1, "layernorm", 0.0, False)
    T, d = X.shape
    _, _, sigma, _ = _norm_parts(norm, X)
    r = _radii(sigma, d, 0.3)
    dj = norm_stage("n", 0, norm, X).bounds(r)[0]
    scaled = dataclasses.replace(norm, weight=3.0 * torch.as_tensor(norm.weight))
    assert torch.allclose(norm_stage("n", 0, scaled, X).bounds(r)[0], 3.0 * dj, rtol=1e-9)
    assert torch.allclose(norm_stage("n", 0, norm, 5.0 * X).bounds(5.0 * r)[0], dj / 5.0, rtol=1e-9)


def _f17_only(norm, sigma, r, d):  # noqa: ANN001, ANN202
    return _ln_drift(norm, sigma, r, d)


CASES = [dict(placement="post", eps=1e-5, xscale=1.0), dict(placement="post", eps=1e-12, xscale=0.05),
         dict(placement="pre", eps=1e-5, xscale=1.0, final_norm=True)]


def assert_network_below(spec, X: torch.Tensor, rho: float, res, *, seed: int) -> float:  # noqa: ANN001
    """The whole network's pair ratios (``adversary``) and a float64 Adam ascent of its Jacobian's (2,inf) rows on
    ``B(X, rho)`` stay below ``stack_local``'s ``res.upper`` and its point plus middle-product drift; the lower."""
    f = lambda Z: transformer_forward(spec, Z, with_head=False)  # noqa: E731
    lo = adversary(f, X, rho, restarts=2, steps=15, seed=seed)
    # jvp_ascent's two starts in one batch (jvp_ascents with one seed: the same draws and steps; each (T, d) slice of
    # the batch its own network evaluation): value (starts, 1, T, d) -> (starts, 1), the (2,inf) row norm of J V
    jv = lambda E, V: torch.autograd.functional.jvp(f, X + E, V, create_graph=True)[1].norm(dim=-1).amax(dim=-1)  # noqa: E731
    lo = max(lo, jvp_ascents(jv, X, rho, [seed], starts=2, steps=40)[0])
    assert lo <= res.upper and lo <= (res.point + res.parts["(middle products)"]) * (1 + 1e-12), (lo, res.upper)
    return lo


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rho_frac", [1e-4, 3e-4])
def test_whole_network_is_never_beaten_and_below_f17(case, rho_frac, monkeypatch):
    """The whole network (2 layers, LayerNorm, GELU, biases; post-LN, post-LN with tiny inputs and eps = 1e-12, pre-LN
    with a final norm) at rho = ``rho_frac`` x the median token norm (finite bounds, 1.04-6x the ascent): the bound and
    the point plus the middle-product drift against the adversary's pair ratios and a float64 Adam ascent of the
    Jacobian's (2,inf) rows; the bound and drift with F17's norm drift alone are larger (by 0.8-11 % here)."""
    case = dict(case)
    xscale = case.pop("xscale")
    spec = random_spec(7, act="gelu", L=2, norm="layernorm", d=8, H=2, dh=4, dff=8, biases=True, **case)
    X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * xscale
    rho = rho_frac * float(X.norm(dim=1).median())
    new = stack_local(spec, X, [rho])[0]
    assert_network_below(spec, X, rho, new, seed=7)
    monkeypatch.setattr(stages_mod, "norm_drift", _f17_only)
    old = stack_local(spec, X, [rho])[0]
    assert math.isfinite(new.upper) and new.upper < old.upper and new.drift < old.drift, (new.upper, old.upper)


def test_f48_tightens_the_deep_stack():
    """Regression (THEORY F48a): the 6-layer post-LN GELU stack of ``test_local_stack_attn.test_f44_tightens_a_deep_stack``;
    with F17's norm drift in the stack's norm stages the middle-product drift was 0.1828 at rho = 1e-5 and the bound 8.770
    at 1e-4, with F43a's 0.1327 and 5.689; the bound at 1e-4 still holds against the adversary."""
    spec = random_spec(1, act="gelu", L=6, norm="layernorm", placement="post", d=6, dff=8, eps=1e-5, biases=True)
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    small, large = stack_local(spec, X, [1e-5, 1e-4])
    assert small.parts["(middle products)"] <= 0.13274 and small.drift <= 0.13274, small.parts
    assert large.upper <= 5.689, large.upper
    lo = adversary(lambda Z: transformer_forward(spec, Z, with_head=False), X, 1e-4, restarts=2, steps=15, seed=1)
    assert lo <= large.upper
