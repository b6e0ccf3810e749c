"""Matplotlib without a display: a lazily imported pyplot on the Agg backend, figures as inline SVG."""

from __future__ import annotations

import io
import re

__all__ = ["pyplot", "figure_svg", "figure_png", "save_figure", "display_bytes"]


def pyplot():
    """``matplotlib.pyplot`` on a non-interactive backend (imported on first use only)."""
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "svg", "pdf", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_svg(fig) -> str:
    """The figure as an ``<svg>`` element for inline HTML (no XML prolog, no external fonts: text
    is drawn as paths, so the file renders the same everywhere and no font is fetched)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "transcover"}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    # the RDF metadata block only names namespaces (purl.org, creativecommons.org): nothing to keep
    return re.sub(r' xmlns:(?:dc|cc|rdf)="[^"]*"', "", re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S))


def _savefig(fig, fmt: str, dpi: int) -> bytes:
    """The figure's bytes in ``fmt``.  numpy's overflow warnings are silenced: a log axis near 1e300 has tick decades
    past float64's range, which matplotlib computes as inf and drops (the picture is right; Note [log span])."""
    import numpy as np

    buf = io.BytesIO()
    with np.errstate(over="ignore", invalid="ignore"):
        fig.savefig(buf, format=fmt, dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def figure_png(fig, dpi: int = 110) -> bytes:
    return _savefig(fig, "png", dpi)


def save_figure(fig, path) -> bytes:
    """The figure's bytes for ``path`` by its extension (.png, .svg or .pdf)."""
    from .._errors import InputError

    suffix = str(path).lower().rsplit(".", 1)[-1]
    if suffix not in ("png", "svg", "pdf"):
        raise InputError(f"a figure path must end in .png, .svg or .pdf, but got {path}")
    return _savefig(fig, suffix, 110)


def display_bytes(display, path, *, fmt: str | None = None, dpi: int = 110) -> bytes:
    """A drawn display's figure as the bytes of ``path``'s format (.png, .svg or .pdf; ``fmt``
    forces one), the figure closed afterwards: what a command writes for ``--plot``."""
    fig = display.figure_
    try:
        if fmt is None:
            return save_figure(fig, path)
        return _savefig(fig, fmt, dpi)
    finally:
        pyplot().close(fig)
