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


def _radius(row: dict) -> float:
    """The radius in force of a constraint row (rows stored before red team 207 called it ``target``)."""
    return row.get("radius", row["target"])


def _unfinished(result) -> str | None:
    """One warning line for a constrained run stopped before its schedule ended (``--stop-after``), else None.

    Such a run's radii in force are the schedule's at the last step, looser than the requested ones, and the
    exact projection at the end has not run; the table showed the loose radius as "target" with no word (red
    team 207).
    """
    done, total = result.epochs_done, result.config.epochs
    if not result.constraints or done >= total:
        return None
    loose: dict[tuple[float, float], list[str]] = {}  # (radius in force, target) -> groups
    for g, r in result.constraints.items():
        if _radius(r) != r["target"]:
            loose.setdefault((_radius(r), r["target"]), []).append(g)
    if loose:
        what = "the radius schedule is unfinished and the requested radii are not reached yet (" + "; ".join(
            f"{', '.join(gs)}: radius in force {c:.6g}, target {target:.6g}" for (c, target), gs in loose.items()) + ")"
    elif result.config.constraint.method in ("spectral", "project"):
        what = "the exact, certified projection onto the requested radii (at the end of training) has not run"
    else:
        return None
    return f"warning: training stopped after epoch {done} of {total}: {what}; --resume continues the run"


def constraint_warnings(result) -> list[str]:
    """One line per group whose forward weights exceeded the radius in force (sigma / c > 1) during or after
    training, and one for a run stopped before its radius schedule ended."""
    lines = [line] if (line := _unfinished(result)) is not None else []
    for g, row in result.exceeded.items():
        during = row.get("max_ratio")
        if during is not None and during > 1.0:
            final = row["ratio"] if row["ratio"] is not None else row["sigma"] / _radius(row)
            end = (f"the final model was projected exactly: certified sigma/c <= {round_up(row['ratio'])}"
                   if row["finalized"] and row["ratio"] is not None and row["ratio"] <= 1.0
                   else f"final sigma/c = {round_up(final)}")
            lines.append(f"warning: {g} exceeded its target during training: max sigma/c = {round_up(during)} at step "
                         f"{row['max_ratio_step']} (exact sigma of the weights used in the forward pass); {end}")
        elif row["ratio"] is not None and row["ratio"] > 1.0:
            lines.append(f"warning: {g} ends above its target: certified sigma/c = {round_up(row['ratio'])}")
    return lines


def train_table(result, task: str):
    """The run's measured losses and accuracies, exact and certified norms against their radii,
    and the certified Lipschitz, covering and gap bounds, each with its kind (a rich Table).

    A constrained group's row is one slot's (the worst ``certified / radius``, named with its layer): value,
    radius, ratio and certificate all of that slot; the group's largest norm, when another layer's, is a row of
    its own.  (Red team 207: the group maximum 2.0 beside another layer's radius 0.3 read "certified <= 0.3".)
    The radius column is the radius in force; a run stopped before its schedule ended also gets a "final
    target" column with the requested radii (red team 207: the loose radius was shown as the target).
    """
    from rich.markup import escape
    from rich.table import Table

    from .._printed import for_kind

    final = any(_radius(r) != r["target"] for r in result.constraints.values())
    t = Table(title=f"transcover train: {escape(str(task))} ({escape(str(result.task_source))})")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("radius in force", justify="right")
    if final:
        t.add_column("final target", justify="right")
    t.add_column("ratio", justify="right")
    t.add_column("kind")

    def add(label: str, value: str, kind: str, radius: str = "", target: str = "", ratio: str = "") -> None:
        t.add_row(label, value, radius, *((target,) if final else ()), ratio, kind)

    for label, v in (("train loss", result.train_loss), ("test loss", result.test_loss),
                     ("train accuracy", result.train_acc), ("test accuracy", result.test_acc),
                     ("generalisation gap", result.gap)):
        if v is not None:
            add(label, f"{v:.4f}", "measured")
    for g, v in result.norms.items():
        kind = "exact (l2 norm)" if g in ("b1", "b2") else "exact (float64 SVD)"
        row = result.constraints.get(g)
        if row is None:
            add(f"max norm {g}", f"{v:.4f}", kind)
            continue
        ratio, sigma = row["ratio"], row["sigma"]
        certified = ratio is not None and ratio <= 1.0
        where = f" (layer {row['layer']})" if "layer" in row else ""
        add(f"norm {g}{where}", f"{sigma:.4f}", kind + (
                f"; certified <= {round_up(row['certified'])} <= radius" if certified else
                f"; certified upper {round_up(row['certified'])}"),
            f"{_radius(row):.6g}", f"{row['target']:.6g}", "" if ratio is None else round_up(ratio))
        if v > sigma:  # another layer holds the group's largest norm (under its own radius)
            add(f"max norm {g} (all layers)", f"{v:.4f}", kind)
    add("capacity proxy (F8)", for_kind(result.capacity.value, result.capacity.kind), result.capacity.kind.value)
    if result.lipschitz is not None:
        add("Lip(g_L) (transcover.lipschitz)", for_kind(result.lipschitz.value, result.lipschitz.kind),
            result.lipschitz.kind.value)
    if result.covering is not None:
        add("log10 log N(eps=0.1) (transcover.covering)", for_kind(result.covering.value, result.covering.kind),
            result.covering.kind.value)
    if result.bound is not None:
        vacuous = getattr(result.bound, "vacuous", False)
        raw = getattr(result.bound, "raw", result.bound.value)
        add("gap bound (transcover.covering)" + (" (vacuous: the trivial loss range)" if vacuous else ""),
            for_kind(result.bound.value, result.bound.kind), result.bound.kind.value)
        add("  raw formula (before the clip at the loss range)", for_kind(raw, result.bound.kind),
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
