"""The attention's reach through the prefix with one output direction for all heads (issue 12; THEORY F50).

F44c bounds each head's reach ``||z_h||`` before ``W_O`` at its own worst direction and combines the heads through
``W_O`` (F35d, F44g), which on MiniLM costs 10-15x over the heads.  Every term of F44b's sup is a coefficient (the
score-change moments ``A``, ``c``, the key and query projections) times a *value-side* factor, and for a fixed output
direction ``u`` (the head sees ``u_h = W_O^h M^T u``, ``M`` the map after the sublayer) each value-side factor is a
seminorm ``(u_h^T K u_h)^{1/2}`` of the head's values: their P-covariance (``C``), ``W_V^T W_V`` (``N``) or the
values of the prefix's ellipsoids (``E``, ``W_V^T (sum_j P_ij Q_j) W_V``), plus a remainder proportional to
``||u_h||``.  Then F47's weighted Cauchy-Schwarz over the heads gives one ``lambda_max`` per query.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_drift import heads_joint
from ._local_jacobian import certified_lmax, pow2_norm
from ._local_rows import _heads_combined
from ._local_stack_attn import HeadSides, head_sides
from ._rounding import _gamma

__all__ = ["KINDS", "aligned_hessian_terms", "value_cores", "joint_basis", "joint_reach", "block_lmax"]

_U = 2.0**-53
KINDS = ("C", "N", "E")  # the value-side seminorms: P-covariance, W_V^T W_V, the ellipsoids' values


def aligned_hessian_terms(s1: dict, s2: dict, m: dict, rho: float, nG: float, nV: float, nQ: float, nK: float,
                          scale: float, ball1: bool, ball2: bool, query: bool = True, acw: bool = True,
                          hs: HeadSides | None = None) -> dict:
    r"""Per query (T,) coefficients ``c_C, c_N, c_E, c_1`` such that for every ``Z`` in ``B(X, rho)``, tangents as in
    ``aligned_hessian_sup`` (rows of ``Delta`` in side ``s1``'s family, of ``E`` in ``s2``'s; ``ball1``/``ball2``: the
    side is the unit ball) and every ``v`` in the head's value space (THEORY F50a):

    .. math:: v\cdot H_i(Z)[\Delta, E] \le c_C\,n_C(v) + c_N\,n_N(v) + c_E\,n_E(v) + c_1\|v\|,

    ``n_K(v) = (v^T K v)^{1/2}`` with ``K_C = sum_j P_ij v_ij v_ij^T`` (``v_ij = W_V^T y_ij``), ``K_N = W_V^T W_V``,
    ``K_E = W_V^T (sum_j P_ij Q_j) W_V``.  Term by term (F44b with the value factor kept as a function of ``v``):
    ``A_1 sigma_2(v) + A_2 sigma_1(v)`` with ``sigma(v)^2 <= sum_j (P_j + a_j)(v . W_V^T e_j)^2``: ``n_N(v)^2`` for the
    ball, ``n_E(v)^2 + sum_j a_j mu_V,j^2 ||v||^2`` for the ellipsoids; the ``a c w`` and cross terms as a coefficient
    ``k_S`` times ``s_V(v) = (sum_j P'_j (v . W_V^T y'_j)^2)^{1/2} <= kappa n_C(v) + alpha ||v|| + rho n_N(v)`` (second
    moment about X's mean, Minkowski; ``kappa = (1 + max a/P)^{1/2}``, ``alpha = 0``, or ``kappa = 1``,
    ``alpha = (sum_j a_j ||v_j||^2)^{1/2}``, whichever is smaller at the head's own sup), or F44b's ``A_1 A_2 w^`` in
    ``c_1`` where the head's own bound takes that branch.  All padded ``1 + 1e-10``.  ``query=False`` leaves the query
    part ``lambda_max(sum_j P'_j g_ij g_ij^T)^{1/2}`` of each ``A`` out of the seminorm coefficients (``c_E``, ``c_N``;
    F53 bounds it jointly over the heads), the ``||v||`` part of ``sigma(v)`` keeping the whole ``A``.  ``acw=False``
    leaves the ``a c w`` term out (F68 bounds it for all heads at once).  ``hs``: ``head_sides`` of these arguments
    when the caller holds it (the same floats, THEORY F83b)."""
    P = m["P"]
    hs = head_sides(s1, s2, m, rho, nG, nV, nQ, nK, scale) if hs is None else hs
    (A1, c1, _, q1, k1), (A2, c2, _, q2, k2) = hs.one, hs.two
    a, ratio, sV, what = hs.a, hs.ratio, hs.sV, hs.what
    x = torch.minimum(A1 * c2, A2 * c1) if acw else torch.zeros_like(A1)
    on = x * sV <= A1 * A2 * what  # the branch the head's own F44b bound takes
    zero = torch.zeros_like(x)
    kS = torch.where(on, x, zero) + scale * (q2 * k1 + q1 * k2)
    c = {"C": zero, "N": kS * rho, "E": zero, "1": torch.where(on, zero, A1 * A2 * what)}
    kap = torch.sqrt((1 + ratio) * (1 + 1e-12))
    alpha = torch.sqrt((a * m["vn"] * m["vn"]).sum(dim=1) * (1 + 1e-12))
    by_ratio = (kap - 1) * torch.sqrt(m["lV"]) <= alpha
    c["C"] = kS * torch.where(by_ratio, kap, torch.ones_like(kap))
    c["1"] = c["1"] + kS * torch.where(by_ratio, zero, alpha)
    R1, R2 = hs.rest if not query else (A1, A2)
    for A, R, sd, ball in ((A1, R1, s2, ball2), (A2, R2, s1, ball1)):  # A_1 sigma_2 + A_2 sigma_1
        if ball:
            c["N"] = c["N"] + R
        else:
            c["E"] = c["E"] + R
            c["1"] = c["1"] + A * torch.sqrt(_pmean_plain(P, a, sd["mV2"]))
    return {k: torch.nan_to_num(v * (1 + 1e-10), nan=math.inf, posinf=math.inf) for k, v in c.items()}


def _pmean_plain(P: Tensor, a: Tensor, mV2: Tensor) -> Tensor:
    """(T,) ``sum_j a_ij mV2_j`` padded (the envelope's excess weight on the ellipsoids' value norms)."""
    return torch.where(P > 0, a * mV2[None, :], torch.zeros_like(P)).sum(dim=1) * (1 + 1e-12)


def value_cores(heads, MV: Tensor, eMV: Tensor) -> dict:  # noqa: ANN001
    r"""Radius-free cores (value-space matrices) of ``aligned_hessian_terms``' seminorms with Frobenius error bounds
    (THEORY F50b): ``"C"`` (H, T, dh, dh) ``V_i^T diag(P_i) V_i`` from the formed values ``V = Y W_V``, ``"N"`` (H, 1,
    dh, dh) ``W_V^T W_V``, ``"E"`` (H, T, dh, dh) ``sum_j P_ij M_hj`` from ``MV`` (H, T, dh, dh), the formed
    ``W_V^h^T Q_j W_V^h`` within ``eMV`` (H, T) of the exact; ``"err"`` per kind the matching (H, T) or (H, 1) bounds:
    each product's ``gamma`` times its ``|.|``-product's Frobenius norm (a Gram's: its trace) and ``E``'s
    ``sum_j P_ij eMV_hj``.  ``"epsV"`` (H,): the formed values' error ``gamma_{d+2} max ||y_ij|| ||W_V||_F``, so
    ``n_C(v) <= n-hat_C(v) + epsV ||v||`` (Minkowski in ``L^2(P)``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    C, N, E, eC, eN, eE, epsV = [], [], [], [], [], [], []
    for h, hd in enumerate(heads):
        P, Y, _, _, _, Wv, _ = hd
        T, d = P.shape[0], Y.shape[2]
        V = hd.values
        C.append(torch.einsum("ija,ij,ijb->iab", V, P, V))
        eC.append(_gamma(T + 2) * (P * (V * V).sum(dim=2)).sum(dim=1) * (1 + 1e-12))
        N.append((Wv.T @ Wv)[None])
        eN.append(torch.full((1,), _gamma(d + 2) * float((Wv * Wv).sum()) * (1 + 1e-12), dtype=torch.float64))
        Eh = torch.einsum("ij,jab->iab", P, MV[h])
        E.append(Eh)
        fM = pow2_norm(MV[h], (1, 2))
        eE.append((P @ eMV[h] + _gamma(T + 2) * (P @ fM)) * (1 + 1e-12))
        epsV.append(_gamma(d + 2) * float(pow2_norm(Y, 2).max()) * float(pow2_norm(Wv)) * (1 + 1e-12))
    st = torch.stack
    return {"C": st(C), "N": st(N), "E": st(E), "err": {"C": st(eC), "N": st(eN), "E": st(eE)},
            "epsV": torch.tensor(epsV, dtype=torch.float64)}


def joint_reach(coef: dict, cores: dict, MO: Tensor, eMO: Tensor, dh: int, per: Tensor, full: Tensor,
                Cw: Tensor | None = None, basis: dict | None = None) -> Tensor:
    r"""(T,) ``>= sup_u u . M_k sum_h W_O^hT z_h,k`` over unit ``u`` for head rows bounded as in ``coef`` (kind -> (H,
    T): ``z . v <= sum_K c_K n_K(v) + c_1 ||v||`` for every ``v``, ``aligned_hessian_terms``' form; ``"1"`` may hold
    the terms bounded only in norm), ``MO`` (T, d, H dh) the map's ``M_k W_O^T`` as formed within ``eMO`` (T,)
    (spectral) of the exact, ``per``, ``full`` the certified ``||M_k W_O^hT||``, ``||M_k W_O^T||`` (and ``Cw``,
    F35d's output-block norms for the norm-only part when ``M = I``).  With ``v_h = (M_k W_O^hT)^T u`` and weights
    ``w = c/nu > 0`` (``nu`` an uncertified estimate of ``lambda_max(MO_h K MO_h^T)^{1/2}``; any positive weights are
    valid), THEORY F50c:

    .. math:: \sum_{h,K} c_{hK} n_K(v_h) \le \Big(\sum_{h,K} c_{hK}^2/w_{hK}\Big)^{1/2}
              \lambda_{\max}\Big(\sum_h MO_h \big(\textstyle\sum_K w_{hK} K_h\big) MO_h^\top\Big)^{1/2},

    the ``c_1`` part (plus ``c_C epsV`` and every term whose estimate ``nu`` is zero) combined as F35d/F44g
    (``_heads_combined``).  Rounding: the block-diagonal core ``B`` as summed within ``sum w err + 4u sum w ||K||_F``;
    ``MO B MO^T`` within ``gamma_{2 H dh + 2} ||MO||_F^2 ||B||_F``, ``MO``'s error adds ``(2 ||MO|| eMO + eMO^2)
    ||B||_F`` and the cores' ``(||MO|| + eMO)^2 ||dB||_F``; symmetrisation ``4u ||G||_F``; the weighted sum
    ``(1 + (2 H |K| + 4) u)``, the roots ``1 + 1e-10``.  Refused (inf) for a token whose map is below ``2^-200``
    (Frobenius) or whose bound is below ``2^-900``: there underflow escapes the relative pads.  ``basis``:
    ``joint_basis(cores, MO, dh)`` when the caller holds it (the same floats, THEORY F83b)."""
    H, T = coef["C"].shape
    dev = {"dtype": torch.float64}
    basis = joint_basis(cores, MO, dh) if basis is None else basis
    alone = coef["1"] + coef["C"] * cores["epsV"][:, None]
    Wsq = torch.zeros(H, T, dh, dh, **dev)
    dB = torch.zeros(T, **dev)
    cs = torch.zeros(T, **dev)
    for K in KINDS:
        core, nu, fro, err = basis[K]
        ck = coef[K]
        on = (ck > 0) & (nu > 0) & torch.isfinite(ck)
        w = torch.where(on, ck / torch.where(on, nu, 1.0), 0.0)
        cs = cs + torch.where(on, ck * nu, 0.0).sum(dim=0)
        # a term left out of the Gram: c_K n_K(v) <= c_K (||K||_F + err) ||v||
        bound = torch.sqrt((fro + err) * (1 + 1e-12))
        alone = alone + torch.where(on | (ck == 0), 0.0, ck * bound)
        Wsq = Wsq + w[:, :, None, None] * core
        dB = dB + (w * (err + 4 * _U * fro)).sum(dim=0)
    lam, fMO = block_lmax(Wsq, dB, MO, eMO)
    main = torch.sqrt(cs * (1 + (2 * H * len(KINDS) + 4) * _U) * lam) * (1 + 1e-10)
    rest = _heads_combined(per, full, alone, None if Cw is None else heads_joint(Cw, alone))
    out = torch.nan_to_num((main + rest) * (1 + 1e-12), nan=math.inf, posinf=math.inf)
    # near float64's underflow the pads (relative to the Frobenius masses) do not hold: the branch is refused there
    return torch.where(((fMO > 0) & (fMO < 2.0**-200)) | (out < 2.0**-900), math.inf, out)


def joint_basis(cores: dict, MO: Tensor, dh: int) -> dict:
    """Per kind of ``joint_reach`` its coefficient-free parts: ``(core, nu, ||core||_F, err)`` (each (H, T) but the core
    (H, T, dh, dh)), ``nu`` the uncertified ``lambda_max(MO_h K MO_h^T)^{1/2}`` that sets F50c's weights (the top
    eigenvalue of ``K (MO_h^T MO_h)``), ``err`` the core's error bound.  THEORY F50c; formed once per map, F83b.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    H, T = cores["C"].shape[:2]
    MOh = MO.reshape(T, MO.shape[1], H, dh).permute(0, 2, 1, 3)  # (T, H, d, dh)
    OO = MOh.transpose(2, 3) @ MOh  # (T, H, dh, dh): MO_h^T MO_h
    out = {}
    for K in KINDS:
        core = cores[K].expand(H, T, dh, dh)
        nu = torch.linalg.eigvals(core @ OO.transpose(0, 1)).real.max(dim=-1).values.clamp(min=0.0).sqrt()
        out[K] = (core, nu, pow2_norm(core, (2, 3)), cores["err"][K].expand(H, T))
    return out


def block_lmax(Wsq: Tensor, dB: Tensor, MO: Tensor, eMO: Tensor) -> tuple[Tensor, Tensor]:
    r"""(T,) certified ``lambda_max(MO* B* MO*^T)`` for the exact block-diagonal core ``B*`` whose blocks ``Wsq``
    (H, T, dh, dh) are as summed within ``dB`` (T,) (Frobenius) and the exact map ``MO*`` within ``eMO`` (T,)
    (spectral) of the formed ``MO`` (T, d, H dh) (THEORY F50c): the certified eigenvalue (F32) of the formed,
    symmetrised product plus ``gamma_{2 H dh + 2} ||MO||_F^2 ||B||_F + (2 ||MO|| eMO + eMO^2) ||B||_F + (||MO|| + eMO)^2
    dB + 4u ||G||_F``; with ``||MO||_F`` (padded), for the callers' underflow refusal.  Every Frobenius norm at a power of
    two (``pow2_norm``): a map ``MO`` of entries ``2^-600`` had ``||MO||_F`` 0 from ``torch``'s norm, which let it past
    that refusal (``fMO > 0``) with its Gram flushed to 0."""
    H, T, dh, _ = Wsq.shape
    B = torch.zeros(T, H * dh, H * dh, dtype=torch.float64)
    for h in range(H):
        B[:, h * dh:(h + 1) * dh, h * dh:(h + 1) * dh] = Wsq[h]
    G = MO @ B @ MO.transpose(1, 2)
    G = (G + G.transpose(1, 2)) / 2
    fB = pow2_norm(B, (1, 2)) * (1 + 1e-12)
    fMO = pow2_norm(MO, (1, 2)) * (1 + 1e-12)
    err = (_gamma(2 * H * dh + 2) * fMO * fMO * fB + (2 * fMO * eMO + eMO * eMO) * fB + (fMO + eMO) ** 2 * dB
           + 4 * _U * pow2_norm(G, (1, 2)))
    return certified_lmax(G) + err * (1 + 1e-12), fMO
