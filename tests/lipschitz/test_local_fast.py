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


def _cluster(seed: int, n: int, d: int, gap: float, scale: float = 1.0) -> torch.Tensor:
    """PSD matrices with eigenvalues ``1 - k gap`` (clamped at 0) in a random basis: evenly spaced below the top, the
    slow case of the block Krylov candidate (at ``d = 200``, gaps ``1e-4``, ``1e-3``, it stops ``1e-5`` to ``1e-4``
    short of ``lambda_max``, so the first rungs of the ladder fail)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))
    ev = (1.0 - gap * torch.arange(d, dtype=torch.float64)).clamp(min=0.0)
    return scale * (Q * ev) @ Q.transpose(1, 2)


def _factorised(monkeypatch) -> list:  # noqa: ANN001
    """Every Cholesky test's batch size, recorded (the factorisations the ladder runs)."""
    seen = []
    chol = torch.linalg.cholesky_ex

    def counted(A, *a, **k):  # noqa: ANN001
        seen.append(A.shape[0])
        return chol(A, *a, **k)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", counted)
    return seen


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), d=st.sampled_from([70, 130, 200]), gap=st.sampled_from([1e-6, 1e-4, 1e-3, 1e-2]),
       e=st.integers(-60, 60))
def test_skipped_rungs_change_no_result(seed, d, gap, e):
    """F32 item 7: with the rungs that must fail skipped, every certificate and candidate vector is the same float as
    with every rung tested (``_rung_floor`` patched to ``-inf``), on near-ties at the top at scales ``2^e``."""
    from transcover.lipschitz import _local_jacobian

    G = _cluster(seed, 3, d, gap, 2.0**e)
    lam, x = certified_lmax_vec(G)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_local_jacobian, "_rung_floor", lambda G, lam, *a: torch.full_like(lam, -math.inf))
        lam0, x0 = certified_lmax_vec(G)
    assert torch.equal(lam, lam0) and torch.equal(x, x0)
    assert bool((lam >= torch.linalg.eigvalsh(G)[:, -1]).all())


def test_skipped_rungs_save_factorisations(monkeypatch):
    """The point of F32 item 7: on matrices whose candidate stops short of ``lambda_max``, fewer factorisations
    than with every rung tested (measured here, not assumed), for the same results."""
    from transcover.lipschitz import _local_jacobian

    G = torch.cat([_cluster(s, 3, 200, gap) for s, gap in ((1, 1e-4), (1, 1e-3))])
    seen = _factorised(monkeypatch)
    lam = certified_lmax(G)
    skipped = sum(seen)
    seen.clear()
    monkeypatch.setattr(_local_jacobian, "_rung_floor", lambda G, lam, *a: torch.full_like(lam, -math.inf))
    assert torch.equal(certified_lmax(G), lam)
    assert sum(seen) > skipped >= G.shape[0], (sum(seen), skipped)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), d=st.sampled_from([70, 130]), gap=st.sampled_from([1e-8, 1e-5, 1e-3, 1e-1]),
       e=st.integers(-300, 300), lowrank=st.booleans())
def test_rung_floor_is_never_above_lambda_max(seed, d, gap, e, lowrank):
    """``_rung_floor`` is a lower bound on ``lambda_max`` as stored: below the float64 eigvalsh value plus its backward
    error, at scales from ``2^-300`` to ``2^300`` (exactly homogeneous in powers of two), also on rank-deficient
    matrices with a near-tie at the top."""
    from transcover.lipschitz._local_jacobian import _candidate, _rung_floor

    G = _cluster(seed, 3, d, gap)
    if lowrank:
        ev, V = torch.linalg.eigh(G)
        G = (V[:, :, -8:] * ev[:, None, -8:]) @ V[:, :, -8:].transpose(1, 2)
    th, res, x = _candidate(G, None, 8)
    res = torch.maximum(res, 1e-6 * th)  # sought for every matrix, converged or not
    low = _rung_floor(G, th, res, x, 8)
    top = torch.linalg.eigvalsh(G)[:, -1]
    assert bool((low <= top + 4 * (d + 1) * _U * G.norm(dim=(1, 2))).all()), (low - top)
    assert bool((low >= th * (1 - 1e-6)).all())  # not vacuous: about the candidate, or above it
    s = 2.0**e
    assert torch.equal(_rung_floor(s * G, s * th, s * res, x, 8), s * low)


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
