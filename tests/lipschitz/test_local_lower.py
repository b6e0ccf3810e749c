"""The empirical lower estimate on a whole ball (issue 12, ``lipschitz._local_lower``): against maps
whose local (2,inf) constant is known in closed form or by brute force, and never above the
certified rows-route bound on random small layers (a violation would be a false certificate).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import random_spec
from transcover._errors import InputError
from transcover._results import Kind, check_certified
from transcover.lipschitz._local_lower import ball_lower, ball_lower_sweep, point_lower
from transcover.lipschitz._local_rows import layer_rows
from transcover.model._functional import layer_forward

_U = 2.0**-53


def _gamma(k: int) -> float:
    return k * _U / (1 - k * _U)


def test_linear_kronecker_map_attains_its_norm():
    """f(X)_i = sum_j a_ij W X_j: nu_i = ||W||_2 sum_j |a_ij| (v_j = sign(a_ij) v*, v* the top right
    singular vector), the same on every ball.  The estimate is within 1 % below it and above it by at
    most the float64 error of the JVP, gamma_{T+d} (sum_j |a_ij|) ||W||_F per row (Higham 3.5)."""
    g = torch.Generator().manual_seed(0)
    T, d = 5, 6
    A = torch.randn(T, T, generator=g, dtype=torch.float64)
    W = torch.randn(d, d, generator=g, dtype=torch.float64)
    truth = float(torch.linalg.matrix_norm(W, 2)) * float(A.abs().sum(dim=1).max())
    tol = 4 * _gamma(T + d + 4) * float(A.abs().sum(dim=1).max()) * float(W.norm())
    X = torch.randn(T, d, generator=g, dtype=torch.float64)
    for rho in (1e-3, 1.0):
        r = ball_lower(lambda Z: A @ Z @ W.T, X, rho, steps=3, pair_steps=3)
        assert 0.99 * truth <= r.value <= truth + tol, (rho, r.value, truth)
        assert r.kind is Kind.EMPIRICAL_LOWER and r.quantity().kind is Kind.EMPIRICAL_LOWER


def _sup_tanh(X: torch.Tensor, rho: float, c: float) -> float:
    # per coordinate the ball lets x_ik move by rho towards 0, where sech^2 is largest
    return c * float((1 / torch.cosh((X.abs() - rho).clamp(min=0.0)) ** 2).max())


def _gelu_slope(x: torch.Tensor) -> torch.Tensor:
    return torch.special.ndtr(x) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _sup_gelu(X: torch.Tensor, rho: float) -> float:
    """sup over |t| <= rho of |GELU'(x + t)| per coordinate: GELU'' = phi (2 - x^2) vanishes only at
    +-sqrt(2), so the sup of |GELU'| on an interval is at its ends or at +-sqrt(2) inside it."""
    cands = [_gelu_slope(X - rho).abs(), _gelu_slope(X + rho).abs()]
    for c in (math.sqrt(2), -math.sqrt(2)):
        inside = ((X - rho) <= c) & (c <= (X + rho))
        cands.append(torch.where(inside, _gelu_slope(torch.full_like(X, c)).abs(), torch.zeros_like(X)))
    return float(torch.stack(cands).max())


@pytest.mark.parametrize("rho", [0.05, 0.6, 2.5])
def test_tokenwise_tanh_reaches_the_closed_form_sup(rho):
    """f(X) = c tanh(X) entrywise: J is diagonal, nu_i(J(X')) = c max_k sech^2(x'_ik), and its sup on
    the ball is c max sech^2(max(0, |x_ik| - rho)); far above the point value for large rho."""
    g = torch.Generator().manual_seed(1)
    X = (1 + 2 * torch.rand(4, 5, generator=g, dtype=torch.float64)) * torch.sign(torch.randn(4, 5, generator=g))
    c = 1.7
    fn = lambda Z: c * torch.tanh(Z)  # noqa: E731
    truth = _sup_tanh(X, rho, c)
    r = ball_lower(fn, X, rho, steps=6, pair_steps=3)
    assert 0.99 * truth <= r.value <= truth * (1 + 16 * _U), (r.value, truth)
    assert r.value >= r.point
    # the witness lies in the ball and attains the value
    assert float((r.centre - X).norm(dim=1).max()) <= rho
    if rho >= 0.6:
        assert r.value > 1.5 * r.point


@pytest.mark.parametrize("rho", [0.3, 1.0])
def test_tokenwise_gelu_reaches_the_interior_maximum(rho):
    """GELU' peaks (1.129) at sqrt(2) inside the interval: the ascent must stop inside the ball, not
    at its boundary, to come within 1 %."""
    g = torch.Generator().manual_seed(2)
    X = 0.5 + 1.5 * torch.rand(3, 4, generator=g, dtype=torch.float64)
    fn = torch.nn.functional.gelu
    truth = _sup_gelu(X, rho)
    r = ball_lower(fn, X, rho, steps=8, pair_steps=2)
    assert 0.99 * truth <= r.value <= truth * (1 + 64 * _U), (r.value, truth)


def _tiny_attention(a: float, b: float):  # noqa: ANN202
    """T = 2 tokens of width 1: out_i = x_i + b sum_j softmax_j(a x_i x_j) x_j (batched over leading dims)."""
    def fn(Z: torch.Tensor) -> torch.Tensor:
        x = Z[..., 0]
        P = torch.softmax(a * x[..., :, None] * x[..., None, :], dim=-1)
        return (x + b * (P @ x[..., :, None])[..., 0])[..., None]
    return fn


def test_small_attention_matches_a_brute_force_grid():
    """On a 2-token, width-1 attention layer the ball is a square; nu_i = sum_j |J_ij| on a 241 x 241
    grid (batched autograd) gives the sup from below, and from above up to the largest change between
    neighbouring grid points (the sup sits within half a cell of a grid point)."""
    fn = _tiny_attention(1.3, 0.9)
    X = torch.tensor([[0.4], [-0.7]], dtype=torch.float64)
    rho = 0.8
    n = 241
    s = torch.linspace(-rho, rho, n, dtype=torch.float64)
    G = torch.stack(torch.meshgrid(X[0, 0] + s, X[1, 0] + s, indexing="ij"), dim=-1).reshape(-1, 2, 1)
    G.requires_grad_(True)
    out = fn(G)
    rows = []
    for i in range(2):
        (gi,) = torch.autograd.grad(out[:, i, 0].sum(), G, retain_graph=True)
        rows.append(gi[:, :, 0].abs().sum(dim=1))
    nu = torch.stack(rows).max(dim=0).values.reshape(n, n)
    grid_max = float(nu.max())
    slack = max(float((nu[1:] - nu[:-1]).abs().max()), float((nu[:, 1:] - nu[:, :-1]).abs().max()))
    r = ball_lower(fn, X, rho, steps=10, restarts=2, pair_steps=3)
    assert 0.99 * grid_max <= r.value <= grid_max + slack, (r.value, grid_max, slack)
    assert r.value > 1.05 * r.point  # the ball matters here


CASES = [dict(norm=n, placement=p, biases=b) for n in ("layernorm", "rmsnorm") for p in ("post", "pre")
         for b in (False, True)]


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), case=st.sampled_from(CASES), scale=st.sampled_from([1.0, 2.0]))
def test_never_above_the_certified_rows_bound(seed, case, scale):
    """Random small layers, several radii: point lower <= ball lower <= certified ball bound of the
    rows route (``check_certified``; a violation would be a false certificate)."""
    spec = random_spec(seed, act="gelu", scale=scale, L=1, **case)
    layer = spec.layers[0]
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.5
    fn = lambda Z: layer_forward(layer, Z)  # noqa: E731
    # radii where the certificate is within a small factor of the truth (an adversary has to be good to
    # matter there) and one where it is loose
    rhos = [1e-3, 1e-2, 5e-2]
    certs = layer_rows(layer, X, rhos)
    pl = point_lower(fn, X, iters=8, tokens=2, seed=1)
    for r, lj in zip(ball_lower_sweep(fn, X, rhos, init=pl, steps=4, pair_steps=3), certs):
        assert r.value >= r.point == pl[0]
        check_certified(f"local constant on B(X, {r.rho})", lj.ball, r.value)
        check_certified(f"local constant on B(X, {r.rho}) (pairs)", lj.ball, r.pair)


def test_sweep_is_monotone_and_keeps_the_order():
    spec = random_spec(5, act="gelu", scale=2.0, L=1, norm="layernorm", placement="post")
    layer = spec.layers[0]
    X = torch.randn(3, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rhos = [0.5, 1e-3, 0.05]
    out = ball_lower_sweep(lambda Z: layer_forward(layer, Z), X, rhos, steps=3, pair_steps=2)
    assert [r.rho for r in out] == rhos
    vals = {r.rho: r.value for r in out}
    assert vals[1e-3] <= vals[0.05] <= vals[0.5]


@pytest.mark.parametrize("rho", [0.0, -1.0, math.inf, math.nan])
def test_bad_radius_is_one_clear_error(rho):
    with pytest.raises(InputError, match="rho must be"):
        ball_lower(torch.tanh, torch.ones(2, 3, dtype=torch.float64), rho)


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_local_table_ball_lower_beside_the_point_lower(placement, capsys, monkeypatch):
    """``local_table(ball=...)``: every row searched on its own certified input ball carries the point
    lower and a ball lower at least as large (checked against the row's certificate inside), the
    components' balls mapped to the stage functions' inputs (pre-LN stages start at their norm); the
    table prints both columns."""
    from transcover.lipschitz._local_report import local_table
    from transcover.report import render_local

    monkeypatch.setenv("COLUMNS", "200")  # rich wraps the headers at 80 columns
    spec = random_spec(13, act="gelu", L=1, norm="layernorm", placement=placement, scale=1.5)
    seqs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)]
    kw = dict(steps=2, restarts=0, pair_steps=1, pair_restarts=0)
    base = local_table(spec, seqs, [1e-2, 0.3], lower_iter=5)
    rows = local_table(spec, seqs, [1e-2, 0.3], lower_iter=5, ball=kw, ball_components=True)
    assert [(r.rho_factor, r.layer, r.component) for r in rows] == [(r.rho_factor, r.layer, r.component) for r in base]
    for r, b in zip(rows, base):
        assert r.local_upper == b.local_upper and r.point_lower == b.lower
        assert r.point_lower <= r.lower <= r.local_upper * (1 + 1e-12)
        assert r.to_dict()["point_lower"] == r.point_lower
    big = [r for r in rows if r.rho_factor == 0.3 and r.component == "layer"]
    assert any(r.lower > 1.01 * r.point_lower for r in big)  # a ball of 0.3 x the token norm moves the Jacobian
    render_local("random13", 1, rows, True)
    out = capsys.readouterr().out
    assert "ball lower" in out and "point lower" in out
    # without ball: the old table, one lower column
    render_local("random13", 1, base, True)
    assert "ball lower" not in capsys.readouterr().out


def test_cli_ball_lower_with_scale_options_is_one_line(tmp_path):
    """``--ball-lower`` runs in one process: with the scale options it is refused before anything loads
    (exit 2, one line, nothing written)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, "-m", "transcover.cli", "lipschitz", "--data", "sklearn-descr", "--limit", "1",
                        "--ball-lower", "layers", "--workers", "2", "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--ball-lower" in lines[0], r.stderr
    assert not out.exists()


def test_flat_relu_region_still_finds_a_slope():
    """ReLU with every coordinate negative: J(X) = 0 (point lower 0) and no second derivative to
    follow, but a coordinate within rho of 0 makes the constant on the ball 1; the pair search, started
    off the zero rows, finds a positive ratio (at most 1)."""
    X = -0.2 - 0.3 * torch.rand(3, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    r = ball_lower(torch.relu, X, 1.0, steps=2, pair_steps=10)
    assert r.point == 0.0 and 0.3 < r.value <= 1.0 + 1e-12, r


def test_a_given_point_image_changes_nothing():
    """``ball_lower_sweep`` computes the point image ``(J(X) V)_token`` once for every radius (it was one JVP
    per radius): ``ball_lower`` given that image returns the same witness, float for float, as computing it."""
    from transcover.lipschitz._local_lower import _point_image

    spec = random_spec(3, act="gelu", norm="layernorm", d=6, H=2, dh=3, dff=12, biases=True)
    fn = lambda Z: layer_forward(spec.layers[0], Z)  # noqa: E731
    X = torch.randn(5, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p, tk, V = point_lower(fn, X)
    V = V / V.norm(dim=-1, keepdim=True)
    for rho in (1e-3, 0.3):
        kw = dict(token=tk, V=V, point=p, steps=2, restarts=1, pair_steps=2, pair_restarts=1)
        a = ball_lower(fn, X, rho, **kw)
        b = ball_lower(fn, X, rho, image=_point_image(fn, X, V, tk), **kw)
        assert (a.value, a.jacobian, a.pair, a.token) == (b.value, b.jacobian, b.pair, b.token)
        assert torch.equal(a.centre, b.centre) and torch.equal(a.direction, b.direction)


def test_last_steps_without_their_unused_derivatives_change_nothing():
    """The centre search skips the last point's gradient in X' (only stored) and the pair search builds no graph
    for its last pair (only evaluated): ``_jac_step`` without ``need_x`` gives the same V and J V float for float,
    and a forward pass without a graph the same image as with one."""
    from transcover.lipschitz._local_lower import _jac_step

    spec = random_spec(4, act="gelu", norm="layernorm", d=6, H=2, dh=3, dff=12, biases=True)
    fn = lambda Z: layer_forward(spec.layers[0], Z)  # noqa: E731
    g = torch.Generator().manual_seed(4)
    X = torch.randn(5, 6, generator=g, dtype=torch.float64)
    for i in range(5):
        u = torch.randn(6, generator=g, dtype=torch.float64)
        u = u / u.norm()
        V1, JV1, gX = _jac_step(fn, X, i, u)
        V2, JV2, none = _jac_step(fn, X, i, u, need_x=False)
        assert none is None and gX is not None and float(gX.norm()) > 0
        assert torch.equal(V1, V2) and torch.equal(JV1, JV2)
    assert torch.equal(fn(X.clone().requires_grad_(True)).detach(), fn(X.clone()))


def test_pairs_only_on_the_larger_balls():
    """``pair_from``: below it the pair search is skipped (``pair`` 0) and the centre search is the same float for
    float; where the centre search set the value (method "jacobian") the value is unchanged, and the balls from
    ``pair_from`` on, started from the same centres, give the same witness as searching pairs everywhere."""
    spec = random_spec(5, act="gelu", norm="layernorm", d=6, H=2, dh=3, dff=12, biases=True)
    fn = lambda Z: layer_forward(spec.layers[0], Z)  # noqa: E731
    X = torch.randn(5, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rhos = [1e-4, 1e-3, 1e-2, 0.3]
    kw = dict(steps=2, restarts=0, pair_steps=2, pair_restarts=0)
    every = ball_lower_sweep(fn, X, rhos, **kw)
    large = ball_lower_sweep(fn, X, rhos, pair_from=0.3, **kw)
    assert all(e.method == "jacobian" for e in every[:-1]), [e.method for e in every]
    for e, g in zip(every[:-1], large[:-1]):
        assert g.pair == 0.0 < e.pair and g.jacobian == e.jacobian and g.value == e.value
        assert torch.equal(g.centre, e.centre)
    e, g = every[-1], large[-1]
    assert (g.value, g.jacobian, g.pair, g.method, g.token) == (e.value, e.jacobian, e.pair, e.method, e.token)


@pytest.mark.parametrize("factor", [1e-12, 1e-9, 1e-6])
def test_ball_lower_witnesses_lie_in_the_ball_as_the_floats_hold_them(factor):
    """Red team 174: offsets were clipped to rho (1 - 1e-9), but X + C rounds by about u |X|: at rho = 1.6e-13 the
    reported centre was 1.000017 rho from X, an "empirical lower bound on B(X, rho)" attained outside it."""
    spec = random_spec(21, act="gelu", L=1, norm="layernorm", placement="pre", scale=1.5, d=8)
    X = 30.0 * torch.randn(5, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    layer = spec.to_torch(torch.float64).layers[0]
    rho = factor * float(X.norm(dim=-1).median())
    r = ball_lower(lambda Z: layer_forward(layer, Z), X, rho, steps=6, restarts=2, pair_steps=3, pair_restarts=1)
    assert float((r.centre - X).norm(dim=-1).max()) <= rho
    assert r.value >= r.point  # the point X itself is always in the ball


def _shifted_tokens(mean: float, T: int = 2, d: int = 64) -> torch.Tensor:
    """Tokens of std exactly about 1 around a common offset ``mean`` (red team 218's ``t1_ln_pair.py``)."""
    torch.manual_seed(0)
    Z = torch.randn(T, d, dtype=torch.float64)
    Z = Z - Z.mean(-1, keepdim=True)
    return Z / Z.std(-1, unbiased=False, keepdim=True) + mean


@pytest.mark.parametrize("mean, rel", [(1e7, 1e-14), (1e5, 3e-14)])
@pytest.mark.parametrize("shadow", [False, True])
def test_pair_noise_of_a_cancelling_layer_norm_is_no_slope(mean, rel, shadow):
    """Red team 218: a LayerNorm of tokens with std 1 around a mean of 1e5-1e7 errs by about u |mean| in float64, and
    the close pair (1e-2 rho apart) turned that noise into slopes of 2.24 (1e7) and 1.14 (1e5), the true constant on the
    ball being at most 1 / (1 - rho / sqrt(d)) (the std moves by at most rho / sqrt(d)).  With a float32 shadow the
    pairs' allowance sees the cancellation; without one, pairs this close do not count (Note [pair allowance])."""
    d = 64
    X = _shifted_tokens(mean, d=d)
    fn = lambda Y: torch.nn.functional.layer_norm(Y, (d,), eps=1e-12)  # noqa: E731
    rho = rel * float(X.norm(dim=-1).median())
    r = ball_lower(fn, X, rho, steps=3, pair_steps=6, **({"shadow": fn} if shadow else {}))
    assert r.value <= 1 / (1 - rho / math.sqrt(d))


def test_the_shadow_allowance_keeps_an_ordinary_pair_value():
    """Red team 218's allowance must not gut the pair search: on a random pre-norm layer at rho = 0.3 x the token
    norm, where the pairs set the value, the recorded value is the pair's plain difference quotient (the points as
    evaluated) to 1e-6, and the same as without the shadow (the separation is far above sqrt(u) there)."""
    spec = random_spec(5, act="gelu", L=1, norm="layernorm", placement="pre", scale=1.5, d=8)
    layer, layer32 = spec.to_torch(torch.float64).layers[0], spec.to_torch(torch.float32).layers[0]
    X = torch.randn(5, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rho = 0.3 * float(X.norm(dim=-1).median())
    fn = lambda Z: layer_forward(layer, Z)  # noqa: E731
    kw = dict(steps=2, pair_steps=8, pair_restarts=2)
    r = ball_lower(fn, X, rho, shadow=lambda Z: layer_forward(layer32, Z), **kw)
    assert r.pair > 0 and r.method == "pair"
    Y, Z = r.centre, r.direction
    raw = float(((fn(Y) - fn(Z)).norm(dim=-1) / (Y - Z).norm(dim=-1).max()).max())
    assert raw * (1 - 1e-6) <= r.pair <= raw
    assert r.pair == pytest.approx(ball_lower(fn, X, rho, **kw).pair, rel=1e-6)


def test_a_bias_1e6_bert_has_no_false_certificate(tmp_path):
    """Red team 218: `transcover lipschitz bert_b6 --data ids --rho 1e-9 --rho-relative --ball-lower layers` (layer 0's
    attention output bias 1e6: its norm's input has mean 1e6, std 1) raised the tool's own CertificateViolation, the
    pair noise 4.02 above the certified 1.066.  Now every ball lower is at most its certified row."""
    from lipschitz_testkit import tiny_bert
    from transcover.lipschitz import local_table
    from transcover.train import load_data, load_model

    path = tiny_bert(tmp_path / "b6", bias=1e6)
    np.save(tmp_path / "ids.npy", np.array([[1, 5, 7, 9]]))
    spec = load_model(str(path)).to_torch(torch.float64)
    seqs = load_data(str(path), spec, str(tmp_path / "ids.npy"))
    rows = local_table(spec, seqs, [1e-9], relative=True, lower_iter=15,
                       ball=dict(steps=3, restarts=0, pair_restarts=0, pair_steps=2, seed=0))
    layers = [r for r in rows if r.component == "layer"]
    assert len(layers) == 2 and all(0 < r.lower <= r.local_upper for r in layers)
