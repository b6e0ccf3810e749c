"""A normalisation on a residual branch's output: ``x + N_post(f(N_pre x))`` (Gemma 2/3, OLMo 2): THEORY F26.

Note [branch-output norm].  Gemma 2 and 3 wrap both the attention and the FFN in "sandwich" norms,
``x + N_post(A(N_pre x))``; OLMo 2 has only the outer one, ``x + N(A(x))`` (``N_pre`` the identity).
The stage is still one residual map ``s(x) = x + N_post(A(N_pre x))``, and every piece acts row by
row, so in both metrics ((2,inf) and Frobenius)::

    Lip(s) <= 1 + L(N_post) L_A(r_1) L(N_pre),

with ``r_1`` the output radius of ``N_pre`` on the stage's input radius r (F14), ``L_A`` from F6
(or F7 for the FFN) on ``r_1``, and ``L(N_post)`` F14's constant on ``N_post``'s certified input
domain: the branch outputs, of norm ``<= rad_A(r_1)`` but with no floor on their spread, so the
global ``max|gamma|/sqrt(eps)`` unless the chain assumes a floor ``sigma_0`` for every norm input.
*Radius.*  An RMSNorm/LayerNorm output has norm ``< max|gamma| sqrt(d) + ||beta||`` whatever its input,
so ``||s(X)_i|| <= r + max|gamma_post| sqrt(d) + ||beta_post||``: the branch adds a bounded amount,
independent of the weights of ``A`` (this is what keeps the radii of a deep Gemma/OLMo 2 stack
growing linearly, and it is the radius the later stages, G.3 and the covering bound read).
*Parameters, X fixed.*  ``N_post(A(N_pre X; θ); γ) - N_post(A(N_pre X; θ~); γ~)`` splits into
``[N_post(.; γ) - N_post(.; γ~)]`` at the same input (F14's ``sqrt(d) ||Δγ||_inf + ||Δβ||``) plus
``L(N_post)`` times the pre-norm branch's change (F6/F7's terms on ``r_1`` plus ``L_A`` times
``N_pre``'s F14 terms).  In F8's chain the stage has ``rho_s`` above and this ``delta_s``; G.3's
coefficients and the covering bound (F9) follow from the chain without change.
"""

from __future__ import annotations

__all__ = ["sandwich_residual_lipschitz", "post_normed_branch"]


def sandwich_residual_lipschitz(L_branch: float, L_pre: float, L_post: float) -> float:
    r"""Input-Lipschitz bound of ``x + N_post(f(N_pre x))``.

    .. math:: \mathrm{Lip} \le 1 + L_{N_{post}}\, L_f(r_1)\, L_{N_{pre}}

    Source: THEORY F26 (Note [branch-output norm]); ``L_f`` from F6/F7 on the radius of ``N_pre``'s
    outputs, the norms' constants from F14 (1 for an absent norm).  Assumptions: those of the three
    constants.  Rounding: covered by the chain's ``1 + ROUNDING_PAD`` (Note [rounding] in ``_weights``).

    Example:
        >>> sandwich_residual_lipschitz(2.0, 1.5, 3.0)
        10.0
    """
    for name, v in (("L_branch", L_branch), ("L_pre", L_pre), ("L_post", L_post)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v!r}")
    return 1.0 + L_post * L_branch * L_pre


def post_normed_branch(post_stage, lip: float, coeffs: list) -> tuple[float, float, list]:  # noqa: ANN001
    """A branch ``f`` (Lipschitz ``lip``, perturbation ``coeffs`` on its own input) followed by the
    norm whose chain stage is ``post_stage`` (built on the branch's output radius): the composed
    branch's (Lipschitz, output radius, coefficients) (THEORY F26, Note [branch-output norm])."""
    out = [(role, c * post_stage.lipschitz, nm) for role, c, nm in coeffs] + list(post_stage.perturbation)
    return post_stage.lipschitz * lip, post_stage.radius_out, out
