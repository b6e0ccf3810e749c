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
# the scale indices whose 2^{k/8} is a normal float64: 2^-1022 (k = -8176) to 2^1023.875 (k = 8191); beyond them
# 2.0 ** (k / 8) raised OverflowError, or was 0 or subnormal (W / 0 quantised every weight to +-m; red team 204)
_K_MIN, _K_MAX = -1022 * SCALE_STEPS_PER_OCTAVE, 1024 * SCALE_STEPS_PER_OCTAVE - 1
# levels: Q in {-m, ..., m} is int64 and dequantised through float64, exact only up to 2^53
_M_MAX = 2**53


def _check_k(k: int) -> int:
    from .._errors import InputError

    if isinstance(k, bool) or not isinstance(k, int) or not _K_MIN <= k <= _K_MAX:
        raise InputError(f"scale index k must be an integer in [{_K_MIN}, {_K_MAX}] (scale 2^(k/8) a normal float64), "
                         f"but got k={k!r}")
    return k


def _check_m(m: int) -> int:
    from .._errors import InputError

    if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= _M_MAX:
        raise InputError(f"level count m must be an integer in [0, 2**53] (2m + 1 levels, exact in float64), "
                         f"but got m={m!r}")
    return m


def scale_of(k: int) -> float:
    """The grid scale ``2^{k/8}`` (float64, a deterministic function of k).

    Raises:
        InputError: ``k`` not an ``int`` in ``[-8176, 8191]``, where the scale is a normal float64 (red team 204:
            ``k = 10**6`` raised OverflowError, ``k = -10**6`` gave scale 0).
    """
    return 2.0 ** (_check_k(k) / SCALE_STEPS_PER_OCTAVE)


def _check_finite(W: Tensor) -> None:
    from .._errors import InputError

    if W.numel() == 0:
        raise InputError(f"cannot quantise an empty tensor (shape {tuple(W.shape)})")
    if not bool(torch.isfinite(W).all()):
        raise InputError("cannot quantise a tensor with NaN or infinite entries")


def quantise(W: Tensor, m: int, k: int) -> Tensor:
    """Integers ``clamp(round(W / s_k), -m, m)`` (round half to even), as int64.

    Raises:
        InputError: ``W`` with NaN or infinite entries (NaN became -2^63, and the description's code failed later);
            ``m`` not an ``int`` in ``[0, 2^53]`` (a negative m clamped every weight to ``-|m|``, a float m gave
            levels off the grid; red team 204); ``k`` out of :func:`scale_of`'s range.
    """
    _check_finite(W)
    _check_m(m)
    _check_k(k)
    if m == 0:
        return torch.zeros_like(W, dtype=torch.int64)
    return torch.clamp(torch.round(W.double() / scale_of(k)), -m, m).to(torch.int64)


def dequantise(Q: Tensor, k: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """``s_k Q`` in ``dtype``; ``k`` is checked by :func:`scale_of` (InputError, not OverflowError; red team 204)."""
    return (Q.to(torch.float64) * scale_of(k)).to(dtype)


def best_scale_index(W: Tensor, m: int, *, span: int = 24) -> int:
    """The grid scale that minimises ``||W - s_k Q(W)||_F`` among ``span`` steps either side of ``max|W| / m``.

    ``m`` is checked as in :func:`quantise` (a negative m was a "math domain error"; red team 204) and ``span``
    must be an integer >= 0; the steps tried are kept inside :func:`scale_of`'s range.
    """
    from .._errors import InputError

    W = W.detach().double()
    _check_finite(W)
    _check_m(m)
    if isinstance(span, bool) or not isinstance(span, int) or span < 0:
        raise InputError(f"span must be an integer >= 0, but got span={span!r}")
    top = float(W.abs().max())
    if m == 0 or top == 0.0:
        return 0
    ratio = top / m
    # log2(top) - log2(m) only where top / m underflows to 0 (subnormal weights, huge m): math domain error before
    centre = round(SCALE_STEPS_PER_OCTAVE * (math.log2(ratio) if ratio > 0.0 else math.log2(top) - math.log2(m)))
    low, high = max(centre - span, _K_MIN), min(centre + span // 4, _K_MAX)
    if low > high:  # the whole window off the grid (subnormal weights): its nearest end
        low = high = min(max(centre, _K_MIN), _K_MAX)
    best, best_err = low, math.inf
    for k in range(low, high + 1):
        err = float((W - dequantise(quantise(W, m, k), k)).pow(2).sum())
        if err < best_err:
            best, best_err = k, err
    return best


def fake_quantise(W: Tensor, m: int, k: int) -> Tensor:
    """``s_k Q(W)`` in the forward pass, identity gradient in the backward pass (straight-through
    estimator, Bengio et al. 2013), for quantisation-aware fine-tuning.  ``m`` and ``k`` are checked as in
    :func:`quantise`."""
    if _check_m(m) == 0:
        return W * 0.0
    s = scale_of(k)
    Wq = torch.clamp(torch.round(W / s), -m, m) * s
    return W + (Wq - W).detach()
