"""Views of the staged-strategy experiment (``transcover experiment staged``): table and figure.

The numbers are :class:`transcover.train.StagedResult`'s (its ``summary()``, per-run histories);
nothing here computes a bound.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["staged_table", "StagedDisplay"]

# the summary's columns whose values are certified upper bounds (the accuracies and losses are measured, the F8 proxy an
# estimate)
_CERTIFIED = {"lipschitz", "covering", "bound"}


def staged_table(result):
    """A rich Table: one row per strategy, mean ± std over seeds; final norms as max per group.

    The gap bound column shows the reported (clipped) bound, marked vacuous where the formula did
    not beat the loss range; the caption says so when that holds for every strategy.
    """
    from rich.table import Table

    from .._printed import fixed

    def cell(c: str, m: tuple) -> str:
        # a certified column's mean is printed rounded up (Note [printed bounds]; "2.413" stood for 10^2.4134443 =
        # 259.09 against a claimed 258.8, red team 188), measured and estimated ones to nearest; the spread to nearest
        # (a log10 or a mean formed in floats is padded for its own rounding first)
        mean = fixed(m[0] + abs(m[0]) * 2.0**-50, 3, "up") if c in _CERTIFIED else f"{m[0]:.3f}"
        return f"{mean}±{m[1]:.3f}"

    summ = result.summary()
    first = next(iter(summ.values()))
    cols = ["test_acc", "train_acc", "gap", "test_loss", "capacity"] + [c for c in ("lipschitz", "covering") if c in first]
    # biases are in the JSON; the table keeps the matrices' norms (what the radii pin down)
    norm_cols = [k for k in first if k.startswith("norm.") and k not in ("norm.b1", "norm.b2")]
    t = Table(title=f"staged strategy, {len(result.config.seeds)} seeds (mean ± std)")
    t.add_column("strategy")
    labels = {"test_acc": "test acc", "train_acc": "train acc", "gap": "gap (acc)", "test_loss": "test loss",
              "capacity": "log10 F8 proxy", "lipschitz": "log10 Lip(g_L)", "covering": "log10 logN(.1)"}
    for c in cols:
        t.add_column(labels.get(c, c), justify="right")
    has_bound = "bound" in first
    if has_bound:
        t.add_column("gap bound (reported; raw formula)", justify="right")
    t.add_column("final norms " + "/".join(c[5:] for c in norm_cols), justify="right")
    for name, m in summ.items():
        bound = []
        if has_bound:
            vac, raw = m["bound_vacuous"][0], m["bound_raw"][0]
            shown = "1 (vacuous)" if vac == 1.0 else cell("bound", m["bound"]) + (
                f" ({vac:.0%} vacuous)" if vac > 0 else "")
            bound = [f"{shown}; raw 10^{fixed(raw + abs(raw) * 2.0**-50, 3, 'up')}"]
        t.add_row(name, *[cell(c, m[c]) for c in cols], *bound,
                  "/".join(f"{m[c][0]:.2f}" for c in norm_cols))
    if has_bound:
        t.caption = result.bound_note()
    return t


@dataclass
class StagedDisplay:
    """Four panels: accuracy per epoch (mean over seeds; solid test, dotted train), final test
    accuracy and gap per strategy (mean ± std, seeds as dots), and the first seed's max ||W_KQ^h|| against
    the scheduled radius."""

    result: object
    figure_: object = field(default=None, repr=False)
    ax_: object = field(default=None, repr=False)

    @classmethod
    def from_result(cls, result) -> "StagedDisplay":
        return cls(result)

    def plot(self, ax=None) -> "StagedDisplay":
        from ._displays import _axes

        fig, axes = _axes(ax, 4, (17, 4), width_ratios=(3, 1.3, 1.3, 3))
        res = self.result
        summ = res.summary()
        for i, (name, runs) in enumerate(res.runs.items()):
            curves = [[(r["epoch"], r["test_acc"]) for r in run.history if r.get("test_acc") is not None]
                      for run in runs]
            epochs = [e for e, _ in curves[0]]
            mean = [statistics.fmean(c[j][1] for c in curves) for j in range(len(epochs))]
            axes[0].plot(epochs, mean, color=f"C{i}", label=name)
            tr = [[(r["epoch"], r["train_acc"]) for r in run.history if r.get("train_acc") is not None] for run in runs]
            axes[0].plot(epochs, [statistics.fmean(c[j][1] for c in tr) for j in range(len(epochs))],
                         color=f"C{i}", ls=":", lw=1)
            radius = [(r["step"], r["radius.KQ"]) for r in runs[0].history if r.get("radius.KQ") is not None]
            sigma = [(r["step"], r["sigma.KQ"]) for r in runs[0].history if r.get("loss") is not None]
            axes[3].plot([s for s, _ in sigma], [v for _, v in sigma], color=f"C{i}", lw=1, label=f"{name} sigma KQ")
            if radius:
                axes[3].plot([s for s, _ in radius], [v for _, v in radius], color=f"C{i}", ls="--", lw=1)
        names = list(summ)
        for j, n in enumerate(names):
            for a, key in ((axes[1], "test_acc"), (axes[2], "gap")):
                a.errorbar([j], [summ[n][key][0]], yerr=[summ[n][key][1]], fmt="o", color=f"C{j}", capsize=4)
                a.scatter([j] * len(res.runs[n]), [getattr(r, key) for r in res.runs[n]], color=f"C{j}",
                          s=8, alpha=0.5)
        for a, title in ((axes[1], "final test accuracy"), (axes[2], "gap (train - test acc.)")):
            a.set_xticks(range(len(names)), names, rotation=20)
            a.set_xlim(-0.5, len(names) - 0.5)
            a.set_title(title)
        axes[0].set_title("accuracy per epoch (solid test, dotted train)")
        axes[0].set_xlabel("epoch")
        axes[0].legend(fontsize=8)
        axes[3].set_yscale("log")
        axes[3].set_xlabel("step")
        axes[3].set_title("max ||W_KQ^h|| (solid, first seed) and radius (dashed)")
        axes[3].legend(fontsize=7)
        if ax is None:
            fig.tight_layout()
        self.figure_, self.ax_ = fig, axes
        return self


def write_staged_plot(result, path):
    """The staged figure written to ``path`` as PNG (atomically); returns the path."""
    from ._figures import display_bytes
    from ._io import atomic_write_bytes

    return atomic_write_bytes(path, display_bytes(StagedDisplay.from_result(result).plot(), path, fmt="png"))
