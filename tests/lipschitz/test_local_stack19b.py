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

import pytest
import torch

import transcover.lipschitz._local_stack as ls
from lipschitz_testkit import jvp_ascents
from batched_projected_ascents import moves_ascent
from test_local_stack19 import CASES, _case, _stage_inputs
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

    J = torch.stack(jac)  # (3, T, d, T, d)
    kk = torch.arange(3 * T)
    st, i = kk // T, kk % T

    def value(E, V):  # noqa: ANN001, ANN202, ARG001
        # every (start, ascent) in one batch: entry (s, k) is stage st_k's token i_k at Z + E[s, k] alone
        outs = torch.stack(_layer_outputs(spec, ly, Z + E))  # (3, S, K, T, d)
        lin = torch.einsum("kaij,skij->ska", J[st, i], E)
        return (outs[st, :, kk, i].transpose(0, 1) - torch.stack(base)[st, i] - lin).norm(dim=-1)

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
    got = moves_ascent(spec, X, rho, seed + 1000, steps=30)  # other draws than test_local_stack19's ascent
    rad = torch.stack(new.token_radii)
    assert bool((got <= rad).all()), (got, rad)
    _without_f59b(monkeypatch)
    old = stack_local(spec, X, [rho])[0]
    orad = torch.stack(old.token_radii)
    assert bool((rad <= orad).all()) and bool((rad < orad).any()), (rad, orad)
    assert new.upper <= old.upper and new.drift <= old.drift, (new.upper, old.upper)


def test_first_norm_scale_leaves_the_attention_remainder():
    """The attention remainder ``remA`` that F59b adds to the stack's first-order ``S1`` radius does not see the first
    norm: its weight and bias x 2 leave it unchanged (the last norm's scaling: test_local_stack19, with F59b in)."""
    spec, X, _, _ = _case(CASES[0])
    last = spec.layers[-1]
    Z = _stage_inputs(spec, X)[5].detach()
    r = 0.05 * float(Z.norm(dim=1).median())
    n1 = last.norm_attn
    ly2 = dataclasses.replace(last, norm_attn=dataclasses.replace(n1, weight=2.0 * n1.weight, bias=2.0 * n1.bias))
    ra = layer_jacobians(last, Z, [r])[0].stage_remainders["attention"]
    assert torch.equal(ra, layer_jacobians(ly2, Z, [r])[0].stage_remainders["attention"])
