"""Notebook views of an :class:`~transcover.norms.AnalysisResult`: a short ``repr``, an HTML table,
DataFrames (one row per matrix; one row per layer like WeightWatcher's ``get_summary()``)."""

from __future__ import annotations

import math

__all__ = ["analysis_repr", "analysis_repr_html", "matrices_dataframe", "layers_dataframe"]

LAYER_KEYS = ("B_KQ", "B_V", "W_O", "B_W1", "B_W2", "B_Wgate", "B_b1", "B_b2", "B_b_attn")


def analysis_repr(result) -> str:
    """A few lines: the model, the mode, the maxima over layers, how to see more."""
    s = result.summary()
    from .._printed import for_kind
    from .._results import Kind

    # an estimate (fast=True) is no upper bound: "≈", not "≤" (red team 210 read B_KQ≤0.06035 as certified)
    sign = "≈" if result.kind is Kind.ESTIMATE else "≤"
    maxima = ", ".join(f"{k}{sign}{for_kind(iv.upper, result.kind)}" for k, iv in s.items())
    n_matrices = sum(len(layer.matrices) for layer in result.layers) + len(result.embeddings)
    n_bias = 3 * len(result.layers)  # b_1, b_2, b_attn per layer: rows of to_dataframe() too (a count of 238 beside
    return (f"<AnalysisResult {result.model!r} ({result.arch}): {len(result.layers)} layers, "  # 256 rows misled)
            f"{result.n_heads} heads x {result.d_head}, d={result.d_model}; {result.kind.value}, rtol={result.rtol:g}\n"
            f"  max over layers: {maxima}\n"
            f"  {n_matrices} matrices and {n_bias} bias vectors; .to_dataframe() one row each, .layers_dataframe() "
            "per layer, .plot() heatmaps>")


def analysis_repr_html(result) -> str:
    """An HTML summary for Jupyter: the per-layer table of upper ends, labelled with their kind."""
    from ._html import fmt, kind_badge, table, text

    keys = [k for k in LAYER_KEYS if any(getattr(layer, k) is not None for layer in result.layers)]
    way = "up" if result.mode == "certified" else "near"
    rows = [[str(layer.index)] + [fmt(getattr(layer, k).upper, 5, way) if getattr(layer, k) is not None else "–"
                                  for k in keys] for layer in result.layers]
    head = (f"<p><b>{text(result.model)}</b> ({text(result.arch)}, {len(result.layers)} layers, "
            f"{result.n_heads} heads × {result.d_head}, d = {result.d_model}) {kind_badge(result.kind)}</p>")
    return head + table(["layer"] + keys, rows, raw=True, numeric=[True] * (len(keys) + 1),
                        caption="upper ends of the intervals per layer")


def _row(layer, where: str, role: str, tensor: str, shape, ivs) -> dict[str, object]:
    row: dict[str, object] = {"layer": layer, "where": where, "matrix": role, "tensor": tensor,
                              "rows": shape[0], "cols": shape[1]}
    for name, iv in zip(("spectral", "frobenius", "l21"), ivs):
        row[f"{name}_lower"] = math.nan if iv is None else iv.lower
        row[f"{name}_upper"] = math.nan if iv is None else iv.upper
    row["kind"] = ivs[0].kind.value
    return row


def matrices_dataframe(result):
    """One row per matrix (every head's W_KQ, W_OV, W_V; W_O, W_1, W_2, W_gate; the biases as
    1 x d rows, whose spectral and Frobenius norms are their l2 norm; embeddings): spectral,
    Frobenius and (2,1) intervals, the checkpoint tensor, and the kind."""
    import pandas as pd

    rows = []
    for layer in result.layers:
        for role, m in layer.matrices.items():
            rows.append(_row(layer.index, "layer", role, m.tensor, m.shape, (m.spectral, m.frobenius, m.l21)))
        d = result.d_model
        for role, iv in (("b_1", layer.B_b1), ("b_2", layer.B_b2), ("b_attn", layer.B_b_attn)):
            width = layer.matrices["W_1"].shape[1] if role == "b_1" else d
            rows.append(_row(layer.index, "layer", role, "", (1, width), (iv, iv, None)))
    for e in result.embeddings:
        m = e.norms
        rows.append(_row(pd.NA, e.where, e.name, m.tensor, m.shape, (m.spectral, m.frobenius, m.l21)))
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    return df


def layers_dataframe(result):
    """One row per layer, every per-layer quantity (lower and upper), the normalisation parameters
    and the largest relative gap: the per-layer summary (WeightWatcher's ``get_summary()`` shape)."""
    import pandas as pd

    rows = []
    for layer in result.layers:
        row: dict[str, object] = {"layer": layer.index}
        gaps = []
        for key in LAYER_KEYS:
            iv = getattr(layer, key)
            if iv is None and key == "B_Wgate" and all(x.B_Wgate is None for x in result.layers):
                continue
            row[f"{key}_lower"] = math.nan if iv is None else iv.lower
            row[f"{key}_upper"] = math.nan if iv is None else iv.upper
            if iv is not None:
                gaps.append(iv.relative_gap)
        row["norm_attn_gamma_max"] = layer.norm_attn.gamma_max_abs
        row["norm_ffn_gamma_max"] = layer.norm_ffn.gamma_max_abs
        row["max_relative_gap"] = max(gaps)
        row["kind"] = result.kind.value
        rows.append(row)
    return pd.DataFrame(rows).set_index("layer")
