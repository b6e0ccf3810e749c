"""Asymptotics of estimated covering numbers (seed 6.1): fitted growth rates beside the bounds'.

Two laws are fitted to estimates ``log N(eps)`` on a range of eps:

.. math::

    \\text{norm-based:}\\quad \\log N(\\varepsilon) \\approx A\\,\\varepsilon^{-\\alpha}
    \\iff \\log\\log N = \\log A + \\alpha \\log(1/\\varepsilon)
    \\qquad(\\text{bounds: } \\alpha = 2,\\ \\text{THEORY F2, F3, F9, F10})

.. math::

    \\text{parameter counting:}\\quad \\log N(\\varepsilon) \\approx c + P_{eff} \\log(1/\\varepsilon)
    \\qquad(\\text{bound: } P_{eff} = \\text{number of parameters},\\ \\text{THEORY F1})

both by least squares on the stated transform, with R^2.  The growth in another variable
(norm radius, n, depth, width) is the power law ``log N \\propto x^\\beta`` (slope of ``log log N``
against ``log x``).  Points where the estimate is 1 (``log log N`` undefined) or saturated (the net
holds more than half the sampled functions, so it measures M rather than the class) are dropped,
and the fit says how many points it used.  An estimate from a finite sample is a lower estimate
(``_montecarlo``), so fitted exponents describe the sampled class on the eps range used, not a
certified rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import InputError
from ._montecarlo import MonteCarloCovering

__all__ = ["LineFit", "EpsGrowthFit", "fit_line", "fit_eps_growth", "fit_power_growth",
           "usable_points"]


@dataclass(frozen=True)
class LineFit:
    """Least-squares line ``y = intercept + slope * x`` with its coefficient of determination."""

    slope: float
    intercept: float
    r2: float
    n_points: int

    def to_dict(self) -> dict[str, float]:
        return {"slope": self.slope, "intercept": self.intercept, "r2": self.r2, "n_points": self.n_points}


def fit_line(x: Sequence[float], y: Sequence[float]) -> LineFit:
    """Ordinary least squares of ``y`` on ``x`` (needs two distinct x)."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xa.shape != ya.shape or xa.ndim != 1:
        raise InputError(f"x and y must be equal-length 1-D sequences, but got {xa.shape} and {ya.shape}")
    if xa.size < 2 or np.ptp(xa) == 0.0:
        raise InputError(f"a fit needs at least 2 distinct x values, but got {xa.size} usable points")
    A = np.stack([np.ones_like(xa), xa], axis=1)
    (c, s), *_ = np.linalg.lstsq(A, ya, rcond=None)
    resid = ya - (c + s * xa)
    ss = float(((ya - ya.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss if ss > 0 else 1.0
    return LineFit(float(s), float(c), r2, int(xa.size))


@dataclass(frozen=True)
class EpsGrowthFit:
    """Both laws fitted to ``log N(eps)``; ``alpha_bound = 2`` and ``n_parameters`` are the bounds'."""

    power: LineFit  # log log N vs log(1/eps): slope = alpha
    counting: LineFit  # log N vs log(1/eps): slope = P_eff
    n_parameters: int | None = None
    alpha_bound: float = 2.0

    @property
    def alpha(self) -> float:
        return self.power.slope

    @property
    def p_eff(self) -> float:
        return self.counting.slope

    def to_dict(self) -> dict[str, object]:
        return {"alpha": self.alpha, "alpha_bound": self.alpha_bound, "power_fit": self.power.to_dict(),
                "p_eff": self.p_eff, "n_parameters": self.n_parameters, "counting_fit": self.counting.to_dict()}


def usable_points(mc: MonteCarloCovering, *, use: str = "net",
                  saturation: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """(eps, log N) at the largest M, dropping N = 1 and saturated points."""
    sizes = mc.net_sizes if use == "net" else mc.packing_sizes
    eps, logn = [], []
    for e, ep in enumerate(mc.eps):
        N = sizes[e][-1]
        if N > 1 and mc.net_sizes[e][-1] <= saturation * mc.n_functions:
            eps.append(ep)
            logn.append(math.log(N))
    return np.asarray(eps), np.asarray(logn)


def fit_eps_growth(eps: Sequence[float], log_N: Sequence[float], *,
                   n_parameters: int | None = None) -> EpsGrowthFit:
    """Fit ``alpha`` (norm-based law) and ``P_eff`` (parameter counting) to ``log N(eps)``.

    Raises:
        InputError: fewer than two usable points (``log N > 0``) or non-positive eps.
    """
    e, l = np.asarray(eps, dtype=float), np.asarray(log_N, dtype=float)
    if np.any(e <= 0):
        raise InputError("eps values must be > 0")
    keep = l > 0
    inv = np.log(1.0 / e[keep])
    return EpsGrowthFit(fit_line(inv, np.log(l[keep])), fit_line(inv, l[keep]), n_parameters)


def fit_power_growth(x: Sequence[float], log_N: Sequence[float]) -> LineFit:
    """Exponent ``beta`` of ``log N \\propto x^beta`` (x: radius, n, depth, width), from ``log N > 0``."""
    xa, l = np.asarray(x, dtype=float), np.asarray(log_N, dtype=float)
    if np.any(xa <= 0):
        raise InputError("x values must be > 0 for a power-law fit")
    keep = l > 0
    return fit_line(np.log(xa[keep]), np.log(l[keep]))
