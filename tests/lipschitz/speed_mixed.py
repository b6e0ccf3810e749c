"""Batched forms of attacks that the files of branch speed-mixed ran one start at a time (test helper): the same
draws, starts, steps and step rules as the loops they replace, every independent start one slice of one batch.

Each start's objective and step depend on its own slice only (the maps act on leading batch axes, and the gradient
of a sum of independent objectives in one slice is that slice's own), so each slice follows the start it replaces,
to rounding; a batched step costs about what one single step did."""

from __future__ import annotations

import math

import torch

from transcover.lipschitz._local_lower import _SHRINK, _clip, _unit_rows

F64 = torch.float64


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
        us.append(_unit_rows(torch.randn(d, generator=g, dtype=F64)))
        Cs.append(rho * _SHRINK * _unit_rows(torch.randn(X.shape, generator=g, dtype=F64)))
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
        V = _unit_rows((gg - g0).detach())
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
        u = torch.where(kept[:, None], _unit_rows(DV[b, idx]), u)
        eta = torch.where(kept, eta, 0.5 * eta)
        if s == steps:
            break
        C = _clip(Cb + (eta * rho)[:, None, None] * _unit_rows(gb), rho)
        eta = torch.clamp(eta, max=0.5)
    k = int(torch.nonzero(bval == bval.max())[0]) if bool(torch.isfinite(bval).all()) else int(bval.argmax())
    best = [float(bval[k]), int(btok[k]), bY[k].clone(), bV[k]] if float(bval[k]) > -1.0 else [-1.0, 0, X, None]
    return vals, best


def gelu_ffn_jacobians(ffn, h: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """``jacobian(lambda u: gelu(u @ W_1 + b_1) @ W_2, h_t, create_graph=True)`` (output x input) for every row
    ``h_t`` of ``h`` (..., d) at once, in closed form ``W_2^T diag(gelu'(u_t)) W_1^T`` with ``gelu'`` by one autograd
    pass through the elementwise GELU (its Jacobian's diagonal): the same entries to rounding, differentiable in h."""
    u = h @ ffn.W_1 + ffn.b_1
    if not u.requires_grad:
        u = u.requires_grad_(True)
    (s,) = torch.autograd.grad(torch.nn.functional.gelu(u).sum(), u, create_graph=True)
    return ffn.W_2.T @ (s[..., :, None] * ffn.W_1.T)
