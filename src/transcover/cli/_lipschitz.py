"""``transcover lipschitz [MODEL]``: certified upper and measured lower Lipschitz constants (issue 3)."""

from __future__ import annotations

import argparse

NAME = "lipschitz"
HELP = "per-layer, per-component Lipschitz constants: certified upper bound, empirical lower bound, ratio"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared with ``perturb``: domain, metric, constants, search effort, output."""
    p.add_argument("--arch", default=None, help="architecture of a bare .safetensors file")
    p.add_argument("--allow-pickle", action="store_true", help="load pickled checkpoints with weights_only=True")
    p.add_argument("--strict", action="store_true",
                   help="refuse a checkpoint with tensors inside a layer that the architecture does not define "
                        "(default: warn, naming each)")
    p.add_argument("--radius", type=float, default=1.0,
                   help="R: every input token (embedded, before the input norm) has l2 norm <= R (default 1)")
    p.add_argument("--metric", choices=("2,inf", "fro"), default="2,inf",
                   help="max over tokens of the l2 norm (T-independent) or Frobenius over --seq-len tokens")
    p.add_argument("--seq-len", type=int, default=8, help="tokens per sampled input (and T for --metric fro)")
    p.add_argument("--c-sm", type=float, default=1.0, help="softmax constant >= 1 (1 proven and tight, the default; 2 Edelman et al.)")
    p.add_argument("--sigma-min", dest="ln_sigma_min", type=float, default=0.0,
                   help="assume every LayerNorm input has std >= this (0: the global, eps-limited constant)")
    from ._conventions import add_deprecated_alias

    add_deprecated_alias(p, "--ln-sigma-min", "--sigma-min", "ln_sigma_min", type=float)
    p.add_argument("--samples", type=int, default=6, help="random starting inputs per search (default 6)")
    p.add_argument("--steps", type=int, default=30, help="ascent steps per search (default 30)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the lower-estimate search")
    p.add_argument("--json", metavar="PATH", default=None, help="write the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .safetensors file or short name (default: the bundled all-MiniLM-L6-v2)")
    add_model_arguments(p)
    p.add_argument("--no-lower", action="store_true", help="certified bounds only (skip the empirical search)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write certified upper vs empirical lower per stage and layer (.png, .svg or .pdf)")
    p.add_argument("--data", default=None,
                   help="local constants at real inputs: token ids (.npy int (n, T)), embeddings (.npy float "
                        "(n, T, d)), texts (.txt, one per line, the model's tokenizer) or 'sklearn-descr' "
                        "(sentences of scikit-learn's dataset descriptions)")
    p.add_argument("--rho", default="1e-3",
                   help="ball radius (per token, l2) around the data, comma-separated for a sweep; with "
                        "--rho-relative a factor of each layer's median token norm (default 1e-3)")
    p.add_argument("--rho-relative", action="store_true", help="read --rho as factors of the median token norm")
    p.add_argument("--max-len", type=int, default=32, help="truncate texts to this many tokens (default 32)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N sequences of --data")
    from ._scaleopts import add_scale_arguments

    add_scale_arguments(p, "sequences of --data", threads=True)


def check_common(args: argparse.Namespace) -> None:
    from .._errors import InputError

    if not (args.radius > 0 and args.radius < float("inf")):
        raise InputError(f"--radius must be a finite number > 0, but got --radius={args.radius}")
    from ..lipschitz._attention import check_c_sm

    check_c_sm(args.c_sm, "--c-sm")
    if not args.ln_sigma_min >= 0:
        raise InputError(f"--sigma-min must be >= 0, but got --sigma-min={args.ln_sigma_min}")
    for flag, v, lo in (("--seq-len", args.seq_len, 1), ("--samples", args.samples, 1), ("--steps", args.steps, 0)):
        if v < lo:
            raise InputError(f"{flag} must be >= {lo}, but got {flag}={v}")


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}"


def run(args: argparse.Namespace) -> int:
    import sys

    import torch
    from rich.console import Console
    from rich.table import Table

    from .._results import check_certified
    from ..lipschitz._compose import compose
    from ..lipschitz._empirical import lipschitz_lower
    from ..lipschitz._weights import spec_norms
    from ..model import load
    from ..report import atomic_write_text, start_progress

    check_common(args)
    if getattr(args, "plot", None):
        from ..report import check_output_path

        check_output_path(args.plot, "--plot", (".png", ".svg", ".pdf"))
    if args.data is not None:
        return run_local(args)
    tracker = start_progress(quiet=args.quiet)
    tracker.step("loading the model")
    spec = load(args.model, arch=args.arch, allow_pickle=args.allow_pickle, strict=args.strict).to_torch()
    tracker.step("certified upper bounds")
    small_threads(spec.d_model, args.seq_len)
    seq = args.seq_len if args.metric == "fro" or _needs_seq_len(spec) else None
    bounds = compose(spec_norms(spec), radius=args.radius, c_sm=args.c_sm, metric=args.metric, seq_len=seq,
                     sigma_min=args.ln_sigma_min)
    lower = {}
    if not args.no_lower:
        torch.manual_seed(args.seed)
        tracker.step(f"empirical lower search ({args.samples} starts x {args.steps} steps per stage)")
        lower = lipschitz_lower(spec, bounds, seq_len=args.seq_len, n_samples=args.samples, n_steps=args.steps,
                                seed=args.seed)
    tracker.close()
    rows = []
    for s in bounds.stages:
        lo = lower.get((s.layer, s.name))
        rows.append(("stage", s.layer, s.name, s.radius_in, s.lipschitz * (1 + 1e-9),
                     None if lo is None else lo.value.value))
    for i in range(spec.n_layers):
        lo = lower.get((i, "layer"))
        rows.append(("layer", i, "layer", None, bounds.layer_upper(i).value, None if lo is None else lo.value.value))
    lo = lower.get((-2, "network"))
    rows.append(("network", -2, "network", args.radius, bounds.upper.value,
                 None if lo is None else lo.value.value))
    rows.append(("network", -2, "network, worst R", args.radius, bounds.upper_uniform.value,
                 None if lo is None else lo.value.value))

    # Every row is a theorem lower <= upper: a violation is a false certificate, never a table row.
    for _, layer, name, _, up, lw in rows:
        if lw is not None:
            check_certified(f"Lipschitz constant of {name} (layer {layer})", up, lw)
    console = Console()
    table = Table(title=f"Lipschitz constants of {spec.name} ({args.metric}, R={args.radius:g})")
    for col in ("layer", "component", "input radius", "certified upper", "empirical lower", "upper/lower"):
        table.add_column(col, justify="right" if col not in ("component",) else "left")
    for kind, layer, name, r, up, lw in rows:
        label = {-1: "input", -2: "all", spec.n_layers: "output"}.get(layer, str(layer))
        ratio = None if not lw else up / lw
        table.add_row(label, name if kind != "layer" else "[bold]whole layer[/bold]", _fmt(r), _fmt(up), _fmt(lw),
                      _fmt(ratio))
    console.print(table)
    for a in bounds.upper.assumptions:
        console.print(f"  assumption: {a}")
    console.print("  upper: certified (THEORY F6/F7/F8/F14, rounding included); lower: attained by input "
                  "pairs inside the domain (each stage searched on its own certified input radius); "
                  "'network, worst R': the plain product with every stage on the largest radius")
    if args.json:
        payload = {
            "model": spec.name, "warnings": list(spec.warnings),
            "bounds": bounds.to_dict(),
            "lower": [{"layer": k[0], "name": k[1], **v.to_dict()} for k, v in lower.items()],
            "table": [{"kind": k, "layer": layer, "component": n, "radius_in": r, "upper": up, "lower": lw,
                       "ratio": None if not lw else up / lw} for k, layer, n, r, up, lw in rows],
        }
        from ..report import envelope_json

        atomic_write_text(args.json, envelope_json(payload, schema="transcover.lipschitz", schema_version="1",
                                                   inputs=[args.model]))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from ..report import atomic_write_bytes
        from ..report._figures import pyplot, save_figure

        fig = bounds.plot(lower=lower).figure_
        atomic_write_bytes(args.plot, save_figure(fig, args.plot))
        pyplot().close(fig)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def small_threads(d_model: int, seq_len: int) -> None:
    """One intra-op thread for small models: the pool's synchronisation costs more than the work
    (measured 70x slower forwards of a d=8 model on a loaded 2-core machine)."""
    import torch

    if d_model * seq_len < 4096:
        torch.set_num_threads(1)


def _needs_seq_len(spec) -> bool:
    from ..lipschitz._weights import attention_kind

    return attention_kind(spec) == "l2"


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
        if not (v > 0 and math.isfinite(v)):
            raise InputError(f"--rho must be finite and > 0, but got {part.strip()} in --rho={text}")
        out.append(v)
    return out


def run_local(args: argparse.Namespace) -> int:
    """``--data``: certified local constants on balls around real inputs (issue 12), every check
    (rho, data, tokenizer) done before anything is computed or written."""
    import sys

    import torch
    from rich.console import Console
    from rich.table import Table

    from .._errors import InputError
    from ..lipschitz._local_report import local_table
    from ..model import load
    from ..model._data import load_inputs
    from ..report import atomic_write_text

    rhos = parse_rhos(args.rho)
    from ._scaleopts import scale_backend, scale_requested

    backend = scale_backend(args) if scale_requested(args) else None  # checked before anything loads
    for flag, v in (("--max-len", args.max_len), ("--limit", args.limit)):
        if v is not None and v < 1:
            raise InputError(f"{flag} must be >= 1, but got {flag}={v}")
    spec = load(args.model, arch=args.arch, allow_pickle=args.allow_pickle, strict=args.strict).to_torch(torch.float64)
    seqs = load_inputs(spec, args.data, max_len=args.max_len, limit=args.limit)
    if backend is not None:  # one sequence per item, in parallel and resumable (issue 14)
        from ._scaleopts import local_rows_from_args

        rows = local_rows_from_args(args, spec, seqs, rhos, backend)
    else:
        rows = local_table(spec, seqs, rhos, lower=not args.no_lower, relative=args.rho_relative,
                           lower_iter=max(args.steps // 2, 5))
    console = Console()
    table = Table(title=f"Local Lipschitz constants of {spec.name} at {len(seqs)} sequences ((2,inf) metric)")
    for col in ("rho", "layer", "component", "global (R)", "domain (sigma0)", "local (rho)", "lower", "local/lower"):
        table.add_column(col, justify="left" if col == "component" else "right")
    for r in rows:
        table.add_row(f"{r.rho_factor:g}", str(r.layer), r.component, _fmt(r.global_upper), _fmt(r.domain_upper),
                      _fmt(r.local_upper), _fmt(r.lower), _fmt(r.ratio))
    console.print(table)
    console.print("  certified upper bounds (THEORY F14, F17; rounding padded); local = on the ball of radius rho "
                  "around each sequence's hidden states" + (" (rho x median token norm)" if args.rho_relative else "")
                  + "; lower = (2,inf) Jacobian norm at the data point")
    if args.json:
        from ..report import envelope_json

        payload = {"model": spec.name, "n_sequences": len(seqs),
                   "rho": rhos, "rho_relative": bool(args.rho_relative), "rows": [r.to_dict() for r in rows]}
        data_input = [args.data] if args.data != "sklearn-descr" else []
        atomic_write_text(args.json, envelope_json(payload, schema="transcover.lipschitz.local", schema_version="1",
                                                   inputs=[args.model, *data_input]))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
