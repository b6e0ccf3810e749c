"""Exact covering numbers of tiny finite classes (the references the estimates are tested against).

* Internal centres (from the set): a set-cover integer program,

  .. math::

      N_{int}(\\varepsilon) = \\min \\Big\\{ \\textstyle\\sum_j z_j :
      \\sum_{j : d(f_i, f_j) \\le \\varepsilon} z_j \\ge 1 \\ \\forall i,\\ z \\in \\{0, 1\\}^M \\Big\\},

  solved with ``scipy.optimize.milp`` (HiGHS branch and bound; exact for these sizes).
* Free centres, only where the ball geometry makes it finite: for ``q = inf`` (or ``b = 1``, where
  every q-norm of a scalar is its absolute value) ``d_q`` is the l_inf distance of the flattened
  rows, whose closed eps-balls are axis-aligned cubes of side ``2 eps``.  A set fits in one cube
  iff its coordinate ranges are ``<= 2 eps`` iff its points are pairwise within ``2 eps``
  (Helly's property of boxes, coordinate by coordinate).  So ``N_ext(eps)`` is the least number
  of cliques covering the graph "``d <= 2 eps``", i.e. the chromatic number of the conflict graph
  "``d > 2 eps``", found by exhaustive backtracking (exponential; ``M <= 16``).  For ``q = 1, 2``
  with ``b > 1`` cubes are replaced by l_q balls, for which pairwise diameter does not decide
  membership (Jung's theorem), so no exact external value is offered.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._errors import InputError
from ._metrics import as_outputs, check_eps, check_q
from ._predicates import within

__all__ = ["exact_covering_number", "MAX_EXACT_INTERNAL", "MAX_EXACT_EXTERNAL"]

MAX_EXACT_INTERNAL = 400  # milp on M binaries with M x M cover constraints: fast up to here
MAX_EXACT_EXTERNAL = 16  # backtracking colouring is exponential in M


def exact_covering_number(Y, eps: float, q: float | str = math.inf, *,
                          centres: str = "internal") -> int:
    """The exact covering number of the rows of ``Y`` at ``eps`` (closed balls).

    Every comparison ``d <= eps`` / ``d > 2 eps`` is decided exactly for the stored data and the
    float64 ``eps`` (``_predicates``), so ties at the radius are neither lost nor invented.

    Args:
        Y: outputs ``(M, n, b)`` or ``(M, n)``.
        eps: radius > 0.
        q: 1, 2 or inf.
        centres: "internal" (centres from the set) or "external" (free centres; q = inf or b = 1).

    Returns:
        ``N_int(eps)`` or ``N_ext(eps)``.

    Raises:
        InputError: too many functions for an exact answer, or an external cover for a q-norm
            whose balls are not cubes.

    Example:
        >>> exact_covering_number([[0.0], [1.0], [2.0], [3.0]], 0.5, centres="internal")
        4
        >>> exact_covering_number([[0.0], [1.0], [2.0], [3.0]], 0.5, centres="external")
        2
    """
    Y = as_outputs(Y)
    eps = check_eps(eps)
    qf = check_q(q)
    M, n, b = Y.shape
    if centres == "internal":
        if M > MAX_EXACT_INTERNAL:
            raise InputError(f"exact internal covering numbers are limited to {MAX_EXACT_INTERNAL} "
                             f"functions, but got M={M}")
        return _set_cover(within(Y, Y, qf, eps).numpy())
    if centres == "external":
        if not (qf == math.inf or b == 1):
            raise InputError("exact external covering numbers need q=inf or scalar outputs (b=1), "
                             f"but got q={q!r}, b={b}")
        if M > MAX_EXACT_EXTERNAL:
            raise InputError(f"exact external covering numbers are limited to {MAX_EXACT_EXTERNAL} "
                             f"functions, but got M={M}")
        if math.isfinite(2.0 * eps):
            return _chromatic_number(~within(Y, Y, qf, 2.0 * eps).numpy())
        # Note [doubled radius]: 2 eps above float64's range was an infinite radius, every pair within it, and the
        # answer 1 for points 2e308 apart (red team 162). d <= 2 eps <=> d(Y/2) <= eps when halving is exact
        half = Y / 2
        if not bool(torch.equal(half * 2, Y)):  # a subnormal entry lost a bit
            raise InputError(f"eps={eps!r} is above half of float64's range and the outputs hold subnormal values: "
                             "the external cover's test d <= 2 eps cannot be decided exactly; rescale the outputs")
        return _chromatic_number(~within(half, half, qf, eps).numpy())
    raise InputError(f"centres must be 'internal' or 'external', but got centres={centres!r}")


def _set_cover(covers: np.ndarray) -> int:
    """Minimum number of columns whose ``True`` entries cover every row (binary program)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    M = covers.shape[0]
    # mip_rel_gap=0: HiGHS's default 1e-4 gap would let it stop above the optimum for large M
    res = milp(c=np.ones(M), constraints=LinearConstraint(covers.astype(float), lb=1.0, ub=np.inf),
               integrality=np.ones(M), bounds=Bounds(0, 1), options={"mip_rel_gap": 0.0})
    if not res.success:  # cannot happen: z = 1 is feasible; keep the reason if it ever does
        raise RuntimeError(f"milp failed: {res.message}")
    chosen = res.x > 0.5
    if not covers[:, chosen].any(axis=1).all():  # the answer must be a cover, checked exactly
        raise RuntimeError("milp returned a set that is not a cover")
    return int(chosen.sum())


def _chromatic_number(conflict: np.ndarray) -> int:
    """Fewest colours such that conflicting vertices differ (exhaustive backtracking)."""
    M = conflict.shape[0]
    order = np.argsort(-conflict.sum(axis=1), kind="stable")  # high degree first prunes early
    adj = [set(np.flatnonzero(conflict[v]).tolist()) for v in range(M)]
    colour = [-1] * M

    def colourable(k: int, pos: int) -> bool:
        if pos == M:
            return True
        v = int(order[pos])
        used = {colour[u] for u in adj[v] if colour[u] >= 0}
        top = max(colour) + 1  # symmetry breaking: open at most one new colour
        for c in range(min(k, top + 1)):
            if c not in used:
                colour[v] = c
                if colourable(k, pos + 1):
                    return True
                colour[v] = -1
        return False

    for k in range(1, M + 1):
        colour = [-1] * M
        if colourable(k, 0):
            return k
    return M
