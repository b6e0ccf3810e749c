"""Tables, figure and JSON payload of ``transcover bound`` (the CLI only parses and calls these)."""

from __future__ import annotations

__all__ = ["json_safe", "fmt_log", "bound_payload", "render_bound", "bound_png"]


def json_safe(obj):
    """Strict JSON: non-finite floats (a zero-coefficient matrix's eps_i = inf) become strings."""
    import math

    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def fmt_log(ln_value: float, way: str = "up") -> str:
    """A number given by its natural log, printed as a float or as 10^x, rounded ``way`` (Note [printed bounds])."""
    from .._printed import from_ln

    return from_ln(ln_value, way)


def _layer_name(layer: int | str, n_layers: int) -> str:
    """A layer index as the tables print it: the input norm at -1, the final norm at ``n_layers`` (it read as a layer
    "2" of a 2-layer model, where ``perturb`` says "out"; red team 185)."""
    return {-1: "input (embedding norm)", n_layers: "out (final norm)"}.get(layer, str(layer))


def _gap(g) -> str:  # noqa: ANN001
    """A reported gap bound as printed: a vacuous one is the loss range b exactly, printed as b (from its log it was
    1.001 for b = 1: red team 188's gap column, 215's BFT column), any other from its log, rounded up."""
    from .._printed import up

    return up(g.gap, 4) if g.vacuous else fmt_log(g.log_gap)


def bound_payload(result, diagnosis, n_needed: float, target: float, warnings: list[str]) -> dict[str, object]:
    """The JSON body of ``transcover bound`` (strict JSON: non-finite floats as strings)."""
    import math

    data = json_safe(result.to_dict())
    data["n_needed_for_gap"] = {"target_gap": target, "n": n_needed if math.isfinite(n_needed) else "> 1e300"}
    data["diagnosis"] = json_safe(diagnosis.to_dict())
    data["warnings"] = list(warnings)
    return data


def render_bound(result, n_needed: float, target: float, top: int, diagnosis) -> None:
    """``transcover bound``'s text: the bound, its gaps, the diagnosis and where ``log N`` comes from.  The by-layer
    and contribution tables give shares of the whole class's ``log N`` (``result.class_terms()``; with an MLP head its
    matrices as layer "head"), as the diagnosis does."""
    import math

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..covering import CompositeCovering
    from .._printed import count_exact, count_up, directed, log10_up, up
    from ._displays import layer_order
    from ._fit import print_table

    con = Console()
    cov = result.covering
    # the model's name (a path: "a[/b]" crashed rich) and any text not ours go in escaped, and the kinds' brackets
    # are literal: "[certified upper bound]" was read as a style tag and vanished (red team 215)
    con.print(f"[bold]{escape(str(result.model))}[/bold] ({escape(str(result.arch))}, {result.n_layers} layers): "
              f"log N_inf(eps={result.eps!r}, n={count_exact(result.generalisation[0].n)} x T={result.seq_len}) "
              f"<= {fmt_log(cov.log_log_N)}  \\[{result.kind.value}]")
    if result.routes:
        others = ", ".join(f"{k} {fmt_log(v)}" for k, v in result.routes.items())
        con.print(f"  route: {result.route}" + (" (family auto: the smallest certified log N of the routes "
                                                 if result.family == "auto" else " (routes for comparison: ")
                  + others + ")")
    if isinstance(cov, CompositeCovering):
        con.print(f"  Theorem G.5: MLP head log N(eps/2) <= {fmt_log(cov.mlp.log_log_N)} "
                  f"({cov.mlp.n_params} params, C = {fmt_log(cov.log_C)}); Transformer log N(eps/2C) <= "
                  f"{fmt_log(cov.transformer.log_log_N)}; " + (
                      f"4C^2(eta+eta~)^3/eps^2 = {fmt_log(cov.log_leading)}" if cov.log_leading > -math.inf
                      else "no 4C^2(eta+eta~)^3/eps^2 term (no matrix uses an F2 cover)"))
    t = Table(title="generalisation gap (w.p. >= 1 - delta)")
    for col in ("n", "gap bound (reported)", "raw formula", "Rademacher", "vacuous", "BFT-baseline gap"):
        t.add_column(col, justify="right")
    b_loss = result.generalisation[0].loss_bound
    for g, b in zip(result.generalisation, result.bft_generalisation):
        t.add_row(count_exact(g.n), _gap(g) + (" (trivial)" if g.vacuous else ""),
                  fmt_log(g.raw_log_gap),
                  # Dudley's infimum at alpha = b is 4b exactly, as the gap's trivial b is (it printed 4.001)
                  f"{up(4 * b_loss, 4)} (trivial 4b)" if g.rademacher.trivial
                  else directed(g.rademacher.value, 4, "up"),
                  "yes" if g.vacuous else "no",
                  _gap(b) + (f" (vacuous, raw {fmt_log(b.raw_log_gap)})" if b.vacuous else ""))
    print_table(con, t)
    if result.norm_grid:
        con.print(f"the gaps' class: {result.grid_norms} norms rounded up to a grid of {result.norm_grid} levels per "
                  f"octave; the level vector costs ln(1/prior) = {up(result.log_prior, 4)} nats beside ln(2/delta) "
                  "(F102), so the gaps hold for norms read off the trained weights")
    else:
        con.print("the gaps' class is taken as fixed before the data (--norm-grid 0): valid only if these norms were "
                  "chosen in advance")
    if any(g.vacuous for g in result.generalisation):
        con.print(f"vacuous: the bound's formula is >= the loss range b = {b_loss:g} (a [0, b] loss never has a "
                  f"larger gap), so the reported gap is the trivial b; the raw formula is shown for comparison only")
    con.print(f"n needed for a gap <= {target:g}: {count_up(n_needed)}" if math.isfinite(n_needed)
              else f"n needed for a gap <= {target:g}: more than 1e300")
    if diagnosis.vacuous:
        dom = ", ".join(f"n={count_exact(g.n)}: {d}" for g, d in zip(result.generalisation, diagnosis.dominant_term))
        con.print(f"[bold]why vacuous[/bold]: dominant gap term ({escape(dom)}); " + (
            "largest shares of log N: "
            + ", ".join(f"{escape(m)} {s:.1%} ({c.split()[0]})" for m, _, c, s, _ in diagnosis.top)
            + "; by layer: " + ", ".join(f"{_layer_name(ly, result.n_layers)}: {s:.1%}"
                                         for ly, s in diagnosis.layers[:3])
            if diagnosis.top else "log N = 0, no matrix contributes"))
        con.print("[bold]what would tighten it[/bold] (advice):")
        for tip in diagnosis.suggestions:
            con.print(f"  - {escape(tip)}")
    con.print("BFT baseline (an estimate, not a bound here: BFT's theorem covers feed-forward chains; the "
              "Transformer's matrices are treated as one chain without residuals, LayerNorm or softmax)")
    con.print(f"BFT spectral complexity R_A = {fmt_log(result.bft.log_R, 'near')} \\[{result.bft.kind.value}]; "
              f"BFT log N ~ A/eps^2 with A = {fmt_log(result.bft.log_A, 'near')}, "
              f"ours at eps: log N * eps^2 = {fmt_log(cov.log_log_N + 2 * math.log(result.eps))}")
    lt = Table(title="share of log N by layer")
    lt.add_column("layer", justify="right")
    lt.add_column("share", justify="right")
    for layer, share in sorted(diagnosis.layers, key=lambda kv: layer_order(kv[0])):
        lt.add_row(_layer_name(layer, result.n_layers), f"{share:.3%}")
    print_table(con, lt)
    from rich import box

    # 80 columns: light borders, the cover as its formula number.  A number is never cropped (rich
    # crops a no_wrap cell to its column: 7.135e-21 was shown as 7.135e-2): every column keeps its
    # widest cell as its minimum width, and where the table is still too wide the names fold.
    mt = Table(title=f"largest {top} contributions (cover: F1 parameter count, F2 (2,1)-norm)",
               box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    rows = []
    for name, _, c, share in sorted(result.class_terms(), key=lambda r: r[2].log_cost, reverse=True)[:top]:
        cover = c.cover[c.cover.rfind("(") + 1:].rstrip(")") if "(" in c.cover else c.cover
        rows.append((escape(name.replace("layer-1.", "input.")), c.group, cover, log10_up(c.log_c, decimals=2),
                     fmt_log(c.log_eps_i, "near")
                     if c.log_eps_i > -700 else f"10^{c.log_eps_i / math.log(10):.1f}", fmt_log(c.log_cost),
                     f"{share:.3%}"))
    for k, col in enumerate(("matrix", "group", "cover", "log10 c_i", "eps_i", "log N_i", "share")):
        cells = [col] + [r[k] for r in rows]
        if k == 0:
            mt.add_column(col, justify="left", overflow="fold", min_width=min(max(len(x) for x in cells), 12))
        else:
            mt.add_column(col, justify="left" if k < 3 else "right", no_wrap=True,
                          min_width=max(len(x) for x in cells))
    for r in rows:
        mt.add_row(*r)
    # below the columns' minimum widths rich drops whole columns: print wider than the terminal instead
    need = sum(c.min_width for c in mt.columns) + 2 * len(mt.columns) + 2
    (con if con.width >= need else Console(width=need)).print(mt)
    con.print("[bold]assumptions[/bold]")
    for a in result.assumptions:
        con.print(f"  - {escape(a)}")


def bound_png(result, n_needed: float, target: float) -> bytes:
    """PNG bytes: log N(eps) at the first n, and the gap bound against n (the result's loss, delta, class and prior)."""
    import io
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from .._printed import count_exact

    loss_bound = result.options["loss_bound"]
    curve = result.curve
    n0 = result.generalisation[0].n
    eps = np.logspace(-3, 1, 41) * result.eps
    loglog = np.array([curve(float(e), n0) for e in eps]) / math.log(10)
    hi = max(12.0, (math.log10(n_needed) + 1) if math.isfinite(n_needed) else 40.0)
    ns = np.logspace(2, hi, 25)
    gaps = np.array([result.gap_at(float(n), n_grid=150).raw_log_gap for n in ns]) / math.log(10)
    reported = np.minimum(gaps, math.log10(loss_bound))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.plot(eps, loglog, "o-", ms=3)
    a1.set_xscale("log")
    a1.set_xlabel(r"$\varepsilon$")
    a1.set_ylabel(r"$\log_{10}\,\log \mathcal{N}_\infty(\varepsilon)$")
    a1.set_title(f"covering bound, $n$={count_exact(n0)}, $T$={result.seq_len}")
    a1.axvline(result.eps, color="grey", ls=":", label=rf"$\varepsilon$={result.eps!r}")
    a1.legend()
    a2.plot(ns, reported, "o-", ms=3, label="certified gap bound (reported: min(formula, b))")
    a2.plot(ns, gaps, ":", color="grey", label="raw formula (vacuous above b)")
    a2.axhline(math.log10(loss_bound), color="red", ls="--", label="trivial (loss bound b)")
    a2.axhline(math.log10(target), color="grey", ls=":", label=f"target {target:g}")
    a2.set_xscale("log")
    a2.set_xlabel("$n$ (training sequences)")
    a2.set_ylabel(r"$\log_{10}$ gap bound")
    a2.set_title("generalisation gap vs n")
    a2.legend()
    from ._html import plain

    # the model's path is no mathtext: "$\\nosuchcmd{$" crashed the plot (red team 215), as the other figures plain() it
    fig.suptitle(f"{plain(result.model)} ({plain(result.arch)}, {result.n_layers} layers), family={result.family}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
