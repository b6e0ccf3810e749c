"""Batched forms of test ascents (test helper): the same starts, steps, step sizes and draws as
the loops they replace, every start of every ascent in one tensor computation per step.

Why this is the same attack: Adam acts entrywise (each parameter tensor its own moments, each param group its own
step size), and the gradient of a sum of per-start values in one start's entries is that start's own gradient; so
start s of ascent k in the batch takes exactly the steps it took alone (to the rounding of a batched forward).
"""

from __future__ import annotations

import torch

from lipschitz_testkit import clip_rows
from test_lipschitz_local import _clip
from test_local_sphere import _centre


def stage_values(layer, ref: dict, names: list, Zs: list) -> list:  # noqa: ANN001
    """``[(_stage_outputs(layer, Z)[name] - ref[name]).norm(dim=-1) for name, Z in zip(names, Zs)]`` (``Z`` of shape
    (starts, T, d), ``test_local_sharp._stage_outputs``' stages) with each sub-stage evaluated once on the stacked
    starts that read it: post-LN the attention on every start, the first norm on the starts of ``norm_attn`` and
    ``ffn``, the FFN on those of ``ffn`` alone (each start's value is its own stage's, as alone)."""
    from transcover.model import attention_forward, ffn_forward

    sizes = [Z.shape[0] for Z in Zs]
    Z = torch.cat(Zs)
    d = Z.shape[-1]
    idx, at = {}, 0
    for name, n in zip(names, sizes):
        idx.setdefault(name, []).append(torch.arange(at, at + n))
        at += n
    idx = {k: torch.cat(v) for k, v in idx.items()}
    out = {}
    P = torch.eye(d, dtype=torch.float64) - 1.0 / d
    if layer.placement.value == "post":
        S1 = Z + attention_forward(layer.attention, Z)
        if "attention" in idx:
            out["attention"] = S1[idx["attention"]] @ P
        hn = torch.cat([idx[k] for k in ("norm_attn", "ffn") if k in idx]) if {"norm_attn", "ffn"} & idx.keys() \
            else None
        if hn is not None:
            H = layer.norm_attn(S1[hn])
            pos = {int(j): k for k, j in enumerate(hn)}
            if "norm_attn" in idx:
                out["norm_attn"] = H[[pos[int(j)] for j in idx["norm_attn"]]]
            if "ffn" in idx:
                Hf = H[[pos[int(j)] for j in idx["ffn"]]]
                out["ffn"] = (Hf + ffn_forward(layer.ffn, Hf)) @ P
    else:
        Y = layer.norm_attn(Z)
        if "attention" in idx:
            out["attention"] = Y[idx["attention"]]
        if "norm_ffn" in idx:
            j = idx["norm_ffn"]
            out["norm_ffn"] = Z[j] + attention_forward(layer.attention, Y[j])
    # back to the jobs' order: each job's rows of its stage's output, in the order they were stacked
    res, seen = [], {k: 0 for k in idx}
    for name, n in zip(names, sizes):
        res.append((out[name][seen[name]:seen[name] + n] - ref[name]).norm(dim=-1))
        seen[name] += n
    return res


def stage_ascents(layer, X: torch.Tensor, jobs: list, g: torch.Generator, *, starts: int, steps: int) -> list:  # noqa: ANN001
    """``[test_local_sharp._ascent(lambda Z: (_stage_outputs(layer, Z)[name] - ref[name]).norm(dim=-1), X, r, g,
    starts=starts, steps=steps) for r, name in jobs]`` (``ref = _stage_outputs(layer, X)``), the calls made in
    ``jobs``' order from the same ``g``, in one batched ascent: per job the projected ascent's starts drawn from ``g``
    in turn (``starts`` draws of E, clipped into the ball), Adam at ``0.1 r``; the sphere ascent's starts from its
    own generator seeded ``g.initial_seed() + 1`` (as ``_ascent`` seeds it for every call), Adam at 0.3 on the
    directions; ``steps`` steps of both; per job the max of both (T,)."""
    from test_local_sharp import _stage_outputs

    ref = {k: v.detach() for k, v in _stage_outputs(layer, X).items()}
    E, V, groups = [], [], []
    for r, _ in jobs:
        Ej = torch.stack([clip_rows(torch.randn(X.shape, generator=g, dtype=torch.float64) * r, r)
                          for _ in range(starts)]).requires_grad_(True)
        gs = torch.Generator().manual_seed(g.initial_seed() + 1)
        Vj = torch.randn((starts, *X.shape), generator=gs, dtype=torch.float64).requires_grad_(True)
        E.append(Ej)
        V.append(Vj)
        groups += [{"params": [Ej], "lr": 0.1 * r}, {"params": [Vj], "lr": 0.3}]
    opt = torch.optim.Adam(groups)
    names = [n for _, n in jobs]
    best = [torch.zeros(X.shape[0], dtype=torch.float64) for _ in range(2 * len(jobs))]
    for step in range(steps):
        with torch.no_grad():
            for Ej, (r, _) in zip(E, jobs):
                Ej.copy_(clip_rows(Ej, r))
        Zs = [X + Ej for Ej in E] + [X + r * Vj / Vj.norm(dim=-1, keepdim=True) for Vj, (r, _) in zip(V, jobs)]
        vals = stage_values(layer, ref, names + names, Zs)
        if step == 0:  # the batched stages are each start's own stage value (the harness attacks what it says)
            for name, Zj, vj in ((names[0], Zs[0], vals[0]), (names[-1], Zs[-1], vals[-1])):
                alone = (_stage_outputs(layer, Zj[-1].detach())[name] - ref[name]).norm(dim=-1)
                assert torch.allclose(vj[-1], alone, rtol=1e-6, atol=1e-9 * float(alone.abs().max())), "not batched"
        best = [torch.maximum(b, v.detach().amax(dim=0)) for b, v in zip(best, vals)]
        opt.zero_grad()
        (-sum(v.sum() for v in vals)).backward()
        opt.step()
    return [torch.maximum(p, s) for p, s in zip(best[:len(jobs)], best[len(jobs):])]


def bilinear_lowers(values, shape: tuple, seeds: list, *, restarts: int, steps: int) -> list:  # noqa: ANN001
    """``[bilinear_lower(objective_k, shape, restarts=restarts, steps=steps, seed=seeds[k]) for k]`` in one batch:
    ``values(h, v)`` maps unit-row points (restarts, K, *shape) to (restarts, K), entry (s, k) objective k at
    ``h[s, k]``, ``v[s, k]`` alone.  Per k and restart the draws of ``bilinear_lower`` (a, then b, from the generator
    seeded ``seeds[k]``, restart after restart), Adam at 0.05 on a, b through ``a / ||a||`` per row; per k the best
    value seen."""
    a, b = [], []
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    draws = [[(torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64))
              for _ in range(restarts)] for g in gens]  # per seed, restart after restart: a then b
    a = torch.stack([torch.stack([draws[k][s][0] for k in range(len(seeds))]) for s in range(restarts)])
    b = torch.stack([torch.stack([draws[k][s][1] for k in range(len(seeds))]) for s in range(restarts)])
    a.requires_grad_(True)
    b.requires_grad_(True)
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    opt = torch.optim.Adam([a, b], lr=0.05)
    best = torch.zeros(restarts, len(seeds), dtype=torch.float64)
    for _ in range(steps):
        val = values(unit(a), unit(b))
        best = torch.maximum(best, val.detach())
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return best.amax(dim=0).tolist()


def score_changes(attn, X: torch.Tensor, P: torch.Tensor, rho: float, mixed: bool, h: int):  # noqa: ANN001, ANN201
    """``test_local_stack17.score_change(attn, X, P, rho, mixed, h, i)`` for every query i at once, as ``values`` of
    ``bilinear_lowers`` (K = T objectives, objective i query i's): head ``h``'s largest visible centred score change
    at ``Z = X + rho hz``, tangent ``v`` (prefix rows, or the unit ball: ``mixed``).  The softmax row ``P'`` at Z is
    read without gradient, as ``score_change`` reads it from ``_head_data`` (``certified_weights`` detaches Z): here
    the plain softmax of the same scores (``attention_scores``), equal to rounding."""
    from transcover.model import attention_scores

    Wq, Wk, bq, bk = attn.W_Q[h], attn.W_K[h], attn.b_Q[h], attn.b_K[h]
    T = X.shape[0]
    i = torch.arange(T)

    def values(hz: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # (R, T, T, d) each: [s, i] objective i's
        Z = X + rho * hz
        E = v if mixed else torch.einsum("kjab,...jb->...ka", P, v)
        Pz = torch.softmax(attention_scores(attn, Z.detach(), h), dim=-1)[:, i, i]  # (R, T, T): query i's row
        Ei, Zi = E[:, i, i], Z[:, i, i]  # (R, T, d): query i's own rows
        ds = attn.softmax_scale * (torch.einsum("rie,rije->rij", Ei @ Wq, Z @ Wk + bk)
                                   + torch.einsum("rie,rije->rij", Zi @ Wq + bq, E @ Wk))
        c = ds - (Pz * ds).sum(dim=-1, keepdim=True)
        return torch.where(Pz > 0, c.abs(), torch.zeros_like(c)).amax(dim=-1)
    return values


def token_lowers(F, shape: tuple, seeds: list, *, restarts: int, steps: int) -> list:  # noqa: ANN001
    """Per output token k, ``bilinear_lower(lambda h, v: F(h, v)[k].norm(), shape, restarts=restarts, steps=steps,
    seed=seeds[k])`` for a map ``F`` of unit-row pairs (T, d) to token rows (T, m) that acts on leading batch axes, the
    ``len(seeds)`` ascents in one batch (``bilinear_lowers``): entry (s, k) is ``F`` at its own pair, token k's norm."""
    k = torch.arange(len(seeds))
    return bilinear_lowers(lambda h, v: F(h, v)[:, k, k].norm(dim=-1), shape, seeds, restarts=restarts, steps=steps)


def batched_jvp(f, Z: torch.Tensor, E: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """``D f(Z)[E]`` (double-backward jvp, differentiable) of a map acting on leading batch axes, ``Z`` broadcast to
    ``E``'s shape (each batch entry its own point and direction)."""
    return torch.autograd.functional.jvp(f, Z.expand_as(E).contiguous(), E, create_graph=True)[1]


# test_local_stack15's norm-stage attack (stop 51, helper speed-stack): ``centred_ascents`` is
# ``test_local_sphere._centred_ascent`` (``unit_v=True``) for several objectives at once, every start of every objective
# (projected and on the sphere) one entry of one batch; ``norm_jacobians`` the m points' norm Jacobians in one call.


def norm_jacobians(norm, X: torch.Tensor, E: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """``torch.stack([_norm_parts(norm, X + E[k])[0] for k in range(m)])`` (m, T, d, d) for moves E (m, T, d), the m
    points' tokens through one ``_norm_parts`` call: every quantity it forms is per token (row means, row norms, the
    token's own ``D``), so each token's Jacobian is the one of its own point."""
    from transcover.lipschitz._local_jacobian import _norm_parts

    m, T, d = E.shape
    return _norm_parts(norm, (X[None] + E).reshape(m * T, d))[0].reshape(m, T, d, d)


def centred_ascents(values: list, kind: str, shape: tuple, r: float, gen: torch.Generator, *, starts: int, steps: int,
                    lr: float) -> list:
    """``[_centred_ascent(value, kind, shape, r, gen, starts=, steps=, lr=, unit_v=True) for value in values]``, every
    ascent in one batch, the same draws in the same order: each objective's projected starts (E then V per start) from
    ``gen`` after the previous objective's, its sphere starts from a fresh generator seeded ``gen.initial_seed() + 1``
    (the same ones for every objective, as each call draws them); the same projection, steps and learning rates (four
    Adam parameter groups: projected E and V at ``lr``, sphere E at ``0.3 r`` and V at ``0.3``).  Adam acts entrywise
    and each (objective, start)'s value depends on its own rows alone, so the summed loss gives each the gradient and
    update it has alone.  ``values[k]`` maps moves and unit rows (m, T, d) to (m, T); per objective the largest value
    seen per token."""
    K = len(values)
    pE, pV, sE, sV = [], [], [], []
    for _ in range(K):
        for _ in range(starts):
            pE.append(_clip(_centre(kind, torch.randn(*shape, generator=gen, dtype=torch.float64)) * r, r))
            pV.append(torch.randn(*shape, generator=gen, dtype=torch.float64))
        g = torch.Generator().manual_seed(gen.initial_seed() + 1)
        for _ in range(starts):
            sE.append(_clip(_centre(kind, torch.randn(*shape, generator=g, dtype=torch.float64)) * r, r))
            sV.append(torch.randn(*shape, generator=g, dtype=torch.float64))
    pE, pV, sE, sV = (torch.stack(t).requires_grad_(True) for t in (pE, pV, sE, sV))  # (K starts, T, d), k-major
    opt = torch.optim.Adam([{"params": [pE], "lr": lr}, {"params": [pV], "lr": lr},
                            {"params": [sE], "lr": 0.3 * r}, {"params": [sV], "lr": 0.3}])
    best = torch.zeros(K, shape[0], dtype=torch.float64)
    unit = lambda V: V / V.norm(dim=-1, keepdim=True)  # noqa: E731
    for _ in range(steps):
        with torch.no_grad():
            pE.copy_(_clip(_centre(kind, pE), r))
        C = _centre(kind, sE)
        sM = r * C / C.norm(dim=-1, keepdim=True)
        vals = []
        for k, value in enumerate(values):
            sl = slice(k * starts, (k + 1) * starts)
            vals.append(value(torch.cat([pE[sl], sM[sl]]), torch.cat([unit(pV[sl]), unit(sV[sl])])))  # (2 starts, T)
        val = torch.stack(vals)  # (K, 2 starts, T)
        best = torch.maximum(best, val.detach().amax(dim=1))
        opt.zero_grad()
        (-val.sum()).backward()
        opt.step()
    return list(best)
