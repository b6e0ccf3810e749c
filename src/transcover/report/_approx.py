"""Views of the approximation lab's results (``transcover approx``, ``transcover advise``).

Tables as rich renderables and lines of text; figures of results that draw themselves on an axis
(``Advice``, ``AttentionRate``, ``MLPRate``, ``FailureCurve``) as PNG bytes.
"""

from __future__ import annotations

__all__ = ["construct_table", "capacity_line", "rate_sweep_table", "rate_sweep_line", "encodings_line", "failures_lines",
           "advice_table", "axes_png"]


def construct_table(result):
    """Lemma H.1 construction: each part's measured sup (empirical lower) beside its certified bound."""
    from rich.table import Table

    c, d, enc = result.construction, result.decomposition, result.encoding
    b = d.bound
    t = Table(title=f"Lemma H.1 construction: n={c.n}, I={result.target.indices}, Δ={enc.delta:.4g} ({enc.family}), "
                    f"R={c.R:g}, d_m={c.mlp.width}")
    t.add_column("part")
    t.add_column("measured sup (empirical lower)", justify="right")
    t.add_column("bound (certified upper)", justify="right")
    t.add_row("attention read-out ||ψ̂-ψ||∞", f"{d.readout.value:.4g}", f"{max(b.readout_bound):.4g}")
    t.add_row("attention part |f(ψ̂)-f(ψ)|", f"{d.attention.value:.4g}", f"{b.attention.value:.4g}")
    t.add_row("  lemma form n e^{-R(1-2Δ)}·…", "", f"{b.lemma_attention.value:.4g}")
    t.add_row("MLP part |f(ψ)-h|", f"{d.mlp.value:.4g}", f"{b.mlp.value:.4g}")
    t.add_row("total |F-g*|", f"{d.total.value:.4g}", f"{b.total.value:.4g}")
    return t


def capacity_line(result) -> str:
    c, cap = result.construction, result.capacity
    return (f"capacity: B_KQ={cap.B_KQ:.4g}  B_V={cap.B_V:.4g}  head Lipschitz<= {cap.head_lipschitz:.4g}  "
            f"params={cap.n_params} (non-zero {cap.n_nonzero})  heads={c.s}  head widths={c.mlp.widths}")


def rate_sweep_table(res, over: str):
    """Rate checks: fitted decay rates in R (``over="R"``) or fitted exponents in d_m (``"dm"``)."""
    from rich.table import Table

    if over == "R":
        t = Table(title="attention error: fitted decay rate in R")
        for col in ("n", "Δ", "λ", "fitted rate", "gap rate 1-Δ-2λ", "lemma rate 1-2Δ"):
            t.add_column(col, justify="right")
        for f in res.fits:
            t.add_row(str(f["n"]), f"{f['delta']:.3g}", f"{f['key_leak']:.3g}", f"{f['fitted_rate']:.4f}",
                      f"{f['gap_rate']:.4f}", f"{f['lemma_rate']:.4f}")
        return t
    t = Table(title="MLP error vs d_m: fitted exponent against -β/s")
    for col in ("β", "s", "fitted exponent", "-β/s"):
        t.add_column(col, justify="right")
    for f in res.fits:
        t.add_row(f"{f['beta']:g}", str(f["s"]), f"{f['fitted_exponent']:.3f}", f"{f['theory_exponent']:.3f}")
    return t


def rate_sweep_line(res, over: str) -> str:
    worst = max(r["measured"] / r["bound"] for r in res.rows)
    if over == "R":
        return f"max measured/bound over {len(res.rows)} points: {worst:.6f}"
    return f"max measured/bound: {worst:.4f}"


def encodings_line(res) -> str:
    enc = res.encoding
    frac = f" = {enc.delta_fraction}" if enc.delta_fraction is not None else ""
    return (f"{enc.family}: n={enc.n}, d_p={enc.dim}, Δ={enc.delta:.6g}{frac} ({enc.kind.value}); "
            f"Welch floor for (n, d_p): {res.welch_bound:.4g}; Δ<{res.target_delta:g} needs d_p>={res.welch_dimension} "
            f"(any design, Welch) and d_p>={res.random_sign_dimension} (random signs, prob>={1 - res.failure_prob:g}, F16b)")


def failures_lines(res) -> list[str]:
    return [res.name] + ["  " + "  ".join(f"{k}={v:.4g}" for k, v in r.items()) for r in res.rows]


def advice_table(a):
    """Design advice (estimates): MLP width, grid, heads, depth, temperature, and the two error terms."""
    from rich.table import Table

    t = Table(title=f"advice for s={a.sparsity}, β={a.smoothness:g}, n={a.seq_len}, N={a.n_samples} (estimates)")
    t.add_column("choice")
    t.add_column("value", justify="right")
    for k, v in (("MLP width d_m", a.d_m), ("interpolation grid per axis", a.grid), ("heads", a.heads),
                 ("attention layers", a.attention_layers), ("MLP hidden layers", a.mlp_hidden_layers),
                 ("temperature R", f"{a.R:.2f}"), ("positional dim d_p (random signs, Δ)", a.positional_dim),
                 ("approximation error", f"{a.approx_error:.4g}"), ("estimation term", f"{a.estimation_error:.4g}")):
        t.add_row(k, str(v))
    return t


def axes_png(result, *, figsize=(7.5, 5), dpi: int = 120) -> bytes:
    """PNG bytes of a result that draws itself on one axis (``result.plot(ax)``)."""
    import io

    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    result.plot(fig.add_subplot())
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
