"""``_attack.attack_pairs`` with fewer passes (test helper of branch speed-props): the same starts, Adam steps,
step sizes, Jacobian points, power-iteration restarts and draws of the generator, so the same search to float64
rounding, where ``_attack`` spends most of its time on the overhead of tiny tensors:

* each ascent step evaluates ``f`` once on the pairs' two points stacked (``X`` and ``Y`` of every restart in one
  batch, one backward) instead of twice;
* the Jacobians at the power-iteration points come from one forward and one backward of a batch holding one copy of
  every point per output coordinate (row ``k`` of ``J(X_b)`` is the gradient of output ``k`` of copy ``(b, k)``),
  instead of one vmapped ``torch.autograd.functional.jacobian`` per point;
* the alternating row-block maximisation runs its restarts at every point as one batch, and the best iterate of
  every restart is made into a pair (``_attack`` keeps the best restart's only: a superset of its candidates, to
  rounding; its choice between restarts that converge to the same value turns on the last bit).

``f`` must act on each batch element alone (every map the attack is given does); the first step checks it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import _attack
from _attack import F64, Domain, Witness, _starts, mnorm, slack


def _check_batched(f, Z: Tensor, out: Tensor) -> None:  # noqa: ANN001
    """``f`` on the last element alone gives the batch's last output (a map mixing the batch would be misattacked)."""
    with torch.no_grad():
        alone = f(Z[-1:].detach(), None)
    ref, got = alone[0], out[-1].detach()
    both = torch.isfinite(ref) & torch.isfinite(got)
    assert torch.equal(torch.isfinite(ref), torch.isfinite(got)), "not batched"
    assert torch.allclose(got[both], ref[both], rtol=1e-9, atol=1e-12 * float(ref[both].abs().max() if both.any()
                                                                              else 0.0) + 1e-300), "not batched"


def _ratio(f, X: Tensor, Y: Tensor, dom: Domain, metric: str, check: bool = False):  # noqa: ANN001, ANN202
    """``_attack._ratio`` with ``f`` evaluated once on ``X`` and ``Y`` stacked (spreads split back per point)."""
    B = X.shape[0]
    sp: list = []
    Z = torch.cat([X, Y])
    out = f(Z, sp)
    if check:
        _check_batched(f, Z, out)
    fx, fy = out[:B], out[B:]
    sx, sy = [s[:B] for s in sp], [s[B:] for s in sp]
    dist = mnorm(Y - X, metric)
    ratio = mnorm(fy - fx, metric) / dist
    ok = dom.valid(X, sx) & dom.valid(Y, sy) & (dist > 0)
    return ratio, slack(fx.detach(), fy.detach(), dist.detach(), metric), ok


def jacobians(f, X: Tensor) -> Tensor:  # noqa: ANN001
    """``J[b] = torch.autograd.functional.jacobian(lambda Z: f(Z[None], None)[0], X[b])`` for every b, shape
    (B, Tout, dout, T, d), from one forward and one backward of ``B * Tout * dout`` copies of the points."""
    B, T, d = X.shape
    with torch.no_grad():
        shape = f(X[:1].detach(), None).shape[1:]
    K = math.prod(shape)
    Z = X.detach()[:, None].expand(B, K, T, d).reshape(B * K, T, d).clone().requires_grad_(True)
    with torch.enable_grad():
        Y = f(Z, None).reshape(B, K, K)
        eye = torch.eye(K, dtype=Y.dtype).expand(B, K, K)
        (G,) = torch.autograd.grad(Y, Z, eye)
    return G.reshape(B, *shape, T, d)


def jacobian_directions(f, X: Tensor, metric: str, g: torch.Generator, n_iter: int = 30) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """``_attack._jacobian_directions`` (the same draws of ``g``, the same restarts and iterations) with the points'
    Jacobians computed together and the restarts of every point iterated as one batch; returned as (point index,
    direction) pairs: under (2,inf) the best iterate of *each* restart (``_attack`` keeps the best of the three, whose
    choice between restarts that converge to the same value flips with the last bit: all three are tried), else the
    one direction of each point."""
    B, T, d = X.shape
    state = g.get_state()
    J = jacobians(f, X.detach())
    Tout, dout = J.shape[1], J.shape[2]
    Jt = J.reshape(B, Tout, dout, T * d)
    finite = [bool(torch.isfinite(J[b]).all()) for b in range(B)]
    idx, out, starts, who = [], [], [], []
    for b in range(B):  # the draws in _attack's order
        if not finite[b]:
            idx.append(b)
            out.append(torch.randn(T, d, generator=g, dtype=F64))
        elif metric == "fro":
            idx.append(b)
            out.append(torch.linalg.svd(Jt[b].reshape(Tout * dout, T * d), full_matrices=False)[2][0].reshape(T, d))
        else:
            for _ in range(3):
                V = torch.randn(T, d, generator=g, dtype=F64)
                starts.append(V / torch.linalg.vector_norm(V, dim=-1, keepdim=True))
            who.append(b)
    if who:
        P = len(who)
        Jw = Jt[torch.tensor(who)][:, None].expand(P, 3, Tout, dout, T * d)
        V = torch.stack(starts).reshape(P, 3, T, d)
        vals, Vs = [], []
        for _ in range(n_iter):
            JV = (Jw @ V.reshape(P, 3, 1, T * d, 1))[..., 0]  # (P, 3, Tout, dout)
            rows = torch.linalg.vector_norm(JV, dim=-1)
            t = rows.argmax(dim=-1)  # (P, 3)
            top = rows.gather(-1, t[..., None])[..., 0]
            vals.append(top)
            Vs.append(V)
            w = JV.gather(2, t[..., None, None].expand(-1, -1, 1, dout))[:, :, 0] / top.clamp_min(1e-300)[..., None]
            Jrow = Jw.gather(2, t[..., None, None, None].expand(-1, -1, 1, dout, T * d))[:, :, 0]  # (P, 3, dout, n)
            V = (w[:, :, None, :] @ Jrow)[:, :, 0].reshape(P, 3, T, d)
            V = V / torch.linalg.vector_norm(V, dim=-1, keepdim=True).clamp_min(1e-300)
        vals_t = torch.stack(vals, dim=2)  # (P, 3, n_iter)
        if bool(torch.isnan(vals_t).any()):  # the loop's NaN handling (and its fallback draw): run it as it is
            g.set_state(state)
            return torch.arange(B), _attack._jacobian_directions(f, X, metric, g, n_iter)
        k = vals_t.argmax(dim=-1)  # per restart the first largest value, as a strict > keeps it
        Vs_t = torch.stack(Vs, dim=2)  # (P, 3, n_iter, T, d)
        for j, b in enumerate(who):
            for r in range(3):
                idx.append(b)
                out.append(Vs_t[j, r, int(k[j, r])])
    return torch.tensor(idx), torch.stack(out)


def attack_pairs(f, *, T: int, d: int, dom: Domain, metric: str, restarts: int = 12, steps: int = 60,  # noqa: ANN001
                 seed: int = 0, n_jacobian: int = 4) -> Witness:
    """``_attack.attack_pairs`` (same arguments, same search; see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    w = Witness()
    R = dom.radius
    X0, U0, s0 = _starts(g, restarts, T, d, dom)
    X, U, s = (t.clone().requires_grad_(True) for t in (X0, U0, s0))
    opt = torch.optim.Adam([{"params": [X], "lr": 0.03 * R}, {"params": [U], "lr": 0.3 / math.sqrt(T * d)},
                            {"params": [s], "lr": 0.2}])
    for step in range(steps + 1):
        with torch.no_grad():
            X.copy_(dom.project(X))
            U.copy_(U / torch.linalg.vector_norm(U.flatten(-2), dim=-1).clamp_min(1e-300)[:, None, None])
            s.clamp_(math.log(1e-7 * R), math.log(4 * R))
        Y = dom.project(X + torch.exp(s)[:, None, None] * U)
        ratio, sl, ok = _ratio(f, X, Y, dom, metric, check=step == 0)
        w.offer(ratio.detach(), sl, ok, f"ascent step {step}")
        if step == steps:
            break
        opt.zero_grad()
        loss = -torch.log(ratio[torch.isfinite(ratio) & (ratio > 0)]).sum()
        if loss.requires_grad:
            loss.backward()
            opt.step()
    with torch.no_grad():
        Xa = dom.project(X.detach())
    Xj = torch.cat([Xa[: n_jacobian // 2], _starts(g, n_jacobian - n_jacobian // 2, T, d, dom)[0]])
    if Xj.shape[0]:
        at, V = jacobian_directions(f, Xj, metric, g)
        Xj = Xj[at]
        with torch.no_grad():
            for h in (1e-5, 1e-3):
                Y = dom.project(Xj + h * R * V / mnorm(V, metric)[:, None, None])
                ratio, sl, ok = _ratio(f, Xj, Y, dom, metric)
                w.offer(ratio, sl, ok, f"jacobian power iteration, step {h:g} R")
    return w
