"""F83 (issue 12, speed28): the attention's F44/F50 forms formed once per ``AttentionAligned`` (``head_sides`` per head,
side and segment point, the maps through ``W_O`` and ``M``, ``joint_reach``'s coefficient-free parts) and F78d's pieces
without the ``M``-side joint give the floats a fresh evaluation gives, bit for bit."""

from __future__ import annotations

import torch

import transcover.lipschitz._local_stack_attn as stack_attn
from test_local_stack16 import _layer
from test_local_stack_attn import _aligned, _case
from transcover.lipschitz._local_drift import SEGMENT_STEPS
from transcover.lipschitz._local_rows import _head_output_norms
from transcover.lipschitz._local_stack import certified_rows
from transcover.lipschitz._local_stack_joint import KINDS, aligned_hessian_terms, joint_basis, joint_reach

_REAL = stack_attn.head_sides


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int64), b.view(torch.int64))


def _with_map(seed: int, qscale: float, aligned: bool) -> tuple:
    """A post-LN layer's ``AttentionAligned`` behind a random prefix, with a random token-local map ``M`` after it
    (F44g), and the prefix rows."""
    layer, _ = _layer(seed, qscale, aligned=aligned)
    X, P = _case(seed)
    T, d = X.shape
    al = _aligned(layer, X, P)
    M = torch.randn(T, d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) / d**0.5
    eM = torch.full((T,), 1e-14, dtype=torch.float64)
    al.p["M"], al.p["MO"] = (M, eM), _head_output_norms(M, eM, al.p["heads"], T)
    return al, certified_rows(P)


def _fresh(al):  # noqa: ANN001, ANN202
    """A second instance on the same parts (its own empty memo)."""
    new = object.__new__(stack_attn.AttentionAligned)
    new.__dict__.update({k: v for k, v in al.__dict__.items() if k != "memo"}, memo={})
    return new


def test_formed_once_gives_the_fresh_floats():
    """After calls at other radii (their memo entries kept), ``joint``, ``drift`` and ``reach_heads`` at a radius are the
    floats of a fresh instance; ``joint(through=False)`` gives ``joint``'s first value (its second None); ``sup`` and
    ``aligned_hessian_terms`` with the kept ``head_sides`` are those without; ``joint_reach`` with ``joint_basis`` is
    ``joint_reach`` without (random coefficients, some zero, one inf)."""
    for seed, qscale, aligned, rho in ((11, 1.0, False, 0.05), (12, 4.0, True, 0.3)):
        al, nu = _with_map(seed, qscale, aligned)
        r, dP = rho * nu * (1 + 1e-12), 0.1 * nu
        g = torch.Generator().manual_seed(seed)
        heads = (torch.rand(len(al.proj), nu.shape[0], generator=g, dtype=torch.float64), 1.0, 0.0)
        for other in (0.5, 2.0):  # warm the memo at other radii (and segment points)
            al.joint(other * r, other * rho, dP, 1e-3, 1e-9)
            al.drift(other * r, other * rho, dP, 1e-3, 1e-9, heads)
        new = _fresh(al)
        for a, b in zip(al.joint(r, rho, dP, 1e-3, 1e-9), new.joint(r, rho, dP, 1e-3, 1e-9)):
            assert _bits(a, b)
        assert _bits(al.drift(r, rho, dP, 1e-3, 1e-9, heads)[0], new.drift(r, rho, dP, 1e-3, 1e-9, heads)[0])
        assert _bits(al.reach_heads(r, rho, dP, 1e-3, 1e-9), new.reach_heads(r, rho, dP, 1e-3, 1e-9))
        v, vM = _fresh(al).joint(r, rho, dP, 1e-3, 1e-9, through=False)
        assert vM is None and _bits(v, new.joint(r, rho, dP, 1e-3, 1e-9)[0])
        w, t = al.p["norms"], float(r.max()) / 3
        for h, (pj, m) in enumerate(zip(al.proj, al.p["mom"].rows)):
            args = (al.ball[h], pj, m, t, w["G"][h], w["V"][h], float(al.nQ[h]), float(al.nK[h]), al.p["scale"])
            kept = aligned_hessian_terms(*args, True, False, False, True, al.sides(h, True, t))
            for k, val in aligned_hessian_terms(*args, True, False, False, True).items():
                assert _bits(val, kept[k])
            assert _bits(stack_attn.aligned_hessian_sup(*args), al.sup(t, True)[h])
        cores, (MO, eMO) = al.cores(), al._maps(True)
        coef = {k: torch.rand(*cores["C"].shape[:2], generator=g, dtype=torch.float64) for k in (*KINDS, "1")}
        coef["N"][0, 0], coef["E"][-1, 1] = 0.0, float("inf")
        dh, (per, full) = al.p["heads"][0][6].shape[0], al.p["MO"]
        plain = joint_reach(coef, cores, MO, eMO, dh, per, full)
        assert _bits(plain, joint_reach(coef, cores, MO, eMO, dh, per, full, basis=joint_basis(cores, MO, dh)))


def test_head_sides_once_per_segment_point(monkeypatch):
    """``joint``, ``drift`` and ``reach_heads`` at one radius form ``head_sides`` once per head, side and segment point
    (F50a's terms, F44b's sups and F68b's ``acw`` read the same points): ``2 H n`` calls, not one per reader."""
    al, nu = _with_map(13, 1.0, False)
    r, z = 0.05 * nu, torch.zeros_like(nu)
    calls = []
    monkeypatch.setattr(stack_attn, "head_sides", lambda *a: calls.append(a[3]) or _REAL(*a))
    al.joint(r, 0.05, z, 0.0, 0.0)
    al.drift(r, 0.05, z, 0.0, 0.0, (torch.ones(len(al.proj), nu.shape[0], dtype=torch.float64), 1.0, 0.0))
    al.reach_heads(r, 0.05, z, 0.0, 0.0)
    assert len(calls) == 2 * len(al.proj) * SEGMENT_STEPS, len(calls)

