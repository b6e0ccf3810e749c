"""QuickGELU (CLIP's ``x sigmoid(1.702 x)``): its constants against independent references.

References: HF's own ``QuickGELUActivation`` (autograd on a fine grid), scipy's bounded optimiser on
our closed-form derivative, and the second derivative by finite differences; the activation the
spec computes is HF's to the last bit.
"""

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar

from transcover.lipschitz import activation_gain, activation_lipschitz
from transcover.lipschitz._activations import activation_derivative
from transcover.lipschitz._local import second_derivative_sup
from transcover.model import Activation


def _hf_quick_gelu():
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.activations import QuickGELUActivation

    return QuickGELUActivation()


def test_spec_activation_is_hf_quick_gelu():
    x = torch.linspace(-30, 30, 100_001, dtype=torch.float64)
    assert torch.equal(Activation.QUICK_GELU(x), _hf_quick_gelu()(x))


def test_lipschitz_constant_dominates_autograd_grid_and_optimiser():
    L = activation_lipschitz("quick_gelu")
    x = torch.linspace(-12.0, 12.0, 400_001, dtype=torch.float64, requires_grad=True)
    _hf_quick_gelu()(x).sum().backward()
    grid = float(x.grad.abs().max())
    assert grid <= L
    best = 0.0
    for lo, hi in ((-6.0, 0.0), (0.0, 6.0)):
        for sign in (1.0, -1.0):
            r = minimize_scalar(lambda v: -sign * activation_derivative("quick_gelu", v), bounds=(lo, hi),
                                method="bounded", options={"xatol": 1e-12})
            best = max(best, abs(activation_derivative("quick_gelu", r.x)))
    assert best <= L and L - best <= 1e-8  # tight
    assert L == activation_lipschitz("silu")  # quick_gelu'(x) = silu'(1.702 x)
    ours = np.array([activation_derivative("quick_gelu", float(v)) for v in np.linspace(-7.3, 7.1, 1001)])
    t = torch.tensor(np.linspace(-7.3, 7.1, 1001), requires_grad=True)
    _hf_quick_gelu()(t).sum().backward()
    np.testing.assert_allclose(ours, t.grad.numpy(), rtol=0, atol=1e-13)


def test_gain_and_second_derivative():
    x = torch.linspace(-20, 20, 40_001, dtype=torch.float64)
    y = Activation.QUICK_GELU(x)
    assert bool(torch.all(y.abs() <= x.abs() * activation_gain("quick_gelu")))
    # sup |sigma''| by central differences of the closed-form derivative, against the constant
    h = 1e-5
    xs = np.linspace(-10, 10, 200_001)
    d2 = np.abs([(activation_derivative("quick_gelu", v + h) - activation_derivative("quick_gelu", v - h)) / (2 * h)
                 for v in xs[::50]])
    assert d2.max() <= second_derivative_sup(Activation.QUICK_GELU)
    assert second_derivative_sup(Activation.QUICK_GELU) == pytest.approx(d2.max(), rel=1e-3)
