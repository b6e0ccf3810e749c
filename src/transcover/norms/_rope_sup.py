"""``B_KQ`` under RoPE: ``sup_delta ||s W_Q R_delta W_K^T||_2`` over relative positions (THEORY F22).

Note [RoPE supremum]: with rotary embeddings the matrix inside the softmax of a query at position i
and a key at position j is ``s W_Q R_delta W_K^T`` with ``delta = i - j`` and ``R_delta`` the
block rotation of the head's coordinates (pairs ``(k, k + r/2)`` of the rotated width r turned by
``delta * theta_k``, the other ``d_head - r`` coordinates fixed).  ``norms`` reports the supremum
over every integer ``|delta| <= P - 1`` (P = ``max_position``) as a certified interval:

* *upper end*: the smaller of two certified bounds, each valid for every delta at once:
  (U1) ``s ||W_Q|| ||W_K||`` (every ``R_delta`` is orthogonal); (U2) with ``S`` the unrotated
  coordinates and the *slow* planes (``(P - 1) theta_k <= 1/8``) and ``F`` the others,
  ``W_Q R W_K^T = W_Q,S W_K,S^T + W_Q,S (R_S - I) W_K,S^T + W_Q,F R_F W_K,F^T``, and
  ``||R_S - I|| = max_k 2|sin(delta theta_k / 2)| <= (P - 1) max_{k in S} theta_k``, so
  ``s (||W_Q,S W_K,S^T|| + ||W_Q,S|| ||W_K,S|| (P - 1) max theta_S + ||W_Q,F|| ||W_K,F||)``.
  U2 is the tighter one when the unrotated part (partial rotary, Pythia) or the slow planes
  (Llama 3's scaled low frequencies) carry structure the plain product bound ignores.  With
  dynamic NTK scaling the frequencies depend on the sequence length T; the upper end must hold for
  every ``T <= P`` and is U1 alone (U2 at one T is not a bound for the others).
* *lower end*: a witness at one offset.  Every sampled offset (:func:`rope_offsets`) is *estimated*
  at once on ``d_head x d_head`` cores: with ``G = W^T W = S^2`` (S the symmetric square root),
  ``||W_Q R W_K^T|| = ||S_Q R S_K||`` because ``W = U S`` with U having orthonormal columns, so all
  offsets cost one batched product and one batched SVD of ``d_head``-sized matrices instead of one
  ``d x d_head`` certified product each.  Only the offset with the largest estimate is certified,
  by a witness ``z = W_K S_K^+ v`` (v the core's top right singular vector there), evaluated in
  float64 with its rounding subtracted (:func:`_witness_lower`) and with the rounding of the rotation
  itself subtracted (the rotated matrix is computed, not exact: :func:`_rotation_slack`).

The estimate only *chooses* the offset; the witness and both upper bounds do not trust it.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from .._results import Interval, Kind
from ._floating import U64, down, gamma, up
from ._spectral import product_norm_interval, spectral_norm_interval

__all__ = ["rope_offsets", "rope_inv_freq", "rotate_columns", "rope_kq_interval", "rope_kq_estimate"]

_SLOW = 0.125  # a plane is "slow" when it turns by at most this angle over the whole context


def rope_offsets(max_position: int) -> np.ndarray:
    """Relative positions at which the lower end is sought: every one below 32, then 32 log-spaced."""
    small = list(range(0, min(max_position, 32)))
    big = np.unique(np.geomspace(32, max(max_position - 1, 33), num=32).astype(int)).tolist()
    return np.array(sorted(set(small + [b for b in big if b < max_position])), dtype=np.int64)


def rope_inv_freq(rope, d_head: int, T: int | None = None) -> np.ndarray:
    """The per-plane frequencies ``theta_k`` in float64 (numpy twin of ``RopeSpec.inv_freq``); with
    dynamic scaling those of a sequence of length T (None: unscaled)."""
    rd = rope.rotary_dim or d_head
    if getattr(rope, "dynamic", None) is not None and T is not None:
        return 1.0 / (rope.dynamic_theta(d_head, T) ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    if rope.inv_freq_values is not None:
        if 2 * len(rope.inv_freq_values) != rd:
            raise ValueError(f"RoPE has {len(rope.inv_freq_values)} frequencies for {rd} rotated coordinates")
        return np.array(rope.inv_freq_values, dtype=np.float64)
    return 1.0 / (rope.theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd))


def _cos_sin(inv: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ang = offsets.astype(np.float64)[:, None] * inv[None, :]
    return np.cos(ang), np.sin(ang)


def rotate_columns(W: np.ndarray, inv: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``W R`` for ``W`` (..., n, d_head) and one rotation per leading batch entry of ``cos``/``sin``
    (shape (..., r/2)): the layout of ``apply_rope`` (pairs ``(k, k + r/2)``, the rest unchanged)."""
    half = inv.size
    c, s = cos[..., None, :], sin[..., None, :]
    a, b = W[..., :half], W[..., half:2 * half]
    return np.concatenate([a * c - b * s, b * c + a * s, W[..., 2 * half:]], axis=-1)


def _sym_sqrt(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(S, S^+)``: the PSD square root of a (float64, nearly PSD) Gram matrix and its pseudo-inverse
    (an estimate's factors only: nothing certified rests on them)."""
    lam, V = np.linalg.eigh(G)
    root = np.sqrt(np.clip(lam, 0.0, None))
    inv = np.divide(1.0, root, out=np.zeros_like(root), where=root > root.max(initial=0.0) * 1e-12)
    return (V * root) @ V.T, (V * inv) @ V.T


def _core_estimates(G_Q: np.ndarray, G_K: np.ndarray, inv: np.ndarray,
                    offsets: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """``||W_Q R_delta W_K^T||_2`` estimated at every offset from the ``d_head x d_head`` Grams, the
    index of the largest, and a witness direction there: ``z = W_K w`` with ``w = S_K^+ v`` (v the top
    right singular vector of ``S_Q R S_K``) reaches ``||W_Q R W_K^T z|| = sigma_max ||z||``."""
    (S_Q, _), (S_K, S_K_pinv) = _sym_sqrt(G_Q), _sym_sqrt(G_K)
    cos, sin = _cos_sin(inv, offsets)
    M = rotate_columns(np.broadcast_to(S_Q, (offsets.size,) + S_Q.shape), inv, cos, sin) @ S_K
    sig = np.sqrt(np.clip(np.linalg.eigvalsh(M.transpose(0, 2, 1) @ M)[:, -1], 0.0, None))
    best = int(np.argmax(sig))
    v = np.linalg.svd(M[best])[2][0]
    return sig, best, S_K_pinv @ v


def _witness_lower(A: np.ndarray, Bt: np.ndarray, z: np.ndarray) -> float:
    """A certified lower bound on ``||A Bt z|| / ||z||`` for float64 ``A`` (d, r), ``Bt`` (r, d).

    ``t = fl(Bt z)`` errs by ``<= gamma_d ||Bt||_F ||z||`` and ``fl(A t)`` by ``<= gamma_r ||A||_F ||t||``
    (Higham eq. 3.5 with Cauchy-Schwarz), so ``||A Bt z|| >= ||fl(A t)|| - gamma_r ||A||_F ||t|| -
    ||A||_F gamma_d ||Bt||_F ||z||``.
    """
    z_up = _norm_up(z)
    if z_up == 0.0:
        return 0.0
    t = Bt @ z
    y = A @ t
    A_f, B_f = _fro_upper(A), _fro_upper(Bt)
    slack = up(A_f * gamma(Bt.shape[1]) * B_f * z_up + gamma(A.shape[1]) * A_f * _norm_up(t))
    low = down(math.sqrt(float(y @ y)) * (1 - gamma(y.size + 2)))
    return max(0.0, down((low - slack) / z_up))


def _norm_up(x: np.ndarray) -> float:
    return up(math.sqrt(float(x @ x)) * (1 + gamma(x.size + 2)))


def _rotation_slack(W_fro: float, W_norm: float, inv: np.ndarray, delta: int) -> float:
    """An upper bound on ``||fl(W R~) - W R_delta||_2`` for the computed rotation ``R~``.

    The angle ``fl(delta theta_k)`` is within ``4u |delta theta_k|`` of the exact one (``theta_k``
    itself is trusted to 2 ulps: numpy and torch evaluate ``theta^(-2k/r)`` separately), and
    ``cos``/``sin`` are within 2u of their exact values, so each 2 x 2 block of ``R~ - R_delta`` has
    norm ``<= 2 e``, ``e = 4u |delta| max theta + 2u``.  Each rotated entry is ``a c - b s``: error
    ``<= gamma_2 (|a||c| + |b||s|)``, whose Frobenius norm over a column pair is at most
    ``sqrt(2) (1 + 4u) ||(a, b)||_F`` (Cauchy-Schwarz, ``c^2 + s^2 <= (1 + 4u)^2``).
    """
    e = up(4 * U64 * abs(delta) * float(inv.max(initial=0.0)) * (1 + 4 * U64) + 2 * U64)
    return up(gamma(2) * 1.5 * W_fro + 2 * e * W_norm * (1 + 4 * U64))


def _fro_upper(W: np.ndarray) -> float:
    return up(math.sqrt(float(np.einsum("ij,ij->", W, W)) * (1 + gamma(W.size))))


def _split_upper(Wq: np.ndarray, Wk: np.ndarray, inv: np.ndarray, max_position: int,
                 grams: tuple | None) -> float:
    """Bound U2 of Note [RoPE supremum] (without the scale), or inf when it does not apply."""
    d_head, half = Wq.shape[1], inv.size
    phi = (max_position - 1) * inv * (1 + 4 * U64)  # the largest angle each plane reaches
    slow = phi <= _SLOW
    S = np.concatenate([np.flatnonzero(slow), half + np.flatnonzero(slow), np.arange(2 * half, d_head)])
    F = np.concatenate([np.flatnonzero(~slow), half + np.flatnonzero(~slow)])
    if S.size == 0:
        return math.inf

    def sub(cols: np.ndarray, k: int) -> tuple | None:
        return None if grams is None else (grams[2 * k][np.ix_(cols, cols)], grams[2 * k + 1])

    def norm(W: np.ndarray, cols: np.ndarray, k: int) -> float:
        return spectral_norm_interval(W[:, cols], gram=sub(cols, k)).upper

    both = None if grams is None else sub(S, 0) + sub(S, 1)
    total = product_norm_interval(Wq[:, S], np.ascontiguousarray(Wk[:, S].T), grams=both).upper
    if slow[:half].any():
        total = up(total + up(up(norm(Wq, S, 0) * norm(Wk, S, 1)) * up(float(phi[slow].max()))))
    if F.size:
        total = up(total + up(norm(Wq, F, 0) * norm(Wk, F, 1)))
    return total


def rope_kq_interval(Wq: np.ndarray, Wk: np.ndarray, rope, scale: float, *,
                     grams: tuple[np.ndarray, float, np.ndarray, float] | None = None,
                     norms: tuple[Interval, Interval] | None = None) -> Interval:
    """Certified enclosure of ``B_KQ = sup_{|delta| < P} ||s W_Q R_delta W_K^T||_2`` (THEORY F22).

    Formula and route: Note [RoPE supremum] (upper end ``min(U1, U2)``, lower end a witness at the
    offset whose core estimate is largest, the rotation's own rounding subtracted).
    Assumptions: the weights are exact float64 values in the safe range; the frequencies are the
    spec's (``rope_inv_freq``) to 2 ulps; ``scale >= 0``.

    Args:
        Wq, Wk: one head's ``W_Q^h`` and its key head's ``W_K^g``, float64 (d, d_head).
        rope: the layer's ``RopeSpec``.
        scale: the softmax scale s.
        grams: optionally ``(G_Q, e_Q, G_K, e_K)``, the heads' Grams with their error bounds.
        norms: optionally certified ``(||W_Q||, ||W_K||)`` intervals already measured.
    """
    d_head = Wq.shape[1]
    P = int(rope.max_position)
    # dynamic scaling: the witness uses the frequencies of one valid length, T = P (its offsets
    # |delta| < P all occur in such a sequence); the upper end must hold for the whole family of
    # lengths T <= P, which U1 does (rotation-independent) and U2, taken at one T, does not
    dynamic = getattr(rope, "dynamic", None) is not None
    inv = rope_inv_freq(rope, d_head, P)
    if norms is None:
        norms = (spectral_norm_interval(Wq, gram=None if grams is None else grams[:2]),
                 spectral_norm_interval(Wk, gram=None if grams is None else grams[2:]))
    q_up, k_up = norms[0].upper, norms[1].upper
    if grams is not None and not all(np.isfinite(g).all() for g in (grams[0], grams[2])):
        grams = None  # Grams that overflowed: every bound below forms its own, scaled
    upper = up(q_up * k_up) if dynamic else min(up(q_up * k_up), _split_upper(Wq, Wk, inv, P, grams))
    # Note [scaled witness]: the estimate and the witness run on 2^-e W with max|entry| in [1/2, 1): the Grams and
    # ||y||^2 of weights near 1e77 overflowed (an eigh that did not converge, exit 1, or an inf witness that the
    # final min(lower, upper) turned into a lower end 74 % above the true sup), those of weights near 1e-200
    # underflowed (a lower end of 0); red team 209.  The scaling is exact unless it pushes an entry below 2^-1022,
    # in which case the witness runs on the stored weights, and a witness that is not finite counts as 0.
    eq, ek = _pow2_exponent(Wq), _pow2_exponent(Wk)
    Sq, Sk = np.ldexp(Wq, -eq), np.ldexp(Wk, -ek)
    offsets = rope_offsets(P)
    _, best, w = _core_estimates(Sq.T @ Sq, Sk.T @ Sk, inv, offsets)
    delta = int(offsets[best])
    cos, sin = _cos_sin(inv, np.array([delta]))
    if not (np.array_equal(np.ldexp(Sq, eq), Wq) and np.array_equal(np.ldexp(Sk, ek), Wk)):
        Sq, Sk, eq, ek = Wq, Wk, 0, 0
    sq_up, sk_up = np.ldexp(q_up, -eq), np.ldexp(k_up, -ek)  # exact: the norms' upper ends scale as the weights
    witness = _witness_lower(rotate_columns(Sq, inv, cos[0], sin[0]), np.ascontiguousarray(Sk.T), Sk @ w)
    lower = down(witness - up(_rotation_slack(_fro_upper(Sq), sq_up, inv, delta) * sk_up))
    lower = _ldexp_down(lower, eq + ek) if math.isfinite(lower) and lower > 0.0 else 0.0
    if math.frexp(scale)[0] != 0.5:  # a power of two (measure_model's unscaled 1.0) scales exactly
        lower, upper = down(lower * scale), up(upper * scale)
    else:
        lower, upper = lower * scale, upper * scale
    if lower > upper:  # both ends are certified: one of them is wrong, and the interval is not reported
        raise AssertionError(f"internal error: RoPE B_KQ's witness {lower!r} exceeds its upper bound {upper!r}")
    how = ("dynamic NTK, every length T <= P: upper s||W_Q||||W_K||" if dynamic
           else "upper min(s||W_Q||||W_K||, slow/fast split)")
    return Interval(lower, upper, Kind.CERTIFIED_INTERVAL,
                    f"RoPE: sup over |delta| < {P}; {how}, lower a witness at delta={delta}")


def _pow2_exponent(W: np.ndarray) -> int:
    """``e`` with ``max|W| 2^-e`` in ``[1/2, 1)`` (0 for a zero or non-finite matrix): Note [scaled witness]."""
    top = float(np.abs(W).max(initial=0.0))
    return math.frexp(top)[1] if top > 0.0 and math.isfinite(top) else 0


def _ldexp_down(x: float, e: int) -> float:
    """``x 2^e`` rounded down, ``x >= 0``: exact in the normal range, one step down where it lands subnormal (rounded
    to nearest there), the largest float where it overflows (the true value is larger still)."""
    try:
        v = math.ldexp(x, e)
    except OverflowError:
        return sys.float_info.max
    return math.nextafter(v, 0.0) if 0.0 < v < sys.float_info.min else v


def rope_kq_estimate(Wq: np.ndarray, Wk: np.ndarray, rope, scale: float) -> Interval:
    """``--fast``: the largest core estimate over the sampled offsets, and ``s ||W_Q|| ||W_K||``
    estimated (both ``Kind.ESTIMATE``)."""
    Wq, Wk = np.asarray(Wq, np.float64), np.asarray(Wk, np.float64)
    inv = rope_inv_freq(rope, Wq.shape[1], int(rope.max_position))
    G_Q, G_K = Wq.T @ Wq, Wk.T @ Wk
    low = float(_core_estimates(G_Q, G_K, inv, rope_offsets(int(rope.max_position)))[0].max()) * scale
    high = math.sqrt(max(float(np.linalg.eigvalsh(G_Q)[-1]), 0.0) * max(float(np.linalg.eigvalsh(G_K)[-1]), 0.0))
    return Interval(low, max(low, high * scale), Kind.ESTIMATE, "RoPE: core estimates over sampled offsets")
