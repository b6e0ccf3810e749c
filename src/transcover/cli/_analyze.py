"""``transcover analyze [MODEL ...]``: certified per-layer, per-head norms (issue 2); sweeps (issue 14).

One model: the per-layer table.  Several models, or a run directory of ``checkpoint-<step>``
folders: a sweep (``transcover.scale``) -- one row per model, a time series over the steps, a
results store that makes a re-run resume, and ``--workers`` / ``--backend ray`` for parallelism.
A sweep's failed items (unreadable, half-written checkpoints) are listed one line each; the others
complete and are written; the exit code is then 1 (0 when every item succeeded, 2 for bad input).
"""

from __future__ import annotations

import argparse

NAME = "analyze"
SWEEP_STORE = "transcover-results.sqlite"  # a sweep's store when --store is not given
HELP = "per-layer and per-head norms B_KQ, B_V, B_W1, B_W2, B_b1, B_b2 as certified intervals"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="*", default=None,
                   help="HF model directory, .safetensors file, or short name (default: the bundled "
                        "all-MiniLM-L6-v2); several, or a run directory of checkpoint-<step> folders, "
                        "make a sweep")
    from ._conventions import add_load_arguments

    add_load_arguments(p)
    p.add_argument("--list-archs", action="store_true",
                   help="print what is supported, per family and per feature, and exit")
    p.add_argument("--fast", action="store_true", help="Lanczos estimates instead of certified intervals")
    p.add_argument("--rtol", type=float, default=1e-3, help="target relative gap of each interval (default 1e-3)")
    p.add_argument("--heads", action="store_true", help="also print per-head tables")
    p.add_argument("--no-embeddings", action="store_true", help="skip the matrices outside the decomposition")
    p.add_argument("--json", metavar="PATH", default=None, help="write the versioned JSON result")
    p.add_argument("--csv", metavar="PATH", default=None, help="write one row per layer as CSV")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write per-layer x per-head heatmaps of B_KQ and B_V (.png, .svg or .pdf)")
    p.add_argument("--describe", action="store_true",
                   help="dry run: list which checkpoint tensor plays which role, measure nothing")
    p.add_argument("--quiet", action="store_true", help="print no table and no progress (with --json/--csv/--plot)")
    g = p.add_argument_group("sweeps (several models)")
    g.add_argument("--workers", type=int, default=1, help="models analysed in parallel (default 1)")
    g.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: this process (1 worker) or a pool of spawned processes; ray: a Ray cluster "
                        "(pip install 'transcover[ray]')")
    g.add_argument("--ray-address", default=None, help="ray.init(address=...) of an existing cluster (default: a local Ray)")
    g.add_argument("--threads", type=int, default=None,
                   help="BLAS threads per model (default 1 in a sweep, torch's own for one model; part of the "
                        "store's key, since a multi-threaded BLAS may change the last bits)")
    g.add_argument("--store", default=None,
                   help="SQLite results store; finished models are committed one by one (default "
                        f"./{SWEEP_STORE})")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,  # None: not given
                   help="reuse finished models from the store (default); --no-resume recomputes them")
    g.add_argument("--hash", choices=("quick", "full"), default="quick",
                   help="input keys: quick = paths, inodes, ctimes, headers, sizes and mtimes of the weights; "
                        "full = every byte")
    g.add_argument("--figure", metavar="PATH", default=None, help="write the time-series figure (PNG/PDF/SVG)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .._api import analyze, describe
    from .._errors import InputError
    from ._conventions import load_options, model_inputs
    from ..report import (analysis_csv, check_output_path, display_bytes, envelope_json, progress, render_analysis,
                          write_outputs)

    if args.list_archs:
        from ..model import support_table

        print(support_table(), end="")
        return 0
    if not (0.0 < args.rtol < 1.0):
        raise InputError(f"--rtol must be in (0, 1), but got --rtol={args.rtol}")
    for flag, path, suffixes in (("--json", args.json, ()), ("--csv", args.csv, ()),
                                 ("--plot", args.plot, (".png", ".svg", ".pdf"))):
        if path is not None:
            check_output_path(path, flag, suffixes)
    from ..scale import expand_models

    models = expand_models(list(args.model or []))
    if len(models) > 1 or len(models) != len(args.model or []):
        if args.roles is not None:
            raise InputError("--roles applies to one model; for a sweep put transcover_roles.json beside each "
                             "checkpoint's weights")
        from ._sweep import run_sweep

        return run_sweep(args, models)
    if args.figure:
        raise InputError("--figure needs several models (a sweep)")
    threads, args.threads = args.threads, None  # honoured below: BLAS threads of this one model
    from ._scaleopts import refuse_scale_options

    refuse_scale_options(args, "a single model", "a sweep (several models, or a run directory)")
    if threads is not None:
        if threads < 1:
            raise InputError(f"--threads must be >= 1, but got --threads={threads}")
        from .._threads import set_torch_threads

        set_torch_threads(threads)
    args.model = models[0] if models else None
    if args.describe:
        print(describe(args.model, **load_options(args)))
        return 0
    console = Console()
    with progress(quiet=args.quiet) as tracker:
        tracker.step("analyzing layers")
        result = analyze(args.model, **load_options(args), fast=args.fast, rtol=args.rtol,
                         embeddings=not args.no_embeddings, progress=tracker.callback())
    from ..norms import PerMatrixResult

    if isinstance(result, PerMatrixResult):
        from ._per_matrix import finish_per_matrix

        return finish_per_matrix(args, result, console)
    # Render everything before writing anything, so an error leaves no half-written outputs.
    outputs = []
    if args.json:
        outputs.append((args.json, envelope_json(result.to_dict(), schema="transcover.analyze",
                                                 schema_version=result.to_dict(matrices=False)["schema_version"],
                                                 inputs=model_inputs(args, args.model)).encode()))
    if args.csv:
        outputs.append((args.csv, analysis_csv(result).encode()))
    if args.plot:
        outputs.append((args.plot, display_bytes(result.plot(), args.plot)))
    if not args.quiet:
        render_analysis(result, console, heads=args.heads)
    write_outputs(outputs)
    return 0
