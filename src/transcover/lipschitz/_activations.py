"""Lipschitz constants of the FFN activations: L_sigma = sup_x |sigma'(x)|.

Every supported activation has the form ``sigma(x) = x * s(x)`` with ``0 <= s(x) <= 1``
(ReLU: the step, GELU: Phi, GELU-tanh: (1 + tanh(...))/2, SiLU: the logistic sigmoid), so
besides being L_sigma-Lipschitz they satisfy ``|sigma(x)| <= |x|`` (:func:`activation_gain` = 1),
which the output-radius and FFN-perturbation bounds use (THEORY F7 with the sharper first term).

Derivations (each checked in tests against a fine grid and a scipy optimiser):

* ReLU, identity: ``sigma' in {0, 1}`` / ``= 1``, so L = 1.
* GELU ``x Phi(x)``: ``sigma' = Phi(x) + x phi(x)``, ``sigma'' = phi(x)(2 - x^2)``, so the extrema of
  ``sigma'`` are at ``x = +-sqrt(2)``: max ``Phi(sqrt 2) + sqrt(2) phi(sqrt 2) = Phi(sqrt 2) + 1/(e sqrt(pi))
  = 1.128904...``, min ``-0.128904...``; L = 1.1289.
* SiLU ``x sigmoid(x)``: ``sigma'' = s(1-s)(2 + x(1 - 2s))`` vanishes at the root ``x* ~ 2.3994`` of
  ``2 + x(1 - 2 s(x)) = 0``; L = ``sigma'(x*) = 1.0998...`` (the minimum is ``1 - L``).
* QuickGELU ``x sigmoid(a x)``, ``a = 1.702`` (CLIP): it is ``silu(a x) / a``, so its derivative is
  ``silu'(a x)`` and L equals SiLU's 1.0998...; it is ``x s(x)`` with ``s = sigmoid(a x)`` in [0, 1].
* GELU-tanh: no closed form; the maximiser of ``sigma'`` is the root of ``sigma''`` in [1, 3]
  (brentq on the analytic second derivative), L = 1.128993...
"""

from __future__ import annotations

import math
from functools import cache

from ..model import QUICK_GELU_SLOPE, Activation

__all__ = ["activation_lipschitz", "activation_gain", "activation_derivative"]

_K = math.sqrt(2.0 / math.pi)  # GELU-tanh constant
_C = 0.044715


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def activation_derivative(act: Activation | str, x: float) -> float:
    """sigma'(x) in float64 closed form (used by the constants and by the tests)."""
    act = Activation(act)
    if act is Activation.RELU:
        return 1.0 if x > 0 else 0.0
    if act is Activation.IDENTITY:
        return 1.0
    if act is Activation.GELU:
        return 0.5 * math.erfc(-x / math.sqrt(2.0)) + x * math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    if act is Activation.SILU:
        s = _sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    if act is Activation.QUICK_GELU:  # d/dx [silu(a x) / a] = silu'(a x)
        return activation_derivative(Activation.SILU, QUICK_GELU_SLOPE * x)
    t = math.tanh(_K * (x + _C * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * x * x)


def _gelu_tanh_second(x: float) -> float:
    u = _K * (x + _C * x**3)
    t = math.tanh(u)
    du = _K * (1.0 + 3.0 * _C * x * x)
    sech2 = 1.0 - t * t
    # d/dx [0.5(1+t) + 0.5 x sech2 du] = sech2 du + 0.5 x (-2 t sech2 du) du + 0.5 x sech2 * 6 C K x
    return sech2 * du - x * t * sech2 * du * du + 3.0 * _C * _K * x * x * sech2


@cache
def _sup_derivative(act: Activation) -> float:
    from scipy.optimize import brentq

    if act in (Activation.RELU, Activation.IDENTITY):
        return 1.0
    if act is Activation.GELU:
        return 0.5 * math.erfc(-1.0) + 1.0 / (math.e * math.sqrt(math.pi))
    if act is Activation.QUICK_GELU:  # quick_gelu'(x) = silu'(1.702 x): the same supremum
        return _sup_derivative(Activation.SILU)
    if act is Activation.SILU:
        x_star = brentq(lambda x: 2.0 + x * (1.0 - 2.0 * _sigmoid(x)), 1.0, 4.0, xtol=1e-15, rtol=1e-15)
    else:
        x_star = brentq(_gelu_tanh_second, 1.0, 3.0, xtol=1e-15, rtol=1e-15)
    # sigma' is flat at its maximiser, so the root's error (~1e-15) moves the value by ~1e-30.
    return activation_derivative(act, x_star)


def activation_lipschitz(act: Activation | str) -> float:
    r"""Certified Lipschitz constant of a pointwise activation.

    .. math::

        L_\sigma = \sup_x |\sigma'(x)|

    Source: THEORY F7 (the FFN bound uses L_sigma); derivations in this module's docstring.
    Assumptions: none (global constant on R).  The float64 value is padded by the module-wide
    rounding pad (Note [rounding] in ``_weights``).

    Args:
        act: an :class:`~transcover.model.Activation` or its name.

    Returns:
        L_sigma (1 for ReLU and identity, 1.1289 GELU, 1.1290 GELU-tanh, 1.0998 SiLU).

    Raises:
        ValueError: for an unknown activation name.

    Example:
        >>> round(activation_lipschitz("gelu"), 4)
        1.1289
    """
    from ._weights import ROUNDING_PAD

    return _sup_derivative(Activation(act)) * (1.0 + ROUNDING_PAD)


def activation_gain(act: Activation | str) -> float:
    r"""sup_x |sigma(x) / x| = 1 for every supported activation (``sigma(x) = x s(x)``, ``0 <= s <= 1``).

    .. math::

        |\sigma(x)| \le |x| \quad\Rightarrow\quad \|\sigma(u)\|_2 \le \|u\|_2

    Used for output radii and the FFN perturbation term ``||sigma(yW_1+b_1)|| <= ||y W_1 + b_1||``.
    """
    Activation(act)
    return 1.0
