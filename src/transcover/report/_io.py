"""Atomic output, re-exported: the writer lives in ``transcover._io``, below every package.

``model`` saves checkpoints with it and ``model`` is the ground floor (it imports no other
transcover package), so the writer cannot live in ``report``, the sink; ``report`` keeps its
names for its own callers.
"""

from .._io import atomic_write_bytes as atomic_write_bytes
from .._io import atomic_write_text as atomic_write_text
from .._io import current_umask as current_umask

__all__ = ["atomic_write_text", "atomic_write_bytes", "current_umask", "write_outputs"]


def write_outputs(outputs) -> None:
    """Write each ``(path, bytes or text)`` atomically and say so on stderr: a command renders every output
    first and writes them last, so an error leaves none half-written."""
    import sys

    for path, data in outputs:
        (atomic_write_text if isinstance(data, str) else atomic_write_bytes)(path, data)
        print(f"wrote {path}", file=sys.stderr)
