"""Activation constants against a fine grid, a scipy optimiser and autograd (independent references)."""

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar

from transcover.lipschitz import activation_gain, activation_lipschitz
from transcover.lipschitz._activations import activation_derivative
from transcover.model import Activation

EXPECTED = {"relu": 1.0, "identity": 1.0, "gelu": 1.1289041, "gelu_tanh": 1.1289930, "silu": 1.0998393}


def _autograd_derivative(act: str, x: np.ndarray) -> np.ndarray:
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    Activation(act)(t).sum().backward()
    return t.grad.numpy()


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu", "identity"])
def test_constant_dominates_grid_and_optimiser(act):
    L = activation_lipschitz(act)
    x = np.linspace(-12.0, 12.0, 400_001)
    grid = np.abs(_autograd_derivative(act, x)).max()  # torch's own activation, not our formula
    assert grid <= L
    # scipy's bounded optimiser on both signs of sigma' (the max and the negative dip)
    best = 0.0
    for lo, hi in ((-6.0, 0.0), (0.0, 6.0)):
        for sign in (1.0, -1.0):
            r = minimize_scalar(lambda v: -sign * activation_derivative(act, v), bounds=(lo, hi),
                                method="bounded", options={"xatol": 1e-12})
            best = max(best, abs(activation_derivative(act, r.x)))
    assert best <= L
    # tight: the optimiser reaches the constant up to the rounding pad and the optimiser's accuracy
    assert L - best <= 1e-8
    assert abs(L - EXPECTED[act]) < 1e-6


def test_gelu_closed_form():
    # sup (x Phi(x))' = Phi(sqrt 2) + 1/(e sqrt(pi)), attained at x = sqrt(2)
    closed = 0.5 * math.erfc(-1.0) + 1.0 / (math.e * math.sqrt(math.pi))
    assert activation_lipschitz("gelu") == pytest.approx(closed, rel=2e-9, abs=0)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu"])
def test_closed_form_derivative_matches_autograd(act):
    x = np.linspace(-7.3, 7.1, 1001)
    ours = np.array([activation_derivative(act, float(v)) for v in x])
    np.testing.assert_allclose(ours, _autograd_derivative(act, x), rtol=0, atol=1e-13)


@pytest.mark.parametrize("act", list(EXPECTED))
def test_gain_is_one(act):
    x = np.linspace(-20, 20, 40_001)
    y = Activation(act)(torch.tensor(x)).numpy()
    assert np.all(np.abs(y) <= np.abs(x) * activation_gain(act) + 1e-300)
