"""Sampled norm-bounded classes, Monte-Carlo estimates, the uniform search and the fits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from transcover import InputError
from transcover.empirical import (
    NormRadii,
    covering_of_outputs,
    fit_eps_growth,
    fit_power_growth,
    maximal_packing,
    greedy_net,
    monte_carlo_covering,
    random_inputs,
    sample_local_class,
    sample_reference_class,
    uniform_covering_search,
    usable_points,
)
from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec, transformer_forward

SMALL = ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=12, head_hidden=(6,), n_outputs=2)
F64_TOL = 1e3 * torch.finfo(torch.float64).eps  # a few hundred roundings through a 2-layer forward


@pytest.mark.parametrize("cfg", [
    SMALL,
    ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=12, head_hidden=(), causal=True, readout="first"),
    ReferenceConfig(d_model=6, n_heads=3, n_layers=2, d_ff=8, norm="none", ffn_bias=False, activation="gelu"),
])
@pytest.mark.parametrize("output", ["head", "features"])
def test_batched_forward_matches_reference_module(cfg, output):
    s = sample_reference_class(cfg, NormRadii(B_head_bias=0.3), 4, seed=2, output=output)
    X = random_inputs(5, 3, cfg.d_model, seed=3)
    Y = s.evaluate(X, chunk_size=3)  # a chunk boundary inside the 4 members
    for j in range(4):
        m = s.model(j)
        ref = m(X) if output == "head" else m.features(X).reshape(-1, cfg.d_model)
        torch.testing.assert_close(Y[j], ref.detach(), rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("radial", ["boundary", "uniform", "volume"])
def test_draws_satisfy_the_constraints(radial):
    r = NormRadii(B_KQ=0.7, B_V=1.3, B_W1=0.5, B_W2=2.0, B_b1=0.2, B_b2=0.4, B_head=0.9, B_head_bias=0.1)
    s = sample_reference_class(SMALL, r, 6, radial=radial, seed=4)
    dh = SMALL.head_dim
    sn = lambda W: torch.linalg.matrix_norm(W, 2)  # noqa: E731
    norms = {
        "B_KQ": sn(s.W_Q @ s.W_K.transpose(-1, -2) / math.sqrt(dh)), "B_V": sn(s.W_V @ s.W_O),
        "B_W1": sn(s.W_1), "B_W2": sn(s.W_2), "B_b1": s.b_1.norm(dim=-1), "B_b2": s.b_2.norm(dim=-1),
        "B_head": torch.stack([sn(W) for W in s.head_W]), "B_head_bias": torch.stack([b.norm(dim=-1) for b in s.head_b]),
    }
    tol = 100 * torch.finfo(torch.float64).eps
    for name, v in norms.items():
        radius = getattr(r, name)
        assert float(v.max()) <= radius * (1 + tol), name
        if radial == "boundary":  # aimed just inside (Note [inside the class]): 4((n + 4) + (e + 4)(1 + kappa))u
            # relative at most, with n <= 96 entries, e <= 4 and kappa = || |A||B| ||_F / ||AB||_2 <= 8 here: < 2e-13
            assert float(v.min()) >= radius * (1 - 2e-13), name
        else:
            assert float(v.min()) < radius * (1 - 1e-6), name  # genuinely inside the ball


def test_sampling_is_reproducible_and_seeded():
    X = random_inputs(4, 3, 8, seed=0)
    a = sample_reference_class(SMALL, NormRadii(), 5, seed=11).evaluate(X)
    b = sample_reference_class(SMALL, NormRadii(), 5, seed=11).evaluate(X)
    c = sample_reference_class(SMALL, NormRadii(), 5, seed=12).evaluate(X)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_monte_carlo_is_consistent_with_the_finite_estimators():
    s = sample_reference_class(SMALL, NormRadii(), 300, seed=1)
    X = random_inputs(6, 3, 8, seed=2)
    eps = (0.02, 0.05, 0.1)
    mc = monte_carlo_covering(s, X, eps, 2.0, checkpoints=[10, 100, 300])
    Y = s.evaluate(X)
    for e, ep in enumerate(eps):
        assert mc.net_sizes[e][-1] == len(greedy_net(Y, ep, 2.0))
        assert mc.packing_sizes[e][-1] == len(maximal_packing(Y, ep, 2.0))
        assert mc.net_sizes[e][0] == len(greedy_net(Y[:10], ep, 2.0))
        assert list(mc.net_sizes[e]) == sorted(mc.net_sizes[e])  # grows with M
        assert all(p <= n for p, n in zip(mc.packing_sizes[e], mc.net_sizes[e]))
    assert mc.log_covering_lower(0).kind.value == "empirical lower bound"
    assert mc.log_packing_lower(0).kind.value == "empirical lower bound"
    assert list(mc.to_dict()["checkpoints"]) == [10, 100, 300]


def test_larger_radius_gives_no_smaller_estimate_on_average():
    """Sanity of the class: scaling every radius by 3 spreads the functions (same seed)."""
    X = random_inputs(6, 3, 8, seed=2)
    small = monte_carlo_covering(sample_reference_class(SMALL, NormRadii().scaled(0.3), 200, seed=1), X, 0.05)
    big = monte_carlo_covering(sample_reference_class(SMALL, NormRadii(), 200, seed=1), X, 0.05)
    assert small.net_sizes[0][-1] < big.net_sizes[0][-1]


def test_local_class_member_zero_is_the_model_and_radii_hold():
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=12, head_hidden=(4,)))
    s = sample_local_class(model, {"W_1": 0.1, "W_Q": 0.2, "b_2": 0.05}, 5, radial="boundary", seed=3)
    X = random_inputs(4, 3, 8, seed=1)
    Y = s.evaluate(X)
    assert Y.shape == (5, 4, 1)
    base = reference_spec(model)  # float32 weights; the class computes in float64
    with torch.no_grad():
        torch.testing.assert_close(Y[0], transformer_forward(base, X), rtol=0, atol=F64_TOL)
        assert float((Y[0] - model(X.float())).abs().max()) < 1e-5  # the module, in its float32
    pert = s.member(2)
    dW1 = pert.layers[0].ffn.W_1.double() - base.layers[0].ffn.W_1.double()
    assert float(torch.linalg.matrix_norm(dW1, 2)) == pytest.approx(0.1, rel=1e-9)
    dWQ = pert.layers[0].attention.W_Q.double() - base.layers[0].attention.W_Q.double()
    torch.testing.assert_close(torch.linalg.matrix_norm(dWQ, 2), torch.full((2,), 0.2, dtype=torch.float64))
    assert torch.equal(pert.layers[0].ffn.W_2, base.layers[0].ffn.W_2)  # not perturbed
    assert torch.equal(s.evaluate(X), Y)  # regenerated identically
    torch.testing.assert_close(Y[2], transformer_forward(pert, X.double()), rtol=0, atol=F64_TOL)


def test_local_radii_are_described_per_head(capsys):
    """Red team 220: ``--perturb W_Q=R`` bounds each head's block ``||dW_Q^h||_2 <= R``; the whole matrix reaches
    ``sqrt(H) R``.  The behaviour stays (the module docstring's class); what the user reads says so."""
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=12, head_hidden=(4,)))
    s = sample_local_class(model, {"W_Q": 0.2, "W_O": 0.2, "W_1": 0.1, "b_2": 0.05, "head": 0.1}, 3,
                           radial="boundary", seed=3)
    base, pert = reference_spec(model).layers[0].attention, s.member(1).layers[0].attention
    dQ, dO = pert.W_Q.double() - base.W_Q.double(), pert.W_O.double() - base.W_O.double()  # (H, d, dh), (H, dh, d)
    torch.testing.assert_close(torch.linalg.matrix_norm(dQ, 2), torch.full((2,), 0.2, dtype=torch.float64))
    whole_Q = float(torch.linalg.matrix_norm(torch.cat(list(dQ), dim=1), 2))  # the layer's d x d query map
    whole_O = float(torch.linalg.matrix_norm(torch.cat(list(dO), dim=0), 2))
    assert whole_Q > 0.2 * (1 + 1e-3) and whole_O > 0.2 * (1 + 1e-3)  # a whole-matrix reading would be false
    assert whole_Q <= math.sqrt(2) * 0.2 * (1 + 1e-12) and whole_O <= math.sqrt(2) * 0.2 * (1 + 1e-12)
    d = s.description
    assert "W_Q=0.2 (spectral, per head)" in d and "W_O=0.2 (spectral, per head)" in d, d
    assert "W_1=0.1 (spectral)" in d and "b_2=0.05 (l2)" in d and "head=0.1 (spectral, per MLP-head matrix)" in d, d
    from transcover.cli import main

    with pytest.raises(SystemExit):
        main(["cover", "local", "--help"])
    assert "(per head, not the whole matrix)" in " ".join(capsys.readouterr().out.split())


def test_uniform_search_beats_or_matches_random_and_its_packing_is_real():
    s = sample_reference_class(SMALL, NormRadii(), 150, seed=5)
    sampler = lambda c, sd: random_inputs(c, 3, 8, seed=sd)  # noqa: E731
    res = uniform_covering_search(s, 3, 0.05, math.inf, input_sampler=sampler, restarts=2, pool_size=12, seed=1)
    assert res.best_packing >= max(res.random_packings)
    assert res.best_packing == max(max(res.random_packings), max(res.greedy_packings))
    # recompute the packing of the returned sample set from scratch
    Y = s.evaluate(res.best_inputs)
    assert len(maximal_packing(Y, 0.05, math.inf)) == res.best_packing
    assert res.lower.kind.value == "empirical lower bound"


def test_eps_growth_fit_recovers_known_laws():
    eps = np.array([0.01, 0.02, 0.05, 0.1, 0.2])
    fit = fit_eps_growth(eps, 3.0 * eps ** -2.0)
    assert fit.alpha == pytest.approx(2.0, abs=1e-9) and fit.power.r2 == pytest.approx(1.0, abs=1e-12)
    fit = fit_eps_growth(eps, 1.0 + 7.0 * np.log(1 / eps), n_parameters=7)
    assert fit.p_eff == pytest.approx(7.0, abs=1e-9)
    assert fit_power_growth([1, 2, 4, 8], 5.0 * np.array([1, 2, 4, 8.0]) ** 1.5).slope == pytest.approx(1.5)
    with pytest.raises(InputError, match="at least 2"):
        fit_eps_growth([0.1, 0.2], [0.0, 1.0])


def test_usable_points_drop_saturated_and_trivial():
    Y = torch.arange(100, dtype=torch.float64)[:, None]
    mc = covering_of_outputs(Y, (0.4, 2.0, 10.0, 1000.0))
    eps, logn = usable_points(mc)
    assert eps.tolist() == [2.0, 10.0]  # 0.4: every point is a centre; 1000: one centre
    np.testing.assert_allclose(logn, np.log([34, 10]))  # greedy on a grid: ceil(100 / (eps + 1))


@pytest.mark.parametrize("call,match", [
    (lambda: NormRadii(B_KQ=0.0), "B_KQ must be"),
    (lambda: NormRadii(B_b1=-1.0), "B_b1 must be"),
    (lambda: sample_reference_class(SMALL, NormRadii(), 0), "n_functions"),
    (lambda: sample_reference_class(SMALL, NormRadii(), 3, radial="gauss"), "radial"),
    (lambda: sample_reference_class(ReferenceConfig(norm="layernorm"), NormRadii(), 3), "norm="),
    (lambda: sample_reference_class(SMALL, NormRadii(), 2).evaluate(torch.zeros(3, 2, 5)), "d_model=8"),
    (lambda: sample_local_class(ReferenceTransformer(SMALL), {"W_9": 1.0}, 3), "unknown perturbation role"),
    (lambda: sample_local_class(ReferenceTransformer(SMALL), {"W_1": 0.0}, 3), "at least one"),
    (lambda: monte_carlo_covering(sample_reference_class(SMALL, NormRadii(), 2), random_inputs(2, 2, 8), -0.1),
     "eps must be"),
    (lambda: random_inputs(0, 2, 8), "n must be"),
])
def test_bad_input_is_one_clear_error(call, match):
    with pytest.raises(InputError, match=match):
        call()


def test_boundary_members_lie_inside_the_class_exactly():
    """radial="boundary" members rescaled in float64 had exact norms up to 4.4e-16 above the radius (red team 37f),
    so a packing could hold points outside F; every norm is now at most the radius, in 200-bit arithmetic
    (the factor products W_Q W_K^T / sqrt(dh) and W_V W_O formed exactly from the stored factors)."""
    import mpmath
    import numpy as np

    from transcover.empirical import NormRadii, sample_reference_class
    from transcover.model import ReferenceConfig

    mpmath.mp.prec = 200
    cfg = ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=5, head_hidden=(3,), n_outputs=1)
    radii = NormRadii(B_KQ=0.7, B_V=1.3, B_W1=2.0, B_W2=0.9, B_b1=0.4, B_b2=0.6, B_head=1.1, B_head_bias=0.5)
    S = sample_reference_class(cfg, radii, 12, radial="boundary", seed=3)

    def mat(t):
        return mpmath.matrix(np.asarray(t, dtype=np.float64).tolist())

    def spec(M):
        return max(mpmath.svd_r(M, compute_uv=False))

    def l2(v):
        return mpmath.sqrt(mpmath.fsum(mpmath.mpf(float(x)) ** 2 for x in v))

    dh = cfg.d_model // cfg.n_heads
    for j in range(12):
        got = {
            "B_KQ": spec(mat(S.W_Q[j, 0, 0]) * mat(S.W_K[j, 0, 0]).T) / mpmath.sqrt(dh),
            "B_V": spec(mat(S.W_V[j, 0, 0]) * mat(S.W_O[j, 0, 0])),
            "B_W1": spec(mat(S.W_1[j, 0])), "B_W2": spec(mat(S.W_2[j, 0])),
            "B_b1": l2(S.b_1[j, 0]), "B_b2": l2(S.b_2[j, 0]),
            "B_head": spec(mat(S.head_W[0][j])), "B_head_bias": l2(S.head_b[0][j]),
        }
        for name, v in got.items():
            bound = mpmath.mpf(getattr(radii, name))
            assert v <= bound and v >= bound * (1 - 1e-12), (j, name, float(v / bound - 1))


@pytest.mark.parametrize("role, radius", [("W_1", 1e-9), ("W_Q", 1e-10), ("b_2", 1e-9), ("W_O", 1e-8)])
def test_local_members_stay_inside_their_balls_when_the_weights_are_large(role, radius):
    """Red team 162: a member is fl(W + D); at weights x1000 and r = 1e-9 the sum's rounding put the exact
    perturbation fl(W + D) - W at 1.0000261 r. Note [inside the local class]: the exact perturbation (the float64
    difference is exact here by Sterbenz: every entry of D is far below half of its weight) has norm <= r, up to
    the float64 SVD's own relative error (min(r, c) + 2) u, for every member on the boundary; and it is not shrunk
    by more than a few ulps' worth of the weights against the radius."""
    cfg = ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, head_hidden=(8,), n_outputs=1, init_scale=1.0)
    torch.manual_seed(0)
    model = ReferenceTransformer(cfg).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1000.0 + p.abs())  # every entry in [1000, 1001]: Sterbenz holds for W' - W
    s = sample_local_class(model, {role: radius}, 12, radial="boundary", seed=1)
    get = {"W_1": lambda m: m.layers[0].ffn.W_1, "W_Q": lambda m: m.layers[0].attention.W_Q,
           "b_2": lambda m: m.layers[0].ffn.b_2, "W_O": lambda m: m.layers[0].attention.W_O}[role]
    base = get(s.spec).double()
    worst = 0.0
    for j in range(1, 12):
        D = get(s.member(j)) - base
        norms = D.norm(dim=-1) if D.ndim == 1 else torch.linalg.matrix_norm(D, ord=2)
        worst = max(worst, float(norms.max()) / radius)
    assert 0.99 < worst <= 1.0 + 16 * 2.0**-53
    with pytest.raises(InputError, match="below float64's resolution"):
        sample_local_class(model, {role: 1e-20}, 3, radial="boundary").member(1)
