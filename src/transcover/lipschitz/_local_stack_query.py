"""The heads' reach with one query move for all heads (issue 12; THEORY F53).

F50 joins the heads through one output direction, but each head's score-change moment ``A_h`` (F44b) still takes
its own worst query move: ``lambda_max(sum_j P_hij g_hij g_hij^T)^{1/2}`` with ``g_hij = Q_i^{1/2} G_h y_hij``.  The
move of token i is one row ``delta_i = Q_i^{1/2} alpha_i`` for every head, so with weights ``w_h > 0``

    ``sum_h A_h(alpha) n_h(v_h) <= (sum_h w_h A_h(alpha)^2)^{1/2} (sum_h n_h(v_h)^2 / w_h)^{1/2}``

and ``sum_h w_h A_h(alpha)^2 <= alpha^T (sum_h w_h Gamma_h) alpha + ...``: one certified ``lambda_max`` of the heads'
stacked query Gram instead of the sum of the heads' own, times one of the value side (F50c's ``block_lmax``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_jacobian import pow2_norm
from ._local_rows import _top_padded
from ._local_sharp import ball_box
from ._local_stack_joint import block_lmax
from ._rounding import _gamma, product_row_error

__all__ = ["joint_query_lmax", "query_excess", "value_weights", "value_lmax", "query_value_reach"]

_U = 2.0**-53


def _fro(A: Tensor, dims: tuple) -> Tensor:
    """Frobenius norms over ``dims`` at a power of two (``pow2_norm``, THEORY F81d), padded up for their float64 sum."""
    n = math.prod(A.shape[d] for d in dims)
    return pow2_norm(A, dims) * (1 + (n + 2) * _U)


def joint_query_lmax(heads, Qs: Tensor | None, eQ: Tensor | None, scale: float, w: Tensor) -> Tensor:  # noqa: ANN001
    r"""(T,) per query ``i`` a certified ``lambda_max(sum_h w_hi Gamma_hi)``, ``Gamma_hi = sum_j P_hij g_hij g_hij^T``,
    ``g_hij = Q*_i^{1/2} scale W_Q^h W_K^hT y_hij`` (THEORY F53a): ``heads`` ``_head_data``'s rows, ``Qs`` (T, d, d) the
    prefix's ellipsoids as formed within ``eQ`` (T,) (Frobenius; None: the unit ball, ``Q = I``), ``w`` (H, T) >= 0.
    The sum is the Gram ``R M_i R^T`` of the heads' stacked centred keys ``R`` (rows ``(w_hi P_hij)^{1/2} scale y_hij
    W_K^h``, block-diagonal over heads) through ``M_i = W_Q^T Q_i W_Q`` (all heads' query maps side by side):
    ``M_i`` within ``eM_i = ||W_Q||_F^2 (gamma_{2d+2} ||Q_i||_F + eQ_i) + u ||M_i||_F`` (the ball: ``gamma_{d+2}
    ||W_Q||_F^2``), so the exact Gram is below the formed one plus ``eM_i tr(R R^T) + gamma_{H dh + 2} tr(R R^T)
    ||M_i||_F`` (the product's rounding, as F44a); the eigenvalue padded by ``1e-9`` of the trace (``_top_padded``)."""
    Wq = torch.cat([hd[3] for hd in heads], dim=1)  # (d, H dh)
    H, dh, d = len(heads), heads[0][3].shape[1], Wq.shape[0]
    T = heads[0][0].shape[0]
    fW = float(_fro(Wq, (0, 1)))
    fW2 = fW * fW  # inf past 2^512, not Python's OverflowError from ``** 2`` (W_Q x 2^600, W_K x 2^-600; mend30)
    if Qs is None:
        M = (Wq.T @ Wq)[None].expand(T, H * dh, H * dh)
        eM = torch.full((T,), _gamma(d + 2) * fW2, dtype=torch.float64)
    else:
        M = Wq.T @ Qs @ Wq
        M = 0.5 * (M + M.transpose(1, 2))
        eM = fW2 * (_gamma(2 * d + 2) * _fro(Qs, (1, 2)) + eQ) + _U * _fro(M, (1, 2))
    Kc = torch.stack([scale * (hd[1] @ hd[4]) for hd in heads])  # (H, T, T, dh): [h, i, j] = scale y_hij W_K^h
    # THEORY F97: the exact keys within ek of the formed Kc (twice Higham's bound: the scaling rounds once more)
    ek = torch.stack([2 * scale * product_row_error(hd[1], hd[4]) for hd in heads])  # (H, T, T)
    P = torch.stack([hd[0] for hd in heads])  # (H, T, T)
    out = torch.empty(T, dtype=torch.float64)
    for i in range(T):
        R = torch.zeros(H * T, H * dh, dtype=torch.float64)
        for h in range(H):
            R[h * T:(h + 1) * T, h * dh:(h + 1) * dh] = Kc[h, i]
        G = R @ M[i] @ R.T
        G = 0.5 * (G + G.T)
        sw = torch.sqrt((w[:, i, None] * P[:, i]).reshape(H * T))
        tr = float((w[:, i, None] * P[:, i] * (Kc[:, i] ** 2).sum(dim=2)).sum()) * (1 + (dh + T + 4) * _U)
        top = float(_top_padded((G * sw[:, None] * sw[None, :])[None])[0])
        fM = float(_fro(M[i], (0, 1)))
        out[i] = (top + (float(eM[i]) + _gamma(H * dh + 2) * fM) * tr) * (1 + 1e-12)
        # the exact R within (sum_hj w P ek^2)^{1/2} of the formed one (Frobenius): the root of the Gram's top
        # eigenvalue through M_i moves by at most ||M_i||^{1/2} times that (Minkowski)
        eR = math.sqrt(float((w[:, i, None] * P[:, i] * ek[:, i] ** 2).sum()) * (1 + 1e-12))
        root = math.sqrt(float(out[i])) + math.sqrt((fM + float(eM[i])) * (1 + 1e-12)) * eR
        out[i] = root * root * (1 + 1e-12)  # a product, not ``** 2``: inf past 2^512, not an OverflowError
    return torch.nan_to_num(out, nan=math.inf)


def query_excess(m: dict, side: dict, t: float, nG: float) -> Tensor:
    r"""(T,) ``>= sum_j a_ij (alpha . g_ij)^2`` for every unit ``alpha`` on ``B(X, t)`` (F31a's envelope ``P' <= P + a``;
    THEORY F53a): ``min(sum_j a_ij ||g_ij||^2, (max_j a_ij/P_ij) lambda_max(Gamma_i))`` from a side of F44b (``g2``,
    ``lG``: ``head_projections`` or ``ball_side``), so ``sum_j P'_ij (alpha . g_ij)^2 <= alpha^T Gamma_i alpha +`` this."""
    P = m["P"]
    _, _, a, _, _ = ball_box(m, t, nG)
    ratio = torch.where(P > 0, a / P, torch.zeros_like(P)).max(dim=1).values * (1 + 1e-12)
    return torch.minimum((a * side["g2"]).sum(dim=1) * (1 + 1e-12), ratio * side["lG"]) * (1 + 1e-12)


def value_weights(core: Tensor, MO: Tensor, lam: Tensor) -> Tensor:
    """(H, T) positive weights ``w_h ~ nu_h / lam_h^{1/2}`` (``nu_h^2`` an uncertified estimate of ``lambda_max(MO_h
    K_h MO_h^T)``, ``lam`` (H, T) the heads' query ``lambda_max``), the equality case of the Cauchy-Schwarz step when
    the heads' worst directions are shared; floored at ``1e-9`` of the largest (any positive weights are valid)."""
    H, T = lam.shape
    dh = core.shape[-1]
    MOh = MO.reshape(T, MO.shape[1], H, dh).permute(0, 2, 1, 3)  # (T, H, d, dh)
    OO = MOh.transpose(2, 3) @ MOh
    nu = torch.linalg.eigvals(core.expand(H, T, dh, dh) @ OO.transpose(0, 1)).real.max(dim=-1).values.clamp(min=0.0)
    nu, sl = nu.sqrt(), lam.clamp(min=0.0).sqrt()
    nu = nu + 1e-9 * nu.max().clamp(min=1e-300)
    sl = sl + 1e-9 * sl.max().clamp(min=1e-300)
    return torch.nan_to_num(nu / sl, nan=1.0, posinf=1.0).clamp(min=1e-300)


def value_lmax(w: Tensor, core: Tensor, err: Tensor, MO: Tensor, eMO: Tensor) -> tuple[Tensor, Tensor]:
    """(T,) certified ``lambda_max(MO blockdiag_h(K_h / w_h) MO^T)`` for the value cores ``K_h`` (``core`` (H, T or 1,
    dh, dh) as formed within ``err`` (H, T or 1), F50b) at the weights ``w`` (H, T), ``MO`` (T, d, H dh) within ``eMO``
    (T,) (``block_lmax``: the cores' error ``sum_h (err_h + 4u ||K_h||_F) / w_h``); with ``||MO||_F`` (THEORY F53b).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    H, T = w.shape
    dh = core.shape[-1]
    core = core.expand(H, T, dh, dh)
    inv = 1.0 / w
    dB = (inv * (err.expand(H, T) + 4 * _U * pow2_norm(core, (2, 3)))).sum(dim=0) * (1 + (H + 2) * _U)
    return block_lmax(core * inv[:, :, None, None], dB, MO, eMO)


def query_value_reach(lamw: Tensor, excess: list[Tensor], w: Tensor, lamB: Tensor, fMO: Tensor) -> Tensor:
    r"""(T,) ``>= sup sum_h Aq_h(alpha) n_K(v_h)`` over unit ``alpha`` and unit output directions ``u`` (``v_h = MO_h^T
    u``), averaged over the segment's points (THEORY F53b):

    .. math:: \frac1n\sum_t \Big(\Lambda_w + \sum_h w_h e_h(t)\Big)^{1/2}\,
              \lambda_{\max}\Big(MO\ \mathrm{blockdiag}_h(K_h / w_h)\ MO^\top\Big)^{1/2}

    ``lamw`` (T,) ``joint_query_lmax`` at the weights ``w`` (H, T), ``excess`` per segment point (H, T) ``query_excess``,
    ``lamB``, ``fMO`` ``value_lmax`` at the same weights.  Refused (inf) where ``||MO||_F < 2^-200`` or the bound is
    below ``2^-900`` (F50c: the pads, relative to Frobenius masses, do not cover underflow there), except where the
    query side is exactly zero (its padded Gram and excess vanish only when every stored ``y_hij W_K^h`` does)."""
    H = w.shape[0]
    seg = sum(torch.sqrt((lamw + (w * e).sum(dim=0) * (1 + (H + 2) * _U)) * (1 + 1e-12)) for e in excess)
    out = torch.nan_to_num(seg / len(excess) * torch.sqrt(lamB) * (1 + 1e-10), nan=math.inf, posinf=math.inf)
    out = torch.where(((fMO > 0) & (fMO < 2.0**-200)) | (out < 2.0**-900), math.inf, out)
    return torch.where(seg == 0, 0.0, out)  # no query part at all (a single visible key: every y_ij = 0)
