"""``transcover bound [MODEL]``: covering number and generalisation bound from the weights (issue 4).

Parses the command line into a :class:`~transcover.covering.BoundConfig` (whose fields hold every
default), calls :func:`~transcover.covering.model_bound`, and renders through
``transcover.report._bound_tables``.
"""

from __future__ import annotations

import argparse

from ..covering import BoundConfig

NAME = "bound"
HELP = "log covering number at eps, generalisation bound at n samples, and where it comes from"
_D = BoundConfig()  # the defaults (the help formatter shows each as "(default: ...)"; n and T name theirs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .safetensors file, a `transcover train` checkpoint folder (n and T "
                        "default to its task's), or short name (default: the bundled all-MiniLM-L6-v2)")
    from ._conventions import add_load_arguments

    add_load_arguments(p)
    p.add_argument("--eps", type=float, default=_D.eps, help="covering scale eps")
    p.add_argument("--n-samples", type=float, nargs="+", default=None,
                   help=f"training-set sizes n for the generalisation bound (default {_D.n_samples[0]:g}; a training "
                        "checkpoint: its n_train)")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"sequence length T (enters as log(nT); default {_D.seq_len}; the model's longest sequence "
                        "if shorter; a training checkpoint: its task's)")
    p.add_argument("--radius", type=float, default=_D.radius,
                   help="bound R on input token norms")
    p.add_argument("--c-sm", type=float, default=_D.c_sm,
                   help="softmax constant >= 1: 1 (proven and tight) or 2 (Edelman)")
    p.add_argument("--family", choices=("auto", "l21", "spectral", "best"), default=_D.family,
                   help="auto: compute every route below and report the smallest certified log N; "
                        "l21: (2,1)-norm covers, 1/eps^2 (the seed's form); spectral: parameter-count covers "
                        "(dimension-dependent); best: the cheaper of the two per matrix inside Lemma G.1")
    p.add_argument("--sigma-min", type=float, default=_D.sigma_min,
                   help="assumed floor on every LayerNorm input's std (0: global max|gamma|/sqrt(eps) constant)")
    p.add_argument("--reference", default=None, metavar="MODEL",
                   help="initialisation: measure distances from this model's weights instead of from 0")
    p.add_argument("--loss-lipschitz", type=float, default=_D.loss_lipschitz,
                   help="Lipschitz constant of the loss")
    p.add_argument("--loss-bound", type=float, default=_D.loss_bound,
                   help="the loss takes values in [0, b]")
    p.add_argument("--delta", type=float, default=_D.delta, help="failure probability")
    p.add_argument("--norm-grid", type=int, default=_D.norm_grid, metavar="K",
                   help="the gaps' class: every norm rounded up to a grid of K levels per octave, each level paid for "
                        "by a prior fixed before the data (THEORY F102), so the gaps hold for norms read off the "
                        "trained weights; 0: no grid, the class taken as fixed before the data (only valid when "
                        "these norms were chosen in advance)"),
    p.add_argument("--target-gap", type=float, default=None,
                   help="also report the n needed for a gap <= this (default: 0.1 * loss bound)")
    p.add_argument("--top", type=int, default=10, help="matrices in the breakdown table (default 10)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the result as JSON")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG: log N(eps) and the bound against n")
    p.add_argument("--quiet", action="store_true", help="print no tables and no progress")


def check_cover_options(*, eps: float, n_samples, seq_len: int | None, radius: float, sigma_min: float) -> None:
    """The covering bound's options, refused in their flags' names before anything is loaded: ``bound``'s and
    ``report``'s one check (red team 215: ``report`` took --n-samples 1.5, inf and 1e301 and --eps 1e-310 and refused
    the last three after loading and analysing, as "n_samples must be")."""
    from .._errors import InputError, check_number

    for flag, v in (("--eps", eps), ("--radius", radius)):
        if not (v > 0 and v < float("inf")):
            raise InputError(f"{flag} must be a finite number > 0, but got {flag}={v}")
    from ..covering import MAX_SAMPLES, MIN_EPS

    if eps < MIN_EPS:  # the API's own check, in the option's name (red team 205)
        raise InputError(f"--eps must be >= {MIN_EPS!r} (twice float64's smallest normal number: below it eps / 2 "
                         f"may round), but got --eps={eps!r}")
    for n in n_samples:
        if not (n >= 1 and n < float("inf")) or n != int(n):  # 1.5 samples: the cover used round(nT) points (37j)
            raise InputError(f"--n-samples must be whole numbers >= 1, but got --n-samples={n:g}")
        if n > MAX_SAMPLES:
            raise InputError(f"--n-samples must be <= {MAX_SAMPLES:g}, but got --n-samples={n:g}")
    if seq_len is not None and seq_len < 1:
        raise InputError(f"--seq-len must be >= 1, but got --seq-len={seq_len}")
    # finite too: inf passed these checks and the API refused it by its own name ("sigma_min must be"; red team 198)
    check_number(sigma_min, "--sigma-min", low=0.0)


def _validate(args: argparse.Namespace) -> None:
    from .._errors import InputError, check_number
    from ..lipschitz import check_c_sm

    check_c_sm(args.c_sm, "--c-sm")
    check_cover_options(eps=args.eps, n_samples=args.n_samples or (), seq_len=args.seq_len, radius=args.radius,
                        sigma_min=args.sigma_min)
    for flag, v in (("--loss-lipschitz", args.loss_lipschitz), ("--loss-bound", args.loss_bound)):
        if not (v > 0 and v < float("inf")):
            raise InputError(f"{flag} must be a finite number > 0, but got {flag}={v}")
    if not (0 < args.delta < 1):
        raise InputError(f"--delta must be in (0, 1), but got --delta={args.delta}")
    if args.target_gap is not None:
        check_number(args.target_gap, "--target-gap", low=0.0, strict=True)
    from ..covering import NORM_GRID_MAX_STEPS as MAX_STEPS

    if not 0 <= args.norm_grid <= MAX_STEPS:
        raise InputError(f"--norm-grid must be in [0, {MAX_STEPS}] levels per octave, "
                         f"but got --norm-grid={args.norm_grid}")
    if args.top < 0:
        raise InputError(f"--top must be >= 0, but got --top={args.top}")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise InputError(f"--plot writes a PNG; the path must end in .png, but got --plot={args.plot}")


def config_from_args(args: argparse.Namespace) -> BoundConfig:
    """The :class:`BoundConfig` of a parsed command line (``n_samples``, ``seq_len`` already resolved)."""
    return BoundConfig(eps=args.eps, n_samples=tuple(args.n_samples), seq_len=args.seq_len, radius=args.radius,
                       c_sm=args.c_sm, family=args.family, sigma_min=args.sigma_min,
                       loss_lipschitz=args.loss_lipschitz, loss_bound=args.loss_bound, delta=args.delta,
                       norm_grid=args.norm_grid)


def run(args: argparse.Namespace) -> int:
    import sys

    from ..covering import diagnose, model_bound
    from ..train import load_model as load
    from ..report import atomic_write_text, start_progress
    from ..report import bound_payload, bound_png, render_bound

    _validate(args)
    tracker = start_progress(quiet=args.quiet)
    tracker.step("loading the model")
    from ..train import load_model_task
    from ._conventions import load_options, model_inputs

    spec, n_train, seq_len = load_model_task(args.model, **load_options(args))
    spec = spec.to_torch()
    if n_train is not None:  # a training run: its own n and T unless given
        args.n_samples = args.n_samples or [float(n_train)]
        args.seq_len = args.seq_len or seq_len
    args.n_samples = args.n_samples or list(_D.n_samples)
    from ..model import sequence_length

    args.seq_len = sequence_length(args.seq_len, _D.seq_len, "--seq-len", spec)
    reference = None if args.reference is None else load(args.reference, **load_options(args)).to_torch()
    tracker.step("covering number and generalisation bound")
    result = model_bound(spec, config_from_args(args), reference=reference)
    target = args.target_gap if args.target_gap is not None else 0.1 * args.loss_bound
    n_needed = result.n_for_gap(target)
    diagnosis = diagnose(result)
    warnings = list(spec.warnings) + ([] if reference is None else list(reference.warnings))
    data = bound_payload(result, diagnosis, n_needed, target, warnings)
    # Render and build every output before writing any, so an error leaves nothing half-written.
    outputs = []
    if args.json:
        from ..report import envelope_json

        # version 2: class_terms and head added, transformer.contributions' share renamed (red team 215)
        outputs.append(("json", args.json, envelope_json(data, schema="transcover.bound", schema_version="2",
                                                         inputs=model_inputs(args, args.model,
                                                                             *filter(None, [args.reference])))))
    if args.plot:
        tracker.step("plotting")
    png = bound_png(result, n_needed, target) if args.plot else None
    tracker.close()
    if not args.quiet:
        render_bound(result, n_needed, target, args.top, diagnosis)
    for _, path, text in outputs:
        atomic_write_text(path, text)
        print(f"wrote {path}", file=sys.stderr)
    if png is not None:
        from ..report import atomic_write_bytes

        atomic_write_bytes(args.plot, png)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
