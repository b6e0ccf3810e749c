"""F62: the post-LN FFN's reach with its Taylor rest and drift part through the prefix's rows (THEORY F62).

Attacks: float64 ascent over the network's input ball (projected Adam on the move and per-token unit probes, and the
sphere parametrisation, restarts) of the FFN sub-stage's reach ``nu_k((J_s(y_s) - J_s(x_s)) P_s(x))`` and of its
Taylor rest past the second order, never above what ``stack_local`` certifies for them, on random 2-layer post-LN GELU
stacks where F62 binds (plain, tiny sigma with eps = 1e-12, sharp causal heads, saturated GELU); the whole network
(``assert_network_below``); F62 off (F40c's reach) never smaller anywhere; homogeneity of the rest in the prefix scale.
"""

from __future__ import annotations

import math

import pytest
import torch

import transcover.lipschitz._local_stack_aligned as al
import transcover.lipschitz._local_stack_third as th
from lipschitz_testkit import jvp_ascents
from test_local_stack15 import assert_network_below
from test_local_stack19 import CASES, _case
from transcover.lipschitz._local_jacobian import gelu_second
from transcover.lipschitz._local_stack import stack_local
from transcover.model import attention_forward, ffn_forward


def _captured(spec, X: torch.Tensor, rho: float, monkeypatch) -> tuple:  # noqa: ANN001
    """``stack_local`` on ``B(X, rho)`` and, per FFN sub-stage in layer order, F62's reach and rest rows, F40c's reach
    on the same arguments, and the token radii of the FFN's input."""
    calls, rests, drifts = [], [], []
    reach, rest, drift = th.aligned_reach, th.aligned_third_rest, al.FFNAligned.drift

    def drift_(self, r, rho_, dP, eP, pad):  # noqa: ANN001, ANN202
        one = torch.ones_like(r)
        old = al.ffn_aligned_reach(self.nqm, self.n2, self._c3r2(r), one, rho_, dP, eP / 2, pad)
        drifts.append((drift(self, r, rho_, dP, eP, pad), old))
        return drifts[-1][0]

    def rest_(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        out = rest(*a, **kw)
        if not kw.get("unit"):  # the reach's rest (the drift rows' has a unit column)
            rests.append(out)
        return out

    def reach_(nq, nqm, n2, c3r2, rs, nu, rho_, dP, eP, pad):  # noqa: ANN001, ANN202
        old = al.ffn_aligned_reach(nq, n2, c3r2, nu, rho_, dP, eP, pad)
        calls.append((reach(nq, nqm, n2, c3r2, rs, nu, rho_, dP, eP, pad), old))
        return calls[-1][0]

    monkeypatch.setattr(al, "aligned_reach", reach_)
    monkeypatch.setattr(al, "aligned_third_rest", rest_)
    monkeypatch.setattr(al.FFNAligned, "drift", drift_)
    res = stack_local(spec, X, [rho])[0]
    monkeypatch.undo()
    return res, [(v, old, r) for (v, old), r in zip(calls, rests)], drifts


def _ffn_input(spec, Z: torch.Tensor, layer: int) -> torch.Tensor:  # noqa: ANN001
    """The FFN sub-stage's input ``H`` of ``layer`` on the post-LN path."""
    Z = spec.input_norm(Z)
    for ly in spec.layers[:layer]:
        H = ly.norm_attn(Z + attention_forward(ly.attention, Z))
        Z = ly.norm_ffn(H + ffn_forward(ly.ffn, H))
    ly = spec.layers[layer]
    return ly.norm_attn(Z + attention_forward(ly.attention, Z))


def _jvp(f, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """``Df(x) v``, differentiable in ``x`` and ``v``."""
    return torch.autograd.functional.jvp(f, x, v, create_graph=True)[1]


def _gelu1(z: torch.Tensor) -> torch.Tensor:
    """The exact-erf GELU's derivative ``Phi(z) + z phi(z)``."""
    return 0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _attained(spec, X: torch.Tensor, rho: float, layer: int, seed: int, kind: str, *, sphere: bool) -> torch.Tensor:  # noqa: ANN001
    """(T,) per token k the largest value Adam finds over network moves E (rows within rho; on the sphere of radius rho
    when ``sphere``) and per-token unit probes ``w``: the reach ``sum_m ||(dJ_kk P_s(x) e_m w_m)_k||`` (a lower bound on
    ``nu_k(dJ P_s(x))``, ``kind`` "reach"), the Taylor rest ``||(F'(h + dh) - F'(h) - F''(h)[dh]) b||`` at token k,
    ``dh = H(X + E) - H(X)``, ``b = (P_s(x) w)_k`` ("rest"), or the drift row ``||dJ_kk w_k||`` ("drift"); one ascent
    per token, every start of every token in one batch."""
    T, d = X.shape
    pre = lambda Z: _ffn_input(spec, Z, layer)  # noqa: E731
    ffn = spec.layers[layer].ffn
    F = lambda Z: ffn_forward(ffn, Z)  # noqa: E731
    W1 = ffn.W_1
    hx = pre(X).detach()
    eye = torch.eye(T, dtype=torch.float64)
    # the terms at the centre are linear in their direction: read from the Jacobians of pre at X and of F at H(X),
    # computed once, instead of a double-backward jvp per step
    Jpre = torch.autograd.functional.jacobian(pre, X).detach() if kind != "drift" else None
    JF = torch.autograd.functional.jacobian(F, hx).detach() if kind == "reach" else None
    lin = lambda J, V: torch.einsum("iajb,...jb->...ia", J, V)  # noqa: E731

    def value(E, W):  # noqa: ANN001, ANN202
        if sphere:
            E = rho * E / E.norm(dim=-1, keepdim=True)
        S, K = E.shape[:2]
        hy = pre(X + E)
        k = torch.arange(K)
        if kind == "drift":
            dG = _gelu1(hy @ W1 + ffn.b_1) - _gelu1(hx @ W1 + ffn.b_1)
            return ((dG * (W @ W1)) @ ffn.W_2)[:, k, k].norm(dim=-1)
        if kind == "rest":
            b = lin(Jpre, W) @ W1
            z, dz = hx @ W1 + ffn.b_1, (hy - hx) @ W1
            R = (_gelu1(z + dz) - _gelu1(z) - gelu_second(z) * dz) * b
            return (R @ ffn.W_2)[:, k, k].norm(dim=-1)
        U = eye[None, None, :, :, None] * W[:, :, :, None, :]  # (S, K, m, T, d): w_m at token m
        PU = lin(Jpre, U)
        hy5 = hy[:, :, None].expand(S, K, T, T, d).contiguous()
        dd = _jvp(F, hy5, PU) - lin(JF, PU)
        return dd.transpose(2, 3)[:, k, k].norm(dim=-1).sum(dim=-1)  # (S, K, m, d) rows k

    return torch.tensor(jvp_ascents(value, X, rho, [seed + k for k in range(T)], starts=2, steps=20),
                        dtype=torch.float64)


@pytest.mark.parametrize("case", CASES)
def test_reach_and_rest_are_never_beaten_and_f62_binds(case, monkeypatch):
    """Per FFN sub-stage and token, projected and sphere Adam over the network's input ball of the reach and of the
    Taylor rest stay below F62's reach and rest rows (random; tiny sigma, eps = 1e-12; sharp causal heads, W_Q x 8;
    saturated GELU, W_1 x 6); F62's reach is never above F40c's and strictly below it somewhere (it binds); the attack
    reaches a visible share of the rest (not idle).  The same for the FFN's drift rows (F44f with F62's rest)."""
    spec, X, rho, seed = _case(case)
    res, calls, drifts = _captured(spec, X, rho, monkeypatch)
    assert len(calls) == len(drifts) == len(spec.layers) and math.isfinite(res.upper)
    share = 0.0
    for layer, ((reach, old, rest), (drift, dold)) in enumerate(zip(calls, drifts)):
        assert bool((reach <= old).all()) and bool((drift <= dold).all()), (reach, old, drift, dold)
        for sphere in (False, True):
            for kind, bound in (("reach", reach), ("rest", rest), ("drift", drift)):
                got = _attained(spec, X, rho, layer, seed + 50 * sphere, kind, sphere=sphere)
                assert bool((got <= bound).all()), (layer, kind, sphere, got, bound)
                if kind == "rest":
                    share = max(share, float((got / rest).max()))
    assert any(bool((v < o).any()) for v, o, _ in calls) and any(bool((v < o).any()) for v, o in drifts)
    assert share >= 1e-3, share


@pytest.mark.parametrize("case", CASES[::3])
def test_whole_network_is_never_beaten_and_not_above_without_f62(case, monkeypatch):
    """The whole network with F62 against pair-ratio and Jacobian-row ascent (``assert_network_below``); with F40c's
    reach instead (F62 off) the bound, drift, every prefix drift row and every radius are at least as large."""
    spec, X, rho, seed = _case(case)
    new = stack_local(spec, X, [rho])[0]
    assert_network_below(spec, X, rho, new, seed=seed)
    monkeypatch.setattr(al, "aligned_reach", lambda nq, nqm, n2, c3r2, rs, *a: al.ffn_aligned_reach(nq, n2, c3r2, *a))
    old = stack_local(spec, X, [rho])[0]
    assert new.upper <= old.upper and new.drift <= old.drift, (new.upper, old.upper)
    assert all(bool((new.spans[k] <= old.spans[k]).all()) for k in old.spans)
    assert all(bool((a <= b).all()) for a, b in zip(new.token_radii, old.token_radii))


def _third(W1: torch.Tensor, B: torch.Tensor) -> tuple:
    """F62's ``(K2, Km2, g)`` per prefix row from ``G`` as ``ffn_aligned_norms`` forms it."""
    G0, e0 = W1.T @ W1, 0.0
    fW1 = float(W1.norm()) * (1 + W1.numel() * 2.0**-53)
    out = []
    for k in range(B.shape[0]):
        Q, eQ = al.ellipsoid_gram(B[k])
        G = (W1.T @ Q) @ W1
        eG = fW1 * fW1 * (2 * W1.shape[0] * 2.0**-53 * float(Q.norm()) + eQ)
        out.append(th.third_norms(G, eG, float(G.abs().max()), G0, e0, float(G0.abs().max())))
    return tuple(torch.stack([torch.as_tensor(o[i], dtype=torch.float64) for o in out]) for i in range(3))


def test_rest_homogeneity_in_the_prefix_scale():
    """Prefix blocks x 2 (exact in float64) with rho / 2 and the drift rows, rounding and column rows x 2: ``K2`` x 16,
    ``Km2`` x 4, ``g`` x 4 and the rest x 2 (degree 1 in the column, 0 in the move); ``nW2`` x 2: the rest x 2."""
    g = torch.Generator().manual_seed(3)
    T, d, dff = 3, 6, 10
    W1 = torch.randn(d, dff, generator=g, dtype=torch.float64)
    B = torch.randn(T, T, d, d, generator=g, dtype=torch.float64)
    z = torch.randn(T, dff, generator=g, dtype=torch.float64)
    a, b = _third(W1, B), _third(W1, 2.0 * B)
    for x, y, p in zip(a, b, (16.0, 4.0, 4.0)):
        assert torch.allclose(y, p * x, rtol=1e-9, atol=0.0), (x, y)
    n1 = W1.norm(dim=0)
    nu, dP, r = torch.rand(T, generator=g, dtype=torch.float64) + 1, torch.rand(T, generator=g, dtype=torch.float64), \
        torch.full((T,), 10.0, dtype=torch.float64)
    one = th.aligned_third_rest(1.5, 40.0, n1, z, None, *a, r, nu, 1e-2, dP, 1e-9, 0.0)
    two = th.aligned_third_rest(1.5, 40.0, n1, z, None, *b, r, 2 * nu, 5e-3, 2 * dP, 2e-9, 0.0)
    assert torch.allclose(two, 2.0 * one, rtol=1e-9, atol=0.0), (one, two)
    assert torch.allclose(th.aligned_third_rest(3.0, 40.0, n1, z, None, *a, r, nu, 1e-2, dP, 1e-9, 0.0), 2.0 * one,
                          rtol=1e-12, atol=0.0)
