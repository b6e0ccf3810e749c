"""Normalisation Jacobians kept in factored form for the rows route (issue 12; THEORY F32).

Note [factored norm Jacobian].  The Jacobian of LayerNorm/RMSNorm at a token (``_norm_parts``) is
``D = diag(a) (I - Q Q^T)`` with ``a = |gamma|``-signed ``gamma / s`` (ones without a scale) and
``Q = [1/sqrt(d), u]`` (LayerNorm) or ``[u]`` (RMSNorm), ``u = P x / (sqrt(d) s)``: a diagonal times
the identity minus a rank-2 term.  Products with it cost ``O(d^2)`` per token instead of a dense
``d x d x d`` product, and the sandwich ``D S D^T = diag(a) (C S C) diag(a)``, ``C = I - Q Q^T``,
``C S C = S - Q (S^T Q)^T - (S Q) Q^T + Q (Q^T S Q) Q^T``.  ``||C||_2 <= 1 + |e . u|`` and
``||Q||_F^2 = 1 + ||u||^2 <= 2 + 4 d u`` (``||u|| = sigma/s < 1`` in exact arithmetic).

Rounding (Higham, Accuracy and Stability, 3.5; ``u = 2^-53``, ``gamma_k = k u/(1 - k u)``), for the
evaluation below with ``k <= 2`` columns in ``Q`` (Frobenius norms of the computed results):

* ``D X`` and ``X D``: ``<= 4 (d + 8) u max|a| ||X||_F`` (inner products of length ``d`` for
  ``Q^T X``, two rank-``k`` updates, one scaling);
* ``D S D^T``: ``<= 20 (d + 8) u max|a|^2 ||S||_F`` (``S Q``, ``S^T Q``, ``Q^T S Q``, two rank-``k``
  updates and the two-sided scaling; the constant collects ``1 + 2 ||Q||_F^2 + ||Q||_F^4 <= 9.1`` and
  the propagated errors of ``S Q`` and ``Q^T S Q``).

Every Frobenius norm in these bounds is formed at a power of two (``pow2_norm``; ``||D||_F`` where ``max|a|`` is outside
``[2^-400, 2^400]``): ``torch``'s norm squares as it sums, and a Gram of entries ``2^-700`` had the norm 0, so its
rounding term was lost; in the normal range the floats are the same as before.

The deviation of the factored ``D`` (exact arithmetic on the computed ``a, Q``) from the true
Jacobian, ``err``, is ``norm_jacobian_error`` (THEORY F17f): absolute in the centring and scaling
errors, not relative to ``||D||_F`` (a one-hot token with a spiky gain has ``||D||_F << max|a|`` and an
error ``~ max|a| ||u - u*||``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._errors import InputError
from ..model import NormKind, NormSpec
from ._local_jacobian import _f64, centre_tokens, certified_spectral, norm_jacobian_error, pow2_exponent, pow2_norm
from ._rounding import root_sq_plus

_U = 2.0**-53


class NormJac:
    """Per-token normalisation Jacobians ``D_t = diag(a_t) (I - Q_t Q_t^T)`` (Note [factored norm Jacobian])."""

    def __init__(self, norm: NormSpec | None, X: Tensor) -> None:
        T, d = X.shape
        self.d = d
        if norm is None or norm.kind is NormKind.NONE:
            self.a = torch.ones(T, d, dtype=torch.float64)
            self.Q = torch.zeros(T, d, 0, dtype=torch.float64)
            self.s = self.sigma = None
        else:
            if norm.kind is NormKind.BALL:
                raise InputError("the exact-Jacobian route does not cover Pi_norm; the product route does")
            lay = norm.kind is NormKind.LAYERNORM
            Z, sig_hat, self.sigma = centre_tokens(X, lay)  # sigma certified low, for the floors
            self.s = root_sq_plus(sig_hat, float(norm.eps))
            u = Z / (math.sqrt(d) * self.s[:, None])
            cols = ([torch.full((T, d), 1.0 / math.sqrt(d), dtype=torch.float64)] if lay else []) + [u]
            self.Q = torch.stack(cols, dim=2)
            g = _f64(norm.weight)[None, :] if norm.weight is not None else torch.ones(1, d, dtype=torch.float64)
            self.a = g / self.s[:, None]
        self.amax = self.a.abs().max(dim=1).values * (1 + 4 * _U)
        # THEORY F98: ||D|| <= max|a| ||I - Q Q^T||; I - Q Q^T has the eigenvalues 1 off Q's columns and 1 - lambda on
        # them (lambda those of Q^T Q, >= 0), so its norm is at most max(1, lambda_max(Q^T Q) - 1) <= max(1, ||Q||_F^2 - 1)
        fq = (self.Q * self.Q).sum(dim=(1, 2)) * (1 + (2 * d + 4) * _U)
        self.spec = self.amax * torch.clamp(fq - 1, min=1.0) * (1 + 1e-12)
        # ||D||_F^2 = sum_k a_k^2 ||e_k - Q q_k||^2 = sum_k a_k^2 (1 - 2 |q_k|^2 + q_k^T (Q^T Q) q_k)
        QtQ = self.Q.transpose(1, 2) @ self.Q
        rows = 1 - 2 * (self.Q * self.Q).sum(-1) + ((self.Q @ QtQ) * self.Q).sum(-1)
        # a token whose max|a| is outside [2^-400, 2^400] sums its squares at a power of two (exact; they flushed to 0
        # below 2^-537 and left ||D||_F at its 1e-12 floor); the others are the very same floats
        m = self.a.abs().amax(dim=1)
        ex = pow2_exponent(m, 400)
        a = torch.ldexp(self.a, -ex[:, None])
        self.fro = (torch.ldexp(torch.sqrt((a * a * rows.clamp(min=0.0)).sum(-1)), ex) * (1 + 1e-9)
                    + self.amax * math.sqrt(d) * 1e-12)
        self.err = norm_jacobian_error(norm, X, formed=False)  # ||D - D_true||, THEORY F17f

    def dense(self, idx: Tensor | None = None) -> Tensor:
        """The formed ``D`` (for the tokens ``idx``), for callers that need single rows."""
        a, Q = (self.a, self.Q) if idx is None else (self.a[idx], self.Q[idx])
        C = torch.eye(self.d, dtype=torch.float64)[None] - Q @ Q.transpose(1, 2)
        return a[:, :, None] * C

    def left(self, X: Tensor) -> tuple[Tensor, Tensor]:
        """``D X`` (T, d, m) and its rounding bound (T,) (Frobenius).
        Norms at powers of two (``pow2_norm``, THEORY F96)."""
        out = X - self.Q @ (self.Q.transpose(1, 2) @ X)
        out = out * self.a[:, :, None]
        return out, 4 * (self.d + 8) * _U * self.amax * pow2_norm(X, (1, 2))

    def right(self, X: Tensor) -> tuple[Tensor, Tensor]:
        """``X D`` (T, m, d) and its rounding bound (T,) (Frobenius).
        Norms at powers of two (``pow2_norm``, THEORY F96)."""
        Xa = X * self.a[:, None, :]
        out = Xa - (Xa @ self.Q) @ self.Q.transpose(1, 2)
        return out, 4 * (self.d + 8) * _U * self.amax * pow2_norm(X, (1, 2))

    def sandwich(self, S: Tensor, err: Tensor) -> tuple[Tensor, Tensor]:
        """``D S D^T`` per token and its error bound (spectral) when ``S`` is known to within ``err``:
        ``(||D|| + e_D)^2 err + (2 ||D|| + e_D) e_D ||S|| + rounding``, ``||D|| <= ||D||_F``, the same
        propagation as the dense ``_sandwich``.
        Norms at powers of two (``pow2_norm``, THEORY F96)."""
        Q = self.Q
        Y1 = S @ Q
        Y2 = S.transpose(1, 2) @ Q
        R = Q.transpose(1, 2) @ Y1
        Zm = Y2 - Q @ R.transpose(1, 2)
        out = torch.baddbmm(S, Q, Zm.transpose(1, 2), alpha=-1.0)
        out = torch.baddbmm(out, Y1, Q.transpose(1, 2), alpha=-1.0)
        out = out * self.a[:, :, None] * self.a[:, None, :]
        nS = pow2_norm(S, (1, 2))
        nA, eA = torch.minimum(self.fro, self.spec), self.err
        new = (nA + eA) ** 2 * err + (2 * nA + eA) * eA * nS + 20 * (self.d + 8) * _U * self.amax**2 * nS
        return out, new


def _chain_output_norms(n1, IF: Tensor, n2, nIF: Tensor, heads, errs) -> list:  # noqa: ANN001
    """Post-LN: ``[(H, T), (T,)]`` certified ``||M W_O^hT||`` and ``||M W_O^T||`` for ``M = D1``,
    ``(I + F) D1`` and ``D2 (I + F) D1``, from one chain ``D1 W_O^T -> (I + F) . -> D2 .`` (one dense
    product instead of three; Note [factored norm Jacobian]).  ``errs``: per ``M`` the bound on its
    factored value against the true one (spectral); each product's rounding is added per head
    (``gamma_d ||I + F||_F ||X||_F`` for the dense one, F32 for the factored ones).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    Wo_all = torch.cat([hd[6] for hd in heads], dim=0)  # (H dh, d)
    H, dh = len(heads), heads[0][6].shape[0]
    T, d = IF.shape[0], IF.shape[1]
    hf = lambda Xs: pow2_norm(Xs.reshape(T, d, H, dh), (1, 3)).T  # noqa: E731  (H, T) per-head Frobenius
    nWh = pow2_norm(Wo_all.reshape(H, dh, d), (1, 2))[:, None]  # (H, 1)
    nW = float(pow2_norm(Wo_all))
    X1, _ = n1.left(Wo_all.T.expand(T, d, H * dh))
    r1h = 4 * (d + 8) * _U * n1.amax[None, :] * nWh
    r1 = 4 * (d + 8) * _U * n1.amax * nW
    X2 = IF @ X1
    nIFf = pow2_norm(IF, (1, 2))
    g = (d + 2) * _U / (1 - (d + 2) * _U)
    r2h = nIF[None, :] * r1h + g * nIFf[None, :] * hf(X1)
    r2 = nIF * r1 + g * nIFf * pow2_norm(X1, (1, 2))
    X3, _ = n2.left(X2)
    nD2 = n2.amax * (1 + 1e-12)  # ||diag(a) (I - Q Q^T)|| <= max|a| (1 + |e . u|)
    r3h = nD2[None, :] * r2h + 4 * (d + 8) * _U * n2.amax[None, :] * hf(X2)
    r3 = nD2 * r2 + 4 * (d + 8) * _U * n2.amax * pow2_norm(X2, (1, 2))
    out = []
    for Xc, (rh, rf), e in zip((X1, X2, X3), ((r1h, r1), (r2h, r2), (r3h, r3)), errs):
        per = certified_spectral(Xc.reshape(T, d, H, dh).permute(2, 0, 1, 3).reshape(H * T, d, dh)).reshape(H, T)
        per = (per + rh + e[None, :] * nWh) * (1 + 1e-12)
        out.append((per, (certified_spectral(Xc) + rf + e * nW) * (1 + 1e-12)))
    return out
