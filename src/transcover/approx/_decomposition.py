"""Measured error decomposition of the Lemma H.1 construction (seed section 4.2).

With ``ψ̂`` the read-out attention delivers, ``ψ = γ z_I`` the ideal one and ``f`` the MLP head,

.. math::

    F(Z) - g^*(Z) = \\underbrace{f(\\hat\\psi(Z)) - f(\\psi(Z))}_{\\text{attention part}}
                  + \\underbrace{f(\\psi(Z)) - h(z_I)}_{\\text{MLP part}},

so ``sup|F - g*| <= sup|attention part| + sup|MLP part|``.  Each supremum is searched separately
(random and adversarial inputs, then signed-gradient ascent).  Each result is attained at a witness input by the
network *as float64 evaluates it*, so it is labelled an estimate of the exact network's supremum
(``Kind.ESTIMATE``), not an empirical lower bound on it: the certified budget of :meth:`Construction.bound` is for
exact arithmetic, and where it is tight (equiangular codes) the float64 rounding, about 1e-16 of the outputs, put a
measured "lower bound" 5e-9 relative above the certified upper one (red team 181).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from .._errors import InputError
from .._results import Kind, Quantity
from ._construction import Construction, ConstructionBound
from ._search import sup_search
from ._threads import single_thread

__all__ = ["ErrorDecomposition", "decompose_construction", "attention_candidates"]


@dataclass(frozen=True)
class ErrorDecomposition:
    """Measured sup-errors of the float64 network (``ESTIMATE``, module docstring) beside the certified budget."""

    total: Quantity
    attention: Quantity
    mlp: Quantity
    readout: Quantity  # sup ||ψ̂ - ψ||_∞ (before the head)
    bound: ConstructionBound | None
    n_evaluated: int

    def to_dict(self) -> dict[str, object]:
        return {"total": self.total.to_dict(), "attention": self.attention.to_dict(),
                "mlp": self.mlp.to_dict(), "readout": self.readout.to_dict(),
                "bound": None if self.bound is None else self.bound.to_dict(),
                "n_evaluated": self.n_evaluated}


def attention_candidates(n: int, indices: tuple[int, ...], n_random: int, *, seed: int = 0) -> Tensor:
    """Random contents in ``[-1,1]^n`` plus the attention's worst case: every token outside I at
    the opposite end of the box from (a random sign pattern of) the relevant tokens."""
    g = torch.Generator().manual_seed(int(seed))
    Z = torch.rand(n_random, n, generator=g, dtype=torch.float64) * 2 - 1
    W = torch.rand(n_random, n, generator=g, dtype=torch.float64) * 2 - 1
    mask = torch.ones(n, dtype=torch.bool)
    mask[list(indices)] = False
    sign = torch.where(torch.rand(n_random, 1, generator=g) < 0.5, -1.0, 1.0).double()
    W[:, list(indices)] = sign * torch.rand(n_random, len(indices), generator=g, dtype=torch.float64)
    W[:, mask] = -sign
    # the exact extremes: z_I = ±1, everything else at the other end (spread 2 for every head)
    E = torch.ones(2, n, dtype=torch.float64)
    E[0, list(indices)], E[1, mask] = -1.0, -1.0
    return torch.cat([Z, W, E])


def _box_grid(s: int, per_axis: int) -> Tensor:
    axis = torch.linspace(-1.0, 1.0, per_axis, dtype=torch.float64)
    return torch.tensor(list(itertools.product(axis.tolist(), repeat=s)), dtype=torch.float64)


def decompose_construction(c: Construction, **kwargs) -> ErrorDecomposition:
    """Measure ``sup|F - g*|``, its attention and MLP parts, and ``sup||ψ̂ - ψ||_∞``.

    The MLP part depends on ``z_I`` only and is searched on a grid of about ``n_grid`` points of
    ``[-1,1]^s`` (plus ascent); the others on :func:`attention_candidates` (plus ascent).
    Keyword arguments: ``n_random`` (1000), ``steps`` (15), ``n_grid`` (4096), ``seed`` (0).
    """
    with single_thread():
        return _decompose(c, **kwargs)


def _decompose(c: Construction, *, n_random: int = 1000, steps: int = 15,
                           n_grid: int = 4096, seed: int = 0) -> ErrorDecomposition:
    if n_random <= 0 or n_grid <= 0 or steps < 0:
        raise InputError(f"search sizes must be positive, but got n_random={n_random}, n_grid={n_grid}, steps={steps}")
    I = list(c.target.indices)
    cand = attention_candidates(c.n, c.target.indices, n_random, seed=seed)

    def err_total(Z: Tensor) -> Tensor:
        return (c(Z) - c.target(Z)).abs()

    def err_attn(Z: Tensor) -> Tensor:
        return (c(Z) - c.head_on_readout(c.ideal_readout(Z))).abs()

    def err_readout(Z: Tensor) -> Tensor:
        return (c.readout(Z) - c.ideal_readout(Z)).abs().amax(dim=1)

    def err_mlp(U: Tensor) -> Tensor:
        return (c.head_on_readout(c.gamma * U) - c.target.h(U)).abs()

    total = sup_search(err_total, cand, steps=steps)
    # the total's witness joins the parts' searches, so the measured parts always satisfy
    # total <= attention + MLP (the decomposition) at the point where the total was found
    cand = torch.cat([cand, total.witness[None]])
    attn = sup_search(err_attn, cand, steps=steps)
    rd = sup_search(err_readout, cand, steps=steps)
    per_axis = max(2, int(round(n_grid ** (1.0 / c.s))))
    # an odd per-axis count off the knots of the interpolation grid sees the cells' interiors
    grid = _box_grid(c.s, per_axis + (per_axis % 2 == 0))
    grid = torch.cat([grid, total.witness[I][None], cand[:n_random, I]])
    mlp = sup_search(err_mlp, grid, steps=steps, step=0.5 / max(c.mlp.N, 1))
    src = "sup attained by the float64 network at a witness (random + adversarial + ascent; the exact network's may " \
          "differ by its rounding)"
    q = lambda v, what: Quantity(v, Kind.ESTIMATE, f"{src}: {what}")
    return ErrorDecomposition(
        q(total.value, "|F - g*|"), q(attn.value, "|f(psi_hat) - f(psi)|"),
        q(mlp.value, "|f(psi) - h|"), q(rd.value, "||psi_hat - psi||_inf"), c.bound(),
        total.n_evaluated + attn.n_evaluated + rd.n_evaluated + mlp.n_evaluated,
    )
