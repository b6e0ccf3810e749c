"""F59: the whole network's sub-stage radii capped by the per-layer route's stage radii (THEORY F59).

Attacks: float64 Adam ascent (restarts) over the network's input ball of every sub-stage input's per-token move, never
above the radius ``stack_local`` certifies there, on random post-LN stacks and adversarial ones (sharp causal softmax,
tiny sigma with eps = 1e-12, saturated GELU); the whole network against pair-ratio and Jacobian-row ascent
(``assert_network_below``); without F59 the radii, the drift and the bound are never smaller (and the radii strictly
larger somewhere); homogeneity in the last norm's scale; MiniLM's first layers (slow).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import transcover.lipschitz._local_stack as ls
from lipschitz_testkit import jvp_ascents, last_norm_doubled, random_spec
from test_local_stack15 import assert_network_below
from transcover.lipschitz._local_stack import stack_local
from transcover.model import attention_forward, ffn_forward


def _stage_inputs(spec, Z: torch.Tensor) -> list:  # noqa: ANN001
    """The inputs of ``stack_local``'s sub-stages on the post-LN path (input norm, per layer the attention, first norm,
    FFN and second norm), each (T, d); a LayerNorm's input centred (all the norm stage reads, so what its radius
    bounds; THEORY F59a)."""
    out = [Z]
    Z = spec.input_norm(Z)
    for ly in spec.layers:
        S1 = Z + attention_forward(ly.attention, Z)
        H = ly.norm_attn(S1)
        S2 = H + ffn_forward(ly.ffn, H)
        out += [Z, S1 - S1.mean(dim=-1, keepdim=True), H, S2 - S2.mean(dim=-1, keepdim=True)]
        Z = ly.norm_ffn(S2)
    return out


def _moves_ascent(spec, X: torch.Tensor, rho: float, seed: int, *, starts: int = 2, steps: int = 50) -> torch.Tensor:  # noqa: ANN001
    """(stages, T) the largest ``||x_s(X + E)_i - x_s(X)_i||`` Adam finds over moves E with every row within rho,
    one ascent per (stage, token), all in one batch (``jvp_ascents``)."""
    base = [x.detach() for x in _stage_inputs(spec, X)]
    n, T = len(base), X.shape[0]

    kk = torch.arange(n * T)
    st, tok = kk // T, kk % T  # ascent k: stage st[k], token tok[k]
    ref = torch.stack(base)[st, tok]  # (n T, d)

    def value(E, V):  # noqa: ANN001, ANN202
        # every (start, ascent) pair's forward pass in one batch, entry (s, k) the stage input of ascent k at X + E[s, k]
        # (the per-pair loop's values, one _stage_inputs call per step instead of starts x n x T)
        moved = torch.stack(_stage_inputs(spec, X + E), dim=2)  # (starts, n T, stages, T, d)
        return (moved[:, kk, st, tok] - ref).norm(dim=-1)

    return torch.tensor(jvp_ascents(value, X, rho, [seed + k for k in range(n * T)], starts=starts,
                                    steps=steps), dtype=torch.float64).reshape(n, T)


def _without_f59(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(ls, "_stage_caps", lambda spec, stages, groups: {})


def _spec(seed: int, *, eps: float = 1e-5, qscale: float = 1.0, causal: bool = False, w1scale: float = 1.0, L: int = 2):
    spec = random_spec(seed, act="gelu", L=L, norm="layernorm", d=8, H=2, dh=4, dff=8, biases=True, placement="post",
                       eps=eps, causal=causal)
    return dataclasses.replace(spec, layers=[dataclasses.replace(
        ly, attention=dataclasses.replace(ly.attention, W_Q=qscale * ly.attention.W_Q),
        ffn=dataclasses.replace(ly.ffn, W_1=w1scale * ly.ffn.W_1)) for ly in spec.layers])


# radii where F59a binds (the stage radii of the second layer 0.001-0.99 x those without it)
CASES = [dict(seed=3, xscale=1.0, rho_frac=5e-3), dict(seed=5, eps=1e-12, xscale=0.05, rho_frac=5e-3),
         dict(seed=7, qscale=8.0, causal=True, xscale=1.0, rho_frac=5e-3),
         dict(seed=11, w1scale=6.0, xscale=1.0, rho_frac=3e-3)]


def _case(case: dict) -> tuple:
    case = dict(case)
    xscale, rho_frac, seed = case.pop("xscale"), case.pop("rho_frac"), case["seed"]
    spec = _spec(**case)
    X = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * xscale
    return spec, X, rho_frac * float(X.norm(dim=1).median()), seed


_CERTIFIED: dict = {}


def _certified(case: dict) -> tuple:
    """``_case(case)`` and its unpatched ``stack_local(spec, X, [rho])[0]`` (F59 on), computed once per case for the
    three tests that read it (each reads it before any patch of its own: the same call, the same floats)."""
    key = repr(case)
    if key not in _CERTIFIED:
        spec, X, rho, seed = _case(case)
        _CERTIFIED[key] = (spec, X, rho, seed, stack_local(spec, X, [rho])[0])
    return _CERTIFIED[key]


@pytest.mark.parametrize("case", CASES)
def test_stage_radii_are_never_beaten_and_not_above_without_f59(case, monkeypatch):
    """Per sub-stage and token, Adam ascent of the stage input's move (a LayerNorm's input centred) over the network's
    input ball stays below the radius ``stack_local`` certifies (random; tiny sigma, eps = 1e-12; sharp causal heads, W_Q x 8; saturated GELU,
    W_1 x 6); without F59 every radius is at least as large and some strictly larger (F59a binds)."""
    spec, X, rho, seed, new = _certified(case)
    got = _moves_ascent(spec, X, rho, seed)
    rad = torch.stack([r for r in new.token_radii])
    assert bool((got <= rad).all()), (got, rad)
    assert float((got / rad)[-3:].max()) >= 0.01, (got / rad)  # the capped stages move (the attack is not idle)
    _without_f59(monkeypatch)
    old = stack_local(spec, X, [rho])[0]
    orad = torch.stack([r for r in old.token_radii])
    assert bool((rad <= orad).all()) and bool((rad < orad).any()), (rad, orad)
    assert new.upper <= old.upper and new.drift <= old.drift, (new.upper, old.upper)


@pytest.mark.parametrize("case", CASES)
def test_whole_network_is_never_beaten(case):
    """The whole network with F59 against pair-ratio and Jacobian-row ascent (``assert_network_below``)."""
    spec, X, rho, seed, new = _certified(case)
    assert math.isfinite(new.upper)
    assert_network_below(spec, X, rho, new, seed=seed)


def test_homogeneity_in_the_last_norm():
    """The last layer's second norm scaled by 2 (weight and bias, no final norm): every sub-stage radius before it is
    unchanged (F59a's caps included) and the bound, point and drift double."""
    spec, X, rho, _, a = _certified(CASES[0])
    b = stack_local(last_norm_doubled(spec), X, [rho])[0]
    for ra, rb in zip(a.token_radii, b.token_radii):
        assert torch.equal(ra, rb)
    for name in ("upper", "point", "drift"):
        assert getattr(b, name) == pytest.approx(2.0 * getattr(a, name), rel=1e-9), name
