"""The per-matrix route reads a module's stored 2-D parameters: they must be the weights its forward uses.

Red team 210: ``analyze`` of a module outside every adapter certified the raw ``parametrizations.weight.original``
of a spectral-norm parametrisation (effective ``||W||_2 = 1``) and the unmasked ``weight_orig`` of a 90 % prune.
Both are now refused in one line naming the tensor and how to remove the rewrite; once removed, the certified
norms are the effective weights'.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune

import transcover
from transcover import UnsupportedArchitectureError
from transcover.norms import per_matrix_norms


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()


@pytest.mark.parametrize("rewrite, match", [
    (lambda m: torch.nn.utils.parametrizations.spectral_norm(m[0]), r"^0\.weight is parametrised"),
    (lambda m: prune.l1_unstructured(m[2], "weight", amount=0.9), r"^2\.weight is pruned"),
    (lambda m: m[2].register_forward_hook(lambda mod, i, o: 10 * o), r"^2 \(Linear\) has a forward hook"),
])
def test_rewritten_weights_are_refused_on_the_per_matrix_route(rewrite, match):
    m = _net()
    rewrite(m)
    for fn in (per_matrix_norms, transcover.analyze):
        with pytest.raises(UnsupportedArchitectureError, match=match) as err:
            fn(m)
        assert "\n" not in str(err.value)


def test_after_removing_the_rewrite_the_effective_weight_is_certified():
    m = _net()
    with torch.no_grad():
        m[0].weight.mul_(10)
    torch.nn.utils.parametrizations.spectral_norm(m[0])
    raw = float(torch.linalg.matrix_norm(m[0].parametrizations.weight.original.detach().double(), 2))
    parametrize.remove_parametrizations(m[0], "weight")
    effective = float(torch.linalg.matrix_norm(m[0].weight.detach().double(), 2))  # ~1 (float32 power iteration)
    row = next(r for r in per_matrix_norms(m).matrices if r.name == "0.weight")
    assert row.spectral.lower <= effective <= row.spectral.upper < 1.01 < raw
