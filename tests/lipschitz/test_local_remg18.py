"""F55: the first norm's own remainder through ``(I + F) diag(gamma1)`` (``_local_remg``), attacked by Adam ascent on
the norm's remainder through a map and on the layer's remainder of S2's move, against the dense spectral norm,
homogeneity, and in ``layer_rows`` (never above the old ``remG``, stage radii held)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lipschitz_testkit import hetero_gamma, random_spec
from batched_projected_ascents import projected_adam_batched, sphere_adam_batched
from transcover.lipschitz._local_jacobian import GRAM_PAD, _norm_parts
from transcover.lipschitz._local_remg import gamma_free_norm_remainder, if_gamma_norm
from transcover.lipschitz._local_rows import _gamma_vec
from transcover.model import NormKind, NormSpec, attention_forward, ffn_forward


def _norm_case(seed: int, kind: str, gamma: str, eps: float, d: int = 7):  # noqa: ANN202
    """A LayerNorm/RMSNorm with a heterogeneous ``gamma``, a point x and a map M (standing in for ``I + F``)."""
    g = torch.Generator().manual_seed(seed)
    norm = NormSpec(NormKind.LAYERNORM if kind == "layernorm" else NormKind.RMSNORM, hetero_gamma(gamma, d, g),
                    0.1 * torch.randn(d, generator=g, dtype=torch.float64) if kind == "layernorm" else None, eps)
    x = torch.randn(1, d, generator=g, dtype=torch.float64) * 0.7 + 0.3
    M = torch.eye(d, dtype=torch.float64) + torch.randn(d, d, generator=g, dtype=torch.float64) * 0.8
    return norm, x, M


def _bound(norm, x: torch.Tensor, M: torch.Tensor, r: float) -> float:  # noqa: ANN001
    """F55a: ``||M diag(gamma)|| * (the norm's remainder with max|gamma| = 1)``."""
    d = x.shape[1]
    _, s, sig, _ = _norm_parts(norm, x)
    gmax = float(norm.weight.abs().max()) * (1 + 1e-9)
    nG = if_gamma_norm(M[None], torch.zeros(1, dtype=torch.float64), _gamma_vec(norm, d), gmax)
    return float(nG[0] * gamma_free_norm_remainder(norm, sig, s, torch.tensor([r], dtype=torch.float64), d)[0])


def _ascent(norm, x: torch.Tensor, M: torch.Tensor, r: float, seed: int, starts: int = 4, steps: int = 120) -> float:  # noqa: ANN001
    """Adam ascent (float64, projected, restarts incl. +- the point's centred direction) on ``||M(N(x + e) - N(x) -
    D(x) e)||`` over ``||e|| <= r``; the max with ``sphere_adam`` from the same starts (THEORY F57).  The starts in one
    batch (``batched_projected_ascents``: each start's own ascent, to rounding)."""
    N = lambda v: norm(v[None])[0]  # noqa: E731
    x0 = x[0]
    D = torch.autograd.functional.jacobian(N, x0)
    y0 = N(x0)
    g = torch.Generator().manual_seed(seed)
    c = x0 - x0.mean()
    starts_ = [((c if k == 0 else -c if k == 1 else torch.randn(x0.shape, generator=g, dtype=torch.float64))
                + 0.3 * torch.randn(x0.shape, generator=g, dtype=torch.float64) * c.norm(),) for k in range(starts)]
    starts_ = [(e0 * r / e0.norm(),) for (e0,) in starts_]
    rem = lambda E: ((norm(x0 + E) - y0 - E @ D.T) @ M.T).norm(dim=-1)  # noqa: E731  (S, d) -> (S,): each start's
    return max(float(projected_adam_batched(rem, starts_, (r,), 0.05 * r, steps).max()),
               float(sphere_adam_batched(rem, starts_, (r,), steps).max()))


@pytest.mark.parametrize("kind,gamma,eps,frac", [
    ("layernorm", "outlier", 1e-12, 0.3), ("layernorm", "negative", 1e-5, 0.6), ("layernorm", "tiny", 0.3, 0.3),
    ("rmsnorm", "outlier", 1e-6, 0.6), ("layernorm", "plain", 1e-12, 0.85)])
def test_norm_remainder_through_a_map_is_never_beaten(kind, gamma, eps, frac):
    """Adam ascent on ``||M(N(x + e) - N(x) - D e)||`` stays below F55a's bound, from small radii to ``frac`` of the
    floor ``sqrt(d) sigma`` (the sphere's and the drift's forms both near their poles), heterogeneous gamma (outliers
    x10, tiny, signed), LayerNorm and RMSNorm; the bound is finite and the ascent reaches a tenth of it at 0.3."""
    norm, x, M = _norm_case(3, kind, gamma, eps)
    _, s, _, _ = _norm_parts(norm, x)
    for f in (0.05, 0.3, frac):
        r = f * math.sqrt(x.shape[1]) * float(s[0])
        bound, got = _bound(norm, x, M, r), _ascent(norm, x, M, r, 0)
        assert math.isfinite(bound) and got <= bound, (f, got, bound)
        if f == 0.3:
            assert got >= 0.1 * bound, (got, bound)


def test_gamma_map_norm_matches_the_dense_norm_and_scales():
    """``if_gamma_norm`` against ``matrix_norm(ord=2)`` of the product (above it, within ``certified_spectral``'s
    pad ``GRAM_PAD^{1/2} ||.||_F`` and 1e-6; ``eF g`` added), linear in the map and in gamma (1e-9); the gamma-free remainder does not see gamma and is second order in
    the radius (r / 8: at most 1/64 + 2 % of it)."""
    g = torch.Generator().manual_seed(1)
    A = torch.randn(3, 40, 40, generator=g, dtype=torch.float64) + torch.eye(40, dtype=torch.float64)
    gam = hetero_gamma("outlier", 40, g).abs()
    ref = torch.linalg.matrix_norm(A * gam[None, None, :], ord=2)
    got = if_gamma_norm(A, torch.zeros(3, dtype=torch.float64), gam, float(gam.max()))
    fro = (A * gam[None, None, :]).norm(dim=(1, 2))  # certified_spectral's pad: GRAM_PAD of the Frobenius mass
    assert bool((ref <= got).all()) and bool((got <= ref * (1 + 1e-6) + 1.01 * math.sqrt(GRAM_PAD) * fro).all())
    eF = torch.tensor([1e-3, 0.0, 2e-3], dtype=torch.float64)
    withe = if_gamma_norm(A, eF, gam, float(gam.max()))
    assert bool((withe >= ref + eF * float(gam.max())).all())
    for c in (0.25, 3.0):
        assert torch.allclose(if_gamma_norm(A * c, torch.zeros(3, dtype=torch.float64), gam, 1.0), c * got, rtol=1e-9)
        assert torch.allclose(if_gamma_norm(A, torch.zeros(3, dtype=torch.float64), gam * c, 1.0), c * got, rtol=1e-9)
    norm, x, _ = _norm_case(2, "layernorm", "outlier", 1e-6)
    _, s, sig, _ = _norm_parts(norm, x)
    r = torch.tensor([0.2, 0.025], dtype=torch.float64) * math.sqrt(7) * float(s[0])
    a = gamma_free_norm_remainder(norm, sig.expand(2), s.expand(2), r, 7)
    b = gamma_free_norm_remainder(dataclasses.replace(norm, weight=norm.weight * 5), sig.expand(2), s.expand(2), r, 7)
    assert torch.equal(a, b) and float(a[1]) <= float(a[0]) / 64 * 1.02


def _post_layer(gamma: str, seed: int, causal: bool, sharp: float, eps: float):  # noqa: ANN202
    """A small post-LN GELU layer (d 8) with the first norm's gamma made heterogeneous, ``W_Q x sharp`` and a tiny eps
    option (sigma near the floor)."""
    layer = random_spec(seed, act="gelu", norm="layernorm", placement="post", d=8, H=2, dh=4, dff=32, biases=True,
                        causal=causal, scale=1.5, eps=eps).layers[0]
    g = torch.Generator().manual_seed(seed)
    attn = dataclasses.replace(layer.attention, W_Q=layer.attention.W_Q * sharp)
    n1 = dataclasses.replace(layer.norm_attn, weight=hetero_gamma(gamma, 8, g))
    return dataclasses.replace(layer, attention=attn, norm_attn=n1)


def _remg_parts(layer, X: torch.Tensor, i: int) -> tuple:  # noqa: ANN001
    """For token i of a post-LN layer: ``S1f`` (``Y -> Y + Attn(Y)``), ``S1(X)``, ``H = LN1(S1)``, ``I + F_i``,
    ``M = (I + F_i) D1_i`` and row i of the sublayer's Jacobian at X, ``B_i`` (d, T, d)."""
    jac = lambda f, x: torch.autograd.functional.jacobian(f, x, vectorize=True)  # noqa: E731
    S1f = lambda Y: Y + attention_forward(layer.attention, Y)  # noqa: E731
    S1 = S1f(X)
    H = layer.norm_attn(S1)
    IF = torch.eye(X.shape[1], dtype=torch.float64) + jac(lambda h: ffn_forward(layer.ffn, h[None])[0], H[i])
    MD1 = IF @ jac(lambda s: layer.norm_attn(s[None])[0], S1[i])
    Bi = jac(lambda Y: S1f(Y)[i], X)
    return S1f, S1, H, IF, MD1, Bi


def remg_maps(layer, X: torch.Tensor, i: int) -> tuple:  # noqa: ANN001
    """For token i of a post-LN layer: ``E -> ||(I + F_i)(LN1(S1(X + E)) - LN1(S1(X)) - D1 B E)_i||`` (what ``remG``
    bounds), ``S1(X)``, ``M = (I + F_i) D1_i`` and row i of the sublayer's Jacobian at X, ``B_i`` (d, T, d)."""
    S1f, S1, H, IF, MD1, Bi = _remg_parts(layer, X, i)
    rem = lambda E: (IF @ (layer.norm_attn(S1f(X + E)[i:i + 1])[0] - H[i]) - MD1 @ torch.einsum("atb,tb->a", Bi, E)).norm()  # noqa: E731
    return rem, S1, MD1, Bi


def _remainder_ascents(layer, X: torch.Tensor, r: float, tokens: list, seed: int, starts: int = 3,  # noqa: ANN001
                       steps: int = 80) -> list:
    """Per token i of ``tokens``, Adam ascent on ``remg_maps``' quantity over ``||E_j|| <= r`` (what ``remG`` bounds),
    float64, projected, from ``starts`` draws of a generator seeded ``seed``; the max with ``sphere_adam`` from the same
    starts (THEORY F57).  Every (token, start) ascent one slice of one batch (``batched_projected_ascents``: each its own ascent, to
    rounding; ``remg_maps``' objective, the token's row of the batch)."""
    parts = [_remg_parts(layer, X, i) for i in tokens]
    S1f, H = parts[0][0], parts[0][2]
    IF, MD1, B = (torch.stack([p[k] for p in parts]) for k in (3, 4, 5))
    g = torch.Generator().manual_seed(seed)
    one = [(torch.randn(X.shape, generator=g, dtype=torch.float64) * r,) for _ in range(starts)]
    n = len(tokens)
    tok = torch.tensor(tokens).repeat_interleave(starts)  # slice b: token tokens[b // starts], start b % starts
    rows = torch.arange(n * starts)
    own = torch.arange(n).repeat_interleave(starts)

    def rem(E: torch.Tensor) -> torch.Tensor:  # (n starts, T, d) -> (n starts,)
        dN = layer.norm_attn(S1f(X + E)[rows, tok]) - H[tok]
        lin = torch.einsum("bac,bc->ba", MD1[own], torch.einsum("batc,btc->ba", B[own], E))
        return (torch.einsum("bac,bc->ba", IF[own], dN) - lin).norm(dim=-1)

    starts_ = one * n
    best = torch.maximum(projected_adam_batched(rem, starts_, (r,), 0.1 * r, steps),
                         sphere_adam_batched(rem, starts_, (r,), steps))
    return best.reshape(n, starts).amax(dim=1).tolist()


def _rows_on_off(monkeypatch, layer, X: torch.Tensor, r: float):  # noqa: ANN001, ANN202
    """``layer_rows`` with and without F55a, and the ``remG`` each saw at the full radius (read where F54 gets it)."""
    from transcover.lipschitz import _local_stages
    from transcover.lipschitz._local_rows import layer_rows

    out = []
    for on in (True, False):
        seen = []
        plain = _local_stages.ffn_reach
        with monkeypatch.context() as m:
            m.setattr(_local_stages, "ffn_reach", lambda at, pt, gram, fn, *a: seen.append(fn.remG) or plain(at, pt, gram, fn, *a))
            if not on:
                m.setattr(_local_stages, "remg_gamma", lambda at, *a: torch.full((at.T,), math.inf, dtype=torch.float64))
            out.append((layer_rows(layer, X, [r])[0], seen[-1]))
    return out


@pytest.mark.parametrize("gamma,seed,causal,sharp,eps,frac", [
    ("outlier", 7, False, 1.0, 0.05, 0.01), ("negative", 5, True, 6.0, 1e-6, 0.04), ("tiny", 3, False, 1.0, 1e-6, 0.01)])
def test_layer_remainder_and_stage_radii_hold(monkeypatch, gamma, seed, causal, sharp, eps, frac):
    """Small post-LN layers (heterogeneous gamma1, sharp softmax W_Q x 6 with a causal mask, tiny eps; the radius
    ``frac`` of the smallest centred S1, at 0.04 some tokens' first-norm floor nearly lost): per token, Adam ascent on
    the remainder of S2's move through ``(I + F) D1`` stays below the certified ``remG`` with F55a (it reaches 0.3-0.6
    of it on the closest tokens); every token's ``remG``, FFN stage radius and the ball at most without it, F55a
    strictly lower somewhere; and ascent on each stage's move stays below the stage radii."""
    from test_local_sharp import assert_stage_radii_hold

    layer = _post_layer(gamma, seed, causal, sharp, eps)
    X = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    S1 = X + attention_forward(layer.attention, X)
    r = frac * float((S1 - S1.mean(dim=1, keepdim=True)).norm(dim=1).min())
    (on, remG), (off, remG0) = _rows_on_off(monkeypatch, layer, X, r)
    assert bool((remG <= remG0).all()) and bool((remG < remG0).any()), (remG, remG0)
    assert bool((on.stage_radii["ffn"] <= off.stage_radii["ffn"]).all()) and on.ball <= off.ball
    for i, got in enumerate(_remainder_ascents(layer, X, r, list(range(X.shape[0])), seed)):
        assert got <= float(remG[i]), (i, got, float(remG[i]))
    assert_stage_radii_hold(layer, X, [r])


@pytest.mark.slow
def test_minilm_remg_never_above_old(monkeypatch):
    """Real MiniLM layer 1, one real sentence cut to T = 7, rho = 1e-2: every token's ``remG``, FFN stage radius and the
    ball with F55a at most without it, its largest ``remG`` at least 1.4x lower (``||(I + F) diag(gamma1)||`` is 0.41-0.45
    of ``||I + F|| max|gamma1|`` on MiniLM), and Adam ascent on the largest token's remainder below the new ``remG``.
    At 7 tokens as at 12: the largest ``remG`` 1.55x lower (1.46x at 12), the ball the same with and without F55a (a
    floor lost at 1e-2); the two ``layer_rows`` and the ascent 14.5 s CPU instead of 19 s."""
    from transcover.model import load
    from transcover.model._data import load_inputs
    from transcover.model._functional import layer_forward

    spec = load(None).to_torch(torch.float64)
    X = spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=7, limit=2)[1].double())
    X = layer_forward(spec.layers[0], X)
    L = spec.layers[1]
    r = 1e-2 * float(X.norm(dim=1).median())
    (on, remG), (off, remG0) = _rows_on_off(monkeypatch, L, X, r)
    assert bool((remG <= remG0).all()) and float(remG.max()) * 1.4 <= float(remG0.max()), (remG, remG0)
    assert bool((on.stage_radii["ffn"] <= off.stage_radii["ffn"]).all()) and on.ball <= off.ball
    i = int(remG.argmax())
    assert _remainder_ascents(L, X, r, [i], 0, starts=2, steps=40)[0] <= float(remG[i])
