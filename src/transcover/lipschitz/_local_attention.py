"""Dot-product attention on a ball around real data: certified local Lipschitz bounds (THEORY F17).

Note [local attention bound].  Column convention, one head, query ``i``: the head's output before
``W_O`` is ``g_i = W_V^T sum_j P_ij x_j`` with scores ``s_ij = scale x~_i^T W~_Q W_K^T x_j``
(``x~ = [x, 1]``: the query bias folded as in Note [attention biases] of ``model._spec``; the
value bias is a constant and drops out of every difference).  Write ``G = scale W_Q W_K^T``
(``d x d``), ``q_i = scale W_K W~_Q^T x~_i`` (the gradient of ``s_ij`` in ``x_j``),
``y_j = x_j - xbar_i`` with ``xbar_i = sum_k P_ik x_k``.  Since ``sum_j P_ij y_j = 0``,
``d g_i = W_V^T [ sum_j P_ij dx_j + Sigma_i G^T dx_i + sum_j P_ij y_j q_i^T dx_j ]`` with
``Sigma_i = sum_j P_ij y_j y_j^T`` (THEORY F17's Jacobian).  For ``||dx_j|| <= 1`` for all j:

    ||d g_i|| <= ||W_V|| + ||sum_j P_ij (W_V^T y_j)(G y_j)^T|| + ||q_i|| sum_j P_ij ||W_V^T y_j||
             <= ||W_V|| + S_V S_G + ||q_i|| S_V,     S_B^2 = sum_j P_ij ||B y_j||^2

(Cauchy-Schwarz for the rank-one sum, Jensen for the last term).  All heads together:
``attn_i = W_O^T concat_h(g_i^h)``, so ``||d attn_i|| <= ||W_O|| (sum_h L_{h,i}^2)^{1/2}``.

On the ball ``X' = X + E`` with ``||e_j|| <= rho``: softmax is invariant under a shift of a row of
scores, so with any fixed ``c`` the weights are ``softmax_j(x~'_i^T M (x'_j - c))``, ``M = scale
W~_Q W_K^T``.  The shifted score moves by ``e_i^T G (x_j - c) + q_i^T e_j + e_i^T G e_j``, at most
``Delta_ij = rho (||G (x_j - c)|| + ||q_i|| + ||G|| rho)`` (``c`` = token mean: the centred
radius).  Then ``P'_ij <= P_ij exp(Delta_ij + max_k Delta_ik) =: P_ij w_ij``.  A weighted
variance is at most the second moment about any point, so with ``c_i = xbar_i`` (fixed):
``S'_B^2 <= sum_j P'_ij ||B (x'_j - xbar_i)||^2 <= sum_j P_ij w_ij (||B y_j|| + ||B|| rho)^2``;
``||q'_i|| <= ||q_i|| + ||G|| rho``.  These bound the Jacobian's (2,inf) norm at every point of
the ball, which is convex, so the mean-value theorem makes them Lipschitz constants on it.  At
``rho = 0`` the formula is the block bound at the point.  Causal masks: ``P_ij = 0`` off the
allowed keys, and the sums run over them only (the argument is unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._errors import InputError
from ..model import to_tensor
from ..model import AttentionSpec, NormKind
from ._rounding import (_TINY_SUB, _U, _gamma, accurate_product, accurate_product_dd, pow2_scale, pow2_steps,
                        product_row_norms, two_sum)
from ._weights import ROUNDING_PAD, spectral, spectral_product

__all__ = ["AttentionLocal", "attention_weights_f64", "attention_local_bound", "attention_query_terms"]

# float64 evaluation of the data-dependent terms (softmax, norms of T x d products): relative
# error a few hundred ulps at most for d <= 1e5; padded by this factor (far above it).
DATA_PAD = 1e-10


def _f64(W) -> Tensor:  # noqa: ANN001
    return to_tensor(W, dtype=torch.float64).detach()


@dataclass(frozen=True)
class AttentionLocal:
    """Local constant of the attention map (no residual) on ``B(X, rho)`` in the (2,inf) metric.

    ``per_query`` is ``||W_O|| (sum_h L_{h,i}^2)^{1/2}`` for each query; ``head_terms`` the
    ``(sum_h L_{h,i}^2)^{1/2}`` before ``||W_O||`` (the layer's Jacobian route multiplies them by
    ``||M_i W_O^T||`` instead); ``linear`` the W_V-linear part ``||W_O|| (sum_h ||W_V^h||^2)^{1/2}``.
    """

    upper: float
    per_query: Tensor
    head_terms: Tensor
    linear: float
    B_O: float
    max_delta: float  # largest score movement bound Delta_i on the ball


def check_local_attention(attn: AttentionSpec, rope: bool = False) -> None:
    """The local bound covers dot-product attention (with or without biases, causal or not); RoPE where the caller
    says it is derived for it (``rope``: ``attention_query_terms``, ``attention_local_bound``, THEORY F107)."""
    if attn.kind != "dot":
        raise InputError("local attention bounds cover dot-product attention only (not L2 attention)")
    if attn.rope is not None and not rope:
        raise InputError("this local route does not cover RoPE (the scores depend on positions); the product route "
                         "of layer_local does (THEORY F107)")
    if attn.softcap is not None:
        raise InputError("local attention bounds do not cover soft-capped scores yet (THEORY F24)")
    if attn.q_norm is not None or attn.k_norm is not None:
        raise InputError("local attention bounds do not cover query/key normalisation yet (THEORY F23)")
    if attn.position_bias is not None:
        raise InputError("local attention bounds do not cover a relative position bias yet (T5; THEORY F28)")
    if attn.window is not None:
        raise InputError(f"local attention bounds do not cover a sliding window (window={attn.window}) yet: their "
                         "weights and Jacobians see every key (or every earlier key when causal)")
    sc = attn.softmax_scale
    if not (math.isfinite(sc) and sc >= 0):
        # the routes multiply score terms by the scale itself: a negative one flipped their signs (stop 35's red team:
        # certified 3.50 where the Jacobian at X reaches 7.50); no model uses one
        raise InputError(f"local attention bounds need a finite softmax scale >= 0, but got scale={sc!r}")


def check_radius(rho: float) -> float:
    """``rho`` as a float, refused (InputError, one line) unless finite and ``>= 0``: the local routes' radius."""
    rho = float(rho)
    if not (rho >= 0 and math.isfinite(rho)):
        raise InputError(f"rho must be a finite number >= 0, but got rho={rho!r}")
    return rho


def check_tokens(X: Tensor, d: int, what: str = "X") -> None:
    """``X`` must be a 2-D (T, d) tensor with T >= 1 and finite entries (InputError, one line)."""
    if not isinstance(X, Tensor) or X.dim() != 2 or X.shape[0] < 1 or X.shape[1] != d:
        shape = tuple(X.shape) if isinstance(X, Tensor) else type(X).__name__
        raise InputError(f"{what} must be a (T, {d}) tensor of tokens with T >= 1, but got shape {shape}")
    if not X.is_floating_point():  # integer X failed deep inside; complex X was cast to its real part (stop 39)
        raise InputError(f"{what} must be a real floating-point tensor, but got dtype {X.dtype}")
    if not bool(torch.isfinite(X).all()):
        raise InputError(f"{what} has NaN or infinite entries")


def check_normal_weights(scores: Tensor, P: Tensor, head: int) -> None:
    """Refuse a head whose softmax gives a visible key (finite score) a weight below the smallest normal
    float64 (a score gap above ~708 under its row's largest).

    Note [underflowed attention weights]: the local ball bounds (F17d, F31a-c, F34, F35) read
    visibility as ``P_ij > 0`` and take every weight with float64's relative accuracy (certified by Note [formed
    attention weights]). A visible key
    whose weight underflows to 0 (or to a subnormal) would be treated as masked, yet a move inside the
    ball can hand it the whole row (the red-team case: certified remainder 0.052, attained 1.0). Rather
    than certify with that convention, such inputs are refused (InputError, one line).  Scores that overflowed
    (NaN or +inf: an input or gain near ``2^512``; only masked keys are -inf) are refused too (Note [local weight
    range]): they gave NaN bounds."""
    if bool((torch.isnan(scores) | (scores == math.inf)).any()):
        raise InputError(f"head {head}: an attention score overflows float64 (NaN or +inf); the local bounds refuse "
                         "this input (Note [local weight range]); rescale the input or the query/key weights")
    bad = torch.isfinite(scores) & (P < torch.finfo(torch.float64).tiny)
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        gap = float(scores[i][torch.isfinite(scores[i])].max() - scores[i, j])
        raise InputError(f"head {head}, query {i}: the softmax weight of visible key {j} underflows float64 (score "
                         f"{gap:.0f} below the row's largest); the local ball bounds assume every visible weight is "
                         "a normal float64 and refuse this input")


# Note [local head data range] (the data's side of Note [local norm range]): the local routes square the heads' data
# terms -- the centred keys ``y_ij``, the values ``v_ij = W_V^T y_ij``, the score gradients ``q_i`` and ``G y_ij`` -- in
# their Grams and weighted sums (``sum_j P_ij ||v_ij||^2``, ``V V^T``, ``(q . q) v v^T``), and the weights' ranges do
# not bound them: tokens at ``2^-505`` with ``W_Q``, ``W_K`` at ``2^505`` (the same scores) and ``W_V`` at ``2^-395``
# (``W_O`` at ``2^395``: the same map) put the values near ``2^-900``, whose squares flushed to 0 while their products
# with ``q_i`` (near ``2^505``) are of the map's order: ``attention_local_bound`` certified 4.55 against an attained
# (2,inf) norm of 5.78, and tokens at ``2^-100`` with ``W_Q``, ``W_K`` at ``2^100``, ``W_V`` at ``2^-390`` made
# ``layer_local`` and ``stack_local`` certify 0.97 of the attained.  Each head is refused (InputError, one line) unless
# the largest entries of ``y``, ``v``, ``q`` and ``G y`` are at most ``2^400`` and that of ``v`` is 0 or at least
# ``2^-400``: every square of a value is then above ``2^-800`` and every square of a gradient below ``2^800``, so a
# product of a value and a gradient is formed from normal floats, and a small ``y``, ``q`` or ``G y`` only meets
# factors below ``2^400`` (what it loses to underflow stays below ``2^-137`` of the map's ``||W_V||``, inside the pads).
def check_head_scales(attn: AttentionSpec, h: int, Y: Tensor, q: Tensor) -> None:
    """Refuse head ``h`` whose data terms leave Note [local head data range] (InputError, one line): ``Y`` (T, T, d) the
    centred keys per query, ``q`` (T, d) the score gradients (with the query bias)."""
    Wq, Wk, Wv, _ = (_f64(W) for W in attn.head(h))
    Y, q = Y.detach(), q.detach()  # a check only: callers may differentiate through the data
    terms = (("y_ij", Y, False), ("W_V^T y_ij", Y @ Wv, True), ("q_i", q, False),
             ("G y_ij", attn.softmax_scale * (Y @ Wk) @ Wq.T, False))
    for name, A, both in terms:
        m = float(A.abs().max()) if A.numel() else 0.0
        if not (_in_local_range(m) if both else m <= 2.0**_LOCAL_RANGE):
            rng = f"0 or in [2^-{_LOCAL_RANGE}, 2^{_LOCAL_RANGE}]" if both else f"at most 2^{_LOCAL_RANGE}"
            raise InputError(f"head {h}: the local bounds need the largest entry of {name} {rng} (their squares are "
                             f"float64, Note [local head data range]), but it is {m:.3g}; rescale the input or the "
                             "query/key/value weights")


# Note [formed attention weights] (THEORY F99): the local routes take the weights ``P`` at X with float64's relative
# accuracy.  Scores formed as ``fl(fl(x~ W~_Q) fl(x W_K)^T)`` are off by up to ``gamma_K sc |x~||W~_Q||W_K|^T|x|``
# (Higham), which is relative to the magnitudes, not to the scores: where queries and keys cancel, ``P`` moved by
# far more than the routes' pads (1.4e-10 relative on MiniLM's worst case; order one under adversarial weights).  The
# scores are therefore formed to about twice the working precision (``accurate_product``) and shifted by each row's
# largest before they are rounded, so each ``D_ij`` is within ``E_ij`` (about ``u |D_ij|``) of the exact shifted score,
# and ``P_ij`` (the softmax of the exact scores) within ``expm1(E_ij + sum_k P_ik expm1(E_ik))`` relative of the
# softmax of ``D``.  A head whose bound exceeds ``WEIGHT_REL`` relative, or ``2 (T + 8) u`` absolute (half the
# envelopes' pad for the softmax's own rounding, ``softmax_envelope``), is refused in one line.
WEIGHT_REL = 2.0**-42


def certified_weights(attn: AttentionSpec, X: Tensor, h: int, rope: bool = False) -> Tensor:
    """``P`` (T, T) of head ``h`` at ``X`` (T, d), float64: the softmax of the scores shifted by each row's largest (``D``,
    ``-inf`` on masked keys), certified within Note [formed attention weights] of the exact weights, else refused
    (InputError, one line); also refused where a visible weight underflows (Note [underflowed attention weights]) or a
    score difference overflows.  Dot attention; with RoPE (``rope``, THEORY F107) the query and key (with both biases)
    are rotated to about twice the working precision (``_local_rope.rotate_dd``) before their product."""
    check_local_attention(attn, rope)
    X = X.detach().to(torch.float64)  # exact for float32/bf16 data; the bounds below are float64's
    T = X.shape[0]
    Xa = torch.cat([X, torch.ones(T, 1, dtype=X.dtype)], dim=1)
    Qh, Ql, Qe, eQ = accurate_product(Xa, _f64(attn.W_Q_augmented(h)))
    if attn.rope is None:
        Kh, Kl, Ke, eK = accurate_product(X, _f64(attn.head(h)[1]))
    else:  # the key bias no longer cancels: [X, 1] [W_K; b_K], then both sides rotated (Note [local RoPE attention])
        from ._local_rope import rope_inv_freq, rotate_dd

        Wk = _f64(attn.head(h)[1])
        bk = torch.zeros(1, Wk.shape[1], dtype=torch.float64) if attn.b_K is None else \
            _f64(attn.b_K)[attn.kv_index(h)][None]
        Kh, Kl, Ke, eK = accurate_product(Xa, torch.cat([Wk, bk], dim=0))
        inv = rope_inv_freq(attn, T)
        Qh, Ql, Qe = rotate_dd(Qh, Ql, Qe, inv)
        Kh, Kl, Ke = rotate_dd(Kh, Kl, Ke, inv)
    Sh, Sl, Se, eS = accurate_product_dd((Qh, Ql, Qe), (Kh.T, Kl.T, Ke.T))
    vis = torch.ones(T, T, dtype=torch.bool)
    if attn.causal:
        vis = vis.tril()
    top = torch.where(vis, Sh, -math.inf).argmax(dim=1, keepdim=True)
    mh, ml, me = Sh.gather(1, top), Sl.gather(1, top), Se.gather(1, top)
    a, b = two_sum(Sh, -mh)  # exact
    t = (b + Sl) - ml
    D = a + t
    g2 = _gamma(2)
    errD = (Se + me + g2 * (1 + 2 * g2) * (b.abs() + Sl.abs() + ml.abs()) + _U * D.abs()) * (1 + 4 * _U)
    sc = attn.softmax_scale
    e = eQ + eK + eS
    D = sc * pow2_scale(D, e)
    # below the normal range each scaling step of D and errD rounds by 2^-1075, and the products by sc once each
    E = (abs(sc) * pow2_scale(errD, e) + _U * D.abs()) * (1 + 4 * _U) \
        + max(4, pow2_steps(e) + 2) * _TINY_SUB * max(1.0, abs(sc))
    D = torch.where(vis, D, -math.inf)
    if not bool(torch.isfinite(D[vis]).all() & torch.isfinite(E[vis]).all()):
        raise InputError(f"head {h}: an attention score difference overflows float64; the local bounds refuse this "
                         "input (Note [local weight range]); rescale the input or the query/key weights")
    P = torch.softmax(D, dim=-1)
    check_normal_weights(D, P, h)  # Note [underflowed attention weights]
    E = torch.where(vis, E, torch.zeros_like(E))
    m1 = (P * torch.expm1(E)).sum(dim=1, keepdim=True) * (1 + 1e-10)
    rel = torch.expm1(E + m1) * (1 + 1e-10)
    bad = vis & ((rel > WEIGHT_REL) | (P * rel > 2 * (T + 8) * _U))
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise InputError(f"head {h}, query {i}: the attention scores cancel, or lie too far below their terms' "
                         f"range, for float64 (certified error "
                         f"{float(E[i, j]):.3g} on key {j}, moving its weight by up to {float(rel[i, j]):.3g} relative); "
                         "the local bounds take the weights with float64's accuracy (THEORY F99) and refuse this input")
    return P


def attention_weights_f64(attn: AttentionSpec, X: Tensor, rope: bool = False) -> list[Tensor]:
    """The softmax matrices ``P^h`` (T, T) of every head at X, float64 (refused where a visible weight
    underflows: Note [underflowed attention weights]; or where the heads' data terms leave Note [local head data
    range]); the weights certified by Note [formed attention weights])."""
    out = []  # certified_weights checks the attention kind (check_local_attention) for every head
    T = X.shape[0]
    Xa = torch.cat([X, torch.ones(T, 1, dtype=X.dtype)], dim=1)
    for h in range(attn.n_heads):
        P = certified_weights(attn, X, h, rope)  # Note [formed attention weights]
        _, Wk, _, _ = (_f64(W) for W in attn.head(h))
        q = attn.softmax_scale * (Xa @ _f64(attn.W_Q_augmented(h))) @ Wk.T
        check_head_scales(attn, h, X[None, :, :] - (P @ X)[:, None, :], q)
        out.append(P)
    return out


def _moved_weights(P: Tensor, w: Tensor, causal: bool) -> Tensor:
    """``P_ij w_ij``, the bound on a moved weight ``P'_ij`` (module docstring), with masked (causal) entries exactly
    0: their ``P = 0`` met ``w = exp(max Delta) = inf`` at a large radius as ``0 * inf = NaN``, which came back from
    ``layer_local`` as a refusal of the user's rho (red team 37e).  A visible weight is a normal float
    (``check_normal_weights``), so elsewhere ``w = inf`` gives inf."""
    out = P * w
    if causal:
        T = P.shape[-1]
        out = out.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), 0.0)
    return out


def _weighted_root(Pw: Tensor, sq: Tensor) -> Tensor:
    """``(sum_j Pw_ij sq_ij)^{1/2}`` per query; a zero ``sq`` adds 0 whatever its weight (no ``inf * 0``)."""
    return torch.sqrt(torch.where(sq > 0, Pw * sq, torch.zeros_like(sq)).sum(dim=1))


def attention_query_terms(attn: AttentionSpec, X: Tensor, rho: float, *,
                          norms: dict | None = None, want_sum: bool = False):
    """``(sum_h L_{h,i}^2)^{1/2}`` per query on ``B(X, rho)`` (Note [local attention bound]) and max Delta.

    ``norms`` caches the certified per-head matrix norms of the spec (they do not depend on X).
    With ``want_sum`` also the heads-summed form ``sum_h (||W_OV^h|| + S_OV (S_G + ||q_i|| + ||G|| rho))``
    (the triangle inequality over heads, with ``W_O`` inside each head), a third return value.
    With RoPE the score gradients are per pair (THEORY F107, Note [local RoPE attention] in ``_local_rope``):
    ``||q_i||`` becomes ``Q_i = (sum_j P_ij w_ij (||p_ij|| + G rho)^2)^{1/2}`` (capped by ``max_j``), ``G y_j`` becomes
    ``r_ij - m_i`` and ``Delta_ij = rho (||r_ij - m_i|| + ||p_ij|| + G rho)``, ``G = sc ||W_Q|| ||W_K||``.
    """
    check_local_attention(attn, rope=True)
    X = X.detach().double()
    T, d = X.shape
    c = X.mean(dim=0, keepdim=True)
    Xa = torch.cat([X, torch.ones(T, 1, dtype=torch.float64)], dim=1)
    norms = head_norms(attn) if norms is None else norms
    total = torch.zeros(T, dtype=torch.float64)
    summed = torch.zeros(T, dtype=torch.float64)
    max_delta = 0.0
    Ps = attention_weights_f64(attn, X, rope=True)
    for h in range(attn.n_heads):
        Wq, Wk, Wv, _ = (_f64(W) for W in attn.head(h))
        Wqa = _f64(attn.W_Q_augmented(h))
        sc = attn.softmax_scale
        nV, nG = norms["V"][h], norms["G"][h]
        P = Ps[h]
        xbar = P @ X  # (T, d)
        Y = X[None, :, :] - xbar[:, None, :]  # (T_i, T_j, d)
        # the score gradients: per query (no RoPE) or per pair (RoPE, THEORY F107); each branch gives Delta_ij, the
        # key-side term's rows (``||G y_j||`` or ``||r_ij - m_i||``) and the query-side term as a function of the
        # moved weights; the rest of Note [local attention bound] is shared
        if attn.rope is not None:
            from ._local_rope import rope_pair_terms

            pn, rn = rope_pair_terms(attn, X, h, P)  # (T, T): ||p_ij||, ||r_ij - m_i|| (THEORY F107)
            # Note [local head data range] for the per-pair gradients: check_head_scales sees the unrotated q and G y
            # without the key bias, which no longer cancels (a huge b_K gave inf, not the refusal; red team 186)
            big = float(torch.maximum(pn, rn).max()) if pn.numel() else 0.0
            if not big <= 2.0**_LOCAL_RANGE:
                raise InputError(f"head {h}: the local bounds need the norms of the score gradients p_ij, r_ij - m_i "
                                 f"at most 2^{_LOCAL_RANGE} (Note [local head data range]), but one is {big:.3g}; "
                                 "rescale the input or the query/key weights and biases")
            delta = rho * (rn + pn + nG * rho)
            g_rows = rn
            vis = torch.ones(T, T, dtype=torch.bool)
            vis = vis.tril() if attn.causal else vis
            qmax = torch.where(vis, pn, torch.zeros_like(pn)).amax(dim=1) + nG * rho

            def plus_q(SG: Tensor, Pw: Tensor, pn=pn, qmax=qmax) -> Tensor:  # noqa: ANN001
                return SG + torch.minimum(_weighted_root(Pw, (pn + nG * rho) ** 2), qmax)
        else:
            # every norm of a formed product below is certified with its rounding (``product_row_norms``, THEORY F97)
            qn = sc * product_row_norms(Xa, Wqa, Wk.T)  # ||q_i||, q_i = sc W_K W_Q^T x_i (row form)
            # ||G (x_j - c)|| with G = sc W_Q W_K^T: (x_j - c)^T G^T = sc (x_j - c) W_K W_Q^T (row form)
            Gc = sc * product_row_norms(X - c, Wk, Wq.T)
            delta = rho * (Gc[None, :] + qn[:, None] + nG * rho)  # Delta_ij (T, T)
            g_rows = sc * product_row_norms(Y, Wk, Wq.T)  # ||G y_j||

            def plus_q(SG: Tensor, Pw: Tensor, qn=qn) -> Tensor:  # noqa: ANN001, ARG001
                return SG + qn + nG * rho
        if attn.causal:
            delta = delta.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), 0.0)
        dmax = delta.max(dim=1).values
        w = torch.exp(delta + dmax[:, None])
        max_delta = max(max_delta, float(dmax.max()))
        Vy = product_row_norms(Y, Wv)  # ||W_V^T y_j|| for each query i
        Pw = _moved_weights(P, w, attn.causal)
        SV = _weighted_root(Pw, (Vy + nV * rho) ** 2)
        SG = _weighted_root(Pw, (g_rows + nG * rho) ** 2)
        L = nV + SV * plus_q(SG, Pw)
        total = total + L * L
        if want_sum:  # the same three terms with W_OV^h = W_V^h W_O^h in place of W_V^h, heads summed
            nOV = norms["OV"][h]
            OVy = product_row_norms(Y, Wv, _f64(attn.W_O[h]))
            SOV = _weighted_root(Pw, (OVy + nOV * rho) ** 2)
            summed = summed + nOV + SOV * plus_q(SG, Pw)
    concat = torch.sqrt(total) * (1.0 + DATA_PAD)
    if want_sum:
        return concat, max_delta, summed * (1.0 + DATA_PAD)
    return concat, max_delta


# Note [local norm range]: the local routes evaluate their data terms as float64 squares (``total += L_h^2`` with
# ``L_h >= ||W_V^h||``, ``(sum_h ||W_V^h||^2)^{1/2}``, the Gram of ``M_i W_O^T``), so a value-side norm below ``2^-537``
# squares to 0 and the attention constant came out 0 (``W_V x 2^-540``, ``W_O x 2^540``: the same map as at scale 1,
# certified 0 against 13.4), and one above ``2^512`` overflows (a raw LinAlgError from eigh).  ``head_norms`` refuses
# ``||W_V^h||``, ``||W_V^h W_O^h||`` or ``||W_O||`` outside ``[2^-400, 2^400]`` (zero is a zero map and allowed): squares
# stay above ``2^-800``, so the flushed parts of the data terms (each below ``2^-1074``) are far inside ``DATA_PAD``.
# The certified matrix norms themselves are right at any finite scale (Note [scaling] in ``norms._spectral``).
_LOCAL_RANGE = 400


def _in_local_range(x: float) -> bool:
    """A norm Note [local norm range] admits: zero (a zero map) or within ``[2^-400, 2^400]``."""
    return x == 0.0 or 2.0**-_LOCAL_RANGE <= x <= 2.0**_LOCAL_RANGE


def _check_local_range(name: str, x: float) -> None:
    if not _in_local_range(x):
        raise InputError(f"local attention bounds need ||W_V^h||, ||W_V^h W_O^h|| and ||W_O|| in [2^-{_LOCAL_RANGE}, "
                         f"2^{_LOCAL_RANGE}] (their data terms are float64 squares, Note [local norm range]), but {name} "
                         f"is {x:.3g}; rescale the weights (W_V c with W_O / c is the same map)")


# Note [local weight range] (mend30; extends Note [local norm range] to the layer): the layer routes (``layer_local``,
# ``stack_local``'s layer stages) form products of a layer's factors ``||W_1||``, ``||W_2||``, ``max|gamma|`` of its two
# norms and ``||W_O||`` (``F``, ``M = D2 (I + F) D1``, ``M W_O^T``) and take float64 Gram eigenvalues or squared norms
# of them: ``W_1 x 2^600`` with ``W_2 x 2^-600`` (the same map) raised a raw ValueError (an overflowed column norm) or
# LinAlgError, ``W_1 x 2^-600`` with ``W_2 x 2^600`` returned a NaN stack bound, and both gains of a post-LN layer at
# ``2^-600`` were certified 2.4e-194 against an attained 7.6e-180 (flushed squares: a false bound).  A layer is refused
# unless ``||W_1||`` and ``||W_2||`` lie in ``[2^-400, 2^400]`` and the sum of ``|log2 f|`` over its nonzero factors is at
# most ``_LOCAL_RANGE``: every product of factors then lies in ``[2^-400, 2^400]`` and its squares stay normal, the
# argument of Note [local norm range].  Data-side overflow (scores, a token's spread) is refused where it is formed
# (``check_normal_weights``, ``centre_tokens``).


def layer_factors(layer, known: dict | None = None) -> list[tuple[str, float]]:  # noqa: ANN001
    """The data-free factors Note [local weight range] budgets: ``||W_1||``, ``||W_2||`` (certified upper ends),
    ``max|gamma|`` of the layer's LayerNorm/RMSNorm gains and ``||W_O||``; ``known`` may hold certified ``"W1"``,
    ``"W2"``, ``"O"`` the caller already has (not formed again)."""
    known = known or {}
    out = [("||W_1||", known["W1"] if "W1" in known else spectral(layer.ffn.W_1)),
           ("||W_2||", known["W2"] if "W2" in known else spectral(layer.ffn.W_2))]
    for name, n in (("norm_attn", layer.norm_attn), ("norm_ffn", layer.norm_ffn)):
        if n is not None and n.weight is not None and n.kind in (NormKind.LAYERNORM, NormKind.RMSNORM):
            out.append((f"max|gamma| of {name}", n.gamma_max_abs))
    out.append(("||W_O||", known["O"] if "O" in known else
                spectral(_f64(layer.attention.W_O).reshape(-1, layer.attention.d_model))))
    return out


def check_layer_range(layer, known: dict | None = None) -> None:  # noqa: ANN001
    """Refuse a layer outside Note [local weight range] (InputError, one line); zero factors are zero maps, allowed.
    ``known``: as ``layer_factors``."""
    facs = layer_factors(layer, known)
    for name, x in facs[:2]:
        if not _in_local_range(x):
            raise InputError(f"local bounds need ||W_1||, ||W_2|| in [2^-{_LOCAL_RANGE}, 2^{_LOCAL_RANGE}] (Note [local "
                             f"weight range]), but {name} of layer {layer.index} is {x:.3g}; rescale the weights")
    budget = sum(abs(math.log2(x)) for _, x in facs if x != 0.0)
    if not budget <= _LOCAL_RANGE:
        raise InputError(f"local bounds need the sum of |log2| of layer {layer.index}'s ||W_1||, ||W_2||, gains and "
                         f"||W_O|| at most {_LOCAL_RANGE} (their products' squares are float64, Note [local weight "
                         f"range]), but it is {budget:.0f}: " + ", ".join(f"{n} {x:.3g}" for n, x in facs))


_TINY = torch.finfo(torch.float64).tiny


def _padded(x: float) -> float:
    """``x (1 + ROUNDING_PAD)``, at least twice the smallest normal float64 for ``x > 0``: below it a product
    is rounded to nearest in absolute terms, which the relative pad does not cover."""
    return max(x * (1.0 + ROUNDING_PAD), 2.0 * _TINY) if x > 0.0 else x


def head_norms(attn: AttentionSpec) -> dict:
    """Certified ||W_V^h||, ||scale W_Q^h W_K^hT|| and ||W_O|| (``transcover.norms``, rounding included; a
    positive one at least 2^-1021, Note [scaling] in norms._spectral); refused outside Note [local norm range]."""
    V, G, OV = [], [], []
    for h in range(attn.n_heads):
        Wq, Wk, Wv, Wo = attn.head(h)
        V.append(_padded(spectral(Wv)))
        OV.append(_padded(spectral_product(Wv, Wo)))
        if attn.rope is None:
            G.append(_padded(attn.softmax_scale * spectral_product(Wq, _f64(Wk).T)))
        else:  # RoPE: sup over offsets of ||sc W_Q R W_K^T|| <= sc ||W_Q|| ||W_K|| (THEORY F22 U1, F107)
            G.append(_padded(attn.softmax_scale * spectral(Wq) * spectral(Wk)))
    W_O = _f64(attn.W_O).reshape(-1, attn.d_model)
    out = {"V": V, "G": G, "OV": OV, "O": _padded(spectral(W_O))}
    for key, name in (("V", "||W_V^h||"), ("OV", "||W_V^h W_O^h||")):
        for h, x in enumerate(out[key]):
            _check_local_range(f"{name} of head {h}", x)
    _check_local_range("||W_O||", out["O"])
    return out


def attention_local_bound(attn: AttentionSpec, X: Tensor, rho: float, *, norms: dict | None = None) -> AttentionLocal:
    r"""Certified Lipschitz constant of multi-head attention (no residual) on the ball ``B(X, rho)``.

    .. math::

        \mathrm{Lip}_{B(X,\rho)} \le \max_i \min\Big(\|W_O\|_2 \Big(\sum_h L_{h,i}^2\Big)^{1/2},
        \sum_h L^{OV}_{h,i}\Big),\quad
        L_{h,i} = \|W_V^h\| + S_V (S_G + \|q_i\| + \|G\|\rho)

    Source: THEORY F17 (exact Jacobian), Note [local attention bound]; F5's softmax constant 1 is
    implicit in the exact Jacobian.  Metric (2,inf).  Assumptions: every token of the input lies
    within ``rho`` (l2) of the corresponding token of ``X``; dot-product attention, with RoPE by THEORY F107's per-pair
    gradients (Note [local RoPE attention] in ``_local_rope``).  Refused (InputError)
    where a head's data terms leave float64's range for their squares (Note [local head data range]).
    """
    rho = check_radius(rho)
    norms = head_norms(attn) if norms is None else norms
    check_tokens(X, attn.d_model)  # attention_query_terms checks the attention kind
    terms, dmax, summed = attention_query_terms(attn, X, rho, norms=norms, want_sum=True)
    per_query = torch.minimum(norms["O"] * terms, summed) * (1.0 + ROUNDING_PAD)
    linear = norms["O"] * math.sqrt(sum(v * v for v in norms["V"]))
    return AttentionLocal(float(per_query.max()), per_query, terms, linear, norms["O"], dmax)


def mixed_head_terms(attn: AttentionSpec, X: Tensor, rho: float, MO: Tensor, drift: float, norms: dict,
                     eMO: Tensor | None = None) -> Tensor:
    r"""Per-query ``sum_h (||M_i W_OV^hT|| + S^M_h (S_G + ||q_i|| + ||G|| rho))``: the heads-summed
    attention terms seen through a per-token matrix ``M_i`` (the layer's norms and FFN), on the ball.

    ``MO`` is ``M_i W_O^T`` at the data point, (T, d, H d_head); on the ball ``M_i`` moves by at most
    ``drift`` in spectral norm, so ``||M'_i C y|| <= ||M_i C y|| + drift ||C y||`` for every vector (the caller
    includes the formed ``M``'s distance from the exact one).  ``eMO`` (T, H): bounds on the formed product's rounding
    ``||fl(M_i W_O^hT) - M_i W_O^hT||_F`` (THEORY F97), carried as ``eMO ||W_V^hT y||`` and ``eMO ||W_V^h||``.
    ``||M_i W_O^hT W_V^hT||`` comes from the Gram eigenvalues ``lambda_max(L^T A^T A L)``,
    ``W_V^hT W_V^h = L L^T`` (Cholesky), padded like ``_local._sym_top``.  Source: Note [local
    attention bound] (heads-summed form) and Note [layer Jacobian route] in ``_local``.
    """
    check_local_attention(attn)  # not derived for RoPE (the Jacobian route)
    X = X.detach().double()
    T, d = X.shape
    Xa = torch.cat([X, torch.ones(T, 1, dtype=torch.float64)], dim=1)
    c = X.mean(dim=0, keepdim=True)
    dh = attn.d_head
    out = torch.zeros(T, dtype=torch.float64)
    Ps = attention_weights_f64(attn, X)
    for h in range(attn.n_heads):
        Wq, Wk, Wv, Wo = (_f64(W) for W in attn.head(h))
        Wqa = _f64(attn.W_Q_augmented(h))
        sc = attn.softmax_scale
        nG, nOV = norms["G"][h], norms["OV"][h]
        P = Ps[h]
        A = MO[:, :, h * dh:(h + 1) * dh]  # (T, d, dh): M_i W_O^hT
        gram_v = Wv.T @ Wv + 1e-300 * torch.eye(dh, dtype=torch.float64)
        try:
            Lc = torch.linalg.cholesky(gram_v)
        except RuntimeError:  # a singular W_V: fall back to the product of norms
            Lc = None
        if Lc is None:
            nMOV = _sym_top_small(A) * norms["V"][h]
        else:
            K = Lc.T @ (A.transpose(1, 2) @ A) @ Lc
            fro2 = (A * A).sum(dim=(1, 2)) * float((Wv * Wv).sum())
            nMOV = torch.sqrt(torch.linalg.eigvalsh(K)[:, -1].clamp(min=0.0) + 1e-9 * fro2)
        qn = sc * product_row_norms(Xa, Wqa, Wk.T)  # formed products with their rounding (THEORY F97)
        Gc = sc * product_row_norms(X - c, Wk, Wq.T)
        delta = rho * (Gc[None, :] + qn[:, None] + nG * rho)
        if attn.causal:
            delta = delta.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), 0.0)
        w = torch.exp(delta + delta.max(dim=1).values[:, None])
        Y = X[None, :, :] - (P @ X)[:, None, :]
        Vy = Y @ Wv  # (T_i, T_j, dh)
        # the einsum's rounding with Vy's: gamma_{d + dh} |A_i| |W_V|^T |y_ij| (Higham 3.5 twice; THEORY F97)
        absMOV = torch.einsum("ide,ije->ijd", A.abs(), Y.abs() @ Wv.abs())
        eMOV = _gamma(Wv.shape[0] + Wv.shape[1]) * absMOV.norm(dim=-1)
        MOVy = (torch.einsum("ide,ije->ijd", A, Vy).norm(dim=-1) + eMOV * (1 + 1e-12)) * (1 + 1e-12)
        OVy = product_row_norms(Y, Wv, Wo)
        Gy = sc * product_row_norms(Y, Wk, Wq.T)
        n_here = nMOV + drift * nOV
        if eMO is not None:  # the formed M_i W_O^hT's rounding, times ||W_V^hT y|| and ||W_V^h|| (THEORY F97)
            MOVy = (MOVy + eMO[:, h, None] * product_row_norms(Y, Wv)) * (1 + 1e-12)
            n_here = (n_here + eMO[:, h] * norms["V"][h]) * (1 + 1e-12)
        Pw = _moved_weights(P, w, attn.causal)
        S = _weighted_root(Pw, (MOVy + drift * OVy + n_here * rho) ** 2)
        SG = _weighted_root(Pw, (Gy + nG * rho) ** 2)
        out = out + n_here + S * (SG + qn + nG * rho)
    return out * (1.0 + DATA_PAD)


def _sym_top_small(A: Tensor) -> Tensor:
    G = A.transpose(1, 2) @ A
    return torch.sqrt(torch.linalg.eigvalsh(G)[:, -1].clamp(min=0.0) + 1e-9 * (A * A).sum(dim=(1, 2)))
