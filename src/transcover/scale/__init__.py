"""Scale: many models (or seeds, or examples) through one function, in parallel, resumable (issue 14).

* :func:`sweep` -- ``sweep(items, fn, store=..., backend=..., workers=...)``: every item's result
  committed to a :class:`ResultStore` as it finishes; re-running skips finished items.
* backends: ``"serial"``, ``"process"`` (local spawned processes), ``"ray"`` (``transcover[ray]``).
* keys: :func:`item_key` of a :func:`fingerprint` of the input files and the options.
* ``transcover analyze RUN_DIR/checkpoint-*`` uses them (``_analyze``), and so do the seeds of
  ``transcover experiment staged --workers N`` (``_train.train_runner``), the Monte-Carlo classes of
  ``transcover cover reference`` (:func:`monte_carlo_reference`: chunks of members) and the
  per-example local certification of ``transcover lipschitz --data`` (:func:`local_rows`: one
  sequence per item).
"""

from ._backends import BACKENDS, RAY_MISSING, Outcome, run_item
from ._keys import fingerprint, item_key
from ._store import ResultStore, StoreError
from ._sweep import Item, ItemResult, SweepReport, sweep

__all__ = ["sweep", "Item", "ItemResult", "SweepReport", "ResultStore", "StoreError", "fingerprint",
           "item_key", "BACKENDS", "Outcome", "run_item", "monte_carlo_reference", "monte_carlo_local",
           "local_rows", "local_items"]

# what `transcover analyze` (sweeps) and `experiment staged --workers` use: exported here so the
# CLI imports no private module of this package (issue 11; tests/test_layering.py)
from ._analyze import (analysis_items, analyze_item, expand_models, failure_rows, rows_csv, sweep_json,  # noqa: E402
                       sweep_rows)
from ._train import train_runner  # noqa: E402

__all__ += ["analysis_items", "analyze_item", "expand_models", "failure_rows", "rows_csv", "sweep_json", "sweep_rows",
            "RAY_MISSING", "train_runner"]

_LAZY = {"monte_carlo_reference": "._montecarlo", "monte_carlo_local": "._montecarlo", "local_rows": "._local",
         "local_items": "._local"}


def __getattr__(name: str):
    """The torch-using entry points, imported on first use (``import transcover.scale`` stays light)."""
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
