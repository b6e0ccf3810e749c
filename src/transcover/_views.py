"""Views of results (figures, tables, DataFrames, notebook reprs) without upward imports.

Note [views]: result types live low in the package order (``norms.AnalysisResult``,
``lipschitz.NetworkLipschitz``, ``covering.ModelBound`` ...) while everything that draws or
tabulates them lives in ``report``, the sink.  A result method such as ``.plot()`` therefore asks
for a view *by name* here, and ``report`` registers the functions that make each view when it is
imported.  ``import transcover`` imports ``report`` (see ``transcover/__init__.py``), and every
``import transcover.<anything>`` runs that first, so the registry is filled before any result
exists.  This module imports nothing from the package: it is on the ground floor beside
``_errors`` and ``_results``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["register_view", "render", "registered_views"]

_VIEWS: dict[str, Callable] = {}


def register_view(name: str, fn: Callable) -> None:
    """Make ``render(name, ...)`` call ``fn(...)``; names look like ``"analysis.plot"``."""
    _VIEWS[name] = fn


def registered_views() -> tuple[str, ...]:
    return tuple(sorted(_VIEWS))


def render(name: str, *args, **kwargs):
    """The view ``name`` of a result: ``render("analysis.plot", result, ax=ax)``."""
    try:
        fn = _VIEWS[name]
    except KeyError:
        raise LookupError(f"no view {name!r} is registered; views come from transcover.report, which "
                          "`import transcover` loads") from None
    return fn(*args, **kwargs)
