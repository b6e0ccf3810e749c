"""Monte-Carlo covering classes on the sweep engine: chunks of members as items, one greedy at the end.

The M members of a norm-bounded reference class are drawn in seed blocks (Note [seed blocks] in
``empirical._montecarlo``), so member j depends only on ``(seed, j)``.  A *chunk* is a run of
``chunk_blocks`` whole blocks; each chunk is one sweep item whose value is the chunk's outputs
``(m, n, b)`` on the samples, float64, stored exactly (base64 of the little-endian bytes, see
:func:`encode_array`).  The greedy net and the packing are sequential in member order, so they are
computed once, in the main process, over the chunks' outputs concatenated in member order: the
same ``covering_of_outputs`` call the serial run makes on the same array, hence the same centres,
net and packing sizes, bit for bit, whatever the backend, the number of workers, or how many of
the chunks came back from the store.

Keys: ``item_key("montecarlo", digest, ...)`` where the digest covers the class (config, radii,
radial law, output), the samples' bytes, the seed, the block size, and the key the chunk's member range
and the torch threads of the chunk (a multi-threaded matmul may split a reduction differently and change
the last bits of the outputs, which the greedy compares exactly: red team 214 found ``threads`` left out);
so a re-run resumes chunk by chunk, and any changed option recomputes.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from .._errors import InputError, check_positive_int
from ._keys import item_key
from ._store import ResultStore
from ._sweep import Item, sweep

__all__ = ["encode_array", "decode_array", "reference_items", "montecarlo_chunk", "monte_carlo_reference",
           "local_class_chunk", "monte_carlo_local"]


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """An array as JSON data that reads back bit for bit (float32 or float64, little endian, base64)."""
    dtype = "<f4" if np.asarray(a).dtype == np.float32 else "<f8"
    a = np.ascontiguousarray(a, dtype=dtype)
    return {"dtype": dtype, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_array(d: dict[str, Any]) -> np.ndarray:
    if d.get("dtype") not in ("<f4", "<f8"):
        raise InputError(f"stored outputs have dtype {d.get('dtype')!r}, expected '<f4' or '<f8'")
    raw = base64.b64decode(d["b64"].encode("ascii"), validate=True)
    shape = tuple(int(s) for s in d["shape"])
    size = np.dtype(d["dtype"]).itemsize * math.prod(shape)
    if len(raw) != size:
        raise InputError(f"stored outputs hold {len(raw)} bytes, not the {size} of shape {shape}")
    return np.frombuffer(raw, dtype=d["dtype"]).reshape(shape)


def montecarlo_chunk(payload: dict[str, Any]) -> dict[str, Any]:
    """One chunk's outputs (the item function of a Monte-Carlo class): members ``[start, stop)``."""
    from ..empirical import reference_block_outputs, torch_threads

    with torch_threads(int(payload.get("threads", 1))), torch.no_grad():
        Y = reference_block_outputs(payload["config"], payload["radii"], payload["X"], payload["start"],
                                    payload["stop"], seed=payload["seed"], radial=payload["radial"],
                                    output=payload["output"], block_size=payload["block"])
    Y = Y.detach().to(torch.float64).numpy()
    return {"start": payload["start"], "stop": payload["stop"], "outputs": encode_array(Y),
            "max_abs": float(np.abs(Y).max())}


def _class_digest(config, radii, radial: str, output: str, X: torch.Tensor, seed: int, block: int) -> str:
    Xb = np.ascontiguousarray(X.detach().to(torch.float64).numpy(), dtype="<f8")
    blob = json.dumps({"config": asdict(config), "radii": radii.to_dict(), "radial": radial, "output": output,
                       "seed": int(seed), "block": int(block), "X_shape": list(Xb.shape),
                       "X_sha256": hashlib.sha256(Xb.tobytes()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def reference_items(config, radii, X: torch.Tensor, n_functions: int, *, seed: int = 0, radial: str = "volume",
                    output: str = "head", chunk_blocks: int = 1, threads: int = 1,
                    block: int | None = None) -> list[Item]:
    """The chunks of a block-seeded reference class as sweep items, in member order."""
    from ..empirical import SEED_BLOCK

    block = SEED_BLOCK if block is None else block
    for name, v in (("n_functions", n_functions), ("chunk_blocks", chunk_blocks), ("threads", threads),
                    ("block", block)):
        check_positive_int(v, name)
    digest = _class_digest(config, radii, radial, output, X, seed, block)
    X64 = X.detach().to(torch.float64).contiguous()
    step = chunk_blocks * block
    items = []
    for c, start in enumerate(range(0, n_functions, step)):
        stop = min(n_functions, start + step)
        key = item_key("montecarlo", digest, {"start": start, "stop": stop, "threads": int(threads)})
        items.append(Item(key, f"chunk {c} (members {start}..{stop - 1})",
                          {"config": config, "radii": radii, "X": X64, "start": start, "stop": stop,
                           "seed": int(seed), "radial": radial, "output": output, "block": block,
                           "threads": threads}))
    return items


def monte_carlo_reference(config, radii, X: torch.Tensor, n_functions: int, eps: Sequence[float] | float,
                          q: float | str = math.inf, *, seed: int = 0, radial: str = "volume", output: str = "head",
                          checkpoints: Sequence[int] | None = None, chunk_blocks: int = 1,
                          store: ResultStore | None = None, backend: str = "serial", workers: int = 1,
                          threads: int = 1, resume: bool = True, options: dict[str, Any] | None = None,
                          on_result: Callable | None = None, block: int | None = None):
    """Monte-Carlo covering of the block-seeded reference class, its members evaluated on any backend.

    Args:
        config, radii: the class (:class:`~transcover.model.ReferenceConfig`, :class:`NormRadii`).
        X: the samples ``(n, T, d)``; n_functions: M.
        eps, q, checkpoints: as in :func:`~transcover.empirical.monte_carlo_covering`.
        seed, radial, output: the draw (Note [seed blocks]).
        chunk_blocks: seed blocks per sweep item (the unit that is stored and resumed).
        store, backend, workers, threads, resume, options, on_result: as in :func:`~transcover.scale.sweep`.

    Returns:
        :class:`~transcover.empirical.MonteCarloCovering` (both sizes empirical lower bounds for the
        class), identical for every backend, worker count and state of the store.

    Raises:
        InputError: bad options, or a chunk that failed (the message names it).
    """
    from ..empirical import SEED_BLOCK, covering_of_outputs, sample_reference_class
    from ..empirical import check_outputs_memory

    # every class check (config, radii, radial law, output, memory) before any chunk runs
    probe = sample_reference_class(config, radii, 1, radial=radial, seed=seed, output=output)
    description = probe.description
    check_positive_int(n_functions, "n_functions")
    rows, width = probe.output_shape(X)
    check_outputs_memory(n_functions, rows, width)
    items = reference_items(config, radii, X, n_functions, seed=seed, radial=radial, output=output,
                            chunk_blocks=chunk_blocks, threads=threads, block=block)
    report = sweep(items, montecarlo_chunk, store=store, backend=backend, workers=workers, threads=threads,
                   resume=resume, options=options, on_result=on_result)
    if report.failed:
        bad = report.failed[0]
        raise InputError(f"{len(report.failed)} Monte-Carlo chunk(s) failed; first: {bad.item.label}: {bad.value}")
    Y = np.concatenate([decode_array(r.value["outputs"]) for r in report.results], axis=0)
    if Y.shape[0] != n_functions:
        raise InputError(f"the chunks hold {Y.shape[0]} members, expected {n_functions}")
    res = covering_of_outputs(torch.from_numpy(Y.copy()), eps, q, checkpoints=checkpoints, description=description,
                              workers=threads)
    scale = max(float(r.value["max_abs"]) for r in report.results)
    extra = {"max_abs_output": scale, "seed_block": SEED_BLOCK if block is None else block,
             "draw": "seed blocks (member j depends only on (seed, j))"}
    return dataclasses.replace(res, extra=extra)


_SPECS: dict[tuple, Any] = {}  # per process: (fingerprint, model, arch, strict) -> spec


def local_class_chunk(payload: dict[str, Any]) -> dict[str, Any]:
    """Members ``[start, stop)`` of a local class (a model plus weight perturbations) on the samples.

    Member j is ``LocalClassSample.member(j)``, regenerated from ``(seed, j)``: the rows equal those
    of ``LocalClassSample.evaluate`` for the whole class, whatever the chunking.
    """
    from ..empirical import sample_local_class, torch_threads
    from ..model import transformer_forward
    from ..train import load_model as load
    from ._keys import check_fingerprint

    key = (payload["fingerprint"], payload["model"], payload["arch"], payload["strict"])
    if key not in _SPECS:
        _SPECS.clear()
        # the files must be those the driver keyed the chunks by (red team 214: a relative path was opened in a Ray
        # worker's own working folder, another model under the driver's key)
        check_fingerprint(payload["model"], payload.get("files"), payload.get("hash", "quick"))
        _SPECS[key] = load(payload["model"], arch=payload["arch"], strict=payload["strict"]).to_torch()
    sample = sample_local_class(_SPECS[key], payload["radii"], payload["stop"], radial=payload["radial"],
                                seed=payload["seed"])
    X = payload["X"].double()
    with torch_threads(int(payload.get("threads", 1))), torch.no_grad():
        Y = torch.stack([transformer_forward(sample.member(j), X).reshape(X.shape[0], -1)
                         for j in range(payload["start"], payload["stop"])])
    Y = Y.detach().numpy()  # its own dtype: the greedy decides on the stored floats as they are
    return {"start": payload["start"], "stop": payload["stop"], "outputs": encode_array(Y),
            "max_abs": float(np.abs(Y).max())}


def monte_carlo_local(model: str, radii: dict[str, float], X: torch.Tensor, n_functions: int,
                      eps: Sequence[float] | float, q: float | str = math.inf, *, seed: int = 0,
                      radial: str = "volume", arch: str | None = None, strict: bool = False, chunk: int = 64,
                      store: ResultStore | None = None, backend: str = "serial", workers: int = 1, threads: int = 1,
                      resume: bool = True, options: dict[str, Any] | None = None, on_result: Callable | None = None):
    """``monte_carlo_covering(sample_local_class(load(model), radii, M, ...), X, ...)`` with chunks of
    ``chunk`` members as sweep items on any backend; the same numbers bit for bit (same threads).

    Raises:
        InputError: bad options (checked before any chunk runs), or a chunk that failed.
    """
    from ..empirical import covering_of_outputs, sample_local_class
    from ..train import load_model as load
    from ._keys import absolute_input, fingerprint, worker_fingerprint

    model = absolute_input(model)  # the workers' working folder is not the driver's (red team 214)
    for name, v in (("n_functions", n_functions), ("chunk", chunk), ("threads", threads)):
        check_positive_int(v, name)
    spec = load(model, arch=arch, strict=strict).to_torch()
    probe = sample_local_class(spec, radii, 1, radial=radial, seed=seed)  # checks radii
    description = probe.description
    from ..empirical import check_outputs_memory

    rows, width = probe.output_shape(X)
    check_outputs_memory(n_functions, rows, width)
    fp = fingerprint(model)
    files = worker_fingerprint(model)  # Note [worker check]
    Xb = np.ascontiguousarray(X.detach().to(torch.float64).numpy(), dtype="<f8")
    digest = hashlib.sha256(json.dumps({"model": fp, "radii": {k: float(v) for k, v in sorted(radii.items())},
                                        "radial": radial, "seed": int(seed), "arch": arch, "strict": strict,
                                        "X_shape": list(Xb.shape), "X": hashlib.sha256(Xb.tobytes()).hexdigest()},
                                       sort_keys=True).encode()).hexdigest()
    items = []
    for c, start in enumerate(range(0, n_functions, chunk)):
        stop = min(n_functions, start + chunk)
        items.append(Item(item_key("montecarlo-local", digest, {"start": start, "stop": stop, "threads": int(threads)}),
                          f"chunk {c} (members {start}..{stop - 1})",
                          {"model": model, "fingerprint": fp, "files": files, "hash": "quick", "arch": arch,
                           "strict": strict,
                           "radii": dict(radii),
                           "radial": radial, "seed": int(seed), "X": X.detach(), "start": start, "stop": stop,
                           "threads": threads}))
    report = sweep(items, local_class_chunk, store=store, backend=backend, workers=workers, threads=threads,
                   resume=resume, options=options, on_result=on_result)
    if report.failed:
        bad = report.failed[0]
        raise InputError(f"{len(report.failed)} Monte-Carlo chunk(s) failed; first: {bad.item.label}: {bad.value}")
    Y = np.concatenate([decode_array(r.value["outputs"]) for r in report.results], axis=0)
    res = covering_of_outputs(torch.from_numpy(Y.copy()), eps, q, description=description, workers=threads)
    scale = max(float(r.value["max_abs"]) for r in report.results)
    return dataclasses.replace(res, extra={"max_abs_output": scale}), spec
