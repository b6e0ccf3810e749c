"""Batched forms of test references that several ascents share: the same draws and the same Adam
steps as the one-call-per-ascent forms they replace, to rounding (Adam acts entrywise, and each entry's gradient of
the summed values is that entry's own)."""

from __future__ import annotations

import torch

from lipschitz_testkit import clip_rows, sphere_ascent


def grouped_ascents(value, X: torch.Tensor, r: float, draws: list, groups: int, *, seed: int,  # noqa: ANN001
                    steps: int) -> list:
    """``test_local_sharp._ascent(value, X, r, g, starts=n, steps=steps)`` for ``groups`` calls at the same ``r`` and
    ``value`` whose generator ``g`` (seeded ``seed``) drew the unit-scale starts ``draws`` (``groups`` x n tensors
    (T, d), in the calls' order: ``torch.randn(X.shape, generator=g)`` each): per call, the per-token best (T,).
    The calls' projected ascents run as one batch of ``groups`` x n starts (each start's own draw and Adam steps);
    their sphere ascents (``sphere_ascent`` from ``Generator(seed + 1)``, n starts, the same for every call: its
    draws do not depend on ``g``'s state) are computed once."""
    n = len(draws) // groups
    E = torch.stack([clip_rows(D * r, r) for D in draws]).requires_grad_(True)
    opt = torch.optim.Adam([E], lr=0.1 * r)
    best = torch.zeros(len(draws), X.shape[0], dtype=torch.float64)
    for step in range(steps):
        with torch.no_grad():
            E.copy_(clip_rows(E, r))
        val = value(X + E)
        if step == 0:  # a value that mixed the batch axis in would attack something else
            alone = value(X + E[-1].detach())
            assert torch.allclose(val[-1], alone, rtol=1e-6, atol=1e-9 * float(alone.abs().max())), "not batched"
        best = torch.maximum(best, val.detach())
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    sph = sphere_ascent(value, X, r, torch.Generator().manual_seed(seed + 1), starts=n, steps=steps)
    return [torch.maximum(best[c * n:(c + 1) * n].amax(dim=0), sph) for c in range(groups)]


def batched_jvp_ascent(f, X: torch.Tensor, rho: float, *, seed: int, starts: int = 3, steps: int = 100) -> float:  # noqa: ANN001
    """``jvp_ascent(jvp_row_norm(f, X), X, rho, seed=seed, starts=starts, steps=steps)`` with every start's Jacobian-
    vector product in one call (``f`` must act on leading batch axes): the same objective per start, ``max_t ||(J_f(X +
    E) V)_t||``, the same draws and Adam steps (``jvp_ascents``, one seed), where ``jvp_ascent`` evaluates the starts
    one after another."""
    from lipschitz_testkit import jvp_ascents

    def value(E: torch.Tensor, V: torch.Tensor) -> torch.Tensor:  # (starts, 1, T, d) -> (starts, 1)
        _, out = torch.autograd.functional.jvp(f, (X + E,), (V,), create_graph=True)
        return out.norm(dim=-1).amax(dim=-1)

    return jvp_ascents(value, X, rho, [seed], starts=starts, steps=steps)[0]
