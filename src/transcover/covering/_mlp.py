"""The MLP head's covering number by parameter counting (THEORY F1, Theorem G.5's first term).

.. math::

    \\log N_\\infty(\\mathcal F_{MLP}, \\varepsilon) \\le \\sum_j p_j \\log\\Big(1 + \\frac{2 r_j}{\\varepsilon_j}\\Big),
    \\qquad \\sum_j c_j\\varepsilon_j \\le \\varepsilon

which is ``O(d_m log(d_m / eps))`` with ``d_m`` the parameter count (THEORY 4.4): each weight
matrix is covered as a spectral-norm ball (Lemma G.2 in spectral norm), each bias as an l2 ball.

Note [MLP perturbation]: with ``h_0 = z`` (``||z|| <= R_0``), ``u_j = h_{j-1} W_j + b_j``,
``h_j = act(u_j)`` for ``j < L`` and output ``u_L``, and ``act(0) = 0`` with Lipschitz constant
``L_act``: ``||h_j|| <= R_j = L_act (s_j R_{j-1} + beta_j)`` and, telescoping layer by layer,

.. math::

    \\|f(z) - \\tilde f(z)\\| \\le \\sum_j D_j\\,(R_{j-1}\\|\\Delta W_j\\|_2 + \\|\\Delta b_j\\|_2),
    \\quad D_j = \\prod_{k>j} L_{act} s_k

uniformly in ``z``; the head is ``C = L_act^{L-1} prod_j s_j`` Lipschitz in ``z``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import InputError
from .._results import Kind
from ._transformer import MatrixTerm, TransformerCovering, transformer_log_covering

__all__ = ["MLPCovering", "mlp_terms", "mlp_log_covering"]


@dataclass(frozen=True)
class MLPCovering:
    """``log N_inf(F_MLP, eps)`` (uniform over inputs of radius ``R_0``) and the head's Lipschitz C."""

    eps: float
    log_log_N: float
    log_C: float
    n_params: int
    covering: TransformerCovering
    kind: Kind = Kind.CERTIFIED_UPPER

    @property
    def log_N(self) -> float:
        return math.inf if self.log_log_N > 709.0 else math.exp(self.log_log_N)

    @property
    def C(self) -> float:
        return math.inf if self.log_C > 709.0 else math.exp(self.log_C)


def _log(x: float) -> float:
    return -math.inf if x == 0 else math.log(x)


def mlp_terms(
    shapes: Sequence[tuple[int, int]],
    spectral: Sequence[float],
    bias_norms: Sequence[float],
    *,
    input_radius: float = 1.0,
    act_lipschitz: float = 1.0,
    radii: Sequence[float] | None = None,
) -> tuple[list[MatrixTerm], float]:
    """The head's matrices as covering terms with their coefficients, and ``log C``.

    Args:
        shapes: ``(d_in, d_out)`` of each layer's weight (row-vector convention).
        spectral: ``s_j >= ||W_j||_2`` (bounds of the class).
        bias_norms: ``beta_j >= ||b_j||_2`` (0 for no bias).
        input_radius: ``R_0``, the radius of the head's input.
        act_lipschitz: ``L_act`` (1 for ReLU; the activation must satisfy ``act(0) = 0``).
        radii: ``||W_j - M_j||_2`` for a reference ``M_j`` (default: ``s_j``, reference 0).

    Returns:
        (terms, log C), the terms tagged ``group="head"``.
    """
    L = len(shapes)
    if not (L == len(spectral) == len(bias_norms)) or L == 0:
        raise InputError(f"the head needs equally many shapes, norms and bias norms (>= 1), but got "
                         f"{len(shapes)}, {len(spectral)}, {len(bias_norms)}")
    for name, v in (("input_radius", input_radius), ("act_lipschitz", act_lipschitz)):
        if not (math.isfinite(v) and v > 0):
            raise InputError(f"{name} must be a finite number > 0, but got {name}={v!r}")
    if any(not (math.isfinite(s) and s >= 0) for s in (*spectral, *bias_norms)):
        raise InputError("head norms must be finite and >= 0")
    radii = list(spectral) if radii is None else list(radii)
    log_R = [math.log(input_radius)]  # log R_{j-1} for j = 1..L
    for j in range(L - 1):
        # R_j = L_act (s_j R_{j-1} + beta_j), in logs
        log_R.append(math.log(act_lipschitz) + float(np.logaddexp(_log(spectral[j]) + log_R[j], _log(bias_norms[j]))))
    log_D = [0.0] * L  # D_j = prod_{k>j} L_act s_k
    for j in range(L - 2, -1, -1):
        log_D[j] = log_D[j + 1] + math.log(act_lipschitz) + _log(spectral[j + 1])
    terms = []
    for j, ((din, dout), r, beta) in enumerate(zip(shapes, radii, bias_norms)):
        terms.append(MatrixTerm(layer=j, role=f"head.W_{j}", shape=(din, dout), log_c=log_D[j] + log_R[j],
                                l21=r, spectral=r, group="head"))
        if beta > 0:
            terms.append(MatrixTerm(layer=j, role=f"head.b_{j}", shape=(1, dout), log_c=log_D[j],
                                    l21=beta, spectral=beta, vector=True, group="head"))
    log_C = (L - 1) * math.log(act_lipschitz) + sum(_log(s) for s in spectral)
    return terms, log_C


def mlp_log_covering(
    shapes: Sequence[tuple[int, int]],
    spectral: Sequence[float],
    bias_norms: Sequence[float],
    eps: float,
    *,
    input_radius: float = 1.0,
    act_lipschitz: float = 1.0,
    radii: Sequence[float] | None = None,
) -> MLPCovering:
    """Upper bound on ``log N_inf(F_MLP, eps)`` (uniform over ``||z|| <= R_0``), THEORY F1.

    .. math::

        \\log N \\le \\min_{\\sum_j c_j\\varepsilon_j\\le\\varepsilon} \\sum_j p_j\\log(1 + 2r_j/\\varepsilon_j)
        = O\\big(d_m \\log(d_m/\\varepsilon)\\big)

    See Note [MLP perturbation] for the coefficients ``c_j``; the split is Lemma G.1's.
    The cover is uniform over inputs (parameter-space centres), as Theorem G.5 needs.

    Raises:
        InputError: bad norms, ``eps <= 0``.
    """
    terms, log_C = mlp_terms(shapes, spectral, bias_norms, input_radius=input_radius,
                             act_lipschitz=act_lipschitz, radii=radii)
    cov = transformer_log_covering(terms, eps, 1, family="spectral",
                                   assumptions=("MLP head, act(0) = 0, parameter-space cover (F1)",))
    n_params = sum(a * b + b for a, b in shapes)
    return MLPCovering(float(eps), cov.log_log_N, log_C, n_params, cov)
