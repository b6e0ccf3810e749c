"""The covering bound of a tiny random Qwen3 (query/key RMSNorm, THEORY F23) and of RoPE with query/key
biases (F22): finite, and its breakdown names the pieces Lemma G.3 charges one by one there."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from transcover.covering import transformer_log_covering
from transcover.covering._model_bound import model_terms
from transcover.lipschitz import perturbation_coefficients
from transcover.model import load


def _qwen3():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=24, vocab_size=32, rms_norm_eps=1e-5, max_position_embeddings=16,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).double().eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # non-trivial norm scales, so q_norm.gamma is not the all-ones vector
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return load(model)


@pytest.fixture(scope="module")
def qwen3():
    return _qwen3()


def _cover(spec, reference=None):
    terms, _, _ = model_terms(spec, reference=reference)
    cov = transformer_log_covering(terms, 0.1, 128 * 1000, family="l21")
    assert math.isfinite(cov.log_log_N)
    return {c.role for c in cov.contributions if c.log_cost > -math.inf}


def test_covering_of_a_tiny_qwen3_names_the_new_terms(qwen3):
    spec = qwen3
    assert spec.layers[0].attention.q_norm is not None
    roles = _cover(spec)
    assert {"W_Q.0", "W_K.1", "q_norm.gamma", "k_norm.gamma", "W_OV.0"} <= roles
    assert not any(r.startswith("W_KQ") for r in roles)  # the scores are not charged through W_Q W_K^T
    assert all(math.isfinite(e.coefficient) and e.coefficient > 0 for e in perturbation_coefficients(spec).entries)


def test_covering_with_a_reference_charges_the_distances(qwen3):
    roles = _cover(qwen3, reference=_qwen3_perturbed(qwen3))
    assert {"W_Q.0", "q_norm.gamma"} <= roles


def _qwen3_perturbed(spec):
    lay = spec.layers[0]
    a = lay.attention
    g = torch.Generator().manual_seed(5)
    q = replace(a.q_norm, weight=a.q_norm.weight + 0.1 * torch.randn(a.q_norm.weight.shape, generator=g, dtype=torch.float64))
    return replace(spec, layers=[replace(lay, attention=replace(a, W_Q=a.W_Q * 1.1, q_norm=q))])


def test_an_rmsnorm_model_without_a_shift_is_covered(qwen3):
    """Regression: G.3 charges every LayerNorm/RMSNorm's shift (F14), and a model without one (every
    Llama) was refused with 'no weights found for layer -1 role input_norm.beta'; the absent shift is
    fixed at zero for the whole class, so nothing is covered for it."""
    plain = replace(qwen3, layers=[replace(lay, attention=replace(lay.attention, q_norm=None, k_norm=None))
                                   for lay in qwen3.layers])
    assert plain.layers[0].norm_attn.bias is None
    roles = _cover(plain)
    assert "W_KQ.0" in roles and "norm_attn.gamma" in roles
