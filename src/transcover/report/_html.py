"""The self-contained HTML report: inline CSS, inline SVG figures, plain tables, no script at all.

Every piece of text that comes from outside (model, tensor, file names, notes, assumptions) goes
through :func:`text`, which escapes HTML and shows control characters as visible escapes, so a
tensor named ``<script>…`` is printed, never run (Note [hostile names]).  Numbers are printed with
their kind next to them (a column or a caption), and every section says what it assumes.

Note [hostile names]: names reach the page by three routes: table cells and headings (escaped
here), figure titles and labels (matplotlib text: :func:`plain` removes control characters and
mathtext's ``$``; the SVG writer escapes the rest), and the figures' SVG text itself (matplotlib
escapes XML in comments and attributes).  The report has no ``<script>`` and loads nothing.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Sequence

from .._printed import directed

__all__ = ["text", "plain", "table", "section", "page", "fmt", "kind_badge"]

# control characters, and the invisible ones that reorder or hide text (zero-width, bidirectional overrides and
# isolates, BOM): a tensor named "ff.up\u202eexe" showed reversed in the report (red team 37h)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def _visible(match: re.Match) -> str:
    return f"\\x{ord(match.group()):02x}" if ord(match.group()) < 0x100 else f"\\u{ord(match.group()):04x}"


def text(value: object) -> str:
    """Any value as HTML text: control characters shown as ``\\xNN``, then HTML-escaped (quotes too)."""
    return html.escape(_CONTROL.sub(_visible, str(value)), quote=True)


def plain(value: object, limit: int = 80) -> str:
    """A name for a matplotlib label: visible control characters, ``$`` escaped, shortened."""
    s = _CONTROL.sub(_visible, str(value)).replace("$", r"\$")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def fmt(x: object, digits: int = 5, way: str = "near") -> str:
    """A number for a table cell (``-`` for missing, ``inf`` and ``nan`` spelled out); a float is rounded ``way``:
    "up" for an upper bound, "down" for a lower bound, "near" for an estimate (Note [printed bounds])."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "∞" if x > 0 else "−∞"
        return directed(x, digits, way)
    return text(x)


_KIND_CLASS = {"certified interval": "cert", "certified upper bound": "cert", "certified lower bound": "cert",
               "empirical lower bound": "emp", "estimate": "est", "exact": "exact"}


def kind_badge(kind: object) -> str:
    k = getattr(kind, "value", kind)
    return f'<span class="kind {_KIND_CLASS.get(str(k), "est")}">{text(k)}</span>'


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], *, caption: str = "",
          numeric: Sequence[bool] | None = None, raw: bool = False, ways: Sequence[str] | None = None) -> str:
    """A plain ``<table>``; cells are formatted by :func:`fmt`, column k rounded ``ways[k]`` (default "near")
    (``raw=True``: cells are trusted HTML)."""
    numeric = numeric or [False] * len(headers)
    ways = ways or ["near"] * len(headers)
    # the caption sits above the table, not inside it: a <caption> is only as wide as a narrow table
    out = [f'<p class="tcap">{caption}</p>'] if caption else []
    out.append("<table>")
    out.append("<thead><tr>" + "".join(f"<th>{text(h)}</th>" for h in headers) + "</tr></thead><tbody>")
    for row in rows:
        cells = []
        for v, num, way in zip(row, numeric, ways):
            cls = ' class="num"' if num else ""
            cells.append(f"<td{cls}>{v if raw else fmt(v, way=way)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def section(anchor: str, title: str, *parts: str) -> str:
    return f'<section id="{text(anchor)}"><h2>{text(title)}</h2>\n' + "\n".join(parts) + "\n</section>"


def figure(svg: str, caption: str) -> str:
    """A figure (an inline data-URI ``<img>`` or SVG made here, never from outside text) with a caption."""
    return f'<figure class="plot">{svg}<figcaption>{caption}</figcaption></figure>'


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1200px;margin:1.5em auto;
padding:0 1em;color:#1b1b1b;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;margin:.6em 0 1em;font-size:.86em}
th,td{border:1px solid #d5d5d5;padding:.2em .5em;vertical-align:top}th{background:#f2f2f2;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.tcap{font-size:.88em;color:#444;margin:.8em 0 .2em}
figure.plot{margin:.8em 0}figure.plot svg,figure.plot img{max-width:100%;height:auto}figcaption{font-size:.85em;color:#444}
.kind{font-size:.78em;padding:.05em .4em;border-radius:.3em;white-space:nowrap}
.cert{background:#dcefdc}.emp{background:#fde9cc}.est{background:#eee}.exact{background:#dde8f7}
.note{color:#555;font-size:.9em}.warn{color:#8a4b00}nav a{margin-right:1em}
details{margin:.5em 0}summary{cursor:pointer;color:#124}
code{font-size:.92em;word-break:break-all}
"""


def page(title: str, body: Sequence[str], nav: Sequence[tuple[str, str]] = ()) -> str:
    """The whole document: inline CSS, no scripts, no external resources."""
    links = " ".join(f'<a href="#{text(a)}">{text(t)}</a>' for a, t in nav)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
            "style-src 'unsafe-inline'; img-src data:\">"
            f"<title>{text(title)}</title><style>{_CSS}</style></head><body>\n"
            f"<h1>{text(title)}</h1>\n<nav>{links}</nav>\n" + "\n".join(body) + "\n</body></html>\n")
