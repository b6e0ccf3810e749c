"""``analyze`` over many checkpoints: items, rows, the time series and its figure.

A training run's checkpoints (``RUN_DIR/checkpoint-<step>``) become one item each; every item is a
full ``analyze`` (its JSON, without matrices and without the wall-clock time, which would differ
between runs and break the bit-for-bit comparison of backends).  The rows of the sweep are the
per-model maxima over layers (``AnalysisResult.summary``) with the step parsed from the path.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any

from .._errors import InputError
from ._keys import absolute_input, check_fingerprint, fingerprint, item_key, worker_fingerprint
from ._sweep import Item, SweepReport

__all__ = ["analyze_item", "expand_models", "parse_step", "analysis_items", "sweep_rows", "failure_rows", "rows_csv",
           "sweep_json", "BOUNDS"]

BOUNDS = ("B_KQ", "B_V", "B_W1", "B_W2", "B_b1", "B_b2")
_STEP = re.compile(r"(?:checkpoint|ckpt|step|global_step|epoch)[-_=]?(\d+)", re.IGNORECASE)
_WEIGHTS = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def analyze_item(payload: dict[str, Any]) -> dict[str, Any]:
    """One model's analysis as JSON data (the item function of an analyze sweep)."""
    from ..train import load_model as load
    from ..norms import analyze_spec

    # the files must be those the driver keyed the item by (red team 214: a Ray worker opened another ./m)
    check_fingerprint(payload["model"], payload.get("files"), payload.get("hash", "quick"))
    # a sweep row needs the layers: an architecture outside every adapter is refused (no per-matrix route)
    spec = load(payload["model"], arch=payload.get("arch"), allow_pickle=payload.get("allow_pickle", False),
                strict=payload.get("strict", False))
    result = analyze_spec(spec, fast=payload.get("fast", False), rtol=payload.get("rtol", 1e-3),
                          embeddings=payload.get("embeddings", True))
    data = result.to_dict(matrices=False)
    data.pop("seconds", None)  # wall-clock time: kept by the store beside the value, not in it
    return data


def parse_step(model: str) -> int | None:
    """The training step in a checkpoint's path (``checkpoint-1200``, ``step_300``, ...), innermost first."""
    for part in reversed(Path(model).parts):
        m = _STEP.search(part)
        if m:
            return int(m.group(1))
    return None


def _is_model_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in _WEIGHTS) or any(path.glob("*.safetensors"))


def expand_models(models: list[str]) -> list[str]:
    """Paths as given, except that a run directory (no weights of its own, ``checkpoint-*`` inside)
    becomes its checkpoints, ordered by step; a ``transcover train`` run or checkpoint folder is one model."""
    from ..train import is_train_checkpoint

    out: list[str] = []
    for m in models:
        p = Path(m).expanduser()
        if p.is_dir() and not _is_model_dir(p) and not is_train_checkpoint(p):
            subs = [q for q in p.iterdir() if q.is_dir() and parse_step(q.name) is not None]
            if not subs:
                raise InputError(f"{p} holds no model weights and no checkpoint-<step> folders")
            out += [str(q) for q in sorted(subs, key=lambda q: (parse_step(q.name), q.name))]
        else:
            out.append(m)
    return out


def analysis_items(models: list[str], options: dict[str, Any], hash_mode: str = "quick",
                   threads: int = 1) -> list[Item]:
    """One item per model; the key covers the files (Note [quick fingerprint]), the options and ``threads``.

    The payload names the model by its absolute path and carries the fingerprint, which the worker checks before it
    loads anything (red team 214: relative paths were opened in a Ray worker's own folder).  ``threads`` (the BLAS
    threads of each item) is in the key because a multi-threaded BLAS may split a reduction differently and change
    the last bits (Note [bit for bit]; red team 214: a store filled at one thread count was reused at another)."""
    items = []
    for m in models:
        path = absolute_input(m)
        try:
            fp: str | None = fingerprint(path, hash_mode)
            key = item_key("analyze", fp, {**options, "threads": int(threads)})
        except OSError as err:  # unreadable: the item gets a key of its own and fails when analysed
            fp, key = None, item_key("analyze", f"unreadable:{path}:{err}", {**options, "threads": int(threads)})
        files = None if fp is None else (fp if hash_mode == "full" else worker_fingerprint(path, hash_mode))
        items.append(Item(key, m, {"model": path, **options, "fingerprint": fp, "files": files, "hash": hash_mode}))
    return items


def sweep_rows(report: SweepReport) -> list[dict[str, Any]]:
    """One row per finished model: step, sizes and the lower/upper ends of each bound's max over layers."""
    rows = []
    for r in report.results:
        if not r.ok:
            continue
        d = r.value
        row: dict[str, Any] = {"model": r.item.label, "step": parse_step(r.item.label), "arch": d["arch"],
                               "n_layers": d["n_layers"], "d_model": d["d_model"], "kind": d["kind"]}
        for key in BOUNDS:
            iv = d["summary"][key]
            row[f"{key}_lower"], row[f"{key}_upper"] = iv["lower"], iv["upper"]
        rows.append(row)
    if rows and all(row["step"] is not None for row in rows):
        rows.sort(key=lambda row: row["step"])
    return rows


def failure_rows(report: SweepReport) -> list[dict[str, Any]]:
    """One row per failed model (``model``, ``step``, ``error``), for the CSV beside ``sweep_rows``: a CSV of the
    finished rows alone left the failed checkpoints out without a mark (red team 184)."""
    return [{"model": r.item.label, "step": parse_step(r.item.label), "error": r.value} for r in report.failed]


def rows_csv(rows: list[dict]) -> str:
    """Rows as CSV text: the union of their keys as the header (first-seen order), an absent value
    empty, floats in ``repr`` (round-trips exactly; ``inf`` and ``nan`` as Python and pandas read them); no
    rows: no text."""
    if not rows:
        return ""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(keys)
    for r in rows:
        w.writerow(["" if r.get(k) is None else repr(r[k]) if isinstance(r[k], float) else r[k] for k in keys])
    return buf.getvalue()


def sweep_json(report: SweepReport, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "schema": "transcover.sweep", "schema_version": "1.0", "command": "analyze",
        "counts": {"items": len(report.results), "computed": report.computed, "reused": report.reused,
                   "failed": len(report.failed)},
        "rows": rows,
        "failures": [{"model": r.item.label, "error": r.value} for r in report.failed],
        "results": [{"model": r.item.label, "key": r.item.key, "result": r.value}
                    for r in report.results if r.ok],
    }
