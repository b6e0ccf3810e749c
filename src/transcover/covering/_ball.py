"""Lemma G.2: covering numbers of balls and boxes in R^p (THEORY F1, section 4.2).

Every function returns the *natural log* of a covering number, as a
:class:`~transcover.Quantity` whose ``kind`` says whether it is an upper bound on ``log N`` or a
lower bound on it.  Logs are used throughout so that ``p = 10^8`` parameters never overflow.

Note [which norm]: the volumetric argument behind ``(1 + 2B/eps)^p`` works for *any* norm and
its own ball (Vershynin, High-Dimensional Probability, Cor. 4.2.13): a maximal eps-separated set
of the radius-B ball is an eps-net, and the disjoint eps/2-balls around its points fit in the
(B + eps/2)-ball, so ``|net| (eps/2)^p <= (B + eps/2)^p``.  In particular it holds for the
spectral-norm ball of ``rows x cols`` matrices in spectral norm, with ``p = rows * cols``.
"""

from __future__ import annotations

import math

from .._errors import InputError
from .._results import Kind, Quantity

__all__ = [
    "ball_log_covering",
    "ball_log_covering_simple",
    "ball_log_packing_lower",
    "box_log_covering",
    "box_log_covering_linf",
]

_G2 = "THEORY F1 (Lemma G.2); Vershynin HDP Cor. 4.2.13"


def _up(x: float) -> float:
    """``x`` rounded outward by a few ulps: log1p and the product each round once."""
    return x + 4.0 * math.ulp(x)


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise InputError(f"{name} must be a finite number > 0, but got {name}={v!r}")


def _check_dim(p: int) -> None:
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise InputError(f"dimension p must be a positive integer, but got p={p!r}")


def ball_log_covering(p: int, radius: float, eps: float) -> Quantity:
    """Upper bound on ``log N(eps)`` of a radius-``B`` ball in its own norm in ``R^p``.

    .. math::

        \\log N(B_p(B), \\varepsilon, \\|\\cdot\\|) \\le p \\log\\Big(1 + \\frac{2B}{\\varepsilon}\\Big)

    Lemma G.2 in its exact form (THEORY F1).  Valid for every ``eps > 0`` (for ``eps >= B`` a
    single centre suffices and the bound is still true, just loose).

    Args:
        p: the dimension (number of real parameters).
        radius: ``B > 0``.
        eps: the covering radius ``> 0``.

    Returns:
        Quantity with ``value = log N`` upper bound, kind CERTIFIED_UPPER.

    Raises:
        InputError: ``p < 1`` or a non-positive ``radius`` / ``eps``.

    Example:
        >>> round(ball_log_covering(2, 1.0, 0.5).value, 6)  # 2 log 5
        3.218876
    """
    _check_dim(p)
    _check_positive(radius=radius, eps=eps)
    value = _up(p * math.log1p(2.0 * radius / eps))
    return Quantity(value, Kind.CERTIFIED_UPPER, _G2, (f"ball of radius {radius:g} in R^{p}, own norm",))


def ball_log_covering_simple(p: int, radius: float, eps: float) -> Quantity:
    """The seed's simplified form ``p log(3B/eps)``, valid only when ``eps <= B``.

    .. math::

        p\\log(1 + 2B/\\varepsilon) \\le p \\log(3B/\\varepsilon) \\quad (\\varepsilon \\le B)

    since ``1 + 2B/eps <= 3B/eps`` iff ``eps <= B`` (THEORY F1, section 4.2).

    Raises:
        InputError: when ``eps > B`` (the form is not an upper bound there) or bad values.
    """
    _check_dim(p)
    _check_positive(radius=radius, eps=eps)
    if eps > radius:
        raise InputError(f"p*log(3B/eps) needs eps <= B, but got eps={eps:g} > B={radius:g}; "
                         "use ball_log_covering")
    value = _up(p * math.log(3.0 * radius / eps))
    return Quantity(value, Kind.CERTIFIED_UPPER, _G2, (f"eps <= B (eps={eps:g}, B={radius:g})",))


def ball_log_packing_lower(p: int, radius: float, eps: float) -> Quantity:
    """Lower bound on ``log N(eps)`` of the radius-``B`` ball: ``p log(B/eps)``.

    .. math::

        N(B_p(B), \\varepsilon) \\ge (B/\\varepsilon)^p

    by volume: ``N`` balls of radius eps must cover the volume of the B-ball (Vershynin Cor.
    4.2.13; Wainwright Ex. 5.8).  Negative values (``eps > B``) are replaced by 0 (``N >= 1``).

    Returns:
        Quantity whose value is exactly ``max(0, p log(B/eps))`` (kind EXACT: the closed form is
        evaluated exactly); it is a proven *lower* bound on ``log N``, as ``source`` says.  transcover
        has no "certified lower" kind, and EMPIRICAL_LOWER would claim a witness.
    """
    _check_dim(p)
    _check_positive(radius=radius, eps=eps)
    value = max(0.0, p * math.log(radius / eps))
    return Quantity(value, Kind.EXACT, _G2 + " (volumetric lower bound)", ("lower bound on log N",))


def box_log_covering(p: int, half_width: float, eps: float) -> Quantity:
    """``log N`` of the box ``{||theta||_inf <= B_b}`` in the l2 metric (THEORY section 4.2).

    .. math::

        \\log N \\le p\\log\\Big(1 + \\frac{2 B_b \\sqrt{p}}{\\varepsilon}\\Big)

    The box sits in the l2 ball of radius ``B_b sqrt(p)``, and a cover of a superset (with centres
    outside the set allowed) covers the set.  This is the likely reading of the seed's garbled
    ``d log(3 B_b d / eps)`` (``3 B_b sqrt(d)/eps`` when ``eps <= B_b sqrt(d)``).
    """
    _check_dim(p)
    _check_positive(half_width=half_width, eps=eps)
    value = _up(p * math.log1p(2.0 * half_width * math.sqrt(p) / eps))
    return Quantity(value, Kind.CERTIFIED_UPPER, "THEORY F1 + section 4.2 (box in l2 ball)",
                    (f"||theta||_inf <= {half_width:g}, l2 metric",))


def box_log_covering_linf(p: int, half_width: float, eps: float) -> Quantity:
    """``log N`` of the box ``[-B_b, B_b]^p`` in the l_inf metric: the grid, exactly.

    .. math::

        N = \\lceil B_b / \\varepsilon \\rceil^p

    A grid with spacing ``2 eps`` per axis covers each interval of length ``2 B_b`` with
    ``ceil(B_b/eps)`` centres, and no cover can do better per axis (the box is a product).
    """
    _check_dim(p)
    _check_positive(half_width=half_width, eps=eps)
    value = p * math.log(math.ceil(half_width / eps))
    return Quantity(value, Kind.EXACT, "THEORY section 4.2 (grid of the l_inf box)",
                    (f"||theta||_inf <= {half_width:g}, l_inf metric",))
