"""Direction-aware certified Taylor rests of the norm and FFN sub-stages of the whole stack (issue 12; THEORY F79).

A sub-stage ``f_s`` at its input ``x_s`` moved by ``Delta = a + e`` (``a = P_s(X) delta`` a row of the exact prefix
applied to a network move, every ``||delta_j|| <= rho``; ``||e_i|| <= E_i`` the move's part outside the prefix's
rows) has the Taylor rest ``R_s = int_0^1 (1 - t) D^2 f_s(x_s + t Delta)[Delta, Delta] dt``, so ``||R_{s,i}||`` is at
most half the sup of the integrand on the segment.  The rows here bound that integrand with the move's shape:

* a LayerNorm/RMSNorm ``gamma * N(P x) + beta``: the curvature of ``N`` is ``-||e_perp||^2 n - 2 a e_perp`` (F43a),
  the radial component ``a`` and the gamma-weighted tangent component read through the prefix's row ellipsoid
  (F40a) of the *centred* blocks (the norm reads ``P Delta`` only), ``||gamma * n||`` for ``max|gamma|``;
* a post-LN FFN ``h + W_2^T GELU(W_1^T h + b_1)``: ``1/2 W_2^T (GELU''(z) o (W_1^T Delta)^2)`` through F40b's
  ellipsoid norms (``NQ``, ``NQm``, ``N2``) and a third-order rest through the units' reaches (F62's ``K2``, ``g``).

Every function is pure; the caller keeps ``min(old, new)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import _rounding
from ._local_ffn2 import gelu3_sup
from ._local_jacobian import certified_lmax, gelu_second_sup, pow2_norm
from ._local_stack_aligned import ellipsoid_gram
from ._rounding import _gamma

__all__ = ["NormForms", "norm_move_forms", "norm_rest_rows", "ffn_rest_rows"]

GRID = 32  # F79b: pieces of the radial component's range


class NormForms(NamedTuple):
    """Radius-free per-token forms of one norm sub-stage (``norm_move_forms``), all (T,) float64 except ``gmax``, ``d``."""

    zn: Tensor  # <= ||Z_i|| (the computed centred token, real norm)
    zerr: Tensor  # >= ||Z_i - P x_i|| (computed against the exact centring of the stored floats)
    gz: Tensor  # >= ||gamma o Z_i||
    lam: Tensor  # >= sup ||P a||^2 over a in the row's ellipsoid (rho = 1)
    tn: Tensor  # >= sup |n_i . P a| (n_i = Z_i / ||Z_i||)
    lg: Tensor  # >= sup ||gamma o (I - n_i n_i^T) P a||
    ec: Tensor  # >= sum_j ||P B_ij - C_ij||_F, the formed centred blocks' rounding (a free move part per unit rho)
    gmax: float
    d: int


def _centred(B: Tensor, lay: bool) -> tuple[Tensor, Tensor]:
    """(``C``, ``ec``): the blocks ``B`` (T_out, T_in, d, d) centred over the output coordinate (LayerNorm; RMSNorm
    unchanged) and per output row ``sum_j`` of a Frobenius bound on the centring's rounding, ``2 gamma_{d+2} d
    max|B_ij|`` (each entry of ``fl(B - mean B)`` within ``2 gamma_{d+2} max|B_ij|`` of the exact one)."""
    if not lay:
        return B, torch.zeros(B.shape[0], dtype=torch.float64)
    d = B.shape[2]
    C = B - B.mean(dim=2, keepdim=True)
    ec = (2 * _gamma(d + 2) * d * B.abs().amax(dim=(2, 3))).sum(dim=1) * (1 + 1e-12)
    return C, ec


def _centre_err(X: Tensor, Z: Tensor, lay: bool) -> Tensor:
    """(T,) ``>= ||Z_i - P x_i||`` for ``Z`` the two-pass centring of ``X`` (``centre_tokens``; F17e): ``sqrt(d)
    gamma_{d+3} max|Z1| + gamma_1 ||Z||``; 0 for RMSNorm (``Z = X``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    if not lay:
        return torch.zeros(X.shape[0], dtype=torch.float64)
    d = X.shape[1]
    Z1 = X - X.mean(dim=1, keepdim=True)
    return (math.sqrt(d) * _gamma(d + 3) * Z1.abs().amax(dim=1) + _gamma(1) * pow2_norm(Z, 1)) * (1 + 1e-12)


def _lmax_sym(M: Tensor, err: Tensor) -> Tensor:
    """(T,) certified ``lambda_max`` of the exact PSD matrices within ``err`` (spectral) of the formed batch ``M``,
    symmetrised first (``u ||M||_F`` more).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    S = 0.5 * (M + M.transpose(1, 2))
    return certified_lmax(S) + err + _rounding._U * pow2_norm(M, (1, 2))


def norm_move_forms(blocks: Tensor, X: Tensor, gamma: Tensor, lay: bool) -> NormForms:
    r"""Radius-free forms of a norm sub-stage at its stored input ``X`` (T, d) for moves ``a_i = sum_j B_ij delta_j``
    (``blocks`` (T, T, d, d) the computed prefix's blocks, ``||delta_j|| <= 1``), THEORY F79a:

    * ``lam >= lambda_max(Q*_i)``, ``Q*_i`` the ellipsoid (F40a, ``ellipsoid_gram``) of the *centred* blocks ``C_ij``
      (``P a = sum_j C_ij delta_j`` up to ``ec``), so ``||P a_i|| <= sqrt(lam_i) + ec_i``;
    * ``tn >= sum_j ||B_ij^T P n_i|| >= |n_i . P a_i|`` (exact for the sup), ``n_i = Z_i / ||Z_i||``;
    * ``lg >= lambda_max(M_i Q*_i M_i^T)^{1/2}``, ``M_i = diag(gamma)(I - n_i n_i^T)``, so
      ``||gamma o (I - n n^T) P a_i|| <= lg_i + max|gamma| ec_i``.

    Rounding: ``Q`` within ``eQ`` (``ellipsoid_gram``); ``M Q M^T`` formed within ``||M||_F^2 (eQ + gamma_{2d+2}
    ||Q||_F)``; the formed ``M`` within ``eM = 8 (d + 4) u max|gamma|`` of the exact one (``n`` to ``(d + 4) u``,
    the outer product and the scaling to ``u`` each), which moves ``lg`` by ``eM (lam)^{1/2}``; ``tn``'s matvecs
    ``(1 + 2(d + 2)u)`` relative plus ``1e-12 sum_j ||B_ij||_F`` for the formed ``P n``; norms of ``Z``
    ``(d + 4)``-fold relative, downward for ``zn``, upward for ``gz``.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = X.shape
    Z = X - X.mean(dim=1, keepdim=True) if lay else X
    Z = Z - Z.mean(dim=1, keepdim=True) if lay else Z  # centre_tokens' two passes
    g = gamma.to(torch.float64)
    gmax = float(g.abs().max())
    zn = pow2_norm(Z, 1) * (1 - 2 * (d + 4) * _rounding._U)
    gz = pow2_norm(g * Z, 1) * (1 + 3 * (d + 4) * _rounding._U)
    n = Z / pow2_norm(Z, 1)[:, None].clamp(min=1e-300)
    pn = n - n.mean(dim=1, keepdim=True) if lay else n
    fro = pow2_norm(blocks, (2, 3))
    tn = pow2_norm(torch.einsum("ijab,ia->ijb", blocks, pn), 2).sum(dim=1) * (1 + 2 * (d + 2) * _rounding._U) \
        + 1e-12 * fro.sum(dim=1)
    C, ec = _centred(blocks, lay)
    Qs, eQs = zip(*(ellipsoid_gram(C[i]) for i in range(T)))
    Q = torch.stack(Qs)
    eQ = torch.tensor(eQs, dtype=torch.float64)
    lam = _lmax_sym(Q, eQ)
    M = g[None, :, None] * (torch.eye(d, dtype=torch.float64)[None] - n[:, :, None] * n[:, None, :])
    fM = (M * M).sum(dim=(1, 2)) * (1 + 2 * d * d * _rounding._U)
    Y = M @ Q @ M.transpose(1, 2)
    eY = fM * (eQ + _gamma(2 * d + 2) * pow2_norm(Q, (1, 2))) * (1 + 1e-12)
    eM = 8 * (d + 4) * _rounding._U * gmax
    lg = (torch.sqrt(_lmax_sym(Y, eY)) + eM * torch.sqrt(lam)) * (1 + 1e-12)
    nan = lambda v: torch.nan_to_num(v, nan=math.inf, posinf=math.inf)  # noqa: E731
    return NormForms(zn, _centre_err(X, Z, lay), gz, nan(lam), nan(tn), nan(lg), ec, gmax, d)


def _curvature(u: Tensor, t: Tensor, Gn: Tensor, gw: Tensor, gmax: float, pieces: int = GRID) -> Tensor:
    r"""(T,) ``>= sup ||gamma o pi(-||e_perp||^2 n_hat - 2 a e_perp)||`` over ``|a| <= t``, ``||e_perp||^2 <= u^2 - a^2``
    (THEORY F79b): ``[0, t]`` cut into ``pieces`` equal pieces ``[a_k, a_{k+1}]``, on each ``p_k = u^2 - a_k^2`` and
    the smaller of ``p_k G_n + 2 a_{k+1} min(gmax sqrt(p_k), g_w)`` (triangle, gamma-weighted) and ``gmax (p_k^2 + 4
    a_{k+1}^2 p_k)^{1/2}`` (the two parts orthogonal, F43a), the largest over pieces.  Ends rounded outward ``4u``."""
    k = torch.arange(pieces + 1, dtype=torch.float64)[:, None] / pieces
    a = k * t[None, :]
    lo, hi = a[:-1] * (1 - 4 * _rounding._U), a[1:] * (1 + 4 * _rounding._U)
    p = ((u * u)[None, :] - lo * lo).clamp(min=0.0) * (1 + 4 * _rounding._U)
    tri = p * Gn[None, :] + 2 * hi * torch.minimum(gmax * p.sqrt(), gw[None, :].expand_as(p))
    quad = gmax * torch.sqrt(p * p + 4 * hi * hi * p)
    return torch.minimum(tri, quad).amax(dim=0)


def _unit_scale(zn: Tensor) -> tuple[Tensor, Tensor]:
    """(``s``, ``ok``) (T,): powers of two with ``s_i zn_i`` in ``[1/2, 1)`` (1 where ``zn`` is not finite or 0), and
    whether ``2^-450 <= zn_i <= 2^450`` (outside, the forms' float64 norms of the token may have under- or overflowed
    in their squares).  THEORY F80."""
    ok = torch.isfinite(zn) & (zn >= 2.0**-450) & (zn <= 2.0**450)
    _, ex = torch.frexp(torch.where(ok, zn, torch.ones_like(zn)))
    return torch.ldexp(torch.ones_like(zn), -ex), ok


def norm_rest_rows(f: NormForms, eps: float, rho: float, E: Tensor, r: Tensor, pad: float) -> Tensor:
    r"""(T,) rows ``>= ||R_{s,i}||`` of a LayerNorm/RMSNorm sub-stage's Taylor rest at the exact input ``x*`` (within
    ``pad`` of the stored ``X``) for every move ``Delta_i = a_i + e_i``, ``a = P_s(X) delta`` (``||delta_j|| <= rho``,
    the computed blocks of ``f`` within the free part), ``||e_i|| <= E_i`` (the caller's free part, with the
    prefix's rounding ``rho e_P``), ``||P Delta_i|| <= r_i``; THEORY F79b:

    .. math:: \|R_{s,i}\| \le \frac{\sqrt d}{2 s_2}\,\mathrm{curv}(u, t, G_n, g_w + t\,\kappa\,G_n)

    ``u = min(r, rho sqrt(lam) + E')``, ``E' = E + rho ec``, ``q = pad + zerr + u`` (how far ``P x* + tau P Delta``
    lies from ``Z``), ``c = zn - q``, ``G_n = min(gmax, (gz + gmax q)/c) >= ||gamma o n_tau||``, ``t = min(u, (zn (rho
    tn + E') + q u)/c) >= |n_tau . P Delta|``, ``g_w = min(gmax u, rho lg + gmax E' + gmax u q/zn)``, ``s_2 = c^2 + d
    eps``, ``kappa = min(1, d eps / s_2)``; inf where ``c <= 0``.  Floats: ``q`` up ``4u``, ``c`` and ``s_2`` down ``4u``
    relative, the result ``(1 + 1e-10)``; nan -> inf.  ``curv``: ``_curvature``, the two curvature terms with
    ``||e_perp||^2 + a^2 = ||P Delta||^2`` kept jointly.  Range (THEORY F80): every length (``zn``, ``zerr``, ``gz``,
    ``rho``, ``E``, ``r``, ``pad``) is first multiplied by the token's power of two ``s`` with ``s zn`` in ``[1/2, 1)``
    and ``eps`` by ``s^2`` (exact; the row is of degree 0 in them jointly), so no square or fourth power of a length
    under- or overflows; inf where ``zn`` is outside ``[2^-450, 2^450]``."""
    d = f.d
    sc, ok = _unit_scale(f.zn)  # F80: the rest is of degree 0 in (x, Delta, pad, sqrt(eps)); lengths of order one
    f = f._replace(zn=f.zn * sc, zerr=f.zerr * sc, gz=f.gz * sc)
    rho, E, r, pad = rho * sc, E * sc, r * sc, pad * sc
    eps = (eps * sc * sc).clamp(max=1e300)  # lower is the safe side: s_2 falls
    Ef = E + rho * f.ec
    u = torch.minimum(r, (rho * torch.sqrt(f.lam) + Ef) * (1 + 4 * _rounding._U))
    q = (pad + f.zerr + u) * (1 + 4 * _rounding._U)
    c = ((f.zn - q) * (1 - 4 * _rounding._U)).clamp(min=0.0)
    Gn = torch.clamp((f.gz + f.gmax * q) / c, max=f.gmax)
    t = torch.minimum(u, (f.zn * (rho * f.tn + Ef) + q * u) / c)
    gw = torch.minimum(f.gmax * u, rho * f.lg + f.gmax * Ef + f.gmax * u * q / f.zn)
    s2 = (c * c + d * eps) * (1 - 4 * _rounding._U)
    kappa = torch.clamp(d * eps / s2, max=1.0)
    out = math.sqrt(d) / (2 * s2) * _curvature(u, t, Gn, gw + t * kappa * Gn, f.gmax) * (1 + 1e-10)
    out = torch.where((c > 0) & ok, out, math.inf)
    return torch.nan_to_num(torch.where(u == 0, 0.0, out), nan=math.inf, posinf=math.inf)


def ffn_rest_rows(al, rho: float, E: Tensor, r: Tensor, pad: float) -> Tensor:  # noqa: ANN001
    r"""(T,) rows ``>= ||R_{s,i}||`` of a post-LN FFN sub-stage's Taylor rest ``F(x* + Delta) - F(x*) - J_F(x*) Delta``
    at the exact input ``x*`` (within ``pad`` of the stored ``H``) for ``Delta_i = a_i + e_i``, ``a = P_s(X) delta``
    in ``rho`` times the row's ellipsoid (F40a), ``||e_i|| <= E_i`` (the caller's free part, with ``rho e_P``),
    ``||Delta_i|| <= r_i``; THEORY F79c.  ``al`` the stage's ``FFNAligned`` (``nq``, ``nqm``, ``n2``, F62's ``(K2,
    Km2, g)``, ``const``, ``n1``, ``z``, ``ez`` at the stored ``H``).  With ``E' = E + pad`` (the centre's offset as a
    free move: ``R(x*, Delta) = R(H, Delta + p) + (J(H) - J(x*)) Delta - R(H, p)``):

    .. math:: \|R_i\| \le \tfrac12\big(NQ\,\rho^2 + 2 NQm\,\rho E' + N2\,E'^2\big)
              + \tfrac16 \|W_2\| \max_k(s_{3,k} m_k)\big(\sqrt{K2}\rho^2 + 2\sqrt{Km2}\rho E' + \sqrt{l_H} E'^2\big)
              + 2\varphi(0)\|W_2\|\sqrt{l_H}\, pad\,(r + pad)

    (``GELU(z* + s) - GELU(z*) - GELU'(z*) s = GELU''(z*) s^2/2 + eps``, ``|eps| <= s3 |s|^3/6``, ``|s_k| <= m_k =
    min(rho sqrt(g_k) + ||w1_k|| E', ||w1_k|| (r + pad))``, ``s3_k`` the sup of ``|GELU'''|`` on ``z_k +- (m_k + ez_k)``;
    ``||s o s|| = ||K (Delta (x) Delta)||``).  Sums of non-negative float64 products padded ``1e-12``; nan -> inf."""
    K2, Km2, g = al.third
    nW2, lH = al.const["nW2"], al.const["lH"]
    Ef = E + pad
    first = 0.5 * (al.nq * rho * rho + 2 * al.nqm * rho * Ef + al.n2 * Ef * Ef)
    m = torch.minimum(rho * g.sqrt() * (1 + 1e-15) + al.n1[None, :] * Ef[:, None],
                      al.n1[None, :] * (r + pad)[:, None]) * (1 + 1e-12)
    ez = torch.zeros_like(m) if al.ez is None else al.ez
    s3m = (gelu3_sup(al.z - m - ez, al.z + m + ez) * m).amax(dim=1)
    third = nW2 * s3m / 6 * (K2.sqrt() * rho * rho + 2 * Km2.sqrt() * rho * Ef + math.sqrt(lH) * Ef * Ef)
    centre = gelu_second_sup() * nW2 * math.sqrt(lH) * pad * (r + pad)
    out = (first + third + centre) * (1 + 1e-12)
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)
