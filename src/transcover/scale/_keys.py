"""Keys of sweep items: a hash of the input's files and of the options that shape the result.

Note [quick fingerprint]: hashing every byte of a large checkpoint costs as much I/O as analysing
it, so by default (``"quick"``) a weights file is identified by its name, size, modification time
(nanoseconds) and, for safetensors, its whole header (every tensor's name, dtype, shape and
offsets); JSON files (config, shard index) are hashed whole.  A rewritten checkpoint gets a new
key (new mtime or size), as does a half-written one once it is completed; the file's absolute path, device,
inode and ctime are hashed too (stop 40), so a copy, a move or an in-place rewrite is recomputed, which is the safe
direction.  ``"full"`` hashes every byte (streamed, 1 MiB at a time)
for content-addressed keys that survive copies.

Only the files the loader reads count: ``config.json``, ``transcover_roles.json`` (the roles
mapping), ``tokenizer.json`` (texts given as data), ``*.safetensors``, ``*.safetensors.index.json``
and, without safetensors, pickled ``.bin/.pt/.pth/.ckpt`` weights; a training run's ``optimizer.pt``
or logs beside them do not change the key.  (The roles and tokenizer files were left out before
stop 36: a resumed sweep reused B_W1 = 0.84 after the roles file had swapped W_1 and W_gate, whose
exact norm was 85.8.)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..model import ROLES_FILE

__all__ = ["fingerprint", "item_key", "model_files", "absolute_input", "check_fingerprint", "worker_fingerprint"]

_PICKLES = (".bin", ".pt", ".pth", ".ckpt")
_BESIDE = ("config.json", ROLES_FILE, "tokenizer.json")  # read beside the weights (model/_load, model/_data)
_SKIP = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "scaler.pt"}


def model_files(path: Path) -> list[Path]:
    """The files a load of ``path`` reads (directory, weights file or shard index), sorted."""
    from ..train import checkpoint_folder

    if path.name == "config.json" and path.is_file():
        # the loader reads a config.json path as its whole folder (model/_load): its key hashed the config alone, so
        # two checkpoints with one config shared a key and a result, and rewritten weights were reused (red team 184)
        return model_files(path.parent)
    run = checkpoint_folder(path) if path.is_dir() else None
    if run is not None:  # a training run: its weights and the config that rebuilds the model (every run folder had
        return [run / "model.safetensors", run / "state.json"]  # the same empty key: stop 39 red team)
    if path.is_dir():
        names = sorted(p for p in path.iterdir() if p.is_file())
        st = [p for p in names if p.name in _BESIDE or p.name.endswith((".safetensors", ".safetensors.index.json"))]
        if not any(p.name.endswith(".safetensors") for p in st):
            st += [p for p in names if p.suffix in _PICKLES and p.name not in _SKIP]
            st += [p for p in names if p.name.endswith(".bin.index.json")]
        # the shards an index names, wherever in the folder they lie: an index may point into a subfolder, whose
        # shards the key did not cover, so a rewritten shard there reused the old result (stop 38 red team)
        for index in [p for p in st if p.name.endswith(".index.json")]:
            st += _index_shards(index)
        return sorted(set(st))
    files = [path]
    if path.name.endswith(".index.json"):
        files += _index_shards(path)
    files += [path.parent / b for b in _BESIDE if (path.parent / b).is_file()]
    return sorted(set(files))


def _index_shards(index: Path) -> list[Path]:
    try:
        shards = json.loads(index.read_text()).get("weight_map", {}).values()
        return [index.parent / s for s in dict.fromkeys(shards) if isinstance(s, str) and (index.parent / s).is_file()]
    except (OSError, ValueError, AttributeError):
        return []  # the load reports a broken index; the key still covers the index's bytes


def _hash_file(h: "hashlib._Hash", path: Path, mode: str) -> None:
    st = path.stat()
    h.update(f"{path.name}\0{st.st_size}\0".encode())
    if mode == "full" or path.suffix == ".json":
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return
    # Note [quick fingerprint]: which file this is (absolute path, device, inode) and when its contents or
    # metadata last changed (ctime, which utime cannot set back): two checkpoints with equal mtimes (tar and zip keep
    # whole seconds) shared one key and one result, and a weight rewritten in place with its old mtime restored was
    # reused, with --no-resume too (red team 167); a copy or a chmod is recomputed, the safe direction.
    # "portable" (Note [worker check]) leaves out what differs between the nodes that read one shared file.
    h.update(f"{st.st_mtime_ns}\0".encode())
    if mode != "portable":
        h.update(f"{path.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_ctime_ns}\0".encode())
    if path.suffix == ".safetensors" and st.st_size >= 8:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            h.update(head)
            if 8 + n <= st.st_size and n <= 100_000_000:
                h.update(f.read(n))


def fingerprint(model: str | os.PathLike | None, mode: str = "quick") -> str:
    """A hex digest of the files ``model`` loads (Note [quick fingerprint]); a name for non-paths."""
    h = hashlib.sha256(f"fingerprint/{mode}\0".encode())
    path = None if model is None else Path(model).expanduser()
    if path is None or not path.exists():
        from ..model import bundled_model_dir

        if model is None or str(model).lower() in {"all-minilm-l6-v2", "minilm",
                                                  "sentence-transformers/all-minilm-l6-v2"}:
            path = bundled_model_dir()
        else:
            h.update(f"missing:{model}".encode())  # the item will fail; its key must still be stable
            return h.hexdigest()
    for f in model_files(path.resolve()):
        _hash_file(h, f, mode)
    return h.hexdigest()


def absolute_input(path: str | os.PathLike | None) -> str | None:
    """``path`` as an absolute path when it names a file or folder here; otherwise (``None``, a bundled or hub model
    name) as given.

    Why: a payload travels to worker processes whose working folder need not be the driver's.  With ``--ray-address``
    the workers of a ``ray start`` cluster opened a relative ``./m`` in *their* folder, another model, and its numbers
    were reported and stored under the key of the driver's file (red team 214: lipschitz certified <= 110.8 where the
    model's own lower estimate was 400.8).  Symbolic links are kept (``abspath``, not ``resolve``): the loader reads
    what the user named."""
    if path is None:
        return None
    p = Path(path).expanduser()
    return os.path.abspath(p) if p.exists() else str(path)


def worker_fingerprint(model: str | os.PathLike | None, mode: str = "quick") -> str:
    """The fingerprint a worker checks the files against (Note [worker check]): the key's own for ``"full"`` (every
    byte: the same on every node), else ``"portable"`` (name, size, mtime and, for safetensors, the header)."""
    return fingerprint(model, "full" if mode == "full" else "portable")


def check_fingerprint(model: str | os.PathLike | None, expected: str | None, mode: str = "quick") -> None:
    """Refuse, in the worker, model files whose :func:`worker_fingerprint` differs from the driver's.

    Note [worker check]: an absolute path is not enough on a cluster whose nodes do not share one filesystem (or when
    the files changed after the driver hashed them): the worker would compute on other bytes under the driver's key
    (red team 214).  The quick key's path, device, inode and ctime differ between nodes that read one shared (NFS)
    file, so the worker compares the portable fingerprint: another model at the same path has another size, header
    or mtime.  ``expected=None`` (an API payload without one, or a file the driver could not read) checks nothing.

    Raises:
        InputError: the fingerprints differ (one line naming the path, the host and the working folder).
    """
    if expected is None:
        return
    if worker_fingerprint(model, mode) != expected:
        import socket

        from .._errors import InputError

        raise InputError(f"the model files at {model} on worker host {socket.gethostname()} (working folder "
                         f"{os.getcwd()}) are not the ones the driver fingerprinted: another filesystem or folder, "
                         f"or files changed since; refused rather than computed under the driver's key (give a path "
                         f"every node sees, with the same files)")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of every ``.py`` file of the installed package (relative path and bytes): the code that computed a
    stored result. The version string never changed across the commits that changed computed numbers, so a store
    written by an older checkout was reused after an upgrade (red team 167)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f"{f.relative_to(root).as_posix()}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def item_key(kind: str, fingerprint_hex: str, options: dict[str, Any]) -> str:
    """The key of one item: what is computed (``kind`` and its ``options``) on which input, by which code."""
    from .._version import __version__

    blob = json.dumps({"kind": kind, "input": fingerprint_hex, "options": options, "transcover": __version__,
                       "code": code_digest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
