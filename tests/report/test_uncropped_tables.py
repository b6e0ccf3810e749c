"""No printed number is cropped at 80 columns (red team 217: piped into a log, ``lipschitz --data`` printed a
certified 3.481e+05 as ``3.481e+…`` and 7.571e+05 as ``7.571e…``; Note [uncropped tables])."""

from __future__ import annotations

import io
import math

import pytest
from rich import box
from rich.console import Console
from rich.table import Table

from transcover._printed import directed
from transcover.lipschitz import LocalRow
from transcover.report import render_local


def _rows(ball: bool) -> list:
    rows = []
    for rho in (1e-3, 1e-2):
        for layer, comp in ((0, "attention"), (0, "ffn"), (0, "layer"), (1, "layer"), (-1, "network (jacobian)")):
            rows.append(LocalRow(rho, layer, comp, 3.4812345e5, 1333.2, 18.78, 3.732, math.nan,
                                 7.5712345e5 if ball and comp == "layer" else math.nan))
    return rows


@pytest.mark.parametrize("ball", [False, True])
def test_local_table_keeps_every_number_whole_at_80_columns(ball, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    rows = _rows(ball)
    render_local("m", 3, rows, True)
    out = capsys.readouterr().out
    assert "…" not in out
    for r in rows:
        for v, way in ((r.global_upper, "up"), (r.domain_upper, "up"), (r.local_upper, "up"), (r.lower, "down"),
                       (r.point_lower, "down")):
            if v == v:
                assert directed(v, 4, way) in out
    for head in ("component", "local/lower"):
        assert head in out
    if not ball:  # the eight columns fit the 80 (light borders)
        assert max(len(line) for line in out.splitlines()) <= 80


def _table(**kw) -> Table:
    t = Table(title="t", **kw)
    for c in ("rho", "layer", "component", "global (R)", "domain (sigma0)", "local (rho)", "point lower",
              "ball lower", "local/lower"):
        t.add_column(c, justify="right")
    t.add_row("0.001", "0", "attention", "3.481e+05", "1333", "18.78", "3.732", "7.571e+05", "5.029")
    return t


@pytest.mark.parametrize("kw", [{}, dict(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)])
def test_print_table_widens_rather_than_crops(kw):
    """Columns whose longest words add up to more than the console: printed wider, not cut."""
    from transcover.report import print_table

    buf = io.StringIO()
    print_table(Console(width=60, file=buf), _table(**kw))
    out = buf.getvalue()
    assert "…" not in out
    for cell in ("0.001", "attention", "3.481e+05", "7.571e+05", "5.029", "component", "local/lower"):
        assert cell in out


def test_print_table_fits_the_console_where_the_words_do():
    """Room enough for the longest words: the table stays inside the console (the first column of a collapsed
    padding, which rich draws one space narrower than it counts, included)."""
    from transcover.report import print_table

    buf = io.StringIO()
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    for c in ("rho", "global (R)", "domain (sigma0)", "local/lower"):
        t.add_column(c, justify="right")
    t.add_row("0.001", "3.481e+05", "1333", "5.029")
    print_table(Console(width=45, file=buf), t)
    out = buf.getvalue()
    assert "…" not in out and "0.001" in out and "3.481e+05" in out
    assert max(len(line) for line in out.splitlines()) <= 45
