"""The spec of an L2-attention reference model computes what the model computes."""

import torch

from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec, transformer_forward


def test_l2_attention_reference_spec_matches_module():
    torch.manual_seed(0)
    model = ReferenceTransformer(ReferenceConfig(d_model=16, n_heads=2, n_layers=2, d_ff=16, attention="l2")).double()
    spec = reference_spec(model)
    assert all(layer.attention.kind == "l2" for layer in spec.layers)
    X = torch.randn(3, 6, 16, dtype=torch.float64) / 4
    tol = 100 * 16 * torch.finfo(torch.float64).eps
    torch.testing.assert_close(transformer_forward(spec, X), model(X), rtol=0, atol=tol)
