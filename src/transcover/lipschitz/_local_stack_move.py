"""The move's rest by its own linear recursion at the data, with each stage's own Taylor rest (issue 12; THEORY F73c,
F76a, F77).

A network move ``delta`` (every token within ``rho``) moves sub-stage ``s``'s input by
``Delta_s = P_s(X) delta + e_s``.  From ``f_s(x_s + Delta_s) = f_s(x_s) + J_s(x_s) Delta_s + R_s`` with the stage's own
Taylor rest ``R_s = int_0^1 (J_s(x_s + tau Delta_s) - J_s(x_s)) Delta_s dtau``,

    e_{s+1} = J_s(x_s) e_s + R_s,   so   e_s = sum_{m < s} M_{m+1 -> s}(x) R_m,

``M_{a -> s} = J_{s-1} ... J_a`` the exact product of the sub-stages at the data: no Jacobian at a moved point
multiplies ``e`` and every span is one exact product (``substage_products``, whose chains from the layer-level cuts
are also F36's middle products and F40e's inner ones, ``middle_of_products``).  The rows of ``R_s`` are one function per
stage kind (``attention_rest_rows``, ``norm_rest_rows``, ``ffn_rest_rows``, ``stage_rest_rows`` for the others): a
tighter certified rest of a kind is one ``torch.minimum`` there.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["substage_products", "carried_error", "product_norm", "move_rest_rows", "carried_rows", "pull_rows", "image_sources", "IMAGE_BYTES",
           "stage_rest_rows", "attention_rest_rows", "norm_rest_rows", "ffn_rest_rows", "layer_rest_rows"]


def _padded(t: Tensor, pad: float = 0.0) -> Tensor:
    """``t (1 + 1e-12) + pad``, nan -> inf: the pad of a float64 sum of a few non-negative products (and the centre's)."""
    return torch.nan_to_num(t * (1 + 1e-12) + pad, nan=math.inf, posinf=math.inf)


def substage_products(stages: list, norms_of, local_error, apply, on_product=None,  # noqa: ANN001
                      first_end: int | None = None, rows_of=None, rows: dict | None = None) -> dict:  # noqa: ANN001
    """``{(a, s): (N, e)}`` for ``0 <= a < s <= n`` (from ``a = 0`` only ``s <= first_end``: ``E`` reads no product
    from the network input, and the prefix chain gives those rows): ``N`` the certified block norms (``norms_of`` of the computed
    columns) of ``M_{a -> s} = J_{s-1} ... J_a`` at the data, by a float64 chain of the sub-stages' tangent maps from
    every start ``a`` (``apply(stage, K)``), and ``e >= max_i sum_k ||E_ik||`` the computed product's rounding:
    ``fl(M_{a -> s}) - M_{a -> s} = sum_{a <= m < s} M_{m+1 -> s} E_m`` exactly (``E_m`` the step's own error,
    ``local_error(stage, K)`` in the (2,inf) norm), each ``||M_{m+1 -> s}||`` the certified rows of the later start's
    product plus its own rounding (the starts run from the last), the identity for ``m + 1 = s``.
    ``on_product(a, s, K, e)`` (optional) sees every computed product's columns.  ``rows_of`` (optional, with the dict
    ``rows``): for starts ``a > 0`` (those ``E`` reads) ``(N, nu)`` from the columns in place of ``norms_of``, ``nu`` the
    product's certified unit rows, kept in ``rows[(a, s)]`` (THEORY F95).  THEORY F73c, F36 item 1."""
    n = len(stages)
    T, d = stages[0].x.shape
    out: dict = {}
    for a in range(n - 1, -1, -1):
        K = torch.eye(T * d, dtype=torch.float64).reshape(T * d, T, d)
        errs = []
        for s in range(a, n if a > 0 or first_end is None else first_end):
            errs.append(local_error(stages[s], K))
            K = apply(stages[s], K)
            err = carried_error(out, errs, a, s + 1)
            if rows_of is not None and a > 0:
                N, rows[(a, s + 1)] = rows_of(K)
            else:
                N = norms_of(K)
            out[(a, s + 1)] = (N, err)
            if on_product is not None:
                on_product(a, s + 1, K, err)
    return out


# THEORY F86: the pulled-back rows kept for one attention stage at most this many bytes (the window's start moves up and
# the rest from before it enters as the image of its per-token ball; MiniLM at T = 7 needs about 0.5 GiB for 6 layers)
IMAGE_BYTES = 2**30


def _spectral(prods: dict, a: int, t: int) -> float:
    """Certified ``||M_{a -> t}||_2`` of the exact product (1 for ``a = t``): ``sqrt(||N||_1 ||N||_inf)`` of its block
    norms (``||M||_2 <= ||[||M_jk||]||_2``) plus the rounding's ``sqrt(T) e`` (block row sums ``<= e``)."""
    if a == t:
        return 1.0
    N, e = prods[(a, t)]
    c, r = float(N.sum(dim=0).max()), float(N.sum(dim=1).max())
    # the two square roots apart where their product leaves the normal range (0 below 2^-537, inf past 2^512)
    root = math.sqrt(c * r) if 2.0**-1000 < c * r < 2.0**1000 else math.sqrt(c) * math.sqrt(r)
    return (root + math.sqrt(N.shape[0]) * e) * (1 + 1e-12)


def pull_rows(stages: list, s: int, rows: Tensor, prods: dict, apply_t, row_error, budget: int = IMAGE_BYTES) -> dict:  # noqa: ANN001
    r"""``{a: (G_a, g_a)}`` for ``a0 <= a < s``: the rows ``rows`` (n, T, d) (cotangents at sub-stage ``s``'s input)
    pulled back through ``M_{a -> s} = J_{s-1} ... J_a`` at the data, ``G_a = rows M_{a -> s}`` as computed by a float64
    chain of the sub-stages' transposed tangent maps (``apply_t(stage, G)``), and (n,) ``g_a >= ||fl(G_a) - G_a||`` per
    row: ``fl(G_a) - G_a = sum_{a <= t < s} E_t M_{a -> t}`` exactly (``E_t`` step ``t``'s own error, per row
    ``row_error(stage, G)``), ``||M_{a -> t}||_2`` from ``prods``' certified block norms (``_spectral``).  ``a0 >= 1``
    (the network input's move has no rest) is as small as ``budget`` bytes of kept rows allow.  THEORY F86."""
    n = rows.shape[0]
    keep = max(1, budget // max(1, rows.numel() * 8))
    a0 = max(1, s - keep)
    out, errs, G = {}, [], rows
    for t in range(s - 1, a0 - 1, -1):
        errs.append((t, row_error(stages[t], G)))
        G = apply_t(stages[t], G)
        g = torch.zeros(n, dtype=torch.float64)
        for u, E in errs:
            g = g + E * _spectral(prods, t, u)
        out[t] = (G, _padded(g))
    return out


def image_sources(rests: list[Tensor], E0: Tensor | None, a0: int, s: int, keys) -> list:  # noqa: ANN001
    r"""THEORY F86: the move's rest at sub-stage ``s``'s input as images, ``e_s = M_{a0 -> s} e_{a0} + sum_{a0 <= m < s}
    M_{m+1 -> s} R_m`` (the linear recursion ``e_{m+1} = J_m e_m + R_m`` at the data, F73c): pairs ``(map, R)`` with
    ``||v_k|| <= R_k`` per token, the map ``keys(a)`` (``M_{a -> s}`` pulled back into the form, ``pull_rows``) or None
    (the identity, ``m + 1 = s``), and the start's ball ``E0 >= ||e_{a0}||`` for ``a0 > 1`` (``e_1 = R_0``: the network
    input moves by ``delta`` itself)."""
    first = a0 if a0 > 1 else 0
    parts = ([(a0, E0)] if a0 > 1 else []) + [(m + 1, rests[m]) for m in range(first, s)]
    return [(None if a == s else keys(a), R) for a, R in parts]


def carried_error(prods: dict, errs: list[float], a: int, s: int) -> float:
    r"""Certified ``||fl(K_s) - K_s||_(2,inf)`` of a chain of the sub-stages' exact linear maps from ``a`` to ``s``
    computed step by step, ``errs[m - a] >= ||E_m||_(2,inf)`` the error step ``m`` adds (``fl(J_m K) - J_m K`` on the
    computed ``K``): the errors are carried by the exact products at the data, not by the steps' own constants,

    .. math:: fl(K_s) - K_s = \sum_{a \le m < s} M_{m+1 \to s} E_m,\qquad
              \|fl(K_s) - K_s\| \le \sum_{a \le m < s} \|M_{m+1 \to s}\|\, \|E_m\|\quad ((2,\infty)\ \text{norms})

    (``K_{m+1} = J_m K_m + E_m`` unrolled; the (2,inf) norm is an operator norm, so submultiplicative), each
    ``||M_{m+1 -> s}||`` from ``prods`` (``_norm``; the identity for ``m + 1 = s``).  Padded ``1e-12`` relative.
    THEORY F73c (the products' own rounding), F88 (the prefix's)."""
    return sum(e * _norm(prods, m + 1, s) for m, e in zip(range(a, s), errs)) * (1 + 1e-12)


def product_norm(pair: tuple) -> float:
    """Certified ``||M||_(2,inf)`` of an exact product from its computed block norms and rounding ``(N, e)``: the
    largest row of ``N`` plus ``e`` (``sum_k ||E_ik|| <= e``)."""
    from ._local_stack import rows_of_block_norms

    N, e = pair
    return float(rows_of_block_norms(N).max()) + e


def _norm(prods: dict, a: int, s: int) -> float:
    """Certified ``||M_{a -> s}||_(2,inf)`` of the exact product (1 for the identity, ``a = s``)."""
    return 1.0 if a == s else product_norm(prods[(a, s)])


def radii_over(R: Tensor, ts: Tensor) -> Tensor:
    """(len(ts), len(R)) ``(R_k - t)_+`` for every ``t`` in ``ts``, rounded up: ``R_k <= t + out`` in exact arithmetic
    (``fl(R_k - t) >= (R_k - t)(1 - u)`` for normal results, exact for subnormal ones, so ``1 + 2^-51`` covers it)."""
    return ((R[None, :] - ts[:, None]) * (1 + 2.0**-51)).clamp(min=0)


def carried_rows(N: Tensor, nu: Tensor, R: Tensor) -> Tensor:
    r"""(T,) upper bounds on ``nu_i(R) = sup_{||h_k|| <= R_k} ||sum_k B_ik h_k||`` for blocks ``B`` with certified block
    norms ``N`` (T, T_in) and certified unit rows ``nu`` (T,) ``>= nu_i(1)`` (THEORY F95):

    .. math:: \nu_i(R) \le \min_{t \in \{0\} \cup \{R_k\}} \Big(t\, \nu_i(1) + \sum_k N_{ik} (R_k - t)_+\Big),

    since ``nu_i`` is monotone and subadditive in ``R >= 0`` (the per-token balls of radius ``a + b`` are the Minkowski
    sums of those of ``a`` and ``b``) and positively homogeneous, and ``R <= t 1 + (R - t)_+``; ``t = 0`` is the triangle
    ``N @ R``.  The bound is convex and piecewise linear in ``t`` with its kinks at the ``R_k``, so the minimum over those
    is the minimum over every ``t >= 0``.  ``(R - t)_+`` is rounded up (``1 + 2^-51``); the float64 sums of non-negative
    products are the caller's to pad."""
    ts = torch.cat([R.new_zeros(1), R])
    over = radii_over(R, ts)  # (T_in + 1, T_in)
    lin = torch.where(ts[None, :] == 0, 0.0, nu[:, None] * ts[None, :])  # t = 0 reads no nu (an inf nu is no bound)
    return (N @ over.T + lin).amin(dim=1)


def move_rest_rows(prods: dict, rests: list[Tensor], s: int, T: int, blocks: dict | None = None,
                   unit: Tensor | float = 1.0, nus: dict | None = None) -> Tensor:
    r"""(T,) rows ``E_{s,i} >= ||e_{s,i}||`` for sub-stage ``s``'s input, from the rows ``rests[m] >= ||R_{m,k}||`` of
    the stages before it (THEORY F73c):

    .. math:: E_{s,i} = \sum_{m < s} \Big(\sum_k N(M_{m+1 \to s})_{ik} R_{m,k} + e_{m+1 \to s} \max_k R_{m,k}\Big)

    (the identity for ``m + 1 = s``; the exact blocks are within ``||E_ik||`` of the computed, ``sum_k ||E_ik|| <= e``).
    ``E_0 = 0`` (the network input moves by ``delta`` itself).  With ``blocks`` (``{(a, s): N^q}``, (..., T, T)) the
    same rest seen through factors ``F_q`` (THEORY F87 (b)): ``C_qi >= ||F_q^T e_{s,i}||`` (..., T), ``N^q`` the blocks
    ``||F_q^T fl(M)_ik||`` (``head_block_norms``), ``unit`` (...) ``>= ||F_q||`` for the identity and the products'
    rounding.  With ``nus`` (``{(a, s): nu}``, certified unit rows ``nu_i >= nu_i(1)`` of the computed ``M_{a -> s}``, the
    weighted row Gram, F93), ``sum_k N_ik R_k`` is ``carried_rows``' smaller bound (THEORY F95).  Float64 sums of
    non-negative products, padded by ``1e-12`` relative; nan -> inf."""
    u = unit if isinstance(unit, float) else unit[..., None]
    acc = torch.zeros(T, dtype=torch.float64)
    for m in range(s):
        R = rests[m]
        if m + 1 == s:
            acc = acc + u * R
        else:
            N, e = prods[(m + 1, s)]
            if blocks is None and nus is not None and (m + 1, s) in nus:
                carried = carried_rows(N, nus[(m + 1, s)], R)
            else:
                carried = (N if blocks is None else blocks[(m + 1, s)]) @ R
            acc = acc + carried + u * (e * float(R.max()))
    return _padded(acc)


def stage_rest_rows(rho: float, reach: Tensor, dj: Tensor, E: Tensor, local: bool) -> Tensor:
    r"""(T,) rows ``>= ||R_{s,i}||`` of any stage's Taylor rest ``R_s = int_0^1 (J_s(x_s + tau Delta) - J_s(x_s)) Delta
    dtau``, ``Delta = P_s(X) delta + e``, every ``x_s + tau Delta`` in the stage's certified ball (the ball is
    star-shaped about ``x_s``, and ``tau Delta = P_s(X)(tau delta) + tau e`` is a move of the same kind, so the rows of
    moves along the prefix's rows hold there too):

    .. math:: \|R_{s,i}\| \le \rho\, \mathrm{reach}_{s,i} + \Delta J_{s,i} \|e_i\|\ \text{(token-local)},\quad
              \rho\, \mathrm{reach}_{s,i} + \Delta J_{s,i} \max_k \|e_k\|\ \text{(otherwise)},

    ``reach_{s,i} >= sup nu_i((J_s(y) - J_s(x_s)) P_s(X))`` and ``dj`` the drift rows on the ball (``||delta_j|| <=
    rho``, ``E >= ||e||``).  Float64, padded by ``1e-12`` relative; nan -> inf.  THEORY F73c."""
    Em = E if local else torch.full_like(E, float(E.max()))
    return _padded(rho * reach + torch.where(Em == 0, 0.0, dj * Em))


def attention_rest_rows(rho: float, reach: Tensor, dj: Tensor, E: Tensor, remA: Tensor | None, pad: float) -> Tensor:
    r"""(T,) rows ``>= ||R_{s,i}||`` of an attention stage's rest: F73c's (``stage_rest_rows``, not token-local) and,
    for a post-LN layer's ``x -> x + A(x)`` (``remA`` given), F59b's centred remainder on the per-layer route's ball
    (F34a/F47 per head), which holds the layer input's move (F59a) and is all the first LayerNorm reads
    (``D_1 = D_1 P``): ``min(F73c, remA (1 + 1e-12) + pad)``, ``pad`` F59a's centre pad.  THEORY F73c, F76a item 2."""
    R = stage_rest_rows(rho, reach, dj, E, False)
    return R if remA is None else torch.minimum(R, _padded(remA, pad))


def norm_rest_rows(rho: float, reach: Tensor, dj: Tensor, E: Tensor, r: Tensor) -> Tensor:
    r"""(T,) rows ``>= ||R_{s,i}||`` of a LayerNorm/RMSNorm stage's rest: F73c's (token-local) and the curvature's
    for every move of its input whose read part (centred for a LayerNorm, F59a) is within ``r_i``:

    .. math:: \|R_{s,i}\| \le \int_0^1 \|D_i(x + \tau\Delta) - D_i(x)\|\, r_i\, d\tau \le \tfrac12\, dj_i(r_i)\, r_i,

    ``dj_i(r)`` the stage's drift rows on the ball of radius ``r`` (F17's or F43a's sphere curvature, the smaller: both
    at most ``tau dj_i(r)`` on the ball of radius ``tau r``, F43a, F34b).  Padded ``1e-12`` relative; nan -> inf.
    THEORY F73c, F76a item 1."""
    return torch.minimum(stage_rest_rows(rho, reach, dj, E, True), _padded(torch.where(r == 0, 0.0, dj * r / 2)))


def ffn_rest_rows(rho: float, reach: Tensor, dj: Tensor, E: Tensor, own: Tensor | None, pad: float) -> Tensor:
    r"""(T,) rows ``>= ||R_{s,i}||`` of an FFN stage ``h -> h + F(h)``: F73c's (token-local) and, in a post-LN layer
    (``own`` given), F59b's own centred FFN rest ``min(ffn_fixed, c ||dh||)`` for every move of ``h`` within the
    stack's radius of ``H`` (``_local_stack._ffn_rest``), all the second LayerNorm reads: ``min(F73c, own (1 + 1e-12) +
    pad)``.  THEORY F73c, F76a item 3."""
    R = stage_rest_rows(rho, reach, dj, E, True)
    return R if own is None else torch.minimum(R, _padded(own, pad))


def layer_rest_rows(N: Tensor, e: float, Ec: Tensor, rem: Tensor, nu: Tensor | None = None) -> Tensor:
    r"""(T,) rows ``>= ||e_{s,i}||`` at a post-LN layer's inner point ``s`` from the layer input's ``E_c`` in one step:
    ``e_s = M_{c -> s}(x) e_c + R_{c -> s}(Delta_c)``, the partial layer's own Taylor rest at ``x_c`` for the layer
    input's whole move ``Delta_c`` (within the per-layer route's ball), ``||R_{c -> s, i}|| <= rem_i`` (F59b's ``remA``,
    ``remH``, ``remG`` plus the FFN's own rest, with the centre pad; centred for ``S1``, ``S2``, which only a LayerNorm
    reads), ``(N, e)`` the computed ``M_{c -> s}``'s block norms and rounding (F40e):

    .. math:: E_{s,i} = \sum_k N(M_{c \to s})_{ik} E_{c,k} + e \max_k E_{c,k} + rem_i.

    With ``nu`` (certified unit rows ``nu_i >= nu_i(1)`` of the computed ``M_{c -> s}``, F93's weighted row Gram) the
    sum ``sum_k N_ik E_{c,k}`` is ``carried_rows``' smaller bound on ``nu_i(E_c)`` (THEORY F95).  Padded ``1e-12``
    relative; nan -> inf.  THEORY F76a item 4."""
    carried = N @ Ec if nu is None else carried_rows(N, nu, Ec)
    return _padded(carried + e * float(Ec.max()) + rem)
