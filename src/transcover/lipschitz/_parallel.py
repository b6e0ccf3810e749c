"""The parallel-residual block ``x + attn(N_1 x) + ffn(N_2 x)`` (GPT-NeoX/Pythia, GPT-J, Falcon): THEORY F21.

Note [parallel residual].  The sequential pre-norm layer is the composition of two residual maps,
``y = x + A(N_1 x)``, ``z = y + F(N_2 y)``, and F8 multiplies their constants.  The parallel block
is *one* residual map whose two branches read the same input::

    f(X) = X + A(N_1 X) + F(N_2 X).

*Input.*  ``N_1``, ``N_2`` act row by row, so ``||N(X) - N(X')|| <= L_N ||X - X'||`` in both
metrics ((2,inf) and Frobenius); ``A`` is ``L_A``-Lipschitz on the ball of radius ``r_1`` that
holds ``N_1``'s outputs (F6) and ``F`` is ``L_F``-Lipschitz on ``r_2`` (F7).  The triangle
inequality on the three terms gives::

    Lip(f) <= 1 + L_A(r_1) L_{N_1} + L_F(r_2) L_{N_2},

which is never larger than the sequential ``(1 + L_A L_{N_1})(1 + L_F L_{N_2})`` (their difference is
the product ``L_A L_{N_1} L_F L_{N_2} >= 0``), and the FFN branch is bounded on ``N_2``'s radius of the
*block input*, not of ``y``.
*Radius.*  ``||f(X)_i|| <= r + rad_A(r_1) + rad_F(r_2)``.
*Parameters, X fixed* (both parameter sets in the class)::

    f(X; θ) - f(X; θ~) = [A(N_1 X; θ) - A(N_1 X; θ~)] + [A(N_1 X; θ~) - A(N~_1 X; θ~)]  (+ the same for F)

so the block's perturbation term is F6's terms on ``r_1`` plus ``L_A(r_1)`` times ``N_1``'s F14 terms,
plus F7's on ``r_2`` plus ``L_F(r_2)`` times ``N_2``'s: the pre-norm terms, summed inside one stage,
with no Lipschitz factor of the FFN multiplying the attention's terms.  In the chain of F8 the block
is one stage ``s`` with ``rho_s`` above and ``delta_s`` the sum, so G.3's coefficients and the
covering bound (F9, which reads the same chain) follow without change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["parallel_residual_lipschitz", "parallel_stage"]


def parallel_residual_lipschitz(L_attn: float, L_norm_attn: float, L_ffn: float, L_norm_ffn: float) -> float:
    r"""Input-Lipschitz bound of the parallel-residual block ``x + attn(N_1 x) + ffn(N_2 x)``.

    .. math:: \mathrm{Lip} \le 1 + L_A L_{N_1} + L_F L_{N_2}

    Source: THEORY F21 (Note [parallel residual]); ``L_A`` from F6 on the radius of ``N_1``'s
    outputs, ``L_F`` from F7 on the radius of ``N_2``'s, ``L_N`` from F14.  Assumptions: those of
    the four constants (each valid on the radius its branch reads).  The float64 rounding of these
    four operations is covered by the chain's one ``1 + ROUNDING_PAD`` (Note [rounding] in ``_weights``).

    Example:
        >>> parallel_residual_lipschitz(2.0, 1.5, 3.0, 0.5)
        5.5
    """
    for name, v in (("L_attn", L_attn), ("L_norm_attn", L_norm_attn), ("L_ffn", L_ffn),
                    ("L_norm_ffn", L_norm_ffn)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    return 1.0 + L_attn * L_norm_attn + L_ffn * L_norm_ffn


def parallel_stage(L: Any, r: float, rr: Callable[[float], float], norm_stage: Callable, attention_block: Callable,
                   ffn_block: Callable, *, sigma_min: float, c_sm: float, metric: str, seq_len: int | None):
    """The chain's one stage for a parallel-residual layer (F21), built from the pieces ``_compose``
    uses for the sequential layers: ``norm_stage(layer, name, bounds, d, r, sigma_min)``,
    ``attention_block(L, r, c_sm, metric, seq_len)`` and ``ffn_block(L, r)`` each return the branch's
    (Lipschitz, output radius, perturbation coefficients); ``rr`` maps a radius to the one the branch
    is bounded on (itself, or the uniform composition's worst radius)."""
    from ._compose import Stage

    d = L.d_model
    n1 = norm_stage(L.index, "norm_attn", L.norm_attn, d, r, sigma_min)
    n2 = norm_stage(L.index, "norm_ffn", L.norm_ffn, d, r, sigma_min)
    la, rad_a, co_a = attention_block(L, rr(n1.radius_out), c_sm, metric, seq_len)
    lf, rad_f, co_f = ffn_block(L, rr(n2.radius_out))
    coeffs = (list(co_a) + [(role, c * la, nm) for role, c, nm in n1.perturbation]
              + list(co_f) + [(role, c * lf, nm) for role, c, nm in n2.perturbation])
    lip = parallel_residual_lipschitz(la, n1.lipschitz, lf, n2.lipschitz)
    return Stage(L.index, "parallel", r, r + rad_a + rad_f, lip, tuple(coeffs),
                 {"attention": la, "norm_attn": n1.lipschitz, "ffn": lf, "norm_ffn": n2.lipschitz},
                 "THEORY F21: 1 + F6 o F14 + F7 o F14 (parallel residual)",
                 max(rr(n1.radius_out), rr(n2.radius_out)))
