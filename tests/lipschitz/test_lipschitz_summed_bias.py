"""The attention's summed output bias ``b_O + sum_h b_V^h W_O^h`` carries its float64 summation error.

bf16 biases of 2^100 that cancel in ``b_O`` leave 2^40 behind, which float64's 53 bits lose: ``analyze``
certified B_b_attn = [0, 0] and G.3 a bound of 0 for two models whose outputs differ by 6 (red team 37d).
Exact references: rational arithmetic on the stored values.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
import torch

from lipschitz_testkit import random_spec
from transcover.lipschitz import perturbation_bound
from transcover.norms import analyze_spec, measure_model


def _exact_bias(a) -> list[Fraction]:
    bV, WO, bO = (t.detach().numpy().astype(np.float64) for t in (a.b_V, a.W_O, a.b_O))
    out = [Fraction(float(x)) for x in bO]
    for h in range(a.n_heads):
        kv = a.kv_index(h)
        for j in range(a.d_model):
            out[j] += sum(Fraction(float(bV[kv, k])) * Fraction(float(WO[h, k, j])) for k in range(WO.shape[1]))
    return out


def _norm(v: list[Fraction]) -> float:
    return float(sum(x * x for x in v)) ** 0.5


def _cancelling(seed: int, dtype: torch.dtype, big: float, small: float):
    """One layer whose head 0 adds big + small to output 0 and b_O takes big away again (all stored in dtype)."""
    spec = random_spec(seed, biases=True, L=1)
    a = spec.layers[0].attention
    W_O, b_V, b_O = a.W_O.clone(), a.b_V.clone(), a.b_O.clone()
    W_O[0, :2, :] = 0.0
    W_O[0, 0, 0] = W_O[0, 1, 0] = 1.0
    b_V[0, 0], b_V[0, 1], b_O[0] = big, small, -big
    a = replace(a, W_O=W_O.to(dtype).double(), b_V=b_V.to(dtype).double(), b_O=b_O.to(dtype).double())
    return replace(spec, layers=[replace(spec.layers[0], attention=a)])


@pytest.mark.parametrize("dtype, big, small", [(torch.bfloat16, 2.0**100, 2.0**40), (torch.float16, 2.0**15, 2.0**-20),
                                               (torch.float32, 2.0**90, 2.0**-10), (torch.bfloat16, 3.0, 0.5)])
def test_analyze_encloses_the_exact_summed_bias(dtype, big, small):
    spec = _cancelling(1, dtype, big, small)
    exact = _norm(_exact_bias(spec.layers[0].attention))
    iv = analyze_spec(spec).layers[0].B_b_attn
    assert iv.lower <= exact <= iv.upper, (iv, exact)


@pytest.mark.parametrize("dtype, big, small", [(torch.bfloat16, 2.0**100, 2.0**40), (torch.float16, 2.0**15, 2.0**-20)])
def test_g3_charges_the_summed_bias_difference(dtype, big, small):
    a = _cancelling(2, dtype, big, small)
    b = _cancelling(2, dtype, big, 0.0)
    ea, eb = _exact_bias(a.layers[0].attention), _exact_bias(b.layers[0].attention)
    exact = _norm([x - y for x, y in zip(ea, eb)])
    assert exact > 0
    assert measure_model(a, reference=b).distances[(0, "b_out")].value >= exact
    assert perturbation_bound(a, b).total.value > 0
