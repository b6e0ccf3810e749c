"""The small class both Monte-Carlo cross-checks of the covering bound sample (issue 5's estimator)."""

from __future__ import annotations

import math

import torch

from transcover.covering import model_terms


def monte_carlo_case():
    """``(terms, X, sample)``: one reference Transformer's matrix terms, 6 inputs of T = 1 token and
    300 functions of the class whose every W_KQ, W_OV, W_1, W_2 spectral norm is at most the
    smallest norm of its kind in the spec (so that class sits inside the one the terms bound).

    With T = 1 the softmax is 1, so the separate ||W_V||, ||W_O|| bounds the coefficients may also
    use play no role, and the sampler's per-sample l2 norm is our max over tokens."""
    from transcover.empirical import NormRadii, random_inputs, sample_reference_class
    from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec

    torch.manual_seed(7)
    cfg = ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=8, head_hidden=(), ffn_bias=False)
    spec = reference_spec(ReferenceTransformer(cfg))
    terms, _, _ = model_terms(spec, radius=1.0)
    by_kind: dict[str, float] = {}
    for t in terms:
        k = t.role.split(".")[0]
        by_kind[k] = min(by_kind.get(k, math.inf), t.spectral)
    radii = NormRadii(B_KQ=by_kind["W_KQ"], B_V=by_kind["W_OV"], B_W1=by_kind["W_1"], B_W2=by_kind["W_2"],
                      B_b1=0.0, B_b2=0.0)
    X = random_inputs(6, 1, 4, seed=1)
    return terms, X, sample_reference_class(cfg, radii, 300, seed=2, output="features")
