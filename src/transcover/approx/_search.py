"""Sup-error search: random and structured candidates, then signed-gradient ascent in a box.

Every value it returns is attained by a witness input, so it is an *empirical lower bound* on the
supremum of the function as evaluated (``Kind.EMPIRICAL_LOWER`` for a trained network, which is its float64
evaluation; the Lemma H.1 construction's are estimates of its exact-arithmetic suprema, ``_decomposition``), never a
certificate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SupSearch", "sup_search"]


@dataclass(frozen=True)
class SupSearch:
    value: float
    witness: Tensor  # the input attaining ``value``
    n_evaluated: int


def sup_search(err: Callable[[Tensor], Tensor], candidates: Tensor, *, lo: float = -1.0, hi: float = 1.0,
               n_ascent: int = 32, steps: int = 25, step: float = 0.05) -> SupSearch:
    """max of ``err`` over ``candidates`` (M, ...) and over ``steps`` of projected sign-gradient
    ascent started from the ``n_ascent`` best candidates (step halves every ``steps // 3``)."""
    with torch.no_grad():
        vals = torch.cat([err(chunk) for chunk in candidates.split(4096)])
    best_i = int(vals.argmax())
    best_v, best_x = float(vals[best_i]), candidates[best_i].clone()
    n_eval = candidates.shape[0]
    if steps <= 0 or n_ascent <= 0:
        return SupSearch(best_v, best_x, n_eval)
    top = vals.topk(min(n_ascent, vals.numel())).indices
    Z = candidates[top].clone()
    for t in range(steps):
        Z.requires_grad_(True)
        e = err(Z)
        (g,) = torch.autograd.grad(e.sum(), Z)
        with torch.no_grad():
            i = int(e.argmax())
            if float(e[i]) > best_v:
                best_v, best_x = float(e[i]), Z[i].detach().clone()
            h = step * 0.5 ** (t // max(1, steps // 3))
            Z = (Z + h * torch.sign(g)).clamp(lo, hi).detach()
        n_eval += Z.shape[0]
    with torch.no_grad():
        e = err(Z)
        i = int(e.argmax())
        if float(e[i]) > best_v:
            best_v, best_x = float(e[i]), Z[i].clone()
    return SupSearch(best_v, best_x, n_eval + Z.shape[0])
