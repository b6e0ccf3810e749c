"""Dot-product self-attention on a bounded domain: input-Lipschitz and parameter-perturbation bounds.

Setting (THEORY F6, our derivation).  Head ``h`` maps ``X`` (rows ``x_i``, ``||x_i||_2 <= R``) to
``f_h(X)_i = sum_j P_ij x_j W_OV^h`` with ``P_i = softmax_j(s_ij)``,
``s_ij = x_i A_h x_j^T + b_h x_j^T``, ``A_h = scale W_Q^h W_K^hT`` (``B_KQ``) and
``b_h = scale b_Q^h W_K^hT`` (the part of the query/key biases that survives the softmax, Note
[attention biases] in ``model._spec``).  The block adds ``sum_h f_h(X) + b_out``.

Note [F6 derivation].  For two inputs ``X, X'`` in the domain::

    f_h(X)_i - f_h(X')_i = sum_j P_ij (x_j - x'_j) W_OV  +  sum_j (P_ij - P'_ij) x'_j W_OV

The first term is at most ``B_OV max_j ||x_j - x'_j||`` (``P_i`` is a probability vector).  The
second is at most ``B_OV R ||P_i - P'_i||_1 <= B_OV R c_sm ||s_i - s'_i||_inf`` (THEORY F5:
``||sm(a) - sm(b)||_1 <= c_sm ||a - b||_inf`` with ``c_sm = 1`` tight), and
``s_ij - s'_ij = (x_i - x'_i) A x_j^T + x'_i A (x_j - x'_j)^T + b (x_j - x'_j)^T`` is at most
``B_KQ R (||dx_i|| + ||dx_j||) + ||b|| ||dx_j||``.  Hence, in ``||.||_{2,inf}``,

    Lip(f_h) <= B_OV (1 + c_sm R (2 B_KQ R + ||b||)).

In Frobenius on sequences of length T: ``||P dX||_F <= ||P||_2 ||dX||_F <= sqrt(T) ||dX||_F``
(``||P||_2 <= sqrt(||P||_1 ||P||_inf) <= sqrt(T)`` for row-stochastic P), and the rows of the
second term sum in l2 to ``c_sm R B_OV (B_KQ R (1 + sqrt T) + sqrt(T) ||b||) ||dX||_F``.

Multi-head: the output is ``sum_h f_h``, so ``Lip <= sum_h Lip(f_h)`` (F6).  A second valid bound
reads the output projection once: the concatenation ``[g_1 .. g_H]`` (``g_h = P_h X W_V^h``) goes
through ``W_O``, so ``Lip <= ||W_O||_2 sqrt(sum_h Lip(g_h)^2)`` with ``B_V^h`` in place of
``B_OV^h``.  :func:`attention_lipschitz` returns the smaller of the two.

Parameters (X fixed): ``f_h(X;θ)_i - f_h(X;θ~)_i = sum_j P_ij x_j dW_OV + sum_j (P_ij - P~_ij) x_j W~_OV``
and ``|s_ij - s~_ij| <= R^2 ||dA|| + R ||db||``, so

    ||df_h||_{2,inf} <= R ||dW_OV^h|| + c_sm B_OV^h (R^3 ||dA_h|| + R^2 ||db_h||),   plus ||d b_out||.

(F6 second bullet, with ``W_OV`` for ``W_V``; ``B_OV^h`` is the class bound, so it covers ``W~``.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._errors import InputError

__all__ = [
    "check_c_sm",
    "head_lipschitz",
    "attention_lipschitz",
    "attention_output_radius",
    "attention_perturbation_coefficients",
    "relative_bias_perturbation_coefficients",
]


def _check_metric(metric: str, seq_len: int | None) -> float:
    """sqrt(T) for Frobenius, 1 for (2,inf); validates the pair."""
    if metric == "2,inf":
        return 1.0
    if metric == "fro":
        if seq_len is None or not isinstance(seq_len, int) or seq_len <= 0:
            raise InputError(f"metric='fro' needs a sequence length seq_len > 0, but got seq_len={seq_len!r}")
        return math.sqrt(seq_len)
    raise InputError(f"metric must be '2,inf' or 'fro', but got metric={metric!r}")


def check_c_sm(c_sm: float, name: str = "c_sm") -> float:
    """Validate a softmax constant for a certified bound: a finite number >= 1.

    THEORY F5 proves ``||sm(a) - sm(b)||_1 <= ||a - b||_inf`` and shows the constant 1 is attained
    in the limit, so every ``c_sm >= 1`` (2 is Edelman et al.'s) gives a true bound and every
    ``c_sm < 1`` would be an assumption the softmax violates: a rank-2 head then exceeds the bound
    (19.4 measured against 11 certified at ``c_sm = 0.5``, issue 10).  ``name`` is how the caller
    spells the argument (``--c-sm`` on the command line).

    Raises:
        InputError: ``c_sm`` not a finite number >= 1.
    """
    if isinstance(c_sm, bool) or not isinstance(c_sm, (int, float)) or not math.isfinite(c_sm) or c_sm < 1.0:
        raise InputError(f"{name} must be a finite number >= 1 (THEORY F5: 1 is the proven, tight softmax "
                         f"constant; a smaller one gives no certificate), but got {name}={c_sm!r}")
    return float(c_sm)


_U = 2.0 ** -53  # unit roundoff of float64


def _round_up(x, n_ops: int):
    """``x`` (a float64 result of at most ``n_ops`` roundings of a formula increasing in its inputs)
    moved above the exact value of the formula: Note [rounding the attention constants].

    Note [rounding the attention constants]: each of the ``n_ops`` float64 operations has relative
    error <= u, so the computed value is >= (exact)(1 - u)^n_ops >= (exact)(1 - (n_ops + 1) u) for
    n_ops u << 1.  Multiplying by ``1 + (2 n_ops + 4) u`` (itself rounded, relative error <= u)
    lands above the exact value.  Works on Python floats and on float64 tensors (the penalties of
    ``transcover.constrain`` differentiate through it).
    """
    return x * (1.0 + (2 * n_ops + 4) * _U)


def head_lipschitz(B_out: float, B_KQ: float, radius: float, *, c_sm: float = 1.0, B_bKQ: float = 0.0,
                   metric: str = "2,inf", seq_len: int | None = None) -> float:
    r"""Input-Lipschitz bound of one dot-product attention head on rows of norm <= R.

    .. math::

        \|f_h(X) - f_h(X')\|_{2,\infty} \le B_{out}\big(1 + c_{sm} R (2 B_{KQ} R + \|b\|)\big)\,\|X - X'\|_{2,\infty}

    and in Frobenius on length-T sequences
    ``B_out (sqrt(T) + c_sm R (B_KQ R (1 + sqrt T) + sqrt(T) ||b||))``.

    Source: THEORY F6 (first bullet; ``b = 0`` and ``B_out = ||W_V||`` is F6 verbatim), derived in
    Note [F6 derivation].  With R = 1 and c_sm = 2 it is Edelman et al.'s ``||W_V||(1 + 4 B_QK)``.
    Assumptions: every token of both inputs has l2 norm <= ``radius``; c_sm is a valid softmax
    constant (1 is tight, F5).  Dot-product attention is *not* globally Lipschitz (F13, Kim et al.
    2021 Thm 3.1): the bound grows like R^2.

    Args:
        B_out: spectral norm of the head's value-to-output map (``||W_OV^h||`` or ``||W_V^h||``).
        B_KQ: ``||scale W_Q^h W_K^hT||_2``.
        radius: R, the token-norm bound of the domain.
        c_sm: softmax constant, ``||sm(a) - sm(b)||_1 <= c_sm ||a - b||_inf``.
        B_bKQ: ``||scale b_Q^h W_K^hT||_2`` (0 without a query bias).
        metric: ``"2,inf"`` (max over tokens of the l2 norm) or ``"fro"``.
        seq_len: T, required for ``"fro"``.

    Returns:
        The certified constant, rounded up (Note [rounding the attention constants]).

    Raises:
        InputError: for a bad metric, a missing seq_len, a non-positive radius or ``c_sm < 1``.

    Example:
        >>> round(head_lipschitz(1.0, 1.0, 1.0, c_sm=2.0), 12)
        5.0
    """
    if radius <= 0:
        raise InputError(f"radius must be > 0, but got radius={radius}")
    check_c_sm(c_sm)
    rt = _check_metric(metric, seq_len)
    if metric == "2,inf":
        return _round_up(B_out * (1.0 + c_sm * radius * (2.0 * B_KQ * radius + B_bKQ)), 7)
    return _round_up(B_out * (rt + c_sm * radius * (B_KQ * radius * (1.0 + rt) + rt * B_bKQ)), 10)


def attention_lipschitz(B_OV: Sequence[float], B_KQ: Sequence[float], radius: float, *,
                        c_sm: float = 1.0, B_bKQ: Sequence[float] | None = None,
                        B_V: Sequence[float] | None = None, B_O: float | None = None,
                        metric: str = "2,inf", seq_len: int | None = None) -> float:
    r"""Input-Lipschitz bound of multi-head attention with output projection (no residual).

    .. math::

        \mathrm{Lip} \le \min\Big(\sum_h L_h(B_{OV}^h),\;
        \|W_O\|_2 \big(\textstyle\sum_h L_h(B_V^h)^2\big)^{1/2}\Big)

    with ``L_h`` from :func:`head_lipschitz`.  Source: THEORY F6 (third bullet: sum over heads,
    times ``||W_O||``), Note [F6 derivation] for the second form.  A residual adds 1 (done by the
    composition).  Assumptions: as :func:`head_lipschitz`.
    """
    H = len(B_OV)
    bq = list(B_bKQ) if B_bKQ is not None else [0.0] * H
    kw = dict(c_sm=c_sm, metric=metric, seq_len=seq_len)
    # each head's constant is already rounded up; the H - 1 additions (and the squares, the root and
    # the product of the second form) are covered by one more upward step (Note [rounding the
    # attention constants])
    per_head = _round_up(sum(head_lipschitz(B_OV[h], B_KQ[h], radius, B_bKQ=bq[h], **kw) for h in range(H)), H)
    if B_V is None or B_O is None:
        return per_head
    # hypot: the squares of constants above 1e154 overflowed (an OverflowError from weights of size 1e100, stop 38)
    concat = _round_up(B_O * math.hypot(*(head_lipschitz(B_V[h], B_KQ[h], radius, B_bKQ=bq[h], **kw)
                                          for h in range(H))), 2 * H + 2)
    return min(per_head, concat)


def attention_output_radius(B_OV: Sequence[float], radius: float, *, B_V: Sequence[float] | None = None,
                            B_O: float | None = None, B_bout: float = 0.0) -> float:
    r"""Bound on every output token's norm: each head outputs a convex combination of rows times W_OV.

    .. math::

        \|\mathrm{attn}(X)_i\|_2 \le R \min\big(\textstyle\sum_h B_{OV}^h,\; \|W_O\| (\sum_h (B_V^h)^2)^{1/2}\big) + \|b_{out}\|

    Source: THEORY F6 setting (``sum_j P_ij x_j`` is a convex combination of rows of norm <= R);
    used for the radius propagation of ``_compose``.  Assumptions: token norms <= ``radius``.
    """
    gain = sum(B_OV)
    if B_V is not None and B_O is not None:
        gain = min(gain, B_O * math.sqrt(sum(v * v for v in B_V)))
    return radius * gain + B_bout


def attention_perturbation_coefficients(B_OV: Sequence[float], radius: float, *, c_sm: float = 1.0,
                                        has_query_bias: bool = False,
                                        has_output_bias: bool = True) -> list[tuple[str, float, str]]:
    r"""Per-matrix coefficients of the attention block's output change when its weights change.

    .. math::

        \|\mathrm{attn}(X;\theta) - \mathrm{attn}(X;\tilde\theta)\|_{2,\infty} \le \sum_h \Big(
        R\,\|\Delta W_{OV}^h\|_2 + c_{sm} B_{OV}^h R^3 \|\Delta W_{KQ}^h\|_2
        + c_{sm} B_{OV}^h R^2 \|\Delta b_{KQ}^h\|_2\Big) + \|\Delta b_{out}\|_2

    Source: THEORY F6 (second bullet), Note [F6 derivation].  Assumptions: rows of X have norm
    ``<= radius``; ``B_OV^h`` bounds ``||W_OV^h||`` of *both* parameter sets (class bound).

    Returns:
        ``(role, coefficient, norm)`` entries: roles ``W_OV.h``, ``W_KQ.h``, ``b_KQ.h``, ``b_out``.
    """
    check_c_sm(c_sm)
    R = radius
    # R**3 raised OverflowError beyond R ~ 5.6e102 (`lipschitz --radius 1e300`, stop 38): inf there, the same
    # floats below
    R2, R3 = (R**2, R**3) if R < 1e100 else (R * R, R * R * R)
    out: list[tuple[str, float, str]] = []
    for h, b in enumerate(B_OV):
        out.append((f"W_KQ.{h}", c_sm * b * R3, "spectral"))
        if has_query_bias:
            out.append((f"b_KQ.{h}", c_sm * b * R2, "l2"))
        out.append((f"W_OV.{h}", R, "spectral"))
    if has_output_bias:
        out.append(("b_out", 1.0, "l2"))
    return out


def relative_bias_perturbation_coefficients(B_OV: Sequence[float], radius: float, *,
                                            c_sm: float = 1.0) -> list[tuple[str, float, str]]:
    r"""Lemma G.3's terms for an additive, input-independent score bias (T5's relative position bias).

    .. math::

        \|\Delta f_h\|_{2,\infty} \mathrel{+}= c_{sm} B_{OV}^h R \max_{i,j} |\Delta B^h_{ij}|

    Source: THEORY F28 (F6's fixed-input step: ``|s_ij - s~_ij|`` gains ``|dB_ij|``, and the
    softmax moves by at most ``c_sm max_j |ds_ij|`` in l1, F5).  ``max_ij |dB^h_ij|`` is at most the
    largest change of head h's column of the bucket table (every ``B_ij`` is a table entry).
    Assumptions: rows of norm ``<= radius``; ``B_OV^h`` bounds both parameter sets; the same bucketing.

    Returns:
        ``(f"pos_bias.{h}", c_sm B_OV^h R, "linf")`` per head.
    """
    check_c_sm(c_sm)
    return [(f"pos_bias.{h}", c_sm * b * radius, "linf") for h, b in enumerate(B_OV)]
