"""``transcover perturb MODEL_A MODEL_B``: Lemma G.3's certified bound vs the measured output change."""

from __future__ import annotations

import argparse

NAME = "perturb"
HELP = "certified bound (Lemma G.3) on how far two same-architecture models' outputs differ, vs measured"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ._lipschitz import add_model_arguments

    p.add_argument("model_a", help="first model (path or short name)")
    p.add_argument("model_b", help="second model with the same architecture (e.g. a fine-tuned version)")
    add_model_arguments(p)
    p.add_argument("--top", type=int, default=10, help="print the largest TOP terms c_i ||dW_i|| (default 10)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write the bound per layer and the total beside the measured change (.png, .svg or .pdf)")


def run(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console
    from rich.table import Table

    from .._errors import InputError
    from .._results import check_certified
    from ..lipschitz import perturbation_bound, perturbation_lower
    from ..model import load, require_same_structure
    from ..report import atomic_write_text, start_progress
    from ._lipschitz import check_common, small_threads

    check_common(args)
    if args.top < 0:
        raise InputError(f"--top must be >= 0, but got --top={args.top}")
    if args.plot:
        from ..report import check_output_path

        check_output_path(args.plot, "--plot", (".png", ".svg", ".pdf"))
    tracker = start_progress(quiet=args.quiet)
    tracker.step("loading the models")
    a = load(args.model_a, arch=args.arch, allow_pickle=args.allow_pickle, strict=args.strict).to_torch()
    b = load(args.model_b, arch=args.arch, allow_pickle=args.allow_pickle, strict=args.strict).to_torch()
    # Lemma G.3 charges weight distances only: refuse before any search (Note [structural differences])
    require_same_structure(a, b)
    small_threads(a.d_model, args.seq_len)
    seq = args.seq_len if args.metric == "fro" else None
    tracker.step("certified bound (Lemma G.3)")
    bound = perturbation_bound(a, b, radius=args.radius, c_sm=args.c_sm, metric=args.metric, seq_len=seq,
                               sigma_min=args.ln_sigma_min)
    tracker.step(f"measured lower ({args.samples} starts x {args.steps} steps)")
    low = perturbation_lower(a, b, radius=args.radius, metric=args.metric, seq_len=args.seq_len,
                             sigma_min=args.ln_sigma_min, n_samples=args.samples, n_steps=args.steps, seed=args.seed)
    tracker.close()
    up, lw = bound.total.value, low.value.value
    check_certified(f"output change ||g(A)(X) - g(B)(X)||_{args.metric} (Lemma G.3)", up, lw)
    console = Console()
    console.print(f"sup_X ||g(A)(X) - g(B)(X)||_{args.metric} over token norms <= {args.radius:g}:")
    console.print(f"  certified upper (Lemma G.3): {up:.6g}")
    console.print(f"  measured lower (max over {args.samples} ascended inputs of {args.seq_len} tokens): {lw:.6g}")
    console.print(f"  upper / lower: {up / lw:.4g}" if lw > 0 else "  upper / lower: - (no change measured)")
    per_layer = Table(title="bound per layer (sum of c_i ||dW_i||)")
    per_layer.add_column("layer", justify="right")
    per_layer.add_column("contribution", justify="right")
    for layer, c in bound.by_layer().items():
        per_layer.add_row({-1: "in", a.n_layers: "out"}.get(layer, str(layer)), f"{c:.4g}")
    console.print(per_layer)
    if args.top:
        terms = Table(title=f"largest {args.top} terms")
        for col in ("layer", "matrix", "norm", "c_i", "||dW_i||", "c_i ||dW_i||"):
            terms.add_column(col, justify="right" if col not in ("matrix", "norm") else "left")
        for e, d, c in bound.terms()[: args.top]:
            terms.add_row(str(e.layer), e.role, e.norm, f"{e.coefficient:.4g}", f"{d:.4g}", f"{c:.4g}")
        console.print(terms)
    for asm in bound.total.assumptions:
        console.print(f"  assumption: {asm}")
    if args.plot:
        from ..report import atomic_write_bytes
        from ..report._figures import pyplot, save_figure

        fig = bound.plot(lower=lw, n_layers=a.n_layers).figure_
        atomic_write_bytes(args.plot, save_figure(fig, args.plot))
        pyplot().close(fig)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        payload = {"model_a": a.name, "model_b": b.name,
                   "warnings": list(a.warnings) + list(b.warnings),
                   "bound": bound.to_dict(), "lower": low.to_dict(), "ratio": up / lw if lw > 0 else None}
        from ..report import envelope_json

        atomic_write_text(args.json, envelope_json(payload, schema="transcover.perturb", schema_version="1",
                                                   inputs=[args.model_a, args.model_b]))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
