"""Small-model numerics run faster on one thread (and do not fight other processes for cores)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._threads import limit_threads


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One torch intra-op thread for the block (``transcover._threads.limit_threads``); restored on exit."""
    import torch  # noqa: F401  (limit_threads sets torch's pool only once torch is imported)

    with limit_threads(1, blas=False):
        yield
