"""``transcover advise``: recommend d_m, heads, depth and R for an (s, beta)-sparse target (seed 5.1)."""

from __future__ import annotations

import argparse

NAME = "advise"
HELP = "design advice: MLP width, heads, depth and temperature from approximation + estimation error"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sparsity", type=int, required=True, help="s = |I|")
    parser.add_argument("--smoothness", type=float, required=True, help="Hölder exponent beta in (0, 2]")
    parser.add_argument("--seq-len", type=int, required=True, help="n")
    parser.add_argument("--n-samples", type=int, required=True, help="N, training samples")
    parser.add_argument("--delta", type=float, default=0.25, help="coherence of the positional encodings")
    parser.add_argument("--gamma", type=float, default=1.0, help="read-out injectivity in (0, 1]")
    parser.add_argument("--holder-constant", type=float, default=1.0, help="Hölder constant L of the target")
    parser.add_argument("--json", metavar="PATH", help="write the advice as JSON")
    parser.add_argument("--plot", metavar="PNG", help="the trade-off curve")


def run(args) -> int:
    from rich.console import Console

    from .._api import advise
    from ..report import advice_table, atomic_write_bytes, atomic_write_text, axes_png, envelope_json

    a = advise(args.sparsity, args.smoothness, args.seq_len, args.n_samples, delta=args.delta,
               gamma=args.gamma, holder_constant=args.holder_constant)
    Console().print(advice_table(a))
    if a.note:
        Console().print(f"  note: {a.note}")
    if args.plot:
        atomic_write_bytes(args.plot, axes_png(a))
    if args.json:
        atomic_write_text(args.json, envelope_json(a.to_dict(), schema="transcover.advise", schema_version="1"))
    return 0
