"""Small-model numerics run faster on one thread (and do not fight other processes for cores)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Temporarily ``torch.set_num_threads(1)``; the previous setting is restored on exit."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
