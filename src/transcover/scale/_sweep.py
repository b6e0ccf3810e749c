"""``sweep``: one function over many items, on any backend, every finished item committed at once.

An item is ``(key, label, payload)``: ``key`` identifies the *work* (a hash of the input's content and
of the options, see ``_keys``), ``label`` is for people, ``payload`` is what the function receives.
The function must be importable by name (a module-level function: it is sent to worker processes)
and return JSON-serialisable data.  Per-example work (local certification over a dataset, a
Monte-Carlo class, a seed of an experiment) plugs in the same way: one item per example.

Resume (the default): an item whose key is in the store is not recomputed; its stored value is
used.  Every finished item is committed in its own transaction as soon as it arrives, so a sweep
killed at any moment and re-run loses no finished item and repeats none.  Items that fail (an
unreadable or half-written checkpoint, any exception) are reported one line each and are not
stored: a re-run retries them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ._backends import Outcome, run_backend
from ._store import ResultStore

__all__ = ["Item", "ItemResult", "SweepReport", "sweep"]


@dataclass(frozen=True)
class Item:
    key: str
    label: str
    payload: Any


@dataclass(frozen=True)
class ItemResult:
    item: Item
    ok: bool
    value: Any  # the decoded JSON value, or the one-line error message when not ok
    seconds: float
    reused: bool  # read back from the store rather than computed in this run


@dataclass
class SweepReport:
    results: list[ItemResult] = field(default_factory=list)  # in the order of the items

    def _unique(self) -> list[ItemResult]:
        return list({r.item.key: r for r in self.results}.values())

    @property
    def computed(self) -> int:
        """Distinct items computed (and committed) in this run."""
        return sum(r.ok and not r.reused for r in self._unique())

    @property
    def reused(self) -> int:
        """Distinct items read back from the store."""
        return sum(r.reused for r in self._unique())

    @property
    def failed(self) -> list[ItemResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        n = len(self._unique())
        given = f" ({len(self.results)} given)" if len(self.results) != n else ""  # the JSON counts every item given
        return (f"{n} item(s){given}: {self.computed} computed, {self.reused} reused from the store, "
                f"{len({r.item.key for r in self.failed})} failed")


def sweep(items: Sequence[Item], fn: Callable[[Any], Any], *, store: ResultStore | None = None,
          backend: str = "serial", workers: int = 1, threads: int = 1, resume: bool = True,
          options: dict[str, Any] | None = None,
          on_result: Callable[[ItemResult], None] | None = None) -> SweepReport:
    """Run ``fn(item.payload)`` for every item not already in ``store`` (see the module docstring).

    Args:
        items: the work; items with equal keys are computed once.
        fn: a module-level function ``payload -> JSON-serialisable value``.
        store: where finished items are committed and looked up (``None``: nothing kept).
        backend: ``"serial"`` (this process), ``"process"`` (a local pool of ``workers`` spawned
            processes) or ``"ray"`` (``options["address"]`` for ``ray.init``; else a local Ray).
        workers: parallel items; ``threads``: BLAS threads per item (Note [bit for bit]).
        resume: use stored results (``False``: recompute every item and replace its row).
        on_result: called with each :class:`ItemResult` as it is final (progress, logs).

    Returns:
        A :class:`SweepReport` whose ``results`` follow the order of ``items``.

    Raises:
        InputError: a bad backend / worker count, Ray not installed, a corrupt store (StoreError).
    """
    final: dict[str, ItemResult] = {}
    todo: dict[str, Item] = {}
    for item in items:
        if item.key in final or item.key in todo:
            continue
        stored = store.get(item.key) if (store is not None and resume) else None
        if stored is not None:
            final[item.key] = ItemResult(item, True, json.loads(stored.value), stored.seconds, True)
            if on_result is not None:
                on_result(final[item.key])
        else:
            todo[item.key] = item
    order = list(todo.values())
    for i, outcome in run_backend(backend, fn, [(i, it.payload) for i, it in enumerate(order)],
                                  workers=workers, threads=threads, options=options):
        item = order[i]
        final[item.key] = _finish(item, outcome, store)
        if on_result is not None:
            on_result(final[item.key])
    # Items with equal keys share one computation, but each row keeps its own item (label): the second
    # of two byte-identical checkpoints was listed under the first one's name (red team of stop 36)
    return SweepReport([replace(final[item.key], item=item) for item in items])


def _finish(item: Item, outcome: Outcome, store: ResultStore | None) -> ItemResult:
    if not outcome.ok:
        return ItemResult(item, False, outcome.value, outcome.seconds, False)
    if store is not None:
        store.put(item.key, item.label, outcome.value, outcome.seconds)  # committed before it counts
    return ItemResult(item, True, json.loads(outcome.value), outcome.seconds, False)
