"""One JSON envelope for every command's output: schema, tool version, command line, inputs' hashes.

The envelope *adds* keys around a command's payload (the payload's own keys stay where they
were, so readers of the older files keep working): ``schema`` and ``schema_version`` name the
payload's layout, ``tool`` and ``tool_version`` the program that wrote it, ``command_line`` how
it was called and ``inputs`` the SHA-256 of every file read (a model directory lists the config, weight and
shard files its load reads, a training run its ``state.json`` and weights; ``--data`` and ``--history`` files, and
the tokenizer that split the texts), so a result can be traced to exactly the weights it measured; a file changed since
the loader read it is refused (Note [inputs read] in ``model._files``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

__all__ = ["envelope", "envelope_json", "input_hashes", "file_sha256"]

_HASH_CACHE: dict[tuple, str] = {}


def _sha256_read(path: Path) -> tuple[str, tuple[int, ...]]:
    """``path``'s SHA-256 and the identity (``model.file_identity``) of the bytes hashed.

    Cached per resolved path and identity: device, inode, size, modification and change times.  Keyed by size and
    mtime alone, an in-place rewrite at the same size with its mtime put back got the stale hash (red team 219); the
    change time cannot be put back.

    Raises:
        InputError: the file changed while it was hashed.
    """
    from .._errors import InputError
    from ..model import file_identity

    with open(path, "rb") as fh:
        before = file_identity(fh)
        key = (os.path.realpath(path), *before)
        if key not in _HASH_CACHE:
            h = hashlib.sha256()
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
            if file_identity(fh) != before:
                raise InputError(f"{path} changed while its checksum was computed; rerun on a copy that does not "
                                 "change")
            _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key], before


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes (cached per path, device, inode, size, mtime and ctime within a process)."""
    return _sha256_read(Path(path))[0]


def _model_path(source) -> Path | None:
    if source is None:
        from ..model import bundled_model_dir

        try:
            return bundled_model_dir()
        except Exception:  # the bundled package missing: nothing to hash
            return None
    if isinstance(source, (str, os.PathLike)) and Path(source).exists():
        return Path(source)
    return None


def _files(path: Path) -> list[Path]:
    """The files of ``path`` to hash: those a load of it reads (a training run: ``train.checkpoint_files``, its
    checkpoint's ``state.json`` and ``model.safetensors``; any other model: ``model.files_read``, config, weights,
    every shard an index names, in subfolders too; a data or history file: itself).  Never a folder's listing: a run
    folder listed nothing, and a checkpoint folder every file of a model suffix in it, read or not (red team 222)."""
    from ..model import files_read
    from ..train import checkpoint_files

    run = checkpoint_files(path) if path.is_dir() else None
    return run if run is not None else files_read(path)


def input_hashes(*sources) -> list[dict[str, object]]:
    """``[{"path", "sha256", "bytes"}]`` for each file a source names (``None``: the bundled model).

    A model (folder, weights file, shard index, training run) contributes the files its load reads (config, weights,
    every shard; a run's ``state.json`` and weights); a data or history file itself; a name that is not a path (an
    in-memory model, a hub name, a built-in data set: ``model.BuiltinData``) is listed with ``sha256: null``.

    Note [inputs read] (``model._files``): a file the loader read in this process must still be what it read, or the
    checksum would describe other bytes than those analysed (red team 219: a shard rewritten after it was read was
    hashed as its new content).  Such a file is refused, so a command writes nothing.

    Raises:
        InputError: a file read by the loader has changed since (replaced, rewritten), or changed while hashed.
    """
    from .._errors import InputError
    from ..model import identity_when_read

    out: list[dict[str, object]] = []
    for src in sources:
        path = _model_path(src)
        if path is None:
            if src is not None:  # an in-memory model (spec, module) or a hub name: named, not hashed
                name = src if isinstance(src, (str, os.PathLike)) else getattr(src, "name", type(src).__name__)
                out.append({"path": str(name), "sha256": None, "bytes": None})
            continue
        for f in _files(path):
            digest, now = _sha256_read(f)
            read = identity_when_read(f)
            if read is not None and read != now:
                raise InputError(f"{f} was replaced or rewritten after it was read: its checksum would not describe "
                                 "the bytes analysed, so nothing is written (rerun on a copy that does not change)")
            out.append({"path": str(f), "sha256": digest, "bytes": now[2]})
    return out


def _safe(obj):
    """Strict JSON: non-finite floats become strings ("inf", "-inf", "nan").

    The payloads do not do it themselves: results' ``to_dict()`` keep Python floats, ``±inf`` and NaN
    included, so users compute with them (red team 210: this docstring claimed otherwise); the envelope,
    i.e. every ``--json`` file the CLI writes, is where they become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_safe(v) for v in obj]
    return obj


def envelope(payload: dict, *, schema: str, schema_version: str, inputs=(), argv=None) -> dict:
    """``payload`` wrapped: the envelope's keys first, then the payload's (which win on a clash
    only for ``schema``/``schema_version`` when the payload already names its own)."""
    from .._version import __version__

    head = {
        "schema": schema,
        "schema_version": schema_version,
        "tool": "transcover",
        "tool_version": __version__,
        "command_line": ["transcover", *sys.argv[1:]] if argv is None else list(argv),
        "inputs": input_hashes(*inputs),
    }
    body = {k: v for k, v in payload.items() if k not in ("schema", "schema_version")}
    return {**head, **body}


def envelope_json(payload: dict, *, schema: str, schema_version: str, inputs=(), argv=None) -> str:
    """The envelope as strict JSON text (``allow_nan=False``; other objects through ``str``)."""
    data = _safe(envelope(payload, schema=schema, schema_version=schema_version, inputs=inputs, argv=argv))
    return json.dumps(data, indent=2, default=str, allow_nan=False) + "\n"
