"""The attention stage's Taylor rest by one positive semi-definite majorant over heads and keys (issue 12; THEORY F84).

F78a's second derivative along the segment, with the score velocity split into F82's fixed linear form ``l_j . Delta``
(centred at the data's weights) and a per-key rest (the cross part, the weight box's shift of the centre, the linear
form's rounding), the value move and the score acceleration by AM-GM, is at every point of the segment at most
``Delta^T [(1 + g) L L^T + blockdiag(Gamma_m)] Delta + (1 + 1/g) B``; its sup over the move set is the SDP dual of F82 (d)
for the low-rank part (F85: on the coupled move set through the prefix's blocks when they are given) and the per-token
Grams' sups.  One more candidate in ``_attention_rest``'s min.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_attn_gram_rest import gram_rest_reach
from ._local_attn_rest import AttnRestData, _head_factors, box_mean, pair_mean
from ._local_jacobian import certified_lmax, pow2_norm, sphere_ascent
from ._rounding import _U, _gamma

__all__ = ["psd_rest_rows", "velocity_rests", "PSD_SIZES", "PSD_MAX_TOKENS"]

# THEORY F84 (a), F85: the AM-GM sizes (alpha_0, beta_0) tried, the smallest row kept (each valid); with F85's
# smaller low-rank part alpha_0 = 2-3 balances it against the value Gram (measured, docs/theory.md F85)
PSD_SIZES: tuple[tuple[float, float], ...] = ((2.5, 1.0),)
# THEORY F84: the row costs per stage and radius T^2 certified lambda_max of d x d Grams and T of (H T) x (H T) SDP
# steps (MiniLM at T = 7: about 1.5 CPU s); ``_attention_rest`` forms it for at most this many tokens (skipping a
# candidate of the min is always valid)
PSD_MAX_TOKENS = 16


def velocity_rests(data: AttnRestData, heads, Wqa: list[Tensor], X: Tensor, rho: float, e: Tensor, e1: Tensor,  # noqa: ANN001
                   Rn: Tensor, h: int, fac: tuple) -> tuple[Tensor, Tensor, Tensor]:
    r"""Head ``h``'s ``(L_i, eps, Tm)`` (THEORY F84 (b)): ``L_i`` (T, T, d) the block ``i`` of F82's ``l_ij`` as computed
    (``G y_ij - sum_m P_im G y_im``; the key blocks are ``q_i (1[m = j] - P_im)``), ``eps`` (T, T)
    ``>= |u_ij - ubar'_i - l_ij . Delta|`` at every point of the segment and every weight row of the box, and ``Tm``
    (T, T) ``>= |t*_ij|`` (the exact centred query-and-key part):

    .. math:: \bar\varepsilon_{ij} = N_{ij} + X_{ij} + \max_{box} \textstyle\sum_m p_m X_{im}
              + \sum_m \max(hi_{im} - P_{im}, P_{im} - lo_{im}) T_{im} + |1 - \sum_m P_{im}|\max_m T_{im}

    (``X`` F81a's cross part, ``N`` the rounding of ``G y`` (row-wise ``gamma_{2d+4}``), of its ``P``-mean and of
    ``q_i`` (``gamma_{2d+8}``) times the move's row norms ``Rn``).  ``fac`` ``_head_factors``' tuple (``e``, ``e1``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = X.shape
    P, Yc, q, Wq, Wk = heads[h][:5]
    sc = data.scale
    _, _, lo, hi, _, _, _, kpart, cross = fac
    Gy, gbar = _query_columns(P, Yc, Wq, Wk, sc)
    eG = pow2_norm(_gamma(2 * d + 4) * sc * (Yc.abs() @ Wk.abs()) @ Wq.abs().T, -1) * (1 + 1e-12)
    eSum = _gamma(T + 2) * pow2_norm(torch.einsum("ij,ijd->id", P, Gy.abs()), -1)
    Xa = torch.cat([X, torch.ones(T, 1, dtype=torch.float64)], dim=1)
    eq = _gamma(2 * d + 8) * pow2_norm(sc * (Xa.abs() @ Wqa[h].abs()) @ Wk.abs().T, -1) * (1 + 1e-12)
    Uab = (rho * data.g[h] + e[:, None] * data.gn[h] + kpart) * (1 + 1e-12)
    Tm = (Uab + ((P * Uab).sum(dim=1, keepdim=True) * (1 + T * _U))) * (1 + 1e-12)
    wd = torch.maximum(hi - P, P - lo).clamp(min=0) * (1 + 1e-12)
    off = (torch.abs(1 - P.sum(dim=1)) + 2 * T * _U) * Tm.max(dim=1).values
    shift = ((wd * Tm).sum(dim=1) * (1 + T * _U) + off) * (1 + 1e-12)
    PR = (P * Rn[None]).sum(dim=1, keepdim=True)
    N = (Rn[:, None] * (eG + (P * eG).sum(dim=1, keepdim=True) + eSum[:, None]) + eq[:, None] * (Rn[None] + PR))
    eps = (N * (1 + 1e-12) + cross + box_mean(lo, hi, cross)[:, None] + shift[:, None]) * (1 + 1e-12)
    return Gy - gbar[:, None, :], torch.nan_to_num(eps, nan=math.inf), Tm


def _query_columns(P: Tensor, Yc: Tensor, Wq: Tensor, Wk: Tensor, sc: float) -> tuple[Tensor, Tensor]:
    """One head's ``G y_ij`` (T, T, d) and its ``P``-mean ``sum_m P_im G y_im`` (T, d) as formed (F84 (b))."""
    Gy = sc * (Yc @ Wk) @ Wq.T
    return Gy, torch.einsum("ij,ijd->id", P, Gy)


def form_rows(heads, scale: float) -> Tensor:  # noqa: ANN001
    """(2 T^2 H, T, d) the rows of every query's low-rank form at the stage's input, radius- and size-free (THEORY F86):
    first ``(i, h, m)``: ``q_i^h`` in token ``m``'s block (the key blocks' rank-``H`` factors), then ``(i, h, j)``: the
    velocity column ``G y_ij - sum_m P_im G y_im`` of head ``h`` in token ``i``'s block; ``KeyImages.pulled`` reads them
    back after ``pull_rows``."""
    q = torch.stack([hd[2] for hd in heads])  # (H, T, d)
    H, T, d = q.shape
    C = torch.stack([gy - gb[:, None, :] for gy, gb in (_query_columns(hd[0], hd[1], hd[3], hd[4], scale)
                                                        for hd in heads)])  # (H, T_i, T_j, d)
    eye = torch.eye(T, dtype=torch.float64)
    rq = eye[None, None, :, :, None] * q.permute(1, 0, 2)[:, :, None, None, :]  # (i, h, m, k, d): q_i^h at k = m
    rc = eye[:, None, None, :, None] * C.permute(1, 0, 2, 3)[:, :, :, None, :]  # (i, h, j, k, d): C at k = i
    return torch.cat([rq.reshape(-1, T, d), rc.reshape(-1, T, d)])


def psd_rest_rows(data: AttnRestData, heads, Wqa: list[Tensor], X: Tensor, Qs: Tensor, eQ: Tensor, rho: float,  # noqa: ANN001
                  E: Tensor, eP: float, pad: float, sizes: tuple = PSD_SIZES, steps: int = 20,
                  Bp: Tensor | KeyImages | None = None, images: list | None = None,
                  heads_rest: tuple | None = None) -> Tensor:
    r"""(T,) rows ``>= ||R_i||`` of the attention stage's Taylor rest for the moves of ``attention_rest_rows`` (``Delta =
    P(X) delta + e``, ``||delta_j|| <= rho``, ``||e_j|| <= E_j``, ``P`` within ``eP``, the centre within ``pad``; the
    ellipsoids ``Qs`` (T, d, d) as formed within ``eQ`` (T,), Frobenius), THEORY F84:

    .. math:: \|R_i\| \le \tfrac12\Big[\big(A_i^{1/2} + B_i^{1/2}\big)^2 + \Gamma_i\Big]

    ``A_i >= sup_Delta sum_{h,j} hi_ij c_ij (l_ij . Delta)^2`` (``c = Yb + alpha``) by the SDP dual through
    ``Q~_m = Qs_m + eQ_m I`` and the e-balls, or (``Bp`` (T, T_in, d, d) the prefix's computed blocks ``P-hat``, whose
    rows ``Qs`` were formed from, or its ``KeyImages``) on the coupled set ``P-hat delta + e'`` (THEORY F85,
    ``_lowrank_sup_sources``), and with ``images`` (pairs ``(KeyImages | None, R)``: the move's rest ``e'`` minus
    ``P-hat``'s own error is ``sum_src B_src v_src`` with ``||v_src,k|| <= R_k``, None the identity; THEORY F86) also
    on ``P-hat delta + sum_src B_src v_src + rho eP B``, the smaller kept; ``B_i = sum_h max_box sum_j p_j c_ij eps_ij^2`` (``velocity_rests``),
    ``Gamma_i = sum_m (rho lambda_max(Q~_m^{1/2} G_m Q~_m^{1/2})^{1/2} + e_m lambda_max(G_m)^{1/2})^2`` with the per-token
    Grams ``G_m = sum_h [scale hi_im Yb_im / beta_im W_K W_K^T + hi_im / alpha_im W_VO W_VO^T] + 1[m = i] sum_h scale
    max_box(sum_j p_j Yb_ij beta_ij) W_Q W_Q^T``, ``alpha_j = alpha_0 W_j / Tm_j``, ``beta_j = beta_0 m_K,j / m_Q,i`` per
    ``(alpha_0, beta_0)`` of ``sizes`` (the smallest row kept); with ``heads_rest`` (``(C, delta)``: ``C`` (3, H, T)
    ``>= ||F_q^T e'_m||`` of the move's rest ``e'`` (``||e'|| <= E``) through each head's Gram factor, ``gram_factors``'
    ``delta``) the term ``e_m lambda_max(G_m)^{1/2}`` is at most ``rho eP lambda_max(G_m)^{1/2} + gram_rest_reach``
    (THEORY F87), the smaller kept.  Every ``lambda_max`` certified (``certified_lmax``) with
    the products' rounding, the Cholesky factor's backward error (``Q~ <= L L^T + ||dQ|| I``) and the Grams' own.
    Assumptions: post-LN dot attention without RoPE, soft-cap or q/k norm.  Padded; nan -> inf.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = X.shape
    H = len(heads)
    e = E + rho * eP
    e1 = e + pad
    if float(e.max()) == 0 and rho == 0:
        return torch.zeros(T, dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    Qt = Qs + (eQ * (1 + 1e-12))[:, None, None] * eye
    Rn = (rho * torch.sqrt((pow2_norm(Qs, (-2, -1)) + eQ) * (1 + 1e-12)) + e) * (1 + 1e-12)
    Lc, info = torch.linalg.cholesky_ex(Qt)
    if bool((info != 0).any()):
        return torch.full((T,), math.inf, dtype=torch.float64)
    eCh = _gamma(d + 1) * pow2_norm(Lc.abs() @ Lc.abs().transpose(1, 2), (-2, -1)) * (1 + 1e-12)  # Higham 10.3
    fac = [_head_factors(data, h, rho, e, e1) for h in range(H)]
    vel = [velocity_rests(data, heads, Wqa, X, rho, e, e1, Rn, h, fac[h]) for h in range(H)]
    Ybs = [pair_mean(f[2], f[3], f[5][None].expand(T, -1, -1)) for f in fac]
    grams = {k: torch.stack([M @ M.T for M in W]) for k, W in
             (("K", [hd[4] for hd in heads]), ("Q", [hd[3] for hd in heads]), ("V", [hd[5] @ hd[6] for hd in heads]))}
    absg = {k: torch.stack([M @ M.T for M in W]) for k, W in
            (("K", [hd[4].abs() for hd in heads]), ("Q", [hd[3].abs() for hd in heads]),
             ("V", [hd[5].abs() @ hd[6].abs() for hd in heads]))}
    kg = 2 * d + 2 * heads[0][3].shape[1] + 2 * H + 8  # the Grams' products and their H-term sums
    Bp = Bp if Bp is None or isinstance(Bp, KeyImages) else KeyImages(Bp)
    cols = [v[0] for v in vel]
    ones = torch.ones(Bp.B.shape[1] if Bp is not None else 0, dtype=torch.float64)
    best = torch.full((T,), math.inf, dtype=torch.float64)
    for a0, b0 in sizes:
        rows = torch.empty(T, dtype=torch.float64)
        for i in range(T):
            wts, qc, kc, vc, Bi = (torch.zeros(H, T, dtype=torch.float64), torch.zeros(H, dtype=torch.float64),
                                   torch.zeros(H, T, dtype=torch.float64), torch.zeros(H, T, dtype=torch.float64), 0.0)
            for h in range(H):
                _, _, lo, hi, mV, _, _, _, _ = fac[h]
                _, eps, Tm = vel[h]
                lo_i, hi_i, Yb, vis = lo[i:i + 1], hi[i:i + 1], Ybs[h][i], hi[i] > 0
                Wj = data.nO[h] * mV * (1 + 1e-12)
                alpha = torch.where(Wj > 0, a0 * Wj / Tm[i], torch.zeros_like(Wj))
                mQ = (rho * data.mQ[h][i] + e[i] * data.nQ[h]) * (1 + 1e-12)
                mK = (rho * data.mK[h] + e * data.nK[h]) * (1 + 1e-12)
                beta = b0 * mK / mQ if float(mQ) > 0 else torch.ones_like(mK)
                c = torch.where(vis, Yb + alpha, torch.zeros_like(Yb))
                Bi += float(box_mean(lo_i, hi_i, (c * eps[i] * eps[i])[None])[0])
                wts[h] = torch.where(vis, hi[i] * c, torch.zeros_like(c)) * (1 + 1e-12)
                qc[h] = data.scale * float(box_mean(lo_i, hi_i, (Yb * beta)[None])[0])
                kc[h] = torch.where(vis & (beta > 0), data.scale * hi[i] * Yb / beta, torch.zeros_like(Yb))
                vc[h] = torch.where(vis & (alpha > 0), hi[i] / alpha, torch.zeros_like(Yb))
            # THEORY F85: with the prefix's blocks, the same form's sup on the coupled move set (F84 (c) without them)
            if Bp is None:
                A = _lowrank_sup(i, [c[i] for c in cols], heads, wts, Qt, rho, e, steps)
            else:  # THEORY F85: the coupled move set through the prefix's blocks, the rest a ball per token
                alts = [[(None, e)]]
                if images is not None:  # THEORY F86: the rest as the images of the upstream rests, the smaller kept
                    alts.append([*images, (None, torch.full_like(e, rho * eP))])
                A = _lowrank_sup_sources(i, cols, heads, wts, [(Bp, rho * ones)], steps, alts)
            hr = None
            if heads_rest is not None:  # THEORY F87: the move's rest through every head's factor of G_m
                w = torch.stack([kc, vc, torch.zeros_like(kc)])
                w[2, :, i] = qc
                hr = (gram_rest_reach(w, heads_rest[0], heads_rest[1], E), rho * eP)
            G = _grams_sup(i, qc, kc, vc, grams, absg, kg, Lc, eCh, rho, e, hr)
            rows[i] = 0.5 * ((math.sqrt(A) + math.sqrt(Bi) * (1 + 1e-12)) ** 2 * (1 + 1e-12) + G) * (1 + 1e-12)
        best = torch.minimum(best, torch.nan_to_num(rows, nan=math.inf))
    return best


def _form_columns(i: int, cols_i: list, heads, wts: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ANN001
    """Query ``i``'s low-rank form ``sum_{h,j} wts_hj (l_hj . Delta)^2 = ||L^T Delta||^2`` (THEORY F82, F84 (c)) as
    ``(Qm, coef, Li)``: the key blocks ``L_m = Qm^T coef_m`` (rank ``H``: column ``(h, j)`` is ``q_i^h coef[m, h, j]``,
    ``coef[m, h, j] = (1[m = j] - P_im) wts_hj^{1/2}``) for ``m != i`` and the query's own block ``Li`` (d, H T)."""
    H, T = wts.shape
    s = torch.sqrt(wts)
    Pm = torch.stack([hd[0][i] for hd in heads])  # (H, T)
    Qm = torch.stack([hd[2][i] for hd in heads])  # (H, d): q_i per head
    d = Qm.shape[1]
    coef = (torch.eye(T, dtype=torch.float64)[:, None, :] - Pm.T[:, :, None]) * s[None]  # [m, h, j]
    Li = ((torch.stack(cols_i) * s[..., None]).reshape(H * T, d).T
          + Qm.T[:, :, None].expand(d, H, T).reshape(d, H * T) * coef[i].reshape(1, H * T))
    return Qm, coef, Li


def _lowrank_sup(i: int, cols_i: list, heads, wts: Tensor, Qt: Tensor, rho: float, e: Tensor, steps: int) -> float:  # noqa: ANN001
    r"""``>= sup_Delta sum_{h,j} wts_hj (l_hj . Delta)^2`` over ``Delta_m in rho Q~_m^{1/2} B + e_m B`` (THEORY F82 (d),
    F84 (c)): the SDP dual (``_sdp_dual``) over the ``2T`` blocks ``rho^2 L_m^T Q~_m L_m``, ``e_m^2 L_m^T L_m``, their
    products' rounding ``gamma_{2d+8}`` of the blocks' absolute mass.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    H, T = wts.shape
    d = Qt.shape[-1]
    r = H * T
    Qm, coef, Li = _form_columns(i, cols_i, heads, wts)
    Me = torch.einsum("mhj,mhk,mkl->mhjkl", coef, torch.einsum("ha,mab,kb->mhk", Qm, Qt, Qm), coef).reshape(T, r, r)
    Me[i] = Li.T @ Qt[i] @ Li
    AQm = torch.einsum("ha,mab,kb->mhk", Qm.abs(), Qt.abs(), Qm.abs())
    Ae = torch.einsum("mhj,mhk,mkl->mhjkl", coef.abs(), AQm, coef.abs()).reshape(T, r, r)
    Ae[i] = Li.abs().T @ Qt[i].abs() @ Li.abs()
    Mo, eo = _e_blocks(i, Qm, coef, Li, e, d)
    blocks = torch.cat([Me * (rho * rho), Mo])
    return _sdp_dual(blocks, torch.cat([_gamma(2 * d + 8) * pow2_norm(Ae, (-2, -1)) * rho * rho, eo]), steps)


def _e_blocks(i: int, Qm: Tensor, coef: Tensor, Li: Tensor, e: Tensor, d: int) -> tuple[Tensor, Tensor]:
    """(T, r, r) the e-balls' blocks ``e_m^2 L_m^T L_m`` of query ``i``'s form (``_form_columns``) and (T,) their
    rounding, ``gamma_{2d+8}`` of the absolute mass ``e_m^2 |L_m|^T |L_m|`` (Frobenius); THEORY F84 (c), F85.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, r = coef.shape[0], Li.shape[1]
    Mo = torch.einsum("mhj,hk,mkl->mhjkl", coef, Qm @ Qm.T, coef).reshape(T, r, r)
    Mo[i] = Li.T @ Li
    Ao = torch.einsum("mhj,hk,mkl->mhjkl", coef.abs(), Qm.abs() @ Qm.abs().T, coef.abs()).reshape(T, r, r)
    Ao[i] = Li.abs().T @ Li.abs()
    return Mo * (e * e)[:, None, None], _gamma(2 * d + 8) * pow2_norm(Ao, (-2, -1)) * e * e


class KeyImages:
    """A computed map ``B`` (T, T_in, d, d) into the attention stage's input (the prefix's blocks ``P-hat``, or a window
    product ``M_{a -> s}`` of the move's rest, THEORY F85, F86) with the Frobenius norms ``nB`` (T, T_in) of its blocks
    (upper bounds) and, per stage, its query-contracted forms (``forms``: radius-free, formed once for every radius and
    AM-GM size)."""

    def __init__(self, B: Tensor | None) -> None:
        self.B, self.nB, self.g = B, None, None
        if B is not None:
            d = B.shape[-1]
            self.nB = pow2_norm(B, (-2, -1)) * (1 + 2 * d * d * _U) * (1 + 1e-12)
        self._memo: tuple | None = None

    @classmethod
    def pulled(cls, G: Tensor, g: Tensor, H: int) -> KeyImages:
        """The forms read off ``form_rows`` pulled back through a product (``pull_rows``: ``G`` (2 T^2 H, T_in, d) as
        computed, ``g`` (2 T^2 H,) each row's error bound), THEORY F86: ``QB[i, m, k, h] = G[(i, h, m)]_k``,
        ``CB[i, k, (h, j)] = G[(i, h, j)]_k``; the errors ``gQ`` (T, H, T), ``gC`` (T, H T)."""
        n, Tin, d = G.shape
        T = round((n // (2 * H)) ** 0.5)
        out = cls(None)
        half = T * H * T
        QB = G[:half].reshape(T, H, T, Tin, d).permute(0, 2, 3, 1, 4)
        CB = G[half:].reshape(T, H, T, Tin, d).permute(0, 3, 1, 2, 4).reshape(T, Tin, H * T, d)
        out._memo = (QB, CB)
        out.g = (g[:half].reshape(T, H, T), g[half:].reshape(T, H * T))
        return out

    def forms(self, heads, cols: list) -> tuple[Tensor, Tensor]:  # noqa: ANN001
        """``(QB, CB)``: ``QB[i, m, k, h] = q_i^h B_mk`` (T, T, T_in, H, d) and ``CB[i, k] = C_i^T B_ik``
        (T, T_in, H T, d), ``C_i`` (d, H T) the query's velocity columns ``cols[h][i, j]`` (F84 (b))."""
        if self._memo is None:
            Qa = torch.stack([hd[2] for hd in heads], dim=1)  # (T, H, d)
            QB = torch.einsum("iha,mkab->imkhb", Qa, self.B)
            C = torch.stack(cols, dim=1)  # (T, H, T, d)
            T, H = C.shape[:2]
            CB = torch.einsum("ira,ikab->ikrb", C.reshape(T, H * T, -1), self.B[:T])
            self._memo = (QB, CB)
        return self._memo


def _key_images(i: int, Qm: Tensor, coef: Tensor, sq: Tensor, nLi: float, src: KeyImages, heads,  # noqa: ANN001
                cols: list) -> tuple[Tensor, Tensor]:
    r"""Query ``i``'s ``N_k = sum_m L_m^T B_mk`` (T_in, r, d) for its form's blocks ``L_m`` (``_form_columns``: the key
    blocks ``Q_i^T coef_m`` and the query's own, its velocity columns scaled by ``sq``, F85) through ``src``'s map,
    ``N_k[(h, j)] = sum_m coef[m, h, j] q_i^h B_mk + sq_hj C_i[(h, j)]^T B_ik`` (the query's key part is the ``m = i``
    term), (T_in,) ``eN_k`` and a scalar ``eT`` with ``||fl(N) - N|| v|| <= sum_k eN_k ||v_k|| + eT ||v||``: for a
    map ``B`` ``eN_k = gamma_{d + T + 3}`` of the absolute mass, ``sum_m ||L'_m||_F ||B_mk||_F`` with ``L'_m`` the key
    blocks and ``nLi`` the velocity part's Frobenius norm, ``eT = 0``; for pulled rows (F86) ``eN_k = gamma_{T + 3}
    ||(sum_m |coef_m| |QB_m| + sq |CB|)_k||_F`` (the combination) and ``eT`` the Frobenius norm over ``(h, j)`` of
    ``sum_m |coef[m, h, j]| gQ[i, h, m] + sq_hj gC[i, (h, j)]`` (the rows' own errors).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    QB, CB = src.forms(heads, cols)
    H, T = sq.shape
    r = H * T
    N = torch.einsum("mhj,mkhb->khjb", coef, QB[i]).reshape(-1, r, Qm.shape[1])
    N += sq.reshape(r)[None, :, None] * CB[i]
    if src.g is not None:
        absN = torch.einsum("mhj,mkhb->khjb", coef.abs(), QB[i].abs()).reshape(-1, r, Qm.shape[1])
        absN += sq.reshape(r)[None, :, None] * CB[i].abs()
        eN = _gamma(T + 3) * pow2_norm(absN, (-2, -1)) * (1 + 2 * r * Qm.shape[1] * _U) * (1 + 1e-12)
        gQ, gC = src.g
        rowe = torch.einsum("mhj,hm->hj", coef.abs(), gQ[i]).reshape(r) + sq.reshape(r) * gC[i]
        return N, eN, float(pow2_norm(rowe)) * (1 + 2 * (r + T) * _U) * (1 + 1e-12)
    Lfro = pow2_norm(coef, 2) * pow2_norm(Qm, 1)[None]  # (T, H): ||L'_m||_F per head's rank one
    nK = torch.sqrt((Lfro * Lfro).sum(dim=1)) * (1 + 2 * (H * T + 2) * _U)
    eN = _gamma(Qm.shape[1] + T + 3) * ((nK[:, None] * src.nB).sum(dim=0) + nLi * src.nB[i]) * (1 + 1e-12)
    return N, eN, 0.0


def _lowrank_sup_sources(i: int, cols: list, heads, wts: Tensor, sources: list, steps: int,  # noqa: ANN001
                         alternatives: list = ((),)) -> float:
    r"""``>= sup_Delta sum_{h,j} wts_hj (l_hj . Delta)^2`` over ``Delta = sum_src B_src v_src`` with every token's
    ``||v_src,k|| <= R_src,k`` (``sources``: pairs ``(KeyImages | None, R)``, None the identity), THEORY F85, F86:
    ``L^T Delta = sum_src sum_k N_src,k v_src,k`` (``_key_images``; ``N = L_k^T`` for the identity), so F82 (c)'s SDP dual
    (``_sdp_dual``) over the blocks ``R_k^2 N_k N_k^T`` with their formation's rounding ``gamma_{2d+8}`` (F85), and
    ``N``'s own rounding outside the square root: ``A <= (A-hat^{1/2} + sum_src sum_k R_k eN_k)^2``.  With
    ``alternatives`` (lists of further sources, each a valid description of the same move set with ``sources``) the
    smallest of their sups, the shared sources' blocks formed once.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    H, T = wts.shape
    Qm, coef, Li = _form_columns(i, [c[i] for c in cols], heads, wts)
    d, r = Qm.shape[1], H * T
    sq = torch.sqrt(wts)
    nLi = float(pow2_norm(torch.stack([c[i] for c in cols]) * sq[..., None])) * (1 + 2 * d * _U)

    def parts(srcs: list) -> tuple[list, list, float]:
        blocks, errs, out = [], [], 0.0
        for src, R in srcs:
            if float(R.max()) == 0:
                continue
            if src is None:
                Mo, eo = _e_blocks(i, Qm, coef, Li, R, d)
                blocks.append(Mo)
                errs.append(eo)
                continue
            N, eN, eT = _key_images(i, Qm, coef, sq, nLi, src, heads, cols)
            R2 = (R * R)[:, None, None]
            blocks.append((N @ N.transpose(1, 2)) * R2)
            fN = pow2_norm(N, (-2, -1)) * (1 + 2 * r * d * _U)
            errs.append(_gamma(2 * d + 8) * fN * fN * R2[:, 0, 0])
            out += (float((eN * R).sum()) * (1 + R.shape[0] * _U) + eT * float(pow2_norm(R)) * (1 + R.shape[0] * _U)) \
                * (1 + 1e-12)
        return blocks, errs, out

    b0, e0, o0 = parts(sources)
    best = math.inf
    for alt in alternatives:
        b1, e1, o1 = parts(alt)
        if not b0 + b1:
            return 0.0
        A = _sdp_dual(torch.cat(b0 + b1), torch.cat(e0 + e1), steps)
        best = min(best, (math.sqrt(A) + (o0 + o1) * (1 + (len(sources) + len(alt)) * _U)) ** 2 * (1 + 1e-12))
    return best


# THEORY F92: steps of the primal ascent whose direction sets the dual's weights
PRIMAL_STEPS = 100


def _primal_weights(blocks: Tensor, z: Tensor | None, steps: int) -> Tensor:
    r"""Weights ``c_k = ||M_k^T z||`` (clamped below at ``1e-8`` of the largest) at the direction ``z`` reached by
    ``steps`` steps of the ascent ``z <- sum_k M_k M_k^T z / ||M_k^T z||`` (normalised; ``sphere_ascent``) from ``z`` (or
    the top eigenvector of ``sum_k M_k M_k^T``): ``phi(z) = sum_k ||M_k^T z||`` is convex, so each step never lowers it on
    the sphere (THEORY F67a), and at a maximiser whose top eigenvector is ``z`` these weights make the dual ``(sum c)
    lambda_max(sum_k M_k M_k^T / c_k)`` equal to ``phi(z)^2``, the primal value (THEORY F92).  Any ``c > 0`` is valid in
    the dual; this only chooses one."""
    if z is None:
        z = torch.linalg.eigh(blocks.sum(0))[1][:, -1]

    def step(z: Tensor) -> tuple[Tensor, Tensor]:
        q = torch.sqrt(torch.einsum("a,kab,b->k", z, blocks, z).clamp(min=1e-300))
        return (torch.einsum("kab,b->ka", blocks, z) / q[:, None]).sum(0), q.sum()

    z = sphere_ascent(step, z / z.norm().clamp(min=1e-300), steps, -math.inf)
    q = torch.sqrt(torch.einsum("a,kab,b->k", z, blocks, z).clamp(min=0))
    return q.clamp(min=max(float(q.max()) * 1e-8, 1e-300))


def _sdp_dual(blocks: Tensor, err: Tensor, steps: int) -> float:
    r"""``>= sup ||sum_k M_k v_k||^2`` over unit ``v_k`` for the PSD blocks ``M_k M_k^T`` as formed (``blocks``, within
    ``err`` Frobenius each) (THEORY F82 (c), F84 (c)): for any ``c > 0``, ``(sum c) lambda_max(sum_k M_k M_k^T / c_k)``;
    ``c`` by damped fixed-point steps towards the top eigenvector's block norms (every ``c`` valid), the best step's
    ``lambda_max`` certified plus ``sum_k err_k / c_k`` and the sum's rounding.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    keep = blocks.abs().amax(dim=(1, 2)) > 0  # exact zeros only (torch's norm of a 2^-540 block is 0)
    blocks, err = 0.5 * (blocks[keep] + blocks[keep].transpose(1, 2)), err[keep]
    if blocks.shape[0] == 0:
        return 0.0
    c = torch.sqrt(torch.linalg.matrix_norm(blocks, ord=2).clamp(min=1e-300))
    best, bestc = math.inf, c
    for _ in range(steps):
        lam, vec = torch.linalg.eigh((blocks / c[:, None, None]).sum(0))
        val = float(c.sum()) * float(lam[-1])
        if val < best:
            best, bestc = val, c.clone()
        cn = torch.sqrt(torch.einsum("a,kab,b->k", vec[:, -1], blocks, vec[:, -1]).clamp(min=0))  # ||M_k^T z||
        cn = cn.clamp(min=float(cn.max()) * 1e-8)
        c = torch.sqrt(c * cn * (float(c.sum()) / float(cn.sum())))  # damped; every c > 0 is valid
    # THEORY F92: c at the primal ascent's direction z (c_k = ||M_k^T z||, the dual's optimality condition), where
    # the damped steps stall
    c = _primal_weights(blocks, None, PRIMAL_STEPS)
    val = float(c.sum()) * float(torch.linalg.eigvalsh((blocks / c[:, None, None]).sum(0))[-1])
    if val < best:
        best, bestc = val, c
    M = (blocks / bestc[:, None, None]).sum(0)
    lam = float(certified_lmax(0.5 * (M + M.T)[None])[0])
    ec = float((err / bestc).sum()) + 2 * blocks.shape[0] * _U * float(pow2_norm(M))
    return float(bestc.sum()) * (1 + 2 * len(bestc) * _U) * (lam + ec) * (1 + 1e-12)


def _grams_sup(i: int, qc: Tensor, kc: Tensor, vc: Tensor, grams: dict, absg: dict, kg: int, Lc: Tensor, eCh: Tensor,
               rho: float, e: Tensor, hr: tuple | None = None) -> float:
    r"""``>= sum_m sup Delta_m^T G_m Delta_m`` over ``Delta_m in rho Q~_m^{1/2} B + e_m B`` (THEORY F84 (c)):
    ``(rho lambda_max(Lc_m^T G_m Lc_m) + ||dQ_m|| lambda_max(G_m))^{1/2} + e_m lambda_max(G_m)^{1/2})^2``, ``Lc`` the
    formed Cholesky factor of ``Q~`` (``Q~ <= Lc Lc^T + ||dQ|| I``, ``eCh`` its backward error), the exact Grams within
    ``gamma_kg`` of their absolute mass, every ``lambda_max`` certified.  ``hr`` (``(reach, f)``, THEORY F87): the move's
    rest part of ``e`` seen through the Grams' factors (``gram_rest_reach``) and the ball ``f`` beside it; then
    ``e_m lambda_max(G_m)^{1/2}`` is at most ``f lambda_max(G_m)^{1/2} + reach_m``, the smaller kept.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = Lc.shape[0], Lc.shape[-1]
    cf = kc.T.clone()  # (T, H)
    G = torch.einsum("mh,hab->mab", cf, grams["K"]) + torch.einsum("mh,hab->mab", vc.T, grams["V"])
    Ga = torch.einsum("mh,hab->mab", cf.abs(), absg["K"]) + torch.einsum("mh,hab->mab", vc.T.abs(), absg["V"])
    G[i] += torch.einsum("h,hab->ab", qc, grams["Q"])
    Ga[i] += torch.einsum("h,hab->ab", qc.abs(), absg["Q"])
    G = 0.5 * (G + G.transpose(1, 2))
    eG = _gamma(kg) * pow2_norm(Ga, (-2, -1)) * (1 + 1e-12)
    lg = (certified_lmax(G) + eG) * (1 + 1e-12)
    N = Lc.transpose(1, 2) @ G @ Lc
    eN = (_gamma(2 * d + 2) * pow2_norm(Lc.abs().transpose(1, 2) @ G.abs() @ Lc.abs(), (-2, -1))
          + eG * pow2_norm(Lc, (-2, -1)) ** 2) * (1 + 1e-12)
    lq = (certified_lmax(0.5 * (N + N.transpose(1, 2))) + eN + eCh * lg) * (1 + 1e-12)
    sg = torch.sqrt(lg.clamp(min=0))
    eg = e * sg
    if hr is not None:  # THEORY F87 (c)
        eg = torch.minimum(eg, (hr[1] * sg + hr[0]) * (1 + 1e-12))
    tot = (rho * torch.sqrt(lq.clamp(min=0)) + eg) ** 2
    return float(tot.sum()) * (1 + T * _U) * (1 + 1e-12)
