"""The FFN's remainder on the first norm's reachable set, post-LN (issue 12; THEORY F54).

F34b bounds the second norm's input radius by ``r2 <= r g_pt + remG + R``, ``R`` a bound on the FFN's remainder
``P(F(h + dh) - F(h) - J_F dh)`` over every ``||dh|| <= r_h`` (the mean FFN drift times ``r_h``, F17c-F51a).  On the
ball the move is ``dh = a + rho`` with ``a`` the exact linear map at X (``a a^T <= r^2 Q``, ``Q`` the first norm's
weighted row Gram times ``sum_j w_j``, F40a) and ``||rho|| <= remH`` (F34b's remainder of H): the second-order part
is taken through that set (F40b's tensor norms), the rest per unit with its own reach (its weight through the
Taylor integral cut into pieces, F58).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import torch
from torch import Tensor

from ._local_ffn2 import (
    _GELU2_ABS_ERR, _weighted_lmax, _weighted_norm, centre_gelu2_err, ffn_second_norms, forms_in_range, gelu3_sup,
    split_row_norm2,
)
from ._local_jacobian import certified_lmax, gelu_second, pow2_norm
from ._local_stack_aligned import _hadamard_norm
from ._rounding import _gamma

__all__ = ["gelu2_range", "nested_beta", "ffn_reach_remainder", "ffn_reach_drift", "ffn_reach_drift_schur"]

_PHI0 = 1 / math.sqrt(2 * math.pi)
_U = 2.0**-53
# F58a: pieces of the Taylor integral's t in [0, 1] and bins of |s| in [0, R] (powers of two: the cuts exact)
NESTED_PIECES, NESTED_BINS = 16, 8


def gelu2_range(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(inf, sup) of ``GELU'' = phi(z)(2 - z^2)`` on each interval ``[a, b]`` (THEORY F54a): its extrema are ``2 phi(0)``
    at 0 and ``-2 phi(2)`` at ``+-2``, monotone in between, so the endpoint values and the extrema inside; each padded
    outward by ``_GELU2_ABS_ERR`` and a relative ``1e-12`` (the float64 evaluation)."""
    fa, fb = gelu_second(a), gelu_second(b)
    lo, hi = torch.minimum(fa, fb), torch.maximum(fa, fb)
    hi = torch.where((a <= 0) & (b >= 0), torch.full_like(hi, 2 * _PHI0), hi)
    two = ((a <= 2) & (b >= 2)) | ((a <= -2) & (b >= -2))
    lo = torch.where(two, torch.minimum(lo, torch.full_like(lo, -2 * math.exp(-2) * _PHI0)), lo)
    pad = lambda v: v.abs() * 1e-12 + _GELU2_ABS_ERR  # noqa: E731
    return lo - pad(lo), hi + pad(hi)


def nested_beta(z: Tensor, R: Tensor, ez: Tensor | float, eD: Tensor | float, pieces: int = NESTED_PIECES,
                bins: int = NESTED_BINS) -> Tensor:
    r"""Per unit, ``beta_k >= sup_{0 < |s| <= R0_k} |e_k(s)/s^2 - GELU''(z*_k)/2|`` (THEORY F58a), ``e_k(s) = GELU(z*_k + s) -
    GELU(z*_k) - GELU'(z*_k) s = s^2 int_0^1 (1 - t) GELU''(z*_k + t s) dt``, for the exact pre-activation ``z*`` within
    ``ez`` of ``z`` and ``R = R0 + ez``.  So ``e_k/s^2 - GELU''(z*)/2 = int_0^1 (1 - t)(GELU''(z* + t s) - GELU''(z*)) dt``;
    ``|s|`` cut into ``bins`` equal bins ``[S_m, S_{m+1}]``, ``t`` into ``pieces`` equal pieces ``[t_j, t_{j+1}]``: for s
    in bin m and t in piece j the argument lies in ``I_mj = [z - ez + t_j S_m, z + ez + t_{j+1} S_{m+1}]`` (s > 0, the
    mirror for s < 0), where ``GELU'' - GELU''(z*)`` lies in ``[L_mj, U_mj]``, ``U = min(hi - D + eD, s3 t_{j+1}
    S_{m+1})``, ``L = max(lo - D - eD, -s3 t_{j+1} S_{m+1})`` (``lo, hi`` the range of GELU'' on ``I_mj``,
    ``gelu2_range``; ``D`` the evaluated ``GELU''(z)``, within ``eD`` of ``GELU''(z*)``; ``s3`` the sup of ``|GELU'''|``
    between ``z*`` and the argument, on ``[z - ez, z + ez + t_{j+1} S_{m+1}]``, ``gelu3_sup``), so, piece by piece,

    .. math:: \beta_k = \max_{\pm, m} \max\Big(\sum_j w_j U_{mj}^\pm,\; -\sum_j w_j L_{mj}^\pm\Big),
              \quad w_j = \int_{t_j}^{t_{j+1}} (1 - t)\,dt

    (``sum_j w_j = 1/2``: one bin and one piece is F54b's range bound).  Rounding: ``t_j``, ``w_j`` and ``S_m / R``
    exact (dyadic), each interval's ends widened by ``4u(|z| + R + ez)`` and ``t S`` by ``4u``, each sum padded by ``1e-12``
    of the sum of its absolute terms plus ``1e-12 (|D| + eD)``.  ``z``, ``R`` (and tensor ``ez``, ``eD``) of one shape."""
    t = torch.arange(pieces + 1, dtype=torch.float64) / pieces
    w = (t[1:] - t[:-1]) - (t[1:] * t[1:] - t[:-1] * t[:-1]) / 2
    sm = torch.arange(bins + 1, dtype=torch.float64) / bins
    lead = (bins, pieces) + (1,) * z.dim()
    lo_reach = ((sm[:-1, None] * t[None, :-1]).reshape(lead) * R) * (1 - 4 * _U)  # t_j S_m
    hi_reach = ((sm[1:, None] * t[None, 1:]).reshape(lead) * R) * (1 + 4 * _U)  # t_{j+1} S_{m+1}
    w = w.reshape((1, pieces) + (1,) * z.dim())
    D = gelu_second(z)
    wid = 4 * _U * (z.abs() + R + ez)
    out = torch.zeros_like(z)
    zl, zh = z - ez - wid, z + ez + wid
    for a, b, a3, b3 in ((zl + lo_reach, zh + hi_reach, zl, zh + hi_reach), (zl - hi_reach, zh - lo_reach, zl - hi_reach, zh)):
        lo, hi = gelu2_range(a, b)
        s3 = gelu3_sup(a3, b3) * hi_reach * (1 + 4 * _U)  # |GELU'''| between z* and the argument
        for side in (torch.minimum(hi - D + eD, s3), -torch.maximum(lo - D - eD, -s3)):
            pad = 1e-12 * ((w * side.abs()).sum(1) + D.abs() + eD)
            out = torch.maximum(out, ((w * side).sum(1) + pad).amax(0))
    return out


def _layer_forms(const: dict, n1: Tensor) -> dict:
    """The radius-free data F54b and F70 share: ``||W_1||_F`` and ``max ||w1_k||`` (each rounded up), ``G_1 = W_1^T W_1``,
    its rounding ``e_1 = gamma_{d+2} ||W_1||_F^2`` and ``max|G_1|``; cached in ``const`` (``ffn_hadamard``'s dict, once
    per layer, with that layer's ``n1``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    if "reach_forms" not in const:
        W1 = const["W1"]
        fW1 = float(pow2_norm(W1)) * (1 + W1.numel() * _gamma(1))
        G1 = W1.T @ W1
        const["reach_forms"] = {"n1": n1, "fW1": fW1, "w1max": float(n1.max()), "G1": G1,
                                "e1": _gamma(W1.shape[0] + 2) * fW1 * fW1, "g1max": float(G1.abs().max())}
    return const["reach_forms"]


def _ellipsoid(S: Tensor, eS: Tensor, wsum: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """F54b's ``Q = wsum (sym(S) + eS I)`` for Grams ``S`` (..., d, d) and ``eS``, ``wsum`` (...,), with ``fQ >= ||Q||_F``
    and ``eQ = gamma_4 fQ`` (its rounding, Frobenius).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    d = S.shape[-1]
    Q = wsum[..., None, None] * (0.5 * (S + S.transpose(-1, -2)) + eS[..., None, None] * torch.eye(d, dtype=S.dtype))
    fQ = pow2_norm(Q, (-2, -1)) * (1 + d * d * _gamma(1))
    return Q, fQ, _gamma(4) * fQ


# the radius-free part of ``_token_forms`` (the forms, ``G`` and the tensor norms, ~0.15 s a token at MiniLM's sizes) is
# the same at every radius and for F54b and F70a's calls on the same token: kept for the last few tokens (each entry
# holds one d_ff x d_ff ``G``, 19 MB at d_ff = 1536) and the layer's ``const``, ``lay`` it was formed with (so their ids
# cannot be reused while the entry lives); a hit is matched on the bytes of every input, so the floats are the same
FORMS_CACHE_SIZE = 6
_FORMS_CACHE: OrderedDict = OrderedDict()


def _digest(*xs) -> str:  # noqa: ANN002
    """A digest of the tensors' shapes, dtypes and bytes and of the other values' reprs."""
    h = hashlib.blake2b(digest_size=20)
    for x in xs:
        if isinstance(x, Tensor):
            h.update(repr((tuple(x.shape), x.dtype)).encode())
            h.update(x.detach().contiguous().numpy().tobytes())
        else:
            h.update(repr(x).encode())
        h.update(b"|")
    return h.hexdigest()


def _token_shapes(const: dict, lay: dict, z: Tensor, S: Tensor, eS: Tensor, wsum: float,
                  ez: Tensor | None) -> dict:
    """The radius-free forms of ``_token_forms`` (see there), cached (``_FORMS_CACHE``)."""
    key = (id(const), id(lay), _digest(z, S, eS, wsum, ez))
    hit = _FORMS_CACHE.get(key)
    if hit is not None and hit[0] is const and hit[1] is lay:
        _FORMS_CACHE.move_to_end(key)
        return hit[2]
    W1, d, fW1 = const["W1"], const["W1"].shape[0], lay["fW1"]
    Q, fQ, eQ = _ellipsoid(S, eS, torch.as_tensor(wsum, dtype=torch.float64))  # float64: as_tensor(float) is float32
    fQ, eQ = float(fQ), float(eQ)
    G = (W1.T @ Q) @ W1
    eG = fW1 * fW1 * (_gamma(2 * d) * fQ + eQ) * (1 + 1e-12)
    gmax = float(G.abs().max())
    HQ, HQm = G * G, G * lay["G1"]
    eHQ = (eG * (2 * gmax + eG) + _gamma(1) * float(pow2_norm(HQ))) * (1 + 1e-12)
    eHQm = (eG * (lay["g1max"] + lay["e1"]) + lay["e1"] * gmax + _gamma(1) * float(pow2_norm(HQm))) * (1 + 1e-12)
    Dk = gelu_second(z)
    eD = torch.as_tensor(centre_gelu2_err(ez), dtype=torch.float64)
    dmax = float(Dk.abs().max()) + float(eD.max())
    nKQ, nKQm = (fQ + eQ) * lay["w1max"] * fW1, math.sqrt(fQ + eQ) * lay["w1max"] * fW1  # ||K_Q||, ||K_{Q,I}|| (F40b)
    nq = _hadamard_norm(const, HQ, eHQ, Dk, nKQ, float(eD.max())) + const["eW2"] * dmax * nKQ
    nqm = _hadamard_norm(const, HQm, eHQm, Dk, nKQm, float(eD.max())) + const["eW2"] * dmax * nKQm
    if not bool(forms_in_range(const, Q)):  # red24-1 (F75): the degree-4 forms underflowed, the pads do not hold
        nq = nqm = math.inf
    out = {"G": G, "eG": eG, "eHQ": eHQ, "eHQm": eHQm, "nq": nq, "nqm": nqm, "D": Dk, "eD": eD}
    _FORMS_CACHE[key] = (const, lay, out)
    while len(_FORMS_CACHE) > FORMS_CACHE_SIZE:
        _FORMS_CACHE.popitem(last=False)
    return out


def _token_forms(const: dict, lay: dict, z: Tensor, S: Tensor, eS: float, wsum: float, r: float, remH: float,
                 rh: float, ez: Tensor | None) -> dict:
    """One token's ellipsoid forms (THEORY F54b, shared with F70): ``Q = wsum (sym(S) + eS I)`` within
    ``gamma_4 ||Q||_F``, ``G = W_1^T Q W_1`` within ``eG``, ``HQ = G o G`` and ``HQm = G o G_1`` with their Frobenius
    errors, the signed tensor norms ``nq``, ``nqm`` (F40b's ``_hadamard_norm``, the centred ``W_2``'s ``eW2`` added),
    the evaluated ``D = GELU''(z)`` within ``eD`` (``centre_gelu2_err``) of the exact centre's and the unit reaches
    ``Rk = min(||w1_k|| rh, r (G_kk + eG)^{1/2} + ||w1_k|| remH) (1 + 1e-12) + ez_k``; ``nq``, ``nqm`` inf outside
    ``forms_in_range`` (THEORY F75: the pads need float64's normal range).  The radius-free part is ``_token_shapes``'s
    (cached: the same floats, THEORY F74d).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    f = _token_shapes(const, lay, z, S, eS, wsum, ez)
    G, eG, n1 = f["G"], f["eG"], lay["n1"]
    Rk = torch.minimum(n1 * rh, r * torch.sqrt(G.diagonal().clamp(min=0.0) + eG) + n1 * remH) * (1 + 1e-12)
    if ez is not None:
        Rk = Rk + ez
    return {"HQ": G * G, "eHQ": f["eHQ"], "HQm": G * lay["G1"], "eHQm": f["eHQm"], "nq": f["nq"], "nqm": f["nqm"],
            "Rk": Rk, "D": f["D"], "eD": f["eD"]}


def ffn_reach_remainder(const: dict, n1: Tensor, z: Tensor, S: Tensor, eS: Tensor, wsum: Tensor, r: float,
                        remH: Tensor, rh: Tensor, ez: Tensor | None = None, n2: Tensor | None = None) -> Tensor:
    r"""(n,) certified ``sup ||P(F(h + dh) - F(h) - J_F dh)||`` per token over ``dh = a + rho``, ``a a^T <= r^2 Q*``,
    ``Q* = wsum S*`` (``S*`` the exact first-norm row Gram, the formed ``S`` within ``eS`` spectral), ``||rho|| <= remH``,
    ``||dh|| <= rh`` (THEORY F54b).  With ``s_k = w1_k . dh``, ``e_k = GELU''(z_k) s_k^2/2 + eps_k``, ``|eps_k| <= beta_k
    s_k^2``, and ``G = W_1^T Q W_1``, ``G_1 = W_1^T W_1``:

    .. math:: R \le \tfrac12\big(N_Q r^2 + 2N_{Qm} r\,rem_H + N_2\,rem_H^2\big)
              + \|\mathrm{diag}(\beta)^{1/2}PW_2\|\,\big(k_Q r^2 + 2k_{Qm} r\,rem_H + k_1 rem_H^2\big)

    ``N_Q, N_{Qm}, N_2 = lambda_max(W_2^T D H D W_2)^{1/2}`` for ``H = G o G, G o G_1, G_1 o G_1`` (``D = diag(GELU''(z))``
    signed; F40b, F44f, F38b), ``k_* = lambda_max(diag(beta)^{1/2} H diag(beta)^{1/2})^{1/2}`` for the same ``H``;
    ``beta_k = min(max(hi_k - GELU''(z_k), GELU''(z_k) - lo_k)/2, s3_k R_k/6)`` on unit k's reach ``[z_k - R_k, z_k + R_k]``,
    ``R_k = min(||w1_k|| rh, r G_kk^{1/2} + ||w1_k|| remH)`` (``lo, hi`` from ``gelu2_range``, ``s3_k`` ``gelu3_sup``),
    each min'ed with F58a's ``nested_beta`` (the Taylor integral's weight piece by piece, THEORY F58).
    ``Q = wsum (sym(S) + eS I) >= Q*`` (so ``G o G`` and ``G o G_1`` dominate the exact ones, Schur), formed within
    ``gamma_4 ||Q||_F``; ``G`` within ``eG = ||W_1||_F^2 (gamma_{2d} ||Q||_F + eQ)`` (F40b), ``G o G`` within ``eG (2 max|G| +
    eG) + u ||G o G||_F``, ``G o G_1`` within ``eG (max|G_1| + e_1) + e_1 max|G|`` (``e_1 = gamma_{d+2} ||W_1||_F^2``); the
    centred ``W_2`` as formed within ``eW2`` adds ``eW2 max|D| ||K_*||`` to each ``N``.  ``const``: ``ffn_hadamard``
    (centred when a LayerNorm follows), ``n1`` the ``||w1_k||``.  ``z`` within ``ez`` of the exact pre-activations
    (``pre_activations``; None: exact, red17-2): each ``R_k`` widened by ``ez_k`` (the reach around the exact centre),
    ``GELU''``'s error at the centre ``e_k = centre_gelu2_err`` in each ``N`` (its max) and in ``beta_k`` (``+ e_k``:
    ``D`` taken at ``z``, the remainder's ``hi - D*, D* - lo`` against the exact ``D*``).  Exact (erf) GELU only; cost
    ~``8 d d_ff^2`` flops and three certified ``d_ff x d_ff`` ``lambda_max`` a token.  ``n2``: the caller's
    ``ffn_second_norms(const, z, ez)`` (F74b), else formed here."""
    W2 = const["W2"]
    lay = _layer_forms(const, n1)
    n2 = ffn_second_norms(const, z, ez) if n2 is None else n2
    out = torch.empty(len(z), dtype=torch.float64)
    for i in range(len(z)):
        f = _token_forms(const, lay, z[i], S[i], eS[i], float(wsum[i]), r, float(remH[i]), float(rh[i]),
                         None if ez is None else ez[i])
        HQ, eHQ, HQm, eHQm, nq, nqm, Rk, Dk, eD = (f[k] for k in ("HQ", "eHQ", "HQm", "eHQm", "nq", "nqm", "Rk", "D", "eD"))
        lo, hi = gelu2_range(z[i] - Rk, z[i] + Rk)
        beta = (torch.minimum((torch.maximum(hi - Dk, Dk - lo) + _GELU2_ABS_ERR) / 2,
                              gelu3_sup(z[i] - Rk, z[i] + Rk) * Rk / 6) + (eD - _GELU2_ABS_ERR)) * (1 + 1e-12)
        beta = torch.minimum(beta, nested_beta(z[i], Rk, 0.0 if ez is None else ez[i], eD))  # F58a
        sb = torch.sqrt(beta)[None] * (1 + 1e-12)
        k = [torch.sqrt(_weighted_lmax(Hm, eHm, sb))[0] for Hm, eHm in
             ((HQ, eHQ), (HQm, eHQm), (const["H"], const["eH"]))]
        nb = _weighted_norm(W2.T, sb)[0] + float(sb.max()) * const["eW2"]
        # products, not ``** 2``: a Python float's power raises OverflowError past 1e154 (red18-1), a product is inf
        rr, rm, hh = r * r, r * float(remH[i]), float(remH[i]) * float(remH[i])
        first = 0.5 * (nq * rr + 2 * nqm * rm + float(n2[i]) * hh)
        second = nb * (k[0] * rr + 2 * k[1] * rm + k[2] * hh)
        out[i] = (first + float(second)) * (1 + 1e-12)
    return torch.nan_to_num(out, nan=math.inf)


def ffn_reach_drift(const: dict, n1: Tensor, z: Tensor, S: Tensor, eS: Tensor, wsum: Tensor, r: float,
                    remH: Tensor, rh: Tensor, ez: Tensor | None = None,
                    n2: Tensor | None = None) -> tuple[Tensor, Tensor]:
    r"""(n,) each: ``ffnq``, certified ``sup ||P(J_F(h + dh) - J_F(h)) b||`` per token over ``dh = a + rho`` (``a a^T <= r^2 Q*``,
    ``||rho|| <= remH``, ``||dh|| <= rh``) and ``b b^T <= Q*`` (``Q* = wsum S*`` as in ``ffn_reach_remainder``: the first
    norm's reachable rows, F40a), THEORY F70a.  With ``s_k = w1_k . dh``, ``b_k = w1_k . b``, ``c_k = Pw2_k . u`` and
    ``GELU'(z*_k + s) - GELU'(z*_k) = GELU''(z*_k) s + rho_k(s)``, ``|rho_k(s)| <= omega_k |s|`` on ``|s| <= R_k``:

    .. math:: \le N_Q r + N_{Qm}\,rem_H + \|\mathrm{diag}(\omega)^{1/2}PW_2\|\,(k_Q r + k_{Qm}\,rem_H)

    (the signed first order by F40b's tensor norms through the ellipsoid for both ``dh`` and ``b``; the rest by
    Cauchy-Schwarz over the units, ``sum_k omega_k |s_k b_k||c_k|``, ``k_* = lambda_max(diag(omega)^{1/2} H diag(omega)^{1/2})^{1/2}``
    for ``H = G o G, G o G_1``); and ``ffnqm >= sup ||P(J_F(h + dh) - J_F(h))||_2`` over the same ``dh`` (any unit
    direction: ``N_{Qm} r + N_2 rem_H`` and ``k_{Qm} r + k_1 rem_H``, ``k_1`` for F38's ``H = G_1 o G_1``, F70a ii).  ``omega_k = min(s3_k R_k / 2, max(hi_k - D_k, D_k - lo_k) + eD_k)``: Taylor with
    ``|GELU'''| <= s3_k`` on unit k's reach, or the slope's mean ``(GELU'(z* + s) - GELU'(z*))/s`` in GELU'''s range
    ``[lo_k, hi_k]`` there (``gelu2_range``) against the exact centre's value within ``eD`` of the evaluated ``D``.  The
    forms, reaches and their rounding are ``ffn_reach_remainder``'s (``_token_forms``); the weights and sums padded
    ``(1 + 1e-12)``; nan gives inf.  Exact (erf) GELU only; cost ~``8 d d_ff^2`` flops and three certified ``d_ff x d_ff``
    ``lambda_max`` a token.  ``n2``: the caller's ``ffn_second_norms(const, z, ez)`` (F74b), else formed here."""
    lay = _layer_forms(const, n1)
    n2 = ffn_second_norms(const, z, ez) if n2 is None else n2
    out = torch.empty(len(z), 2, dtype=torch.float64)
    for i in range(len(z)):
        f = _token_forms(const, lay, z[i], S[i], eS[i], float(wsum[i]), r, float(remH[i]), float(rh[i]),
                         None if ez is None else ez[i])
        sw = torch.sqrt(_omega(z[i], f["Rk"], f["D"], f["eD"]))[None] * (1 + 1e-12)
        k = [torch.sqrt(_weighted_lmax(Hm, eHm, sw))[0] for Hm, eHm in
             ((f["HQ"], f["eHQ"]), (f["HQm"], f["eHQm"]), (const["H"], const["eH"]))]
        nw = _weighted_norm(const["W2"].T, sw)[0] + float(sw.max()) * const["eW2"]
        rem = float(remH[i])
        out[i, 0] = (f["nq"] * r + f["nqm"] * rem + float(nw * (k[0] * r + k[1] * rem))) * (1 + 1e-12)
        out[i, 1] = (f["nqm"] * r + float(n2[i]) * rem + float(nw * (k[1] * r + k[2] * rem))) * (1 + 1e-12)
    return torch.nan_to_num(out, nan=math.inf).unbind(1)


def _omega(z: Tensor, Rk: Tensor, D: Tensor, eD: Tensor | float) -> Tensor:
    """F70a's per-unit weight ``omega_k (1 + 1e-12) >= sup |GELU'(z*_k + s) - GELU'(z*_k) - GELU''(z*_k) s| / |s|`` on
    ``|s| <= R_k``: ``min(s3_k R_k / 2, max(hi_k - D_k, D_k - lo_k) + eD_k)`` (``gelu3_sup``, ``gelu2_range`` on the
    reach; ``D`` the evaluated ``GELU''(z)`` within ``eD`` of the exact centre's)."""
    lo, hi = gelu2_range(z - Rk, z + Rk)
    return torch.minimum(gelu3_sup(z - Rk, z + Rk) * Rk / 2, torch.maximum(hi - D, D - lo) + eD) * (1 + 1e-12)


def _schur_layer(const: dict) -> dict:
    """The radius-free data of F72a, cached in ``const`` (``ffn_hadamard``'s dict, once per layer): ``L`` with ``W_1 W_1^T
    <= L L^T + eL I`` and ``l1 >= lambda_max(W_1^T W_1)``.  ``C = fl(W_1 W_1^T)`` is within ``gamma_{d_ff} ||W_1||_F^2``
    (spectral) of the exact Gram; ``L`` is Cholesky's factor of ``fl(C + tau I)``, ``tau = 1e-12 max C_aa`` (so that
    matrix is ``>= C``), and ``L L^T`` is within ``gamma_{d+1} ||L||_F^2`` of it (Higham, Thm 10.3); a failed
    factorisation gives ``eL = inf``."""
    if "schur" not in const:
        W1 = const["W1"]
        d, dff = W1.shape
        fW1 = float((W1 * W1).sum()) * (1 + 2 * W1.numel() * _U)
        C = W1 @ W1.T
        eC = _gamma(dff) * fW1
        A = C.clone()
        A.diagonal().add_(1e-12 * float(C.diagonal().max()))
        L, info = torch.linalg.cholesky_ex(A)
        fL = float((L * L).sum()) * (1 + 2 * L.numel() * _U)
        eL = (eC + _gamma(d + 1) * fL) * (1 + 1e-12) if int(info) == 0 else math.inf
        const["schur"] = {"L": L, "fL": fL, "eL": eL, "l1": (float(certified_lmax(C[None])[0]) + eC) * (1 + 1e-12)}
    return const["schur"]


def _lmax_g(sch: dict, Q: Tensor, fQ: Tensor, eQ: Tensor) -> Tensor:
    """(n,) certified ``lambda_max(W_1^T Q' W_1)`` for ``Q' = Q + eQ I`` (``Q`` (n, d, d) as formed, symmetric, ``fQ >=
    ||Q||_F``; THEORY F72a): the nonzero spectrum of ``Q'^{1/2} W_1 W_1^T Q'^{1/2}``, with ``W_1 W_1^T <= L L^T + eL I``
    (``_schur_layer``) at most ``lambda_max(L^T Q L) + eQ ||L||_F^2 + eL (fQ + eQ)``; ``M = fl(L^T (Q L))`` within
    ``gamma_{2d} ||L||_F^2 ||Q||_F``, symmetrised within ``u ||M||_F``, then ``certified_lmax``.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    L, fL = sch["L"], sch["fL"]
    M = L.T[None] @ (Q @ L[None])
    fM = pow2_norm(M, (1, 2)) * (1 + M[0].numel() * _U)
    err = _gamma(2 * L.shape[0]) * fL * fQ + _U * fM + eQ * fL + sch["eL"] * (fQ + eQ)
    return (certified_lmax(0.5 * (M + M.transpose(1, 2))) + err) * (1 + 1e-12)


def _wnorm(const: dict, a: Tensor, split: dict | None = None) -> Tensor:
    """(n,) certified ``||diag(a) P W_2||`` for weights ``a >= 0`` (n, d_ff), the exact centred rows: of the rows as
    formed (``_weighted_norm``, ``d^2 d_ff`` flops a row; or from F45a's ``split``, ``split_row_norm2``) plus ``max a eW2``
    (F51a)."""
    nW = _weighted_norm(const["W2"].T, a) if split is None else torch.sqrt(split_row_norm2(split, a)) * (1 + 1e-12)
    return (nW + a.amax(dim=1) * const["eW2"]) * (1 + 1e-12)


def ffn_reach_drift_schur(const: dict, n1: Tensor, z: Tensor, S: Tensor, eS: Tensor, wsum: Tensor, r: float,
                          remH: Tensor, rh: Tensor, ez: Tensor | None = None,
                          split: dict | None = None) -> tuple[Tensor, Tensor]:
    r"""(n,) each: upper bounds of F70a's ``ffnq`` and ``ffnqm`` (``ffn_reach_drift``'s arguments and claims) from
    Schur's inequality instead of three ``d_ff x d_ff`` certified ``lambda_max`` and two ``d_ff^2 d`` products a token
    (THEORY F72a): for PSD ``A, B``, ``A o B <= lambda_max(B) (A o I)``, so with ``G = W_1^T Q' W_1`` (``Q' = Q + eQ I >=
    Q*``), ``g_k >= G_kk``, ``G_1 = W_1^T W_1``, ``l_G >= lambda_max(G)`` (a ``d x d`` certificate, ``_lmax_g``), ``l_1
    >= lambda_max(G_1)`` and ``delta_k = |GELU''(z_k)| + eD_k >= |GELU''(z*_k)|``:

    .. math:: N_Q \le l_G^{1/2}\|\mathrm{diag}(g^{1/2}\delta)PW_2\|,\quad
              N_{Qm} \le \min(l_G^{1/2}\|\mathrm{diag}(\|w_1\|\delta)PW_2\|,\ l_1^{1/2}\|\mathrm{diag}(g^{1/2}\delta)PW_2\|),
              \quad N_2 \le l_1^{1/2}\|\mathrm{diag}(\|w_1\|\delta)PW_2\|,

    ``k_Q^2 <= l_G max_k omega_k g_k``, ``k_Qm^2 <= min(l_G max omega_k ||w1_k||^2, l_1 max omega_k g_k)``, ``k_1^2 <= min(l_1
    max omega_k ||w1_k||^2, max omega lH)`` (``diag(omega)^{1/2}(A o B)diag(omega)^{1/2} = (diag(omega)^{1/2} A
    diag(omega)^{1/2}) o B``).  ``g_k = fl(w1_k . fl(Q w1_k)) + (gamma_{2d} ||Q||_F + eQ) ||w1_k||^2``; the reaches and
    ``omega`` as F70a with this ``g``.  ``split`` (F45a's ``ffn_split_constants``): the two norms with the weights
    ``||w1|| delta`` and ``omega^{1/2}`` from it (``_wnorm``).  Cost ``4 d^2 d_ff`` flops a token (``2 d^2 d_ff`` with
    ``split``) and ``d x d`` certificates, batched; inf where ``forms_in_range`` fails (THEORY F75)."""
    sch = _schur_layer(const)
    n12 = n1 * n1 * (1 + 2 * _U)
    eD = torch.as_tensor(centre_gelu2_err(ez), dtype=torch.float64)
    lG, g, vQ, v1, ok = _schur_shapes(const, sch, n1, n12, z, S, eS, wsum, ez, eD, split)
    Rk = torch.minimum(n1[None] * rh[:, None], r * torch.sqrt(g) + n1[None] * remH[:, None]) * (1 + 1e-12)
    if ez is not None:
        Rk = Rk + ez
    om = _omega(z, Rk, gelu_second(z), eD)
    sG, s1 = torch.sqrt(lG) * (1 + 1e-12), math.sqrt(sch["l1"]) * (1 + 1e-12)
    nq, nqm, n2 = sG * vQ, torch.minimum(sG * v1, s1 * vQ), s1 * v1
    mg, m1 = (om * g).amax(dim=1), (om * n12[None]).amax(dim=1)
    kq = torch.sqrt(lG * mg * (1 + 1e-12))
    kqm = torch.sqrt(torch.minimum(lG * m1, sch["l1"] * mg) * (1 + 1e-12))
    k1 = torch.sqrt(torch.minimum(sch["l1"] * m1, om.amax(dim=1) * const["lH"]) * (1 + 1e-12))
    nw = _wnorm(const, torch.sqrt(om) * (1 + 1e-12), split)
    pad = 1 + 1e-12
    q = (nq * r + nqm * remH + nw * (kq * r + kqm * remH) * pad) * pad
    qm = (nqm * r + n2 * remH + nw * (kqm * r + k1 * remH) * pad) * pad
    return tuple(torch.nan_to_num(torch.where(ok, v, math.inf), nan=math.inf) for v in (q, qm))


# F72a's radius-free terms per token (``_schur_shapes``), kept across the radii: small rows (``g`` is d_ff floats)
SCHUR_CACHE_SIZE = 256
_SCHUR_CACHE: OrderedDict = OrderedDict()


def _schur_shapes(const: dict, sch: dict, n1: Tensor, n12: Tensor, z: Tensor, S: Tensor, eS: Tensor, wsum: Tensor,
                  ez: Tensor | None, eD: Tensor, split: dict | None) -> tuple[Tensor, ...]:
    """(``lG``, ``g``, ``vQ``, ``v1``, ``ok``) of ``ffn_reach_drift_schur``, the terms that do not depend on the radius:
    ``l_G`` (``_lmax_g`` of the ellipsoid ``Q``), ``g``, the two norms ``||diag(g^{1/2} delta) P W_2||`` and
    ``||diag(||w1|| delta) P W_2||`` (``_wnorm``) and ``forms_in_range``.  Token by token (every one of them is formed
    per token, one token's floats the same in any batch, F74b), so a token's row is kept (``_SCHUR_CACHE``, matched on
    the bytes of its inputs and the identity of ``const``, ``split``) and the others formed as one batch."""
    keys = [(id(const), id(split), _digest(n1, z[i], S[i], eS[i], wsum[i], None if ez is None else ez[i]))
            for i in range(len(z))]
    rows: list = [None] * len(z)
    for i, k in enumerate(keys):
        hit = _SCHUR_CACHE.get(k)
        if hit is not None and hit[0] is const and hit[1] is split:
            _SCHUR_CACHE.move_to_end(k)
            rows[i] = hit[2]
    miss = [i for i in range(len(z)) if rows[i] is None]
    if miss or not len(z):
        m = torch.tensor(miss, dtype=torch.long)
        W1, d = const["W1"], const["W1"].shape[0]
        Q, fQ, eQ = _ellipsoid(S[m], eS[m], wsum[m])
        lG = _lmax_g(sch, Q, fQ, eQ)
        g = ((Q @ W1[None]) * W1[None]).sum(dim=1).clamp(min=0.0) + (_gamma(2 * d) * fQ + eQ)[:, None] * n12[None]
        g = g * (1 + 1e-12)
        eDm = eD if eD.dim() == 0 else eD[m]
        delta = gelu_second(z[m]).abs() + eDm
        vQ, v1 = _wnorm(const, torch.sqrt(g) * delta * (1 + 1e-12)), _wnorm(const, n1[None] * delta, split)
        ok = forms_in_range(const, Q)  # red24-1 (F75): the forms' relative pads need float64's normal range
        for j, i in enumerate(miss):
            rows[i] = (lG[j], g[j], vQ[j], v1[j], ok[j])
            _SCHUR_CACHE[keys[i]] = (const, split, rows[i])
        while len(_SCHUR_CACHE) > SCHUR_CACHE_SIZE:
            _SCHUR_CACHE.popitem(last=False)
        if len(miss) == len(z):
            return lG, g, vQ, v1, ok
    return tuple(torch.stack([row[k] for row in rows]) for k in range(5))
