"""``transcover report``: compute what the report shows (analyze, Lipschitz, model bound), then
render one self-contained HTML page (:mod:`._html`) with inline SVG figures (:mod:`._displays`).

The empirical lower Lipschitz estimates are the slow part (a gradient search per stage); the
report runs them with few starts and steps (``ReportOptions``), says so next to the numbers, and
``lower=False`` skips them.  Local (at-the-data) bounds are an optional block: pass ``local`` (any
object with ``to_dict()`` holding ``rows``) and the page gets a section for it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ._displays import (AnalysisDisplay, BoundDisplay, CoveringDisplay, HistoryDisplay, LipschitzDisplay,
                        layer_label, layer_order)
from ._figures import figure_png, pyplot
from ._html import fmt, kind_badge, page, plain, section, table, text
from ._html import figure as html_figure
from ._lipschitz_tables import lipschitz_rows
from .._printed import count_exact, log10_up, up
from ._cover import fmt_eps
from ._progress import Tracker

__all__ = ["ReportOptions", "ReportData", "compute_report", "render_report"]


@dataclass(frozen=True)
class ReportOptions:
    radius: float = 1.0  # token-norm bound R of the global Lipschitz and covering bounds
    eps: float = 0.1
    n_samples: float | None = None  # n of the gap bound (None: a training run's n_train, as `bound`; else 1e6)
    seq_len: int | None = None  # T of the covering bound (None: a training run's T, else 128, or the model's longest
    # sequence if shorter)
    lower: bool = True
    lower_samples: int = 1  # fast settings: the report is a first look, not a search campaign
    lower_steps: int = 3
    lower_seq_len: int = 4
    lower_stages: bool = False  # per-stage searches too (32 on MiniLM instead of 7: minutes, not seconds)
    seed: int = 0
    rtol: float = 1e-3
    sigma_min: float = 0.0  # assumed floor on every LayerNorm input's std (0: the global, eps-limited constant)


@dataclass
class ReportData:
    model: str
    source: object
    analysis: object
    bounds: object
    lower: dict
    bound: object
    spec_config: dict
    inputs: list
    options: ReportOptions
    history: list | None = None
    history_path: str | None = None
    local: object = None
    data_path: str | None = None
    timings: dict = field(default_factory=dict)
    warnings: tuple = ()
    bound_note: str = ""  # why there is no covering bound (bound is None)


def _own_history(model) -> Path | None:
    """``history.jsonl`` of the ``transcover train`` run ``model`` names (its run or checkpoint folder), if any."""
    from ..train import checkpoint_folder

    folder = checkpoint_folder(model)
    if folder is None:
        return None
    own = folder.parent / "history.jsonl"
    return own if own.is_file() else None


def _checked_history(history, spec, model) -> tuple[list, list[str]]:
    """The records of ``history``, refused in one line where they cannot be the monitor of ``spec``'s training:
    no record with a series to draw (an empty, step-only or foreign file drew four empty panels), steps that
    go backwards (two histories concatenated drew zig-zags), or per-layer groups beyond the model's layers.
    A training run given with another run's history is warned about (the file is read as given); the warning's text
    is returned beside the records, for the report's own warnings."""
    import warnings

    from .._errors import InputError, TranscoverWarning
    from ..constrain import read_history

    records = read_history(history)
    series = ("loss", "train_loss", "test_loss", "train_acc", "test_acc", "grad_norm", "capacity")
    if not any(isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for r in records for k in r
               if k in series or k.startswith(("sigma.", "radius.", "certified."))):
        raise InputError(f"history file {history} holds no training series (loss, accuracy, grad_norm, capacity or "
                         "sigma.<group>): not a training monitor's history")
    for prev, rec in zip(records, records[1:]):
        if rec["step"] < prev["step"]:
            raise InputError(f"history file {history}: the steps go backwards ({prev['step']} then {rec['step']}); "
                             "two histories concatenated?")
    layers = {int(k.split(".")[2]) for r in records for k in r
              if k.startswith("sigma.") and k.count(".") == 2 and k.split(".")[2].isdigit()}
    if layers and max(layers) >= len(spec.layers):
        raise InputError(f"history file {history} records layer {max(layers)}, but the model has "
                         f"{len(spec.layers)} layers: it is not this model's training history")
    own = _own_history(model) if isinstance(model, (str, os.PathLike)) else None
    notes = []
    if own is not None and not Path(history).resolve() == own.resolve():
        notes.append(f"the training history {history} is not the run's own ({own}); it is shown as given")
        warnings.warn(notes[-1], TranscoverWarning, stacklevel=2)
    return records, notes


def compute_report(model=None, *, arch=None, allow_pickle=False, strict=False, roles=None, options=ReportOptions(),
                   history=None, data=None, local=None, tracker: Tracker | None = None,
                   seq_len_option: str = "seq_len") -> ReportData:
    """Everything the report shows, computed once (``tracker`` shows the phases on a terminal).  ``arch``,
    ``allow_pickle``, ``strict``, ``roles``: how ``model`` is read (:func:`transcover.load`); a mapping file given by
    path is hashed with the model's files.  ``seq_len_option``: the name a T longer than the model covers is refused
    in (``report`` passes "--seq-len")."""
    from .._errors import UnsupportedArchitectureError
    from ..covering import BoundConfig, NoFiniteBound, model_bound
    from ..lipschitz import class_bounds, compose, lipschitz_lower
    from ..train import load_model_task
    from ..norms import analyze_spec
    from ._envelope import input_hashes

    tracker = tracker or Tracker()
    timings: dict[str, float] = {}
    t = time.perf_counter()
    tracker.step("loading the model")
    from ..model import TransformerSpec, default_sequence_length, sequence_length

    spec, n_train, task_len = (model, None, None) if isinstance(model, TransformerSpec) else \
        load_model_task(model, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles)
    if n_train is not None:  # a training run: its own n and T unless given, as `bound` takes them (red team 222)
        options = replace(options, n_samples=options.n_samples or float(n_train), seq_len=options.seq_len or task_len)
    # the defaults shrink to what the model covers: the lower search's 4 tokens too (red team 197: a 3-position
    # GPT-2 was refused for a T the user never gave)
    options = replace(options, n_samples=options.n_samples or 1e6,
                      seq_len=sequence_length(options.seq_len, 128, seq_len_option, spec),
                      lower_seq_len=default_sequence_length(options.lower_seq_len, spec))
    records, history_notes = None, []
    if history is None and isinstance(model, (str, os.PathLike)):
        history = _own_history(model)  # a training run reports its own monitor unasked
    if history is not None:
        records, history_notes = _checked_history(history, spec, model)
    timings["load"] = time.perf_counter() - t
    t = time.perf_counter()
    tracker.step("certified norms (analyze)", total=len(spec.layers))
    # one measurement (Note [one engine] in ``norms._model``): the tables show it, the Lipschitz chain
    # and the covering bound read ``analysis.norms``
    analysis = analyze_spec(spec, rtol=options.rtol, progress=tracker.callback(), entrywise=True)
    timings["analyze"] = time.perf_counter() - t
    t = time.perf_counter()
    tracker.step("certified Lipschitz constants")
    ts = spec.to_torch()
    seq = options.lower_seq_len if any(layer.attention.kind == "l2" for layer in ts.layers) else None
    norms = analysis.norms
    bounds = compose(class_bounds(norms), radius=options.radius, c_sm=1.0, metric="2,inf", seq_len=seq,
                     sigma_min=options.sigma_min)
    timings["lipschitz upper"] = time.perf_counter() - t
    lower = {}
    if options.lower:
        t = time.perf_counter()
        tracker.step(f"empirical lower Lipschitz ({options.lower_samples} start(s), {options.lower_steps} steps)")
        from .._threads import limit_threads, small_problem

        # small forwards: one thread, as `transcover lipschitz` does (Note [small problems])
        with limit_threads(1 if small_problem(ts.d_model, options.lower_seq_len) else None, blas=False):
            lower = lipschitz_lower(ts, bounds, seq_len=options.lower_seq_len, n_samples=options.lower_samples,
                                    n_steps=options.lower_steps, seed=options.seed, stages=options.lower_stages)
        timings["lipschitz lower"] = time.perf_counter() - t
    t = time.perf_counter()
    tracker.step("covering number and generalisation bound")
    bound_note = ""
    try:
        bound = model_bound(ts, BoundConfig(eps=options.eps, n_samples=(options.n_samples,), seq_len=options.seq_len,
                                            radius=options.radius, sigma_min=options.sigma_min), norms=norms)
    # the other sections still hold; the page says why this one is missing: a constant that overflows (red team
    # 169), or a lemma not derived for the architecture (L2 attention's G.3: the page was refused, red team 222)
    except (NoFiniteBound, UnsupportedArchitectureError) as err:
        bound, bound_note = None, f"no covering bound: {err}"
    timings["bound"] = time.perf_counter() - t
    from ..train import data_files

    # the data's files as read: the file, the tokenizer of texts (red team 222); a built-in set by name
    inputs = input_hashes(model, *([roles] if isinstance(roles, (str, os.PathLike)) else []),
                          *([history] if history is not None else []),
                          *(data_files(spec, data) if data is not None else []))
    return ReportData(spec.name, model, analysis, bounds, lower, bound, dict(spec.config), inputs, options,
                      records, None if history is None else str(history), local,
                      None if data is None else str(data), timings, (*spec.warnings, *history_notes),
                      bound_note)


def _svg(display, **kw) -> str:
    """The display drawn as an inline ``<img>`` of a base64 PNG (150 dpi, shown at 100 dpi).

    Inline SVG with text as paths was tried first: Chromium took 0.6-1.4 s to lay out the four
    MiniLM figures (the page without them: 0.35 s); a PNG decodes in milliseconds, renders the same
    everywhere, and needs no font.
    """
    import base64

    import numpy as np

    # a log axis beside an upper near 1e308: matplotlib's margins and tick decades overflow float64 (red team 169);
    # the picture is right, numpy's warnings about its own arithmetic are not ours to show
    with np.errstate(over="ignore", invalid="ignore"):
        display.plot(**kw)
        fig = display.figure_
        try:
            data = figure_png(fig, dpi=150)
        finally:
            pyplot().close(fig)
    width, height = _png_size(data)
    return (f'<img src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}" '
            f'width="{round(width / 1.5)}" height="{round(height / 1.5)}" alt="figure">')


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height from the PNG header (IHDR: bytes 16-24, big-endian)."""
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _sha_cell(entry: dict, data_path: str | None) -> str:
    """The SHA-256 cell of an ``inputs`` entry; one without a file (``sha256`` null in the JSON) says why (red team
    222: the card printed "None" for the built-in sklearn-descr sentences)."""
    if entry["sha256"] is not None:
        return f"<code>{text(entry['sha256'])}</code>"
    return ("built-in data set, not a file: not hashed" if entry["path"] == data_path
            else "not a file (a model in memory): not hashed")


def _model_card(d: ReportData) -> str:
    a, cfg = d.analysis, d.spec_config
    rows = [("model", text(d.model)), ("architecture", text(a.arch)), ("layers", fmt(len(a.layers))),
            ("d_model", fmt(a.d_model)), ("heads × d_head", f"{a.n_heads} × {a.d_head}"),
            ("FFN width d_ff", fmt(cfg.get("d_ff"))), ("activation", text(cfg.get("activation", "?"))),
            ("stored dtype", text(cfg.get("storage_dtype", "?"))),
            ("normalisation", text(f"{a.layers[0].norm_attn.kind}, {a.layers[0].placement}")),
            ("source", text("bundled all-MiniLM-L6-v2 package" if d.source is None
                             else getattr(d.source, "name", d.source)))]
    parts = [table(("property", "value"), rows, raw=True)]
    if d.inputs:
        parts.append(table(("input file", "bytes", "SHA-256"),
                           [(f"<code>{text(i['path'])}</code>", fmt(i["bytes"]), _sha_cell(i, d.data_path))
                            for i in d.inputs], raw=True, numeric=(False, True, False),
                           caption="files read (hashes identify exactly the weights measured)"))
    for w in d.warnings:
        parts.append(f'<p class="warn">loader warning: {text(w)}</p>')
    return section("model", "Model card", *parts)


def _analysis(d: ReportData) -> str:
    a = d.analysis
    disp = AnalysisDisplay.from_result(a)
    disp.model = ""  # the page's title names the model
    head = html_figure(_svg(disp), f"Per-layer × per-head norms {kind_badge(a.kind)}: the upper ends of "
                       f"certified intervals (target relative gap {a.rtol:g}; rounding accounted for). "
                       "B_KQ includes the softmax scale 1/√d_head.")
    keys = ["B_KQ", "B_V", "W_O", "B_W1", "B_W2", "B_b1", "B_b2", "B_b_attn"]
    if any(layer.B_Wgate is not None for layer in a.layers):
        keys.append("B_Wgate")
    rows = []
    for layer in a.layers:
        ivs = [getattr(layer, k) for k in keys]
        gaps = [iv.relative_gap for iv in ivs if iv is not None]
        rows.append([str(layer.index)] + ["–" if iv is None else fmt(iv.upper, 6, "up") for iv in ivs]
                    + [fmt(max(gaps), 2, "up")])  # a bound on the gap: up (red team 189)
    layer_table = table(["layer"] + [("‖W_O‖₂" if k == "W_O" else k) for k in keys] + ["max rel. gap"], rows,
                        numeric=[True] * (len(keys) + 2), raw=True,
                        caption=f"per layer: upper ends of certified intervals {kind_badge(a.kind)} (the lower "
                                "ends are within the last column's relative gap; both in the matrix table); "
                                "B_KQ, B_V are the maxima over heads, B_b_attn = ‖b_O + Σ_h b_V^h W_O^h‖₂")
    mrows = []
    for layer in a.layers:
        for role, m in layer.matrices.items():
            mrows.append((str(layer.index), text(role), f"<code>{text(m.tensor)}</code>" if m.tensor else "–",
                          "×".join(map(str, m.shape)),
                          *(f"{fmt(iv.lower, 8, 'down')} … {fmt(iv.upper, 8, 'up')}"
                            for iv in (m.spectral, m.frobenius, m.l21)),
                          kind_badge(m.spectral.kind)))
    for e in a.embeddings:
        m = e.norms
        mrows.append((e.where, text(e.name), "–", "×".join(map(str, m.shape)),
                      *(f"{fmt(iv.lower, 5, 'down')} … {fmt(iv.upper, 5, 'up')}"
                        for iv in (m.spectral, m.frobenius, m.l21)),
                      kind_badge(m.spectral.kind)))
    matrix_table = table(("layer", "matrix", "tensor", "shape", "‖·‖₂", "‖·‖_F", "‖·‖_{2,1}", "kind"),
                         mrows,
                         raw=True, numeric=(True, False, False, True, True, True, True, False),
                         caption="every matrix: spectral, Frobenius and (2,1) norms (row-vector convention "
                                 "x @ W; (2,1) = sum of column norms)")
    notes = "".join(f'<p class="note">note: {text(n)}</p>' for n in a.notes)
    return section("norms", "Certified norms (analyze)", head, layer_table,
                   f"<details><summary>all {len(mrows)} matrices</summary>{matrix_table}</details>", notes)


def _lipschitz(d: ReportData) -> str:
    b, lower, o = d.bounds, d.lower, d.options
    disp = LipschitzDisplay.from_bounds(b, lower)  # the page's title names the model
    where = "every stage, layer and the network" if o.lower_stages else "whole layers and the network"
    how = (f"empirical lower on {where}: best of {o.lower_samples} random start(s) and {o.lower_steps} ascent "
           f"steps on T={o.lower_seq_len} tokens (fast settings: a first look, far from tight; `transcover "
           "lipschitz` searches harder)" if o.lower else "empirical lower estimates skipped (--no-lower)")
    fig = html_figure(_svg(disp), f"certified upper {kind_badge('certified upper bound')} vs "
                      f"{kind_badge('empirical lower bound')}; {text(how)}")
    rows = []  # the stage uppers with the chain's rounding pad, as `lipschitz` prints them (red team 169)
    for kind, layer, comp, radius, upper, lv in lipschitz_rows(b, lower, b.n_layers):
        if comp == "network, worst R":
            continue
        label = "all" if kind == "network" else (str(layer) if kind == "layer" else layer_label(layer, b.n_layers))
        rows.append((label, "whole layer" if kind == "layer" else comp, radius if kind != "layer" else None, upper,
                     lv, None if not lv else upper / lv))
    tab = table(("layer", "component", "input radius", "certified upper", "empirical lower", "upper / lower"),
                rows, numeric=(True, False, True, True, True, True),
                ways=("near", "near", "up", "up", "down", "near"),  # a stage's certified input radius: up too
                caption=f"global Lipschitz constants, metric (2,∞) (max over tokens of ‖·‖₂), input tokens "
                        "with "
                        f"‖x‖₂ ≤ R = {b.radius:g}; layer 'input' is the embedding LayerNorm before layer 0")
    assumptions = "".join(f"<li>{text(x)}</li>" for x in b.upper.assumptions)
    return section("lipschitz", "Lipschitz constants (global)", fig, tab,
                   f"<p>assumptions of the certified upper bounds:</p><ul>{assumptions}</ul>")


def _way(header: str) -> str:
    """How a column named ``header`` is rounded when printed: upper bounds up, lower bounds down."""
    h = str(header).lower()
    return "up" if "upper" in h else ("down" if "lower" in h else "near")


# the at-the-data table's headers, by the rows' JSON keys (LocalRow.to_dict), as `transcover lipschitz --data` prints
# them; ratio is local/lower
_LOCAL_HEADERS = {"rho_factor": "ρ", "layer": "layer", "component": "component",
                  "global_upper": "global upper (R)", "domain_upper": "domain upper (σ₀)",
                  "local_upper": "local upper (ρ)", "point_upper": "upper at the point", "lower": "lower",
                  "point_lower": "point lower", "ratio": "local/lower",
                  "local_from_global": "global constant taken in"}


def _missing(v: object) -> bool:
    """Whether a table value is no number: None, NaN (or "nan" as the JSON writes it)."""
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and v.lower() == "nan")


def _local(d: ReportData) -> str:
    """The optional at-the-data block: rendered from ``local.to_dict()`` (``rows``, ``assumptions``)."""
    if d.local is None:
        if d.data_path is None:
            return ""
        return section("local", "Lipschitz constants at the data",
                       f'<p class="note">data {text(d.data_path)} given, but this build computes no local '
                       "bounds; the global bounds above hold on every input with token norms ≤ R.</p>")
    info = d.local.to_dict() if hasattr(d.local, "to_dict") else dict(d.local)
    rows = list(info.get("rows", []))
    # the rows' keys in their order, less a column with no number in any row (red team 222: point_upper, computed
    # for whole layers only, was an all-"nan" column); rounded by the key, shown under a header for people
    keys = [k for k in (rows[0] if rows else []) if not all(_missing(r.get(k)) for r in rows)]
    shown = [[("all" if k == "layer" and r.get(k) == -1 else r.get(k)) for k in keys] for r in rows]  # the network
    parts = [table([_LOCAL_HEADERS.get(k, k) for k in keys], shown,
                   numeric=[isinstance(rows[0].get(k), (int, float)) for k in keys],
                   ways=[_way(k) for k in keys],
                   caption=text(info.get("caption", "local bounds at the data")))]
    parts += [f"<p>assumption: {text(a)}</p>" for a in info.get("assumptions", [])]
    return section("local", "Lipschitz constants at the data", *parts)


def _bound(d: ReportData) -> str:
    r = d.bound
    if r is None:
        return section("bound", "Covering number and generalisation bound",
                       f'<p class="note">{text(d.bound_note or "no covering bound")}</p>')
    bd = BoundDisplay.from_result(r)
    bd.top_names = [plain(n, 40) for n in bd.top_names]
    bd.title = plain(bd.title)
    cov = CoveringDisplay.from_result(r)  # its plot escapes the title
    figs = [html_figure(_svg(bd), f"where log N comes from {kind_badge(r.kind)}: per layer and group, log10 of "
                                  "the summed log N_i with each layer's share of the total as text (left), and the "
                                  "largest terms log N_i (right)"),
            html_figure(_svg(cov), f"the certified covering bound against ε {kind_badge(r.kind)}")]
    terms = r.class_terms()  # shares of the whole class's log N, an MLP head's matrices as layer "head"
    by_layer: dict = {}
    for _, ly, _, share in terms:
        by_layer[ly] = by_layer.get(ly, 0.0) + share
    t_layers = table(("layer", "share of log N"), [(layer_label(k, r.n_layers), f"{100 * by_layer[k]:.3g} %")
                                                   for k in sorted(by_layer, key=layer_order)],
                     numeric=(False, True), caption="share of log N per layer")
    top = sorted(terms, key=lambda row: row[2].log_cost, reverse=True)[:15]
    t_top = table(("matrix", "layer", "group", "cover", "log₁₀ log N_i", "share"),
                  [(name, layer_label(ly, r.n_layers), c.group, c.cover, log10_up(c.log_cost, 5),
                    f"{100 * share:.3g} %") for name, ly, c, share in top],
                  numeric=(False, True, False, False, True, True),
                  caption="largest 15 contributions")
    g_rows = [(count_exact(g.n), up(g.gap, 4), log10_up(g.raw_log_gap, 5), g.vacuous) for g in r.generalisation]
    t_gen = table(("n", "gap bound (reported)", "log₁₀ raw formula", "vacuous (≥ loss range b)"), g_rows,
                  numeric=(True, True, True, False),
                  caption=f"generalisation gap, w.p. ≥ 1 − δ {kind_badge(r.kind)}")
    # eps and n as given, exactly: eps 0.123454 was shown to nearest as 0.12345, a cover at a smaller eps than
    # certified, and n 110384404 as 1.1e+08 (red team 215)
    head = (f"<p>log N_∞(ε = {fmt_eps(r.eps)}, n = {count_exact(r.generalisation[0].n)} × T = {r.seq_len}) ≤ "
            f"10^{log10_up(r.log_log_N, 4)} {kind_badge(r.kind)}, family {text(r.family)}"
            + (f" (route {text(r.route)}; every route: "
               + ", ".join(f"{text(k)} 10^{log10_up(v, 4)}" for k, v in sorted(r.routes.items()))
               + ")" if r.route else "") + "</p>")
    assumptions = "".join(f"<li>{text(x)}</li>" for x in r.assumptions)
    return section("bound", "Covering number and generalisation bound", head, *figs, t_layers, t_top, t_gen,
                   f"<p>assumptions:</p><ul>{assumptions}</ul>")


def _history(d: ReportData) -> str:
    if d.history is None:
        return ""
    disp = HistoryDisplay(d.history, plain(d.history_path or ""))
    return section("history", "Training monitor",
                   html_figure(_svg(disp), f"from {text(d.history_path)} ({len(d.history)} records), read as "
                               "recorded during training and not recomputed for this model: losses, accuracies "
                               "and gradient norms measured; sigma the exact largest singular values per group of "
                               "the weights the training forward used (certified markers: at evaluations); "
                               "capacity an estimate (F8)"))


def render_report(d: ReportData) -> str:
    """The HTML text of the report (deterministic for the same data)."""
    from .._version import __version__

    body = [f'<p class="note">transcover {text(__version__)}; every number carries its kind: '
            f'{kind_badge("certified interval")} {kind_badge("certified upper bound")} '
            f'{kind_badge("empirical lower bound")} {kind_badge("estimate")}. Timings: '
            + text(", ".join(f"{k} {v:.1f} s" for k, v in d.timings.items())) + "</p>",
            _model_card(d), _analysis(d), _lipschitz(d), _local(d), _bound(d), _history(d)]
    nav = [("model", "model"), ("norms", "norms"), ("lipschitz", "Lipschitz")]
    if "id=\"local\"" in body[4]:
        nav.append(("local", "local"))
    nav.append(("bound", "bound"))
    if d.history is not None:
        nav.append(("history", "training"))
    return page(f"transcover report: {d.model}", [b for b in body if b], nav)
