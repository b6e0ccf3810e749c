"""The argument checks the constrain package shares (one line each, :class:`InputError`).

``check_weight`` refuses what no norm constraint can be enforced on (complex, integer or meta
tensors, NaN/inf entries); ``check_number`` a real number in a range; ``check_progress`` a training
progress (NaN refused, the rest clamped to [0, 1]).  Red team 190 found each of these reaching a
raw ``TypeError`` / ``RuntimeError`` or a wrong result (a complex matrix lost its imaginary part).
"""

from __future__ import annotations

import math

from torch import Tensor

from .._errors import InputError, _real, check_finite_tensor, check_number

__all__ = ["check_weight", "check_number", "check_progress"]  # check_number: from _errors (the CLIs use it too)


def check_weight(t: Tensor, name: str) -> Tensor:
    """``t``, or :class:`InputError` unless it is a real floating-point tensor with data and finite entries."""
    if not isinstance(t, Tensor):
        raise InputError(f"{name} must be a tensor, but got {type(t).__name__}")
    if t.is_meta:
        raise InputError(f"{name} is a meta tensor (no data); materialise it (to_empty + init) before constraining it")
    if not t.is_floating_point():  # complex, integer and bool tensors: no real spectral norm to constrain
        raise InputError(f"{name} must be a real floating-point tensor, but got dtype {t.dtype}")
    return check_finite_tensor(t, name)


def check_progress(progress: float) -> float:
    """Training progress as a float clamped to [0, 1] (``-inf`` -> 0, ``inf`` -> 1); NaN is refused.

    ``min(max(nan, 0), 1)`` is NaN: every radius became NaN and a spectral cap wrote NaN into the weights.
    """
    p = _real(progress)
    if math.isnan(p):
        raise InputError(f"progress must be a number (clamped to [0, 1]), but got progress={progress!r}")
    return min(max(p, 0.0), 1.0)
