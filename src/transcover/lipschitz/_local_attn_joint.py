"""The attention sublayer's remainder with one direction shared by every head (issue 12; THEORY F47).

F34a bounds each head's remainder ``R_h W_O^h`` (post-LN, through ``W_V W_O^h``) on its own and sums the norms
over the heads, each head at its own worst output direction.  Every term of F34a's ``L^2(P)`` forms is, for a unit
output direction ``u``, a coefficient times a seminorm of ``u`` (``sigma_h(u)``, the P-standard deviation of the
head's values along ``u``; ``||W_h u||``), so one ``u`` for all heads and Cauchy-Schwarz with weights give

    sum_h c_h n_h(u) <= (sum_h c_h^2 / w_h)^{1/2} lambda_max(sum_h w_h K_h)^{1/2},   n_h(u)^2 = u^T K_h u,

where the heads' value covariances ``K_h`` point in different directions of the model space.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._local_jacobian import GRAM_PAD, certified_lmax, pow2_norm
from ._local_joint import HeadGeometry, head_remainder_terms

__all__ = ["JointHeads", "joint_heads", "joint_remainder"]

_U = 2.0**-53
_PAD = 1 + 1e-10


@dataclass
class JointHeads:
    """Radius-free data of F47 for one layer: per head the value-output maps ``W_h = W_V^h W_O^h`` as formed (H, d, d),
    their Grams ``W_h^T W_h`` (H, d, d) and the float64 errors ``eps_z`` of the rows ``y_ij W_h`` and ``eps_w`` of
    ``W_h`` itself (H,); ``r_ref``: the radius whose coefficients set the weights (None: the first radius evaluated);
    ``cache`` keeps the weights and the certified ``lambda_max`` per query once formed."""

    heads: list
    W: Tensor
    N: Tensor
    eps_z: Tensor
    eps_w: Tensor
    r_ref: float | None = None
    cache: dict = field(default_factory=dict)


def joint_heads(heads, r_ref: float | None = None, cache: dict | None = None) -> JointHeads:  # noqa: ANN001
    """``JointHeads`` from the rows route's head data (``_head_data``: P, y, q, Wq, Wk, Wv, Wo), the weights set at
    ``r_ref`` (a radius fixed by the layer's data makes every ball's bound independent of the other radii of the
    call; None: at the first radius evaluated).  ``cache``: a per-layer dict (``head_norms``') that keeps the
    data-free ``W_h`` and ``W_h^T W_h`` across calls (the same floats; THEORY F52c).  Rounding as
    ``head_geometry``'s: each row ``y_ij W_h`` as formed is within ``gamma_{d + d_h + 2} max_j ||y_j|| ||W_V||_F
    ||W_O^h||_F`` of the exact one, ``W_h`` within ``gamma_{d_h} ||W_V||_F ||W_O^h||_F`` (spectral).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    if cache is None or "joint_WN" not in cache:
        W = torch.stack([hd[5] @ hd[6] for hd in heads])
        WN = (W, W.transpose(1, 2) @ W)
        if cache is not None:
            cache["joint_WN"] = WN
    W, N = WN if cache is None else cache["joint_WN"]
    fro = torch.tensor([float(pow2_norm(hd[5]) * pow2_norm(hd[6])) for hd in heads], dtype=torch.float64)
    ymax = torch.tensor([float(pow2_norm(hd[1], -1).max()) for hd in heads], dtype=torch.float64)
    d, dh = heads[0][1].shape[2], heads[0][5].shape[1]
    eps_z = 4 * (d + dh + 6) * _U * ymax * fro
    eps_w = 4 * (dh + 4) * _U * fro
    return JointHeads(heads, W, N, eps_z, eps_w, r_ref)


def _joint_lmax(jh: JointHeads, w1: Tensor, w3: Tensor, maps: dict) -> dict:
    r"""Per map ``M`` (``"A"`` the identity and ``maps``: name -> (``sandwich``, ``||M||``)) the (T,) certified
    ``lambda_max(M_i G_i M_i^T)``, ``G_i = sum_h w1_hi sum_j P^h_ij z_hij z_hij^T + w3_hi W_h^T W_h`` for the formed
    rows ``z_hij = y_ij W_h`` and maps ``W_h`` (weights ``>= 0``).  Rounding: the weighted Gram of ``m = H T + H d``
    rows as evaluated is within ``gamma_m`` of its trace (spectral, ``|z||z|^T`` has Frobenius norm ``||z||^2``),
    covered by ``GRAM_PAD`` of the trace for ``m <= 10^6``; the products ``w P`` and the symmetrisation ``4 u ||G||_F``;
    a map's ``sandwich(S, err)`` returns ``M S M^T`` with its own error bound (``NormJac.sandwich``, ``_sandwich``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    G = torch.einsum("th,hde->tde", w3.T.contiguous(), jh.N)
    for h, hd in enumerate(jh.heads):
        Z = hd[1] @ jh.W[h]  # (T, T, d): rows y_ij W_h
        G = G + Z.transpose(1, 2) @ (Z * (w1[h, :, None] * hd[0])[:, :, None])
    G = (G + G.transpose(1, 2)) / 2  # exactly symmetric (each entry and its mirror: the same sum)
    err = GRAM_PAD * G.diagonal(dim1=1, dim2=2).sum(-1) + 4 * _U * pow2_norm(G, (1, 2))
    out = {"A": certified_lmax(G) + err}
    for name, (sandwich, _) in maps.items():
        S, e = sandwich(G, err)
        out[name] = certified_lmax((S + S.transpose(1, 2)) / 2) + e * (1 + 1e-12) + 4 * _U * pow2_norm(S, (1, 2))
    return out


def _coefficients(mom, geo: HeadGeometry, r: float, norms: dict) -> tuple:  # noqa: ANN001
    """(the diameter forms summed over the heads (T,), ``c1`` and ``c3`` (H, T)) of F34a's per-head terms on
    ``B(X, r)`` (``head_remainder_terms``), each ``L^2(P)`` form kept where it is the one the head's own bound takes."""
    sp = geo.spread
    alone, c1s, c3s = 0.0, [], []
    for h in range(len(mom.rows)):
        t1d, c1, t2d, c2, c3 = head_remainder_terms(mom, geo, h, r, norms)
        l1, l2 = c1 * sp[h] <= t1d, c2 * sp[h] <= t2d  # the form the head's own bound takes
        alone = alone + torch.where(l1, 0.0, t1d) + torch.where(l2, 0.0, t2d)
        c1s.append(torch.where(l1, c1, 0.0) + torch.where(l2, c2, 0.0))
        c3s.append(c3)
    return alone, torch.stack(c1s), torch.stack(c3s)


def joint_remainder(jh: JointHeads, mom, geo: HeadGeometry, r: float, norms: dict,  # noqa: ANN001
                    maps: dict | None = None) -> dict:
    r"""Per map ``M`` (T,) certified ``||M_i sum_h R_h W_O^h||``: ``"A"`` the attention sublayer's remainder on
    ``B(X, r)`` itself, and for each of ``maps`` (name -> (``sandwich``, ``||M_i||``), the per-token maps after the
    sublayer, e.g. ``D1``, ``(I + F) D1``) the same seen through ``M`` (THEORY F47),
    one output direction ``u`` for every head: per head F34a's terms (``head_remainder_terms``, ``geo`` for ``W_V W_O``)
    in the form each head's own bound takes, the diameter forms as they are, the ``L^2(P)`` forms as
    ``c1_h sigma_h(u)`` and the value move as ``c3_h ||W_h u||``; then for any weights ``w > 0``

    .. math:: \sum_h c1_h\sigma_h(u) + c3_h\|W_hu\| \le \Big(\sum_h \frac{c1_h^2}{w1_h} + \frac{c3_h^2}{w3_h}\Big)^{1/2}
              \lambda_{\max}\Big(\sum_h w1_h C_h + w3_h W_h^\top W_h\Big)^{1/2},

    ``C_h = sum_j P_j z_j z_j^T`` (``sigma_h(u)^2 = u^T C_h u``, the rows ``z_j = y_j W_h`` centred by the P-mean).  The
    weights ``w1 = c1/spread``, ``w3 = c3/||W_h||`` make the right side at most the per-head sum (``lambda_max`` of a
    sum at most the sum at the radius they are taken at); they are taken at ``jh.r_ref`` (else the first radius this
    layer evaluates) and kept with their ``lambda_max``
    (any weights are valid); a head with a zero weight there and a positive ``L^2(P)`` term here is added alone
    (``c1 spread``, ``c3 ||W_h||``).  Through ``M``: ``u . M R = (M^T u) . R``, so ``K`` becomes ``M K M^T`` and the
    terms outside the Gram get ``||M_i||``.  The rows' float64 errors enter by Minkowski: ``sigma_h(u) <= sigma-hat_h(u)
    + eps_z``, ``||W_h u|| <= ||W-hat_h u|| + eps_w``.  ``maps`` are read when the weights are set (the first call).
    Assumptions: F34a's (post-LN, dot attention without RoPE)."""
    H, sp, nW = len(mom.rows), geo.spread, geo.norm[:, None]
    alone, c1, c3 = _coefficients(mom, geo, r, norms)
    if "lam" not in jh.cache:
        pos = lambda c, n: torch.where((c > 0) & (n > 0) & torch.isfinite(c), c / n, torch.zeros_like(c))  # noqa: E731
        w1, w3 = (c1, c3) if jh.r_ref is None or jh.r_ref == r else _coefficients(mom, geo, jh.r_ref, norms)[1:]
        w1, w3 = pos(w1, sp), pos(w3, nW.expand_as(w3))
        maps = maps or {}
        jh.cache.update(w1=w1, w3=w3, lam=_joint_lmax(jh, w1, w3, maps), norm={k: v[1] for k, v in maps.items()})
    w1, w3, lam = jh.cache["w1"], jh.cache["w3"], jh.cache["lam"]  # lam: per map
    on1, on3 = w1 > 0, w3 > 0
    alone = alone + (torch.where(on1, 0.0, c1 * sp) + torch.where(on3, 0.0, c3 * nW)).sum(dim=0)
    cs = (torch.where(on1, c1 * c1 / torch.where(on1, w1, 1.0), 0.0)
          + torch.where(on3, c3 * c3 / torch.where(on3, w3, 1.0), 0.0)).sum(dim=0) * (1 + (2 * H + 4) * _U)
    eps = (torch.where(on1, c1, 0.0) * jh.eps_z[:, None] + torch.where(on3, c3, 0.0) * jh.eps_w[:, None]).sum(dim=0)
    nM = {"A": 1.0, **jh.cache["norm"]}
    out = {k: (torch.sqrt(cs * v) * (1 + 2 * _U) + nM[k] * (eps + alone)) * _PAD for k, v in lam.items()}
    return {k: torch.nan_to_num(v, nan=math.inf, posinf=math.inf) for k, v in out.items()}
