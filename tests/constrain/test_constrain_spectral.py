"""Spectral caps and power iteration against float64 SVD (STYLE 15-17)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

from transcover import InputError
from transcover.constrain import (
    HeadLayout,
    power_iteration,
    product_cap,
    product_power_iteration,
    remove_spectral_cap,
    spectral_cap,
)



def _sigma(W):
    return torch.linalg.matrix_norm(W.detach().double(), 2)


@pytest.mark.parametrize("shape", [(7, 7), (12, 5), (5, 12), (3, 6, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_power_iteration_converges_to_svd(shape, dtype):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    u = torch.randn(shape[:-1], generator=g, dtype=torch.float64).to(dtype)
    sigma, _, _ = power_iteration(W, u, 300)
    ref = _sigma(W)
    eps = torch.finfo(dtype).eps
    # power iteration's error is quadratic in the vector error; 300 steps resolve gaps of random
    # Gaussian matrices far below 100 n eps relative.
    assert torch.allclose(sigma.double(), ref, rtol=100 * max(shape) * eps, atol=0)
    assert bool((sigma.double() <= ref * (1 + 10 * max(shape) * eps)).all())  # a lower estimate


def test_product_power_iteration_matches_formed_product():
    g = torch.Generator().manual_seed(1)
    A = torch.randn(3, 10, 4, generator=g, dtype=torch.float64)
    B = torch.randn(3, 9, 4, generator=g, dtype=torch.float64)
    u = torch.randn(3, 10, generator=g, dtype=torch.float64)
    sigma, _, _ = product_power_iteration(A, B, u, 300, scale=0.5)
    ref = torch.linalg.matrix_norm(0.5 * A @ B.transpose(-1, -2), 2)
    assert torch.allclose(sigma, ref, rtol=1e-10, atol=0)


@settings(max_examples=15, deadline=None)
@given(m=st.integers(2, 12), n=st.integers(2, 12), radius=st.floats(0.05, 5.0), gap=st.floats(0.1, 0.8),
       seed=st.integers(0, 10_000))
def test_spectral_cap_converges_to_radius(m, n, radius, gap, seed):
    # W = U diag(3c, 3c gap, 3c gap^2, ...) V^T: the cap must act, and power iteration's error
    # after k steps is O(gap^(2k)) (< 1e-14 here after the 15 + 60 steps), so convergence to
    # sigma = c is then limited by float32 only.
    g = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
    S = 3 * radius * gap ** torch.arange(r, dtype=torch.float64)
    lin = nn.Linear(n, m)
    with torch.no_grad():
        lin.weight.copy_((U * S) @ V.T)
    spectral_cap(lin, radius=radius)
    for _ in range(60):
        lin(torch.zeros(1, n))
    tol = 100 * max(m, n) * torch.finfo(torch.float32).eps
    assert abs(float(_sigma(lin.weight)) - radius) <= tol * radius


def test_spectral_cap_inside_ball_is_identity_and_per_head():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(4, 6, 3, generator=g)
    W[0] *= 10 / _sigma(W[0])
    W[1] *= 0.5 / _sigma(W[1])
    mod = nn.Module()
    mod.W = nn.Parameter(W.clone())
    spectral_cap(mod, "W", radius=1.0)
    for _ in range(50):
        _ = mod.W
    capped = mod.W.detach()
    assert torch.equal(capped[1], W[1])  # inside the ball: untouched, bit for bit
    assert abs(float(_sigma(capped[0])) - 1.0) < 1e-5
    remove_spectral_cap(mod, "W", keep_constrained=False)
    assert torch.equal(mod.W.detach(), W)


def test_spectral_cap_gradient_is_the_cap_with_fixed_vectors():
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(5, 4).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4, 5, generator=g, dtype=torch.float64) * 3)
    spectral_cap(lin, radius=0.7)
    lin.eval()  # freeze u, v so the map is a fixed function of W
    p = lin.parametrizations.weight
    u, v = p[0].u.clone(), p[0].v.clone()
    W0 = p.original.detach().clone().requires_grad_(True)

    def reference(W):
        return W * torch.clamp(0.7 / (u @ W @ v), max=1.0)

    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    (lin(x) ** 2).sum().backward()
    ((nn.functional.linear(x, reference(W0), lin.bias)) ** 2).sum().backward()
    assert torch.allclose(p.original.grad, W0.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["KQ", "OV"])
def test_product_cap_converges_per_head(kind):
    g = torch.Generator().manual_seed(4)
    H, d, dh = 3, 8, 4
    mod = nn.Module()
    mod.A = nn.Parameter(torch.randn(H, d, dh, generator=g) * 2)
    if kind == "KQ":
        mod.B = nn.Parameter(torch.randn(H, d, dh, generator=g) * 2)
        lb, scale = HeadLayout("stacked", H, dh), 1 / math.sqrt(dh)
    else:
        mod.B = nn.Parameter(torch.randn(H, dh, d, generator=g) * 2)  # W_O layout (H, dh, d)
        lb, scale = HeadLayout("stacked_t", H, dh), 1.0
    state = product_cap((mod, "A", HeadLayout("stacked", H, dh)), (mod, "B", lb), 0.8, scale=scale)
    for _ in range(60):
        _ = mod.A, mod.B
    A = mod.A.detach().double()
    B = lb.heads(mod.B.detach()).double()
    sig = torch.linalg.matrix_norm(scale * A @ B.transpose(-1, -2), 2)
    assert torch.allclose(sig, torch.full_like(sig, 0.8), rtol=1e-5, atol=0)
    assert state.radius.item() == pytest.approx(0.8)


def test_bad_radius_and_missing_tensor_raise_one_line():
    with pytest.raises(InputError, match="radius must be a finite number > 0, but got radius=-1"):
        spectral_cap(nn.Linear(2, 2), radius=-1)
    with pytest.raises(InputError, match="no tensor named 'nope'"):
        spectral_cap(nn.Linear(2, 2), "nope", radius=1)
    with pytest.raises(InputError, match="carries no constraint"):
        remove_spectral_cap(nn.Linear(2, 2))
    assert not parametrize.is_parametrized(nn.Linear(2, 2))


def test_power_iteration_from_zero_restarts_once_the_matrix_is_not_zero():
    """Red team 190, D2: from ``W = 0`` the vectors became 0 and stayed 0 (``0 / ||0||`` is kept at 0)."""
    _, u, v = power_iteration(torch.zeros(5, 4), torch.ones(5))
    assert float(u.norm()) == pytest.approx(1.0) and float(v.norm()) == pytest.approx(1.0)
    W = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    sigma, _, _ = power_iteration(W, u, 40)
    assert float(sigma) == pytest.approx(float(_sigma(W)), rel=1e-5)
    _, u2, _ = product_power_iteration(torch.zeros(2, 5, 3), torch.zeros(2, 4, 3), torch.zeros(2, 5))
    assert torch.allclose(u2.norm(dim=-1), torch.ones(2))


def test_caps_registered_on_zero_weights_cap_them_once_trained():
    """Red team 190, D2: a zero-initialised weight (a residual output projection) kept ``u = 0``, so its cap's
    estimate stayed 0 and its factor 1, and the trained weight grew to 19x-918x the radius."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    nn.init.zeros_(lin.weight)
    spectral_cap(lin, radius=0.5)
    q, k = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    nn.init.zeros_(k.weight)
    rows = HeadLayout("rows", 2, 4)
    product_cap((q, "weight", rows), (k, "weight", rows), 0.5)
    with torch.no_grad():  # what training does to the raw tensors
        lin.parametrizations.weight.original.copy_(torch.randn(8, 8) * 2)
        k.parametrizations.weight.original.copy_(torch.randn(8, 8) * 2)
    lin.train(), q.train(), k.train()
    for _ in range(60):
        x = torch.randn(4, 8)
        lin(x), q(x), k(x)
    assert float(_sigma(lin.weight)) <= 0.5 * 1.01  # 19x the radius before the fix
    with torch.no_grad():
        A, B = rows.heads(q.weight), rows.heads(k.weight)
    assert float(_sigma(A.double() @ B.double().transpose(-1, -2)).max()) <= 0.5 * 1.01


def test_the_penalty_sees_a_weight_that_was_zero_when_tracked():
    """Red team 190, D2: the SigmaTracker reported sigma = 0 for a weight zero at registration, so the hinge
    penalty never fired however large the weight grew."""
    from transcover.constrain import ConstraintConfig, constrain
    from transcover.model import ReferenceConfig, ReferenceTransformer

    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=12))
    with torch.no_grad():
        model.blocks[0].W_2.zero_()
        model.blocks[0].W_O.zero_()
    cons = constrain(model, ConstraintConfig(method="penalty", radii={"W2": 0.5, "OV": 0.5}))
    with torch.no_grad():
        model.blocks[0].W_2.copy_(torch.randn_like(model.blocks[0].W_2) * 2)
        model.blocks[0].W_O.copy_(torch.randn_like(model.blocks[0].W_O) * 2)
    for _ in range(30):
        sigmas = cons.tracker()
    assert float(sigmas["W2.0"]) == pytest.approx(float(_sigma(model.blocks[0].W_2)), rel=1e-3)
    assert float(sigmas["OV.0"].min()) > 0.5
    assert float(cons.penalty().detach()) > 0.0


def test_the_restart_vector_has_no_zero_entry():
    """Note [zero restart]'s vector is formed in float64: formed in float32 it had 117 zero entries at n = 2^16 (red
    team 197), coordinates a restart could not reach.  Unit norm in the dtype asked for."""
    from transcover.constrain._spectral import _seed_vector

    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        s = _seed_vector(2**16, dtype, torch.device("cpu"))
        assert s.dtype == dtype and bool((s != 0).all())
        # each entry rounded within eps/2 relative; the float64 norms (forming it, checking it) within n u each
        assert abs(float(s.double().norm()) - 1) <= torch.finfo(dtype).eps / 2 + 2.02 * 2**16 * 2.0**-53
