"""The public surface: every exported name imports, and the display draws what it holds."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import transcover.empirical as E
import transcover.report as R  # noqa: E402


def test_every_public_name_imports():
    for name in E.__all__:
        assert getattr(E, name) is not None, name
    assert len(set(E.__all__)) == len(E.__all__)


def test_display_plots_estimate_lower_and_bound():
    import matplotlib.pyplot as plt

    Y = torch.arange(50, dtype=torch.float64)[:, None]
    mc = E.covering_of_outputs(Y, (1.0, 3.0, 10.0))
    eps = np.array([1.0, 3.0, 10.0])
    disp = R.CoveringCurveDisplay.from_result(mc, "grid", bound=(eps, np.log([50.0, 50.0, 50.0])))
    fig, ax = plt.subplots()
    assert disp.plot(ax) is disp and disp.ax is ax
    ys = [line.get_ydata() for line in ax.get_lines()]
    np.testing.assert_allclose(ys[0], np.log([25, 13, 5]))  # greedy on a 50-point grid: ceil(50/(eps+1))
    assert len(ys) == 3
    plt.close(fig)
