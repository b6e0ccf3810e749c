"""report's displays of the lab's results: each draws what the result holds, on the given axis or a
new figure, and result methods (``Advice.plot`` ...) reach them through the view registry."""

from __future__ import annotations

import math

import numpy as np
import pytest

import transcover
from transcover.report import (AdviceDisplay, AttentionRateDisplay, EmpiricalCoveringDisplay, FailureCurveDisplay,
                               MLPRateDisplay, TrainingDisplay, axes_png, display_bytes)
from transcover.report._figures import pyplot

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    pyplot().close("all")


def test_advice_plot_draws_the_curve_on_the_given_axis():
    a = transcover.advise(2, 1.0, 16, 10_000)
    fig, ax = pyplot().subplots()
    assert a.plot(ax) is a  # the result method returns the result, as before
    ys = [line.get_ydata() for line in ax.get_lines()]
    assert np.allclose(ys[0], [c["approx"] for c in a.curve]) and np.allclose(ys[2], [c["total"] for c in a.curve])
    assert ax.get_lines()[3].get_xdata()[0] == a.d_m  # the advised width is marked
    disp = AdviceDisplay.from_result(a).plot()
    assert disp.ax_ is not None and axes_png(a).startswith(PNG)


def test_rate_and_failure_displays_plot_every_row():
    res = transcover.approx("sweep", over="R", Rs=[2, 4, 6], ns=[4], deltas=[0.0, 0.2])
    d = AttentionRateDisplay.from_result(res).plot()
    measured = [line for line in d.ax_.get_lines() if line.get_marker() == "o"]
    assert len(measured) == 2 and sum(len(line.get_xdata()) for line in measured) == len(res.rows)
    fake_mlp = type("R", (), {"rows": [{"beta": 1.0, "s": 1, "d_m": 4, "measured": 0.1, "bound": 0.2},
                                       {"beta": 1.0, "s": 1, "d_m": 8, "measured": 0.05, "bound": 0.1}],
                              "fits": [{"beta": 1.0, "s": 1, "fitted_exponent": -1.0, "theory_exponent": -1.0}]})()
    m = MLPRateDisplay.from_result(fake_mlp).plot(pyplot().subplots()[1])  # ax=None draws on the current axes
    assert list(m.ax_.get_lines()[0].get_ydata()) == [0.1, 0.05]
    curve = type("C", (), {"name": "n", "x_label": "x", "rows": [{"x": 0.0, "sup": 1.0, "bound": 2.0},
                                                                 {"x": 1.0, "sup": 3.0, "bound": 4.0}]})()
    f = FailureCurveDisplay.from_result(curve).plot(pyplot().subplots()[1])
    assert [line.get_linestyle() for line in f.ax_.get_lines()] == ["-", "--"]


def test_cover_display_from_a_finite_result():
    Y = np.random.default_rng(0).standard_normal((20, 4, 2))
    r = transcover.cover(Y, eps=[0.5, 1.0])
    d = EmpiricalCoveringDisplay.from_result(r).plot()
    rows = r.to_dict()["rows"]
    assert list(d.upper) == [row["log_N_upper"]["value"] for row in rows]
    assert all(lo <= up for lo, up in zip(d.lower, d.upper))
    assert display_bytes(d, "x.png").startswith(PNG)


def test_a_name_with_mathtext_is_drawn_as_written(tmp_path):
    """Red team 215: a path holding "$\\nosuchcmd{$" reached matplotlib's mathtext unescaped and the figure raised
    (``cover finite FILE --plot``'s legend, ``CoveringDisplay``'s title drawn outside the report)."""
    from transcover.covering import model_bound
    from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec
    from transcover.report import CoveringDisplay

    name = r"m$\nosuchcmd{$"
    d = EmpiricalCoveringDisplay(np.array([0.5, 1.0]), np.array([2.0, 1.0]), np.array([1.0, 0.5]), name).plot()
    assert display_bytes(d, "x.png").startswith(PNG)
    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=8)), name=name)
    c = CoveringDisplay.from_result(model_bound(spec, seq_len=4)).plot()
    assert display_bytes(c, "x.png").startswith(PNG)


def test_training_display_draws_sigma_against_radius():
    records = [{"step": s, "loss": 1.0 / (s + 1), "grad_norm": 1.0, "capacity": 2.0, "sigma.KQ": 1.5 - 0.1 * s,
                "radius.KQ": 1.0} for s in range(5)]
    d = TrainingDisplay(records, "t").plot()
    sigma = [line for line in d.ax_[2].get_lines() if line.get_label() == "sigma KQ"]
    assert len(sigma) == 1 and math.isclose(sigma[0].get_ydata()[-1], 1.1)
    assert display_bytes(d, "h.png", fmt="png").startswith(PNG)


def test_nonvacuous_figure_is_drawn_by_report_for_the_result(tmp_path):
    """The experiment's result asks report for its figure (Note [views]); one line per series,
    the covering bound only where every case has one, and a real PNG written atomically."""
    from types import SimpleNamespace

    from transcover.train._nonvacuous_report import NonvacuousResult

    def case(n, kl, cov):
        return SimpleNamespace(task="majority", split=None, n_train=n, test_error=0.01,
                               bound=SimpleNamespace(kl=kl, sqrt=2 * kl), covering=cov)

    cases = [case(1000, 0.3, None), case(10000, 0.02, {"value": 0.7})]
    result = NonvacuousResult(cases=tuple(cases), seconds=0.0)
    out = result.plot(tmp_path / "nv.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["nv.png"]  # nothing half-written beside it


def test_the_repr_counts_the_rows_of_the_dataframe():
    """The repr said '238 matrices' of MiniLM beside a 256-row to_dataframe(): the bias vectors are rows too."""
    import re

    import transcover
    from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec

    m = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=8))
    r = transcover.analyze(reference_spec(m))
    a, b = map(int, re.search(r"(\d+) matrices and (\d+) bias vectors", repr(r)).groups())
    assert a + b == len(r.to_dataframe())


def test_the_staged_tables_certified_columns_are_rounded_up():
    """Red team 188: the staged experiment's table printed its certified columns to nearest: log10 Lip = 2.4134443
    as "2.413" (a claim of 258.8 for a certified 259.09), log10 log N 5.2312535 as "5.231", the raw gap formula
    1.1014632 as "10^1.101".  Certified means are rounded up, measured ones to nearest."""
    from types import SimpleNamespace

    from rich.console import Console

    from transcover.report._staged import staged_table

    row = {"test_acc": (0.91234, 0.0), "train_acc": (0.95, 0.0), "gap": (0.03766, 0.0), "test_loss": (0.2, 0.0),
           "capacity": (3.0, 0.0), "lipschitz": (2.4134443, 0.01), "covering": (5.2312535, 0.0),
           "bound": (0.4134443, 0.0), "bound_raw": (1.1014632, 0.0), "bound_vacuous": (0.0, 0.0), "norm.KQ": (1.0, 0.0)}
    fake = SimpleNamespace(summary=lambda: {"staged": row}, config=SimpleNamespace(seeds=(0,)), bound_note=lambda: "")
    console = Console(width=300, record=True)
    console.print(staged_table(fake))
    text = console.export_text()
    for shown in ("2.414±0.010", "5.232±0.000", "0.414±0.000", "raw 10^1.102", "0.912±0.000"):
        assert shown in text, (shown, text)


@pytest.mark.parametrize("low", [2.5e-78, 1e-300, 5e-324])
def test_a_log_axis_over_hundreds_of_decades_is_drawn(low):
    """Red team 189: lowers of 2.5e-78 beside a network upper of 2.0e264 (a float32 model at its dtype's edge) made
    matplotlib's tick formatter overflow, and ``report`` ended in an internal error.  The axes span at most
    ``LOG_SPAN`` decades below the largest value (Note [log span]) and the figure is drawn; the largest bar is
    inside."""
    from transcover.report._displays import LOG_SPAN, LipschitzDisplay, PerturbationDisplay

    d = LipschitzDisplay(["0·attn", "layer 0", "network"], np.array([3.0, 1e100, 2.0e264]),
                         np.array([np.nan, low, 1.5]))
    assert display_bytes(d.plot(), None, fmt="png").startswith(PNG)
    for a in d.ax_:
        lo, hi = a.get_ylim()
        assert math.log10(hi) - math.log10(lo) <= LOG_SPAN + 1
    assert d.ax_[1].get_ylim()[1] >= 2.0e264
    p = PerturbationDisplay(["0", "1"], np.array([low, 1e300]), 1.1e300, low)
    assert display_bytes(p.plot(), None, fmt="png").startswith(PNG)
