"""Batched forms of attacks several test files share (test helper): the same starts, steps, step sizes and draws as
the per-start loops they replace (``lipschitz_testkit.projected_adam``, ``sphere_adam``, ``sphere_ascent``,
``test_local_stack19._moves_ascent``), every start (and every independent ascent) one slice of one batch.

Adam acts entrywise and the gradient of a sum of independent objectives in one slice is that slice's own, so each
slice follows the ascent it replaces, to rounding; a batched step costs about what one single step did."""

from __future__ import annotations

import torch

from lipschitz_testkit import clip_rows
from test_local_stack19 import _stage_inputs as stage_inputs  # acts per (T, d) slice of a batch (..., T, d)


def _best(best: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``best`` raised by the finite-or-inf values of ``v`` (a NaN never raises it, as ``max(best, nan)`` does not)."""
    return torch.maximum(best, torch.where(torch.isnan(v), best, v))


def projected_adam_batched(value, starts: list, radii: tuple, lr: float, steps: int) -> torch.Tensor:  # noqa: ANN001
    """``projected_adam(value1, starts, radii, lr, steps)`` with the starts in one batch: ``value`` maps the
    parameters, each ``(S, *shape)`` (S the number of starts), to ``(S,)``, entry s ``value1`` of slice s.  Returns
    (S,) the largest value each start's ascent saw (``projected_adam``'s result is their max)."""
    ps = [torch.stack([clip_rows(st[j], c) for st in starts]).clone().requires_grad_(True)
          for j, c in enumerate(radii)]
    opt = torch.optim.Adam(ps, lr=lr)
    best = torch.zeros(len(starts), dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            for p, c in zip(ps, radii):
                p.copy_(clip_rows(p, c))
        v = value(*ps)
        best = _best(best, v.detach())
        opt.zero_grad()
        (-v.sum()).backward()
        opt.step()
    return best


def sphere_adam_batched(value, starts: list, radii: tuple, steps: int, lr: float = 0.3) -> torch.Tensor:  # noqa: ANN001
    """``sphere_adam(value1, starts, radii, steps, lr)`` with the starts in one batch (``value`` and the result as in
    ``projected_adam_batched``)."""
    Vs = [torch.stack([st[j] for st in starts]).clone().requires_grad_(True) for j in range(len(radii))]
    opt = torch.optim.Adam(Vs, lr=lr)
    best = torch.zeros(len(starts), dtype=torch.float64)
    for _ in range(steps):
        v = value(*(c * V / V.norm(dim=-1, keepdim=True).clamp(min=1e-300) for V, c in zip(Vs, radii)))
        best = _best(best, v.detach())
        opt.zero_grad()
        (-v.sum()).backward()
        opt.step()
    return best


def moves_ascent(spec, X: torch.Tensor, rho: float, seed: int, *, starts: int = 2, steps: int = 50) -> torch.Tensor:  # noqa: ANN001
    """``test_local_stack19._moves_ascent`` with every (start, stage, token) ascent's forward in one batch: (stages, T)
    the largest ``||x_s(X + E)_i - x_s(X)_i||`` Adam finds over moves E with every row within rho, one ascent per
    (stage, token) from seed ``seed + k`` (``jvp_ascents``: the same draws, steps and step sizes)."""
    from lipschitz_testkit import jvp_ascents

    base = torch.stack([x.detach() for x in stage_inputs(spec, X)])  # (n, T, d)
    n, T = base.shape[0], X.shape[0]
    k = torch.arange(n * T)
    st, i = k // T, k % T

    def value(E, V):  # noqa: ANN001, ANN202, ARG001
        ys = torch.stack(stage_inputs(spec, X + E))  # (n, S, K, T, d): every stage of every (start, ascent)
        return (ys[st, :, k, i] - base[st, i][:, None]).norm(dim=-1).T  # (S, K): ascent k's own stage and token

    return torch.tensor(jvp_ascents(value, X, rho, [seed + kk for kk in range(n * T)], starts=starts, steps=steps),
                        dtype=torch.float64).reshape(n, T)


def sphere_moves(spec, X: torch.Tensor, rho: float, seed: int, *, starts: int = 3, steps: int = 30) -> torch.Tensor:  # noqa: ANN001
    """``test_local_redteam19b._sphere_moves`` with the stages' ascents in one batch: per stage the ``sphere_ascent``
    (starts drawn from one generator seeded ``seed``, stage after stage, as the sequential ascents drew them) of
    every token's move of that stage's input; (stages, T)."""
    base = torch.stack([x.detach() for x in stage_inputs(spec, X)])  # (n, T, d)
    n = base.shape[0]
    g = torch.Generator().manual_seed(seed)
    # sphere_ascent draws its starts first and nothing else: stage after stage, the same draws
    V = torch.stack([torch.randn((starts, *X.shape), generator=g, dtype=torch.float64) for _ in range(n)])
    V.requires_grad_(True)  # (n, starts, T, d)
    opt = torch.optim.Adam([V], lr=0.3)
    best = torch.zeros(n, X.shape[0], dtype=torch.float64)
    s = torch.arange(n)
    for _ in range(steps):
        ys = torch.stack(stage_inputs(spec, X + rho * V / V.norm(dim=-1, keepdim=True)))  # (n_out, n, S, T, d)
        val = (ys[s, s] - base[:, None]).norm(dim=-1)  # (n, S, T): ascent s's own stage
        best = torch.maximum(best, val.detach().amax(dim=1))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return best
