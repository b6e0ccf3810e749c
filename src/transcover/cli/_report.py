"""``transcover report [MODEL] -o report.html``: one self-contained HTML page of everything (issue 13)."""

from __future__ import annotations

import argparse

NAME = "report"
HELP = "one self-contained HTML report: model card, certified norms, Lipschitz constants, covering bound"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .safetensors file or short name (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("-o", "--output", default="report.html", metavar="PATH", help="the HTML file to write")
    from ._conventions import add_load_arguments

    add_load_arguments(p)
    p.add_argument("--data", default=None, metavar="PATH",
                   help="inputs for the at-the-data section: token ids (.npy int), embeddings (.npy float), "
                        "texts (.txt), 'sklearn-descr' or 'task' (as `transcover lipschitz --data`; hashed into "
                        "the report)")
    p.add_argument("--whole-network", choices=("auto", "product", "stack"), default=None,
                   help="with --data: also the whole network's local constant per rho (as `transcover lipschitz "
                        "--whole-network`; the stack route costs minutes per MiniLM sentence)")
    p.add_argument("--rho", default="1e-3",
                   help="with --data: ball radii around the data, comma-separated, as factors of each layer's "
                        "median token norm")
    p.add_argument("--max-len", type=int, default=32, help="with --data: truncate texts to this many tokens")
    p.add_argument("--limit", type=int, default=4,
                   help="with --data: certify at the first N sequences (a few seconds per layer and sequence)")
    p.add_argument("--history", default=None, metavar="PATH",
                   help="a training history.jsonl (from `transcover train`): adds the training-monitor plots")
    p.add_argument("--radius", type=float, default=1.0, help="bound R on input token norms")
    p.add_argument("--eps", type=float, default=0.1, help="covering scale eps")
    p.add_argument("--n-samples", type=float, default=None,
                   help="training-set size n of the generalisation bound (default 1e6; a training checkpoint: its "
                        "n_train)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length T of the covering bound (default 128, or the model's longest sequence if "
                        "shorter; a training checkpoint: its task's T)")
    p.add_argument("--sigma-min", type=float, default=0.0,
                   help="assume every LayerNorm input has std >= this (0: the global, eps-limited constant; needed "
                        "for a norm with eps = 0)")
    p.add_argument("--no-lower", action="store_true", help="skip the empirical lower Lipschitz estimates")
    p.add_argument("--lower-samples", type=int, default=1, help="random starts per lower-estimate search")
    p.add_argument("--lower-steps", type=int, default=3, help="ascent steps per lower-estimate search")
    p.add_argument("--lower-stages", action="store_true",
                   help="also search every stage (attention, FFN, norms) for lower estimates: much slower")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def run(args: argparse.Namespace) -> int:
    import sys

    from .._errors import InputError
    from ..report import atomic_write_text, check_output_path, progress
    from ..report import ReportOptions, compute_report, render_report
    from ._conventions import load_options

    check_output_path(args.output, "--output", (".html", ".htm"))
    from ._bound import check_cover_options

    # the covering bound's options as `bound` checks them, before anything is loaded (red team 215)
    check_cover_options(eps=args.eps, n_samples=(args.n_samples,) if args.n_samples is not None else (),
                        seq_len=args.seq_len, radius=args.radius,
                        sigma_min=args.sigma_min)
    for flag, v, lo in (("--lower-samples", args.lower_samples, 1),
                        ("--lower-steps", args.lower_steps, 0)):
        if v < lo:
            raise InputError(f"{flag} must be >= {lo}, but got {flag}={v}")
    from pathlib import Path

    for flag, path in (("--data", args.data), ("--history", args.history)):
        if path is not None and path not in ("sklearn-descr", "task") and not Path(path).is_file():
            raise InputError(f"{flag}={path}: no such file")
    local = None
    if args.whole_network is not None and args.data is None:
        raise InputError("--whole-network certifies the network at the data; it needs --data")
    if args.data is not None:
        local = _local_bounds(args)
    options = ReportOptions(radius=args.radius, eps=args.eps, n_samples=args.n_samples, seq_len=args.seq_len,
                            lower=not args.no_lower, lower_samples=args.lower_samples, lower_steps=args.lower_steps,
                            lower_stages=args.lower_stages, sigma_min=args.sigma_min)
    with progress(quiet=args.quiet) as tracker:
        data = compute_report(args.model, **load_options(args), options=options, history=args.history, data=args.data,
                              local=local, tracker=tracker, seq_len_option="--seq-len")
        tracker.step("rendering the figures")
        html = render_report(data)
    atomic_write_text(args.output, html)
    print(f"wrote {args.output} ({len(html.encode()) / 1e6:.2f} MB)", file=sys.stderr)
    return 0


def _local_bounds(args: argparse.Namespace) -> dict:
    """The at-the-data block: certified local constants (``transcover.lipschitz(data=...)``, THEORY
    F17) on balls around the first ``--limit`` sequences of ``--data``, every input check first."""
    from .._api import lipschitz
    from ..report import local_block
    from ._conventions import load_options
    from ._lipschitz import parse_rhos

    rhos = parse_rhos(args.rho)
    for flag, v in (("--max-len", args.max_len), ("--limit", args.limit)):
        if v < 1:
            from .._errors import InputError

            raise InputError(f"{flag} must be >= 1, but got {flag}={v}")
    # lower_iter 15 as before: steps=30 gives max(30 // 2, 5)
    result = lipschitz(args.model, **load_options(args), data=args.data, rho=rhos, rho_relative=True,
                       max_len=args.max_len, limit=args.limit, lower=not args.no_lower, steps=30,
                       whole_network=args.whole_network)
    return local_block(result, args.data)
