"""A certified local constant that cannot be evaluated is inf, never NaN (red team 192).

On a pre-LN GPT-2 with eps 1e-12 and tokens of spread 1e-3, ``mixed_head_terms``' moved softmax weights overflowed and
the Jacobian route's ball came out NaN; ``min(nan, exact)`` kept it as ``jacobian_ball``, and ``local_table``'s
``max(0.0, nan)`` would have reported 0 for it.
"""

from __future__ import annotations

import math

import pytest
import torch

from transcover.lipschitz._local import layer_local, nan_as_inf
from transcover.model import load


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    transformers = pytest.importorskip("transformers")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the red team's model: built and initialised in float64
    try:
        torch.manual_seed(3)
        m = transformers.GPT2Model(transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, n_inner=16, n_positions=16,
                                                            vocab_size=32, layer_norm_epsilon=1e-12))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "ln" in n and n.endswith("weight"):
                    p.copy_(1 + 0.3 * torch.randn_like(p))
                elif "ln" in n and n.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                elif p.dim() == 2 and "wte" not in n and "wpe" not in n:
                    p.copy_(torch.randn_like(p) / p.shape[0] ** 0.5)
                elif n.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
        d = tmp_path_factory.mktemp("gpt2nan")
        m.save_pretrained(d, safe_serialization=True)
    finally:
        torch.set_default_dtype(old)
    return d


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_an_overflowing_route_is_inf_not_nan(gpt2_dir, default) -> None:  # noqa: ANN001
    """Also under either default dtype: the drift's finiteness was tested in the default dtype, so under float32 a
    drift of 1e39 counted as infinite and the NaN showed only under float64 (the red team's session)."""
    spec = load(gpt2_dir).to_torch(torch.float64)
    torch.manual_seed(2)
    X = torch.ones(3, 8, dtype=torch.float64) * 0.7 + 1e-3 * torch.randn(3, 8, dtype=torch.float64)
    old = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        ll = layer_local(spec.layers[0], X, 9e-4)
    finally:
        torch.set_default_dtype(old)
    for v in (ll.jacobian_point, ll.jacobian_ball, ll.exact_point, ll.exact_ball, ll.product, ll.upper):
        assert not math.isnan(v)
    assert ll.jacobian_ball <= ll.exact_ball and ll.upper == min(ll.product, ll.jacobian_ball)


def test_nan_as_inf() -> None:
    assert nan_as_inf(math.nan) == math.inf and nan_as_inf(2.5) == 2.5 and nan_as_inf(-math.inf) == -math.inf
