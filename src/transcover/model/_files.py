"""Which files the loader read, and what each was when it was read: for the JSON envelope's checksums.

Note [inputs read]: a command's ``--json`` lists the SHA-256 of every file it read (``report.input_hashes``), computed
after the analysis.  A shard rewritten after the loader had read it was hashed as its new content beside numbers from
the old one (red team 219).  So every file the loader opens is recorded here with its identity at that moment
(:func:`identity`: device, inode, size, modification and change times; the change time is set by the kernel on every
write and cannot be put back), and the envelope refuses to hash a file whose identity is no longer the one read.
The record is per process and keeps the latest read of each file (by its resolved path).  Every file a command reads
is recorded so: weights, configs and mappings, a training checkpoint's ``state.json``, the ``--data`` file and the
tokenizer that splits its texts, the ``--history`` file (red team 222: the last three were hashed at the end of the
run, unchecked, so a history appended to or a data file rewritten after it was read was listed with its new content).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable, TypeVar

from .._errors import InputError

__all__ = ["identity", "record_read", "identity_when_read", "read_text", "read_recorded"]

_READ: dict[str, tuple[int, ...]] = {}
T = TypeVar("T")


def identity(f) -> tuple[int, ...]:  # noqa: ANN001  (an open file or a path)
    """Which file an open handle (or a path) reads, and its version: device, inode, size, modification and change
    times (ns)."""
    st = os.fstat(f.fileno()) if hasattr(f, "fileno") else os.stat(f)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def record_read(path: str | os.PathLike[str], ident: tuple[int, ...]) -> None:
    """Note that ``path`` was read while it had identity ``ident``."""
    _READ[os.path.realpath(path)] = ident


def identity_when_read(path: str | os.PathLike[str]) -> tuple[int, ...] | None:
    """The identity ``path`` had when the loader last read it in this process; None where it never did."""
    return _READ.get(os.path.realpath(path))


def read_recorded(path: str | os.PathLike[str], read: Callable[[BinaryIO], T]) -> T:
    """``read(f)`` of ``path`` opened in binary mode, the file recorded as read (Note [inputs read]) with its identity
    when opened; OSError as from ``open``, and InputError where the file changed while it was read."""
    with open(path, "rb") as f:
        before = identity(f)
        data = read(f)
        if identity(f) != before:
            raise InputError(f"{path} changed while it was read; rerun on a copy that does not change")
    record_read(path, before)
    return data


def read_text(path: Path) -> str:
    """``path``'s text, recorded as read (Note [inputs read]); OSError as from ``Path.read_text``,
    UnicodeDecodeError for bytes that are not UTF-8, and InputError where the file changed while it was read."""
    return read_recorded(path, lambda f: f.read()).decode()
