"""Red team of F54 (the FFN remainder on the first norm's reachable set) and F53 (F44b's centred maximum, the joint
query Gram), and the fix of red17-2 (THEORY F51a: the per-unit intervals around the exact pre-activation).

red17-2: ``z = fl(h W_1 + b_1)`` is off the exact pre-activation by up to ``gamma_{d+2}(|h| |W_1| + |b_1|)``
(``pre_activations``' ``ez``); at a unit on GELU''s zero with cancelling ``h ~ 1e5`` every per-unit term (F31d's slope
moves, F38's N2 and third order, F51a, F54, the exact-Jacobian route's ``_ffn_drift``) fell below the exact value on
tiny balls; with ``ez`` each is above it (mpmath), and without it each is still beaten (so the reproducer bites).
F54: the exact supremum of a single unit (where every Cauchy-Schwarz is tight) over GELU''s extrema, zeros and
saturation, reaches from 1e-14 to 1e3; Adam ascent with restarts from the units' own maximisers on multi-unit FFNs;
homogeneity; the true S2 move of small post-LN layers (T = 1, 2, d = 2..8, eps 1e-12 and 1, causal, sharp, saturated,
heterogeneous gamma, tiny sigma1) never above ``r2`` with F54 on every token (no gate) and with the gate.
F53: ``centred_max`` and ``joint_query_lmax`` on one key (T = 1), equal scores (W_Q = 0), one-hot softmax and all
heads equal (Cauchy-Schwarz over the heads tight), against ascent and the dense Gram.
"""

from __future__ import annotations

import dataclasses
import math

import mpmath
import pytest
import torch

from batched_redteam_ascents import unit_sup
from lipschitz_testkit import hetero_gamma, random_spec
from transcover.lipschitz import _local_stages
from transcover.lipschitz._local_ffn2 import ffn_hadamard, ffn_second_norms, ffn_taylor_drift
from transcover.lipschitz._local_ffn_reach import ffn_reach_remainder
from transcover.lipschitz._local_jacobian import _ffn_drift, _ffn_weight_norms, pre_activations
from transcover.lipschitz._local_rows import layer_rows
from transcover.lipschitz._local_sharp import unit_slope_moves
from transcover.model import Activation, attention_forward, ffn_forward
from transcover.model._spec import FFNSpec

F64 = torch.float64


def _sig(z):  # noqa: ANN001, ANN202
    """GELU(z) = z Phi(z) in mpmath."""
    return z * mpmath.ncdf(z)


def _g1(z):  # noqa: ANN001, ANN202
    return mpmath.ncdf(z) + z * mpmath.npdf(z)


def _mp(x) -> mpmath.mpf:  # noqa: ANN001
    return mpmath.mpf(float(x))


# -- red17-2: the reproducer through every per-unit term ---------------------------------------------------------------
def _red17_2():  # noqa: ANN202
    """One unit, ``h = (100000.3, -99999.7)``: ``fl(z) = fl(sqrt 2)`` (GELU''s zero) where the two-term dot is rounded
    product by product, ``sqrt 2 + 7.1e-12`` where the CPU's kernel fuses them (FMA), the exact pre-activation
    ``sqrt 2 + 1.39e-11`` (mpmath, from the float64 data); ``W_2 = e_1`` (uncentred: every norm is the unit's)."""
    h = torch.tensor([100000.3, -99999.7], dtype=F64)
    W1 = torch.tensor([[1.0000000000000298], [0.9999999999999937]], dtype=F64)
    ffn = FFNSpec(W_1=W1, W_2=torch.eye(1, 2, dtype=F64), activation=Activation.GELU,
                  b_1=torch.tensor([0.8142135587729513], dtype=F64), b_2=torch.zeros(2, dtype=F64))
    z, ez = pre_activations(ffn, h[None])
    exact_z = mpmath.fsum(_mp(a) * _mp(w) for a, w in zip(h, W1[:, 0])) + _mp(ffn.b_1[0])
    assert abs(exact_z - _mp(z[0, 0])) > 5e-12 and float(ez[0, 0]) > abs(exact_z - _mp(z[0, 0]))
    n1 = mpmath.sqrt(mpmath.fsum(_mp(x) ** 2 for x in W1[:, 0]))
    return ffn, z, ez, exact_z, n1


def _both(f):  # noqa: ANN001, ANN202
    """``f(ez)`` with the pre-activations' rounding and without it (None / zeros)."""
    return float(f(True)), float(f(False))


def test_red17_2_every_per_unit_term_holds_with_the_pre_activation_rounding():
    """The red17-2 reproducer at ``r = 1e-16`` (F31d, F38b/c, F51a's sibling terms, the exact-Jacobian route) and
    ``r = 1e-13`` (F54, a remainder of order ``r^2``): each certified value with ``ez`` is at least the exact one
    (mpmath at the exact centre), and each without ``ez`` is below it (the reproducer exposes every site; measured
    1.3e-13 against 5.7e-12 per unit of F31d's move, 25x on F54)."""
    mpmath.mp.dps = 60
    ffn, z, ez, zs, n1 = _red17_2()
    n1t = ffn.W_1.norm(dim=0)
    r = 1e-16
    rt = torch.tensor([r], dtype=F64)
    s = n1 * r
    move = max(abs(_g1(zs + t) - _g1(zs)) for t in (s, -s))  # GELU' is monotone on so small an interval
    with_, without = _both(lambda e: unit_slope_moves(z, n1t, rt, ez if e else None)[0, 0])
    assert float(move) <= with_ and without < float(move), (float(move), with_, without)
    const = ffn_hadamard(ffn, centred=False)
    drift = move * n1  # rank one: ||J(h + dh) - J(h)|| = |slope move| ||w1|| ||w2||, ||w2|| = 1
    with_, without = _both(lambda e: ffn_taylor_drift(const, ffn_second_norms(const, z, ez if e else None), z, n1t,
                                                      rt, ez if e else None)[0][0])
    assert float(drift) <= with_ and without < float(drift), (float(drift), with_, without)
    norms = _ffn_weight_norms(ffn)
    with_, without = _both(lambda e: _ffn_drift(ffn, (z, ez if e else torch.zeros_like(ez)), rt, norms,
                                                0.8 * norms["ffn_curv"])[0])
    assert float(drift) <= with_ and without < float(drift), (float(drift), with_, without)
    r = 1e-13
    s = n1 * r
    rem = max(abs(_sig(zs + t) - _sig(zs) - _g1(zs) * t) for t in (s, -s))
    one = torch.ones(1, dtype=F64)
    with_, without = _both(lambda e: ffn_reach_remainder(
        const, n1t, z, torch.eye(2, dtype=F64)[None], torch.zeros(1, dtype=F64), one, r, 0 * one, r * one,
        ez if e else None)[0])
    assert float(rem) <= with_ and without < float(rem), (float(rem), with_, without)


def test_pre_activation_rounding_bound_holds_on_adversarial_magnitudes():
    """``pre_activations``' ``ez`` is never below ``|fl(z) - z*|`` (mpmath, exact products of the float64 data) on
    cancelling rows at 2^60 and 2^-60, subnormal products, bf16/float32-representable weights and MiniLM-like sizes
    (d 384); and it is 0-free (subnormal floor) where everything cancels exactly."""
    mpmath.mp.dps = 80
    g = torch.Generator().manual_seed(18)
    for d, scale, wdt in ((2, 2.0**60, F64), (8, 2.0**-60, torch.bfloat16), (5, 1e-160, F64), (384, 30.0, torch.float32),
                          (3, 1.0, F64)):
        W1 = (torch.randn(d, 6, generator=g, dtype=F64)).to(wdt).double()
        h = torch.randn(d, generator=g, dtype=F64) * scale
        h[-1] = -(h[:-1] @ W1[:-1, 0]) / W1[-1, 0]  # unit 0 cancels to ~ rounding
        b1 = torch.randn(6, generator=g, dtype=F64) * scale * 1e-3
        ffn = FFNSpec(W_1=W1, W_2=torch.ones(6, d, dtype=F64), activation=Activation.GELU, b_1=b1,
                      b_2=torch.zeros(d, dtype=F64))
        z, ez = pre_activations(ffn, h[None])
        for k in range(6):
            exact = mpmath.fsum(_mp(a) * _mp(w) for a, w in zip(h, W1[:, k])) + _mp(b1[k])
            assert abs(_mp(z[0, k]) - exact) <= _mp(ez[0, k]), (d, scale, k, float(z[0, k]), float(ez[0, k]))
        assert bool((ez > 0).all())


# -- F54: the exact supremum of one unit --------------------------------------------------------------------------------
def _one_unit(z0: float, d: int, seed: int):  # noqa: ANN202
    """One GELU unit whose pre-activation at the centre ``h = 0`` is ``z0`` (the bias), random ``w1``, ``w2`` and a
    random ellipsoid ``Q`` of rank ``d - 1`` (a flat direction)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(d, 1, generator=g, dtype=F64)
    w2 = torch.randn(1, d, generator=g, dtype=F64)
    ffn = FFNSpec(W_1=w1, W_2=w2, activation=Activation.GELU, b_1=torch.tensor([z0], dtype=F64),
                  b_2=torch.zeros(d, dtype=F64))
    L = torch.randn(d, d - 1, generator=g, dtype=F64)
    return ffn, L @ L.T


def _reach_bound(ffn: FFNSpec, Q: torch.Tensor, r: float, remH: float) -> float:
    const = ffn_hadamard(ffn, centred=True)
    z, ez = pre_activations(ffn, torch.zeros(1, Q.shape[0], dtype=F64))
    rh = r * math.sqrt(float(torch.linalg.eigvalsh(Q)[-1])) * (1 + 1e-9) + remH
    one = torch.ones(1, dtype=F64)
    return float(ffn_reach_remainder(const, ffn.W_1.norm(dim=0) * (1 + 1e-12), z, Q[None], torch.zeros(1, dtype=F64),
                                     one, r, remH * one, rh * one, ez)[0])


@pytest.mark.parametrize("z0", [0.0, math.sqrt(2), -2.0, 0.7922876485147344, 2.524257372700608, 6.0, -9.0])
def test_f54_single_unit_exact_supremum(z0):
    """One unit (every Cauchy-Schwarz of F54b tight): the exact sup of the centred remainder over the reachable set
    (``batched_redteam_ascents.unit_sup``) is never above F54b, for the pre-activation at GELU''s peak (0), zero (sqrt 2), trough (-2), at
    GELU'''s extrema, saturated (6, -9), reaches ``R0`` from 1e-14 to 1e3, with and without ``remH``.  On the small
    reaches (r 1e-9 and 1e-4, the Taylor regime) it is within 0.5 of it wherever GELU'' or GELU''' is away from 0 (the
    bound is then the second- or third-order term itself): a bound 2x loose fails."""
    mpmath.mp.dps = 40
    ffn, Q = _one_unit(z0, 4, 7)
    for r in (1e-14, 1e-9, 1e-4, 0.3, 3.0, 1e3):
        for remH in (0.0, 0.5 * r):
            exact = float(unit_sup(ffn, Q, r, remH))
            cert = _reach_bound(ffn, Q, r, remH)
            assert exact <= cert, (z0, r, remH, exact, cert)
            if 1e-9 <= r <= 1e-4 and abs(z0) < 5:
                assert exact >= 0.5 * cert, (z0, r, remH, exact, cert)


def test_f54_joint_scale_of_the_ellipsoid_and_radius():
    """Homogeneity of exponent 0: ``Q x c^2`` with ``r / c`` is the same reachable set, so the same bound (1e-9)."""
    ffn, Q = _one_unit(0.3, 5, 3)
    for remH in (0.0, 0.2):
        base = _reach_bound(ffn, Q, 0.7, remH)
        for c in (2.0**-20, 3.0, 2.0**30):
            assert _reach_bound(ffn, Q * c * c, 0.7 / c, remH) == pytest.approx(base, rel=1e-9)


# -- F54 through the layer: the true S2 move never above r2 -------------------------------------------------------------
def _every_token(at, pt, gram, fn, ffn_drift, r):  # noqa: ANN001, ANN202
    """``ffn_reach`` without its gate (F54c): F54b on every token (the gate may only cost tightness)."""
    base = getattr(ffn_drift, "base", ffn_drift)
    out = torch.full((at.T,), math.inf, dtype=F64)
    if base.taylor is None or at.sig2 is None:
        return out
    Sa, ea = at.n1.sandwich(gram.S, gram.err)  # each token's own D1 S_i D1^T (ffn23: a slice read token 0's D1)
    for i in range(at.T):
        out[i] = ffn_reach_remainder(base.taylor, base.n1, at.z[i:i + 1], Sa[i:i + 1], ea[i:i + 1], gram.wsum[i:i + 1], r,
                                     fn.remH[i:i + 1], fn.rh[i:i + 1], at.ez[i:i + 1])[0]
    return out


def _stress_layer(d: int, seed: int, *, eps: float, causal: bool, qscale: float, bias: float, gamma: str):  # noqa: ANN202
    """A post-LN GELU layer built to stress F54: the first-layer biases shifted by ``bias`` (0: units near GELU''s
    peak, -4: saturated, 1.4: at GELU''s zero), ``W_Q x qscale`` (sharp softmax), heterogeneous gamma1, ``eps``."""
    layer = random_spec(seed, act="gelu", norm="layernorm", placement="post", d=d, H=2, dh=max(d // 2, 1), dff=4 * d,
                        biases=True, causal=causal, scale=2.0, eps=eps).layers[0]
    g = torch.Generator().manual_seed(seed)
    ffn = dataclasses.replace(layer.ffn, b_1=layer.ffn.b_1 * 0.1 + bias)
    attn = dataclasses.replace(layer.attention, W_Q=layer.attention.W_Q * qscale)
    return dataclasses.replace(layer, ffn=ffn, attention=attn,
                               norm_attn=dataclasses.replace(layer.norm_attn, weight=hetero_gamma(gamma, d, g)))


def _s2_ascent(layer, X: torch.Tensor, r: float, seed: int, starts: int = 4, steps: int = 60) -> torch.Tensor:  # noqa: ANN001
    """Per token, the largest ``||P(S2(X + E) - S2(X))||`` seen by Adam ascent (float64, rows of E within r,
    projected; ``starts`` starts on the sphere), less the float64 evaluation's own noise ``64 d u (|S2| + |X| + 1)``
    (at r = 1e-14 the computed difference is that noise: 9.4e-16 against a certified 5.1e-20 at d = 2)."""
    d = X.shape[1]
    P = torch.eye(d, dtype=F64) - 1.0 / d

    def s2(Z: torch.Tensor) -> torch.Tensor:
        H = layer.norm_attn(Z + attention_forward(layer.attention, Z))
        return (H + ffn_forward(layer.ffn, H)) @ P

    ref = s2(X)
    noise = 64 * d * 2.0**-53 * (ref.norm(dim=-1) + X.norm(dim=-1) + 1)  # the float64 evaluation of S2 itself
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(starts, *X.shape, generator=g, dtype=F64)
    E = (E / E.norm(dim=-1, keepdim=True) * r).requires_grad_(True)
    opt = torch.optim.Adam([E], lr=0.1 * r)
    best = torch.zeros(X.shape[0], dtype=F64)
    for _ in range(steps):
        with torch.no_grad():
            E.mul_(torch.clamp(r / E.norm(dim=-1, keepdim=True).clamp(min=1e-300), max=1.0))
        val = (s2(X + E) - ref).norm(dim=-1)  # (starts, T): s2 acts on the leading batch axis, start by start
        best = torch.maximum(best, val.detach().amax(dim=0))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return (best - noise).clamp(min=0.0)


@pytest.mark.parametrize("d,T,eps,causal,qscale,bias,gamma,radii", [
    (2, 1, 1e-12, False, 1.0, 0.0, "plain", (1e-14, 1e-3, 0.3)), (4, 2, 1e-12, False, 1.0, 0.0, "flat", (1e-5, 1e-3)),
    (4, 2, 1e-12, True, 8.0, 1.4, "negative", (1e-6, 0.03, 1e3)),
    (8, 2, 1.0, False, 1.0, -4.0, "outlier", (0.01, 0.3, 3.0)),
    (8, 5, 1e-12, True, 6.0, 0.0, "tiny", (1e-3, 0.05)),
    (6, 4, 1e-12, False, 1.0, 0.0, "negative", (0.02, 0.1))])
def test_f54_true_s2_move_never_above_r2(d, T, eps, causal, qscale, bias, gamma, radii, monkeypatch):
    """The FFN stage radius ``r2`` of ``layer_rows`` with F54 on every token (gate removed) and with F54c's gate is
    never below Adam ascent on the true centred S2 move over the input ball (4 starts x 60 steps): T = 1, 2, 4, 5, d =
    2..8, eps 1e-12 and 1, causal and sharp heads, units at GELU''s peak, zero and saturated, gamma1 signed, with
    outliers or tiny entries, tokens nearly constant (sigma1 ~ 1e-3), radii 1e-14 to 1e3.  The gate only ever takes away a ``min`` branch: the gated ``r2``
    is at least the ungated one, token by token, and F54 is finite and wins somewhere (the attack is not idle)."""
    layer = _stress_layer(d, 3 + d + T, eps=eps, causal=causal, qscale=qscale, bias=bias, gamma=gamma)
    X = torch.randn(T, d, generator=torch.Generator().manual_seed(d * T), dtype=F64) * 2
    if gamma == "flat":  # every token nearly constant: the first norm's sigma ~ 1e-3, its floor near
        X = 2.0 + X * 1e-3
    seen = []
    monkeypatch.setattr(_local_stages, "ffn_reach", lambda *a: seen.append(_every_token(*a)) or seen[-1])
    free = layer_rows(layer, X, list(radii))
    monkeypatch.undo()
    gated = layer_rows(layer, X, list(radii))
    for k, r in enumerate(radii):
        got = _s2_ascent(layer, X, r, seed=k)
        r2f, r2g = free[k].stage_radii["ffn"], gated[k].stage_radii["ffn"]
        assert bool((got <= r2f).all()) and bool((r2f <= r2g).all()), (r, got, r2f, r2g)
    assert any(bool(torch.isfinite(s).any()) for s in seen)


# -- F53: the centred maximum and the joint query Gram on adversarial heads ---------------------------------------------
def _f53_case(kind: str, seed: int):  # noqa: ANN202
    """(layer, attn, X, P): ``one-key`` T = 1; ``equal`` every token the same (equal scores, uniform softmax, yet
    moving scores); ``one-hot`` W_Q x 60 (a saturated softmax, causal); ``aligned`` every head a copy of head 0 (the
    Cauchy-Schwarz over the heads tight), sharp and causal."""
    from test_local_stack16 import _layer
    from test_local_stack_attn import _case

    T = 1 if kind == "one-key" else 4
    qscale = {"one-hot": 60.0, "aligned": 5.0}.get(kind, 1.0)
    layer, attn = _layer(seed, qscale, causal=kind in ("one-hot", "aligned"), aligned=kind == "aligned")
    X, P = _case(seed, T=T)
    if kind == "equal":
        X = X[:1].expand_as(X).clone()
    return layer, attn, X, P


@pytest.mark.parametrize("kind,rho,mixed", [("one-key", 0.3, False), ("equal", 0.2, True), ("one-hot", 0.1, False),
                                            ("aligned", 0.05, True)])
def test_f53a_centred_max_on_adversarial_heads(kind, rho, mixed):
    """Per head and query, Adam ascent (bilinear, 2 restarts x 50 steps) over the point of ``B(X, rho)`` and the
    tangent (prefix ellipsoid rows or the unit ball) of the largest visible centred score change never exceeds
    ``centred_max`` (THEORY F53a): one key (the change is 0), equal scores, a one-hot softmax, all heads equal."""
    import transcover.lipschitz._local_stack_attn as stack_attn
    from batched_stage_ascents import bilinear_lowers, score_changes
    from test_local_stack_attn import _aligned

    layer, attn, X, P = _f53_case(kind, 5)
    al = _aligned(layer, X, P)
    T, d = X.shape
    w = al.p["norms"]
    for h, (pj, m) in enumerate(zip(al.proj, al.p["mom"].rows)):
        side = al.ball[h] if mixed else pj
        hs = stack_attn.head_sides(side, pj, m, rho, w["G"][h], w["V"][h], float(al.nQ[h]), float(al.nK[h]),
                                   al.p["scale"])
        chat = hs.one[1]
        assert bool(torch.isfinite(chat).all()), chat
        # per query i, bilinear_lower of score_change(attn, X, P, rho, mixed, h, i) (2 restarts x 50 steps, seed
        # 11 + i): every query's ascent in one batch, the same draws and steps
        los = bilinear_lowers(score_changes(attn, X, P, rho, mixed, h), (T, d), [11 + i for i in range(T)],
                              restarts=2, steps=50)
        for i, lo in enumerate(los):
            assert lo <= float(chat[i]) + 1e-12 * float(chat.max()), (kind, h, i, lo, chat)


@pytest.mark.parametrize("kind", ["one-key", "equal", "one-hot", "aligned"])
def test_f53b_joint_query_gram_on_adversarial_heads(kind):
    """``joint_query_lmax`` against the dense weighted Gram on the adversarial heads (never below, within 1e-6; all
    heads equal: the joint Gram is the weighted sum of the heads' own, Cauchy-Schwarz over the heads tight, 1e-9)."""
    from test_local_stack17 import _dense_query_lmax
    from test_local_stack_attn import _aligned
    from transcover.lipschitz._local_stack_query import joint_query_lmax

    layer, attn, X, P = _f53_case(kind, 9)
    al = _aligned(layer, X, P)
    heads, sc = al.p["heads"], al.p["scale"]
    T, d = X.shape
    w = torch.rand(len(heads), T, generator=torch.Generator().manual_seed(2), dtype=F64) + 0.1
    for Q, eQ, lG in ((al.Qs, al.eQ, [pj["lG"] for pj in al.proj]), (None, None, [b["lG"] for b in al.ball])):
        got = joint_query_lmax(heads, Q, eQ, sc, w)
        ref = _dense_query_lmax(heads, torch.eye(d, dtype=F64).expand(T, d, d) if Q is None else Q, sc, w)
        assert bool((got >= ref).all()) and bool((got <= ref * (1 + 1e-6) + 1e-12 * ref.max() + 1e-300).all()), (got, ref)
        per_head = (w * torch.stack(lG)).sum(dim=0)
        assert bool((got <= per_head * (1 + 1e-9) + 1e-300).all())
        if kind == "aligned":
            # (a query with one visible key: exactly 0 against the per-head pads' 2e-11)
            assert bool((got >= per_head * (1 - 1e-6) - 1e-10 * float(per_head.max())).all()), (got, per_head)


def _unit_starts(ffn, Ls: torch.Tensor, w: torch.Tensor, r: float, remH: float, n: int) -> list:  # noqa: ANN001
    """Starts ``(D, R)`` at the reachable set's maximisers of ``+-w1_k . dh`` for the ``n`` units of largest reach
    (``D_j = r L_j^T w1_k / ||.||`` weighted as the ellipsoid's extreme point, ``R = remH w1_k / ||w1_k||``)."""
    W1 = ffn.W_1.double()
    reach = torch.stack([(Ls[j].T @ W1).norm(dim=0) for j in range(Ls.shape[0])]).sum(0)
    out = []
    for k in reach.argsort(descending=True)[:n].tolist():
        D = torch.stack([Ls[j].T @ W1[:, k] for j in range(Ls.shape[0])])
        D = r * D / D.norm(dim=1, keepdim=True).clamp(min=1e-300)
        R = remH * W1[:, k] / W1[:, k].norm()
        out += [(D, R), (-D, -R)]
    return out


@pytest.mark.parametrize("seed,d,dff,scale,bias,rank,r,remH", [
    (21, 2, 16, 2.0, None, 1, 0.4, 0.0), (22, 4, 32, 3.0, 1.4, 2, 0.3, 0.1), (23, 8, 48, 6.0, -4.0, 8, 0.05, 0.02),
    (24, 8, 48, 2.0, 0.0, 3, 2.0, 1.0), (25, 3, 24, 2.0, None, 3, 1e-4, 1e-5)])
def test_f54_multi_unit_ascent_from_the_units_maximisers(seed, d, dff, scale, bias, rank, r, remH):
    """Adam ascent (float64, projected) on F54b's centred remainder over the reachable set from random starts AND from
    each leading unit's own maximiser (the directions where one unit's second-order term peaks), d = 2..8, units at
    GELU''s peak (``bias=None``), zero (1.4), saturated (-4, scale 6), rank-1 maps, tiny and large reaches: never
    above the bound."""
    from test_local_layer17 import _ascent, _bound, _case

    ffn, h, Ls, w = _case(seed, d, dff, scale, bias, rank)
    bound, _ = _bound(ffn, h, Ls, w, r, remH)
    d = h.shape[0]
    g = torch.Generator().manual_seed(seed)
    starts = _unit_starts(ffn, Ls, w, r, remH, 3) + [
        (torch.randn(Ls.shape[0], d, generator=g, dtype=F64) * r, torch.randn(d, generator=g, dtype=F64) * remH)
        for _ in range(2)]
    best = _ascent(ffn, h, Ls, r, remH, seed, starts=starts, steps=40, lr=0.05)
    assert math.isfinite(bound) and best <= bound, (best, bound)


@pytest.mark.parametrize("c", [2.0**-60, 2.0**60, 2.0**-7])
def test_f54_input_scale_exponent_zero_on_bf16_weights(c):
    """``W_1 x c`` with the centre, the moves and ``remH`` divided by c is the same map on the same reachable set
    (every pre-activation and unit move unchanged, exactly: powers of two): F54b is unchanged (1e-9), on
    bf16-representable weights at 2^-60 and 2^60 (Grams near 2^+-240)."""
    from test_local_layer17 import _bound, _case

    ffn, h, Ls, w = _case(31, 6, 24, 2.0, 0.0, 4)
    ffn = dataclasses.replace(ffn, W_1=ffn.W_1.to(torch.bfloat16).double(), W_2=ffn.W_2.to(torch.bfloat16).double())
    h = h.to(torch.bfloat16).double()
    base, _ = _bound(ffn, h, Ls, w, 0.3, 0.1)
    got, _ = _bound(dataclasses.replace(ffn, W_1=ffn.W_1 * c), h / c, Ls / c, w, 0.3, 0.1 / c)
    assert math.isfinite(base) and got == pytest.approx(base, rel=1e-9), (got, base)


@pytest.mark.parametrize("kind,rho,drift", [("one-key", 0.3, 0.5), ("equal", 0.1, 0.0), ("one-hot", 0.05, 0.5)])
def test_f53b_branch_reach_on_adversarial_heads(kind, rho, drift, monkeypatch):
    """F53b's branch alone (``test_local_stack17._f53_as_reach``) behind a linear prefix, against bilinear ascent over the
    move and the tangent (``aligned_reach_case``) on one key, equal scores and a one-hot softmax: never beaten."""
    from test_local_redteam14_stack import aligned_reach_case
    from test_local_stack17 import _f53_as_reach
    from transcover.lipschitz._local_lower import bilinear_lower

    layer, _, X, P = _f53_case(kind, 7)
    _f53_as_reach(monkeypatch)
    reach, obj = aligned_reach_case(layer, X, P, rho, drift, 0.0)
    assert bool(torch.isfinite(reach).all()), reach
    for k in range(X.shape[0]):
        lo = bilinear_lower(obj(k), (2 * X.shape[0], X.shape[1]), restarts=2, steps=25, seed=7 + k)
        assert lo <= float(reach[k]), (kind, k, lo, reach)


def test_rows_route_input_scale_exponent_with_eps_0():
    """A post-LN layer whose attention is linear (``W_Q = 0``: uniform softmax) and whose norms have eps = 0: ``S1`` is
    linear in X and H, S2 and the output are scale-invariant, so on ``B(cX, c r)`` the rows are ``1/c`` times those on
    ``B(X, r)`` and the FFN stage radius (S2's move, F54's ``r2``) is the same; ``c = 2^k`` (exact scaling), k = -20, -3,
    10: equal to 1e-9 (measured: exactly)."""
    layer = random_spec(5, act="gelu", norm="layernorm", placement="post", d=6, H=2, dh=3, dff=24, eps=0.0).layers[0]
    layer = dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, W_Q=layer.attention.W_Q * 0))
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=F64) * 2
    radii = [1e-3, 0.05]
    base = layer_rows(layer, X, radii)
    for c in (2.0**-20, 2.0**-3, 2.0**10):
        for b, got in zip(base, layer_rows(layer, X * c, [r * c for r in radii])):
            assert got.ball * c == pytest.approx(b.ball, rel=1e-9) and got.point * c == pytest.approx(b.point, rel=1e-9)
            assert torch.allclose(got.stage_radii["ffn"], b.stage_radii["ffn"], rtol=1e-9, atol=0.0)
