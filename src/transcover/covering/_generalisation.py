"""From a covering bound to a high-probability generalisation gap (THEORY F11).

.. math::

    \\mathbb E\\,\\ell(f) \\le \\hat{\\mathbb E}_n\\,\\ell(f) + 2\\hat{\\mathfrak R}_n(\\ell\\circ\\mathcal F)
    + 3b\\sqrt{\\frac{\\ln(2/\\delta)}{2n}}\\qquad\\forall f\\in\\mathcal F,\\ \\text{w.p.}\\ \\ge 1-\\delta

for a loss with values in ``[0, b]`` (Bartlett-Mendelson 2002; Mohri et al., Foundations of ML,
Thm 3.3 scaled by b).  The loss class is covered directly: an ``L_loss``-Lipschitz loss (in the
l2 norm of the output) gives ``log N(l o F, eps) <= log N(F, eps / L_loss)`` (THEORY F11, vector
outputs), and its ``L2(P_n)`` diameter is at most ``b``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .._errors import InputError
from .._results import Kind
from ._dudley import DudleyBound, dudley_entropy_integral

__all__ = ["GeneralisationBound", "concentration_term", "generalisation_gap", "generalisation_bound",
           "sample_size_for_gap"]


@dataclass(frozen=True)
class GeneralisationBound:
    """``gap`` bounds ``E loss - empirical loss`` uniformly over the class, w.p. ``>= 1 - delta``.

    ``vacuous`` is True when the gap is at least ``b`` (the trivial bound); ``log_gap`` keeps
    the size of a vacuous bound readable.
    """

    n: float
    gap: float
    log_gap: float
    rademacher: DudleyBound
    concentration: float
    delta: float
    loss_bound: float
    vacuous: bool
    kind: Kind = Kind.CERTIFIED_UPPER
    assumptions: tuple[str, ...] = field(default_factory=tuple)


def _pos(**values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise InputError(f"{name} must be a finite number > 0, but got {name}={v!r}")


def concentration_term(n: float, *, loss_bound: float = 1.0, delta: float = 0.05) -> float:
    """``3 b sqrt(ln(2/delta) / (2n))`` (McDiarmid, both directions of the symmetrisation)."""
    _pos(n=n, loss_bound=loss_bound, delta=delta)
    if delta >= 1:
        raise InputError(f"delta must be in (0, 1), but got delta={delta!r}")
    return 3.0 * loss_bound * math.sqrt(math.log(2.0 / delta) / (2.0 * n))


def generalisation_gap(rademacher: DudleyBound, n: float, *, loss_bound: float = 1.0,
                       delta: float = 0.05) -> GeneralisationBound:
    """``2 R_n(l o F) + 3 b sqrt(ln(2/delta)/(2n))`` from a Rademacher bound of the loss class."""
    conc = concentration_term(n, loss_bound=loss_bound, delta=delta)
    log_gap = float(np.logaddexp(math.log(2.0) + rademacher.log_value, math.log(conc)))
    gap = math.inf if log_gap > 709 else math.exp(log_gap)
    return GeneralisationBound(n, gap, log_gap, rademacher, conc, delta, loss_bound, gap >= loss_bound,
                               assumptions=(f"loss in [0, {loss_bound:g}]", f"delta = {delta:g}"))


def generalisation_bound(
    loglog_covering: Callable[[float, float], float],
    n: float,
    *,
    loss_lipschitz: float = 1.0,
    loss_bound: float = 1.0,
    delta: float = 0.05,
    n_grid: int = 400,
) -> GeneralisationBound:
    """The generalisation gap at ``n`` samples from a covering curve of the *function* class.

    .. math::

        \\text{gap} \\le 2\\,\\mathrm{Dudley}\\big(\\varepsilon\\mapsto\\log N(\\mathcal F, \\varepsilon/L_\\ell, n)\\big)
        + 3b\\sqrt{\\ln(2/\\delta)/(2n)}

    Args:
        loglog_covering: ``(eps, n) -> ln log N(F, eps)`` for a sample of ``n`` sequences (the
            covering bound depends on n through ``log(nT)``), non-increasing in eps.
        n: the number of training samples.
        loss_lipschitz: ``L_loss`` of the loss in the model's output (l2).
        loss_bound: ``b``: the loss takes values in ``[0, b]`` (also the diameter D).
        delta: failure probability.
        n_grid: quadrature points for Dudley's integral.

    Raises:
        InputError: non-positive ``n``, ``loss_lipschitz``, ``loss_bound``; ``delta`` not in (0, 1).
    """
    _pos(n=n, loss_lipschitz=loss_lipschitz, loss_bound=loss_bound, delta=delta)
    if delta >= 1:
        raise InputError(f"delta must be in (0, 1), but got delta={delta!r}")
    rad = dudley_entropy_integral(lambda e: loglog_covering(e / loss_lipschitz, n), n, loss_bound, n_grid=n_grid)
    out = generalisation_gap(rad, n, loss_bound=loss_bound, delta=delta)
    return GeneralisationBound(out.n, out.gap, out.log_gap, out.rademacher, out.concentration, delta, loss_bound,
                               out.vacuous, assumptions=out.assumptions + (f"loss {loss_lipschitz:g}-Lipschitz in the output",))


def sample_size_for_gap(
    loglog_covering: Callable[[float, float], float],
    target_gap: float,
    *,
    loss_lipschitz: float = 1.0,
    loss_bound: float = 1.0,
    delta: float = 0.05,
    max_log10_n: float = 300.0,
    n_grid: int = 200,
) -> float:
    """The smallest ``n`` (to 1% in log10) whose certified gap is ``<= target_gap``; ``inf`` if none.

    Bisection on ``log10 n``: the gap bound falls with n (the ``1/sqrt n`` factors dominate the
    ``log(nT)`` growth of the covering bound).  The returned n satisfies the target (checked).

    Raises:
        InputError: ``target_gap <= 0`` or ``>= loss_bound`` is allowed but must be > 0.
    """
    _pos(target_gap=target_gap)

    def gap(log10_n: float) -> float:
        return generalisation_bound(loglog_covering, 10.0 ** log10_n, loss_lipschitz=loss_lipschitz,
                                    loss_bound=loss_bound, delta=delta, n_grid=n_grid).log_gap

    log_t = math.log(target_gap)
    lo, hi = 0.0, max_log10_n
    if gap(hi) > log_t:
        return math.inf
    if gap(lo) <= log_t:
        return 1.0
    while hi - lo > 0.01:
        mid = 0.5 * (lo + hi)
        if gap(mid) > log_t:
            lo = mid
        else:
            hi = mid
    return 10.0 ** hi
