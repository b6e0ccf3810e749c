"""Output paths checked before any work: a long computation must not end in "folder missing"."""

from __future__ import annotations

import os
from pathlib import Path

from .._errors import InputError
from .._io import missing_folder

__all__ = ["check_output_path"]


def check_output_path(path, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """``path`` as a Path, or InputError naming ``flag``: missing or unwritable folder, a folder as
    the target, or a suffix not in ``suffixes`` (when given)."""
    p = Path(path)
    if suffixes and not str(p).lower().endswith(suffixes):
        raise InputError(f"{flag} must end in {' or '.join(suffixes)}, but got {flag}={path}")
    if p.is_dir():
        raise InputError(f"{flag}={path} is a folder; give a file name")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"cannot write {flag}={path}: {missing_folder(folder)}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"cannot write {flag}={path}: folder {folder} is not writable")
    return p
