"""Red team, issue 12 stop 15 (THEORY F17f): the LayerNorm/RMSNorm Jacobian every route forms from the computed
centring and scale, against the exact Jacobian of the same float64 token.

Finding red15-1 (main at 452617e): the deviation was padded relatively, ``4 (d + 9) u ||D_hat||_F`` (``NormJac.err``)
or ``4 (d + 8) u ||D_hat||_F`` (the formed ``_norm_parts`` / ``_norm_jacobians``), as if ``u`` and ``s`` were
relatively accurate and ``||D_hat||_F ~ max|a|``.  A one-hot token with a spiky gain (``x = c e_k``, ``gamma_k = 1``,
the others 1e-30 or 1e-8) has ``(I - Q Q^T) e_k ~ 0``, so ``||D_hat||_F << gamma_k/s`` while the error is
``~ gamma_k/s ||u_hat - u*||``: ``NormJac.err`` was beaten 3e5-2e6 times, and ``layer_local`` (both its Jacobian
route and the rows route) certified ``||J(X)||`` 4.8 times below the exact value on a one-layer model whose only
non-trivial map is such a norm (``test_layer_local_is_not_beaten_on_a_spiky_norm``).  ``norm_jacobian_error`` bounds
the deviation from the centring and scaling errors (absolute, F17e), and every route adds it.

The exact Jacobian is formed in rationals / mpmath (80 digits) from the same floats; the spectral norm of the
(exactly formed, then rounded) difference is computed in float64 and taken ``1e-10`` high.
"""

from __future__ import annotations

from fractions import Fraction

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover.lipschitz._local import layer_local
from transcover.lipschitz._local_jacobian import _norm_parts, norm_jacobian_error
from transcover.lipschitz._local_stack import stack_local
from transcover.lipschitz._local_struct import NormJac
from transcover.model import (
    Activation, AttentionSpec, FFNSpec, LayerSpec, NormKind, NormSpec, Placement, TransformerSpec,
)

mpmath.mp.dps = 80
_U = 2.0**-53


def _mp(F: Fraction):
    return mpmath.mpf(F.numerator) / F.denominator


def _exact_D(x: list, g: list, eps: float, lay: bool) -> list:
    """The exact ``diag(gamma)(P - u u^T)/s`` at the stored floats (``P = I`` for RMSNorm), mpmath rows."""
    d = len(x)
    xs = [Fraction(v) for v in x]
    m = sum(xs, Fraction(0)) / d if lay else Fraction(0)
    px = [v - m for v in xs]
    s = mpmath.sqrt(_mp(sum((p * p for p in px), Fraction(0)) / d) + _mp(Fraction(eps)))
    u = [_mp(p) / (mpmath.sqrt(d) * s) for p in px]
    c = mpmath.mpf(1) / d if lay else 0
    return [[mpmath.mpf(g[i]) * ((1 if i == j else 0) - c - u[i] * u[j]) / s for j in range(d)] for i in range(d)]


def _spectral_gap(A: list, B: list) -> float:
    """``||A - B||_2`` (mpmath rows), the difference formed exactly and its norm taken 1e-10 high."""
    E = torch.tensor([[float(a - b) for a, b in zip(ra, rb)] for ra, rb in zip(A, B)], dtype=torch.float64)
    return float(torch.linalg.matrix_norm(E, 2)) * (1 + 1e-10)


def _deviations(x: list, g: list, eps: float, lay: bool) -> tuple[float, float, float, float]:
    """(factored deviation, ``NormJac.err``, formed deviation, ``norm_jacobian_error(formed=True)``) at one token."""
    d = len(x)
    norm = NormSpec(NormKind.LAYERNORM if lay else NormKind.RMSNORM, torch.tensor(g, dtype=torch.float64), None, eps)
    X = torch.tensor([x], dtype=torch.float64)
    exact = _exact_D(x, g, eps, lay)
    nj = NormJac(norm, X)
    a, Q = nj.a[0].tolist(), nj.Q[0].tolist()
    fact = [[mpmath.mpf(a[i]) * ((1 if i == j else 0) - mpmath.fsum(mpmath.mpf(Q[i][c]) * mpmath.mpf(Q[j][c])
                                                                      for c in range(len(Q[i]))))
             for j in range(d)] for i in range(d)]
    D = _norm_parts(norm, X)[0][0].tolist()
    formed = [[mpmath.mpf(v) for v in row] for row in D]
    return (_spectral_gap(fact, exact), float(nj.err[0]), _spectral_gap(formed, exact),
            float(norm_jacobian_error(norm, X, formed=True)[0]))


def _spiky(d: int, k: int, small: float) -> list:
    g = [small] * d
    g[k] = 1.0
    return g


def _one_hot(d: int, k: int, c: float) -> list:
    x = [0.0] * d
    x[k] = c
    return x


CASES = [  # (name, x, gamma, eps, LayerNorm)
    ("one-hot, gamma 1e-8 elsewhere, eps 1e-12", _one_hot(8, 2, 1.0), _spiky(8, 2, 1e-8), 1e-12, True),
    ("one-hot, gamma 1e-3 elsewhere, eps 1e-12", _one_hot(8, 2, 1.0), _spiky(8, 2, 1e-3), 1e-12, True),
    ("one-hot, eps 0", _one_hot(8, 2, 1.0), _spiky(8, 2, 1e-8), 0.0, True),
    ("one-hot, large, eps 1e-12", _one_hot(8, 2, 1e3), _spiky(8, 2, 1e-8), 1e-12, True),
    ("one-hot plus 1e-9 ramp", [1e-9 * (i - 3) for i in range(2)] + [1.0] + [1e-9 * (i - 3) for i in range(3, 8)],
     _spiky(8, 2, 1e-8), 1e-12, True),
    ("one-hot, eps 6u sigma^2", _one_hot(4, 2, 2.3e-6), _spiky(4, 2, 1e-30), 6 * _U * (2.3e-6) ** 2 * 3 / 16, True),
    ("RMSNorm one-hot", _one_hot(8, 2, 1.0), _spiky(8, 2, 1e-8), 1e-12, False),
]


@pytest.mark.parametrize("name,x,g,eps,lay", CASES, ids=[c[0] for c in CASES])
def test_norm_jacobian_error_covers_spiky_one_hot_tokens(name, x, g, eps, lay):
    """red15-1: the factored ``NormJac`` (exact arithmetic on its ``a``, ``Q``) and the formed ``_norm_parts`` Jacobian
    against the exact one; main's ``NormJac.err`` was 4-2e6 times below the factored deviation here."""
    dev_f, err_f, dev_d, err_d = _deviations(x, g, eps, lay)
    assert dev_f <= err_f, (name, dev_f, err_f)
    assert dev_d <= err_d, (name, dev_d, err_d)


def _mean_dominated(seed: int, d: int, mean: float, spread: float) -> list:
    gen = torch.Generator().manual_seed(seed)
    return (mean + spread * torch.randn(d, generator=gen, dtype=torch.float64)).tolist()


@pytest.mark.parametrize("mean,spread", [(1e12, 1e-3), (1e15, 1.0), (1.0, 1e-15), (1e8, 1e-8)])
@pytest.mark.parametrize("spiky", [False, True])
def test_norm_jacobian_error_covers_tokens_a_few_ulps_wide(mean, spread, spiky):
    """F17e's family (mean/spread up to 1e15, the centring's error a large part of ``sigma``): the bound holds with a
    uniform and a spiky gain (eps 0, so nothing floors ``s``)."""
    d = 8
    x = _mean_dominated(int(mean % 97), d, mean, spread)
    g = _spiky(d, 0, 1e-8) if spiky else [1.0] * d
    dev_f, err_f, dev_d, err_d = _deviations(x, g, 0.0, True)
    assert dev_f <= err_f and dev_d <= err_d, (dev_f, err_f, dev_d, err_d)


_TOKEN = st.sampled_from(["gauss", "one-hot", "narrow"])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), d=st.integers(2, 12), kind=_TOKEN, gkind=st.sampled_from(["uniform", "random", "spiky"]),
       eps=st.sampled_from([0.0, 1e-30, 1e-12, 1e-3, 1.0]), lay=st.booleans(), scale=st.sampled_from([1e-6, 1.0, 1e6]))
def test_norm_jacobian_error_on_random_tokens(seed, d, kind, gkind, eps, lay, scale):
    """Random tokens (Gaussian, one-hot with a small ramp, a spread a few ulps around a large mean) and gains
    (uniform, ``1 + 0.5 N``, spiky): the new bound is at least the exact deviation, factored and formed."""
    gen = torch.Generator().manual_seed(seed)
    k = seed % d
    if kind == "gauss":
        x = torch.randn(d, generator=gen, dtype=torch.float64) * scale
    elif kind == "one-hot":
        x = torch.randn(d, generator=gen, dtype=torch.float64) * scale * 1e-9
        x[k] = scale
    else:
        x = scale * (1e6 + 1e-9 * torch.randn(d, generator=gen, dtype=torch.float64))
    g = {"uniform": torch.ones(d, dtype=torch.float64),
         "random": 1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64),
         "spiky": torch.tensor(_spiky(d, k, 1e-10), dtype=torch.float64)}[gkind]
    if float(x.std()) == 0.0 and eps == 0.0:
        return  # no Jacobian at a constant token without a floor
    dev_f, err_f, dev_d, err_d = _deviations(x.tolist(), g.tolist(), eps, lay)
    assert dev_f <= err_f and dev_d <= err_d, (dev_f, err_f, dev_d, err_d)


def test_norm_jacobian_error_homogeneity():
    """Scaling ``gamma`` by ``2^k`` scales the bound by ``2^k``; scaling the token by ``2^k`` (eps 0) by ``2^-k`` (powers of
    two keep every float the same up to the scale, so the equalities are exact but for the padded ``max|gamma|``)."""
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    g = 1 + 0.5 * torch.randn(16, generator=gen, dtype=torch.float64)
    for lay in (True, False):
        kind = NormKind.LAYERNORM if lay else NormKind.RMSNORM
        for formed in (True, False):
            e = norm_jacobian_error(NormSpec(kind, g, None, 0.0), X, formed=formed)
            e_g = norm_jacobian_error(NormSpec(kind, 8 * g, None, 0.0), X, formed=formed)
            e_x = norm_jacobian_error(NormSpec(kind, g, None, 0.0), 2.0**-7 * X, formed=formed)
            torch.testing.assert_close(e_g, 8 * e, rtol=1e-14, atol=0.0)
            torch.testing.assert_close(e_x, 2.0**7 * e, rtol=1e-14, atol=0.0)


def test_norm_jacobian_error_is_small_on_ordinary_tokens():
    """On Gaussian tokens at d = 384 with MiniLM-like gains (two outlier coordinates) the bound is ``~1e-12 max|a|``
    (what moves the certified numbers at that level), and it exceeds the exact deviation."""
    gen = torch.Generator().manual_seed(5)
    d = 384
    X = torch.randn(4, d, generator=gen, dtype=torch.float64) * 0.3
    X[:, 7] += 6.0
    g = 0.6 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)
    g[[3, 200]] = 1.5
    norm = NormSpec(NormKind.LAYERNORM, g, None, 1e-12)
    _, s, _, _ = _norm_parts(norm, X)
    amax = float(g.abs().max()) / s
    for formed in (True, False):
        rel = norm_jacobian_error(norm, X, formed=formed) / amax
        assert float(rel.max()) < 3e-11 and float(rel.min()) > 1e-14, rel


def _norm_only_layer(d: int, g: list, eps: float) -> LayerSpec:
    """Post-LN layer whose map is exactly ``x -> LN2(x)``: ``W_V = 0`` (attention output 0), no first norm, ``W_1 = 0``
    (FFN output ``W_2^T gelu(0) = 0``), so ``J_ij = delta_ij D2*`` and ``S2 = X`` with no rounding."""
    z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    attn = AttentionSpec(W_Q=rnd(1, d, 2), W_K=rnd(1, d, 2), W_V=z(1, d, 2), W_O=rnd(1, 2, d))
    ffn = FFNSpec(W_1=z(d, 4), W_2=rnd(4, d), activation=Activation("gelu"))
    return LayerSpec(0, attn, ffn, NormSpec(NormKind.NONE),
                     NormSpec(NormKind.LAYERNORM, torch.tensor(g, dtype=torch.float64), None, eps), Placement.POST)


@pytest.mark.parametrize("c,m", [(2.3e-6, 3), (2.3e-6, 4), (2.3e-6, 6), (2.9e-6, 4)])
def test_layer_local_is_not_beaten_on_a_spiky_norm(c, m):
    """red15-1 end to end: ``layer_local``'s certified ``||J(X)||`` (Jacobian route ``jacobian_point``, rows route
    ``exact_point``) and its ball constant (rho 1e-20) against ``||D2*||_2 >= |gamma_k| ||(I - Q*Q*^T) e_k||/s`` exactly
    (the row k of the exact Jacobian), ``eps = m u sigma^2``: main certified 2.1-4.8 times below it.  The stack route
    (its abs evaluation scales with ``max|a|``) held on main and must still hold."""
    d, k = 4, 2
    g = _spiky(d, k, 1e-30)
    x = _one_hot(d, k, c)
    eps = m * _U * c * c * (d - 1) / d / d
    exact = _exact_D(x, g, eps, True)
    row_k = float(mpmath.sqrt(mpmath.fsum(v * v for v in exact[k]))) * (1 - 1e-12)
    X = torch.tensor([x, x], dtype=torch.float64)
    layer = _norm_only_layer(d, g, eps)
    ll = layer_local(layer, X, 1e-20)
    assert min(ll.jacobian_point, ll.exact_point, ll.upper) >= row_k, (ll.jacobian_point, ll.exact_point, ll.upper, row_k)
    spec = TransformerSpec(arch="test", name="spiky", d_model=d, layers=[layer], input_norm=None, final_norm=None)
    assert stack_local(spec, X, [1e-20])[0].point >= row_k


# -- F44c's e- and eps-terms, each alone necessary (red14's coverage gap) ---------------------------------------------

def _reach_case(seed: int, thin: bool, eP: float, drift: float):  # noqa: ANN202
    """A post-LN attention sub-stage behind a linear prefix ``P`` with F44c's reach and the ascent objective on
    ``||[(DA(X + Delta) - DA(X)) E]_k||``, ``Delta = rho P h + e`` (``||e_j|| <= e_max``), ``E = P v + eps``
    (``||eps_j|| <= eP``).  ``thin``: every block ``c_kj u u^T`` with ``u = e_0`` and ``W_Q``, ``W_K`` blind to ``u``
    (the scores never see the prefix, so ``H[P h, P v] = 0`` and F44c's first term vanishes); otherwise ``P = 0``
    (both ellipsoid terms vanish)."""
    import dataclasses

    from lipschitz_testkit import random_spec
    from test_local_redteam14_stack import aligned_reach_case

    layer = random_spec(seed, act="gelu", norm="layernorm", d=6, H=2, dh=3, dff=8, biases=True).layers[0]
    a = layer.attention
    WQ, WK = a.W_Q.clone(), a.W_K.clone()
    WQ[:, 0, :] = 0.0
    WK[:, 0, :] = 0.0
    attn = dataclasses.replace(a, W_Q=3 * WQ, W_K=WK)
    layer = dataclasses.replace(layer, attention=attn)
    g = torch.Generator().manual_seed(seed + 1)
    T, d, rho = 4, 6, 0.05
    X = torch.randn(T, d, generator=g, dtype=torch.float64) * 1.5
    P = torch.zeros(T, T, d, d, dtype=torch.float64)
    if thin:
        P[:, :, 0, 0] = torch.randn(T, T, generator=g, dtype=torch.float64)
    reach, obj = aligned_reach_case(layer, X, P, rho, drift, eP)
    return reach, obj, T


@pytest.mark.parametrize("seed,thin,eP,drift", [(1, False, 0.5, 0.0), (2, True, 0.0, 3.0)])
def test_reach_terms_each_necessary(seed, thin, eP, drift):
    """F44c's ``e_max F^m`` and ``r e_P S`` terms, each the only non-zero one: ``P = 0`` leaves ``H[e, eps]`` (the
    eps-term alone bounds it); a prefix along a direction the scores cannot see, with a large drift and no rounding,
    leaves ``H[e, P v]`` (the e-term alone; the first term is 8e-7 here).  Adam ascent stays below the reach and
    reaches 5 % of it (measured 7.5 % and more), so deleting either term (the reach then ~0) fails here."""
    from transcover.lipschitz._local_lower import bilinear_lower

    reach, obj, T = _reach_case(seed, thin, eP, drift)
    best = 0.0
    for k in range(T):
        lo = bilinear_lower(obj(k), (2 * T, 6), restarts=2, steps=60, seed=seed + k)
        assert lo <= float(reach[k]), (k, lo, reach)
        best = max(best, lo / float(reach[k]))
    assert best >= 0.05, (best, reach)


@pytest.mark.parametrize("name,x,g,eps,lay", CASES + [
    ("narrow token", _mean_dominated(7, 8, 1e12, 1e-3), [1.0] * 8, 0.0, True),
    ("narrow, spiky", _mean_dominated(8, 8, 1e15, 1.0), _spiky(8, 0, 1e-8), 0.0, True),
    ("gaussian, random gain", torch.randn(8, generator=torch.Generator().manual_seed(9), dtype=torch.float64).tolist(),
     (1 + 0.5 * torch.randn(8, generator=torch.Generator().manual_seed(10), dtype=torch.float64)).tolist(), 1e-12, True)],
    ids=[c[0] for c in CASES] + ["narrow", "narrow-spiky", "gaussian"])
def test_stack_norm_map_model_error_is_entrywise(name, x, g, eps, lay):
    """The stack's ``_NormLin`` carries F17f entrywise in its abs evaluation (``_model``, over ``gamma_k``): on each unit
    column (and row, the transposed map) it bounds ``|D_hat - D*|`` exactly, ``D_hat = diag(gamma)(P - u u^T)/s`` in
    exact arithmetic on its computed ``u``, ``s``."""
    from transcover.lipschitz._local_stack_maps import _NormLin

    d = len(x)
    norm = NormSpec(NormKind.LAYERNORM if lay else NormKind.RMSNORM, torch.tensor(g, dtype=torch.float64), None, eps)
    nl = _NormLin(norm, torch.tensor([x], dtype=torch.float64))
    exact = _exact_D(x, g, eps, lay)
    u, s = [mpmath.mpf(v) for v in nl.u[0].tolist()], mpmath.mpf(float(nl.s[0]))
    c = mpmath.mpf(1) / d if lay else 0
    dev = [[abs(mpmath.mpf(g[i]) * ((1 if i == j else 0) - c - u[i] * u[j]) / s - exact[i][j]) for j in range(d)]
           for i in range(d)]
    eye = torch.eye(d, dtype=torch.float64)[:, None, :]  # d unit rows, one token
    ku = nl.k * _U
    fwd = (nl._model(eye, False)[:, 0, :] * ku).tolist()  # [m][j] >= |dD_jm|
    bwd = (nl._model(eye, True)[:, 0, :] * ku).tolist()  # [m][j] >= |dD_mj|
    for i in range(d):
        for j in range(d):
            assert dev[i][j] <= fwd[j][i] and dev[i][j] <= bwd[i][j], (name, i, j, float(dev[i][j]), fwd[j][i], bwd[i][j])
