"""Per-component certified bounds against adversarial witnesses (hypothesis, random small maps).

A measured value above a certified one is a bug in the bound: no tolerance is added anywhere.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lipschitz_testkit import ACTS, random_spec
from transcover.lipschitz import (
    ffn_lipschitz, head_lipschitz, layernorm_lipschitz, lipschitz_bounds, rmsnorm_lipschitz,
)
from transcover.lipschitz._empirical import _lower, _sigma_floor_projection, stage_functions
from transcover.lipschitz._weights import layer_norms
from transcover.model import NormKind, NormSpec
from transcover.model._functional import attention_forward, ffn_forward

FAST = dict(n_samples=3, n_steps=25, n_power=8)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), radius=st.floats(0.3, 3.0), scale=st.floats(0.5, 3.0),
       T=st.integers(2, 5), biases=st.booleans(), causal=st.booleans(), metric=st.sampled_from(["2,inf", "fro"]))
def test_multihead_attention_bound_dominates_adversarial_search(seed, radius, scale, T, biases, causal, metric):
    spec = random_spec(seed, L=1, scale=scale, biases=biases, causal=causal)
    layer = spec.layers[0]
    n = layer_norms(layer)
    seq = T if metric == "fro" else None
    from transcover.lipschitz import attention_lipschitz

    upper = attention_lipschitz(n.B_OV, n.B_KQ, radius, B_bKQ=n.B_bKQ, B_V=n.B_V, B_O=n.B_O,
                                metric=metric, seq_len=seq)
    # the per-head sum (F6 third bullet), rounded up the same way (Note [rounding the attention constants])
    per_head = attention_lipschitz(n.B_OV, n.B_KQ, radius, B_bKQ=n.B_bKQ, metric=metric, seq_len=seq)
    assert per_head >= sum(head_lipschitz(n.B_OV[h], n.B_KQ[h], radius, B_bKQ=n.B_bKQ[h], metric=metric,
                                          seq_len=seq) for h in range(2))
    assert upper <= per_head
    fn = lambda X, t: attention_forward(layer.attention, X)  # noqa: E731
    lower = _lower(fn, T=T, d=spec.d_model, radius=radius, metric=metric, sigma_min=0.0, seed=seed, **FAST)
    assert 0 < lower <= upper


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), act=st.sampled_from(ACTS), gated=st.booleans(), biases=st.booleans(),
       radius=st.floats(0.3, 3.0))
def test_ffn_bound_dominates_adversarial_search(seed, act, gated, biases, radius):
    spec = random_spec(seed, L=1, act=act, gated=gated, biases=biases, scale=2.0)
    layer = spec.layers[0]
    n = layer_norms(layer)
    upper = ffn_lipschitz(n.B_W1, n.B_W2, act, radius=radius, B_b1=n.B_b1, B_Wg=n.B_Wg, B_bg=n.B_bg)
    fn = lambda X, t: ffn_forward(layer.ffn, X)  # noqa: E731
    lower = _lower(fn, T=2, d=spec.d_model, radius=radius, metric="2,inf", sigma_min=0.0, seed=seed, **FAST)
    assert 0 < lower <= upper


@settings(max_examples=40, deadline=None, derandomize=True)
@given(d=st.integers(2, 12), eps=st.floats(1e-6, 1.0), sigma_min=st.floats(0.0, 2.0),
       gamma_scale=st.floats(0.1, 3.0), constant_gamma=st.booleans(), rms=st.booleans(), seed=st.integers(0, 999))
def test_layernorm_rmsnorm_bound_dominates_and_is_tight(d, eps, sigma_min, gamma_scale, constant_gamma, rms, seed):
    g = torch.Generator().manual_seed(seed)
    gamma = (torch.full((d,), gamma_scale, dtype=torch.float64) if constant_gamma
             else gamma_scale * torch.randn(d, generator=g, dtype=torch.float64))
    kind = NormKind.RMSNORM if rms else NormKind.LAYERNORM
    norm = NormSpec(kind, gamma, None, eps)
    G = float(gamma.abs().max())
    upper = (rmsnorm_lipschitz if rms else layernorm_lipschitz)(G, eps, sigma_min)
    if rms:  # the floor for RMSNorm is on the root mean square: project radially
        def extra(Z):
            r = Z.pow(2).mean(-1, keepdim=True).sqrt()
            return Z * torch.clamp(sigma_min * (1 + 1e-9) / torch.clamp(r, min=1e-300), min=1.0)
    else:
        extra = _sigma_floor_projection(sigma_min)
    radius = 10.0 * math.sqrt(d) * max(sigma_min, 0.1)
    # start at the floor, where the constant is attained (F14)
    starts = torch.randn(3, 1, d, generator=g, dtype=torch.float64)
    starts = starts / starts.norm(dim=-1, keepdim=True) * math.sqrt(d) * max(sigma_min, 1e-3)
    lower = _lower(lambda X, t: norm(X), T=1, d=d, radius=radius, metric="2,inf", sigma_min=0.0,
                   n_samples=2, n_steps=20, n_power=8, seed=seed, project_extra=extra, extra_starts=starts)
    assert lower <= upper
    if constant_gamma and sigma_min > 0.05 and d >= 3:
        # not vacuous: for constant gamma the bound is attained at the floor
        assert lower >= 0.9 * upper


def test_layernorm_global_constant_numbers():
    assert abs(layernorm_lipschitz(1.0, 1e-5) - 316.2277660168379) < 1e-9
    # the Jacobian norm at a point equals 1/sqrt(sigma^2 + eps) for gamma = 1 (F14, exact)
    x = torch.tensor([[0.3, -1.2, 0.7, 2.0, -0.1]], dtype=torch.float64)
    n = NormSpec(NormKind.LAYERNORM, None, None, 1e-3)
    J = torch.autograd.functional.jacobian(lambda z: n(z), x)[0, :, 0, :]
    s = x.std(unbiased=False) ** 2
    assert abs(float(torch.linalg.matrix_norm(J, 2)) - float(1 / torch.sqrt(s + 1e-3))) < 1e-12


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), placement=st.sampled_from(["post", "pre"]),
       norm=st.sampled_from(["ball", "layernorm", "rmsnorm", "none"]), radius=st.floats(0.5, 2.5))
def test_every_stage_of_a_layer_dominates_its_witnesses(seed, placement, norm, radius):
    spec = random_spec(seed, L=1, norm=norm, placement=placement, biases=True, eps=0.1)
    bounds = lipschitz_bounds(spec, radius=radius)
    fns = stage_functions(spec)
    for st_ in bounds.stages:
        key = (st_.layer, st_.name)
        lower = _lower(fns[key], T=3, d=spec.d_model, radius=st_.radius_in, metric="2,inf", sigma_min=0.0,
                       n_samples=2, n_steps=15, n_power=6, seed=seed)
        assert lower <= st_.lipschitz, key


def test_eps_zero_refusal_names_both_norm_kinds():
    """Red team 165: an RMSNorm with eps = 0 (Llama, rms_norm_eps=0) was refused as "LayerNorm with eps=0"."""
    import pytest

    from transcover import InputError
    from transcover.lipschitz import layernorm_lipschitz

    with pytest.raises(InputError, match="LayerNorm or RMSNorm with eps=0 is not Lipschitz"):
        layernorm_lipschitz(1.0, 0.0)
