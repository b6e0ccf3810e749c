"""Red-team attacks on the local certificates (issue 12): THEORY F34 (stage radii by the exact
linearisation plus second-order remainders, inside ``layer_rows``), F35 (the attention Jacobian drift from
the second derivative, inside ``attention_drift_rows``), F38 (the FFN Jacobian's drift by one certified
tensor norm, ``ffn_taylor_drift``) and the whole network's drift by exact middle
products inside ``stack_local`` (the chain12 branch's section; its F-number is cited here once merged).

The adversary is stronger than the helpers' own: the inner problem ``nu_i(J) = max_{|u|=1} sum_j
||J_ij^T u||`` is solved on the full float64 Jacobian by alternating maximisation from many starts (random
cotangents and every block's top singular vector), and the outer problem by Adam on ``u^T (J(Y) V)_i``
over ``Y`` in the ball (per-token projection), started at adversarial constructions: every token moved
along the top singular directions of ``W_Q^h W_K^hT``, the push that flips each head's argmax, the
centring that shrinks each token's standard deviation, and random points of the boundary.  Small
layers with sharp heads (``W_Q`` x 8-30), causal masks, biases and LayerNorm eps 1e-12.  The cases are
the tightest the attack scripts under ``scripts/redteam/`` found (found/certified 0.90-0.99).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lipschitz_testkit import random_spec
from transcover.lipschitz._local_ffn2 import ffn_hadamard, ffn_second_norms, ffn_taylor_drift
from transcover.lipschitz._local_jacobian import _head_data, _weight_norms
from transcover.lipschitz._local_rows import _HeadMoments, attention_drift_rows, layer_rows
from transcover.lipschitz._local_stack import stack_local
from transcover.model import attention_forward, attention_scores
from transcover.model._functional import ffn_forward, layer_forward, transformer_forward


def _eps(norm, eps: float):  # noqa: ANN001, ANN202
    return norm if norm is None or norm.weight is None else dataclasses.replace(norm, eps=eps)


def _sharp(layer, q: float, eps: float = 1e-12):  # noqa: ANN001, ANN202
    """``W_Q`` x ``q`` (sharp heads), LayerNorm eps as MiniLM's (a near-degenerate input is not rescued)."""
    attn = dataclasses.replace(layer.attention, W_Q=layer.attention.W_Q * q)
    return dataclasses.replace(layer, attention=attn, norm_attn=_eps(layer.norm_attn, eps),
                               norm_ffn=_eps(layer.norm_ffn, eps))


def _layer(seed: int, placement: str, causal: bool, q: float):  # noqa: ANN202
    spec = random_spec(seed, act="gelu", norm="layernorm", placement=placement, d=8, H=2, dh=4, dff=16,
                       biases=True, causal=causal)
    return _sharp(spec.layers[0], q)


def _X(seed: int, T: int = 6, d: int = 8) -> torch.Tensor:
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64) * 2


def _clip(E: torch.Tensor, r: float) -> torch.Tensor:
    return E * torch.clamp(r / E.norm(dim=1, keepdim=True).clamp(min=1e-300), max=1.0)


def _jac(f, Y: torch.Tensor, create_graph: bool = False) -> torch.Tensor:  # noqa: ANN001
    """(T, m, T, d) Jacobian of ``f`` at ``Y``."""
    return torch.autograd.functional.jacobian(f, Y, create_graph=create_graph, vectorize=True)


def _nu_row(Ji: torch.Tensor, starts: int = 16, iters: int = 40) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Attained ``||sum_j J_ij v_j||`` (unit ``v_j``) near ``nu_i`` by alternating maximisation from random
    cotangents and the blocks' top left singular vectors; with the maximising ``u`` and ``V``."""
    m = Ji.shape[0]
    tops = [torch.linalg.svd(Ji[:, j, :])[0][:, 0] for j in range(Ji.shape[1])]
    U = torch.cat([torch.randn(starts, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64),
                   torch.stack(tops)])
    U = U / U.norm(dim=1, keepdim=True)
    for _ in range(iters):
        W = torch.einsum("mjd,sm->sjd", Ji, U)
        Z = torch.einsum("mjd,sjd->sm", Ji, W / W.norm(dim=2, keepdim=True).clamp(min=1e-300))
        U = Z / Z.norm(dim=1, keepdim=True).clamp(min=1e-300)
    W = torch.einsum("mjd,sm->sjd", Ji, U)
    k = int(W.norm(dim=2).sum(dim=1).argmax())
    V = W[k] / W[k].norm(dim=1, keepdim=True).clamp(min=1e-300)
    return float(torch.einsum("mjd,jd->m", Ji, V).norm()), U[k], V


def _ascend_nu(f, X: torch.Tensor, r: float, i: int, starts, steps: int = 20, J0=None) -> float:  # noqa: ANN001
    """Largest attained ``nu_i(J_f(Y) [- J0])`` along Adam ascent over ``Y`` in ``B(X, r)`` from the starts."""
    best = 0.0
    for E0 in starts:
        E = _clip(E0.clone(), r).requires_grad_(True)
        opt = torch.optim.Adam([E], lr=0.15 * r)
        for _ in range(steps):
            D = _jac(f, X + E, create_graph=True)
            D = D if J0 is None else D - J0
            val, u, V = _nu_row(D[i].detach(), starts=6, iters=20)
            best = max(best, val)
            opt.zero_grad()
            (-torch.einsum("m,mjd,jd->", u, D[i], V)).backward()
            opt.step()
            with torch.no_grad():
                E.copy_(_clip(E, r))
    return best


def _adversarial_starts(attn, X: torch.Tensor, r: float, n_random: int = 2) -> list[torch.Tensor]:  # noqa: ANN001
    """Offsets: all tokens along the top singular directions of each head's ``W_Q W_K^T`` (both signs), the
    push that flips each head's argmax, the shrink of every token's spread, random boundary points."""
    T, d = X.shape
    out = []
    for h in range(attn.n_heads):
        U, _, Vt = torch.linalg.svd(attn.W_Q[h].double() @ attn.W_K[h].double().T)
        out += [s * r * v.expand(T, d).clone() for v in (U[:, 0], Vt[0]) for s in (1.0, -1.0)]
        Xr = X.clone().requires_grad_(True)
        S = attention_scores(attn, Xr, h)
        top2 = S.detach().topk(2, dim=1).indices
        (gr,) = torch.autograd.grad((S.gather(1, top2[:, 1:]) - S.gather(1, top2[:, :1])).sum(), Xr)
        out.append(r * gr / gr.norm(dim=1, keepdim=True).clamp(min=1e-300))
    c = X - X.mean(dim=1, keepdim=True)
    out.append(-r * c / c.norm(dim=1, keepdim=True))
    g = torch.Generator().manual_seed(1)
    for _ in range(n_random):
        E = torch.randn(T, d, generator=g, dtype=torch.float64)
        out.append(r * E / E.norm(dim=1, keepdim=True))
    return out


def _worst_start(f, X: torch.Tensor, r: float, bound: torch.Tensor, starts, J0=None, keep: int = 3):  # noqa: ANN001
    """The token and the ``keep`` starts with the largest ``nu_i / bound_i`` at the start points."""
    vals = []
    for E in starts:
        D = _jac(f, X + _clip(E, r))
        D = D if J0 is None else D - J0
        vals.append(torch.tensor([_nu_row(D[i], starts=4, iters=20)[0] for i in range(X.shape[0])]))
    ratio = torch.stack(vals) / bound
    i = int(ratio.max(dim=0).values.argmax())
    return i, [starts[k] for k in ratio[:, i].argsort(descending=True)[:keep].tolist()]


def _stage_maps(layer) -> dict:  # noqa: ANN001
    """The stage outputs whose moves ``stage_radii`` bound (post-LN: centred sublayer outputs)."""
    cen = lambda Z: Z - Z.mean(dim=1, keepdim=True)  # noqa: E731
    if layer.placement.value == "post":
        S1 = lambda Z: Z + attention_forward(layer.attention, Z)  # noqa: E731
        H = lambda Z: layer.norm_attn(S1(Z))  # noqa: E731
        return {"attention": lambda Z: cen(S1(Z)), "norm_attn": H,
                "ffn": lambda Z: cen(H(Z) + ffn_forward(layer.ffn, H(Z)))}
    S1 = lambda Z: Z + attention_forward(layer.attention, layer.norm_attn(Z))  # noqa: E731
    return {"attention": layer.norm_attn, "norm_ffn": S1, "ffn": lambda Z: layer.norm_ffn(S1(Z))}


def _largest_move(fn, X: torch.Tensor, r: float, starts, steps: int = 25) -> torch.Tensor:  # noqa: ANN001
    """(T,) the largest attained ``||fn(Y)_i - fn(X)_i||`` along Adam ascent from the starts."""
    ref = fn(X).detach()
    best = torch.zeros(X.shape[0], dtype=torch.float64)
    for E0 in starts:
        E = _clip(E0.clone(), r).requires_grad_(True)
        opt = torch.optim.Adam([E], lr=0.15 * r)
        for _ in range(steps):
            v = (fn(X + E) - ref).norm(dim=1)
            best = torch.maximum(best, v.detach())
            opt.zero_grad()
            (-v.sum()).backward()
            opt.step()
            with torch.no_grad():
                E.copy_(_clip(E, r))
        best = torch.maximum(best, (fn(X + E.detach()) - ref).norm(dim=1))
    return best


@pytest.mark.parametrize("seed,placement,causal,q,r", [(2, "post", True, 30.0, 1e-3), (1, "post", False, 8.0, 1e-2),
                                                        (3, "pre", False, 8.0, 1e-3)])
def test_ball_rows_and_stage_radii_survive_the_adversary(seed, placement, causal, q, r):
    """F34 in ``layer_rows``: the adversary's ``nu_i(J(Y))`` on the ball stays below ``total_rows`` and
    every stage's (and the output's) attained move below its certified radius.  post/causal/q=30 at r=1e-3
    was the tightest case found (0.995: the point bound is exact for the causal first token)."""
    layer = _layer(seed, placement, causal, q)
    X = _X(seed)
    lj = layer_rows(layer, X, [r])[0]
    f = lambda Z: layer_forward(layer, Z)  # noqa: E731
    starts = _adversarial_starts(layer.attention, X, r)
    i, best = _worst_start(f, X, r, lj.total_rows, starts, keep=2)
    found = _ascend_nu(f, X, r, i, best)
    assert found <= float(lj.total_rows[i]), (i, found, float(lj.total_rows[i]))
    maps = {**_stage_maps(layer), "output": f}
    for name, fn in maps.items():
        rad = lj.output_radii if name == "output" else lj.stage_radii[name]
        moved = _largest_move(fn, X, r, best[:1])
        assert bool((moved <= rad).all()), (name, moved, rad)


@pytest.mark.parametrize("seed,causal,q,r", [(2, True, 30.0, 1e-3), (1, False, 8.0, 1e-3)])
def test_attention_drift_rows_survive_the_adversary_per_head(seed, causal, q, r):
    """F35 (with F17d) in ``attention_drift_rows``: per head and query, the adversary's ``nu_i(Z^h(Y) -
    Z^h(X))`` (the head's Jacobian before ``W_O``) stays below the certified row; the tightest cases found
    (causal q=30 head 1: 0.90; q=8: 0.84)."""
    layer = _layer(seed, "post", causal, q)
    attn = layer.attention
    X = _X(seed)
    dZ = attention_drift_rows(_HeadMoments(_head_data(attn, X), attn.softmax_scale), r, _weight_norms(layer))
    starts = _adversarial_starts(attn, X, r)
    for h in range(attn.n_heads):
        Wv = attn.W_V[h].double()
        f = lambda Z, h=h, Wv=Wv: torch.softmax(attention_scores(attn, Z, h), dim=-1) @ Z @ Wv  # noqa: E731
        J0 = _jac(f, X)
        i, best = _worst_start(f, X, r, dZ[h], starts, J0=J0, keep=2)
        found = _ascend_nu(f, X, r, i, best, J0=J0)
        assert found <= float(dZ[h, i]), (h, i, found, float(dZ[h, i]))


@pytest.mark.parametrize("c", [0.25, 4.0])
def test_attention_drift_rows_follow_the_input_scale(c):
    """Homogeneity: ``X -> c X``, ``r -> c r``, ``W_Q, W_K, W_V -> W/c`` make every head's output a function
    of ``Z/c``, so ``nu_i(Z'(Y) - Z'(cX)) = nu_i(Z(Y/c) - Z(X))/c``; the certified rows follow ``1/c``
    exactly (powers of two: no rounding)."""
    layer = _layer(2, "post", True, 30.0)
    X = _X(2)

    def rows(L, X, r):  # noqa: ANN001, ANN202
        return attention_drift_rows(_HeadMoments(_head_data(L.attention, X), L.attention.softmax_scale), r,
                                    _weight_norms(L))

    a = layer.attention
    scaled = dataclasses.replace(layer, attention=dataclasses.replace(a, W_Q=a.W_Q / c, W_K=a.W_K / c, W_V=a.W_V / c))
    for r in (1e-3, 0.1):
        assert torch.allclose(rows(scaled, c * X, c * r) * c, rows(layer, X, r), rtol=1e-12, atol=0.0)


def test_whole_network_bound_and_drift_survive_the_adversary():
    """The whole network (``stack_local``, middle products): on a 2-layer post-LN stack with sharp causal heads and biases at rho = 1e-5,
    the adversary's ``nu_i(J(Y))`` stays below ``upper`` and ``stack`` (found 0.989 of it) and its
    ``nu_i(J(Y) - J(X))`` below ``drift``."""
    spec = random_spec(3, act="gelu", L=2, d=6, H=2, dh=3, dff=8, norm="layernorm", placement="post",
                       causal=True, biases=True)
    spec = dataclasses.replace(spec, layers=[_sharp(L, 8.0, eps=L.norm_attn.eps) for L in spec.layers])
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(53), dtype=torch.float64)
    rho = 1e-5
    res = stack_local(spec, X, [rho])[0]
    f = lambda Z: transformer_forward(spec, Z, with_head=False)  # noqa: E731
    J0 = _jac(f, X)
    starts = _adversarial_starts(spec.layers[0].attention, X, rho)
    for J, bound in ((None, min(res.upper, res.stack)), (J0, res.drift)):
        i, best = _worst_start(f, X, rho, torch.full((X.shape[0],), bound), starts, J0=J, keep=2)
        found = _ascend_nu(f, X, rho, i, best, J0=J)
        assert found <= bound, (found, bound)


@pytest.mark.parametrize("rh", [1e-3, 1e-2])
def test_ffn_taylor_drift_survives_the_adversary(rh):
    """F38 (``ffn_taylor_drift``): per token, Adam on ``u^T P (F'(h + dh) - F'(h)) v`` (``u, v`` the top singular
    pair, recomputed each step) over ``||dh|| <= rh`` never exceeds the certified drift; a sharp FFN
    (``W_1`` x 15) from the first-order tensor's largest unit and random starts (found 0.986 at 1e-3)."""
    ffn = random_spec(3, act="gelu", norm="layernorm", d=8, dff=16, biases=True).layers[0].ffn
    ffn = dataclasses.replace(ffn, W_1=ffn.W_1 * 15.0)
    W1, W2, b1 = ffn.W_1.double(), ffn.W_2.double(), ffn.b_1.double()
    W2c = W2 - W2.mean(dim=1, keepdim=True)
    Hs = torch.randn(2, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    const = ffn_hadamard(ffn, centred=True)
    z = Hs @ W1 + b1
    full, _ = ffn_taylor_drift(const, ffn_second_norms(const, z), z, W1.norm(dim=0),
                               torch.full((2,), rh, dtype=torch.float64))
    slope = lambda v: torch.special.ndtr(v) + v * torch.exp(-0.5 * v * v) / (2 * torch.pi) ** 0.5  # noqa: E731
    g = torch.Generator().manual_seed(0)
    for t in range(2):
        curv = (torch.exp(-0.5 * z[t] ** 2) * (2 - z[t] ** 2)).abs()
        starts = [W1[:, int(curv.argmax())].clone()] + [torch.randn(8, generator=g, dtype=torch.float64) for _ in range(2)]
        for dh0 in starts:
            dh = (rh * dh0 / dh0.norm()).requires_grad_(True)
            opt = torch.optim.Adam([dh], lr=0.1 * rh)
            for _ in range(40):
                M = W2c.T @ torch.diag(slope(z[t] + dh @ W1) - slope(z[t])) @ W1.T
                U, S, Vt = torch.linalg.svd(M.detach())
                assert float(S[0]) <= float(full[t]), (t, float(S[0]), float(full[t]))
                opt.zero_grad()
                (-(U[:, 0] @ M @ Vt[0])).backward()
                opt.step()
                with torch.no_grad():
                    dh.mul_(torch.clamp(rh / dh.norm(), max=1.0))


def _underflow_case(c: float, r: float = 0.052):
    """One head, d = d_head = 4, ``G = c I`` (W_V = W_O = I, no biases), T = 2: x_0 = u, x_1 = 0.9u + 0.3w, so query
    0's second key sits 0.1c below the first; ``Y = X + (-r u, +r u)`` (every token moved by exactly r) closes the
    gap and hands that key the row (the red team's case, docs/results/redteam12.md)."""
    d = 4
    L = random_spec(1, act="gelu", norm="layernorm", placement="post", d=d, H=1, dh=d, dff=8).layers[0]
    eye = torch.eye(d, dtype=torch.float64)[None]
    s = (c * d**0.5) ** 0.5
    attn = dataclasses.replace(L.attention, W_Q=eye * s, W_K=eye * s, W_V=eye.clone(), W_O=eye.clone(), b_Q=None,
                               b_K=None, b_V=None, b_O=None)
    L = dataclasses.replace(L, attention=attn)
    u, w = eye[0, 0], eye[0, 1]
    X = torch.stack([u, 0.9 * u + 0.3 * w])  # query 1 sees both keys at one score (gap 0)
    return L, X, X + torch.stack([-r * u, r * u]), r


def test_underflowed_visible_key_is_refused():
    """Gap 800 (weight 0.0 in float64): the local bounds read visibility as P > 0, so the input is refused
    (Note [underflowed attention weights]) instead of certified with the key treated as masked (the red team
    found F34's remainder 0.052 against an attained 1.000, the attention stage radius 0.156 against 0.899)."""
    from transcover import InputError

    L, X, _, r = _underflow_case(8000.0)
    with pytest.raises(InputError, match="key 1 underflows float64"):
        layer_rows(L, X, [r])
    with pytest.raises(InputError, match="underflows"):
        _head_data(L.attention, X)


def test_tiny_but_normal_weight_is_covered():
    """Gap 700 (weight ~1e-304, a normal float64, so the key counts as visible): at the red team's point the F34
    remainder and the attention stage radius cover the attained remainder and centred move."""
    from transcover.lipschitz._local_attention import head_norms
    from transcover.lipschitz._local_joint import attention_remainder, head_geometry

    L, X, Y, r = _underflow_case(7000.0)
    attn = L.attention
    A = lambda Z: attention_forward(attn, Z)  # noqa: E731
    J = torch.autograd.functional.jacobian(A, X)
    R = (A(Y) - A(X) - torch.einsum("imjd,jd->im", J, Y - X)).norm(dim=1)
    assert float(R.max()) > 0.5  # the point really hands the second key the row
    heads = _head_data(attn, X)
    mom = _HeadMoments(heads, attn.softmax_scale)
    gv, gov = (head_geometry(heads, attn.softmax_scale, output=o) for o in (False, True))
    remA, _ = attention_remainder(mom, gv, gov, float(head_norms(attn)["O"]), r, _weight_norms(L))
    assert bool((R <= remA).all()), (R, remA)
    lj = layer_rows(L, X, [r])[0]
    cen = lambda Z: Z - Z.mean(dim=1, keepdim=True)  # noqa: E731
    moved = (cen(Y + A(Y)) - cen(X + A(X))).norm(dim=1)
    assert bool((moved <= lj.stage_radii["attention"]).all()), (moved, lj.stage_radii["attention"])
