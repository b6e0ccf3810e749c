"""``transcover analyze [MODEL]``: certified per-layer, per-head norms (issue 2)."""

from __future__ import annotations

import argparse

NAME = "analyze"
HELP = "per-layer and per-head norms B_KQ, B_V, B_W1, B_W2, B_b1, B_b2 as certified intervals"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .safetensors file, or short name (default: the bundled "
                        "all-MiniLM-L6-v2)")
    p.add_argument("--arch", default=None, help="architecture of a bare .safetensors file (bert, gpt2, llama, vit, "
                                                "torch_encoder, reference)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="load pickled checkpoints (.bin/.pt) with torch.load(weights_only=True)")
    p.add_argument("--strict", action="store_true",
                   help="refuse a checkpoint with tensors inside a layer that the architecture does not define "
                        "(default: warn, naming each)")
    p.add_argument("--fast", action="store_true", help="Lanczos estimates instead of certified intervals")
    p.add_argument("--rtol", type=float, default=1e-3, help="target relative gap of each interval (default 1e-3)")
    p.add_argument("--heads", action="store_true", help="also print per-head tables")
    p.add_argument("--no-embeddings", action="store_true", help="skip the matrices outside the decomposition")
    p.add_argument("--json", metavar="PATH", default=None, help="write the versioned JSON result")
    p.add_argument("--csv", metavar="PATH", default=None, help="write one row per layer as CSV")
    p.add_argument("--quiet", action="store_true", help="print no table (with --json/--csv)")


def run(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console

    from .._api import analyze
    from .._errors import InputError
    from ..report import analysis_csv, analysis_json, atomic_write_text, render_analysis

    if not (0.0 < args.rtol < 1.0):
        raise InputError(f"--rtol must be in (0, 1), but got --rtol={args.rtol}")
    console = Console()
    err_console = Console(stderr=True)
    progress = None
    bar = None
    if err_console.is_terminal:
        from rich.progress import Progress

        bar = Progress(console=err_console, transient=True)
        task = bar.add_task("analyzing layers", total=None)
        bar.start()

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

    try:
        result = analyze(args.model, arch=args.arch, allow_pickle=args.allow_pickle, strict=args.strict, fast=args.fast,
                         rtol=args.rtol, embeddings=not args.no_embeddings, progress=progress)
    finally:
        if bar is not None:
            bar.stop()
    # Render everything before writing anything, so an error leaves no half-written outputs.
    outputs = []
    if args.json:
        outputs.append((args.json, analysis_json(result)))
    if args.csv:
        outputs.append((args.csv, analysis_csv(result)))
    if not args.quiet:
        render_analysis(result, console, heads=args.heads)
    for path, text in outputs:
        atomic_write_text(path, text)
        print(f"wrote {path}", file=sys.stderr)
    return 0
