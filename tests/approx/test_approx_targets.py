"""I-sparse targets and the synthetic tasks: sparsity, determinism, Hölder constants, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover import InputError
from transcover.approx import (
    holder_ridge, make_sparse_task, retrieval_indices, sparse_majority, sparse_parity, sparse_target,
)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.data())
def test_targets_depend_only_on_I(n, data):
    s = data.draw(st.integers(1, n))
    I = tuple(data.draw(st.permutations(range(n)))[:s])
    beta = data.draw(st.floats(0.05, 2.0))
    seed = data.draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    Z = torch.rand(16, n, generator=g, dtype=torch.float64) * 2 - 1
    W = torch.rand(16, n, generator=g, dtype=torch.float64) * 2 - 1
    W[:, list(I)] = Z[:, list(I)]  # same tokens on I, anything elsewhere
    targets = [holder_ridge(I, beta, seed=seed), sparse_parity(I)]
    if s % 2:
        targets.append(sparse_majority(I))
    for t in targets:
        assert torch.equal(t(Z), t(W))
    # and the target does depend on I (changing a relevant token changes a Hölder target somewhere)
    V = Z.clone()
    V[:, I[0]] = -V[:, I[0]] + 0.37
    assert not torch.equal(holder_ridge(I, beta, seed=seed)(Z), holder_ridge(I, beta, seed=seed)(V))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.floats(0.1, 2.0), st.integers(0, 1000))
def test_holder_constant_holds(s, beta, seed):
    t = holder_ridge(tuple(range(s)), beta, seed=seed)
    g = torch.Generator().manual_seed(seed)
    U = torch.rand(400, s, generator=g, dtype=torch.float64) * 2 - 1
    V = torch.rand(400, s, generator=g, dtype=torch.float64) * 2 - 1
    dist = (U - V).norm(dim=1)
    tol = 1e3 * torch.finfo(torch.float64).eps
    if beta <= 1:
        assert ((t.h(U) - t.h(V)).abs() <= t.holder_constant * dist**beta + tol).all()
    else:  # first-order Taylor remainder <= (L/beta) |u - v|^beta, the form the MLP bound uses
        Vg = V.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(t.h(Vg).sum(), Vg)
        rem = t.h(U) - t.h(V) - ((U - V) * grad).sum(1)
        assert (rem.abs() <= t.holder_constant / beta * dist**beta + tol).all()


def test_make_sparse_task_shapes_seeds_and_labels():
    X, y = make_sparse_task("holder", 64, 10, sparsity=3, beta=0.5, seed=3)
    assert X.shape == (64, 10, 1) and y.shape == (64,) and X.dtype == torch.float32
    X2, y2 = make_sparse_task("holder", 64, 10, sparsity=3, beta=0.5, seed=3)
    assert torch.equal(X, X2) and torch.equal(y, y2)
    t = sparse_target("holder", 10, sparsity=3, beta=0.5, seed=3)
    torch.testing.assert_close(t(X.double()).float(), y, rtol=0, atol=4 * torch.finfo(torch.float32).eps)
    Xp, yp = make_sparse_task("parity", 200, 9, sparsity=3, seed=1, dtype=torch.float64)
    tp = sparse_target("parity", 9, sparsity=3, seed=1)
    assert set(Xp.unique().tolist()) == {-1.0, 1.0} and torch.equal(yp, tp(Xp))
    Xm, ym = make_sparse_task("majority", 50, 9, sparsity=3, seed=2)
    assert set(ym.unique().tolist()) <= {-1.0, 1.0}
    Xr, yr = make_sparse_task("retrieval", 40, 12, sparsity=4, seed=5, dtype=torch.float64)
    assert Xr.shape == (40, 12, 2)
    for row, I, v in zip(Xr, retrieval_indices(Xr), yr):
        assert len(I) == 4
        assert float(v) == pytest.approx(float(row[list(I), 0].mean()), abs=1e-14)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="nope", n_samples=4, seq_len=4), "task name"),
    (dict(name="holder", n_samples=0, seq_len=4), "n_samples"),
    (dict(name="holder", n_samples=4, seq_len=3, sparsity=4), "s=4 > n=3"),
    (dict(name="holder", n_samples=4, seq_len=4, beta=2.5), "beta"),
    (dict(name="holder", n_samples=4, seq_len=4, noise=-1.0), "noise"),
    (dict(name="majority", n_samples=4, seq_len=4, sparsity=2), "odd"),
    (dict(name="holder", n_samples=4, seq_len=4, indices=(1, 1)), "repeat"),
    (dict(name="holder", n_samples=4, seq_len=4, indices=(7,)), "outside"),
])
def test_bad_task_arguments(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(InputError, match=match):
        make_sparse_task(name, **kwargs)
