"""Batched forms of attacks of test_local_redteam17, test_local_layer16 and test_local_drift (test helper): the same starts,
steps, step sizes and draws as the loops they replace, every independent ascent one slice of one batch.

Adam acts entrywise and the gradient of a sum of independent objectives in one slice is that slice's own, so each slice
follows the ascent it replaces, to rounding; a batched step costs about what one single step did."""

from __future__ import annotations

import math

import torch

from transcover.lipschitz._local_lower import _SHRINK, _clip
from transcover.lipschitz._local_lower import _unit_rows as _lib_unit_rows

F64 = torch.float64


def _unit_rows(a: torch.Tensor) -> torch.Tensor:
    return a / a.norm(dim=-1, keepdim=True)


def _exact(gr: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows set to the unit rows of the gradient ``gr``; rows with a zero gradient kept (as the original)."""
    live = gr.norm(dim=-1, keepdim=True) > 0
    return torch.where(live, _unit_rows(torch.where(live, gr, t)), t)


def drift_ascents(f, X: torch.Tensor, rho: float, ks: list, seeds: list, restarts: int = 2, outer: int = 8) -> list:  # noqa: ANN001
    """Block ascents on ``||[(Df(X + h) - Df(X)) E]_k||`` over ``||h_j|| <= rho`` and (2,inf)-unit ``E``, one per
    ``(k, seed)`` of ``zip(ks, seeds)``, in one batch (test_local_redteam17's per-token loop before f56ba88): per
    ascent and restart (in that order, each ascent's draws from its own generator ``seed``, as ``_block_ascent`` draws
    them: the point ``az`` (0 at restart 0), then ``E``, then ``u``) one slice; per outer step twice ``E``'s rows then
    ``u`` set to their exact maximisers (the rows of the gradient, normalised; rows with a zero gradient kept) at the
    point ``z`` (rows clipped to the unit ball), then one Adam step (lr 0.1) on ``az``; each ascent's best value
    ``u . [(Df(X + rho z) - Df(X)) E]_k`` at the Adam steps' points.  ``f`` acts on leading batch axes.

    The objective is linear in ``E`` and in ``u``, so each exact maximiser is the unit rows of a gradient that needs
    no double backward (stop 51, helper speed-red; before, autograd through two differentiable jvps): in ``E`` the
    vjp ``(Df(Z) - Df(X))^T w`` (``w``: ``u`` on row ``k``; one backward on ``Z`` and ``X`` stacked), in ``u`` the jvp
    ``[(Df(Z) - Df(X)) E]_k`` (one jvp on the stacked pair); the Adam step's value ``<Df(Z)^T w, E> - u . [Df(X) E]_k``
    (the same number, ``<Df(Z)^T w, E> = u . [Df(Z) E]_k``) is differentiated in the point through one vjp with its
    graph, ``[Df(X) E]_k`` from the last exact step (``E`` unchanged since).  Every quantity is the loop's to rounding
    (about 1e-12 relative); about 3x faster."""
    shape = X.shape
    azs, Es, us = [], [], []
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        for rs in range(restarts):
            azs.append(torch.randn(shape, generator=g, dtype=F64) * (0.0 if rs == 0 else 1.0))
            Es.append(_unit_rows(torch.randn(shape, generator=g, dtype=F64)))
            us.append(_unit_rows(torch.randn((shape[1],), generator=g, dtype=F64)))
    B = len(azs)
    rows = torch.arange(B)
    kk = torch.tensor([k for k in ks for _ in range(restarts)])
    X0 = X.detach().expand(B, *shape)

    def on_row(u: torch.Tensor) -> torch.Tensor:  # w: u on row k of each slice, 0 elsewhere
        w = torch.zeros(B, *shape, dtype=F64)
        w[rows, kk] = u
        return w

    def grad_E(Z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # (Df(Z) - Df(X))^T w: Z and X in one batch
        Zs = torch.cat([Z, X0]).requires_grad_(True)
        w = on_row(u)
        (gr,) = torch.autograd.grad(f(Zs), Zs, torch.cat([w, w]))
        return gr[:B] - gr[B:]

    def grad_u(Z: torch.Tensor, E: torch.Tensor) -> tuple:  # [(Df(Z) - Df(X)) E]_k and [Df(X) E]_k
        out = torch.autograd.functional.jvp(f, torch.cat([Z, X0]), torch.cat([E, E]))[1]
        a, b = out[:B][rows, kk], out[B:][rows, kk]
        return a - b, b

    az = torch.stack(azs).requires_grad_(True)
    E, u = torch.stack(Es), torch.stack(us)
    opt = torch.optim.Adam([az], lr=0.1)
    best = torch.full((B,), -math.inf, dtype=F64)
    for _ in range(outer):
        Z = X + rho * (az.detach() / az.detach().norm(dim=-1, keepdim=True).clamp(min=1.0))
        for _ in range(2):
            E = _exact(grad_E(Z, u), E)
            gu, J0E = grad_u(Z, E)
            u = _exact(gu, u)
        Zg = X + rho * (az / az.norm(dim=-1, keepdim=True).clamp(min=1.0))
        (gZ,) = torch.autograd.grad(f(Zg), Zg, on_row(u), create_graph=True)
        v = (gZ * E).sum(dim=(1, 2)) - (u * J0E).sum(dim=-1)
        vd = v.detach()
        best = torch.where(vd > best, vd, best)
        opt.zero_grad()
        (-v.sum()).backward()
        opt.step()
    return [float(b) for b in best.reshape(len(seeds), restarts).amax(dim=1)]


def slope_jacobian(ffn, h: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The FFN Jacobian at ``h`` (output x input, differentiable in ``h``; an elementwise activation, no gate; points
    ``h`` (..., d) give one Jacobian per row) in closed
    form, ``W_2^T diag(act'(u)) W_1^T`` with ``u = h W_1 + b_1`` formed as ``ffn_forward`` forms it and
    ``act'(u)`` by one autograd pass through the activation itself (elementwise: the diagonal of its Jacobian), instead
    of one pass per output: the same entries to rounding."""
    u = h @ ffn.W_1.double()
    if ffn.b_1 is not None:
        u = u + ffn.b_1.double()
    if not u.requires_grad:
        u = u.requires_grad_(True)
    (s,) = torch.autograd.grad(ffn.activation(u).sum(), u, create_graph=True)
    return ffn.W_2.double().T @ (s[..., :, None] * ffn.W_1.double().T)


def ffn_ascent(ffn, h: torch.Tensor, r: float, centred: bool, g: torch.Generator) -> tuple[float, float]:  # noqa: ANN001
    """Adam ascent over ``||dh|| <= r`` (2 starts x 25 steps projected, then 2 x 25 on the sphere ``dh = r V/||V||``,
    Adam on V (THEORY F57; 1.0-1.8x more on F38's and F51a's cases, sphere19) from a generator seeded by ``g``'s, so
    ``g``'s draws are unchanged): the largest ``||P(J(h + dh) - J(h))||_2`` (the sup over unit v) and
    ``||P(FFN(h + dh) - FFN(h) - J(h) dh)|| / ||dh||`` seen.  The starts run in turn (the objective is normalised by
    the running maxima); the FFN Jacobian in closed form (``slope_jacobian``: an elementwise activation, no gate), not
    by ``torch.autograd.functional.jacobian`` as test_local_ffn2 had it before f56ba88."""
    from test_local_ffn2 import _clip
    from transcover.model import ffn_forward

    d = h.shape[0]
    P = torch.eye(d, dtype=F64) - (1.0 / d if centred else 0.0)
    J0 = slope_jacobian(ffn, h).detach()
    y0 = ffn_forward(ffn, h[None])[0]
    bd, bh = 0.0, 0.0
    for sphere in (False, True):
        gen = torch.Generator().manual_seed(g.initial_seed() + 1) if sphere else g
        for _ in range(2):
            D = _clip(torch.randn(d, generator=gen, dtype=F64) * r, r).requires_grad_(True)
            opt = torch.optim.Adam([D], lr=0.3 * r if sphere else 0.1 * r)
            for _ in range(25):
                if sphere:
                    dh = r * D / D.norm()
                else:
                    with torch.no_grad():
                        D.copy_(_clip(D, r))
                    dh = D
                h1 = h + dh
                drift = torch.linalg.matrix_norm(P @ (slope_jacobian(ffn, h1) - J0), ord=2)
                rem = (P @ (ffn_forward(ffn, h1[None])[0] - y0 - J0 @ dh)).norm() / dh.norm()
                bd, bh = max(bd, float(drift.detach())), max(bh, float(rem.detach()))
                opt.zero_grad()
                (-(drift / (bd + 1e-300) + rem / (bh + 1e-300))).backward()
                opt.step()
    return bd, bh


def drift_lower_batched(fn, X: torch.Tensor, rho: float, *, tokens=(0,), restarts: int = 3, steps: int = 30,  # noqa: ANN001
                        seed: int = 0) -> tuple[torch.Tensor, list]:
    """``transcover.lipschitz._local_lower.drift_lower`` (the same return: per output token the attained
    ``nu_i(J(Y) - J(X))`` and the best witness ``[value, token, Y, V]``) with its ``restarts x len(tokens)`` starts
    in one batch (``fn`` must act on leading batch axes): each start's draws from the one generator in the loop's
    order (``u``, then the offset), its own ``_drift_step`` (the unit rows ``V`` of ``(J(Y) - J(X))^T w``, the
    rows ``(J(Y) - J(X)) V`` and the gradient in ``Y`` of ``u^T (J(Y) V)_i``), its own halving ascent
    (``_HalvingAscent``: keep or halve on token ``i``'s row, the step along the kept gradient's unit rows, clipped)
    and ``steps + 1`` evaluated points; the witness is the first start's (in the loop's order) largest row, at its
    first step attaining it, as the loop keeps it."""
    X = X.detach().double()
    T, d = X.shape
    g = torch.Generator().manual_seed(seed)
    n = restarts * len(tokens)
    idx = torch.tensor([int(tokens[k % len(tokens)]) for k in range(n)])
    us, Cs = [], []
    for _ in range(n):  # drift_lower draws u, then the offset, per start
        us.append(_lib_unit_rows(torch.randn(d, generator=g, dtype=F64)))
        Cs.append(rho * _SHRINK * _lib_unit_rows(torch.randn(X.shape, generator=g, dtype=F64)))
    u, C = torch.stack(us), torch.stack(Cs)
    b = torch.arange(n)
    eta = torch.ones(n, dtype=F64)
    prev = torch.full((n,), -math.inf, dtype=F64)
    Cb, gb = C, torch.full_like(C, math.nan)
    Xb = X.expand(n, T, d)
    vals = torch.zeros(T, dtype=F64)
    bval = torch.full((n,), -1.0, dtype=F64)
    btok = torch.zeros(n, dtype=torch.long)
    bY, bV = Xb.clone(), torch.zeros_like(Xb)
    for s in range(steps + 1):
        w = torch.zeros(n, T, d, dtype=F64)
        w[b, idx] = u
        Xr = Xb.clone().requires_grad_(True)
        (g0,) = torch.autograd.grad(fn(Xr), Xr, w)
        Yp = X + C
        Yr = Yp.detach().clone().requires_grad_(True)
        wr = w.clone().requires_grad_(True)
        (gg,) = torch.autograd.grad(fn(Yr), Yr, wr, create_graph=True)
        V = _lib_unit_rows((gg - g0).detach())
        JV, gY = torch.autograd.grad((gg * V).sum(), (wr, Yr), allow_unused=True)
        if gY is None:  # fn linear: its Jacobian does not drift
            gY = torch.zeros_like(Yr)
        J0V = torch.autograd.functional.jvp(fn, Xb.clone(), V)[1]
        DV, gY = (JV - J0V).detach(), gY.detach()
        rows = DV.norm(dim=-1)  # (n, T)
        vals = torch.maximum(vals, rows.amax(dim=0))
        top, t = rows.max(dim=-1)
        better = top > bval  # each start's first step attaining its largest row
        bval = torch.where(better, top, bval)
        btok = torch.where(better, t, btok)
        bY = torch.where(better[:, None, None], Yp.detach(), bY)
        bV = torch.where(better[:, None, None], V, bV)
        val_i = rows[b, idx]
        kept = val_i >= prev
        prev = torch.where(kept, val_i, prev)
        Cb = torch.where(kept[:, None, None], C, Cb)
        gb = torch.where(kept[:, None, None], gY, gb)
        u = torch.where(kept[:, None], _lib_unit_rows(DV[b, idx]), u)
        eta = torch.where(kept, eta, 0.5 * eta)
        if s == steps:
            break
        C = _clip(Cb + (eta * rho)[:, None, None] * _lib_unit_rows(gb), rho)
        eta = torch.clamp(eta, max=0.5)
    k = int(torch.nonzero(bval == bval.max())[0]) if bool(torch.isfinite(bval).all()) else int(bval.argmax())
    best = [float(bval[k]), int(btok[k]), bY[k].clone(), bV[k]] if float(bval[k]) > -1.0 else [-1.0, 0, X, None]
    return vals, best
