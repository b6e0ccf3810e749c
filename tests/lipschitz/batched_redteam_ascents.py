"""Batched forms of the red-team ascents (test helper): each runs the SAME starts (the same draws from
the same generators, in the same order), the same number of Adam steps with the same step sizes and schedules, and
reads the same values as the per-start loops it replaces -- only every start (and, where several independent ascents
run side by side, every ascent) is one slice of one batched tensor.  Adam acts entrywise and the summed objective's
gradient in one slice is that slice's own value's gradient, so each slice follows its own loop's trajectory (to the
rounding of a batched matmul); one batched step costs about what one small unbatched step did.  Beside them,
``headwise_attention``: the MiniLM ascents' attention with all heads in one product (``check_attention`` ties it to the
library's ``attention_forward`` before each use)."""

from __future__ import annotations

import torch

from lipschitz_testkit import clip_rows

F64 = torch.float64


def row_ascents(Js: list, starts: int = 4, steps: int = 200, seed: int = 0) -> list:
    """``test_local_wts18._ascent(J, starts, steps, seed)`` for every ``J`` (T, Tj, d, d') of ``Js`` (one shape), all
    starts of all of them in one batch: per ``J`` the generator seeded ``seed`` draws its starts' ``V`` in turn (the same
    draws for each ``J``, as each fresh call did), Adam (lr 0.05) on ``||sum_j J_ij Vp_j||``; per output token the larger
    of ``row_norm_lower(J)`` and the starts' values at their last iterate."""
    from transcover.lipschitz._local_jacobian import row_norm_lower

    J = torch.stack(Js)  # (m, T, Tj, d, d')
    m, T, Tj, d, _ = J.shape
    g = torch.Generator().manual_seed(seed)
    V0 = torch.stack([torch.randn(T, Tj, J.shape[-1], generator=g, dtype=F64) for _ in range(starts)])  # (s, T, Tj, d')
    V = V0[None].expand(m, *V0.shape).clone().requires_grad_(True)  # (m, s, T, Tj, d')
    opt = torch.optim.Adam([V], lr=0.05)

    def val(V: torch.Tensor) -> torch.Tensor:
        Vp = V / V.norm(dim=-1, keepdim=True).clamp(min=1.0)
        return torch.einsum("mijab,msijb->msia", J, Vp).norm(dim=-1)  # (m, s, T)

    for _ in range(steps):
        v = val(V)
        opt.zero_grad()
        (-v.sum()).backward()
        opt.step()
    with torch.no_grad():
        last = val(V).amax(dim=1)  # (m, T)
    return [torch.maximum(row_norm_lower(Js[k]), last[k]) for k in range(m)]


def norm_ascent(norm, x: torch.Tensor, M: torch.Tensor, r: float, starts: int = 6, steps: int = 150) -> float:  # noqa: ANN001
    """``test_local_redteam19._norm_ascent``, its starts in one batch: Adam (float64, projected, cosine-annealed) on
    ``||M(N(x + e) - N(x) - D(x) e)||`` over ``||e|| <= r``; starts +- the centred point, +- its gamma-weighted image,
    and random ones (the same draws); the largest finite value seen."""
    N = lambda v: norm(v[None])[0]  # noqa: E731
    x0 = x[0]
    D = torch.autograd.functional.jacobian(N, x0)
    y0 = N(x0)
    g = torch.Generator().manual_seed(0)
    c = x0 - x0.mean()
    cg = c * norm.weight.abs() + 1e-3 * c
    dirs = [c, -c, cg, -cg] + [torch.randn(x0.shape, generator=g, dtype=F64) for _ in range(starts - 4)]
    E = torch.stack([e0 * r / e0.norm() for e0 in dirs]).requires_grad_(True)  # (starts, d)
    opt = torch.optim.Adam([E], lr=0.05 * r)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    best = torch.zeros(starts, dtype=F64)
    for _ in range(steps):
        with torch.no_grad():
            E.copy_(clip_rows(E, r))
        v = ((norm(x0 + E) - y0 - E @ D.T) @ M.T).norm(dim=-1)  # (starts,): row s is M (N(x0 + e_s) - y0 - D e_s)
        vd = v.detach()
        best = torch.where(torch.isfinite(vd), torch.maximum(best, vd), best)
        opt.zero_grad()
        (-v.sum()).backward()
        opt.step()
        sched.step()
    return float(best.max())


def remainder_ascents(layer, X: torch.Tensor, r: float, tokens: list, starts: int = 5, steps: int = 60) -> list:  # noqa: ANN001
    """``test_local_redteam19._remainder_ascent(layer, X, r, i, starts, steps)`` for every token ``i`` of ``tokens``, all
    tokens' starts in one batch: per token the maps of ``test_local_remg18.remg_maps`` (formed by the same calls), the
    starts +- the centred S1 rows, +- the row map's top right singular vectors, then draws from the generator seeded
    ``i``; Adam (float64, projected, lr 0.1 r) on ``||(I + F_i)(LN1(S1(X + E)) - LN1(S1(X)) - D1 B E)_i||``; per token
    the largest finite value seen."""
    from transcover.model import attention_forward, ffn_forward

    jac = lambda f, x: torch.autograd.functional.jacobian(f, x, vectorize=True)  # noqa: E731
    S1f = lambda Y: Y + attention_forward(layer.attention, Y)  # noqa: E731
    S1 = S1f(X)
    H = layer.norm_attn(S1)
    c = S1 - S1.mean(dim=1, keepdim=True)
    IFs, MD1s, Bis, E0s = [], [], [], []
    for i in tokens:
        IF = torch.eye(X.shape[1], dtype=F64) + jac(lambda h: ffn_forward(layer.ffn, h[None])[0], H[i])
        MD1 = IF @ jac(lambda s: layer.norm_attn(s[None])[0], S1[i])
        Bi = jac(lambda Y, i=i: S1f(Y)[i], X)
        top = torch.linalg.svd(torch.einsum("ab,btc->atc", MD1, Bi).reshape(X.shape[1], -1))[2][0].reshape(X.shape)
        g = torch.Generator().manual_seed(i)
        E0 = [[c, -c, top, -top][s] if s < 4 else torch.randn(X.shape, generator=g, dtype=F64) for s in range(starts)]
        IFs.append(IF)
        MD1s.append(MD1)
        Bis.append(Bi)
        E0s.append(torch.stack([e / e.norm(dim=1, keepdim=True).clamp(min=1e-300) * r for e in E0]))
    IF, MD1, B, idx = torch.stack(IFs), torch.stack(MD1s), torch.stack(Bis), torch.tensor(tokens)
    E = torch.stack(E0s).requires_grad_(True)  # (n, starts, T, d)
    opt = torch.optim.Adam([E], lr=0.1 * r)
    n = len(tokens)
    best = torch.zeros(n, starts, dtype=F64)
    for _ in range(steps):
        with torch.no_grad():
            E.copy_(clip_rows(E, r))
        Si = S1f(X + E)[torch.arange(n), :, idx]  # (n, starts, d): row i of S1 at X + E for token i's starts
        moved = layer.norm_attn(Si) - H[idx][:, None]
        v = (torch.einsum("nab,nsb->nsa", IF, moved) - torch.einsum("nab,nsb->nsa", MD1,
                                                                     torch.einsum("natb,nstb->nsa", B, E))).norm(dim=-1)
        vd = v.detach()
        best = torch.where(torch.isfinite(vd), torch.maximum(best, vd), best)
        opt.zero_grad()
        (-v.sum()).backward()
        opt.step()
    return best.amax(dim=1).tolist()


def stage_ascent(layer, X: torch.Tensor, r: float, starts: int = 4, steps: int = 60) -> dict:  # noqa: ANN001
    """``test_local_redteam19._stage_ascent``: per stage output (``test_local_sharp._stage_outputs``) and token, Adam
    (float64, projected, lr 0.1 r) of its move, from ``starts`` draws on the sphere per stage (the generator seeded 3
    draws them stage after stage, as there); every stage's starts in one batch."""
    from test_local_sharp import _stage_outputs

    ref = _stage_outputs(layer, X)
    names = list(ref)
    g = torch.Generator().manual_seed(3)
    E = torch.stack([torch.randn(starts, *X.shape, generator=g, dtype=F64) for _ in names])  # (stages, starts, T, d)
    E = (E / E.norm(dim=-1, keepdim=True) * r).requires_grad_(True)
    opt = torch.optim.Adam([E], lr=0.1 * r)
    best = torch.zeros(len(names), X.shape[0], dtype=F64)
    for _ in range(steps):
        with torch.no_grad():
            E.copy_(clip_rows(E, r))
        out = _stage_outputs(layer, X + E)
        val = torch.stack([(out[name][k] - ref[name]).norm(dim=-1) for k, name in enumerate(names)])  # (stages, s, T)
        best = torch.maximum(best, torch.nan_to_num(val.detach(), nan=0.0).amax(1))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return {name: best[k] for k, name in enumerate(names)}


def jac_ascent(layer, X: torch.Tensor, r: float, starts: int = 3, steps: int = 60, tokens: list | None = None,  # noqa: ANN001
               V0: torch.Tensor | None = None) -> torch.Tensor:
    """``test_local_redteam19._jac_ascent`` with its starts in one batch: per output token in ``tokens`` (default all),
    Adam (float64; lr 0.1 r on E, 0.05 on V) over moves ``E`` in the ball and unit rows ``V`` of
    ``||sum_j J_ij(X + E) V_j||``; with ``V0`` the first two starts ``V = V0``, ``E = +- r V0_j/||V0_j||``, the others
    drawn (V, then E) from the generator seeded 0, start after start."""
    from transcover.model._functional import layer_forward

    T, d = X.shape
    tokens = list(range(T)) if tokens is None else tokens
    n, idx = len(tokens), torch.tensor(tokens)
    g = torch.Generator().manual_seed(0)
    f = lambda Z: layer_forward(layer, Z)  # noqa: E731
    Vs, Es = [], []
    for s in range(starts):
        if V0 is not None and s < 2:
            V = V0.expand(n, T, d).clone()
            E = (1 - 2 * s) * r * V / V.norm(dim=-1, keepdim=True)
        else:
            V = torch.randn(n, T, d, generator=g, dtype=F64)
            E = torch.randn(n, T, d, generator=g, dtype=F64)
            E = r * E / E.norm(dim=-1, keepdim=True)
        Vs.append(V)
        Es.append(E)
    E, V = torch.stack(Es).requires_grad_(True), torch.stack(Vs).requires_grad_(True)  # (starts, n, T, d)
    opt = torch.optim.Adam([{"params": [E], "lr": 0.1 * r}, {"params": [V], "lr": 0.05}])
    best = torch.zeros(n, dtype=F64)
    for _ in range(steps):
        with torch.no_grad():
            E.copy_(clip_rows(E, r))
        Vn = V / V.norm(dim=-1, keepdim=True)
        out = torch.autograd.functional.jvp(f, X + E, Vn, create_graph=True)[1]  # (starts, n, T, d)
        val = out[:, torch.arange(n), idx].norm(dim=-1)  # (starts, n)
        best = torch.maximum(best, torch.nan_to_num(val.detach(), nan=0.0).amax(0))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return best


def pair_ascent(layer, X: torch.Tensor, r: float, starts: int = 2, steps: int = 30) -> float:  # noqa: ANN001
    """``test_local_redteam19._pair_ascent`` with its starts in one batch: Adam (float64, lr 0.05 r, projected) over
    pairs in the ball of ``max_i ||f(X + E1)_i - f(X + E2)_i|| / max_j ||E1_j - E2_j||`` from the same draws (the
    generator seeded 1); the largest value seen (a NaN never taken, as Python's ``max(best, nan)`` keeps ``best``)."""
    from transcover.model._functional import layer_forward

    g = torch.Generator().manual_seed(1)
    E = torch.stack([clip_rows(torch.randn(2, *X.shape, generator=g, dtype=F64) * r, r) for _ in range(starts)])
    E = E.requires_grad_(True)  # (starts, 2, T, d)
    opt = torch.optim.Adam([E], lr=0.05 * r)
    best = torch.zeros(starts, dtype=F64)
    for _ in range(steps):
        with torch.no_grad():
            E.copy_(clip_rows(E, r))
        Y = layer_forward(layer, X + E)
        ratio = (Y[:, 0] - Y[:, 1]).norm(dim=-1).amax(-1) / (E[:, 0] - E[:, 1]).norm(dim=-1).amax(-1)
        rd = ratio.detach()
        best = torch.where(rd > best, rd, best)
        opt.zero_grad()
        (-ratio.sum()).backward()
        opt.step()
    return float(best.max())


def ffn_remainder_ascent(ffn, h: torch.Tensor, Ls: torch.Tensor, r: float, remH: float, seed: int,  # noqa: ANN001
                         starts: list | None = None, steps: int = 60, lr: float = 0.1) -> float:
    """``test_local_layer17._ascent`` with its starts in one batch: ``max(projected_adam(...), sphere_adam(...))`` of
    ``lipschitz_testkit`` (float64 Adam; the projected one at step ``lr`` times the larger radius, every row projected
    before each step; the sphere one on ``V`` at step 0.3, every row at its full radius) on
    ``||P(F(h + dh) - F(h) - J dh)||`` over ``dh = sum_j L_j d_j + rho``, ``||d_j|| <= r``, ``||rho|| <= remH``, from the
    same starts (``starts``, else 3 drawn from ``seed`` as there); the largest value seen by either."""
    from lipschitz_testkit import clip_rows
    from transcover.model import ffn_forward

    d = h.shape[0]
    P = torch.eye(d, dtype=F64) - 1.0 / d
    J = torch.autograd.functional.jacobian(lambda x: ffn_forward(ffn, x[None])[0], h)
    y0 = ffn_forward(ffn, h[None])[0]
    g = torch.Generator().manual_seed(seed)
    if starts is None:
        starts = [(torch.randn(Ls.shape[0], d, generator=g, dtype=F64) * r,
                   torch.randn(d, generator=g, dtype=F64) * remH) for _ in range(3)]
    D0 = torch.stack([D for D, _ in starts])  # (S, n_j, d)
    R0 = torch.stack([R for _, R in starts])  # (S, d)

    def rem(D: torch.Tensor, R: torch.Tensor) -> torch.Tensor:  # (S,)
        dh = torch.einsum("jab,sjb->sa", Ls, D) + R
        return ((ffn_forward(ffn, h + dh) - y0 - dh @ J.T) @ P.T).norm(dim=-1)

    best = torch.zeros(len(starts), dtype=F64)
    # projected_adam
    ps = [clip_rows(D0, r).clone().requires_grad_(True), clip_rows(R0, remH).clone().requires_grad_(True)]
    opt = torch.optim.Adam(ps, lr=lr * max(r, remH))
    for _ in range(steps):
        with torch.no_grad():
            for p, c in zip(ps, (r, remH)):
                p.copy_(clip_rows(p, c))
        v = rem(*ps)
        vd = v.detach()
        best = torch.where(vd > best, vd, best)
        opt.zero_grad()
        (-v.sum()).backward()
        opt.step()
    # sphere_adam
    Vs = [D0.clone().requires_grad_(True), R0.clone().requires_grad_(True)]
    opt = torch.optim.Adam(Vs, lr=0.3)
    for _ in range(steps):
        v = rem(*(c * V / V.norm(dim=-1, keepdim=True).clamp(min=1e-300) for V, c in zip(Vs, (r, remH))))
        vd = v.detach()
        best = torch.where(vd > best, vd, best)
        opt.zero_grad()
        (-v.sum()).backward()
        opt.step()
    return float(best.max())


def unit_sup(ffn, Q: torch.Tensor, r: float, remH: float):  # noqa: ANN001, ANN201
    """The exact ``sup ||P w2|| |e(s)|``, ``e(s) = GELU(z + s) - GELU(z) - GELU'(z) s``, over the reachable
    ``s = w1 . (a + rho)``: ``|s| <= R0 = r (w1^T Q w1)^{1/2} + ||w1|| remH`` (a lower bound of the sup: grid points are
    attained; ``|e|`` is smooth at the grid's scale), as test_local_redteam18 had it (on its 201-point
    grid, mpmath), the same operations in the same order, with ``GELU(z)`` and ``GELU'(z)`` at the fixed centre formed
    once instead of at every grid point: the same mpf values."""
    import mpmath

    from test_local_redteam18 import _g1, _mp, _sig

    w1 = [_mp(x) for x in ffn.W_1[:, 0]]
    Qm = mpmath.matrix([[_mp(Q[a, b]) for b in range(Q.shape[0])] for a in range(Q.shape[0])])
    wv = mpmath.matrix(w1)
    R0 = _mp(r) * mpmath.sqrt((wv.T * Qm * wv)[0]) + mpmath.sqrt(mpmath.fsum(x * x for x in w1)) * _mp(remH)
    w2 = [_mp(x) for x in ffn.W_2[0]]
    mu = mpmath.fsum(w2) / len(w2)
    nPw2 = mpmath.sqrt(mpmath.fsum((x - mu) ** 2 for x in w2))
    z = _mp(ffn.b_1[0])
    s0, g0 = _sig(z), _g1(z)
    best = max(abs(_sig(z + s) - s0 - g0 * s) for s in (R0 * mpmath.mpf(k) / 100 for k in range(-100, 101)))
    return nPw2 * best


# test_local_redteam15b: several independent ascents of one test as slices of one batch, and the MiniLM ascents' attention
# all heads at once (test_local_redteam15b, test_local_redteam19)

def _same(batched: torch.Tensor, alone: torch.Tensor) -> None:
    batched, alone = batched.detach(), alone.detach()
    assert torch.allclose(batched, alone, rtol=1e-6, atol=1e-9 * float(alone.abs().max())), "not batched"


def directional_ascents(f, X: torch.Tensor, jobs: list, g: torch.Generator, *, starts: int = 3,  # noqa: ANN001
                        steps: int = 60) -> list:
    """``[test_local_redteam15b._directional_ascent(f, X, r, g, J0, starts=starts, steps=steps) for r, J0 in jobs]``
    (the calls made in ``jobs``' order from the same ``g``) in one batch: per job ``starts`` draws of (E clipped into
    the ball of radius r, then V) from ``g`` in turn; Adam at ``0.05 r`` on E and 0.05 on V; per output token the
    largest ``||sum_j J_ij(X + E) v_j||`` (``J0`` given: of ``(J(X + E) - J0) v``) seen, per job.  ``f`` acts on
    leading batch axes."""
    Es, Vs, groups = [], [], []
    for r, _ in jobs:
        draws = [(clip_rows(torch.randn(X.shape, generator=g, dtype=F64) * r, r),
                  torch.randn(X.shape, generator=g, dtype=F64)) for _ in range(starts)]
        E = torch.stack([e for e, _ in draws]).requires_grad_(True)
        V = torch.stack([v for _, v in draws]).requires_grad_(True)
        Es.append(E)
        Vs.append(V)
        groups += [{"params": [E], "lr": 0.05 * r}, {"params": [V], "lr": 0.05}]
    opt = torch.optim.Adam(groups)
    best = [torch.zeros(X.shape[0], dtype=F64) for _ in jobs]

    def values(Z: torch.Tensor, v: torch.Tensor, J0s: list) -> list:
        out = torch.autograd.functional.jvp(f, Z, v, create_graph=True)[1].split(starts)
        return [(o if J0 is None else o - torch.einsum("imjd,...jd->...im", J0, vj)).norm(dim=-1)
                for o, vj, J0 in zip(out, v.split(starts), J0s)]

    J0s = [J0 for _, J0 in jobs]
    for step in range(steps):
        with torch.no_grad():
            for E, (r, _) in zip(Es, jobs):
                E.copy_(clip_rows(E, r))
        v = torch.cat([V / V.norm(dim=-1, keepdim=True) for V in Vs])
        vals = values(X + torch.cat(Es), v, J0s)
        if step == 0:  # the last job's last start alone
            _same(vals[-1][-1], values(X + Es[-1][-1:].detach(), v[-1:].detach(), J0s[-1:])[0][0])
        best = [torch.maximum(b, val.detach().amax(dim=0)) for b, val in zip(best, vals)]
        opt.zero_grad()
        (-sum(val.sum() for val in vals)).backward()
        opt.step()
    return best


def ascents(value, X: torch.Tensor, jobs: list, g: torch.Generator, *, starts: int = 2, steps: int = 30) -> list:  # noqa: ANN001
    """``[test_local_sharp._ascent(lambda Z: value(Z, key), X, r, g, starts=starts, steps=steps) for r, key in jobs]``
    (the calls made in ``jobs``' order from the same ``g``) in one batch: per job the projected ascent's ``starts``
    draws of E from ``g`` in turn (clipped into the ball), Adam at ``0.1 r``; the sphere ascent's starts from its own
    generator seeded ``g.initial_seed() + 1`` (as ``_ascent`` seeds it at every call: the same draws for every job),
    Adam at 0.3 on the directions; ``steps`` steps of both; per job and token the max of both.  ``value(Z, keys)``
    maps moves ``Z`` (N, T, d) and one key per slice to (N, T), each slice its own value."""
    Es, Vs, groups = [], [], []
    for r, _ in jobs:
        E = torch.stack([clip_rows(torch.randn(X.shape, generator=g, dtype=F64) * r, r) for _ in range(starts)])
        gs = torch.Generator().manual_seed(g.initial_seed() + 1)
        V = torch.randn((starts, *X.shape), generator=gs, dtype=F64)
        Es.append(E.requires_grad_(True))
        Vs.append(V.requires_grad_(True))
        groups += [{"params": [Es[-1]], "lr": 0.1 * r}, {"params": [Vs[-1]], "lr": 0.3}]
    opt = torch.optim.Adam(groups)
    keys = [k for _, k in jobs for _ in range(starts)] * 2
    n = len(jobs)
    best = [torch.zeros(X.shape[0], dtype=F64) for _ in range(2 * n)]
    for step in range(steps):
        with torch.no_grad():
            for E, (r, _) in zip(Es, jobs):
                E.copy_(clip_rows(E, r))
        Z = torch.cat([X + E for E in Es] + [X + r * V / V.norm(dim=-1, keepdim=True) for V, (r, _) in zip(Vs, jobs)])
        val = value(Z, keys)
        if step == 0:  # the last projected start and the last sphere start, each alone
            for s in (n * starts - 1, 2 * n * starts - 1):
                _same(val[s], value(Z[s:s + 1].detach(), keys[s:s + 1])[0])
        vals = val.split(starts)
        best = [torch.maximum(b, v.detach().amax(dim=0)) for b, v in zip(best, vals)]
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return [torch.maximum(p, s) for p, s in zip(best[:n], best[n:])]


def headwise_attention(attn, Z: torch.Tensor, *, key_mask=None, layer: int = 0, hooks=None) -> torch.Tensor:  # noqa: ANN001, ARG001
    """``transcover.model.attention_forward(attn, Z)`` for plain softmax attention (no RoPE, query/key norms,
    soft-capping, position bias, masks or windows; float64 weights), as the models compute it: every head's scores
    ``scale [Z, 1] [W_Q; b_Q] (Z W_K)^T`` (``b_K`` cancels), ``P (Z W_V)`` and then ``W_O`` (the value bias folded into
    ``effective_output_bias``, P's rows summing to 1), all heads in one product each.  The same map; the library forms
    ``W_V W_O`` (d x d) per head and call and multiplies ``P Z`` by it, 4-6x the flops at MiniLM's d = 384, d_head = 32
    (the rounding differs: ``check_attention`` compares the two)."""
    assert attn.kind != "l2" and attn.rope is None and attn.q_norm is None and attn.k_norm is None
    assert attn.softcap is None and attn.position_bias is None and not attn.causal and attn.window is None
    assert attn.n_kv_heads == attn.n_heads and key_mask is None and hooks is None
    H = attn.n_heads
    Wqa = torch.stack([attn.W_Q_augmented(h) for h in range(H)]).to(Z.dtype)  # (H, d + 1, dh)
    Za = torch.cat([Z, torch.ones_like(Z[..., :1])], dim=-1)
    q = torch.einsum("...td,hde->...hte", Za, Wqa)
    k = torch.einsum("...td,hde->...hte", Z, attn.W_K.to(Z.dtype))
    v = torch.einsum("...td,hde->...hte", Z, attn.W_V.to(Z.dtype))
    P = torch.softmax(attn.softmax_scale * (q @ k.transpose(-1, -2)), dim=-1)
    out = torch.einsum("...hte,hef->...tf", P @ v, attn.W_O.to(Z.dtype))
    bias = attn.effective_output_bias()
    return out if bias is None else out + bias.to(Z.dtype)


def check_attention(attn, Z: torch.Tensor) -> None:  # noqa: ANN001
    """``headwise_attention`` is the library's ``attention_forward`` on ``Z``, to float64 rounding (1e-12 of the
    largest output entry), and so is its gradient along a random direction."""
    from transcover.model import attention_forward

    Z = Z.detach().clone().requires_grad_(True)
    a, b = headwise_attention(attn, Z), attention_forward(attn, Z)
    W = torch.randn(a.shape, generator=torch.Generator().manual_seed(0), dtype=a.dtype)
    (ga,) = torch.autograd.grad((a * W).sum(), Z)
    (gb,) = torch.autograd.grad((b * W).sum(), Z)
    for x, y in ((a.detach(), b.detach()), (ga, gb)):
        assert float((x - y).abs().max()) <= 1e-12 * float(y.abs().max()), float((x - y).abs().max() / y.abs().max())
