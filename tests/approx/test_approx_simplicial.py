"""The simplicial MLP equals the interpolant it claims to be, and its error is within the bound."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover import InputError
from transcover.approx import holder_ridge, simplicial_error_bound, simplicial_interpolate, simplicial_mlp

EPS = np.finfo(np.float64).eps


@pytest.mark.parametrize("s, N", [(1, 7), (2, 5), (3, 3), (4, 2)])
def test_network_equals_sorting_reference(s, N):
    t = holder_ridge(tuple(range(s)), 0.8, seed=s)
    mlp = simplicial_mlp(t.h, s, N)
    U = np.random.default_rng(0).uniform(-1, 1, (3000, s))
    net = mlp(torch.from_numpy(U)).numpy()
    ref = simplicial_interpolate(mlp.node_values, U)
    scale = np.abs(mlp.node_values).max() * (2 * N + s)  # magnitudes summed inside the network
    assert np.abs(net - ref).max() <= 64 * EPS * scale
    assert mlp.width == max(mlp.widths) and len(mlp.widths) == 2 + int(np.ceil(np.log2(s)))


def test_one_dimension_is_numpy_interp():
    t = holder_ridge((0,), 0.5, seed=3)
    mlp = simplicial_mlp(t.h, 1, 9)
    x = np.linspace(-1, 1, 1001)
    knots = np.linspace(-1, 1, 10)
    ref = np.interp(x, knots, t.h(torch.from_numpy(knots[:, None])).numpy())
    assert np.abs(mlp(torch.from_numpy(x[:, None])).numpy() - ref).max() <= 64 * EPS * 20


@pytest.mark.parametrize("s", [1, 2, 3])
def test_affine_functions_are_reproduced(s):
    w = np.array([0.3, -1.2, 0.7][:s])
    mlp = simplicial_mlp(lambda U: U @ torch.from_numpy(w) + 0.25, s, 4)
    U = np.random.default_rng(1).uniform(-1, 1, (2000, s))
    assert np.abs(mlp(torch.from_numpy(U)).numpy() - (U @ w + 0.25)).max() <= 1e3 * EPS


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([1, 2]), st.floats(0.2, 2.0), st.integers(1, 12), st.integers(0, 100),
       st.floats(0.3, 1.0))
def test_interpolation_error_within_bound(s, beta, N, seed, gamma):
    t = holder_ridge(tuple(range(s)), beta, seed=seed)
    h = lambda U: t.h(U / gamma)
    mlp = simplicial_mlp(h, s, N)
    per = 1001 if s == 1 else 161
    axis = np.linspace(-gamma, gamma, per)  # the read-out box the construction uses
    U = np.stack(np.meshgrid(*([axis] * s), indexing="ij"), -1).reshape(-1, s)
    err = np.abs(simplicial_interpolate(mlp.node_values, U) - h(torch.from_numpy(U)).numpy()).max()
    bound = simplicial_error_bound(beta, t.holder_constant, s, N, gamma=gamma)
    assert err <= bound * (1 + 1e-9) + 1e3 * EPS


def test_bad_simplicial_arguments():
    with pytest.raises(InputError, match="grid"):
        simplicial_mlp(lambda U: U[:, 0], 1, 0)
    with pytest.raises(InputError, match="max_width"):
        simplicial_mlp(lambda U: U[:, 0], 3, 30, max_width=1000)
    with pytest.raises(InputError, match="beta"):
        simplicial_error_bound(2.5, 1.0, 1, 4)
    with pytest.raises(InputError, match="gamma"):
        simplicial_error_bound(1.0, 1.0, 1, 4, gamma=0.0)
