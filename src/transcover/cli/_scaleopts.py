"""The parallel, resumable options that commands running many items share (issue 14).

``--workers N`` processes (``--threads`` stays the torch/BLAS threads of each), ``--backend``,
``--ray-address``, ``--store PATH`` and ``--resume/--no-resume``; :func:`scale_backend` checks them
(Ray installed, an address only with Ray) before any work starts.
"""

from __future__ import annotations

import argparse

__all__ = ["add_scale_arguments", "scale_backend", "scale_requested", "open_store", "refuse_scale_options"]


def add_scale_arguments(p: argparse.ArgumentParser, items: str, *, threads: bool = False,
                        note: str = "") -> argparse._ArgumentGroup:
    """Add the options to ``p`` in their own group (returned); ``items`` names what runs in parallel."""
    g = p.add_argument_group(f"parallel, resumable {items} (transcover.scale)")
    g.add_argument("--workers", type=int, default=1,
                   help=f"processes working on {items} in parallel (default 1: in this process){note}")
    g.add_argument("--backend", choices=("local", "serial", "process", "ray"), default="local",
                   help="local: this process, or spawned processes with --workers > 1; ray: a Ray cluster "
                        "(pip install 'transcover[ray]'); the results are the same bit for bit")
    g.add_argument("--ray-address", default=None,
                   help="ray.init(address=...) of an existing cluster, joined within 30 s or refused (default: a new "
                        "local Ray, its session files in a private temp folder removed afterwards)")
    g.add_argument("--store", default=None, help=f"SQLite results store: finished {items} are kept and reused")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,  # None: not given
                   help=f"with --store: reuse finished {items} (default); --no-resume recomputes them")
    if threads:
        g.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    return g


def scale_requested(args: argparse.Namespace) -> bool:
    """Whether any parallel/store option was given; ``--resume``/``--no-resume`` count, so that
    :func:`scale_backend` refuses them without ``--store`` (red team 214: accepted and ignored)."""
    return args.workers != 1 or args.backend != "local" or bool(args.store) or args.resume is not None


def refuse_scale_options(args: argparse.Namespace, where: str, applies: str) -> None:
    """One line naming every parallel/store option set away from its default where ``where`` (a single-model
    run) would ignore it; ``applies`` says what the options are for. A value equal to the default changes
    nothing and passes (red team 167: they were dropped without a word); ``--resume`` given outright is named too,
    as ``experiment staged`` names it (red team 214)."""
    from .._errors import InputError

    given = [flag for flag, on in (
        ("--workers", args.workers != 1), ("--backend", args.backend != "local"),
        ("--ray-address", bool(args.ray_address)), ("--store", bool(args.store)),
        ("--resume", args.resume is True), ("--no-resume", args.resume is False),
        ("--threads", getattr(args, "threads", None) not in (None, 1)),
        ("--hash", getattr(args, "hash", "quick") != "quick")) if on]
    if given:
        raise InputError(f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to {applies}; "
                         f"{where} would ignore {'them' if len(given) > 1 else 'it'}")


def scale_backend(args: argparse.Namespace) -> str:
    """The backend to run on; one clear line for bad counts, a stray address, or Ray missing."""
    from .._errors import InputError

    if args.workers < 1:
        raise InputError(f"--workers must be >= 1, but got --workers={args.workers}")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise InputError(f"--threads must be >= 1, but got --threads={args.threads}")
    if args.backend == "serial" and args.workers > 1:  # serial is one process: --workers was dropped (red team 214)
        raise InputError(f"--backend serial runs every item in this process; --workers {args.workers} needs "
                         f"--backend local or process")
    if getattr(args, "resume", None) is not None and not args.store:
        flag = "--resume" if args.resume else "--no-resume"  # accepted and ignored before (red team 214)
        raise InputError(f"{flag} applies to the results store; without --store every item is computed anyway")
    backend = {"local": "process" if args.workers > 1 else "serial"}.get(args.backend, args.backend)
    if args.ray_address and backend != "ray":
        raise InputError("--ray-address needs --backend ray")
    if backend == "ray":
        from ..scale import RAY_MISSING

        try:
            import ray  # noqa: F401
        except ImportError as err:
            raise InputError(RAY_MISSING) from err
    return backend


def open_store(args: argparse.Namespace):
    from ..scale import ResultStore

    return ResultStore(args.store) if args.store else None


def local_rows_from_args(args: argparse.Namespace, spec, seqs: list, rhos: list[float], backend: str) -> list:
    """``lipschitz --data`` with one sequence per item (``scale.local_rows``): the rows ``local_table``
    gives, resumable from ``--store`` and computed by ``--workers`` processes."""
    import sys

    from ..scale import local_rows

    counts = {"computed": 0, "reused": 0}

    def on_result(r) -> None:
        counts["reused" if r.reused else "computed"] += r.ok

    store = open_store(args)
    try:
        rows = local_rows(args.model, seqs, rhos, spec=spec, relative=args.rho_relative, lower=not args.no_lower,
                          lower_iter=max(args.steps // 2, 5), arch=args.arch, allow_pickle=args.allow_pickle,
                          strict=args.strict, roles=args.roles, store=store, backend=backend, workers=args.workers,
                          threads=args.threads, resume=args.resume is not False, options={"address": args.ray_address},
                          on_result=on_result)
    finally:
        if store is not None:
            store.close()
    if store is not None:
        print(f"sequences: {counts['computed']} computed, {counts['reused']} reused from the store {args.store}",
              file=sys.stderr)
    return rows
