"""Printed numbers keep their claim (Note [printed bounds], red team 169): an upper bound is printed rounded up, a
lower bound rounded down, in the helpers (property tests against exact decimals and mpmath) and on the pages and
tables that show them (every certified cell parsed back and compared with its unrounded value)."""

from __future__ import annotations

from decimal import Decimal, localcontext
from html.parser import HTMLParser

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover._printed import count_exact, directed, fixed, for_kind, from_ln, log10_up
from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec
from transcover.report._build import ReportOptions, compute_report, render_report

FINITE = st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=400, deadline=None)
@given(FINITE, st.integers(1, 17))
def test_directed_rounding_is_on_the_side_of_the_claim_and_within_one_unit(x, digits):
    with localcontext(prec=2000):  # every difference below exact
        _directed_case(x, digits)


def _directed_case(x, digits):
    ex = Decimal(x)  # exact
    hi, lo, nr = (directed(x, digits, w) for w in ("up", "down", "near"))
    assert Decimal(hi) >= ex and Decimal(lo) <= ex
    assert nr == f"{x:.{digits}g}"
    for s in (hi, lo):  # spelled as float's %g (red team 173: Decimal's g wrote 0.0000077492 for 7.7492e-06)
        if Decimal(s) == Decimal(nr):
            assert s == nr, (s, nr)
    if x != 0:
        unit = Decimal(1).scaleb(ex.adjusted() - digits + 1)
        assert Decimal(hi) - ex < unit and ex - Decimal(lo) < unit  # the nearest digits on that side
    if Decimal(hi) == ex:
        assert hi == lo or Decimal(lo) == ex


@settings(max_examples=200, deadline=None)
@given(st.floats(-1e15, 1e15), st.integers(0, 8))
def test_fixed_decimals_are_on_the_side_of_the_claim(x, decimals):
    with localcontext(prec=2000):
        _fixed_case(x, decimals)


def _fixed_case(x, decimals):
    ex = Decimal(x)
    assert Decimal(fixed(x, decimals, "up")) >= ex >= Decimal(fixed(x, decimals, "down"))
    assert Decimal(fixed(x, decimals, "up")) - ex < Decimal(1).scaleb(-decimals)
    assert fixed(x, decimals, "near") == f"{x:.{decimals}f}"


@settings(max_examples=200, deadline=None)
@given(st.floats(-700, 1e300), st.integers(2, 8))
def test_log10_and_ln_printing_bound_the_exact_value_from_above(ln_value, digits):
    mpmath.mp.prec = 200
    exact = mpmath.mpf(ln_value) / mpmath.log(10)
    assert mpmath.mpf(log10_up(ln_value, digits)) >= exact
    assert mpmath.mpf(log10_up(ln_value, decimals=digits)) >= exact
    s, d = from_ln(ln_value), from_ln(ln_value, "down")
    value = mpmath.mpf(10) ** mpmath.mpf(s[3:]) if s.startswith("10^") else mpmath.mpf(s)
    low = mpmath.mpf(10) ** mpmath.mpf(d[3:]) if d.startswith("10^") else mpmath.mpf(d)
    exact = mpmath.exp(mpmath.mpf(ln_value))
    assert value >= exact * (1 - mpmath.mpf(2) ** -150) and low <= exact * (1 + mpmath.mpf(2) ** -150)


def test_for_kind_rounds_by_the_kind():
    x = 5.972362725630611  # nearest at 6 digits is 5.97236, below x
    assert for_kind(x, "certified upper bound", 6) == "5.97237"
    assert for_kind(x, "certified interval", 6) == "5.97237"
    assert for_kind(x, "empirical lower bound", 6) == "5.97236"
    assert for_kind(x, "estimate", 6) == f"{x:.6g}"
    with pytest.raises(ValueError, match="but got way="):
        directed(x, 4, "sideways")


class _Tables(HTMLParser):
    """Every <table>: rows of cell texts."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(3)
    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=16, n_heads=2, n_layers=2, d_ff=32,
                                                               d_input=3, max_len=6)))
    data = compute_report(spec, options=ReportOptions(lower=False, seq_len=4))
    p = _Tables()
    p.feed(render_report(data))
    return data, p.tables


def _table(tables, first_header: list[str]):
    return next(t for t in tables if t and t[0][: len(first_header)] == first_header)


def test_report_prints_interval_ends_and_uppers_on_their_sides(report):
    data, tables = report
    a = data.analysis
    keys = ["B_KQ", "B_V", "W_O", "B_W1", "B_W2", "B_b1", "B_b2", "B_b_attn"]
    rows = _table(tables, ["layer", "B_KQ"])[1:]
    below_if_nearest = 0
    for layer, row in zip(a.layers, rows):
        for k, cell in zip(keys, row[1:]):
            iv = getattr(layer, k)
            if iv is None:
                continue
            assert Decimal(cell) >= Decimal(iv.upper), (k, cell, iv.upper)
            below_if_nearest += Decimal(f"{iv.upper:.6g}") < Decimal(iv.upper)
        # the last column bounds every interval's relative gap (red team 189: 5.012e-10 printed as 5.0e-10)
        gap = max(getattr(layer, k).relative_gap for k in keys if getattr(layer, k) is not None)
        assert Decimal(row[len(keys) + 1]) >= Decimal(gap), (row, gap)
        below_if_nearest += Decimal(f"{gap:.1e}") < Decimal(gap)
    assert below_if_nearest > 0  # nearest rounding would have printed some below: the check can fail
    matrices = _table(tables, ["layer", "matrix", "tensor", "shape"])[1:]
    ivs = [(m.spectral, m.frobenius, m.l21) for layer in a.layers for m in layer.matrices.values()]
    ivs += [(e.norms.spectral, e.norms.frobenius, e.norms.l21) for e in a.embeddings]
    assert len(matrices) == len(ivs)
    for row, triple in zip(matrices, ivs):
        for cell, iv in zip(row[4:7], triple):
            lo, hi = cell.split(" … ")
            assert Decimal(lo) <= Decimal(iv.lower) and Decimal(hi) >= Decimal(iv.upper), (cell, iv)


def test_report_lipschitz_stages_carry_the_pad_and_round_up(report):
    from transcover._results import rounding_pad

    data, tables = report
    b = data.bounds
    rows = _table(tables, ["layer", "component", "input radius", "certified upper"])[1:]
    stages = [r for r in rows if r[1] not in ("whole layer", "network")]
    assert len(stages) == len(b.stages)
    for row, s in zip(stages, b.stages):
        assert Decimal(row[3]) >= Decimal(s.lipschitz * (1 + rounding_pad())), (row, s.lipschitz)
    layers = [r for r in rows if r[1] == "whole layer"]
    for i, row in enumerate(layers):
        assert Decimal(row[3]) >= Decimal(b.layer_upper(i).value)
    net = next(r for r in rows if r[1] == "network")
    assert Decimal(net[3]) >= Decimal(b.upper.value)


def test_cli_tables_print_uppers_up_and_lowers_down(tmp_path, capsys, monkeypatch):
    """analyze's tables beside their JSON: every printed upper >= the JSON's, every lower <= it."""
    import json
    import re

    from transcover.cli import main
    from transcover.scale._synthetic import write_gpt2_checkpoint

    ckpt = write_gpt2_checkpoint(tmp_path / "m", d=32, layers=2, heads=2, vocab=64, positions=16, seed=5)
    out = tmp_path / "a.json"
    monkeypatch.setenv("COLUMNS", "200")  # the per-head cells "lower … upper" on one line each
    assert main(["analyze", str(ckpt), "--json", str(out), "--heads"]) == 0
    printed = capsys.readouterr().out
    layers = json.loads(out.read_text())["layers"]
    keys = ("B_KQ", "B_V", "W_O", "B_W1", "B_W2", "B_b1", "B_b2")
    rows = [line.split() for line in printed.splitlines() if re.match(r"^\s*[01]\s+[0-9]", line)][:2]
    assert len(rows) == 2
    strict = 0
    for layer, row in zip(layers, rows):
        for k, cell in zip(keys, row[1:]):
            upper = layer[k]["upper"]
            assert Decimal(cell) >= Decimal(upper), (k, cell, upper)
            strict += Decimal(f"{upper:.5g}") < Decimal(upper)
    assert strict > 0  # nearest would have printed some below
    heads = [c for line in printed.splitlines() for c in re.findall(r"([0-9.e+-]+) … ([0-9.e+-]+)", line)]
    # per head: B_KQ, B_V, W_V and, where the query has a bias, B_KQ with b_Q (both ends since red team 217)
    per_head = [iv for layer in layers for h in layer["heads"]
                for iv in (h["B_KQ"], h["B_V"], h["W_V"]) + ((h["B_KQ_bias"],) if "B_KQ_bias" in h else ())]
    assert len(heads) == len(per_head)
    for (lo, hi), iv in zip(heads, per_head):
        assert Decimal(lo) <= Decimal(iv["lower"]) and Decimal(hi) >= Decimal(iv["upper"]), (lo, hi, iv)


def test_a_cell_without_a_number_prints_a_dash():
    """Red team 203: the network row's domain column (not computed there, NaN) printed as "nan" in the local table."""
    from transcover.report._lipschitz_tables import _fmt

    assert _fmt(float("nan"), "up") == _fmt(None) == "-"
    assert _fmt(1.00001, "up") == "1.001" and _fmt(float("inf"), "up") != "-"


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=1.0, max_value=1e300))
def test_a_sample_size_is_printed_exactly(n):
    """Red team 215: n was printed with ``%.3g``; whatever n is, its printed form reads back to the same float."""
    shown = count_exact(n)
    assert float(shown.replace(",", "")) == n
    assert count_exact(110384404.0) == "110,384,404" and count_exact(1e300) == "1e+300"
