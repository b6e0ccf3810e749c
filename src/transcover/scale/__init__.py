"""Scale: many models (or seeds, or examples) through one function, in parallel, resumable (issue 14).

* :func:`sweep` -- ``sweep(items, fn, store=..., backend=..., workers=...)``: every item's result
  committed to a :class:`ResultStore` as it finishes; re-running skips finished items.
* backends: ``"serial"``, ``"process"`` (local spawned processes), ``"ray"`` (``transcover[ray]``).
* keys: :func:`item_key` of a :func:`fingerprint` of the input files and the options.
* ``transcover analyze RUN_DIR/checkpoint-*`` uses them (``_analyze``), and so do the seeds of
  ``transcover experiment staged --workers N`` (``_train.train_runner``).
"""

from ._backends import BACKENDS, Outcome, run_item
from ._keys import fingerprint, item_key
from ._store import ResultStore, StoreError
from ._sweep import Item, ItemResult, SweepReport, sweep

__all__ = ["sweep", "Item", "ItemResult", "SweepReport", "ResultStore", "StoreError", "fingerprint",
           "item_key", "BACKENDS", "Outcome", "run_item"]

# what `transcover analyze` (sweeps) and `experiment staged --workers` use: exported here so the
# CLI imports no private module of this package (issue 11; tests/test_layering.py)
from ._analyze import analysis_items, analyze_item, expand_models, plot_sweep, rows_csv, sweep_json, sweep_rows  # noqa: E402
from ._backends import RAY_MISSING  # noqa: E402
from ._train import train_runner  # noqa: E402

__all__ += ["analysis_items", "analyze_item", "expand_models", "plot_sweep", "rows_csv", "sweep_json", "sweep_rows",
            "RAY_MISSING", "train_runner"]
