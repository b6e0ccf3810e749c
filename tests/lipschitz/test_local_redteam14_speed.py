"""Red team, issue 12 stop 14: F45 (branch speed14) -- the cheap split-of-H tier of F38's N2 and the tiered lazy
refinement.  Attacked where the branch's own tests do not reach:

* the tier against the explicitly formed ``||W_2^T D K||`` (D = GELU''(z) evaluated independently) with W_1's units
  and W_2's rows scaled over 8-14 decades (H and W_2 W_2^T ill-conditioned: the rest R and the roundings carry the
  bound), rank-one W_1, pre-activations that switch on only the small or only the large units or a single unit,
  splits of rank 1 up to beyond d_ff and d;
* the tier's promise to ``refine_lazily`` on whole layers: the reported maxima (ball, drift, every part) with the
  tier (``layer_rows(..., tiers=True)``) equal those without it, post- and pre-LN, FFN-dominated layers (W_1 x 3),
  several radii, and the tier really decides (exact N2 at fewer tokens).
speed14 is on main since dccf3f2.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lipschitz_testkit import random_spec
from transcover.lipschitz import _local_rows
from transcover.lipschitz._local_ffn2 import ffn_hadamard, ffn_second_norms, ffn_second_split, ffn_split_constants
from transcover.lipschitz._local_rows import BOUND_PARTS, layer_rows

pytestmark = pytest.mark.usefixtures("without_reach_drift")  # F70c off: these test F37a's exact maxima


def _gelu2(z: torch.Tensor) -> torch.Tensor:
    """GELU'' = phi(z) (2 - z^2), written here independently of ``gelu_second``."""
    return torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * (2 - z * z)


def _true_n2(ffn, z: torch.Tensor, centred: bool) -> torch.Tensor:  # noqa: ANN001
    W1, W2 = ffn.W_1.double(), ffn.W_2.double()
    W2 = W2 - W2.mean(dim=1, keepdim=True) if centred else W2
    K = torch.einsum("ak,bk->kab", W1, W1).reshape(W1.shape[1], -1)
    return torch.stack([torch.linalg.matrix_norm((W2.T * _gelu2(zi)) @ K, ord=2) for zi in z])


def _ill_conditioned(seed: int, d: int, dff: int, c1: float, c2: float, zkind: str):  # noqa: ANN202
    """An FFN with W_1's units scaled over 1e-c1..1e+c1 and W_2's rows over 1e-c2..1e+c2 (shuffled), and 4 tokens'
    pre-activations of the kind named."""
    g = torch.Generator().manual_seed(seed)
    ffn = random_spec(seed, act="gelu", norm="layernorm", d=d, dff=dff, biases=True).layers[0].ffn
    s1 = torch.logspace(-c1, c1, dff, dtype=torch.float64)[torch.randperm(dff, generator=g)]
    s2 = torch.logspace(-c2, c2, dff, dtype=torch.float64)[torch.randperm(dff, generator=g)]
    W1, W2 = ffn.W_1.double() * s1[None, :], ffn.W_2.double() * s2[:, None]
    if zkind == "rank1":
        W1 = W1[:, :1] @ torch.randn(1, dff, generator=g, dtype=torch.float64)
    ffn = dataclasses.replace(ffn, W_1=W1, W_2=W2)
    off = torch.full((4, dff), 40.0, dtype=torch.float64)  # saturated: GELU'' = 0 to float64
    if zkind == "small_on":
        z = torch.where(s1[None] < 1, torch.zeros_like(off), off)
    elif zkind == "large_on":
        z = torch.where(s1[None] > 1, torch.zeros_like(off), off)
    elif zkind == "one_unit":
        z = off.clone()
        for i in range(4):
            z[i, (7 * i) % dff] = 0.0
    else:
        z = torch.randn(4, d, generator=g, dtype=torch.float64) @ W1
    return ffn, z


@pytest.mark.parametrize("d,dff", [(4, 20), (8, 6), (3, 3)])
@pytest.mark.parametrize("c1,c2", [(0, 0), (4, 4), (7, 7)])
@pytest.mark.parametrize("zkind", ["small_on", "large_on", "one_unit", "data", "rank1"])
def test_tier_is_never_below_the_formed_norm_on_ill_conditioned_weights(d, dff, c1, c2, zkind):
    """Per token, the tier is at least F38b's certified N2 and the explicitly formed ``||W_2^T D K||``, centred and
    not, for split ranks (1, 1), (2, 1), half, full and beyond (d_ff + 5, d + 3) and the production (256, 128)
    (red14 probes: 5 040 cases, the tightest at 1 + 5e-10 of the formed norm)."""
    ffn, z = _ill_conditioned(d + dff, d, dff, c1, c2, zkind)
    for centred in (False, True):
        const = ffn_hadamard(ffn, centred=centred)
        true, exact = _true_n2(ffn, z, centred), ffn_second_norms(const, z)
        for rank, rank2 in ((1, 1), (2, 1), (max(dff // 2, 1), max(d // 2, 1)), (dff, d), (dff + 5, d + 3),
                            (256, 128)):
            tier = ffn_second_split(const, ffn_split_constants(const, rank, rank2), z)
            assert bool((tier >= true).all()), (centred, rank, rank2, tier, true)
            assert bool((tier >= exact).all()), (centred, rank, rank2, tier, exact)


def _maxima(ljs) -> list:  # noqa: ANN001
    """Ball, largest drift row and the parts that are refined maxima (F61b: with tiers, ``BOUND_PARTS`` are upper
    bounds)."""
    return [(lj.ball, float(lj.drift_rows.max()), {k: v for k, v in lj.parts.items() if k not in BOUND_PARTS})
            for lj in ljs]


def _counting(monkeypatch, name: str) -> list:  # noqa: ANN001
    """Count the tokens ``_local_rows.<name>`` (an N2 function of ``(const, [split,] z)``) is evaluated at."""
    seen, plain = [0], getattr(_local_rows, name)

    def counted(*args):  # noqa: ANN002, ANN202
        seen[0] += args[-1].shape[0]
        return plain(*args)

    monkeypatch.setattr(_local_rows, name, counted)
    return seen


@pytest.mark.parametrize("seed,placement,w1", [(0, "post", 3.0), (1, "pre", 3.0), (2, "post", 1.0), (3, "pre", 0.5)])
def test_tiered_lazy_refinement_reports_the_eager_maxima(seed, placement, w1, monkeypatch):
    """``layer_rows(..., tiers=True)`` reports the same ball, largest drift row and every part but F61b's (at least
    the eager one), float for float, as without the tier (every token refined straight to F38's exact N2), on GELU layers whose FFN curvature dominates
    (W_1 x 3) or not, T = 6, three radii; the tier is evaluated and spares exact N2's."""
    spec = random_spec(seed, act="gelu", norm="layernorm", placement=placement, d=8, H=2, dh=4, dff=24, biases=True)
    L = spec.layers[0]
    L = dataclasses.replace(L, ffn=dataclasses.replace(L.ffn, W_1=w1 * L.ffn.W_1))
    X = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    radii = [1e-3, 1e-2, 5e-2]
    exact, tier = _counting(monkeypatch, "ffn_second_norms"), _counting(monkeypatch, "ffn_second_split")
    eager_ljs = layer_rows(L, X, radii)
    n_eager = exact[0]
    assert tier[0] == 0
    tiered_ljs = layer_rows(L, X, radii, tiers=True)
    tiered, eager = _maxima(tiered_ljs), _maxima(eager_ljs)
    assert tiered == eager, (tiered, eager)
    assert all(a.parts[k] >= b.parts[k] for a, b in zip(tiered_ljs, eager_ljs) for k in BOUND_PARTS if k in a.parts)
    assert tier[0] > 0 and exact[0] - n_eager <= n_eager, (tier[0], exact[0] - n_eager, n_eager)
