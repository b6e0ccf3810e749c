"""Red team of stop 17's certificates (F71, F72; docs/results/redteam24.md) and of red23's surviving mutations.

red24-1: the Hadamard tensor norms of F40b (``ffn_aligned_norms``, the stack) and F70a (``ffn_reach_drift``, the layer
rows) form ``G o G`` (degree 4 in ``W_1``) with pads relative to float64's normal range; with ``W_1`` out of F38's
range the products underflow and the norm fell 1e11 below the true one (THEORY F75).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import transcover.lipschitz._local_stack as ls
from test_local_drift23 import CASES as _DRIFT23_CASES
from test_local_drift23 import _case as _drift23_case
from test_local_ffn22 import _ascent, _bounds
from test_local_layer17 import _case
from transcover.lipschitz import _local_ffn_reach as fr
from transcover.lipschitz import _local_stack_aligned as sa
from transcover.lipschitz import _local_stack_attn as sat
from transcover.lipschitz._local_ffn2 import ffn_hadamard, ffn_split_constants, split_row_norm2
from transcover.lipschitz._local_jacobian import gelu_second
from transcover.lipschitz._local_stack import stack_local
from transcover.lipschitz._local_stack_aligned import ellipsoid_gram, ffn_aligned_norms


def _first_order(ffn, h: torch.Tensor, Ls: torch.Tensor, r: float) -> float:  # noqa: ANN001
    """The largest ``||P W_2^T diag(GELU''(z) s o b') ||`` (``s = W_1^T dh``, ``b' = W_1^T b``) over 64 random pairs of the
    reachable set: F70a's aligned drift to first order, exact in the limit of small moves."""
    W1, W2 = ffn.W_1.double(), ffn.W_2.double()
    d = h.shape[0]
    P = torch.eye(d, dtype=torch.float64) - 1.0 / d
    D2 = gelu_second(h @ W1 + ffn.b_1.double())
    g = torch.Generator().manual_seed(0)
    A, B = (torch.randn(64, *Ls.shape[:2], generator=g, dtype=torch.float64) for _ in "AB")
    dh = torch.einsum("tij,ntj->ni", Ls, r * A / A.norm(dim=-1, keepdim=True))
    b = torch.einsum("tij,ntj->ni", Ls, B / B.norm(dim=-1, keepdim=True))
    return float(((D2 * (dh @ W1) * (b @ W1)) @ W2 @ P).norm(dim=1).max())


def test_f40b_f70a_norms_hold_with_weights_out_of_range():
    """red24-1: ``W_1 x c`` with the first biases moved so that the pre-activations stay (``c = 1e-100``; the true
    first-order drift and ``N_Q`` scale by exactly ``c^2``, the rest is ``O(c^3)``): F70a's ``ffnq`` and F72a's stay above
    ``c^2`` times the attained first-order value at ``c = 1`` (F70a gave 3.7e-210 against 3.3e-199), F40b's ``nq`` above
    ``c^2`` times the exact ``lambda_max(W_2^T D (G o G) D W_2)^{1/2}`` (1.2e-209 against 5.3e-198)."""
    ffn, h, Ls, w = _case(7, 6, 24, 2.0, None, 2, T=3)
    W1 = ffn.W_1.double()
    z = h @ W1 + ffn.b_1.double()
    att = _first_order(ffn, h, Ls, 0.3)
    Q, _ = ellipsoid_gram(Ls)
    G = W1.T @ Q @ W1
    A = gelu_second(z)[:, None] * ffn_hadamard(ffn, centred=False)["W2"]
    exact = float(torch.linalg.eigvalsh(A.T @ (G * G) @ A)[-1]) ** 0.5
    for c in (1.0, 1e-100):
        f = dataclasses.replace(ffn, W_1=ffn.W_1 * c, b_1=z - h @ (W1 * c))
        for drift in (fr.ffn_reach_drift, fr.ffn_reach_drift_schur):
            q, _ = _bounds(f, h, Ls, w, 0.3, 0.0, drift=drift)
            assert q >= 0.5 * c * c * att, (c, drift.__name__, q, c * c * att)
        nq, _ = ffn_aligned_norms(ffn_hadamard(f, centred=False), f.W_1.double(), z[None], Ls[None])
        assert float(nq[0]) >= c * c * exact, (c, float(nq[0]), c * c * exact)


def test_f72a_is_attained_by_one_unit():
    """With one unit (``d_ff = 1``) Schur's inequality is an equality (``G o G = lambda_max(G) (G o I)``), so F72a equals
    F70a's formula (to 1e-10) and red23's one-unit case attains it: Adam reaches >= 95 % of ``ffnq``, ``ffnqm`` at the
    unit's GELU'' peak (``r = 1e-2``, ``remH = r/2``: every ``N`` term exact) and >= 92 % at ``z = sqrt 2`` (only the rest
    ``||diag(omega)^{1/2} P W_2|| (k r + k' remH)`` remains): any of F72a's factors halved fails."""
    for shift, r, share in ((0.0, 1e-2, 0.95), (math.sqrt(2), 0.03, 0.92)):
        ffn, h, Ls, w = _case(3, 6, 1, 1.0, None, 1, T=1)
        ffn = dataclasses.replace(ffn, b_1=ffn.b_1 + shift)
        q, qm = _bounds(ffn, h, Ls, w, r, r / 2, drift=fr.ffn_reach_drift_schur)
        assert (q, qm) == pytest.approx(_bounds(ffn, h, Ls, w, r, r / 2), rel=1e-10)
        got, got_m = _ascent(ffn, h, Ls, r, r / 2, 0)
        assert share * q <= got <= q and share * qm <= got_m <= qm, (got / q, got_m / qm)


def test_f72a_lambda_max_pads(monkeypatch):
    """``_lmax_g``'s error terms: with the ellipsoid's own error ``eQ = 1e-2 ||Q||_F`` (float64) the certificate stays
    above ``lambda_max(W_1^T (Q + eQ I) W_1)`` only with its ``eQ ||L||_F^2`` term; evaluated in float32 with u = 2^-24
    (float32 ``W_1``, ``Q``) its rounding terms cover the float64 value of the same data, within 1e-4 of it."""
    g = torch.Generator().manual_seed(5)
    for u in (2.0**-53, 2.0**-24):
        monkeypatch.setattr(fr, "_U", u)
        monkeypatch.setattr(sa, "_U", u)
        dt, rel = (torch.float64, 1e-2) if u < 1e-10 else (torch.float32, 2.0**-20)
        W1 = torch.randn(8, 20, generator=g, dtype=torch.float64).to(dt)
        B = torch.randn(8, 8, generator=g, dtype=torch.float64)
        Q = (B @ B.T).to(dt)[None]
        fQ = Q.double().norm(dim=(1, 2)).to(dt) * (1 + 1e-6)
        eQ = fQ * rel
        got = float(fr._lmax_g(fr._schur_layer({"W1": W1}), Q, fQ, eQ)[0])
        W = W1.double()
        exact = float(torch.linalg.eigvalsh(W.T @ (Q[0].double() + float(eQ[0]) * torch.eye(8, dtype=torch.float64)) @ W)[-1])
        assert exact <= got <= exact * (1 + (0.5 if u < 1e-10 else 1e-4)), (u, exact, got)


def test_split_row_norm2_is_exact_with_a_full_split_and_covers_the_rest():
    """F45a's ``||diag(a) W_2||^2`` (F72a's two cheap norms): with the split's rank at least d (``R_2 = 0``, only the
    ``tau`` shift) it is the exact value to 1e-6; with rank 2 of d = 6 it stays above the exact value for one-hot
    weights (each unit's row is ``||F e_k||^2 + (R_2)_kk``: the ``lR2`` term carries the rest) and random ones."""
    ffn = _case(3, 6, 24, 2.0, 0.0, 2)[0]
    const = ffn_hadamard(ffn, centred=True)
    a = torch.cat([torch.eye(24, dtype=torch.float64)[:6], torch.rand(3, 24, generator=torch.Generator().manual_seed(1),
                                                                      dtype=torch.float64)])
    exact = torch.linalg.matrix_norm(a[:, :, None] * const["W2"][None], ord=2) ** 2
    for rank2 in (6, 2):
        got = split_row_norm2(ffn_split_constants(const, rank=4, rank2=rank2), a)
        assert bool((exact <= got).all()), (rank2, got / exact)
        if rank2 == 6:
            assert bool((got <= exact * (1 + 1e-6)).all()), got / exact


def test_f70a_omega_is_bounded_by_gelu2_oscillation():
    """F70a/F72a's ``omega`` (the slope change's mean past first order, per unit) at a large reach is the range branch,
    at most ``sup GELU'' - inf GELU'' < 0.91`` (red23's surviving mutation, the Taylor branch ``s3 R / 2`` alone, is 39
    at ``R = 100``); at a small reach the Taylor branch, below ``0.39 R``."""
    z = torch.linspace(-6, 6, 49, dtype=torch.float64)
    for R, cap in ((100.0, 0.91), (1e-3, 0.39e-3)):
        om = fr._omega(z, torch.full_like(z, R), gelu_second(z), 1e-16)
        assert bool((om <= cap).all()) and float(om.max()) > 0.5 * cap, (R, float(om.max()))


def test_f71_every_move_consumer_reads_the_segment_rows(monkeypatch):
    """F71b items 1, 3, 4: at every sub-stage and radius, F44e/F44f/F40's drift and reach (``AttentionAligned.drift``,
    ``reach_heads``, ``joint``, ``FFNAligned.drift``, ``reach``) read exactly F71's rows ``m`` of that stage and radius
    (saturated GELU, T = 1, radii ``[rho, rho/2]`` unsorted, one auxiliary radius; the per-layer route off), and the stage
    radii of the first layer's three inner sub-stages are ``rho (nu + m)`` (1e-9 against a run with ``m`` replaced by 0):
    a consumer reading less (a halved or a smaller radius's ``m``) is not a bound of the move, and none of them shows in
    an attained value (docs/results/redteam24.md)."""
    spec, X, rhos, _ = _drift23_case(_DRIFT23_CASES[3])
    rhos = [rhos[-1], rhos[-1] / 2]
    seen, calls = [], []
    real = ls.segment_moves
    monkeypatch.setattr(ls, "segment_moves", lambda dP, rs: seen.append((list(rs), real(dP, rs))) or seen[-1][1])
    for cls, name, at in ((sat.AttentionAligned, "drift", 2), (sat.AttentionAligned, "reach_heads", 2),
                          (sat.AttentionAligned, "joint", 2), (sa.FFNAligned, "drift", 2), (sa.FFNAligned, "reach", 3)):
        orig = getattr(cls, name)

        def spy(self, *a, _o=orig, _n=name, _at=at, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            calls.append((_n, len(seen) - 1, a[_at - 1], a[_at]))
            return _o(self, *a, **k)
        monkeypatch.setattr(cls, name, spy)
    res = stack_local(spec, X, rhos, aux=(0.25,), layer_route=False)
    assert {c[0] for c in calls} == {"drift", "reach_heads", "joint", "reach"}, calls
    for _, s, rho, dP in calls:
        rs, m = seen[s]
        assert torch.equal(dP, m[rs.index(rho)])
    monkeypatch.setattr(ls, "segment_moves", lambda dP, rs: [torch.zeros_like(v) for v in dP])
    zero = stack_local(spec, X, rhos, aux=(0.25,), layer_route=False)
    for k, rho in enumerate(rhos):
        for s in (1, 2, 3):
            m = seen[s][1][seen[s][0].index(rho)]
            got = res[k].token_radii[s] - zero[k].token_radii[s]
            assert torch.allclose(got, rho * m, rtol=1e-9, atol=0.0), (s, got / (rho * m))
