"""Red team, issue 12 stop 13: F40 (branch whole13) -- the post-LN FFN's first-order drift through the prefix's
reachable rows -- attacked where the branch's own tests do not reach: behind a NONLINEAR prefix (input norm,
a whole layer, the next attention and first norm), with the prefix drift ``dP``, its rounding and the radii the
whole-stack recursion really passes (recorded from ``stack_local``), not a linear prefix with ``dP = 0``.
Adam ascent on ``||(J_s(y_s) - J_s(x_s)) (P_s(x) v)_k||`` over ``y`` in the ball and (2,inf)-unit ``v`` must stay
below the reach ``v_k``, and comes within 0.5 of it at rho = 1e-4 (first order dominates: 0.91 in the
red13 probes), so a transposed prefix block or a lost term would show.  Also F40e-g's layer drift rows inside the
stack (the span (1, 2)) against ascent.  Depends on whole13 (merge with it; head 2fbc869 or later).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.autograd.functional import jvp

from lipschitz_testkit import random_spec, token_ascents
from transcover.lipschitz import _local_stack_aligned as aligned
from transcover.lipschitz._local_stack import stack_local
from transcover.model import attention_forward, ffn_forward
from transcover.model._functional import layer_forward


def _ffn_input(spec, q: int):  # noqa: ANN001, ANN202
    """X -> the input of layer q's FFN sub-stage (post-LN: the first norm's output)."""
    def f(Z: torch.Tensor) -> torch.Tensor:
        Y = spec.input_norm(Z)
        for layer in spec.layers[:q]:
            Y = layer_forward(layer, Y)
        layer = spec.layers[q]
        return layer.norm_attn(Y + attention_forward(layer.attention, Y))
    return f


def _reach_ascents(spec, q: int, X: torch.Tensor, rho: float) -> list:  # noqa: ANN001
    """Per token k, Adam (seed k, 2 starts x 100 steps; the tokens in one batch) on
    ``||[DF(h(X + E)) - DF(h(X))] (Dh(X) V)]_k||``, h the FFN's input."""
    f, ffn = _ffn_input(spec, q), spec.layers[q].ffn
    F = lambda h: ffn_forward(ffn, h)  # noqa: E731
    hx = f(X).detach()

    def out(E, V):  # noqa: ANN001, ANN202
        _, b = jvp(f, X.expand_as(V), V, create_graph=True)
        return jvp(F, f(X + E), b, create_graph=True)[1] - jvp(F, hx.expand_as(b), b, create_graph=True)[1]
    return token_ascents(out, X, rho, starts=2, steps=100)


def test_f40_reach_behind_a_nonlinear_prefix_is_never_beaten(monkeypatch):
    """Two post-LN GELU layers, the FFNs' W_1 x 3 (curved units), attention x 0.3; the reach the stack recursion
    computes for layer 1's FFN (prefix: input norm, layer 0, attention, first norm) at rho = 1e-4 and 1e-2."""
    spec = random_spec(0, act="gelu", norm="layernorm", placement="post", d=6, H=2, dh=3, dff=12, L=2, biases=True,
                       eps=1e-2)
    spec = dataclasses.replace(spec, layers=[
        dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, W_V=0.3 * layer.attention.W_V,
                                                                 W_Q=0.3 * layer.attention.W_Q),
                            ffn=dataclasses.replace(layer.ffn, W_1=3 * layer.ffn.W_1)) for layer in spec.layers])
    X = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 2
    seen = []
    plain = aligned.FFNAligned.reach

    def recording(self, r, nu, rho, dP, eP, pad):  # noqa: ANN001, ANN202
        out = plain(self, r, nu, rho, dP, eP, pad)
        seen.append((rho, out.clone()))
        return out

    monkeypatch.setattr(aligned.FFNAligned, "reach", recording)
    rhos = [1e-4, 1e-2]
    stack_local(spec, X, rhos)
    assert len(seen) == 2 * len(rhos)  # one FFN sub-stage per layer, per radius
    for rho, reach in seen[len(rhos):]:  # layer 1
        ratios = [lo / float(reach[k]) for k, lo in enumerate(_reach_ascents(spec, 1, X, rho))]
        assert max(ratios) <= 1.0, (rho, ratios, reach)
        if rho == 1e-4:
            assert max(ratios) >= 0.5, (rho, ratios)


def test_a_layers_drift_rows_inside_the_stack_are_never_beaten():
    """F40e-g (a layer's drift rows by the exact partial products from its cut, the attention's reach through the
    token-local product): the span (1, 2) of ``stack_local`` -- layer 0's ``sup nu_i(J_L(y) - J_L(x))`` with
    ``y`` reached through the input norm -- against Adam ascent over the network input's ball and unit-row V;
    post-LN GELU, attention x 0.3, W_1 x 3 (probes: 0.13 of the bound, never above)."""
    from torch.autograd.functional import jvp as jvp_

    spec = random_spec(0, act="gelu", norm="layernorm", placement="post", d=6, H=2, dh=3, dff=12, L=2, biases=True,
                       final_norm=True, eps=1e-5)
    spec = dataclasses.replace(spec, layers=[
        dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, W_V=0.3 * layer.attention.W_V,
                                                                 W_Q=0.3 * layer.attention.W_Q),
                            ffn=dataclasses.replace(layer.ffn, W_1=3 * layer.ffn.W_1)) for layer in spec.layers])
    X = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 2
    rho = 1e-4
    rows = stack_local(spec, X, [rho])[0].spans[(1, 2)]
    layer = lambda Z: layer_forward(spec.layers[0], Z)  # noqa: E731
    u0 = spec.input_norm(X).detach()

    def out(E, V):  # noqa: ANN001, ANN202  (per token i, Adam from seed i, 2 starts x 80 steps)
        return (jvp_(layer, spec.input_norm(X + E), V, create_graph=True)[1]
                - jvp_(layer, u0.expand_as(V), V, create_graph=True)[1])

    best = torch.tensor(token_ascents(out, X, rho, starts=2, steps=80), dtype=torch.float64)
    assert bool((best <= rows).all()), (best, rows)
    assert float((best / rows).max()) >= 0.05, (best, rows)
