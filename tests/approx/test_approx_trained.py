"""Trained 1-layer models: attention goes to I, and the error decomposes with the stated bound."""

import time

import pytest
import torch

from transcover import InputError
from transcover.approx import (
    decompose_trained, forward_with_attention, make_sparse_task, sparse_target, train_sparse_model,
)
from transcover.model import ReferenceConfig, ReferenceTransformer


@pytest.mark.parametrize("norm, readout", [("ball", "first"), ("none", "mean")])
def test_forward_with_attention_is_the_model(norm, readout):
    torch.manual_seed(0)
    m = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16, d_input=1, max_len=6,
                                             head_hidden=(8,), norm=norm, readout=readout)).double()
    X = torch.randn(20, 6, 1, dtype=torch.float64)
    out, probs, _ = forward_with_attention(m, X)
    torch.testing.assert_close(out, m(X), rtol=0, atol=64 * torch.finfo(torch.float64).eps)
    assert len(probs) == 2 and torch.allclose(probs[0].sum(-1), torch.ones(20, 2, 6, dtype=torch.float64))


@pytest.mark.parametrize("norm, readout", [("ball", "first"), ("none", "mean")])
def test_attention_part_bound_holds_at_random_init(norm, readout):
    torch.manual_seed(1)
    m = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, d_input=1, max_len=7,
                                             head_hidden=(8,), norm=norm, readout=readout, init_scale=3.0)).double()
    target = sparse_target("holder", 7, sparsity=2, seed=4)
    X, _ = make_sparse_task("holder", 300, 7, sparsity=2, seed=4, dtype=torch.float64)
    d = decompose_trained(m, target, X)
    assert 0 < d.attention.value and d.attention_bound_ratio <= 1 + 1e-9
    assert d.total.value <= d.attention.value + d.rest.value + 1e-12


def test_trained_model_attends_to_I_and_decomposes():
    t0 = time.perf_counter()
    model, target = train_sparse_model("holder", seq_len=8, sparsity=2, steps=250, n_samples=2048, seed=0)
    X, _ = make_sparse_task("holder", 1000, 8, sparsity=2, seed=99)  # fresh inputs, same target
    d = decompose_trained(model, target, X)
    assert time.perf_counter() - t0 < 20
    # learned to look at I: every head puts far more than the uniform s/T mass there
    assert min(d.mass_on_I) >= 0.6 and sum(d.mass_on_I) / len(d.mass_on_I) >= 3 * d.uniform_mass
    # learned the target: much better than predicting the mean
    y = target(X)
    assert d.rmse_total <= 0.35 * float((y - y.mean()).pow(2).mean().sqrt())
    # and the error decomposes as claimed: the attention part is within its per-sample bound
    assert d.attention_bound_ratio <= 1 + 1e-6
    assert d.total.value <= d.attention.value + d.rest.value + 1e-6


def test_decompose_trained_rejects_deep_models():
    m = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=8, d_input=1, max_len=5))
    with pytest.raises(InputError, match="1-layer"):
        decompose_trained(m, sparse_target("holder", 5, sparsity=2), torch.zeros(2, 5, 1))
    with pytest.raises(InputError, match="steps"):
        train_sparse_model(steps=0)
