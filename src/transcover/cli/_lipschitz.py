"""``transcover lipschitz [MODEL]``: certified upper and measured lower Lipschitz constants (issue 3).

Parses the command line into a :class:`~transcover.lipschitz.LipschitzConfig` (whose fields hold
every default), calls ``transcover.lipschitz``, renders through ``transcover.report``.
"""

from __future__ import annotations

import argparse

from ..lipschitz import LipschitzConfig

_D = LipschitzConfig()  # the defaults (the help formatter shows each as "(default: ...)")

NAME = "lipschitz"
HELP = "per-layer, per-component Lipschitz constants: certified upper bound, empirical lower bound, ratio"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared with ``perturb``: domain, metric, constants, search effort, output."""
    from ._conventions import add_deprecated_alias, add_load_arguments

    add_load_arguments(p)
    p.add_argument("--radius", type=float, default=_D.radius,
                   help="R: every input token (embedded, before the input norm) has l2 norm <= R")
    p.add_argument("--metric", choices=("2,inf", "fro"), default=_D.metric,
                   help="max over tokens of the l2 norm (T-independent) or Frobenius over --seq-len tokens")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sampled input (and T for --metric fro; default {_D.seq_len}, or the model's "
                        "longest sequence if shorter)")
    p.add_argument("--c-sm", type=float, default=_D.c_sm,
                   help="softmax constant >= 1 (1 proven and tight; 2 Edelman et al.)")
    p.add_argument("--sigma-min", dest="ln_sigma_min", type=float, default=_D.sigma_min,
                   help="assume every LayerNorm input has std >= this (0: the global, eps-limited constant)")
    add_deprecated_alias(p, "--ln-sigma-min", "--sigma-min", "ln_sigma_min", type=float)
    p.add_argument("--samples", type=int, default=_D.samples,
                   help="random starting inputs per search")
    p.add_argument("--steps", type=int, default=_D.steps, help="ascent steps per search")
    p.add_argument("--seed", type=int, default=_D.seed,
                   help="random seed of the lower-estimate search")
    p.add_argument("--json", metavar="PATH", default=None, help="write the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .safetensors file or short name (default: the bundled all-MiniLM-L6-v2)")
    add_model_arguments(p)
    p.add_argument("--no-lower", action="store_true", help="certified bounds only (skip the empirical search)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write certified upper vs empirical lower per stage and layer (.png, .svg or .pdf); with "
                        "--data per layer and network against rho")
    p.add_argument("--csv", metavar="PATH", default=None,
                   help="write the table's rows as CSV (one per stage, layer and network; with --data one per rho, "
                        "layer and component)")
    p.add_argument("--data", default=None,
                   help="local constants at real inputs: token ids (.npy int (n, T); -1 pads at row ends), "
                        "embeddings (.npy float (n, T, d); rows of NaN pad at sequence ends), a model's raw inputs "
                        "when it has an input embedding (.npy float (n, T, d_in): digits rows), texts (.txt, one per "
                        "line, the model's tokenizer; blank lines are skipped, and sequences are numbered from 0 over "
                        "the other lines), 'sklearn-descr' "
                        "(sentences of scikit-learn's dataset descriptions) or 'task' (a `transcover train` "
                        "run's own held-out inputs)")
    p.add_argument("--rho", default="1e-3",
                   help="ball radius (per token, l2) around the data, comma-separated for a sweep; with "
                        "--rho-relative a factor of each layer's median token norm (default 1e-3)")
    p.add_argument("--rho-relative", action="store_true", help="read --rho as factors of the median token norm")
    p.add_argument("--max-len", type=int, default=32, help="truncate texts to this many tokens (default 32)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N sequences of --data")
    p.add_argument("--whole-network", choices=("auto", "product", "stack"), default=None,
                   help="with --data: also the whole network's local constant per rho, by the product of the "
                        "layers' constants or the exact stack Jacobian + drift (THEORY F30; costs T^2 d^3 per "
                        "layer), the smaller kept; 'auto' runs the stack route on small inputs only")
    p.add_argument("--move-rest", action="store_true",
                   help="with --whole-network: the stack route also bounds each sub-stage input's move by its rest's "
                        "own recursion at the data (THEORY F77-F79; tighter at larger radii, about 2x the CPU)")
    p.add_argument("--ball-lower", choices=("off", "layers", "all"), default="off",
                   help="with --data: the lower estimate on the whole ball (Jacobian-norm ascent over centres and "
                        "pair-ratio ascent inside it, about the certification's own time) for the layers' rows "
                        "or for every component's, beside the point lower (default off: the point lower only)")
    p.add_argument("--ball-steps", type=int, default=3, help="ascent steps per start of --ball-lower (default 3)")
    from ._scaleopts import add_scale_arguments

    add_scale_arguments(p, "sequences of --data", threads=True)


def config_from_args(args: argparse.Namespace, cls: type = LipschitzConfig) -> LipschitzConfig:
    """The config of a parsed (and checked) command line."""
    return cls(radius=args.radius, metric=args.metric, seq_len=args.seq_len, c_sm=args.c_sm,
               sigma_min=args.ln_sigma_min, samples=args.samples, steps=args.steps, seed=args.seed)


def check_common(args: argparse.Namespace) -> None:
    from .._errors import InputError, check_number, check_radius

    check_radius(args.radius, "--radius")
    from ..lipschitz import check_c_sm

    check_c_sm(args.c_sm, "--c-sm")
    check_number(args.ln_sigma_min, "--sigma-min", low=0.0)  # inf reached the bounds, refused in their words
    for flag, v, lo in (("--seq-len", args.seq_len, 1), ("--samples", args.samples, 1), ("--steps", args.steps, 0)):
        if v is not None and v < lo:
            raise InputError(f"{flag} must be >= {lo}, but got {flag}={v}")


def _refuse_global_options(args: argparse.Namespace) -> None:
    """With ``--data`` the global bounds' options change nothing (the balls are the data's, the metric (2,inf), the
    softmax constant the exact Jacobian's, the floors certified): ``--metric fro`` printed (2,inf) constants without a
    word (red team 167). Each one given is refused."""
    from .._errors import InputError

    d = LipschitzConfig()
    given = [flag for flag, v, dv in (("--radius", args.radius, d.radius), ("--metric", args.metric, d.metric),
                                      ("--seq-len", args.seq_len, None), ("--c-sm", args.c_sm, d.c_sm),
                                      ("--sigma-min", args.ln_sigma_min, d.sigma_min),
                                      ("--samples", args.samples, d.samples)) if v != dv]
    if given:
        raise InputError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply with --data: the local "
                         "bounds are on the data's balls (--rho) in the (2,inf) metric, from the exact Jacobian and "
                         "the certified variance floors; drop it or run without --data")


def run(args: argparse.Namespace) -> int:
    import torch

    from .._results import check_certified
    from ..lipschitz import lipschitz_bounds, lipschitz_lower
    from ..train import load_model as load
    from ..report import start_progress
    from ._conventions import load_options, model_inputs
    from ..report import lipschitz_payload, lipschitz_rows, render_lipschitz

    check_common(args)
    from ..report import check_output_path

    for flag, path, suffixes in (("--plot", getattr(args, "plot", None), (".png", ".svg", ".pdf")),
                                 ("--json", args.json, ()), ("--csv", getattr(args, "csv", None), ())):
        if path is not None:
            check_output_path(path, flag, suffixes)  # before any work, so a bad path costs nothing
    if args.data is not None:
        _refuse_global_options(args)
        return run_local(args)
    from ._scaleopts import refuse_scale_options

    refuse_scale_options(args, "the global bounds (no --data)", "the sequences of --data")
    tracker = start_progress(quiet=args.quiet)
    tracker.step("loading the model")
    spec = load(args.model, **load_options(args)).to_torch()
    from ..model import sequence_length

    args.seq_len = sequence_length(args.seq_len, _D.seq_len, "--seq-len", spec)
    cfg = config_from_args(args)
    tracker.step("certified upper bounds")
    small_threads(spec.d_model, cfg.seq_len)
    seq = cfg.seq_len if cfg.metric == "fro" or _needs_seq_len(spec) else None
    bounds = lipschitz_bounds(spec, radius=cfg.radius, c_sm=cfg.c_sm, metric=cfg.metric, seq_len=seq,
                     sigma_min=cfg.sigma_min)
    lower = {}
    if not args.no_lower:
        torch.manual_seed(cfg.seed)
        tracker.step(f"empirical lower search ({cfg.samples} starts x {cfg.steps} steps per stage)")
        lower = lipschitz_lower(spec, bounds, seq_len=cfg.seq_len, n_samples=cfg.samples, n_steps=cfg.steps,
                                seed=cfg.seed)
    tracker.close()
    rows = lipschitz_rows(bounds, lower, spec.n_layers)
    # Every row is a theorem lower <= upper: a violation is a false certificate, never a table row.
    for _, layer, name, _, up, lw in rows:
        if lw is not None:
            check_certified(f"Lipschitz constant of {name} (layer {layer})", up, lw)
    render_lipschitz(spec.name, bounds, rows, spec.n_layers)
    # every output rendered before any is written, so an error leaves none half-written
    from ..report import envelope_json, figure_bytes, global_rows, write_outputs
    from ..scale import rows_csv

    outputs = []
    if args.json:
        outputs.append((args.json, envelope_json(lipschitz_payload(spec, bounds, lower, rows),
                                                 schema="transcover.lipschitz", schema_version="1",
                                                 inputs=model_inputs(args, args.model)).encode()))
    if getattr(args, "csv", None):
        outputs.append((args.csv, rows_csv(global_rows(rows)).encode()))
    if args.plot:
        outputs.append((args.plot, figure_bytes(bounds.plot(lower=lower).figure_, args.plot)))
    write_outputs(outputs)
    return 0


def small_threads(d_model: int, seq_len: int) -> None:
    """One intra-op thread for the rest of the command when the model is small (Note [small problems]
    in ``transcover._threads``: measured 70x slower forwards of a d=8 model on a loaded 2-core machine)."""
    from .._threads import set_torch_threads, small_problem

    if small_problem(d_model, seq_len):
        set_torch_threads(1)


def _needs_seq_len(spec) -> bool:
    return any(layer.attention.kind == "l2" for layer in spec.layers)


def parse_rhos(text: str) -> list[float]:
    """``--rho`` as a list of finite numbers > 0 (one clear line otherwise)."""
    import math

    from .._errors import InputError

    out = []
    for part in str(text).split(","):
        try:
            v = float(part)
        except ValueError:
            raise InputError(f"--rho must be numbers > 0 separated by commas, but got --rho={text}") from None
        from ._conventions import literal_problem

        if literal_problem(part):
            raise InputError(f"--rho: {literal_problem(part)} in --rho={text}")
        if not (v > 0 and math.isfinite(v)):
            raise InputError(f"--rho must be finite and > 0, but got {part.strip()} in --rho={text}")
        if v in out:  # the same radius twice wrote every row twice (stop 38 red team)
            raise InputError(f"--rho lists {part.strip()} twice in --rho={text}")
        out.append(v)
    return out


def run_local(args: argparse.Namespace) -> int:
    """``--data``: certified local constants on balls around real inputs (issue 12), every check
    (rho, data, tokenizer) done before anything is computed or written."""
    import torch

    from .._errors import InputError
    from ..lipschitz import local_table
    from ..train import load_data
    from ..train import load_model as load
    from ._conventions import load_options, model_inputs
    from ..report import local_payload, render_local

    rhos = parse_rhos(args.rho)
    from ._scaleopts import scale_backend, scale_requested

    backend = scale_backend(args) if scale_requested(args) else None  # checked before anything loads
    for flag, v in (("--max-len", args.max_len), ("--limit", args.limit)):
        if v is not None and v < 1:
            raise InputError(f"{flag} must be >= 1, but got {flag}={v}")
    whole = getattr(args, "whole_network", None)
    if backend is not None and whole is not None:
        raise InputError("--whole-network is computed in one process; drop the scale options to use it")
    move_rest = getattr(args, "move_rest", False)
    if move_rest and whole is None:
        raise InputError("--move-rest bounds the whole network's stack route; it needs --whole-network")
    ball_mode = getattr(args, "ball_lower", "off")
    if backend is not None and ball_mode != "off":
        raise InputError("--ball-lower is computed in one process; drop the scale options to use it")
    if ball_mode != "off" and args.no_lower:
        raise InputError("--ball-lower is a lower estimate; it cannot be combined with --no-lower")
    if getattr(args, "ball_steps", 3) < 1:
        raise InputError(f"--ball-steps must be >= 1, but got --ball-steps={args.ball_steps}")
    spec = load(args.model, **load_options(args)).to_torch(torch.float64)
    seqs = load_data(args.model, spec, args.data, max_len=args.max_len, limit=args.limit)
    if backend is not None:  # one sequence per item, in parallel and resumable (issue 14)
        from ._scaleopts import local_rows_from_args

        rows = local_rows_from_args(args, spec, seqs, rhos, backend)
    else:
        ball = None if ball_mode == "off" else dict(steps=args.ball_steps, restarts=0, pair_restarts=0,
                                                    pair_steps=max(args.ball_steps - 1, 1), seed=args.seed)
        rows = local_table(spec, seqs, rhos, lower=not args.no_lower, relative=args.rho_relative,
                           lower_iter=max(args.steps // 2, 5), whole=whole, ball=ball,
                           ball_components=ball_mode == "all", move_rest=move_rest)
    render_local(spec.name, len(seqs), rows, bool(args.rho_relative))
    from ..report import envelope_json, figure_bytes, local_figure, write_outputs
    from ..scale import rows_csv

    outputs = []  # every output rendered before any is written
    if args.json:
        payload = local_payload(spec.name, len(seqs), rhos, bool(args.rho_relative), rows)
        from ..train import data_files

        # the files read for the data: the file, the tokenizer of texts (red team 222); sklearn-descr by name
        data_input = data_files(spec, args.data)
        outputs.append((args.json, envelope_json(payload, schema="transcover.lipschitz.local", schema_version="1",
                                                 inputs=[*model_inputs(args, args.model), *data_input]).encode()))
    if getattr(args, "csv", None):
        outputs.append((args.csv, rows_csv([r.to_dict() for r in rows]).encode()))
    if getattr(args, "plot", None):
        outputs.append((args.plot, figure_bytes(local_figure(rows), args.plot)))
    write_outputs(outputs)
    return 0
