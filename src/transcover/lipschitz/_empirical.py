"""Empirical lower estimates of Lipschitz constants and of the G.3 output change.

Note [witnesses]: every number here is an EMPIRICAL_LOWER bound because it is the ratio
``||f(X) - f(X')|| / ||X - X'||`` (or the output change ``||g(W)(X) - g(W~)(X)||``) at an explicit
pair of inputs *inside the domain* (token norms <= R, and, when a LayerNorm variance floor is
assumed, every LayerNorm input of both points satisfying it), computed in float64 (the step D is
re-synchronised to ``fl(X + D) - X`` before every evaluation, so it is the stored pair's distance).  The
true supremum is therefore at least the value, up to float64 rounding of the two forward passes:
relative ~1e-15 on well-conditioned stages, but it grows with the stage's conditioning (a LayerNorm
at eps = 1e-12 on inputs of norm 1e6 near its variance floor: 6e-8, red team 37f), and the ascent,
which maximises the computed ratio, finds that noise where it is largest.
Search: (1) autograd power iteration on the Jacobian at many
random inputs (``jacobian_operator_norm``: power iteration on J^T J for Frobenius; for
``(2,inf)`` an alternating row-block iteration that maximises ``||(J V)_t||`` over unit-row V,
monotone like power iteration); its direction seeds (2) Adam ascent on the pair (X, X') with
projection onto the domain after every step, from several restarts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._errors import InputError
from .._results import Kind, Quantity, check_certified
from ..model import (
    ForwardHooks,
    NormKind,
    NormSpec,
    Placement,
    TransformerSpec,
    attention_forward,
    check_sequence_length,
    ffn_forward,
    layer_forward,
    norm_forward,
    transformer_forward,
)
from ._compose import empty_domain_stages
from ._weights import ROUNDING_PAD, check_radius

__all__ = [
    "LowerEstimate",
    "function_lipschitz_lower",
    "jacobian_operator_norm",
    "lipschitz_lower",
    "network_lipschitz_lower",
    "perturbation_lower",
    "stage_functions",
]

Fn = Callable[[Tensor, list | None], Tensor]  # (X (B,T,d), tracker) -> (B,T,d)


@dataclass(frozen=True)
class LowerEstimate:
    """An empirical lower bound with how it was found (Note [witnesses])."""

    value: Quantity
    n_starts: int
    n_steps: int
    method: str = "power iteration + projected Adam ascent over input pairs"

    def to_dict(self) -> dict[str, object]:
        return {"value": self.value.to_dict(), "n_starts": self.n_starts, "n_steps": self.n_steps,
                "method": self.method}


def _metric_norm(Y: Tensor, metric: str) -> Tensor:
    """Per batch element: max_t ||y_t||_2 for (2,inf), ||Y||_F for fro."""
    if metric == "2,inf":
        return Y.norm(dim=-1).amax(dim=-1)
    return Y.flatten(-2).norm(dim=-1)


# -- forward passes that record LayerNorm input spreads -------------------------------------------
def _record_spread(track: list, n: NormSpec, X: Tensor) -> None:
    """Append the smallest spread (std for LayerNorm, RMS for RMSNorm) of ``n``'s input rows."""
    if n.kind is NormKind.LAYERNORM:
        track.append(X.std(dim=-1, unbiased=False).amin(dim=-1))
    elif n.kind is NormKind.RMSNORM:
        track.append(X.pow(2).mean(-1).sqrt().amin(dim=-1))


def _tracking(track: list | None) -> ForwardHooks | None:
    """Hooks for the model's forward pass that record every LayerNorm/RMSNorm input's smallest
    spread into ``track`` (the normalisations themselves are left as they are)."""
    if track is None:
        return None
    return ForwardHooks(on_norm=lambda site, n, X: _record_spread(track, n, X))


def _norm_apply(n: NormSpec | None, X: Tensor, track: list | None) -> Tensor:
    if n is None:
        return X
    if track is not None:
        _record_spread(track, n, X)
    return norm_forward(n, X)


def stage_functions(spec: TransformerSpec) -> dict[tuple[int, str], Fn]:
    """The map of every stage of :func:`~transcover.lipschitz.lipschitz_bounds`'s chain, every
    layer (``(i, "layer")``) and the network (``(-2, "network")``), keyed like the chain."""
    L = spec.n_layers
    layers = list(spec.layers)  # materialise a lazy LayerSequence once, not on every forward
    out: dict[tuple[int, str], Fn] = {
        (-1, "input_norm"): lambda X, t: _norm_apply(spec.input_norm, X, t),
        (L, "final_norm"): lambda X, t: _norm_apply(spec.final_norm, X, t),
        (-2, "network"): lambda X, t: transformer_forward(spec, X, with_head=False, hooks=_tracking(t),
                                                          layers=layers),
    }
    for i, layer in enumerate(layers):
        out[(i, "layer")] = lambda X, t, lay=layer: layer_forward(lay, X, hooks=_tracking(t))
        if layer.residual.value == "parallel":  # the whole layer is the chain's one stage (F21)
            out[(i, "parallel")] = out[(i, "layer")]
        elif layer.placement is Placement.POST:
            out[(i, "attention")] = lambda X, t, lay=layer: X + attention_forward(lay.attention, X)
            out[(i, "norm_attn")] = lambda X, t, lay=layer: _norm_apply(lay.norm_attn, X, t)
            out[(i, "ffn")] = lambda X, t, lay=layer: X + ffn_forward(lay.ffn, X)
            out[(i, "norm_ffn")] = lambda X, t, lay=layer: _norm_apply(lay.norm_ffn, X, t)
        else:  # a branch-output norm (Gemma 2/3, OLMo 2; F26) is part of its residual stage
            out[(i, "attention")] = lambda X, t, lay=layer: X + _norm_apply(lay.post_norm_attn, attention_forward(
                lay.attention, _norm_apply(lay.norm_attn, X, t)), t)
            out[(i, "ffn")] = lambda X, t, lay=layer: X + _norm_apply(
                lay.post_norm_ffn, ffn_forward(lay.ffn, _norm_apply(lay.norm_ffn, X, t)), t)
    return out


# -- domain ----------------------------------------------------------------------------------
def _project(X: Tensor, radius: float) -> Tensor:
    """Scale every row into the closed ball of radius R (a hair inside, so rounding cannot leave it)."""
    n = X.norm(dim=-1, keepdim=True)
    return X * torch.clamp(radius * (1.0 - 1e-12) / torch.clamp(n, min=1e-300), max=1.0)


def _valid(track: list, sigma_min: float, B: int) -> Tensor:
    ok = torch.ones(B, dtype=torch.bool)
    if sigma_min > 0:
        for s in track:
            ok &= s >= sigma_min
    return ok


def _random_inputs(g: torch.Generator, n: int, T: int, d: int, radius: float) -> Tensor:
    X = torch.randn(n, T, d, generator=g, dtype=torch.float64)
    # Rows at norm R (where attention's constant grows, F6) for most tokens, smaller for some.
    scale = torch.where(torch.rand(n, T, 1, generator=g, dtype=torch.float64) < 0.7, 1.0,
                        torch.rand(n, T, 1, generator=g, dtype=torch.float64))
    return X / X.norm(dim=-1, keepdim=True) * radius * scale * (1.0 - 1e-9)


# -- Jacobian power iteration --------------------------------------------------------------------
def jacobian_operator_norm(fn: Callable[[Tensor], Tensor], X: Tensor, *, metric: str = "fro",
                           n_iter: int = 20, seed: int = 0) -> tuple[float, Tensor]:
    r"""Local operator norm of the Jacobian of ``fn`` at ``X`` (T, d): a lower estimate.

    .. math::

        \|J\|_{F\to F} = \sigma_{\max}(J) \quad\text{(power iteration on } J^\top J\text{)},\qquad
        \|J\|_{(2,\infty)} = \max_t \max_{\|v_s\| \le 1} \Big\|\sum_s J_{ts} v_s\Big\|

    The ``(2,inf)`` norm is computed by alternating maximisation (each step cannot decrease it).
    Every iterate is a value ``||J V|| / ||V||`` actually attained, hence a lower bound on the
    local constant, which is at most the Lipschitz constant on any domain containing a
    neighbourhood of X.

    Returns:
        (estimate, direction V of shape (T, d)).
    """
    # Note [one forward graph]: the double-backward jvp of torch.autograd.functional, on one forward graph.  The
    # forward (and the first backward, J^T w0 as a function of a zero w0) are built once; each step is then one
    # backward of that backward (J V, linear in w0 and so independent of its value) and one plain backward (the
    # pullback): the same operations on the same saved tensors as functional.jvp / vjp make anew per step, so
    # the same floats (checked in tests/lipschitz/test_lipschitz_power_graph.py), at about a third of the passes.
    # (torch.func's forward mode would load TorchScript decompositions that warn on this torch version.)
    X = X.detach().double().requires_grad_(True)
    g = torch.Generator().manual_seed(seed)
    V = torch.randn(X.shape, generator=g, dtype=torch.float64)
    with torch.enable_grad():
        Y = fn(X)
        w0 = torch.zeros_like(Y, requires_grad=True)
        gX = torch.autograd.grad(Y, X, w0, create_graph=True, allow_unused=True)[0] if Y.requires_grad else None

    def jvp(V: Tensor) -> Tensor:
        if gX is None or not gX.requires_grad:  # fn does not depend on X: J = 0
            return torch.zeros_like(Y)
        (JV,) = torch.autograd.grad(gX, w0, V, retain_graph=True, allow_unused=True)
        return torch.zeros_like(Y) if JV is None else JV

    def pullback(w: Tensor) -> Tensor:
        if not Y.requires_grad:
            return torch.zeros_like(X)
        (G,) = torch.autograd.grad(Y, X, w, retain_graph=True, allow_unused=True)
        return torch.zeros_like(X) if G is None else G

    best = 0.0
    if metric == "fro":
        V = V / V.norm()
        for _ in range(n_iter):
            JV = jvp(V)
            best = max(best, float(JV.norm()))
            V = pullback(JV)
            nv = V.norm()
            if nv == 0:
                break
            V = V / nv
        return best, V
    V = V / V.norm(dim=-1, keepdim=True)
    for _ in range(n_iter):
        JV = jvp(V)
        rows = JV.norm(dim=-1)
        t = int(rows.argmax())
        best = max(best, float(rows[t]))
        w = torch.zeros_like(JV)
        w[t] = JV[t] / max(float(rows[t]), 1e-300)
        G = pullback(w)
        V = G / torch.clamp(G.norm(dim=-1, keepdim=True), min=1e-300)
    return best, V


# -- ascent ---------------------------------------------------------------------------------------
def _ascent(fn: Fn, X0: Tensor, D0: Tensor, *, radius: float, metric: str, sigma_min: float,
            n_steps: int, lr: float, project_extra: Callable[[Tensor], Tensor] | None,
            min_step: float = 1e-6) -> float:
    """Best valid ratio ||f(X+D) - f(X)|| / ||D|| over projected Adam steps (Note [witnesses])."""
    def proj(Z: Tensor) -> Tensor:
        Z = _project(Z, radius)
        return project_extra(Z) if project_extra is not None else Z

    X = proj(X0.clone()).requires_grad_(True)
    D = D0.clone().requires_grad_(True)
    opt = torch.optim.Adam([X, D], lr=lr * radius)
    best = 0.0
    min_step = min_step * radius
    for step in range(n_steps + 1):
        with torch.no_grad():  # keep both points in the domain, D not vanishing
            X.copy_(proj(X))
            D.copy_(proj(X + D) - X)
            dn = _metric_norm(D, metric)[:, None, None]
            small = dn < min_step
            if bool(small.any()):
                D.copy_(torch.where(small, D / torch.clamp(dn, min=1e-300) * min_step, D))
                D.copy_(proj(X + D) - X)
        t0: list = []
        t1: list = []
        Y0 = fn(X, t0)
        Y1 = fn(X + D, t1)
        ratio = _metric_norm(Y1 - Y0, metric) / _metric_norm(D, metric)
        with torch.no_grad():
            ok = _valid(t0, sigma_min, X.shape[0]) & _valid(t1, sigma_min, X.shape[0]) & torch.isfinite(ratio)
            ok &= _metric_norm(D, metric) > 0
            # both points in the ball as evaluated: an extra projection (the variance floor) can move rows out of it
            ok &= (X.norm(dim=-1).amax(-1) <= radius) & ((X + D).norm(dim=-1).amax(-1) <= radius)
            if bool(ok.any()):
                best = max(best, float(ratio[ok].max()))
        if step == n_steps:
            break
        opt.zero_grad()
        (-ratio[torch.isfinite(ratio)].sum()).backward()
        opt.step()
    return best


def _lower(fn: Fn, *, T: int, d: int, radius: float, metric: str, sigma_min: float, n_samples: int,
           n_steps: int, seed: int, lr: float = 0.02, n_power: int = 15,
           project_extra: Callable[[Tensor], Tensor] | None = None,
           extra_starts: Tensor | None = None, step0: float = 1e-3, min_step: float = 1e-6) -> float:
    """Best witness ratio from ``n_samples`` random starts (+ ``extra_starts``); ``step0`` and
    ``min_step`` are the initial and smallest pair distances as fractions of the radius."""
    g = torch.Generator().manual_seed(seed)
    X0 = _random_inputs(g, n_samples, T, d, radius)
    if extra_starts is not None:
        X0 = torch.cat([X0, extra_starts.double()], dim=0)
    if project_extra is not None:
        X0 = project_extra(X0)
    dirs = []
    for k in range(X0.shape[0]):
        _, V = jacobian_operator_norm(lambda Z: fn(Z[None], None)[0], X0[k], metric=metric,
                                      n_iter=n_power, seed=seed + k)
        dirs.append(V)
    V = torch.stack(dirs)
    D0 = V / _metric_norm(V, metric)[:, None, None].clamp(min=1e-300) * (step0 * radius)
    return _ascent(fn, X0, D0, radius=radius, metric=metric, sigma_min=sigma_min, n_steps=n_steps,
                   lr=lr, project_extra=project_extra, min_step=min_step)


def _check_sizes(n_samples: int, n_steps: int, seq_len: int) -> None:
    for name, v, lo in (("n_samples", n_samples, 1), ("n_steps", n_steps, 0), ("seq_len", seq_len, 1)):
        if not isinstance(v, int) or v < lo:
            raise InputError(f"{name} must be an integer >= {lo}, but got {name}={v!r}")


def _quantity(value: float, what: str, metric: str, radius: float, sigma_min: float) -> Quantity:
    assumptions = (f"witness inputs with token norms <= {radius:g}", f"metric {metric}")
    if sigma_min > 0:
        assumptions += (f"witnesses keep every LayerNorm input std >= {sigma_min:g}",)
    return Quantity(value, Kind.EMPIRICAL_LOWER, what, assumptions)


def function_lipschitz_lower(fn: Callable[[Tensor], Tensor], *, seq_len: int, d_model: int, radius: float,
                             metric: str = "2,inf", n_samples: int = 8, n_steps: int = 40,
                             seed: int = 0) -> LowerEstimate:
    """Empirical lower bound on the Lipschitz constant of any sequence map ``fn`` ((B,T,d) -> (B,T,d'))
    on token norms <= radius (Note [witnesses]).

    Raises:
        InputError: non-positive radius, n_samples or seq_len; bad metric.
    """
    check_radius(radius)
    _check_sizes(n_samples, n_steps, seq_len)
    if metric not in ("2,inf", "fro"):
        raise InputError(f"metric must be '2,inf' or 'fro', but got metric={metric!r}")
    v = _lower(lambda X, t: fn(X), T=seq_len, d=d_model, radius=radius, metric=metric, sigma_min=0.0,
               n_samples=n_samples, n_steps=n_steps, seed=seed)
    return LowerEstimate(_quantity(v, "sequence map", metric, radius, 0.0), n_samples, n_steps)


def network_lipschitz_lower(spec: TransformerSpec, *, radius: float = 1.0, metric: str = "2,inf",
                            seq_len: int = 8, sigma_min: float = 0.0, n_samples: int = 8,
                            n_steps: int = 40, seed: int = 0) -> LowerEstimate:
    """Empirical lower bound on the input-Lipschitz constant of ``g_L`` on token norms <= radius.

    Raises:
        InputError: non-positive radius, n_samples, seq_len or negative n_steps.
    """
    check_radius(radius)
    _check_sizes(n_samples, n_steps, seq_len)
    check_sequence_length(spec, seq_len, "seq_len")  # a lower at T beside bounds for <= T (189)
    fn = stage_functions(spec)[(-2, "network")]
    v = _lower(fn, T=seq_len, d=spec.d_model, radius=radius, metric=metric, sigma_min=sigma_min,
               n_samples=n_samples, n_steps=n_steps, seed=seed)
    return LowerEstimate(_quantity(v, "network g_L", metric, radius, sigma_min), n_samples, n_steps)


def _sigma_floor_projection(sigma_min: float, radius: float = math.inf) -> Callable[[Tensor], Tensor]:
    """Rows onto ``{std >= sigma_min}`` (the centred part stretched), then their mean shrunk so that they stay in the
    ball of ``radius`` (``||mu 1 + c||^2 = d mu^2 + ||c||^2`` for a centred ``c``; red team 218: stretched after the
    ball's projection, witnesses left the ball).  A row whose centred part alone is outside (the floor above
    ``radius / sqrt(d)``: no such input) stays outside, and ``_ascent`` does not count it."""
    def proj(Z: Tensor) -> Tensor:
        mu = Z.mean(-1, keepdim=True)
        s = Z.std(-1, unbiased=False, keepdim=True)
        C = (Z - mu) * torch.clamp(sigma_min * (1 + 1e-9) / torch.clamp(s, min=1e-300), min=1.0)
        room = torch.clamp((radius * (1 - 1e-12)) ** 2 - C.pow(2).sum(-1, keepdim=True), min=0.0)
        m = (room / Z.shape[-1]).sqrt()
        return torch.maximum(torch.minimum(mu, m), -m) + C
    return proj


def lipschitz_lower(spec: TransformerSpec, bounds, *, metric: str | None = None, seq_len: int = 8,
                    n_samples: int = 6, n_steps: int = 30, seed: int = 0,
                    stages: bool = True) -> dict[tuple[int, str], LowerEstimate]:
    """Empirical lower estimates for every stage, layer and the network of a bound's chain.

    Each stage is searched on *its own certified domain*: token norms <= the stage's propagated
    input radius from ``bounds`` (a :class:`~transcover.lipschitz.NetworkLipschitz`), so every
    lower value is comparable with the stage's certified upper value.  Layers are searched on
    their first stage's radius, the network on ``bounds.radius``.  A LayerNorm stage with a
    variance floor is searched on ``{std >= sigma_0}`` (its certified constant does not depend on
    the radius; Note [LayerNorm on a variance floor] in ``_normalisation``).

    Returns:
        ``{(layer, name): LowerEstimate}`` with names as in ``bounds.stages``, plus
        ``(i, "layer")`` and ``(-2, "network")``; none for a stage whose domain is empty (``EMPTY DOMAIN`` among the
        upper's assumptions: no witness exists), for its layer or for the network.

    Raises:
        CertificateViolation: a lower estimate above its certified upper value (searched in the
            bound's own metric): a false certificate, never returned as a result.
    """
    _check_sizes(n_samples, n_steps, seq_len)
    check_sequence_length(spec, seq_len, "seq_len")  # a lower at T beside bounds for <= T (189)
    metric = metric or bounds.metric
    if bounds.seq_len is not None:  # Frobenius and L2-attention bounds are for that length only
        seq_len = bounds.seq_len
    sig = bounds.sigma_min
    fns = stage_functions(spec)
    # a stage whose domain is empty (EMPTY DOMAIN beside the upper) has no witness: no lower for it, for its layer,
    # or for the network, whose domain it empties (red team 218: a lower 2.0 from witnesses outside the radius)
    empty = {(st.layer, st.name) for st in empty_domain_stages(spec, bounds.stages, sig)}
    out: dict[tuple[int, str], LowerEstimate] = {}
    layer_radius = {}
    for k, st in enumerate(bounds.stages):
        layer_radius.setdefault(st.layer, st.radius_in)
        key = (st.layer, st.name)
        if not stages or key not in fns or key in empty:
            continue
        norm = _stage_norm(spec, st)
        extra = _sigma_floor_projection(sig, st.radius_in) if (norm is not None and sig > 0
                                                               and norm.kind is NormKind.LAYERNORM) else None
        common = dict(T=seq_len, d=spec.d_model, radius=st.radius_in, metric=metric, n_steps=n_steps,
                      seed=seed + 17 * k, project_extra=extra, sigma_min=sig)
        v = _lower(fns[key], n_samples=n_samples, **common)
        if norm is not None and norm.kind in (NormKind.LAYERNORM, NormKind.RMSNORM):
            # Note [LayerNorm witnesses]: the constant max|gamma|/sqrt(sigma_0^2 + eps) is approached
            # at inputs whose spread sits at the floor (sigma_0, or sqrt(eps) without one), with pair
            # distances well below that spread; random points in a large ball never get there.
            spread = sig * (1 + 1e-6) if sig > 0 else max(math.sqrt(norm.eps), 1e-7)
            starts = _spread_starts(seed + k, seq_len, spec.d_model, spread, st.radius_in,
                                    centred=norm.kind is NormKind.LAYERNORM)
            step = 1e-3 * spread * math.sqrt(spec.d_model) / st.radius_in
            v = max(v, _lower(fns[key], n_samples=1, extra_starts=starts, step0=step, min_step=step / 10,
                              lr=step, **common))
        out[key] = LowerEstimate(_quantity(v, f"stage {st.name} of layer {st.layer}", metric,
                                           st.radius_in, sig), n_samples, n_steps)
    for i in range(spec.n_layers):
        if any(layer == i for layer, _ in empty):
            continue
        v = _lower(fns[(i, "layer")], T=seq_len, d=spec.d_model, radius=layer_radius[i], metric=metric,
                   sigma_min=sig, n_samples=n_samples, n_steps=n_steps, seed=seed + 1000 + i)
        out[(i, "layer")] = LowerEstimate(_quantity(v, f"layer {i}", metric, layer_radius[i], sig),
                                          n_samples, n_steps)
    if not empty:
        out[(-2, "network")] = network_lipschitz_lower(spec, radius=bounds.radius, metric=metric,
                                                       seq_len=seq_len, sigma_min=sig, n_samples=n_samples,
                                                       n_steps=n_steps, seed=seed + 5000)
    if metric == bounds.metric:
        _check_against(bounds, out)
    return out


def _check_against(bounds, lower: dict[tuple[int, str], LowerEstimate]) -> None:  # noqa: ANN001
    """Every lower estimate <= its certified upper value, or CertificateViolation (Note [certificate check])."""
    pad = 1.0 + ROUNDING_PAD
    uppers = {(s.layer, s.name): s.lipschitz * pad for s in bounds.stages}
    uppers.update({(i, "layer"): bounds.layer_upper(i).value for i in range(bounds.n_layers)})
    uppers[(-2, "network")] = bounds.upper.value
    for key, est in lower.items():
        if key in uppers:
            what = "network g_L" if key[0] == -2 else f"{key[1]} of layer {key[0]}"
            check_certified(f"Lipschitz constant of {what} ({bounds.metric})", uppers[key], est.value.value)


def _spread_starts(seed: int, T: int, d: int, spread: float, radius: float, *, centred: bool) -> Tensor:
    """Rows whose standard deviation (LayerNorm) or root mean square (RMSNorm) equals ``spread``."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2, T, d, generator=g, dtype=torch.float64)
    if centred:
        z = z - z.mean(-1, keepdim=True)
    z = z / z.pow(2).mean(-1, keepdim=True).sqrt() * spread
    if centred:  # a common offset leaves the spread alone and stays inside the ball
        room = max(radius * (1 - 1e-6) - float(z.norm(dim=-1).max()), 0.0)
        z = z + 0.5 * room / math.sqrt(d) * torch.randn(2, T, 1, generator=g, dtype=torch.float64).clamp(-1, 1)
    return z


def _stage_norm(spec: TransformerSpec, st) -> NormSpec | None:
    if st.name == "input_norm":
        return spec.input_norm
    if st.name == "final_norm":
        return spec.final_norm
    if st.name in ("norm_attn", "norm_ffn"):
        return getattr(spec.layers[st.layer], st.name)
    return None


def perturbation_lower(spec_a: TransformerSpec, spec_b: TransformerSpec, *, radius: float = 1.0,
                       metric: str = "2,inf", seq_len: int = 8, sigma_min: float = 0.0,
                       n_samples: int = 8, n_steps: int = 40, seed: int = 0, lr: float = 0.02) -> LowerEstimate:
    """Empirical lower bound on ``sup_X ||g_L(W_a)(X) - g_L(W_b)(X)||`` over token norms <= radius.

    Random inputs in the domain, then projected Adam ascent on X (Note [witnesses]).

    Raises:
        InputError: non-positive radius, n_samples or seq_len; different d_model.
    """
    check_radius(radius)
    _check_sizes(n_samples, n_steps, seq_len)
    check_sequence_length(spec_a, seq_len, "seq_len", spec_b)  # a lower at T beside bounds for <= T (189, 197)
    if spec_a.d_model != spec_b.d_model:
        raise InputError(f"the two models have different d_model: {spec_a.d_model} vs {spec_b.d_model}")
    fa = stage_functions(spec_a)[(-2, "network")]
    fb = stage_functions(spec_b)[(-2, "network")]
    g = torch.Generator().manual_seed(seed)
    X = _random_inputs(g, n_samples, seq_len, spec_a.d_model, radius)
    # Half the starts repeat one token at norm R: attention then averages identical rows, where
    # the fixed-input terms of G.3 (R ||dW_OV||, ...) are attained and which random rows,
    # pointing every way, rarely approach.
    k = n_samples // 2
    if k:
        X[:k] = X[:k, :1] / X[:k, :1].norm(dim=-1, keepdim=True) * radius * (1.0 - 1e-9)
    X.requires_grad_(True)
    opt = torch.optim.Adam([X], lr=lr * radius)
    best = 0.0
    for step in range(n_steps + 1):
        with torch.no_grad():
            X.copy_(_project(X, radius))
        ta: list = []
        tb: list = []
        gap = _metric_norm(fa(X, ta) - fb(X, tb), metric)
        with torch.no_grad():
            ok = _valid(ta, sigma_min, n_samples) & _valid(tb, sigma_min, n_samples) & torch.isfinite(gap)
            if bool(ok.any()):
                best = max(best, float(gap[ok].max()))
        if step == n_steps:
            break
        opt.zero_grad()
        (-gap.sum()).backward()
        opt.step()
    q = _quantity(best, "output change between the two models", metric, radius, sigma_min)
    return LowerEstimate(q, n_samples, n_steps, "projected Adam ascent over inputs")
