"""Red team (red19b) of F58a (``nested_beta``) and F59a (the stack route's stage caps).

F58a: the per-unit weight against the attained ``|e(s)/s^2 - GELU''(z*)/2|`` (float64 closed form with its rounding
bound subtracted, or mpmath at small reaches) on a dense dyadic sweep of centres (so the t-piece/|s|-bin cuts land on
GELU'''s extrema 0, +-2 and zeros), GELU''''s extrema, reaches 1e-8 .. 50 and a pre-activation error 1e-3 with the exact
centre at either end.  F59a: float64 Adam (sphere ascent and projected, restarts) over the network's input ball of every
sub-stage input's (centred where a LayerNorm reads it) move against ``stack_local``'s capped radius on random small
post-LN stacks where the caps bind (T = 1, 3 layers, heterogeneous gamma, sharp causal, tiny sigma with eps 1e-12,
saturated GELU, rho 1e-6 .. 1e-1 of the token norm); the caps refused for RMSNorm and pre-LN.
"""

from __future__ import annotations

import dataclasses
import math

import mpmath
import pytest
import torch

import transcover.lipschitz._local_stack as ls
from lipschitz_testkit import hetero_gamma, random_spec
from test_local_stack15 import assert_network_below
from batched_projected_ascents import moves_ascent, sphere_moves
from transcover.lipschitz._local_ffn2 import centre_gelu2_err
from transcover.lipschitz._local_ffn_reach import gelu2_range, nested_beta
from transcover.lipschitz._local_jacobian import GELU2_ABS_ERR, gelu_second
from transcover.lipschitz._local_stack import stack_local
from transcover.model import attention_forward, ffn_forward

F64 = torch.float64
_U = 2.0**-53
# dyadic centres -6 .. 6 in steps 1/32 (cut points z + t_j S_m land on 0, +-2 for dyadic R), GELU''''s zeros and
# GELU'''s extrema (irrational)
_SPECIAL = (math.sqrt(2), -math.sqrt(2), 0.7922876485147344, -0.7922876485147344, 2.524257372700608,
            -2.524257372700608)
_Z = torch.cat([torch.arange(-192, 193, dtype=F64) / 32, torch.tensor(_SPECIAL, dtype=F64)])


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * torch.special.erfc(-x / math.sqrt(2))


def _attained(zs: torch.Tensor, R: float, n: int = 1500) -> torch.Tensor:
    """Per exact centre, ``max |e(s)/s^2 - GELU''(z*)/2|`` over ``n`` points ``|s| = R k/n`` a side (float64 closed form,
    erfc: each GELU within a few ulps), minus a bound on its rounding ``16u(|G(z+s)| + |G(z)| + |G'(z)s|)/s^2 +
    4u|GELU''|`` (so every value is attained, to rounding, from below)."""
    s = torch.cat([torch.arange(1, n + 1, dtype=F64), -torch.arange(1, n + 1, dtype=F64)]) * (R / n)
    z = zs[:, None]
    g0 = _gelu(z)
    g1 = 0.5 * torch.special.erfc(-z / math.sqrt(2)) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    g2 = gelu_second(z)
    gz = _gelu(z + s)
    val = ((gz - g0 - g1 * s) / (s * s) - g2 / 2).abs()
    err = 16 * _U * (gz.abs() + g0.abs() + (g1 * s).abs()) / (s * s) + 4 * _U * g2.abs() + GELU2_ABS_ERR
    return (val - err).amax(dim=1)


@pytest.mark.parametrize("R", [0.05, 0.125, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 2.2, 3.0, 4.0, 6.0, 8.0, 10.0, 16.0, 32.0, 50.0])
def test_nested_beta_dense_sweep(R):
    """On 391 centres (dyadic sweep -6 .. 6 and GELU''/GELU''' critical points) ``nested_beta`` is never below the
    attained weight (closed form, rounding subtracted), with and without a pre-activation error ``ez = 1e-3`` (the
    exact centre at ``z - ez`` and ``z + ez``, reach ``R``; the certified reach ``R + ez``, ``eD = centre_gelu2_err``),
    and never above F54b's range weight by more than the pads."""
    got = nested_beta(_Z, torch.full_like(_Z, R), 0.0, GELU2_ABS_ERR)
    att = _attained(_Z, R)
    assert bool((att <= got).all()), (R, float((att - got).max()), float(_Z[(att - got).argmax()]))
    lo, hi = gelu2_range(_Z - R, _Z + R)
    d0 = gelu_second(_Z)
    old = torch.maximum(hi - d0, d0 - lo) / 2 + GELU2_ABS_ERR
    assert bool((got <= old * (1 + 1e-9) + 1e-14).all())
    ez = 1e-3
    eD = torch.as_tensor(centre_gelu2_err(torch.full_like(_Z, ez)))
    gez = nested_beta(_Z, torch.full_like(_Z, R + ez), torch.full_like(_Z, ez), eD)
    for zs in (_Z - ez, _Z + ez):
        assert bool((_attained(zs, R, 600) <= gez).all()), R
    ratio = float((att / got).max())
    assert ratio > 0.5, ratio  # the attack reaches the bound's scale (not idle)


def _exact_small(z0: float, R: float) -> float:
    """mpmath (50 digits) ``max |e(s)/s^2 - GELU''(z0)/2|`` on 12 points a side, ``|s| <= R`` (tiny reaches, where the
    float64 closed form cancels)."""
    mpmath.mp.dps = 50
    z = mpmath.mpf(z0)
    phi = lambda x: mpmath.exp(-x * x / 2) / mpmath.sqrt(2 * mpmath.pi)  # noqa: E731
    sig = lambda x: x * mpmath.ncdf(x)  # noqa: E731
    g1, g2 = mpmath.ncdf(z) + z * phi(z), phi(z) * (2 - z * z)
    best = mpmath.mpf(0)
    for k in range(1, 13):
        for s in (mpmath.mpf(R) * k / 12, -mpmath.mpf(R) * k / 12):
            best = max(best, abs((sig(z + s) - sig(z) - g1 * s) / (s * s) - g2 / 2))
    return float(best)


def test_nested_beta_tiny_reaches_exact():
    """Reaches 1e-8 .. 1e-2 at the critical centres, the dyadic 2 - 2^-k (a cut on the trough) and one saturated:
    mpmath's exact weight never above ``nested_beta`` (there it is ~ |GELU'''| R / 6, the pads' scale at 1e-8)."""
    for z0 in (0.0, 2.0, -2.0, 2 - 2.0**-10) + _SPECIAL + (5.0, -7.5):
        for R in (1e-8, 1e-6, 1e-4, 1e-2):
            got = float(nested_beta(torch.tensor([z0], dtype=F64), torch.tensor([R], dtype=F64), 0.0,
                                    GELU2_ABS_ERR)[0])
            assert _exact_small(z0, R) <= got, (z0, R)


# -- F59a: the stack route's stage caps -------------------------------------------------------------------------------

def _stack_spec(seed: int, *, eps: float = 1e-5, qscale: float = 1.0, causal: bool = False, w1scale: float = 1.0,
                gamma: str | None = None, norm: str = "layernorm", placement: str = "post"):  # noqa: ANN202
    """A random 3-layer GELU stack (d = 8, biases), ``W_Q x qscale``, ``W_1 x w1scale``, every layer norm's gamma
    ``hetero_gamma(gamma)`` when given."""
    spec = random_spec(seed, act="gelu", L=3, norm=norm, d=8, H=2, dh=4, dff=8, biases=True, placement=placement,
                       eps=eps, causal=causal)
    g = torch.Generator().manual_seed(seed + 100)
    nm = lambda n: n if gamma is None else dataclasses.replace(n, weight=hetero_gamma(gamma, 8, g))  # noqa: E731
    return dataclasses.replace(spec, layers=[dataclasses.replace(
        ly, attention=dataclasses.replace(ly.attention, W_Q=qscale * ly.attention.W_Q),
        ffn=dataclasses.replace(ly.ffn, W_1=w1scale * ly.ffn.W_1), norm_attn=nm(ly.norm_attn),
        norm_ffn=nm(ly.norm_ffn)) for ly in spec.layers])


def _sphere_moves(spec, X: torch.Tensor, rho: float, seed: int, *, starts: int = 3, steps: int = 30) -> torch.Tensor:  # noqa: ANN001
    """(stages, T) per sub-stage input (a LayerNorm's centred, ``_stage_inputs``) the largest per-token move the sphere
    ascent (``sphere_ascent``: every input row on the sphere of radius rho) finds, one ascent per stage (the stages'
    ascents in one batch, ``batched_projected_ascents.sphere_moves``: the same draws from one generator, stage after stage)."""
    return sphere_moves(spec, X, rho, seed, starts=starts, steps=steps)


# (case, T, rho / median token norm): each binds (some capped radius below the one without F59a)
STACK_CASES = [(dict(seed=11, w1scale=6.0), 1, 1e-2), (dict(seed=17, gamma="tiny"), 3, 1e-2), (dict(seed=7, qscale=8.0, causal=True), 3, 1e-3),
               (dict(seed=5, eps=1e-12), 1, 1e-2)]


@pytest.mark.parametrize("case,T,frac", STACK_CASES)
def test_capped_radii_and_network_never_beaten(case, T, frac, monkeypatch):
    """3-layer post-LN stacks where the caps bind (saturated GELU and T = 1; negative / tiny gamma; sharp causal heads;
    tiny sigma with eps = 1e-12): the sphere and the projected ascent (``_moves_ascent``) of every sub-stage input's
    move over the network's input ball stay below ``stack_local``'s radius, the whole network below its bound
    (``assert_network_below``), and without F59a some radius is strictly larger."""
    spec = _stack_spec(**case)
    X = torch.randn(T, 8, generator=torch.Generator().manual_seed(case["seed"]), dtype=F64) * (0.05 if "eps" in case else 1.0)
    rho = frac * float(X.norm(dim=1).median())
    new = stack_local(spec, X, [rho])[0]
    rad = torch.stack(list(new.token_radii))
    got = torch.maximum(_sphere_moves(spec, X, rho, case["seed"]),
                        moves_ascent(spec, X, rho, case["seed"], starts=1, steps=20))
    assert bool((got <= rad).all()), (got / rad)
    capped = [k for k in range(2, rad.shape[0]) if k % 4 != 1]  # each layer's S1, H, S2 (stages 0, 1: X, input norm)
    assert float((got / rad)[capped].max()) >= 0.5, (got / rad)  # the attack reaches the capped radii's scale
    assert math.isfinite(new.upper)
    assert_network_below(spec, X, rho, new, seed=case["seed"])
    monkeypatch.setattr(ls, "_stage_caps", lambda spec, stages, groups: {})
    old = torch.stack(list(stack_local(spec, X, [rho])[0].token_radii))
    assert bool((rad <= old).all()) and bool((rad < old).any())


@pytest.mark.parametrize("norm,placement,caps", [("rmsnorm", "post", False), ("layernorm", "pre", False),
                                                 ("layernorm", "post", True)])
def test_caps_only_for_post_layernorm(norm, placement, caps, monkeypatch):
    """``_stage_caps`` gives caps only where both norms of a post-LN layer are LayerNorms (centring: RMSNorm reads the
    uncentred move, a pre-LN layer's stage radii are not its norms' inputs'); the post-LN LayerNorm stack has them."""
    seen = []
    orig = ls._stage_caps
    monkeypatch.setattr(ls, "_stage_caps", lambda *a: seen.append(orig(*a)) or seen[-1])
    spec = _stack_spec(3, norm=norm, placement=placement)
    X = torch.randn(2, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    stack_local(spec, X, [1e-3])
    assert len(seen) == 1 and bool(seen[0]) == caps, seen


def test_caps_measured_from_the_stacks_own_centres():
    """The per-layer route measures its stage radii from ``S1 = x + Attn(x)``, ``H = LN1(S1)``, ``S2 = H + F(H)`` at the
    stack's own layer input ``x`` (``layer_at_x``): bit for bit the stack's sub-stage centres (tiny sigma with eps
    1e-12, tiny gamma, sharp causal heads), so the caps need no centre pad beyond the stack's own."""
    for case in (dict(seed=5, eps=1e-12), dict(seed=17, gamma="tiny"), dict(seed=7, qscale=8.0, causal=True)):
        spec = _stack_spec(**case)
        X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), dtype=F64) * 0.05
        stages, _, groups = ls._stages(spec, X)
        for ly in spec.layers:
            a = groups[ly.index][0]
            S1 = stages[a].x + attention_forward(ly.attention, stages[a].x)
            H = ly.norm_attn(S1)
            for k, u in ((1, S1), (2, H), (3, H + ffn_forward(ly.ffn, H))):
                assert torch.equal(u, stages[a + k].x), (case, ly.index, k)
