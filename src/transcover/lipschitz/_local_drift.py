"""The attention Jacobian's drift on a ball from its second derivative (issue 12; THEORY F35).

Note [attention second derivative].  One head, query ``i``, column convention (as in F17):
``P_j = softmax_j(s_ij)``, ``s_ij = x_i^T G x_j + (terms of x_j or x_i alone)``, ``G = scale W_Q W_K^T``,
``q_i = d s_ij / d x_j``, ``xbar = sum_j P_j x_j``, ``y_j = x_j - xbar``, ``v_j = W_V^T y_j``.  Along
tangents ``E`` (the Jacobian's argument) and ``Delta`` (the move of the point), with ``et_j = e_j -
sum_k P_k e_k``, ``dt_j`` likewise and the centred score changes

    c_j = e_i^T G y_j + q_i^T et_j,      a_j = delta_i^T G y_j + q_i^T dt_j      (sum_j P_j a_j = 0),

the head's first derivative is ``do_i[E] = W_V^T (ebar + sum_j P_j c_j y_j)`` and its second

    H_i[Delta, E] = W_V^T sum_j P_j (a_j et_j + c_j dt_j + a_j c_j y_j
                                     + (e_i^T G dt_j + delta_i^T G et_j) y_j)

(the product rule on ``sum_j P_j c_j y_j`` with ``dP_j = P_j a_j``, ``d y_j = dt_j - sum_k P_k a_k y_k``,
``d q_i = G^T delta_i``; every term constant in ``j`` drops against ``sum_j P_j y_j = 0``).  With
``||e_j||, ||delta_j|| <= 1`` each term is bounded by weighted Cauchy-Schwarz in ``L^2(P)``: the
``L^2(P)`` norms of ``a`` and ``c`` are at most ``s = lG^{1/2} + eta ||q_i||`` (``lB = lambda_max(sum_j
P_j (B y_j)(B y_j)^T)``, ``eta^2 >= sum_j P_j ||et_j||^2``: 1, or ``4 p (1 - p)`` when the top weight
``p > 1/2``), the products ``(e_i . G y_j)(u . v_j)`` by the Hadamard Gram of the ``G y_j (x) v_j`` (as in
F17c), and the rest as in THEORY F35b.  On ``B(X, rho)`` each quantity is bounded at every point:
``P'_j <= P_j + a_j`` (F31a's envelope), a weighted variance is at most the second moment about the
fixed ``xbar``, ``||q'_i|| <= ||q_i|| + ||G|| rho``, the largest ``||B y'_j||`` by the mean's move or the
visible diameter.  The drift is the integral of the second derivative along the segment:
``J(X + Delta) - J(X) = int_0^1 H(X + t Delta)[Delta] dt`` and ``X + t Delta`` lies in ``B(X, t r)``,
so a right Riemann sum of the ball sups bounds it.

Note [heads through W_O jointly].  Per-head bounds ``||z_h|| <= b_h`` (a head's drift row or move, before
``W_O``) combine through ``W_O`` as ``||sum_h W_O^hT z_h||^2 <= sum_{h,k} b_h b_k ||W_O^h W_O^kT||``: the
off-diagonal blocks of ``W_O W_O^T`` are small when the heads write to nearly orthogonal subspaces, and the
bound then stays near the largest head instead of ``||W_O|| (sum_h b_h^2)^{1/2}``.  A per-token map
``M_i`` in front costs ``||M_i||``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._local_jacobian import pow2_norm
from ._local_sharp import ball_box

__all__ = ["attention_drift_hessian", "head_second_derivative", "heads_joint", "output_block_norms"]

# sub-balls of the segment integral (right Riemann sum of the ball sups of the second derivative)
SEGMENT_STEPS = 4


def head_second_derivative(P: Tensor, Y: Tensor, q: Tensor, G: Tensor, Wv: Tensor, i: int,
                           Delta: Tensor, E: Tensor) -> Tensor:
    """``H_i[Delta, E]`` of one head's output before ``W_O`` (Note [attention second derivative]) at a
    point: ``P`` (T,) the query's softmax row, ``Y`` (T, d) the ``y_j``, ``q`` (d,), ``G`` (d, d) with
    ``s_ij = x_i^T G x_j + ...``, ``Wv`` (d, dh); ``Delta``, ``E`` (T, d).  Source: THEORY F35a."""
    dt, et = Delta - P @ Delta, E - P @ E
    Gy = Y @ G.T  # rows (G y_j)^T
    a = Gy @ Delta[i] + dt @ q
    c = Gy @ E[i] + et @ q
    cross = dt @ (G.T @ E[i]) + et @ (G.T @ Delta[i])
    inner = (P * a) @ et + (P * c) @ dt + (P * (a * c + cross)) @ Y
    return inner @ Wv


def _ball_moment(lam_P: Tensor, a: Tensor, norms2: Tensor, ratio: Tensor) -> Tensor:
    """``lambda_max(sum_j (P_j + a_j) z_j z_j^T)^{1/2}`` from the certified ``lam_P`` (the same with ``P``) at X:
    the ``a``-part is at most its trace ``sum_j a_j ||z_j||^2`` (``norms2`` (T, T) the ``||z_j||^2``) and at most
    ``ratio lam_P`` (``ratio = max_j a_j / P_j`` over the visible keys, so ``a_j <= ratio P_j``)."""
    extra = torch.minimum((a * norms2).sum(dim=1), ratio * lam_P)
    return torch.sqrt((lam_P + extra) * (1 + 1e-12))


def _hadamard_moment(m: dict) -> Tensor:
    """(T,) certified ``lambda_max(sum_j P_j (G y_j (x) v_j)(G y_j (x) v_j)^T)`` (the Hadamard Gram of F17c),
    computed once per head and kept in the head's moments."""
    if "lGV" not in m:
        from ._local_rows import moment_lmax

        # the exact rows G y_j (x) v_j are within eg ||v_j|| + ||G y_j|| ev of the formed ones (``vn``, ``gn`` are
        # already upper bounds of the exact norms; THEORY F97)
        m["lGV"] = moment_lmax(m["KG"] * m["KV"], m["P"], (m["eg"] * m["vn"] + m["gn"] * m["ev"]) * (1 + 1e-12))
    return m["lGV"]


def hessian_ball_sup(mom, rho: float, norms: dict) -> Tensor:  # noqa: ANN001
    r"""(H, T) certified ``sup_{Z in B(X, rho)} sup_{||delta_j||, ||e_j|| <= 1} ||H^h_i(Z)[Delta, E]||`` per head
    (before ``W_O``), Note [attention second derivative]:

    .. math:: 2\|W_V\|\eta\,(s_G + \eta\|q_i\|) + T_2 + 2\|G\|\eta\, s_V,\qquad
              T_2 = \min\big(\Lambda (s_G + 2\eta\|q_i\|) + \|q_i\|^2\min(k_4 s_V, \eta\min(2 s_V, \eta\hat v)),\
                    s_V (s_G + \eta\|q_i\|)(\hat g + 2\|q_i\|)\big)

    (``s_B = lambda_max(sum_j P_j (B y_j)(B y_j)^T)^{1/2}``, ``Lambda`` the same for ``G y_j (x) W_V^T y_j``,
    ``v^``, ``g^`` the largest ``||W_V^T y_j||``, ``||G y_j||``, ``k_4 <= (4/3)^{1/2}`` from the fourth moments of
    the centred ``q_i . delta_j``) with every quantity bounded on the ball.
    Source: THEORY F35b.  Assumptions: every token of the
    attention's input within ``rho`` of X; dot attention without RoPE."""
    out = []
    for h, m in enumerate(mom.rows):
        memo = m.setdefault("hess", {})  # the sub-balls' segment points repeat the ball's (F42b)
        key = (float(rho), float(norms["G"][h]), float(norms["V"][h]))
        if key not in memo:
            memo[key] = _head_hessian_sup(m, rho, norms["G"][h], norms["V"][h])
        out.append(memo[key])
    return torch.nan_to_num(torch.stack(out), nan=math.inf, posinf=math.inf)


def _head_hessian_sup(m: dict, rho: float, nG: float, nV: float) -> Tensor:
    """One head's (T,) bound of ``hessian_ball_sup`` (before the nan/inf cleanup)."""
    P = m["P"]
    _, _, a, lo, tv = ball_box(m, rho, nG)
    # sum_j P'_j ||e_j - ebar'||^2 <= 4 p (1 - p) when the top weight p = max_j P'_j > 1/2 (else 1)
    top = lo.max(dim=1).values
    ve = torch.where(top > 0.5, torch.sqrt(4 * top * (1 - top)) * (1 + 1e-12), torch.ones_like(top))
    # sum_j P'_j (s_j - sbar)^4 <= 16 t (1 - 3 t), t = min(1/6, p (1 - p)), for scalars |s_j| <= 1 (F35b)
    t = torch.where(top > 0.5, torch.clamp(top * (1 - top), max=1 / 6), torch.full_like(top, 1 / 6))
    k4 = torch.sqrt(16 * t * (1 - 3 * t)) * (1 + 1e-12)
    # ||y'_j - y_j|| <= rho + ||xbar' - xbar||, the mean's softmax part as in F31b
    mv = torch.minimum((a * m["yn"]).sum(dim=1), tv * m["dY"])  # ||sum_j (P'_j - P_j) y_j||
    eps = 2 * rho + mv
    vis = lambda R: torch.where(P > 0, R, torch.zeros_like(R)).max(dim=1).values  # noqa: E731
    # ||B y'_j|| <= ||B y_j|| + ||B|| rho + ||B (xbar' - xbar)||, or the visible diameter of B x'
    bmax = lambda R, nB, Rd: torch.minimum(  # noqa: E731
        vis(R) + 2 * nB * rho + torch.minimum((a * R).sum(dim=1), nB * mv), Rd + 2 * nB * rho)
    gmax, vmax = bmax(m["gn"], nG, m["dG"]), bmax(m["vn"], nV, m["dV"])
    vn2, gn2 = m["vn"] * m["vn"], m["gn"] * m["gn"]
    ratio = torch.where(P > 0, a / P, torch.zeros_like(P)).max(dim=1).values * (1 + 1e-12)
    lV0, lG0 = _ball_moment(m["lV"], a, vn2, ratio), _ball_moment(m["lG"], a, gn2, ratio)
    sV, sG = lV0 + nV * rho, lG0 + nG * rho
    qn = m["qn"] * (1 + 1e-12) + nG * rho
    lam = _ball_moment(_hadamard_moment(m), a, vn2 * gn2, ratio) + nG * eps * sV + nV * eps * lG0
    lam = torch.minimum(torch.minimum(lam, gmax * sV), sG * vmax)
    qv = qn * ve
    qq = qn * torch.minimum(k4 * qn * sV, qv * torch.minimum(2 * sV, vmax * ve))
    t2 = torch.minimum(lam * (sG + 2 * qv) + qq, sV * (sG + qv) * (gmax + 2 * qn))
    bound = 2 * nV * ve * (sG + qv) + t2 + 2 * nG * ve * sV
    return bound * (1 + 1e-10)


def attention_drift_hessian(mom, r: float, norms: dict, steps: int = SEGMENT_STEPS) -> Tensor:  # noqa: ANN001
    r"""(H, T): per head and query a certified bound on ``nu_i(Z'^h - Z^h)`` over ``B(X, r)`` (the same
    quantity as ``attention_drift_rows``, F17d), from the second derivative's ball sups:

    .. math:: \nu_i(J(X + \Delta) - J(X)) \le \int_0^1 \|H(X + t\Delta)\|\, r\, dt
              \le \frac{r}{n}\sum_{k=1}^{n} \sup_{B(X, kr/n)} \|H\|

    Source: THEORY F35c.  Assumptions: as ``hessian_ball_sup``."""
    if r == 0:
        return torch.zeros(len(mom.rows), mom.rows[0]["P"].shape[0], dtype=torch.float64)
    total = sum(hessian_ball_sup(mom, k * r / steps, norms) for k in range(1, steps + 1))
    return torch.nan_to_num(total * (r / steps) * (1 + 1e-10), nan=math.inf, posinf=math.inf)


def output_block_norms(heads) -> Tensor:  # noqa: ANN001
    """(H, H) certified ``C_hk >= ||W_O^h W_O^kT||_2`` (``W_O^h`` the head's (d_head, d) output rows): the
    certified spectral norm of each float64 product plus its rounding ``gamma_d ||W_O^h||_F ||W_O^k||_F``
    (Note [heads through W_O jointly], THEORY F35d).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    Wo = torch.stack([hd[6] for hd in heads])  # (H, dh, d)
    H, _, d = Wo.shape
    prods = torch.einsum("had,kbd->hkab", Wo, Wo).reshape(H * H, Wo.shape[1], Wo.shape[1])
    fro = pow2_norm(Wo.flatten(1), 1)
    from ._local_jacobian import certified_spectral

    pad = 4 * (d + 2) * 2.0**-53 * fro[:, None] * fro[None, :]
    return certified_spectral(prods).reshape(H, H) + pad


def heads_joint(C: Tensor, b: Tensor) -> Tensor:
    r"""(T,) certified ``sup ||sum_h W_O^hT z_h||`` over ``||z_h|| <= b_{h,i}`` (``b`` (H, T), e.g. the heads' drift
    rows or moves): ``||sum_h W_O^hT z_h||^2 = sum_{h,k} z_h^T W_O^h W_O^kT z_k <= b^T C b`` (Note [heads
    through W_O jointly]); near ``max_h ||W_O^h|| b_h`` when the heads' output spaces are nearly
    orthogonal (callers keep the smaller with ``||W_O|| (sum_h b_h^2)^{1/2}``).

    .. math:: \Big\|\sum_h W_O^{h\top} z_h\Big\| \le \Big(\sum_{h,k} b_h C_{hk} b_k\Big)^{1/2}

    Source: THEORY F35d.  Assumptions: ``C`` from ``output_block_norms``; ``b >= 0``."""
    H = C.shape[0]
    q = torch.einsum("ht,hk,kt->t", b, C, b) * (1 + 4 * (H * H + 4) * 2.0**-53)
    return torch.nan_to_num(torch.sqrt(q) * (1 + 1e-15), nan=math.inf, posinf=math.inf)
