"""Whole-network and per-layer bounds (F8, radius propagation) against adversarial witnesses."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lipschitz_testkit import ACTS, NORMS, random_spec
from transcover import InputError, Kind
from transcover.lipschitz import lipschitz_bounds, lipschitz_lower, network_lipschitz_lower
from transcover.lipschitz._empirical import stage_functions
from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec, transformer_forward


@settings(max_examples=12, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), norm=st.sampled_from(NORMS), placement=st.sampled_from(["post", "pre"]),
       act=st.sampled_from(ACTS), gated=st.booleans(), biases=st.booleans(), causal=st.booleans(),
       radius=st.floats(0.3, 3.0), metric=st.sampled_from(["2,inf", "fro"]), final=st.booleans(),
       rope=st.booleans())
def test_measured_never_exceeds_certified_anywhere(seed, norm, placement, act, gated, biases, causal, radius,
                                                   metric, final, rope):
    spec = random_spec(seed, norm=norm, placement=placement, act=act, gated=gated, biases=biases,
                       causal=causal, final_norm=final, eps=0.1, rope=rope)
    T = 3
    bounds = lipschitz_bounds(spec, radius=radius, metric=metric, seq_len=T if metric == "fro" else None)
    assert bounds.upper.kind is Kind.CERTIFIED_UPPER
    assert bounds.upper.value <= bounds.upper_uniform.value
    low = lipschitz_lower(spec, bounds, seq_len=T, n_samples=2, n_steps=10, seed=seed)
    for st_ in bounds.stages:
        assert low[(st_.layer, st_.name)].value.value <= st_.lipschitz, (st_.layer, st_.name)
    for i in range(spec.n_layers):
        assert low[(i, "layer")].value.value <= bounds.layer_upper(i).value
    net = low[(-2, "network")].value
    assert net.kind is Kind.EMPIRICAL_LOWER
    assert 0 < net.value <= bounds.upper.value


@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), sigma_min=st.floats(0.05, 1.0), placement=st.sampled_from(["post", "pre"]))
def test_layernorm_floor_bounds_hold_on_witnesses_that_respect_the_floor(seed, sigma_min, placement):
    spec = random_spec(seed, norm="layernorm", placement=placement, eps=1e-5)
    bounds = lipschitz_bounds(spec, radius=3.0, sigma_min=sigma_min)
    low = network_lipschitz_lower(spec, radius=3.0, sigma_min=sigma_min, seq_len=3, n_samples=3, n_steps=15,
                                  seed=seed)
    assert low.value.value <= bounds.upper.value
    assert any("sigma_0" in a for a in bounds.upper.assumptions)


@pytest.mark.parametrize("norm", ["ball", "layernorm", "none"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_our_forward_is_the_reference_models_forward(norm, activation):
    torch.manual_seed(3)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=12, norm=norm,
                                                 activation=activation)).double()
    spec = reference_spec(model)
    X = torch.randn(4, 5, 8, dtype=torch.float64) * 2
    with torch.no_grad():
        ours = stage_functions(spec)[(-2, "network")](X, None)
        theirs = model.features(X)
    eps = 50 * torch.finfo(torch.float64).eps
    torch.testing.assert_close(ours, theirs, rtol=0, atol=eps * float(theirs.abs().max() + 1))
    torch.testing.assert_close(ours, transformer_forward(spec, X, with_head=False), rtol=0, atol=1e-12)


def test_radius_propagation_is_tighter_than_the_uniform_product_without_normalisation():
    spec = random_spec(1, norm="none", L=3, scale=1.5)
    b = lipschitz_bounds(spec, radius=1.0)
    radii = [s.radius_in for s in b.stages if s.name == "attention"]
    assert radii == sorted(radii) and radii[-1] > radii[0]  # the stream grows without a norm
    assert b.upper.value < b.upper_uniform.value


def test_ball_stages_see_radius_one_and_layer_products_match():
    spec = random_spec(2, norm="ball")
    b = lipschitz_bounds(spec, radius=5.0)
    assert all(s.radius_in <= 1.0 for s in b.stages if s.name in ("attention", "ffn"))
    prod = 1.0
    for s in b.stages:
        prod *= s.lipschitz
    assert abs(b.upper.value / prod - 1) < 2e-9


@pytest.mark.parametrize("kwargs, match", [
    (dict(radius=0.0), "radius"), (dict(radius=-1.0), "radius"), (dict(radius=float("nan")), "radius"),
    (dict(metric="l1"), "metric"), (dict(metric="fro"), "seq_len"), (dict(c_sm=0.0), "c_sm"),
    (dict(sigma_min=-0.1), "sigma_min"),
])
def test_bad_arguments_raise_one_line_input_errors(kwargs, match):
    spec = random_spec(0)
    with pytest.raises(InputError, match=match):
        lipschitz_bounds(spec, **kwargs)


def test_bad_sample_sizes_raise():
    spec = random_spec(0)
    with pytest.raises(InputError, match="n_samples"):
        network_lipschitz_lower(spec, n_samples=0)
    with pytest.raises(InputError, match="seq_len"):
        network_lipschitz_lower(spec, seq_len=0)


def test_layernorm_without_eps_or_floor_is_refused():
    spec = random_spec(0, norm="layernorm", eps=0.0)
    with pytest.raises(InputError, match="not Lipschitz"):
        lipschitz_bounds(spec)


def test_public_names_import():
    import transcover.lipschitz as lip

    for name in lip.__all__:
        assert getattr(lip, name) is not None
