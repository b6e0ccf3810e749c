"""THEORY F46: the FFN stage seen through the preceding norm's gamma (``_local_gamma_fold``), attacked.

The folded drift ``dG(rn) >= sup_{||v|| <= rn} ||P (J_F(h + gamma o v) - J_F(h)) diag(gamma)||`` and its segment mean
(through the remainder ``||P (F(h + gamma o v) - F(h) - J_F(h)(gamma o v))|| <= dGh(rn) rn``) against float64 Adam
ascent with heterogeneous gamma (outliers x10, tiny, negative) and saturated / near-zero GELU units; the whole
layer's rows with the fold against pair/Jacobian ascent, post-LN and pre-LN; homogeneity; new <= old.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lipschitz_testkit import hetero_gamma, minilm_layer0_rows, random_spec
from test_lipschitz_local import adversaries
from transcover.lipschitz import _local_gamma_fold
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz._local_gamma_fold import FoldedFfnDrift, folded_layer
from transcover.lipschitz._local_jacobian import _weight_norms
from transcover.lipschitz._local_rows import layer_rows
from transcover.model import ffn_forward
from transcover.model._functional import layer_forward

D, DFF, T = 6, 12, 3


def _case(seed: int, kind: str, placement: str, saturate: bool):
    """A layer whose FFN-reading norm carries ``hetero_gamma(kind)``, a centre ``h`` and its pre-activations ``z`` with
    (``saturate``) a third of the units at |z| ~ 4-6 (GELU's slope saturated), a third at |z| < 0.05."""
    g = torch.Generator().manual_seed(seed)
    spec = random_spec(seed, act="gelu", norm="layernorm", placement=placement, d=D, dff=DFF, biases=True, scale=2.0)
    layer = spec.layers[0]
    name = "norm_attn" if placement == "post" else "norm_ffn"
    layer = dataclasses.replace(layer,
                                **{name: dataclasses.replace(getattr(layer, name), weight=hetero_gamma(kind, D, g))})
    h = torch.randn(T, D, generator=g, dtype=torch.float64)
    ffn = layer.ffn
    z = h @ ffn.W_1 + ffn.b_1
    if saturate:
        target = z.clone()
        target[:, : DFF // 3] = (4 + 2 * torch.rand(T, DFF // 3, generator=g, dtype=torch.float64)) * torch.sign(
            torch.randn(T, DFF // 3, generator=g, dtype=torch.float64))
        target[:, DFF // 3: 2 * DFF // 3] = 0.05 * (2 * torch.rand(T, DFF // 3, generator=g, dtype=torch.float64) - 1)
        # one bias for all tokens: shift by the first token's gap, the other tokens stay near the same units' targets
        ffn = dataclasses.replace(ffn, b_1=ffn.b_1 + (target - z)[0])
        layer = dataclasses.replace(layer, ffn=ffn)
        z = h @ ffn.W_1 + ffn.b_1
    return layer, h, z


def _fold_drifts(layer, z: torch.Tensor, rn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Every token's final folded drift ``(dG, dGh)`` on radii ``rn``, rounding pad included."""
    fd = FoldedFfnDrift(layer, z, _weight_norms(layer))
    assert fd.fold is not None  # the fold applies: the test can fail
    dG, dGh = fd.fold.glob(rn)
    fd.fold.final(rn, dG, dGh, torch.full_like(rn, math.inf), torch.arange(len(rn)))
    pad = fd.pad(rn)
    return dG + pad, dGh + pad


def _P(post: bool) -> torch.Tensor:
    """What the following LayerNorm sees post-LN (the centring), nothing pre-LN."""
    return torch.eye(D, dtype=torch.float64) - (1.0 / D if post else 0.0)


def _gelu1(z: torch.Tensor) -> torch.Tensor:
    """GELU' (float64, differentiable)."""
    return torch.special.ndtr(z) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _ascent(value, rn: float, seed: int, starts: int = 3, steps: int = 120) -> torch.Tensor:  # noqa: ANN001
    """(T,) float64 Adam ascent of ``value(v, u, w)`` (..., T) over per-token ``||v_i|| <= rn`` and unit ``u_i``, ``w_i``;
    the starts run as one batch (leading axis; each start's own draws and Adam steps: Adam acts entrywise)."""
    return _ascents(value, [rn], [seed], starts, steps)[0]


def _ascents(value, rns: list, seeds: list, starts: int = 3, steps: int = 120) -> list:  # noqa: ANN001
    """``[_ascent(value, rn, seed, starts, steps) for rn, seed in zip(rns, seeds)]``, every radius's starts in one batch
    (leading axes (radius, start)): per radius the same draws (its own generator), its own Adam param groups (lr
    ``0.1 rn`` on ``v``, 0.05 on ``u``, ``w``; Adam acts entrywise) and projection, so each ascent takes its own steps."""
    vs, us, ws = [], [], []
    for rn, seed in zip(rns, seeds):
        g = torch.Generator().manual_seed(seed)
        draws = torch.stack([torch.stack([torch.randn(T, D, generator=g, dtype=torch.float64) for _ in "vuw"])
                             for _ in range(starts)])  # (starts, 3, T, D), per start v, u, w
        vs.append((draws[:, 0] / draws[:, 0].norm(dim=-1, keepdim=True) * rn).requires_grad_(True))
        us.append(draws[:, 1].clone().requires_grad_(True))
        ws.append(draws[:, 2].clone().requires_grad_(True))
    opt = torch.optim.Adam([{"params": [v], "lr": 0.1 * rn} for v, rn in zip(vs, rns)]
                           + [{"params": [u, w], "lr": 0.05} for u, w in zip(us, ws)])
    best = torch.zeros(len(rns), T, dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            for v, rn in zip(vs, rns):
                v.mul_(torch.clamp(rn / v.norm(dim=-1, keepdim=True).clamp(min=1e-300), max=1.0))
        u, w = torch.stack(us), torch.stack(ws)
        val = value(torch.stack(vs), u / u.norm(dim=-1, keepdim=True), w / w.norm(dim=-1, keepdim=True))
        best = torch.maximum(best, val.detach().amax(dim=1))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return list(best)


@pytest.mark.parametrize("placement", ["post", "pre"])
@pytest.mark.parametrize("kind", ["outlier", "tiny", "negative"])
@pytest.mark.parametrize("saturate", [False, True])
def test_folded_drift_and_remainder_are_never_beaten(placement, kind, saturate):
    """(a) Adam over ``v`` on the n-ball (the H-ellipsoid ``gamma o v``) of ``u^T P (J_F(h + gamma o v) - J_F(h))
    diag(gamma) w`` and of the remainder's norm over ``rn``: never above ``dG``, ``dGh``; per token, radii from the
    linear to the capped regime; the Jacobian by its formula ``W_2^T diag(GELU'(z)) W_1^T`` (checked against autograd)."""
    layer, h, z = _case(11, kind, placement, saturate)
    ffn, gam, P = layer.ffn, (layer.norm_attn if placement == "post" else layer.norm_ffn).weight, _P(placement == "post")
    W1, W2, b1 = ffn.W_1, ffn.W_2, ffn.b_1

    def F(x):  # noqa: ANN001, ANN202
        return torch.nn.functional.gelu(x @ W1 + b1) @ W2

    J = torch.autograd.functional.jacobian(F, h[0])
    assert torch.allclose(J, (W2.T * _gelu1(z[0])) @ W1.T, rtol=1e-12, atol=1e-12)
    s0 = _gelu1(z)

    def drift(v, u, w):  # noqa: ANN001, ANN202
        ds = _gelu1(z + (gam * v) @ W1) - s0  # (T, d_ff)
        return ((u @ P @ W2.T) * ds * ((gam * w) @ W1)).sum(dim=-1)

    def rem(v, u, w):  # noqa: ANN001, ANN202, ARG001
        dh = gam * v
        return ((F(h + dh) - F(h) - (s0 * (dh @ W1)) @ W2) @ P).norm(dim=-1)

    rns = (0.03, 0.4, 3.0)
    # the three radii's ascents in one batch each (_ascents: every ascent its own draws and steps, seeds k and k + 50)
    los = _ascents(drift, list(rns), [0, 1, 2])
    los_r = _ascents(rem, list(rns), [50, 51, 52])
    for rn, lo, lo_r in zip(rns, los, los_r):
        dG, dGh = _fold_drifts(layer, z, torch.full((T,), rn, dtype=torch.float64))
        assert bool((lo > 0).all()) and bool((lo <= dG).all()), (kind, saturate, rn, lo, dG)
        assert bool((lo_r <= dGh * rn).all()), (kind, saturate, rn, lo_r, dGh * rn)


CASES = [dict(norm=n, placement=p, biases=b) for n in ("layernorm", "rmsnorm") for p in ("post", "pre")
         for b in (False, True)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["outlier", "negative"])
def test_layer_rows_with_the_fold_are_never_beaten(case, kind):
    """(b) The whole layer's certified ball rows and output radii with the fold against pair/Jacobian ascent, with
    heterogeneous gamma on every norm; at radii where the fold's branch is the one taken."""
    g = torch.Generator().manual_seed(3)
    spec = random_spec(7, act="gelu", scale=1.5, **case)
    layer = spec.layers[0]
    layer = dataclasses.replace(layer, norm_attn=dataclasses.replace(layer.norm_attn, weight=hetero_gamma(kind, D, g)),
                                norm_ffn=dataclasses.replace(layer.norm_ffn, weight=hetero_gamma(kind, D, g)))
    assert folded_layer(layer) is not None
    X = torch.randn(4, D, generator=g, dtype=torch.float64)
    out = layer_forward(layer, X)
    rhos = (1e-3, 3e-2, 0.2)
    # the layer's weight-only norms once for the three balls (as layer_local's cache passes them; no patch here), and
    # the three radii's adversaries in one batch (adversaries: each radius adversary's own starts and steps)
    norms, hn = _weight_norms(layer), head_norms(layer.attention)
    los = adversaries(lambda Z: layer_forward(layer, Z), X, rhos, restarts=3, steps=30, seed=5)
    for rho, lo in zip(rhos, los):
        lj = layer_rows(layer, X, [rho], norms=norms, head_norms_=hn)[0]
        assert lo <= lj.ball * (1 + 1e-12), (rho, lo, lj.ball, lj.parts)
        for _ in range(5):
            E = torch.randn(X.shape, generator=g, dtype=torch.float64)
            E = E / E.norm(dim=1, keepdim=True) * rho
            assert bool(((layer_forward(layer, X + E) - out).norm(dim=1) <= lj.output_radii).all())


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("kind", ["outlier", "tiny", "negative"])
def test_post_fold_ball_is_never_beaten(norm, kind):
    """(b) Post-LN ``FoldBall``: Adam ascent over the ball of each token's move of the normalised vector
    ``n(S1(X + E))`` (``gamma`` left out) never above ``rn``, and the row constants ``nu_i`` of its Jacobian at the
    ascent's points and at random points of the ball never above ``Ns`` (one sub-ball: ``rn <= r Ns``)."""
    from transcover.lipschitz import _local_stages as st
    from transcover.lipschitz._local_attention import head_norms
    from transcover.lipschitz._local_jacobian import row_norm_lower
    from transcover.model import attention_forward
    from lipschitz_testkit import clip_rows

    g = torch.Generator().manual_seed(8)
    layer = random_spec(12, act="gelu", norm=norm, placement="post", biases=True, scale=1.5).layers[0]
    layer = dataclasses.replace(layer, norm_attn=dataclasses.replace(layer.norm_attn, weight=hetero_gamma(kind, D, g)))
    nrm = dataclasses.replace(layer.norm_attn, weight=None, bias=None)
    X = torch.randn(4, D, generator=g, dtype=torch.float64)

    def n(Z):  # noqa: ANN001, ANN202
        return nrm(Z + attention_forward(layer.attention, Z))

    norms, hn = _weight_norms(layer), head_norms(layer.attention)
    at = st.layer_at_x(layer, X, float(hn["O"]))
    gram = st.attention_row_gram(at)
    pt, dd = st.post_point(at, gram), st.drift_at_x(at)
    fx = st.fold_at_x(at, gram)
    n0 = n(X)
    radii = (1e-3, 3e-2, 0.2)
    # every radius's 3 starts and 3 random points drawn from g in the original order (per radius: the starts in turn,
    # then the points; the ascents draw nothing)
    starts, rand = [], []
    for r in radii:
        starts.append(torch.stack([clip_rows(torch.randn(X.shape, generator=g, dtype=torch.float64) * r, r)
                                   for _ in range(3)]))
        rand.append(torch.stack([clip_rows(torch.randn(X.shape, generator=g, dtype=torch.float64) * r, r)
                                 for _ in range(3)]))
    # the 3 radii x 3 starts as one batch: each start its own Adam steps (Adam acts entrywise; a radius's starts are
    # one param group, lr 0.1 r), n acts on the leading batch axes
    Es = [E0.clone().requires_grad_(True) for E0 in starts]
    opt = torch.optim.Adam([{"params": [E], "lr": 0.1 * r} for E, r in zip(Es, radii)])
    best = torch.zeros(len(radii), 4, dtype=torch.float64)
    for _ in range(80):
        with torch.no_grad():
            for E, r in zip(Es, radii):
                E.copy_(clip_rows(E, r))
        mv = (n(X + torch.stack(Es)) - n0).norm(dim=-1)  # (radius, start, T)
        best = torch.maximum(best, mv.detach().amax(dim=1))
        opt.zero_grad()
        (-mv.sum()).backward()
        opt.step()
    # per point (the ascents' last iterates, then the random points) the exact Jacobian of n, all 18 points in one:
    # n maps each point on its own, so the Jacobian of the batch's sum in one point is that point's Jacobian
    pts = torch.stack([torch.cat([clip_rows(E.detach(), r), R]) for E, R, r in zip(Es, rand, radii)])  # (3, 6, T, d)
    Jb = torch.autograd.functional.jacobian(lambda Z: n(Z).sum(dim=(0, 1)), X + pts)  # (T, d, 3, 6, T, d)
    for k, r in enumerate(radii):
        att = st.post_attention(at, pt, dd, norms, r, [])
        fb = st.post_fold(at, dd, att, fx, r, [])
        assert bool((best[k] > 0).all()) and bool((best[k] <= fb.rn).all()), (r, best[k], fb.rn)
        for p in range(pts.shape[1]):
            J = Jb[:, :, k, p]  # (T, d, T, d)
            assert bool((row_norm_lower(J.permute(0, 2, 1, 3)) <= fb.Ns).all()), (r, fb.Ns)


def test_homogeneity_of_the_folded_drift():
    """(c) ``gamma -> c gamma``, ``beta -> c beta``, ``W_1 -> W_1 / c`` leaves the FFN after the norm and the folded
    FFN, hence ``dG``, unchanged (bit for bit at ``c = 4``: the products are the same doubles; to rounding at
    ``c = 3``); ``W_2 -> c W_2`` scales it by ``c``."""
    layer, h, z = _case(4, "outlier", "post", True)
    rn = torch.tensor([0.05, 0.5, 2.0], dtype=torch.float64)
    dG, dGh = _fold_drifts(layer, z, rn)
    n1, ffn = layer.norm_attn, layer.ffn
    for c in (4.0, 3.0):
        lc = dataclasses.replace(layer, norm_attn=dataclasses.replace(n1, weight=n1.weight * c, bias=n1.bias * c),
                                 ffn=dataclasses.replace(ffn, W_1=ffn.W_1 / c))
        same = [ffn_forward(L.ffn, L.norm_attn(h)) for L in (lc, layer)]  # the FFN as a function of n
        assert torch.allclose(*same, rtol=1e-12, atol=1e-12)
        dGc, dGhc = _fold_drifts(lc, z, rn)
        if c == 4.0:
            assert torch.equal(dGc, dG) and torch.equal(dGhc, dGh)
        else:
            assert torch.allclose(dGc, dG, rtol=1e-9) and torch.allclose(dGhc, dGh, rtol=1e-9)
    lw = dataclasses.replace(layer, ffn=dataclasses.replace(ffn, W_2=ffn.W_2 * 4.0))
    dGw, dGhw = _fold_drifts(lw, z, rn)
    assert torch.allclose(dGw, 4.0 * dG, rtol=1e-9) and torch.allclose(dGhw, 4.0 * dGh, rtol=1e-9)


def test_rounding_pad_is_zero_only_for_float32_values():
    """``fl(diag(gamma) W_1)`` is exact for float32-valued factors (no pad), padded otherwise."""
    layer, _, _ = _case(2, "outlier", "post", False)
    assert folded_layer(layer)[1] > 0.0
    n1, ffn = layer.norm_attn, layer.ffn
    l32 = dataclasses.replace(layer, norm_attn=dataclasses.replace(n1, weight=n1.weight.float().double()),
                              ffn=dataclasses.replace(ffn, W_1=ffn.W_1.float().double()))
    fl, e = folded_layer(l32)
    assert e == 0.0
    exact = [[float(a) * float(b) for b in row] for a, row in zip(l32.norm_attn.weight.tolist(), l32.ffn.W_1.tolist())]
    assert fl.ffn.W_1.tolist() == exact  # Python floats: the same IEEE products


@pytest.mark.slow
def test_new_never_above_old_on_minilm(monkeypatch, shared_tmp):
    """(d) Real MiniLM layers 0 and 3, one real sentence, rho = 1e-3, 1e-2 of the median token norm: with the fold
    every token's ball row, drift row and output radius is at most its row without it (F37a alone: the first pass
    refines as without the fold), every drift part too, and at 1e-2 the FFN term falls.  Layer 0's rows with the fold
    are the ones ``minilm_layer0_rows`` shares with F47's and F51a's MiniLM tests (12 tokens); layer 3 sees the
    sentence cut to 7 tokens (its two ``layer_rows`` 12 s CPU instead of 20 s; the FFN term 0.76x, 0.78x at 12)."""
    from transcover.model._data import load_inputs

    spec, X, radii, rows0 = minilm_layer0_rows(shared_tmp)
    X3 = spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=7, limit=2)[1].double())
    for layer in spec.layers[:3]:
        X3 = layer_forward(layer, X3)
    for li, Xl in ((0, X), (3, X3)):
        L = spec.layers[li]
        rhos = [rho * float(Xl.norm(dim=1).median()) for rho in (1e-3, 1e-2)]
        new = rows0 if li == 0 else layer_rows(L, Xl, rhos)
        with monkeypatch.context() as m:
            m.setattr(_local_gamma_fold, "folded_layer", lambda layer: None)
            old = layer_rows(L, Xl, rhos)
        for a, b in zip(new, old):
            for rows in ("total_rows", "drift_rows", "output_radii"):
                assert bool((getattr(a, rows) <= getattr(b, rows)).all()), (li, rows)
            assert all(a.parts[k] <= b.parts[k] for k in b.parts), (li, a.parts, b.parts)
            assert bool((a.stage_radii["ffn"] <= b.stage_radii["ffn"]).all())
        assert new[1].parts["ffn (dF)"] < 0.9 * old[1].parts["ffn (dF)"], (new[1].parts, old[1].parts)
