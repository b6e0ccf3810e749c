"""Red team of F56 (optimised row-Gram weights, ``_local_row_weights``) and F55a (the first norm's own remainder through
``(I + F) diag(gamma1)``, ``_local_remg``), and end-to-end attacks on the per-layer balls (red19): adversarial weights
(spanning 1e-150..1e150, 1e-300, denormals, 1e300), softmax weights down to 1e-290, causal masks, T = 1; gamma1 with
zeros, 1e-8 entries, signs and x1e3 outliers, eps 1e-12 .. 1, RMSNorm, radii up to and past the floor, an ill-conditioned
``I + F``; bf16/float32-stored weights, inputs x 2^-40 and 2^40, eps = 0 with nearly constant tokens; MiniLM layers 0 and
5 at rho = 1e-3 (slow).  Every ascent is float64 Adam inside the ball with restarts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lipschitz_testkit import hetero_gamma, random_spec
from batched_redteam_ascents import jac_ascent, norm_ascent, pair_ascent, remainder_ascents, row_ascents, stage_ascent
from test_local_wts18 import _blocks, _stage_maps
from transcover._errors import InputError
from transcover.lipschitz import _local_row_weights as rw
from transcover.lipschitz import _local_stages as stg
from transcover.lipschitz._local_jacobian import _norm_parts, _weight_norms
from transcover.lipschitz._local_remg import gamma_free_norm_remainder, if_gamma_norm
from transcover.lipschitz._local_rows import _gamma_vec, layer_rows
from transcover.model import NormKind, NormSpec, attention_forward
from transcover.model import _functional
from transcover.model._functional import layer_forward
from batched_redteam_ascents import check_attention, headwise_attention


def _extreme_gamma(kind: str, d: int, g: torch.Generator) -> torch.Tensor:
    """``hetero_gamma``'s kinds, or ``"zeros"`` (every third 0 and one 1e-8) or ``"huge"`` (one x1e3, signs)."""
    if kind == "zeros":
        gam = hetero_gamma("plain", d, g)
        gam[::3] = 0.0
        gam[1] = 1e-8
    elif kind == "huge":
        gam = hetero_gamma("negative", d, g)
        gam[2] *= 1e3
    else:
        gam = hetero_gamma(kind, d, g)
    return gam


def _layer(seed: int, *, placement: str = "post", causal: bool = False, sharp: float = 1.0, gamma: str = "outlier",
           d: int = 8, norm: str = "layernorm", eps: float = 0.05, w2: float = 1.0):  # noqa: ANN202
    """A small GELU layer (d 8, 2 heads): ``W_Q, W_K x sharp``, the first norm's gamma heterogeneous (``hetero_gamma``
    kinds, or ``"zeros"``: every third 0 and one 1e-8, ``"huge"``: one x1e3 and signs), ``W_2 x w2``."""
    layer = random_spec(40 + seed, act="gelu", norm=norm, biases=True, d=d, H=2, dh=4, dff=16, placement=placement,
                        causal=causal, eps=eps).layers[0]
    g = torch.Generator().manual_seed(seed)
    gam = _extreme_gamma(gamma, d, g)
    attn = dataclasses.replace(layer.attention, W_Q=layer.attention.W_Q * sharp, W_K=layer.attention.W_K * sharp)
    return dataclasses.replace(layer, attention=attn, norm_attn=dataclasses.replace(layer.norm_attn, weight=gam),
                               ffn=dataclasses.replace(layer.ffn, W_2=layer.ffn.W_2 * w2))


def _sharpest(seed: int, X: torch.Tensor, **kw):  # noqa: ANN202
    """``_layer`` with the largest ``sharp`` (from 17, x0.95) whose softmax weights are all normal float64 (the
    local route refuses underflowed weights): visible weights reach ~1e-290."""
    sharp = 17.0
    while True:
        layer = _layer(seed, sharp=sharp, **kw)
        try:
            return layer, stg.layer_at_x(layer, X, _weight_norms(layer)["O"])
        except InputError:
            sharp *= 0.95


def _X(seed: int, T: int = 5, d: int = 8, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


# -- F56: any positive weights ------------------------------------------------------------------------------------

def _weights(kind: str, T: int, g: torch.Generator) -> torch.Tensor:
    """Adversarial positive weights (T, T)."""
    if kind == "span":  # 1e-150 .. 1e150
        return 10 ** (torch.rand(T, T, generator=g, dtype=torch.float64) * 300 - 150)
    if kind == "tiny":  # off-diagonal 1e-300
        return torch.full((T, T), 1e-300, dtype=torch.float64).fill_diagonal_(1.0)
    if kind == "denormal":
        return 5e-324 * torch.randint(1, 100, (T, T), generator=g).double()
    if kind == "huge":
        return 1e300 * torch.rand(T, T, generator=g, dtype=torch.float64)
    return torch.ones(T, T, dtype=torch.float64).fill_diagonal_(1e-200)  # "diag": the diagonal block's weight tiny


def _certified(at, pt, w: torch.Tensor) -> dict:  # noqa: ANN001
    """Every stage row certified with the weights ``w`` alone (F17b's formula, F56)."""
    g2 = stg.attention_row_gram(at, w)
    if at.post:
        return dict(zip(("aP_pt", "h_pt", "g_pt", "point"), stg.post_rows(at, g2, pt.IF)[:4])) | {"a_pt": g2.a_pt}
    return {"point": stg.pre_rows(g2, pt.M, pt.eM)[0]}


F56_CASES = [dict(placement="post", causal=True), pytest.param(dict(placement="post", sharp=True), marks=pytest.mark.slow),
             dict(placement="post", sharp=True, causal=True), dict(placement="pre", sharp=True),
             pytest.param(dict(placement="post", T=1), marks=pytest.mark.slow), dict(placement="pre", T=1)]


@pytest.mark.parametrize("case", F56_CASES)
def test_f56_any_positive_weights_certify(monkeypatch, case):
    """F56's claim: for ANY positive weights the certified row (the Gram's and ``lambda_max``'s rounding included)
    bounds ``nu_i``.  Weights spanning 1e-150..1e150, 1e-300 off the diagonal, denormals, 1e300, a 1e-200 diagonal; a
    causal mask (zero blocks), softmax weights down to ~1e-290 (blocks of norm ~1e-290 next to O(1) ones), T = 1.
    Each stage row certified with those weights alone is at or above Adam ascent (5 restarts) and the alternating
    ascent on the dense autograd blocks, or not finite; through ``reweighted`` (``stage_weights`` returning them) every
    row stays finite, above the ascent and at or below the fixed-weight row.  The pipeline's own weights likewise."""
    T = case.get("T", 5)
    X = _X(1, T=T)
    kw = dict(placement=case["placement"], causal=case.get("causal", False))
    layer, at = _sharpest(1, X, **kw) if case.get("sharp") else (_layer(1, **kw), None)
    at = at or stg.layer_at_x(layer, X, _weight_norms(layer)["O"])
    if case.get("sharp"):
        pmin = min(float(hd[0][hd[0] > 0].min()) for hd in at.heads)
        assert pmin < 1e-200, pmin  # blocks ~1e150 times smaller than others
    gram = stg.attention_row_gram(at)
    pt = stg.post_point(at, gram) if at.post else stg.pre_point(at, gram)
    maps = _stage_maps(layer) if at.post else {"point": lambda Z: layer_forward(layer, Z)}
    lows = dict(zip(maps, row_ascents([_blocks(f, X) for f in maps.values()], starts=5, steps=120)))
    g = torch.Generator().manual_seed(5)
    for kind in ("own", "span", "tiny", "denormal", "huge", "diag"):
        w = rw.stage_weights(at, gram, pt) if kind == "own" else _weights(kind, T, g)
        cert = _certified(at, pt, w)
        with monkeypatch.context() as m:
            m.setattr(rw, "stage_weights", lambda *a, w=w: w)
            _, pt2 = rw.reweighted(at, gram, pt)
        for name, lo in lows.items():
            c = cert[name]
            assert bool((~torch.isfinite(c) | (lo <= c)).all()), (kind, name, lo, c)
            new, old = getattr(pt2, name), getattr(pt, name)
            assert bool(torch.isfinite(new).all()) and bool((lo <= new).all()) and bool((new <= old).all()), \
                (kind, name, lo, new, old)


def test_f56_carried_gram_bounds_the_folded_map():
    """The row Gram ``reweighted`` carries on (per token the weights with the smaller ``h_pt``) feeds F46's ``D_n B``
    row (``fold_at_x``) and F54's reach: ``fold_at_x``'s ``hn_pt`` from it stays above Adam ascent on the blocks of
    ``n(S1(X))`` (the first norm without gamma), on the sharp causal layer where the two weight sets differ per token."""
    X = _X(2)
    layer, at = _sharpest(2, X, causal=True)
    gram = stg.attention_row_gram(at)
    pt = stg.post_point(at, gram)
    gram2, pt2 = rw.reweighted(at, gram, pt)
    hn = stg.fold_at_x(at, gram2).hn_pt
    plain = dataclasses.replace(layer.norm_attn, weight=None)
    lo = row_ascents([_blocks(lambda Z: plain(Z + attention_forward(layer.attention, Z)), X)], starts=6, steps=150)[0]
    assert bool((lo <= hn).all()), (lo, hn)
    assert bool((pt2.h_pt < pt.h_pt).any())  # the weights changed somewhere: the carried Gram is a mix


def test_f56_weight_fixed_point_on_extreme_orthogonal_blocks():
    """Blocks ``a_j e_j e_0^T`` (orthogonal ranges, the oscillation case) with ``a_j`` from 1e-120 to 1e120 and one
    zero block: ``optimised_weights`` stays finite and positive (the floor) without collapsing to the floor everywhere
(red19-1: the power step's ``||y||`` overflowed past 1e154, every weight became 1e-300 and ``stage_weights`` fell back
to F34c's), and the weighted-Gram bound with them is
    at or above ``nu = ||a||`` and within ``T FLOOR`` of it (the tiny blocks' weights floored)."""
    from test_local_wts18 import _Dense, _gram_bound

    n, d = 6, 7
    a = torch.tensor([[1e-120, 1.0, 1e120, 3e119, 0.0, 1e60]], dtype=torch.float64)
    A = torch.zeros(1, n, d, d, dtype=torch.float64)
    for j in range(n):
        A[0, j, j, 0] = a[0, j]
    eye = lambda x: x  # noqa: E731
    w = rw.optimised_weights(_Dense(A), eye, eye, torch.ones(1, d, dtype=torch.float64),
                             torch.ones(1, n, dtype=torch.float64))
    assert bool(torch.isfinite(w).all()) and float(w.min()) > 0 and float(w.max()) > 1e-200, w  # not collapsed
    nu = float(a.norm())
    got = float(_gram_bound(A, w)[0])
    assert nu * (1 - 1e-12) <= got <= nu * (1 + n * rw.FLOOR + 1e-12), (got, nu)


# -- F55a: the norm's remainder through (I + F) diag(gamma1) --------------------------------------------------------

# the ascents of this file, batched over their starts (the same starts, steps and step sizes): batched_redteam_ascents
_norm_ascent = norm_ascent


@pytest.mark.parametrize("kind,gamma,eps", [
    ("layernorm", "zeros", 1e-12), pytest.param("layernorm", "huge", 1.0, marks=pytest.mark.slow),
    pytest.param("rmsnorm", "zeros", 1e-3, marks=pytest.mark.slow), ("rmsnorm", "huge", 1e-12),
    pytest.param("layernorm", "tiny", 0.0, marks=pytest.mark.slow)])
def test_f55a_norm_remainder_extreme_gamma_and_eps(kind, gamma, eps):
    """F55a at the norm: gamma with zeros and a 1e-8 entry, or a x1e3 outlier with signs; eps 0 .. 1; LayerNorm and
    RMSNorm; ``M`` ill-conditioned (singular values 1e-8 .. 1e3, its top direction on gamma's largest coordinate); radii
    0.5, 0.95 and 1.3 of the floor ``sqrt(d) s``: ``||M diag(gamma)|| remN^1`` at or above the ascent (6 starts x 150
    steps), inf allowed past the floor."""
    d = 7
    g = torch.Generator().manual_seed(11)
    gam = _extreme_gamma(gamma, d, g)
    norm = NormSpec(NormKind.LAYERNORM if kind == "layernorm" else NormKind.RMSNORM, gam,
                    0.1 * torch.randn(d, generator=g, dtype=torch.float64) if kind == "layernorm" else None, eps)
    x = torch.randn(1, d, generator=g, dtype=torch.float64) * 0.7 + 0.3
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    k = int(gam.abs().argmax())
    Q[:, [0, k]] = Q[:, [k, 0]]
    M = Q @ torch.diag(torch.logspace(3, -8, d, dtype=torch.float64)) @ Q.T
    M = M + 1e3 * torch.outer(torch.randn(d, generator=g, dtype=torch.float64), torch.eye(d, dtype=torch.float64)[k])
    _, s, sig, _ = _norm_parts(norm, x)
    gmax = float(gam.abs().max()) * (1 + 1e-9)
    nG = float(if_gamma_norm(M[None], torch.zeros(1, dtype=torch.float64), _gamma_vec(norm, d), gmax)[0])
    for f in (0.5, 0.95, 1.3):
        r = f * math.sqrt(d) * float(s[0])
        bound = nG * float(gamma_free_norm_remainder(norm, sig, s, torch.tensor([r], dtype=torch.float64), d)[0])
        assert not math.isnan(bound)
        got = _norm_ascent(norm, x, M, r)
        assert got <= bound, (f, got, bound)


_stage_ascent = stage_ascent


def _rows_and_remg(monkeypatch, layer, X: torch.Tensor, r: float):  # noqa: ANN001, ANN202
    """``layer_rows`` at ``r`` and the ``remG`` (F55a's min'ed in) seen at the full radius."""
    seen = []
    plain = stg.ffn_reach
    with monkeypatch.context() as m:
        m.setattr(stg, "ffn_reach", lambda at, pt, gram, fn, *a: seen.append(fn.remG) or plain(at, pt, gram, fn, *a))
        lj = layer_rows(layer, X, [r])[0]
    return lj, seen[-1]


@pytest.mark.parametrize("gamma,norm,eps,w2,frac", [
    ("zeros", "layernorm", 1e-12, 1.0, 0.05), pytest.param("huge", "layernorm", 1.0, 1.0, 0.3, marks=pytest.mark.slow),
    pytest.param("zeros", "rmsnorm", 1e-6, 6.0, 0.05, marks=pytest.mark.slow), ("huge", "layernorm", 1e-12, 6.0, 0.01),
    pytest.param("huge", "layernorm", 1e-12, 6.0, 0.6, marks=pytest.mark.slow)])
def test_f55a_layer_remainder_extreme_gamma(monkeypatch, gamma, norm, eps, w2, frac):
    """F55a end to end on small post-LN layers: gamma1 with zeros and 1e-8 or a x1e3 signed outlier, eps 1e-12 .. 1,
    RMSNorm, ``W_2 x 6`` (``||I + F||`` large, ill-conditioned), radius ``frac`` of the smallest centred S1 (0.6:
    past the first norm's floor, r1 > 20 against centred S1 norms 4.8-8.7, the bounds ~1e17 but never NaN): per token the ascent on the remainder of S2's move through ``(I + F) D1`` (5
    starts incl. the row map's top direction) stays at or below the certified ``remG``, and the stage radii above
    their attained moves."""
    layer = _layer(3, gamma=gamma, norm=norm, eps=eps, w2=w2)
    X = _X(3, scale=2.0)
    S1 = X + attention_forward(layer.attention, X)
    r = frac * float((S1 - S1.mean(dim=1, keepdim=True)).norm(dim=1).min())
    lj, remG = _rows_and_remg(monkeypatch, layer, X, r)
    tokens = [i for i in range(X.shape[0]) if math.isfinite(float(remG[i]))]
    for i, got in zip(tokens, remainder_ascents(layer, X, r, tokens)):  # 5 starts x 60 steps per token, one batch
        assert got <= float(remG[i]), (i, got, float(remG[i]))
    for name, best in _stage_ascent(layer, X, r).items():
        assert bool((best <= lj.stage_radii[name]).all()), (name, best, lj.stage_radii[name])


# -- rounding: stored precisions and input scales -------------------------------------------------------------------

_jac_ascent, _pair_ascent = jac_ascent, pair_ascent


def _stored(layer, dtype: torch.dtype):  # noqa: ANN001, ANN202
    """Every weight of the layer rounded to ``dtype`` and converted back to float64 (exactly)."""
    cast = lambda t: t if t is None else t.to(dtype).double()  # noqa: E731
    def conv(obj):  # noqa: ANN001, ANN202
        fields = {f.name: cast(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                  if isinstance(getattr(obj, f.name), torch.Tensor)}
        return dataclasses.replace(obj, **fields)
    return dataclasses.replace(layer, attention=conv(layer.attention), ffn=conv(layer.ffn),
                               norm_attn=conv(layer.norm_attn), norm_ffn=conv(layer.norm_ffn))


@pytest.mark.parametrize("case", ["bf16", pytest.param("f32", marks=pytest.mark.slow), "tiny", "huge", "flat"])
def test_rounding_cases_hold(case):
    """Rounding attacks on a whole post-LN layer (F55a and F56 inside): weights stored in bf16 / float32 (converted
    exactly to float64), inputs x 2^-40 and x 2^40 (with ``W_Q, W_K x 2^-40``), eps = 0 with nearly constant tokens (spread
    1e-6 of their mean): the ball's rows at or above the ascent on the row's (2,inf) norm over the ball, the stage
    radii above their attained moves; a refused input (``InputError``) is a valid answer."""
    layer = _layer(4, gamma="negative", causal=True)
    X = _X(4)
    if case in ("bf16", "f32"):
        layer = _stored(layer, torch.bfloat16 if case == "bf16" else torch.float32)
    elif case == "tiny":
        X = X * 2.0**-40
    elif case == "huge":  # W_Q, W_K x 2^-40 keep the scores (the softmax would underflow and be refused)
        X = X * 2.0**40
        a = layer.attention
        layer = dataclasses.replace(layer, attention=dataclasses.replace(a, W_Q=a.W_Q * 2.0**-40, W_K=a.W_K * 2.0**-40))
    else:
        layer = dataclasses.replace(layer, norm_attn=dataclasses.replace(layer.norm_attn, eps=0.0),
                                    norm_ffn=dataclasses.replace(layer.norm_ffn, eps=0.0))
        X = 3.0 + 1e-6 * X
    S1 = X + attention_forward(layer.attention, X)
    r = 0.02 * float((S1 - S1.mean(dim=1, keepdim=True)).norm(dim=1).min())
    try:
        lj = layer_rows(layer, X, [r])[0]
    except InputError:
        return
    lo = _jac_ascent(layer, X, r, steps=40)
    assert bool((lo <= lj.total_rows).all()), (lo, lj.total_rows)
    assert _pair_ascent(layer, X, r) <= lj.ball
    for name, best in _stage_ascent(layer, X, r, starts=3, steps=40).items():
        assert bool((best <= lj.stage_radii[name]).all()), (name, best, lj.stage_radii[name])


# -- end to end on MiniLM -------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sentence,L", [(1, 5)])  # (0, 0) too, measured: docs/results "red19"; one case for CI time
def test_minilm_layer_ball_end_to_end(sentence, L, monkeypatch):
    """Real MiniLM (float64), an sklearn-descr sentence cut to 12 tokens, layer ``L``'s input, rho = 1e-3 of its median
    token norm (F55a and F56 inside ``layer_rows``): Adam ascent on the row's (2,inf) norm of the layer Jacobian over the
    ball, for the three tokens with the largest certified point rows, two starts at the certified worst token's
    attained ``V`` (``lower_V``, ``E = +- r V``) and one random, at or below each token's ball row; pairs in the ball
    at or below the ball; each stage's attained move (r1 ``attention``, rh ``norm_attn``, r2 ``ffn``) at or below its
    certified radius.  Measured (red19 table in docs/results/local_lipschitz_rows.md): ball / ascent 3.07 and 2.76
    on (0, 0) and (1, 5), stage attained / certified at most 0.63 (a stronger ascent than this test's)."""
    from transcover.model import load
    from transcover.model._data import load_inputs

    spec = load(None).to_torch(torch.float64)
    X = spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=12, limit=2)[sentence].double())
    for layer in spec.layers[:L]:
        X = layer_forward(layer, X).detach()
    layer = spec.layers[L]
    r = 1e-3 * float(X.norm(dim=1).median())
    lj = layer_rows(layer, X, [r], lower=3)[0]
    top = lj.point_rows.topk(3).indices.tolist()
    # the ascents' layer forwards take the attention all heads at once (batched_redteam_ascents.headwise_attention:
    # the same map, 5x cheaper at d = 384; checked against attention_forward here, values and gradients, on X and moves
    # in the ball), patched after the rows, for the ascents alone
    check_attention(layer.attention, X + r * torch.randn((4, *X.shape), dtype=torch.float64,
                                                         generator=torch.Generator().manual_seed(1)))
    monkeypatch.setattr(_functional, "attention_forward", headwise_attention)
    lo = _jac_ascent(layer, X, r, starts=3, steps=30, tokens=top, V0=lj.lower_V[1])
    assert bool((lo <= lj.total_rows[top]).all()), (lo, lj.total_rows[top])
    assert _pair_ascent(layer, X, r, starts=1, steps=30) <= lj.ball
    for name, best in _stage_ascent(layer, X, r, starts=2, steps=25).items():
        assert bool((best <= lj.stage_radii[name]).all()), (name, best, lj.stage_radii[name])
