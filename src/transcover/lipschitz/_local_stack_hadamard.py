"""The attention's ``a c w`` term of all heads as one Hadamard Gram, certified on the ball (issue 12; THEORY F68).

F44b bounds the term ``sum_j P_j a_j c_j W_V^T y_j`` of F35a's second derivative per head at every point of the
ball, and F50/F53 join the heads only through the output direction.  With both tangents rows of the prefix
(``Delta_m = L_m alpha_m``, ``L_m L_m^T = Q_m``), every score change is ``phi_r . alpha`` for one functional per
(head, key) ``r`` (F65a), so the term of all heads through ``W_O`` is the trilinear form
``sum_r (phi_r . alpha)(phi_r . beta)(zeta_r . u)``, bounded by one ``HT x HT`` Hadamard Gram per query (F65b).  That
holds at X; along the segment ``X -> X + t Delta`` the form moves by its first derivative along the move, bounded per
head by F44b's factors on the ball (F68b): a third-order rest, small where the scores move little.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_ffn2 import _in_range
from ._local_jacobian import certified_lmax, pow2_norm
from ._rounding import _gamma

__all__ = ["phi_rows", "zeta_rows", "hadamard_acw", "acw_drift", "acw_bound"]

_U = 2.0**-53


def _fro(A: Tensor) -> float:
    """Frobenius norm at a power of two (``pow2_norm``, THEORY F81d), padded up for its own float64 sum."""
    return float(pow2_norm(A, tuple(range(A.dim())))) * (1 + (A.numel() + 2) * _U)


def phi_rows(heads, i: int, scale: float) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    r"""``(V, eV)`` for query ``i`` (THEORY F65a, F68a): ``V`` (H T, T, d) the formed blocks ``v_{hj,m}`` of the score
    functionals, ``a_hj = sum_m v_{hj,m} . Delta_m`` the centred score change of key j along the rows ``Delta``,

    .. math:: v_{hj,m} = [m = i]\,\kappa_{hj} + ([m = j] - P_{hm})\,q_{hi},\quad \kappa_{hj} = G_h y_{hij},

    and ``eV`` (H T, T) ``>= ||v* - v||`` per block: ``kappa``'s product within ``gamma scale ||y|| ||W_K||_F ||W_Q||_F``,
    ``(delta - P) q`` within ``gamma |delta - P| ||q||`` (``P``, ``y``, ``q``: ``_head_data``'s, the data).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    V, eV = [], []
    for P, Y, q, Wq, Wk, _, _ in heads:
        T, d = Y.shape[1], Y.shape[2]
        C = torch.eye(T, dtype=torch.float64) - P[i][None, :]  # C[j, m] = [m = j] - P_im
        v = C[:, :, None] * q[i][None, None, :]
        kap = scale * (Y[i] @ Wk) @ Wq.T
        v[:, i] = v[:, i] + kap
        g = _gamma(2 * d + 6)
        e = g * C.abs() * float(pow2_norm(q[i]))
        e[:, i] = e[:, i] + g * scale * pow2_norm(Y[i], 1) * _fro(Wk) * _fro(Wq)
        V.append(v)
        eV.append(e)
    return torch.cat(V), torch.cat(eV)


def zeta_rows(heads, i: int, MO: Tensor) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    r"""``(Z, eZ)`` for query ``i`` (THEORY F65a, F68a): ``Z`` (H T, m) the formed ``zeta_hj = P_hij MO_h W_V^hT y_hij``
    (``MO`` (m, H dh) the map after the heads as stored: ``W_O^T``, ``M_i(x) W_O^T`` or the identity), ``eZ`` (H T,)
    ``>= ||zeta* - zeta||`` for that map: ``gamma_{m+dh+3} P ||y|| ||W_V||_F ||MO_h||_F`` (the map's own error is
    ``acw_bound``'s).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    Z, eZ = [], []
    for h, (P, Y, _, _, _, Wv, _) in enumerate(heads):
        dh = Wv.shape[1]
        MOh = MO[:, h * dh:(h + 1) * dh]
        Z.append(P[i][:, None] * ((Y[i] @ Wv) @ MOh.T))
        eZ.append(_gamma(MO.shape[0] + dh + 3) * P[i] * pow2_norm(Y[i], 1) * _fro(Wv) * _fro(MOh))
    return torch.cat(Z), torch.cat(eZ) * (1 + 1e-12)


def _gram_phi(V: Tensor, eV: Tensor, Qs: Tensor, eQ: Tensor) -> tuple[Tensor, float]:
    r"""``(S, eS)``: ``Gamma_phi = sum_m V_m Q_m V_m^T`` as formed (symmetrised) and ``eS >= ||Gamma_phi* - S||_F`` for the
    exact blocks and ellipsoids (``Q*_m`` within ``eQ_m`` of ``Qs_m``, Frobenius): per block
    ``gamma_{2d+T+2} ||V_m||_F^2 ||Q_m||_F + ||V_m||_F^2 eQ_m + (2 ||V_m||_F ||eV_m|| + ||eV_m||^2)(||Q_m||_F + eQ_m)``,
    plus ``u ||S||_F`` for the symmetrisation (THEORY F68a).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = Qs.shape[0], Qs.shape[1]
    S = torch.einsum("rme,sme->rs", torch.einsum("rmd,mde->rme", V, Qs), V)
    S = 0.5 * (S + S.T)
    fV = pow2_norm(V, (0, 2)) * (1 + (V.shape[0] * d + 2) * _U)
    fE = pow2_norm(eV, 0) * (1 + (V.shape[0] + 2) * _U)
    fQ = pow2_norm(Qs, (1, 2)) * (1 + (d * d + 2) * _U)
    per = _gamma(2 * d + T + 2) * fV**2 * fQ + fV**2 * eQ + (2 * fV * fE + fE**2) * (fQ + eQ)
    return S, (float(per.sum()) + _U * _fro(S)) * (1 + 1e-12)


def _psd_lmax(B: Tensor, eB: float) -> float:
    r"""Certified ``lambda_max(B*)`` for a PSD ``B*`` within ``eB`` (Frobenius) of the symmetric ``B``: F32's certified
    ``lambda_max`` of ``B + s I``, ``s = 2 eB + 2u max|B_ii|`` (the stored shift makes it PSD and covers ``eB``)."""
    s = 2 * eB + 2 * _U * float(B.diagonal().abs().max())
    Bs = B + s * torch.eye(B.shape[0], dtype=torch.float64)
    return float(certified_lmax(Bs[None])[0])


def hadamard_acw(V: Tensor, eV: Tensor, Z: Tensor, eZ: Tensor, Qs: Tensor, eQ: Tensor) -> float:
    r"""Certified ``>= sup sum_r (phi_r . alpha)(phi_r . beta)(zeta_r . u)`` over unit ``u`` and ``||alpha_m||,
    ||beta_m|| <= 1`` (every row in its ellipsoid) for one query: THEORY F65b, F68a,

    .. math:: T\,\lambda_{\max}\big(\Gamma_\phi^{1/2} (\Gamma_\zeta \circ \Gamma_\phi) \Gamma_\phi^{1/2}\big)^{1/2}

    (``Gamma_phi = Phi Phi^T`` from ``phi_rows``, ``Gamma_zeta = Z Z^T`` from ``zeta_rows``).  Certified through a factor
    ``C`` of the formed ``Gamma_phi`` (``eigh``; any ``C`` serves): ``Gamma_phi* <= C C^T + eta I`` with
    ``eta >= ||Gamma_phi* - C C^T||_F``, so with ``K* = Gamma_zeta* o Gamma_phi*`` (PSD, Schur)
    ``lambda <= lambda_max(C^T K* C) + eta lambda_max(K*)``; ``K*`` within ``eK = eZ2 (||S||_F + eS) + ||Gz||_F eS +
    u ||K||_F`` of the formed (``||A o B||_F <= ||A||_F ||B||_F``), ``C^T K* C`` within
    ``gamma_{2n+2} ||C||_F^2 ||K||_F + ||C||_F^2 eK + u ||C^T K C||_F`` (``_psd_lmax``), ``lambda_max(K*) <= ||K||_F + eK``.
    Assumptions: F65a's (post-LN dot attention at X, rows of the prefix in ``E(Q*_m)``); ``V``, ``Z``, ``Qs`` each 0 or
    with its largest entry in [2^-100, 2^100] (``_in_range``: the products, degree 8 in them, and the relative pads stay
    in float64's normal range), else ``inf`` (red23-1: a prefix x 2^-500 underflowed to 0, an overflowed one raised)."""
    if not all(_in_range(A) for A in (V, Z, Qs)):
        return math.inf
    T = Qs.shape[0]
    S, eS = _gram_phi(V, eV, Qs, eQ)
    fZ, fEZ = _fro(Z), _fro(eZ)
    Gz = Z @ Z.T
    eGz = _gamma(Z.shape[1] + 2) * fZ**2 + 2 * fZ * fEZ + fEZ**2
    K = Gz * S
    eK = (eGz * (_fro(S) + eS) + _fro(Gz) * eS + _U * _fro(K)) * (1 + 1e-12)
    ev, U = torch.linalg.eigh(S)
    C = U * ev.clamp(min=0.0).sqrt()[None, :]
    n = S.shape[0]
    fC2 = _fro(C) ** 2
    eta = (_fro(C @ C.T - S) + _gamma(n + 3) * (fC2 + _fro(S)) + eS) * (1 + 1e-12)
    B = C.T @ K @ C
    B = 0.5 * (B + B.T)
    eB = (_gamma(2 * n + 2) * fC2 * _fro(K) + fC2 * eK + _U * _fro(B)) * (1 + 1e-12)
    lam = (_psd_lmax(B, eB) + eta * (_fro(K) + eK)) * (1 + 1e-12)
    out = T * math.sqrt(lam) * (1 + 1e-10)
    return out if math.isfinite(out) else math.inf


def acw_drift(hs, sg: dict, se: dict, scale: float) -> Tensor:  # noqa: ANN001
    r"""(T,) per query ``>= sup_Z ||D_gamma [sum_j P_j a_j c_j W_V^T y_j](Z)||`` of one head: the derivative along a move
    ``gamma`` (rows in side ``sg``'s family) of the ``a c w`` term with both tangents in side ``se``'s (the prefix's
    ellipsoids), at every Z of the ball of ``hs = head_sides(sg, se, ...)`` (THEORY F68b):

    .. math:: \hat c_\gamma t_3 + 2\,(2\chi + A_\gamma A) A s_V + A^2 (2 \max_j\mu_{V\gamma,j} + A_\gamma s_V),

    ``t_3 = min(A c s_V, A^2 w^)`` (F44b's bound of the term), ``chi = scale (mu_Qg,i max_j mu_K,j + mu_Q,i max_j
    mu_Kg,j)``: ``D P'_j = P'_j a_gamma,j``; ``D a_j = (D^2 s_j)_centred - sum_m P'_m a_gamma,m a_m`` with
    ``|D^2 s_j| <= chi`` (the scores are bilinear); ``D W_V^T (z_j - zbar) = W_V^T (gamma_j - sum P' gamma) - sum_m P'_m
    a_gamma,m W_V^T (z_m - zbar)``; each sum by Cauchy-Schwarz in ``L^2(P')``.  Padded ``1 + 1e-10``."""
    Ag, cg, _, qg, _ = hs.one
    A, c, _, q, _ = hs.two
    sV, what = hs.sV, hs.what
    mKe, mKg, mVg = (math.sqrt(float(sd[k].max())) for sd, k in ((se, "mK2"), (sg, "mK2"), (sg, "mV2")))
    t3 = torch.minimum(A * c * sV, A * A * what)
    chi = scale * (qg * mKe + q * mKg)
    out = (cg * t3 + 2 * (2 * chi + Ag * A) * A * sV + A * A * (2 * mVg + Ag * sV)) * (1 + 1e-10)
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


def acw_bound(heads, i: int, scale: float, MO: Tensor, eMO: float, Qs: Tensor, eQ: Tensor) -> float:  # noqa: ANN001
    r"""F68a for query ``i`` through the exact map ``MO*`` known as ``MO`` (m, H dh) within ``eMO`` (spectral):
    ``hadamard_acw`` through ``MO`` plus ``eMO`` times it through the identity of the heads' value space
    (``MO* zeta^ = MO zeta^ + (MO* - MO) zeta^``: the second form's output direction ``(MO* - MO)^T u`` has norm at most
    ``eMO``; there the heads' values lie in disjoint coordinates, so their Gram is block-diagonal)."""
    V, eV = phi_rows(heads, i, scale)
    out = hadamard_acw(V, eV, *zeta_rows(heads, i, MO), Qs, eQ)
    if eMO > 0:
        eye = torch.eye(MO.shape[1], dtype=torch.float64)
        out = (out + eMO * hadamard_acw(V, eV, *zeta_rows(heads, i, eye), Qs, eQ)) * (1 + 1e-12)
    return out
