"""The rows route one stage at a time (issue 12; THEORY F17, F31, F34, F35): the spine of ``layer_rows``.

A layer's rows on ``B(X, r)`` are built in this order, each step a function below:

* at X, radius-free: the layer's data (``layer_at_x``: the norms' Jacobians, the FFN slopes, the
  heads), the weighted row Gram of the attention sublayer (``attention_row_gram``), the row
  constants of every stage at X through the token-wise maps (``post_point`` / ``pre_point``), the
  attained lower rows (``point_lower``) and the radius-free drift data (``drift_at_x``);
* per radius, in the order the data flows through the layer (post-LN: attention, first norm, FFN,
  second norm; pre-LN: first norm, attention, second norm, FFN): each stage's sup of its row
  constant on the ball and its output radius, then the drift terms and the assembled rows
  (``radius_rows``).

The FFN term is the one refined lazily (F37), token by token, by ``_local_rows.FfnDrift`` (twice, with the
``gamma``-folded FFN, in ``_local_gamma_fold.FoldedFfnDrift``, F46); a stage's rows after the FFN are therefore a
function ``tail(dF, dFh, fold)`` of the FFN drift bounds (``post_tail``, ``pre_tail``).  Every function keeps the
float64 operations of the one-function version it replaced; without ``fold`` the certified numbers are the same
to the last bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import Tensor

from .._errors import InputError
from ..model import LayerSpec, Placement, attention_forward, ffn_forward
from ._local_attn_joint import joint_heads, joint_remainder
from ._local_drift import heads_joint, output_block_norms
from ._local_jacobian import (
    LayerJacobian, _f64, _head_data, _norm_parts, norm_jacobian_error, point_slope_err, pow2_norm, pre_activations,
)
from ._local_joint import attention_remainder, head_geometry, norm_drift, norm_remainder, sphere_remainder
from ._local_remg import first_norm_gamma, remg_gamma
from ._local_rows import (
    _U, _centre, _diag_blocks, _gamma_vec, _head_gram, _head_output_norms, _HeadMoments, _heads_combined,
    _nu, _rows, _sandwich, _spectral_err, attention_drift_rows, refine_lazily, row_lower, row_weights,
)
from ._local_sharp import head_moves
from ._local_struct import NormJac, _chain_output_norms
from ._weights import ROUNDING_PAD, spectral


# -- at X ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerAtX:
    """A layer's data at X (THEORY F17): the attention input ``Xin`` and heads, the norms' Jacobians
    (post-LN factored, ``n1``/``n2``, Note [factored norm Jacobian], F32; pre-LN dense ``D1``/``D2``),
    their ``sigma`` (None without a centring/scaling norm), ``max|gamma|`` and ``||D||`` per token, and
    the FFN's pre-activations ``z`` (within ``ez`` of the exact ones, ``pre_activations``) with its Jacobian
    ``F_i = W_2^T diag(sigma'(z_i)) W_1^T`` and the rounding ``eF`` of ``F``."""

    layer: LayerSpec
    post: bool
    T: int
    d: int
    Xin: Tensor
    heads: list
    Wo_all: Tensor  # (H dh, d)
    nO: float
    n1: NormJac | None
    n2: NormJac | None
    D1: Tensor | None
    D2: Tensor | None
    sig1: Tensor | None
    sig2: Tensor | None
    g1: float
    g2: float
    nD1: Tensor
    nD2: Tensor
    z: Tensor
    F: Tensor
    eF: Tensor
    eD1: Tensor | None = None  # pre-LN: the formed D1, D2 against the true ones (F17f)
    eD2: Tensor | None = None
    ez: Tensor | None = None  # (T, d_ff) |z - exact pre-activation| (F51a, red17-2)


def _gamma_max(norm) -> float:  # noqa: ANN001
    """``max|gamma|`` of a norm, padded (1 without a scale)."""
    return 1.0 if norm is None or norm.weight is None else norm.gamma_max_abs * (1 + ROUNDING_PAD)


def ffn_slope_map(ffn, H: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # noqa: ANN001
    """(``z``, ``F``, ``eF``, ``ez``) at the FFN input ``H``: ``z = fl(H W_1 + b_1)`` within ``ez`` of the exact
    pre-activations (``pre_activations``), ``F_i = W_2^T diag(sigma'(z_i)) W_1^T`` (T, d, d) and a bound on its
    distance to the exact ``F_i`` (spectral) per token: the float64 rounding (THEORY F17) plus the slope's move from
    the exact pre-activation, ``point_slope_err ||W_1|| ||W_2||`` (certified spectral norms; F51a, red17-2).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    W1, W2 = _f64(ffn.W_1), _f64(ffn.W_2)
    z, ez = pre_activations(ffn, H)
    z = z.clone().requires_grad_(True)
    (slope,) = torch.autograd.grad(ffn.activation(z).sum(), z)
    slope, z = slope.detach(), z.detach()
    F = (W2.T[None] * slope[:, None, :]) @ W1.T  # (T, d, d)
    fro = float(pow2_norm(W1) * pow2_norm(W2))
    eF = (4 * (W1.shape[1] + 8) * _U * fro * (slope.abs().max(dim=1).values + 1.0)
          + point_slope_err(ffn.activation, z, ez) * spectral(W1) * spectral(W2) * (1 + 1e-12))
    return z, F, eF, ez


def layer_at_x(layer: LayerSpec, X: Tensor, nO: float) -> LayerAtX:
    """The forward pass at X with every Jacobian factor the rows route needs (``LayerAtX``; THEORY F17,
    F32's factored norms post-LN)."""
    attn, T, d = layer.attention, *X.shape
    post = layer.placement is Placement.POST
    n1 = n2 = D1 = D2 = eD1 = eD2 = None
    if post:
        Xin = X
        S1 = X + attention_forward(attn, X)
        n1 = NormJac(layer.norm_attn, S1)  # Note [factored norm Jacobian]: D1, D2 never formed
        s1, sig1 = n1.s, n1.sigma
        H = layer.norm_attn(S1) if layer.norm_attn is not None else S1
        n2 = NormJac(layer.norm_ffn, H + ffn_forward(layer.ffn, H))
        s2, sig2 = n2.s, n2.sigma
    else:
        D1, s1, sig1, _ = _norm_parts(layer.norm_attn, X)
        Xin = layer.norm_attn(X) if layer.norm_attn is not None else X
        S1 = X + attention_forward(attn, Xin)
        D2, s2, sig2, _ = _norm_parts(layer.norm_ffn, S1)
        eD1, eD2 = norm_jacobian_error(layer.norm_attn, X, formed=True), norm_jacobian_error(layer.norm_ffn, S1, formed=True)
        H = layer.norm_ffn(S1) if layer.norm_ffn is not None else S1
    g1, g2 = _gamma_max(layer.norm_attn), _gamma_max(layer.norm_ffn)
    nrm = lambda g, s: torch.ones(T, dtype=torch.float64) if s is None else g / s * (1 + 1e-12)  # noqa: E731
    z, F, eF, ez = ffn_slope_map(layer.ffn, H)
    heads = _head_data(attn, Xin)
    return LayerAtX(layer, post, T, d, Xin, heads, torch.cat([hd[6] for hd in heads], dim=0), nO, n1, n2, D1, D2,
                    sig1, sig2, g1, g2, nrm(g1, s1) + (n1.err if post else eD1), nrm(g2, s2) + (n2.err if post else eD2),
                    z, F, eF, eD1, eD2, ez)  # ||D*|| <= max|gamma|/s* <= max|gamma|/s + err (F17f)


def _centring(norm) -> bool:  # noqa: ANN001
    """A LayerNorm (it sees only the centred ``P dx``, Note [local norm floor])."""
    return norm is not None and norm.kind.value == "layernorm"


def _centred(v: Tensor) -> Tensor:
    """``P v`` per token, ``P = I - 11^T/d`` (a Ritz vector mapped into a centring norm's input)."""
    return v - v.mean(dim=1, keepdim=True)


@dataclass(frozen=True)
class RowGram:
    """The attention sublayer's weighted row Gram at X (Note [weighted row Gram], THEORY F17b, F34c):
    ``S_i = sum_j B_ij B_ij^T / w_ij`` (T, d, d) with its rounding ``err``, ``sum_j w_ij``, the exact
    diagonal blocks ``B_ii``, the row constant ``a_pt`` of ``B`` and its Ritz vectors ``x``; post-LN ``S1``, the first
    norm's Gram ``D1_i S_i D1_i^T`` of every token with its error (``NormJac.sandwich``), formed once per layer for
    ``h_pt`` and F54b/F70's ellipsoids (None pre-LN)."""

    S: Tensor
    err: Tensor
    wsum: Tensor
    Bii: Tensor
    a_pt: Tensor
    x: Tensor
    S1: tuple | None = None


def _diag_terms(at: LayerAtX) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The weight-free part of ``attention_row_gram``: ``_diag_blocks``' ``B_ii`` and rounding bound,
    ``fl(B_ii B_ii^T)`` and ``pow2_norm(B_ii)``, formed once per ``LayerAtX`` (F56's second row Gram has the same
    blocks: the same floats)."""
    got = at.__dict__.get("_diag_terms")
    if got is None:
        Bii, eB = _diag_blocks(at.heads, at.Wo_all, at.D1, at.T, at.d, at.layer.attention.softmax_scale, at.eD1,
                               None if at.post else (at.nD1 + at.eD1) * (1 + 1e-12))
        got = (Bii, eB, Bii @ Bii.transpose(1, 2), pow2_norm(Bii, (1, 2)))
        object.__setattr__(at, "_diag_terms", got)  # frozen dataclass: a private cache beside the fields
    return got


def attention_row_gram(at: LayerAtX, w: Tensor | None = None) -> RowGram:
    """``RowGram`` of ``B_ij = delta_ij I + W_O^T Z_ij N_j`` (``N = D1`` pre-LN, ``I`` post-LN): the
    off-diagonal part assembled in the head space (``_head_gram``), the diagonal blocks exactly
    (THEORY F17b); the weights ``w`` (T, T), positive, default F34c's ``row_weights`` (F56's optimised ones).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d, heads, Wo_all = at.T, at.d, at.heads, at.Wo_all
    nN = None if at.post else at.nD1
    w = row_weights(heads, T, at.nO, nN) if w is None else w
    c = (nN[None, :] ** 2 if nN is not None else torch.ones(T, T, dtype=torch.float64)) / w
    c = c * (1 - torch.eye(T, dtype=torch.float64))
    Sh, errh = _head_gram(heads, c)
    S0, err0 = _sandwich(Wo_all.T.expand(T, d, Wo_all.shape[0]), Sh, errh, torch.zeros(T, dtype=torch.float64), at.nO)
    Bii, eB, BBt, nB = _diag_terms(at)
    wii = w.diagonal()
    S0 = S0 + BBt / wii[:, None, None]
    err0 = err0 + ((2 * nB + eB) * eB + 4 * (d + 2) * _U * nB * nB) / wii
    wsum = w.sum(dim=1) * (1 + 1e-12)
    a_pt, x0 = _nu(S0, err0, wsum)
    return RowGram(S0, err0, wsum, Bii, a_pt, x0, at.n1.sandwich(S0, err0) if at.post else None)


@dataclass(frozen=True)
class PostPoint:
    """Post-LN row constants at X of every stage (Note [weighted row Gram], THEORY F17b, F32): ``B``
    (``a_pt``; centred ``aP_pt``), ``D1 B`` (``h_pt``), ``(I + F) D1 B`` (``g_pt``, centred when a
    LayerNorm follows), the layer ``D2 (I + F) D1 B`` (``point``, Ritz vectors ``x``); ``I + F`` and its
    norm, ``||D2 (I + F) Gamma1||`` and the head-output norms through ``D1``, ``(I + F) D1`` and the whole
    chain ``M = D2 (I + F) D1`` (F32's chains); ``nIFG`` F55a's ``||(I + F) diag(gamma1)||`` where the first norm
    scales (``first_norm_gamma``; None elsewhere), formed once per layer for every radius's ``remG``."""

    a_pt: Tensor
    aP_pt: Tensor
    h_pt: Tensor
    g_pt: Tensor
    point: Tensor
    x: Tensor
    IF: Tensor
    nIF: Tensor
    nD2IFg: Tensor
    D1O: tuple
    IFD1O: tuple
    MO: tuple
    nIFG: Tensor | None = None


def post_rows(at: LayerAtX, gram: RowGram, IF: Tensor, nIF: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor,
                                                                                        Tensor, Tensor]:
    """(``aP_pt``, ``h_pt``, ``g_pt``, ``point``, the layer's Ritz vectors) of ``PostPoint`` from one row Gram
    (``IF = I + F``, ``nIF`` a certified bound on its spectral norm for the error's propagation, THEORY F98): each Gram's candidate starts from the previous stage's Ritz vector mapped forward (F32); a
    norm that centres sees only ``P dx`` (Note [local norm floor]), so the radius into it is the centred row
    constant.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    d, n1, n2, wsum, S0, err0, x0 = at.d, at.n1, at.n2, gram.wsum, gram.S, gram.err, gram.x
    aP_pt = _nu(_centre(S0), err0 + 4 * (d + 2) * _U * pow2_norm(S0, (1, 2)), wsum, _centred(x0))[0] \
        if _centring(at.layer.norm_attn) else gram.a_pt
    Sa, ea = gram.S1
    h_pt, xa = _nu(Sa, ea, wsum, n1.left(x0[:, :, None])[0][:, :, 0])
    Sb, eb = _sandwich(IF, Sa, ea, at.eF, nIF)
    xb = (IF @ xa[:, :, None])[:, :, 0]
    g_pt = (_nu(_centre(Sb), eb + 4 * (d + 2) * _U * pow2_norm(Sb, (1, 2)), wsum, _centred(xb))
            if _centring(at.layer.norm_ffn) else _nu(Sb, eb, wsum, xb))[0]
    Sc, ec = n2.sandwich(Sb, eb)
    point, xc = _nu(Sc, ec, wsum, n2.left(xb[:, :, None])[0][:, :, 0])
    return aP_pt, h_pt, g_pt, point, xc


def post_point(at: LayerAtX, gram: RowGram) -> PostPoint:
    """``PostPoint``: the row constants by ``post_rows``, the chains' norms by F32."""
    d, n1, n2 = at.d, at.n1, at.n2
    IF, eF = at.F.clone(), at.eF
    IF.diagonal(dim1=1, dim2=2).add_(1.0)  # I + F
    nIF = _spectral_err(IF, eF)
    aP_pt, h_pt, g_pt, point, xc = post_rows(at, gram, IF, nIF)
    D2IF, rD2IF = n2.left(IF)
    eD2IF = n2.err * (nIF + eF) + at.nD2 * eF  # the factored D2 against the true one, F's error
    nD2IFg = _spectral_err(D2IF * _gamma_vec(at.layer.norm_attn, d)[None, None, :], (eD2IF + rD2IF) * at.g1)
    eIFD1 = eF * (at.nD1 + n1.err) + nIF * n1.err
    eM = eD2IF * (at.nD1 + n1.err) + (at.nD2 * nIF) * n1.err
    chains = _chain_output_norms(n1, IF, n2, nIF, at.heads, (n1.err, eIFD1, eM))
    nIFG = first_norm_gamma(at, IF) if at.sig1 is not None else None
    return PostPoint(gram.a_pt, aP_pt, h_pt, g_pt, point, xc, IF, nIF, nD2IFg, *chains, nIFG)


@dataclass(frozen=True)
class PrePoint:
    """Pre-LN row constants at X (Note [weighted row Gram], THEORY F17b): ``B`` (``a_pt``, ``B_ij`` with
    ``D1_j``) and the layer ``M B`` (``point``, Ritz vectors ``x``) with the token-wise ``M = I + F D2``
    (norm ``nM``), ``||F Gamma2||``, the head-output norms through ``M`` and the bound ``eM`` on the rounding
    of the formed ``M``."""

    a_pt: Tensor
    point: Tensor
    x: Tensor
    M: Tensor
    nM: Tensor
    nFg: Tensor
    MO: tuple
    eM: Tensor


def pre_point(at: LayerAtX, gram: RowGram) -> PrePoint:
    """``PrePoint``: the Gram ``M S M^T`` per token, with ``M``'s rounding from ``F``'s and ``D2``'s.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    d, F, eF, D2 = at.d, at.F, at.eF, at.D2
    M = torch.eye(d, dtype=torch.float64) + F @ D2
    eD2 = at.eD2  # the formed D2 against the true one: u, s and the entries (F17f)
    nF = pow2_norm(F, (1, 2))
    eM = eF * at.nD2 + (nF + eF) * eD2 + 4 * (d + 2) * _U * nF * pow2_norm(D2, (1, 2))
    nM = _spectral_err(M, eM)
    point, xc = pre_rows(gram, M, eM, nM)
    nFg = _spectral_err(F * _gamma_vec(at.layer.norm_ffn, d)[None, None, :], eF * at.g2)
    return PrePoint(gram.a_pt, point, xc, M, nM, nFg, _head_output_norms(M, eM, at.heads, at.T), eM)


def pre_rows(gram: RowGram, M: Tensor, eM: Tensor, nM: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(``point``, Ritz vectors) of ``PrePoint`` from one row Gram: ``M S M^T`` (``M`` within ``eM``; ``nM`` a
    certified bound on the formed ``M``'s spectral norm for the error's propagation, THEORY F98)."""
    Sc, ec = _sandwich(M, gram.S, gram.err, eM, nM)
    return _nu(Sc, ec, gram.wsum)


def point_lower(at: LayerAtX, gram: RowGram, pt: PostPoint | PrePoint, lower: int) -> tuple[Tensor, tuple]:
    """Attained row norms at X (``row_lower``, empirical lower) for the ``lower`` tokens with the largest
    certified point rows, NaN elsewhere, and ``(token, V)`` of the largest; the search starts from the
    Ritz vectors of the row Grams.  Post-LN forms ``M_i = D2_i (I + F_i) D1_i`` for those tokens only."""
    top = pt.point.topk(min(lower, at.T)).indices.tolist()
    if at.post:
        it = torch.tensor(top)
        M = dict(zip(top, at.n2.dense(it) @ pt.IF[it] @ at.n1.dense(it)))
    else:
        M = pt.M
    vals, Vs = row_lower(at.heads, at.Wo_all, gram.Bii, M, at.D1, top, init=pt.x)
    low = torch.full((at.T,), math.nan, dtype=torch.float64)
    low[top] = vals
    k = int(vals.argmax())
    return low, (top[k], Vs[k])


# F47's weights are set on the ball of this factor of the median input token norm: fixed by the layer's data, so a
# ball's bound does not depend on the other radii of the call (any weights are valid; the 1e-3 .. 1e-2 balls matter)
JOINT_REF = 5e-3


@dataclass(frozen=True)
class DriftAtX:
    """The radius-free data of the attention drift (THEORY F17d, F35): per-head output norms ``Oh`` and
    all heads' ``Oall`` (``||W_O^hT||``, ``||W_O^T||`` per token), F35d's joint block norms ``Cw``, the
    per-query moments, and post-LN F34a's value(-output) geometries and F47's heads (``joint``)."""

    Oh: Tensor
    Oall: Tensor
    Cw: Tensor
    mom: _HeadMoments
    geo_v: object
    geo_ov: object
    joint: object


def drift_at_x(at: LayerAtX, cache: dict | None = None) -> DriftAtX:
    """``DriftAtX`` of the layer's heads at X (per layer, shared by every radius); ``cache`` (``head_norms``' dict)
    keeps the data-free per-head maps and norms across calls (F52c)."""
    scale = at.layer.attention.softmax_scale
    Oh, _ = _head_output_norms(None, None, at.heads, at.T)
    geo = [head_geometry(at.heads, scale, output=o, cache=cache) for o in (False, True)] if at.post else [None, None]
    return DriftAtX(Oh, torch.full((at.T,), at.nO, dtype=torch.float64), output_block_norms(at.heads),
                    _HeadMoments(at.heads, scale), *geo,
                    joint_heads(at.heads, JOINT_REF * float(at.Xin.norm(dim=1).median()), cache) if at.post else None)


# -- per radius ------------------------------------------------------------------------------------

def riemann(r: float, subs: list, name: str, sup_r: Tensor) -> Tensor:
    """F31e: a stage's move is ``int_0^1 nu(J_s(X + tE)) ||E|| dt``, and for ``t`` in ``[t_k, t_{k+1}]`` the
    point lies in ``B(X, t_{k+1} r)``: r times the mean of the stage sups at ``t_k r`` (right Riemann sum);
    ``subs`` the sub-balls' sups, ``sup_r`` the stage sup on ``B(X, r)``."""
    return r * sum([s[name] for s in subs] + [sup_r]) / (len(subs) + 1)


@dataclass(frozen=True)
class PostAttention:
    """Post-LN attention sublayer on ``B(X, r)``: the heads' drift rows ``dZ`` (H, T) and their joint
    bound ``jz`` (F17d/F35, F35d), the sups of ``nu_i(B')`` (``A``; centred ``AP``) and of the attention
    alone (``att_rows``), the output radius ``r1`` (F31b, F34), F34a's remainders ``remA`` (all heads)
    and ``remV`` (per head), F47's remainders through ``D1`` and ``(I + F) D1`` (``remJ``: ``"H"``, ``"G"``) and the
    drift seen through the whole chain ``M`` (``mixed``)."""

    dZ: Tensor
    jz: Tensor
    A: Tensor
    AP: Tensor
    att_rows: Tensor
    r1: Tensor
    remA: Tensor
    remV: Tensor
    remJ: dict
    mixed: Tensor


def joint_maps(at: LayerAtX, pt: PostPoint) -> dict:
    """F47's per-token maps after the post-LN attention sublayer: ``D1`` and ``(I + F) D1``, each as (its sandwich
    ``S, err -> M S M^T, err'``, ``||M_i||``)."""
    IFsw = lambda S, e: _sandwich(pt.IF, *at.n1.sandwich(S, e), at.eF, pt.nIF)  # noqa: E731
    return {"H": (at.n1.sandwich, at.nD1), "G": (IFsw, pt.nIF * at.nD1)}


def post_attention(at: LayerAtX, pt: PostPoint, dd: DriftAtX, norms: dict, r: float, subs: list) -> PostAttention:
    """``PostAttention``: ``nu_i(A') <= nu_i(B') + 1``; the radius the smallest of F31e's Riemann sum of
    the sups, the sublayer's own move (residual + heads, F31b) and the exact linear map at X plus
    F34a's second-order remainder (the smaller of F34a's per-head forms and F47's one direction for all heads)."""
    dZ = attention_drift_rows(dd.mom, r, norms)
    jz = heads_joint(dd.Cw, dZ)
    dB = _heads_combined(dd.Oh, dd.Oall, dZ, jz)
    A, AP = pt.a_pt + dB, pt.aP_pt + dB  # ||P W_O^hT|| <= ||W_O^hT||
    hm = head_moves(dd.mom, r, norms)
    rr = torch.full((at.T,), r, dtype=torch.float64)
    r1 = torch.minimum(riemann(r, subs, "AP", AP), rr + _heads_combined(dd.Oh, dd.Oall, hm, heads_joint(dd.Cw, hm)))
    remA, remV = attention_remainder(dd.mom, dd.geo_v, dd.geo_ov, at.nO, r, norms)
    remJ = joint_remainder(dd.joint, dd.mom, dd.geo_ov, r, norms, joint_maps(at, pt))  # F47, also through the maps
    remA = torch.minimum(remA, remJ["A"])
    r1 = torch.minimum(r1, r * pt.aP_pt + remA) * (1 + 1e-12)
    mixed = _heads_combined(*pt.MO, dZ, at.nD2 * pt.nIF * at.nD1 * jz)
    return PostAttention(dZ, jz, A, AP, A + 1, r1, remA, remV, remJ, mixed)


@dataclass(frozen=True)
class PostFirstNorm:
    """Post-LN first norm on its input ball of radii ``r1``: its Jacobian drift ``e1`` (``max|gamma|``
    left out), the sup of ``nu_i(D1' B')`` (``Hs``), the output radius ``rh`` (F31b, F34b), the heads'
    remainder through ``(I + F) D1`` (``remG``) and the attention drift seen through ``(I + F) D1``
    (``dG``, F32's chains); ``remH`` the remainder of H's move past the linear map at X (F34b) and ``reach`` F54's
    bound on the FFN's remainder (inf where not evaluated, ``ffn_reach``); ``dHs >= sup nu_i(D1' B' - D1 B)`` and
    ``ffnq`` F70's FFN drift through the reachable rows at X (inf where not evaluated; filled in place by
    ``ffn_reach_rows``)."""

    e1: Tensor
    Hs: Tensor
    rh: Tensor
    remG: Tensor
    dG: Tensor
    remH: Tensor
    dHs: Tensor
    ffnq: Tensor
    ffnqm: Tensor
    reach: Tensor | None = None


def post_first_norm(at: LayerAtX, pt: PostPoint, att: PostAttention, r: float, subs: list) -> PostFirstNorm:
    """``PostFirstNorm``: ``Delta D1 = Delta D1 P`` acts on ``P B'`` (rows at most ``AP``); the heads'
    remainders seen through ``D1 W_O`` and ``(I + F) D1 W_O`` or the norms (F34b) or jointly (F47), the norm's own
    remainder the smaller of F34b's and the sphere's curvature (F41c) -- a zero output map
    times an infinite remainder is nan, the bound there is inf; ``||D1'|| <= max|gamma|/s_floor``; the drift ``e1``
    the smaller of F17's and the sphere's curvature (F43a)."""
    g1, nD1, r1 = at.g1, at.nD1, att.r1
    e1, sf1 = norm_drift(at.layer.norm_attn, at.sig1, r1, at.d)  # F17's drift or the sphere's curvature (F43a)
    remN = norm_remainder(g1, e1, r1)
    if at.sig1 is not None:  # F41c: the normalisation's own curvature
        remN = torch.minimum(remN, sphere_remainder(g1, at.n1.s, r1, at.d))
    remH = torch.minimum(torch.minimum(nD1 * att.remA, _heads_combined(*pt.D1O, att.remV)), att.remJ["H"]) + remN
    remG = torch.minimum(pt.nIF * remH, torch.minimum(_heads_combined(*pt.IFD1O, att.remV), att.remJ["G"])
                         + pt.nIF * remN)  # F47's through (I + F) D1
    remH, remG = (torch.nan_to_num(v, nan=math.inf) for v in (remH, remG))
    hB = _heads_combined(*pt.D1O, att.dZ, nD1 * att.jz)  # nu_i(D1 (B' - B))
    Hs = torch.minimum(pt.h_pt + g1 * e1 * att.AP + hB, g1 / sf1 * att.AP if at.sig1 is not None else att.A)
    rh = riemann(r, subs, "Hs", Hs)
    rh = torch.minimum(rh, g1 / sf1 * r1 if at.sig1 is not None else r1)
    rh = torch.minimum(rh, r * pt.h_pt + remH) * (1 + 1e-12)  # F34b
    dG = _heads_combined(*pt.IFD1O, att.dZ, pt.nIF * nD1 * att.jz)
    dHs = torch.minimum(g1 * e1 * att.AP + hB, Hs + pt.h_pt) * (1 + 1e-12)  # D1'B' - D1B = (D1' - D1)B' + D1(B' - B)
    return PostFirstNorm(e1, Hs, rh, remG, dG, remH, dHs, torch.full_like(rh, math.inf), torch.full_like(rh, math.inf))


# F54: the reachable-set FFN remainder is evaluated where F34b's r2 with F17c's global drift is at least this
# fraction of the second norm's floor sqrt(d) sigma2 (below it the floor holds with room)
REACH_GATE = 0.5


def ffn_reach(at: LayerAtX, pt: PostPoint, gram: RowGram, fn: PostFirstNorm, ffn_drift, r: float) -> Tensor:  # noqa: ANN001
    """(T,) F54's bound on the FFN's remainder (``ffn_reach_remainder``; the first norm's row Gram ``D1 S D1^T``, the
    remainder ``remH``), inf where not evaluated.  Gate (cost, F54c): only tokens whose ``r g_pt + remG`` plus F17c's
    global remainder reaches ``REACH_GATE`` of ``sqrt(d) sigma2``, in decreasing order of that ratio, stopping after the
    first token where ``r g_pt + remG`` plus this bound still reaches ``sqrt(d) sigma2`` (its floor is lost by this
    branch).  None without a GELU FFN or a centring second norm."""
    from ._local_ffn_reach import ffn_reach_remainder

    base = getattr(ffn_drift, "base", ffn_drift)
    out = torch.full((at.T,), math.inf, dtype=torch.float64)
    if base.taylor is None or at.sig2 is None or not _centring(at.layer.norm_ffn):
        return out
    lin = r * pt.g_pt + fn.remG
    lim = math.sqrt(at.d) * at.sig2
    ratio = (lin + base.glob(fn.rh)[1] * fn.rh) / lim
    Sa, ea = gram.S1  # every token's own D1 S_i D1^T (a slice of S against all tokens' D1 would pair S_i with D1 of 0)
    for i in ratio.argsort(descending=True).tolist():
        if not bool(ratio[i] >= REACH_GATE):
            break
        S, eS = Sa[i:i + 1], ea[i:i + 1]
        out[i] = ffn_reach_remainder(base.taylor, base.n1, at.z[i:i + 1], S, eS, gram.wsum[i:i + 1], r,
                                     fn.remH[i:i + 1], fn.rh[i:i + 1], at.ez[i:i + 1],
                                     base.known_second_norms(torch.tensor([i])))[0]
        if not bool(lin[i] + out[i] < lim[i]):
            break
    return out


# F70c/F72b: per radius, at most this many tokens get F70a's exact certificate (~0.7 s CPU a token at MiniLM's sizes);
# 0 turns F70 and F72 off
REACH_DRIFT_TOKENS = 2


class _LastCall:
    """A rows tail that keeps its last arguments: ``ffn_drift.rows`` ends with the final FFN drifts (F37a's last
    evaluation), so ``ffn_reach_rows`` can evaluate the same rows again with more of F70a's terms."""

    def __init__(self, tail) -> None:  # noqa: ANN001
        self.tail, self.args = tail, ()

    def __call__(self, *args):  # noqa: ANN002, ANN204
        self.args = args
        return self.tail(*args)


def ffn_reach_rows(at: LayerAtX, gram: RowGram, fn: PostFirstNorm, ffn_drift, r: float, tail: _LastCall,  # noqa: ANN001
                   rows: dict) -> dict:
    """The rows with F70a's FFN drift through the reachable rows (in place in ``fn.ffnq``, ``fn.ffnqm``), refined
    lazily by F37a's rule over the reported rows (THEORY F72b): a token asked for gets F72a's Schur bound first
    (``ffn_reach_drift_schur``, batched, ~0.07 s a token), then, asked again, F70a's certificate (``ffn_reach_drift``)
    min'ed with it, final; a token whose second-norm input radius reaches the floor ``sqrt(d) sigma2`` is final as it
    is (its row is ``s_floor``'s cap), and past ``REACH_DRIFT_TOKENS`` exact certificates the Schur bound is final (a
    gate of cost, F70c: the maxima are then certified bounds, no longer those of F70a at every token).  Every row is
    non-increasing in ``ffnq``, ``ffnqm`` and depends on its own token's only, so with nothing capped the reported maxima
    are those of F70a at every token.  Only where the caller reads the maxima (F45's tiers) and the FFN is an
    exact-GELU one (F38's constants)."""
    from ._local_ffn_reach import ffn_reach_drift, ffn_reach_drift_schur

    base = getattr(ffn_drift, "base", ffn_drift)
    if base.taylor is None or not base.tiers or REACH_DRIFT_TOKENS <= 0:
        return rows
    Sa, ea = gram.S1  # every token's own D1 S_i D1^T
    level = torch.zeros(at.T, dtype=torch.long)  # 0 none, 1 F72a, 2 final (floor lost or capped), 3 final with F70a
    floor = None if at.sig2 is None else math.sqrt(at.d) * at.sig2
    last = {"rows": rows}

    def args(idx: Tensor) -> tuple:
        ez = None if at.ez is None else at.ez[idx]
        return (base.taylor, base.n1, at.z[idx], Sa[idx], ea[idx], gram.wsum[idx], r, fn.remH[idx], fn.rh[idx], ez)

    def refine(idx: Tensor) -> Tensor:
        lost = torch.zeros(len(idx), dtype=torch.bool) if floor is None else \
            ~(last["rows"]["stage"]["ffn"][idx] < floor[idx])
        level[idx[lost & (level[idx] < 2)]] = 2  # the second norm's floor lost there: F70 cannot matter (F70c)
        new = idx[level[idx] == 0]
        if len(new):
            fn.ffnq[new], fn.ffnqm[new] = ffn_reach_drift_schur(*args(new), split=base.split())
            level[new] = 1
        for i in idx[(level[idx] == 1) & ~torch.isin(idx, new)].tolist():
            if int((level == 3).sum()) < REACH_DRIFT_TOKENS:
                one = torch.tensor([i])
                q, qm = ffn_reach_drift(*args(one), n2=base.known_second_norms(one))
                fn.ffnq[i], fn.ffnqm[i] = torch.minimum(fn.ffnq[i], q[0]), torch.minimum(fn.ffnqm[i], qm[0])
                level[i] = 3
            else:
                level[i] = 2
        return level[idx] >= 2

    def evaluate() -> dict:
        last["rows"] = tail(*tail.args)
        return last["rows"]

    return refine_lazily(evaluate, base.asks, refine, at.T)


@dataclass(frozen=True)
class FoldAtX:
    """Post-LN, the first norm's Jacobian without ``gamma``, ``D_n``, at X (THEORY F46): ``nu_i(D_n B)`` (``hn_pt``)
    and ``||D_n||`` (``nDn``) per token."""

    hn_pt: Tensor
    nDn: Tensor


def fold_at_x(at: LayerAtX, gram: RowGram) -> FoldAtX:
    """``FoldAtX``: ``post_point``'s sandwich of the first norm with ``gamma`` left out (a ``NormJac`` of the norm
    without a scale at the same ``S1``); ``||diag(a)(I - Q Q^T)|| <= max|a| (1 + 1e-12)`` as F32's chains."""
    S1 = at.Xin + attention_forward(at.layer.attention, at.Xin)
    nn = NormJac(replace(at.layer.norm_attn, weight=None), S1)
    Sa, ea = nn.sandwich(gram.S, gram.err)
    return FoldAtX(_nu(Sa, ea, gram.wsum)[0], nn.amax * (1 + 1e-12))


@dataclass(frozen=True)
class FoldBall:
    """The normalised vector ``n`` before the FFN on the ball (THEORY F46): ``Ns >= sup ||D_n'||`` (pre-LN) or
    ``sup nu_i(D_n' B')`` (post-LN), ``D_n`` the norm's Jacobian without ``gamma``, and the radii ``rn`` of ``n``."""

    Ns: Tensor
    rn: Tensor


def post_fold(at: LayerAtX, dd: DriftAtX, att: PostAttention, fx: FoldAtX, r: float, subs: list) -> FoldBall:
    """Post-LN ``FoldBall`` (``post_first_norm``'s bounds with ``gamma`` left out): ``||D_n'|| <= 1/s_floor`` and
    ``D_n = D_n P``, so ``nu_i(D_n' B') <= AP/s_floor``, or ``<= nu_i(D_n B) + e1 AP + ||D_n|| nu_i(B' - B)``; ``rn``
    the smallest of F31e's Riemann sum of those sups, ``r1/s_floor`` (the mean-value theorem on the input ball) and
    F34b's ``r nu_i(D_n B) + ||D_n|| remA`` plus the norm's own remainder (F34b's or F41c's, ``gamma`` left out); a
    zero map times an infinite remainder is nan, the bound there inf."""
    e1, sf1 = norm_drift(at.layer.norm_attn, at.sig1, att.r1, at.d)
    dB = _heads_combined(dd.Oh, dd.Oall, att.dZ, att.jz)  # nu_i(B' - B), as post_attention's
    Ns = torch.minimum(att.AP / sf1, fx.hn_pt + e1 * att.AP + fx.nDn * dB) * (1 + 1e-12)
    remN = torch.minimum(norm_remainder(1.0, e1, att.r1), sphere_remainder(1.0, at.n1.s, att.r1, at.d))
    lin = torch.nan_to_num(r * fx.hn_pt + fx.nDn * att.remA + remN, nan=math.inf)
    rn = torch.minimum(torch.minimum(riemann(r, subs, "Ns", Ns), att.r1 / sf1), lin)
    return FoldBall(Ns, rn * (1 + 1e-12))


def post_ffn(at: LayerAtX, pt: PostPoint, att: PostAttention, fn: PostFirstNorm, lffn: float, r: float,
             subs: list, fb: FoldBall | None, dF: Tensor, dFh: Tensor, fold: tuple | None) -> tuple[Tensor, Tensor]:
    """Post-LN FFN sublayer given its drift bounds (``dF`` on the ball, ``dFh`` its mean along a
    segment): the sup ``Gs`` of ``nu_i((I + F') D1' B')`` (centred: ``||P dF|| <= kappaP rh``) and the
    output radius ``r2`` (F31b: ``S2' - S2 = (I + F) dh + int_0^1 (F(h + t dh) - F(h)) dh dt``, the
    remainder at most ``dF(rh)/2 rh``; F34b).  ``fold``: the ``gamma``-folded drifts ``(dG, dGh)`` on ``fb``'s
    radii (F46): ``(F' - F) D1' B' = (F' - F) diag(gamma1) D_n' B'`` and ``dh = gamma1 o dn``, one more branch each."""
    Hs, rh = fn.Hs, fn.rh
    Gs = torch.minimum(pt.g_pt + dF * Hs + pt.nIF * at.g1 * fn.e1 * att.AP + fn.dG, (pt.nIF + dF) * Hs)
    if fold is not None:  # F46
        Gs = torch.minimum(Gs, torch.minimum(pt.g_pt + fold[0] * fb.Ns + pt.nIF * at.g1 * fn.e1 * att.AP + fn.dG,
                                             pt.nIF * Hs + fold[0] * fb.Ns))
    Gs = torch.minimum(Gs, (1 + lffn) * Hs)
    q = rows_drift(fn, dF)  # F70b
    Gs = torch.where(torch.isfinite(q), torch.minimum(Gs, pt.g_pt + q + pt.nIF * at.g1 * fn.e1 * att.AP + fn.dG), Gs)
    r2 = torch.minimum(riemann(r, subs, "Gs", Gs), (pt.nIF + dFh).clamp(max=1 + lffn) * rh)
    r2 = torch.minimum(r2, r * pt.g_pt + fn.remG + dFh * rh)  # F34b
    if fn.reach is not None:  # F54: the remainder on the first norm's reachable set
        r2 = torch.minimum(r2, r * pt.g_pt + fn.remG + fn.reach)
    if fold is not None:  # F46: the remainder on S2's move through the folded drift on n's ball
        r2 = torch.minimum(r2, torch.minimum(pt.nIF * rh, r * pt.g_pt + fn.remG) + fold[1] * fb.rn)
    return Gs, r2 * (1 + 1e-12)


def rows_drift(fn: PostFirstNorm, dF: Tensor) -> Tensor:
    """(T,) F70b's bound on ``sup nu_i(P(F' - F) D1' B')``: ``(F' - F) D1' B' = (F' - F) D1 B + (F' - F)(D1' B' - D1 B)``,
    so ``<= ffnq + min(dF, ffnqm) dHs``, and ``<= ffnqm Hs`` (``ffnq`` F70a's drift through the reachable rows at X,
    ``ffnqm`` its sup over unit directions, ``dF`` the drift on the ball ``||dh|| <= rh``); inf where not evaluated (also
    where a product is nan: ``0 inf``)."""
    split = (fn.ffnq + torch.minimum(dF, fn.ffnqm) * fn.dHs) * (1 + 1e-12)
    return torch.nan_to_num(torch.minimum(split, fn.ffnqm * fn.Hs * (1 + 1e-12)), nan=math.inf)


def post_tail(at: LayerAtX, pt: PostPoint, att: PostAttention, fn: PostFirstNorm, lffn: float, r: float,
              subs: list, fb: FoldBall | None, dF: Tensor, dFh: Tensor, fold: tuple | None) -> dict:
    """Post-LN rows on ``B(X, r)`` given the FFN drift bounds: the FFN stage (``post_ffn``), the second
    norm on its input ball of radii ``r2`` (its drift F17's or the sphere's curvature, F43a) and the drift
    terms of ``J = D2 (I + F) D1 B`` telescoped stage by stage (Note [stage radii], THEORY F17), capped by
    ``max|gamma2|/s_floor`` times ``Gs``; the FFN term also through the folded drift (F46, ``post_ffn``)."""
    Gs, r2 = post_ffn(at, pt, att, fn, lffn, r, subs, fb, dF, dFh, fold)
    e2, sf2 = norm_drift(at.layer.norm_ffn, at.sig2, r2, at.d)  # F17 or F43a
    ffn = at.nD2 * dF * fn.Hs if fold is None else torch.minimum(at.nD2 * dF * fn.Hs, at.nD2 * fold[0] * fb.Ns)
    q = rows_drift(fn, dF)  # F70b
    ffn = torch.where(torch.isfinite(q), torch.minimum(ffn, at.nD2 * q), ffn)
    terms = {"norm_ffn (dD2)": at.g2 * e2 * Gs, "ffn (dF)": ffn,
             "norm_attn (dD1)": pt.nD2IFg * fn.e1 * att.AP, "attention (dA)": att.mixed}
    total = pt.point + sum(terms.values())
    if at.sig2 is not None:
        total = torch.minimum(total, at.g2 / sf2 * Gs)
    sups = {"AP": att.AP, "Hs": fn.Hs, "Gs": Gs} | ({} if fb is None else {"Ns": fb.Ns})
    out = _rows(terms, total, {"attention": att.r1, "norm_attn": fn.rh, "ffn": r2}, sups)
    out["rem"] = stage_remainders(att, fn, dFh, fb, fold)
    return out


def stage_remainders(att: PostAttention, fn: PostFirstNorm, dFh: Tensor, fb: FoldBall | None,
                     fold: tuple | None) -> dict:
    """Post-LN, the remainders past the layer's linear maps at X that ``post_tail``'s radii add to ``r`` times the
    point rows (THEORY F59b): per stage output the remainder of its move for every input move in ``B(X, r)``,
    ``"attention"`` ``remA`` (F34a/F47), ``"norm_attn"`` ``remH`` (F34b), ``"ffn"`` ``remG`` (F34b/F55a); the FFN's own
    remainder ``||P(F(h + dh) - F(h) - F'(h) dh)||`` at most ``ffn_coef * ||dh||`` for ``||dh|| <= ffn_ball``
    (``dFh``, F17c/F37) and at most ``ffn_fixed`` (F54's ``reach``, F46's folded ``fold[1] rn``; inf where absent);
    ``radius_rows`` adds F17c's global drift on any smaller ball, ``min(ffn_slope rh / 2, ffn_cap)``.  Every entry is
    already one of ``post_tail``'s terms: exposing them changes no per-layer number."""
    fixed = torch.full_like(fn.rh, math.inf) if fn.reach is None else fn.reach
    if fold is not None:
        fixed = torch.minimum(fixed, fold[1] * fb.rn)
    return {"attention": att.remA, "norm_attn": fn.remH, "ffn": fn.remG, "ffn_coef": dFh, "ffn_ball": fn.rh,
            "ffn_fixed": fixed}


@dataclass(frozen=True)
class PreAttention:
    """Pre-LN first norm and attention on ``B(X, r)``: the attention's input radius ``ry`` (through
    ``sup||D1'||``, Note [Jacobian drift]), the sups ``A`` of ``nu_i(I + A' D1')`` and ``att_rows`` of the
    attention alone (F17d/F35 drift, F35d), ``max||D1'||`` and ``max|gamma1| e1`` (``mD1``, ``mE1``),
    the output radius ``r1`` (F31b, F31e) and the drift seen through ``M`` (``mixed``)."""

    ry: float
    A: Tensor
    att_rows: Tensor
    mD1: float
    mE1: float
    r1: Tensor
    mixed: Tensor


def pre_attention(at: LayerAtX, pt: PrePoint, dd: DriftAtX, norms: dict, hn: dict, r: float,
                  subs: list) -> PreAttention:
    """``PreAttention``: ``nu_i(B') <= nu_i(B) + dA sup||D1'|| + nu_i(A') max|gamma1| e1``, capped by
    ``1 + nu_i(A') sup||D1'||``; the radius the smaller of F31e's Riemann sum and the residual plus the
    attention's own move on its input ball (F31b)."""
    from ._local_attention import attention_local_bound

    T, g1 = at.T, at.g1
    rr = torch.full((T,), r, dtype=torch.float64)
    e1, sf1 = norm_drift(at.layer.norm_attn, at.sig1, rr, at.d)  # F17 or F43a
    sD1 = torch.minimum(g1 / sf1, at.nD1 + g1 * e1) if at.sig1 is not None else torch.ones(T, dtype=torch.float64)
    ry = r * float(sD1.max()) * (1 + 1e-12)
    if not math.isfinite(ry):
        raise InputError(f"the attention's input radius behind the first norm overflows float64 at r = {r:g} "
                         "(r times sup ||D1|| on the ball): the per-layer route has no bound on this ball")
    dZ = attention_drift_rows(dd.mom, ry, norms)
    jz = heads_joint(dd.Cw, dZ)
    dA = _heads_combined(dd.Oh, dd.Oall, dZ, jz)
    att_rows = attention_local_bound(at.layer.attention, at.Xin, ry, norms=hn).per_query
    mD1, mE1 = float(sD1.max()), float((g1 * e1).max())
    A = torch.minimum(pt.a_pt + (dA * mD1 + att_rows * mE1), 1 + att_rows * mD1)
    hm = head_moves(dd.mom, ry, norms)
    r1 = torch.minimum(riemann(r, subs, "A", A), rr + _heads_combined(dd.Oh, dd.Oall, hm, heads_joint(dd.Cw, hm)))
    mixed = _heads_combined(*pt.MO, dZ, pt.nM * jz) * mD1
    return PreAttention(ry, A, att_rows, mD1, mE1, r1 * (1 + 1e-12), mixed)


def pre_second_norm(at: LayerAtX, att: PreAttention) -> tuple[Tensor, Tensor, Tensor]:
    """Pre-LN second norm on its input ball of radii ``r1``: (``e2``, ``sup||D2'||``, the FFN's input
    radius ``rh``) (Note [Jacobian drift]; the drift F17's or the sphere's curvature, F43a)."""
    e2, sf2 = norm_drift(at.layer.norm_ffn, at.sig2, att.r1, at.d)  # F17 or F43a
    sD2 = torch.minimum(at.g2 / sf2, at.nD2 + at.g2 * e2) if at.sig2 is not None \
        else torch.ones(at.T, dtype=torch.float64)
    return e2, sD2, att.r1 * sD2 * (1 + 1e-12)


def pre_fold(at: LayerAtX, att: PreAttention) -> FoldBall:
    """Pre-LN ``FoldBall`` of the second norm on its input ball of radii ``r1``: ``||D_n'|| <= 1/s_floor``,
    ``rn = r1/s_floor`` (THEORY F46)."""
    _, sf2 = norm_drift(at.layer.norm_ffn, at.sig2, att.r1, at.d)
    Ns = (1 / sf2) * (1 + 1e-12)
    return FoldBall(Ns, att.r1 * Ns * (1 + 1e-12))


def pre_tail(at: LayerAtX, pt: PrePoint, att: PreAttention, e2: Tensor, sD2: Tensor, rh: Tensor,
             fb: FoldBall | None, dF: Tensor, dFh: Tensor, fold: tuple | None) -> dict:
    """Pre-LN rows on ``B(X, r)`` given the FFN drift bound ``dF``: ``J = M B`` with ``||M' - M|| <= dM
    = dF sup||D2'|| + ||F Gamma2|| e2``, the drift terms of ``M``, the attention and the first norm
    (THEORY F17), capped by ``(||M|| + dM) A``; ``fold``: the folded drift ``dG`` on ``fb``'s radii, ``(F' - F) D2' =
    (F' - F) diag(gamma2) D_n'`` (F46).  ``dFh`` is not used (no stage after the FFN)."""
    dM = dF * sD2 + pt.nFg * e2
    if fold is not None:  # F46
        dM = torch.minimum(dM, fold[0] * fb.Ns + pt.nFg * e2)
    terms = {"norm_ffn/ffn (dM)": dM * att.A, "attention (dA)": att.mixed,
             "norm_attn (pre, dD1)": pt.nM * att.att_rows * att.mE1}
    total = torch.minimum(pt.point + sum(terms.values()), (pt.nM + dM) * att.A)
    return _rows(terms, total, {"attention": att.ry * torch.ones(at.T, dtype=torch.float64), "norm_ffn": att.r1,
                                "ffn": rh}, {"A": att.A})


def radius_rows(at: LayerAtX, pt: PostPoint | PrePoint, dd: DriftAtX, ffn_drift, norms: dict, hn: dict,  # noqa: ANN001
                r: float, subs: list, unit: bool = True, low: tuple | None = None,
                fx: FoldAtX | None = None, gram: RowGram | None = None) -> tuple[LayerJacobian, dict]:
    """The ``LayerJacobian`` on ``B(X, r)`` and its stage sups (for F31e's sums of a larger ball), stage
    after stage; the FFN drift by ``ffn_drift.rows`` (F17c, refined lazily by F31d/F38 when ``unit``,
    F37), with its ``gamma``-folded branch where ``ffn_drift.fold`` is set (F46; ``fx`` its post-LN data at X);
    ``low``: ``point_lower``'s result, carried into the result; ``gram`` (post-LN, with ``unit``): the attention's row
    Gram, for F54's FFN remainder on the reachable set (``ffn_reach``), and there F55a's branch of ``remG`` (the first
    norm's own remainder through ``(I + F) diag(gamma1)``, ``remg_gamma``; F31e's sub-balls do not read ``remG``)."""
    if at.post:
        att = post_attention(at, pt, dd, norms, r, subs)
        fn = post_first_norm(at, pt, att, r, subs)
        if unit and gram is not None:
            if at.sig1 is not None:  # F55a: the norm's own remainder through (I + F) diag(gamma1)
                fn = replace(fn, remG=torch.minimum(fn.remG, remg_gamma(at, pt, att, pt.nIFG)))
            fn = replace(fn, reach=ffn_reach(at, pt, gram, fn, ffn_drift, r))
        fb = post_fold(at, dd, att, fx, r, subs) if ffn_drift.fold is not None else None
        tail = _LastCall(partial(post_tail, at, pt, att, fn, ffn_drift.lip, r, subs, fb))
        rows = ffn_drift.rows(tail, fn.rh, None if fb is None else fb.rn, unit)
        if unit and gram is not None:
            rows = ffn_reach_rows(at, gram, fn, ffn_drift, r, tail, rows)
        base = getattr(ffn_drift, "base", ffn_drift)  # F17c's global drift on any smaller ball (F59b)
        rows["rem"] = rows["rem"] | {"ffn_slope": min(float(base.kappa), float(base.curv)),
                                     "ffn_cap": base.cap}
    else:
        att = pre_attention(at, pt, dd, norms, hn, r, subs)
        e2, sD2, rh = pre_second_norm(at, att)
        fb = pre_fold(at, att) if ffn_drift.fold is not None else None
        rows = ffn_drift.rows(partial(pre_tail, at, pt, att, e2, sD2, rh, fb), rh, None if fb is None else fb.rn, unit)
    return assemble(pt.point, att.att_rows, rows, r, low), rows["sups"]


def assemble(point: Tensor, att_rows: Tensor, rows: dict, r: float, low: tuple | None) -> LayerJacobian:
    """A radius's ``LayerJacobian``: point and ball rows padded for the rounding, the drift terms' maxima
    as ``parts``, the stage radii and the attained lower rows (if searched)."""
    parts = {k: float(v.max()) for k, v in rows["terms"].items()}
    lj = LayerJacobian(point * (1 + ROUNDING_PAD), rows["drift"], None, att_rows, parts,
                       ball_rows=rows["total"] * (1 + ROUNDING_PAD))
    lj.radius = r
    lj.stage_radii = rows["stage"]
    lj.stage_remainders = rows.get("rem", {})
    if low is not None:
        lj.lower_rows, lj.lower_V = low
    return lj
