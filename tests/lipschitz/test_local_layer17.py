"""F54: the FFN's remainder on the first norm's reachable set (``_local_ffn_reach``), attacked by Adam ascent over the
set, against a dense reference and a fine grid, homogeneity, and in ``layer_rows``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from batched_redteam_ascents import ffn_remainder_ascent
from lipschitz_testkit import hetero_gamma, minilm_layer0_rows, projected_adam, random_spec, sphere_adam
from test_local_ffn2 import _ffn
from transcover.lipschitz._local_ffn2 import ffn_hadamard
from transcover.lipschitz._local_ffn_reach import ffn_reach_remainder, gelu2_range, nested_beta
from transcover.lipschitz._local_jacobian import gelu_second
from transcover.model import ffn_forward


def test_gelu2_range_holds_on_a_fine_grid():
    """``gelu2_range`` against GELU'' on a 20 001-point grid of each interval (around 0, around +-2, saturated, tiny,
    wide): the grid's extrema lie inside, and the bounds are within the grid's Lipschitz margin (``sup|GELU'''| h/2``,
    0.78) plus 1e-12 of them."""
    for a, b in ((-0.3, 0.4), (1.5, 2.6), (-2.4, -1.9), (-40.0, -30.0), (5.0, 5.0 + 1e-9), (-7.0, 9.0), (0.1, 1.9)):
        lo, hi = gelu2_range(torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64))
        grid = gelu_second(torch.linspace(a, b, 20_001, dtype=torch.float64))
        margin = 0.78 * (b - a) / 20_000 / 2 + 1e-12
        assert float(lo) <= float(grid.min()) and float(grid.max()) <= float(hi), (a, b)
        assert float(grid.min()) - float(lo) <= margin and float(hi) - float(grid.max()) <= margin, (a, b)


def _case(seed: int, d: int, dff: int, scale: float, bias: float, rank: int, T: int = 4):  # noqa: ANN202
    """An FFN (first-layer biases shifted by ``bias``; ``bias=None``: the centre's pre-activations 0, every unit at
    GELU'''s peak), a centre ``h`` and the blocks ``L_j`` of a linear map of rank ``rank`` (the reachable set of the
    attention and first norm at X) with positive weights."""
    ffn = _ffn(seed, d, dff, scale)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(d, generator=g, dtype=torch.float64) * 2
    b1 = -(h @ ffn.W_1.double()) if bias is None else ffn.b_1.double() + bias
    ffn = dataclasses.replace(ffn, b_1=b1)
    U = torch.randn(d, rank, generator=g, dtype=torch.float64)
    Ls = U[None] @ torch.randn(T, rank, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    w = Ls.norm(dim=(1, 2)) + 0.1
    return ffn, h, Ls, w


def _bound(ffn, h: torch.Tensor, Ls: torch.Tensor, w: torch.Tensor, r: float, remH: float) -> tuple[float, float]:  # noqa: ANN001
    """F54's bound (centred) and the ball radius ``rh = r (lambda_max(S) sum w)^{1/2} + remH`` it is called with."""
    const = ffn_hadamard(ffn, centred=True)
    S = (Ls @ Ls.transpose(1, 2) / w[:, None, None]).sum(0)[None]
    wsum = w.sum()[None]
    rh = r * math.sqrt(float(torch.linalg.eigvalsh(S[0])[-1] * wsum[0])) + remH
    z = (h @ ffn.W_1.double() + ffn.b_1.double())[None]
    out = ffn_reach_remainder(const, ffn.W_1.double().norm(dim=0) * (1 + 1e-12), z, S,
                              torch.zeros(1, dtype=torch.float64), wsum, r, torch.tensor([remH], dtype=torch.float64),
                              torch.tensor([rh], dtype=torch.float64))
    return float(out[0]), rh


def _ascent(ffn, h: torch.Tensor, Ls: torch.Tensor, r: float, remH: float, seed: int, starts: list | None = None,  # noqa: ANN001
            steps: int = 60, lr: float = 0.1) -> float:
    """Adam ascent (float64; ``starts`` the ``(d_j, rho)`` starting points, else 3 random ones from ``seed``; ``steps``
    steps of ``lr`` times the larger radius) on ``||P(F(h + dh) - F(h) - J dh)||`` over ``dh = sum_j L_j d_j + rho``,
    ``||d_j|| <= r``, ``||rho|| <= remH`` (projected after every step); the max with ``sphere_adam`` from the same starts'
    directions (every row at its full radius, THEORY F57)."""
    d = h.shape[0]
    P = torch.eye(d, dtype=torch.float64) - 1.0 / d
    J = torch.autograd.functional.jacobian(lambda x: ffn_forward(ffn, x[None])[0], h)
    y0 = ffn_forward(ffn, h[None])[0]
    g = torch.Generator().manual_seed(seed)
    if starts is None:
        starts = [(torch.randn(Ls.shape[0], d, generator=g, dtype=torch.float64) * r,
                   torch.randn(d, generator=g, dtype=torch.float64) * remH) for _ in range(3)]

    def rem(D: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
        dh = (Ls @ D[:, :, None])[:, :, 0].sum(0) + R
        return (P @ (ffn_forward(ffn, (h + dh)[None])[0] - y0 - J @ dh)).norm()

    return max(projected_adam(rem, starts, (r, remH), lr * max(r, remH), steps), sphere_adam(rem, starts, (r, remH), steps))


@pytest.mark.parametrize("scale,bias,rank,r,remH", [
    (2.0, 0.0, 2, 0.5, 0.2), (0.5, 0.0, 8, 1.0, 0.0), (2.0, None, 1, 0.8, 0.1), (6.0, -4.0, 3, 0.3, 0.3),
    (2.0, 3.0, 8, 2.0, 1.0), (2.0, None, 8, 0.05, 0.0)])
def test_reach_remainder_is_never_beaten(scale, bias, rank, r, remH):
    """Adam ascent on the FFN's centred remainder over the reachable set stays below F54's bound: units near 0 (scale
    0.5), every unit at GELU'''s peak (``bias=None``), saturated (bias -4, scale 6), half-open (+3); a rank-1, 2, 3 and
    full linear map, with and without the isotropic remainder ``remH``; and the bound is finite."""
    ffn, h, Ls, w = _case(11, 8, 32, scale, bias, rank)
    bound, _ = _bound(ffn, h, Ls, w, r, remH)
    got = ffn_remainder_ascent(ffn, h, Ls, r, remH, 0)  # _ascent's starts in one batch
    assert math.isfinite(bound) and got <= bound, (got, bound)


def _dense(ffn, h: torch.Tensor, Ls: torch.Tensor, w: torch.Tensor, r: float, remH: float, rh: float) -> float:  # noqa: ANN001
    """F54b's formula by dense matrices: ``K`` (d_ff x d^2) and ``Q^{1/2}`` formed, every norm by ``matrix_norm`` (the
    per-unit weight min'ed with F58a's ``nested_beta``)."""
    W1, W2 = ffn.W_1.double(), ffn.W_2.double()
    W2 = W2 - W2.mean(dim=1, keepdim=True)
    z = h @ W1 + ffn.b_1.double()
    Q = (Ls @ Ls.transpose(1, 2) / w[:, None, None]).sum(0) * w.sum()
    ev, U = torch.linalg.eigh(Q)
    Qh = U @ torch.diag(ev.clamp(min=0).sqrt()) @ U.T
    I = torch.eye(W1.shape[0], dtype=torch.float64)
    K = lambda A, B: torch.einsum("ak,bk->kab", A.T @ W1, B.T @ W1).reshape(W1.shape[1], -1)  # noqa: E731
    Ks = (K(Qh, Qh), K(Qh, I), K(I, I))
    n = lambda M: float(torch.linalg.matrix_norm(M, ord=2))  # noqa: E731
    D = gelu_second(z)
    n1 = W1.norm(dim=0)
    R = torch.minimum(n1 * rh, r * (W1 * (Q @ W1)).sum(0).sqrt() + n1 * remH)
    lo, hi = gelu2_range(z - R, z + R)
    from transcover.lipschitz._local_ffn2 import gelu3_sup
    beta = torch.minimum(torch.maximum(hi - D, D - lo) / 2, gelu3_sup(z - R, z + R) * R / 6)
    beta = torch.minimum(beta, nested_beta(z, R, 0.0, 0.0))  # F58a's weight (its own formula, without eD)
    sb = beta.sqrt()
    c = (r * r, 2 * r * remH, remH * remH)
    first = 0.5 * sum(ci * n(W2.T @ (D[:, None] * Ki)) for ci, Ki in zip(c, Ks))
    return first + n(sb[:, None] * W2) * sum(ci * n(sb[:, None] * Ki) for ci, Ki in zip(c, Ks))


def test_matches_the_dense_formula_and_scales_with_the_output_weights():
    """The certified value is the dense formula to within 1e-6 above (d_ff 40 by eigh, 96 by the Krylov candidate and
    the Cholesky test; units at 0, at the peak and saturated; a full-rank map: with a rank-3 one the d_ff 96 Gram's
    candidate falls back to a looser certified value, 934 against 777), and ``W_2 x c`` scales it by c (1e-9): the
    remainder is linear in ``W_2``."""
    for dff, bias in ((40, 0.0), (96, None), (40, -3.0)):
        ffn, h, Ls, w = _case(5, 10, dff, 2.0, bias, 10)
        bound, rh = _bound(ffn, h, Ls, w, 0.7, 0.2)
        want = _dense(ffn, h, Ls, w, 0.7, 0.2, rh)
        assert want <= bound <= want * (1 + 1e-6), (bound, want)
    for c in (0.25, 3.0):
        got, _ = _bound(dataclasses.replace(ffn, W_2=ffn.W_2 * c), h, Ls, w, 0.7, 0.2)
        assert got == pytest.approx(c * bound, rel=1e-9)


def _post_layer(gamma: str, seed: int):  # noqa: ANN202
    """A small post-LN GELU layer (d 8, d_ff 64) with the first norm's scale made heterogeneous by ``gamma`` and a
    second norm with tiny eps (the floor ``sqrt(d) sigma2`` is what F54 must keep)."""
    layer = random_spec(seed, act="gelu", norm="layernorm", placement="post", d=8, H=2, dh=4, dff=64, biases=True,
                        scale=2.0, eps=1e-6).layers[0]
    g = torch.Generator().manual_seed(seed)
    n1 = dataclasses.replace(layer.norm_attn, weight=hetero_gamma(gamma, 8, g))
    return dataclasses.replace(layer, norm_attn=n1)


@pytest.mark.parametrize("gamma,seed,r", [("negative", 7, 0.03), ("plain", 5, 0.03)])
def test_layer_rows_with_the_reach_remainder(monkeypatch, gamma, seed, r):
    """A small post-LN layer at a radius where the gate opens (eps 1e-6: a tiny floor): F54 is evaluated and sets the
    largest FFN stage radius (8.29 -> 4.60 with signed gamma, 5.32 -> 4.08; each token's own ellipsoid ``D1_i S_i
    D1_i^T`` since ffn23, before it token 0's ``D1``: 3.94, 3.25), never raises any token's, lowers the ball (5 464 ->
    1 181, 1 317 -> 810), and Adam ascent on each stage's move and the pair/Jacobian adversary stay below the rows
    with it."""
    from test_lipschitz_local import adversary
    from test_local_sharp import assert_stage_radii_hold
    from transcover.lipschitz import _local_stages
    from transcover.lipschitz._local_rows import layer_rows
    from transcover.model._functional import layer_forward

    from transcover.lipschitz import _local_row_weights

    # on F34c's row weights: F56's lower g_pt keeps the signed-gamma case's tokens below F54's gate at this radius
    monkeypatch.setattr(_local_row_weights, "reweighted", lambda at, gram, pt: (gram, pt))
    layer = _post_layer(gamma, seed)
    X = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    seen = []
    plain = _local_stages.ffn_reach
    monkeypatch.setattr(_local_stages, "ffn_reach", lambda *a: seen.append(plain(*a)) or seen[-1])
    on = assert_stage_radii_hold(layer, X, [r])[0]
    assert adversary(lambda Z: layer_forward(layer, Z), X, r, restarts=2, steps=30, seed=1) <= on.ball
    assert any(bool(torch.isfinite(s).any()) for s in seen)
    monkeypatch.setattr(_local_stages, "ffn_reach", lambda at, *a: torch.full((at.T,), math.inf, dtype=torch.float64))
    off = layer_rows(layer, X, [r])[0]
    ratio = on.stage_radii["ffn"] / off.stage_radii["ffn"]
    assert bool((ratio <= 1).all()) and float(on.stage_radii["ffn"].max()) < 0.8 * float(off.stage_radii["ffn"].max())
    assert on.ball < 0.65 * off.ball, (on.ball, off.ball)


@pytest.mark.slow
def test_minilm_new_never_above_old_and_the_remainder_holds(monkeypatch, shared_tmp):
    """Real MiniLM layer 0, one real sentence (T = 12), rho = 1e-2: the ball and every token's FFN stage radius with F54
    at most without it, F54 finite at 1e-2 (on every token but the first, whose floor stays lost) and lowering the first
    such token's ``r2`` more than 2x (8.16 -> 2.66); and Adam ascent over the layer's input ball on that token's FFN
    remainder (at the attained move of H) below F54's bound. The rows with F54 are the ones ``minilm_layer0_rows``
    shares (F54 is the default); without it only the 1e-2 ball is computed: at 1e-3 F54 is inf on every token and the
    rows with and without it are the same floats (measured), and the largest ball comes first, so its rows do not depend
    on the smaller one. ``ffn_reach`` is evaluated in the run without F54 (its first call, at 1e-2, sees the same
    inputs)."""
    from transcover.lipschitz import _local_stages
    from transcover.lipschitz._local_rows import layer_rows
    from transcover.model import attention_forward

    spec, X, rhos, new = minilm_layer0_rows(shared_tmp)
    L = spec.layers[0]
    seen = []
    plain = _local_stages.ffn_reach
    with monkeypatch.context() as m:
        m.setattr(_local_stages, "ffn_reach",
                  lambda at, *a: seen.append(plain(at, *a)) or torch.full((at.T,), math.inf, dtype=torch.float64))
        old = layer_rows(L, X, rhos[1:])[0]
    assert new[1].ball <= old.ball and bool((new[1].stage_radii["ffn"] <= old.stage_radii["ffn"]).all())
    reach = seen[0]
    t = int(torch.isfinite(reach).nonzero()[0])
    assert float(new[1].stage_radii["ffn"][t]) < float(old.stage_radii["ffn"][t]) / 2
    H = lambda Z: L.norm_attn(Z + attention_forward(L.attention, Z))  # noqa: E731
    h = H(X)[t].detach()
    ffn = L.ffn
    P = torch.eye(h.shape[0], dtype=torch.float64) - 1.0 / h.shape[0]
    J = torch.autograd.functional.jacobian(lambda x: ffn_forward(ffn, x[None])[0], h)
    y0 = ffn_forward(ffn, h[None])[0]
    g = torch.Generator().manual_seed(0)
    r, best = rhos[1], 0.0
    for _ in range(1):
        E = torch.randn(X.shape, generator=g, dtype=torch.float64)
        E = (E / E.norm(dim=1, keepdim=True) * r).requires_grad_(True)
        opt = torch.optim.Adam([E], lr=0.1 * r)
        for _ in range(30):
            with torch.no_grad():
                E.mul_(torch.clamp(r / E.norm(dim=1, keepdim=True), max=1.0))
            dh = H(X + E)[t] - h
            rem = (P @ (ffn_forward(ffn, (h + dh)[None])[0] - y0 - J @ dh)).norm()
            best = max(best, float(rem.detach()))
            opt.zero_grad()
            (-rem).backward()
            opt.step()
    assert best <= float(reach[t]), (best, float(reach[t]))
