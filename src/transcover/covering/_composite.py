"""Theorem G.5: the Transformer + MLP class ``F_MLP o G_TF`` (THEORY F10).

.. math::

    \\log N_\\infty(\\mathcal F_{MLP}\\circ\\mathcal G_{TF}, \\varepsilon) \\le
    \\log N(\\mathcal F_{MLP}, \\varepsilon/2) + \\log N_\\infty(\\mathcal G_{TF}, \\varepsilon/(2C))
    = O\\big(d_m\\log(d_m/\\varepsilon)\\big) + \\frac{4C^2(\\eta+\\tilde\\eta)^3}{\\varepsilon^2}

Proof of the split: ``||f(g(x)) - f^(g^(x))|| <= ||f(g(x)) - f(g^(x))|| + ||f(g^(x)) - f^(g^(x))||
<= C ||g(x) - g^(x)|| + sup_z ||f(z) - f^(z)||``; the readout (mean over tokens or the first
token) is 1-Lipschitz from the ``max_t ||.||_2`` metric to l2, and the MLP cover is uniform over
its inputs (parameter-space centres).  The "4C^2" is ``(2C)^2``; ``eta`` and ``eta~`` are F4's
gamma restricted to the attention and the FFN matrices (a reading of the split, THEORY F10).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .._errors import InputError
from .._results import Kind
from ._mlp import MLPCovering
from ._transformer import MatrixTerm, TransformerCovering, transformer_log_covering

__all__ = ["CompositeCovering", "composite_log_covering", "g5_leading_log"]


@dataclass(frozen=True)
class CompositeCovering:
    """Theorem G.5's bound: the MLP part at ``eps/2`` plus the Transformer part at ``eps/(2C)``."""

    eps: float
    log_log_N: float
    mlp: MLPCovering
    transformer: TransformerCovering
    log_C: float
    log_leading: float  # ln of 4 C^2 (eta + eta~)^3 / eps^2 at the Transformer's split
    kind: Kind = Kind.CERTIFIED_UPPER
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def log_N(self) -> float:
        return math.inf if self.log_log_N > 709.0 else math.exp(self.log_log_N)


def g5_leading_log(log_C: float, log_eta: float, log_eta_tilde: float, eps: float) -> float:
    """``ln(4 C^2 (eta + eta~)^3 / eps^2)`` from logs (Theorem G.5's second term, THEORY F10)."""
    if not (math.isfinite(eps) and eps > 0):
        raise InputError(f"eps must be a finite number > 0, but got eps={eps!r}")
    log_sum = float(np.logaddexp(log_eta, log_eta_tilde))
    return math.log(4.0) + 2.0 * log_C + 3.0 * log_sum - 2.0 * math.log(eps)


def composite_log_covering(
    transformer_terms: Sequence[MatrixTerm],
    mlp_at_half_eps: MLPCovering,
    eps: float,
    n_points: int,
    *,
    family: str = "l21",
) -> CompositeCovering:
    """Upper bound on ``log N_inf(F_MLP o G_TF, eps)`` (Theorem G.5, THEORY F10).

    Args:
        transformer_terms: the Transformer's matrices (coefficients to its output).
        mlp_at_half_eps: the head's cover at ``eps/2`` (:func:`mlp_log_covering` with ``eps/2``);
            its ``log_C`` is the head's Lipschitz constant ``C``.
        eps: the total scale ``> 0``.
        n_points: ``m * T``.
        family: the Transformer's norm family (see :func:`transformer_log_covering`).

    Raises:
        InputError: ``eps <= 0`` or an MLP cover that was not computed at ``eps / 2``.
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise InputError(f"eps must be a finite number > 0, but got eps={eps!r}")
    if not math.isclose(mlp_at_half_eps.eps, eps / 2.0, rel_tol=1e-12):
        raise InputError(f"the MLP cover must be at eps/2 = {eps / 2:g}, but got eps={mlp_at_half_eps.eps:g}")
    log_C = mlp_at_half_eps.log_C
    # exp and log round to nearest: step down so eps_tf never exceeds eps / (2C) (the split's budget)
    # (and capped inside float64: a tiny head constant C made eps / (2C) overflow; a smaller scale is only safer)
    eps_tf = math.nextafter(math.exp(min(math.log(eps) - math.log(2.0) - log_C, 709.0)) * (1.0 - 1e-15), 0.0)
    if eps_tf == 0.0:
        raise InputError(f"the head's Lipschitz constant (log C = {log_C:.1f}) leaves no budget for the Transformer")
    tf = transformer_log_covering(transformer_terms, eps_tf, n_points, family=family)
    # logaddexp rounds to nearest: a relative pad of 1e-15 and one step up keep the sum an upper bound
    total = float(np.logaddexp(mlp_at_half_eps.log_log_N, tf.log_log_N))
    total = math.nextafter(total + (abs(total) + 1.0) * 1e-15, math.inf)
    leading = (g5_leading_log(log_C, tf.log_eta, tf.log_eta_tilde, eps)
               if tf.log_gamma > -math.inf else -math.inf)
    return CompositeCovering(float(eps), total, mlp_at_half_eps, tf, log_C, leading,
                             assumptions=tf.assumptions + ("Theorem G.5 split eps/2 + eps/(2C)",))
