"""The feed-forward block: input-Lipschitz, output radius and parameter perturbation (THEORY F7).

Plain FFN ``g(y) = sigma(y W_1 + b_1) W_2 + b_2``; gated FFN (Llama)
``g(y) = (sigma(y W_g + b_g) * (y W_1 + b_1)) W_2 + b_2``.  Every supported activation satisfies
``|sigma(t)| <= |t|`` and is L_sigma-Lipschitz (``_activations``).

Note [gated FFN].  The gated product is not globally Lipschitz; on ``||y|| <= r``, with
``u = y W_1 + b_1`` and ``g = y W_g + b_g``, the derivative of the hidden vector is
``sigma'(g) * dg * u + sigma(g) * du``, and ``||a * b||_2 <= ||a||_2 ||b||_inf <= ||a||_2 ||b||_2``
gives ``Lip <= B_W2 (L_sigma B_Wg (B_W1 r + B_b1) + B_W1 (B_Wg r + B_bg))`` (the ball is convex,
so the mean-value argument applies).
"""

from __future__ import annotations

from ._activations import activation_gain, activation_lipschitz

__all__ = ["ffn_lipschitz", "ffn_output_radius", "ffn_perturbation_coefficients"]


def ffn_lipschitz(B_W1: float, B_W2: float, activation: str, *, radius: float | None = None,
                  B_b1: float = 0.0, B_Wg: float | None = None, B_bg: float = 0.0) -> float:
    r"""Input-Lipschitz bound of the FFN (per token, l2; identical in ``(2,inf)`` and Frobenius).

    .. math::

        \mathrm{Lip}(g) \le L_\sigma \|W_1\|_2 \|W_2\|_2
        \qquad\text{(gated: } \|W_2\|(L_\sigma\|W_g\|(\|W_1\| r + \|b_1\|) + \|W_1\|(\|W_g\| r + \|b_g\|))\text{)}

    Source: THEORY F7 (first bullet); gated form in Note [gated FFN].  Assumptions: plain FFN none
    (global); gated FFN inputs of norm ``<= radius``.  A residual adds 1 (done by the composition).
    """
    L = activation_lipschitz(activation)
    if B_Wg is None:
        return L * B_W1 * B_W2
    if radius is None:
        raise ValueError("the gated FFN bound needs the input radius")
    return B_W2 * (L * B_Wg * (B_W1 * radius + B_b1) + B_W1 * (B_Wg * radius + B_bg))


def ffn_output_radius(B_W1: float, B_W2: float, activation: str, radius: float, *, B_b1: float = 0.0,
                      B_b2: float = 0.0, B_Wg: float | None = None, B_bg: float = 0.0) -> float:
    r"""Bound on the FFN's output norm for inputs of norm <= r.

    .. math::

        \|g(y)\| \le m_\sigma (\|W_1\| r + \|b_1\|)\|W_2\| + \|b_2\|, \quad m_\sigma = \sup|\sigma(t)/t| = 1
    """
    m = activation_gain(activation)
    u = B_W1 * radius + B_b1
    if B_Wg is None:
        return m * u * B_W2 + B_b2
    return m * (B_Wg * radius + B_bg) * u * B_W2 + B_b2


def ffn_perturbation_coefficients(B_W1: float, B_W2: float, activation: str, radius: float, *,
                                  B_b1: float = 0.0, B_Wg: float | None = None, B_bg: float = 0.0,
                                  has_b1: bool = True, has_b2: bool = True,
                                  has_bg: bool = False) -> list[tuple[str, float, str]]:
    r"""Per-matrix coefficients of the FFN's output change when its weights change, input fixed.

    .. math::

        \|g(y;\theta) - g(y;\tilde\theta)\| \le (B_{W1} r + B_{b1})\|\Delta W_2\|
        + L_\sigma B_{W2}(r\|\Delta W_1\| + \|\Delta b_1\|) + \|\Delta b_2\|

    (THEORY F7 second bullet with radius r and ``|sigma(t)| <= |t|`` in the first term.)  Gated:
    with ``a = B_Wg r + B_bg``, ``u = B_W1 r + B_b1``: ``a u ||dW_2|| + B_W2 (L_sigma u (r||dW_g||
    + ||db_g||) + a (r ||dW_1|| + ||db_1||)) + ||db_2||``.  Assumptions: ``||y|| <= radius``; the B's
    bound both parameter sets (class bounds).

    Returns:
        ``(role, coefficient, norm)`` entries for ``W_1, b_1, W_2, b_2`` (and ``W_gate, b_gate``).
    """
    L = activation_lipschitz(activation)
    m = activation_gain(activation)
    r = radius
    u = B_W1 * r + B_b1
    out: list[tuple[str, float, str]] = []
    if B_Wg is None:
        out.append(("W_1", L * B_W2 * r, "spectral"))
        if has_b1:
            out.append(("b_1", L * B_W2, "l2"))
        out.append(("W_2", m * u, "spectral"))
    else:
        a = m * (B_Wg * r + B_bg)
        out.append(("W_gate", B_W2 * L * u * r, "spectral"))
        if has_bg:
            out.append(("b_gate", B_W2 * L * u, "l2"))
        out.append(("W_1", B_W2 * a * r, "spectral"))
        if has_b1:
            out.append(("b_1", B_W2 * a, "l2"))
        out.append(("W_2", a * u, "spectral"))
    if has_b2:
        out.append(("b_2", 1.0, "l2"))
    return out
