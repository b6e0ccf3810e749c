"""Batched forms of ascents of test_local_redteam15b (test helper, branch speed-redteam): several independent ascents
of one test -- the same starts (the same draws from the same generators, in the same order), steps, step sizes --
run as slices of one batch, one forward and one backward per step for all of them instead of one per ascent.

Why this is the same attack: Adam acts entrywise (each parameter group its own step size), and the gradient of a
sum of per-slice values in one slice's entries is that slice's own gradient (the maps act on leading batch axes); so
every slice takes exactly the steps it took in its own loop (to the rounding of a batched forward).  Each helper
checks at its first step that a slice's batched value is its value alone.
"""

from __future__ import annotations

import torch

from lipschitz_testkit import clip_rows

F64 = torch.float64


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
