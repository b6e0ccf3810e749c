"""Where a training run is read as a model: its folders and its task's inputs, for every command.

Importing this module imports neither torch nor the training loop: ``transcover analyze`` asks
:func:`is_train_checkpoint` of every path it is given, and a checkpoint read from a file must not
pay for torch (``tests/model/test_model_no_torch.py``).  The loop is imported when a run is read.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._errors import InputError

__all__ = ["is_train_checkpoint", "checkpoint_folder", "checkpoint_files", "load_model", "load_data", "data_files",
           "TASK_DATA"]


def _is_checkpoint(folder: Path) -> bool:
    return folder.is_dir() and (folder / "state.json").is_file() and (folder / "model.safetensors").is_file()


def checkpoint_folder(path: str | Path) -> Path | None:
    """The checkpoint folder ``path`` names: itself, or its ``checkpoint/`` (a run's ``--out`` folder) when
    ``path`` holds no weights of its own (a model folder that happens to hold a run is read as the model)."""
    p = Path(path)
    if _is_checkpoint(p):
        return p
    if not p.is_dir() or not _is_checkpoint(p / "checkpoint"):
        return None
    own = [q for q in p.iterdir() if q.is_file() and q.name.endswith((".safetensors", ".safetensors.index.json",
                                                                        ".bin", ".bin.index.json", ".pt", ".pth"))]
    return None if own else p / "checkpoint"


# what :func:`load_model` reads of a checkpoint (``load_checkpoint`` without an optimiser; ``optimizer.pt`` is read
# by ``train --resume`` alone), in the order read
MODEL_FILES = ("state.json", "model.safetensors")


def checkpoint_files(path: str | Path) -> list[Path] | None:
    """The files :func:`load_model` reads of the run or checkpoint folder ``path`` (``state.json``, which rebuilds
    the model and its task, and ``model.safetensors``), each recorded with its identity when read (Note [inputs
    read] in ``model._files``); None when ``path`` is no training run.  What the JSON envelope lists for a run:
    a run folder listed nothing, and a checkpoint folder every file of a model suffix in it, read or not
    (``optimizer.pt``, a stray ``notes.json`` or another model's ``.safetensors``; red team 222)."""
    folder = checkpoint_folder(path)
    return None if folder is None else [folder / name for name in MODEL_FILES]


def is_train_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by :func:`train` (``state.json`` with a training config),
    or the run folder (``--out``) holding one as ``checkpoint/``."""
    return checkpoint_folder(path) is not None


TASK_DATA = "task"


def load_data(source, spec, data, *, max_len: int | None = None, limit: int | None = None) -> list:
    """The sequences at which the local bounds are certified: :func:`transcover.model.load_inputs`'s
    sources, plus ``"task"``, the held-out inputs of a ``transcover train`` checkpoint's own task
    (digits test images, a sparse task's test sequences), embedded as the model embeds them.

    Raises:
        InputError: ``"task"`` with a model that is not a training checkpoint, or any bad data.
    """
    from ..model import inputs_from_array, load_inputs

    if not (isinstance(data, str) and data == TASK_DATA):  # an array compared elementwise (red team 216)
        return load_inputs(spec, data, max_len=max_len, limit=limit)
    folder = None if source is None or not isinstance(source, (str, os.PathLike)) else checkpoint_folder(source)
    if folder is None:
        raise InputError(f"--data {TASK_DATA} reads a `transcover train` checkpoint's own task; give its run or "
                         "checkpoint folder as the model")
    from ._loop import _checkpoint_task

    X = _checkpoint_task(folder)[1].X_test
    return inputs_from_array(spec, X[:limit].detach().double().numpy() if limit else X.detach().double().numpy())


def data_files(spec, data) -> list:
    """What :func:`load_data` reads for ``data``, for the JSON envelope's ``inputs``: ``model.data_files`` (the data
    file, the tokenizer of texts, ``sklearn-descr`` by name), and nothing for ``"task"``, which the checkpoint's
    ``state.json`` rebuilds (listed with the model)."""
    from ..model import data_files as files

    if isinstance(data, str) and data == TASK_DATA:
        return []
    return files(spec, data)


def load_model_task(source=None, *, arch: str | None = None, allow_pickle: bool = False, strict: bool = False,
                    roles=None):
    """:func:`load_model` and, for a training run read as one, its task's ``(n_train, T)`` (else ``None, None``):
    what ``bound`` takes as its defaults for n and T.  One rule for the API and the CLI: an explicit ``arch`` reads
    the folder's weights the ordinary way (the bound's CLI had ignored it for a run, stop 39's list), and so does an
    explicit ``roles`` mapping, as in :func:`load_model`."""
    if source is not None and arch is None and roles is None and isinstance(source, (str, os.PathLike)) \
            and is_train_checkpoint(source):
        from ._loop import checkpoint_spec

        return checkpoint_spec(source)
    return load_model(source, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles), None, None


def load_model(source=None, *, arch: str | None = None, allow_pickle: bool = False, strict: bool = False,
               roles=None):
    """:func:`transcover.model.load`, plus ``transcover train`` checkpoints: a checkpoint folder, or the
    run folder (``--out``) holding one, gives the trained model as :func:`checkpoint_spec` exports it.

    Every command that takes a model reads it through here, so a training run is analysed, certified
    and reported like any checkpoint.  An explicit ``arch`` or ``roles`` reads the folder's weights
    the ordinary way instead.
    """
    from ..model import load

    if source is not None and arch is None and roles is None and isinstance(source, (str, os.PathLike)) \
            and is_train_checkpoint(source):
        from ._loop import checkpoint_spec

        return checkpoint_spec(source)[0]
    return load(source, arch=arch, allow_pickle=allow_pickle, strict=strict, roles=roles)
