"""THEORY F89: the move's rest as a tangent side of F44b's Hessian sup, through every head's factors (``head_key_data``,
``image_side``; ``AttentionAligned.drift``/``reach_heads(..., img=)``).

Independent references: the exact sup of every linear functional the side bounds over the images' set (closed form:
``sum_k ||M_jk^T a|| R_k + ||a|| b``), float64 projected Adam for the projections' norms and the weighted square sum,
and a float64 projected Adam over moves ``P delta + M v + w`` of the attention sub-stage's exact Jacobian drift rows
``nu_k(J(x + D) - J(x))`` and reach rows ``nu_k((J(x + D) - J(x)) P)`` (``torch.func.jacrev`` of the stage).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from test_local_attn_gram_rest import _cols
from test_local_attn_psd_images import _maps_of
from test_local_attn_rest import _case, _clip
from transcover.lipschitz._local_attn_gram_rest import gram_factors, head_block_norms
from transcover.lipschitz._local_attn_img_side import head_key_data, image_side
from transcover.lipschitz._local_stack_move import move_rest_rows
from transcover.model import attention_forward

F64 = torch.float64


def _images(aa, M: torch.Tensor, R: torch.Tensor, Rw: torch.Tensor) -> tuple:  # noqa: ANN001
    """F87's ``C`` (4, H, T) of the rest ``e' = M v + w'`` (``||v_k|| <= R_k``, ``||w'_k|| <= Rw_k``) and its rows ``E``."""
    F, _, fn = gram_factors(aa.p["heads"], values=True)
    t = M.shape[0]
    C = move_rest_rows({(1, 2): (None, 0.0)}, [R, Rw], 2, t, {(1, 2): head_block_norms(F, _cols(M))}, fn)
    E = (torch.linalg.matrix_norm(M, ord=2) @ R + Rw) * (1 + 1e-12)
    return C, E


def _sup_linear(a: torch.Tensor, M: torch.Tensor, j: int, R: torch.Tensor, Rw: torch.Tensor, b: float) -> float:
    """The exact ``sup |a . e_j|`` over ``e = M v + w' + w`` (``||v_k|| <= R_k``, ``||w'_j|| <= Rw_j``, ``||w_j|| <= b``)."""
    return float((torch.linalg.vector_norm(torch.einsum("kab,a->kb", M[j], a), dim=1) * R).sum()
                 + a.norm() * (Rw[j] + b))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 200), qscale=hs.sampled_from([1.0, 4.0]), causal=hs.booleans(),
       mscale=hs.sampled_from([1e-2, 1.0]))
def test_side_dominates_the_exact_sups(seed, qscale, causal, mscale):
    """Every entry of ``image_side`` is above the exact sup of what it bounds over the images' set (the linear
    functionals ``q_i . e_j`` and ``e_i . G y_ij`` in closed form, the projections' norms and ``sum_j P_ij (e_i . G
    y_ij)^2`` by Adam), and the closed forms reach a tenth of the side's ``om`` and ``g`` where the images bind."""
    attn, X, _, _, aa, _ = _case(seed, qscale, causal)
    t, d = X.shape
    (M,) = _maps_of(seed, t, d, 1, mscale)
    g = torch.Generator().manual_seed(seed)
    R, Rw = torch.rand(t, generator=g, dtype=F64) * 0.1, torch.rand(t, generator=g, dtype=F64) * 0.01
    b = 1e-3
    C, E = _images(aa, M, R, Rw)
    keys = head_key_data(aa.p["heads"], X, aa.p["Wqa"], aa.p["scale"])
    sc = aa.p["scale"]
    heads = aa.p["heads"]
    Gys = [sc * (Y @ Wk) @ Wq.T for (_, Y, _, Wq, Wk, _, _) in heads]
    # every head's, key's and row's Adam ascents in one batch each (the same starts and steps as one at a time)
    norms = _adam_norms(torch.stack([W for hd in heads for W in hd[3:6]]), M, R, Rw, b, seed).reshape(len(heads), 3, t)
    squares = _adam_square_sums(torch.stack(Gys), torch.stack([hd[0] for hd in heads]), M, R, Rw, b, seed)
    reached = 0.0
    for h, ((P, Y, q, Wq, Wk, Wv, _), m) in enumerate(zip(heads, aa.p["mom"].rows)):
        side = image_side(C[:, h], keys[h], m, float(aa.nQ[h]), float(aa.nK[h]), aa.p["norms"]["V"][h], sc, E, b)
        Gy = Gys[h]
        for i in range(t):
            for j in range(t):
                om = _sup_linear(q[i], M, j, R, Rw, b)
                gg = _sup_linear(Gy[i, j], M, i, R, Rw, b)
                assert om <= float(side["om2"][i, j]) ** 0.5 and gg <= float(side["g2"][i, j]) ** 0.5, (h, i, j)
                for v, key in ((om, "om2"), (gg, "g2")):
                    if float(side[key][i, j]) > 0:
                        reached = max(reached, v / float(side[key][i, j]) ** 0.5)
        for n, key in enumerate(("mQ2", "mK2", "mV2")):
            for j in range(t):
                assert float(norms[h, n, j]) <= float(side[key][j]) ** 0.5, (h, key, j)
        for i in range(t):
            assert float(squares[h, i]) <= float(side["lG"][i]) * (1 + 1e-12), (h, i)
    assert reached > 0.1, reached


def _adam_norms(Ws: torch.Tensor, M: torch.Tensor, R: torch.Tensor, Rw: torch.Tensor, b: float,
                seed: int) -> torch.Tensor:
    """(K, t): per ``W = Ws[k]`` and ``j``, Adam over unit ``a`` of ``sup_e (W a) . e_j`` (= ``sup ||W^T e_j||`` over the
    images' set, in closed form for each ``a``): 3 starts (drawn from ``seed``, the same for every ``W`` and ``j``) x 60
    steps, every ascent in one batch -- Adam acts entrywise and each entry's gradient of the summed values is its own
    ascent's, so entry (k, j, s) takes the steps start s of the one-at-a-time ascent of ``(W_k, j)`` took."""
    g = torch.Generator().manual_seed(seed)
    K, n, t = Ws.shape[0], Ws.shape[2], M.shape[0]
    starts = torch.stack([torch.randn(n, generator=g, dtype=F64) for _ in range(3)])  # one draw per start, in order
    a = starts[None, None].expand(K, t, 3, n).clone().requires_grad_(True)
    opt = torch.optim.Adam([a], lr=0.05)
    best = torch.zeros(K, t, dtype=F64)
    for _ in range(60):
        u = torch.einsum("Kdn,Kjsn->Kjsd", Ws, a / a.norm(dim=-1, keepdim=True))
        val = ((torch.linalg.vector_norm(torch.einsum("jkab,Kjsa->Kjskb", M, u), dim=-1) * R).sum(-1)
               + u.norm(dim=-1) * (Rw + b)[None, :, None])
        best = torch.maximum(best, val.detach().amax(dim=-1))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return best


def _adam_square_sums(Gys: torch.Tensor, Ps: torch.Tensor, M: torch.Tensor, R: torch.Tensor, Rw: torch.Tensor,
                      b: float, seed: int) -> torch.Tensor:
    """(H, t): per head ``h`` and row ``i``, projected Adam of ``sum_j P_ij (e_i . Gy_ij)^2`` over ``e_i = sum_k M_ik v_k
    + w'_i + w_i`` (``Gys`` (H, t, t, d), ``Ps`` (H, t, t)): 3 starts (drawn from ``seed + 1``, the same for every head
    and row) x 80 steps, every ascent in one batch (entrywise Adam: each entry takes its own ascent's steps)."""
    H, t, d = Gys.shape[0], M.shape[1], M.shape[2]
    g = torch.Generator().manual_seed(seed + 1)
    v0, w0 = [], []
    for _ in range(3):  # per start v, then w, as drawn one start at a time
        v0.append(_clip(torch.randn(t, d, generator=g, dtype=F64), R))
        w0.append(torch.randn(d, generator=g, dtype=F64))
    v = torch.stack(v0)[None, None].expand(H, t, 3, t, d).clone().requires_grad_(True)
    w = torch.stack(w0)[None, None].expand(H, t, 3, d).clone().requires_grad_(True)
    cap = (Rw + b)[None, :, None]  # row i's ball for w' + w
    opt = torch.optim.Adam([v, w], lr=0.02)
    best = torch.zeros(H, t, dtype=F64)
    for _ in range(80):
        with torch.no_grad():
            v.copy_(_clip(v, R))
            w.mul_(torch.clamp(cap / w.norm(dim=-1).clamp(min=1e-300), max=1.0)[..., None])
        e = torch.einsum("ikab,Hiskb->Hisa", M, v) + w
        val = (Ps[:, :, None, :] * torch.einsum("Hijd,Hisd->Hisj", Gys, e) ** 2).sum(-1)
        best = torch.maximum(best, val.detach().amax(dim=-1))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return best


def _jac(attn, Z: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """(T, d, T, d) the attention sub-stage's Jacobian ``I + A'(Z)`` (the identity drops from every drift)."""
    return torch.func.jacrev(lambda U: attention_forward(attn, U))(Z)


def _rows(D: torch.Tensor) -> torch.Tensor:
    """(..., T) ``nu_k`` of blocks ``D[..., k, :, j, :]``: the sum over ``j`` of their spectral norms."""
    return torch.linalg.matrix_norm(D.transpose(-3, -2), ord=2).sum(dim=-1)


def _adam_drift(attn, X: torch.Tensor, P: torch.Tensor, M: torch.Tensor, R: torch.Tensor, Rw: torch.Tensor,  # noqa: ANN001
                rho: float, through: bool, seed: int) -> torch.Tensor:
    """(T,) per row the largest ``nu_k(J(X + D) - J(X))`` (or, ``through``, of ``(J(X + D) - J(X)) P``) float64 projected
    Adam finds over ``D = P delta + M v + w`` (2 starts x 25 steps per row).  The rows' ascents run in one batch (each
    start's draws in the one-at-a-time order, row by row; Adam acts entrywise and each entry's gradient of the summed
    values is its own ascent's, so every ascent takes the steps it took alone)."""
    t, d = X.shape
    J0 = _jac(attn, X).detach()
    g = torch.Generator().manual_seed(seed)
    full = torch.full((t,), rho, dtype=F64)
    draws = [[[_clip(torch.randn(t, d, generator=g, dtype=F64), r) for r in (full, R, Rw)] for _ in range(2)]
             for _ in range(t)]  # [row k][start][delta, v, w]
    dl, v, w = (torch.stack([torch.stack([draws[k][s][n] for s in range(2)]) for k in range(t)]).requires_grad_(True)
                for n in range(3))  # each (t rows, 2 starts, t, d)
    opt = torch.optim.Adam([dl, v, w], lr=0.1 * float(max(rho, R.max())))
    jac = torch.func.vmap(torch.func.vmap(lambda U: _jac(attn, U)))
    out = torch.zeros(t, dtype=F64)
    k = torch.arange(t)
    for _ in range(25):
        with torch.no_grad():
            dl.copy_(_clip(dl, full))
            v.copy_(_clip(v, R))
            w.copy_(_clip(w, Rw))
        D = torch.einsum("kjab,rsjb->rska", P, dl) + torch.einsum("kjab,rsjb->rska", M, v) + w
        dJ = jac(X + D) - J0
        if through:
            dJ = torch.einsum("rskamb,mjbc->rskajc", dJ, P)
        val = _rows(dJ)[k, :, k]  # (rows, starts): ascent (k, s) maximises row k
        out = torch.maximum(out, val.detach().amax(dim=1))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return out


@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 50), causal=hs.booleans(), qscale=hs.sampled_from([1.0, 3.0]))
def test_drift_and_reach_with_images_are_never_beaten(seed, causal, qscale):
    """``AttentionAligned.drift`` and ``reach_heads`` with the images (F89) stay above Adam's exact Jacobian drift and
    reach rows over moves ``P delta + M v + w``, never above the rows without them, and strictly below them somewhere
    (the move's rest is most of the move here, ``R = 3 rho``, and lies in a plane)."""
    attn, X, P, _, aa, st = _case(seed, qscale, causal)
    t, d = X.shape
    (M,) = _maps_of(seed, t, d, 1, 0.5)
    U = torch.linalg.qr(torch.randn(d, 2, generator=torch.Generator().manual_seed(seed), dtype=F64))[0]
    M = torch.einsum("ab,mkbc->mkac", U @ U.T, M)  # the rest in a plane: no head's factor sees all of its ball
    rho = 0.01
    R, Rw = torch.full((t,), 3 * rho, dtype=F64), torch.full((t,), 0.1 * rho, dtype=F64)
    C, E = _images(aa, M, R, Rw)
    r = (rho * torch.linalg.matrix_norm(P, ord=2).sum(dim=1) + E) * (1 + 1e-9)
    dP = E / rho
    hd = st.bounds(r)[3]
    old, _ = aa.drift(r, rho, dP, 0.0, 0.0, hd)
    new, _ = aa.drift(r, rho, dP, 0.0, 0.0, hd, C)
    reach_old = aa.combined(aa.reach_heads(r, rho, dP, 0.0, 0.0))
    reach_new = aa.combined(aa.reach_heads(r, rho, dP, 0.0, 0.0, C))
    assert bool((new <= old).all()) and bool((new < old).any()), (new, old)
    assert bool((reach_new <= reach_old).all()) and bool((reach_new < reach_old).any()), (reach_new, reach_old)
    got = _adam_drift(attn, X, P, M, R, Rw, rho, False, seed)
    assert bool((got <= new).all()), (got, new)
    assert float((got / new).max()) > 0.02, (got, new)
    got = _adam_drift(attn, X, P, M, R, Rw, rho, True, seed)
    assert bool((got <= reach_new).all()), (got, reach_new)


def test_image_drift_homogeneity_and_the_misaligned_rest():
    """The move's part ``(C, rho dP, b)`` x 2: ``image_drift`` x 2 (the side enters linearly; exact powers of two, the
    same ball); a rest orthogonal to head 0's ``W_Q``, ``W_K``, ``W_V`` (but for 1e-3; d = 16, four heads of 4) is seen
    by head 0 far below the ball's ``e_max S``."""
    _, X, P, _, aa, _ = _case(3)
    t, d = X.shape
    (M,) = _maps_of(3, t, d, 1)
    R, Rw = torch.full((t,), 0.02, dtype=F64), torch.zeros(t, dtype=F64)
    C, E = _images(aa, M, R, Rw)
    rm, rho = 0.5, 0.01
    a = aa.image_drift(C, rho, E / rho, 1e-4, 1e-5, rm, True)
    b = aa.image_drift(2 * C, rho, 2 * E / rho, 2e-4, 2e-5, rm, True)
    assert torch.allclose(b, 2 * a, rtol=1e-10, atol=0), (a, b)
    _, X, P, _, aa, _ = _case(3, d=16, heads=4)
    t, d = X.shape
    (M,) = _maps_of(3, t, d, 1)
    W = torch.cat([aa.p["heads"][0][k] for k in (3, 4, 5)], dim=1)  # (16, 12): head 0's factors
    U, _, _ = torch.linalg.svd(W)
    Pp = U[:, W.shape[1]:] @ U[:, W.shape[1]:].T + 1e-3 * torch.eye(d, dtype=F64)
    C, E = _images(aa, torch.einsum("ab,mkbc->mkac", Pp, M), R, Rw)
    seen = aa.image_drift(C, rho, E / rho, 0.0, 0.0, rm, True)
    ball = float(E.max()) * aa.integrals(rm)[2]
    assert bool((seen[0] < 0.1 * ball[0]).all()), (seen[0], ball[0])


def test_stack_passes_the_images_of_its_own_rests(monkeypatch):
    """In ``stack_local`` every attention stage's drift reads, per radius, the images of that radius's own upstream
    rests through its heads' factors: recomputed here from the stages' exact Jacobians at the data (autograd, the
    products multiplied out), the run's rests and float64 SVDs of every ``F_q^T M_jk``, equal to within 1e-6 (above)."""
    import transcover.lipschitz._local_stack as ls
    from lipschitz_testkit import chain, stack_substage_maps, stage_jacobians
    from test_local_move26 import CASES, _case as _stack_case
    from transcover.lipschitz._local_stack_attn import AttentionAligned

    spec, X, rho, _ = _stack_case(CASES[0])
    rhos = [rho, rho / 3]  # F78d's pieces call the drift at t rho, t in {1/4, 1/2, 3/4, 1}: no collision
    seen, rests, drift, rest = [], {}, AttentionAligned.drift, ls._stage_rest

    def recorded(self, r, rho_, dP, eP, pad, heads, img=None):  # noqa: ANN001, ANN202
        seen.append((self.p["X"], self.p["heads"], rhos.index(rho_) if rho_ in rhos else None, img))
        return drift(self, r, rho_, dP, eP, pad, heads, img)

    monkeypatch.setattr(AttentionAligned, "drift", recorded)
    monkeypatch.setattr(ls, "_stage_rest", lambda *a: rests.setdefault((a[1], a[10]), rest(*a)))
    ls.stack_local(spec, X, rhos, move_rest=True)
    monkeypatch.undo()
    maps = stack_substage_maps(spec)
    xs = [x.detach() for x in chain(maps, X)]
    t, d = X.shape
    J = stage_jacobians(maps, xs)
    checked = set()
    for Xs, heads, k, img in seen:
        if k is None or img is None:
            continue
        s = min(range(len(xs)), key=lambda i: float((xs[i] - Xs).norm()) if xs[i].shape == Xs.shape else float("inf"))
        assert float((xs[s] - Xs).norm()) <= 1e-12 * float(Xs.norm()), s
        F = gram_factors(heads, values=True)[0]
        ref = torch.zeros_like(img)
        for m in range(s):
            M = torch.eye(t * d, dtype=F64)
            for q in range(m + 1, s):
                M = J[q] @ M
            B = M.reshape(t, d, t, d).permute(0, 2, 1, 3)
            ref = ref + torch.linalg.matrix_norm(torch.einsum("qhar,jkab->qhjkrb", F, B), ord=2) @ rests[(m, k)]
        assert bool((img >= ref).all()) and bool((img <= ref * (1 + 1e-6)).all()), (s, k, (img / ref).min(), (img / ref).max())
        checked.add((s, k))
    assert checked == {(1, 0), (1, 1), (5, 0), (5, 1)}, checked
