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
