"""Enforcement at the edges of the storage dtype, and non-finite weights (red team of stop 36).

Found: ``norm_cap`` left an fp16 bias at 1.25x its radius (a factor of 9.5e-8 is subnormal in
fp16 and rounded to 2^-23); ``clip_weights_`` rounded the bound to nearest in the weight's dtype
(bf16 ``fl(0.1) = 0.10009765625``); NaN weights passed ``project_bias_``, ``clip_weights_`` and
the caps silently and crashed ``project_spectral_`` with a raw ``torch.linalg`` error.  The
references are exact: float64 holds every fp16/bf16/float32 value, and the norms of the stored
vectors are decided in rationals.
"""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from transcover._errors import InputError
from transcover.constrain import (clip_weights_, norm_cap, project_bias_, project_product_, project_spectral_,
                                  spectral_cap)
from transcover.constrain._projection import radius_floor

LOW = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _norm_over(b: torch.Tensor, c: float) -> bool:
    """Whether ``||b||_2 > c`` exactly (squares of the stored values summed in rationals)."""
    return sum(Fraction(float(x)) ** 2 for x in b.detach().double().flatten()) > Fraction(c) ** 2


def _capped(bias: list[float], radius: float, dtype: torch.dtype) -> torch.Tensor:
    lin = nn.Linear(1, len(bias)).to(dtype)
    with torch.no_grad():
        lin.bias.copy_(torch.tensor(bias, dtype=torch.float64).to(dtype))
    norm_cap(lin, "bias", radius)
    return lin.bias.detach()


def test_norm_cap_fp16_with_a_subnormal_factor_stays_inside():
    """The red team's case: bias 60000 capped at 0.0057 came out at 1.2548 c."""
    b = _capped([60000.0], 0.0057, torch.float16)
    assert not _norm_over(b, 0.0057)
    assert float(b[0]) > 0.0057 * 0.99  # still the projection, not a collapse to 0


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(LOW), n=st.integers(1, 24), log_scale=st.floats(-2, 4.5),
       log_c=st.floats(-7.5, 1), seed=st.integers(0, 2**16))
def test_norm_cap_stored_norm_below_radius_at_every_scale(dtype, n, log_scale, log_c, seed):
    g = torch.Generator().manual_seed(seed)
    bias = (torch.randn(n, generator=g, dtype=torch.float64) * 10.0**log_scale).clamp(-6e4, 6e4)
    c = 10.0**log_c
    b = _capped(bias.tolist(), c, dtype)
    assert b.dtype == dtype and bool(b.isfinite().all())
    assert not _norm_over(b, c)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bound", [0.1, 1.115e-6, 3.3e-7, 0.7, 1e-3])
def test_clip_never_leaves_an_entry_above_the_bound(dtype, bound):
    W = torch.tensor([1.0, -1.0, 5e-8, 0.0], dtype=torch.float64).to(dtype)
    clip_weights_(W, bound)
    assert W.dtype == dtype
    assert float(W.double().abs().max()) <= bound
    # the clamp is the largest value of the dtype below the bound: one step up would exceed it
    up = torch.nextafter(W[0], torch.tensor(math.inf, dtype=dtype))
    assert float(up) > bound


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32))
def test_radius_floor_is_below_every_radius_that_rounds_to_the_buffer(dtype):
    """c >= radius_floor(fl(c)) for normal and subnormal radii (fp16 1.1e-6 rounds up by 2.7 %)."""
    for c in (1.1e-6, 3e-8, 6.2e-5, 0.0057, 0.1, 3.0):
        buf = torch.tensor(c, dtype=dtype)
        if float(buf) == 0.0:
            continue  # no buffer: the cap's own check refuses a radius that rounds to 0
        assert radius_floor(buf) <= c


def _nan_vec():
    return torch.tensor([math.nan, 1.0])


@pytest.mark.parametrize("call", [
    lambda: project_bias_(_nan_vec(), 1.0),
    lambda: clip_weights_(_nan_vec(), 1.0),
    lambda: clip_weights_(torch.tensor([math.inf, 1.0]), 1.0),
    lambda: project_spectral_(torch.tensor([[1.0, math.nan], [0.0, 1.0]]), 1.0),
    lambda: project_product_(torch.tensor([[[1.0], [math.nan]]]), torch.ones(1, 2, 1), 1.0),
    lambda: project_spectral_(torch.ones(3), 1.0),
], ids=["bias", "clip-nan", "clip-inf", "spectral", "product", "vector"])
def test_non_finite_or_misshapen_weights_are_refused_in_one_line(call):
    with pytest.raises(InputError) as e:
        call()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("cap", [norm_cap, spectral_cap])
def test_caps_refuse_a_non_finite_parameter_at_registration(cap):
    lin = nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight[0, 0] = math.nan
        lin.bias[0] = math.inf
    with pytest.raises(InputError, match="NaN or infinite"):
        cap(lin, "bias" if cap is norm_cap else "weight", 1.0)


def test_empty_matrix_projects_to_itself():
    W = torch.zeros(0, 3)
    before = project_spectral_(W, 1.0)
    assert before.shape == () and float(before) == 0.0 and W.shape == (0, 3)
