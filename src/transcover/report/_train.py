"""Views of ``transcover train`` results: the summary table, constraint warnings, the monitor figure.

Numbers come from :class:`transcover.train.TrainResult` and the monitor's history records;
printed upper bounds are rounded *up* (an upper bound stays an upper bound when printed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["train_table", "constraint_warnings", "TrainingDisplay", "round_up"]


def round_up(x: float, digits: int = 6) -> str:
    """``x`` rounded *up* to ``digits`` decimals: an upper bound stays an upper bound when printed (exactly, on the
    float's decimal expansion: ``ceil(x 10^d) / 10^d`` in floats could land below ``x``)."""
    from .._printed import fixed

    return fixed(x, digits, "up")


def constraint_warnings(result) -> list[str]:
    """One line per group whose forward weights exceeded the target (sigma / c > 1) during or after training."""
    lines = []
    for g, row in result.exceeded.items():
        during = row.get("max_ratio")
        if during is not None and during > 1.0:
            end = (f"the final model was projected exactly: certified sigma/c <= {round_up(row['ratio'])}"
                   if row["finalized"] and row["ratio"] is not None and row["ratio"] <= 1.0
                   else f"final sigma/c = {round_up(row['ratio'] if row['ratio'] is not None else row['sigma'] / row['target'])}")
            lines.append(f"warning: {g} exceeded its target during training: max sigma/c = {round_up(during)} at step "
                         f"{row['max_ratio_step']} (exact sigma of the weights used in the forward pass); {end}")
        elif row["ratio"] is not None and row["ratio"] > 1.0:
            lines.append(f"warning: {g} ends above its target: certified sigma/c = {round_up(row['ratio'])}")
    return lines


def train_table(result, task: str):
    """The run's measured losses and accuracies, exact and certified norms against their targets,
    and the certified Lipschitz, covering and gap bounds, each with its kind (a rich Table)."""
    from rich.table import Table

    from .._printed import for_kind

    t = Table(title=f"transcover train: {task} ({result.task_source})")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("target", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("kind")
    for label, v in (("train loss", result.train_loss), ("test loss", result.test_loss),
                     ("train accuracy", result.train_acc), ("test accuracy", result.test_acc),
                     ("generalisation gap", result.gap)):
        if v is not None:
            t.add_row(label, f"{v:.4f}", "", "", "measured")
    for g, v in result.norms.items():
        kind = "exact (l2 norm)" if g in ("b1", "b2") else "exact (float64 SVD)"
        row = result.constraints.get(g)
        if row is None:
            t.add_row(f"max norm {g}", f"{v:.4f}", "", "", kind)
            continue
        ratio = row["ratio"]
        certified = ratio is not None and ratio <= 1.0
        t.add_row(f"max norm {g}", f"{v:.4f}", f"{row['target']:.6g}", "" if ratio is None else round_up(ratio),
                  kind + (f"; certified <= {round_up(row['certified'])} <= target" if certified else
                          f"; certified upper {round_up(row['certified'])}"))
    t.add_row("capacity proxy (F8)", for_kind(result.capacity.value, result.capacity.kind), "", "",
              result.capacity.kind.value)
    if result.lipschitz is not None:
        t.add_row("Lip(g_L) (transcover.lipschitz)", for_kind(result.lipschitz.value, result.lipschitz.kind), "", "",
                  result.lipschitz.kind.value)
    if result.covering is not None:
        t.add_row("log10 log N(eps=0.1) (transcover.covering)", for_kind(result.covering.value, result.covering.kind),
                  "", "",
                  result.covering.kind.value)
    if result.bound is not None:
        vacuous = getattr(result.bound, "vacuous", False)
        raw = getattr(result.bound, "raw", result.bound.value)
        t.add_row("gap bound (transcover.covering)" + (" (vacuous: the trivial loss range)" if vacuous else ""),
                  for_kind(result.bound.value, result.bound.kind), "", "", result.bound.kind.value)
        t.add_row("  raw formula (before the clip at the loss range)", for_kind(raw, result.bound.kind), "", "",
                  "not a bound above the loss range" if vacuous else result.bound.kind.value)
    return t


@dataclass
class TrainingDisplay:
    """A training run's monitor in four panels: loss, accuracy, max sigma per group against its
    radius, and gradient norm with the capacity proxy (estimate) and the certified covering bound."""

    records: list[dict]
    title: str = ""
    figure_: object = field(default=None, repr=False)
    ax_: object = field(default=None, repr=False)

    @classmethod
    def from_result(cls, result, title: str = "") -> "TrainingDisplay":
        return cls(list(result.history), title)

    def _series(self, key):
        pts = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def plot(self, ax=None) -> "TrainingDisplay":
        from ._displays import _axes

        if ax is None:
            from ._figures import pyplot

            fig, grid = pyplot().subplots(2, 2, figsize=(11, 7))
            axes = list(grid.flat)
        else:
            fig, axes = _axes(ax, 4, None)
        a = axes[0]
        a.plot(*self._series("loss"), lw=0.6, alpha=0.5, label="step loss")
        for key in ("train_loss", "test_loss"):
            a.plot(*self._series(key), marker="o", ms=3, label=key.replace("_", " "))
        a.set_yscale("log")
        a.set_title("loss")
        a.legend(fontsize=8)
        a = axes[1]
        for key in ("train_acc", "test_acc"):
            a.plot(*self._series(key), marker="o", ms=3, label=key.replace("_", " "))
        a.set_title("accuracy")
        a.legend(fontsize=8)
        a = axes[2]
        groups = [k.split(".", 1)[1] for k in (self.records[0] if self.records else {}) if k.startswith("sigma.")]
        for i, g in enumerate(groups):
            a.plot(*self._series(f"sigma.{g}"), color=f"C{i}", lw=1, label=f"sigma {g}")
            xs, ys = self._series(f"radius.{g}")
            if xs:
                a.plot(xs, ys, color=f"C{i}", ls="--", lw=1)
            xs, ys = self._series(f"certified.{g}")  # measure_model at evaluations (Note [certified columns])
            if xs:
                a.plot(xs, ys, color=f"C{i}", ls="none", marker="^", ms=4)
        a.set_yscale("log")
        a.set_title("max sigma per group (solid), radius (dashed), certified upper (triangles)")
        a.legend(fontsize=7, ncol=2)
        a = axes[3]
        a.plot(*self._series("grad_norm"), lw=0.6, label="grad norm")
        a.plot(*self._series("capacity"), lw=1, label="capacity proxy (F8, estimate)")
        xs, ys = self._series("log_covering")
        if xs:
            a.plot(xs, [10.0**y for y in ys], marker="s", ms=3, lw=1, label="log N(0.1), certified (covering)")
        a.set_yscale("log")
        a.set_title("gradient norm, capacity proxy, covering bound")
        a.legend(fontsize=8)
        for a in axes:
            a.set_xlabel("step")
        if self.title:
            fig.suptitle(self.title)
        if ax is None:
            fig.tight_layout()
        self.figure_, self.ax_ = fig, axes
        return self
