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

    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{name} must be a comma-separated list of numbers, but got {text!r}") from None


def _write_outputs(args, data: dict, display=None) -> None:
    from ..report import atomic_write_bytes, atomic_write_text

    if getattr(args, "plot", None) and display is not None:
        import io

        from matplotlib.figure import Figure

        fig = Figure(figsize=(7.5, 5))
        display.plot(fig.add_subplot())
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=120)
        atomic_write_bytes(args.plot, buf.getvalue())
    if getattr(args, "json", None):
        from ..report import envelope_json

        schema = f"transcover.approx.{getattr(args, 'approx_command', '')}"
        atomic_write_text(args.json, envelope_json(data, schema=schema, schema_version="1"))


def _construct(args) -> int:
    from rich.table import Table

    from .. import approx
    from .._errors import InputError

    if args.search <= 0:
        raise InputError(f"--search must be > 0, but got --search={args.search}")
    if args.sparsity > args.seq_len:
        raise InputError(f"sparsity s must be <= seq_len n, but got s={args.sparsity} > n={args.seq_len}")
    if args.encoding == "equiangular" and not (0.0 <= args.delta < 0.5):
        raise InputError(f"--delta must be in [0, 1/2), but got --delta={args.delta}")
    target = approx.sparse_target("holder", args.seq_len, sparsity=args.sparsity, beta=args.smoothness, seed=args.seed)
    enc = approx.make_encoding(args.encoding, args.seq_len, dim=args.pos_dim, delta=args.delta, seed=args.seed)
    c = approx.build_construction(target, enc, R=args.R, grid=args.grid, gamma=args.gamma,
                                  key_leak=args.key_leak, norm=args.norm)
    d = approx.decompose_construction(c, n_random=args.search, seed=args.seed)
    cap = approx.construction_capacity(c)
    b = d.bound
    t = Table(title=f"Lemma H.1 construction: n={c.n}, I={target.indices}, Δ={enc.delta:.4g} ({enc.family}), "
                    f"R={c.R:g}, d_m={c.mlp.width}")
    t.add_column("part")
    t.add_column("measured sup (empirical lower)", justify="right")
    t.add_column("bound (certified upper)", justify="right")
    t.add_row("attention read-out ||ψ̂-ψ||∞", f"{d.readout.value:.4g}", f"{max(b.readout_bound):.4g}")
    t.add_row("attention part |f(ψ̂)-f(ψ)|", f"{d.attention.value:.4g}", f"{b.attention.value:.4g}")
    t.add_row("  lemma form n e^{-R(1-2Δ)}·…", "", f"{b.lemma_attention.value:.4g}")
    t.add_row("MLP part |f(ψ)-h|", f"{d.mlp.value:.4g}", f"{b.mlp.value:.4g}")
    t.add_row("total |F-g*|", f"{d.total.value:.4g}", f"{b.total.value:.4g}")
    console = _console(args)
    console.print(t)
    console.print(f"capacity: B_KQ={cap.B_KQ:.4g}  B_V={cap.B_V:.4g}  head Lipschitz<= {cap.head_lipschitz:.4g}  "
                  f"params={cap.n_params} (non-zero {cap.n_nonzero})  heads={c.s}  head widths={c.mlp.widths}")
    if args.save:
        from ..model import save_reference

        save_reference(c.model, args.save)
        console.print(f"saved {args.save}")
    data = {"config": vars(args) | {"indices": list(target.indices), "delta_exact": enc.delta},
            "decomposition": d.to_dict(), "capacity": cap.to_dict()}
    data["config"].pop("func", None)
    _write_outputs(args, data)
    return 0


def _sweep(args) -> int:
    from rich.table import Table

    from .. import approx
    from .._errors import InputError

    if args.over == "R":
        ns = [int(x) for x in _floats(args.ns, "--ns")]
        res = approx.attention_rate_sweep(_floats(args.Rs, "--Rs"), ns, _floats(args.deltas, "--deltas"),
                                          lemma_worst_case=args.lemma_worst_case)
        t = Table(title="attention error: fitted decay rate in R")
        for col in ("n", "Δ", "λ", "fitted rate", "gap rate 1-Δ-2λ", "lemma rate 1-2Δ"):
            t.add_column(col, justify="right")
        for f in res.fits:
            t.add_row(str(f["n"]), f"{f['delta']:.3g}", f"{f['key_leak']:.3g}", f"{f['fitted_rate']:.4f}",
                      f"{f['gap_rate']:.4f}", f"{f['lemma_rate']:.4f}")
        worst = max(r["measured"] / r["bound"] for r in res.rows)
        console = _console(args)
        console.print(t)
        console.print(f"max measured/bound over {len(res.rows)} points: {worst:.6f}")
    else:
        cases = []
        for item in args.cases.split(","):
            try:
                b, s = item.split(":")
                cases.append((float(b), int(s)))
            except ValueError:
                raise InputError(f"--cases must look like 'beta:s,beta:s', but got {item!r}") from None
        res = approx.mlp_rate_sweep(cases)
        t = Table(title="MLP error vs d_m: fitted exponent against -β/s")
        for col in ("β", "s", "fitted exponent", "-β/s"):
            t.add_column(col, justify="right")
        for f in res.fits:
            t.add_row(f"{f['beta']:g}", str(f["s"]), f"{f['fitted_exponent']:.3f}", f"{f['theory_exponent']:.3f}")
        console = _console(args)
        console.print(t)
        console.print(f"max measured/bound: {max(r['measured'] / r['bound'] for r in res.rows):.4f}")
    _write_outputs(args, res.to_dict(), res)
    return 0


def _encodings(args) -> int:

    from .. import approx
    from .._errors import InputError

    if not (0.0 <= args.delta < 0.5):
        raise InputError(f"--delta must be in [0, 1/2), but got --delta={args.delta}")
    enc = approx.make_encoding(args.kind, args.n, dim=args.dim, delta=args.delta, seed=args.seed)
    need = approx.random_sign_dimension(max(args.n, 2), args.delta, args.failure_prob) if args.delta > 0 else None
    floor = approx.welch_bound(enc.n, enc.dim)
    frac = f" = {enc.delta_fraction}" if enc.delta_fraction is not None else ""
    _console(args).print(f"{enc.family}: n={enc.n}, d_p={enc.dim}, Δ={enc.delta:.6g}{frac} ({enc.kind.value}); "
                    f"Welch floor for (n, d_p): {floor:.4g}; Δ<{args.delta:g} needs d_p>={approx.welch_dimension(args.n, args.delta)} "
                    f"(any design, Welch) and d_p>={need} (random signs, prob>={1 - args.failure_prob:g}, F16b)")
    data = {"family": enc.family, "n": enc.n, "dim": enc.dim, "delta": enc.delta,
            "delta_fraction": None if enc.delta_fraction is None else str(enc.delta_fraction),
            "welch_bound": floor, "target_delta": args.delta, "random_sign_dimension": need,
            "welch_dimension": approx.welch_dimension(args.n, args.delta)}
    _write_outputs(args, data)
    return 0


def _failures(args) -> int:

    from .. import approx

    if args.mode == "weak":
        res = approx.weak_dependence_curve([0.0, 0.01, 0.03, 0.1, 0.3, 1.0])
    elif args.mode == "delta":
        res = approx.delta_to_half_curve([0.0, 0.1, 0.2, 0.3, 0.4, 0.45, 0.49])
    else:
        res = approx.shift_curve([0.0, 0.05, 0.1, 0.2, 0.5, 1.0])
    console = _console(args)
    console.print(res.name)
    for r in res.rows:
        console.print("  " + "  ".join(f"{k}={v:.4g}" for k, v in r.items()))
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
