"""Tables and JSON payloads of ``transcover lipschitz`` and ``transcover perturb`` (the CLI parses and
calls these; the numbers come from ``transcover.lipschitz``)."""

from __future__ import annotations

__all__ = ["lipschitz_rows", "render_lipschitz", "lipschitz_payload", "render_perturb", "perturb_payload",
           "render_local", "local_payload", "figure_bytes"]


def _fmt(x: float | None, way: str = "near") -> str:
    """4 significant digits, rounded ``way`` (Note [printed bounds]: uppers up, lowers down); "-" where there is no
    number (None, or NaN: a column not computed for the row, e.g. the network row's domain column; it printed "nan",
    red team 203)."""
    from .._printed import directed

    return "-" if x is None or x != x else directed(x, 4, way)


def lipschitz_rows(bounds, lower: dict, n_layers: int) -> list[tuple]:
    """``(kind, layer, component, input radius, certified upper, empirical lower)`` per stage, layer and
    network; the stage uppers carry the chain's rounding pad (as ``NetworkLipschitz.to_dict``)."""
    from .._results import rounding_pad

    pad = rounding_pad()  # the chain's pad (``lipschitz``'s ROUNDING_PAD), as in NetworkLipschitz.to_dict

    def low(key):
        lo = lower.get(key)
        return None if lo is None else lo.value.value

    rows = [("stage", s.layer, s.name, s.radius_in, s.lipschitz * (1 + pad), low((s.layer, s.name)))
            for s in bounds.stages]
    rows += [("layer", i, "layer", None, bounds.layer_upper(i).value, low((i, "layer"))) for i in range(n_layers)]
    rows.append(("network", -2, "network", bounds.radius, bounds.upper.value, low((-2, "network"))))
    rows.append(("network", -2, "network, worst R", bounds.radius, bounds.upper_uniform.value, low((-2, "network"))))
    return rows


def render_lipschitz(name: str, bounds, rows: list[tuple], n_layers: int) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ._fit import print_table

    console = Console()
    # the model's name is the user's text, never markup ("a[/b]" crashed rich; red team 215)
    table = Table(title=f"Lipschitz constants of {escape(str(name))} ({bounds.metric}, R={bounds.radius:g})")
    for col in ("layer", "component", "input radius", "certified upper", "empirical lower", "upper/lower"):
        table.add_column(col, justify="right" if col not in ("component",) else "left")
    for kind, layer, comp, r, up, lw in rows:
        label = {-1: "input", -2: "all", n_layers: "output"}.get(layer, str(layer))
        ratio = None if not lw else up / lw
        table.add_row(label, comp if kind != "layer" else "[bold]whole layer[/bold]", _fmt(r, "up"), _fmt(up, "up"),
                      _fmt(lw, "down"),
                      _fmt(ratio))
    print_table(console, table)
    for a in bounds.upper.assumptions:
        console.print(f"  assumption: {a}", markup=False, highlight=False)
    console.print("  upper: certified (THEORY F6/F7/F8/F14, rounding included); lower: attained by input "
                  "pairs inside the domain (each stage searched on its own certified input radius; a norm with a "
                  "floor on std >= sigma_0 instead, its constant being the same on every radius); "
                  "'network, worst R': the plain product with every stage on the largest radius")


def lipschitz_payload(spec, bounds, lower: dict, rows: list[tuple]) -> dict[str, object]:
    """The JSON body of ``transcover lipschitz`` (schema ``transcover.lipschitz`` 1)."""
    return {
        "model": spec.name, "warnings": list(spec.warnings),
        "bounds": bounds.to_dict(),
        "lower": [{"layer": k[0], "name": k[1], **v.to_dict()} for k, v in lower.items()],
        "table": [{"kind": k, "layer": layer, "component": n, "radius_in": r, "upper": up, "lower": lw,
                   "ratio": None if not lw else up / lw} for k, layer, n, r, up, lw in rows],
    }


def render_perturb(bound, metric: str, radius: float, samples: int, seq_len: int, lower: float, n_layers: int,
                   top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from .._printed import directed
    from ._fit import print_table

    up = bound.total.value
    console = Console()
    console.print(f"sup_X ||g(A)(X) - g(B)(X)||_{metric} over token norms <= {radius:g}:")
    console.print(f"  certified upper (Lemma G.3): {directed(up, 6, 'up')}")
    console.print(f"  measured lower (max over {samples} ascended inputs of {seq_len} tokens): "
                  f"{directed(lower, 6, 'down')}")
    console.print(f"  upper / lower: {up / lower:.4g}" if lower > 0 else "  upper / lower: - (no change measured)")
    per_layer = Table(title="bound per layer (sum of c_i ||dW_i||)")
    per_layer.add_column("layer", justify="right")
    per_layer.add_column("contribution", justify="right")
    for layer, c in bound.by_layer().items():
        per_layer.add_row({-1: "in", n_layers: "out"}.get(layer, str(layer)), directed(c, 4, "up"))
    print_table(console, per_layer)
    if top:
        terms = Table(title=f"largest {top} terms")
        for col in ("layer", "matrix", "norm", "c_i", "||dW_i||", "c_i ||dW_i||"):
            terms.add_column(col, justify="right" if col not in ("matrix", "norm") else "left")
        for e, d, c in bound.terms()[:top]:
            terms.add_row(str(e.layer), e.role, e.norm, *(directed(v, 4, "up") for v in (e.coefficient, d, c)))
        print_table(console, terms)
    for asm in bound.total.assumptions:
        console.print(f"  assumption: {asm}", markup=False, highlight=False)


def perturb_payload(a, b, bound, low) -> dict[str, object]:
    """The JSON body of ``transcover perturb`` (schema ``transcover.perturb`` 1)."""
    up, lw = bound.total.value, low.value.value
    return {"model_a": a.name, "model_b": b.name, "warnings": list(a.warnings) + list(b.warnings),
            "bound": bound.to_dict(), "lower": low.to_dict(), "ratio": up / lw if lw > 0 else None}


def render_local(name: str, n_sequences: int, rows: list, rho_relative: bool) -> None:
    """The table of ``transcover lipschitz --data`` (local constants at real inputs, issue 12)."""
    import math

    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ._fit import print_table

    console = Console()
    # light borders, one space between columns: the eight columns fit 80 (Note [uncropped tables])
    table = Table(title=f"Local Lipschitz constants of {escape(str(name))} at {n_sequences} sequences ((2,inf) metric)",
                  box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    # with --ball-lower some rows carry the point lower beside the ball one: both are shown
    ball = any(not math.isnan(getattr(r, "point_lower", math.nan)) for r in rows)
    cols = ("rho", "layer", "component", "global (R)", "domain (sigma0)", "local (rho)",
            *(("point lower", "ball lower") if ball else ("lower",)), "local/lower")
    for col in cols:
        table.add_column(col, justify="left" if col == "component" else "right")
    for r in rows:
        has = not math.isnan(r.point_lower)
        lo = _fmt(r.lower, "down")
        lows = ((_fmt(r.point_lower, "down"), lo) if has else (lo, "-")) if ball else (lo,)
        table.add_row(f"{r.rho_factor:g}", str(r.layer) if r.layer >= 0 else "all", r.component,
                      *(_fmt(v, "up") for v in (r.global_upper, r.domain_upper, r.local_upper)), *lows, _fmt(r.ratio))
    print_table(console, table)
    console.print("  certified upper bounds (THEORY F14, F17; rounding padded); local = on the ball of radius rho "
                  "around each sequence's hidden states" + (" (rho x median token norm)" if rho_relative else "")
                  + " (a layer and the network on that ball; a component on the ball its input reaches from it, "
                    "a radius the layer's earlier components set)"
                  + "; lower = (2,inf) Jacobian norm at the data point (the network row: the larger of it and a "
                    "pair ascent inside the ball, so it may grow with rho); '-' = not computed for that row"
                  + ("; ball lower = the best of it and an ascent over centres and pairs inside the ball "
                     "(empirical, local/lower uses it)" if ball else ""))


def global_rows(rows: list[tuple]) -> list[dict]:
    """:func:`lipschitz_rows` as dicts (``kind, layer, component, input_radius, upper, lower``; layer -2: the
    network)."""
    return [dict(zip(("kind", "layer", "component", "input_radius", "upper", "lower"), r)) for r in rows]


def local_figure(rows: list):
    """``lipschitz --data --plot``: per layer (and the whole network), the certified local upper bound
    (solid) and the empirical lower estimate (dashed) against the ball radius, log-log; the ratio is
    the vertical gap.  Rows with a non-finite upper are left out of their curve (named in the title)."""
    import math

    from ._displays import log_limits
    from ._figures import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves: dict[str, list] = {}
    for r in rows:
        if r.component == "layer" or r.layer == -1:
            curves.setdefault("network" if r.layer == -1 else f"layer {r.layer}", []).append(r)
    dropped, shown = 0, []
    for k, (label, rs) in enumerate(sorted(curves.items(), key=lambda kv: (kv[0] == "network", kv[0]))):
        rs = sorted(rs, key=lambda r: r.rho_factor)
        up = [(r.rho_factor, r.local_upper) for r in rs if math.isfinite(r.local_upper) and r.local_upper > 0]
        lo = [(r.rho_factor, r.lower) for r in rs if math.isfinite(r.lower) and r.lower > 0]
        dropped += len(rs) - len(up)
        shown += [v for _, v in up + lo]
        colour = f"C{k % 10}"
        if up:
            ax.plot(*zip(*up), "o-", color=colour, label=f"{label}: certified upper")
        if lo:
            ax.plot(*zip(*lo), "x--", color=colour, alpha=0.7, label=f"{label}: empirical lower")
    ax.set_xscale("log")
    log_limits(ax, shown)  # Note [log span]
    ax.set_xlabel("ball radius rho")
    ax.set_ylabel("local Lipschitz constant, (2,inf)")
    ax.set_title("certified local upper vs empirical lower" + (f" ({dropped} unbounded rows left out)" if dropped
                                                                else ""))
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def local_payload(name: str, n_sequences: int, rhos: list[float], rho_relative: bool, rows: list) -> dict[str, object]:
    """The JSON body of ``transcover lipschitz --data`` (schema ``transcover.lipschitz.local`` 1)."""
    return {"model": name, "n_sequences": n_sequences, "rho": rhos, "rho_relative": rho_relative,
            "rows": [r.to_dict() for r in rows]}


def figure_bytes(fig, path: str) -> bytes:
    """``fig`` encoded for ``path``'s suffix (.png, .svg, .pdf), and closed."""
    from ._figures import pyplot, save_figure

    data = save_figure(fig, path)
    pyplot().close(fig)
    return data
