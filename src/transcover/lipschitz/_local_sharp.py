"""Sharper local bounds for the rows route at moderate radii (issue 12; THEORY F31).

The rows route (``_local_rows``) certifies a layer's (2,inf) Lipschitz constant on ``B(X, r)``; its
stage radii were ``r`` times a Jacobian sup over the ball, and the attention drift used independent
multiplicative softmax envelopes ``e^{delta}`` that overshoot for sharp heads.  The pieces here
bound the functions themselves: a softmax row's envelope and total variation under a bounded logit
shift (F31a), the attention head's output move (F31b), the chi-square distance of the moved row
(F31c) and the FFN slope drift per hidden unit (F31d).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..model import Activation
from ._local_jacobian import _f64, certified_lmax, pow2_norm
from ._weights import ROUNDING_PAD

__all__ = ["softmax_envelope", "score_moves", "chi_bound", "head_moves", "ffn_unit_drift", "unit_slope_moves",
           "visible_diameter", "gram_lower", "ball_box", "GELU_SLOPE_RANGE"]

_U = 2.0**-53
# F42a: power steps of ``gram_lower`` (MiniLM sentence 1: F31d still formed at 18 uncapped token-radii of 557 refined, 15 with 12 steps)
GRAM_LOWER_ITERS = 4
# the range of the exact GELU's slope, sup GELU' - inf GELU' = erf(1) + 2 sqrt(2) phi(sqrt(2)), padded
GELU_SLOPE_RANGE = (math.erf(1.0) + 2 * math.sqrt(2) * math.exp(-1.0) / math.sqrt(2 * math.pi)) * (1 + 1e-9)


def visible_diameter(R: Tensor, vis: Tensor) -> Tensor:
    """(T,) certified ``max_{j, k visible to i} ||R_j - R_k||`` (``vis`` (T, T) the keys each query
    sees); the differences are formed directly (no Gram cancellation), padded for float64 rounding.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T = R.shape[0]
    if T > 128:  # the T^3 table would not pay for itself; inf leaves the other bound in every min
        return torch.full((T,), math.inf, dtype=R.dtype)
    D = pow2_norm(R[:, None, :] - R[None, :, :], -1) * (1 + 4 * (R.shape[1] + 4) * _U)
    pair = vis[:, :, None] & vis[:, None, :]
    return torch.where(pair, D[None], torch.zeros_like(D)[None]).amax(dim=(1, 2))


def softmax_envelope(P: Tensor, delta: Tensor, osc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""Certified envelope of a softmax row under a bounded logit shift (THEORY F31a).

    Rows ``P = softmax(s)`` (T, T), ``P' = softmax(s + d)`` with ``|d_j| <= delta_j`` and
    ``max_{j,k} |d_j - d_k| <= osc`` over the visible keys (``P_j > 0``; masked keys keep ``P' = 0``).
    ``P'_j = P_j / (P_j + sum_{k != j} P_k e^{d_k - d_j})`` is increasing in ``d_j`` and decreasing in
    the others, and ``|d_k - d_j| <= min(delta_j + delta_k, osc)``, so

    .. math:: P'_j \ge lo_j = \frac{P_j}{P_j + \min(e^{\delta_j}\sum_{k\ne j}P_ke^{\delta_k},\ (1-P_j)e^{osc})},\quad
              P'_j \le hi_j = \frac{P_j}{P_j + \max(e^{-\delta_j}\sum_{k\ne j}P_ke^{-\delta_k},\ (1-P_j)e^{-osc})}

    and ``|P'_j - P_j| <= a_j = max(hi_j - P_j, P_j - lo_j)``.  The total variation ``(1/2)||P' - P||_1``
    is at most ``min(sum_j a_j / 2, g*)``: for ``A = {P' > P}`` with ``p = P(A)``, ``P'(A) <= p e^{osc}/(p
    e^{osc} + 1 - p)`` (the ratio ``P'_j/P_j = e^{d_j}/Z`` is at most ``e^{osc}`` times its value off A),
    so ``TV <= g(p) = p(1 - p)(e^{osc} - 1)/(p e^{osc} + 1 - p)``, concave in ``p`` with its maximum
    ``tanh(osc/4)`` at ``p_0 = 1/(1 + e^{osc/2})``; a dominant key (``P* > 1/2``) leaves only ``p <= 1 -
    P*`` or ``p >= P*``, hence ``g* = max(g(min(p_0, 1 - P*)), g(max(p_0, P*)))`` there.

    Returns ``(a, lo, tv)``.  Rounding: the row sums minus one entry carry ``(T + 2) u`` of the row
    mass, and every ``a_j`` gets ``4 (T + 8) u`` absolute (the float64 softmax's own error on ``P``).
    Assumptions: ``delta >= 0`` zero on masked keys, ``osc >= 0``."""
    T = P.shape[-1]
    vis = P > 0
    pad = (T + 2) * _U
    ep, em = P * torch.exp(delta), P * torch.exp(-delta)
    sp, sm, s1 = ep.sum(-1, keepdim=True), em.sum(-1, keepdim=True), P.sum(-1, keepdim=True)
    op = (sp - ep) + pad * sp
    om = ((sm - em) - pad * sm).clamp(min=0.0)
    rest_hi = (s1 - P) + pad * s1
    rest_lo = ((s1 - P) - pad * s1).clamp(min=0.0)
    eo = torch.exp(osc)[..., None]
    up = torch.minimum(torch.exp(delta) * op, eo * rest_hi)
    down = torch.maximum(torch.exp(-delta) * om, rest_lo / eo)
    lo = torch.where(vis, P / (P + up), torch.zeros_like(P)) * (1 - 1e-12)
    hi = torch.where(vis, P / (P + down), torch.zeros_like(P)) * (1 + 1e-12)
    a = torch.maximum(hi - P, P - lo).clamp(min=0.0) + 4 * (T + 8) * _U
    a = torch.where(vis, a, torch.zeros_like(a))
    em1 = torch.expm1(osc)

    def g(p: Tensor) -> Tensor:
        return p * (1 - p) * em1 / (p * (em1 + 1) + 1 - p)

    p0 = 1.0 / (1.0 + torch.exp(osc / 2))
    top = P.max(dim=-1).values
    sharp = torch.maximum(g(torch.minimum(p0, 1 - top)), g(torch.maximum(p0, top)))
    conc = torch.where(top > 0.5, sharp, torch.tanh(osc / 4))
    # P* is known to (T + 8) u; g' <= e^{osc} - 1
    conc = conc * (1 + 1e-12) + 4 * (T + 8) * _U * em1
    conc = torch.nan_to_num(conc, nan=1.0, posinf=1.0).clamp(max=1.0)
    tv = torch.minimum(0.5 * a.sum(-1), conc)
    return a, lo, tv


def score_moves(m: dict, r: float, nG: float) -> tuple[Tensor, Tensor]:
    """(T, T) ``delta_ij`` and (T,) ``osc_i`` for ``softmax_envelope`` on ``B(X, r)``: the shifted score
    change ``e_i^T G y_ij + q_i^T e_j + e_i^T G e_j`` (F17d) is at most ``delta_ij = r (||G y_ij|| + ||q_i||
    + ||G|| r)``, and two keys' changes differ by ``e_i^T G (x_j - x_k) + q_i^T (e_j - e_k) + e_i^T G (e_j
    - e_k)``, at most ``r ||G (x_j - x_k)|| + 2 r ||q_i|| + 2 ||G|| r^2`` (F31a)."""
    P = m["P"]
    delta = r * (m["gn"] * (1 + 1e-12) + m["qn"][:, None] * (1 + 1e-12) + nG * r) * (1 + 1e-12)
    delta = torch.where(P > 0, delta, torch.zeros_like(delta))  # masked keys keep P' = 0
    osc = torch.minimum(2 * delta.max(dim=1).values,
                        r * (m["dG"] + 2 * m["qn"] + 2 * nG * r) * (1 + 1e-12)) * (1 + 1e-12)
    return delta, osc


def ball_box(m: dict, r: float, nG: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(delta, osc, a, lo, tv)``: ``score_moves`` and then ``softmax_envelope`` of the head with moments ``m`` on
    ``B(X, r)``, computed once per radius and kept in ``m`` (the attention drift, the heads' moves and remainders
    and F35's ball sups ask for the same radii: the same floats, evaluated once; THEORY F42b)."""
    memo = m.setdefault("box", {})
    key = (float(r), float(nG))
    if key not in memo:
        delta, osc = score_moves(m, r, nG)
        memo[key] = (delta, osc, *softmax_envelope(m["P"], delta, osc))
    return memo[key]


def chi_bound(m: dict, r: float, nG: float, delta: Tensor) -> Tensor:
    r"""(T,) certified ``(sum_j (P'_j - P_j)^2 / P_j)^{1/2}`` on ``B(X, r)`` (THEORY F31c).  With ``w_j = e^{d_j}/Z
    - 1`` (``Z = sum_k P_k e^{d_k}``): ``sum_j P_j w_j^2 <= sum_j P_j (e^{d_j} - 1)^2 / Z^2`` (a variance is at
    most the second moment about 1), ``|e^d - 1| <= |d| (e^D - 1)/D`` for ``|d| <= D = max_j delta_j``, and
    ``d_j = e_i^T G y_j + q_i^T e_j + e_i^T G e_j`` has ``(sum_j P_j d_j^2)^{1/2} <= s = r lambda_max(sum_j P_j
    G y_j (G y_j)^T)^{1/2} + r ||q_i|| + ||G|| r^2`` (Minkowski; one ``e_i`` for every key), ``Z >= e^{sum_j P_j
    d_j} >= e^{-s}`` (Jensen), so the bound is ``e^s s (e^D - 1)/D``."""
    sd = (r * torch.sqrt(m["lG"]) + r * m["qn"] + nG * r * r) * (1 + 1e-10)
    D = delta.max(dim=1).values
    slope = torch.where(D > 0, torch.expm1(D) / torch.where(D > 0, D, torch.ones_like(D)), torch.ones_like(D))
    return torch.nan_to_num(torch.exp(sd) * sd * slope * (1 + 1e-10), nan=math.inf, posinf=math.inf)


def head_moves(mom, r: float, norms: dict) -> Tensor:  # noqa: ANN001
    r"""(H, T) certified ``sup_{X' in B(X, r)} ||o^h(X')_i - o^h(X)_i||`` per head (before ``W_O``) from the function itself, not
    from a Jacobian sup (THEORY F31b).  Per head ``o_i = sum_j P_ij v_j`` (``v_j = W_V^T x_j`` + bias):

    .. math:: o'_i - o_i = \sum_j P'_{ij}\,W_V^\top e_j + \sum_j (P'_{ij} - P_{ij})(v_j - o_i),\qquad
              \|o'_i - o_i\| \le \|W_V\| r + \min\big(\textstyle\sum_j a_{ij}\|v_j - o_i\|,\ TV_i\,\mathrm{diam}_i(v)\big)

    (``P'`` a convex combination; ``sum_j (P' - P)_j = 0``, and a zero-sum vector with positive part
    ``TV`` moves any set of points by at most ``TV`` times its diameter), with ``a``, ``TV`` from
    ``softmax_envelope`` and the chi bound ``chi_bound`` times ``lambda_max(sum_j P_j (v_j - o_i)(v_j - o_i)^T)^{1/2}``
    (Cauchy-Schwarz in ``L^2(P)``); the caller combines the heads through ``W_O``.
    Assumptions: every token of the attention's input within ``r`` of X; dot attention without RoPE."""
    out = []
    for h, m in enumerate(mom.rows):
        delta, _, a, _, tv = ball_box(m, r, norms["G"][h])
        mix = torch.minimum(torch.minimum((a * m["vn"]).sum(dim=1), tv * m["dV"]),
                            chi_bound(m, r, norms["G"][h], delta) * torch.sqrt(m["lV"]))
        out.append((norms["V"][h] * r + mix) * (1 + 1e-10))
    return torch.nan_to_num(torch.stack(out), nan=math.inf, posinf=math.inf)


def ffn_unit_drift(ffn, z: Tensor, n1: Tensor, rh: Tensor,  # noqa: ANN001
                   above: tuple[Tensor, Tensor] | None = None, ez: Tensor | None = None) -> tuple[Tensor, Tensor]:
    r"""Per token, on the FFN input ball ``||dh|| <= rh_t`` (THEORY F31d): ``sup ||F(h + dh) - F(h)||`` and
    ``||int_0^1 (F(h + t dh) - F(h)) dt||`` (the FFN's second-order remainder per unit of ``dh``).

    Unit ``k`` moves by ``|dz_k| <= h_k = ||W_1[:, k]|| rh`` and ``|sigma'(z_k + s) - sigma'(z_k)| <=
    s2_k |s|`` with ``s2_k = sup |GELU''|`` on ``[z_k - h_k, z_k + h_k]`` (``gelu2_sup``); so the slope
    changes by at most ``c_k = min(s2_k h_k, R)`` (``R`` the range of GELU') and its mean over the
    segment by ``min(s2_k h_k / 2, R)``.  For ``|delta_k| <= c_k``, ``|u^T W_2^T diag(delta) W_1^T v| <=
    (sum_k c_k (w2_k . u)^2)^{1/2} (sum_k c_k (w1_k . v)^2)^{1/2}``, i.e.

    .. math:: \|W_2^\top \mathrm{diag}(\delta) W_1^\top\| \le \big(\lambda_{\max}(W_2^\top \mathrm{diag}(c) W_2)\,
              \lambda_{\max}(W_1 \mathrm{diag}(c) W_1^\top)\big)^{1/2}.

    Uses that a saturated unit (large ``|z_k|``) has a flat slope, which the global ``kappa`` cannot.  ``ez``: the
    pre-activations' rounding (``pre_activations``; None: ``z`` exact), which widens every ``h_k`` (F51a).
    ``above``: (T,) bounds ``(b, b_half)`` the caller takes the minimum with; a token with no capped unit whose
    bound is provably at least ``b`` and its half at least ``b_half`` (``gram_lower``, THEORY F42a) gets
    ``(inf, inf)`` without its Grams: every ``min`` with the caller's bounds is unchanged.
    Assumptions: non-gated FFN; exact (erf) GELU, else ``(inf, inf)`` (the global bounds apply).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T = z.shape[0]
    if Activation(ffn.activation) is not Activation.GELU:
        inf = torch.full((T,), math.inf, dtype=torch.float64)
        return inf, inf
    from ._local_jacobian import GRAM_PAD

    W1, W2 = _f64(ffn.W_1), _f64(ffn.W_2)
    raw = unit_slope_moves(z, n1, rh, ez)
    fro = float(pow2_norm(W1) * pow2_norm(W2))

    def bound(c: Tensor) -> Tensor:
        # both Grams in one certified batch (one Krylov pass and one Cholesky for the pair)
        l2, l1 = certified_lmax(torch.cat([(W2.T[None] * c[:, None, :]) @ W2[None],
                                           (W1[None] * c[:, None, :]) @ W1.T[None]])).chunk(2)
        b = torch.sqrt(l1 * l2) * (1 + GRAM_PAD) + GRAM_PAD * fro * c.max(dim=1).values
        return torch.nan_to_num(b, nan=math.inf, posinf=math.inf)

    c = raw.clamp(max=GELU_SLOPE_RANGE)
    capped = (raw > GELU_SLOPE_RANGE).any(dim=1)
    full = torch.full((T,), math.inf, dtype=torch.float64)
    form = torch.ones(T, dtype=torch.bool)
    if above is not None:  # F42a: skip the Grams where the bound provably loses to the caller's
        low = torch.sqrt(gram_lower(W1, c) * gram_lower(W2.T, c)) * (1 - 1e-12)
        form = capped | ~(low >= above[0]) | ~(low / 2 >= above[1])
    if bool(form.any()):
        full[form] = bound(c[form])
    # a token with nothing capped: the bound is 1-homogeneous in c, its half is half of it
    half = full / 2
    if bool(capped.any()):
        half[capped] = bound((raw[capped] / 2).clamp(max=GELU_SLOPE_RANGE))
    return full, half


def gram_lower(R: Tensor, c: Tensor, *, iters: int = GRAM_LOWER_ITERS) -> Tensor:
    r"""(n,) a lower bound on what F31d's certified ``lambda_max`` of ``R diag(c_t) R^T`` returns (THEORY F42a):
    the Rayleigh quotient of the ``iters``-th power iterate (from the normalised all-ones vector) of the implicit
    operator ``v -> R (c_t * (R^T v))`` (``2 d d_ff`` flops a step, no Gram), minus its float64 error and the formed
    Gram's, each at most ``gamma_{d + d_ff + 8} sum_k c_k ||r_k||^2`` (``r_k`` the columns of ``R``):

    .. math:: \lambda_{\max}(\widehat G) \ge \frac{v^\top G v}{v^\top v} - \|\widehat G - G\|_2
              \ge \widehat{\mathrm{RQ}}\,(1 - 10^{-10}) - 12(d + d_{ff} + 8)\,u \textstyle\sum_k c_k\|r_k\|^2

    (``G`` exact, ``\widehat G`` as formed, whose certified ``lambda_max`` is at least its own).  Assumptions:
    ``c >= 0`` finite (a NaN gives NaN, which no comparison passes); ``R`` (d, d_ff) float64.  Clamped at 0:
    the formed Gram's diagonal is a float sum of non-negative terms, so its ``lambda_max`` is ``>= 0`` (red13: two
    slightly negative lower bounds would otherwise multiply to a positive one)."""
    n = c.shape[0]
    d, m = R.shape
    V = torch.full((n, d), 1.0 / math.sqrt(d), dtype=torch.float64)
    for _ in range(iters):
        V = (V @ R * c) @ R.T
        V = V / V.norm(dim=1, keepdim=True).clamp(min=1e-300)
    U = V @ R
    rq = (U * U * c).sum(dim=1) / (V * V).sum(dim=1)
    mass = (c * (R * R).sum(dim=0)[None, :]).sum(dim=1) * (1 + 1e-9)
    return (rq * (1 - 1e-10) - 12 * (d + m + 8) * _U * mass).clamp_min(0.0)


def unit_slope_moves(z: Tensor, n1: Tensor, rh: Tensor, ez: Tensor | None = None) -> Tensor:
    """(T, d_ff) ``s2_k h_k`` of F31d before the cap: unit ``k`` of token ``t`` moves by ``|dz| <= h_k = ||W_1[:, k]||
    rh_t`` and its slope by at most ``sup |GELU''|`` on ``[z_k - h_k, z_k + h_k]`` times ``h_k``; exact GELU.  With
    ``ez`` (``pre_activations``: ``z`` within ``ez`` of the exact pre-activation) the interval is ``[z_k +- (h_k +
    ez_k)]``, which holds the exact centre's (red17-2, THEORY F51a); the move from that centre is still ``<= h_k``, so
    the bound stays linear in ``h_k`` at fixed sup (F37b's scaled references)."""
    from ._local_jacobian import gelu2_sup

    h = n1[None, :] * rh[:, None] * (1 + 1e-12)
    w = h if ez is None else h + ez
    return gelu2_sup(z - w, z + w) * h * (1 + ROUNDING_PAD)
