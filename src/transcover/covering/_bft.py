"""Bartlett-Foster-Telgarsky's spectral complexity, the comparison baseline (THEORY F12).

.. math::

    R_A = \\Big(\\prod_i \\rho_i \\|A_i\\|_\\sigma\\Big)
    \\Big(\\sum_i \\frac{\\|A_i^\\top - M_i^\\top\\|_{2,1}^{2/3}}{\\|A_i\\|_\\sigma^{2/3}}\\Big)^{3/2}

BFT 2017 (arXiv 1706.08498) eq. (1.2) / Thm 1.1; covering form Thm 3.3:
``ln N <= ||X||_F^2 ln(2 W^2) R_A^2 / eps^2`` (Frobenius over all n rows, so ``||X||_F^2 = n B_X^2``
and, in the normalised ``L2(P_n)`` metric, ``A_BFT = B_X^2 ln(2W^2) R_A^2``).

Note [as a baseline for Transformers]: BFT's theorem is for feed-forward chains ``x -> sigma_L(A_L
... sigma_1(A_1 x))``; attention is not such a chain.  Applied to a Transformer's matrices
(treated as one chain, ``rho_i`` the activations' Lipschitz constants) it is a *heuristic*
comparison number, reported with kind ESTIMATE; only the feed-forward case is a theorem.
The (2,1) norm here is the sum of column norms in the row-vector convention, which is BFT's
``||A^T||_{2,1}`` for ``x -> A x``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import InputError, check_positive_int
from .._results import Kind

__all__ = ["SpectralComplexity", "bft_spectral_complexity", "bft_margin_term"]


@dataclass(frozen=True)
class SpectralComplexity:
    """``R_A`` (as ``log_R``) and the normalised covering constant ``A_BFT`` (as ``log_A``)."""

    log_R: float
    log_A: float
    width: int
    kind: Kind = Kind.ESTIMATE
    source: str = "Bartlett-Foster-Telgarsky 2017 eq. (1.2), Thm 3.3; THEORY F12"

    @property
    def R(self) -> float:
        return math.inf if self.log_R > 709 else math.exp(self.log_R)


def bft_spectral_complexity(
    spectral: Sequence[float],
    l21_from_reference: Sequence[float],
    *,
    rho: Sequence[float] | None = None,
    width: int,
    input_radius: float = 1.0,
    feedforward: bool = False,
) -> SpectralComplexity:
    """BFT's spectral complexity ``R_A`` and covering constant, in logs (THEORY F12).

    Args:
        spectral: ``||A_i||_sigma > 0``.
        l21_from_reference: ``||A_i - M_i||_{2,1} >= 0`` (reference M: 0 or the initialisation).
        rho: the activations' Lipschitz constants (default all 1).
        width: ``W``, the largest layer width (enters as ``ln(2 W^2)``).
        input_radius: ``B_X`` (row norm of the inputs).
        feedforward: True when the matrices really form a feed-forward chain (kind becomes
            CERTIFIED_UPPER); False for a Transformer (a heuristic baseline, kind ESTIMATE).

    Raises:
        InputError: empty or mismatched lists, a non-positive spectral norm, ``width < 1``.
    """
    s = np.asarray(spectral, dtype=np.float64)
    b = np.asarray(l21_from_reference, dtype=np.float64)
    r = np.ones_like(s) if rho is None else np.asarray(rho, dtype=np.float64)
    if s.size == 0 or s.shape != b.shape or s.shape != r.shape:
        raise InputError(f"spectral norms, (2,1) distances and rho must be non-empty and of equal length, "
                         f"but got {s.size}, {b.size}, {r.size}")
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise InputError("spectral norms must be finite and > 0 (a zero matrix makes R_A = 0)")
    if not (np.isfinite(b).all() and (b >= 0).all() and np.isfinite(r).all() and (r > 0).all()):
        raise InputError("(2,1) distances must be finite and >= 0, rho finite and > 0")
    check_positive_int(width, "width")
    if not (math.isfinite(input_radius) and input_radius > 0):
        raise InputError(f"input_radius must be > 0, but got input_radius={input_radius!r}")
    log_prod = float(np.sum(np.log(r) + np.log(s)))
    with np.errstate(divide="ignore"):
        w = (2.0 / 3.0) * (np.log(b) - np.log(s))
    m = float(np.max(w))
    log_sum = -math.inf if m == -math.inf else m + math.log(float(np.sum(np.exp(w - m))))
    log_R = log_prod + 1.5 * log_sum
    log_A = 2.0 * math.log(input_radius) + math.log(math.log(2.0 * width * width)) + 2.0 * log_R
    if not feedforward:  # an estimate: left as computed
        return SpectralComplexity(log_R, log_A, width, Kind.ESTIMATE)
    # Certified: every log, exp, product and sum above rounds to nearest (libm's log/exp within an ulp), so
    # each result is within (a few ulps) x (the sum of the magnitudes it was formed from) of the exact value;
    # 16 (m + 4) u times those magnitudes covers it with room (log_R was up to 1.1e-13 relative low; red
    # team 37b).  The pad is added and one more step taken upward.
    u = 2.0**-53
    with np.errstate(divide="ignore"):
        mags = float(np.sum(np.abs(np.log(r))) + np.sum(np.abs(np.log(s))) + np.sum(np.abs(np.log(b[b > 0]))))
    pad = 16.0 * (s.size + 4) * u * (1.0 + mags + abs(m) + abs(log_sum))
    log_R = math.nextafter(log_R + pad, math.inf)
    pad_A = 16.0 * u * (1.0 + abs(2.0 * math.log(input_radius)) + math.log(2.0 * width * width) + 2.0 * abs(log_R))
    log_A = math.nextafter(log_A + 2.0 * pad + pad_A, math.inf)
    return SpectralComplexity(log_R, log_A, width, Kind.CERTIFIED_UPPER)


def bft_margin_term(sc: SpectralComplexity, n: float, *, margin: float = 1.0, input_radius: float = 1.0) -> float:
    """BFT Thm 1.1's complexity term ``72 ||X||_F R_A ln(2W) ln(n) / (gamma n)``, ``||X||_F = sqrt(n) B_X``.

    Returns the log of the term (it is usually astronomically large for real models).

    Raises:
        InputError: ``n <= 1`` or ``margin <= 0``.
    """
    if not (math.isfinite(n) and n > 1):
        raise InputError(f"n must be > 1, but got n={n!r}")
    if not (math.isfinite(margin) and margin > 0):
        raise InputError(f"margin must be > 0, but got margin={margin!r}")
    return (math.log(72.0) + math.log(input_radius) - 0.5 * math.log(n) + sc.log_R
            + math.log(math.log(2.0 * sc.width)) + math.log(math.log(n)) - math.log(margin))
