"""The one thread-limit helper: BLAS pools and torch's intra-op pool, set and restored together.

Note [small problems]: transcover's inner loops are often many tiny (d_head-sized) BLAS/LAPACK
calls or forwards of small models.  A multi-threaded pool only adds synchronisation to those, and
on a busy machine its spinning threads made such loops 15-100x slower (measured: MiniLM's lower
Lipschitz search 1049 s instead of ~70 s; per-head certificates).  Callers wrap such work in
:func:`limit_threads`; large Grams and forwards keep the caller's setting.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["limit_threads", "small_problem", "set_torch_threads", "init_worker_threads", "THREAD_VARS"]

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")

_SMALL = 4096  # d_model * seq_len below which one intra-op thread is faster (Note [small problems])


def small_problem(d_model: int, seq_len: int) -> bool:
    """True when a forward of this size runs faster on one thread (Note [small problems])."""
    return d_model * seq_len < _SMALL


@contextlib.contextmanager
def limit_threads(n: int | None = 1, *, blas: bool = True, torch: bool = True) -> Iterator[None]:
    """Run the block with at most ``n`` BLAS threads and ``n`` torch intra-op threads (None: leave both).

    torch is only touched when it is already imported (numpy-only code paths stay torch-free);
    both settings are restored on exit, also after an exception.
    """
    if n is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        if blas:
            from threadpoolctl import threadpool_limits

            stack.enter_context(threadpool_limits(limits=n))
        tm = sys.modules.get("torch") if torch else None
        if tm is not None:
            old = tm.get_num_threads()
            tm.set_num_threads(n)
            stack.callback(tm.set_num_threads, old)
        yield


def set_torch_threads(n: int) -> None:
    """Set torch's intra-op pool to ``n`` threads for the rest of the process (a CLI command, a worker)."""
    from ._errors import InputError

    if not isinstance(n, int) or n < 1:
        raise InputError(f"threads must be >= 1, but got threads={n!r}")
    import torch

    torch.set_num_threads(n)


def init_worker_threads(n: int) -> None:
    """A fresh worker process: ``n`` threads in every BLAS pool now and in libraries it imports later
    (they read the environment variables at import)."""
    import os

    for var in THREAD_VARS:
        os.environ[var] = str(n)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=n)

