"""F70 (issue 12, ffn22): the FFN Jacobian's drift through the first norm's reachable rows, against float64 ascent."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lipschitz_testkit import hetero_gamma, projected_adam, random_spec, sphere_adam
from test_local_layer17 import _case
from transcover.lipschitz._local_ffn2 import ffn_hadamard
from transcover.lipschitz._local_ffn_reach import ffn_reach_drift
from transcover.model import ffn_forward


def _bounds(ffn, h: torch.Tensor, Ls: torch.Tensor, w: torch.Tensor, r: float, remH: float,  # noqa: ANN001
            drift=ffn_reach_drift) -> tuple[float, float]:  # noqa: ANN001
    """F70a's two bounds (centred; ``drift``: or F72a's ``ffn_reach_drift_schur``) for the reachable rows ``sum_j L_j
    d_j`` (``Q = sum w (sum_j L_j L_j^T / w_j)``, F40a) on the ball ``rh = r (lambda_max(S) sum w)^{1/2} + remH``."""
    const = ffn_hadamard(ffn, centred=True)
    S = (Ls @ Ls.transpose(1, 2) / w[:, None, None]).sum(0)[None]
    wsum = w.sum()[None]
    rh = r * math.sqrt(float(torch.linalg.eigvalsh(S[0])[-1] * wsum[0])) + remH
    z = (h @ ffn.W_1.double() + ffn.b_1.double())[None]
    one = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    q, qm = drift(const, ffn.W_1.double().norm(dim=0) * (1 + 1e-12), z, S, torch.zeros(1, dtype=torch.float64), wsum,
                  r, one(remH), one(rh))
    return float(q[0]), float(qm[0])


def _slope(ffn, h: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The centred FFN Jacobian ``P W_2^T diag(GELU'(z)) W_1^T`` in closed form (``GELU' = Phi + z phi``; differentiable
    in h, checked against autograd in ``test_reach_drift_scales_with_the_output_weights_and_the_rows``)."""
    d = h.shape[0]
    z = h @ ffn.W_1.double() + ffn.b_1.double()
    s = 0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * torch.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return (torch.eye(d, dtype=torch.float64) - 1.0 / d) @ (ffn.W_2.double().T * s) @ ffn.W_1.double().T


def _ascent(ffn, h: torch.Tensor, Ls: torch.Tensor, r: float, remH: float, seed: int) -> tuple[float, float]:  # noqa: ANN001
    """Float64 Adam (projected, then on the spheres) over ``dh = sum_j L_j d_j + rho`` (``||d_j|| <= r``, ``||rho|| <=
    remH``) and ``b = sum_j L_j v_j`` (``||v_j|| <= 1``): the largest ``||P(J_F(h + dh) - J_F(h)) b||`` and
    ``||P(J_F(h + dh) - J_F(h))||_2`` seen."""
    T, d = Ls.shape[0], h.shape[0]
    J0 = _slope(ffn, h).detach()
    g = torch.Generator().manual_seed(seed)
    starts = [(torch.randn(T, d, generator=g, dtype=torch.float64) * r, torch.randn(d, generator=g, dtype=torch.float64)
               * max(remH, 1e-300), torch.randn(T, d, generator=g, dtype=torch.float64)) for _ in range(2)]
    move = lambda D, R: (Ls @ D[:, :, None])[:, :, 0].sum(0) + R  # noqa: E731

    def aligned(D: torch.Tensor, R: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        return ((_slope(ffn, h + move(D, R)) - J0) @ (Ls @ V[:, :, None])[:, :, 0].sum(0)).norm()

    def free(D: torch.Tensor, R: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        return torch.linalg.matrix_norm(_slope(ffn, h + move(D, R)) - J0, ord=2)

    radii, lr = (r, remH, 1.0), 0.1 * max(r, remH)
    return tuple(max(projected_adam(f, starts, radii, lr, 25), sphere_adam(f, starts, radii, 25)) for f in (aligned, free))


@pytest.mark.parametrize("scale,bias,rank,r,remH", [
    (2.0, None, 2, 0.3, 0.1), (6.0, -4.0, 3, 0.2, 0.0), (0.5, 0.0, 8, 1.0, 0.2), (2.0, 3.0, 1, 0.5, 0.05)])
def test_reach_drift_is_never_beaten(scale, bias, rank, r, remH):
    """Adam ascent on the aligned drift ``||P(J_F(h + dh) - J_F(h)) b||`` and on the free one ``||P(J_F(h + dh) -
    J_F(h))||`` over the reachable set stays below F70a's two bounds: every unit at GELU'''s peak (``bias=None``),
    saturated (``W_1 x 6``, bias -4), units near 0 (scale 0.5), half-open (+3); maps of rank 1, 2, 3 and full, with and
    without ``remH``."""
    ffn, h, Ls, w = _case(3, 6, 24, scale, bias, rank, T=3)
    q, qm = _bounds(ffn, h, Ls, w, r, remH)
    got, got_m = _ascent(ffn, h, Ls, r, remH, 0)
    assert math.isfinite(q) and got <= q and got_m <= qm, (got, q, got_m, qm)
    assert got >= 0.02 * q  # the ascent finds the scale (not a vacuous pass)


def test_reach_drift_scales_with_the_output_weights_and_the_rows():
    """``W_2 x c`` scales both bounds by c (linear in ``W_2``); the rows ``L x c`` with ``r / c`` (the same moves of
    ``h``, the direction rows ``b`` c times longer) and ``remH = 0`` scale the aligned bound by c, the free one by 1."""
    ffn, h, Ls, w = _case(5, 6, 24, 2.0, 0.0, 6, T=3)
    J = torch.autograd.functional.jacobian(lambda x: ffn_forward(ffn, x[None])[0], h)
    assert torch.allclose(_slope(ffn, h), J - J.mean(dim=0, keepdim=True), atol=1e-12)
    q, qm = _bounds(ffn, h, Ls, w, 0.4, 0.0)
    for c in (0.25, 3.0):
        got = _bounds(dataclasses.replace(ffn, W_2=ffn.W_2 * c), h, Ls, w, 0.4, 0.0)
        assert got[0] == pytest.approx(c * q, rel=1e-9) and got[1] == pytest.approx(c * qm, rel=1e-9)
        got = _bounds(ffn, h, Ls * c, w * c, 0.4 / c, 0.0)
        assert got[0] == pytest.approx(c * q, rel=1e-6) and got[1] == pytest.approx(qm, rel=1e-6)


def _layer(kind: str, seed: int, placement: str = "post"):  # noqa: ANN202
    """A small GELU layer (d 8, d_ff 48): ``"sat"`` with ``W_1 x 6`` (saturated units), ``"sharp"`` with ``W_Q x 8``
    (sharp heads, causal), ``"flat"`` with eps 1e-12 (for near-flat tokens) and every other ``gamma_1`` 1e-6."""
    layer = random_spec(seed, act="gelu", norm="layernorm", placement=placement, d=8, H=2, dh=4, dff=48, biases=True,
                        scale=2.0, eps=1e-12 if kind == "flat" else 1e-6, causal=kind == "sharp").layers[0]
    if kind == "sat":
        layer = dataclasses.replace(layer, ffn=dataclasses.replace(layer.ffn, W_1=layer.ffn.W_1 * 6))
    if kind == "flat":
        g = torch.Generator().manual_seed(seed)
        layer = dataclasses.replace(layer, norm_attn=dataclasses.replace(layer.norm_attn,
                                                                         weight=hetero_gamma("tiny", 8, g)))
    if kind == "sharp":
        att = layer.attention
        layer = dataclasses.replace(layer, attention=dataclasses.replace(att, W_Q=att.W_Q * 8))
    return layer


def _drift_ascent(layer, X: torch.Tensor, r: float, i: int) -> float:  # noqa: ANN001
    """Float64 Adam over ``Y in B(X, r)`` ((2,inf)) and (2,inf)-unit ``V``: the largest ``||((J(Y) - J(X)) V)_i||`` seen."""
    from transcover.model._functional import layer_forward

    f = lambda Z: layer_forward(layer, Z)  # noqa: E731
    g = torch.Generator().manual_seed(i)
    starts = [(torch.randn(X.shape, generator=g, dtype=torch.float64) * r,
               torch.randn(X.shape, generator=g, dtype=torch.float64)) for _ in range(2)]

    def val(E: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        jy = torch.autograd.functional.jvp(f, X + E, V, create_graph=True)[1]
        jx = torch.autograd.functional.jvp(f, X, V, create_graph=True)[1]
        return (jy - jx)[i].norm()

    return max(projected_adam(val, starts, (r, 1.0), 0.1 * r, 25), sphere_adam(val, starts, (r, 1.0), 25))


def _rows(layer, X: torch.Tensor, r: float, tokens: int) -> tuple:  # noqa: ANN001
    from transcover.lipschitz import _local_stages
    from transcover.lipschitz._local_rows import layer_rows

    _local_stages.REACH_DRIFT_TOKENS, keep = tokens, _local_stages.REACH_DRIFT_TOKENS
    try:
        return layer_rows(layer, X, [r], tiers=True)[0]
    finally:
        _local_stages.REACH_DRIFT_TOKENS = keep


@pytest.mark.parametrize("kind,T,r", [("sat", 1, 0.05), ("sharp", 5, 0.01), ("flat", 3, 0.03)])
def test_layer_rows_with_the_reach_drift(kind, T, r):
    """Post-LN layers (T = 1, 3, 5; saturated units, sharp heads, eps 1e-12 with a near-flat token and tiny gamma_1): with
    F70 at every token the ball, each ball row and drift row are at most without it, the pair/Jacobian adversary stays
    below the ball and Adam on ``||((J(Y) - J(X))V)_i||`` below the drift row of the ball's largest token."""
    from test_lipschitz_local import adversary
    from transcover.model._functional import layer_forward

    layer = _layer(kind, 11)
    X = torch.randn(T, 8, generator=torch.Generator().manual_seed(T), dtype=torch.float64) * 2
    if kind == "flat":
        X[0] = 0.5 + 1e-9 * X[0]  # a token within 1e-8 of a constant vector: sigma ~ 1e-9
    off, on = _rows(layer, X, r, 0), _rows(layer, X, r, T)
    assert on.ball <= off.ball and bool((on.ball_rows <= off.ball_rows).all()) and \
        bool((on.drift_rows <= off.drift_rows).all())
    assert adversary(lambda Z: layer_forward(layer, Z), X, r, restarts=1, steps=15, seed=1) <= on.ball
    i = int(on.ball_rows.argmax())
    assert _drift_ascent(layer, X, r, i) <= float(on.drift_rows[i])


def test_the_reach_drift_wins_somewhere_and_leaves_pre_ln_alone():
    """A post-LN layer where F70 lowers the ball (the FFN drift through thin reachable rows) and a pre-LN one where it is
    not applied (the same floats)."""
    X = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2
    layer = _layer("plain", 3)
    off, on = _rows(layer, X, 0.02, 0), _rows(layer, X, 0.02, 4)
    assert on.ball < 0.9 * off.ball, (on.ball, off.ball)
    pre = _layer("plain", 3, placement="pre")
    off, on = _rows(pre, X, 0.02, 0), _rows(pre, X, 0.02, 4)
    assert on.ball == off.ball and torch.equal(on.ball_rows, off.ball_rows)
