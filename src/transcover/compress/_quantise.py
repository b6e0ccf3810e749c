"""Per-matrix uniform quantisation on a fixed grid of scales, and its straight-through estimator.

A matrix ``W`` is described by a level count ``m >= 0``, a scale index ``k`` (an integer) and
integers ``Q in {-m, ..., m}``; it decodes to

.. math::

    \\hat W = s_k Q, \\qquad s_k = 2^{k / 8},

so ``2m + 1`` levels ("``log2(2m + 1)`` bits per weight": m = 1 is ternary, m = 3 about 3 bits,
m = 7 about 4 bits).  The scale grid is fixed before seeing data (8 steps per octave), which is
what lets a finite-class bound pay for the scale with a few bits (THEORY F18; Lotfi et al. 2022
quantise the same way, with learned cluster centres instead of a fixed grid).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["SCALE_STEPS_PER_OCTAVE", "scale_of", "quantise", "dequantise", "best_scale_index", "fake_quantise"]

SCALE_STEPS_PER_OCTAVE = 8


def scale_of(k: int) -> float:
    """The grid scale ``2^{k/8}`` (float64, a deterministic function of k)."""
    return 2.0 ** (k / SCALE_STEPS_PER_OCTAVE)


def _check_finite(W: Tensor) -> None:
    from .._errors import InputError

    if W.numel() == 0:
        raise InputError(f"cannot quantise an empty tensor (shape {tuple(W.shape)})")
    if not bool(torch.isfinite(W).all()):
        raise InputError("cannot quantise a tensor with NaN or infinite entries")


def quantise(W: Tensor, m: int, k: int) -> Tensor:
    """Integers ``clamp(round(W / s_k), -m, m)`` (round half to even), as int64.

    Raises:
        InputError: ``W`` with NaN or infinite entries (NaN became -2^63, and the description's code failed later).
    """
    _check_finite(W)
    if m == 0:
        return torch.zeros_like(W, dtype=torch.int64)
    return torch.clamp(torch.round(W.double() / scale_of(k)), -m, m).to(torch.int64)


def dequantise(Q: Tensor, k: int, dtype: torch.dtype = torch.float64) -> Tensor:
    return (Q.to(torch.float64) * scale_of(k)).to(dtype)


def best_scale_index(W: Tensor, m: int, *, span: int = 24) -> int:
    """The grid scale that minimises ``||W - s_k Q(W)||_F`` among ``span`` steps either side of ``max|W| / m``."""
    W = W.detach().double()
    _check_finite(W)
    top = float(W.abs().max())
    if m == 0 or top == 0.0:
        return 0
    centre = round(SCALE_STEPS_PER_OCTAVE * math.log2(top / m))
    best, best_err = centre, math.inf
    for k in range(centre - span, centre + span // 4 + 1):
        err = float((W - dequantise(quantise(W, m, k), k)).pow(2).sum())
        if err < best_err:
            best, best_err = k, err
    return best


def fake_quantise(W: Tensor, m: int, k: int) -> Tensor:
    """``s_k Q(W)`` in the forward pass, identity gradient in the backward pass (straight-through
    estimator, Bengio et al. 2013), for quantisation-aware fine-tuning."""
    if m == 0:
        return W * 0.0
    s = scale_of(k)
    Wq = torch.clamp(torch.round(W / s), -m, m) * s
    return W + (Wq - W).detach()
