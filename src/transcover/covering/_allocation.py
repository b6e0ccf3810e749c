"""Lemma G.1: splitting the error budget eps across matrices (THEORY F4), in log space.

A cover of a composed class is the product of per-matrix covers; if matrix ``i`` is covered at
scale ``eps_i`` and moves the output by at most ``c_i`` per unit of its error, the composed cover
has scale ``sum_i c_i eps_i``.  Any split with ``sum_i c_i eps_i <= eps`` is *sound*; the functions
here choose the split that minimises the total ``sum_i log N_i(eps_i)``.

Note [log space]: downstream Lipschitz factors are products over layers (``c_i`` of a 48-layer
model can exceed 1e300), so every quantity is carried as its natural log and combined with
``logaddexp``; nothing is exponentiated unless it fits in a float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import InputError
from .._results import Kind
from ._outward import exact

__all__ = ["Allocation", "budget_allocation", "budget_allocation_log", "CoverCost", "allocate_mixed",
           "budget_holds", "fit_to_budget"]


def _safe_exp(x: float) -> float:
    return math.inf if x > 709.0 else math.exp(x)


def _logsumexp(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return -math.inf
    m = float(np.max(x))
    if m == -math.inf:
        return -math.inf
    return m + math.log(float(np.sum(np.exp(x - m))))


@dataclass(frozen=True)
class Allocation:
    """A split ``eps_i`` of ``eps`` and the total cost ``sum_i log N_i(eps_i)`` it achieves.

    ``log_eps_i`` and ``log_costs`` are natural logs (so ``-inf`` means exactly 0); ``log_total``
    is the log of the total cost ``sum_i cost_i``; ``log_gamma`` is ``log gamma`` for the pure
    ``a/eps^2`` case (NaN for a mixed allocation).
    """

    eps: float
    log_eps_i: tuple[float, ...]
    log_costs: tuple[float, ...]
    log_total: float
    log_gamma: float = math.nan
    kind: Kind = Kind.EXACT

    @property
    def eps_i(self) -> tuple[float, ...]:
        return tuple(_safe_exp(v) for v in self.log_eps_i)

    @property
    def total(self) -> float:
        """``sum_i cost_i`` (``inf`` only if it exceeds float64; use ``log_total`` then)."""
        return _safe_exp(self.log_total)

    @property
    def gamma(self) -> float:
        return _safe_exp(self.log_gamma)


def _check_eps(eps: float) -> None:
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise InputError(f"eps must be a finite number > 0, but got eps={eps!r}")


def budget_allocation_log(log_a: Sequence[float], log_c: Sequence[float], eps: float) -> Allocation:
    """Lemma G.1 with ``log a_i`` and ``log c_i`` given (see :func:`budget_allocation`).

    ``log_a[i] = -inf`` (a single-point class) gets ``eps_i = 0`` and cost 0; ``log_c[i] = -inf``
    (a matrix that cannot move the output) gets cost 0 as well.
    """
    _check_eps(eps)
    la = np.asarray(log_a, dtype=np.float64)
    lc = np.asarray(log_c, dtype=np.float64)
    if la.shape != lc.shape or la.ndim != 1 or la.size == 0:
        raise InputError(f"a and c must be non-empty 1-D and of equal length, but got {la.shape} and {lc.shape}")
    if np.isnan(la).any() or np.isnan(lc).any() or (la == math.inf).any() or (lc == math.inf).any():
        raise InputError("a and c must be finite and >= 0 (log a, log c must not be NaN or +inf)")
    live = (la > -math.inf) & (lc > -math.inf)
    # (a_i c_i^2)^{1/3} in logs; gamma = sum of them.
    w = np.where(live, (la + 2.0 * lc) / 3.0, -math.inf)
    log_gamma = _logsumexp(w)
    log_eps = math.log(eps)
    # eps_i* = eps (a_i/c_i)^{1/3} / gamma
    le = np.full(la.shape, -math.inf)
    le[live] = log_eps + (la[live] - lc[live]) / 3.0 - log_gamma
    le[lc == -math.inf] = math.inf  # no influence on the output: any scale works
    # a_i / eps_i^2 = gamma^2 (a_i c_i^2)^{1/3} / eps^2
    costs = np.where(live, 2.0 * log_gamma + w - 2.0 * log_eps, -math.inf)
    log_total = 3.0 * log_gamma - 2.0 * log_eps if live.any() else -math.inf
    return Allocation(float(eps), tuple(map(float, le)), tuple(map(float, costs)), float(log_total),
                      float(log_gamma) if live.any() else -math.inf)


def budget_allocation(a: Sequence[float], c: Sequence[float], eps: float) -> Allocation:
    """The optimal split of Lemma G.1 in closed form.

    .. math::

        \\min_{\\varepsilon_i>0,\\ \\sum_i c_i\\varepsilon_i=\\varepsilon} \\sum_i \\frac{a_i}{\\varepsilon_i^2}
        = \\frac{\\gamma^3}{\\varepsilon^2},\\qquad
        \\varepsilon_i^* = \\frac{\\varepsilon}{\\gamma}\\Big(\\frac{a_i}{c_i}\\Big)^{1/3},\\qquad
        \\gamma = \\sum_i (a_i c_i^2)^{1/3}

    THEORY F4 (Lemma G.1; the same 2/3-power rule as Bartlett-Foster-Telgarsky 2017 Thm 3.3).
    Derivation (Lagrange): ``-2 a_i / eps_i^3 + lambda c_i = 0`` gives ``eps_i ∝ (a_i/c_i)^{1/3}``;
    the objective is convex on the open orthant, so the stationary point is the minimum.

    Args:
        a: per-matrix costs ``a_i >= 0`` (``log N_i(e) <= a_i / e^2``).
        c: per-matrix Lipschitz coefficients ``c_i >= 0``.
        eps: the total budget ``> 0``.

    Returns:
        :class:`Allocation` (kind EXACT: the closed form of the minimum).

    Raises:
        InputError: negative or non-finite entries, mismatched lengths, ``eps <= 0``.

    Example:
        >>> round(budget_allocation([3, 1, 7, .5], [2, 5, 1, .3], 0.1).total, 3)
        41885.599
    """
    a_arr = np.asarray(a, dtype=np.float64)
    c_arr = np.asarray(c, dtype=np.float64)
    for name, arr in (("a", a_arr), ("c", c_arr)):
        if arr.ndim != 1 or not np.isfinite(arr).all() or (arr < 0).any():
            raise InputError(f"{name} must be a 1-D sequence of finite numbers >= 0, but got {name}={list(arr.ravel())}")
    with np.errstate(divide="ignore"):
        return budget_allocation_log(np.log(a_arr), np.log(c_arr), eps)


@dataclass(frozen=True)
class CoverCost:
    """The covering cost of one matrix (or vector) as a function of its scale ``e``.

    ``form="inverse_square"``: ``log N(e) <= A / e^2`` (norm-based, dimension-free covers, F2/F3);
    ``form="parametric"``: ``log N(e) <= p log(1 + k / e)`` (Lemma G.2 on a radius-``k/2`` ball).
    ``log_c`` is the log of the matrix's downstream coefficient.
    """

    log_c: float
    form: str
    log_A: float = -math.inf
    p: int = 0
    log_k: float = -math.inf

    def log_cost(self, log_e: float) -> float:
        if self.form == "inverse_square":
            return self.log_A - 2.0 * log_e
        if self.p == 0 or self.log_k == -math.inf:
            return -math.inf
        # p log(1 + k/e), in logs: log p + log(log1p(k/e)) with log1p(k/e) = softplus(log k - log e); below z = -30
        # ln(log1p(e^z)) is z - e^z/2 + ..., and z bounds it above (log1p(x) <= x): softplus underflowed there
        # (log(0): a ValueError for a bias whose k/e is below 2^-1074; under-reported where k/e was subnormal)
        z = self.log_k - log_e
        return math.log(self.p) + (z if z < -30.0 else math.log(float(np.logaddexp(0.0, z))))


def _arrays(costs: Sequence[CoverCost]) -> dict[str, np.ndarray]:
    return {
        "log_c": np.array([t.log_c for t in costs], dtype=np.float64),
        "inv": np.array([t.form == "inverse_square" for t in costs]),
        "log_A": np.array([t.log_A for t in costs], dtype=np.float64),
        "log_p": np.array([math.log(t.p) if t.p > 0 else -math.inf for t in costs], dtype=np.float64),
        "log_k": np.array([t.log_k for t in costs], dtype=np.float64),
    }


class _ScalesAt:
    """``log_lam -> _log_eps_at_arrays(ar, log_lam)``, the same floats, with what does not depend on ``lambda``
    (which terms are dead, each form's leading sums) computed once: the multiplier's bisection evaluates it some
    fifty times per split (Note [budget in floats] has the other half of the allocations' cost)."""

    def __init__(self, ar: dict[str, np.ndarray]):
        lc, inv = ar["log_c"], ar["inv"]
        dead = np.where(inv, ar["log_A"] == -math.inf, (ar["log_p"] == -math.inf) | (ar["log_k"] == -math.inf))
        self.base = np.where(lc == -math.inf, math.inf, np.where(dead, -math.inf, 0.0))
        keep = ~dead & (lc != -math.inf)
        self.i, self.p = np.flatnonzero(keep & inv), np.flatnonzero(keep & ~inv)
        # the first sum of each form's expression, as _log_eps_at_arrays evaluates it (left to right)
        self.a_inv, self.lc_i = math.log(2.0) + ar["log_A"][self.i], lc[self.i]
        self.a_par, self.lc_p, self.lk_p = math.log(4.0) + ar["log_p"][self.p], lc[self.p], ar["log_k"][self.p]

    def __call__(self, log_lam: float) -> np.ndarray:
        out = self.base.copy()
        with np.errstate(invalid="ignore"):
            out[self.i] = (self.a_inv - log_lam - self.lc_i) / 3.0
            log_u = self.a_par - log_lam - self.lc_p - self.lk_p
            log_sqrt1pu = 0.5 * np.logaddexp(0.0, log_u)
            out[self.p] = self.lk_p + log_u - math.log(2.0) - np.logaddexp(0.0, log_sqrt1pu)
        return out


def _log_eps_at_arrays(ar: dict[str, np.ndarray], log_lam: float) -> np.ndarray:
    lc, inv = ar["log_c"], ar["inv"]
    with np.errstate(invalid="ignore"):
        # inverse square: 2A/e^3 = lambda c
        e_inv = (math.log(2.0) + ar["log_A"] - log_lam - lc) / 3.0
        # parametric: p k / (e (e + k)) = lambda c  =>  e = k u / (2 (1 + sqrt(1+u))), u = 4p/(lambda c k)
        log_u = math.log(4.0) + ar["log_p"] - log_lam - lc - ar["log_k"]
        log_sqrt1pu = 0.5 * np.logaddexp(0.0, log_u)
        e_par = ar["log_k"] + log_u - math.log(2.0) - np.logaddexp(0.0, log_sqrt1pu)
    out = np.where(inv, e_inv, e_par)
    dead = np.where(inv, ar["log_A"] == -math.inf, (ar["log_p"] == -math.inf) | (ar["log_k"] == -math.inf))
    out = np.where(dead, -math.inf, out)
    return np.where(lc == -math.inf, math.inf, out)


def allocate_mixed(costs: Sequence[CoverCost], eps: float) -> Allocation:
    """Lemma G.1 for mixed cost shapes: ``A_i/e^2`` and ``p_i log(1 + k_i/e)`` terms together.

    .. math::

        \\min_{\\sum_i c_i e_i = \\varepsilon} \\sum_i f_i(e_i),\\qquad
        f_i'(e_i) = -\\lambda c_i

    Every ``f_i`` is convex and decreasing, so the KKT point is the minimum; each ``e_i(lambda)``
    has a closed form (``(2A/(lambda c))^{1/3}``, or the positive root of
    ``e^2 + k e - p k/(lambda c) = 0``), and ``lambda`` is found by bisection on ``log lambda``
    so that ``sum_i c_i e_i <= eps`` holds (the side of the bracket that keeps the split sound).
    With only ``A/e^2`` terms this reproduces :func:`budget_allocation`.

    Raises:
        InputError: ``eps <= 0``, an empty list or an unknown form.
    """
    _check_eps(eps)
    if not costs:
        raise InputError("allocate_mixed needs at least one cost term")
    for t in costs:
        if t.form not in ("inverse_square", "parametric"):
            raise InputError(f"cost form must be 'inverse_square' or 'parametric', but got form={t.form!r}")
        if not all(v < math.inf and not math.isnan(v) for v in (t.log_c, t.log_A, t.log_k)):
            raise InputError(f"a cost term's log_c, log_A and log_k must be finite or -inf (a coefficient, cost or "
                             f"radius of 0), but got log_c={t.log_c!r}, log_A={t.log_A!r}, log_k={t.log_k!r}")
    lc = np.array([t.log_c for t in costs])
    if not (lc > -math.inf).any():
        raise InputError("allocate_mixed needs at least one term with a coefficient c_i > 0")
    # Note [sound side]: the KKT split satisfies sum c_i e_i <= eps up to rounding in logsumexp (and
    # the bracket may have stopped short on absurd inputs); fit_to_budget checks the sum exactly and
    # shrinks the split until it holds, so the returned split never exceeds the budget.
    le = fit_to_budget(lc, kkt_split(costs, eps) - 1e-12, eps)
    log_costs = np.array([_term_log_cost(t, float(e)) for t, e in zip(costs, le)])
    return Allocation(float(eps), tuple(map(float, le)), tuple(map(float, log_costs)),
                      _logsumexp(log_costs))


def kkt_split(costs: Sequence[CoverCost], eps: float) -> np.ndarray:
    """The KKT split of :func:`allocate_mixed` in floats, *not* checked against the budget.

    For searches that try many splits and certify only the one they keep (``allocate_mixed`` does
    that check).  ``costs`` must already have passed ``allocate_mixed``'s input checks.
    """
    log_eps = math.log(eps)
    lc = np.array([t.log_c for t in costs])
    live = lc > -math.inf  # a term with c_i = 0 cannot move the output and takes no budget
    ar = _arrays(costs)
    scales = _ScalesAt(ar)
    lc_live = lc[live]

    def excess(log_lam: float) -> float:  # log(sum c_i e_i) - log eps, decreasing in lambda
        return _logsumexp(lc_live + scales(log_lam)[live]) - log_eps

    size = [np.abs(v[live & np.isfinite(v)]).max(initial=0.0) for k, v in ar.items() if k != "inv"]
    return scales(replayed_bisection(excess, max(size) + abs(log_eps), int(live.sum()))[1])


def replayed_bisection(excess: Callable[[float], float], size: float, n_terms: int) -> tuple[float, float]:
    """:func:`bisect_log_multiplier`'s ``(lo, hi)``, the same floats, from about a quarter of its evaluations.

    Note [replayed bisection]: ``excess`` is kkt_split's ``ln(sum_i c_i e_i(lambda)) - ln eps``.  Each live term's
    ``ln e_i`` falls with ``ln lambda`` at slope 1/3 (an ``A/e^2`` cost) or between 1/2 and 1 (a parametric one), so
    the exact excess falls by at least ``|dx|/3``.  Its float value errs by at most ``delta = 64 u (size + n)``
    (``size``: the largest magnitude among the terms' logs and ``ln eps``, plus the bracket's ``|ln lambda|``; a few
    roundings of that size per term, the sum's ``n u``).  Regula falsi (Illinois) first brackets the float sign change
    to a few ``delta``: ``a`` (last evaluated with excess ``> 0``) and ``b`` (``<= 0``).  Then the bisection is
    replayed step by step: a midpoint ``6 delta`` or more below ``a`` has exact excess ``> -delta + 2 delta`` and so
    float excess ``> 0``, one ``6 delta`` above ``b`` has float excess ``< 0``; any other midpoint is evaluated.  So
    every step takes the branch the plain bisection takes, and the result is its result.  The bracket's own
    expansion is the plain one.  Nothing certified depends on this split (``allocate_mixed`` checks the budget
    exactly); the replay only saves evaluations (each a dozen numpy operations: the allocations' cost in every
    covering curve's anchors).
    """
    lo, hi = -50.0, 50.0
    e_lo = excess(lo)
    while e_lo < 0 and lo > -1e5:
        lo *= 2
        e_lo = excess(lo)
    e_hi = excess(hi)
    while e_hi > 0 and hi < 1e5:
        hi *= 2
        e_hi = excess(hi)
    delta = 64.0 * 2.0**-53 * (size + max(abs(lo), abs(hi)) + n_terms + 1.0)  # |ln lambda| rounds in each term too
    a, b = (lo, e_lo), (hi, e_hi)  # the float sign change lies between: excess(a) > 0 >= excess(b), when bracketed
    if not (e_lo > 0 >= e_hi and math.isfinite(e_lo) and math.isfinite(e_hi)):
        return bisect_log_multiplier(excess)
    side = 0
    for _ in range(60):  # Illinois: regula falsi with the stale end's value halved
        if b[0] - a[0] <= 4.0 * delta:
            break
        x = (a[0] * b[1] - b[0] * a[1]) / (b[1] - a[1])
        if not (a[0] < x < b[0]):
            x = 0.5 * (a[0] + b[0])
        fx = excess(x)
        if not math.isfinite(fx):
            return bisect_log_multiplier(excess)
        if fx > 0:
            a = (x, fx)
            if side == 1:
                b = (b[0], 0.5 * b[1])
            side = 1
        else:
            b = (x, fx)
            if side == -1:
                a = (a[0], 0.5 * a[1])
            side = -1
    a_x, b_x = a[0], b[0]
    # the plain bisection, replayed: a midpoint 6 delta or more outside the bracket takes the side the slope fixes
    return _bisect(lo, hi, lambda mid: mid <= a_x - 6.0 * delta or (mid < b_x + 6.0 * delta and excess(mid) > 0))


def bisect_log_multiplier(excess: Callable[[float], float]) -> tuple[float, float]:
    """``(lo, hi)`` around the sign change of ``excess(log lambda)`` (decreasing; > 0 overspends):
    ``hi`` is the side that meets the budget, unless the bracket reached ``±1e5`` on absurd inputs."""
    lo, hi = -50.0, 50.0
    while excess(lo) < 0 and lo > -1e5:
        lo *= 2
    while excess(hi) > 0 and hi < 1e5:
        hi *= 2
    return _bisect(lo, hi, lambda mid: excess(mid) > 0)


def _bisect(lo: float, hi: float, overspends: Callable[[float], bool]) -> tuple[float, float]:
    """The bisection both searches run: halve ``[lo, hi]`` toward the sign change (``overspends(mid)``: ``mid`` is the
    new ``lo``), at most 200 times, until ``hi - lo < 1e-12 max(1, |hi|)``; ``replayed_bisection`` reproduces the
    midpoints of ``bisect_log_multiplier``'s because both halve through this loop."""
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if overspends(mid):
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, abs(hi)):
            break
    return lo, hi


def budget_holds(log_c: Sequence[float], log_eps_i: Sequence[float], eps: float) -> bool:
    """Whether ``sum_i exp(log_c_i + log_eps_i) <= eps`` holds for the *real* numbers the floats denote.

    Lemma G.1's soundness condition (THEORY F4) decided exactly: every float is a dyadic rational,
    the sum ``log_c_i + log_eps_i`` and ``exp`` run on outward-rounded decimal enclosures
    (``_outward``), and the check passes only when the enclosure's upper end is ``<= eps``.  A term
    with ``c_i = 0`` (``log_c = -inf``) moves nothing and is skipped, whatever its ``eps_i``
    (``+inf`` included); a term with ``eps_i = 0`` adds 0.  Decimal exponents reach ``10^(10^18)``,
    so ``c_i ~ e^(10^5)`` is harmless.
    """
    lc = [float(v) for v in log_c]
    le = [float(v) for v in log_eps_i]
    if len(lc) != len(le):
        raise InputError(f"log_c and log_eps_i must have equal lengths, but got {len(lc)} and {len(le)}")
    if _float_sum_below(lc, le, eps):
        return True
    total = exact(0)
    for c, e in zip(lc, le):
        if c == -math.inf or e == -math.inf:
            continue
        if math.isnan(c) or math.isnan(e) or c == math.inf or e == math.inf:
            return False
        total = total + (exact(c) + exact(e)).exp()
    return total.hi <= exact(eps).lo


def _float_sum_below(lc: list[float], le: list[float], eps: float) -> bool:
    """``True`` only where ``sum_i exp(lc_i + le_i) <= eps`` holds for the real numbers; ``False`` means undecided.

    Note [budget in floats]: the exact check costs a 40-digit decimal exp per term (0.4 ms), and the allocations
    run it for every anchor and every split they keep.  Most splits meet the budget with room, which floats can
    certify: ``x = fl(c + e)`` errs by ``<= u|x|`` (u = 2^-53), so ``exp`` of the real sum is at most
    ``exp(x) e^{u|x|}``; libm's ``exp`` is within one ulp (``<= 2u`` relative; an underflow to 0 loses at most
    2^-1074 absolute); ``math.fsum`` rounds the float terms' sum correctly (``<= u``).  The factor
    ``1 + 32u + 4u max|x|`` and ``n 2^-1073`` cover all of that and the few roundings of the comparison itself.
    Where the room is smaller, or a term is non-finite or overflows, the exact check decides, so
    :func:`budget_holds` answers as the exact check does wherever that check's 40-digit enclosure is tighter than
    the room this one needs (always, at 40 digits).
    """
    u = 2.0**-53
    terms = []
    big = 0.0
    for c, e in zip(lc, le):
        if c == -math.inf or e == -math.inf:
            continue
        x = c + e
        if not math.isfinite(x) or x > 700.0:  # NaN, +inf or an exp that may overflow: undecided
            return False
        terms.append(math.exp(x))
        big = max(big, abs(x))
    bound = math.fsum(terms) * (1.0 + 32.0 * u + 4.0 * u * big) + len(terms) * 2.0**-1073
    return bound <= eps * (1.0 - 8.0 * u)


def fit_to_budget(log_c: Sequence[float], log_eps_i: Sequence[float], eps: float) -> np.ndarray:
    """``log_eps_i`` shrunk by a common factor until :func:`budget_holds` certifies the split.

    The shrink starts at ``1e-12`` (relative) and doubles; the float rounding of ``log_eps_i - s``
    is harmless because the check is made on the returned floats themselves.
    """
    lc = np.asarray(log_c, dtype=np.float64)
    le = np.asarray(log_eps_i, dtype=np.float64).copy()
    live = lc > -math.inf
    le[~live & (le == math.inf)] = math.inf  # c_i = 0: any scale, the budget is untouched
    shrink = 0.0
    step = 1e-12
    while not budget_holds(lc, le, eps):
        if not np.isfinite(le[live & (le > -math.inf)]).all():
            raise InputError("the split has a non-finite scale for a term with c_i > 0; cannot meet the budget")
        # excess in logs (float estimate): shrink by at least that, and by a doubling pad
        ex = _logsumexp(lc[live] + le[live]) - math.log(eps)
        s = max(step, ex if math.isfinite(ex) else step)
        le[live] = le[live] - s
        shrink += s
        step *= 2.0
        if shrink > 1e3:
            raise InputError("cannot fit the split to the budget (coefficients out of range)")
    return le


def _term_log_cost(t: CoverCost, log_e: float) -> float:
    if t.log_c == -math.inf or log_e == math.inf:
        return -math.inf
    if t.form == "inverse_square" and t.log_A == -math.inf:
        return -math.inf  # a single-point class: e = 0 costs nothing
    if t.form == "parametric" and (t.p == 0 or t.log_k == -math.inf):
        return -math.inf
    return t.log_cost(log_e)
