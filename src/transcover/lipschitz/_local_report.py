"""Tables of local certified constants at real data beside global and domain ones (issue 12).

For every layer and component: the global certified constant (token norms <= R, no variance
floor), the domain constant (LayerNorm inputs with std >= sigma_0, the smallest certified floor
seen on the data balls), the local constant on ``B(X, rho)`` (max over the sequences), and an
empirical lower estimate at the same points: the (2,inf) norm of the Jacobian at the data point
(power iteration, ``jacobian_operator_norm``), a value the local Lipschitz constant on any ball
around the point attains in the limit, and, when asked (``ball``), the larger ball lower estimate
(``_local_lower.ball_lower``: Jacobian-norm ascent over centres and pair-ratio ascent inside each
component's certified ball), the point value kept beside it.  Every row is checked with
``check_certified``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from .._results import check_certified
from ..model import attention_forward, ffn_forward, layer_forward
from ..model import NormKind, Placement, TransformerSpec
from ._compose import compose
from ._empirical import jacobian_operator_norm
from ._local import layer_local, nan_as_inf
from ._rounding import pow2_norm
from ._weights import spec_norms

__all__ = ["LocalRow", "local_table", "assemble_local_rows"]


@dataclass
class LocalRow:
    rho_factor: float
    layer: int
    component: str
    global_upper: float
    domain_upper: float
    local_upper: float
    lower: float
    point_upper: float = math.nan  # Jacobian route at the point (layers only)
    point_lower: float = math.nan  # the point lower estimate when ``lower`` is the ball one (else NaN)
    # the components whose global constant (on a domain holding their ball) replaced a larger local one in
    # ``local_upper``, at the sequence that gives the max: "ffn, norm_ffn"; "" for none (Note [global on a
    # component's ball] in ``_local``)
    local_from_global: str = ""

    @property
    def ratio(self) -> float:
        # no lower searched (NaN, ``--no-lower``): no ratio either, not an infinite one
        if math.isnan(self.lower):
            return math.nan
        return self.local_upper / self.lower if self.lower > 0 else math.inf

    def to_dict(self) -> dict:
        return {"rho_factor": self.rho_factor, "layer": self.layer, "component": self.component,
                "global_upper": self.global_upper, "domain_upper": self.domain_upper,
                "local_upper": self.local_upper, "point_upper": self.point_upper, "lower": self.lower,
                "ratio": self.ratio, **({} if math.isnan(self.point_lower) else {"point_lower": self.point_lower}),
                "local_from_global": self.local_from_global}


# the stage functions' input balls among ``LayerLocal.radii`` (pre-LN stages start at the norm before them)
_STAGE_BALL = {Placement.POST: {n: n for n in ("attention", "norm_attn", "ffn", "norm_ffn")},
               Placement.PRE: {"attention": "norm_attn", "ffn": "norm_ffn"}}



def _relative_rho(f: float, norms, layer: int | None, seq: int | None) -> float:  # noqa: ANN001  (a tensor)
    """``f`` times the median token norm, or one line naming the zero median (red team 174: mostly zero-padded
    embeddings gave rho = 0, refused as "rho must be > 0, but got rho=0.0" while the user had asked for 1e-3)."""
    from .._errors import InputError

    median = float(norms.median())
    if not median > 0:
        where = ("the network's input" if layer is None else f"layer {layer}'s input") + \
            ("" if seq is None else f" of sequence {seq}")
        raise InputError(f"--rho-relative: the median token norm of {where} is {median:g}, so rho = {f:g} x median "
                         "is no ball; give an absolute rho, or data without all-zero tokens")
    return f * median

def stage_functions(layer):  # noqa: ANN001, ANN202
    """The maps the chain's stages compute, named like ``compose``'s stages."""
    if layer.placement is Placement.POST:
        return {"attention": lambda X: X + attention_forward(layer.attention, X),
                "norm_attn": lambda X: layer.norm_attn(X),
                "ffn": lambda X: X + ffn_forward(layer.ffn, X),
                "norm_ffn": lambda X: layer.norm_ffn(X)}
    return {"attention": lambda X: X + attention_forward(layer.attention, layer.norm_attn(X)),
            "ffn": lambda X: X + ffn_forward(layer.ffn, layer.norm_ffn(X))}


def stage_local_constants(ll, placement: Placement) -> dict[str, float]:  # noqa: ANN001
    c = ll.components
    if not c:  # no finite certificate at this radius (layer_local's _Unbounded): every stage inf, not a KeyError
        names = ("attention", "norm_attn", "ffn", "norm_ffn") if placement is Placement.POST else ("attention", "ffn")
        return dict.fromkeys(names, math.inf)
    if placement is Placement.POST:
        return {"attention": 1 + c["attention"], "norm_attn": c["norm_attn"], "ffn": c.get("ffn_residual", 1 + c["ffn"]),
                "norm_ffn": c["norm_ffn"]}
    return {"attention": 1 + c["attention"] * c["norm_attn"], "ffn": 1 + c["ffn"] * c["norm_ffn"]}


def stage_global_parts(ll, placement: Placement) -> dict[str, str]:  # noqa: ANN001
    """Per stage of :func:`stage_local_constants` (and "layer"), the components of ``ll`` behind it that took their
    global constant (``LayerLocal.global_parts``), as the row's ``local_from_global`` text."""
    parts = {"attention": ("attention",), "norm_attn": ("norm_attn",), "ffn": ("ffn",), "norm_ffn": ("norm_ffn",)}
    if placement is not Placement.POST:
        parts = {"attention": ("norm_attn", "attention"), "ffn": ("norm_ffn", "ffn")}
    parts["layer"] = tuple(c for v in parts.values() for c in v)
    return {k: ", ".join(c for c in v if c in ll.global_parts) for k, v in parts.items()}


def local_table(spec: TransformerSpec, seqs: list, rho_factors: list[float], *, lower_iter: int = 15,
                jacobian: bool = True, lower: bool = True, relative: bool = True,
                timings: dict | None = None, whole: str | None = None, ball: dict | None = None,
                ball_components: bool = False, move_rest: bool = False) -> list[LocalRow]:
    """Per-layer and per-component rows for every ``rho`` (a factor of each stage's median token
    norm when ``relative``, else absolute), max over the sequences (each layer's ball is centred at
    the data's hidden states, the layer's input on the data path).  ``whole`` (a ``network_local``
    route): also one whole-network row per rho (layer -1, component ``network (<route that won>)``; ``move_rest``: the
    stack route's THEORY F77 switch, ``stack_local(move_rest=)``).
    ``ball`` (keyword arguments of ``ball_lower``): the lower estimate of the layers' rows (and of the
    components' with ``ball_components``, each on its certified input ball ``LayerLocal.radii``) is
    the larger of the point one and ``ball_lower`` on the same ball, max over the sequences; the
    point value stays in ``point_lower``."""
    from .._errors import InputError
    from ._local_attention import check_tokens

    from ._local import check_rho

    # a factor 0 was certified per layer while the network row refused it (stop 39's list): a ball needs rho > 0
    rho_factors = [check_rho(f) for f in rho_factors]
    seqs = list(seqs)  # a generator, or one (n, T, d) tensor read as its n sequences
    if not seqs:
        raise InputError("no sequences to certify at (the data is empty)")
    for X in seqs:
        check_tokens(X, spec.d_model, "a sequence")
    layers = list(spec.layers)
    points = [spec.input_norm(X.double()) if spec.input_norm is not None else X.double() for X in seqs]
    stage_inputs: list[list[dict]] = []  # per layer, per sequence: stage name -> its input
    for layer in layers:
        per = []
        for k, X in enumerate(points):
            ins = {"layer": X}
            if layer.placement is Placement.POST:
                ins["attention"] = X
                X1 = X + attention_forward(layer.attention, X)
                ins["norm_attn"] = X1
                H = layer.norm_attn(X1)
                ins["ffn"] = H
                ins["norm_ffn"] = H + ffn_forward(layer.ffn, H)
            else:
                ins["attention"] = X
                ins["ffn"] = X + attention_forward(layer.attention, layer.norm_attn(X))
            per.append(ins)
            points[k] = layer_forward(layer, X).detach()
        stage_inputs.append(per)
    # the global column's domain must hold every token: any radius >= the largest norm serves, and all-zero data
    # (norm 0, which no radius check accepts) takes the smallest normal float
    R = max(max(float(pow2_norm(X, 1).max()) for X in seqs), 2.0**-1022)
    norms = spec_norms(spec)
    glob = compose(norms, radius=R)
    lows: dict[tuple[int, str], float] = {}
    if lower:
        for i, layer in enumerate(layers):
            fns = {"layer": (lambda lay: (lambda X: layer_forward(lay, X)))(layer), **stage_functions(layer)}
            for name, fn in fns.items():
                lows[(i, name)] = max(jacobian_operator_norm(fn, ins[name], metric="2,inf", n_iter=lower_iter)[0]
                                      for ins in stage_inputs[i])
    rows: list[LocalRow] = []
    # the global column's class bounds serve layer_local's global components (Note [global on a component's ball])
    cache: dict = {("bounds", layer.index): L for layer, L in zip(layers, norms.layers)}
    witnesses: dict = {}  # (layer, stage, sequence) -> the point witness and the last ball's BallLower
    # the float32 shadow of every layer the ball searches run on: it measures their pairs' float64 error (Note [pair
    # allowance], red team 218); converted one layer at a time where it is used
    shadow = replace(spec, layers=layers).to_torch(torch.float32) if lower and ball is not None else None
    for f in rho_factors:
        best: dict[tuple[int, str], float] = {}
        took: dict[tuple[int, str], str] = {}  # the local_from_global text at the sequence of the max
        point: dict[int, float] = {}
        balls: dict[tuple[int, str], float] = {}
        sig0 = math.inf
        for i, layer in enumerate(layers):
            t0 = time.perf_counter()
            for k, ins in enumerate(stage_inputs[i]):
                X = ins["layer"]
                rho = _relative_rho(f, pow2_norm(X, 1), i, k) if relative else f
                ll = layer_local(layer, X, rho, cache=cache, jacobian=jacobian)
                sig0 = min(sig0, ll.min_sigma)
                parts = stage_global_parts(ll, layer.placement)
                for name, v in {**stage_local_constants(ll, layer.placement), "layer": ll.upper}.items():
                    keep_max(best, took, (i, name), v, parts[name])
                point[i] = max(point.get(i, 0.0), nan_as_inf(ll.jacobian_point))
                if lower and ball is not None:
                    t1 = time.perf_counter()
                    names = ["layer", *(stage_functions(layer) if ball_components else ())]
                    layer32 = shadow.layers[i]
                    for name in names:
                        r = rho if name == "layer" else ll.radii[_STAGE_BALL[layer.placement][name]]
                        v = _ball_lower_at(layer, name, ins[name], r, ball, witnesses, (i, name, k), layer32)
                        balls[(i, name)] = max(balls.get((i, name), 0.0), v)
                    if timings is not None:
                        key = (f, i, "ball_lower")
                        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t1
            if timings is not None:
                timings[(f, i)] = time.perf_counter() - t0 - timings.get((f, i, "ball_lower"), 0.0)
        dom = compose(norms, radius=R, sigma_min=max(sig0, 0.0)) if math.isfinite(sig0) else glob
        rows += assemble_local_rows(f, best, point, lows, glob, dom, lower=lower, ball_lows=balls or None, took=took)
        if whole is not None:
            rows.append(_network_row(spec, seqs, f, relative, whole, glob, (norms, R, sig0), lower, cache, move_rest))
    return rows


def keep_max(best: dict, took: dict, key: tuple, v: float, parts: str) -> None:
    """``best[key]`` the max over the sequences so far (NaN read as inf: no bound) and ``took[key]`` the
    ``local_from_global`` text of the first sequence that gives it (``local_table`` and ``transcover.scale``'s merge
    alike, in the same order)."""
    v = nan_as_inf(v)
    if key not in best or v > best[key]:
        best[key], took[key] = v, parts


def _network_row(spec, seqs, f, relative, whole, glob, domain, lower, cache,  # noqa: ANN001
                 move_rest=False) -> LocalRow:
    """The whole network on the balls around the embedded sequences (``network_local``, THEORY F30):
    max over sequences; the lower estimate is ``stack_lower`` at the same points.

    ``domain = (norms, R, sigma_0)``: the domain column's floor must hold for every norm the network applies on its
    balls. The layers' floors (``sigma_0``) do not cover the input norm, whose floor on the network's input balls is
    taken here (``norm_local``); on a toy BERT's text it was 0.034 against the layers' floors, and the column read 1.35
    beside an empirical lower of 30.3 (stop 38 red team). A final norm's inputs have no ball certified here: with
    one, the column is not reported (nan)."""
    from ._local import ball_radius, network_local, norm_local, variance_floor
    from ._local_stack import stack_lower

    norms, R, sig0 = domain
    up, lo, routes, took = 0.0, 0.0, set(), ""
    for X in seqs:
        norms_t = pow2_norm(X.double(), 1)
        rho = _relative_rho(f, norms_t, None, None) if relative else f
        n_in = spec.input_norm
        if n_in is not None and n_in.kind in (NormKind.LAYERNORM, NormKind.RMSNORM):
            _, s_in = norm_local(n_in, X.double(), rho)
            sig0 = min(sig0, float(variance_floor(n_in, s_in).min()))
        nl = network_local(spec, X, rho, cache=cache, route=whole, move_rest=move_rest, keep_jacobian=lower)
        # Note [global on the ball] (THEORY F104): every token of B(X, rho) has norm <= max_t ||X_t|| + rho, so the
        # global chain (THEORY F8) at that radius is a certified bound on the ball too; it wins where the local
        # routes' radii compound past it (a Pi_norm model at rho = 0.1: 1e72 against 1785)
        g = compose(norms, radius=ball_radius(X, rho)).upper.value
        here, route = (g, "global") if g < nl.upper else (nl.upper, nl.route)
        if here > up or not routes:  # the product route's global components at the sequence of the max
            took = ", ".join(nl.global_parts) if route == "product" else ""
        up, routes = max(up, here), routes | {route}
        if lower:  # the stack route's Jacobian blocks where it ran; else autograd's (not the stack machinery again)
            blocks, err = nl.jacobian if nl.jacobian is not None else (None, 0.0)
            lo = max(lo, stack_lower(spec, X, rho, restarts=2, steps=10, blocks=blocks, blocks_err=err,
                                     form_blocks=False))
    if lower:
        check_certified("local Lipschitz constant of the whole network", up, lo)
    final = spec.final_norm is not None and spec.final_norm.kind in (NormKind.LAYERNORM, NormKind.RMSNORM)
    dom = (math.nan if final or not math.isfinite(sig0)
           else compose(norms, radius=R, sigma_min=max(sig0, 0.0)).upper.value)
    return LocalRow(f, -1, f"network ({'/'.join(sorted(routes))})", glob.upper.value, dom, up,
                    lo if lower else math.nan, local_from_global=took)


def assemble_local_rows(rho_factor: float, best: dict, point: dict, lows: dict, glob, dom, *,  # noqa: ANN001
                        lower: bool, ball_lows: dict | None = None, took: dict | None = None) -> list[LocalRow]:
    """One rho's rows: each (layer, component)'s local constant (``best``, the max over sequences)
    beside the global (``glob``, radius R) and domain (``dom``, sigma >= sigma_0) constants and the
    lower estimate, which must not exceed it (``check_certified``).  Shared by :func:`local_table`
    and the per-sequence items of ``transcover.scale`` so both give the same rows.  ``ball_lows``:
    ball lower estimates of some (layer, component)s (max over sequences); their rows' ``lower`` is
    the larger of the two and ``point_lower`` the point one.  ``took``: each row's ``local_from_global`` text."""
    took = {} if took is None else took
    gstage = {(s.layer, s.name): s.lipschitz for s in glob.stages}
    dstage = {(s.layer, s.name): s.lipschitz for s in dom.stages}
    rows = []
    for (i, name), v in best.items():
        if name == "layer":
            g, dv = glob.layer_upper(i).value, dom.layer_upper(i).value
        else:
            g, dv = gstage.get((i, name), math.nan), dstage.get((i, name), math.nan)
        lo = lows.get((i, name), math.nan)
        plo = math.nan
        if lower:
            check_certified(f"local Lipschitz constant of {name} (layer {i})", v, lo)
            if ball_lows is not None and (i, name) in ball_lows:
                check_certified(f"local Lipschitz constant of {name} (layer {i}) on its ball", v, ball_lows[(i, name)])
                plo, lo = lo, max(lo, ball_lows[(i, name)]) if not math.isnan(lo) else ball_lows[(i, name)]
        rows.append(LocalRow(rho_factor, i, name, g, dv, v, lo, point.get(i, math.nan) if name == "layer" else math.nan,
                             plo, took.get((i, name), "")))
    return rows


def _stage_fn(layer, name: str):  # noqa: ANN001, ANN202
    """The map of ``layer``'s stage ``name``, or of the whole layer (``"layer"``)."""
    return (lambda Z: layer_forward(layer, Z)) if name == "layer" else stage_functions(layer)[name]


def _ball_lower_at(layer, name: str, X, rho: float, kw: dict, witnesses: dict, key: tuple,  # noqa: ANN001
                   layer32=None) -> float:  # noqa: ANN001
    """``ball_lower`` of ``layer``'s stage ``name`` (or the whole layer) on ``B(X, rho)``, started at
    the point witness of that stage and sequence (computed once) and at the best centre of the last,
    smaller ball of the same key stretched to this radius; never below that ball's value (nested
    balls).  ``layer32``: the same layer in float32, the pairs' shadow (Note [pair allowance]).
    Returns the value (empirical lower)."""
    from ._local_lower import ball_lower, point_lower

    fn = _stage_fn(layer, name)
    if not (rho > 0 and math.isfinite(rho)):
        return 0.0
    if key not in witnesses:
        witnesses[key] = (point_lower(fn, X, iters=kw.get("steps", 3) + 5, tokens=2, seed=kw.get("seed", 0)), None)
    (p, tok, V), prev = witnesses[key]
    start, floor = None, p
    if prev is not None and prev.rho <= rho:
        floor = prev.value
        if prev.method == "jacobian":
            start = X + (rho / prev.rho) * (prev.centre - X)
    shadow = None if layer32 is None else _stage_fn(layer32, name)
    r = ball_lower(fn, X, rho, token=tok, V=V, point=p, start=start, shadow=shadow, **kw)
    witnesses[key] = ((p, tok, V), r if r.value >= floor or prev is None else prev)
    return max(r.value, floor)
