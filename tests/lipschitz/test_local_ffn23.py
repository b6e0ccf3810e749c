"""F72 (issue 12, ffn23): F70's drift through the reachable rows by Schur's inequality, and at every token lazily."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from test_local_ffn22 import _ascent, _bounds, _layer, _rows
from test_local_layer17 import _case
from transcover.lipschitz import _local_ffn_reach as fr
from transcover.lipschitz import _local_stages as st
from transcover.lipschitz._local_ffn2 import centre_gelu2_err, ffn_hadamard
from transcover.lipschitz._local_jacobian import gelu_second


def _lmax(M: torch.Tensor) -> float:
    return float(torch.linalg.eigvalsh(0.5 * (M + M.T))[-1])


def _tightest(ffn, h: torch.Tensor, Ls: torch.Tensor, w: torch.Tensor, r: float, remH: float) -> tuple[float, float]:  # noqa: ANN001
    """F70a's two sums with every ``lambda_max`` by float64 ``eigvalsh`` (no pads) and the reaches from the exact
    ``G_kk``: the smallest values F70a's formula can take, which each of F72a's branches must not undercut."""
    const = ffn_hadamard(ffn, centred=True)
    W1, W2 = const["W1"], const["W2"]
    Q = w.sum() * (Ls @ Ls.transpose(1, 2) / w[:, None, None]).sum(0)
    G, G1 = W1.T @ Q @ W1, W1.T @ W1
    n1 = W1.norm(dim=0)
    rh = r * math.sqrt(_lmax(Q)) + remH
    z = h @ W1 + ffn.b_1.double()
    Rk = torch.minimum(n1 * rh, r * G.diagonal().clamp(min=0).sqrt() + n1 * remH)
    om = fr._omega(z, Rk, gelu_second(z), centre_gelu2_err(None))
    A, sw = gelu_second(z)[:, None] * W2, om.sqrt()
    N = {k: math.sqrt(max(_lmax(A.T @ H @ A), 0.0)) for k, H in (("Q", G * G), ("Qm", G * G1), ("1", G1 * G1))}
    k = {k: math.sqrt(max(_lmax(sw[:, None] * H * sw[None]), 0.0)) for k, H in (("Q", G * G), ("Qm", G * G1),
                                                                                 ("1", G1 * G1))}
    nw = float(torch.linalg.matrix_norm(sw[:, None] * W2, ord=2))
    q = N["Q"] * r + N["Qm"] * remH + nw * (k["Q"] * r + k["Qm"] * remH)
    qm = N["Qm"] * r + N["1"] * remH + nw * (k["Qm"] * r + k["1"] * remH)
    return q, qm


CASES = [(2.0, None, 2, 0.3, 0.1), (6.0, -4.0, 3, 0.2, 0.0), (0.5, 0.0, 6, 1.0, 0.2), (2.0, 3.0, 1, 0.5, 0.05),
         (1e-3, 0.0, 6, 1e-4, 0.0)]


@pytest.mark.parametrize("scale,bias,rank,r,remH", CASES)
def test_schur_bound_is_at_least_every_exact_lambda_max(scale, bias, rank, r, remH):
    """F72a's sums are at least F70a's formula with every ``lambda_max`` exact (float64 ``eigvalsh``): every unit at
    GELU'''s peak, saturated, near 0, half-open, tiny weights; maps of rank 1 to full, with and without ``remH``."""
    ffn, h, Ls, w = _case(7, 6, 24, scale, bias, rank, T=3)
    q, qm = _bounds(ffn, h, Ls, w, r, remH, drift=fr.ffn_reach_drift_schur)
    tq, tqm = _tightest(ffn, h, Ls, w, r, remH)
    assert math.isfinite(q) and q >= tq and qm >= tqm, (q, tq, qm, tqm)
    assert q <= 200 * tq + 1e-300  # and not vacuous: within a bounded factor of the exact formula at these sizes


@pytest.mark.parametrize("kind", ["random", "rank1", "huge", "tiny"])
def test_lambda_max_of_g_from_a_d_by_d_certificate(kind):
    """``_lmax_g``: ``lambda_max(W_1^T (Q + eQ I) W_1)`` from ``L^T Q L`` (``W_1 W_1^T``'s Cholesky factor) is at least
    the float64 eigenvalue, for a rank-1 ``W_1`` (a singular ``W_1 W_1^T``), ``W_1 x 1e6`` and ``x 1e-6``, and within
    1e-6 of it."""
    g = torch.Generator().manual_seed(3)
    W1 = torch.randn(6, 20, generator=g, dtype=torch.float64)
    if kind == "rank1":
        W1 = torch.randn(6, 1, generator=g, dtype=torch.float64) @ torch.randn(1, 20, generator=g, dtype=torch.float64)
    W1 = W1 * {"huge": 1e6, "tiny": 1e-6}.get(kind, 1.0)
    B = torch.randn(2, 6, 6, generator=g, dtype=torch.float64)
    Q = B @ B.transpose(1, 2)
    Q[1] = Q[1] * 1e-8 + torch.outer(B[1, 0], B[1, 0])  # nearly rank 1
    fQ = Q.norm(dim=(1, 2))
    eQ = fQ * 1e-15
    lG = fr._lmax_g(fr._schur_layer({"W1": W1}), Q, fQ, eQ)
    for i in range(2):
        exact = _lmax(W1.T @ (Q[i] + eQ[i] * torch.eye(6, dtype=torch.float64)) @ W1)
        assert exact <= float(lG[i]) <= exact * (1 + 1e-6) + 1e-300, (kind, exact, float(lG[i]))


@pytest.mark.parametrize("scale,bias,rank,r,remH", [CASES[0], CASES[1]])
def test_schur_bound_is_never_beaten(scale, bias, rank, r, remH):
    """Float64 Adam over the reachable set (``test_local_ffn22``'s ascent) on the aligned and the free drift stays below
    F72a's two bounds."""
    ffn, h, Ls, w = _case(3, 6, 24, scale, bias, rank, T=3)
    q, qm = _bounds(ffn, h, Ls, w, r, remH, drift=fr.ffn_reach_drift_schur)
    got, got_m = _ascent(ffn, h, Ls, r, remH, 0)
    assert got <= q and got_m <= qm, (got, q, got_m, qm)


def test_schur_bound_scales_with_the_output_weights_and_the_rows():
    """``W_2 x c`` scales both of F72a's bounds by c; the rows ``L x c`` with ``r / c`` and ``remH = 0`` scale the aligned
    one by c and leave the free one (F70a's homogeneity)."""
    ffn, h, Ls, w = _case(5, 6, 24, 2.0, 0.0, 6, T=3)
    q, qm = _bounds(ffn, h, Ls, w, 0.4, 0.0, drift=fr.ffn_reach_drift_schur)
    for c in (0.25, 3.0):
        got = _bounds(dataclasses.replace(ffn, W_2=ffn.W_2 * c), h, Ls, w, 0.4, 0.0, drift=fr.ffn_reach_drift_schur)
        assert got[0] == pytest.approx(c * q, rel=1e-9) and got[1] == pytest.approx(c * qm, rel=1e-9)
        got = _bounds(ffn, h, Ls * c, w * c, 0.4 / c, 0.0, drift=fr.ffn_reach_drift_schur)
        assert got[0] == pytest.approx(c * q, rel=1e-6) and got[1] == pytest.approx(qm, rel=1e-6)


def _every_token(monkeypatch) -> None:  # noqa: ANN001
    """Replace F72b's lazy rule by refining every token to the end (F72a, then F70a at all of them)."""
    def full(evaluate, reported, refine, T, lowest=None):  # noqa: ANN001, ANN202
        evaluate()
        while not bool(refine(torch.arange(T)).all()):
            pass
        return evaluate()
    monkeypatch.setattr(st, "refine_lazily", full)


@pytest.mark.parametrize("kind,T,r", [("sharp", 5, 0.01), ("flat", 3, 0.03), ("plain", 4, 0.02)])
def test_lazy_rows_have_the_maxima_of_every_token(kind, T, r, monkeypatch):
    """F72b's lazy rule gives the ball and the largest drift row of F70a at every token (the same floats), each ball row
    and drift row at most F70's off; with the exact certificate capped at one token the rows are still at most off."""
    layer = _layer(kind, 11)
    X = torch.randn(T, 8, generator=torch.Generator().manual_seed(T), dtype=torch.float64) * 2
    if kind == "flat":
        X[0] = 0.5 + 1e-9 * X[0]
    off, lazy, one = _rows(layer, X, r, 0), _rows(layer, X, r, T), _rows(layer, X, r, 1)
    for on in (lazy, one):
        assert bool((on.ball_rows <= off.ball_rows).all()) and bool((on.drift_rows <= off.drift_rows).all())
    _every_token(monkeypatch)
    every = _rows(layer, X, r, T)
    assert lazy.ball == every.ball and float(lazy.drift_rows.max()) == float(every.drift_rows.max())
    if kind == "plain":
        assert lazy.ball < 0.9 * off.ball


def test_each_token_uses_its_own_first_norm_gram(monkeypatch):
    """F70/F72 read token i's ellipsoid ``D1_i S_i D1_i^T`` (F54b, F40a), not ``S_i`` through another token's ``D1`` (a
    slice of the Grams against every token's norm Jacobian pairs ``S_i`` with token 0's)."""
    from transcover.lipschitz._local_attention import head_norms
    from transcover.lipschitz._local_row_weights import reweighted

    layer = _layer("sharp", 11)
    X = torch.randn(5, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2
    seen = []
    for name in ("ffn_reach_drift", "ffn_reach_drift_schur"):
        orig = getattr(fr, name)
        monkeypatch.setattr(fr, name, lambda *a, _f=orig, **k: seen.append((a[2], a[3])) or _f(*a, **k))
    _rows(layer, X, 0.01, 5)
    at = st.layer_at_x(layer, X, float(head_norms(layer.attention)["O"]))
    gram = st.attention_row_gram(at)
    gram, _ = reweighted(at, gram, st.post_point(at, gram))
    Sa = at.n1.sandwich(gram.S, gram.err)[0]
    assert seen
    for z, S in seen:
        for k in range(len(z)):
            i = int((at.z - z[k]).abs().sum(dim=1).argmin())
            assert torch.equal(S[k], Sa[i]), i
