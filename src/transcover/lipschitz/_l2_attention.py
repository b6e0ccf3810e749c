r"""L2 self-attention (Kim, Papamakarios, Mnih, ICML 2021, arXiv 2006.04710): globally Lipschitz.

Head ``h`` with tied query/key map ``W_Q^h`` (d x d_h) and value map ``W_V^h``:

.. math::

    P^h_{ij} = \mathrm{softmax}_j\Big(-\frac{\|x_i W_Q^h - x_j W_Q^h\|_2^2}{\sqrt{d_h}}\Big),\qquad
    f^h(X) = P^h X A_h W_V^h,\quad A_h = \frac{W_Q^h W_Q^{hT}}{\sqrt{d_h}}

and the block outputs ``sum_h f^h(X) W_O^h`` (= ``[f^1 ... f^H] W_O``).  Kim et al. write
``sqrt(D/H)`` for the head dimension; here it is ``d_h`` (equal when ``d_h = d / H``).  Tying
``W_K = W_Q`` is what makes the map Lipschitz (their Thm 3.2); dot-product attention is not
(their Thm 3.1, THEORY F13).  ``W_Q`` enters twice (scores and ``A_h``), so the Lipschitz constant
has degree 2 in ``W_Q^h``: :func:`l2_attention_lipschitz` derives it (THEORY F13, corrected).
The map itself is computed by :func:`transcover.model.l2_attention_forward`, part of the one forward
pass in ``model``; this module keeps the bound.
"""

from __future__ import annotations

import math
import operator

from .._errors import InputError
from ..model import l2_attention_forward  # the forward is model's (one forward pass); re-exported here

__all__ = ["l2_attention_forward", "phi_inverse", "l2_attention_constants", "l2_attention_lipschitz"]


def phi_inverse(y: float) -> float:
    r"""Inverse of ``phi(x) = x e^{x+1}`` on ``x >= 0``: ``phi^{-1}(y) = W_0(y / e)``.

    .. math:: x e^{x+1} = y \iff x e^x = y/e \iff x = W_0(y/e)

    Kim et al. 2021, Thm 3.2.  ``phi^{-1}(N-1) ~ log N - log log N``.  It is the largest value of
    ``sum_j p_j a_j`` over softmax weights ``p = softmax(-a)`` of ``N`` scores with ``a_i = 0``,
    ``a_j >= 0`` (Note [second moment] in :func:`l2_attention_lipschitz`).

    Example:
        >>> round(4 * phi_inverse(1.0) + 1, 4)
        2.1139
    """
    from scipy.special import lambertw

    try:
        if isinstance(y, (str, bytes)):
            raise TypeError
        y = float(y)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"phi_inverse needs a number y >= 0, but got y={y!r}") from None
    if not y >= 0:
        raise InputError(f"phi_inverse needs y >= 0, but got y={y}")
    return float(lambertw(y / math.e, 0).real)


def _positive_int(v, name: str) -> int:  # noqa: ANN001
    """``v`` as an int (numpy integers too), or InputError unless an integer in ``[1, 2^53]``.

    A float ``d_head = inf`` passed ``d_head > 0`` and made the bound 0 (red team of stop 36); above
    ``2^53`` the constants' float arithmetic no longer sees the integer.
    """
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise InputError(f"L2 attention bound needs an integer {name} >= 1, but got {name}={v!r}")
    n = operator.index(v)
    if not 1 <= n <= 2**53:
        raise InputError(f"L2 attention bound needs an integer {name} in [1, 2^53], but got {name}={v!r}")
    return n


def l2_attention_constants(seq_len: int) -> dict[str, float]:
    r"""Lipschitz constants of the parameter-free map ``h(U)_i = sum_j softmax_j(-||u_i-u_j||^2) u_j``
    on ``N = seq_len`` tokens, per metric (derivation in :func:`l2_attention_lipschitz`).

    .. math::

        c_{2,\infty}(N) = 1 + 4w,\qquad c_F(N) = \sqrt{(N+1)/2} + 2w + 2\sqrt N\,w,\qquad w = \phi^{-1}(N-1)

    Not padded for rounding (the callers pad once).

    Example:
        >>> c = l2_attention_constants(1)
        >>> (c["2,inf"], c["fro"])
        (1.0, 1.0)
    """
    N = _positive_int(seq_len, "seq_len")
    w = phi_inverse(N - 1.0)
    return {"2,inf": 1.0 + 4.0 * w, "fro": math.sqrt((N + 1) / 2.0) + 2.0 * w + 2.0 * math.sqrt(N) * w}


def l2_attention_lipschitz(B_Q: list[float], B_V: list[float], B_O: float, d_head: int, seq_len: int,
                           *, metric: str = "fro", B_OV: list[float] | None = None) -> float:
    r"""Certified Lipschitz bound of L2 multi-head attention (:func:`l2_attention_forward`), global.

    .. math::

        \mathrm{Lip} \le \frac{c_m(N)}{\sqrt{d_h}}\,\min\Big\{\|W_O\|_2\Big(\sum_h \|W_Q^h\|_2^4
        \|W_V^h\|_2^2\Big)^{1/2},\ \sum_h \|W_Q^h\|_2^2\,\|W_V^h W_O^h\|_2\Big\}

    with ``c_m`` from :func:`l2_attention_constants` (``m`` = ``"2,inf"`` or ``"fro"``).  Source:
    THEORY F13 (corrected), following Kim, Papamakarios, Mnih 2021 Thm 3.2; degree 2 in ``W_Q^h``
    (``W_Q -> lam W_Q`` maps ``F(X)`` to ``lam F(lam X)``), 1 in ``W_V`` and ``W_O``.
    Assumptions: none on the input domain (globally Lipschitz); ``N = seq_len`` tokens; the
    ``B_*`` are upper bounds of the spectral norms (``B_O`` of the stacked ``(H d_h, d)`` ``W_O``).

    Derivation.  Per head ``g(X) = P X A``, ``A = W W^T/s``, ``s = sqrt(d_h)``, ``W = W_Q^h``.  With
    ``Q = X W`` and ``U = Q / sqrt(s)``: ``g(X) = (1/s) h(Q) W^T`` and ``h(Q) = sqrt(s) h_1(Q/sqrt(s))``
    where ``h_1(U)_i = sum_j P_ij u_j``, ``P_ij = softmax_j(-||u_i - u_j||^2)``.  Both row maps are
    linear (``||W||_2`` each in both metrics), so ``Lip(g) <= ||W||_2^2 Lip(h_1) / s``.  Jacobian of
    ``h_1`` (``ubar_i = sum_j P_ij u_j``, ``C_i`` the ``P_i``-covariance of the ``u_j``):

        ``dh_i = sum_j P_ij du_j + 2 C_i du_i + 2 sum_j P_ij (u_j - ubar_i)(u_i - u_j)^T du_j``.

    Note [second moment]: ``S_i = sum_j P_ij ||u_j - u_i||^2 <= w = phi^{-1}(N-1)``: with
    ``a_j = ||u_j - u_i||^2`` (``a_i = 0``), ``S_i <= w`` iff ``sum_{j != i} (a_j - w) e^{-a_j} <= w``,
    and each term is at most ``e^{-(w+1)}`` (maximised at ``a_j = w + 1``), ``(N-1) e^{-(w+1)} = w``.
    Hence ``||C_i||_2 <= tr C_i <= S_i <= w`` and, by Cauchy-Schwarz in the weights ``P_i``,
    ``b_i := sum_j 2 P_ij ||u_j - ubar_i|| ||u_i - u_j|| <= 2w``.
    ``(2,inf)``: row ``i`` moves by at most ``(1 + 2w + 2w) max_j ||du_j||``.  Frobenius: the three
    terms have operator norms ``||P||_2 <= sqrt(||P||_1 ||P||_inf) <= sqrt((N+1)/2)`` (rows sum to 1,
    ``P_ij <= P_ii`` so off-diagonal entries are ``<= 1/2``), ``2w`` (block diagonal) and
    ``||[2 P_ij ||u_j - ubar_i|| ||u_i - u_j||]_ij||_F <= sqrt(N) max_i b_i <= 2 sqrt(N) w``.
    Heads: ``F = [g_1 W_V^1 ... g_H W_V^H] W_O`` gives the first form (rows of the concatenation
    move by ``sqrt(sum_h Lip_h^2 ||W_V^h||^2)``); ``F = sum_h g_h W_V^h W_O^h`` gives the second.
    Kim et al.'s own ``Lip_2`` constant ``sqrt(N)(4w + 1)`` is never smaller than ``c_F``.  An
    earlier form here had ``||W_Q^h||_2^2`` inside the root (degree 1 in ``W_Q``): false (issue 10).

    Args:
        B_Q, B_V: per head ``||W_Q^h||_2``, ``||W_V^h||_2``.
        B_O: ``||W_O||_2`` of the stacked output map.
        d_head: ``d_h``, the ``s = sqrt(d_h)`` of the forward.
        seq_len: ``N``.
        metric: ``"fro"`` (Frobenius over the ``N x d`` input) or ``"2,inf"`` (max over tokens of l2).
        B_OV: optional per-head ``||W_V^h W_O^h||_2`` (enables the second form).

    Returns:
        The bound, padded by ``1 + ROUNDING_PAD`` for the float arithmetic.

    Raises:
        InputError: ``seq_len`` or ``d_head`` not an integer in ``[1, 2^53]``, unknown metric,
            mismatched, non-numeric or negative/non-finite norms.
    """
    from ._weights import ROUNDING_PAD

    if metric not in ("fro", "2,inf"):
        raise InputError(f"metric must be '2,inf' or 'fro', but got metric={metric!r}")
    d_head = _positive_int(d_head, "d_head")
    c = l2_attention_constants(seq_len)[metric]
    if len(B_Q) != len(B_V) or (B_OV is not None and len(B_OV) != len(B_Q)):
        raise InputError(f"one norm per head is needed: got {len(B_Q)} B_Q, {len(B_V)} B_V"
                         + ("" if B_OV is None else f", {len(B_OV)} B_OV"))
    for name, vals in (("B_Q", B_Q), ("B_V", B_V), ("B_O", [B_O]), ("B_OV", B_OV or [])):
        try:
            ok = all(0 <= float(v) < math.inf for v in vals)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise InputError(f"{name} must hold finite norms >= 0, but got {name}={list(vals)!r}")
    stacked = B_O * math.sqrt(sum((q * q * v) ** 2 for q, v in zip(B_Q, B_V)))
    if B_OV is not None:
        stacked = min(stacked, sum(q * q * ov for q, ov in zip(B_Q, B_OV)))
    return c / math.sqrt(d_head) * stacked * (1.0 + ROUNDING_PAD)
