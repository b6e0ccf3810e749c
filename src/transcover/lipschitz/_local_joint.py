"""Stage radii by the exact linearisation at X plus a second-order remainder (issue 12; THEORY F34).

The rows route (``_local_rows``) needs, per token, how far each stage of a layer moves on ``B(X, r)``:
the attention sublayer, the first LayerNorm, the FFN sublayer.  F31b bounded the attention sublayer by
each head's own worst move (query move and softmax shift chosen per head, though one ``Delta`` serves
all heads).  Here each stage's move is split into the exact linear map at X, whose row constant the
rows route already certifies jointly over all heads (``nu_i`` of the stage Jacobian, residual
included), and a remainder that is second order in ``r``:

    S(X + Delta) - S(X) = J_S(X) Delta + R(Delta),   ||R_i|| = O(r^2).

The functions here bound the remainders; ``layer_rows`` adds ``r nu_i`` and keeps the smaller of this
and the older radii.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._local_jacobian import GRAM_PAD, certified_spectral, pow2_norm
from ._local_sharp import ball_box, visible_diameter

__all__ = ["softmax_taylor_l1", "quadratic_score_mad", "range_taylor", "VAR_SQUARE_RANGE", "HeadGeometry",
           "head_geometry", "head_remainders", "head_remainder_terms", "attention_remainder", "norm_remainder",
           "sphere_remainder", "SPHERE_CURVATURE", "sphere_drift", "norm_drift"]

_U = 2.0**-53
_PAD = 1 + 1e-10


def _at_dominant(P: Tensor, M: Tensor) -> Tensor:
    """(T,) ``M[i, k_i]`` with ``k_i = argmax_j P_ij`` (the dominant key of each row)."""
    return M.gather(1, P.argmax(dim=1, keepdim=True))[:, 0]


def _off_dominant(P: Tensor, W: Tensor) -> Tensor:
    """(T,) ``sum_{j != k_i} W_ij`` for ``W >= 0`` (``k_i`` the dominant key), the float64 sum padded by
    ``(T + 2) u`` of itself."""
    off = torch.ones_like(P).scatter_(1, P.argmax(dim=1, keepdim=True), 0.0)
    return (W * off).sum(dim=1) * (1 + (P.shape[1] + 2) * _U)


def softmax_taylor_l1(P: Tensor, delta: Tensor, osc: Tensor, a: Tensor, tv: Tensor) -> Tensor:
    r"""(T,) certified ``||p(s + t) - p(s) - J_p(s) t||_1`` per softmax row (THEORY F34a) for every shift
    with ``|t_j| <= delta_j`` and spread ``<= osc`` over the visible keys (``a``, ``tv`` from
    ``softmax_envelope`` for the same box; ``J_p = diag(p) - p p^T``).

    Along ``p(tau) = p(s + tau t)``: ``p_j'' = p_j ((t_j - tbar)^2 - Var_{p(tau)} t)``, so ``||p''||_1 <= 2 Var``
    and the Taylor remainder ``int_0^1 (1 - tau) p'' dtau`` has ``l1`` norm at most ``sup_tau Var_{p(tau)} t``;

    .. math:: \mathrm{Var}_{p(\tau)} t \le \min\Big(\frac{osc^2}{4},\ \sum_{j \ne k} (P_j + a_j) c_{jk}^2\Big),
              \quad c_{jk} = \min(\delta_j + \delta_k, osc)

    (Popoviciu; the second moment about ``t_k``, ``k`` the dominant key, with ``p_j(tau) <= P_j + a_j``
    because ``tau t`` lies in the same box).  Also the remainder is at most ``||p' - p||_1 + ||J_p t||_1 <=
    2 TV + E_P|t - E_P t|``, and ``E_P|t - E_P t| <= 2 E_P|t - t_k| <= min(osc/2, 2 sum_{j != k} P_j c_jk)``.
    Rounding: ``P`` (and ``J_p``) as formed are within ``4 (T + 8) u`` per entry of the true softmax (F31a),
    so ``4 (T + 8) u T (2 + 2 max_j delta_j)`` absolute is added.  Assumptions: ``delta``, ``a`` zero on masked keys."""
    T = P.shape[-1]
    c = torch.minimum(delta + _at_dominant(P, delta)[:, None], osc[:, None])
    var = torch.minimum(osc * osc / 4, _off_dominant(P, (P + a) * c * c))
    mad = torch.minimum(osc / 2, 2 * _off_dominant(P, P * c))
    pad = 4 * (T + 8) * _U * T * (2 + 2 * delta.max(dim=-1).values)
    return torch.minimum(var, 2 * tv + mad) * _PAD + pad


def quadratic_score_mad(P: Tensor, r: float, nG: float) -> Tensor:
    r"""(T,) certified ``||J_p u||_1 = E_P|u - E_P u|`` for the quadratic part of the score change,
    ``u_j = e_i^T G e_j`` on ``B(X, r)`` (THEORY F34a): ``|u_j - u_k| <= ||G^T e_i|| ||e_j - e_k|| <= 2 ||G|| r^2``,
    so the mean absolute deviation is at most ``min(||G|| r^2, 4 ||G|| r^2 (1 - P_k))`` (half the range;
    twice ``E_P|u - u_k|``).  ``nG`` a certified ``||G||`` (softmax scale included)."""
    span = 2 * nG * r * r * _PAD
    return torch.minimum(torch.full(P.shape[:1], span / 2, dtype=P.dtype), 2 * span * _off_dominant(P, P)) * _PAD


@dataclass
class HeadGeometry:
    """Per head, radius-free, for one value map ``W`` (``W_V`` or ``W_V W_O``): ``norm`` (H,) a certified
    ``||W||``; per query (H, T) ``diam``, the diameter of the visible rows ``z_j = x_j W``, and ``spread =
    lambda_max(sum_j P_ij (z_j - c_i)(z_j - c_i)^T)^{1/2}`` (``c_i`` the mapped P-mean); ``score_eps`` (H,)
    the float64 error of the score-gradient rows ``G y_j`` behind ``lG`` (``_HeadMoments``)."""

    norm: Tensor
    diam: Tensor
    spread: Tensor
    score_eps: Tensor


def head_geometry(heads, scale: float, output: bool, cache: dict | None = None) -> HeadGeometry:  # noqa: ANN001
    """``HeadGeometry`` of ``W = W_V W_O`` (``output``) or ``W_V``; ``cache``: a per-layer dict (``head_norms``') that
    keeps the data-free certified ``||W||`` across calls (the same floats; THEORY F52c).  Rounding: each row ``y_ij W`` as formed
    is within ``eps = gamma_{d + d_h + 2} max_j ||y_j|| ||W_V||_F (||W_O||_F)`` of the true one, so the
    diameter gets ``2 eps`` and the spread ``eps`` (Minkowski in ``L^2(P)``); the norm gets the product's
    ``gamma_{d_h} ||W_V||_F ||W_O||_F``; the weighted Grams' own eigenvalue pad is ``_lmax_gram``'s; the rows
    ``scale y_j W_K W_Q^T`` likewise ``gamma_{d + d_h + 2} scale max_j ||y_j|| ||W_K||_F ||W_Q||_F``.  The Frobenius norms
    are formed at powers of two (``pow2_norm``): ``W_K`` at ``2^-600`` beside ``W_Q`` at ``2^600`` (the same scores) had
    ``torch``'s ``||W_K||_F`` 0, and the score rows' rounding term with it."""
    from ._local_rows import _lmax_gram

    norm, diam, spread, score_eps = [], [], [], []
    for P, Y, _, Wq, Wk, Wv, Wo in heads:
        W = Wv @ Wo if output else Wv
        fro = float(pow2_norm(Wv) * pow2_norm(Wo)) if output else float(pow2_norm(Wv))
        R = Y @ W  # (T, T, m): row j of query i is (x_j - mean_i) W
        gam = 4 * (Y.shape[2] + Wv.shape[1] + 6) * _U * float(pow2_norm(Y, -1).max())
        if cache is None or ("geo_norm", output) not in cache:
            norm.append(float(certified_spectral(W[None])[0]) + 4 * (Wv.shape[1] + 4) * _U * fro)
        diam.append(visible_diameter(R[0], P > 0) + 2 * gam * fro)
        spread.append(torch.sqrt(_lmax_gram(R @ R.transpose(1, 2), P)) + gam * fro)
        score_eps.append(gam * scale * float(pow2_norm(Wk) * pow2_norm(Wq)))  # W_K at 2^-600: torch's norm 0
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    if cache is not None:
        norm = cache.setdefault(("geo_norm", output), norm)
    return HeadGeometry(f64(norm) * (1 + GRAM_PAD), torch.stack(diam), torch.stack(spread), f64(score_eps))


def head_remainders(mom, geo: HeadGeometry, r: float, norms: dict) -> Tensor:  # noqa: ANN001
    r"""(H, T) certified norm of each head's remainder on ``B(X, r)`` (every token of the attention's input
    within ``r``), the head's output move less its linear part at X, as seen through the value map of ``geo``
    (``R_h`` itself for ``W = W_V``, ``R_h W_O^h`` for ``W = W_V W_O``; THEORY F34a).
    With ``p' = p(s + t)``, ``t = t^lin + u`` the score change (``u_j = e_i^T G e_j``), ``z_j = x_j W``:

    .. math:: R^W = \sum_j [p' - p - J_p t]_j z_j + \sum_j (J_p u)_j z_j + \sum_j (p'_j - p_j) e_j W,

    three zero-sum weightings.  A zero-sum ``w`` moves a point set by at most ``||w||_1/2`` times its
    diameter (``softmax_taylor_l1``, ``quadratic_score_mad``); in ``L^2(P)`` the first is also
    ``int_0^1 (1 - tau) Cov_{p(tau)}((t - tbar)^2, z) dtau <= osc s spread (e^{osc} - 1 - osc)/osc^2``
    (``E(t - tbar)^4 <= osc^2 Var``, ``p_j(tau)/P_j <= e^{tau osc}``, ``s`` the ``L^2(P)`` spread of ``t``,
    ``chi_bound``'s ``r lambda_max(sum_j P_j G y_j (G y_j)^T)^{1/2} + r ||q_i|| + ||G|| r^2``) or by the range alone
    (``range_taylor``, THEORY F41a) and the second
    ``Cov_P(u, z) <= ||G|| r^2 spread``; the third is at most ``2 TV ||W|| r``.
    Assumptions: dot attention without RoPE (the key bias shifts a row by a constant, the value bias
    cancels in zero sums)."""
    out = []
    for h in range(len(mom.rows)):
        t1d, c1, t2d, c2, c3 = head_remainder_terms(mom, geo, h, r, norms)
        t1 = torch.minimum(t1d, c1 * geo.spread[h])
        t2 = torch.minimum(t2d, c2 * geo.spread[h])
        out.append((t1 + t2 + c3 * float(geo.norm[h])) * _PAD)
    return torch.nan_to_num(torch.stack(out), nan=math.inf, posinf=math.inf)


def head_remainder_terms(mom, geo: HeadGeometry, h: int, r: float, norms: dict) -> tuple[Tensor, ...]:  # noqa: ANN001
    r"""Head ``h``'s three remainder terms on ``B(X, r)`` (THEORY F34a, F41a), each (T,): the softmax Taylor term by
    the diameter (``t1d``) and the coefficient ``c1`` of its ``L^2(P)`` forms (``min(osc s e(osc), C_4 osc^2
    e(osc/2))``, times ``sigma(u) = (sum_j P_j (u.z_j - u.zbar)^2)^{1/2}`` for every unit ``u``, at most ``spread``);
    the quadratic score term by the diameter (``t2d``) and ``c2 = ||G|| r^2`` (times ``sigma(u)``); the value move's
    coefficient ``c3 = 2 TV r`` (times ``||W u||``, at most ``||W||``)."""
    m, nG = mom.rows[h], norms["G"][h]
    P = m["P"]
    delta, osc, a, _, tv = ball_box(m, r, nG)
    s = (r * (torch.sqrt(m["lG"]) + float(geo.score_eps[h])) + r * m["qn"] + nG * r * r) * _PAD
    c1 = torch.minimum(osc * s * _exp_weight(osc), range_taylor(osc, torch.ones_like(osc)))  # F41a
    c1 = torch.nan_to_num(c1, nan=math.inf, posinf=math.inf)
    t1d = softmax_taylor_l1(P, delta, osc, a, tv) / 2 * geo.diam[h]
    t2d = quadratic_score_mad(P, r, nG) / 2 * geo.diam[h]
    return t1d, c1, t2d, torch.full_like(t1d, nG * r * r), 2 * tv * r


# C_4 = (max_{theta <= 1/3} theta (1 - theta)^2 (1 - 2 theta))^{1/2}, the maximum at theta = (7 - sqrt 17)/16
# (THEORY F41a), padded
VAR_SQUARE_RANGE = 0.27831734347385703 * (1 + 1e-12)


def range_taylor(osc: Tensor, spread: Tensor) -> Tensor:
    r"""(T,) certified ``||int_0^1 (1 - tau) sum_j p''_j(tau) z_j dtau||``, the softmax Taylor term of a row
    ``p(tau) = p(s + tau t)`` whose shift has spread ``max_{j,k} |t_j - t_k| <= osc`` over the visible keys
    (THEORY F41a).  ``sum_j p''_j z_j = Cov_{p(tau)}((t - tbar)^2, z)``; a variable with range ``L`` has
    ``Var((t - tbar)^2)^{1/2} <= C_4 L^2`` (``C_4 = VAR_SQUARE_RANGE``: Bhatia-Davis for ``(t - tbar)^2`` and for
    ``t``), and ``p_j(tau)/P_j <= e^{tau osc}`` gives ``spread_{p(tau)}(z) <= e^{tau osc/2} spread``, so

    .. math:: \le C_4\, osc^2\, spread \int_0^1 (1 - \tau) e^{\tau osc/2} d\tau,

    ``spread = lambda_max(sum_j P_j (z_j - zbar)(z_j - zbar)^T)^{1/2}`` (``HeadGeometry.spread``).  Unlike F34a's
    ``L^2(P)`` form it does not grow with the score gradients' spread ``s``, only with the range.  An overflowed
    ``osc`` gives the certified ``inf`` (not a nan that ``torch.minimum`` would spread to the other forms)."""
    out = VAR_SQUARE_RANGE * osc * osc * spread * _exp_weight(osc / 2) * _PAD
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)


def _exp_weight(osc: Tensor) -> Tensor:
    """``int_0^1 (1 - tau) e^{tau osc} dtau = (e^{osc} - 1 - osc)/osc^2`` (1/2 at 0), padded: the series
    ``sum_n osc^n/(n + 2)!`` below 1e-3, where the closed form cancels."""
    series = 0.5 + osc / 6 + osc * osc / 24 + osc**3 / 120 * torch.exp(osc)
    closed = (torch.expm1(osc) - osc) / torch.where(osc > 0, osc * osc, torch.ones_like(osc))
    return torch.where(osc < 1e-3, series, closed) * (1 + 1e-12)


def attention_remainder(mom, geo_v: HeadGeometry, geo_ov: HeadGeometry, nO: float, r: float,  # noqa: ANN001
                        norms: dict) -> tuple[Tensor, Tensor]:
    r"""(T,) certified ``||R_i||`` for the attention sublayer's remainder ``R = sum_h R_h W_O^h`` (THEORY F34a):
    the smaller of ``sum_h ||R_h W_O^h||`` (through ``W_V W_O``) and ``||W_O|| (sum_h ||R_h||^2)^{1/2}`` (the
    heads' output blocks stacked); and (H, T) the heads' own ``||R_h||`` (for maps applied after ``W_O``)."""
    per = head_remainders(mom, geo_ov, r, norms).sum(dim=0)
    stacked = head_remainders(mom, geo_v, r, norms)
    return torch.minimum(per, nO * torch.sqrt((stacked * stacked).sum(dim=0)) * _PAD), stacked


def norm_remainder(g: float, e: Tensor, r: Tensor) -> Tensor:
    r"""(T,) certified ``||N(x + E) - N(x) - D(x) E||`` for a normalisation whose Jacobian drifts by at
    most ``g e`` on the input ball of (centred) radius ``r`` with ``e`` linear in the radius below the
    floor (``_ln_drift``: ``e = 2 r/(sqrt(d) s_f(r)^2)``, ``s_f`` non-increasing in ``r``): the Taylor remainder
    ``int_0^1 (D(x + tau E) - D(x)) E dtau`` has norm at most ``int_0^1 g e tau r dtau = g e r / 2``
    (THEORY F34b)."""
    return g * e * r / 2 * _PAD


# sup ||D^2 N(u)[e, e]|| over unit u, e for N(u) = u/||u||: (1 + 2c^2 - 3c^4)^{1/2} at c^2 = 1/3, i.e. 2/sqrt(3) (THEORY F41c)
SPHERE_CURVATURE = 2 / math.sqrt(3) * (1 + 1e-12)


def sphere_remainder(g: float, s: Tensor, r: Tensor, d: int) -> Tensor:
    r"""(T,) certified ``||N(x + E) - N(x) - D(x) E||`` for a LayerNorm or RMSNorm ``N`` on every move with
    ``||P E|| <= r`` (``P`` the centring, the identity for RMSNorm), from the normalisation's own curvature
    (THEORY F41c).  ``s`` (T,) the norm's ``(sigma^2 + eps)^{1/2}`` at x, ``g`` a certified ``max|gamma|``.

    ``P x / s = sqrt(d) pi(u / ||u||)`` with ``u = (P x, (d eps)^{1/2})`` in ``R^{d+1}`` (``pi`` drops the last
    coordinate), ``||u|| = sqrt(d) s``; ``||D^2(u/||u||)[e, e]|| <= (2/sqrt 3) ||e||^2/||u||^2`` and ``||u + tau e|| >=
    ||u||(1 - tau rho)``, ``rho = r/(sqrt(d) s)``, so the Taylor remainder is at most

    .. math:: g \sqrt{d}\, \tfrac{2}{\sqrt 3} \int_0^1 \frac{(1 - \tau)\rho^2}{(1 - \tau\rho)^2} d\tau
              = g \sqrt{d}\, \tfrac{2}{\sqrt 3} \big(-\rho - \log(1 - \rho)\big)\quad (\rho < 1),

    and ``inf`` for ``rho >= 1`` (the segment may pass the origin when ``eps = 0``; the other bounds stay).  For
    ``rho < 0.1`` the series ``rho^2/2 + rho^3/3 + rho^4/(4 (1 - rho))`` bounds ``-rho - log(1 - rho)`` (no
    cancellation).  ``s`` is taken ``(1 - 1e-12)`` low (the float64 centring and root, as ``_floor``)."""
    rho = r / (math.sqrt(d) * s * (1 - 1e-12)) * (1 + 1e-12)
    below = rho.clamp(max=0.5)
    series = below * below / 2 + below**3 / 3 + below**4 / (4 * (1 - below))
    closed = -rho - torch.log1p(-rho.clamp(max=1 - 1e-12))
    tail = torch.where(rho < 0.1, series, closed * (1 + 1e-12))
    psi = torch.where(rho < 1, SPHERE_CURVATURE * tail, torch.full_like(rho, math.inf))
    return g * math.sqrt(d) * psi * _PAD


def sphere_drift(sigma: Tensor, eps: float, r: Tensor, d: int) -> Tensor:
    r"""(T,) certified ``sup ||D(x + E) - D(x)||_2 / max|gamma|`` over every move with ``||P E|| <= r`` (``P`` the
    centring, the identity for RMSNorm) for a LayerNorm or RMSNorm with Jacobian ``D`` (THEORY F43a), in the units of
    ``_local_rows._ln_drift``'s ``e`` (``gamma`` left out).  ``sigma`` (T,) the norm's ``||P x||/sqrt(d)`` at x, ``eps``
    its epsilon.

    ``D(x) = sqrt(d) diag(gamma) pi Dn(u) iota P`` with ``u = (P x, (d eps)^{1/2})``, ``n(u) = u/||u||`` (F41c);
    ``||D^2 n(u)[e, v]|| <= (2/sqrt 3) ||e|| ||v|| / ||u||^2`` for all ``e, v`` (the bilinear form's sup is its
    diagonal's, F43a), and on the segment ``||u + tau e||^2 >= d ((sigma - tau b)^2 + eps)``, ``b = r/sqrt(d)``,
    so for ``sigma >= b``

    .. math:: \|D(x + E) - D(x)\| \le \max|\gamma| \tfrac{2}{\sqrt 3}\, b
              \int_0^1 \frac{d\tau}{(\sigma - \tau b)^2 + eps}
              \le \max|\gamma|\, \frac{2}{\sqrt 3} \frac{b}{eps + \sigma(\sigma - b)}

    (the integral is ``arctan(z)/(b eps^{1/2})``, ``z = b eps^{1/2}/(eps + sigma(sigma - b))``, and
    ``arctan z <= z``; exact for ``eps = 0``), against F17's ``2 b/((sigma - b)^2 + eps)``: at most ``1/sqrt 3`` of
    it.  ``inf`` for ``sigma < b`` (F17's floor bound stays).  The bound at ``tau r`` is at most ``tau`` times the
    bound at ``r`` (F34b's integration holds).  ``sigma`` is taken ``(1 - 1e-12)`` low and ``b`` high (as ``_floor``),
    the denominator ``(1 - 1e-15)`` low for its three roundings, the result padded by ``1 + 1e-10``."""
    a = sigma * (1 - 1e-12)
    b = r / math.sqrt(d) * (1 + 1e-12)
    den = (eps + a * (a - b)) * (1 - 1e-15)
    ok = (a >= b) & (den > 0)
    drift = SPHERE_CURVATURE * b / torch.where(ok, den, torch.ones_like(den))
    return torch.where(ok, drift * _PAD, torch.full_like(drift, math.inf))


def norm_drift(norm, sigma: Tensor | None, r: Tensor, d: int) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """(``e``, ``s_floor``) as ``_local_rows._ln_drift`` (F17's Jacobian drift by the variance floor, ``gamma`` left
    out, and the floor), with ``e`` the smaller of F17's and the sphere's curvature (``sphere_drift``, THEORY F43a)
    per token."""
    from ._local_rows import _ln_drift

    e, sf = _ln_drift(norm, sigma, r, d)
    if sigma is None:
        return e, sf
    return torch.minimum(e, sphere_drift(sigma, float(norm.eps), r, d)), sf
