"""Hard constraints: after every optimiser step every constrained sigma <= c (1 + tol), by float64 SVD."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from transcover.constrain import (
    ConstraintConfig,
    clip_weights_,
    constrain,
    find_slots,
    project_bias_,
    project_product_,
    project_spectral_,
)
from transcover.model import ReferenceConfig, ReferenceTransformer



def _exact(slot):
    """Exact norms of a slot (per head for products), float64 SVD."""
    with torch.no_grad():
        if slot.kind == "product":
            A, B = slot.value("a").double(), slot.value("b").double()
            return torch.linalg.matrix_norm(slot.scale * A @ B.transpose(-1, -2), 2)
        if slot.kind == "matrix":
            return torch.linalg.matrix_norm(slot.value().double(), 2)
        return slot.value().double().norm()


def _tol(slot):
    # Projection is exact in float64; the only error is the final cast to float32, whose spectral
    # norm is at most the Frobenius norm of the rounding, ~ sqrt(m n) eps32 relative; products add
    # one such error per factor.  10 * max dimension * eps32 covers both with margin.
    T = slot.value("a")
    return 10 * max(T.shape[-2:]) * torch.finfo(torch.float32).eps


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), c=st.floats(0.1, 2.0), scale=st.floats(1.0, 4.0))
def test_projection_holds_after_every_step_reference(seed, c, scale):
    torch.manual_seed(seed)
    model = ReferenceTransformer(ReferenceConfig(d_model=12, n_heads=2, n_layers=2, d_ff=16, init_scale=scale,
                                                 head_hidden=(8,)))
    cons = constrain(model, ConstraintConfig(method="project", radii={"all": 4 * c, "KQ": c, "OV": c},
                                             schedule="linear", loose_factor=3.0))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    cons.step_hook(opt)
    X = torch.randn(8, 5, 12)
    for step in range(6):
        cons.set_progress(step / 5)
        loss = model(X).pow(2).mean() - model(X).std()  # pushes norms up
        opt.zero_grad()
        loss.backward()
        opt.step()  # the hook projects
        for s in find_slots(model):
            r = cons.radius(s.key)
            assert bool((_exact(s) <= r * (1 + _tol(s))).all()), (s.key, _exact(s), r)


def test_projection_holds_on_torch_encoder():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(12, 3, 24, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False)
    cons = constrain(enc, ConstraintConfig(method="project", radii={"all": 0.3}))
    opt = torch.optim.SGD(enc.parameters(), lr=0.5)
    X = torch.randn(4, 6, 12)
    for _ in range(3):
        loss = -enc(X).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        cons.after_step()
        for s in find_slots(enc):
            assert bool((_exact(s) <= 0.3 * (1 + _tol(s))).all()), s.key


@pytest.mark.parametrize("m,n,k", [(9, 7, 3), (6, 6, 6), (5, 8, 2)])
def test_project_product_is_exact_and_minimal(m, n, k):
    g = torch.Generator().manual_seed(m * n * k)
    A = torch.randn(2, m, k, generator=g, dtype=torch.float64) * 2
    B = torch.randn(2, n, k, generator=g, dtype=torch.float64) * 2
    scale = 1 / math.sqrt(k)
    S_before = torch.linalg.svdvals(scale * A @ B.transpose(-1, -2))
    c = float(S_before[:, 0].min()) * 0.6
    A2, B2 = A.clone(), B.clone()
    project_product_(A2, B2, c, scale)
    S_after = torch.linalg.svdvals(scale * A2 @ B2.transpose(-1, -2))
    # singular values become min(S, c'), c' = c (1 - 4e-9 - 2u): the top ones clipped just below c
    # (Note [cast margin]), the others untouched
    assert torch.allclose(S_after, S_before.clamp(max=c), rtol=1e-8, atol=1e-12)
    assert bool((S_after <= c).all())


def test_project_spectral_and_bias_and_clip():
    g = torch.Generator().manual_seed(5)
    W = torch.randn(3, 7, 5, generator=g, dtype=torch.float64)
    S = torch.linalg.svdvals(W)
    project_spectral_(W, 1.0)
    S_after = torch.linalg.svdvals(W)
    assert torch.allclose(S_after, S.clamp(max=1.0), rtol=1e-8, atol=1e-14)  # c' = c (1 - 4e-9 - 2u)
    assert bool((S_after <= 1.0).all())
    b = torch.tensor([3.0, 4.0], dtype=torch.float64)
    project_bias_(b, 1.0)
    assert torch.allclose(b, torch.tensor([0.6, 0.8], dtype=torch.float64), rtol=1e-8, atol=0)
    assert float(b.norm()) <= 1.0
    b_in = torch.tensor([0.3, 0.4])
    project_bias_(b_in, 1.0)
    assert torch.equal(b_in, torch.tensor([0.3, 0.4]))
    V = torch.randn(20, generator=g) * 5
    clip_weights_(V, 0.5)
    assert float(V.abs().max()) <= 0.5


def test_clip_method_bounds_every_entry():
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8, init_scale=3.0))
    cons = constrain(model, ConstraintConfig(method="clip", radii={"W1": 0.05, "KQ": 0.1}))
    cons.after_step()
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # the bound as stored in float32
    assert float(model.blocks[0].W_1.detach().abs().max()) <= f32(0.05)
    assert float(model.blocks[0].W_Q.detach().abs().max()) <= f32(0.1)
    assert float(model.blocks[0].W_K.detach().abs().max()) <= f32(0.1)
    assert float(model.blocks[0].W_2.detach().abs().max()) > 0.05  # unselected groups are untouched
