"""Scaled RoPE (THEORY F22): the bounds take the supremum over every rotation, so they hold for any
fixed frequencies; checked against the independent attacker with Llama 3's and YaRN's frequencies."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _attack import Domain, attack_gap, attack_pairs, fuzz_spec, ref_attention, ref_stage
from transcover.lipschitz import lipschitz_bounds, perturbation_bound
from transcover.model import attention_forward
from transcover.model._rope_scaling import rope_from_config

CONFIGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10.0},
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_scaled_rope_bounds_hold(kind):
    rope, score = rope_from_config({"max_position_embeddings": 64, "rope_parameters": CONFIGS[kind]}, "t", 4)
    base = fuzz_spec(21, norm="rmsnorm", placement="pre", rope=True, causal=True, qk_scale=3.0)
    spec = replace(base, layers=[replace(la, attention=replace(la.attention, rope=rope, scale=score / 2.0))
                                 for la in base.layers])
    a = spec.layers[0].attention
    X = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert float((attention_forward(a, X) - ref_attention(a, X)).abs().max()) < 1e-12
    bounds = lipschitz_bounds(spec, radius=1.0)
    for st in bounds.stages:
        if st.name in ("attention", "ffn"):
            w = attack_pairs(ref_stage(spec, st.layer, st.name), T=4, d=6, dom=Domain(st.radius_in),
                             metric="2,inf", restarts=3, steps=12, seed=st.layer, n_jacobian=2)
            assert w.ratio - w.slack <= st.lipschitz
    moved = replace(spec, layers=[replace(la, attention=replace(la.attention, W_K=la.attention.W_K * 1.02))
                                  for la in spec.layers])
    pb = perturbation_bound(spec, moved)
    w = attack_gap(ref_stage(spec, 0, "network"), ref_stage(moved, 0, "network"), T=4, d=6, dom=Domain(1.0),
                   metric="2,inf", restarts=3, steps=12, seed=7)
    assert 0 < w.ratio and w.ratio - w.slack <= pb.total.value
