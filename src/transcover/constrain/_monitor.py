"""Training monitor: gradient norm, per-group sigma and radius, capacity, losses -> JSONL + CSV + plots.

Seed 6.2 asks to "monitor gradient norms during training".  Each record is one optimiser step
(or one evaluation) and is appended to ``<path>.jsonl`` and ``<path>.csv`` as it happens, so a
crashed or interrupted run keeps its history.  Per group, ``sigma.<G>`` is the maximum over layers
(and heads) of the *exact* norm (float64 SVD; ``_measure``) of the weights the forward pass used,
``radius.<G>`` the largest radius those weights were constrained to (``Constrainer.radii_in_force``: a cap's
scheduled radius at that step; for ``project``/``clip`` the previous step's projection) and ``ratio.<G>`` the
largest ``sigma / c`` over the group's constrained slots.  A ratio above 1 is the cap exceeded
(issue 10, defect 8: the power-iteration ``spectral`` cap reached 1.31 on digits).

Note [forward weights]: a training loop calls :meth:`TrainingMonitor.snapshot` after ``backward``
and before the optimiser step; the parametrized values read then in eval mode are bit for bit the
ones the step's forward used (caps refined their power-iteration vectors in that forward and no
one touched them since).  :meth:`TrainingMonitor.log` uses that snapshot, or measures the current
weights when there is none (e.g. at evaluations).

Note [certified columns]: the per-step ``sigma.<G>`` are exact float64 norms, training signals
(what the penalties and projections act on), not certificates.  What the history calls *certified*
comes from one place: ``log(certify=True)`` (the training loop does it at every evaluation) runs
``transcover.norms.measure_model`` on the spec of the module's forward weights
(:func:`~transcover.constrain.certified_model_norms`) and records ``certified.<G>`` (the largest
certified upper end over the group's layers and heads, in the CSV too) and ``certified_norms``
(JSONL only: per layer the certified intervals of every head's ``W_KQ`` and ``W_OV`` and of
``W_1``, ``W_2``, with the bias norms), kind *certified interval*.

``capacity`` is the product-of-norms Lipschitz proxy of THEORY F8 (:func:`capacity_proxy`), an
estimate (:data:`CAPACITY_KIND`); it is the factor every covering bound of F9/F10 scales with, not
itself a generalisation bound.  ``log_covering`` is filled by the caller when it computes the
certified covering bound (``transcover.covering``, log10 of log N at eps = 0.1), which costs about
a second and so is logged at evaluations only.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
from pathlib import Path

from torch import nn

from .._errors import InputError
from .._io import atomic_write_text
from ..model import read_recorded
from ._measure import certified_model_norms, certified_slot_uppers, exact_slot_norms, forward_weights
from ._penalties import capacity_proxy
from ._slots import GROUPS, find_slots

__all__ = ["TrainingMonitor", "grad_norm", "read_history", "certified_record", "CAPACITY_KIND"]

CAPACITY_KIND = "estimate: product-of-norms Lipschitz proxy (THEORY F8), not a certified bound"
_BASE = ("step", "epoch", "progress", "loss", "grad_norm", "lr", "capacity", "log_covering",
         "train_loss", "train_acc", "test_loss", "test_acc")


def grad_norm(model: nn.Module) -> float:
    """``||grad||_2`` over every parameter that has a gradient (0 when none has)."""
    sq = 0.0
    for p in model.parameters():
        if p.grad is not None:
            sq += float(p.grad.detach().double().pow(2).sum())
    return math.sqrt(sq)


class TrainingMonitor:
    """Appends one record per call of :meth:`log` to ``<prefix>.jsonl`` and ``<prefix>.csv``.

    Args:
        model: the (possibly constrained) model whose norms are tracked.
        prefix: output path without suffix; its folder must exist.  ``None``: keep records in memory.
        radii: a callable returning the current ``{slot key: radius}`` (e.g. ``Constrainer.radii``).
        resume: append to existing files instead of starting them afresh.
        stale: files of an earlier run in the same place (its checkpoint), removed when this fresh history starts
            on disk (``begin``), so a run that fails before its first row leaves the earlier run as it was.
        keep_until: with ``resume``, drop the records after this step (those written after the
            checkpoint a run resumes from, so the history has no duplicates) and reload the rest.
        ratios: record ``ratio.<G> = sigma / c`` (the radii bound sigma; not for entrywise clipping).
    """

    def __init__(self, model: nn.Module, prefix: str | os.PathLike[str] | None = None, *, radii=None,
                 resume: bool = False, keep_until: int | None = None, ratios: bool = True, stale: tuple = ()):
        self.model = model
        self.slots = find_slots(model)
        self.n_layers = 1 + max(s.layer for s in self.slots if s.group != "head")
        self.groups = [g for g in GROUPS if any(s.group == g for s in self.slots)]
        self.columns = (list(_BASE) + [f"sigma.{g}" for g in self.groups] + [f"radius.{g}" for g in self.groups]
                        + [f"ratio.{g}" for g in self.groups] + [f"certified.{g}" for g in self.groups])
        self.radii = radii
        self.ratios = ratios
        self._snapshot: dict[str, float | None] | None = None
        self._stale: tuple[Path, ...] | None = None  # a fresh history's stale files, until it starts on disk
        self.records: list[dict[str, float | int | None]] = []
        self.prefix = None if prefix is None else Path(prefix)
        if self.prefix is not None:
            if not self.prefix.parent.exists():
                raise InputError(f"cannot write the history: folder {self.prefix.parent} does not exist")
            jsonl, csv_path = self.paths
            if resume and jsonl.exists():
                kept = [r for r in read_history(jsonl, torn_tail=True) if keep_until is None or r["step"] <= keep_until]
                self.records = kept
                atomic_write_text(jsonl, "".join(json.dumps(r) + "\n" for r in kept))
                atomic_write_text(csv_path, ",".join(self.columns) + "\n" + "".join(self._csv_row(r) for r in kept))
            else:
                # a fresh history replaces an old one only with its first row, and the old run's files listed in
                # ``stale`` (its checkpoint) go at that moment: a new run that failed before any row had emptied the
                # old history and left the old checkpoint beside it (red team 188)
                self._stale = tuple(Path(p) for p in stale)

    def begin(self) -> None:
        """Start a fresh history on disk (empty files with the header) and remove the old run's ``stale`` files, once;
        the first row does it, and a caller about to write anything else of the new run (a checkpoint) calls it
        first."""
        if self._stale is None:
            return
        jsonl, csv_path = self.paths
        for path in self._stale:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        atomic_write_text(jsonl, "")
        atomic_write_text(csv_path, ",".join(self.columns) + "\n")
        self._stale = None

    @property
    def paths(self) -> tuple[Path, Path]:
        assert self.prefix is not None
        return self.prefix.with_suffix(".jsonl"), self.prefix.with_suffix(".csv")

    def norms(self) -> dict[str, float | None]:
        """Per group: max exact ``sigma`` of the current forward weights, radius, max ``sigma / c``;
        and ``capacity`` (THEORY F8 from the same exact norms)."""
        with forward_weights(self.model):
            sig = {s.key: exact_slot_norms(s) for s in self.slots}
        current = self.radii() if self.radii is not None else {}
        out: dict[str, float | None] = {}
        for g in self.groups:
            keys = [s.key for s in self.slots if s.group == g]
            out[f"sigma.{g}"] = max(float(sig[k].max()) for k in keys)
            radii = [current[k] for k in keys if k in current]
            out[f"radius.{g}"] = max(radii) if radii else None
            ratios = [float(sig[k].max()) / current[k] for k in keys if k in current]
            out[f"ratio.{g}"] = max(ratios) if ratios and self.ratios else None
        out["capacity"] = capacity_proxy(sig, self.n_layers)  # reads the matrix groups only
        return out

    def snapshot(self) -> None:
        """Measure the weights the current step's forward used (Note [forward weights])."""
        self._snapshot = self.norms()

    def certified(self) -> dict[str, object]:
        """The certified columns of the current weights (Note [certified columns])."""
        measured = certified_model_norms(self.model)
        uppers = certified_slot_uppers(self.model, self.slots, measured)
        out: dict[str, object] = {f"certified.{g}": max(v for k, v in uppers.items() if k.split(".")[0] == g)
                                  for g in self.groups}
        out["certified_norms"] = certified_record(measured[0])
        return out

    def log(self, certify: bool = False, measure: bool = True,
            **fields: float | int | None) -> dict[str, float | int | None]:
        """Record ``fields`` (any of the columns) plus the norms, radii and ratios; returns the record.
        ``certify``: also the certified columns (``measure_model``; Note [certified columns]).  ``measure=False``:
        no norms (a row of losses averaged over earlier steps, whose forward weights are already in those steps' rows;
        the current weights beside them gave one step two different sigmas: red team 171)."""
        unknown = set(fields) - set(self.columns)
        if unknown:
            raise InputError(f"unknown monitor field(s): {', '.join(sorted(unknown))}")
        rec: dict[str, float | int | None] = dict.fromkeys(self.columns)
        if measure or self._snapshot is not None:
            rec.update(self._snapshot if self._snapshot is not None else self.norms())
        self._snapshot = None
        if certify:
            rec.update(self.certified())  # type: ignore[arg-type]
        rec.update(fields)
        self.records.append(rec)
        if self.prefix is not None:
            jsonl, csv_path = self.paths
            self.begin()
            with jsonl.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
            with csv_path.open("a") as fh:
                fh.write(self._csv_row(rec))
        return rec

    def max_ratios(self) -> dict[str, tuple[float, int | None]]:
        """Per group, the largest ``sigma / c`` recorded so far and the step where it occurred."""
        out: dict[str, tuple[float, int | None]] = {}
        for g in self.groups:
            vals = [(r[f"ratio.{g}"], r.get("step")) for r in self.records if r.get(f"ratio.{g}") is not None]
            if vals:
                out[g] = max(vals, key=lambda t: t[0])
        return out

    def _csv_row(self, rec: dict) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(["" if rec.get(c) is None else rec[c] for c in self.columns])
        return buf.getvalue()


def certified_record(norms) -> dict[str, object]:  # noqa: ANN001  (a transcover.norms.ModelNorms)
    """The JSON form of a measurement's certified intervals the history keeps, per layer:
    ``W_KQ`` and ``W_OV`` per head (``[lower, upper]``, ``W_KQ`` with the softmax scale), ``W_1``,
    ``W_2`` and the float64 bias norms ``b_1``, ``b_2``."""
    def pair(iv) -> list[float]:  # noqa: ANN001
        return [iv.lower, iv.upper]

    return {"kind": norms.kind.value, "source": "transcover.norms.measure_model",
            "layers": [{"layer": L.index, "W_KQ": [pair(h.W_KQ(L.scale)) for h in L.heads],
                        "W_OV": [pair(h.W_OV) for h in L.heads], "W_1": pair(L.W_1), "W_2": pair(L.W_2),
                        "b_1": L.b_1, "b_2": L.b_2} for L in norms.layers]}


def read_history(path: str | os.PathLike[str], *, torn_tail: bool = False) -> list[dict]:
    """The records of a ``.jsonl`` history file, each checked: a JSON object whose ``step`` is an integer and
    whose other values are numbers, null or nested records (``certified_norms``).

    ``torn_tail``: a last line that is not JSON is dropped (a run killed in the middle of an append leaves one;
    ``train --resume`` continues from the records before it).  Anything else that is not such a record is
    :class:`InputError`, one line naming the file and the line (a truncated line, a list or a binary file
    stopped ``report`` and ``--resume`` with an internal error, and a wrong schema was drawn as a meaningless
    training section; red team 37h).
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"history file {path} does not exist")
    try:  # recorded with its identity when read: the JSON envelope refuses it changed since (Note [inputs read])
        lines = read_recorded(path, lambda f: f.read()).decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise InputError(f"history file {path} is not UTF-8 text (a monitor's .jsonl)") from None
    except OSError as err:
        raise InputError(f"cannot read history file {path}: {err.strerror or err}") from None
    numbered = [(k + 1, line) for k, line in enumerate(lines) if line.strip()]
    records = []
    for j, (k, line) in enumerate(numbered):
        try:
            rec = json.loads(line)
        except ValueError as err:
            if torn_tail and j == len(numbered) - 1:
                break
            # json's own errors carry .msg; Python's integer-digit limit raises a plain ValueError (stop 39 red team)
            raise InputError(f"history file {path} line {k} is not JSON ({getattr(err, 'msg', err)})") from None
        step = rec.get("step") if isinstance(rec, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or not all(
                v is None or isinstance(v, (dict, list)) or (isinstance(v, (int, float)) and not isinstance(v, bool))
                for v in rec.values()):
            raise InputError(f"history file {path} line {k} is not a monitor record (a JSON object with an "
                             "integer 'step' and numbers, null or nested records as values)")
        records.append(rec)
    return records
