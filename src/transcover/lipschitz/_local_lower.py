"""Empirical lower estimates of a local (2,inf)-Lipschitz constant on a whole ball (issue 12, item 1).

Note [ball lower].  For ``f`` mapping T tokens to T tokens and the ball ``B(X, rho)`` (every token
within ``rho``, l2, of ``X``; convex), the (2,inf) Lipschitz constant of ``f`` on the ball is

    L = sup_{X' in B} max_i nu_i(J(X')),   nu_i(J) = max_{||v_j|| <= 1} ||sum_j J_ij v_j||,

(mean-value inequality along segments for ``<=``, difference quotients at interior points and the
continuity of ``J`` for ``>=``).  The point estimate ``nu_i(J(X))`` is the same for every ``rho`` and
understates ``L`` on large balls.  Two searches attain values of ``L`` from below:

* (a) centres: projected ascent of ``u^T (J(X') V)_i`` over ``X'`` in the ball, alternating with the
  maximisation over ``V`` (``v_j = J_ij^T u / ||J_ij^T u||``) and ``u`` (the normalised image).  One
  autograd pass with a double backward gives all three: ``g = J^T w`` (``w`` the cotangent ``u`` at
  token ``i``, built with ``create_graph``), then ``d<w, J V>/d(w, X')`` = (``J V``, the gradient of
  ``u^T (J V)_i`` in ``X'``).  The step is the steepest ascent of the ball's geometry: per token
  ``X'_j += eta rho grad_j / ||grad_j||`` (the maximiser of a linear function over a product of l2
  balls), then each token clipped back into its ball.  Every recorded value is ``||(J(X') V)_i||``
  with unit rows ``v_j`` at a point of the ball: attained.
* (b) pairs: Adam ascent of ``||f(Y)_i - f(Z)_i|| / max_j ||Y_j - Z_j||`` over ``Y, Z`` in the ball
  (antipodal pairs along the best direction, a close pair at the best centre, random pairs), each
  recorded ratio reduced by an allowance for the float64 error of the two evaluations (Note [pair
  allowance]), so tiny separations cannot pass rounding noise off as slope.  By the mean-value
  inequality (b) never exceeds the sup in (a); it is a second, derivative-free witness.

Both are values attained by witnesses (kind: empirical lower bound); the caller compares them with a
certified bound through ``check_certified``.  Points are kept at ``rho (1 - 1e-9)`` so that float
rounding of the clipping never leaves the ball.

Note [pair allowance] (red team 218; THEORY F30 item 7).  A recorded pair value is

    max(0, ||f(Y)_i - f(Z)_i|| - a_i - e(Y)_i - e(Z)_i) / s,

``s = max_j ||Y_j - Z_j||`` of the two points as evaluated (the floats ``fl(X + A)``, not the intended
offsets), rounded up; ``a_i = 64 (T + d) u (||f(Y)_i|| + ||f(Z)_i||)`` the rounding of the output-sized
values (the subtraction, the norms); ``e(Y)_i`` the float64 error of evaluating ``f`` at ``Y``, which an
allowance on the output size cannot see: a LayerNorm whose input has mean 1e7 and std 1 errs by about
``u 1e7`` times its amplification while its output has norm ``sqrt(d)``, and a close pair at 1e-2 rho
turned that noise into slopes of 2.2 and 8 against true constants near 1.  ``e`` is measured by a float32
shadow of the same function (``shadow``): ``e(Y)_i = 64 (u64 / u32) ||f32(Y)_i - f(Y)_i||``.  To first
order the rounding error of an evaluation is the unit roundoff times a coefficient of the computation
and the point, the same at both precisions; the shadow also rounds its inputs to float32, which only
adds error (the safe side: the value gets smaller); 64 covers the spread of the coefficient between
the two roundings.  Past first order the estimate means nothing: a shadow row that is not finite or
errs by more than 1/16 of the row is given an infinite ``e`` (the row does not count).  Without a
shadow, pairs closer than ``sqrt(u) (max_j ||Y_j|| + max_j ||Z_j||)`` do not count (a function whose
float64 error is below ``sqrt(u)`` of its inputs' size times its slope cannot then double the slope).
Search (a) differentiates in float64 (no difference quotient): on the red team's cases (LayerNorm at
mean 1e5 and 1e7, the bias-1e6 BERT layer) its values stayed at or below the true constants.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .._errors import InputError
from .._results import Kind, Quantity

__all__ = ["BallLower", "ball_lower", "ball_lower_sweep", "bilinear_lower", "point_lower"]

Fn = Callable[[Tensor], Tensor]
_U = 2.0**-53
_SHRINK = 1 - 1e-9
_U32 = 2.0**-24
_SHADOW_K = 2.0**6  # Note [pair allowance]: the spread of the first-order error coefficient between two roundings
_SHADOW_SAT = 2.0**-4  # a shadow row erring by more than this fraction of the row is past first order


@dataclass
class BallLower:
    """The best attained value of the (2,inf) Lipschitz constant of ``fn`` on ``B(X, rho)``."""

    value: float  # max over the two searches (empirical lower bound)
    rho: float
    method: str  # "jacobian" (a centre X' and unit rows V) or "pair" (two points Y, Z)
    token: int  # the output token whose row attains it
    point: float  # the same search's value at X itself (rho -> 0), for comparison
    jacobian: float  # best of search (a)
    pair: float  # best of search (b)
    centre: Tensor | None = field(default=None, repr=False)  # X' (a) or Y (b)
    direction: Tensor | None = field(default=None, repr=False)  # V (a) or Z (b)
    seconds: float = math.nan

    @property
    def kind(self) -> Kind:
        return Kind.EMPIRICAL_LOWER

    def quantity(self) -> Quantity:
        return Quantity(self.value, Kind.EMPIRICAL_LOWER, "Note [ball lower] (issue 12)",
                        (f"attained at a point (or pair) with every token within rho={self.rho:.6g} (l2) of X",
                         "metric (2,inf)", f"witness: {self.method}, output token {self.token}"))


def _clip(D: Tensor, rho: float) -> Tensor:
    """Each token of the offset ``D`` shrunk into the ball of radius ``rho (1 - 1e-9)``."""
    n = D.norm(dim=-1, keepdim=True)
    return D * torch.clamp(rho * _SHRINK / n.clamp(min=1e-300), max=1.0)


def _unit_rows(G: Tensor) -> Tensor:
    return G / G.norm(dim=-1, keepdim=True).clamp(min=1e-300)


def _inner_radius(X: Tensor, rho: float) -> float:
    """The radius for ``_clip`` inside ``B(X, rho)``: rho less what forming ``X + C`` can round by (``u (|X_j| + rho)``
    per token), so every point searched lies in ``B(X, rho)`` as the floats hold it (red team 174: 1.000017 rho at
    rho = 1.6e-13); 0 below the data's float resolution (only the point X itself is searched then)."""
    return max(rho * _SHRINK - 2 * _U * (float(X.norm(dim=-1).max()) + rho), 0.0) / _SHRINK


def _shadow_error(shadow: Fn, Y: Tensor, fY: Tensor) -> Tensor:
    """Per output row: ``e(Y)_i``, the float64 error of ``fY = f(Y)`` estimated by the float32 ``shadow`` of ``f``
    (Note [pair allowance]); infinite where the shadow is not finite or past first order."""
    with torch.no_grad():
        e = (shadow(Y.detach().float()).double() - fY).norm(dim=-1)
    bad = ~torch.isfinite(e) | (e > _SHADOW_SAT * fY.norm(dim=-1))
    return torch.where(bad, torch.full_like(e, math.inf), _SHADOW_K * (_U / _U32) * e)


def _pair_quotients(Y: Tensor, Z: Tensor, fY: Tensor, fZ: Tensor, shadow: Fn | None) -> Tensor:
    """Per output row ``i``: the recorded value of the pair ``(Y, Z)`` (the points as evaluated, ``fY = f(Y)``,
    ``fZ = f(Z)``), an attained difference quotient less the float64 error of the two evaluations (Note [pair
    allowance]); zeros where nothing counts.  ``shadow``: ``f`` in float32, or None."""
    with torch.no_grad():
        Y, Z, fY, fZ = Y.detach(), Z.detach(), fY.detach(), fZ.detach()
        T, d = Y.shape[-2:]
        zero = torch.zeros(fY.shape[:-1], dtype=torch.float64)
        s = float((Y - Z).norm(dim=-1).max())  # the subtraction and the norm: (d + 3) u at most, rounded up
        s = math.nextafter(s * (1 + (d + 6) * _U), math.inf)
        if not (s > 0 and math.isfinite(s)):
            return zero
        allow = 64 * (T + d) * _U * (fY.norm(dim=-1) + fZ.norm(dim=-1))
        if shadow is not None:
            allow = allow + _shadow_error(shadow, Y, fY) + _shadow_error(shadow, Z, fZ)
        elif s < math.sqrt(_U) * (float(Y.norm(dim=-1).max()) + float(Z.norm(dim=-1).max())):
            return zero  # no shadow: a separation this small could be rounding noise (Note [pair allowance])
        r = ((fY - fZ).norm(dim=-1) - allow).clamp(min=0.0) / s
        return torch.where(torch.isfinite(r), r, zero)


def _jac_step(fn: Fn, Xp: Tensor, i: int, u: Tensor, need_x: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """At ``Xp`` with cotangent ``u`` at token ``i``: (``V``, the unit rows of ``J^T w``; ``J V``;
    the gradient in ``Xp`` of ``u^T (J V)_i`` with ``V`` held, when ``need_x``) (Note [ball lower], (a))."""
    Xr = Xp.detach().clone().requires_grad_(True)
    w = torch.zeros_like(Xr)
    w[i] = u
    w.requires_grad_(True)
    y = fn(Xr)
    (g,) = torch.autograd.grad(y, Xr, w, create_graph=True)
    V = _unit_rows(g.detach())
    if not need_x:
        (JV,) = torch.autograd.grad((g * V).sum(), w)
        return V, JV.detach(), None
    JV, gX = torch.autograd.grad((g * V).sum(), (w, Xr), allow_unused=True)
    if gX is None:  # fn linear in X: the Jacobian does not move
        gX = torch.zeros_like(Xr)
    return V, JV.detach(), gX.detach()


def point_lower(fn: Fn, X: Tensor, *, iters: int = 15, seed: int = 0, tokens: int = 4) -> tuple[float, int, Tensor]:
    """The attained (2,inf) norm of ``J(X)``: ``jacobian_operator_norm``'s alternating rule (which
    follows the largest row) picks candidate rows, then for each of the ``tokens`` largest rows of
    its ``J V`` the per-row alternating maximisation (``u -> V = unit rows of J^T u -> u = unit
    (J V)_i``, each step non-decreasing): (value, token, V) of the best, the value the returned
    witness attains.  Kind: empirical lower."""
    from ._empirical import jacobian_operator_norm

    X = X.detach().double()
    _, V = jacobian_operator_norm(fn, X, metric="2,inf", n_iter=max(iters // 3, 2), seed=seed)
    JV = torch.autograd.functional.jvp(fn, X, _unit_rows(V))[1]
    rows = JV.norm(dim=-1)
    best = (-1.0, 0, V)
    for i in rows.topk(min(tokens, rows.shape[0])).indices.tolist():
        u = _unit_rows(JV[i])
        for _ in range(iters):
            Vi, JVi, _ = _jac_step(fn, X, i, u, need_x=False)
            val = float(JVi[i].norm())
            if val > best[0]:
                best = (val, i, Vi)
            u = _unit_rows(JVi[i])
    return best


class _HalvingAscent:
    """Projected steepest ascent of the offset ``C`` on ``B(0, rho)`` (Note [ball lower] (a)): each step
    goes along the unit rows of the last kept point's gradient (per token) and is clipped into the ball;
    a point whose value drops below the last kept one is not kept and the step length halves.  The
    first step goes to the linear maximiser on the boundary, later ones refine (length at most 1/2)."""

    def __init__(self, C: Tensor, rho: float) -> None:
        self.C, self.rho = C, rho
        self.eta, self.prev, self.Cb, self.gb = 1.0, -math.inf, C, None

    def keep(self, value: float, grad: Tensor) -> bool:
        """Whether the current point is kept (its ``value`` did not drop); if not, the step halves."""
        if value >= self.prev:
            self.prev, self.Cb, self.gb = value, self.C, grad
            return True
        self.eta *= 0.5
        return False

    def step(self) -> None:
        self.C = _clip(self.Cb + self.eta * self.rho * _unit_rows(self.gb), self.rho)
        self.eta = min(self.eta, 0.5)


def _centre_ascent(fn: Fn, X: Tensor, rho: float, C: Tensor, i: int, u: Tensor, steps: int,
                   best: list) -> None:
    """Search (a) from offset ``C``: ``steps`` alternating/ascent iterations (``_HalvingAscent`` on the
    largest row); ``best`` holds [value, token, X', V] and is updated in place with every attained value
    (a point that is not kept was still attained)."""
    asc = _HalvingAscent(C, rho)
    for k in range(steps + 1):
        # the last point's gradient in X' would only be stored: its double backward is skipped (same V, J V)
        V, JV, gX = _jac_step(fn, X + asc.C, i, u, need_x=k < steps)
        rows = JV.norm(dim=-1)
        t = int(rows.argmax())
        val = float(rows[t])
        if not math.isfinite(val):
            return
        if val > best[0]:
            best[:] = [val, t, (X + asc.C).detach().clone(), V]
        if asc.keep(val, gX):
            # follow the largest row (V was chosen for row i; a larger row t is attained as well)
            i = t if float(rows[t]) > float(rows[i]) else i
            u = _unit_rows(JV[i])
        if k == steps:
            break
        asc.step()


def _pair_ascent(fn: Fn, X: Tensor, rho: float, A0: Tensor, B0: Tensor, i: int, steps: int, lr: float,
                 best: list, shadow: Fn | None = None) -> None:
    """Search (b): Adam (Kingma & Ba 2015, beta = (0.9, 0.999); written out here, ``torch.optim``'s
    first step costs seconds of imports) on the ratio of row ``i`` over the pair ``(X + A, X + B)``,
    each iterate clipped into the ball; ``best`` holds [value, token, Y, Z], each value recorded by
    ``_pair_quotients`` (Note [pair allowance]; ``shadow``: ``fn`` in float32, or None)."""
    P = torch.stack([_clip(A0, rho), _clip(B0, rho)])
    m, v = torch.zeros_like(P), torch.zeros_like(P)
    for k in range(steps + 1):
        # the last pair is only evaluated (no gradient follows): no autograd graph, the same floats
        Pr = P.detach().clone().requires_grad_(k < steps)
        Ya, Yb = X + Pr[0], X + Pr[1]
        fa, fb = fn(Ya), fn(Yb)
        den = (Pr[0] - Pr[1]).norm(dim=-1).max()
        num = (fa - fb).norm(dim=-1)
        with torch.no_grad():
            # the quotient over the evaluated points bounds the recorded value: the shadow runs only where it could win
            raw = float((num / (Ya - Yb).norm(dim=-1).max()).max())
            if raw > best[0]:
                r = _pair_quotients(Ya, Yb, fa, fb, shadow)
                t = int(r.argmax())
                if float(r[t]) > best[0]:
                    best[:] = [float(r[t]), t, Ya.detach().clone(), Yb.detach().clone()]
        ratio = num[i] / den
        if k == steps or not bool(torch.isfinite(ratio)):
            return
        (grad,) = torch.autograd.grad(ratio, Pr)
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        step = (m / (1 - 0.9 ** (k + 1))) / ((v / (1 - 0.999 ** (k + 1))).sqrt() + 1e-30)
        P = torch.stack([_clip(P[0] + lr * step[0], rho), _clip(P[1] + lr * step[1], rho)])


def ball_lower(fn: Fn, X: Tensor, rho: float, *, steps: int = 6, restarts: int = 1, pair_steps: int = 6,
               pair_restarts: int = 1, seed: int = 0, token: int | None = None, V: Tensor | None = None,
               start: Tensor | None = None, point: float | None = None, image: Tensor | None = None,
               shadow: Fn | None = None) -> BallLower:
    r"""An empirical lower bound on the (2,inf) Lipschitz constant of ``fn`` on ``B(X, rho)`` (Note
    [ball lower]):

    .. math:: \max\Big(\max_{k} \|(J(X'_k) V_k)_{i_k}\|,\ \max_k \frac{\|f(Y_k)_{i_k} - f(Z_k)_{i_k}\|
              - \epsilon_k}{\max_j \|Y_{kj} - Z_{kj}\|}\Big) \le \sup_{X' \in B(X,\rho)} \|J(X')\|_{(2,\infty)}

    over the centres ``X'_k`` of the projected ascent (a) and the pairs of the Adam ascent (b), every
    point in the ball.  Starts of (a): ``X`` (or ``start``, a point of the ball, e.g. the best centre of
    a smaller ball), then ``restarts`` random points; ``token``/``V``: the point search's best row
    and direction (computed by :func:`point_lower` when not given; ``point``: its value).  ``steps``,
    ``pair_steps``: iterations per start (each about 11 and 4 forward evaluations of ``fn``); ``image``: the
    unit vector ``(J(X) V)_token / ||.||`` of the search's first step, computed when None; ``shadow``: ``fn``
    evaluated in float32 (the same weights cast), which measures the float64 error of the pairs' evaluations
    (Note [pair allowance]; without it close pairs do not count).  Kind:
    empirical lower bound; never above a certified bound of the same quantity (callers run
    ``check_certified``).  Assumptions: ``fn`` maps (T, d) float64 to (T, d'), differentiable twice
    almost everywhere (ReLU kinks give a zero second derivative, search (b) still moves).
    """
    if not (rho > 0 and math.isfinite(rho)):
        raise InputError(f"rho must be a finite number > 0, but got rho={rho!r}")
    for name, v in (("steps", steps), ("restarts", restarts), ("pair_steps", pair_steps),
                    ("pair_restarts", pair_restarts)):
        if v < 0:
            raise InputError(f"{name} must be >= 0, but got {name}={v}")
    t0 = time.perf_counter()
    X = X.detach().double()
    if token is None or V is None or point is None:
        p, tk, Vp = point_lower(fn, X, seed=seed)
        token = tk if token is None else token
        V = Vp if V is None else V
        point = p if point is None else point
    V = _unit_rows(V.detach().double())
    inner = _inner_radius(X, rho)
    if inner == 0.0:
        steps = restarts = pair_steps = pair_restarts = 0
    g = torch.Generator().manual_seed(seed)
    best = [float(point), int(token), X.clone(), V]  # the point's value is attained at X (in the ball)
    u0 = _point_image(fn, X, V, int(token)) if image is None else image
    starts = [torch.zeros_like(X) if start is None else _clip(start.detach().double() - X, inner)]
    for _ in range(restarts):
        D = _unit_rows(torch.randn(X.shape, generator=g, dtype=torch.float64))
        starts.append(D * inner * torch.rand(X.shape[0], 1, generator=g, dtype=torch.float64).sqrt())
    for C in starts:
        _centre_ascent(fn, X, inner, C, int(token), u0, steps, best)
    jac = best[0]
    jbest = list(best)
    pbest = [0.0, int(token), None, None]
    if pair_steps > 0 or pair_restarts > 0:
        Xc, Vb, tb = best[2], best[3], best[1]
        # rows of V that the Jacobian left at zero (a flat ReLU region, say) get a random direction, so
        # the pairs still separate there
        R = _unit_rows(torch.randn(X.shape, generator=g, dtype=torch.float64))
        Vb = torch.where(Vb.norm(dim=-1, keepdim=True) > 0.5, Vb, R)
        pstarts = [(inner * Vb, -inner * Vb, 0.05 * inner),  # antipodal along the best direction
                   (Xc - X, Xc - X - 1e-2 * inner * Vb, 1e-3 * inner)]  # a close pair at the best centre
        for _ in range(pair_restarts):
            D = _unit_rows(torch.randn(X.shape, generator=g, dtype=torch.float64)) * inner
            E = _unit_rows(torch.randn(X.shape, generator=g, dtype=torch.float64)) * inner
            pstarts.append((D, E, 0.05 * rho))
        for A0, B0, lr in pstarts:
            _pair_ascent(fn, X, inner, A0, B0, tb, pair_steps, lr, pbest, shadow)
    if pbest[0] > jbest[0]:
        value, method, tok, c, dr = pbest[0], "pair", pbest[1], pbest[2], pbest[3]
    else:
        value, method, tok, c, dr = jbest[0], "jacobian", jbest[1], jbest[2], jbest[3]
    return BallLower(value, rho, method, int(tok), float(point), jac, pbest[0], c, dr, time.perf_counter() - t0)


def _point_image(fn: Fn, X: Tensor, V: Tensor, token: int) -> Tensor:
    """``(J(X) V)_token`` normalised (one JVP): the first cotangent of the centre search (a)."""
    with torch.no_grad():
        return _unit_rows(torch.autograd.functional.jvp(fn, X, V)[1][token])


def ball_lower_sweep(fn: Fn, X: Tensor, rhos, *, init: tuple | None = None, adaptive: bool = True,  # noqa: ANN001
                     pair_from: float = 0.0, **kw) -> list[BallLower]:
    """:func:`ball_lower` for increasing radii, each started at the previous ball's best centre
    stretched to the new radius (``X + (rho_k / rho_{k-1}) (X' - X)``, inside the new ball) and never
    below the previous value (the balls are nested: a witness of a smaller ball is one of the larger).
    ``init``: a point witness (value, token, V) at X to start from (e.g. the rows route's
    ``row_lower``), else :func:`point_lower`.  ``adaptive``: a radius whose predecessor gained under
    1 % over the point value (the Jacobian barely moves there, the stretched centre is already near
    the maximiser) gets one centre step, and the steps saved go to the largest radius, where the
    Jacobian norm is multimodal (measured on MiniLM at 0.1 x the token norm: 18-23 -> 25-28 at the
    same cost).  ``pair_from``: the pair search (b) only on balls of radius at least this (below, ``pair`` is 0): on a
    small ball the centre search (a) attains nearly the sup the pairs are bounded by (mean-value inequality), and on
    the 150 benchmark sentences it set the lower at every one of the 3 600 (sentence, layer) rows with ``rho <= 1e-2``
    x the median token norm (the pairs about 45 % of the search's time).  Returned in the order of ``rhos``."""
    X = X.detach().double()
    p, tk, V = point_lower(fn, X, seed=kw.get("seed", 0)) if init is None else init
    p = float(p)
    steps = int(kw.pop("steps", 6))
    out: dict[float, BallLower] = {}
    prev: BallLower | None = None
    order = sorted(float(r) for r in rhos)
    saved = 0
    image = _point_image(fn, X, _unit_rows(V.detach().double()), int(tk))  # the same at every radius
    for k, rho in enumerate(order):
        n = steps
        if adaptive and prev is not None and prev.value < 1.01 * p and k < len(order) - 1:
            n = min(1, steps)
        saved += steps - n
        if adaptive and k == len(order) - 1:
            n += saved
        start = None
        if prev is not None and prev.method == "jacobian" and prev.centre is not None:
            start = X + (rho / prev.rho) * (prev.centre - X)
        # the point witness (value p attained at X by (tk, V)) seeds every radius; the centre is carried
        pairs = {} if rho >= pair_from else {"pair_steps": 0, "pair_restarts": 0}
        r = ball_lower(fn, X, rho, token=tk, V=V, start=start, point=p, steps=n, image=image, **{**kw, **pairs})
        if prev is not None and prev.value > r.value:
            r = BallLower(prev.value, rho, prev.method, prev.token, p, max(prev.jacobian, r.jacobian),
                          max(prev.pair, r.pair), prev.centre, prev.direction, r.seconds)
        out[rho] = prev = r
    return [out[float(r)] for r in rhos]


def _drift_step(fn: Fn, X: Tensor, Yp: Tensor, i: int, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """At ``Yp`` with cotangent ``u`` at token ``i``: (``V``, the unit rows of ``(J(Yp) - J(X))^T w``;
    ``(J(Yp) - J(X)) V``; the gradient in ``Yp`` of ``u^T (J(Yp) V)_i`` with ``V`` held)."""
    w = torch.zeros_like(X)
    w[i] = u
    Xr = X.detach().clone().requires_grad_(True)
    (g0,) = torch.autograd.grad(fn(Xr), Xr, w)
    Yr = Yp.detach().clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(Yr), Yr, wr, create_graph=True)
    V = _unit_rows((g - g0).detach())
    JV, gY = torch.autograd.grad((g * V).sum(), (wr, Yr), allow_unused=True)
    if gY is None:  # fn linear: its Jacobian does not drift
        gY = torch.zeros_like(Yr)
    J0V = torch.autograd.functional.jvp(fn, X, V)[1]
    return V, (JV - J0V).detach(), gY.detach()


def drift_lower(fn: Fn, X: Tensor, rho: float, *, tokens=(0,), restarts: int = 3, steps: int = 30,  # noqa: ANN001
                seed: int = 0) -> tuple[Tensor, list]:
    r"""(T,) attained values of ``sup_{Y in B(X, rho)} nu_i(J(Y) - J(X))`` per output token (zero where
    no witness was recorded) and the best witness ``[value, token, Y, V]``: for each start (random
    offsets on the ball's boundary, random cotangents ``u`` at a token of ``tokens``), alternating
    maximisation over the unit rows ``V`` (``v_j`` the unit rows of ``(J(Y) - J(X))^T w``) and ``u`` (the
    normalised image, following the largest row) with a projected steepest-ascent step in ``Y`` (per
    token along the gradient of ``u^T (J(Y) V)_i``, halved when the value drops), as in Note [ball
    lower] (a).  Every recorded value is ``||((J(Y) - J(X)) V)_i||`` at a point of the ball with unit
    rows: attained.  Kind: empirical lower."""
    X = X.detach().double()
    g = torch.Generator().manual_seed(seed)
    vals = torch.zeros(X.shape[0], dtype=torch.float64)
    best = [-1.0, 0, X, None]
    for k in range(restarts * len(tokens)):
        i = int(tokens[k % len(tokens)])
        u = _unit_rows(torch.randn(X.shape[1], generator=g, dtype=torch.float64))
        asc = _HalvingAscent(rho * _SHRINK * _unit_rows(torch.randn(X.shape, generator=g, dtype=torch.float64)), rho)
        for s in range(steps + 1):
            V, DV, gY = _drift_step(fn, X, X + asc.C, i, u)
            rows = DV.norm(dim=-1)
            vals = torch.maximum(vals, rows)
            t = int(rows.argmax())
            if float(rows[t]) > best[0]:
                best = [float(rows[t]), t, (X + asc.C).clone(), V]
            if asc.keep(float(rows[i]), gY):  # the ascent follows token i's row
                u = _unit_rows(DV[i])
            if s == steps:
                break
            asc.step()
    return vals, best


def bilinear_lower(objective: Callable[[Tensor, Tensor], Tensor], shape, *, restarts: int = 3,  # noqa: ANN001
                   steps: int = 120, seed: int = 0) -> float:
    """Empirical lower estimate of ``sup objective(h, v)`` over ``h, v`` of ``shape`` with every token (last
    axis) on the unit sphere: Adam (lr 0.05) on unconstrained ``a, b`` through ``h = a / ||a||`` per token,
    ``restarts`` random starts of ``steps`` steps, the best value seen.  Used for the second-derivative
    forms of F40 (``benchmarks/stack_aligned_probe.py``, ``tests/lipschitz/test_local_stack_aligned.py``).
    The restarts run as one batch (``torch.func.vmap`` of ``objective``; Adam is elementwise, so one optimiser on the
    stacked starts takes each start's own steps) and one at a time where ``objective`` cannot be mapped."""
    g = torch.Generator().manual_seed(seed)
    starts = [(torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64))
              for _ in range(restarts)]
    if restarts > 1:
        try:
            return _bilinear_batched(objective, starts, steps)
        except Exception:  # noqa: BLE001  (a data-dependent branch, .item(), an in-place write: not mappable)
            pass
    best = 0.0
    for a0, b0 in starts:
        a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        opt = torch.optim.Adam([a, b], lr=0.05)
        for _ in range(steps):
            val = objective(_on_sphere(a), _on_sphere(b))
            best = max(best, float(val.detach()))
            opt.zero_grad()
            (-val).backward()
            opt.step()
    return best


def _on_sphere(a: Tensor) -> Tensor:  # unclamped: the draws are never 0
    return a / a.norm(dim=-1, keepdim=True)


def _bilinear_batched(objective: Callable[[Tensor, Tensor], Tensor], starts: list, steps: int) -> float:
    """``bilinear_lower``'s restarts at once: the same starts, steps and Adam, on (restarts, *shape) tensors."""
    f = torch.func.vmap(objective)
    a = torch.stack([a0 for a0, _ in starts]).requires_grad_(True)
    b = torch.stack([b0 for _, b0 in starts]).requires_grad_(True)
    opt = torch.optim.Adam([a, b], lr=0.05)
    best = 0.0
    for _ in range(steps):
        vals = f(_on_sphere(a), _on_sphere(b))
        if vals.shape != (len(starts),):
            raise ValueError("objective is not a scalar")
        seen = vals.detach()[~torch.isnan(vals.detach())]  # a nan start is skipped, as max(best, nan) skips it
        if seen.numel():
            best = max(best, float(seen.max()))
        opt.zero_grad()
        (-vals.sum()).backward()  # d(sum)/d(start k) is start k's own gradient
        opt.step()
    return best
