"""Views of an :class:`~transcover.norms.AnalysisResult`: a rich table, JSON and CSV text."""

from __future__ import annotations

import io
import json
from pathlib import Path

__all__ = ["render_analysis", "analysis_json", "analysis_csv", "analysis_sweep_table", "plot_sweep"]

_LAYER_KEYS = ("B_KQ", "B_V", "W_O", "B_W1", "B_W2", "B_b1", "B_b2")


# kinds as table cells: the full names do not fit 80 columns beside six numbers
_NORM_SHORT = {"layernorm": "LN", "rmsnorm": "RMS", "ball": "Π", "none": "none"}


def _fmt(x: float, way: str = "near") -> str:
    from .._printed import directed

    return directed(x, 5, way)


def render_analysis(result, console, *, heads: bool = False) -> None:
    """Print the per-layer table (and per-head tables with ``heads=True``) to a rich console."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from .._results import Kind
    from ._fit import print_table

    # --fast estimates the spectral norms only; the bias norms stay certified, and the gap printed is theirs
    # (red team 217: "not certified; largest relative gap 6.8e-13" named no entry that gap belongs to)
    kept = [k for k in _LAYER_KEYS if all(getattr(layer, k).kind is not Kind.ESTIMATE for layer in result.layers)]
    what = ("upper ends of certified intervals \\[lower, upper]" if result.mode == "certified"
            else "Lanczos ESTIMATES (--fast): not certified" if not kept
            else f"Lanczos ESTIMATES (--fast): not certified, except {', '.join(kept)}: certified intervals")
    hi, lo = ("up", "down") if result.mode == "certified" else ("near", "near")  # Note [printed bounds]
    gap_keys = kept if kept and result.mode != "certified" else _LAYER_KEYS
    gaps = [getattr(layer, k).relative_gap for layer in result.layers for k in gap_keys]
    gaps += [h.B_KQ.relative_gap for layer in result.layers for h in layer.heads]
    # a model's name, path or tensor name is the user's text, never markup: "a[/b]" crashed rich (red team 215)
    table = Table(title=f"{escape(str(result.model))}  ({escape(str(result.arch))}, {len(result.layers)} layers, "
                        f"{result.n_heads} heads x {result.d_head}, d={result.d_model})",
                  caption=f"{what}; largest relative gap {max(gaps):.1e} (target {result.rtol:g}); "
                          f"{result.seconds:.2f} s",
                  caption_justify="left", box=box.SIMPLE_HEAD,  # light borders, one space between columns:
                  padding=(0, 1), collapse_padding=True)        # 80 columns suffice
    rows = [[str(layer.index), *(_fmt(getattr(layer, k).upper, hi) for k in _LAYER_KEYS)] for layer in result.layers]
    # a number is never cropped: rich cut 0.0062296 to "0.00622…" in 80 columns; each column keeps its widest cell
    for k, head in enumerate(("layer",) + tuple("‖W_O‖" if key == "W_O" else key for key in _LAYER_KEYS)):
        table.add_column(head, justify="right", no_wrap=True, min_width=max(len(r[k]) for r in rows))
    for row in rows:
        table.add_row(*row)
    print_table(console, table)
    norms = Table(title="normalisation: max|γ|, ‖β‖ of the attention and FFN sub-layers' norms, "
                        "variance floor eps", box=box.SIMPLE_HEAD,
                  caption="kind: LN LayerNorm, RMS RMSNorm, Π row-wise unit-ball projection", caption_justify="left")
    for col in ("layer", "pre/post", "kind", "attn max|γ|", "attn ‖β‖", "ffn max|γ|", "ffn ‖β‖", "eps"):
        norms.add_column(col, justify="right")
    for layer in result.layers:
        n1, n2 = layer.norm_attn, layer.norm_ffn
        norms.add_row(str(layer.index), layer.placement, _NORM_SHORT.get(n1.kind, n1.kind),
                      _fmt(n1.gamma_max_abs), _fmt(n1.beta_norm),
                      _fmt(n2.gamma_max_abs), _fmt(n2.beta_norm), f"{n1.eps:g}")
    print_table(console, norms)
    if heads:
        for layer in result.layers:
            t = Table(title=f"layer {layer.index}: per head (lower … upper)")
            for col in ("head", "B_KQ", "B_V", "‖W_V^h‖"):
                t.add_column(col, justify="right")
            has_bias = any(h.B_KQ_bias is not None for h in layer.heads)
            if has_bias:
                t.add_column("B_KQ with b_Q", justify="right")
            def ends(iv) -> str:
                return f"{_fmt(iv.lower, lo)} … {_fmt(iv.upper, hi)}"

            for h in layer.heads:
                cells = [str(h.head)] + [ends(iv) for iv in (h.B_KQ, h.B_V, h.W_V)]
                if has_bias:  # both ends, as the title says (red team 217: the upper end alone was shown)
                    cells.append(ends(h.B_KQ_bias) if h.B_KQ_bias is not None else "")
                t.add_row(*cells)
            print_table(console, t)
    if result.embeddings:
        t = Table(title="outside the decomposition (embeddings, un-embedding, heads)")
        for col in ("matrix", "shape", "‖·‖₂", "‖·‖_F", "max row ‖·‖₂"):
            t.add_column(col, justify="right")
        for e in result.embeddings:
            shape = "×".join(map(str, e.norms.shape)) if e.norms.shape[1] > 1 else str(e.norms.shape[0])
            t.add_row(escape(e.name), shape,
                      _fmt(e.norms.spectral.upper, hi),
                      _fmt(e.norms.frobenius.upper, hi), _fmt(e.max_row_norm, hi))
        print_table(console, t)
    for note in result.notes:
        console.print(f"[dim]note: {escape(note)}[/dim]")


def analysis_json(result, *, matrices: bool = True) -> str:
    """The documented, versioned JSON (docs/analyze.md)."""
    return json.dumps(result.to_dict(matrices=matrices), indent=2, allow_nan=False) + "\n"


def analysis_csv(result) -> str:
    """One row per layer with lower/upper columns of every per-layer quantity (``layers_dataframe``)."""
    buf = io.StringIO()
    result.layers_dataframe().to_csv(buf)
    return buf.getvalue()


def analysis_sweep_table(rows: list[dict]):
    """An analyze sweep (``transcover analyze A B ...``): one row per model, the maxima over layers
    as ``[lower, upper]`` of their kind (a rich Table)."""
    from rich.markup import escape
    from rich.table import Table

    kind = rows[0]["kind"]
    table = Table(title=f"analyze sweep: max over layers ({kind}: \\[lower, upper])")
    for col in ("step", "model", "B_KQ", "B_V", "B_W1", "B_W2"):
        table.add_column(col, justify="right" if col != "model" else "left")
    from .._printed import directed

    hi, lo = ("near", "near") if kind == "estimate" else ("up", "down")  # Note [printed bounds]
    for row in rows:
        table.add_row("" if row["step"] is None else str(row["step"]), escape(str(row["model"])),
                      *(f"\\[{directed(row[k + '_lower'], 4, lo)}, {directed(row[k + '_upper'], 4, hi)}]"
                        for k in ("B_KQ", "B_V", "B_W1", "B_W2")))
    return table


def plot_sweep(rows: list[dict], path: str):
    """The time series: each bound's certified upper end (and lower end, dashed) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .._io import atomic_write_bytes

    steps = [row["step"] for row in rows]
    x = steps if rows and all(s is not None for s in steps) else list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("B_KQ", "B_V", "B_W1", "B_W2"):
        line, = ax.plot(x, [row[f"{key}_upper"] for row in rows], marker="o", ms=3, label=key)
        ax.plot(x, [row[f"{key}_lower"] for row in rows], ls="--", lw=0.8, color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("training step" if x is steps else "checkpoint")
    ax.set_ylabel("max over layers (upper solid, lower dashed)")
    ax.set_title("transcover analyze: norms over training")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", dpi=120)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
