"""Homogeneity of every certified bound: scale a weight by lambda (or the radius by mu) and the
bound must follow the known exponent of the true constant.

For each component the true constant is exactly homogeneous in some parameter (the map itself
scales): attention is degree 1 in W_V and W_O and satisfies Lip_R(lambda W_Q) = Lip_{sqrt(lambda) R}(W_Q)
(the scores are bilinear in X); L2 attention is degree 2 in W_Q (F(X) -> lambda F(lambda X));
the FFN is degree 1 in W_2 and, for positively homogeneous activations, in W_1; LayerNorm is degree
1 in gamma and degree -1 in (sigma_0, sqrt(eps)) together; a final LayerNorm's gamma scales the
whole network.  So two things are checked each time:

* where the bound is a product formula, ``bound(lambda) / bound(1)`` equals the exponent's power
  (tolerance: the certified norms are upper ends of intervals of relative width <= 1e-6, ``RT``);
* ``bound(lambda) >= measured(lambda)`` and ``bound(lambda) >= lambda^k measured(1)`` with the
  measured values from the independent attack of ``_attack`` (the second inequality is what a bound
  with a wrong exponent fails, e.g. the L2 attention bound linear in ||W_Q||, issue 10 item 1).
"""

import math
from dataclasses import replace

import pytest
import torch

from _attack import Domain, attack_gap, attack_pairs, fuzz_spec, ref_attention, ref_ffn, ref_norm, ref_stage, violates
from transcover.lipschitz import (
    attention_lipschitz, attention_perturbation_coefficients, ffn_lipschitz, ffn_perturbation_coefficients,
    head_lipschitz, l2_attention_lipschitz, layernorm_lipschitz, lipschitz_bounds, perturbation_bound,
    rmsnorm_lipschitz,
)
from transcover.lipschitz._weights import ROUNDING_PAD, layer_norms
from transcover.model import NormKind, NormSpec

RT = 1e-6  # relative width of the certified spectral-norm intervals the bounds read (_weights.spectral)
ATTACK = dict(restarts=6, steps=30)


def _close(ratio: float, expected: float, n_norms: int) -> bool:
    """ratio of two bounds, each a product of ``n_norms`` certified norms (each within RT of exact)."""
    tol = (1 + RT) ** (2 * n_norms) - 1 + 1e-12
    return abs(ratio / expected - 1) <= tol


def _attention_bound(attn, radius, metric, T):
    n = layer_norms(_layer_with(attn))
    if attn.kind == "l2":
        return l2_attention_lipschitz(list(n.B_Q), list(n.B_V), n.B_O, n.d_head, T, metric=metric,
                                      B_OV=list(n.B_OV))
    return attention_lipschitz(n.B_OV, n.B_KQ, radius, B_bKQ=n.B_bKQ, B_V=n.B_V, B_O=n.B_O, metric=metric,
                               seq_len=T)


def _layer_with(attn):
    base = fuzz_spec(0, d=attn.W_Q.shape[1]).layers[0]
    return replace(base, attention=attn)


def _scaled(attn, **factors):
    return replace(attn, **{k: getattr(attn, k) * v for k, v in factors.items()})


def _measure(f, T, d, radius, metric, seed, dom=None):
    return attack_pairs(f, T=T, d=d, dom=dom or Domain(radius), metric=metric, seed=seed, **ATTACK)


def _check(bound1, boundl, w1, wl, power, exact_norms):
    """The two checks of the module docstring; ``exact_norms`` = None for a non-product bound."""
    assert not violates(w1, bound1), (w1, bound1)
    assert not violates(wl, boundl), (wl, boundl)
    assert (w1.ratio - w1.slack) * power <= boundl, ("wrong exponent", w1.ratio, power, boundl)
    if exact_norms is not None:
        assert _close(boundl / bound1, power, exact_norms), (boundl / bound1, power)


# -- dot-product attention (F6): single/multi-head with W_O, biases, GQA, RoPE -----------------------
ATTN_CASES = [dict(H=1), dict(H=2, biases=True), dict(H=4, Hkv=2), dict(H=2, rope=True),
              dict(H=2, causal=True, biases=True)]


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_attention_is_degree_one_in_W_V_and_W_O(case):
    T, R, lam = 3, 1.5, 4.0
    metric = "fro" if len(case) % 2 else "2,inf"
    attn = fuzz_spec(7, scale=1.5, **case).layers[0].attention
    w1 = _measure(lambda X, s: ref_attention(attn, X), T, 6, R, metric, 1)  # the unscaled map: one attack for both
    for factors in (dict(W_V=lam), dict(W_O=lam)):
        big = _scaled(attn, **factors)
        b1, bl = _attention_bound(attn, R, metric, T), _attention_bound(big, R, metric, T)
        wl = _measure(lambda X, s: ref_attention(big, X), T, 6, R, metric, 2)
        _check(b1, bl, w1, wl, lam, exact_norms=2)


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_attention_W_Q_scaling_is_the_radius_scaling(case):
    """Lip_R(lambda W_Q, b_Q) = Lip_{sqrt(lambda) R}(W_Q, b_Q / sqrt(lambda)): the bound must obey the
    same identity (R^2 on ||A||, R on the bias term), and dominate both attacks."""
    T, R, metric = 3, 1.0, "2,inf"
    attn = fuzz_spec(11, scale=1.0, **case).layers[0].attention
    for lam in (0.25, 9.0):
        big = _scaled(attn, W_Q=lam)
        small_bias = attn if attn.b_Q is None else _scaled(attn, b_Q=1 / math.sqrt(lam))
        b_big = _attention_bound(big, R, metric, T)
        b_far = _attention_bound(small_bias, R * math.sqrt(lam), metric, T)
        assert _close(b_big / b_far, 1.0, 4)
        w_big = _measure(lambda X, s: ref_attention(big, X), T, 6, R, metric, 3)
        w_far = _measure(lambda X, s: ref_attention(small_bias, X), T, 6, R * math.sqrt(lam), metric, 4)
        assert not violates(w_big, b_big) and not violates(w_far, b_far)


def test_head_bound_pure_function_exponents():
    """Exact arithmetic of F6: degree 1 in B_out, affine in B_KQ with slope 2 c R^2 B_out ((2,inf))."""
    for metric, T in (("2,inf", None), ("fro", 5)):
        base = head_lipschitz(0.7, 1.3, 1.1, B_bKQ=0.4, metric=metric, seq_len=T)
        assert math.isclose(head_lipschitz(2.8, 1.3, 1.1, B_bKQ=0.4, metric=metric, seq_len=T), 4 * base,
                            rel_tol=1e-14)
        for lam in (0.5, 3.0, 40.0):
            a = head_lipschitz(0.7, 1.3 * lam, 1.1, B_bKQ=0.4, metric=metric, seq_len=T)
            b = head_lipschitz(0.7, 1.3, 1.1 * math.sqrt(lam), B_bKQ=0.4 / math.sqrt(lam), metric=metric, seq_len=T)
            assert math.isclose(a, b, rel_tol=1e-13)
    bound = head_lipschitz(1.0, 2.0, 3.0)
    assert math.isclose(bound - 1.0, 2 * 2.0 * 3.0**2, rel_tol=1e-14)


# -- L2 attention (Kim et al. 2021, THEORY F13) ------------------------------------------------------
@pytest.mark.parametrize("metric", ["fro", "2,inf"])
def test_l2_attention_bound_follows_the_quadratic_exponent_in_W_Q(metric):
    """W_Q -> lambda W_Q gives F -> lambda F(lambda .), so the global constant scales by lambda^2."""
    T = 3
    attn = fuzz_spec(5, kind="l2", H=2, scale=1.5).layers[0].attention
    for lam in (4.0, 16.0):
        big = _scaled(attn, W_Q=lam, W_K=lam)
        b1, bl = _attention_bound(attn, 1.0, metric, T), _attention_bound(big, 1.0, metric, T)
        # the bound is global: attack on a radius that holds the witnesses of both maps
        w1 = _measure(lambda X, s: ref_attention(attn, X), T, 6, 2.0, metric, 5)
        wl = _measure(lambda X, s: ref_attention(big, X), T, 6, 2.0 / lam, metric, 6)
        _check(b1, bl, w1, wl, lam**2, exact_norms=None)
    for name in ("W_V", "W_O"):  # degree 1 in the value and output maps
        big = _scaled(attn, **{name: 3.0})
        assert _close(_attention_bound(big, 1.0, metric, T) / _attention_bound(attn, 1.0, metric, T), 3.0, 4)


def test_l2_attention_issue_reproduction():
    """Issue 10 item 1: d = 2, W_Q = 4 I, W_V = W_O = I, tokens +-0.21 e_1: Jacobian norm 18.12."""
    from transcover.model import AttentionSpec

    eye = torch.eye(2, dtype=torch.float64)[None]
    attn = AttentionSpec(W_Q=4 * eye, W_K=4 * eye, W_V=eye, W_O=eye, kind="l2")
    X = torch.tensor([[0.21, 0.0], [-0.21, 0.0]], dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda Z: ref_attention(attn, Z), X).reshape(4, 4)
    exact = float(torch.linalg.matrix_norm(J, 2))
    assert 18.1 < exact < 18.2
    assert _attention_bound(attn, 1.0, "fro", 2) >= exact


# -- FFN (F7) ------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu", "identity"])
def test_ffn_bound_is_degree_one_in_W_1_and_W_2(act):
    T, R, lam = 2, 2.0, 3.0
    ffn = fuzz_spec(13, act=act, biases=True, scale=1.5).layers[0].ffn
    n = lambda m: layer_norms(replace(fuzz_spec(0).layers[0], ffn=m))  # noqa: E731
    bound = lambda m: ffn_lipschitz(n(m).B_W1, n(m).B_W2, act)  # noqa: E731
    homogeneous = act in ("relu", "identity")  # sigma(lambda t) = lambda sigma(t): the map scales exactly
    w1 = _measure(lambda X, s: ref_ffn(ffn, X), T, 6, R, "2,inf", 7)  # the unscaled map: one attack for both
    for scaled, power_exact in ((replace(ffn, W_2=lam * ffn.W_2), True),
                                (replace(ffn, W_1=lam * ffn.W_1, b_1=lam * ffn.b_1), homogeneous)):
        b1, bl = bound(ffn), bound(scaled)
        assert _close(bl / b1, lam, 2)  # a product formula: exact degree 1 for every activation
        wl = _measure(lambda X, s: ref_ffn(scaled, X), T, 6, R, "2,inf", 8)
        if power_exact:
            _check(b1, bl, w1, wl, lam, exact_norms=2)
        else:
            assert not violates(w1, b1) and not violates(wl, bl)


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_gated_ffn_bound_exponents(act):
    """Gated FFN on radius r: degree 1 in (W_1, b_1), in W_2, and (ReLU gate) in (W_gate, b_gate);
    without biases and with a ReLU gate the map is quadratic, so Lip on mu r is mu Lip on r."""
    T, r, lam = 2, 1.5, 2.5
    ffn = fuzz_spec(17, act=act, gated=True, biases=True, scale=1.5).layers[0].ffn
    nb = lambda m: layer_norms(replace(fuzz_spec(0).layers[0], ffn=m))  # noqa: E731

    def bound(m, rad):
        n = nb(m)
        return ffn_lipschitz(n.B_W1, n.B_W2, act, radius=rad, B_b1=n.B_b1, B_Wg=n.B_Wg, B_bg=n.B_bg)

    cases = [replace(ffn, W_1=lam * ffn.W_1, b_1=lam * ffn.b_1), replace(ffn, W_2=lam * ffn.W_2)]
    if act == "relu":
        cases.append(replace(ffn, W_gate=lam * ffn.W_gate, b_gate=lam * ffn.b_gate))
    w1 = _measure(lambda X, s: ref_ffn(ffn, X), T, 6, r, "2,inf", 9)  # the unscaled map: one attack for every case
    for scaled in cases:
        wl = _measure(lambda X, s: ref_ffn(scaled, X), T, 6, r, "2,inf", 10)
        _check(bound(ffn, r), bound(scaled, r), w1, wl, lam, exact_norms=3)
    if act == "relu":
        plain = replace(ffn, b_1=None, b_2=None, b_gate=None)
        w1 = _measure(lambda X, s: ref_ffn(plain, X), T, 6, r, "2,inf", 11)
        wl = _measure(lambda X, s: ref_ffn(plain, X), T, 6, lam * r, "2,inf", 12)
        _check(bound(plain, r), bound(plain, lam * r), w1, wl, lam, exact_norms=0)


# -- LayerNorm / RMSNorm (F14) and Pi_norm ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_bound_is_degree_one_in_gamma_and_minus_one_in_the_floor(kind):
    d, T = 5, 1
    g = torch.Generator().manual_seed(3)
    gamma = 1.0 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    fn = layernorm_lipschitz if kind == "layernorm" else rmsnorm_lipschitz
    fk = "std" if kind == "layernorm" else "rms"
    for eps, s0 in ((1e-2, 0.0), (1e-4, 0.3)):
        norm = NormSpec(NormKind(kind), gamma, None, eps)
        floor = max(s0, 1e-3)  # a positive floor for the eps-fixed monotonicity check
        dom = Domain(50.0, s0, fk) if s0 > 0 else Domain(2.0)
        b1 = fn(float(gamma.abs().max()), eps, s0)
        w1 = _measure(lambda X, s: ref_norm(norm, X), T, d, dom.radius, "2,inf", 13, dom)
        # gamma -> lambda gamma: the map scales by lambda
        big = replace(norm, weight=4.0 * gamma)
        wl = _measure(lambda X, s: ref_norm(big, X), T, d, dom.radius, "2,inf", 14, dom)
        _check(b1, fn(4.0 * float(gamma.abs().max()), eps, s0), w1, wl, 4.0, exact_norms=0)
        # (sigma_0, eps) -> (mu sigma_0, mu^2 eps): N'(x) = N(x / mu), the constant scales by 1/mu
        mu = 10.0
        wide = replace(norm, eps=mu * mu * eps)
        dom_w = Domain(mu * dom.radius, mu * s0, fk) if s0 > 0 else Domain(mu * dom.radius)
        bw = fn(float(gamma.abs().max()), mu * mu * eps, mu * s0)
        ww = _measure(lambda X, s: ref_norm(wide, X), T, d, dom_w.radius, "2,inf", 15, dom_w)
        _check(b1, bw, w1, ww, 1 / mu, exact_norms=0)
        # eps fixed, floor raised by mu: never below 1/mu of the old bound, never above it
        G = float(gamma.abs().max())
        assert fn(G, eps, floor) / mu <= fn(G, eps, mu * floor) <= fn(G, eps, floor)


@pytest.mark.parametrize("radius", [0.5, 1.0, 4.0])
def test_pi_norm_is_one_lipschitz_at_every_radius(radius):
    from transcover.lipschitz import ball_lipschitz

    ball = NormSpec(NormKind.BALL)
    for metric in ("2,inf", "fro"):
        w = _measure(lambda X, s: ref_norm(ball, X), 3, 4, radius, metric, 16)
        assert not violates(w, ball_lipschitz())
        assert w.ratio > 0.999  # 1 is attained (inside the unit ball the map is the identity)


# -- residual, composition per layer and whole network (F8) -----------------------------------------
def _scale_layer(spec, i, **f):
    layers = list(spec.layers)
    lay = layers[i]
    attn = replace(lay.attention, **{k: getattr(lay.attention, k) * v for k, v in f.items() if k.startswith("W_")
                                     and hasattr(lay.attention, k) and k in ("W_Q", "W_K", "W_V", "W_O")})
    layers[i] = replace(lay, attention=attn, **{k: v for k, v in f.items() if k.startswith("norm")})
    return replace(spec, layers=layers)


@pytest.mark.parametrize("metric", ["2,inf", "fro"])
def test_residual_stage_minus_one_is_degree_one_in_W_V(metric):
    """Stage ``x + attn(x)`` has constant 1 + Lip(attn): the branch part scales with W_V."""
    T, R, lam = 3, 1.2, 3.0
    spec = fuzz_spec(19, norm="none", placement="post", scale=1.5, input_norm=False)
    big = _scale_layer(spec, 0, W_V=lam)
    kw = dict(radius=R, metric=metric, seq_len=T if metric == "fro" else None)
    s1 = next(s for s in lipschitz_bounds(spec, **kw).stages if s.name == "attention")
    sl = next(s for s in lipschitz_bounds(big, **kw).stages if s.name == "attention")
    assert _close((sl.lipschitz - 1) / (s1.lipschitz - 1), lam, 2)
    for sp, st_, seed in ((spec, s1, 20), (big, sl, 21)):
        w = _measure(ref_stage(sp, 0, "attention"), T, 6, st_.radius_in, metric, seed)
        assert not violates(w, st_.lipschitz)


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_last_normalisation_gamma_scales_the_layer_and_the_network(placement):
    """A LayerNorm's gamma -> lambda gamma scales its map by lambda (beta is a constant).  For the
    last normalisation of the chain, nothing downstream changes, so the layer bound and the network
    bound scale by exactly lambda (a product formula, F8) -- and so does the true constant."""
    T, R, lam = 3, 1.5, 5.0
    spec = fuzz_spec(23, L=2, norm="layernorm", placement=placement, eps=0.1, final_norm=True, biases=True)
    fin = spec.final_norm
    big = replace(spec, final_norm=replace(fin, weight=lam * fin.weight))
    b1, bl = lipschitz_bounds(spec, radius=R), lipschitz_bounds(big, radius=R)
    assert math.isclose(bl.upper.value / b1.upper.value, lam, rel_tol=1e-12)
    assert math.isclose(bl.upper_uniform.value / b1.upper_uniform.value, lam, rel_tol=1e-12)
    prod = math.prod(s.lipschitz for s in b1.stages) * (1 + ROUNDING_PAD)
    assert math.isclose(b1.upper.value, prod, rel_tol=1e-15)
    w1 = _measure(ref_stage(spec, 0, "network"), T, 6, R, "2,inf", 24)
    wl = _measure(ref_stage(big, 0, "network"), T, 6, R, "2,inf", 25)
    _check(b1.upper.value, bl.upper.value, w1, wl, lam, exact_norms=0)
    if placement == "pre":  # a pre-norm layer's norms sit inside its branches: no exact scaling
        return
    # per layer: scale the last layer's last norm instead (no final norm), layer bound x lambda
    nofin = replace(spec, final_norm=None)
    last = nofin.layers[-1]
    name = "norm_ffn"
    scaled = replace(nofin, layers=[nofin.layers[0], replace(last, **{name: replace(
        getattr(last, name), weight=lam * getattr(last, name).weight)})])
    c1, cl = lipschitz_bounds(nofin, radius=R), lipschitz_bounds(scaled, radius=R)
    assert math.isclose(cl.layer_upper(1).value / c1.layer_upper(1).value, lam, rel_tol=1e-12)
    assert math.isclose(cl.upper.value / c1.upper.value, lam, rel_tol=1e-12)
    r1 = next(s.radius_in for s in c1.stages if s.layer == 1)
    w1 = _measure(ref_stage(nofin, 1, "layer"), T, 6, r1, "2,inf", 26)
    wl = _measure(ref_stage(scaled, 1, "layer"), T, 6, r1, "2,inf", 27)
    _check(c1.layer_upper(1).value, cl.layer_upper(1).value, w1, wl, lam, exact_norms=0)


def test_network_bound_is_monotone_in_the_radius():
    """The domain grows with R, so the true constant cannot decrease; neither may the bound."""
    spec = fuzz_spec(29, L=2, norm="none", scale=1.2, biases=True)
    prev = 0.0
    for R in (0.25, 0.5, 1.0, 2.0):
        b = lipschitz_bounds(spec, radius=R).upper.value
        assert b >= prev
        prev = b
        w = _measure(ref_stage(spec, 0, "network"), 3, 6, R, "2,inf", 30)
        assert not violates(w, b)


# -- perturbation coefficients (Lemma G.3) ----------------------------------------------------------
def test_perturbation_coefficient_exponents():
    """Attention: W_KQ degree 1 in B_OV and 3 in R, b_KQ 1 and 2, W_OV degree 1 in R; FFN: W_1 degree
    1 in B_W2 and in r, W_2 degree 1 in B_W1 and in r (no b_1)."""
    def att(b, r):
        return {k: c for k, c, _ in attention_perturbation_coefficients([b], r, has_query_bias=True)}

    a1, a2 = att(0.8, 1.3), att(2.0 * 0.8, 3.0 * 1.3)
    assert math.isclose(a2["W_KQ.0"] / a1["W_KQ.0"], 2.0 * 27.0, rel_tol=1e-14)
    assert math.isclose(a2["b_KQ.0"] / a1["b_KQ.0"], 2.0 * 9.0, rel_tol=1e-14)
    assert math.isclose(a2["W_OV.0"] / a1["W_OV.0"], 3.0, rel_tol=1e-14)
    assert a2["b_out"] == a1["b_out"] == 1.0

    def ffn(w1, w2, r):
        return {k: c for k, c, _ in ffn_perturbation_coefficients(w1, w2, "relu", r, has_b1=False)}

    f1, f2 = ffn(0.7, 1.1, 1.5), ffn(2.0 * 0.7, 5.0 * 1.1, 3.0 * 1.5)
    assert math.isclose(f2["W_1"] / f1["W_1"], 5.0 * 3.0, rel_tol=1e-14)
    assert math.isclose(f2["W_2"] / f1["W_2"], 2.0 * 3.0, rel_tol=1e-14)


def _one_attention_layer(seed):
    """One head, no normalisation, a zero FFN: nothing downstream amplifies the attention's change
    (one head, so R ||dW_OV|| is attained: with several heads the bound sums their norms)."""
    spec = fuzz_spec(seed, H=1, norm="none", input_norm=False, scale=1.2)
    lay = spec.layers[0]
    zero = replace(lay.ffn, W_1=torch.zeros_like(lay.ffn.W_1))
    return replace(spec, layers=[replace(lay, ffn=zero)])


@pytest.mark.parametrize("role", ["W_V", "W_Q"])
def test_perturbation_bound_scales_with_the_perturbation_and_the_radius(role):
    """A change of W_V moves the output by P X dW_OV: degree 1 in the change and in R, and R ||dW_OV||
    is attained (repeated tokens).  A change of W_Q alone is charged c B_OV R^3 ||dW_KQ||: degree 3 in R
    as a product formula; the measured change must stay below it at every scale."""
    a = _one_attention_layer(31)
    g = torch.Generator().manual_seed(32)
    direction = torch.randn(a.layers[0].attention.W_Q.shape, generator=g, dtype=torch.float64)

    def moved(t):
        return _scale_layer_add(a, role, t * direction)

    ref = ref_stage(a, 0, "network")
    for t, R in ((1e-3, 1.0), (3e-3, 1.0), (1e-3, 2.0)):
        b = moved(t)
        bound = perturbation_bound(a, b, radius=R).total.value
        base = perturbation_bound(a, moved(1e-3), radius=1.0).total.value
        power = (t / 1e-3) * (R if role == "W_V" else R**3)
        assert _close(bound / base, power, 2), (bound / base, power)
        w = attack_gap(ref, ref_stage(b, 0, "network"), T=3, d=6, dom=Domain(R), metric="2,inf", seed=33,
                       restarts=8, steps=40)
        assert not violates(w, bound)
        if role == "W_V":  # the fixed-input term is exact: the attack reaches it
            assert w.ratio >= 0.99 * bound


def _scale_layer_add(spec, name, delta):
    lay = spec.layers[0]
    return replace(spec, layers=[replace(lay, attention=replace(lay.attention, **{
        name: getattr(lay.attention, name) + delta}))])
