"""F52a: with F45's tier, the gamma-folded FFN drift is refined to its final term before the plain one (THEORY F52).

The staged order only decides *where* the existing bounds are evaluated (F37a/F45b with the folded final term as
one more intermediate tier of a token): every reported maximum must equal refining every token to both final terms,
the route without the tier must report the same maxima, a lazy row is never below the eager one, and the order must
spare some plain refinements (else the test could not tell it from the old order).
"""

from __future__ import annotations

import pytest
import torch

from lipschitz_testkit import hetero_gamma, random_spec
from transcover.lipschitz import _local_rows
from transcover.lipschitz._local_rows import FfnDrift, layer_rows
from transcover.model import NormKind

RADII = [1e-4, 1e-3, 1e-2, 3e-2, 0.1]


def _refine_all(evaluate, reported, refine, T, lowest=None):  # noqa: ANN001, ANN202, ARG001
    idx = torch.arange(T)
    while len(idx):  # until every token is final in both drifts
        final = refine(idx)
        idx = idx[:0] if final is None else idx[~final]
    return evaluate()


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


def _count_finals(monkeypatch, L):  # noqa: ANN001, ANN202
    """Counts of ``FfnDrift.final`` tokens for the plain FFN (``"base"``) and the folded one (``"fold"``)."""
    counts = {"base": 0, "fold": 0}
    orig = FfnDrift.final

    def final(self, rh, dF, dFh, ref, idx):  # noqa: ANN001, ANN202
        counts["base" if self.ffn is L.ffn else "fold"] += len(idx)
        return orig(self, rh, dF, dFh, ref, idx)

    monkeypatch.setattr(FfnDrift, "final", final)
    return counts


def _same_maxima(a, b) -> None:  # noqa: ANN001
    assert a.point == b.point and a.ball == b.ball, (a.radius, a.ball, b.ball)
    assert float(a.drift_rows.max()) == float(b.drift_rows.max())
    assert a.parts == b.parts, (a.parts, b.parts)


@pytest.mark.parametrize("placement", ["post", "pre"])
@pytest.mark.parametrize("gamma", ["plain", "outlier", "tiny", "negative"])
def test_fold_first_reports_the_eager_maxima(placement, gamma, monkeypatch):
    """Random GELU layers with heterogeneous gamma (outliers, tiny and negative entries), five radii: the staged
    lazy route's maxima equal every token refined to both final terms and the untiered route's; its rows and
    stage radii are at least the eager ones."""
    L, X = _case(21, placement, gamma)
    lazy = layer_rows(L, X, RADII, tiers=True)
    plain = layer_rows(L, X, RADII)
    monkeypatch.setattr(_local_rows, "refine_lazily", _refine_all)
    full = layer_rows(L, X, RADII, tiers=True)
    for a, b, c in zip(lazy, full, plain):
        _same_maxima(a, b)
        _same_maxima(a, c)
        assert bool((a.total_rows >= b.total_rows).all()) and bool((a.drift_rows >= b.drift_rows).all())
        for name, rad in a.stage_radii.items():
            assert bool((rad >= b.stage_radii[name]).all()), name


def test_fold_first_spares_plain_refinements(monkeypatch):
    """Over seeds and gamma kinds (post-LN, where the fold enters the most rows) the staged order refines the plain
    FFN at fewer token-radii than the folded one, and never the plain one at a token whose folded drift is not
    final (every plain refinement follows a folded one)."""
    base = fold = 0
    for seed in (21, 22, 23):
        for gamma in ("plain", "outlier", "tiny"):
            L, X = _case(seed, "post", gamma)
            with monkeypatch.context() as m:
                counts = _count_finals(m, L)
                layer_rows(L, X, RADII, tiers=True)
            base, fold = base + counts["base"], fold + counts["fold"]
    assert 0 < fold and base < fold, (base, fold)


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
