"""Note [local cache binding]: a ``cache`` passed to ``layer_local`` / ``network_local`` across calls keeps the
weight-only constants of the layer it was made from, and only of that layer with its tensors unchanged."""

import torch

from lipschitz_testkit import random_spec
from transcover.lipschitz import _local_rows
from transcover.lipschitz._local import layer_local, network_local


def _spec(seed: int, scale: float = 1.0):
    return random_spec(seed, act="gelu", norm="layernorm", placement="post", biases=True, d=6, dff=8, scale=scale)


def _X(seed: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _key(ll) -> tuple:  # noqa: ANN001
    return (ll.upper, ll.product, ll.jacobian_point, ll.jacobian_ball, ll.exact_ball, tuple(sorted(ll.components.items())),
            tuple(sorted(ll.radii.items())))


def test_one_cache_across_two_models_certifies_each_as_a_fresh_cache_does():
    X = _X(0)
    a, b = _spec(1), _spec(2, scale=3.0)
    cache: dict = {}
    layer_local(a.layers[0], X, 0.05, cache=cache)
    shared, fresh = layer_local(b.layers[0], X, 0.05, cache=cache), layer_local(b.layers[0], X, 0.05)
    assert _key(shared) == _key(fresh)  # with a's norms b's layer 0 was certified below its own constants


def test_an_in_place_weight_change_drops_the_layers_entries():
    X = _X(1)
    spec = _spec(3)
    cache: dict = {}
    before = layer_local(spec.layers[0], X, 0.05, cache=cache)
    with torch.no_grad():
        spec.layers[0].ffn.W_1.mul_(4.0)  # exact: a power of two
    after, fresh = layer_local(spec.layers[0], X, 0.05, cache=cache), layer_local(spec.layers[0], X, 0.05)
    assert _key(after) == _key(fresh) and after.upper > before.upper


def test_the_network_route_rebinds_the_stack_routes_norms_too():
    X = _X(2)
    a, b = _spec(4), _spec(5, scale=3.0)
    cache: dict = {}
    network_local(a, X, 0.01, cache=cache, route="stack")
    shared, fresh = network_local(b, X, 0.01, cache=cache, route="stack"), network_local(b, X, 0.01, route="stack")
    assert (shared.upper, shared.stack, shared.product) == (fresh.upper, fresh.stack, fresh.product)


def test_the_same_layer_reuses_its_weight_constants(monkeypatch):
    X = _X(3)
    spec = _spec(6)
    calls = []
    real = _local_rows.ffn_drift_constant
    monkeypatch.setattr(_local_rows, "ffn_drift_constant", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache: dict = {}
    first = layer_local(spec.layers[0], X, 0.05, cache=cache)
    n = len(calls)
    again = layer_local(spec.layers[0], X * 1.5, 0.02, cache=cache)
    assert n > 0 and len(calls) == n  # the second ball reads the first's kappa
    assert _key(again) == _key(layer_local(spec.layers[0], X * 1.5, 0.02))
    assert first.upper > 0
