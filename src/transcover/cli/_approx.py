"""``transcover approx``: the Lemma H.1 construction, its error decomposition, sweeps, encodings, failures."""

from __future__ import annotations

import argparse

NAME = "approx"
HELP = "approximation lab: build the Lemma H.1 Transformer, decompose its error, sweep rates"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the result as JSON (atomically)")
    p.add_argument("--plot", metavar="PNG", help="write a figure")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def _console(args):
    """The console of the results: the progress display is closed first (it only covers the work)."""
    from rich.console import Console

    tracker = getattr(args, "tracker", None)
    if tracker is not None:
        tracker.close()
    return Console()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="approx_command", metavar="WHAT")
    c = sub.add_parser("construct", help="build the construction and measure its error decomposition")
    c.add_argument("--seq-len", type=int, default=16, help="n, sequence length")
    c.add_argument("--sparsity", type=int, default=2, help="s = |I| (one head per relevant token)")
    c.add_argument("--smoothness", type=float, default=1.0, help="Hölder exponent beta in (0, 2]")
    c.add_argument("--R", type=float, default=20.0, help="attention temperature")
    c.add_argument("--encoding", default="equiangular", help="random | sinusoidal | equiangular | designed | orthogonal")
    c.add_argument("--delta", type=float, default=0.2, help="coherence for equiangular encodings")
    c.add_argument("--pos-dim", type=int, default=64, help="d_p for random/sinusoidal/designed encodings")
    c.add_argument("--grid", type=int, default=8, help="cells per axis of the MLP's interpolation grid")
    c.add_argument("--gamma", type=float, default=1.0, help="read-out injectivity in (0, 1]")
    c.add_argument("--key-leak", type=float, default=0.0, help="content cross-term in the keys, in [0, 1/2)")
    c.add_argument("--norm", default="ball", help="ball (the seed's Pi_norm) | none")
    c.add_argument("--search", type=int, default=1000, help="random + adversarial inputs for the sup search")
    c.add_argument("--seed", type=int, default=0, help="random seed of the sup search")
    c.add_argument("--save", metavar="SAFETENSORS", help="save the model (transcover.model.save_reference)")
    _common(c)
    s = sub.add_parser("sweep", help="rate checks: attention error vs R, or MLP error vs d_m")
    s.add_argument("--over", choices=("R", "dm"), required=True,
                   help="R: attention error against the logit scale R; dm: MLP error against the width d_m")
    s.add_argument("--ns", default="16", help="comma list of n (--over R)")
    s.add_argument("--deltas", default="0,0.2,0.4", help="comma list of Delta (--over R)")
    s.add_argument("--Rs", default="2,4,6,8,10,14,18,24,30", help="comma list of R (--over R)")
    s.add_argument("--lemma-worst-case", action="store_true", help="key_leak = Delta/2 (gap exactly R(1-2Delta))")
    s.add_argument("--cases", default="0.5:1,1:1,2:1,0.5:2,1:2,2:2", help="beta:s pairs (--over dm)")
    _common(s)
    e = sub.add_parser("encodings", help="positional encodings: exact Delta, Welch floor, dimension needed")
    e.add_argument("--kind", default="random", help="random | sinusoidal | equiangular | designed | orthogonal")
    e.add_argument("--n", type=int, default=64, help="number of positions")
    e.add_argument("--dim", type=int, default=64, help="d_p")
    e.add_argument("--delta", type=float, default=0.25, help="target Delta (equiangular: the value)")
    e.add_argument("--failure-prob", type=float, default=0.01, help="delta of F16b")
    e.add_argument("--seed", type=int, default=0, help="random seed of the random encodings")
    e.add_argument("--json", metavar="PATH", help="write the result as JSON")
    e.add_argument("--quiet", action="store_true", help="no progress display")
    f = sub.add_parser("failures", help="when assumptions fail (seed 7.2): weak | delta | shift")
    f.add_argument("--mode", choices=("weak", "delta", "shift"), required=True,
                   help="which assumption fails: weak gamma, large Delta, or a shifted input distribution")
    _common(f)


def _floats(text: str, name: str) -> list[float]:
    from .._errors import InputError

    parts = text.split(",")
    if any(not x.strip() for x in parts):  # "1,,2" was read as [1, 2] (stop 38 red team)
        raise InputError(f"{name} has an empty item: {text!r}")
    from ._conventions import read_float

    return [read_float(x, f"{name} (a comma-separated list of numbers, {text!r})") for x in parts]


def _ints(text: str, name: str) -> list[int]:
    from .._errors import InputError

    import math

    vals = _floats(text, name)
    if not all(math.isfinite(v) and v == int(v) for v in vals):  # 2.5 ran as n = 2 (stop 38 red team)
        raise InputError(f"{name} must be whole numbers, but got {text!r}")
    return [int(v) for v in vals]


def _write_outputs(args, data: dict, display=None) -> None:
    from ..report import atomic_write_bytes, atomic_write_text, axes_png, envelope_json

    if getattr(args, "plot", None) and display is not None:
        atomic_write_bytes(args.plot, axes_png(display))
    if getattr(args, "json", None):
        schema = f"transcover.approx.{getattr(args, 'approx_command', '')}"
        atomic_write_text(args.json, envelope_json(data, schema=schema, schema_version="1"))


_CONSTRUCT_OPTIONS = ("seq_len", "sparsity", "smoothness", "R", "encoding", "delta", "pos_dim", "grid", "gamma",
                      "key_leak", "norm", "search", "seed")


def _construct(args) -> int:
    from .._api import approx
    from ..report import capacity_line, construct_table

    # the config names the construction's parameters only (not output paths or the progress display)
    res = approx("construct", **{k: getattr(args, k) for k in _CONSTRUCT_OPTIONS})
    console = _console(args)
    console.print(construct_table(res))
    console.print(capacity_line(res))
    if args.save:
        from ..model import save_reference

        save_reference(res.construction.model, args.save)
        console.print(f"saved {args.save}", markup=False, highlight=False)  # a path (red team 215)
    _write_outputs(args, res.to_dict())
    return 0


def _sweep(args) -> int:
    from .._api import approx
    from .._errors import InputError
    from ..report import rate_sweep_line, rate_sweep_table
    from ._conventions import read_float

    if args.over == "R":
        res = approx("sweep", over="R", Rs=_floats(args.Rs, "--Rs"), ns=_ints(args.ns, "--ns"),
                     deltas=_floats(args.deltas, "--deltas"), lemma_worst_case=args.lemma_worst_case)
    else:
        cases = []
        for item in args.cases.split(","):
            try:
                b, s = item.split(":")
                s = int(s)
            except ValueError:
                raise InputError(f"--cases must look like 'beta:s,beta:s', but got {item!r}") from None
            cases.append((read_float(b, f"--cases beta in {item!r}"), s))
        res = approx("sweep", over="dm", cases=cases)
    console = _console(args)
    console.print(rate_sweep_table(res, args.over))
    console.print(rate_sweep_line(res, args.over))
    _write_outputs(args, res.to_dict(), res)
    return 0


def _encodings(args) -> int:
    from .._api import approx
    from ..report import encodings_line

    res = approx("encodings", kind=args.kind, n=args.n, dim=args.dim, delta=args.delta,
                 failure_prob=args.failure_prob, seed=args.seed)
    _console(args).print(encodings_line(res))
    _write_outputs(args, res.to_dict())
    return 0


def _failures(args) -> int:
    from .._api import approx
    from ..report import failures_lines

    res = approx("failures", mode=args.mode)
    console = _console(args)
    for line in failures_lines(res):
        console.print(line)
    _write_outputs(args, res.to_dict(), res)
    return 0


def run(args) -> int:
    from .._errors import InputError

    handlers = {"construct": _construct, "sweep": _sweep, "encodings": _encodings, "failures": _failures}
    if args.approx_command is None:
        raise InputError("approx needs a sub-command: construct | sweep | encodings | failures")
    from ..report import start_progress

    args.tracker = start_progress(quiet=args.quiet)  # a spinner while computing; closed by _console
    args.tracker.step(f"approx {args.approx_command}")
    try:
        return handlers[args.approx_command](args)
    finally:
        args.tracker.close()
