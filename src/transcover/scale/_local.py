"""Per-example local certification on the sweep engine: one sequence of a dataset per item (issue 14).

``lipschitz --data`` (``lipschitz._local_report.local_table``) certifies every layer and component
on balls around each sequence and reports, per ``(rho, layer, component)``, the max over sequences
of the local constants and of the Jacobian lower estimates, beside the global constant at the
data's largest token norm ``R`` and the domain constant at the smallest variance floor ``sigma_0``
seen on any ball.  Everything expensive is per sequence; what couples the sequences is a max, a
min and two calls of ``lipschitz_bounds``.  So the work splits exactly:

* :func:`local_example` (an item): one sequence's stage constants for every rho (``layer_local``),
  its Jacobian lower estimates (``jacobian_operator_norm``, fixed seed), its ``R_k`` and the
  smallest ``min_sigma`` of its balls;
* :func:`merge_local`: the same maxima and minima over the items, in the same order, then the
  global and domain constants -- the rows ``local_table`` returns on the same data, bit for bit
  (a test checks it against ``local_table`` itself, so a change there is caught).

Floats travel as ``float.hex`` strings: exact, and ``inf``/``nan`` survive JSON.  The model is loaded
once per worker process (a small cache keyed by the model's fingerprint and load options).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._errors import InputError
from ._keys import absolute_input, check_fingerprint, fingerprint, item_key, worker_fingerprint
from ._store import ResultStore
from ._sweep import Item, sweep

__all__ = ["local_items", "local_example", "merge_local", "local_rows"]

_SPECS: dict[tuple, Any] = {}  # per process: (fingerprint, load options) -> float64 spec


def _hex(x: float) -> str:
    return float(x).hex()


def _unhex(s: str) -> float:
    return float.fromhex(s)


def _spec(payload: dict[str, Any]):
    from ..train import load_model as load

    roles = payload.get("roles")
    # the mapping's content, not its path: an edited file between two calls in one process reused the spec read
    # through the old one (red team 184)
    key = (payload["fingerprint"], payload["model"], payload["arch"], payload["allow_pickle"], payload["strict"],
           _roles_digest(roles))
    if key not in _SPECS:
        _SPECS.clear()  # one model per sweep: keep only the latest
        # checked where the spec is loaded (once per process): the files and the mapping must be those the driver
        # keyed the items by (red team 214: a Ray worker opened another ./m in its own working folder)
        check_fingerprint(payload["model"], payload.get("files"), payload.get("hash", "quick"))
        if "roles_digest" in payload and _roles_digest(roles) != payload["roles_digest"]:
            raise InputError(f"the roles mapping {roles} on this worker is not the one the driver keyed the items by")
        _SPECS[key] = load(payload["model"], arch=payload["arch"], allow_pickle=payload["allow_pickle"],
                           strict=payload["strict"], roles=roles).to_torch(torch.float64)
    return _SPECS[key]


def _stage_inputs(spec, X: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer, the input of the layer and of each stage on the data path (as ``local_table``)."""
    from ..model import Placement, attention_forward, ffn_forward, layer_forward

    point = spec.input_norm(X.double()) if spec.input_norm is not None else X.double()
    out = []
    for layer in spec.layers:
        ins = {"layer": point, "attention": point}
        if layer.placement is Placement.POST:
            X1 = point + attention_forward(layer.attention, point)
            ins["norm_attn"] = X1
            H = layer.norm_attn(X1)
            ins["ffn"] = H
            ins["norm_ffn"] = H + ffn_forward(layer.ffn, H)
        else:
            ins["ffn"] = point + attention_forward(layer.attention, layer.norm_attn(point))
        out.append(ins)
        point = layer_forward(layer, point).detach()
    return out


def local_example(payload: dict[str, Any]) -> dict[str, Any]:
    """One sequence's share of ``local_table`` (the item function; module docstring)."""
    from ..empirical import torch_threads
    from ..lipschitz import jacobian_operator_norm, layer_local
    from ..lipschitz import stage_functions, stage_global_parts, stage_local_constants
    from ..model import layer_forward

    with torch_threads(int(payload.get("threads", 1))):
        spec = _spec(payload)
        X = torch.from_numpy(np.frombuffer(bytes.fromhex(payload["X"]), dtype="<f8").reshape(payload["shape"]).copy())
        stage_inputs = _stage_inputs(spec, X)
        lows = []
        if payload["lower"]:
            for i, layer in enumerate(spec.layers):
                fns = {"layer": (lambda lay: (lambda Z: layer_forward(lay, Z)))(layer), **stage_functions(layer)}
                for name, fn in fns.items():
                    v, _ = jacobian_operator_norm(fn, stage_inputs[i][name], metric="2,inf",
                                                  n_iter=payload["lower_iter"])
                    lows.append([i, name, _hex(v)])
        per_rho = []
        cache: dict = {}
        for f in payload["rhos"]:
            stages, points, sigma = [], [], math.inf
            for i, layer in enumerate(spec.layers):
                Z = stage_inputs[i]["layer"]
                rho = f * float(Z.norm(dim=1).median()) if payload["relative"] else f
                ll = layer_local(layer, Z, rho, cache=cache, jacobian=payload["jacobian"])
                sigma = min(sigma, ll.min_sigma)
                parts = stage_global_parts(ll, layer.placement)
                for name, v in {**stage_local_constants(ll, layer.placement), "layer": ll.upper}.items():
                    stages.append([i, name, _hex(v), parts[name]])
                points.append(_hex(ll.jacobian_point))
            per_rho.append({"stages": stages, "points": points, "min_sigma": _hex(sigma)})
    return {"R": _hex(float(X.norm(dim=1).max())), "lows": lows, "per_rho": per_rho}


def merge_local(spec, parts: Sequence[dict[str, Any]], rhos: Sequence[float], *, lower: bool = True) -> list:
    """The rows of ``local_table`` from the items' values, in order (module docstring)."""
    from ..lipschitz import assemble_local_rows, keep_max, lipschitz_bounds

    if not parts:
        raise InputError("the data is empty (no sequences)")
    R = max(_unhex(p["R"]) for p in parts)
    glob = lipschitz_bounds(spec, radius=R)
    lows: dict[tuple[int, str], float] = {}
    if lower:
        for j, (i, name, _) in enumerate(parts[0]["lows"]):
            lows[(i, name)] = max(_unhex(p["lows"][j][2]) for p in parts)
    rows = []
    for r, f in enumerate(rhos):
        best: dict[tuple[int, str], float] = {}
        took: dict[tuple[int, str], str] = {}
        point: dict[int, float] = {}
        sig0 = math.inf
        for i in range(spec.n_layers):  # layer-major, then sequence: local_table's insertion order
            for p in parts:
                pr = p["per_rho"][r]
                for li, name, v, why in pr["stages"]:
                    if li == i:
                        keep_max(best, took, (i, name), _unhex(v), why)
                point[i] = max(point.get(i, 0.0), _unhex(pr["points"][i]))
        for p in parts:
            sig0 = min(sig0, _unhex(p["per_rho"][r]["min_sigma"]))
        dom = lipschitz_bounds(spec, radius=R, sigma_min=max(sig0, 0.0)) if math.isfinite(sig0) else glob
        rows += assemble_local_rows(f, best, point, lows, glob, dom, lower=lower, took=took)
    return rows


def _roles_digest(roles) -> str | None:
    """sha256 of a mapping's canonical JSON (a dict, or a file's parsed content: the same mapping as a file or a dict,
    however spaced, has one key); a file that does not parse, by its bytes; None without a mapping."""
    if roles is None:
        return None
    if not isinstance(roles, dict):
        try:
            raw = Path(roles).read_bytes()
        except OSError:  # the loader names a missing or unreadable mapping file in its own line
            return str(roles)
        try:
            roles = json.loads(raw)
        except ValueError:
            return hashlib.sha256(raw).hexdigest()
    return hashlib.sha256(json.dumps(roles, sort_keys=True).encode()).hexdigest()


def local_items(model: str | None, seqs: Sequence[torch.Tensor], rhos: Sequence[float], *, relative: bool = True,
                lower: bool = True, lower_iter: int = 15, jacobian: bool = True, arch: str | None = None,
                allow_pickle: bool = False, strict: bool = False, roles=None, threads: int = 1,
                hash_mode: str = "quick") -> list[Item]:
    """One item per sequence; the key covers the model's files, the sequence's bytes, the options and the mapping file
    (``roles``: a path or a dict, as ``transcover.load``; its bytes, not its name)."""
    model = absolute_input(model)  # the workers' working folder is not the driver's (red team 214)
    if roles is not None and not isinstance(roles, dict):
        roles = absolute_input(roles)
    fp = fingerprint(model, hash_mode)
    files = fp if hash_mode == "full" else worker_fingerprint(model, hash_mode)  # Note [worker check]
    options = {"rhos": [_hex(f) for f in rhos], "relative": bool(relative), "lower": bool(lower),
               "lower_iter": int(lower_iter), "jacobian": bool(jacobian), "arch": arch,
               "allow_pickle": bool(allow_pickle), "strict": bool(strict), "threads": int(threads),
               "roles": _roles_digest(roles)}
    items = []
    for k, X in enumerate(seqs):
        Xb = np.ascontiguousarray(torch.as_tensor(X).detach().to(torch.float64).numpy(), dtype="<f8")
        digest = hashlib.sha256(f"{Xb.shape}".encode() + Xb.tobytes()).hexdigest()
        key = item_key("local", fp, {**options, "sequence": digest})
        items.append(Item(key, f"sequence {k} ({Xb.shape[0]} tokens)",
                          {**options, "rhos": [float(f) for f in rhos], "model": model, "fingerprint": fp,
                           "files": files,
                           "hash": hash_mode, "roles_digest": options["roles"],
                           "roles": roles if roles is None or isinstance(roles, dict) else str(roles),
                           "X": Xb.tobytes().hex(), "shape": list(Xb.shape)}))
    return items


def local_rows(model: str | None, seqs: Sequence[torch.Tensor], rhos: Sequence[float], *, spec=None,
               relative: bool = True, lower: bool = True, lower_iter: int = 15, jacobian: bool = True,
               arch: str | None = None, allow_pickle: bool = False, strict: bool = False, roles=None,
               store: ResultStore | None = None, backend: str = "serial", workers: int = 1, threads: int = 1,
               resume: bool = True, options: dict[str, Any] | None = None, on_result: Callable | None = None) -> list:
    """``local_table``'s rows for ``model`` at ``seqs``, one sequence per item on any backend, resumable.

    Args:
        model: what ``transcover.model.load`` reads (path or short name; workers load it themselves).
        seqs: embedded sequences ``(T, d)`` (``model._data.load_inputs``).
        rhos, relative, lower, lower_iter, jacobian: as in ``local_table``.
        arch, allow_pickle, strict, roles: how ``model`` is read (``transcover.load``).
        spec: the float64 spec of ``model`` if already loaded (the merge needs it).
        store, backend, workers, threads, resume, options, on_result: as in :func:`~transcover.scale.sweep`.

    Returns:
        ``LocalRow`` list, equal to ``local_table(spec, seqs, rhos, ...)`` bit for bit.

    Raises:
        InputError: a sequence failed (the message names it), or ``check_certified`` found a
            lower estimate above a certified value.
    """
    items = local_items(model, seqs, rhos, relative=relative, lower=lower, lower_iter=lower_iter, jacobian=jacobian,
                        arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles, threads=threads)
    report = sweep(items, local_example, store=store, backend=backend, workers=workers, threads=threads,
                   resume=resume, options=options, on_result=on_result)
    if report.failed:
        bad = report.failed[0]
        raise InputError(f"{len(report.failed)} sequence(s) failed; first: {bad.item.label}: {bad.value}")
    if spec is None:
        from ..train import load_model as load

        spec = load(model, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles).to_torch(torch.float64)
    return merge_local(spec, [r.value for r in report.results], rhos, lower=lower)
