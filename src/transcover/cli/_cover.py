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
    p.add_argument("--plot", metavar="PATH", default=None, help="write log N against eps (.png, .svg or .pdf)")
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
    f.add_argument("--allow-pickle", action="store_true", help="read a .pt outputs file (a pickle; only files you trust)")
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
                    help="radius per role in every layer: spectral norm of each head's block for W_Q W_K W_V W_O "
                         "(per head, not the whole matrix), of W_1 W_2 and each MLP-head matrix (head); l2 for b_1 b_2")
    lo.add_argument("--radial", default="volume", help="radial law of the perturbations: volume | uniform | boundary")
    lo.add_argument("--functions", type=int, default=500, help="sampled perturbed models M")
    lo.add_argument("--samples", type=int, default=8, help="input sequences n")
    lo.add_argument("--seq-len", type=int, default=4, help="tokens per sequence T")
    _common(lo, eps_default=[0.001, 0.003, 0.01, 0.03], scale="local")


def _positive_int(name: str, v: int) -> None:
    from .._errors import InputError

    if v is None or v < 1:
        raise InputError(f"--{name} must be a positive integer, but got --{name}={v}")


def _check(args: argparse.Namespace) -> None:
    from ..empirical import check_eps, check_q

    from ..empirical import check_seed

    for e in args.eps:
        check_eps(e, "--eps")
    check_seed(args.seed, "--seed")
    if getattr(args, "head_hidden", None) is not None:
        for w in args.head_hidden:
            _positive_int("head-hidden", w)
    args.q = check_q(args.q)
    if args.threads is not None:
        _positive_int("threads", args.threads)
    for name in ("functions", "samples", "seq_len", "n", "restarts", "pool", "orders", "layers",
                 "d_model", "heads", "d_ff", "n_outputs", "workers", "chunk_blocks", "chunk"):
        if hasattr(args, name):
            _positive_int(name.replace("_", "-"), getattr(args, name))
    if hasattr(args, "pool") and hasattr(args, "n") and args.pool < args.n:  # the API's "pool_size" named no option
        from .._errors import InputError

        raise InputError(f"--pool must be >= --n (candidate inputs per restart, of which --n are kept), but got "
                         f"--pool={args.pool}, --n={args.n}")
    from ..report import check_output_path

    # before any work, and the format the suffix names (--plot x.svg wrote PNG bytes: red team 220)
    for flag, path, suffixes in (("--json", args.json, ()), ("--plot", args.plot, (".png", ".svg", ".pdf"))):
        if path is not None:
            check_output_path(path, flag, suffixes)


def _perturb_radii(items: list[str]) -> dict[str, float]:
    from .._errors import InputError

    from ._conventions import read_float

    radii = {}
    for item in items:
        role, eq, val = item.partition("=")
        if not eq:
            raise InputError(f"--perturb expects ROLE=RADIUS, but got {item!r}")
        if role in radii:  # the last one won silently (red team 191)
            raise InputError(f"--perturb gives {role} twice ({role}={radii[role]!r} and {item!r}); give each role once")
        radii[role] = read_float(val, f"--perturb {role}")
    return radii


def _call(args: argparse.Namespace, tracker):
    """``transcover.cover`` with this command line's options."""
    from .._api import cover

    if args.mode == "reference" or (args.mode == "local" and _scale_requested(args)):
        return _scaled_result(args, tracker)  # chunks of members as resumable items (issue 14)
    common = dict(eps=args.eps, q=args.q, seed=args.seed, workers=args.threads, progress=tracker)
    if args.mode == "finite":
        return cover(args.outputs, mode="finite", key=args.key, orders=args.orders, exact=args.exact,
                     allow_pickle=args.allow_pickle, **common)
    sampling = dict(radial=args.radial, functions=args.functions, **common)
    if args.mode == "local":
        return cover(args.model, mode="local", arch=args.arch, strict=args.strict,
                     perturb=_perturb_radii(args.perturb), samples=args.samples, seq_len=args.seq_len, **sampling)
    cls = dict(layers=args.layers, d_model=args.d_model, heads=args.heads, d_ff=args.d_ff,
               head_hidden=tuple(args.head_hidden), n_outputs=args.n_outputs, radius=args.radius,
               radii={k: getattr(args, k) for k in ("B_KQ", "B_V", "B_W1", "B_W2", "B_b1", "B_b2", "B_head")},
               output=args.output, seq_len=args.seq_len, **sampling)
    if args.mode == "uniform":
        return cover(mode="uniform", n=args.n, restarts=args.restarts, pool=args.pool, **cls)
    return cover(mode="reference", samples=args.samples, **cls)


def _scale_requested(args: argparse.Namespace) -> bool:
    from ._scaleopts import scale_requested

    return scale_requested(args)


def _scaled_result(args: argparse.Namespace, tracker):
    """``cover reference`` (always: its members are drawn in seed blocks, so every backend and worker
    count gives the serial numbers) and ``cover local`` with --workers/--backend/--store: chunks of
    members on the chosen backend through ``transcover.scale``, as a ``CoverResult``."""
    import sys

    from .. import empirical as E
    from .._api_results import CoverResult
    from .._errors import InputError
    from ..scale import monte_carlo_local, monte_carlo_reference
    from ._scaleopts import open_store, scale_backend

    backend = scale_backend(args)  # every check before any work starts
    counts = {"computed": 0, "reused": 0}

    def on_result(r) -> None:
        counts["reused" if r.reused else "computed"] += r.ok

    run = dict(backend=backend, workers=args.workers, threads=args.threads or 1, resume=args.resume is not False,
               options={"address": args.ray_address}, on_result=on_result)
    warnings: tuple[str, ...] = ()
    if args.mode == "reference":
        from ..model import ReferenceConfig

        try:
            cfg = ReferenceConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, d_ff=args.d_ff,
                                  head_hidden=tuple(args.head_hidden), n_outputs=args.n_outputs)
        except ValueError as err:
            raise InputError(str(err)) from None
        radii = E.NormRadii(**{k: getattr(args, k) for k in ("B_KQ", "B_V", "B_W1", "B_W2", "B_b1", "B_b2",
                                                             "B_head")}).scaled(args.radius)
        X = E.random_inputs(args.samples, args.seq_len, cfg.d_model, seed=args.seed + 1)
        tracker.step(f"Monte Carlo covering ({args.functions} functions)")
        store = open_store(args)
        try:
            mc = monte_carlo_reference(cfg, radii, X, args.functions, args.eps, args.q, seed=args.seed,
                                       radial=args.radial, output=args.output, chunk_blocks=args.chunk_blocks,
                                       store=store, **run)
        finally:
            if store is not None:
                store.close()
    else:
        from ..train import load_model as load

        spec = load(args.model, arch=args.arch, strict=args.strict).to_torch()
        warnings = tuple(spec.warnings)
        X = E.random_inputs(args.samples, args.seq_len, spec.d_model, seed=args.seed + 1)
        tracker.step(f"Monte Carlo covering ({args.functions} functions)")
        store = open_store(args)
        try:
            mc, _ = monte_carlo_local(args.model, _perturb_radii(args.perturb), X, args.functions, args.eps, args.q,
                                      seed=args.seed, radial=args.radial, arch=args.arch, strict=args.strict,
                                      chunk=args.chunk, store=store, **run)
        finally:
            if store is not None:
                store.close()
    if store is not None:
        print(f"chunks: {counts['computed']} computed, {counts['reused']} reused from the store {args.store}",
              file=sys.stderr)
    fit, fit_error = None, ""
    try:
        fit = E.fit_eps_growth(*E.usable_points(mc))
    except InputError as err:
        fit_error = str(err)
    return CoverResult(args.mode, tuple(mc.eps), mc.q, None if args.mode == "reference" else str(args.model),
                       mc.description, (args.functions, args.samples, args.seq_len), monte_carlo=mc, fit=fit,
                       fit_error=fit_error, warnings=warnings)


def run(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console

    from ..report import (EmpiricalCoveringDisplay, atomic_write_bytes, atomic_write_text, cover_table,
                          display_bytes, envelope_json, print_table, start_progress)

    _check(args)
    tracker = start_progress(quiet=args.quiet)
    tracker.step(f"cover {args.mode}")
    result = _call(args, tracker)
    # Render everything before writing anything: an error leaves no half-written outputs.
    source = getattr(args, "outputs", None) or getattr(args, "model", None)
    text = (envelope_json(result.to_dict(), schema=f"transcover.cover.{args.mode}", schema_version="1",
                          inputs=[source] if source else []) if args.json else None)
    figure = display_bytes(EmpiricalCoveringDisplay.from_result(result).plot(), args.plot) if args.plot else None
    tracker.close()
    print_table(Console(), cover_table(result))
    if text is not None:
        atomic_write_text(args.json, text)
        print(f"wrote {args.json}", file=sys.stderr)
    if figure is not None:
        atomic_write_bytes(args.plot, figure)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
