"""Test helper: an exact memo of ``transcover.covering.model_bound``.

``model_bound`` is a deterministic function of its arguments (a spec's weights and fields, the BoundConfig's numbers,
the reference), and it is most of the CPU of every ``train`` call (its final generalisation bound), of ``bound`` and of
``report``.  Several tests of a file compute it on bit-identical inputs: a resumed run ends with the weights of the
uninterrupted one (so its final bound is the same computation), ``bound RUN`` and ``report RUN`` of one run.  The memo
keys a call on a SHA-256 of every argument, every tensor's dtype, shape and raw bytes, every dataclass field, enum and
number (``repr`` of a float is exact); a call with anything it cannot key (``terms=``, ``norms=``, an unknown type) goes
to the real function.  A hit returns a deep copy of the stored result, so no caller sees another's object.  Exceptions
are not stored: a refused call is refused again by the real function.

The spec's ``name`` (a label: the result's ``model``, taken from each call) and ``config`` (the loader's notes, e.g.
the stored dtype, which ``model_bound`` never reads) are left out of the key, and the options are keyed as the
BoundConfig ``model_bound`` forms from them: ``train``'s final bound of a run and ``bound RUN`` are one computation.

``BOUND_MEMO_VERIFY=1`` recomputes every hit and asserts it equals the stored result (``to_dict()``, compared as JSON):
the check that the key misses nothing the result depends on.

``local_table_once`` does the same for ``transcover.lipschitz.local_table`` (stop 51): ``lipschitz RUN --data``
computes it on bit-identical inputs when one run is read through two ``--data`` forms that give the same sequences, or
when two tests ask for the same table with other outputs (``--json`` / ``--csv`` / ``--plot``).  Its key is the
fingerprint of every argument (the whole spec, ``name`` included; every sequence's dtype, shape and bytes; the radii;
every keyword); a call with ``timings=`` (a dict the function fills) goes to the real function.
``BOUND_MEMO_VERIFY=1`` checks its hits as JSON of the rows, any clock field left out.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch


class _Unkeyable(TypeError):
    pass


def _feed(h, obj) -> None:  # noqa: ANN001, C901
    if obj is None or isinstance(obj, (bool, int, str, bytes)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    elif isinstance(obj, float):
        h.update(f"float:{obj!r};".encode())
    elif isinstance(obj, enum.Enum):
        h.update(f"enum:{type(obj).__qualname__}.{obj.name};".encode())
        _feed(h, obj.value)
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor:{t.dtype}:{tuple(t.shape)}:{t.layout}:{t.requires_grad};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"ndarray:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    elif isinstance(obj, np.generic):
        h.update(f"npscalar:{obj.dtype.str}:{obj.item()!r};".encode())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        h.update(f"dc:{type(obj).__module__}.{type(obj).__qualname__}(".encode())
        for f in dataclasses.fields(obj):
            h.update(f"{f.name}=".encode())
            _feed(h, getattr(obj, f.name))
        h.update(b");")
    elif isinstance(obj, Mapping):  # a dict or a lazy mapping (embeddings read on demand): keyed by its items
        h.update(f"map:{len(obj)}(".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
        h.update(b");")
    elif isinstance(obj, Sequence):  # a list, tuple or lazy LayerSequence (layers built on demand): by its items
        h.update(f"seq:{len(obj)}(".encode())
        for v in obj:
            _feed(h, v)
        h.update(b");")
    else:
        raise _Unkeyable(type(obj))


def fingerprint(obj) -> str | None:  # noqa: ANN001
    """SHA-256 of everything in ``obj`` (None if some part cannot be keyed exactly)."""
    h = hashlib.sha256()
    try:
        _feed(h, obj)
    except _Unkeyable:
        return None
    return h.hexdigest()


def _as_json(result) -> str:  # noqa: ANN001
    return json.dumps(result.to_dict(), sort_keys=True, default=repr)


class ModelBoundMemo:
    """``model_bound`` computed once per distinct argument set (see the module docstring)."""

    def __init__(self, real):  # noqa: ANN001
        self.real, self.store, self.hits, self.misses = real, {}, 0, 0
        self.verify = os.environ.get("BOUND_MEMO_VERIFY") == "1"

    def __call__(self, spec, config=None, *, reference=None, terms=None, norms=None, **options):  # noqa: ANN001, ANN003, ANN204
        key = None
        if terms is None and norms is None:
            key = self._key(spec, config, reference, options)
        if key is None:
            return self.real(spec, config, reference=reference, terms=terms, norms=norms, **options)
        if key not in self.store:
            self.misses += 1
            self.store[key] = self.real(spec, config, reference=reference, **options)
            return copy.deepcopy(self.store[key])
        self.hits += 1
        hit = dataclasses.replace(copy.deepcopy(self.store[key]), model=spec.name)
        if self.verify:
            again = self.real(spec, config, reference=reference, **options)
            assert _as_json(again) == _as_json(hit), "model_bound memo: a hit differs"
        return hit

    @staticmethod
    def _key(spec, config, reference, options):  # noqa: ANN001, ANN205
        """The key: the spec without its label (``name``, which the result carries as ``model`` and a hit takes from
        the call, and ``config``, the loader's notes, which the bound never reads) and the BoundConfig as
        ``model_bound`` forms it first (``replace(config or BoundConfig(), **options).checked()``): a config passed
        whole and the same numbers passed as options are one computation.  None where that cannot be formed (the real
        function then refuses the call itself)."""
        from transcover.covering import BoundConfig

        if not (dataclasses.is_dataclass(spec) and {"name", "config"} <= {f.name for f in dataclasses.fields(spec)}):
            return None
        try:
            cfg = dataclasses.replace(config or BoundConfig(), **options).checked()
        except Exception:  # noqa: BLE001
            return None
        return fingerprint(("model_bound", dataclasses.replace(spec, name="", config={}), cfg, reference))


@contextlib.contextmanager
def model_bound_once():
    """``transcover.covering.model_bound`` (which train, bound, report and the CLI import at call time) memoised."""
    import transcover.covering as covering

    memo = ModelBoundMemo(covering.model_bound)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(covering, "model_bound", memo)
        yield memo
    if memo.verify:  # seen with -s: how many calls the memo served, each recomputed and compared above
        print(f"\nmodel_bound memo: {memo.hits} hits (verified), {memo.misses} misses", file=sys.stderr)


_CLOCK = ("seconds", "time", "wall_s", "cpu_s")  # none in LocalRow.to_dict today; a clock there would never match


def _rows_json(rows) -> str:  # noqa: ANN001
    return json.dumps([{k: v for k, v in r.to_dict().items() if k not in _CLOCK} for r in rows], sort_keys=True,
                      default=repr)


class LocalTableMemo:
    """``local_table`` computed once per distinct argument set (the module docstring's last paragraph)."""

    def __init__(self, real):  # noqa: ANN001
        self.real, self.store, self.hits, self.misses = real, {}, 0, 0
        self.verify = os.environ.get("BOUND_MEMO_VERIFY") == "1"

    def __call__(self, spec, seqs, rho_factors, **kw):  # noqa: ANN001, ANN003, ANN204
        key = None if kw.get("timings") is not None else fingerprint(("local_table", spec, list(seqs),
                                                                      [float(r) for r in rho_factors],
                                                                      sorted(kw.items())))
        if key is None:
            return self.real(spec, seqs, rho_factors, **kw)
        if key not in self.store:
            self.misses += 1
            self.store[key] = self.real(spec, seqs, rho_factors, **kw)
            return copy.deepcopy(self.store[key])
        self.hits += 1
        hit = copy.deepcopy(self.store[key])
        if self.verify:
            again = self.real(spec, seqs, rho_factors, **kw)
            assert _rows_json(again) == _rows_json(hit), "local_table memo: a hit differs"
        return hit


@contextlib.contextmanager
def local_table_once():
    """``transcover.lipschitz.local_table`` (which ``lipschitz --data`` imports at call time) memoised (module
    docstring, last paragraph)."""
    import transcover.lipschitz as lipschitz

    memo = LocalTableMemo(lipschitz.local_table)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lipschitz, "local_table", memo)
        yield memo
    if memo.verify:
        print(f"\nlocal_table memo: {memo.hits} hits (verified), {memo.misses} misses", file=sys.stderr)
