"""The views ``report`` provides to result types of lower packages (Note [views] in ``transcover._views``).

Each entry names a view a result method asks for and the function that makes it; the displays'
modules are imported when the view is first used, so registering costs no import of matplotlib
or pandas.
"""

from __future__ import annotations

from .._views import register_view


def _analysis_plot(result, ax=None, **kw):
    from ._displays import AnalysisDisplay

    return AnalysisDisplay.from_result(result).plot(ax=ax, **kw)


def _lipschitz_plot(bounds, ax=None, lower=None):
    from ._displays import LipschitzDisplay

    return LipschitzDisplay.from_bounds(bounds, lower).plot(ax=ax)


def _perturbation_plot(bound, ax=None, lower=None, *, n_layers=None):
    from ._displays import PerturbationDisplay

    return PerturbationDisplay.from_result(bound, lower, n_layers=n_layers).plot(ax=ax)


def _bound_plot(result, ax=None):
    from ._displays import BoundDisplay

    return BoundDisplay.from_result(result).plot(ax=ax)


def _staged_table(result):
    from ._staged import staged_table

    return staged_table(result)


def _nonvacuous_plot_file(result, path):
    from ._nonvacuous import write_nonvacuous_plot

    return write_nonvacuous_plot(result, path)


def _staged_plot_file(result, path):
    from ._staged import write_staged_plot

    return write_staged_plot(result, path)


def _approx_display(name: str):
    def view(result, ax=None):
        from . import _approx

        return getattr(_approx, name).from_result(result).plot(ax=ax)

    view.__name__ = name
    return view


def _notebook(name: str):
    def view(result):
        from . import _notebook

        return getattr(_notebook, name)(result)

    view.__name__ = name
    return view


register_view("analysis.plot", _analysis_plot)
register_view("analysis.repr", _notebook("analysis_repr"))
register_view("analysis.repr_html", _notebook("analysis_repr_html"))
register_view("analysis.matrices_dataframe", _notebook("matrices_dataframe"))
register_view("analysis.layers_dataframe", _notebook("layers_dataframe"))
register_view("lipschitz.plot", _lipschitz_plot)
register_view("perturbation.plot", _perturbation_plot)
register_view("bound.plot", _bound_plot)
register_view("staged.table", _staged_table)
register_view("staged.plot_file", _staged_plot_file)
register_view("nonvacuous.plot_file", _nonvacuous_plot_file)
register_view("advice.plot", _approx_display("AdviceDisplay"))
register_view("failure_curve.plot", _approx_display("FailureCurveDisplay"))
register_view("attention_rate.plot", _approx_display("AttentionRateDisplay"))
register_view("mlp_rate.plot", _approx_display("MLPRateDisplay"))
