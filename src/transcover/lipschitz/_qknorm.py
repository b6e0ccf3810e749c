"""Attention with normalised queries and keys (Qwen3, Gemma 3): THEORY F23.

Note [query/key normalisation].  Head h scores query i against key j as
``s_ij = s q_i R_{j-i} k_j^T`` with ``q_i = N_q(x_i W_Q + b_Q)``, ``k_j = N_k(x_j W_K + b_K)``, where
``N`` is an RMSNorm over the head's ``d_head`` coordinates (``gamma * u / sqrt(mean(u^2) + eps)``)
and ``R`` the RoPE rotation (the identity without RoPE; orthogonal, partial or not).  The F6
argument goes through with the score difference bounded by what the normalisation guarantees
instead of by ``||W_Q W_K^T||``:

* *size*: ``||N(u)||_2 = ||gamma * u / rms_eps(u)|| <= max|gamma| ||u|| / sqrt(||u||^2/d_head + eps)
  < max|gamma| sqrt(d_head)`` for every ``u`` (F14's output radius over ``d_head`` coordinates).  So
  ``Q_max = max|gamma_q| sqrt(d_head)`` with the norm, ``||W_Q|| r + ||b_Q||`` without (rows of
  norm <= r); the same for keys.  Every score obeys ``|s_ij| <= s Q_max K_max``.
* *Lipschitz*: ``||q_i - q'_i|| <= L_{N_q} ||W_Q|| ||x_i - x'_i||`` with F14's global RMSNorm constant
  ``L_N = max|gamma| / sqrt(eps)`` (the query projections can come arbitrarily close to 0, so no
  variance floor is assumed); ``L_{N_q} = 1`` without the norm.  Hence, splitting
  ``q_i R k_j^T - q'_i R k'_j^T = (q_i - q'_i) R k_j^T + q'_i R (k_j - k'_j)^T``,

      |s_ij - s'_ij| <= a ||dx_i|| + c ||dx_j||,   a = s L_{N_q} ||W_Q|| K_max,   c = s Q_max L_{N_k} ||W_K||.

F6 bounds the same difference by ``B_KQ r (||dx_i|| + ||dx_j||) + ||b|| ||dx_j||`` and uses it as
``2 B_KQ r + ||b||`` in (2,inf) and ``B_KQ r (1 + sqrt T) + sqrt(T) ||b||`` in Frobenius (a coefficient
of ``||dx_i||`` counted once, of ``||dx_j||`` sqrt(T) times).  Choosing ``B_KQ := a / r`` and
``||b|| := max(c - a, 0)`` makes both F6 forms at least ``a + c`` resp. ``a + sqrt(T) c`` (if
``c >= a`` they are ``a + c`` and ``a + sqrt(T) c``; otherwise ``2a >= a + c`` and
``a (1 + sqrt T) >= a + sqrt(T) c``), so F6's constants with these two numbers are certified for
the normalised head.  With both norms the score Lipschitz part ``a + c`` no longer grows with the
radius: the head's constant grows like ``r`` (through the values), not ``r^2``.

Note [split G.3].  Lemma G.3 at a fixed input (rows of norm <= r) for two parameter sets of the
class (THEORY F22/F23, G.3 paragraphs).  The scores are not a function of ``W_Q W_K^T`` here, so the
pieces are charged one by one.  With ``u = x W_Q + b_Q`` and ``u~`` the same with the other weights,
``||u - u~|| <= r ||dW_Q|| + ||db_Q||``, and

    ||N_g(u) - N_g~(u~)|| <= ||N_g(u) - N_g(u~)|| + ||(g - g~) * u~ / rms_eps(u~)||
                          <= L_N ||u - u~|| + sqrt(d_head) ||dg||_inf

(``||u~ / rms_eps(u~)|| = ||u~|| / sqrt(||u~||^2/d_head + eps) < sqrt(d_head)``; ``L_N = 1`` and no
gamma term without the norm).  Splitting ``q R k^T - q~ R k~^T = (q - q~) R k^T + q~ R (k - k~)^T``
with ``||k|| <= K_max``, ``||q~|| <= Q_max`` (class sizes, :func:`side_bounds`, valid for both sets):

    |s_ij - s~_ij| <= s (K_max ||dq_i|| + Q_max ||dk_j||),

and, as in F6, ``||df_h||_{2,inf} <= r ||dW_OV^h|| + c_sm B_OV^h r max_j |s_ij - s~_ij|``.  Hence per
query head, with ``A_h = c_sm B_OV^h r s``: ``W_Q.h: A_h K_max L_q r``, ``b_Q.h: A_h K_max L_q``,
``W_K.h: A_h Q_max L_k r``, ``b_K.h: A_h Q_max L_k``, ``W_OV.h: r``, and per layer (the scales are
shared by the heads) ``q_norm.gamma: sum_h A_h K_max sqrt(d_head)``, ``k_norm.gamma: sum_h A_h
Q_max sqrt(d_head)``; ``b_out: 1``.  The same formula, with ``L = 1`` and no gamma terms, is G.3 for
RoPE with query/key biases (``R`` orthogonal, the same in both models).

Note [whole-projection q/k norm].  OLMo 2 normalises the whole projection ``u = x W_all + b_all``
(all H heads' ``H d_head`` coordinates, keys over ``H_kv d_head``) and then splits it: head h reads
``q_h = P_h N(u)`` with ``P_h`` a coordinate projection (norm 1).  Both facts above survive with the
whole width: ``||q_h|| <= ||N(u)|| < max|gamma| sqrt(H d_head)``, and ``||q_h - q'_h|| <= L_N ||u - u'||
<= L_N ||W_all|| ||dx||`` with ``||W_all||_2 <= sqrt(sum_h ||W^h||_2^2)`` (``W_all = [W^1 ... W^H]``
column blocks).  So F23's constants hold with ``Q_max = max|gamma_q| sqrt(H d_head)`` and ``||W_Q||``
replaced by that bound (``_weights._joint_qk_bounds``): sqrt(H) times a per-head norm's size, which is
what one RMSNorm across the heads guarantees (a single head may carry all the mass).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._errors import InputError

__all__ = ["side_bounds", "score_difference_terms", "qknorm_effective_kq", "qknorm_layer_kq", "score_magnitude_bound",
           "split_perturbation_coefficients"]


def side_bounds(B_W: float, B_b: float, radius: float, norm_lip: float | None, norm_out: float | None) -> tuple[float, float]:
    """(size bound, Lipschitz constant) of one side ``x -> N(x W + b)`` of the scores on rows of norm
    <= radius: ``(max|gamma| sqrt(d_head), L_N ||W||)`` with the norm (``norm_lip = max|gamma|/sqrt(eps)``,
    ``norm_out = max|gamma| sqrt(d_head)``), ``(||W|| r + ||b||, ||W||)`` without (``None``)."""
    if norm_lip is None:
        return B_W * radius + B_b, B_W
    if not (math.isfinite(norm_lip) and norm_lip >= 0):
        raise InputError("query/key normalisation with eps = 0 is not Lipschitz near 0 (F14): no bound")
    return norm_out, norm_lip * B_W


def score_difference_terms(scale: float, q: tuple[float, float], k: tuple[float, float]) -> tuple[float, float]:
    r"""``(a, c)`` with ``|s_ij - s'_ij| <= a ||dx_i|| + c ||dx_j||`` (Note [query/key normalisation]).

    .. math:: a = s\,L_q K_{max},\qquad c = s\,Q_{max} L_k

    ``q`` and ``k`` are :func:`side_bounds`'s ``(size, Lipschitz)`` pairs.  Source: THEORY F23.
    """
    (q_max, l_q), (k_max, l_k) = q, k
    return scale * l_q * k_max, scale * q_max * l_k


def qknorm_effective_kq(terms: Sequence[tuple[float, float]], radius: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per head ``(B_KQ, B_bKQ)`` that make F6's constants certified for the normalised scores:
    ``B_KQ = a / r``, ``B_bKQ = max(c - a, 0)`` (Note [query/key normalisation])."""
    if radius <= 0:
        raise InputError(f"radius must be > 0, but got radius={radius}")
    return (tuple(a / radius for a, _ in terms), tuple(max(c - a, 0.0) for a, c in terms))


def score_magnitude_bound(scale: float, q_max: float, k_max: float) -> float:
    r"""``|s_ij| <= s Q_max K_max`` (Cauchy-Schwarz, ``||R|| = 1``): with both norms
    ``s max|gamma_q| max|gamma_k| d_head``, whatever the weights and the input.  Source: THEORY F23."""
    return scale * q_max * k_max


def qknorm_layer_kq(L, radius: float) -> tuple[tuple[float, ...], tuple[float, ...]]:  # noqa: ANN001
    """F6's ``(B_KQ, B_bKQ)`` per head for a layer's class bounds (``_weights.LayerNorms``) with
    query/key normalisation, on rows of norm <= ``radius`` (the attention branch's input)."""
    terms = []
    for h in range(len(L.B_OV)):
        q = side_bounds(L.B_Q[h], L.B_bQ[h], radius, L.qn_lip if L.has_q_norm else None, L.qn_out)
        k = side_bounds(L.B_K[h], L.B_bK[h], radius, L.kn_lip if L.has_k_norm else None, L.kn_out)
        terms.append(score_difference_terms(L.softmax_scale, q, k))
    return qknorm_effective_kq(terms, radius)


def split_perturbation_coefficients(L, radius: float, c_sm: float) -> list[tuple[str, float, str]]:  # noqa: ANN001
    r"""Lemma G.3's local coefficients of an attention block whose scores are split (Note [split G.3]).

    .. math::

        \|\Delta\mathrm{attn}\|_{2,\infty} \le \sum_h \Big(r\|\Delta W_{OV}^h\| + A_h\big[K_{max}
        (L_q(r\|\Delta W_Q^h\| + \|\Delta b_Q^h\|) + \sqrt{d_h}\|\Delta\gamma_q\|_\infty)
        + Q_{max}(L_k(r\|\Delta W_K^h\| + \|\Delta b_K^h\|) + \sqrt{d_h}\|\Delta\gamma_k\|_\infty)\big]\Big)
        + \|\Delta b_{out}\|,\qquad A_h = c_{sm} B_{OV}^h\, r\, s

    Source: THEORY F22/F23 (G.3 paragraphs), F6 (second bullet), F14 (RMSNorm).  Assumptions: rows of
    norm <= ``radius``; both parameter sets in the class of ``L`` (``_weights.LayerBounds``: every norm,
    size and Lipschitz constant is a class maximum), with the same softmax scale, RoPE and norm eps.

    Returns:
        ``(role, coefficient, norm)``: ``W_Q.h``, ``W_K.h`` (spectral), ``b_Q.h``, ``b_K.h`` (l2, when a
        model of the class has them), ``W_OV.h``, ``q_norm.gamma``, ``k_norm.gamma`` (linf), ``b_out``.
    """
    r, s = radius, L.softmax_scale
    joint = getattr(L, "qk_joint", False)
    # the normalised width: d_head per head, or the whole projection (OLMo 2; at most H d_head for keys too)
    root = math.sqrt(L.d_head * (len(L.B_OV) if joint else 1))
    out: list[tuple[str, float, str]] = []
    g_q = g_k = 0.0
    if joint:
        return _joint_split(L, r, c_sm, root)
    for h, b_ov in enumerate(L.B_OV):
        q_max = side_bounds(L.B_Q[h], L.B_bQ[h], r, L.qn_lip if L.has_q_norm else None, L.qn_out)[0]
        k_max = side_bounds(L.B_K[h], L.B_bK[h], r, L.kn_lip if L.has_k_norm else None, L.kn_out)[0]
        l_q = L.qn_lip if L.has_q_norm else 1.0  # the norm's slope on the raw projection (F14)
        l_k = L.kn_lip if L.has_k_norm else 1.0
        a = c_sm * b_ov * r * s
        out.append((f"W_Q.{h}", a * k_max * l_q * r, "spectral"))
        if L.has_b_Q:
            out.append((f"b_Q.{h}", a * k_max * l_q, "l2"))
        out.append((f"W_K.{h}", a * q_max * l_k * r, "spectral"))
        if L.has_b_K:
            out.append((f"b_K.{h}", a * q_max * l_k, "l2"))
        out.append((f"W_OV.{h}", r, "spectral"))
        g_q += a * k_max * root
        g_k += a * q_max * root
    if L.has_q_norm:
        out.append(("q_norm.gamma", g_q, "linf"))
    if L.has_k_norm:
        out.append(("k_norm.gamma", g_k, "linf"))
    if L.has_output_bias:
        out.append(("b_out", 1.0, "l2"))
    return out


def _joint_split(L, r: float, c_sm: float, root: float) -> list[tuple[str, float, str]]:  # noqa: ANN001
    """Note [split G.3] with the norms over the whole projection (OLMo 2, Note [whole-projection q/k
    norm]): head h's query is ``P_h N(x W_all + b_all)``, so ``||dq_h|| <= L_q (r ||dW_all|| + ||db_all||)
    + sqrt(H d_head) ||dg||_inf`` with ``||dW_all|| <= sum_h' ||dW_Q^h'||`` (column blocks), the same for
    keys (``sum`` over the query heads' key heads, each counted once per query head that reads it, at
    least ``||dW_K,all||``).  Every head's score therefore depends on every head's W_Q: each ``W_Q.h'``
    carries ``sum_h A_h K_max L_q r``."""
    tot_q = tot_k = 0.0
    out: list[tuple[str, float, str]] = []
    for h, b_ov in enumerate(L.B_OV):
        q_max = side_bounds(L.B_Q[h], L.B_bQ[h], r, L.qn_lip if L.has_q_norm else None, L.qn_out)[0]
        k_max = side_bounds(L.B_K[h], L.B_bK[h], r, L.kn_lip if L.has_k_norm else None, L.kn_out)[0]
        a = c_sm * b_ov * r * L.softmax_scale
        tot_q += a * k_max
        tot_k += a * q_max
        out.append((f"W_OV.{h}", r, "spectral"))
    l_q = L.qn_lip if L.has_q_norm else 1.0
    l_k = L.kn_lip if L.has_k_norm else 1.0
    for h in range(len(L.B_OV)):
        out.append((f"W_Q.{h}", tot_q * l_q * r, "spectral"))
        out.append((f"W_K.{h}", tot_k * l_k * r, "spectral"))
        if L.has_b_Q:
            out.append((f"b_Q.{h}", tot_q * l_q, "l2"))
        if L.has_b_K:
            out.append((f"b_K.{h}", tot_k * l_k, "l2"))
    if L.has_q_norm:
        out.append(("q_norm.gamma", tot_q * root, "linf"))
    if L.has_k_norm:
        out.append(("k_norm.gamma", tot_k * root, "linf"))
    if L.has_output_bias:
        out.append(("b_out", 1.0, "l2"))
    return out
