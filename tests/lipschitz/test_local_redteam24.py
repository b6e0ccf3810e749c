"""Red team of stop 17's certificates (F71, F72; docs/results/redteam24.md) and of red23's surviving mutations.

red24-1: the Hadamard tensor norms of F40b (``ffn_aligned_norms``, the stack) and F70a (``ffn_reach_drift``, the layer
rows) form ``G o G`` (degree 4 in ``W_1``) with pads relative to float64's normal range; with ``W_1`` out of F38's
range the products underflow and the norm fell 1e11 below the true one (THEORY F75).
"""

from __future__ import annotations

import dataclasses

import torch

from test_local_ffn22 import _bounds
from test_local_layer17 import _case
from transcover.lipschitz import _local_ffn_reach as fr
from transcover.lipschitz._local_ffn2 import ffn_hadamard
from transcover.lipschitz._local_jacobian import gelu_second
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
    ``c^2`` times the attained first-order value at ``c = 1`` (F70a gave 3.7e-210 against 3.9e-199), F40b's ``nq`` above
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
