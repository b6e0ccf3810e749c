"""F71: the prefix's move outside its rows at X averaged along the segment over the run's radii (THEORY F71).

Attacks: float64 Adam (projected, starts on the sphere) over the network's input ball of the part of every sub-stage
input's move outside the prefix at X, ``e = x_s(X + E) - x_s(X) - P_s(X) E``, never above ``rho m`` (``segment_moves``'
rows) and of the move itself never above the stage radius, on post-LN and pre-LN GELU stacks (T = 1, 3, 5; tiny sigma
with eps = 1e-12; sharp causal heads; saturated GELU); the whole network below its bound (``assert_network_below``);
F71 off never tighter anywhere and looser somewhere; the rows' homogeneity; a radius alone never tighter than with a
smaller one beside it, and no radius reads a larger one's rows.
"""

from __future__ import annotations

import pytest
import torch

import transcover.lipschitz._local_stack as ls
from lipschitz_testkit import assert_stack_never_looser, jvp_ascents, last_norm_doubled, random_spec
from test_local_stack15 import assert_network_below
from test_local_stack19 import _spec
from transcover.lipschitz._local_stack import stack_local
from transcover.lipschitz._local_stack_segment import segment_moves, with_auxiliary
from transcover.model import attention_forward, ffn_forward

# (spec arguments, T, input scale, rho fraction of the median token norm): the segment binds at the largest radius
CASES = [(dict(seed=3, L=3), 3, 1.0, 1e-3), (dict(seed=5, eps=1e-12), 5, 0.05, 3e-3),
         (dict(seed=7, qscale=8.0, causal=True), 3, 1.0, 3e-3), (dict(seed=11, w1scale=6.0), 1, 1.0, 1e-2),
         (dict(seed=13, placement="pre"), 3, 1.0, 3e-3)]
FRACTIONS = (0.5,)  # the run's radii: these fractions of rho beside rho


def _case(case: tuple) -> tuple:
    kw, T, xscale, frac = case
    kw = dict(kw)
    if kw.pop("placement", "post") == "pre":
        spec = random_spec(kw["seed"], act="gelu", L=2, norm="layernorm", d=8, H=2, dh=4, dff=8, biases=True,
                           placement="pre", final_norm=True)
    else:
        spec = _spec(**kw)
    X = torch.randn(T, 8, generator=torch.Generator().manual_seed(kw["seed"]), dtype=torch.float64) * xscale
    rho = frac * float(X.norm(dim=1).median())
    return spec, X, [f * rho for f in FRACTIONS] + [rho], kw["seed"]


def _inputs(spec, Z: torch.Tensor) -> list:  # noqa: ANN001
    """The inputs of ``stack_local``'s sub-stages (uncentred), each (T, d): the input norm's, then per post-LN layer the
    attention's, first norm's, FFN's and second norm's, per pre-LN layer the attention block's and the FFN block's,
    then the final norm's."""
    out = [Z]
    Z = spec.input_norm(Z)
    for ly in spec.layers:
        if ly.placement.value == "pre":
            S = Z + attention_forward(ly.attention, ly.norm_attn(Z))
            out += [Z, S]
            Z = S + ffn_forward(ly.ffn, ly.norm_ffn(S))
        else:
            S1 = Z + attention_forward(ly.attention, Z)
            H = ly.norm_attn(S1)
            S2 = H + ffn_forward(ly.ffn, H)
            out += [Z, S1, H, S2]
            Z = ly.norm_ffn(S2)
    return out + ([Z] if spec.final_norm is not None else [])


def _captured(spec, X: torch.Tensor, rhos: list, monkeypatch) -> tuple:  # noqa: ANN001
    """``stack_local``'s results and, per sub-stage, F71's rows ``m`` per radius."""
    got = []

    def seg(dP, rs):  # noqa: ANN001, ANN202
        got.append(segment_moves(dP, rs))
        return got[-1]

    monkeypatch.setattr(ls, "segment_moves", seg)
    res = stack_local(spec, X, rhos)
    monkeypatch.undo()
    return res, got


def _attained(spec, X: torch.Tensor, rho: float, seed: int) -> tuple:  # noqa: ANN001
    """(stages, T) each: Adam's largest ``||e_i||`` (the move outside ``P_s(X) E``) and ``||x_s(X + E)_i - x_s(X)_i||``
    over moves E with every row within rho, one ascent per (quantity, stage, token), all in one batch."""
    base = torch.stack(_inputs(spec, X)).detach()
    n, T = base.shape[0], X.shape[0]
    k = torch.arange(2 * n * T)
    q, st, i = k // (n * T), (k % (n * T)) // T, k % T

    def value(E, V):  # noqa: ANN001, ANN202, ARG001
        f = lambda Z: torch.stack(_inputs(spec, Z), dim=-3)  # noqa: E731
        move = f(X + E) - base  # (starts, K, stages, T, d)
        lin = torch.autograd.functional.jvp(f, X.expand_as(E).contiguous(), E, create_graph=True)[1]
        both = torch.stack([move - lin, move])  # (2, starts, K, stages, T, d)
        return both[q, :, k, st, i].norm(dim=-1).T

    got = jvp_ascents(value, X, rho, [seed + j for j in range(2 * n * T)], starts=2, steps=5)
    return torch.tensor(got, dtype=torch.float64).reshape(2, n, T).unbind(0)


@pytest.mark.parametrize("case", [CASES[i] for i in (1, 4)])
def test_moves_are_never_beaten(case, monkeypatch):
    """Per sub-stage and token, Adam's largest part of the move outside the prefix at X stays below ``rho m`` (F71's
    rows at the largest radius, which the smaller radii's rows set) and the move below the certified radius."""
    spec, X, rhos, seed = _case(case)
    res, got = _captured(spec, X, rhos, monkeypatch)
    e, move = _attained(spec, X, rhos[-1], seed)
    m = torch.stack([g[-1] for g in got]) * rhos[-1]
    rad = torch.stack(res[-1].token_radii)
    assert len(got) == len(rad) == e.shape[0] and bool(torch.isfinite(rad).all())
    e, m = e[1:], m[1:]  # the input norm's input moves by E itself (e = 0; its float64 jvp within 1e-16)
    assert bool((e <= m).all()) and bool((move <= rad).all()), (e / m, move / rad)
    assert float((e / m).max()) >= 1e-3, e / m  # the attack is not idle


def test_whole_network_is_never_beaten_and_f71_never_looser():
    """Sharp causal heads: the whole network at the largest radius below its bound; with F71 off (``segment=False``)
    the bound, drift, every span drift row and radius at least as large and some prefix span row strictly larger, at
    the largest radius (at the smaller ones never smaller)."""
    spec, X, rhos, seed = _case(CASES[2])
    new = stack_local(spec, X, rhos)
    assert_network_below(spec, X, rhos[-1], new[-1], seed=seed)
    old = stack_local(spec, X, rhos, segment=False)
    assert_stack_never_looser(new[-1], old[-1])
    for a, b in zip(new, old):
        assert a.upper <= b.upper and all(bool((x <= y).all()) for x, y in zip(a.token_radii, b.token_radii))


def test_a_radius_alone_is_never_tighter():
    """Pre-LN: a run with ``[rho]`` alone against ``[rho / 10, rho]`` and ``[rho]`` with auxiliary radii: never tighter
    at rho (its segment reads the smaller radii's rows), looser somewhere than with the auxiliary ones, which are not
    reported; the smaller radius of the pair is the same floats as that radius alone (F71 reads no larger radius's rows;
    here the per-layer route's F37b, which lets a larger ball of one call refine a smaller, changes none either)."""
    spec, X, rhos, _ = _case(CASES[4])
    alone = stack_local(spec, X, [rhos[-1]])[0]
    pair = stack_local(spec, X, [rhos[-1] / 10, rhos[-1]])
    extra = stack_local(spec, X, [rhos[-1]], aux=(0.25, 0.5, 0.75))
    assert len(extra) == 1 and extra[0].rho == rhos[-1]
    for r in (pair[1], extra[0]):
        assert r.upper <= alone.upper and r.drift <= alone.drift
        assert all(bool((x <= y).all()) for x, y in zip(r.token_radii, alone.token_radii))
    assert any(bool((x < y).any()) for x, y in zip(extra[0].token_radii, alone.token_radii))
    small = stack_local(spec, X, [rhos[-1] / 10])[0]
    assert small.upper == pair[0].upper and all(torch.equal(x, y) for x, y in zip(small.token_radii, pair[0].token_radii))


def test_segment_moves_rows():
    """The right Riemann sum over the radii in increasing order (any order given), ``min`` with the radius's own rows,
    a larger radius's rows never read, a zero weight on an inf row ignored; degree 1 in the rows, degree 0 in the
    radii; ``with_auxiliary`` adds fractions of the largest radius only below it and keeps the user's positions."""
    dP = [torch.tensor([4.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([2.0, 8.0]), torch.tensor([9.0, 0.5])]
    rhos = [1.0, 0.25, 0.5, 1.0]
    m = segment_moves(dP, rhos)
    want = 0.25 * dP[1] + 0.25 * dP[2] + 0.5 * dP[0]  # the equal radius after it has weight 0
    assert torch.allclose(m[0], torch.minimum(dP[0], want), rtol=1e-11)
    assert torch.equal(m[1], dP[1]) and torch.allclose(m[2], torch.minimum(dP[2], 0.5 * dP[1] + 0.5 * dP[2]))
    big = [dP[0] + torch.inf, dP[1], dP[2], dP[3] * 1e9]
    assert torch.equal(segment_moves(big, rhos)[2], m[2]) and torch.equal(segment_moves(big, rhos)[1], m[1])
    assert all(bool(torch.isfinite(v).all()) for v in segment_moves(big, rhos)[1:3])
    for a, b in zip(segment_moves([v * 3 for v in dP], rhos), m):
        assert torch.allclose(a, 3 * b, rtol=1e-11)
    for a, b in zip(segment_moves(dP, [r * 1e-7 for r in rhos]), m):
        assert torch.allclose(a, b, rtol=1e-11)
    ext, keep = with_auxiliary([1e-4, 1e-6], (0.5, 0.0, 1.0, 2.0, 0.01))
    assert ext == [1e-4, 1e-6, 0.01 * 1e-4, 5e-5], ext
    assert keep == [0, 1]


def test_homogeneity_in_the_last_norm():
    """Saturated GELU, T = 1: the last layer's second norm scaled by 2 (no final norm): every radius unchanged (F71's
    rows read only the prefix before it), the bound, point and drift doubled, at every radius of the run (the sub-stage
    route alone, ``layer_route=False``: the layer route's rows do not enter F71's)."""
    spec, X, rhos, _ = _case(CASES[3])
    a, b = (stack_local(s, X, rhos, layer_route=False) for s in (spec, last_norm_doubled(spec)))
    for ra, rb in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(ra.token_radii, rb.token_radii))
        for name in ("upper", "point", "drift"):
            assert getattr(rb, name) == pytest.approx(2.0 * getattr(ra, name), rel=1e-9), name
