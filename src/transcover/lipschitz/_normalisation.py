"""Normalisation maps: LayerNorm, RMSNorm and the seed's Pi_norm (THEORY F14, section 2).

Note [LayerNorm on a variance floor]: write ``z = P x`` (``P = I - 11^T/d`` centres; for RMSNorm
``P = I``) and ``LN(x) = gamma * psi(||z||) z/||z|| + beta`` with the radial profile
``psi(t) = t / sqrt(t^2/d + eps)``.  For a radial map, with ``a = ||z||``, ``b = ||w||`` and angle
``theta``::

    ||F(z) - F(w)||^2 = (psi(a) - psi(b))^2 + 2 psi(a) psi(b) (1 - cos theta)
    ||z - w||^2       = (a - b)^2           + 2 a b       (1 - cos theta)

so ``Lip <= max(sup psi', sup psi(t)/t)`` over the radii involved -- *without* needing the segment
between the points to stay in the set.  Here ``psi'(t) = eps/(t^2/d + eps)^{3/2} <= psi(t)/t =
1/sqrt(t^2/d + eps)``, decreasing in t.  On ``{sigma(x) >= sigma_0}`` (``t = sqrt(d) sigma``)
this gives ``Lip <= max|gamma| / sqrt(sigma_0^2 + eps)``, and ``sigma_0 = 0`` is F14's global
bound ``max|gamma| / sqrt(eps)`` (attained as sigma -> 0 for constant gamma).
"""

from __future__ import annotations

import math

from .._errors import InputError
from ..model import NormKind
from ._weights import NormBounds

__all__ = [
    "layernorm_lipschitz",
    "rmsnorm_lipschitz",
    "ball_lipschitz",
    "norm_lipschitz",
    "norm_output_radius",
    "norm_perturbation_coefficients",
    "eps_change_bound",
]


def layernorm_lipschitz(gamma_max: float, eps: float, sigma_min: float = 0.0) -> float:
    r"""Lipschitz constant (l2 -> l2, per token) of LayerNorm on ``{x : std(x) >= sigma_min}``.

    .. math::

        \mathrm{Lip}(LN) \le \frac{\max_i|\gamma_i|}{\sqrt{\sigma_0^2 + \varepsilon}}

    Source: THEORY F14 (Jacobian ``diag(gamma)(P - uu^T)/s``), extended to the non-convex set
    ``{sigma >= sigma_0}`` by the radial-map argument of Note [LayerNorm on a variance floor].
    Assumptions: every input of this LayerNorm has standard deviation ``>= sigma_min``
    (``sigma_min = 0``: no assumption, the global constant).

    Args:
        gamma_max: ``max_i |gamma_i|`` (1 without a learnable scale).
        eps: the variance floor inside the square root (a model hyperparameter).
        sigma_min: assumed lower bound on the input's standard deviation.

    Returns:
        The certified constant, rounded up (Note [outward rounding]).

    Raises:
        InputError: if ``eps + sigma_min^2 <= 0`` (LayerNorm is then not Lipschitz) or an argument
            is negative.

    Example:
        >>> round(layernorm_lipschitz(1.0, 1e-5), 1)
        316.2
    """
    try:
        g, e, s0 = float(gamma_max), float(eps), float(sigma_min)
    except (TypeError, ValueError, OverflowError):
        g = e = s0 = math.nan
    if isinstance(gamma_max, bool) or not (0 <= g < math.inf and 0 <= e < math.inf and 0 <= s0 < math.inf):  # NaN too
        raise InputError(f"LayerNorm bound needs finite gamma_max, eps, sigma_min >= 0, but got "
                         f"gamma_max={gamma_max!r}, eps={eps!r}, sigma_min={sigma_min!r}")
    if e == 0.0 and s0 == 0.0:
        # shared by RMSNorm, whose eps = 0 was refused in LayerNorm's words (red team 165)
        raise InputError("a LayerNorm or RMSNorm with eps=0 is not Lipschitz near constant (LayerNorm) or zero "
                         "(RMSNorm) inputs; give a variance floor sigma_min > 0 (--sigma-min)")
    if g == 0.0:
        return 0.0  # exact
    # Note [outward rounding]: sqrt(sigma_0^2 + eps) = hypot(sigma_0, sqrt(eps)), formed without squaring
    # (sigma_0^2 is subnormal below 1.5e-154 -- rounded up by up to 2x, the bound 29 % low -- and
    # overflows above 1.3e154): sqrt rounds to nearest (<= u), hypot within 1 ulp, the division <= u,
    # so the quotient is < 4u relative below the exact value while it is a normal float; for constant
    # gamma the value is attained, and four ulps up put it above.  A quotient in the subnormal range
    # (absolute error up to 2^-1075) is replaced by 2^-1021, above the exact value (never 0).
    value = g / math.hypot(s0, math.sqrt(e))
    if value < 2.0**-1022:
        return 2.0**-1021
    for _ in range(4):
        value = math.nextafter(value, math.inf)
    return value


def rmsnorm_lipschitz(gamma_max: float, eps: float, rms_min: float = 0.0) -> float:
    r"""Lipschitz constant of RMSNorm on ``{x : rms(x) >= rms_min}``.

    .. math::

        \mathrm{Lip}(RMS) \le \frac{\max_i|\gamma_i|}{\sqrt{\rho_0^2 + \varepsilon}}

    Source: THEORY F14 (RMSNorm: ``P = I``); same radial-map argument as LayerNorm.
    Assumptions: every input has root-mean-square ``>= rms_min``.

    Raises:
        InputError: as :func:`layernorm_lipschitz`.
    """
    return layernorm_lipschitz(gamma_max, eps, rms_min)


def ball_lipschitz() -> float:
    r"""Pi_norm(x) = x / max(1, ||x||_2) is the metric projection onto a convex set: Lipschitz 1.

    .. math:: \mathrm{Lip}(\Pi_{norm}) = 1

    Source: THEORY section 2 (Edelman et al. 2022).  No assumption.
    """
    return 1.0


def norm_lipschitz(n: NormBounds, sigma_min: float = 0.0) -> float:
    """Dispatch on the norm kind; ``sigma_min`` is the floor assumed for LayerNorm/RMSNorm inputs."""
    if n.kind is NormKind.LAYERNORM:
        return layernorm_lipschitz(n.gamma_max, n.eps, sigma_min)
    if n.kind is NormKind.RMSNORM:
        return rmsnorm_lipschitz(n.gamma_max, n.eps, sigma_min)
    return 1.0  # BALL (projection) and NONE (identity)


def norm_output_radius(n: NormBounds, d: int, radius_in: float) -> float:
    r"""Bound on every output token's l2 norm.

    .. math::

        \|LN(x)\|_2 \le \max|\gamma|\sqrt d + \|\beta\|_2, \qquad \|\Pi_{norm}(x)\| \le \min(1, r)

    LayerNorm/RMSNorm: the normalised vector has ``||y||^2 = d sigma^2/(sigma^2 + eps) < d``.
    """
    if n.kind in (NormKind.LAYERNORM, NormKind.RMSNORM):
        return n.gamma_max * math.sqrt(d) + n.beta_norm
    if n.kind is NormKind.BALL:
        return min(1.0, radius_in)
    return radius_in


def eps_change_bound(eps_a: float, eps_b: float) -> float:
    r"""``sup_{v >= 0} |sqrt(v/(v + eps_a)) - sqrt(v/(v + eps_b))|``: how far a change of the variance
    floor moves a normalised vector, per unit ``sqrt(d) max|gamma|``.

    .. math::

        \|N_{\varepsilon_a}(x) - N_{\varepsilon_b}(x)\|_2 \le \max_i|\gamma_i|\sqrt d\;
        \frac{k^{1/3} - 1}{\sqrt{k^{2/3} + k^{1/3} + 1}},\qquad k = \frac{\max(\varepsilon_a, \varepsilon_b)}{\min(\varepsilon_a, \varepsilon_b)}

    Note [eps change]: at a fixed input, LayerNorm (``v`` = variance of x, ``z = x - mean``) and
    RMSNorm (``v`` = mean square, ``z = x``) both output ``gamma * z / sqrt(v + eps) + beta`` with
    ``||z|| = sqrt(d v)``, so the change is at most ``max|gamma| sqrt(d) f(v)`` with
    ``f(v) = sqrt(v/(v+e1)) - sqrt(v/(v+e2))`` (``e1 < e2``).  Writing ``a = e1/v`` and
    ``k = e2/e1``, ``f = (1+a)^{-1/2} - (1+ka)^{-1/2}``; its derivative vanishes where
    ``k^{2/3}(1+a) = 1+ka``, i.e. ``a* = (k^{1/3}+1)/k^{2/3}``, where ``1 + k a* = S =
    k^{2/3}+k^{1/3}+1`` and ``1 + a* = S/k^{2/3}``, giving the maximum ``(k^{1/3}-1)/sqrt(S)`` (f
    vanishes at both ends, a = 0 and a -> inf).  With ``e1 = 0`` the supremum is 1 (k -> inf).
    ``k^{1/3} - 1`` is formed as ``expm1(log1p(k-1)/3)``, accurate to a few ulps even for k near 1
    (the caller's rounding pad covers the rest).  The test compares it with a brute-force supremum.
    Rounded up since stop 38: the six roundings (quotient, log1p, /3, expm1, the square root's argument and
    root, the quotient) err by well under 16 ulps together, so ``(1 + 2^-48)`` and one step up hold the exact
    value; the bare value was up to 1 ulp below it, which ``deltas_from_norms`` returned as it was.

    Raises:
        InputError: a negative or non-finite eps.
    """
    lo, hi = sorted((float(eps_a), float(eps_b)))
    if lo < 0 or not math.isfinite(hi):
        raise InputError(f"eps must be finite and >= 0, but got eps={eps_a!r} and {eps_b!r}")
    if lo == hi:
        return 0.0
    if lo == 0.0:
        return 1.0
    c = math.expm1(math.log1p((hi - lo) / lo) / 3.0)  # k^{1/3} - 1
    k13 = 1.0 + c
    return min(1.0, math.nextafter(c / math.sqrt(k13 * k13 + k13 + 1.0) * (1.0 + 2.0**-48), math.inf))


def norm_perturbation_coefficients(n: NormBounds, d: int) -> list[tuple[str, float, str]]:
    r"""Output change of a normalisation when its parameters change, input fixed.

    .. math::

        \|N(x;\gamma,\beta) - N(x;\tilde\gamma,\tilde\beta)\|_2 \le \sqrt d\,\|\gamma-\tilde\gamma\|_\infty
        + \|\beta - \tilde\beta\|_2

    (``||y||_2 < sqrt(d)`` for the normalised vector).  Returns ``(role, coefficient, norm)``
    entries; Pi_norm and the identity have no parameters.  A class whose eps ranges over
    ``[n.eps, n.eps_max]`` (two models with different variance floors) adds the role ``eps`` with
    coefficient ``max|gamma| sqrt(d)``, charged against :func:`eps_change_bound` (Note [eps change]).
    """
    if n.kind in (NormKind.LAYERNORM, NormKind.RMSNORM):
        out = [("gamma", math.sqrt(d), "linf"), ("beta", 1.0, "l2")]
        if n.eps_max > n.eps:
            out.append(("eps", n.gamma_max * math.sqrt(d), "eps"))
        return out
    return []
