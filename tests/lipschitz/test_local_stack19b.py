"""F59b: the stack's post-LN sub-stage radii as the exact prefix first order plus the per-layer remainders (THEORY F59b).

Attacks: float64 Adam ascent (restarts) of each post-LN stage output's remainder past the layer's exact Jacobian at X
(``S1``, ``S2`` centred, ``H``) over the layer's input ball, never above the remainders ``post_tail`` exposes
(``LayerJacobian.stage_remainders``); every sub-stage input's per-token move over the network's input ball never above
``stack_local``'s radius, on the random and adversarial stacks of test_local_stack19 (sharp causal softmax, tiny sigma
with eps = 1e-12, saturated GELU), where F59b binds; without F59b the radii, drift and bound are never smaller; the
whole network against pair-ratio and Jacobian-row ascent; homogeneity in the last norm's scale.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import transcover.lipschitz._local_stack as ls
from lipschitz_testkit import jvp_ascents
from test_local_stack15 import assert_network_below
from test_local_stack19 import CASES, _case, _moves_ascent, _stage_inputs, _without_f59
from transcover.lipschitz._local_jacobian import layer_jacobians
from transcover.lipschitz._local_stack import stack_local


def _without_f59b(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(ls, "_hybrid_radius", lambda *args: None)


def _layer_outputs(spec, ly, Z: torch.Tensor) -> list:  # noqa: ANN001
    """One post-LN layer's ``[S1 - mean, H, S2 - mean]`` at its input ``Z`` (``_stage_inputs`` without the input
    norm, the layer alone)."""
    one = dataclasses.replace(spec, input_norm=lambda V: V, layers=[ly])
    return _stage_inputs(one, Z)[2:5]


def _remainder_ascent(spec, ly, Z: torch.Tensor, r: float, seed: int, *, starts: int = 2, steps: int = 40):  # noqa: ANN001
    """(3, T) the largest ``||f(Z + E)_i - f(Z)_i - (f'(Z) E)_i||`` Adam finds over moves E with every row within
    ``r``, ``f`` each of ``_layer_outputs`` (the exact Jacobian at Z by autograd)."""
    T = Z.shape[0]
    base = [v.detach() for v in _layer_outputs(spec, ly, Z)]
    jac = [torch.autograd.functional.jacobian(lambda V, k=k: _layer_outputs(spec, ly, V)[k], Z) for k in range(3)]

    def value(E, V):  # noqa: ANN001, ANN202
        rows = []
        for s in range(E.shape[0]):
            row = []
            for k in range(3 * T):
                st, i = divmod(k, T)
                out = _layer_outputs(spec, ly, Z + E[s, k])[st][i]
                row.append((out - base[st][i] - torch.einsum("aij,ij->a", jac[st][i], E[s, k])).norm())
            rows.append(torch.stack(row))
        return torch.stack(rows)

    return torch.tensor(jvp_ascents(value, Z, r, [seed + k for k in range(3 * T)], starts=starts, steps=steps),
                        dtype=torch.float64).reshape(3, T)


def _bounds(rem: dict) -> torch.Tensor:
    """(3, T) the remainders F59b adds: ``remA``, ``remH``, ``remG`` plus the FFN's on the per-layer ball."""
    ffn = torch.minimum(rem["ffn_fixed"], rem["ffn_coef"] * rem["ffn_ball"])
    return torch.stack([rem["attention"], rem["norm_attn"], rem["ffn"] + ffn])


@pytest.mark.parametrize("case", CASES)
def test_exposed_remainders_hold_past_the_exact_linear_map(case):
    """The second layer at its input ``Z`` on ``B(Z, r)``: Adam's remainder of ``S1`` (centred), ``H`` and ``S2``
    (centred) past ``f'(Z)`` stays below ``stage_remainders``, which are finite and attained to a visible fraction."""
    spec, X, _, seed = _case(case)
    ly = spec.layers[1]
    Z = _stage_inputs(spec, X)[5].detach()
    r = 0.1 * float(Z.norm(dim=1).median())
    rem = layer_jacobians(ly, Z, [r])[0].stage_remainders
    bound = _bounds(rem)
    got = _remainder_ascent(spec, ly, Z, r, seed)
    assert bool(torch.isfinite(bound).all()), bound
    assert bool((got <= bound).all()), (got, bound)
    assert float((got / bound).max()) >= 1e-3, got / bound  # the attack is not idle


@pytest.mark.parametrize("case", CASES)
def test_stage_radii_are_never_beaten_and_not_above_without_f59b(case, monkeypatch):
    """Per sub-stage and token, Adam ascent of the stage input's move over the network's input ball stays below
    ``stack_local``'s radius with F59b; without it every radius is at least as large and some strictly larger (F59b
    binds on each case), the drift and bound never smaller."""
    spec, X, rho, seed = _case(case)
    new = stack_local(spec, X, [rho])[0]
    got = _moves_ascent(spec, X, rho, seed + 1000, steps=30)  # other draws than test_local_stack19's ascent
    rad = torch.stack(new.token_radii)
    assert bool((got <= rad).all()), (got, rad)
    _without_f59b(monkeypatch)
    old = stack_local(spec, X, [rho])[0]
    orad = torch.stack(old.token_radii)
    assert bool((rad <= orad).all()) and bool((rad < orad).any()), (rad, orad)
    assert new.upper <= old.upper and new.drift <= old.drift, (new.upper, old.upper)


@pytest.mark.parametrize("case", CASES)
def test_whole_network_is_never_beaten(case):
    """The whole network with F59b against pair-ratio and Jacobian-row ascent (``assert_network_below``)."""
    spec, X, rho, seed = _case(case)
    new = stack_local(spec, X, [rho])[0]
    assert math.isfinite(new.upper)
    assert_network_below(spec, X, rho, new, seed=seed)


def test_homogeneity_in_the_last_norm():
    """The last layer's second norm scaled by 2 (weight and bias, no final norm): every sub-stage radius before it
    (F59b's included) unchanged, the bound, point and drift x 2; the first norm's scale x 2 leaves ``remA`` as it is."""
    spec, X, rho, _ = _case(CASES[0])
    last = spec.layers[-1]
    n2 = last.norm_ffn
    scaled = dataclasses.replace(spec, layers=spec.layers[:-1] + [dataclasses.replace(
        last, norm_ffn=dataclasses.replace(n2, weight=2.0 * n2.weight, bias=2.0 * n2.bias))])
    a, b = stack_local(spec, X, [rho])[0], stack_local(scaled, X, [rho])[0]
    for ra, rb in zip(a.token_radii, b.token_radii):
        assert torch.equal(ra, rb)
    for name in ("upper", "point", "drift"):
        assert getattr(b, name) == pytest.approx(2.0 * getattr(a, name), rel=1e-9), name
    Z = _stage_inputs(spec, X)[5].detach()
    r = 0.05 * float(Z.norm(dim=1).median())
    n1 = last.norm_attn
    ly2 = dataclasses.replace(last, norm_attn=dataclasses.replace(n1, weight=2.0 * n1.weight, bias=2.0 * n1.bias))
    ra = layer_jacobians(last, Z, [r])[0].stage_remainders["attention"]
    assert torch.equal(ra, layer_jacobians(ly2, Z, [r])[0].stage_remainders["attention"])


@pytest.mark.slow
def test_minilm_first_layers_not_above_without_f59(monkeypatch):
    """MiniLM's first three layers (no final norm) on a real 7-token input at rho = 1e-4 x the median token norm: the
    bound with F59a and F59b is finite and not above the one without either, and layer 2's ``S2`` radius strictly
    below (each one's own gain is measured on the random stacks above and in docs/results/local_stack.md)."""
    from transcover.model import load
    from transcover.model._data import load_inputs

    spec = load(None).to_torch(torch.float64)
    spec = dataclasses.replace(spec, layers=spec.layers[:3], final_norm=None)
    X = load_inputs(spec, "sklearn-descr", max_len=32, limit=20)[14].double()
    rho = 1e-4 * float(X.norm(dim=1).median())
    new = stack_local(spec, X, [rho])[0]
    _without_f59b(monkeypatch)
    _without_f59(monkeypatch)
    old = stack_local(spec, X, [rho])[0]
    assert math.isfinite(new.upper) and new.upper <= old.upper and new.drift <= old.drift, (new.upper, old.upper)
    s2 = new.stage_names.index("layer 2 norm_ffn")
    assert float(new.token_radii[s2].max()) < float(old.token_radii[s2].max())
