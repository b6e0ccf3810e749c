"""Probe (issue 12, THEORY F49): would a lazy point stage pay?  Two measurements on the per-layer rows route.

(a) F49a: the post-LN point stage's values replaced by products of norms (``aP <= a_pt``, ``h <= ||D1|| aP``,
``g <= ||I + F|| h``, ``point <= ||D2|| g``, the chains ``||M W_O^T|| <= ||M|| ||W_O^T||``): per layer the tier's
ratios to the exact values, and per radius each token's ball row with the tier (and F17c's global FFN drift, an
upper bound of any refined row) over the exact reported maximum; a token above 1 would need its exact point stage.
The same with ``aP``, ``h`` and the ``D1 W_O`` chain exact (only the stages after ``I + F`` by products).
(b) F49b: how often the concatenated chain norm ``||M W_O^T||`` is the strict minimum in ``_heads_combined``.

    PYTHONPATH=src HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/point_tier_probe.py [--sentence 1] [--layers 3]

Not a certificate of anything new: the tier is certified, but this script only compares numbers.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from transcover.lipschitz import _local_rows as lr
from transcover.lipschitz import _local_stages as st
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz._local_jacobian import _weight_norms
from transcover.model import load
from transcover.model._data import load_inputs
from transcover.model._functional import layer_forward

RHOS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def product_tier(at: st.LayerAtX, pt: st.PostPoint, dd: st.DriftAtX, h_exact: bool = False) -> st.PostPoint:
    """F49a's tier from the exact ``a_pt`` and ``||I + F||``; ``h_exact``: ``aP``, ``h`` and the ``D1 W_O`` chain
    exact (the factored sandwich, F32), the stages after ``I + F`` by products."""
    if h_exact:
        aP, h, D1O = pt.aP_pt, pt.h_pt, pt.D1O
    else:
        aP, h, D1O = pt.a_pt, at.nD1 * pt.a_pt, (at.nD1[None] * dd.Oh, at.nD1 * dd.Oall)
    g = pt.nIF * h
    IFD1O = (pt.nIF[None] * D1O[0], pt.nIF * D1O[1])
    return dataclasses.replace(pt, aP_pt=aP, h_pt=h, g_pt=g, point=at.nD2 * g, nD2IFg=at.nD2 * pt.nIF * at.g1,
                               D1O=D1O, IFD1O=IFD1O, MO=(at.nD2[None] * IFD1O[0], at.nD2 * IFD1O[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentence", type=int, default=1)
    ap.add_argument("--layers", type=int, default=3)
    a = ap.parse_args()
    spec = load(None).to_torch(torch.float64)
    X = spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=32, limit=a.sentence + 1)[a.sentence].double())
    for li, L in enumerate(list(spec.layers)[:a.layers]):
        norms, hn = _weight_norms(L), head_norms(L.attention)
        at = st.layer_at_x(L, X.detach().double(), float(hn["O"]))
        pt = st.post_point(at, st.attention_row_gram(at))
        dd = st.drift_at_x(at)
        tier = product_tier(at, pt, dd)
        q = lambda c, e: f"{float((c / e).min()):.3g}-{float((c / e).max()):.3g}"  # noqa: E731
        print(f"layer {li}: tier/exact point {q(tier.point, pt.point)}, h {q(tier.h_pt, pt.h_pt)}, "
              f"g {q(tier.g_pt, pt.g_pt)} (with h exact {q(pt.nIF * pt.h_pt, pt.g_pt)}), "
              f"||D2(I+F)D1 W_O|| {q(tier.MO[1], pt.MO[1])}")
        med = float(X.norm(dim=1).median())
        for rho in (1e-3, 1e-2):
            ex = st.radius_rows(at, pt, dd, lr.FfnDrift(L, at.z, norms, True, at.ez), norms, hn, rho * med, [])[0]
            for name, t in (("tier", tier), ("tier with h exact", product_tier(at, pt, dd, h_exact=True))):
                ch = st.radius_rows(at, t, dd, lr.FfnDrift(L, at.z, norms, True, at.ez), norms, hn, rho * med, [],
                                    unit=False)[0]
                rel = ch.ball_rows / ex.ball_rows.max()
                print(f"  rho {rho:g}: exact max {float(ex.ball_rows.max()):.4g}; tokens above it with the {name} "
                      f"{int((rel > 1).sum())}/{len(rel)} (/ max {float(rel.min()):.3g}-{float(rel.max()):.3g})")
        X = layer_forward(L, X).detach()
    # (b): the concatenated branch of _heads_combined at the per-token chain norms
    wins = [0, 0]
    orig = st._heads_combined

    def counted(per, concat, dZ, joint=None):  # noqa: ANN001, ANN202
        if concat.numel() > 1 and bool(concat.std() > 0):  # a per-token chain norm (not the constant ||W_O||)
            other = (per * dZ).sum(dim=0) if joint is None else torch.minimum((per * dZ).sum(dim=0), joint)
            wins[0] += int((concat * torch.sqrt((dZ * dZ).sum(dim=0)) < other).sum())
            wins[1] += concat.numel()
        return orig(per, concat, dZ, joint)

    st._heads_combined = counted
    X = spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=32, limit=a.sentence + 1)[a.sentence].double())
    for L in list(spec.layers)[:a.layers]:
        med = float(X.norm(dim=1).median())
        lr.layer_rows(L, X, [f * med for f in RHOS], tiers=True)
        X = layer_forward(L, X).detach()
    st._heads_combined = orig
    print(f"concatenated chain norm the strict minimum at {wins[0]} of {wins[1]} (token, call) pairs")


if __name__ == "__main__":
    main()
