"""The attention's first-order drift through the prefix's reachable rows (issue 12, ``lipschitz._local_stack_attn``,
THEORY F44): the projected second-derivative sup and the reach are never beaten by a float64 Adam ascent (random
and sharp heads, biases, causal masks; points of the ball, rows of the prefix), their homogeneity in ``W_V`` and in
the prefix, the whole network against pair-ratio and Jacobian-norm ascent (post- and pre-LN), and a regression on
a deep stack.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lipschitz_testkit import random_spec
from batched_stage_ascents import batched_jvp, bilinear_lowers, token_lowers
from test_lipschitz_local import adversary
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz._local_drift import head_second_derivative
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_lower import bilinear_lower
from transcover.lipschitz._local_stack import certified_rows, stack_local
from transcover.lipschitz._local_stack_aligned import FFNAligned, ellipsoid_gram
from transcover.lipschitz._local_rows import _HeadMoments
from transcover.lipschitz._local_stack_attn import AttentionAligned, head_projections
from transcover.lipschitz._local_stack_stages import _attn_stage
from transcover.model import attention_forward, attention_scores, ffn_forward
from transcover.model._functional import transformer_forward

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _layer(seed: int, qscale: float = 1.0, causal: bool = False, vscale: float = 1.0, d: int = 6, H: int = 2):  # noqa: ANN202
    """A post-LN layer with biases (``qscale`` > 1: sharp heads) and its attention."""
    L = random_spec(seed, act="gelu", norm="layernorm", d=d, H=H, dh=d // H, dff=8, biases=True, causal=causal).layers[0]
    attn = dataclasses.replace(L.attention, W_Q=L.attention.W_Q * qscale, W_V=L.attention.W_V * vscale)
    return dataclasses.replace(L, attention=attn), attn


def _case(seed: int, T: int = 4, d: int = 6, pscale: float = 1.0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed + 1)
    X = torch.randn(T, d, generator=g, dtype=torch.float64) * 1.5
    P = pscale * torch.randn(T, T, d, d, generator=g, dtype=torch.float64) / d**0.5
    return X, P


def _aligned(layer, X: torch.Tensor, P: torch.Tensor) -> AttentionAligned:  # noqa: ANN001
    st_, _ = _attn_stage("a", 0, layer, X, None, {"w": _weight_norms(layer), "h": head_norms(layer.attention)})
    return AttentionAligned(st_.attn, P)


def _rows(P: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The rows (P h)_k = sum_j P_kj h_j (h of shape (..., T, d): per leading batch entry)."""
    return torch.einsum("kjab,...jb->...ka", P, h)


def _second_derivatives(attn, X: torch.Tensor, P: torch.Tensor, rho: float, mixed: bool, h: int):  # noqa: ANN001, ANN202
    """``values`` of ``bilinear_lowers`` (K = T objectives, objective i query i's): ``||H_i(Z)[Delta, E]||`` of head
    ``h`` (``head_second_derivative``, F35a) at ``Z = X + rho hz[T:]``, ``Delta = P hz[:T]`` (the unit rows themselves:
    ``mixed``), ``E = P v[:T]``, for points (R, T, 2T, d).  The softmax row at Z is read without gradient, as
    ``_head_data`` reads it (``certified_weights`` detaches Z): here the plain softmax of the same scores
    (``attention_scores``), equal to rounding; the rest is ``head_second_derivative``'s algebra on batches."""
    Wq, Wk, Wv, _ = attn.head(h)
    G = attn.softmax_scale * Wq @ Wk.T
    Wqa = attn.W_Q_augmented(h)
    T = X.shape[0]
    i = torch.arange(T)

    def values(hz: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # (R, T, 2T, d) each: [s, i] objective i's
        Z = X + rho * hz[..., T:, :]
        Pz = torch.softmax(attention_scores(attn, Z.detach(), h), dim=-1)[:, i, i]  # (R, T, T): query i's row
        Zi = Z[:, i, i]
        Y = Z - (Pz[..., None, :] @ Z)  # y_j = z_j - sum_k P_ik z_k
        q = attn.softmax_scale * (torch.cat([Zi, torch.ones_like(Zi[..., :1])], dim=-1) @ Wqa) @ Wk.T
        D = hz[..., :T, :] if mixed else _rows(P, hz[..., :T, :])
        E = _rows(P, v[..., :T, :])
        Di, Ei = D[:, i, i], E[:, i, i]
        dt, et = D - Pz[..., None, :] @ D, E - Pz[..., None, :] @ E
        Gy = Y @ G.T
        a = (Gy @ Di[..., None])[..., 0] + (dt @ q[..., None])[..., 0]
        c = (Gy @ Ei[..., None])[..., 0] + (et @ q[..., None])[..., 0]
        cross = (dt @ (Ei @ G)[..., None])[..., 0] + (et @ (Di @ G)[..., None])[..., 0]
        inner = ((Pz * a)[..., None, :] @ et + (Pz * c)[..., None, :] @ dt + (Pz * (a * c + cross))[..., None, :] @ Y)
        return (inner[..., 0, :] @ Wv).norm(dim=-1)
    return values


@pytest.mark.parametrize("seed,mixed,causal", [(3, False, False), (8, True, True)])
def test_batched_second_derivative_is_the_librarys(seed, mixed, causal):
    """``_second_derivatives`` (the batched objective of the ascent below) is ``head_second_derivative`` at the point's
    ``_head_data`` (certified weights), per head, query and random point, to float64 rounding."""
    layer, attn = _layer(seed, 1.0, causal)
    X, P = _case(seed)
    T, d = X.shape
    g = torch.Generator().manual_seed(seed)
    hz, v = (torch.randn(2, T, 2 * T, d, generator=g, dtype=torch.float64) for _ in range(2))
    for h in range(attn.n_heads):
        got = _second_derivatives(attn, X, P, 0.3, mixed, h)(hz, v)
        for s in range(2):
            for i in range(T):
                Pz, Y, q, Wq, Wk, Wv, _ = _head_data(attn, X + 0.3 * hz[s, i, T:])[h]
                D = hz[s, i, :T] if mixed else _rows(P, hz[s, i, :T])
                ref = head_second_derivative(Pz[i], Y[i], q[i], attn.softmax_scale * Wq @ Wk.T, Wv, i, D,
                                             _rows(P, v[s, i, :T])).norm()
                assert torch.isclose(got[s, i], ref, rtol=1e-12, atol=0.0), (h, s, i, got[s, i], ref)


@settings(max_examples=5, **_SETTINGS)
@given(seed=st.integers(0, 10_000), qscale=st.sampled_from([1.0, 5.0]), causal=st.booleans(),
       rho=st.sampled_from([0.0, 0.05, 0.5]), mixed=st.booleans())
def test_projected_second_derivative_is_never_beaten(seed, qscale, causal, rho, mixed):
    """sup over points Z of B(X, rho) (every token on its sphere), prefix rows E = P v and Delta = P h (or, ``mixed``,
    Delta = h in the unit ball), (2,inf)-unit h, v, of ||H_i(Z)[Delta, E]|| per head and query (F35a's second
    derivative at Z, Adam ascent) stays below ``aligned_hessian_sup`` (THEORY F44b), and reaches a fair share of it
    at the data point on some row where the head is neither sharp nor degenerate (sharp heads: ascent ~1 % of the bound)."""
    layer, attn = _layer(seed, qscale, causal)
    X, P = _case(seed)
    al = _aligned(layer, X, P)
    T, d = X.shape
    sup = al.sup(max(rho, 1e-300), mixed)
    shares = []
    for h in range(len(al.proj)):
        values = _second_derivatives(attn, X, P, rho, mixed, h)
        # per query i, bilinear_lower of ||H_i(Z)[Delta, E]|| (2 restarts x 30 steps, seed seed + i), every i in one batch
        for i, lo in enumerate(bilinear_lowers(values, (2 * T, d), [seed + i for i in range(T)], restarts=2, steps=30)):
            assert lo <= float(sup[h, i]), (h, i, lo, sup)
            if rho == 0 and qscale == 1.0 and (al.p["mom"].rows[h]["P"][i] > 0).sum() > 1:
                shares.append(lo / float(sup[h, i]))
    # the attack is not vacuous: at the data point it reaches a fair share of the bound on some soft row (per row it
    # can be far lower: a causal example in CI, query 2 of head 0, gave 0.8 %: a loose row, not a beaten one)
    assert not shares or max(shares) >= 0.02, shares


@pytest.mark.parametrize("seed,rho,qscale", [(1, 0.02, 1.0), (2, 0.2, 1.0), (3, 0.05, 5.0), (4, 1.0, 1.0)])
def test_reach_is_never_beaten_behind_a_linear_prefix(seed, rho, qscale):
    """Behind a linear prefix (dP = 0 exactly), sup over ||h_j|| <= rho and (2,inf)-unit v of
    ||[(DA(X + P h) - DA(X)) P v]_k|| (the attention with its output map and biases; Adam ascent) stays below the
    reach v_k of ``AttentionAligned`` (THEORY F44c), from the Taylor regime to far outside it."""
    layer, attn = _layer(seed, qscale)
    X, P = _case(seed)
    al = _aligned(layer, X, P)
    nu = certified_rows(P)
    reach = al.reach(rho * nu * (1 + 1e-12), nu, rho, torch.zeros_like(nu), 0.0, 0.0)
    A = lambda Z: attention_forward(attn, Z)  # noqa: E731

    def F(h, v):  # noqa: ANN001, ANN202 -- on batches of pairs (R, K, T, d): E = P v, the move P (rho h)
        E = _rows(P, v)
        return batched_jvp(A, X + _rows(P, rho * h), E) - batched_jvp(A, X, E)
    # per token k, bilinear_lower of ||F(h, v)_k|| (2 restarts x 50 steps, seed seed + k), every k in one batch
    for k, lo in enumerate(token_lowers(F, X.shape, [seed + k for k in range(X.shape[0])], restarts=2, steps=50)):
        assert 0 < lo <= float(reach[k]), (k, lo, reach)


def assert_drift_rows_hold(al, attn, X: torch.Tensor, P: torch.Tensor, rho: float, seed: int) -> torch.Tensor:  # noqa: ANN001
    """``AttentionAligned.drift``'s rows behind the linear prefix ``P`` (dP = 0) against Adam ascent (per query k) of
    ``||[(DA(X + P h) - DA(X)) E]_k||`` over ``||h_j|| <= rho`` and (2,inf)-unit E (THEORY F44e); the rows."""
    nu = certified_rows(P)
    dZ = torch.full((len(al.proj), X.shape[0]), math.inf, dtype=torch.float64)
    rows, _ = al.drift(rho * nu * (1 + 1e-12), rho, torch.zeros_like(nu), 0.0, 0.0, (dZ, 1.0, 0.0))
    A = lambda Z: attention_forward(attn, Z)  # noqa: E731
    F = lambda h, E: batched_jvp(A, X + _rows(P, rho * h), E) - batched_jvp(A, X, E)  # noqa: E731
    # per query k, bilinear_lower of ||F(h, E)_k|| (2 restarts x 50 steps, seed seed + k), every k in one batch
    for k, lo in enumerate(token_lowers(F, X.shape, [seed + k for k in range(X.shape[0])], restarts=2, steps=50)):
        assert 0 < lo <= float(rows[k]), (k, lo, rows)
    return rows


@pytest.mark.parametrize("seed,rho,qscale", [(1, 0.02, 1.0), (3, 0.05, 5.0), (4, 0.5, 1.0)])
def test_drift_rows_are_never_beaten_behind_a_linear_prefix(seed, rho, qscale):
    """Behind a linear prefix (dP = 0), the drift rows for moves along the prefix's rows, sup over ||h_j|| <= rho and
    (2,inf)-unit E of ||[(DA(X + P h) - DA(X)) E]_k|| (attention, THEORY F44e) and of ||(F'(H_k + (P h)_k) -
    F'(H_k)) e|| (a GELU FFN, F44f), by Adam ascent, stay below ``AttentionAligned.drift`` / ``FFNAligned.drift``."""
    from test_local_stack_aligned import _case as ffn_case, _jac

    layer, attn = _layer(seed, qscale)
    X, P = _case(seed, pscale=0.3)
    assert_drift_rows_hold(_aligned(layer, X, P), attn, X, P, rho, seed)
    ffn, H, Pf = ffn_case(seed, pscale=0.3)
    fa = FFNAligned(ffn, H, Pf, {})
    nuf = certified_rows(Pf)
    rows = fa.drift(rho * nuf * (1 + 1e-12), rho, torch.zeros_like(nuf), 0.0, 0.0)
    for k in range(H.shape[0]):
        J0 = _jac(ffn, H[k]).detach()
        lo = bilinear_lower(lambda h, e, k=k, J0=J0: ((_jac(ffn, H[k] + _rows(Pf, rho * h)[k]) - J0) @ e[k]).norm(),
                            H.shape, restarts=2, steps=50, seed=seed + k)
        assert 0 < lo <= float(rows[k]), (k, lo, rows)


def test_homogeneity_in_the_values_and_the_prefix():
    """``W_V -> c W_V``: the value projections scale by c (``||Q^{1/2} W_V||^2`` by c^2) and the projected sup by c
    (every term of F44b carries one value factor); ``P -> c P``: every projection ``||Q^{1/2} W||`` by c (the
    ellipsoid by c^2) and the sup by c^2 (two rows of the prefix), at the point and on a ball."""
    layer, attn = _layer(7)
    X, P = _case(7)
    base = _aligned(layer, X, P)

    sup = AttentionAligned.sup
    for c in (0.5, 3.0):
        lv, av = _layer(7, vscale=c)
        vals = _aligned(lv, X, P)
        assert torch.allclose(vals.proj[0]["mV2"], c * c * base.proj[0]["mV2"], rtol=1e-9, atol=0.0)
        for mixed in (False, True):
            assert torch.allclose(sup(vals, 1e-12, mixed), c * sup(base, 1e-12, mixed), rtol=1e-6, atol=0.0)
        scaled = _aligned(layer, X, c * P)
        for key in ("mQ2", "mK2", "mV2"):
            assert torch.allclose(scaled.proj[1][key], c * c * base.proj[1][key], rtol=1e-9, atol=0.0)
        assert torch.allclose(scaled.proj[1]["om2"], c * c * base.proj[1]["om2"], rtol=1e-9, atol=0.0)
        for rho in (1e-12, 0.1):
            assert torch.allclose(sup(scaled, rho), c * c * sup(base, rho), rtol=1e-6, atol=0.0)
            assert torch.allclose(sup(scaled, rho, True), c * sup(base, rho, True), rtol=1e-6, atol=0.0)


def test_projections_bound_the_ellipsoid_ascent():
    """The projected norms are the sups over the ellipsoid: for random prefix rows a = sum_j B_kj h_j (unit h_j),
    ||W^T a|| <= ||Q_k^{1/2} W|| and |q_i . a| <= ||Q_k^{1/2} q_i|| (THEORY F44a), and an ascent gets close."""
    layer, attn = _layer(3)
    X, P = _case(3)
    T = X.shape[0]
    grams = [ellipsoid_gram(P[j]) for j in range(T)]
    heads = _head_data(attn, X)
    proj = head_projections(heads, _HeadMoments(heads, attn.softmax_scale), torch.stack([g[0] for g in grams]),
                            torch.tensor([g[1] for g in grams], dtype=torch.float64), attn.softmax_scale)
    Wv, q = attn.W_V[0].double(), _head_data(attn, X)[0][2]
    for k in range(T):
        lo = bilinear_lower(lambda h, v, k=k: (_rows(P, h)[k] @ Wv).norm() + 0 * v.sum(), X.shape, steps=80)
        assert lo <= float(proj[0]["mV2"][k]) ** 0.5 and lo >= 0.3 * float(proj[0]["mV2"][k]) ** 0.5
        for i in range(T):
            lo = bilinear_lower(lambda h, v, k=k, i=i: (_rows(P, h)[k] @ q[i]).abs() + 0 * v.sum(), X.shape, steps=60)
            assert lo <= float(proj[0]["om2"][i, k]) ** 0.5 * (1 + 1e-9)


CASES = [dict(norm="layernorm", placement="post"), dict(norm="layernorm", placement="post", causal=True),
         dict(norm="layernorm", placement="pre", final_norm=True)]


@settings(max_examples=4, **_SETTINGS)
@given(seed=st.integers(0, 10_000), rho=st.sampled_from([1e-3, 1e-2, 5e-2]), case=st.sampled_from(CASES),
       L=st.sampled_from([2, 3]))
def test_whole_network_is_never_beaten(seed, rho, case, L):
    """The certified bound (and the point plus the middle-product drift) of the whole network with F44's reach
    against the adversary (Adam ascent on pair ratios and Jacobian norms in the ball, restarts), post- and
    pre-LN, 2-3 layers, T = 4, d = 8."""
    spec = random_spec(seed, act="gelu", L=L, biases=True, d=8, H=2, dh=4, **case)
    X = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    r = stack_local(spec, X, [rho])[0]
    lo = adversary(lambda Z: transformer_forward(spec, Z, with_head=False), X, rho, restarts=2, steps=15, seed=seed)
    assert lo <= r.upper and lo <= (r.point + r.parts["(middle products)"]) * (1 + 1e-12), (lo, r.point, r.parts)


def test_f44_tightens_a_deep_stack():
    """Regression (issue 12, THEORY F44): the 6-layer post-LN GELU stack of ``test_local_stack_aligned``; with F40
    the middle-product drift was 1.150 at rho = 1e-5 (drift 1.070) and the bound 524.6 at 1e-4; with the
    attention's reach through the prefix's ellipsoids (F44a-c) 0.2576 and 21.73; with the spans telescoped the
    other way (F44d) 0.2259 and 14.10; with the drift rows for moves along the prefix's rows (F44e, F44f) 0.2126 and
    10.89; with the heads' reach through the layer's token-local product (F44g) 0.1828 and 8.770; every attention's
    reach is smaller."""
    spec = random_spec(1, act="gelu", L=6, norm="layernorm", placement="post", d=6, dff=8, eps=1e-5, biases=True)
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    small, large = stack_local(spec, X, [1e-5, 1e-4])
    assert small.parts["(middle products)"] <= 0.1828 and small.drift <= 0.1828
    assert large.upper <= 8.770
    for name, (plain, used) in small.reaches.items():
        assert "attention" not in name or used < 0.6 * plain, (name, plain, used)
    lo = adversary(lambda Z: transformer_forward(spec, Z, with_head=False), X, 1e-4, restarts=2, steps=15, seed=1)
    assert lo <= large.upper


def _sub_stages(spec) -> list:  # noqa: ANN001
    """The post-LN stack's sub-stage maps in order (input norm; per layer x + A(x), LN1, h + FFN(h), LN2)."""
    out = [spec.input_norm]
    for ly in spec.layers:
        out += [lambda Z, ly=ly: Z + attention_forward(ly.attention, Z), ly.norm_attn,
                lambda Z, ly=ly: Z + ffn_forward(ly.ffn, Z), ly.norm_ffn]
    return out


@pytest.mark.parametrize("seed,rho", [(2, 0.02), (5, 0.1)])
def test_prefix_span_drifts_are_never_beaten(seed, rho):
    """The prefix drift rows at every layer cut, ``spans[(0, b)] >= sup_y nu_i(P_b(y) - P_b(x))`` (F36 with F40,
    F44a-c's reaches and F44d's other telescoping; they set the radii), against Adam ascent over y in B(X, rho)
    and (2,inf)-unit tangents, per output token."""
    spec = random_spec(seed, act="gelu", L=2, norm="layernorm", placement="post", d=6, dff=8, biases=True)
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    r = stack_local(spec, X, [rho])[0]
    fs = _sub_stages(spec)
    for b in range(1, len(r.cuts)):
        def pre(Z, n=r.cuts[b]):  # noqa: ANN001, ANN202
            for f in fs[:n]:
                Z = f(Z)
            return Z
        F = lambda h, v, pre=pre: batched_jvp(pre, X + rho * h, v) - batched_jvp(pre, X, v)  # noqa: E731
        # per token i, bilinear_lower of ||F(h, v)_i|| (2 restarts x 25 steps, seed seed + i), every i in one batch
        for i, lo in enumerate(token_lowers(F, X.shape, [seed + i for i in range(X.shape[0])], restarts=2,
                                            steps=25)):
            assert lo <= float(r.spans[(0, b)][i]), (b, i, lo, r.spans[(0, b)])


@pytest.mark.parametrize("rho", [1e-3, 5e-2])
def test_reach_and_drift_behind_a_nonlinear_prefix_are_never_beaten(monkeypatch, rho):
    """Inside ``stack_local`` (prefix drift, rounding and pads as computed there): layer 1's attention sub-stage
    (prefix: input norm and layer 0, post-LN GELU, W_Q x 2) -- the reach ``nu_k((J(y_s) - J(x_s)) P_s(x))`` (F44c) and
    the drift rows ``nu_k(J(y_s) - J(x_s))`` (F44e) it records, against Adam ascent over y in the network's ball
    B(X, rho) (through the exact nonlinear prefix) and (2,inf)-unit v (E = P_s(x) v) or E."""
    import transcover.lipschitz._local_stack_attn as attn_mod

    spec = random_spec(2, act="gelu", norm="layernorm", placement="post", d=6, H=2, dh=3, dff=8, L=2, biases=True)
    spec = dataclasses.replace(spec, layers=[dataclasses.replace(
        ly, attention=dataclasses.replace(ly.attention, W_Q=2 * ly.attention.W_Q)) for ly in spec.layers])
    X = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 2
    seen: dict = {"reach": [], "drift": []}
    reach0, drift0 = attn_mod.AttentionAligned.reach_heads, attn_mod.AttentionAligned.drift

    def reach(self, *args):  # noqa: ANN001, ANN202
        out = reach0(self, *args)
        seen["reach"].append(self.combined(out))
        return out

    def drift(self, *args):  # noqa: ANN001, ANN202
        out = drift0(self, *args)
        seen["drift"].append(out[0].clone())
        return out

    monkeypatch.setattr(attn_mod.AttentionAligned, "reach_heads", reach)
    monkeypatch.setattr(attn_mod.AttentionAligned, "drift", drift)
    stack_local(spec, X, [rho])
    assert len(seen["reach"]) == 2 and len(seen["drift"]) == 2  # one attention per layer
    fs = _sub_stages(spec)
    pre = lambda Z: fs[4](fs[3](fs[2](fs[1](fs[0](Z)))))  # noqa: E731
    att = lambda Z: fs[5](Z)  # noqa: E731
    dP = lambda v: batched_jvp(pre, X, v)  # noqa: E731
    xs = pre(X).detach()
    # per token k, bilinear_lower (2 restarts x 30 steps, seed k) of the reach's and of the drift's objective, every
    # k of each in one batch
    seeds = list(range(X.shape[0]))
    reach = token_lowers(lambda h, v: batched_jvp(att, pre(X + rho * h), dP(v)) - batched_jvp(att, xs, dP(v)),
                         X.shape, seeds, restarts=2, steps=30)
    drift = token_lowers(lambda h, E: batched_jvp(att, pre(X + rho * h), E) - batched_jvp(att, xs, E), X.shape, seeds,
                         restarts=2, steps=30)
    for k in seeds:
        assert 0 < reach[k] <= float(seen["reach"][1][k]), (k, reach[k], seen["reach"][1])
        assert 0 < drift[k] <= float(seen["drift"][1][k]), (k, drift[k], seen["drift"][1])
