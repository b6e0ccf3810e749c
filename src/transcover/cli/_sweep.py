"""The sweep half of ``transcover analyze`` (several models): not a command of its own."""

from __future__ import annotations

import argparse
import sys


def run_sweep(args: argparse.Namespace, models: list[str]) -> int:
    from rich.console import Console

    from .._errors import InputError
    from ..report import analysis_sweep_table, plot_sweep, write_outputs
    from ..scale import (ResultStore, analysis_items, analyze_item, failure_rows, rows_csv, sweep, sweep_json,
                         sweep_rows)

    from ._analyze import SWEEP_STORE

    args.threads = 1 if args.threads is None else args.threads
    args.store = args.store or SWEEP_STORE
    if args.workers < 1 or args.threads < 1:
        raise InputError(f"--workers and --threads must be >= 1, but got {args.workers} and {args.threads}")
    if args.ray_address and args.backend != "ray":
        raise InputError("--ray-address needs --backend ray")
    if args.heads:
        raise InputError("--heads prints one model's per-head tables; it does not apply to a sweep")
    if getattr(args, "describe", False):  # the dry run computed and stored a whole sweep (red team 184)
        raise InputError("--describe lists one model's tensors and measures nothing; it does not apply to a sweep")
    if getattr(args, "roles", None):
        raise InputError("--roles maps one model's tensors; in a sweep put a transcover_roles.json beside each "
                         "checkpoint (it is read and keyed per model)")
    if getattr(args, "plot", None):  # ignored without a word before (stop 38 red team)
        raise InputError("--plot draws one model's per-head heatmaps; a sweep draws its rows with --figure")
    # --strict is part of what is computed and of the key: a sweep only warned where one model refused (stop 38)
    options = {"arch": args.arch, "allow_pickle": args.allow_pickle, "fast": args.fast, "rtol": args.rtol,
               "embeddings": not args.no_embeddings, **({"strict": True} if getattr(args, "strict", False) else {})}
    backend = "ray" if args.backend == "ray" else ("process" if args.workers > 1 else "serial")
    if backend == "ray":  # fail before hashing or opening anything
        from ..scale import RAY_MISSING

        try:
            import ray  # noqa: F401
        except ImportError as err:
            raise InputError(RAY_MISSING) from err
    items = analysis_items(models, options, args.hash, threads=args.threads)
    done = [0]
    # items with one key are computed (and reported) once: the count ran to [2/3] for "c100 c100 c200" (red team 184)
    distinct = len({it.key for it in items})

    def on_result(r) -> None:
        done[0] += 1
        state = "reused" if r.reused else ("ok" if r.ok else "FAILED")
        line = f"[{done[0]}/{distinct}] {state} {r.item.label}"
        print(line if r.ok else f"{line}: {r.value}", file=sys.stderr, flush=True)

    with ResultStore(args.store) as store:
        report = sweep(items, analyze_item, store=store, backend=backend, workers=args.workers,
                       threads=args.threads, resume=args.resume is not False, options={"address": args.ray_address},
                       on_result=on_result)
    rows = sweep_rows(report)
    outputs = []
    if args.json:
        from ..report import envelope_json

        # no input hashes here: a sweep's inputs may be many large checkpoints; the store's keys name them
        outputs.append((args.json, envelope_json(sweep_json(report, rows), schema="transcover.analyze.sweep",
                                                 schema_version="1")))
    if args.csv:
        outputs.append((args.csv, rows_csv(rows + failure_rows(report))))  # failures marked, bounds empty
    if not args.quiet and rows:
        Console().print(analysis_sweep_table(rows))
    write_outputs(outputs)
    if args.figure and rows:
        print(f"wrote {plot_sweep(rows, args.figure)}", file=sys.stderr)
    print(f"sweep: {report.summary()}; store {args.store}", file=sys.stderr)
    return 1 if report.failed else 0
