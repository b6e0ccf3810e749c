"""The non-vacuous experiment's figure (``transcover experiment nonvacuous --plot``): certified
bounds (finite-class kl, covering/Dudley) and the measured test error against the sample size."""

from __future__ import annotations

import io
from pathlib import Path

__all__ = ["write_nonvacuous_plot"]


def write_nonvacuous_plot(result, path: str | Path) -> Path:
    """Certified bounds and measured test error against n, written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .._io import atomic_write_bytes

    fig, ax = plt.subplots(figsize=(10, 4.5))
    markers = {"majority": "o", "majority-noise": "s", "digits": "D"}

    def series(c) -> str:
        return c.task if c.split is None else f"{c.task}, split prior"

    for task in dict.fromkeys(series(c) for c in result.cases):
        cs = sorted((c for c in result.cases if series(c) == task), key=lambda c: c.n_train)
        n = [c.n_train for c in cs]
        mk = markers.get(cs[0].task, "o") if cs[0].split is None else "P"
        ax.plot(n, [c.bound.kl for c in cs], marker=mk, color="C0", label=f"{task}: kl bound (certified)")
        ax.plot(n, [c.bound.sqrt for c in cs], marker=mk, color="C1", ls="--",
                label=f"{task}: sqrt bound (certified)")
        ax.plot(n, [c.test_error for c in cs], marker=mk, color="C2", ls=":", label=f"{task}: test error (measured)")
        if all(c.covering is not None for c in cs):
            ax.plot(n, [c.covering["value"] for c in cs], marker=mk, color="C3", ls="-.",
                    label=f"{task}: covering/Dudley bound (certified)")
    ax.axhline(0.5, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training samples n")
    ax.set_ylabel("0-1 error")
    ax.set_ylim(0, 1)
    ax.set_title("certified bounds of the quantised Transformer vs measured test error")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: the curves fill the axes
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
