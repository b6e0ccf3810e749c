"""Checkpoints: weights as safetensors, optimiser tensors via ``torch.save`` (loaded with
``weights_only=True``), progress as JSON.  A new set is written whole beside the old one and swapped in by
renames (Note [checkpoint swap]), so an interrupt leaves the previous complete checkpoint or the new one.

The model's ``state_dict`` includes the constraints' buffers (power-iteration vectors ``u``,
``v`` and the current ``radius``) and the unconstrained ``original`` tensors, so a resumed run
continues the warm start exactly.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from .._errors import InputError
from .._io import atomic_write_bytes, atomic_write_text

__all__ = ["save_checkpoint", "load_checkpoint", "recover_checkpoint", "CHECKPOINT_FILES"]

CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "state.json")


_EXTRA = "__extra__."


def save_checkpoint(folder: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model.safetensors``, ``optimizer.pt`` and ``state.json`` (JSON-able ``state``) into ``folder``.

    ``extra`` tensors (e.g. a penalty's power-iteration vectors) are stored beside the weights and
    come back from :func:`load_checkpoint` under ``state["extra"]``.
    """
    from safetensors.torch import save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    tensors.update({_EXTRA + k: v.detach().contiguous().clone() for k, v in (extra or {}).items()})
    weights = save(tensors, metadata={"format": "pt"})
    buf = io.BytesIO()
    torch.save(optimizer.state_dict(), buf)
    # Note [torn checkpoint]: each file is atomic but the three are not, so a kill between them left new weights
    # beside an older state.json, which resumed without a word (stop 38 red team). state.json, written last, holds
    # the other two files' digests; load_checkpoint refuses a set that does not match.
    files = {"model.safetensors": weights, "optimizer.pt": buf.getvalue()}
    state = {**state, "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}
    # Note [checkpoint swap]: the digests let a torn set be refused, but refusing lost every earlier epoch (a SIGTERM
    # between two files left new weights beside the old state.json; red team 188).  The new set is written whole into
    # ``<folder>.new``, then swapped in by two renames (the old set kept as ``<folder>.prev`` until the new one is in
    # place); ``recover_checkpoint`` finishes or undoes a swap that an interrupt cut short.
    recover_checkpoint(folder)
    new, prev = _sibling(folder, ".new"), _sibling(folder, ".prev")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    for name, data in files.items():
        atomic_write_bytes(new / name, data)
    atomic_write_text(new / "state.json", json.dumps(state, indent=1, sort_keys=True))
    shutil.rmtree(prev, ignore_errors=True)
    if folder.exists():
        os.replace(folder, prev)
    os.replace(new, folder)
    shutil.rmtree(prev, ignore_errors=True)
    return folder


def _sibling(folder: Path, suffix: str) -> Path:
    return folder.with_name(folder.name + suffix)


def _torn(folder: Path, files: dict, names, read: dict | None = None) -> str | None:  # noqa: ANN001
    """The first of ``names`` whose bytes are not the file ``files`` (state.json's digests) names, else None (Note
    [torn checkpoint]); ``read``: bytes already read, by name (checked as read, not read again)."""
    read = read or {}
    for name, digest in files.items():
        if name in names:
            data = read[name] if name in read else (folder / name).read_bytes()
            if hashlib.sha256(data).hexdigest() != digest:
                return name
    return None


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds a whole checkpoint: every file present and each the one its state.json names."""
    try:
        state = json.loads((folder / "state.json").read_text())
        return all((folder / n).is_file() for n in CHECKPOINT_FILES) and \
            _torn(folder, state.get("files") or {}, CHECKPOINT_FILES) is None
    except (OSError, ValueError, AttributeError):
        return False


def recover_checkpoint(folder: str | os.PathLike[str]) -> None:
    """Finish or undo a checkpoint swap an interrupt cut short (Note [checkpoint swap]): with ``folder`` missing, a
    complete ``<folder>.new`` becomes it, else ``<folder>.prev`` (the last complete set) does; a leftover ``.new``
    beside a present ``folder`` is removed."""
    folder = Path(folder)
    new, prev = _sibling(folder, ".new"), _sibling(folder, ".prev")
    if not folder.exists():
        if new.is_dir() and _complete(new):
            os.replace(new, folder)
        elif prev.is_dir():
            os.replace(prev, folder)
    if folder.exists():
        shutil.rmtree(new, ignore_errors=True)
        if prev.exists() and _complete(folder):
            shutil.rmtree(prev, ignore_errors=True)


def load_checkpoint(folder: str | os.PathLike[str], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (and optimiser state) from ``folder`` into ``model``; returns the JSON state.

    Raises:
        InputError: a missing or unreadable file, or weights that do not fit ``model``.
    """
    from safetensors.torch import load as load_bytes

    from ..model import read_recorded, read_text

    folder = Path(folder)
    recover_checkpoint(folder)  # Note [checkpoint swap]
    # the weights alone need no optimiser state: a shared run without optimizer.pt is read (stop 39 red team)
    needed = CHECKPOINT_FILES if optimizer is not None else ("model.safetensors", "state.json")
    for name in needed:
        if not (folder / name).is_file():
            raise InputError(f"checkpoint file {folder / name} does not exist")
    try:  # state.json and the weights recorded with their identity when read (Note [inputs read] in model._files)
        state = json.loads(read_text(folder / "state.json"))
    except json.JSONDecodeError as err:
        raise InputError(f"checkpoint state {folder / 'state.json'} is not valid JSON: {err}") from None
    files = state.get("files") if isinstance(state, dict) else None
    if files is not None and (not isinstance(files, dict) or not set(files) <= {"model.safetensors", "optimizer.pt"}):
        raise InputError(f"checkpoint state {folder / 'state.json'} has a malformed 'files' entry")
    # the weights are read once: the bytes checked against state.json's digest are the bytes loaded and recorded
    raw = read_recorded(folder / "model.safetensors", lambda f: f.read())
    name = _torn(folder, files or {}, needed, {"model.safetensors": raw})  # Note [torn checkpoint]
    if name is not None:
        raise InputError(f"checkpoint {folder} is torn: {name} is not the file its state.json was written "
                         "with (a write was interrupted); train again without --resume")
    try:
        weights = load_bytes(raw)
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise InputError(f"cannot read {folder / 'model.safetensors'}: {err}") from None
    bad = [k for k, t in weights.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if bad:
        raise InputError(f"checkpoint {folder / 'model.safetensors'}: tensor {bad[0]!r} holds NaN or infinite values; "
                         "resume from an earlier checkpoint")
    extra = {k[len(_EXTRA):]: weights.pop(k) for k in list(weights) if k.startswith(_EXTRA)}
    own = model.state_dict()
    missing = set(own) ^ set(weights)
    if missing:
        raise InputError(f"checkpoint {folder} does not fit the model: tensors {sorted(missing)[:3]} differ")
    wrong = [k for k in sorted(own) if tuple(own[k].shape) != tuple(weights[k].shape)]
    if wrong:  # load_state_dict's RuntimeError was an internal error (a state.json edited to another width)
        k = wrong[0]
        raise InputError(f"checkpoint {folder} does not fit the model its state.json describes: tensor {k!r} has "
                         f"shape {tuple(weights[k].shape)}, the model {tuple(own[k].shape)}")
    with torch.no_grad():
        model.load_state_dict(weights)
    if optimizer is not None:
        try:  # the file this tool wrote; weights_only: the restricted unpickler (tensors, dicts, numbers)
            opt_state = torch.load(folder / "optimizer.pt", weights_only=True)
            optimizer.load_state_dict(opt_state)
        except Exception as err:  # torch raises UnpicklingError, RuntimeError or ValueError for damaged files
            raise InputError(f"cannot read {folder / 'optimizer.pt'} as an optimizer state ({type(err).__name__}: the "
                             "file is damaged or not this tool's); start afresh or from an earlier checkpoint") from None
    state["extra"] = extra
    return state
