"""``transcover cover {finite,reference,uniform,local}``: empirical covering numbers (issue 5)."""

from __future__ import annotations

import argparse

NAME = "cover"
HELP = "estimate covering numbers: eps-nets and packings of finite sets, Monte Carlo over norm-bounded classes"

_DEFAULT_EPS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5]


def _common(p: argparse.ArgumentParser, *, eps_default: list[float] | None, scale: str = "") -> None:
    p.add_argument("--eps", type=float, nargs="+", default=eps_default, required=eps_default is None,
                   help="accuracies > 0" + ("" if eps_default is None else f" (default {eps_default})"))
    p.add_argument("--q", default="inf", help="per-sample output norm: 1, 2 or inf (default inf)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default 1)" if scale else "torch threads to use (default: torch's)")
    if scale:
        _scale_args(p, scale)
    else:  # --workers meant torch threads before the parallel backends (issue 14)
        from ._conventions import add_deprecated_alias

        add_deprecated_alias(p, "--workers", "--threads", "threads", type=int)
    p.add_argument("--json", metavar="PATH", default=None, help="write the result as JSON")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG of log N against eps")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def _scale_args(p: argparse.ArgumentParser, mode: str) -> None:
    from ._scaleopts import add_scale_arguments

    g = add_scale_arguments(p, "chunks of members", note="; torch threads, which --workers meant before, "
                                                           "are --threads")
    if mode == "reference":
        g.add_argument("--chunk-blocks", type=int, default=1,
                       help="seed blocks (256 members each) per stored chunk (default 1)")
    else:
        g.add_argument("--chunk", type=int, default=64, help="members per stored chunk (default 64)")


def _class_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reference class (seed 1.2 model under the seed 2.1 constraints)")
    g.add_argument("--layers", type=int, default=2, help="Transformer layers L")
    g.add_argument("--d-model", type=int, default=16, help="model width d")
    g.add_argument("--heads", type=int, default=2, help="attention heads per layer")
    g.add_argument("--d-ff", type=int, default=32, help="FFN hidden width")
    g.add_argument("--head-hidden", type=int, nargs="*", default=[16], help="MLP head widths (none: linear head)")
    g.add_argument("--n-outputs", type=int, default=1, help="MLP head outputs b (default 1)")
    g.add_argument("--radius", type=float, default=1.0, help="multiplies every radius below (default 1)")
    for name in ("B_KQ", "B_V", "B_W1", "B_W2", "B_b1", "B_b2", "B_head"):
        g.add_argument(f"--{name}", type=float, default=1.0, help=f"radius {name} (default 1)")
    g.add_argument("--radial", default="volume", help="radial law: volume | uniform | boundary")
    g.add_argument("--output", default="head", help="head (Transformer+MLP) or features (token rows of g_L)")
    g.add_argument("--functions", type=int, default=2000, help="sampled members M (default 2000)")
    g.add_argument("--samples", type=int, default=16, help="input sequences n (default 16)")
    g.add_argument("--seq-len", type=int, default=4, help="tokens per sequence T (default 4)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mode", metavar="MODE", required=True)
    f = sub.add_parser("finite", help="a finite class given by its outputs (M x n x b) in .npy/.pt/.safetensors")
    f.add_argument("outputs", help="file of function outputs, shape (M, n, b) or (M, n)")
    f.add_argument("--key", default=None, help="tensor name inside a .pt/.safetensors with several")
    f.add_argument("--orders", type=int, default=1, help="visiting orders tried (best kept; default 1)")
    f.add_argument("--exact", action="store_true", help="also the exact internal covering number (M <= 400)")
    _common(f, eps_default=None)
    r = sub.add_parser("reference", help="Monte Carlo over the norm-bounded reference class")
    _class_args(r)
    _common(r, eps_default=_DEFAULT_EPS, scale="reference")
    u = sub.add_parser("uniform", help="lower estimate of the uniform covering number by sample-set search")
    _class_args(u)
    u.add_argument("--n", type=int, default=4, help="sample-set size n (default 4)")
    u.add_argument("--restarts", type=int, default=3, help="independent sample-set searches (best kept)")
    u.add_argument("--pool", type=int, default=64, help="candidate inputs per restart (default 64)")
    _common(u, eps_default=[0.05])
    lo = sub.add_parser("local", help="Monte Carlo over a model plus weight perturbations (local covering number)")
    lo.add_argument("model", help="model file or directory (anything transcover.model.load reads)")
    lo.add_argument("--arch", default=None, help="architecture of a bare .safetensors file")
    lo.add_argument("--strict", action="store_true", help="refuse unexpected tensors inside a layer (default: warn)")
    lo.add_argument("--perturb", nargs="+", default=["W_1=0.05", "W_2=0.05"], metavar="ROLE=R",
                    help="spectral radius per role (W_Q W_K W_V W_O W_1 W_2 b_1 b_2 head)")
    lo.add_argument("--radial", default="volume", help="radial law of the perturbations: volume | uniform | boundary")
    lo.add_argument("--functions", type=int, default=500, help="sampled perturbed models M")
    lo.add_argument("--samples", type=int, default=8, help="input sequences n")
    lo.add_argument("--seq-len", type=int, default=4, help="tokens per sequence T")
    _common(lo, eps_default=[0.001, 0.003, 0.01, 0.03], scale="local")


def _fmt_eps(e: float) -> str:
    """eps as the shortest string that reads back to the same float (0.999999999, not "1")."""
    return repr(float(e))


def _positive_int(name: str, v: int) -> None:
    from .._errors import InputError

    if v is None or v < 1:
        raise InputError(f"--{name} must be a positive integer, but got --{name}={v}")


def _check(args: argparse.Namespace) -> None:
    from ..empirical._metrics import check_eps, check_q

    for e in args.eps:
        check_eps(e, "--eps")
    args.q = check_q(args.q)
    if args.threads is not None:
        _positive_int("threads", args.threads)
    for name in ("functions", "samples", "seq_len", "n", "restarts", "pool", "orders", "layers",
                 "d_model", "heads", "d_ff", "n_outputs", "workers", "chunk_blocks", "chunk"):
        if hasattr(args, name):
            _positive_int(name.replace("_", "-"), getattr(args, name))


def _reference_class(args: argparse.Namespace):
    from ..empirical import NormRadii
    from ..model import ReferenceConfig

    try:
        cfg = ReferenceConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, d_ff=args.d_ff,
                              head_hidden=tuple(args.head_hidden), n_outputs=args.n_outputs)
    except ValueError as err:
        from .._errors import InputError

        raise InputError(str(err)) from None
    radii = NormRadii(B_KQ=args.B_KQ, B_V=args.B_V, B_W1=args.B_W1, B_W2=args.B_W2, B_b1=args.B_b1,
                      B_b2=args.B_b2, B_head=args.B_head).scaled(args.radius)
    return cfg, radii


def _reference_sample(args: argparse.Namespace):
    from ..empirical import sample_reference_class

    cfg, radii = _reference_class(args)
    return cfg, sample_reference_class(cfg, radii, args.functions, radial=args.radial, seed=args.seed,
                                       output=args.output)


def _reference_scaled(args: argparse.Namespace, X):
    """``cover reference``: the block-seeded class, chunks of members on the chosen backend (issue 14)."""
    import sys

    from ..scale._montecarlo import monte_carlo_reference
    from ._scaleopts import open_store, scale_backend

    backend = scale_backend(args)  # every check before any work starts
    cfg, radii = _reference_class(args)

    counts = {"computed": 0, "reused": 0}

    def on_result(r) -> None:
        counts["reused" if r.reused else "computed"] += r.ok

    store = open_store(args)
    try:
        mc = monte_carlo_reference(cfg, radii, X, args.functions, args.eps, args.q, seed=args.seed,
                                   radial=args.radial, output=args.output, chunk_blocks=args.chunk_blocks,
                                   store=store, backend=backend, workers=args.workers, threads=args.threads or 1,
                                   resume=args.resume, options={"address": args.ray_address}, on_result=on_result)
    finally:
        if store is not None:
            store.close()
    if store is not None:
        print(f"chunks: {counts['computed']} computed, {counts['reused']} reused from the store {args.store}",
              file=sys.stderr)
    return mc


def _scale_requested(args: argparse.Namespace) -> bool:
    from ._scaleopts import scale_requested

    return scale_requested(args)


def _local_scaled(args: argparse.Namespace, radii: dict, X):
    """``cover local`` with chunks of members on a backend: the numbers of the serial run, bit for bit."""
    import sys

    from ..scale._montecarlo import monte_carlo_local
    from ._scaleopts import open_store, scale_backend

    backend = scale_backend(args)
    counts = {"computed": 0, "reused": 0}

    def on_result(r) -> None:
        counts["reused" if r.reused else "computed"] += r.ok

    store = open_store(args)
    try:
        mc, _ = monte_carlo_local(args.model, radii, X, args.functions, args.eps, args.q, seed=args.seed,
                                  radial=args.radial, arch=args.arch, strict=args.strict, chunk=args.chunk,
                                  store=store, backend=backend, workers=args.workers, threads=args.threads or 1,
                                  resume=args.resume, options={"address": args.ray_address}, on_result=on_result)
    finally:
        if store is not None:
            store.close()
    if store is not None:
        print(f"chunks: {counts['computed']} computed, {counts['reused']} reused from the store {args.store}",
              file=sys.stderr)
    return mc


def run(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console
    from rich.table import Table

    from .. import empirical as E
    from .._errors import InputError
    from .._results import check_certified
    from ..report import atomic_write_text, envelope_json, start_progress

    _check(args)
    console = Console()
    qn = "inf" if args.q == float("inf") else str(int(args.q))
    tracker = start_progress(quiet=args.quiet)
    tracker.step(f"cover {args.mode}")
    fig_data = None
    if args.mode == "finite":
        Y = E.load_outputs(args.outputs, key=args.key)
        table = Table(title=f"{args.outputs}: M={Y.shape[0]} functions, n={Y.shape[1]} samples, "
                            f"b={Y.shape[2]} outputs, q={qn}")
        for c in ("eps", "packing (lower)", "net (upper)", "log N in") + (("exact N_int",) if args.exact else ()):
            table.add_column(c, justify="right")
        rows = []
        for e in args.eps:
            est = E.estimate_covering_number(Y, e, args.q, n_orders=args.orders, seed=args.seed, workers=args.threads)
            # packing <= N_ext <= N_int <= net (the net is a certificate, the packing a witness)
            check_certified(f"covering number at eps={e!r} (packing vs net)", est.net_size, est.packing_size)
            d = est.to_dict()
            cells = [_fmt_eps(e), str(est.packing_size), str(est.net_size),
                     f"[{est.lower.value:.3f}, {est.upper.value:.3f}]"]
            if args.exact:
                d["exact_internal"] = E.exact_covering_number(Y, e, args.q)
                check_certified(f"internal covering number at eps={e!r} (exact vs net)", est.net_size,
                                d["exact_internal"])
                check_certified(f"covering number at eps={e!r} (packing vs exact)", d["exact_internal"],
                                est.packing_size)
                cells.append(str(d["exact_internal"]))
            rows.append(d)
            table.add_row(*cells)
        payload: dict[str, object] = {"mode": "finite", "file": str(args.outputs), "rows": rows}
        fig_data = ([r["eps"] for r in rows], [r["log_N_upper"]["value"] for r in rows],
                    [r["log_N_lower"]["value"] for r in rows], str(args.outputs))
    elif args.mode in ("reference", "local"):
        if args.mode == "reference":
            d_model = _reference_class(args)[0].d_model
        else:
            radii = {}
            for item in args.perturb:
                role, _, val = item.partition("=")
                try:
                    radii[role] = float(val)
                except ValueError:
                    raise InputError(f"--perturb expects ROLE=RADIUS, but got {item!r}") from None
            from ..model import load

            spec = load(args.model, arch=args.arch, strict=args.strict).to_torch()
            sample = E.sample_local_class(spec, radii, args.functions, radial=args.radial, seed=args.seed)
            d_model = spec.d_model
        X = E.random_inputs(args.samples, args.seq_len, d_model, seed=args.seed + 1)
        tracker.step(f"Monte Carlo covering ({args.functions} functions)")
        if args.mode == "reference":
            mc = _reference_scaled(args, X)
        elif _scale_requested(args):  # chunks of perturbed models as resumable items (issue 14)
            mc = _local_scaled(args, radii, X)
        else:
            mc = E.monte_carlo_covering(sample, X, args.eps, args.q, workers=args.threads)
        table = Table(title=f"{mc.description}\nM={mc.n_functions}, n={args.samples} x T={args.seq_len}, q={qn}")
        for c in ("eps", "packing (lower N_ext)", "net (lower packing no.)", "log N estimate", "note"):
            table.add_column(c, justify="right")
        for e, eps in enumerate(mc.eps):
            note = "saturated" if mc.saturated(e) else ("still growing with M" if mc.still_growing(e) else "")
            table.add_row(_fmt_eps(eps), str(mc.packing_sizes[e][-1]), str(mc.net_sizes[e][-1]),
                          f"{mc.log_packing_lower(e).value:.3f}", note)
        payload = {"mode": args.mode, **mc.to_dict()}
        if args.mode == "local":
            payload["warnings"] = list(spec.warnings)
        try:
            fit = E.fit_eps_growth(*E.usable_points(mc))
            payload["eps_growth_fit"] = fit.to_dict()
            table.caption = (f"fitted log N ~ eps^-{fit.alpha:.2f} (norm-based bound: eps^-2); "
                             f"log N ~ {fit.p_eff:.1f} log(1/eps) (parameter counting)")
        except InputError as err:
            table.caption = f"no growth fit: {err}"
        import numpy as np

        fig_data = (list(mc.eps), list(np.log([s[-1] for s in mc.net_sizes])),
                    list(np.log([s[-1] for s in mc.packing_sizes])), args.mode)
    else:  # uniform
        cfg, sample = _reference_sample(args)
        if args.functions > E._uniform.MAX_FUNCTIONS:
            raise InputError(f"--functions must be <= {E._uniform.MAX_FUNCTIONS} for the uniform search, "
                             f"but got --functions={args.functions}")
        T = args.seq_len

        def sampler(count: int, seed: int):
            return E.random_inputs(count, T, cfg.d_model, seed=seed)

        table = Table(title=f"{sample.description}\nuniform search: n={args.n}, M={args.functions}, q={qn}")
        for c in ("eps", "random-set packings", "greedy-set packings", "best (lower N_inf(F,eps,n))"):
            table.add_column(c, justify="right")
        rows = []
        tracker.step("uniform search over sample sets", total=len(args.eps))
        for e in args.eps:
            tracker.update(len(rows), len(args.eps))
            res = E.uniform_covering_search(sample, args.n, e, args.q, input_sampler=sampler,
                                            restarts=args.restarts, pool_size=args.pool, seed=args.seed,
                                            workers=args.threads)
            rows.append(res.to_dict())
            table.add_row(_fmt_eps(e), str(list(res.random_packings)), str(list(res.greedy_packings)),
                          str(res.best_packing))
        payload = {"mode": "uniform", "rows": rows}
        import math

        fig_data = (list(args.eps), [math.log(r["best_packing"]) for r in rows],
                    [math.log(max(r["random_packings"])) for r in rows], "uniform")
    # Render everything before writing anything: an error leaves no half-written outputs.
    source = getattr(args, "outputs", None) or getattr(args, "model", None)
    text = (envelope_json(payload, schema=f"transcover.cover.{args.mode}", schema_version="1",
                          inputs=[source] if source else []) if args.json else None)
    png = _figure_bytes(*fig_data) if args.plot else None
    tracker.close()
    console.print(table)
    if text is not None:
        atomic_write_text(args.json, text)
        print(f"wrote {args.json}", file=sys.stderr)
    if png is not None:
        from ..report import atomic_write_bytes

        atomic_write_bytes(args.plot, png)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _figure_bytes(eps, upper, lower, label) -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(eps, upper, "o-", label=f"{label}: net / best")
    ax.plot(eps, lower, "v--", label=f"{label}: packing / random")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # labelled minor ticks overlap
    ax.set_xticks(list(eps), [_fmt_eps(e) for e in eps])
    ax.set_xlabel(r"$\varepsilon$")
    ax.set_ylabel(r"$\log N(\varepsilon)$")
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
