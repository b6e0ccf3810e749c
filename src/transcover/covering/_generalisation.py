"""From a covering bound to a high-probability generalisation gap (THEORY F11).

.. math::

    \\mathbb E\\,\\ell(f) \\le \\hat{\\mathbb E}_n\\,\\ell(f) + 2\\hat{\\mathfrak R}_n(\\ell\\circ\\mathcal F)
    + 3b\\sqrt{\\frac{\\ln(2/\\delta)}{2n}}\\qquad\\forall f\\in\\mathcal F,\\ \\text{w.p.}\\ \\ge 1-\\delta

for a loss with values in ``[0, b]`` (Bartlett-Mendelson 2002; Mohri et al., Foundations of ML,
Thm 3.3 scaled by b).  The loss class is covered directly: an ``L_loss``-Lipschitz loss (in the
l2 norm of the output) gives ``log N(l o F, eps) <= log N(F, eps / L_loss)`` (THEORY F11, vector
outputs), and its ``L2(P_n)`` diameter is at most ``b``.

Note [trivial gap bound]: a loss in ``[0, b]`` has ``E loss - empirical loss <= b`` for every
function and every sample, so ``b`` is itself a certified gap bound (and ``b`` a certified bound
on the expected loss).  The formula above can exceed it by far (a rich class gives Dudley's
trivial ``4D = 4b`` Rademacher term, so ``2 * 4b + concentration``: 8.0 for b = 1).  The
*reported* ``gap`` is therefore ``min(raw, b)``, ``vacuous`` says that the formula did not beat
``b`` (the reported number then carries no information), and ``raw_gap`` keeps the formula's own
value, labelled as such, for comparisons between classes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from .._printed import up
from .._errors import InputError, check_number
from .._results import Kind
from ._dudley import DudleyBound, dudley_entropy_integral
from ._outward import exact, to_float

__all__ = ["GeneralisationBound", "concentration_term", "generalisation_gap", "generalisation_bound",
           "sample_size_for_gap"]

# Dudley quadrature points of a reported gap, and of every sample-size search that claims to meet it: a search on a
# coarser grid integrates a larger bound and returned an n above the smallest one that meets the target (red team 198:
# 4.49e8 on 200 points where 4.383e8 already gave 0.09965 <= 0.1 on these 400)
N_GRID = 400
# a sample-size search's tolerance in log10 n (2.3 %), for the n as printed (rounded up to 3 digits, up to 0.0043 more)
SEARCH_TOL_LOG10 = 0.01


@dataclass(frozen=True)
class GeneralisationBound:
    """``gap`` bounds ``E loss - empirical loss`` uniformly over the class, w.p. ``>= 1 - delta``.

    ``gap = min(raw_gap, b)`` (Note [trivial gap bound]): never above the loss range.
    ``raw_gap`` / ``raw_log_gap`` are ``2 R + concentration`` before that clip (``raw_log_gap``
    stays finite when ``raw_gap`` overflows); ``vacuous`` is True when ``raw_gap >= b``, i.e. the
    reported ``gap`` is the trivial bound ``b``.
    """

    n: float
    gap: float
    log_gap: float
    rademacher: DudleyBound
    concentration: float
    delta: float
    loss_bound: float
    vacuous: bool
    raw_gap: float
    raw_log_gap: float
    kind: Kind = Kind.CERTIFIED_UPPER
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    log_prior: float = 0.0  # ln(1/prior) of the class in a union fixed before the data (F102), in the concentration

    @property
    def note(self) -> str:
        """One line for tables and JSON: what the reported number means, by its ``kind`` (red team 222: BFT's
        baseline, an estimate, was noted "certified gap bound")."""
        if not self.vacuous:
            if self.kind == Kind.CERTIFIED_UPPER:
                return f"certified gap bound {up(self.gap, 4)} < loss range b={self.loss_bound:g}"
            return f"{self.kind.value} of the gap, not certified: {up(self.gap, 4)} < loss range b={self.loss_bound:g}"
        why = (" (Dudley's infimum at alpha = D: the Rademacher term is its trivial 4b, independent of the "
               "weights)" if self.rademacher.trivial else "")
        return (f"vacuous: the formula gives {_fmt_raw(self.raw_log_gap)} >= loss range b={self.loss_bound:g}; "
                f"reported as the trivial bound b{why}")

    def test_loss_bound(self, empirical_loss: float) -> float:
        """``min(empirical_loss + gap, b)``: a certified bound on the expected loss (w.p. >= 1 - delta).

        Raises:
            InputError: ``empirical_loss`` outside ``[0, b]``.
        """
        if not (math.isfinite(empirical_loss) and 0.0 <= empirical_loss <= self.loss_bound):
            raise InputError(f"empirical_loss must be in [0, b={self.loss_bound:g}], but got {empirical_loss!r}")
        # rounding up: fl(a + g) may fall below a + g, so step one ulp up before clipping at b
        return min(math.nextafter(empirical_loss + self.gap, math.inf), self.loss_bound)

    def to_dict(self) -> dict[str, object]:
        return {
            "n": self.n, "gap": self.gap, "log10_gap": self.log_gap / math.log(10),
            "raw_gap": self.raw_gap if math.isfinite(self.raw_gap) else str(self.raw_gap),
            "log10_raw_gap": self.raw_log_gap / math.log(10), "vacuous": self.vacuous,
            "trivial_bound": self.loss_bound, "note": self.note, "kind": self.kind.value,
            "rademacher": self.rademacher.value if math.isfinite(self.rademacher.value) else str(self.rademacher.value),
            "rademacher_trivial": self.rademacher.trivial, "alpha": self.rademacher.alpha,
            "concentration": self.concentration, "delta": self.delta, "log_prior": self.log_prior,
        }


def _fmt_raw(ln_value: float) -> str:
    from .._printed import from_ln

    return from_ln(ln_value)


def _clipped(n: float, raw_log_gap: float, rademacher: DudleyBound, conc: float, delta: float, b: float,
             assumptions: tuple[str, ...], raw_gap: float | None = None, log_prior: float = 0.0) -> GeneralisationBound:
    """Note [trivial gap bound]: report ``min(raw, b)``, flag ``raw >= b`` as vacuous."""
    # exp rounded up (libm is within one ulp): the raw value stays an upper bound of its formula
    if raw_gap is None:
        raw_gap = math.inf if raw_log_gap > 709 else math.nextafter(math.exp(raw_log_gap), math.inf)
    vacuous = raw_gap >= b
    gap, log_gap = (b, math.log(b)) if vacuous else (raw_gap, raw_log_gap)
    return GeneralisationBound(n, gap, log_gap, rademacher, conc, delta, b, vacuous, raw_gap, raw_log_gap,
                               assumptions=assumptions, log_prior=log_prior)


def _pos(**values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise InputError(f"{name} must be a finite number > 0, but got {name}={v!r}")


def _check_prior(log_prior: float) -> None:
    if not (isinstance(log_prior, (int, float)) and math.isfinite(log_prior) and log_prior >= 0):
        raise InputError(f"log_prior must be a finite number >= 0, but got log_prior={log_prior!r}")


def concentration_term(n: float, *, loss_bound: float = 1.0, delta: float = 0.05, log_prior: float = 0.0) -> float:
    """``3 b sqrt((ln(2/delta) + log_prior) / (2n))`` (McDiarmid, both directions of the symmetrisation).

    ``log_prior``: ``ln(1/prior)`` of the class among a union fixed before the data (THEORY F102: a grid of
    norm levels), i.e. the bound at ``delta * prior``; 0 for a class fixed in advance.
    """
    _pos(n=n, loss_bound=loss_bound)
    check_number(delta, "delta", low=0.0, strict=True, below=1.0)
    _check_prior(log_prior)
    # rounded up: evaluated on decimal enclosures (Note [directed decimals]); plain floats fell under the formula
    # in about half of the cases, by up to 3.1e-16 relative (red team of stop 35)
    enc = exact(3) * exact(loss_bound) * ((exact(Fraction(2) / Fraction(delta)).ln() + exact(log_prior)) * exact(
        Fraction(1) / (2 * Fraction(n)))).sqrt()
    return to_float(enc, "up")


def generalisation_gap(rademacher: DudleyBound, n: float, *, loss_bound: float = 1.0,
                       delta: float = 0.05, log_prior: float = 0.0) -> GeneralisationBound:
    """``2 R_n(l o F) + 3 b sqrt((ln(2/delta) + log_prior)/(2n))`` from a Rademacher bound of the loss class (its
    value and log rounded up: on decimal enclosures where the Rademacher bound is a finite float, else in logs with
    a pad); ``log_prior`` as in :func:`concentration_term`."""
    conc = concentration_term(n, loss_bound=loss_bound, delta=delta, log_prior=log_prior)
    if math.isfinite(rademacher.value):
        enc = exact(2) * exact(rademacher.value) + exact(conc)
        raw, log_gap = to_float(enc, "up"), to_float(enc.ln(), "up")
    else:  # beyond float64: the logs, logaddexp's rounding (a few ulps of its magnitude) padded
        x = float(np.logaddexp(math.log(2.0) + rademacher.log_value, math.log(conc)))
        raw, log_gap = None, math.nextafter(x + 8 * 2.0**-52 * (abs(x) + 1), math.inf)
    prior = (f"the class chosen from a union fixed before the data: ln(1/prior) = {up(log_prior, 6)} nats added to "
             "ln(2/delta)",) if log_prior else ()
    return _clipped(n, log_gap, rademacher, conc, delta, loss_bound,
                    (f"loss in [0, {loss_bound:g}]", f"delta = {delta:g}", *prior,
                     f"gap reported as min(formula, b={loss_bound:g}): a [0, b] loss never has a larger gap"),
                    raw_gap=raw, log_prior=log_prior)


def generalisation_bound(
    loglog_covering: Callable[[float, float], float],
    n: float,
    *,
    loss_lipschitz: float = 1.0,
    loss_bound: float = 1.0,
    delta: float = 0.05,
    n_grid: int = N_GRID,
    log_prior: float = 0.0,
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
        log_prior: ``ln(1/prior)`` of the class in a union fixed before the data (THEORY F102), added to
            ``ln(2/delta)``; 0 for a class fixed in advance.

    Raises:
        InputError: non-positive ``n``, ``loss_lipschitz``, ``loss_bound``; ``delta`` not in (0, 1).
    """
    _pos(n=n, loss_lipschitz=loss_lipschitz, loss_bound=loss_bound)
    check_number(delta, "delta", low=0.0, strict=True, below=1.0)
    rad = dudley_entropy_integral(_AtSize(loglog_covering, n, loss_lipschitz), n, loss_bound, n_grid=n_grid)
    out = generalisation_gap(rad, n, loss_bound=loss_bound, delta=delta, log_prior=log_prior)
    return _clipped(out.n, out.raw_log_gap, out.rademacher, out.concentration, delta, loss_bound,
                    out.assumptions + (f"loss {loss_lipschitz:g}-Lipschitz in the output",), raw_gap=out.raw_gap,
                    log_prior=log_prior)


class _AtSize:
    """``eps -> loglog_covering(eps / L, n)``, with ``many`` where the curve has one (Note [curve on a grid])."""

    def __init__(self, curve: Callable[[float, float], float], n: float, loss_lipschitz: float):
        self.curve, self.n, self.L = curve, n, loss_lipschitz
        if hasattr(curve, "many"):
            self.many = lambda eps: curve.many(np.asarray(eps, dtype=np.float64) / loss_lipschitz, n)

    def __call__(self, e: float) -> float:
        return self.curve(e / self.L, self.n)


def sample_size_for_gap(
    loglog_covering: Callable[[float, float], float],
    target_gap: float,
    *,
    loss_lipschitz: float = 1.0,
    loss_bound: float = 1.0,
    delta: float = 0.05,
    max_log10_n: float = 300.0,
    n_grid: int = N_GRID,
    log_prior: float = 0.0,
) -> float:
    """The smallest ``n`` (to :data:`SEARCH_TOL_LOG10` in log10) whose certified gap is ``<= target_gap``; ``inf``
    if none: :func:`smallest_n` on :func:`generalisation_bound` with these arguments.

    Raises:
        InputError: ``target_gap <= 0``.
    """
    return smallest_n(lambda n: generalisation_bound(loglog_covering, n, loss_lipschitz=loss_lipschitz,
                                                     loss_bound=loss_bound, delta=delta, n_grid=n_grid,
                                                     log_prior=log_prior).log_gap,
                      target_gap, max_log10_n=max_log10_n)


def smallest_n(log_gap_at: Callable[[float], float], target_gap: float, *, max_log10_n: float = 300.0) -> float:
    """The smallest ``n`` whose ``log_gap_at(n) <= ln(target_gap)``, to :data:`SEARCH_TOL_LOG10` in log10 n as
    printed; ``inf`` if none up to ``10**max_log10_n``.

    Bisection on ``log10 n``: the gap bound falls with n (the ``1/sqrt n`` factors dominate the
    ``log(nT)`` growth of the covering bound).  The returned n meets the target by the very function given
    (callers pass the one that computes their reported gaps), and ``n / 10**SEARCH_TOL_LOG10`` does not: the
    bisection stops at half the tolerance, which leaves room for printing n rounded up to 3 digits
    (:func:`transcover._printed.count_up`).  A target met at ``n = 1`` returns 1.

    Raises:
        InputError: ``target_gap <= 0``.
    """
    _pos(target_gap=target_gap)

    def gap(log10_n: float) -> float:
        return log_gap_at(10.0 ** log10_n)

    log_t = math.log(target_gap)
    lo, hi = 0.0, max_log10_n
    if gap(hi) > log_t:
        return math.inf
    if gap(lo) <= log_t:
        return 1.0
    while hi - lo > SEARCH_TOL_LOG10 / 2:
        mid = 0.5 * (lo + hi)
        if gap(mid) > log_t:
            lo = mid
        else:
            hi = mid
    return 10.0 ** hi
