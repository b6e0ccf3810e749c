"""Radius schedules: loose early, tight in fine-tuning (the seed's closing remark).

.. math::

    c(t) = \\begin{cases} c_0 & t \\le t_0 \\\\
           c_0 + (c_1 - c_0)\\,\\phi\\big(\\tfrac{t - t_0}{t_1 - t_0}\\big) & t_0 < t < t_1 \\\\
           c_1 & t \\ge t_1 \\end{cases}

with training progress ``t`` in [0, 1] (a progress outside is clamped to it, NaN refused), loose
radius ``c_0``, target ``c_1``, and the shape
``phi(s) = s`` (linear), ``(1 - cos(pi s)) / 2`` (cosine), ``floor(n s) / n`` (``n`` equal steps),
or ``c(t) = c_1`` throughout (constant, i.e. tight from the start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._errors import InputError, check_positive_int
from ._checks import check_progress
from ._spectral import check_radius

__all__ = ["RadiusSchedule", "SCHEDULE_KINDS", "check_fraction"]

SCHEDULE_KINDS = ("constant", "linear", "cosine", "step")


def check_fraction(x: float, name: str) -> float:
    """Return ``float(x)`` or raise :class:`InputError` unless ``0 <= x <= 1``."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number in [0, 1], but got {name}={x!r}") from None
    if not 0.0 <= v <= 1.0:
        raise InputError(f"{name} must be in [0, 1], but got {name}={x!r}")
    return v


@dataclass(frozen=True)
class RadiusSchedule:
    """A radius as a function of training progress (see the module docstring).

    Example:
        >>> s = RadiusSchedule(target=1.0, start=4.0, kind="linear", start_fraction=0.5)
        >>> [s(t) for t in (0.0, 0.5, 0.75, 1.0)]
        [4.0, 4.0, 2.5, 1.0]
    """

    target: float
    start: float | None = None  # the loose radius c_0; None means c_0 = target
    kind: str = "constant"
    start_fraction: float = 0.0  # t_0: tightening begins (the "staged" switch)
    end_fraction: float = 1.0  # t_1: the target is reached
    n_steps: int = 4  # number of drops of the "step" shape

    def __post_init__(self) -> None:
        check_radius(self.target, "target radius")
        if self.start is not None:
            check_radius(self.start, "start radius")
        if self.kind not in SCHEDULE_KINDS:
            raise InputError(f"schedule must be one of {', '.join(SCHEDULE_KINDS)}, but got schedule={self.kind!r}")
        t0 = check_fraction(self.start_fraction, "start_fraction")
        t1 = check_fraction(self.end_fraction, "end_fraction")
        if t1 < t0:
            raise InputError(f"end_fraction must be >= start_fraction, but got {t1} < {t0}")
        check_positive_int(self.n_steps, "n_steps")  # True was taken for 1 (red team 190)

    @property
    def loose(self) -> float:
        return self.target if self.start is None else float(self.start)

    def __call__(self, progress: float) -> float:
        """The radius at ``progress``, clamped to [0, 1]; NaN is refused (:class:`InputError`), not returned."""
        t = check_progress(progress)
        c0, c1 = self.loose, float(self.target)
        if self.kind == "constant":
            return c1
        t0, t1 = float(self.start_fraction), float(self.end_fraction)
        if t <= t0 and t < t1:
            return c0
        if t >= t1:
            return c1
        s = (t - t0) / (t1 - t0)
        if self.kind == "linear":
            phi = s
        elif self.kind == "cosine":
            phi = 0.5 * (1.0 - math.cos(math.pi * s))
        else:
            phi = math.floor(self.n_steps * s) / self.n_steps
        return c0 + (c1 - c0) * phi
