"""F52c: the data-free per-head maps and norms kept per layer across calls are the fresh floats (THEORY F52)."""

from __future__ import annotations

import torch

from lipschitz_testkit import hetero_gamma, random_spec
from transcover.lipschitz._local_rows import layer_rows
from transcover.model import NormKind

RADII = [1e-4, 1e-3, 1e-2, 3e-2, 0.1]


def _case(seed: int, placement: str, gamma: str, d: int = 12, T: int = 10):  # noqa: ANN202
    spec = random_spec(seed, act="gelu", norm="layernorm", placement=placement, d=d, H=2, dh=6, dff=48,
                       scale=1.5, biases=True)
    L = spec.layers[0]
    g = torch.Generator().manual_seed(seed)
    for norm in (L.norm_attn, L.norm_ffn):
        if norm.kind is NormKind.LAYERNORM:
            norm.weight.copy_(hetero_gamma(gamma, d, g))
    X = torch.randn(T, d, generator=g, dtype=torch.float64) * 2
    return L, X


def _same_maxima(a, b) -> None:  # noqa: ANN001
    assert a.point == b.point and a.ball == b.ball, (a.radius, a.ball, b.ball)
    assert float(a.drift_rows.max()) == float(b.drift_rows.max())
    assert a.parts == b.parts, (a.parts, b.parts)


def test_cached_head_maps_are_the_fresh_floats():
    """F52c: the data-free per-head maps and norms kept in the layer's ``head_norms`` dict across calls give the
    same floats as fresh ones: a second sentence with a warm cache reports exactly what it reports alone, and the
    cached ``W_h``, ``W_h^T W_h`` and ``||W||`` equal fresh evaluations."""
    from transcover.lipschitz import _local_stages as st
    from transcover.lipschitz._local_attention import head_norms

    L, X = _case(24, "post", "outlier")
    X2 = torch.randn(7, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    hn = head_norms(L.attention)
    layer_rows(L, X, RADII, head_norms_=hn)  # fills the cache
    assert "joint_WN" in hn and ("geo_norm", True) in hn and ("geo_norm", False) in hn
    warm = layer_rows(L, X2, RADII, head_norms_=hn)
    cold = layer_rows(L, X2, RADII)
    for a, b in zip(warm, cold):
        _same_maxima(a, b)
        assert torch.equal(a.total_rows, b.total_rows) and torch.equal(a.drift_rows, b.drift_rows)
    at = st.layer_at_x(L, X2, float(hn["O"]))
    fresh, cached = st.drift_at_x(at), st.drift_at_x(at, hn)
    assert torch.equal(fresh.joint.W, cached.joint.W) and torch.equal(fresh.joint.N, cached.joint.N)
    for f, c in ((fresh.geo_v, cached.geo_v), (fresh.geo_ov, cached.geo_ov)):
        assert torch.equal(f.norm, c.norm) and torch.equal(f.spread, c.spread)
