"""The Grams' part of the attention rest with the move's rest seen through every head's factor (issue 12; THEORY F87).

F84's Grams' part pays ``e_m lambda_max(G_m)^{1/2}`` for the move's rest at token ``m``: the Gram's worst direction
against a ball.  The rest is not a ball but the images of the upstream stages' own rests through the exact products at
the data (F73c, F86), and the Gram is a non-negative combination of per-head, per-kind Grams with thin factors,
``G_m = sum_q w_qm F_q F_q^T`` (``q`` over the keys', values' and queries' heads).  So

    ||e_m||_{G_m}^2 = sum_q w_qm ||F_q^T e_m||^2  and  ||F_q^T e_m|| <= sum_src sum_k ||F_q^T M_mk|| R_k,

the block norms ``||F_q^T M_mk||`` read off the products once per stage (query-free), the weights per query.  Measured on
MiniLM (docs/theory.md F87): 2-3x below ``e_m lambda_max(G_m)^{1/2}`` per token at layer 3, 1.5-2x at layer 5.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_jacobian import certified_spectral, pow2_norm
from ._rounding import _U, _gamma

__all__ = ["gram_factors", "head_block_norms", "gram_rest_reach"]


def gram_factors(heads, values: bool = False) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ANN001
    r"""``(F, delta, fn)`` for one attention stage's heads (``_head_data``'s tuples, THEORY F87 (a)): ``F`` (3, H, d, r)
    the factors of the keys' ``W_K W_K^T``, the values' ``W_VO W_VO^T`` (``W_VO = W_V W_O``) and the queries' ``W_Q
    W_Q^T``, with ``G_q <= F_q F_q^T + delta_q I`` for the exact Grams; ``fn`` (3, H) certified ``||F_q||_2``.
    ``values``: a fourth kind, ``W_V`` itself (exact, ``delta = 0``), whose blocks THEORY F89 reads.

    ``F_K = W_K`` and ``F_Q = W_Q`` exactly (``delta = 0``); ``F_V = fl(W_V L)`` with ``L`` the computed Cholesky
    factor of ``fl(W_O W_O^T) + tau I`` (``tau = 0`` unless the factorisation fails, then ``1e-12`` of the trace, doubled
    until it succeeds), and with ``a = gamma_r ||W_V| |L||_F`` (the product's rounding) and ``S = W_O W_O^T``:

    .. math:: \delta_V = \|W_V\|_F^2\big(\gamma_d \||W_O| |W_O|^T\|_F + \gamma_{r+1} \||L| |L|^T\|_F + \tau\big)
              + 2 a (\|F_V\|_F + a) + a^2

    (``S <= LL^T + (||fl(S) - S|| + ||LL^T - fl(fl(S) + tau I)|| + tau) I``: Higham Thm 10.3 for the Cholesky
    backward error, ``-tau I`` dropped, the shifted diagonal's rounding ``u (S_ii + tau)`` below ``tau``)."""
    Wq = torch.stack([hd[3] for hd in heads])  # (H, d, r)
    Wk = torch.stack([hd[4] for hd in heads])
    Wv = torch.stack([hd[5] for hd in heads])
    Wo = torch.stack([hd[6] for hd in heads])  # (H, r, d)
    H, d, r = Wv.shape
    S = Wo @ Wo.transpose(1, 2)
    tau = torch.zeros(H, dtype=torch.float64)
    L, info = torch.linalg.cholesky_ex(S)
    while bool((info != 0).any()):
        bad = info != 0
        tr = S.diagonal(dim1=1, dim2=2).sum(-1)
        tau = torch.where(bad, torch.where(tau > 0, 2 * tau, 1e-12 * tr + 1e-300), tau)
        L, info = torch.linalg.cholesky_ex(S + tau[:, None, None] * torch.eye(r, dtype=torch.float64))
    Fv = Wv @ L
    La = L.abs()
    a = _gamma(r) * torch.linalg.matrix_norm(Wv.abs() @ La) * (1 + 2 * d * r * _U)
    eS = (_gamma(d) * torch.linalg.matrix_norm(Wo.abs() @ Wo.abs().transpose(1, 2))
          + _gamma(r + 1) * torch.linalg.matrix_norm(La @ La.transpose(1, 2)) + tau) * (1 + 2 * r * r * _U)
    nV = torch.linalg.matrix_norm(Wv) * (1 + 2 * d * r * _U)
    nF = torch.linalg.matrix_norm(Fv) * (1 + 2 * d * r * _U)
    dV = (nV * nV * eS + 2 * a * (nF + a) + a * a) * (1 + 1e-12)
    zero = torch.zeros(H, dtype=torch.float64)
    F = torch.stack([Wk, Fv, Wq, Wv] if values else [Wk, Fv, Wq])
    delta = torch.stack([zero, dV, zero, zero] if values else [zero, dV, zero])
    fn = certified_spectral(F.reshape(-1, d, r)).reshape(F.shape[0], H) * (1 + 1e-12)
    return F, delta, fn


def head_block_norms(F: Tensor, K: Tensor) -> Tensor:
    r"""(nq, H, T, T_in) certified ``||F_q^T fl(M)_mk||_2`` for the factors ``F`` (nq, H, d, r) and the computed
    product's columns ``K`` (T_in d, T, d) (``K[(k, c), m] = fl(M)_mk[:, c]``, ``substage_products``' layout), THEORY F87 (b): each block's ``F_q^T fl(M)_mk``
    as computed (``certified_spectral``) plus its rounding, ``gamma_d ||F_q||_F ||fl(M)_mk||_F``.  The product's own
    error (``fl(M) - M``) is the caller's (``move_rest_rows(..., blocks=)``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    nq, H, d, r = F.shape
    Tin = K.shape[0] // d
    T = K.shape[1]
    nM = pow2_norm(K.reshape(Tin, d, T, d), (1, 3)).T * (1 + 2 * d * d * _U)  # (T, T_in)
    nF = pow2_norm(F, (-2, -1)) * (1 + 2 * d * r * _U)  # (3, H); W_Q, W_K unranged: at powers of two
    out = torch.empty(nq, H, T, Tin, dtype=torch.float64)
    for q in range(nq):
        Y = K.reshape(Tin * d, T, d) @ F[q].permute(1, 0, 2).reshape(d, H * r)  # [(k, c), m, (h, r)]
        Z = Y.reshape(Tin, d, T, H, r).permute(3, 2, 0, 4, 1).reshape(H * T * Tin, r, d)
        out[q] = certified_spectral(Z).reshape(H, T, Tin)
    return ((out + _gamma(d) * nF[:, :, None, None] * nM[None, None]) * (1 + 1e-12))


def gram_rest_reach(w: Tensor, C: Tensor, delta: Tensor, E: Tensor) -> Tensor:
    r"""(T,) ``>= sup ||e_m||_{G_m}`` over the move's rests (``||e_m|| <= E_m``, ``||F_q^T e_m|| <= C_qm``) for the Grams
    ``G_m = sum_q w_qm G_q``, ``w`` (3, H, T) their weights (a negative one counts as 0; ``C``, ``delta`` may carry
    ``gram_factors(values=True)``'s fourth kind, not read here), THEORY F87 (c):

    .. math:: \|e_m\|_{G_m}^2 = \sum_q w_{qm} e_m^T G_q e_m \le \sum_q w_{qm}^+ (C_{qm}^2 + \delta_q E_m^2)."""
    wp = w.clamp(min=0)
    C, delta = C[: w.shape[0]], delta[: w.shape[0]]  # kinds past the Grams' (F89's ``W_V``) are not Grams' factors
    sq = (wp * (C * C + delta[..., None] * (E * E)[None, None])).sum(dim=(0, 1))
    return torch.nan_to_num(torch.sqrt(sq * (1 + (w.shape[1] * 3 + 4) * _U)) * (1 + 1e-12), nan=math.inf)
