"""Where a sweep's items run: in this process, in a local process pool, or on a Ray cluster.

Every backend calls the same :func:`run_item` on each payload and yields ``(index, Outcome)`` as
items finish, in any order; the sweep commits each outcome as it arrives.

Note [bit for bit]: a result must not depend on the backend.  :func:`run_item` runs the item's
function with BLAS/OpenMP limited to ``threads`` (default 1) threads in every backend -- serial
included -- since a multi-threaded BLAS may split a reduction differently and change the last bits;
the value is serialised to JSON (``repr`` of floats: exact) inside the worker, so the text the store
receives is the same whichever process produced it.  Workers start by ``spawn`` (or
``forkserver``), never ``fork``: a forked copy of a parent holding BLAS thread pools or a Ray
client is not safe.

Ray is optional (``pip install 'transcover[ray]'``); without it ``backend="ray"`` is one
:class:`~transcover.InputError` line naming the extra.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InputError

__all__ = ["Outcome", "run_item", "BACKENDS", "run_backend", "RAY_MISSING"]

BACKENDS = ("serial", "process", "ray")
RAY_MISSING = "the Ray backend needs Ray: pip install 'transcover[ray]' (ray>=2.9)"
from .._threads import THREAD_VARS as _THREAD_VARS


@dataclass(frozen=True)
class Outcome:
    ok: bool
    value: str  # JSON text of the result, or a one-line error message
    seconds: float


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def run_item(fn: Callable[[Any], Any], payload: Any, threads: int = 1) -> Outcome:
    """``fn(payload)`` with ``threads`` BLAS threads, as JSON text; an exception becomes a failed outcome."""
    from .._threads import limit_threads

    t0 = time.perf_counter()
    try:
        with limit_threads(threads, torch=False):
            value = fn(payload)
        text = json.dumps(value, sort_keys=True, allow_nan=False)
    except Exception as err:  # an item's failure is reported per item; the sweep goes on
        return Outcome(False, _one_line(err), time.perf_counter() - t0)
    return Outcome(True, text, time.perf_counter() - t0)


def _init_worker(threads: int) -> None:
    from .._threads import init_worker_threads

    init_worker_threads(threads)


def _serial(fn, jobs, workers, threads, options) -> Iterator[tuple[int, Outcome]]:
    for i, payload in jobs:
        yield i, run_item(fn, payload, threads)


def _pool_round(fn, jobs, workers, threads, ctx, lost: list) -> Iterator[tuple[int, Outcome]]:
    """One process pool over ``jobs``; the jobs a dying worker took down are appended to ``lost``."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(threads,)) as pool:
        futures = {pool.submit(run_item, fn, payload, threads): (k, i, payload)
                   for k, (i, payload) in enumerate(jobs)}
        while futures:
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for fut in done:
                k, i, payload = futures.pop(fut)
                try:
                    outcome = fut.result()
                except BrokenProcessPool:
                    lost.append((k, i, payload))
                    continue
                yield i, outcome


def _process(fn, jobs, workers, threads, options) -> Iterator[tuple[int, Outcome]]:
    import multiprocessing as mp

    ctx = mp.get_context(options.get("start_method") or "spawn")
    pending = list(jobs)
    while pending:
        lost: list = []
        yield from _pool_round(fn, pending, workers, threads, ctx, lost)
        lost.sort()
        # Note [a dying worker]: when a worker dies (killed, out of memory) every unfinished item of
        # the pool fails with it.  The pool hands out items in submission order, so the culprit is
        # among the first workers + 1 unfinished ones: each of those is retried alone in its own
        # one-worker pool (the culprit then fails by itself), the rest go back to a normal pool.
        suspects, pending = lost[: workers + 1], [(i, payload) for _, i, payload in lost[workers + 1:]]
        for _, i, payload in suspects:
            alone: list = []
            yield from _pool_round(fn, [(i, payload)], 1, threads, ctx, alone)
            if alone:
                yield i, Outcome(False, "worker process died (killed or out of memory)", 0.0)


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """One line, not a hang: ``ray.init`` retries an unreachable ``host:port`` without end (stop 38 red team)."""
    import re
    import socket

    m = re.fullmatch(r"(?:ray://)?\[?([^\[\]]+?)\]?:(\d+)", address.strip())
    if m is None:  # "auto", "local" and the like: Ray resolves them itself
        return
    try:
        socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout).close()
    except OSError as err:
        raise InputError(f"cannot reach the Ray cluster at {address}: {err.strerror or err}") from err


# Note [joining a cluster]: ``ray.init(address=...)`` against a port that accepts TCP but is no Ray GCS retries for
# 7+ minutes (20 tries of ~40 s each), printing a warning every few seconds and ignoring SIGTERM (red team 214).  The
# join is therefore tried first in a child process with a deadline: it is killed when the deadline passes (and dies
# with this process: PR_SET_PDEATHSIG), its warnings are kept out of the terminal, and the user gets one line.
RAY_CONNECT_TIMEOUT = 30.0  # seconds; TRANSCOVER_RAY_CONNECT_TIMEOUT overrides it
_PROBE = """
import sys
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL: never outlive the driver
except Exception:
    pass
import ray
ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False, logging_level=40)
ray.shutdown()
"""


def _probe_cluster(address: str, timeout: float | None = None) -> None:
    """Join ``address`` once in a child process with a deadline (Note [joining a cluster]); one line if it fails."""
    import subprocess
    import sys

    if timeout is None:
        try:
            timeout = float(os.environ.get("TRANSCOVER_RAY_CONNECT_TIMEOUT") or RAY_CONNECT_TIMEOUT)
        except ValueError:
            raise InputError("TRANSCOVER_RAY_CONNECT_TIMEOUT must be a number of seconds") from None
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, address], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise InputError(f"cannot join the Ray cluster at {address}: no Ray answered within {timeout:g} s (the port "
                         f"accepts connections; is it a Ray head's GCS port, 6379 by default? "
                         f"TRANSCOVER_RAY_CONNECT_TIMEOUT sets the wait)") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception"))]
        last = (errors or lines or [f"exit status {proc.returncode}"])[-1]
        raise InputError(f"cannot join the Ray cluster at {address}: {' '.join(last.split())[:400]}")


def _private_temp_dir() -> str:
    """A fresh 0700 folder for a local Ray instance's session files (red team 214: each run left a ~200 KB session
    folder with drwxrwxrwx subfolders in /tmp/ray, whatever the umask).  Ray's socket paths must stay under the
    107-byte limit of Unix sockets, so a long ``TMPDIR`` falls back to /tmp."""
    import tempfile

    base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="transcover-ray-", dir=base if len(base) <= 40 else "/tmp")


def _ray(fn, jobs, workers, threads, options) -> Iterator[tuple[int, Outcome]]:
    try:
        import ray
    except ImportError as err:
        raise InputError(RAY_MISSING) from err
    started, temp_dir = False, None
    if not ray.is_initialized():
        env = {var: str(threads) for var in _THREAD_VARS}
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "runtime_env": {"env_vars": env}}
        # an address from the option or from RAY_ADDRESS (which ray.init reads itself): connect, and pass no
        # num_cpus, which Ray refuses for an existing cluster (stop 38 red team: an internal ValueError)
        address = options.get("address") or os.environ.get("RAY_ADDRESS")
        if address and address != "local":
            _check_reachable(address)
            _probe_cluster(address, options.get("connect_timeout"))  # Note [joining a cluster]
            kwargs["address"] = address
        else:
            # "local" said outright: without it ray.init joins any `ray start` cluster of the host (its address is
            # in /tmp/ray/ray_current_cluster) and then refuses num_cpus (red team 214)
            temp_dir = _private_temp_dir()
            kwargs.update(address="local", num_cpus=workers, _temp_dir=temp_dir)
        try:
            ray.init(**kwargs)
        except (ConnectionError, ValueError, RuntimeError, TimeoutError) as err:
            _remove_temp_dir(temp_dir)
            raise InputError(f"cannot start or join Ray (address {address or 'local'}): {_one_line(err)}") from err
        started = True
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(run_item)
        queue = list(jobs)
        inflight: dict[Any, int] = {}
        limit = max(1, 2 * workers)
        while queue or inflight:
            while queue and len(inflight) < limit:
                i, payload = queue.pop(0)
                inflight[remote.remote(fn, payload, threads)] = i
            ready, _ = ray.wait(list(inflight), num_returns=1)
            for ref in ready:
                i = inflight.pop(ref)
                try:
                    yield i, ray.get(ref)
                except Exception as err:  # the task's worker died
                    yield i, Outcome(False, _one_line(err), 0.0)
    finally:
        if started:
            ray.shutdown()
        _remove_temp_dir(temp_dir)


def _remove_temp_dir(temp_dir: str | None) -> None:
    """Remove the private session folder of a local Ray instance this run started (and shut down)."""
    if temp_dir is not None:
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


_RUNNERS = {"serial": _serial, "process": _process, "ray": _ray}


def run_backend(backend: str, fn: Callable[[Any], Any], jobs: Sequence[tuple[int, Any]], *, workers: int = 1,
                threads: int = 1, options: dict[str, Any] | None = None) -> Iterator[tuple[int, Outcome]]:
    """Run ``fn`` on each ``(index, payload)`` of ``jobs``; yield ``(index, Outcome)`` as items finish.

    Raises:
        InputError: an unknown backend, ``workers < 1`` or ``threads < 1``, or Ray requested but
            not installed.
    """
    if backend not in _RUNNERS:
        raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if workers < 1 or threads < 1:
        raise InputError(f"workers and threads must be >= 1, but got workers={workers}, threads={threads}")
    if backend == "ray":
        try:
            import ray  # noqa: F401  (checked before any work starts)
        except ImportError as err:
            raise InputError(RAY_MISSING) from err
    return _RUNNERS[backend](fn, list(jobs), workers, threads, dict(options or {}))
