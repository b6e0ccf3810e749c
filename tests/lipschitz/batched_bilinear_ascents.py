"""Batched forms of the bilinear ascents of ``test_local_stack16`` and ``test_local_stack17`` (test helper).

Each replaces a loop ``[bilinear_lower(obj_k, shape, restarts=R, steps=S, seed=seeds[k]) for k]`` whose objectives
could not be mapped by ``torch.func.vmap`` (an ``autograd.functional.jvp`` inside, or ``_head_data``'s certified
weights), so that every restart of every ascent ran one after another: here all ``K x R`` ascents are slices of one
batch (``batched_stage_ascents.bilinear_lowers``: per k and restart the same draws from the generator seeded
``seeds[k]``, the same Adam steps at lr 0.05 through ``a / ||a||`` per row; Adam acts entrywise and the gradient of
the summed values in a slice is that slice's own, so each slice follows its own ascent to rounding).

``checked`` compares the batched values on their first evaluation with the per-ascent objectives they replace, on
every ascent k (the harness attacks what the test says it attacks)."""

from __future__ import annotations

import torch

from batched_stage_ascents import batched_jvp, bilinear_lowers
from test_local_stack_attn import _rows


def checked(values, objs: list, atol: float):  # noqa: ANN001, ANN201
    """``values`` (entry (s, k) of ``values(h, v)`` objective k at ``h[s, k]``, ``v[s, k]``), asserting on its first
    call that entry (s, k) is ``objs[k]`` at the same point for the last restart s and every k (within 1e-7 relative
    plus ``atol``)."""
    first = [True]

    def f(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = values(h, v)
        if first[0]:
            first[0] = False
            for k, obj in enumerate(objs):
                alone = obj(h[-1, k].detach().clone(), v[-1, k].detach().clone()).detach()
                got = out[-1, k].detach()
                assert torch.allclose(got, alone, rtol=1e-7, atol=atol), ("not batched", k, got, alone)
        return out
    return f


def reach_values(layer, X: torch.Tensor, P: torch.Tensor, rho: float, drift: float, eP: float,  # noqa: ANN001
                 M: torch.Tensor | None = None):  # noqa: ANN201
    """``test_local_redteam14_stack.aligned_reach_case``'s ``obj(k)`` for every token k at once, as ``values`` of
    ``bilinear_lowers`` (shape (2T, d)): ``||[(DA(X + Delta) - DA(X)) E]_k||`` for the move ``Delta = rho P h +
    emax e`` and the tangent ``E = P v + eP eps`` (``emax = rho max(drift nu + eP)``, ``nu = certified_rows(P)``, as
    there); ``M`` (T, d, d): each token's row seen through ``M_k`` first (the token-map tests, whose move and tangent
    are ``rho P h`` and ``P v`` of (T, d) points: drift = eP = 0 and no second half)."""
    from transcover.lipschitz._local_stack import certified_rows
    from transcover.model import attention_forward

    attn = layer.attention
    T = X.shape[0]
    emax = rho * float((drift * certified_rows(P) + eP).max())
    A = lambda Z: attention_forward(attn, Z)  # noqa: E731
    k = torch.arange(T)

    def values(he: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:  # (R, T, n, d) each -> (R, T)
        Delta, E = rho * _rows(P, he[..., :T, :]), _rows(P, vs[..., :T, :])
        if M is None:
            Delta, E = Delta + emax * he[..., T:, :], E + eP * vs[..., T:, :]
        F = batched_jvp(A, X + Delta, E) - batched_jvp(A, X, E)  # (R, K, T, d)
        Fk = F[:, k, k]  # (R, K, d): ascent k's own token
        if M is not None:
            Fk = torch.einsum("kab,rkb->rka", M, Fk)
        return Fk.norm(dim=-1)
    return values


def reach_lowers(values, objs: list, shape: tuple, seeds: list, *, restarts: int, steps: int) -> list:  # noqa: ANN001
    """``[bilinear_lower(objs[k], shape, restarts=restarts, steps=steps, seed=seeds[k]) for k]`` in one batch
    (``values`` their batched form, checked against ``objs`` on its first call)."""
    return bilinear_lowers(checked(values, objs, 1e-12), shape, seeds, restarts=restarts, steps=steps)


def value_side_values(attn, X: torch.Tensor, P: torch.Tensor, rho: float, mixed: bool, h: int, c: dict,  # noqa: ANN001
                      K: list):  # noqa: ANN201
    """``test_local_stack16.test_value_side_terms_are_never_beaten``'s ``obj`` of head ``h`` for every query i at once,
    as ``values`` of ``bilinear_lowers`` (shape (2T, d), ascent i query i's): at ``Z = X + rho hz[T:]``, ``v . H_i(Z)
    [Delta, E]`` (``head_second_derivative``: ``Delta = hz[:T]`` (``mixed``) or ``P hz[:T]``, ``E = P v[:T]``, ``u`` the
    first d_h entries of ``v[T]``) less the seminorms' combination with the coefficients ``c`` and the cores ``K[i]``.
    The softmax row ``P'`` at Z is read without gradient, as ``_head_data`` reads it (``certified_weights`` detaches Z):
    here the plain softmax of the same scores (``attention_scores``), equal to rounding."""
    from transcover.lipschitz._local_stack_joint import KINDS
    from transcover.model import attention_scores

    Wq, Wk, Wv, _ = attn.head(h)
    bq = attn.b_Q[h]
    sc = attn.softmax_scale
    G = sc * Wq @ Wk.T
    T, dh = X.shape[0], Wv.shape[1]
    i = torch.arange(T)
    Ks = {k: torch.stack([K[q][k] for q in range(T)]) for k in KINDS}  # (T, dh, dh): query i's core
    cs = {k: torch.as_tensor(c[k], dtype=torch.float64)[:T] for k in (*KINDS, "1")}

    def values(hz: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # (R, T, 2T, d) each -> (R, T)
        Z = X + rho * hz[..., T:, :]  # (R, I, T, d): ascent i's point
        Pi = torch.softmax(attention_scores(attn, Z.detach(), h), dim=-1)[:, i, i]  # (R, I, T): query i's row
        Y = Z - torch.einsum("rij,rijd->rid", Pi, Z)[:, :, None, :]  # (R, I, T, d): y_ij = z_j - P'_i Z
        q = sc * (Z[:, i, i] @ Wq + bq) @ Wk.T  # (R, I, d)
        D = hz[..., :T, :] if mixed else _rows(P, hz[..., :T, :])
        E = _rows(P, v[..., :T, :])
        Di, Ei = D[:, i, i], E[:, i, i]  # (R, I, d)
        dt = D - torch.einsum("rij,rijd->rid", Pi, D)[:, :, None, :]
        et = E - torch.einsum("rij,rijd->rid", Pi, E)[:, :, None, :]
        Gy = Y @ G.T
        a = torch.einsum("rijd,rid->rij", Gy, Di) + torch.einsum("rijd,rid->rij", dt, q)
        cc = torch.einsum("rijd,rid->rij", Gy, Ei) + torch.einsum("rijd,rid->rij", et, q)
        cross = torch.einsum("rijd,rid->rij", dt, Ei @ G) + torch.einsum("rijd,rid->rij", et, Di @ G)
        inner = (torch.einsum("rij,rijd->rid", Pi * a, et) + torch.einsum("rij,rijd->rid", Pi * cc, dt)
                 + torch.einsum("rij,rijd->rid", Pi * (a * cc + cross), Y))
        u = v[..., T, :dh]  # (R, I, dh)
        val = ((inner @ Wv) * u).sum(dim=-1)
        bound = sum(cs[k] * torch.sqrt(torch.einsum("ria,iab,rib->ri", u, Ks[k], u) + 1e-300) for k in KINDS) \
            + cs["1"] * u.norm(dim=-1)
        return val - bound
    return values
