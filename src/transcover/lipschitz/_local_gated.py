"""Gated FFNs on a ball around real data: a certified local Lipschitz constant (THEORY F107).

Note [local gated FFN].  Row convention, one token: ``f(h) = (sigma(h W_g + b_g) * (h W_1 + b_1)) W_2 + b_2``
(Llama's SwiGLU with SiLU, GeGLU with GELU-tanh; ``*`` entrywise).  With ``g = h W_g + b_g``, ``u = h W_1 + b_1``
its Jacobian acts on a row ``dh`` as ``dh (W_g diag(alpha) + W_1 diag(beta)) W_2`` with ``alpha = sigma'(g) u``,
``beta = sigma(g)``.  On the ball ``||h - h0|| <= r`` every unit's ``g_k`` lies in ``[g0_k -+ (r ||W_g[:, k]|| +
e_k)]`` (``e_k`` the formed pre-activation's rounding), ``u_k`` likewise, so ``alpha_k`` and ``beta_k`` lie in
certified intervals (``act_ranges``: endpoints and the interior critical points of ``sigma`` and ``sigma'``).  For
any diagonal ``D`` with ``|D| <= diag(a)``, ``D = diag(sqrt a) S diag(sqrt a)`` with ``|S| <= I``, so
``||W D W_2|| <= ||W diag(sqrt a)|| ||diag(sqrt a) W_2||``.  Two bounds on the sup of ``||J||`` over the ball:

* *sup form*: ``a_k = sup|alpha_k|``, ``b_k = sup|beta_k|``:
  ``L <= ||W_g diag(sqrt a)|| ||W_2^T diag(sqrt a)|| + ||W_1 diag(sqrt b)|| ||W_2^T diag(sqrt b)||``;
* *centred form*: ``alpha = alpha0 + dalpha``, ``|dalpha_k| <= ra_k`` (``alpha0`` the formed value at the centre, any
  float), ``beta`` likewise:  ``L <= ||(W_g diag(alpha0) + W_1 diag(beta0)) W_2|| + (the sup form with ra, rb)``,
  which tends to the Jacobian's norm at the centre as ``r -> 0``.

The smaller per token, the largest over the tokens (a per-token map in the (2,inf) metric).  Each norm is certified
with its rounding (``_weighted_norm``, ``certified_spectral`` plus the formed product's Frobenius error).  The ball
is convex and the map C^1 (smooth activations), so a bound on ``||J||`` over it is a Lipschitz constant on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._errors import InputError
from ..model import QUICK_GELU_SLOPE, Activation, to_tensor
from ._local_ffn2 import _weighted_norm
from ._local_jacobian import affine_with_error, certified_spectral
from ._rounding import _U, _gamma, pow2_norm

__all__ = ["GatedLocal", "act_ranges", "gated_ffn_local", "GATED_ACTIVATIONS"]

_K = math.sqrt(2.0 / math.pi)
_C = 0.044715
# (critical point of sigma (its minimum), that minimum, argmin of sigma', min sigma', argmax of sigma', max sigma'),
# computed with mpmath at 40 digits (tests/lipschitz/test_local_gated.py re-derives them); the module brackets each
# critical point by +-_BRACKET and moves each extreme value outward by _EXT_PAD
_CRIT = {
    Activation.SILU: (-1.2784645427610738, -0.27846454276107380, -2.3993572805154677, -0.099839320128866917,
                      2.3993572805154677, 1.0998393201288669),
    Activation.GELU: (-0.75179152469356446, -0.16997120747990366, -1.4142135623730950, -0.12890414518515479,
                      1.4142135623730950, 1.1289041451851548),
    Activation.GELU_TANH: (-0.75246142207101626, -0.17004075057125405, -1.4185040087908284, -0.12899306865877177,
                           1.4185040087908284, 1.1289930686587718),
}
_BRACKET = 1e-3
_EXT_PAD = 1e-9
# float64 evaluation of sigma and sigma' below (libm exp/erfc within a few ulps; a polynomial's relative error times
# the sigmoid's log-slope, at most ~1e-12 where nothing underflows): padded by this, relative; sigma' is a sum of
# terms of order one that cancel near sigma's minimum (its error there is absolute, a few u), so sigma' is also
# padded by _SLOPE_ABS absolute (sigma = x s(x) is a product: relative, plus the subnormal floor)
_EVAL_PAD = 1e-10
_SLOPE_ABS = 1e-12
GATED_ACTIVATIONS = (Activation.SILU, Activation.QUICK_GELU, Activation.GELU, Activation.GELU_TANH,
                     Activation.IDENTITY)


def _values(act: Activation, x: Tensor) -> tuple[Tensor, Tensor]:
    """(sigma(x), sigma'(x)) in float64, by formulas without cancellation in the tails (THEORY F107)."""
    if act is Activation.IDENTITY:
        return x.clone(), torch.ones_like(x)
    if act in (Activation.SILU, Activation.QUICK_GELU):
        a = 1.0 if act is Activation.SILU else QUICK_GELU_SLOPE
        s, sn = torch.sigmoid(a * x), torch.sigmoid(-a * x)
        return x * s, s * (1 + a * x * sn)
    if act is Activation.GELU:
        Phi = 0.5 * torch.special.erfc(-x / math.sqrt(2.0))
        return x * Phi, Phi + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    # GELU-tanh: 0.5 (1 + tanh y) = sigmoid(2 y), 0.5 sech^2 y = 2 sigmoid(2y) sigmoid(-2y)
    y = _K * (x + _C * x * x * x)
    s, sn = torch.sigmoid(2 * y), torch.sigmoid(-2 * y)
    return x * s, s + 2 * x * s * sn * _K * (1 + 3 * _C * x * x)


def _crit(act: Activation) -> tuple[float, ...]:
    if act is Activation.QUICK_GELU:  # sigma(x) = silu(a x)/a, sigma'(x) = silu'(a x)
        xm, m, x1, d1, x2, d2 = _CRIT[Activation.SILU]
        a = QUICK_GELU_SLOPE
        return xm / a, m / a, x1 / a, d1, x2 / a, d2
    return _CRIT[act]


def _down(x: Tensor, absolute: float = 1e-300) -> Tensor:
    return x - (x.abs() * _EVAL_PAD + absolute)


def act_ranges(act: Activation | str, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""Certified ``[min, max]`` of ``sigma`` and of ``sigma'`` over each interval ``[lo, hi]`` (THEORY F107):
    ``(s_lo, s_hi, d_lo, d_hi)``.

    ``sigma`` (SiLU, QuickGELU, GELU, GELU-tanh) decreases to one minimum and then increases; ``sigma'`` decreases to
    its minimum, increases to its maximum, then decreases.  The extremes over an interval are therefore at its ends or
    at an interior critical point: each end is evaluated in float64 and moved outward by ``_EVAL_PAD`` relative (and
    ``sigma'`` by ``_SLOPE_ABS = 1e-12`` absolute: near sigma's minimum its terms cancel), and an interval that meets
    a critical point's bracket (``+-1e-3`` around the mpmath value) takes that extreme value, moved outward by
    ``1e-9``.  An end whose evaluation is not finite takes the global range (``sigma' in
    [min, max]``; ``sigma`` in ``[min sigma, max(|lo|, |hi|)]``, as ``|sigma(x)| <= |x|``).  Identity: exact.
    Assumption: ``lo <= hi`` finite.  ReLU is not covered (InputError)."""
    act = Activation(act)
    if act not in GATED_ACTIVATIONS:
        raise InputError(f"the local gated-FFN bound (THEORY F107) covers the activations "
                         f"{', '.join(a.value for a in GATED_ACTIVATIONS)}, not {act.value}")
    if act is Activation.IDENTITY:
        one = torch.ones_like(lo)
        return lo, hi, one, one
    xm, m, x1, d1, x2, d2 = _crit(act)
    sl, dl = _values(act, lo)
    sh, dh = _values(act, hi)
    big = torch.maximum(lo.abs(), hi.abs())
    fin = torch.isfinite(sl) & torch.isfinite(sh) & torch.isfinite(dl) & torch.isfinite(dh)
    s_hi = torch.where(fin, -_down(-torch.maximum(sl, sh)), big)
    s_lo = torch.where(fin, _down(torch.minimum(sl, sh)), torch.full_like(lo, m - _EXT_PAD))
    d_hi = torch.where(fin, -_down(-torch.maximum(dl, dh), _SLOPE_ABS), torch.full_like(lo, d2 + _EXT_PAD))
    d_lo = torch.where(fin, _down(torch.minimum(dl, dh), _SLOPE_ABS), torch.full_like(lo, d1 - _EXT_PAD))
    meets = lambda c: (lo <= c + _BRACKET) & (hi >= c - _BRACKET)  # noqa: E731
    s_lo = torch.where(meets(xm), torch.minimum(s_lo, torch.full_like(lo, m - _EXT_PAD)), s_lo)
    d_lo = torch.where(meets(x1), torch.minimum(d_lo, torch.full_like(lo, d1 - _EXT_PAD)), d_lo)
    d_hi = torch.where(meets(x2), torch.maximum(d_hi, torch.full_like(lo, d2 + _EXT_PAD)), d_hi)
    return s_lo, s_hi, d_lo, d_hi


def _outward(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """``[lo, hi]`` moved outward by ``4u`` relative and the smallest subnormal (one rounding of each end)."""
    t = 2.0**-1074
    return lo - lo.abs() * (4 * _U) - t, hi + hi.abs() * (4 * _U) + t


def _interval_product(al: Tensor, ah: Tensor, bl: Tensor, bh: Tensor) -> tuple[Tensor, Tensor]:
    ps = torch.stack([al * bl, al * bh, ah * bl, ah * bh])
    return _outward(ps.amin(0), ps.amax(0))


def _box(W: Tensor, b: Tensor | None, H: Tensor, r: float) -> tuple[Tensor, Tensor, Tensor]:
    """(z0, lo, hi): the formed pre-activations at the centres and certified per-unit ranges over the ball."""
    z, e = affine_with_error(W, b, H)
    col = pow2_norm(W, 0) * (1 + _gamma(W.shape[0] + 2)) * (1 + 1e-12)
    rad = (e + r * col[None, :]) * (1 + 4 * _U)
    lo, hi = _outward(z - rad, z + rad)
    return z, lo, hi


def _sqrt_up(a: Tensor) -> Tensor:
    """``s`` with ``s^2 >= a`` (``a >= 0``): the correctly rounded root moved up."""
    return torch.sqrt(a.clamp(min=0.0)) * (1 + 4 * _U)


@dataclass(frozen=True)
class GatedLocal:
    """The gated FFN's local constant on ``B(H, r)`` (THEORY F107): ``upper`` the max over tokens of the smaller of
    ``sup_form`` and ``centred`` (both (T,)); ``point`` (T,) the certified Jacobian norm at each centre."""

    upper: float
    sup_form: Tensor
    centred: Tensor
    point: Tensor


def gated_ffn_local(ffn, H: Tensor, r: float) -> GatedLocal:  # noqa: ANN001
    r"""Certified Lipschitz constant of a gated FFN ``(sigma(h W_g + b_g) * (h W_1 + b_1)) W_2 + b_2`` on the ball
    ``{H' : ||h'_t - h_t|| <= r for every token}`` in the (2,inf) metric (THEORY F107, Note [local gated FFN]):

    .. math:: L \le \max_t \min\Big(\|W_g D_{\sqrt a}\|\,\|W_2^\top D_{\sqrt a}\| + \|W_1 D_{\sqrt b}\|\,
              \|W_2^\top D_{\sqrt b}\|,\ \|(W_g D_{\alpha_0} + W_1 D_{\beta_0}) W_2\| + (\text{the same with } r_a,
              r_b)\Big)

    ``a_k >= sup|sigma'(g_k) u_k|``, ``b_k >= sup|sigma(g_k)|`` over the unit's pre-activation ranges on the ball
    (``act_ranges``, rounding outward), ``alpha0, beta0`` the values at the centre and ``r_a, r_b`` their largest
    moves.  Assumptions: ``H`` (T, d) float64 centres, ``r >= 0`` finite; activation one of ``GATED_ACTIVATIONS``;
    ``d_ff`` products of float64 weights (no member stack)."""
    if not ffn.gated:
        raise InputError("gated_ffn_local needs a gated FFN (W_gate)")
    act = Activation(ffn.activation)
    if act not in GATED_ACTIVATIONS:
        raise InputError(f"local bounds (THEORY F107) do not cover gated FFNs with activation {act.value}: covered "
                         f"are {', '.join(a.value for a in GATED_ACTIVATIONS)}")
    f64 = lambda W: None if W is None else to_tensor(W, dtype=torch.float64).detach()  # noqa: E731
    Wg, W1, W2 = f64(ffn.W_gate), f64(ffn.W_1), f64(ffn.W_2)
    H = H.detach().double()
    r = float(r)
    if not (r >= 0 and math.isfinite(r)):
        raise InputError(f"gated_ffn_local needs a finite radius r >= 0, but got r={r!r}")
    g0, gl, gh = _box(Wg, f64(ffn.b_gate), H, r)
    u0, ul, uh = _box(W1, f64(ffn.b_1), H, r)
    s_lo, s_hi, d_lo, d_hi = act_ranges(act, gl, gh)
    al, ah = _interval_product(d_lo, d_hi, ul, uh)  # alpha = sigma'(g) u
    a = torch.maximum(al.abs(), ah.abs())
    b = torch.maximum(s_lo.abs(), s_hi.abs())
    W2t = W2.T.contiguous()
    sa, sb = _sqrt_up(a), _sqrt_up(b)
    sup_form = (_weighted_norm(Wg, sa) * _weighted_norm(W2t, sa) + _weighted_norm(W1, sb) * _weighted_norm(W2t, sb))
    # centred form: alpha0, beta0 the formed values at the centre (exact floats: any centre is allowed)
    s0, d0 = _values(act, g0)
    alpha0, beta0 = d0 * u0, s0
    fin = torch.isfinite(alpha0).all(dim=1) & torch.isfinite(beta0).all(dim=1)
    alpha0, beta0 = torch.nan_to_num(alpha0), torch.nan_to_num(beta0)
    ra = torch.maximum(ah - alpha0, alpha0 - al) * (1 + 4 * _U)
    rb = torch.maximum(s_hi - beta0, beta0 - s_lo) * (1 + 4 * _U)
    C = Wg[None] * alpha0[:, None, :] + W1[None] * beta0[:, None, :]  # (T, d, d_ff)
    J0 = C @ W2  # (T, d, d)
    dff = W2.shape[0]
    eC = (Wg.abs()[None] * alpha0.abs()[:, None, :] + W1.abs()[None] * beta0.abs()[:, None, :])
    fro = lambda A: torch.sqrt((A * A).sum(dim=(-2, -1)))  # noqa: E731
    nW2F = float(fro(W2)) * (1 + 1e-12)
    err = (_gamma(2) * fro(eC) + _gamma(dff + 2) * fro(C)) * nW2F * (1 + _gamma(C.shape[1] * C.shape[2] + 4))
    point = (certified_spectral(J0) + err) * (1 + 1e-12)
    ra_, rb_ = _sqrt_up(ra), _sqrt_up(rb)
    move = _weighted_norm(Wg, ra_) * _weighted_norm(W2t, ra_) + _weighted_norm(W1, rb_) * _weighted_norm(W2t, rb_)
    centred = torch.where(fin, (point + move) * (1 + 1e-12), torch.full_like(point, math.inf))
    per = torch.minimum(sup_form * (1 + 1e-12), centred)
    upper = float(per.max()) if per.numel() else 0.0
    if not math.isfinite(upper) and bool(torch.isfinite(per).any()):
        upper = math.inf
    return GatedLocal(upper, sup_form, centred, point)
