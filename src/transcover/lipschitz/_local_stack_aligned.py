"""The FFN's first-order drift seen through the exact prefix at the data (issue 12; THEORY F40).

F36 bounds the whole stack's span drifts with ``v_k >= nu_k(dJ_m P_m(x))``, ``dJ_{m,k} nu_k(P_m)``: the
stage's drift on its input ball times the prefix's row.  For a post-LN FFN sub-stage ``h -> h + F(h)``
(``F(h)_k = W_2^T GELU(W_1^T h_k + b_1)``) the first-order part of ``dJ_kk b`` is
``W_2^T diag(GELU''(z_k)) ((W_1^T a_k) o (W_1^T b_k))`` with ``a_k`` token k's move and ``b_k = (P v)_k``,
both rows of the *same* prefix applied to (2,inf)-bounded vectors.  Such a row lies in the ellipsoid
``{Q_k^{1/2} beta : ||beta|| <= 1}``, ``Q_k = (sum_j w_j) sum_j P_kj P_kj^T / w_j`` (Cauchy-Schwarz, any
``w_j > 0``), so the first-order part is at most ``rho ||W_2^T D_k K_{Q_k}||`` with ``K_Q`` the rows
``Q^{1/2} w1_n (x) Q^{1/2} w1_n`` and ``K_Q K_Q^T = (W_1^T Q W_1) o (W_1^T Q W_1)``: one certified
``lambda_max`` of a d x d matrix per token (F38b's ``N2`` with ``W_1`` replaced by the reachable rows).
The second- and third-order parts keep F38's norms.  On MiniLM the reachable rows are far from the
worst direction of the FFN's second derivative: ``||W_2^T D K_Q|| ~ 1e3`` against
``N2 nu_k(P)^2 ~ 2e4`` (``docs/results/local_stack.md``, F40).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..model import Activation
from ._local_ffn2 import (
    _GELU2_ABS_ERR, centre_gelu2_err, ffn_hadamard, ffn_second_norms, ffn_second_norms_flat, ffn_taylor_drift,
    forms_in_range,
)
from ._local_jacobian import (
    GRAM_PAD, _f64, _pow2_far, certified_lmax, certified_lmax_vec, gelu_second, pow2_exponent, pow2_norm,
    pre_activations, sphere_ascent,
)
from ._local_stack_third import aligned_reach, aligned_third_rest, third_norms
from ._rounding import _gamma

__all__ = ["ellipsoid_gram", "row_weights_primal", "gram_rows", "block_norms_and_rows", "ffn_aligned_norms", "ffn_aligned_reach", "FFNAligned"]

_U = 2.0**-53


def _weights(B: Tensor) -> Tensor:
    """Positive weights ``w_j ~ ||B_j||_2`` for the Cauchy-Schwarz split (any positive values are valid: a
    few power steps, floored).  A block whose largest entry is outside ``[2^-400, 2^400]`` takes its steps at a power of
    two (exact; its weight scaled back): below ``2^-537`` the steps and the floor flushed to 0 (a zero weight); the others
    are the very same floats."""
    B, ex = _pow2_far(B)
    v = torch.ones(B.shape[0], B.shape[2], dtype=B.dtype)
    for _ in range(4):
        v = (B.transpose(1, 2) @ (B @ v[..., None]))[..., 0]
        v = v / v.norm(dim=1, keepdim=True).clamp(min=1e-300)
    w = (B @ v[..., None])[..., 0].norm(dim=1)
    return torch.ldexp(torch.maximum(w, B.norm(dim=(1, 2)) * 1e-3), ex)


def row_weights_primal(B: Tensor, steps: int = 100, tol: float = 1e-6) -> Tensor:
    """Positive weights ``w_j = ||B_j^T z||`` for blocks ``B`` (..., T, m, k) (a batch of rows), floored at ``1e-8`` of the
    row's largest and ``1e-11 ||B_j||_F`` so that every ``w_j > 0``, at the direction ``z`` of the ascent
    ``z <- sum_j B_j B_j^T z / ||B_j^T z||`` (normalised; THEORY F67a, F92) from the top eigenvector of ``sum_j B_j B_j^T``,
    stopped after ``steps`` or once no row's ``phi(z) = sum_j ||B_j^T z||`` rises by more than ``tol`` (relative): at a
    maximiser ``z`` of ``phi`` that is the top eigenvector of ``sum_j B_j B_j^T / w_j`` these weights make the weighted
    Gram's ``(sum_j w_j) lambda_max`` equal to ``phi(z)^2 = nu(B)^2``, the row's (2,inf) norm squared (THEORY F93).  Any
    positive weights are valid in ``ellipsoid_gram``; this only chooses them, so the ascent runs in float32 (half the
    memory traffic) on the blocks scaled by a power of two to a largest entry in [1/2, 1) (exact, so the weights scale
    exactly with the blocks; entries below float32's range of the largest only move the choice)."""
    B64, top = B, float(B.abs().max()) if B.numel() else 0.0
    if 0 < top < math.inf:
        B = torch.ldexp(B, torch.tensor(-math.frexp(top)[1], dtype=B.dtype)).float()
    z = torch.linalg.eigh(torch.einsum("...jab,...jcb->...ac", B, B))[1][..., -1]
    Bt = B.transpose(-1, -2)
    def step(z: Tensor) -> tuple[Tensor, Tensor]:
        g = (Bt @ z[..., None, :, None]).squeeze(-1)  # B_j^T z, (..., T, k)
        n = g.norm(dim=-1)
        return (B @ (g / n.clamp(min=torch.finfo(B.dtype).tiny)[..., None])[..., None]).squeeze(-1).sum(-2), n.sum(-1)

    z = sphere_ascent(step, z, steps, tol)
    w = (B64.transpose(-1, -2) @ z.to(B64.dtype)[..., None, :, None]).squeeze(-1).norm(dim=-1)
    floor = torch.maximum(w.amax(dim=-1, keepdim=True) * 1e-8, B64.norm(dim=(-2, -1)) * 1e-11)
    return torch.maximum(w, floor).clamp(min=1e-300)


def ellipsoid_gram(B: Tensor, w: Tensor | None = None) -> tuple[Tensor, float]:
    r"""For blocks ``B_j`` (T, d, d) of one prefix row, ``(Q, eQ)``: ``Q`` as formed and ``eQ`` a Frobenius
    bound on its distance to the exact ``Q* = c sum_j B_j B_j^T / w_j`` (``c >= sum_j w_j``), so that every
    ``a = sum_j B_j h_j`` with ``||h_j|| <= 1`` has ``a a^T <= Q*`` (THEORY F40a):
    ``(u.a)^2 <= (sum_j ||B_j^T u||)^2 <= (sum_j w_j)(sum_j ||B_j^T u||^2 / w_j)``.  Zero blocks are left out.
    ``w`` (T,) positive weights (default: ``_weights``' power steps; ``row_weights_primal`` for the row's norm, F93).
    Rounding: each entry of ``c B_j B_j^T / w_j`` summed over ``j`` within ``gamma_{d+T+4}`` of the same sum of
    ``|terms|``, whose Frobenius norm is at most ``c sum_j ||B_j||_F^2 / w_j``.  Underflow: only exact zeros are left out
    (``torch``'s norm of a block of entries below ``2^-537`` is 0, and such a block was dropped: a row of them had the
    ellipsoid 0 and the pad 0), a block outside ``[2^-400, 2^400]`` enters ``tQ`` as ``(||B_j||_F / w_j) ||B_j||_F`` at a
    power of two (its squares flushed), and a row whose mass ``tQ`` (degree 2 in the blocks) is below ``2^-900`` gets
    ``eQ = inf``: there the flushed products (``2^-1074`` each) are no longer far inside the relative pads; the others
    give the very same floats."""
    keep = B.abs().amax(dim=(1, 2)) > 0 if B.numel() else torch.zeros(B.shape[0], dtype=torch.bool)
    B = B[keep]
    if B.shape[0] == 0:
        return torch.zeros(B.shape[1], B.shape[1], dtype=B.dtype), 0.0
    w = _weights(B) if w is None else w[keep]
    c = float(w.sum()) * (1 + 2 * B.shape[0] * _U)
    Q = c * torch.einsum("jab,jcb->ac", B / w[:, None, None], B)
    far = _pow2_far(B)[1] != 0
    sq = (B * B).sum(dim=(1, 2)) / w
    if bool(far.any()):
        f = pow2_norm(B, (1, 2)) * (1 + (B[0].numel() + 2) * _U)  # above the exact root, its sum's rounding padded
        sq = torch.where(far, f / w * f, sq)
    tQ = c * float(sq.sum()) * (1 + 4 * B.shape[0] * _U)
    if not tQ >= 2.0**-900:  # a row of nonzero blocks whose Gram is near float64's underflow (or nan): refused
        return Q, math.inf
    return Q, _gamma(B.shape[1] + B.shape[0] + 4) * tQ * (1 + 1e-12)


def gram_rows(blocks: Tensor, norms: Tensor | None = None) -> Tensor:
    r"""(T,) certified upper bounds on each row's (2,inf) norm ``nu_i = sup_{||h_j|| <= 1} ||sum_j B_ij h_j||`` for
    blocks (T, T_in, m, k) (``_col_blocks``), by the weighted row Gram (THEORY F93): for any positive ``w``,
    ``nu_i^2 <= lambda_max(Q*_i)``, ``Q*_i = c sum_j B_ij B_ij^T / w_j`` (``ellipsoid_gram``, its rounding ``eQ``), every
    ``lambda_max`` certified (``certified_lmax``); the smaller over two choices of ``w``: ``row_weights_primal``'s (equal
    to ``nu_i`` where the ascent's direction is the weighted Gram's top eigenvector) and, with ``norms`` (T, T_in) upper
    bounds on ``||B_ij||_2``, those (then ``nu_i^2 <= (sum_j ||B_ij||)^2``: never above the triangle
    ``certified_rows`` but for the rounding).  Padded ``1e-12`` relative and for underflow (below), nan -> inf."""
    T, _, m, k = blocks.shape
    # each row scaled by a power of two to a largest entry in [1/2, 1) (exact; undone at the end); underflow then only
    # touches entries below 2^-500 of it: a block dropped as zero (its squares underflow) has entries < 2^-537, norm
    # < sqrt(m k) 2^-537, so the row moves by less than T sqrt(m k) 2^-530, added; each product's underflow in Q is
    # <= 2^-1075, at most T k per entry, times c: m T k c 2^-1070 (Frobenius), added to eS
    top = blocks.abs().amax(dim=(1, 2, 3))
    ex = pow2_exponent(top)
    blocks = torch.ldexp(blocks, -ex[:, None, None, None])
    out = torch.full((T,), math.inf, dtype=blocks.dtype)
    cands = [row_weights_primal(blocks)]
    if norms is not None:
        norms = torch.ldexp(norms, -ex[:, None])
        cands.append(torch.maximum(norms, norms.amax(dim=1, keepdim=True) * 1e-8 + 1e-300))
    for ws in cands:
        Qs, eQ = zip(*(ellipsoid_gram(blocks[i], ws[i]) for i in range(T)))
        Q = torch.stack(Qs)
        c = ws.sum(dim=1) * (1 + 2 * T * _U)
        # the symmetric part is as close to the symmetric Q* as Q is; its sum and halving within 2u ||Q||_F
        eS = torch.tensor(eQ, dtype=Q.dtype) + 2 * _U * torch.linalg.matrix_norm(Q) + m * T * k * c * 2.0**-1070
        lam = certified_lmax(0.5 * (Q + Q.transpose(1, 2)))
        nu = torch.sqrt((lam + eS).clamp(min=0)) * (1 + 1e-12) + (top != 0) * T * math.sqrt(m * k) * 2.0**-530
        out = torch.minimum(out, torch.nan_to_num(nu, nan=math.inf))
    return torch.ldexp(out, ex)


def block_norms_and_rows(blocks: Tensor, steps: int = 30, tol: float = 1e-6) -> tuple[Tensor, Tensor]:
    r"""For blocks (T, T_in, m, k), ``(N, nu)``: (T, T_in) certified ``N_ik >= ||B_ik||_2`` and (T,) certified
    ``nu_i >= sup_{||h_k|| <= 1} ||sum_k B_ik h_k||`` (the rows' (2,inf) norms), from one left Gram ``B_ik B_ik^T`` per
    block (THEORY F95): each block's norm is its Gram's certified ``lambda_max`` (``certified_spectral``'s, on the left
    side), and each row's is the weighted row Gram of F93, ``nu_i^2 <= (sum_k w_k) lambda_max(sum_k B_ik B_ik^T / w_k)``
    (any ``w > 0``), summed from the same Grams, so a row costs one more ``m x m`` certified ``lambda_max`` instead of
    ``T_in m^2 k`` flops.  The weights ``w_k = ||B_ik^T z||`` at the direction of the ascent
    ``z <- sum_k G_ik z / ||B_ik^T z||`` (F67a, F92; float32 on the scaled Grams, from the largest block's top Ritz
    vector, stopped after ``steps`` or a relative rise below ``tol``): any positive ``w`` is valid, this only chooses.
    Scaling: each block by a power of two ``2^-e_ik`` to a largest entry in [1/2, 1) (exact) before its Gram, so no Gram
    under- or overflows (``certified_spectral``); a row's Grams are summed at ``4^(e_ik - e_i)``, ``e_i`` the row's
    largest exponent, where what underflows is below ``2^-1074`` per term.  Rounding of the row Gram, Frobenius: each
    ``fl(G~_ik)`` within ``GRAM_PAD`` of its trace ``f_ik`` (``certified_spectral``'s pad, taken twice for the trace's own
    rounding); the coefficients ``a_ik = c 4^(e_ik - e_i) / w_k``, the products and the ``T_in``-term sum within
    ``gamma_{T_in + 4}`` of ``sum_k a_ik f_ik``; the products' underflow, at most ``2^-1074`` each and ``T_in`` per
    entry, ``m T_in 2^-1070`` (Frobenius); the symmetric part ``2 u ||Q||_F``.  Padded ``1e-12`` relative; nan -> inf; never above the triangle ``sum_k N_ik`` (padded),
    itself a bound on ``nu_i``."""
    T, Ti, m, k = blocks.shape
    B = blocks.reshape(T * Ti, m, k)
    top = B.abs().amax(dim=(1, 2)) if B.numel() else B.new_zeros(T * Ti)
    ex = pow2_exponent(top)
    Bs = torch.ldexp(B, -ex[:, None, None])
    G = Bs @ Bs.transpose(1, 2)
    f = G.diagonal(dim1=1, dim2=2).sum(-1)
    lam, x = certified_lmax_vec(G)
    sp = torch.ldexp(torch.sqrt(lam + GRAM_PAD * f) * (1 + GRAM_PAD), ex)
    fro = torch.ldexp(Bs.norm(dim=(1, 2)), ex) * (1 + 4 * m * k * _U)
    N = torch.minimum(sp, fro).reshape(T, Ti)
    G, f, ex, x = G.reshape(T, Ti, m, m), f.reshape(T, Ti), ex.reshape(T, Ti), x.reshape(T, Ti, m)
    zero = top.reshape(T, Ti) == 0
    er = torch.where(zero, -2000.0, ex).amax(dim=1, keepdim=True)  # the row's largest exponent
    sc = torch.where(zero, 0.0, torch.ldexp(torch.ones_like(ex), 2 * (ex - er)))  # 4^(e_ik - e_i), 0 for zero blocks
    top_row = x.gather(1, N.argmax(dim=1)[:, None, None].expand(T, 1, m))[:, 0]  # the largest block's top Ritz vector
    w = _gram_weights(G, sc, top_row, steps, tol)  # relative weights in the row's scale, > 0 where the block is not zero
    c = w.sum(dim=1) * (1 + 2 * Ti * _U)
    a = torch.where(zero, 0.0, c[:, None] * sc / w.clamp(min=1e-300))
    Q = torch.einsum("ik,ikab->iab", a, G)
    eQ = (2 * GRAM_PAD + _gamma(Ti + 4)) * (a * f).sum(dim=1) * (1 + 4 * Ti * _U) + m * Ti * 2.0**-1070
    eS = eQ + 2 * _U * torch.linalg.matrix_norm(Q)
    lq = certified_lmax(0.5 * (Q + Q.transpose(1, 2)), start=top_row)
    nu = torch.ldexp(torch.sqrt((lq + eS).clamp(min=0)) * (1 + 1e-12), er[:, 0])
    # blocks whose scale underflowed out of the row's Gram (below 2^-1074 of it) enter by their norms (the triangle)
    nu = nu + (N * ((sc == 0) & ~zero)).sum(dim=1) * (1 + 2 * Ti * _U)
    nu = torch.where(zero.all(dim=1), 0.0, nu)
    # the triangle sum_k ||B_ik|| is a bound too (where the ascent stopped at a poor local maximum the Gram can pass it)
    nu = torch.minimum(torch.nan_to_num(nu, nan=math.inf), N.sum(dim=1) * (1 + Ti * _U))
    return N, nu


def _gram_weights(G: Tensor, sc: Tensor, x0: Tensor, steps: int, tol: float) -> Tensor:
    """(T, T_in) weights ``w_ik = (sc_ik z_i^T G_ik z_i)^{1/2}`` (floored at ``1e-8`` of the row's largest and above 0 for
    every nonzero block) at the ascent's ``z_i`` from ``x0`` (``block_norms_and_rows``), in the row's scale; float32."""
    G32, sc32 = G.float(), sc.float()
    z = x0.float()
    z = z / z.norm(dim=1, keepdim=True).clamp(min=1e-30)

    def step(z: Tensor) -> tuple[Tensor, Tensor]:
        Gz = (G32 @ z[:, None, :, None])[..., 0]
        q = torch.sqrt((sc32 * torch.einsum("ika,ia->ik", Gz, z)).clamp(min=0))
        return (Gz * (sc32 / q.clamp(min=torch.finfo(torch.float32).tiny))[..., None]).sum(1), q.sum(1)

    zd = sphere_ascent(step, z, steps, tol).double()
    w = torch.sqrt((sc * torch.einsum("ika,ia->ik", torch.einsum("ikab,ib->ika", G, zd), zd)).clamp(min=0))
    floor = torch.maximum(w.amax(dim=1, keepdim=True) * 1e-8, sc.sqrt() * 1e-11)
    return torch.maximum(w, floor)


def _hadamard_norm(const: dict, H: Tensor, eH: float, Dk: Tensor, nKQ: float, eD: float = _GELU2_ABS_ERR) -> float:
    """Certified ``lambda_max(W_2^T D H* D W_2)^{1/2}`` for ``H`` as formed within ``eH`` (Frobenius) of ``H*`` (THEORY
    F40b's last steps: ``A = D W_2``, two products, the symmetrised matrix, ``GELU''``'s error ``eD`` at the centre
    (evaluation and the pre-activation's rounding, ``centre_gelu2_err``) through ``||K|| <= nKQ``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    A = Dk[:, None] * const["W2"]
    fH = float(pow2_norm(H)) * (1 + H.numel() * _U)
    M = A.T @ (H @ A)
    fM = float(pow2_norm(M)) * (1 + M.numel() * _U)
    M = 0.5 * (M + M.T)
    fA = float((A * A).sum()) * (1 + 4 * A.numel() * _U)
    err = (fA * (eH + _U * fH + 4 * (H.shape[0] + 4) * _U * fH) + _U * fM) * (1 + 1e-12)
    lam = float(certified_lmax(M[None])[0])
    return (math.sqrt(lam + err) + eD * const["nW2"] * nKQ) * (1 + 1e-12)


def ffn_aligned_norms(const: dict, W1: Tensor, z: Tensor, blocks: Tensor, ez: Tensor | None = None,
                      third: bool = False) -> tuple:
    r"""(T,) each, certified ``NQ_k >= ||W_2^T D_k K_{Q*_k}||_2 = lambda_max(W_2^T D_k H_k D_k W_2)^{1/2}``,
    ``H_k = G_k o G_k``, ``G_k = W_1^T Q*_k W_1``, ``D_k = diag(GELU''(z_k))`` signed at the centre,
    ``Q*_k`` the ellipsoid of prefix row k (``ellipsoid_gram`` of ``blocks[k]``, (T, T, d, d): the computed
    prefix's blocks ``P_kj``), THEORY F40b; and ``NQm_k`` the same with one factor through the unit ball,
    ``H_k = G_k o G0``, ``G0 = W_1^T W_1`` (THEORY F44f).  ``const``: F38's uncentred ``ffn_hadamard`` (``W2``, ``nW2``).
    Rounding, Frobenius, in the direction of the claim: ``G`` within ``eG = ||W_1||_F^2 (gamma_{2d} ||Q||_F + eQ)``
    of ``W_1^T Q* W_1``, ``G0`` within ``e0 = gamma_{d+2} ||W_1||_F^2``; ``H = G o G`` within ``eG (2 max|G| + eG)``,
    ``G o G0`` within ``eG (max|G0| + e0) + e0 max|G|``, each plus ``u ||H||_F`` (the products); then F38b's
    ``A = D W_2`` and two products (``||A||_F^2 (eH + 4 (d_ff + 4) u ||H||_F)``); the symmetrised matrix adds
    ``u ||M||_F``; ``GELU''``'s error at the centre (``centre_gelu2_err``: evaluation, and ``z`` within ``ez`` of the
    exact pre-activation) moves the norm by that times ``||W_2|| ||K||``, ``||K_Q||^2 = lambda_max(G o G)
    <= max_n G_nn lambda_max(G) <= ||Q||^2 max_n ||w1_n||^2 ||W_1||^2`` and ``||K_{Q,I}||^2 <= ||Q|| max_n ||w1_n||^2
    ||W_1||^2``.  One ellipsoid and one ``G`` per token for both; cost per token ``3 d d_ff^2`` flops.  ``third``: also
    F62's ``(K2, Km2, g)`` (T,), (T,), (T, d_ff) from the same ``G`` (``third_norms``), as a third element.  Each is
    inf for a row whose ``Q`` fails ``forms_in_range`` (THEORY F75: the pads need float64's normal range).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T = z.shape[0]
    fW1 = float(W1.norm()) * (1 + W1.numel() * _U)
    w1max = float(W1.norm(dim=0).max()) * (1 + W1.shape[0] * _U)
    d = W1.shape[0]
    G0 = W1.T @ W1
    e0 = _gamma(d + 2) * fW1 * fW1
    g0max = float(G0.abs().max())
    nq, nqm = torch.empty(T, dtype=torch.float64), torch.empty(T, dtype=torch.float64)
    K2, Km2 = torch.empty(T, dtype=torch.float64), torch.empty(T, dtype=torch.float64)
    g = torch.empty(T, W1.shape[1], dtype=torch.float64)
    for k in range(T):
        Q, eQ = ellipsoid_gram(blocks[k])
        fQ = float(pow2_norm(Q)) * (1 + Q.numel() * _U)
        G = (W1.T @ Q) @ W1
        eG = fW1 * fW1 * (_gamma(2 * d) * fQ + eQ) * (1 + 1e-12)
        gmax = float(G.abs().max())
        Dk = gelu_second(z[k])
        eD = float(torch.as_tensor(centre_gelu2_err(None if ez is None else ez[k]), dtype=torch.float64).max())
        nq[k] = _hadamard_norm(const, G * G, eG * (2 * gmax + eG) * (1 + 1e-12), Dk, (fQ + eQ) * w1max * fW1, eD)
        nqm[k] = _hadamard_norm(const, G * G0, (eG * (g0max + e0) + e0 * gmax) * (1 + 1e-12), Dk,
                                math.sqrt(fQ + eQ) * w1max * fW1, eD)
        if third:
            K2[k], Km2[k], g[k] = third_norms(G, eG, gmax, G0, e0, g0max)
        if not bool(forms_in_range(const, Q)):  # red24-1 (F75): the degree-4 forms underflowed, the pads do not hold
            nq[k] = nqm[k] = K2[k] = Km2[k] = math.inf
            g[k] = math.inf
    out = torch.nan_to_num(nq, nan=math.inf), torch.nan_to_num(nqm, nan=math.inf)
    return (*out, tuple(torch.nan_to_num(v, nan=math.inf) for v in (K2, Km2, g))) if third else out


def ffn_aligned_reach(nq: Tensor, n2: Tensor, c3r2: Tensor, nu: Tensor, rho: float, dP: Tensor, eP: float,
                      pad: float) -> Tensor:
    r"""(T,) ``v_k >= nu_k((J_s(y_s) - J_s(x_s)) P_s(x))`` for a post-LN FFN sub-stage on ``B(x, rho)``
    (THEORY F40c):

    .. math:: v_k = \rho\,NQ_k + N2_k\,\nu_k\,\big(\rho(\delta P_k + 2 e_P) + \mathrm{pad}\big)
              + c_3(r_k)\,r_k^2\,\nu_k

    ``nq`` from ``ffn_aligned_norms``, ``n2`` F38b's ``N2`` (uncentred), ``c3r2`` F38c's third-order term at
    the token's radius ``r_k`` (``ffn_taylor_drift`` with ``N2 = 0``), ``nu`` the certified rows of the exact
    prefix at x (computed rows plus ``eP``), ``dP`` the prefix's drift rows on the ball, ``eP`` the computed
    prefix's rounding bound, ``pad`` the centre pad of the radii."""
    e = rho * (dP + 2 * eP) + pad
    v = (rho * nq + n2 * nu * e + c3r2 * nu) * (1 + 1e-12)
    return torch.nan_to_num(v, nan=math.inf)


class FFNAligned:
    """F40 for one post-LN FFN sub-stage: the radius-free ``NQ_k`` and ``N2_k`` at the data, then the reach
    ``v_k`` per radius (``reach``)."""

    def __init__(self, ffn, H: Tensor, blocks: Tensor, cache: dict) -> None:  # noqa: ANN001
        if "ffn2" not in cache:
            cache["ffn2"] = ffn_hadamard(ffn, centred=False)
        self.const = cache["ffn2"]
        W1 = _f64(ffn.W_1)
        self.z, self.ez = pre_activations(ffn, H)  # F51a: the intervals and GELU'' around the exact centre
        self.n1 = pow2_norm(W1, 0) * (1 + W1.shape[0] * _U)
        # THEORY F90: every use here is the trilinear form at rank-one arguments, so the smaller flattening serves
        self.n2 = torch.minimum(ffn_second_norms(self.const, self.z, self.ez),
                                ffn_second_norms_flat(self.const, self.z, self.ez))
        self.nq, self.nqm, self.third = ffn_aligned_norms(self.const, W1, self.z, blocks, self.ez, third=True)

    def _c3r2(self, r: Tensor) -> Tensor:
        return ffn_taylor_drift(self.const, torch.zeros_like(r), self.z, self.n1, r, self.ez)[0]

    def reach(self, r: Tensor, nu: Tensor, rho: float, dP: Tensor, eP: float, pad: float) -> Tensor:
        """F40c's reach, its second- and third-order terms also through the prefix's rows (THEORY F62, never above
        ``ffn_aligned_reach``)."""
        rest = aligned_third_rest(self.const["nW2"], self.const["lH"], self.n1, self.z, self.ez, *self.third, r, nu,
                                  rho, dP, eP, pad)
        return aligned_reach(self.nq, self.nqm, self.n2, self._c3r2(r), rest, nu, rho, dP, eP, pad)

    def drift(self, r: Tensor, rho: float, dP: Tensor, eP: float, pad: float) -> Tensor:
        """(T,) the sub-stage's drift rows on the network's ball for moves along the prefix's rows (THEORY F44f):
        ``ffn_aligned_reach`` with ``NQ`` mixed (one factor through the unit ball) and the argument a unit row
        (``nu = 1``; ``eP / 2``: the reach's ``2 e_P`` counts the argument's rounding, absent here, beside the move's),
        its Taylor rest also with the move through the prefix's rows (THEORY F62)."""
        rest = aligned_third_rest(self.const["nW2"], self.const["lH"], self.n1, self.z, self.ez, *self.third, r,
                                  torch.ones_like(r), rho, dP, eP, pad, unit=True)
        return ffn_aligned_reach(self.nqm, self.n2, torch.minimum(self._c3r2(r), rest), torch.ones_like(r), rho, dP,
                                 eP / 2, pad)

    @staticmethod
    def applies(ffn) -> bool:  # noqa: ANN001
        """A non-gated FFN with the exact (erf) GELU (F38's third derivative)."""
        return not getattr(ffn, "gated", False) and Activation(ffn.activation) is Activation.GELU
