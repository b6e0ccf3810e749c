"""The exact-Jacobian local route without the T^2 d^2 blocks (issue 12; THEORY F17, F17b-F17d).

Note [weighted row Gram].  Row ``i`` of a layer Jacobian is the operator ``v -> sum_j J_ij v_j``;
its (2,inf) norm is ``nu_i(J) = sup_{||v_j|| <= 1} ||sum_j J_ij v_j||``.  For any weights
``w_j > 0``, ``sum_j J_ij v_j = sum_j (J_ij / sqrt(w_j)) (sqrt(w_j) v_j)`` and
``||(sqrt(w_j) v_j)_j||^2 <= sum_j w_j``, so

    nu_i(J)^2 <= lambda_max(sum_j J_ij J_ij^T / w_j) * sum_j w_j,

which with ``w_j = ||J_ij||`` is at most ``(sum_j ||J_ij||)^2`` (the block-sum bound) and with
better weights smaller.  ``J_ij = M_i B_ij`` with a per-token ``M_i`` (norms and FFN), so the Gram
is ``M_i S_i M_i^T``, ``S_i = sum_j B_ij B_ij^T / w_j``; ``S_i`` is assembled in the head space
(``H d_head`` wide) from rank-one pieces, never from the blocks:
``B_ij = delta_ij I + W_O^T Z_ij N_j``, head block ``Z^h_ij = P_ij W_V^T (I + y_ij q_i^T)`` for
``j != i`` (``N_j = I`` post-LN, ``D1_j`` pre-LN, then ``N_j N_j^T <= ||N_j||^2 I``), so block
``(h, h')`` of ``sum_{j != i} Z_ij Z_ij^T / w_j`` is
``sum_j c_j P^h P^h' [V_h^T V_h' + (V_h^T q^h') v^h'^T + v^h (V_h'^T q^h)^T + (q^h . q^h') v^h v^h'^T]``
(``v^h = V_h^T y^h_ij``, ``c_j = ||N_j||^2 / w_j``); the diagonal block ``B_ii`` (with the
``Sigma_i G^T`` term) is formed exactly.  Each stage's row constant at X is the same bound with the
token-wise maps applied so far (post-LN: ``S``, ``D1 S D1^T``, ``(I+F) D1 S D1^T (I+F)^T``, and
``D2 (.) D2^T``); every Gram gets its float64 rounding added (``_sandwich``).

Note [stage radii].  On ``B(X, r)`` the stage outputs move per token by at most ``r`` times the sup
of that stage's row constant over the ball (mean-value theorem on the convex ball), and that sup is
the row constant at X plus the drift of the stage's Jacobian: so each radius is ``r nu_i + O(r^2)``,
a first-order term from the exact linear map at X and a certified second-order remainder, never a
product of stage norms.  The LayerNorm floors are per token with those radii.

Note [FFN drift by the Hadamard Gram].  ``F(h) = W_2^T diag(sigma'(W_1^T h + b)) W_1^T``; for
``||h' - h|| <= rh`` and unit ``u, v``: ``u^T (F' - F) v = sum_k sigma''(xi_k) (w1_k . dh)(w2_k . u)
(w1_k . v)`` (one mean value per unit), and by Cauchy-Schwarz
``|.| <= s2 (sum_k (w1_k . dh)^2)^{1/2} (sum_k (w2_k . u)^2 (w1_k . v)^2)^{1/2}
       <= s2 ||W_1|| rh  lambda_max(K)^{1/2}``,
``s2 = sup|sigma''|``, ``K_kl = (w2_k . w2_l)(w1_k . w1_l)`` (the Gram of the ``w2_k (x) w1_k``, so
``sum_k ((w2_k (x) w1_k) . (u (x) v))^2 <= lambda_max(K)``).  A single ``dh`` cannot move every unit
by ``||w1_k|| rh`` at once; this bound uses that (the per-unit one does not).
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import Tensor

from ..model import Activation, LayerSpec, Placement
from ._local_jacobian import (
    LayerJacobian, _f64, _floor, _weight_norms, certified_lmax, certified_lmax_vec, certified_spectral, pow2_norm,
    root_sum_squares,
)
from ._local_drift import attention_drift_hessian
from ._local_ffn2 import (
    ffn_curvature_drift, ffn_hadamard, ffn_second_norms, ffn_second_split, ffn_split_constants, ffn_taylor_drift, gelu_ffn,
)
from ._local_sharp import (
    GELU_SLOPE_RANGE, ball_box, chi_bound, ffn_unit_drift, unit_slope_moves, visible_diameter,
)
from ._weights import ROUNDING_PAD

__all__ = ["layer_rows", "ffn_drift_constant", "row_weights"]

_U = 2.0**-53
# F31e: sub-balls per radius for the stage radii (the right Riemann sum of the stage sups); cost x RIEMANN_STEPS
RIEMANN_STEPS = 2

# Note [local data range] (extends Note [local weight range] in ``_local_attention`` by the data's norm Jacobians): a
# post-LN row is the Gram ``M_i S_i M_i^T`` with ``M_i = D2_i (I + F_i) D1_i``, formed as float64 products through
# ``D1_i``, ``I + F_i`` and ``D2_i`` in turn, and ``||D_i|| <= max|gamma|/s_i`` carries the data's spread: a token spread
# of ``2^200`` (``W_Q``, ``W_K`` at ``2^-200``: the same scores) with both gains at ``2^-190`` put ``M_i`` near ``2^-580``
# and its Grams below ``2^-1074``: they flushed to 0, and the rows route certified the point 0 and the ball 1.1e-175
# against an attained 7.9e-174 (``layer_local`` and ``stack_local`` took it).  The route refuses (InputError; its
# callers fall back to the product and sub-stage routes) a post-LN layer unless, for every token, each partial product
# ``D1_i``, ``(I + F_i) D1_i`` and ``M_i`` has its scale in ``[2^-_DATA_RANGE, 2^_DATA_RANGE]``, the scales taken from
# the bounds ``nD1``, ``nD2`` and ``||I + F|| in [1, 1 + ||W_1|| ||W_2||]`` (both ends): the Grams then stay above
# ``2^-1000`` and their pads (``GRAM_PAD`` of the trace) far above what flushes (below ``2^-1074`` per product).  Pre-LN
# rows carry the residual's identity (``M_i = I + F_i D2_i``, ``B_ii = I + ...``): a flushed part is far inside the pads
# of a Gram of order one or more.
_DATA_RANGE = 500


def check_data_range(at, norms: dict) -> None:  # noqa: ANN001
    """Refuse a post-LN layer whose row products leave float64's range at this data (Note [local data range];
    InputError, one line); ``at`` the layer at X (``_local_stages.layer_at_x``), ``norms`` its ``_weight_norms``."""
    from .._errors import InputError

    if not at.post:
        return
    lg = lambda v: torch.where((v > 0) & torch.isfinite(v), v.log2(), torch.zeros_like(v))  # noqa: E731
    f = math.log2(1 + norms["W1"] * norms["W2"])
    e1, e3 = lg(at.nD1), lg(at.nD1) + lg(at.nD2)
    worst = torch.stack([e1.abs(), (e1 + f).abs(), e3.abs(), (e3 + f).abs()]).amax(dim=0)
    if not float(worst.max()) <= _DATA_RANGE:
        i = int(worst.argmax())
        raise InputError(f"the exact-Jacobian rows route needs layer {at.layer.index}'s token-local products D1, "
                         f"(I + F) D1 and D2 (I + F) D1 within 2^+-{_DATA_RANGE} (their Grams are float64, Note [local "
                         f"data range]), but token {i} has ||D1|| <= {float(at.nD1[i]):.3g}, ||D2|| <= "
                         f"{float(at.nD2[i]):.3g}; rescale the input or the norms' gains")


def ffn_drift_constant(ffn, *, centred: bool = False, shared: dict | None = None) -> float:  # noqa: ANN001
    r"""Certified ``kappa`` with ``||F(h') - F(h)||_2 <= kappa ||h' - h||`` for every pair (Note [FFN drift
    by the Hadamard Gram]): the smaller of the two pairings of Cauchy-Schwarz,

    .. math:: \kappa = \sup|\sigma''| \min\Big(\|W_1\|\,\lambda_{\max}\big((W_2W_2^\top)\odot(W_1^\top W_1)\big)^{1/2},\
              \|W_2\|\,\lambda_{\max}\big((W_1^\top W_1)\odot(W_1^\top W_1)\big)^{1/2}\Big)

    ``centred``: the bound on ``||P (F(h') - F(h))||`` with ``P = I - 11^T/d`` (``w2_k`` replaced by
    ``P w2_k``), what a following LayerNorm sees.  ``kappa`` has degree 2 in ``W_1`` and 1 in ``W_2``, so it is
    computed on the weights scaled by powers of two to a largest entry in [1/2, 1) (exact) and scaled back, rounded
    up: the Grams' rounding pads are relative to their mass and would not cover underflow at tiny weights.
    ``shared``: a dict kept across the calls for one FFN (``drift_kappa``): the factors that do not depend on ``W_2``
    (``||W_1||``, the Hadamard square's certified ``lambda_max``) are computed by the first call and read by the others,
    the same floats.
    Source: THEORY F17c.  Assumptions: non-gated FFN, ``sup|sigma''|`` finite (inf for ReLU)."""
    from ._local import second_derivative_sup

    s2 = second_derivative_sup(ffn.activation)
    if not math.isfinite(s2):
        return math.inf
    if s2 == 0.0:
        return 0.0
    (W1, e1), (W2, e2) = _pow2_unit(_f64(ffn.W_1)), _pow2_unit(_f64(ffn.W_2))
    return _scale_up(_kappa_unit(W1, W2, centred, s2, {} if shared is None else shared), 2 * e1 + e2)


def drift_kappa(ffn, norms: dict, centred: bool) -> float:  # noqa: ANN001
    """F17c's ``kappa`` of ``ffn`` kept in ``norms`` (a layer's weight-constant cache): ``norms["kappaP"]``, the
    centred constant (``P (F(h') - F(h))``), when ``centred``, else ``norms["kappa"]``; each computed on its first use
    (``ffn_drift_constant``), the ``W_1`` factors the two share once (``norms["kappa_w1"]``)."""
    key = "kappaP" if centred else "kappa"
    if key not in norms:
        norms[key] = ffn_drift_constant(ffn, centred=centred, shared=norms.setdefault("kappa_w1", {}))
    return norms[key]


def _pow2_unit(W: Tensor) -> tuple[Tensor, int]:
    """``(W 2^-e, e)`` with the largest ``|entry|`` of ``W 2^-e`` in [1/2, 1) (``e = 0`` for a zero or non-finite
    ``W``): exact, a power of two."""
    m = float(W.abs().max()) if W.numel() else 0.0
    if m == 0.0 or not math.isfinite(m):
        return W, 0
    e = math.frexp(m)[1]
    return torch.ldexp(W, torch.tensor(-e, dtype=torch.int64)) if e else W, e


def _scale_up(x: float, e: int) -> float:
    """An upper bound on ``x 2^e``: exact unless it leaves the normal range, then rounded up (inf on overflow)."""
    try:
        y = math.ldexp(x, e) if x > 0.0 else x
    except OverflowError:
        return math.inf
    return math.nextafter(y, math.inf) if 0.0 < x and y < 2.2250738585072014e-308 else y


def _kappa_unit(W1: Tensor, W2: Tensor, centred: bool, s2: float, shared: dict) -> float:
    """``ffn_drift_constant`` on weights of unit scale (F17c); ``shared`` holds the ``W_1`` factors (filled here)."""
    if centred:
        W2 = W2 - W2.mean(dim=1, keepdim=True)  # rows P w2_k (the rounding is inside the pads below)
    G1, G2 = W1.T @ W1, W2 @ W2.T

    def lam(K: Tensor, pad_mass: float) -> float:
        # each Gram entry within (d + 2) u of its sums of |terms|; the Hadamard product and the
        # centring add a few u more: 4 (d + 8) u of the Frobenius mass of the factors' squares
        return float(certified_lmax(K[None])[0]) + 4 * (W1.shape[0] + 8) * _U * pad_mass

    if not shared:
        f1 = float((W1 * W1).sum())
        shared.update(f1=f1, n1=float(certified_spectral(W1[None])[0]), l11=lam(G1 * G1, f1 * f1))
    f1, f2 = shared["f1"], float((W2 * W2).sum())
    a = shared["n1"] * math.sqrt(lam(G2 * G1, f1 * f2))
    b = float(certified_spectral(W2[None])[0]) * (1 + 8 * W2.shape[1] * _U) * math.sqrt(shared["l11"])
    return s2 * min(a, b) * (1 + ROUNDING_PAD)


def row_weights(heads, T: int, nO: float, nN: Tensor | None = None) -> Tensor:  # noqa: ANN001
    """(T, T) positive weights ``w_ij`` for Note [weighted row Gram]: a cheap proxy of ``||B_ij||`` (any
    positive weights give a valid bound; these make it close to the block sum).  The off-diagonal
    proxies are worst-case spectral norms through every head; the bound is tightest with ``w_j`` near
    ``||J_ij^T u||`` at the top direction ``u``, which a head's ``d_h``-dimensional value map meets at about
    ``(d_h/d)^{1/2}`` of its norm, so they are scaled by that against the diagonal block (residual included)
    (THEORY F34c)."""
    w = torch.zeros(T, T, dtype=torch.float64)
    for hd in heads:
        P, Y, q, _, _, Wv, _ = hd
        vn = hd.values.norm(dim=-1)
        w = w + P * (float(torch.linalg.matrix_norm(Wv, 2)) + vn * q.norm(dim=-1)[:, None])
    eye = torch.eye(T, dtype=torch.float64)
    w = nO * w * (eye + math.sqrt(heads[0][5].shape[1] / heads[0][5].shape[0]) * (1 - eye))
    if nN is not None:
        w = w * nN[None, :]
    w = w + eye
    return w.clamp(min=1e-12 * float(w.max()))


def _head_gram(heads, c: Tensor) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """(T, H dh, H dh) ``sum_j c_ij Z_ij Z_ij^T`` with the diagonal ``j = i`` excluded by ``c`` (Note
    [weighted row Gram]) and (T,) a bound on the float64 rounding of each (spectral norm).  The values and score
    gradients are balanced by a power of two first (``_balanced``: the same Gram, no flushed ``v v^T``), and the
    Frobenius norms formed at powers of two (``pow2_norm``: ``torch``'s norm of entries below ``2^-537`` is 0)."""
    H = len(heads)
    T = c.shape[0]
    dh = heads[0][5].shape[1]
    P = torch.stack([hd[0] for hd in heads])  # (H, T, T)
    V = torch.stack([hd.values for hd in heads])  # (H, T, T, dh): v^h_ij
    Q = torch.stack([hd[2] for hd in heads])  # (H, T, d)
    Wv = torch.stack([hd[5] for hd in heads])  # (H, d, dh)
    V, Q = _balanced(V, Q)
    VV = torch.einsum("hda,kdb->hkab", Wv, Wv)
    a = torch.einsum("hda,kid->hkia", Wv, Q)  # V_h^T q^k_i
    qq = torch.einsum("hid,kid->hki", Q, Q)
    cPP = c[None, None] * P[:, None] * P[None, :]  # (H, H, T, T)
    coef = cPP.sum(-1)  # (H, H, T)
    U = torch.einsum("hkij,kija->hkia", cPP, V)  # sum_j c P^h P^k v^k_ij
    Wt = (P[..., None] * V).permute(1, 2, 0, 3).reshape(T, T, H * dh)  # [i, j]: concat_h P^h_ij v^h_ij
    VVt = (Wt.transpose(1, 2) * c[:, None, :]) @ Wt  # (T, H dh, H dh)
    VVt = VVt.reshape(T, H, dh, H, dh)
    S = coef.permute(2, 0, 1)[:, :, None, :, None] * VV.permute(0, 2, 1, 3)[None]
    S = S + torch.einsum("hkia,hkib->ihakb", a, U)
    S = S + torch.einsum("khib,khia->ihakb", a, U)
    S = S + qq.permute(2, 0, 1)[:, :, None, :, None] * VVt
    S = S.reshape(T, H * dh, H * dh)
    # rounding: each entry a sum of <= 4 (T + d) products; the Frobenius mass of |terms| is at most
    # sum_j c_j (sum_h P^h (||V_h||_F + ||v^h|| ||q^h||))^2
    mass = torch.zeros(T, T, dtype=torch.float64)
    for h in range(H):
        mass = mass + P[h] * (float(pow2_norm(Wv[h])) + pow2_norm(V[h], -1) * pow2_norm(Q[h], -1)[:, None])
    err = 8 * (T + Wv.shape[1] + 4) * _U * (c * mass * mass).sum(dim=1)
    # THEORY F97: v^h_ij and q^h_i are formed products, within ev, eq of the exact ones, so each exact Z_ij is within
    # dZ_ij = sum_h P^h_ij (ev ||q|| + (||v|| + ev) eq) of the formed one (spectral), and the exact Gram within
    # sum_j c_ij (2 ||Z_ij|| dZ_ij + dZ_ij^2) of the formed one, ||Z_ij|| <= mass_ij (the products ev ||q|| are
    # unchanged by ``_balanced``)
    dZ = torch.zeros(T, T, dtype=torch.float64)
    for h, hd in enumerate(heads):
        ev, qn, vn = hd.value_err, pow2_norm(hd[2], -1) * (1 + 1e-12), pow2_norm(hd.values, -1) * (1 + 1e-12)
        dZ = dZ + P[h] * (ev * qn[:, None] + (vn + ev) * hd.q_err[:, None])
    dZ = dZ * (1 + 1e-12)
    err = (err + (c * (2 * mass * dZ + dZ * dZ)).sum(dim=1)) * (1 + 1e-12)
    return S, err


def _balanced(V: Tensor, Q: Tensor, gap: int = 200) -> tuple[Tensor, Tensor]:
    """``(V s, Q / s)`` with ``s = 2^k`` per head and query (``V`` (H, T, T, dh) the values ``v^h_ij``, ``Q`` (H, T, d) the
    score gradients ``q^h_i``): the head Gram's terms are products ``v q^T`` and ``(q . q) v v^T``, unchanged by it
    (exactly, a power of two).  ``k`` halves the gap between the exponents of ``max_j |v^h_ij|`` and ``|q^h_i|`` where
    it exceeds ``gap``, else 0 (the same floats): values near ``2^-400`` with gradients near ``2^300`` (tokens at
    ``2^-300``, ``W_Q``, ``W_K`` at ``2^300``, ``W_V`` at ``2^-100``) had ``v v^T`` flushed to 0 where ``(q . q) v v^T``
    is of the Gram's order, and the rows came out 0.97 of the attained."""
    mv, mq = V.abs().amax(dim=(2, 3)), Q.abs().amax(dim=2)  # (H, T)
    ok = (mv > 0) & (mq > 0) & torch.isfinite(mv) & torch.isfinite(mq)
    diff = torch.frexp(mq).exponent - torch.frexp(mv).exponent
    k = torch.where(ok & (diff.abs() > gap), torch.div(diff, 2, rounding_mode="floor"), 0).to(V.dtype)
    if not bool((k != 0).any()):
        return V, Q
    return torch.ldexp(V, k[:, :, None, None]), torch.ldexp(Q, -k[:, :, None])


def _diag_blocks(heads, Wo_all: Tensor, N: Tensor | None, T: int, d: int, scale: float,  # noqa: ANN001
                 eN: Tensor | None = None, nN2: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(T, d, d) the exact diagonal blocks ``B_ii = I + W_O^T Z_ii N_i`` (with ``Sigma_i G^T``) and
    (T,) a bound on their float64 rounding (spectral norm); ``eN`` bounds the formed ``N`` against the
    true one (F17f), ``nN2`` (optional) the formed ``N``'s spectral norm (THEORY F98: the error carried through ``N``
    by it rather than by ``||N||_F``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    Zs = []
    idx = torch.arange(T)
    dZ = torch.zeros(T, dtype=torch.float64)  # the formed products' distance from the exact Z_ii (THEORY F97)
    up = 1 + 1e-12
    for hd in heads:
        P, Y, q, Wq, Wk, Wv, Wo = hd
        v = hd.values  # (T, T, dh)
        pii = P[idx, idx]
        vii = v[idx, idx]  # (T, dh)
        Z = pii[:, None, None] * (Wv.T[None] + vii[:, :, None] * q[:, None, :])  # (T, dh, d)
        g = scale * (Y @ Wk) @ Wq.T  # (T, T, d): rows (G y_ik)^T
        Z = Z + torch.einsum("ik,ika,ikd->iad", P, v, g)
        Zs.append(Z)
        # exact v, q, g within ev, q_err, eg of the formed ones: ||v q^T - v~ q~^T|| <= ev ||q~|| + (||v~|| + ev) eq
        ev, eg = hd.value_err, hd.score_err
        vn, gn, qn = pow2_norm(v, -1) * up, pow2_norm(g, -1) * up, pow2_norm(q, -1) * up
        dZ = dZ + pii * (ev[idx, idx] * qn + (vn[idx, idx] + ev[idx, idx]) * hd.q_err)
        dZ = dZ + (P * (ev * gn + (vn + ev) * eg)).sum(dim=1)
    Z = torch.cat(Zs, dim=1)  # (T, H dh, d)
    B = Wo_all.T[None] @ Z
    nZ = pow2_norm(Z, (1, 2))  # Frobenius norms at powers of two (``pow2_norm``: no square flushes)
    # every entry of Z a sum of <= T + 2 products, of W_O^T Z of H dh more (Higham 3.5), N likewise; and W_O^T times
    # the formed products' distance dZ (Frobenius, so at least the spectral)
    err = (4 * (T + d + Wo_all.shape[0] + 4) * _U * float(pow2_norm(Wo_all)) * nZ
           + float(pow2_norm(Wo_all)) * dZ * up) * up
    if N is not None:
        nB, nN = pow2_norm(B, (1, 2)), pow2_norm(N, (1, 2))
        nS = nN if nN2 is None else torch.minimum(nN, nN2)
        err = err * nS + 4 * (d + 2) * _U * nB * nN + (nB + err) * eN
        B = B @ N
    return B + torch.eye(d, dtype=torch.float64)[None], err


def _sandwich(A: Tensor, S: Tensor, err: Tensor, eA: Tensor, nA2: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
    """``A S A^T`` per token and its rounding bound: ``A`` is known to within ``eA`` (spectral),
    ``S`` to within ``err`` (spectral): ``(||A|| + eA)^2 err + (2 ||A|| + eA) eA ||S||`` with ``||A||`` the smaller of
    ``||A||_F`` and ``nA2`` (a certified upper bound on the formed ``A``'s spectral norm, THEORY F98: the Frobenius
    norm squared inflated ``err`` about ``d``-fold at every stage); the float64 product adds ``gamma_{2d} ||A||_F^2
    ||S||_F`` (the Frobenius norms at powers of two, ``pow2_norm``: a Gram of entries ``2^-700`` had the norm 0 and
    lost this term)."""
    out = A @ S @ A.transpose(1, 2)
    nA = pow2_norm(A, (1, 2))
    nS = pow2_norm(S, (1, 2))
    nP = nA if nA2 is None else torch.minimum(nA, torch.as_tensor(nA2, dtype=nA.dtype))
    new = (nP + eA) ** 2 * err + (2 * nP + eA) * eA * nS + 4 * (A.shape[1] + 2) * _U * nA * nA * nS
    return out, new


def _centre(S: Tensor) -> Tensor:
    """``P S P`` with ``P = I - 11^T/d`` (exact up to rounding far below the pads of ``_sandwich``)."""
    S = S - S.mean(dim=1, keepdim=True)
    return S - S.mean(dim=2, keepdim=True)


def _nu(S: Tensor, err: Tensor, wsum: Tensor, start: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Certified ``sqrt((lambda_max(S) + err) sum_j w_j)`` per token, and the candidate top
    eigenvectors of ``S`` (warm starts for the next stage's Gram, F32)."""
    lam, x = certified_lmax_vec(S, start=start)
    return torch.sqrt((lam + err) * wsum) * (1 + 1e-12), x


def _lmax_gram(K: Tensor, wts: Tensor) -> Tensor:
    """(T,) certified ``lambda_max(sum_j wts_ij r_ij r_ij^T)`` for rows ``r_ij`` (``wts >= 0``) from their
    stored Grams ``K[i, j, k] = r_ij . r_ik``: the same top eigenvalue as the T x T Gram of the weighted
    rows (backward-stable eigvalsh, padded by ``1e-9`` of the trace, ``_top_padded``)."""
    sw = torch.sqrt(wts)
    return _top_padded(K * sw[:, :, None] * sw[:, None, :])


def _top_padded(K: Tensor) -> Tensor:
    """(T,) padded top eigenvalue of each PSD Gram; a Gram with a non-finite entry (weights or norms
    overflowed at a large radius) gets the certified ``inf`` instead of reaching eigvalsh, which
    cannot take it."""
    out = torch.full(K.shape[:1], math.inf, dtype=K.dtype)
    ok = torch.isfinite(K).all(dim=2).all(dim=1)
    if bool(ok.any()):
        Kf = K[ok]
        tr = Kf.diagonal(dim1=1, dim2=2).sum(-1)
        top = (torch.linalg.eigvalsh(Kf)[:, -1].clamp(min=0.0) + 1e-9 * tr) * (1 + 1e-9)
        out[ok] = torch.where(torch.isfinite(top), top, torch.full_like(top, math.inf))
    return out


class _HeadMoments:
    """Radius-free per-head, per-query Grams and norms the attention drift uses (Note [attention drift rows]),
    and per query the diameters of the visible keys' values and score gradients (F31)."""

    def __init__(self, heads, scale: float) -> None:  # noqa: ANN001
        self.rows = []
        for hd in heads:
            P, Y, q, Wq, Wk, Wv, _ = hd
            V = hd.values
            Gy = scale * (Y @ Wk) @ Wq.T
            # THEORY F97: the rows v_ij = W_V^T y_ij, G y_ij and q_i are formed products; ``HeadData``'s
            # ``value_err``, ``score_err`` (T, T) and ``q_err`` bound their distance from the exact rows.  Norms,
            # diameters and weighted Grams carry them.
            ev, eg = hd.value_err, hd.score_err
            KY, KV, KG = (R @ R.transpose(1, 2) for R in (Y, V, Gy))
            # differences of the rows of Y[0], V[0], Gy[0] are x_j - x_k, W_V^T (x_j - x_k), G (x_j - x_k):
            # the same for every query, so one pairwise table serves all rows
            vis = P > 0
            up = 1 + 1e-12
            self.rows.append({"P": P, "yn": pow2_norm(Y, -1), "qn": (pow2_norm(q, -1) * up + hd.q_err) * up,
                              "vn": (pow2_norm(V, -1) * up + ev) * up, "gn": (pow2_norm(Gy, -1) * up + eg) * up,
                              "KY": KY, "KV": KV, "KG": KG, "ev": ev, "eg": eg,
                              "lV": moment_lmax(KV, P, ev), "lG": moment_lmax(KG, P, eg), "lY": _lmax_gram(KY, P),
                              "dY": visible_diameter(Y[0], vis), "dV": (visible_diameter(V[0], vis) + 2 * ev[0].max()) * up,
                              "dG": (visible_diameter(Gy[0], vis) + 2 * eg[0].max()) * up})


def moment_lmax(K: Tensor, wts: Tensor, err: Tensor) -> Tensor:
    """(T,) certified ``lambda_max(sum_j wts_ij r_ij r_ij^T)`` for exact rows ``r_ij`` within ``err_ij`` of the formed
    rows whose Grams are ``K`` (THEORY F97): ``||diag(sqrt(w)) R||_2`` moves by at most ``||diag(sqrt(w)) E||_2 <=
    (sum_j w_j err_j^2)^{1/2}`` (Minkowski), so the root of ``_lmax_gram``'s value plus that."""
    return (torch.sqrt(_lmax_gram(K, wts)) + torch.sqrt((wts * err * err).sum(dim=1)) * (1 + 1e-12)) ** 2 * (1 + 1e-12)


def attention_drift_rows(mom: _HeadMoments, r: float, norms: dict) -> Tensor:
    """(H, T) certified ``nu_i(Z'^h - Z^h)`` over ``B(X, r)``: per entry the smaller of THEORY F17d
    (``attention_drift_f17d``) and F35 (``attention_drift_hessian``, the second derivative's ball sups)."""
    return torch.minimum(attention_drift_f17d(mom, r, norms), attention_drift_hessian(mom, r, norms))


def attention_drift_f17d(mom: _HeadMoments, r: float, norms: dict) -> Tensor:
    r"""(H, T): per head and query, a certified bound on ``nu_i(Z'^h - Z^h)`` over ``B(X, r)``, ``Z^h_ij
    = W_V^T Q^h_ij`` the head's Jacobian blocks before ``W_O`` (Note [attention drift rows]).

    Source: THEORY F17d, with F31a's envelope (``|P'_j - P_j| <= min(P_j eps_j, a_j)``) and F31c's
    per-key move of ``y_j``: ``y'_j - y_j = (e_j - sum_k P'_k e_k) - sum_k (P'_k - P_k) y_k``, so
    ``||dy_j|| <= 2 r (1 - lo_j) + m2`` with ``m2`` the mean's softmax part.  Assumptions: every token
    within ``r`` of X; dot attention without RoPE."""
    out = []
    for h, m in enumerate(mom.rows):
        P, nG, nV = m["P"], norms["G"][h], norms["V"][h]
        delta, osc, env, lo, tv = ball_box(m, r, nG)
        mbar = (P * delta).sum(dim=1)
        lse = torch.log((P * torch.exp(delta)).sum(dim=1))
        eps = torch.maximum(torch.expm1(delta + mbar[:, None]), delta + lse[:, None]) * (1 + 1e-10)
        a = torch.minimum(P * eps, env)
        sa = a.sum(dim=1)
        # the mean's softmax part: sum_j dP_j y_j = (1/Z) sum_j P_j (e^{delta_j} - 1) y_j (sum_j P_j y_j = 0),
        # 1/Z <= e^{mbar} (Jensen), Cauchy-Schwarz with sum_j P_j = 1; or |dP_j| <= a_j; or TV times the diameter
        et = torch.expm1(delta) * (1 + 1e-10)
        m2 = torch.exp(mbar) * torch.minimum((P * et * m["yn"]).sum(dim=1), torch.sqrt(_lmax_gram(m["KY"], P * et * et)))
        m2 = torch.minimum(torch.minimum(m2, (a * m["yn"]).sum(dim=1)), tv * m["dY"])
        m2 = torch.minimum(m2, chi_bound(m, r, nG, delta) * torch.sqrt(m["lY"]))
        dy = (2 * r * (1 - lo) * (1 + 1e-12) + m2[:, None]) * (1 + 1e-12)  # (T, T): ||y'_ij - y_ij||
        dyP = torch.sqrt((P * dy * dy).sum(dim=1))
        dya = torch.sqrt((a * dy * dy).sum(dim=1))
        qp = m["qn"] + nG * r
        t1 = nV * sa
        t2 = (a * (m["vn"] + nV * dy)).sum(dim=1) * qp + nV * (P * dy).sum(dim=1) * qp + (P * m["vn"]).sum(dim=1) * nG * r
        t3 = ((torch.sqrt(moment_lmax(m["KV"], a, m["ev"])) + nV * dya) * (torch.sqrt(moment_lmax(m["KG"], a, m["eg"]))
                                                                            + nG * dya)
              + nV * dyP * (torch.sqrt(m["lG"]) + nG * dyP) + torch.sqrt(m["lV"]) * nG * dyP)
        # an overflowed term times a zero weight is nan; the bound there is the certified inf
        out.append(torch.nan_to_num((t1 + t2 + t3) * (1 + 1e-10), nan=math.inf, posinf=math.inf))
    return torch.stack(out)


def _head_output_norms(M: Tensor | None, eM: Tensor | None, heads, T: int) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """(H, T) certified ``||M_i W_O^hT||`` and (T,) ``||M_i W_O^T||`` (``M = I`` when None); ``M`` is
    known to within ``eM`` (spectral), the product adds ``gamma_d ||M||_F ||W_O^h||_F``.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    Wo_all = torch.cat([hd[6] for hd in heads], dim=0)
    dh = heads[0][6].shape[0]
    if M is None:  # the same for every token: certify once
        eye = torch.eye(Wo_all.shape[1], dtype=torch.float64)[None]
        per, full = _head_output_norms(eye, torch.zeros(1, dtype=torch.float64), heads, 1)
        return per.expand(len(heads), T), full.expand(T)
    MO = M @ Wo_all.T[None]
    nM = pow2_norm(M, (1, 2))
    err = lambda W: 4 * (M.shape[1] + 2) * _U * nM * float(pow2_norm(W)) + eM * float(pow2_norm(W))  # noqa: E731
    per = torch.stack([certified_spectral(MO[:, :, h * dh:(h + 1) * dh]) + err(Wo_all[h * dh:(h + 1) * dh])
                       for h in range(len(heads))])
    return per * (1 + 1e-12), (certified_spectral(MO) + err(Wo_all)) * (1 + 1e-12)


def _spectral_err(A: Tensor, eA: Tensor | float = 0.0) -> Tensor:
    """Certified ``||A_t||_2`` per token for a matrix known to within ``eA``."""
    return certified_spectral(A) + eA


def _heads_combined(per_head: Tensor, concat: Tensor, dZ: Tensor, joint: Tensor | None = None) -> Tensor:
    """``nu_i(M W_O^T concat_h dZ^h) <= min(sum_h ||M W_O^hT|| dZ_h, ||M W_O^T|| (sum_h dZ_h^2)^{1/2})``, and
    ``joint`` (T,) when given: ``||M_i|| heads_joint(C, dZ)`` (THEORY F35d).  The root of the squares at a power of two
    where ``dZ`` is outside ``[2^-400, 2^400]`` (``root_sum_squares``: at ``2^-600`` it flushed to 0, and the bound
    with it)."""
    out = torch.minimum((per_head * dZ).sum(dim=0), concat * root_sum_squares(dZ, 0))
    return out if joint is None else torch.minimum(out, joint)


def _ln_drift(norm, sigma: Tensor | None, r: Tensor, d: int):  # noqa: ANN001, ANN202
    """(``e``, ``s_floor``): ``||Delta((P - u u^T)/s)|| <= e = 2 r/(sqrt(d) s_f^2)`` per token on balls of
    radii ``r`` (Note [Jacobian drift], norm), ``gamma`` left out; no norm: (0, inf)."""
    if sigma is None:
        return torch.zeros_like(r), torch.full_like(r, math.inf)
    sf = _floor(norm, sigma, r, d)
    e = 2.0 * r / (math.sqrt(d) * sf * sf) * (1 + 1e-12)
    return torch.where(sf > 0, e, torch.full_like(e, math.inf)), sf


def _rows(terms: dict, total: Tensor, stage: dict, sups: dict) -> dict:
    """One radius's per-token results: the drift terms, the capped total (non-finite -> the certified inf),
    the drift (their sum: ``sup nu_i(J' - J)``, what ``_local_stack`` reads), the stage radii and sups."""
    total = torch.where(torch.isfinite(total), total, torch.full_like(total, math.inf))
    # drift_rows bounds sup nu_i(J' - J) (the telescoped terms; _local_stack relies on it), the
    # capped total bounds sup nu_i(J') and may be smaller than point + drift
    drift = sum(terms.values())
    drift = torch.where(torch.isfinite(drift), drift, torch.full_like(drift, math.inf)) * (1 + ROUNDING_PAD)
    return {"terms": terms, "total": total, "drift": drift, "stage": stage, "sups": sups}


BOUND_PARTS = ("ffn (dF)",)  # F61b: with maxima only, parts reported as a certified upper bound, not refined for


def _reported(rows: dict) -> list[Tensor]:
    """The (T,) rows whose maxima ``layer_rows`` reports: the ball rows (``ball``), the drift rows (read as
    a max by ``_local_stack``) and every drift term (``parts``); the first orders the refinement."""
    return [rows["total"], rows["drift"], *rows["terms"].values()]


def _reported_maxima(rows: dict) -> list[Tensor]:
    """``_reported`` without ``BOUND_PARTS`` (THEORY F61b): the rows that ask for a refinement when only the maxima
    are read (F45b's ``tiers``); the parts left out are reported as the maximum of their current per-token values, a
    certified upper bound of the refined maximum (every term is one), not that maximum."""
    return [rows["total"], rows["drift"], *(v for k, v in rows["terms"].items() if k not in BOUND_PARTS)]


def unbounded(rows: dict, *radii: Tensor | None) -> bool:
    """F61c: whether a refinement can change nothing of ``rows`` (the rows at the cheap FFN terms) but the FFN
    coefficient ``ffn_coef``: every FFN input radius in ``radii`` (None: absent) is non-finite at every token, so F37b
    records no reference a smaller ball could use (``scaled_refs`` takes finite radii only), and every reported row
    (``_reported``), stage radius and stage sup is already non-finite at every token.  The FFN terms enter the rows
    only multiplied by those sups (``Hs``, ``Ns``, ``A``) or radii, or added, so the rows stay non-finite for any
    smaller term (inf, or nan where a refined term is exactly 0 against an infinite factor).  Then the cheap rows are
    returned (``ffn_coef`` the cheap coefficient, still certified)."""
    if any(r is not None and bool(torch.isfinite(r).any()) for r in radii):
        return False
    vals = [*_reported(rows), *rows["stage"].values(), *rows["sups"].values()]
    return not any(bool(torch.isfinite(v).any()) for v in vals)


def refine_lazily(evaluate, reported, refine, T: int, lowest: dict | None = None) -> dict:  # noqa: ANN001
    r"""F37a: per-token rows with an expensive refinement, refined only where a reported maximum can change.

    ``evaluate()`` gives the rows with the refinements made so far, ``reported(rows)`` the (T,) tensors whose
    maxima are reported, ``refine(idx)`` replaces the cheap terms of the tokens ``idx`` by the smaller refined
    ones; ``lowest``: the rows with every term at its smallest possible value (e.g. 0), or None.  Every
    reported row is non-decreasing in each token's term and token ``i``'s rows depend only on its own term,
    so ``low_k <= full_k <= cur_k`` (``cur`` the current rows, equal to ``full`` at refined tokens) and
    ``max_k full_k >= m = max(max_{refined} cur, max_k low_k)``.  While some unrefined token has ``cur_k > m``
    in some row (or a NaN), the largest such tokens (first row) are refined, 1, 2, 4, ... at a time.  At the
    end every unrefined token has ``cur_k <= m <= max full``, hence for every reported row

    .. math:: \max_k \mathrm{cur}_k = \max_k \mathrm{full}_k,

    the maxima of the full computation; the other rows stay certified (cheap ones).  A row that does not see
    the term at token k (``low_k = cur_k``) never asks for its refinement.  ``refine`` may return a (len(idx),)
    bool mask of the tokens now final; the others got an intermediate term (a tier between the cheap and the
    full one, still ``>= full``) and stay candidates, so the argument holds with "refined" read as "final"
    (THEORY F45b); None means all final.  Source: THEORY F37a, F45b.
    Assumptions: the monotonicity and locality above (the caller's)."""
    done = torch.zeros(T, dtype=torch.bool)
    rows = evaluate()
    floors = [v.max() for v in reported(lowest)] if lowest is not None else None
    batch = 1
    while True:
        vals = reported(rows)
        need = torch.zeros(T, dtype=torch.bool)
        for m, v in enumerate(vals):
            top = v[done].max() if bool(done.any()) else torch.tensor(-math.inf, dtype=v.dtype)
            if floors is not None:
                top = torch.maximum(top, floors[m])  # NaN propagates: then every token is refined
            need |= ~(v <= top)  # NaN: refined too
        need &= ~done
        if not bool(need.any()):
            return rows
        order = torch.where(need, torch.nan_to_num(vals[0], nan=math.inf), torch.full_like(vals[0], -math.inf))
        idx = order.argsort(descending=True, stable=True)[:min(batch, int(need.sum()))]
        final = refine(idx)
        done[idx] = True if final is None else final
        batch *= 2
        rows = evaluate()


class FfnDrift:
    """The FFN term of one layer's rows, per radius (THEORY F17c, F31d, F37, F38): F17c's global drift of
    ``F`` on ``||dh|| <= rh``, F37b's references (F31d's per-unit bound at a larger ball where no unit was
    capped, scaled) and, at the tokens that can set a reported maximum (F37a), F31d's per-unit Grams
    (2 d^2 d_ff flops a token) and F38's second-order tensor norm (d d_ff^2 flops a token, once per token
    and layer).  State across the radii of one call: the references and the tensor norms per token.  ``z`` the
    pre-activations at the centre, within ``ez`` of the exact ones (``pre_activations``; None: exact): every per-unit
    term widens its intervals by ``ez`` and pays for ``GELU''`` at the centre (F51a, red17-2)."""

    def __init__(self, layer: LayerSpec, z: Tensor, norms: dict, tiers: bool = False, ez: Tensor | None = None) -> None:
        from ._activations import activation_lipschitz
        from ._local import second_derivative_sup

        ffn = layer.ffn
        post = layer.placement is Placement.POST
        centring = layer.norm_ffn is not None and layer.norm_ffn.kind.value == "layernorm"
        self.kappa = drift_kappa(ffn, norms, post and centring)  # post-LN the second norm sees P dF
        self.curv = second_derivative_sup(ffn.activation) * norms["ffn_curv"]
        self.cap = (GELU_SLOPE_RANGE if Activation(ffn.activation) is Activation.GELU
                    else 2 * activation_lipschitz(ffn.activation)) * norms["W1"] * norms["W2"] * (1 + ROUNDING_PAD)
        self.lip = activation_lipschitz(ffn.activation) * norms["W1"] * norms["W2"] * (1 + ROUNDING_PAD) ** 2
        self.ffn, self.z, self.ez, self.n1 = ffn, z, ez, norms["n1"]
        self.taylor = None  # F38: the radius-free Hadamard Grams (per layer, cached with the weight norms)
        if gelu_ffn(ffn):
            key = "ffn2P" if post and centring else "ffn2"
            if key not in norms:
                norms[key] = ffn_hadamard(ffn, centred=post and centring)
            self.taylor = norms[key]
        # F45a's constants, cached beside F38's; None: no tier (every refinement final at once, as F37a alone)
        self.split_key = key + "_split" if self.taylor is not None and tiers else None
        self.norms = norms
        self.asks = _reported_maxima if tiers else _reported  # F61b: maxima only, ffn (dF) an upper bound
        self.tiers = tiers  # the caller reads the maxima only (F45b, F61b, F70c)
        self.n2_tok = torch.full((z.shape[0],), math.nan, dtype=torch.float64)
        self.n2_cheap = torch.full((z.shape[0],), math.nan, dtype=torch.float64)  # F45a's tier, per token
        self.refs: list = []  # (rh_b, bound_b): F31d at a larger ball where no unit was capped (F37b)

    def glob(self, rh: Tensor) -> tuple[Tensor, Tensor]:
        """F17c's global FFN drift on ``||dh|| <= rh``: ``sup ||F(h + dh) - F(h)||`` and ``int_0^1 sup ||F(h + t dh)
        - F(h)|| dt`` (the linear bounds halve, the cap stays).  On a ball of radius 0 ``F`` does not move:
        0 there, also when ``kappa`` is inf (ReLU), whose product with 0 would be nan."""
        lin = torch.where(rh == 0, 0.0, torch.minimum(self.kappa * rh, self.curv * rh))
        return torch.minimum(lin, torch.full_like(rh, self.cap)), torch.minimum(lin / 2, torch.full_like(rh, self.cap))

    def scaled_refs(self, rh: Tensor, dF: Tensor, dFh: Tensor) -> tuple[Tensor, Tensor]:
        """F37b: each larger ball's reference scaled to the radii ``rh``, where finite (an infinite ball's
        ``rh / rb = 0`` times an infinite bound is nan, and torch.minimum would carry that nan into every
        smaller ball's rows)."""
        for rb, ub in self.refs:
            ok = (rh <= rb) & (rb > 0) & torch.isfinite(rb) & torch.isfinite(ub)
            scaled = torch.where(ok, rh / torch.where(ok, rb, 1.0) * torch.where(ok, ub, 0.0), math.inf) * (1 + 1e-12)
            dF, dFh = torch.minimum(dF, scaled), torch.minimum(dFh, scaled / 2)
        return dF, dFh

    def refine(self, rh: Tensor, dF: Tensor, dFh: Tensor, ref: Tensor, base: tuple, level: Tensor,
               idx: Tensor) -> Tensor:
        """One step of the tokens ``idx``' FFN drift (in place in ``dF``, ``dFh``; ``base`` the unrefined values,
        ``level`` per token 0 unrefined, 1 F45a's tier, 2 final): a token whose exact N2 is not known yet gets
        F38 with F45a's cheap N2 first (level 1), the others the final term (``final``).  Returns the mask of
        ``idx`` now final (F45b)."""
        first = (level[idx] == 0) & torch.isnan(self.n2_tok[idx]) if self.split_key is not None \
            else torch.zeros(len(idx), dtype=torch.bool)
        if bool(first.any()):
            self.tier(rh, dF, dFh, base, idx[first])
            level[idx[first]] = 1
        if not bool(first.all()):
            dF[idx[~first]], dFh[idx[~first]] = base[0][idx[~first]], base[1][idx[~first]]
            self.final(rh, dF, dFh, ref, idx[~first])
            level[idx[~first]] = 2
        return ~first

    def tier(self, rh: Tensor, dF: Tensor, dFh: Tensor, base: tuple, idx: Tensor) -> None:
        """F38 with F45a's cheap upper bound of N2 (cached per token) on the tokens ``idx``, from ``base``."""
        new = idx[torch.isnan(self.n2_cheap[idx])]
        if len(new):
            self.n2_cheap[new] = ffn_second_split(self.taylor, self.split(), self.z[new], self._ez(new))
        t, th = ffn_taylor_drift(self.taylor, self.n2_cheap[idx], self.z[idx], self.n1, rh[idx], self._ez(idx))
        dF[idx], dFh[idx] = torch.minimum(base[0][idx], t), torch.minimum(base[1][idx], th)

    def split(self) -> dict:
        """F45a's data-free split constants of this layer (``ffn_split_constants``), cached beside F38's."""
        if self.split_key not in self.norms:
            self.norms[self.split_key] = ffn_split_constants(self.taylor)
        return self.norms[self.split_key]

    def final(self, rh: Tensor, dF: Tensor, dFh: Tensor, ref: Tensor, idx: Tensor) -> None:
        """The tokens ``idx``' FFN drift (in place in ``dF``, ``dFh``) by F38's tensor norm and F31d's per-unit
        bound, whose Grams are formed only where they can beat F38 (F42a); F31d's bound becomes the reference
        ``ref`` where no unit was capped (F37b)."""
        z, n1, ez = self.z, self.n1, self._ez(idx)
        taylor = None
        if self.taylor is not None:
            taylor = ffn_taylor_drift(self.taylor, self.second_norms(idx), z[idx], n1, rh[idx], ez)
            dF[idx], dFh[idx] = torch.minimum(dF[idx], taylor[0]), torch.minimum(dFh[idx], taylor[1])
        u, uh = ffn_unit_drift(self.ffn, z[idx], n1, rh[idx], above=taylor, ez=ez)
        dF[idx], dFh[idx] = torch.minimum(dF[idx], u), torch.minimum(dFh[idx], uh)
        if self.taylor is not None:  # F51a: F17c's kappa with each unit's own curvature on its reachable interval
            # F61a: its certificates only where they can beat the bounds so far (the same floats)
            c, ch = ffn_curvature_drift(self.taylor, z[idx], n1, rh[idx], ez, (dF[idx], dFh[idx]))
            dF[idx], dFh[idx] = torch.minimum(dF[idx], c), torch.minimum(dFh[idx], ch)
        uncapped = (unit_slope_moves(z[idx], n1, rh[idx], ez) <= GELU_SLOPE_RANGE).all(dim=1)
        ref[idx] = torch.where(uncapped, u, ref[idx])

    def second_norms(self, idx: Tensor) -> Tensor:
        """F38b's ``N2`` of the tokens ``idx`` (``ffn_second_norms``), each formed once per layer and kept in ``n2_tok``
        (whether a token has it decides F45a's tier, ``refine``)."""
        new = idx[torch.isnan(self.n2_tok[idx])]
        if len(new):
            self.n2_tok[new] = ffn_second_norms(self.taylor, self.z[new], self._ez(new))
        return self.n2_tok[idx]

    def known_second_norms(self, idx: Tensor) -> Tensor | None:
        """``n2_tok[idx]`` where every one is formed already, else None (F54b/F70a read the same norm, one token's
        float being the same in any batch, THEORY F74b; they do not store theirs: that would change F45a's tiers)."""
        n2 = self.n2_tok[idx]
        return None if bool(torch.isnan(n2).any()) else n2

    def _ez(self, idx: Tensor) -> Tensor | None:
        return None if self.ez is None else self.ez[idx]

    def rows(self, tail, rh: Tensor, unit: bool) -> dict:  # noqa: ANN001
        """``tail(dF, dF_half)`` at the FFN input radii ``rh``: the global drift, and with ``unit`` the
        references and the lazy refinement (F37a), whose per-unit bounds then serve the smaller balls."""
        dF, dFh = self.glob(rh)
        if not unit:
            return tail(dF, dFh)
        dF, dFh = self.scaled_refs(rh, dF, dFh)
        cheap = tail(dF, dFh)
        if unbounded(cheap, rh):  # F61c
            return cheap
        ref = torch.full_like(rh, math.inf)
        zero = torch.zeros_like(rh)  # the smallest FFN drift: the rows' floors (F37a)
        level = torch.zeros(len(rh), dtype=torch.long)
        refine = partial(self.refine, rh, dF, dFh, ref, (dF.clone(), dFh.clone()), level)
        rows = refine_lazily(lambda: tail(dF, dFh), self.asks, refine, len(rh), lowest=tail(zero, zero))
        self.refs.append((rh, ref))
        return rows


def layer_rows(layer: LayerSpec, X: Tensor, radii, *, norms: dict | None = None,  # noqa: ANN001
               head_norms_: dict | None = None, lower: int = 0, tiers: bool = False) -> list[LayerJacobian]:
    r"""Certified (2,inf) bound of one layer's Jacobian at every point of ``B(X, r)`` for each ``r``,
    without forming the ``T^2`` blocks (Notes [weighted row Gram], [stage radii], [FFN drift by the
    Hadamard Gram]).

    .. math:: \nu_i(J(X')) \le \Big(\lambda_{\max}\big(M_iS_iM_i^\top\big)\textstyle\sum_j w_{ij}\Big)^{1/2}
              + \mathrm{drift}_i(r)

    Source: THEORY F17, F17b-F17d (F37, F45 for the lazy FFN term, F46 for its gamma-folded branch).  Returns ``LayerJacobian`` objects (``blocks`` None) whose
    ``output_radii`` are the certified per-token radii of the layer's output on the ball.  ``lower``:
    also an attained row norm (``row_lower``, empirical lower) for that many tokens with the largest
    certified point rows, in ``lower_rows`` (NaN elsewhere) with the best ``V`` in ``lower_V``.  ``tiers``: maxima
    only -- F45's cheap tier of N2 before the exact one (F45b) and F61b's rule (the part ``ffn (dF)`` does not ask for
    refinements; its reported value is then a certified upper bound of the refined maximum, not that maximum): the same
    ball and largest drift row, other tokens' rows and stage radii looser (``_local_stack`` reads every token's rows,
    so it is off by default).  The
    stages are the functions of ``_local_stages``, in the order its docstring gives.
    Assumptions: dot attention without RoPE, non-gated FFN, every token within ``r`` of X.
    A post-LN layer outside Note [local data range] is refused (InputError): its row Grams would flush."""
    from .._errors import InputError
    from . import _local_stages as st
    from ._local_attention import check_local_attention, head_norms
    from ._local_gamma_fold import FoldedFfnDrift
    from ._local_row_weights import reweighted

    if layer.ffn.gated:
        raise InputError("the exact-Jacobian route does not cover gated FFNs")
    check_local_attention(layer.attention)
    norms = _weight_norms(layer) if norms is None else norms
    hn = head_norms(layer.attention) if head_norms_ is None else head_norms_
    at = st.layer_at_x(layer, X.detach().double(), float(hn["O"]))
    check_data_range(at, norms)  # Note [local data range]
    gram = st.attention_row_gram(at)
    pt = st.post_point(at, gram) if at.post else st.pre_point(at, gram)
    gram, pt = reweighted(at, gram, pt)  # F56: the row Grams again with optimised weights, the smaller kept
    low = st.point_lower(at, gram, pt, lower) if lower else None
    dd = st.drift_at_x(at, hn)  # the data-free head maps cached beside the head norms (F52c)
    ffn = FoldedFfnDrift(layer, at.z, norms, tiers, at.ez)  # F46: also through the preceding norm's gamma
    fx = st.fold_at_x(at, gram) if at.post and ffn.fold is not None else None
    out = {}
    # the largest ball first: its F31d bounds, scaled, are the smaller balls' cheap terms (F37b)
    for k in sorted(range(len(radii)), key=lambda k: -float(radii[k])):
        r = float(radii[k])
        # the sub-balls use the global FFN drift only (F31d's per-unit Grams are most of the cost)
        subs = [st.radius_rows(at, pt, dd, ffn, norms, hn, j * r / RIEMANN_STEPS, [], unit=False, fx=fx)[1]
                for j in range(1, RIEMANN_STEPS)]
        out[k] = st.radius_rows(at, pt, dd, ffn, norms, hn, r, subs, low=low, fx=fx, gram=gram)[0]
    return [out[k] for k in range(len(radii))]


def _gamma_vec(norm, d: int) -> Tensor:  # noqa: ANN001
    """|gamma| padded (ones without a scale)."""
    if norm is None or norm.weight is None:
        return torch.ones(d, dtype=torch.float64)
    return _f64(norm.weight).abs() * (1 + ROUNDING_PAD)


def row_lower(heads, Wo_all: Tensor, Bii: Tensor, M: Tensor, N: Tensor | None, tokens, *,  # noqa: ANN001
              iters: int = 20, restarts: int = 2, seed: int = 0, init: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """For each token ``i`` in ``tokens``, an attained value of ``nu_i(J) = max_{||v_j|| <= 1} ||sum_j J_ij
    v_j||`` and its ``V`` (T, d), with ``J_ij = M_i B_ij`` applied through its factors (no blocks):
    alternating maximisation ``v_j = J_ij^T u / ||J_ij^T u||``, ``u`` the normalised image, each step
    non-decreasing; restarts from ``init[i]`` (e.g. a top eigenvector of the row Gram) and random
    ``u``.  Kind: empirical lower (the caller re-evaluates the best ``V`` through autograd)."""
    d = Bii.shape[1]
    dh = heads[0][5].shape[1]
    g = torch.Generator().manual_seed(seed)
    vals, Vs = [], []
    for i in tokens:
        P = torch.stack([hd[0][i] for hd in heads])  # (H, T)
        Vy = torch.stack([hd[1][i] @ hd[5] for hd in heads])  # (H, T, dh)
        Q = torch.stack([hd[2][i] for hd in heads])  # (H, d)
        Wv = torch.stack([hd[5] for hd in heads])  # (H, d, dh)
        off = P.clone()
        off[:, i] = 0.0

        def fwd(V: Tensor) -> Tensor:
            X = V if N is None else (N @ V[:, :, None])[:, :, 0]
            s = torch.einsum("hd,hda->ha", off @ X, Wv)  # W_V^T sum_j P_ij x_j
            s = s + torch.einsum("hj,hj,hja->ha", off, (X @ Q.T).T, Vy)  # sum_j P_ij (q_i . x_j) v_ij
            return M[i] @ (Bii[i] @ V[i] + Wo_all.T @ s.reshape(-1))

        def bwd(u: Tensor) -> Tensor:
            z = M[i].T @ u
            x = (Wo_all @ z).reshape(len(heads), dh)  # (H, dh)
            a = torch.einsum("hda,ha->hd", Wv, x)  # W_V x_h
            c = torch.einsum("hja,ha->hj", Vy, x)  # v_ij . x_h
            G = torch.einsum("hj,hd->jd", off, a) + torch.einsum("hj,hj,hd->jd", off, c, Q)
            if N is not None:
                G = (N.transpose(1, 2) @ G[:, :, None])[:, :, 0]
            G[i] = G[i] + Bii[i].T @ z
            return G

        best, bestV = -1.0, None
        starts = ([init[i]] if init is not None else []) + [torch.randn(d, generator=g, dtype=torch.float64)
                                                            for _ in range(restarts)]
        for u in starts:
            u = u / u.norm().clamp(min=1e-300)
            for _ in range(iters):
                G = bwd(u)
                V = G / G.norm(dim=1, keepdim=True).clamp(min=1e-300)
                y = fwd(V)
                val = float(y.norm())
                if val > best:
                    best, bestV = val, V
                u = y / max(val, 1e-300)
        vals.append(best)
        Vs.append(bestV)
    return torch.tensor(vals, dtype=torch.float64), torch.stack(Vs)
