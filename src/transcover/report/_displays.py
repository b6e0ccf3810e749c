"""Figures of results in the scikit-learn display style: ``Display.from_result(r).plot(ax=None)``.

Each display holds the numbers it draws (plain arrays, so it can be built from a saved JSON as
well), ``plot`` draws them on ``ax`` (a new figure when ``None``) and returns the display with
``figure_`` and ``ax_`` set.  Titles use matplotlib mathtext; every title names the kind of the
numbers drawn (certified upper, empirical lower, estimate).  matplotlib is imported on first
``plot`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .._printed import count_exact, for_kind
from ._figures import pyplot
from ._html import plain

__all__ = ["AnalysisDisplay", "LipschitzDisplay", "PerturbationDisplay", "BoundDisplay", "CoveringDisplay",
           "HistoryDisplay", "layer_label"]


def layer_order(layer: int | str) -> tuple[bool, int]:
    """A sort key for layer indices and names: the indices in order, then the names (an MLP head's "head")."""
    return (isinstance(layer, str), layer if isinstance(layer, int) else 0)


def layer_label(layer: int | str, n_layers: int | None = None) -> str:
    """Layer indices as people read them: -1 is the input (embedding) stage, n_layers the output; a name (an MLP
    head's ``"head"``) as it is."""
    if isinstance(layer, str):
        return layer
    if layer == -1:
        return "input"
    if layer == -2:
        return "network"
    if n_layers is not None and layer >= n_layers:
        return "output"
    return str(layer)


def _axes(ax, n: int, figsize, width_ratios=None):
    plt = pyplot()
    if ax is None:
        kw = {} if width_ratios is None else {"gridspec_kw": {"width_ratios": list(width_ratios)}}
        fig, axes = plt.subplots(1, n, figsize=figsize, squeeze=False, **kw)
        return fig, list(axes[0])
    axes = list(np.atleast_1d(ax))
    if len(axes) != n:
        from .._errors import InputError

        raise InputError(f"this display draws {n} panel(s); pass that many axes, not {len(axes)}")
    return axes[0].figure, axes


# Note [log span]: the most decades one log axis shows.  A float32 model at its dtype's edge had lowers of 2.5e-78
# beside a network upper of 2.0e264; matplotlib's tick formatter overflowed on the 342 decades (red team 189: the
# report ended in an internal error).  Bars below the floor are cut at it; every value stays in the tables.
LOG_SPAN = 200


def log_limits(a, values) -> None:  # noqa: ANN001
    """A log y-axis on ``a`` over the positive finite ``values`` with half a decade of room, at most ``LOG_SPAN``
    decades below the largest (Note [log span]).  The limits are set first: matplotlib's autoscaling on switching to
    log overflowed in its margins near 1e300."""
    from matplotlib.ticker import LogLocator

    class FiniteLogLocator(LogLocator):  # ticks a decade stride past 1e300 are inf; the formatter raised on them
        def tick_values(self, vmin, vmax):  # noqa: ANN001, ANN202
            with np.errstate(over="ignore"):
                t = super().tick_values(vmin, vmax)
            return t[np.isfinite(t)]

    v = np.asarray(values, float)
    v = v[np.isfinite(v) & (v > 0)]
    if v.size:
        top = min(float(v.max()) * 10**0.5, np.finfo(float).max)
        a.set_ylim(max(float(v.min()) / 10**0.5, top / 10.0**LOG_SPAN), top)
    a.set_yscale("log")
    a.yaxis.set_major_locator(FiniteLogLocator())
    a.yaxis.set_minor_locator(FiniteLogLocator(subs="auto"))


@dataclass
class AnalysisDisplay:
    """Per-layer x per-head heatmaps of ``B_KQ`` and ``B_V`` (upper ends of certified intervals)."""

    B_KQ: np.ndarray  # (layers, heads)
    B_V: np.ndarray
    model: str = ""
    kind: str = "certified interval"
    figure_: object = field(default=None, repr=False)
    ax_: object = field(default=None, repr=False)

    @classmethod
    def from_result(cls, result) -> "AnalysisDisplay":
        kq = np.array([[h.B_KQ.upper for h in layer.heads] for layer in result.layers], dtype=float)
        ov = np.array([[h.B_V.upper for h in layer.heads] for layer in result.layers], dtype=float)
        return cls(kq, ov, result.model, result.kind.value)

    def plot(self, ax=None, *, annotate: bool | None = None, cmap: str = "viridis") -> "AnalysisDisplay":
        L, H = self.B_KQ.shape
        fig, axes = _axes(ax, 2, (max(8.0, 0.9 * H + 3), max(3.0, 0.45 * L + 1.6)))
        annotate = (L * H <= 400) if annotate is None else annotate
        what = "upper end of certified interval" if "certified" in self.kind else "estimate, not certified"
        titles = (r"$B_{KQ}^{(\ell,h)} = \|W_Q^h W_K^{h\top}\|_2/\sqrt{d_h}$",
                  r"$B_V^{(\ell,h)} = \|W_V^h W_O^h\|_2$")
        for a, M, title in zip(axes, (self.B_KQ, self.B_V), titles):
            im = a.imshow(M, cmap=cmap, aspect="auto")
            a.set_title(f"{title}\n({what})", fontsize=10)
            a.set_xlabel("head $h$")
            a.set_ylabel(r"layer $\ell$")
            a.set_xticks(range(H))
            a.set_yticks(range(L))
            fig.colorbar(im, ax=a, fraction=0.046, pad=0.03)
            if annotate:
                lo, hi = float(np.nanmin(M)), float(np.nanmax(M))
                mid = (lo + hi) / 2
                for i in range(L):
                    for j in range(H):
                        a.text(j, i, for_kind(M[i, j], self.kind, 3), ha="center", va="center", fontsize=6.5,
                               color="black" if M[i, j] > mid else "white")
        if ax is None and self.model:
            fig.suptitle(plain(self.model), fontsize=11, y=1.06)  # above the two-line panel titles
        self.figure_, self.ax_ = fig, axes
        return self


@dataclass
class LipschitzDisplay:
    """Certified upper vs empirical lower Lipschitz constants per stage (log scale)."""

    labels: list[str]
    upper: np.ndarray
    lower: np.ndarray  # NaN where no lower estimate was measured
    title: str = ""
    figure_: object = field(default=None, repr=False)
    ax_: object = field(default=None, repr=False)

    @classmethod
    def from_bounds(cls, bounds, lower: dict | None = None, *, model: str = "") -> "LipschitzDisplay":
        lower = lower or {}
        short = {"input_norm": "norm", "attention": "attn", "norm_attn": "norm1", "ffn": "ffn",
                 "norm_ffn": "norm2", "final_norm": "norm"}
        labels, up, lo = [], [], []
        for s in bounds.stages:
            labels.append(f"{layer_label(s.layer, bounds.n_layers)}·{short.get(s.name, s.name)}")
            up.append(s.lipschitz)
            e = lower.get((s.layer, s.name))
            lo.append(np.nan if e is None else e.value.value)
        for i in range(bounds.n_layers):  # whole layers, then the network: where lowers are cheapest
            labels.append(f"layer {i}")
            up.append(bounds.layer_upper(i).value)
            e = lower.get((i, "layer"))
            lo.append(np.nan if e is None else e.value.value)
        labels.append("network")
        up.append(bounds.upper.value)
        e = lower.get((-2, "network"))
        lo.append(np.nan if e is None else e.value.value)
        return cls(labels, np.array(up, float), np.array(lo, float), model)

    from_result = from_bounds

    def plot(self, ax=None) -> "LipschitzDisplay":
        """Two panels: the stages (left) and the whole layers and network (right), each on its own
        log axis: the network's product bound is ~100 decades above any stage and would flatten them."""
        split = next((k for k, lab in enumerate(self.labels) if lab.startswith("layer ")), len(self.labels))
        n_left, n_right = split, max(1, len(self.labels) - split)
        fig, axes = _axes(ax, 2, (max(9.0, 0.3 * len(self.labels) + 3), 3.8), width_ratios=(n_left, n_right + 2))
        for a, sl in zip(axes, (slice(0, split), slice(split, None))):
            labels, up, lo = self.labels[sl], self.upper[sl], self.lower[sl]
            x = np.arange(len(labels))
            fin = np.isfinite(up)  # an upper that overflows float64 is drawn as "∞" at the top, not as a bar
            a.bar(x[fin] - 0.2, up[fin], width=0.4, color="C0", label="certified upper (F6/F7/F8/F14)")
            for xi in x[~fin]:
                a.text(xi - 0.2, 0.98, "∞", transform=a.get_xaxis_transform(), ha="center", va="top", color="C0")
            if np.isfinite(lo).any():
                a.bar(x + 0.2, np.where(np.isfinite(lo), lo, np.nan), width=0.4, color="C1",
                      label="empirical lower (witness pair)")
            if (up[fin] > 0).any() or (np.isfinite(lo) & (lo > 0)).any():
                log_limits(a, np.concatenate([up, lo]))
            a.set_xticks(x)
            a.set_xticklabels(labels, rotation=70, fontsize=7)
            a.grid(axis="y", alpha=0.3)
        axes[0].set_ylabel(r"Lipschitz constant $L$")
        axes[0].set_title(r"per stage: certified upper $\geq L$", fontsize=10)
        axes[1].set_title(r"layers, network: upper $\geq L \geq$ lower", fontsize=10)
        # right of the plots: bars reach the top of both panels, tick labels fill the bottom
        axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        if ax is None and self.title:
            fig.suptitle(plain(self.title), fontsize=10, y=1.04)  # above the panel titles
        self.figure_, self.ax_ = fig, axes
        return self


@dataclass
class PerturbationDisplay:
    """Lemma G.3: the certified bound's contribution per layer (sum of c_i ||dW_i||), and the total
    beside the measured output change (an empirical lower bound of the same supremum)."""

    layers: list[str]
    contributions: np.ndarray
    total: float
    lower: float = math.nan  # NaN when no change was measured
    title: str = ""
    figure_: object = field(default=None, repr=False)
    ax_: object = field(default=None, repr=False)

    @classmethod
    def from_result(cls, bound, lower: float | None = None, *, n_layers: int | None = None,
                    model: str = "") -> "PerturbationDisplay":
        by_layer = bound.by_layer()
        labels = [layer_label(k, n_layers) for k in by_layer]
        return cls(labels, np.array(list(by_layer.values()), float), float(bound.total.value),
                   math.nan if lower is None else float(lower), model)

    def plot(self, ax=None) -> "PerturbationDisplay":
        fig, axes = _axes(ax, 2, (9.0, 3.6), width_ratios=(max(len(self.layers), 2), 2))
        x = np.arange(len(self.layers))
        pos = np.where(self.contributions > 0, self.contributions, np.nan)
        axes[0].bar(x, pos, color="C0", label="certified upper (Lemma G.3, F6-F8)")
        log_limits(axes[0], pos)
        axes[0].set_xticks(x)
        axes[0].set_xticklabels(self.layers, fontsize=8)
        axes[0].set_xlabel("layer")
        axes[0].set_ylabel(r"$\sum_i c_i \|\Delta W_i\|$")
        axes[0].set_title("bound per layer", fontsize=10)
        axes[0].grid(axis="y", alpha=0.3)
        vals = [self.total] + ([self.lower] if math.isfinite(self.lower) and self.lower > 0 else [])
        names = ["certified upper", "measured lower"][: len(vals)]
        axes[1].bar(np.arange(len(vals)), vals, color=["C0", "C1"][: len(vals)])
        log_limits(axes[1], vals)
        axes[1].set_xticks(np.arange(len(vals)))
        axes[1].set_xticklabels(names, fontsize=8)
        axes[1].set_title(r"$\sup_X \|g_A(X) - g_B(X)\|$", fontsize=10)
        axes[1].grid(axis="y", alpha=0.3)
        if ax is None and self.title:
            fig.suptitle(plain(self.title), fontsize=10, y=1.04)
        self.figure_, self.ax_ = fig, axes
        return self


@dataclass
class BoundDisplay:
    """Where ``log N`` comes from: per layer and group (log10 of the summed log N_i, share as text),
    and the largest matrices."""

    layers: list[str]
    groups: list[str]
    shares: np.ndarray  # (layers, groups), fractions of the Transformer's log N
    log10_parts: np.ndarray  # (layers, groups): log10 of the sum of log N_i over the cell (-inf: empty)
    top_names: list[str]
    top_log10: np.ndarray  # log10 of each top matrix's log N_i
    title: str = ""
    figure_: object = field(default=None, repr=False)
    ax_: object = field(default=None, repr=False)

    @classmethod
    def from_result(cls, result, top: int = 12) -> "BoundDisplay":
        terms = result.class_terms()  # shares of the whole class's log N, an MLP head's matrices as layer "head"
        layer_ids = sorted({ly for _, ly, _, _ in terms}, key=layer_order)
        groups = sorted({t.group for _, _, t, _ in terms})
        shares = np.zeros((len(layer_ids), len(groups)))
        ln_parts = np.full((len(layer_ids), len(groups)), -np.inf)
        for _, ly, t, share in terms:
            i, j = layer_ids.index(ly), groups.index(t.group)
            shares[i, j] += share
            ln_parts[i, j] = np.logaddexp(ln_parts[i, j], t.log_cost)
        best = sorted(terms, key=lambda r: r[2].log_cost, reverse=True)[:top]
        return cls([layer_label(i, result.n_layers) for i in layer_ids], groups, shares, ln_parts / math.log(10),
                   [name for name, *_ in best], np.array([t.log_cost / math.log(10) for _, _, t, _ in best]),
                   f"{result.model}, eps={result.eps!r}")

    def plot(self, ax=None) -> "BoundDisplay":
        fig, (a1, a2) = _axes(ax, 2, (12.0, 4.2))
        # log N spans hundreds of decades between layers (later layers' errors are amplified by fewer
        # Lipschitz factors), so a linear share axis shows one bar; log10 of each cell's log N shows all
        y = np.arange(len(self.layers))
        width = 0.8 / max(1, len(self.groups))
        for j, g in enumerate(self.groups):
            vals = np.where(np.isfinite(self.log10_parts[:, j]), self.log10_parts[:, j], np.nan)
            a1.barh(y + (j - (len(self.groups) - 1) / 2) * width, vals, height=width, label=g, color=f"C{j}")
        total = self.shares.sum(axis=1)
        xmax = np.nanmax(np.where(np.isfinite(self.log10_parts), self.log10_parts, np.nan))
        for i, s in enumerate(total):
            a1.text(xmax * 1.02, i, f"{100 * s:.3g}%", va="center", fontsize=7)
        a1.set_xlim(right=xmax * 1.22)
        a1.set_yticks(y)
        a1.set_yticklabels(self.layers)
        a1.invert_yaxis()
        a1.set_xlabel(r"$\log_{10} \sum_i \log N_i$ over the layer's matrices of a group")
        a1.set_ylabel("layer")
        a1.set_title(r"$\log \mathcal{N}_\infty(\varepsilon)$ by layer and group (text: share)", fontsize=10)
        a1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.2), ncol=3)  # below: bars fill the box
        y2 = np.arange(len(self.top_names))
        a2.barh(y2, self.top_log10, color="C3")
        a2.set_yticks(y2)
        a2.set_yticklabels(self.top_names, fontsize=7)
        a2.invert_yaxis()
        a2.set_xlabel(r"$\log_{10} \log N_i$ (certified upper)")
        a2.set_title("largest contributions (matrices)", fontsize=10)
        if ax is None:
            fig.subplots_adjust(wspace=0.45)  # room for the matrix names between the panels
        self.figure_, self.ax_ = fig, (a1, a2)
        return self


@dataclass
class CoveringDisplay:
    """The certified covering bound as a function of eps (log-log), at the result's n and T."""

    eps: np.ndarray
    log10_log_N: np.ndarray
    eps0: float
    title: str = ""
    figure_: object = field(default=None, repr=False)
    ax_: object = field(default=None, repr=False)

    @classmethod
    def from_result(cls, result, *, decades: tuple[float, float] = (-3.0, 1.0), num: int = 29) -> "CoveringDisplay":
        n0 = result.generalisation[0].n if result.generalisation else 1.0
        eps = np.logspace(*decades, num) * result.eps
        vals = np.array([result.curve(float(e), n0) for e in eps]) / math.log(10)
        return cls(eps, vals, result.eps,
                   f"{result.model}: n={count_exact(n0)}, T={result.seq_len}, family={result.family}")

    def plot(self, ax=None) -> "CoveringDisplay":
        fig, (a,) = _axes(ax, 1, (6.0, 3.8))
        a.plot(self.eps, self.log10_log_N, "o-", ms=3, label="certified upper")
        a.axvline(self.eps0, color="grey", ls=":", label=rf"$\varepsilon$ = {self.eps0!r}")
        a.set_xscale("log")
        a.set_xlabel(r"$\varepsilon$")
        a.set_ylabel(r"$\log_{10}\,\log \mathcal{N}_\infty(\varepsilon)$")
        a.set_title(f"covering bound\n{plain(self.title)}", fontsize=10)  # a model's path: no mathtext (215)
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
        self.figure_, self.ax_ = fig, a
        return self


@dataclass
class HistoryDisplay:
    """A training run's monitor: loss, accuracy, sigma per group (with radius), gradient norm."""

    records: list[dict]
    title: str = ""
    figure_: object = field(default=None, repr=False)
    ax_: object = field(default=None, repr=False)

    @classmethod
    def from_file(cls, path) -> "HistoryDisplay":
        from ..constrain import read_history

        return cls(read_history(path), "")

    def _series(self, key):
        pts = [(r.get("step", i), r[key]) for i, r in enumerate(self.records)
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return [p[0] for p in pts], [p[1] for p in pts]

    def plot(self, ax=None) -> "HistoryDisplay":
        fig, axes = _axes(ax, 4, (14.0, 3.4))
        keys = sorted({k for r in self.records for k in r})
        panels = (("loss", [k for k in keys if "loss" in k], True),
                  ("accuracy", [k for k in keys if k.endswith("acc")], False),
                  (r"$\max_\ell \sigma$ per group (—), radius (- -), certified (▲)",
                   [k for k in keys if k.startswith(("sigma.", "radius.", "certified."))], True),
                  ("gradient norm, capacity (estimate)", [k for k in keys if k in ("grad_norm", "capacity")], True))
        for a, (title, ks, log) in zip(axes, panels):
            drawn = False
            for i, k in enumerate(ks):
                xs, ys = self._series(k)
                if not xs:
                    continue
                group = k.split(".", 1)[-1]
                color = f"C{sorted({x.split('.', 1)[-1] for x in ks}).index(group) % 10}" if "." in k else f"C{i}"
                certified = k.startswith("certified.")  # certified upper ends, at evaluations only: markers
                a.plot(xs, ys, lw=1, ls="none" if certified else "--" if k.startswith("radius.") else "-",
                       marker="^" if certified else None, color=color, label=plain(k, 30))
                drawn = True
            if drawn and log and all(v > 0 for k in ks for v in self._series(k)[1]):
                a.set_yscale("log")
            a.set_title(title, fontsize=10)
            a.set_xlabel("step")
            if drawn:
                a.legend(fontsize=6)
        self.figure_, self.ax_ = fig, axes
        return self
