"""Seeds of ``transcover experiment`` through the sweep engine: one item per training run.

An item's payload is a :class:`~transcover.train.TrainConfig` (seed included) as a dict; its key is a
hash of that dict, so a re-run with the same options resumes and a changed option recomputes.  The
stored value is ``TrainResult.to_dict()`` plus the run's history, from which the result is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from ._keys import item_key
from ._store import ResultStore
from ._sweep import Item, sweep

__all__ = ["train_item", "train_result_from_value", "train_runner"]


def train_item(payload: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration (the item function of a seeds sweep)."""
    from .._threads import set_torch_threads
    from ..train import TrainConfig, train

    set_torch_threads(int(payload.get("threads", 1)))
    result = train(TrainConfig.from_dict(payload["config"]))
    return {"result": result.to_dict(), "history": result.history}


def _quantity(d: dict | None):
    """A :class:`Quantity` back from its ``to_dict`` (a :class:`ClippedQuantity` keeps raw, trivial, note)."""
    from .._results import ClippedQuantity, Kind, Quantity

    if d is None:
        return None
    args = (d["value"], Kind(d["kind"]), d["source"], tuple(d["assumptions"]))
    if "raw" in d:
        return ClippedQuantity(*args, raw=float(d["raw"]), trivial=float(d["trivial"]), note=d.get("note", ""))
    return Quantity(*args)


def train_result_from_value(value: dict[str, Any]):
    """The :class:`~transcover.train.TrainResult` of a stored :func:`train_item` value."""
    from ..train import TrainConfig, TrainResult

    r = value["result"]
    return TrainResult(config=TrainConfig.from_dict(r["config"]), epochs_done=r["epochs_done"],
                       train_loss=r["train_loss"], test_loss=r["test_loss"], train_acc=r["train_acc"],
                       test_acc=r["test_acc"], norms=r["norms"], capacity=_quantity(r["capacity"]),
                       lipschitz=_quantity(r["lipschitz"]), bound=_quantity(r["bound"]),
                       covering=_quantity(r["covering"]), history=value["history"], task_source=r["task_source"],
                       constraints=r.get("constraints", {}))


def train_runner(*, store: ResultStore | None = None, backend: str = "serial", workers: int = 1, threads: int = 1,
                 resume: bool = True, options: dict[str, Any] | None = None,
                 on_result: Callable | None = None) -> Callable[[list], list]:
    """A ``runner`` for ``staged_experiment``: its training runs as sweep items (any backend).

    Raises (when called): :class:`~transcover.InputError` if a run fails (the message names it).
    """
    from .._errors import InputError

    def run(configs: list) -> list:
        items = []
        for k, cfg in enumerate(configs):
            d = cfg.to_dict()
            digest = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
            items.append(Item(item_key("train", digest, {"threads": threads}), f"run {k} (seed {cfg.seed})",
                              {"config": d, "threads": threads}))
        report = sweep(items, train_item, store=store, backend=backend, workers=workers, threads=threads,
                       resume=resume, options=options, on_result=on_result)
        if report.failed:
            bad = report.failed[0]
            raise InputError(f"{len(report.failed)} training run(s) failed; first: {bad.item.label}: {bad.value}")
        return [train_result_from_value(r.value) for r in report.results]

    return run
