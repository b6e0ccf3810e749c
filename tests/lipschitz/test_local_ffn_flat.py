"""THEORY F90: F38b's FFN second-order trilinear form flattened the other way (``ffn_second_norms_flat``), and its use
in the stack's ``FFNAligned`` (the smaller of the two flattenings).

Independent references: the flattening ``W_1 D Phi`` formed explicitly (d x d^2) and its float64 SVD; a float64 Adam
over unit ``(v, e, u)`` of the form ``T(v, e, u) = sum_k GELU''(z_k) (w2_k . v)(w1_k . e)(w1_k . u)`` (the rank-one sup
both flattenings bound); the stack's own attacks on every FFN stage's drift and rest (``test_local_move26.py``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from lipschitz_testkit import random_spec
from transcover.lipschitz._local_ffn2 import ffn_hadamard, ffn_second_norms, ffn_second_norms_flat

F64 = torch.float64


def _ffn(seed: int, d: int, dff: int, scale: float):  # noqa: ANN202
    return random_spec(seed, act="gelu", norm="layernorm", d=d, dff=dff, scale=scale, biases=True).layers[0].ffn


def _gelu2_exact(z: torch.Tensor) -> torch.Tensor:
    """GELU''(z) = phi(z) (2 - z^2) for the exact (erf) GELU, phi the standard normal density."""
    return torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi) * (2 - z**2)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 500), scale=hs.sampled_from([0.5, 2.0, 6.0]), centred=hs.booleans())
def test_flattening_is_the_explicit_norm_and_bounds_the_form(seed, scale, centred):
    """``N2e`` is ``||W_1 D Phi||_2`` with ``Phi``'s columns ``w2_k (x) w1_k`` formed explicitly (within 1e-8 above
    float64's SVD), and a float64 Adam over unit ``(v, e, u)`` of the trilinear form never exceeds ``min(N2, N2e)`` and
    reaches a third of it."""
    ffn = _ffn(seed, 8, 32, scale)
    const = ffn_hadamard(ffn, centred=centred)
    h = torch.randn(2, 8, generator=torch.Generator().manual_seed(seed), dtype=F64)
    z = h @ ffn.W_1.double() + ffn.b_1.double()
    n2e = ffn_second_norms_flat(const, z)
    n2 = ffn_second_norms(const, z)
    W1, W2 = const["W1"], const["W2"]
    D = _gelu2_exact(z)
    Phi = torch.einsum("ka,bk->kab", W2, W1).reshape(W1.shape[1], -1)  # (d_ff, d^2): rows w2_k (x) w1_k
    for i in range(2):
        exact = float(torch.linalg.matrix_norm((W1 * D[i]) @ Phi, ord=2))
        assert exact <= float(n2e[i]) <= exact * (1 + 1e-8), (exact, float(n2e[i]))
        best = _adam_form(W1, W2, D[i], seed + i)
        top = min(float(n2[i]), float(n2e[i]))
        assert best <= top and best > top / 3, (best, top)


def _adam_form(W1: torch.Tensor, W2: torch.Tensor, D: torch.Tensor, seed: int) -> float:
    """Float64 Adam on the unit spheres (4 starts x 150 steps) of ``|T(v, e, u)|``."""
    g = torch.Generator().manual_seed(seed)
    d = W1.shape[0]
    best = 0.0
    for _ in range(4):
        V = torch.randn(3, d, generator=g, dtype=F64).requires_grad_(True)
        opt = torch.optim.Adam([V], lr=0.05)
        for _ in range(150):
            v, e, u = (V / V.norm(dim=1, keepdim=True)).unbind(0)
            val = (D * (W2 @ v) * (e @ W1) * (u @ W1)).sum().abs()
            best = max(best, float(val.detach()))
            opt.zero_grad()
            (-val).backward()
            opt.step()
    return best


def test_homogeneous_in_the_weights_and_smaller_where_the_outputs_overlap():
    """``W_2 x 2``: ``N2e x 2`` (exact powers of two); ``W_2`` of rank one (every unit writes the same output direction)
    makes the form's ``v`` side one-dimensional, where the other flattening is the smaller one by far."""
    ffn = _ffn(7, 12, 48, 2.0)
    z = torch.randn(3, 12, generator=torch.Generator().manual_seed(1), dtype=F64) @ ffn.W_1.double()
    base = ffn_second_norms_flat(ffn_hadamard(ffn, centred=False), z)
    got = ffn_second_norms_flat(ffn_hadamard(dataclasses.replace(ffn, W_2=ffn.W_2 * 2), centred=False), z)
    assert torch.allclose(got, 2 * base, rtol=1e-12, atol=0), (got, base)
    W2 = ffn.W_2.double()
    one = dataclasses.replace(ffn, W_2=(W2[:, :1] @ W2[:1, :]).to(ffn.W_2.dtype))
    const = ffn_hadamard(one, centred=False)
    n2, n2e = ffn_second_norms(const, z), ffn_second_norms_flat(const, z)
    assert bool((n2e < n2).all()), (n2e, n2)
