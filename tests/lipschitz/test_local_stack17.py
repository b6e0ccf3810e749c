"""F53: the largest centred score change without F44b's factor 2, the heads' query moves joined (THEORY F53).

Attacks: Adam ascent (float64, restarts) on the centred score change's largest entry at points of the ball, on the
attention's reach behind linear prefixes with F53b's branch alone (random, all-equal heads where the Cauchy-Schwarz
over the heads is tight, sharp causal heads, prefix drift and rounding) and through a per-token map; the joint query
Gram and the value side against their dense formation; homogeneity; the whole network against pair-ratio and
Jacobian-row ascent and never above the bound without F53; MiniLM layer 0 below F50.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import transcover.lipschitz._local_stack_attn as stack_attn
from batched_stage_ascents import bilinear_lowers, score_changes
from lipschitz_testkit import random_spec
from batched_bilinear_ascents import checked, reach_lowers, reach_values
from test_local_redteam14_stack import aligned_reach_case
from test_local_stack15 import assert_network_below
from test_local_stack16 import _layer
from test_local_stack_attn import _aligned, _case, _rows
from transcover.lipschitz._local_jacobian import _head_data
from transcover.lipschitz._local_rows import _head_output_norms
from transcover.lipschitz._local_stack import certified_rows, stack_local
from transcover.lipschitz._local_stack_query import joint_query_lmax, value_lmax
from transcover.model import attention_forward


def _old_centred_max(P, a, gn, qmove, om):  # noqa: ANN001, ANN202
    """F44b's ``2 max_j (||g_ij|| + qmove + om_ij)`` (before F53a)."""
    cj = gn + qmove[:, None] + om
    return 2 * torch.where(P > 0, cj, torch.zeros_like(cj)).max(dim=1).values


def _without_f53(monkeypatch) -> None:  # noqa: ANN001
    """F44b's centred maximum, F50's branch alone (F53b's and F68's, built on it, refused)."""
    monkeypatch.setattr(stack_attn, "centred_max", _old_centred_max)
    orig = stack_attn.AttentionAligned.branch
    refused = lambda self: (torch.full((self.p["heads"][0][0].shape[0],), math.inf, dtype=torch.float64),) * 2  # noqa: E731
    monkeypatch.setattr(stack_attn.AttentionAligned, "branch", lambda self, rm, rho, emax, eP, query, through=True: (
        orig(self, rm, rho, emax, eP, query, through) if query else refused(self)))
    monkeypatch.setattr(stack_attn.AttentionAligned, "hadamard_branch",
                        lambda self, rm, rho, emax, eP, through=True: refused(self))


def score_change(attn, X: torch.Tensor, P: torch.Tensor, rho: float, mixed: bool, h: int, i: int):  # noqa: ANN001, ANN201
    """The ascent objective of F53a's tests: at the point ``Z = X + rho hz`` and the tangent ``v`` (its rows in the
    prefix's ellipsoids, or in the unit ball: ``mixed``), head ``h``'s largest visible centred score change of query
    ``i``, ``max_j |ds_ij - sum_k P'_ik ds_ik|``."""
    Wq, Wk, bq, bk = attn.W_Q[h], attn.W_K[h], attn.b_Q[h], attn.b_K[h]

    def obj(hz, v):  # noqa: ANN001, ANN202
        Z = X + rho * hz
        E = v if mixed else _rows(P, v)
        Pz = _head_data(attn, Z)[h][0][i]
        ds = attn.softmax_scale * ((E[i] @ Wq) @ (Z @ Wk + bk).T + (Z[i] @ Wq + bq) @ (E @ Wk).T)
        c = ds - (Pz * ds).sum()
        return torch.where(Pz > 0, c.abs(), torch.zeros_like(c)).max()
    return obj


@pytest.mark.parametrize("seed,qscale,causal,rho,mixed", [(1, 1.0, False, 0.0, False), (3, 8.0, True, 0.3, True)])
def test_centred_score_change_is_never_beaten(seed, qscale, causal, rho, mixed):
    """Per head and query, Adam ascent over the point Z of ``B(X, rho)`` and the tangent (rows in the prefix's
    ellipsoids, or in the unit ball: ``mixed``) of ``max_{visible j} |c_j|``, ``c_j = ds_ij - sum_k P'_ik ds_ik`` the
    centred score change at Z, stays below ``centred_max`` (THEORY F53a), which is never above F44b's ``2 max F_j``
    and strictly below it somewhere; at the data point of a soft head the ascent reaches >= 30 % of it."""
    layer, attn = _layer(seed, qscale, causal)
    X, P = _case(seed)
    al = _aligned(layer, X, P)
    T, d = X.shape
    w = al.p["norms"]
    below = False
    for h, (pj, m) in enumerate(zip(al.proj, al.p["mom"].rows)):
        side = al.ball[h] if mixed else pj
        hs = stack_attn.head_sides(side, pj, m, rho, w["G"][h], w["V"][h], float(al.nQ[h]), float(al.nK[h]),
                                   al.p["scale"])
        chat = hs.one[1]
        # per query i, bilinear_lower(score_change(attn, X, P, rho, mixed, h, i), (T, d), restarts=2, steps=40,
        # seed=seed + i): every query's ascent in one batch, the same draws and steps (``score_changes``, its values
        # checked against ``score_change`` on every query)
        objs = [score_change(attn, X, P, rho, mixed, h, i) for i in range(T)]
        los = bilinear_lowers(checked(score_changes(attn, X, P, rho, mixed, h), objs, 1e-12 * float(chat.max())),
                              (T, d), [seed + i for i in range(T)], restarts=2, steps=40)
        for i, lo in enumerate(los):
            assert lo <= float(chat[i]), (h, i, lo, chat)
            if rho == 0 and qscale == 1.0 and (m["P"][i] > 0).sum() > 1:
                assert lo >= 0.3 * float(chat[i]), (h, i, lo, chat)
        P_, a = m["P"], hs.a
        gn = torch.sqrt(side["g2"])
        mQ = torch.sqrt(side["mQ2"])
        qmove = al.p["scale"] * mQ * float(al.nK[h]) * rho
        om = torch.sqrt(side["om2"]) + (al.p["scale"] * float(al.nQ[h]) * rho) * torch.sqrt(side["mK2"])[None, :]
        old = _old_centred_max(P_, a, gn, qmove, om)
        assert bool((chat <= old).all()), (chat, old)
        below = below or bool((chat < 0.9 * old).any())
    assert below


def _dense_query_lmax(heads, Q, scale, w):  # noqa: ANN001, ANN202
    """``lambda_max(sum_h w_hi sum_j P_hij g g^T)``, ``g = Q_i^{1/2} G_h y_hij``, formed densely (eigh roots)."""
    T = heads[0][0].shape[0]
    out = []
    for i in range(T):
        ev, V = torch.linalg.eigh(Q[i])
        R = V @ torch.diag(ev.clamp(min=0).sqrt()) @ V.T
        S = sum(w[h, i] * R @ (scale * hd[3] @ hd[4].T) @ (hd[1][i].T * hd[0][i]) @ hd[1][i]
                @ (scale * hd[3] @ hd[4].T).T @ R for h, hd in enumerate(heads))
        out.append(float(torch.linalg.eigvalsh(0.5 * (S + S.T))[-1]))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("seed,qscale,causal", [(11, 1.0, False), (12, 8.0, True)])
def test_joint_query_gram_against_dense_and_homogeneity(seed, qscale, causal):
    """``joint_query_lmax`` against the dense ``sum_h w_h Q^{1/2} G_h Y^T P Y G_h^T Q^{1/2}`` (an ellipsoid family and
    the unit ball): never below it, within 1e-6 of it; ``W_Q`` or ``W_K`` of every head x 2 (the weights and P held):
    x 4, the weights x 2: x 2; never above the weighted sum of the heads' own ``lambda_max`` (F44a's ``lG``)."""
    layer, attn = _layer(seed, qscale, causal)
    X, P = _case(seed)
    al = _aligned(layer, X, P)
    heads, sc = al.p["heads"], al.p["scale"]
    T, d = X.shape
    w = torch.rand(len(heads), T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1
    for Q, eQ, lG in ((al.Qs, al.eQ, [pj["lG"] for pj in al.proj]),
                      (None, None, [b["lG"] for b in al.ball])):
        got = joint_query_lmax(heads, Q, eQ, sc, w)
        ref = _dense_query_lmax(heads, torch.eye(d, dtype=torch.float64).expand(T, d, d) if Q is None else Q, sc, w)
        assert bool((got >= ref).all()) and bool((got <= ref * (1 + 1e-6) + 1e-12 * ref.max()).all()), (got, ref)
        assert bool((got <= (w * torch.stack(lG)).sum(dim=0) * (1 + 1e-9)).all())
        for k in (3, 4):
            sc2 = [tuple(2 * t if n == k else t for n, t in enumerate(hd)) for hd in heads]
            assert torch.allclose(joint_query_lmax(sc2, Q, eQ, sc, w), 4 * got, rtol=1e-9)
        assert torch.allclose(joint_query_lmax(heads, Q, eQ, sc, 2 * w), 2 * got, rtol=1e-9)


def test_value_side_against_dense():
    """``value_lmax`` against the dense ``lambda_max(MO blockdiag(K_h / w_h) MO^T)``: never below, within 1e-6."""
    layer, _ = _layer(21)
    X, P = _case(21)
    al = _aligned(layer, X, P)
    cores = al.cores()
    MO, eMO = al._maps(False)
    H, T = len(al.proj), X.shape[0]
    w = torch.rand(H, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.1
    for K in ("E", "N"):
        got, _ = value_lmax(w, cores[K], cores["err"][K], MO, eMO)
        core = cores[K].expand(H, T, *cores[K].shape[2:])
        for i in range(T):
            B = torch.block_diag(*[core[h, i] / w[h, i] for h in range(H)])
            ref = float(torch.linalg.eigvalsh(MO[i] @ B @ MO[i].T)[-1])
            assert ref <= float(got[i]) <= ref * (1 + 1e-6), (K, i, got, ref)


def _f53_as_reach(monkeypatch) -> None:  # noqa: ANN001
    """``AttentionAligned.reach`` replaced by F53b's branch alone (through ``W_O``), so F44's cases attack it."""
    def reach(self, r, nu, rho, dP, eP, pad):  # noqa: ANN001, ANN202, ARG001
        return self.branch(float(r.max()), rho, float((rho * (dP + eP) + pad).max()), eP, False)[0]
    monkeypatch.setattr(stack_attn.AttentionAligned, "reach", reach)


@pytest.mark.parametrize("seed,qscale,causal,aligned,rho,drift,eP", [
    (2, 1.0, False, True, 0.05, 0.0, 0.0), (6, 8.0, True, True, 0.05, 0.5, 0.0), (5, 1.0, False, False, 0.3, 3.0, 0.2)])
def test_f53_reach_is_never_beaten(seed, qscale, causal, aligned, rho, drift, eP, monkeypatch):
    """Behind a linear prefix (three heads: random, all equal, sharp causal; prefix drift and rounding), Adam ascent over
    the move ``rho P h + e`` and the tangent ``P v + eps`` on ``||[(DA(X + Delta) - DA(X)) E]_k||`` (the attention with
    ``W_O`` and biases) stays below F53b's branch alone (``test_local_redteam14_stack``'s case)."""
    layer, _ = _layer(seed, qscale, causal, aligned)
    X, P = _case(seed)
    _f53_as_reach(monkeypatch)
    reach, obj = aligned_reach_case(layer, X, P, rho, drift, eP)
    T = X.shape[0]
    # per token k, bilinear_lower(obj(k), (2T, d), restarts=2, steps=25, seed=seed + k), every token's in one batch
    los = reach_lowers(reach_values(layer, X, P, rho, drift, eP), [obj(k) for k in range(T)], (2 * T, X.shape[1]),
                       [seed + k for k in range(T)], restarts=2, steps=25)
    for k, lo in enumerate(los):
        assert lo <= float(reach[k]), (k, lo, reach)


def test_f53_through_a_token_map_and_homogeneity():
    """F53b's branch through a dense per-token map ``M_k`` against Adam ascent of ``||M_k [(DA(X + P h) - DA(X)) P v]_k||``
    (sharp aligned heads); ``W_V``, ``W_O`` x 2: both F53b reaches x 2 (one value factor, one output map)."""
    layer, attn = _layer(12, 4.0, aligned=True)
    X, P = _case(12)
    T, d = X.shape
    M = torch.randn(T, d, d, generator=torch.Generator().manual_seed(12), dtype=torch.float64) / d**0.5
    nu = certified_rows(P)
    rho = 0.1

    def run(lay):  # noqa: ANN001, ANN202
        al = _aligned(lay, X, P)
        eM = torch.zeros(T, dtype=torch.float64)
        al.p["M"], al.p["MO"] = (M, eM), _head_output_norms(M, eM, al.p["heads"], T)
        return al.branch(float((rho * nu * (1 + 1e-12)).max()), rho, 0.0, 0.0, False)

    plain, through = run(layer)
    A = lambda Z: attention_forward(attn, Z)  # noqa: E731
    dA = lambda Z, E: torch.autograd.functional.jvp(A, Z, E, create_graph=True)[1]  # noqa: E731

    def obj(k):  # noqa: ANN001, ANN202
        def f(h, v):  # noqa: ANN001, ANN202
            E = _rows(P, v)
            return (M[k] @ (dA(X + _rows(P, rho * h), E) - dA(X, E))[k]).norm()
        return f

    # per token k, bilinear_lower(obj(k), X.shape, restarts=2, steps=25, seed=12 + k), every token's in one batch
    los = reach_lowers(reach_values(layer, X, P, rho, 0.0, 0.0, M), [obj(k) for k in range(T)], X.shape,
                       [12 + k for k in range(T)], restarts=2, steps=25)
    for k, lo in enumerate(los):
        assert 0 < lo <= float(through[k]), (k, lo, through)
    for name in ("W_V", "W_O"):
        a = dataclasses.replace(attn, **{name: 2.0 * getattr(attn, name)})
        for new, old in zip(run(dataclasses.replace(layer, attention=a)), (plain, through)):
            assert torch.allclose(new, 2.0 * old, rtol=1e-9), name


CASES = [dict(eps=1e-5, xscale=1.0, qscale=1.0), dict(eps=1e-12, xscale=0.05, qscale=1.0),
         dict(eps=1e-5, xscale=1.0, qscale=8.0, causal=True)]


@pytest.mark.parametrize("case,rho_frac", [(CASES[0], 1e-3), (CASES[1], 1e-4), (CASES[2], 1e-3)])
def test_whole_network_is_never_beaten_and_not_above_f50(case, rho_frac, monkeypatch):
    """The whole network (2 post-LN layers, LayerNorm, GELU, biases, 4 heads; tiny inputs with eps = 1e-12; sharp
    causal heads) against pair-ratio and Jacobian-row ascent (``assert_network_below``); without F53 (F44b's ``2 max``
    and F50 alone) the bound and the drift are never smaller."""
    case = dict(case)
    xscale, qscale = case.pop("xscale"), case.pop("qscale")
    spec = random_spec(9, act="gelu", L=2, norm="layernorm", d=8, H=4, dh=2, dff=8, biases=True, placement="post",
                       **case)
    spec = dataclasses.replace(spec, layers=[dataclasses.replace(
        ly, attention=dataclasses.replace(ly.attention, W_Q=qscale * ly.attention.W_Q)) for ly in spec.layers])
    X = torch.randn(4, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * xscale
    rho = rho_frac * float(X.norm(dim=1).median())
    new = stack_local(spec, X, [rho])[0]
    assert math.isfinite(new.upper)
    assert_network_below(spec, X, rho, new, seed=9)
    _without_f53(monkeypatch)
    old = stack_local(spec, X, [rho])[0]
    assert new.upper <= old.upper and new.drift <= old.drift, (new.upper, old.upper)


@pytest.mark.slow
def test_minilm_first_layer_below_f50(monkeypatch):
    """MiniLM layer 0 on a real 7-token input behind the identity prefix at rho = 1e-4 (x the median token norm, after
    the input norm): the reach (through ``W_O`` and through the layer's token-local product) with F53 is below F50's
    by >= 1.3x on every token (measured 1.41-1.68x)."""
    from transcover.lipschitz._local_stack_stages import layer_stages
    from transcover.model import load
    from transcover.model._data import load_inputs

    spec = load(None).to_torch(torch.float64)
    X = spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=32, limit=20)[14].double())
    T, d = X.shape
    att = layer_stages(spec.layers[0], X, {})[0][0]
    eye = torch.eye(T * d, dtype=torch.float64).reshape(T, d, T, d).permute(0, 2, 1, 3).contiguous()
    nu = certified_rows(eye)
    z = torch.zeros_like(nu)
    rho = 1e-4 * float(X.norm(dim=1).median())
    r = rho * nu * (1 + 1e-12)
    new, new_m = stack_attn.AttentionAligned(att.attn, eye).joint(r, rho, z, 0.0, 0.0)
    _without_f53(monkeypatch)
    old, old_m = stack_attn.AttentionAligned(att.attn, eye).joint(r, rho, z, 0.0, 0.0)
    assert bool((1.3 * new <= old).all()) and bool((1.3 * new_m <= old_m).all()), (new, old, new_m, old_m)
