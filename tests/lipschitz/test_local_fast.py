"""The fast primitives of the rows route (issue 12, THEORY F32): the certified ``lambda_max`` from a
block-Krylov candidate and one Cholesky test, the factored normalisation Jacobians, the chained
head-output norms, and the whole ``layer_rows`` at a width where the Krylov path runs, each against
an independent float64 reference (eigvalsh, SVD, formed matrices, autograd blocks)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import random_spec
from transcover.lipschitz._local_jacobian import (
    _head_data, _norm_parts, certified_lmax, certified_lmax_vec, certified_spectral, row_norm_lower,
)
from transcover.lipschitz._local_rows import layer_rows
from transcover.lipschitz._local_struct import NormJac, _chain_output_norms
from transcover.model._functional import layer_forward

_U = 2.0**-53


def _psd(seed: int, n: int, d: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "lowrank":
        A = torch.randn(n, d, 3, generator=g, dtype=torch.float64)
    elif kind == "illcond":
        Q, _ = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))
        ev = 10.0 ** torch.linspace(-12, 3, d, dtype=torch.float64)
        return (Q * ev) @ Q.transpose(1, 2)
    elif kind == "cluster" and d >= 4:  # the top eigenvalues 1e-4 apart: the slow case of the candidate
        Q, _ = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))
        ev = torch.rand(d, generator=g, dtype=torch.float64)
        ev[-4:] = torch.tensor([1.0, 1.0 - 1e-4, 1.0 - 2e-4, 1.0 - 3e-4], dtype=torch.float64)
        return (Q * ev) @ Q.transpose(1, 2)
    else:
        A = torch.randn(n, d, d, generator=g, dtype=torch.float64)
    return A @ A.transpose(1, 2)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), d=st.sampled_from([1, 7, 40, 70, 130]),
       kind=st.sampled_from(["full", "lowrank", "illcond", "cluster"]))
def test_certified_lmax_is_above_eigvalsh_and_tight(seed, d, kind):
    """Never below the float64 eigvalsh value (minus its own backward error ``d u ||G||``), and within
    ``1e-6`` of it when the spectrum is not a near-tie at the top (then the ladder may add ``1e-4``)."""
    G = _psd(seed, 3, d, kind)
    lam = torch.linalg.eigvalsh(G)[:, -1]
    c = certified_lmax(G)
    slack = 4 * (d + 1) * _U * G.norm(dim=(1, 2))
    assert bool((c >= lam - slack).all()), (c, lam)
    tol = 1e-3 if kind == "cluster" else 1e-6
    assert bool((c <= lam * (1 + tol) + slack).all()), (c / lam - 1)


def test_certified_lmax_warm_start_and_vector():
    """A warm start at the top eigenvector gives the same certificate and returns that direction."""
    G = _psd(3, 4, 100, "full")
    ev, V = torch.linalg.eigh(G)
    lam, x = certified_lmax_vec(G, start=V[:, :, -1] + 1e-3)
    assert bool((lam >= ev[:, -1]).all()) and bool((lam <= ev[:, -1] * (1 + 1e-6)).all())
    cos = (x * V[:, :, -1]).sum(-1).abs() / x.norm(dim=1)
    assert bool((cos > 1 - 1e-6).all())


def test_certified_lmax_non_finite_is_inf():
    G = _psd(1, 3, 70, "full")
    G[1, 2, 3] = math.inf
    c = certified_lmax(G)
    assert math.isinf(float(c[1])) and bool(torch.isfinite(c[[0, 2]]).all())


@pytest.mark.parametrize("lam", [2.0**-30, 0.37, 3.0, 2.0**40])
def test_certified_lmax_is_homogeneous(lam):
    """lambda_max(lam G) = lam lambda_max(G): the certificate follows the scale on both search paths
    (eigh below width 65, the block Krylov candidate above), never below the scaled float64 eigvalsh."""
    g = torch.Generator().manual_seed(11)
    for d in (40, 130):
        A = torch.randn(3, d, d // 2, generator=g, dtype=torch.float64)
        G = A @ A.transpose(1, 2)
        base = certified_lmax(G)
        scaled = certified_lmax(lam * G)
        ref = torch.linalg.eigvalsh(lam * G)[:, -1]
        assert bool((scaled >= ref).all())
        assert torch.allclose(scaled, lam * base, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("d", [70, 150])
@pytest.mark.parametrize("rank", [1, 2, 5, 7, 10, 13, 20, 31, 32, 33, 45])
def test_certified_lmax_is_tight_at_every_rank(d, rank):
    """Below the Krylov space's width (8 blocks of 4) the space becomes invariant; the reorthogonalised blocks are then
    rounding noise, and unless they are made orthogonal to the space again the Ritz values exceed ``lambda_max`` (rank 5
    at d = 150: every rung failed and the trace, 3.9x ``lambda_max``, was returned).  Within ``1e-6`` of the float64
    eigvalsh value at every rank, never below it."""
    g = torch.Generator().manual_seed(rank + 1000 * d)
    A = torch.randn(3, d, rank, generator=g, dtype=torch.float64)
    G = A @ A.transpose(1, 2)
    lam = torch.linalg.eigvalsh(G)[:, -1]
    c = certified_lmax(G)
    slack = 4 * (d + 1) * _U * G.norm(dim=(1, 2))
    assert bool((c >= lam - slack).all()) and bool((c <= lam * (1 + 1e-6) + slack).all()), (c / lam - 1)
    for e in (-40, 40):  # homogeneous of degree 1: the breakdown test (a pivot against the block's norm) scales too
        s = 2.0**e
        assert torch.allclose(certified_lmax(s * G), s * c, rtol=1e-6, atol=0.0), (e, certified_lmax(s * G) / (s * c))


@pytest.mark.parametrize("shape", [(3, 100, 20), (3, 20, 100), (2, 80, 80)])
def test_certified_spectral_either_side(shape):
    B = torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    s = torch.linalg.matrix_norm(B, 2)
    c = certified_spectral(B)
    assert bool((c >= s).all()) and bool((c <= s * (1 + 1e-6)).all())


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "none"])
def test_norm_jacobian_factored_matches_the_formed_one(kind):
    """``NormJac``: the formed ``D`` equals ``_norm_parts``'s, products and sandwiches equal the dense
    ones within the F32 rounding bounds, ``||D||_F`` is the formed one's."""
    spec = random_spec(4, d=70, H=2, dh=5, dff=9, norm=kind, placement="post")
    norm = spec.layers[0].norm_attn
    X = torch.randn(5, 70, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3 + 1
    D = _norm_parts(norm, X)[0]
    nj = NormJac(norm, X)
    assert torch.allclose(nj.dense(), D, rtol=0, atol=1e-13 * float(D.abs().max()))
    assert torch.allclose(nj.fro, D.norm(dim=(1, 2)), rtol=1e-9)
    S = torch.randn(5, 70, 70, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    Y, r = nj.left(S)
    assert bool(((Y - D @ S).norm(dim=(1, 2)) <= r + 1e-300).all())
    Y, r = nj.right(S)
    assert bool(((Y - S @ D).norm(dim=(1, 2)) <= r + 1e-300).all())
    S = S @ S.transpose(1, 2)
    Y, e = nj.sandwich(S, torch.zeros(5, dtype=torch.float64))
    assert bool((torch.linalg.matrix_norm(Y - D @ S @ D.transpose(1, 2), 2) <= e).all())


def test_chain_output_norms_against_svd():
    """The nine head-output norms of the post-LN chain are certified upper bounds on the SVD values
    of the formed ``M W_O^hT`` and within ``1e-6`` of them."""
    spec = random_spec(8, d=72, H=3, dh=6, dff=20, norm="layernorm", placement="post")
    L = spec.layers[0]
    g = torch.Generator().manual_seed(3)
    X1, X2 = (torch.randn(4, 72, generator=g, dtype=torch.float64) for _ in range(2))
    n1, n2 = NormJac(L.norm_attn, X1), NormJac(L.norm_ffn, X2)
    IF = torch.eye(72, dtype=torch.float64) + 0.3 * torch.randn(4, 72, 72, generator=g, dtype=torch.float64)
    heads = _head_data(L.attention, X1)
    nIF = certified_spectral(IF)
    zero = torch.zeros(4, dtype=torch.float64)
    out = _chain_output_norms(n1, IF, n2, nIF, heads, (zero, zero, zero))
    Wo = torch.cat([hd[6] for hd in heads], dim=0)
    for (per, full), M in zip(out, (n1.dense(), IF @ n1.dense(), n2.dense() @ IF @ n1.dense())):
        MO = M @ Wo.T
        ref = torch.linalg.matrix_norm(MO, 2)
        assert bool((full >= ref).all()) and bool((full <= ref * (1 + 1e-6)).all())
        for h in range(3):
            rh = torch.linalg.matrix_norm(MO[:, :, h * 6:(h + 1) * 6], 2)
            assert bool((per[h] >= rh).all()) and bool((per[h] <= rh * (1 + 1e-6)).all())


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_layer_rows_at_krylov_width_is_above_the_autograd_rows(placement):
    """At d = 72 (the Krylov candidate and the factored norms run) the certified point rows are above
    the attained row norms of the autograd Jacobian and the ball bound above the point."""
    spec = random_spec(12, d=72, H=3, dh=8, dff=40, norm="layernorm", placement=placement, act="gelu")
    L = spec.layers[0]
    X = torch.randn(3, 72, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda Z: layer_forward(L, Z), X).permute(0, 2, 1, 3)
    lo = row_norm_lower(J)
    lj = layer_rows(L, X, [1e-6])[0]
    assert bool((lo <= lj.point_rows).all()), (lo, lj.point_rows)
    assert bool((lj.point_rows <= lj.total_rows * (1 + 1e-12)).all())
    # the weighted-Gram bound is at most sqrt(T) above the attained rows (Cauchy-Schwarz over 3 tokens)
    assert bool((lj.point_rows <= lo * math.sqrt(3) * 1.5).all())
