"""Views of ``transcover.cover`` results: the table per mode and log N against eps.

The numbers come from :class:`transcover._api_results.CoverResult`; nothing here computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["cover_table", "EmpiricalCoveringDisplay", "CoveringCurveDisplay", "fmt_eps"]


def fmt_eps(e: float) -> str:
    """eps as the shortest string that reads back to the same float (0.999999999, not "1")."""
    return repr(float(e))


def _q(q: float) -> str:
    return "inf" if q == math.inf else str(int(q))


def cover_table(result):
    """A rich Table of ``result`` (one row per eps), caption included."""
    from rich.markup import escape
    from rich.table import Table

    from .._printed import for_kind

    r = result
    if r.mode == "finite":
        M, n, b = r.shape
        table = Table(title=f"{escape(str(r.source))}: M={M} functions, n={n} samples, b={b} outputs, q={_q(r.q)}")
        for c in ("eps", "packing (lower)", "net (upper)", "log N in") + (("exact N_int",) if r.exact is not None else ()):
            table.add_column(c, justify="right")
        for i, (e, est) in enumerate(zip(r.eps, r.estimates)):
            cells = [fmt_eps(e), str(est.packing_size), str(est.net_size),
                     f"\\[{for_kind(est.lower.value, est.lower.kind, 4)}, "
                     f"{for_kind(est.upper.value, est.upper.kind, 4)}]"]
            if r.exact is not None:
                cells.append(str(r.exact[i]))
            table.add_row(*cells)
        return table
    if r.mode == "uniform":
        M, n, _ = r.shape
        table = Table(title=f"{escape(r.description)}\nuniform search: n={n}, M={M}, q={_q(r.q)}")
        for c in ("eps", "random-set packings", "greedy-set packings", "best (lower N_inf(F,eps,n))"):
            table.add_column(c, justify="right")
        for e, res in zip(r.eps, r.searches):
            table.add_row(fmt_eps(e), str(list(res.random_packings)), str(list(res.greedy_packings)),
                          str(res.best_packing))
        rel = max((res.rel_pad for res in r.searches), default=0.0)
        if rel > 0:
            table.caption = _pad_note(rel)
        return table
    mc = r.monte_carlo
    _, n, T = r.shape
    table = Table(title=f"{escape(r.description)}\nM={mc.n_functions}, n={n} x T={T}, q={_q(r.q)}")
    for c in ("eps", "packing (lower N_ext)", "net (lower packing no.)", "log N estimate", "note"):
        table.add_column(c, justify="right")
    for e, eps in enumerate(mc.eps):
        note = "saturated" if mc.saturated(e) else ("still growing with M" if mc.still_growing(e) else "")
        table.add_row(fmt_eps(eps), str(mc.packing_sizes[e][-1]), str(mc.net_sizes[e][-1]),
                      f"{mc.log_N_estimate(e).value:.3f}", note)
    if r.fit is not None:
        table.caption = (f"fitted log N ~ eps^-{r.fit.alpha:.2f} (norm-based bound: eps^-2); "
                         f"log N ~ {r.fit.p_eff:.1f} log(1/eps) (parameter counting)")
    else:
        table.caption = f"no growth fit: {r.fit_error}"
    if mc.rel_pad > 0:
        table.caption += "\n" + _pad_note(mc.rel_pad)
    return table


def _pad_note(rel: float) -> str:
    """The footnote of the forward-accuracy assumption behind the lower bounds (THEORY F109)."""
    return (f"lower bounds assume each float64 output within {rel:g} max|output| of the exact one (THEORY F109): "
            "pairs closer than that margin count as not separated")


@dataclass
class EmpiricalCoveringDisplay:
    """log N against eps of an empirical covering estimate: the upper curve (finite: the greedy net,
    a certificate for the finite set; Monte Carlo: the net; uniform: the best packing found) beside
    the lower one (packing / random-set packing)."""

    eps: np.ndarray
    upper: np.ndarray
    lower: np.ndarray
    label: str
    figure_: object = field(default=None, repr=False)
    ax_: object = field(default=None, repr=False)

    @classmethod
    def from_result(cls, result) -> "EmpiricalCoveringDisplay":
        r = result
        if r.mode == "finite":
            rows = result.to_dict()["rows"]
            up = [row["log_N_upper"]["value"] for row in rows]
            lo = [row["log_N_lower"]["value"] for row in rows]
            label = str(r.source)
        elif r.mode == "uniform":
            up = [math.log(s.best_packing) for s in r.searches]
            lo = [math.log(max(s.random_packings)) for s in r.searches]
            label = "uniform"
        else:
            mc = r.monte_carlo
            up = list(np.log([s[-1] for s in mc.net_sizes]))
            lo = list(np.log([s[-1] for s in mc.packing_sizes]))
            label = r.mode
        return cls(np.array(r.eps, float), np.array(up, float), np.array(lo, float), label)

    def plot(self, ax=None) -> "EmpiricalCoveringDisplay":
        from ._displays import _axes
        from ._html import plain

        fig, (a,) = _axes(ax, 1, (6.0, 4.0))
        import matplotlib.ticker

        label = plain(self.label)  # a file's path: no mathtext (red team 215)
        a.plot(self.eps, self.upper, "o-", label=f"{label}: net / best")
        a.plot(self.eps, self.lower, "v--", label=f"{label}: packing / random")
        a.set_xscale("log")
        a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # labelled minor ticks overlap
        a.set_xticks(list(self.eps), [fmt_eps(e) for e in self.eps])
        a.set_xlabel(r"$\varepsilon$")
        a.set_ylabel(r"$\log N(\varepsilon)$")
        a.legend(fontsize=8)
        self.figure_, self.ax_ = fig, a
        return self


@dataclass
class CoveringCurveDisplay:
    """log N(eps): Monte-Carlo estimate (net), lower bound (packing) and, where given, a bound."""

    eps: np.ndarray
    log_net: np.ndarray
    log_packing: np.ndarray
    label: str = ""
    bound_eps: np.ndarray | None = None
    log_bound: np.ndarray | None = None
    ax: object = None

    @classmethod
    def from_result(cls, mc, label: str = "", bound=None) -> "CoveringCurveDisplay":
        eps = np.asarray(mc.eps)
        net = np.log([s[-1] for s in mc.net_sizes])
        pack = np.log([s[-1] for s in mc.packing_sizes])
        be = lb = None
        if bound is not None:
            be, lb = np.asarray(bound[0], float), np.asarray(bound[1], float)
        return cls(eps, net, pack, label, be, lb)

    def plot(self, ax=None, *, color=None) -> "CoveringCurveDisplay":
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots()
        (line,) = ax.plot(self.eps, self.log_net, "o-", color=color, label=f"{self.label} estimate (net)")
        c = line.get_color()
        ax.plot(self.eps, self.log_packing, "v--", color=c, alpha=0.7, label=f"{self.label} lower (packing)")
        if self.log_bound is not None:
            ax.plot(self.bound_eps, self.log_bound, ":", color=c, lw=2, label=f"{self.label} bound")
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("eps")
        ax.set_ylabel("log N(eps)")
        self.ax = ax
        return self
